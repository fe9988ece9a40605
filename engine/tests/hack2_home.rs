//! A durable `hack2` wave context lives on disk in 2-bit form after a checkpoint: its
//! segments in 2-bit segment files, its plain sink and tail rows in the home, and its data
//! file's f16 chunks for those tokens punched out. Recovery restores the index from them
//! with nothing recomputed (attention equals an engine that never restarted), later
//! checkpoints write only the new segments, and a home the manifest relies on that is
//! missing or damaged is a typed error, never a silent rebuild. A durable `hack2` PQ
//! context does the same: its base rows in 2-bit pieces, its codebooks in its layout file.

mod common;
use common::allocated;
use common::synth::{SynthContext, SynthParams};

use std::path::Path;

use attnstore::durable::{check, DATA_DIR};
use attnstore::{
    AttnShape, Budget, Codec, ContextId, ContextSpec, DurableConfig, Engine, EngineConfig, Error, HackParams,
    IndexRebuild, KeyLayout, Method, PqParams, Request, WaveParams,
};
use std::time::Duration;

fn shape() -> AttnShape {
    AttnShape::new(8, 2, 64).unwrap()
}

fn spec() -> ContextSpec {
    spec_with(HackParams::default())
}

/// Both 2-bit layouts: HACK's per-token keys (`hack2`) and per-channel keys (`hack2c`).
fn layouts() -> [HackParams; 2] {
    [HackParams::default(), HackParams::default().with_keys(KeyLayout::PerChannel)]
}

fn spec_with(params: HackParams) -> ContextSpec {
    let wave =
        WaveParams { segment_tokens: 512, decode_segment_tokens: 128, local_tokens: 32, ..WaveParams::default() };
    ContextSpec::new(shape(), 1).with_method(Method::Wave(wave)).with_codec(Codec::Hack2(params))
}

/// Batches: a prefill of 2000 tokens, then appends of 40.
fn feed(engines: &[(&Engine, ContextId)], synth: &SynthContext, from: usize, to: usize) {
    let mut at = from;
    while at < to {
        let end = if at == 0 { 2000 } else { (at + 40).min(to) };
        let (k, v) = synth.slice(at, end);
        for &(engine, ctx) in engines {
            match at {
                0 => engine.prefill(ctx, 0, &k, &v).unwrap(),
                _ => engine.append(ctx, 0, &k, &v).unwrap(),
            }
        }
        at = end;
    }
}

fn synth(tokens: usize, seed: u64) -> SynthContext {
    SynthContext::generate(SynthParams::new(shape(), tokens, seed))
}

fn outputs(engine: &Engine, ctx: ContextId, synth: &SynthContext, step: u64) -> Vec<Vec<f32>> {
    let q = synth.queries(step);
    let budgets = [Budget::full(), Budget::default().with_retrieve_floor(64).with_retrieve(0.05)];
    budgets
        .iter()
        .map(|b| {
            let plan = engine.plan(&[Request::new(ctx, 0, q.clone())], b).unwrap();
            engine.execute(&plan).unwrap().remove(0)
        })
        .collect()
}

/// Checkpoints a durable engine holding one context of 2400 tokens in its data file, and
/// when the file system punched the homed bytes out, checks that the data file shrank to a
/// tenth and that everything besides the log is under `max_ratio` of the f16 KV. Returns the
/// report and whether bytes were punched.
fn checkpoint_2400(engine: &Engine, dir: &Path, max_ratio: f64) -> (attnstore::durable::CheckpointReport, bool) {
    let f16_bytes = 2400 * 2 * shape().kv_heads * shape().head_dim * 2;
    let data = dir.join(DATA_DIR);
    let before = allocated(&data);
    assert!(before as usize >= f16_bytes, "the data file holds f16 rows: {before} B");
    let report = engine.checkpoint().unwrap();
    let punched = report.data_bytes_freed > 0;
    if punched {
        let after = allocated(&data);
        assert!(after * 10 < before, "data file {before} → {after} allocated bytes");
        let on_disk = allocated(dir) - allocated(&dir.join("wal"));
        let ratio = on_disk as f64 / f16_bytes as f64;
        println!("2400 tokens: {on_disk} B on disk besides the log, {ratio:.3} of f16 ({f16_bytes} B)");
        assert!(ratio < max_ratio, "{ratio}");
    } else {
        println!("this file system cannot punch holes: the data file keeps its bytes (unread)");
    }
    (report, punched)
}

#[test]
fn a_hack2_context_is_stored_in_2_bit_form_after_a_checkpoint_and_recovers_exactly() {
    for params in layouts() {
        wave_home_round_trip(params);
    }
}

fn wave_home_round_trip(params: HackParams) {
    let spec = || spec_with(params);
    let dir = tempfile::tempdir().unwrap();
    let synth = synth(3000, 5);
    let reference = Engine::in_memory(EngineConfig::default()).unwrap();
    let rctx = reference.create_context(spec()).unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    let ctx = engine.create_context(spec()).unwrap();
    feed(&[(&engine, ctx), (&reference, rctx)], &synth, 0, 2400);
    // Per-channel keys add an f16 minimum and range per channel and block: 4 bytes per
    // token and head, 0.016 of f16 at d = 64.
    let max_ratio = if params.per_channel() { 0.32 } else { 0.3 };
    let (first, punched) = checkpoint_2400(&engine, dir.path(), max_ratio);
    assert_eq!((first.homes_written, first.layouts_written), (1, 0), "{first:?}");
    let before_restart = outputs(&engine, ctx, &synth, 1);
    assert_eq!(before_restart, outputs(&reference, rctx, &synth, 1));
    drop(engine);

    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    let report = engine.recovery_report().unwrap();
    assert_eq!((report.homes_restored, report.layouts_restored), (1, 0), "{report}");
    assert!(report.layout_errors.is_empty(), "{:?}", report.layout_errors);
    assert_eq!(engine.stats(ctx, 0).unwrap(), reference.stats(rctx, 0).unwrap());
    assert_eq!(outputs(&engine, ctx, &synth, 1), before_restart);
    assert_eq!(outputs(&engine, ctx, &synth, 2), outputs(&reference, rctx, &synth, 2));

    // Decode goes on; the next checkpoint writes only the new segments.
    feed(&[(&engine, ctx), (&reference, rctx)], &synth, 2400, 3000);
    let second = engine.checkpoint().unwrap();
    assert_eq!(second.homes_written, 1);
    assert!(second.home_bytes < first.home_bytes, "{} then {} B", first.home_bytes, second.home_bytes);
    let layer = &check(dir.path()).unwrap().layers[0];
    assert!(layer.homed_bytes > 0 && layer.home_segments >= 5, "{layer:?}");
    drop(engine);
    for rebuild in [IndexRebuild::Blocking, IndexRebuild::Background] {
        let config = DurableConfig { index_rebuild: rebuild, ..DurableConfig::default() };
        let engine = Engine::open_with(dir.path(), EngineConfig::default(), config).unwrap();
        let report = engine.recovery_report().unwrap();
        assert_eq!((report.homes_restored, report.background_rebuild_layers), (1, 0), "{rebuild:?}: {report}");
        assert_eq!(outputs(&engine, ctx, &synth, 3), outputs(&reference, rctx, &synth, 3), "{rebuild:?}");
        if punched {
            // What is left in the data file: the batches after the second checkpoint (none).
            assert!(engine.stored_batches(ctx, 0).unwrap().is_empty());
        }
    }
}

#[test]
fn a_home_the_manifest_relies_on_that_is_missing_or_damaged_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let synth = synth(2400, 6);
    {
        let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
        let ctx = engine.create_context(spec()).unwrap();
        feed(&[(&engine, ctx)], &synth, 0, 2400);
        engine.checkpoint().unwrap();
    }
    let index = dir.path().join("index");
    let segment = index.join(format!("ctx-{}-layer-0-seg-1.h2", 1));
    let home = index.join("ctx-1-layer-0.home");
    let saved = std::fs::read(&segment).unwrap();
    std::fs::remove_file(&segment).unwrap();
    let corrupt = |what: &str| match Engine::open(dir.path(), EngineConfig::default()) {
        Err(Error::Corrupt { file, detail, .. }) => {
            assert_eq!(file, home, "{what}");
            assert!(detail.contains("live only there"), "{what}: {detail}");
            detail
        }
        Err(e) => panic!("{what}: expected Corrupt, got {e}"),
        Ok(_) => panic!("{what}: opened"),
    };
    assert!(corrupt("a segment file deleted").contains("seg-1.h2: missing"));
    assert!(check(dir.path()).is_err());
    std::fs::write(&segment, &saved).unwrap();
    let home_bytes = std::fs::read(&home).unwrap();
    let mut flipped = home_bytes.clone();
    let at = flipped.len() - 3;
    flipped[at] ^= 0x40;
    std::fs::write(&home, &flipped).unwrap();
    corrupt("a bit flipped in the home");
    std::fs::remove_file(&home).unwrap();
    corrupt("the home deleted");
    // Put back, it opens again.
    std::fs::write(&home, &home_bytes).unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    assert_eq!(engine.recovery_report().unwrap().homes_restored, 1);
    assert_eq!(engine.stats(ContextId(1), 0).unwrap().tokens, 2400);
    // Dropping the context deletes its 2-bit files at once.
    engine.drop_context(ContextId(1)).unwrap();
    let left: Vec<_> = std::fs::read_dir(&index).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(
        left.iter().all(|n| !n.to_string_lossy().ends_with(".h2") && !n.to_string_lossy().ends_with(".home")),
        "{left:?}"
    );
}

#[test]
fn hack2_rows_homed_in_the_buffer_manager_checkpoint_and_recover_the_same() {
    for params in layouts() {
        buffered_round_trip(params);
    }
}

fn buffered_round_trip(params: HackParams) {
    let spec = || spec_with(params);
    let dir = tempfile::tempdir().unwrap();
    let synth = synth(2600, 8);
    let buffered = || EngineConfig {
        buffers: Some(attnstore::BufferSettings { maintainer_idle: None, ..attnstore::BufferSettings::new(2048) }),
        ..EngineConfig::default()
    };
    let reference = Engine::in_memory(EngineConfig::default()).unwrap();
    let rctx = reference.create_context(spec()).unwrap();
    let ctx = {
        let engine = Engine::open(dir.path(), buffered()).unwrap();
        let ctx = engine.create_context(spec()).unwrap();
        feed(&[(&engine, ctx), (&reference, rctx)], &synth, 0, 2400);
        assert!(engine.buffer_stats().unwrap().tier(attnstore::Tier::Host).unwrap().used_blocks > 0);
        // The checkpoint reads the 2-bit rows back out of the buffer manager.
        assert_eq!(engine.checkpoint().unwrap().homes_written, 1);
        assert_eq!(outputs(&engine, ctx, &synth, 1), outputs(&reference, rctx, &synth, 1));
        ctx
    };
    let engine = Engine::open(dir.path(), buffered()).unwrap();
    assert_eq!(engine.recovery_report().unwrap().homes_restored, 1);
    assert!(engine.buffer_stats().unwrap().tier(attnstore::Tier::Host).unwrap().used_blocks > 0);
    feed(&[(&engine, ctx), (&reference, rctx)], &synth, 2400, 2600);
    for step in 2..4 {
        assert_eq!(outputs(&engine, ctx, &synth, step), outputs(&reference, rctx, &synth, step));
    }
}

fn pq_spec() -> ContextSpec {
    pq_spec_with(HackParams::default())
}

fn pq_spec_with(params: HackParams) -> ContextSpec {
    let pq = PqParams { min_build_tokens: 512, local_tokens: 32, ..PqParams::default() };
    ContextSpec::new(shape(), 1).with_method(Method::Pq(pq)).with_codec(Codec::Hack2(params))
}

fn wait_built(engine: &Engine, ctx: ContextId) {
    assert!(engine.wait_index(ctx, 0, Duration::from_secs(120)).unwrap(), "codebooks trained");
}

#[test]
fn a_hack2_pq_context_is_stored_in_2_bit_form_after_a_checkpoint_and_recovers_exactly() {
    for params in layouts() {
        pq_home_round_trip(params);
    }
}

fn pq_home_round_trip(params: HackParams) {
    let pq_spec = || pq_spec_with(params);
    let dir = tempfile::tempdir().unwrap();
    let synth = synth(3000, 7);
    let reference = Engine::in_memory(EngineConfig::default()).unwrap();
    let rctx = reference.create_context(pq_spec()).unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    let ctx = engine.create_context(pq_spec()).unwrap();
    feed(&[(&engine, ctx), (&reference, rctx)], &synth, 0, 2000);
    wait_built(&engine, ctx);
    wait_built(&reference, rctx);
    feed(&[(&engine, ctx), (&reference, rctx)], &synth, 2000, 2400);
    // The home needs the codebooks: both go to disk in the same checkpoint. On disk: 2-bit
    // base rows (0.16 of f16), the 400 decode tokens in f16 (1/6 of the tokens), PQ codes.
    let (first, punched) = checkpoint_2400(&engine, dir.path(), 0.5);
    assert_eq!((first.homes_written, first.layouts_written), (1, 1), "{first:?}");
    let before_restart = outputs(&engine, ctx, &synth, 1);
    assert_eq!(before_restart, outputs(&reference, rctx, &synth, 1));
    drop(engine);

    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    let report = engine.recovery_report().unwrap();
    assert_eq!(report.homes_restored, 1, "{report}");
    assert!(report.layout_errors.is_empty(), "{:?}", report.layout_errors);
    assert_eq!(engine.stats(ctx, 0).unwrap(), reference.stats(rctx, 0).unwrap());
    assert_eq!(outputs(&engine, ctx, &synth, 1), before_restart);
    assert_eq!(outputs(&engine, ctx, &synth, 2), outputs(&reference, rctx, &synth, 2));

    // Decode goes on; the next checkpoint writes a new home, no segment and no layout again.
    feed(&[(&engine, ctx), (&reference, rctx)], &synth, 2400, 3000);
    let second = engine.checkpoint().unwrap();
    assert_eq!((second.homes_written, second.layouts_written), (1, 0), "{second:?}");
    let layer = &check(dir.path()).unwrap().layers[0];
    assert!(layer.homed_bytes > 0 && layer.home_segments == 1, "{layer:?}");
    drop(engine);
    for rebuild in [IndexRebuild::Blocking, IndexRebuild::Background] {
        let config = DurableConfig { index_rebuild: rebuild, ..DurableConfig::default() };
        let engine = Engine::open_with(dir.path(), EngineConfig::default(), config).unwrap();
        let report = engine.recovery_report().unwrap();
        assert_eq!((report.homes_restored, report.background_rebuild_layers), (1, 0), "{rebuild:?}: {report}");
        assert_eq!(outputs(&engine, ctx, &synth, 3), outputs(&reference, rctx, &synth, 3), "{rebuild:?}");
        if punched {
            assert!(engine.stored_batches(ctx, 0).unwrap().is_empty());
        }
    }

    // The codebooks are part of what the home relies on: without them it is a typed error.
    common::codebooks_are_needed(dir.path(), ctx);
}

#[test]
fn a_hack2_pq_context_checkpointed_before_its_codebooks_keeps_its_data_file() {
    let dir = tempfile::tempdir().unwrap();
    let synth = synth(400, 9);
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    let ctx = engine.create_context(pq_spec()).unwrap();
    // 400 tokens: fewer than a build needs, so there are no codebooks and no 2-bit rows.
    let (k, v) = synth.slice(0, 400);
    engine.prefill(ctx, 0, &k, &v).unwrap();
    let report = engine.checkpoint().unwrap();
    assert_eq!((report.homes_written, report.data_bytes_freed), (0, 0), "{report:?}");
    let before = outputs(&engine, ctx, &synth, 1);
    drop(engine);
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    assert_eq!(engine.recovery_report().unwrap().homes_restored, 0);
    assert_eq!(outputs(&engine, ctx, &synth, 1), before);
}
