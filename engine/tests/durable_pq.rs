//! PQ layers survive a restart without training their codebooks again: a checkpoint keeps
//! each PQ layer's codebooks and base codes, reopening restores the index from them and the
//! KV it reads back (plans are sparse at once, answers equal the engine that wrote them),
//! and a damaged or missing snapshot is reported and the layer retrained from its KV.

mod common;
use common::synth::{SynthContext, SynthParams};

use std::time::Duration;

use attnstore::{
    AttnShape, Budget, ContextId, ContextSpec, DurableConfig, Engine, EngineConfig, IndexRebuild, Method, PqParams,
    Request, Strategy,
};

const LAYERS: usize = 2;
const PREFILL: usize = 6000;
const TOTAL: usize = 6400;

fn shape() -> AttnShape {
    AttnShape::new(4, 2, 16).unwrap()
}

fn spec() -> ContextSpec {
    let pq = PqParams { min_build_tokens: 512, local_tokens: 32, ..PqParams::default() };
    ContextSpec::new(shape(), LAYERS).with_method(Method::Pq(pq))
}

fn budget() -> Budget {
    Budget::default().with_retrieve_floor(16).with_retrieve(0.05)
}

/// Tokens `from..to` into every layer: a prefill from 0, appends after.
fn ingest(engine: &Engine, ctx: ContextId, synth: &SynthContext, from: usize, to: usize) {
    let (k, v) = synth.slice(from, to);
    for layer in 0..LAYERS {
        match from {
            0 => engine.prefill(ctx, layer, &k, &v).unwrap(),
            _ => engine.append(ctx, layer, &k, &v).unwrap(),
        }
    }
}

/// Decode-step appends of 1..=9 tokens from `from` to `to`.
fn decode(engine: &Engine, ctx: ContextId, synth: &SynthContext, from: usize, to: usize) {
    let mut at = from;
    while at < to {
        let next = (at + 1 + at % 9).min(to);
        ingest(engine, ctx, synth, at, next);
        at = next;
    }
}

/// Per layer: the sparse plan's strategy must be sparse; its output and the exact output.
fn answers(engine: &Engine, ctx: ContextId, synth: &SynthContext) -> Vec<Vec<Vec<f32>>> {
    (0..LAYERS)
        .map(|layer| {
            let request = [Request::new(ctx, layer, synth.queries(1))];
            let sparse = engine.plan(&request, &budget()).unwrap();
            assert!(matches!(sparse.requests[0].strategy, Strategy::Sparse { .. }), "{}", sparse.explain());
            let exact = engine.plan(&request, &Budget::full()).unwrap();
            vec![engine.execute(&sparse).unwrap().remove(0), engine.execute(&exact).unwrap().remove(0)]
        })
        .collect()
}

fn wait_built(engine: &Engine, ctx: ContextId) {
    for layer in 0..LAYERS {
        assert!(engine.wait_index(ctx, layer, Duration::from_secs(120)).unwrap(), "layer {layer}");
    }
}

#[test]
fn a_checkpointed_pq_layer_reopens_without_training_and_a_bad_snapshot_is_retrained() {
    let dir = tempfile::tempdir().unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape(), TOTAL, 5));
    let (ctx, before, trained) = {
        let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
        let ctx = engine.create_context(spec()).unwrap();
        ingest(&engine, ctx, &synth, 0, PREFILL);
        wait_built(&engine, ctx);
        let checkpoint = engine.checkpoint().unwrap();
        assert_eq!((checkpoint.layouts_written, checkpoint.layouts_pending), (LAYERS, 0), "{checkpoint:?}");
        assert!(checkpoint.layout_bytes > 0);
        // Decode tokens are encoded with the same codebooks: the snapshot does not change.
        decode(&engine, ctx, &synth, PREFILL, PREFILL + 200);
        assert_eq!(engine.checkpoint().unwrap().layouts_written, 0);
        // Logged after the checkpoint: replayed from the log on reopen.
        decode(&engine, ctx, &synth, PREFILL + 200, TOTAL);
        let trained = engine.index_build(ctx, 0).unwrap().expect("built");
        (ctx, answers(&engine, ctx, &synth), trained)
    };
    let snapshot_file = dir.path().join("index").join(format!("ctx-{}-layer-1.pq", ctx.0));
    assert!(snapshot_file.exists());
    {
        let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
        let report = engine.recovery_report().unwrap().clone();
        assert_eq!(report.layouts_restored, LAYERS, "{report}");
        assert!(report.layout_errors.is_empty(), "{report}");
        // Ready the moment `open` returns: nothing trains in the background.
        for layer in 0..LAYERS {
            assert!(engine.wait_index(ctx, layer, Duration::ZERO).unwrap(), "layer {layer}");
        }
        let restored = engine.index_build(ctx, 0).unwrap().expect("restored");
        assert_eq!(
            (restored.layout, restored.codes, restored.tokens, restored.iters_run),
            (trained.layout, trained.codes, trained.tokens, trained.iters_run)
        );
        assert_eq!(engine.stats(ctx, 0).unwrap().tokens, TOTAL);
        // Same codebooks and codes, so the same sparse plans and the same answers.
        assert_eq!(answers(&engine, ctx, &synth), before);
    }
    // A damaged snapshot is reported; that layer is trained again from its KV (seeded, so
    // the same codebooks) and serves the same answers.
    let mut bytes = std::fs::read(&snapshot_file).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x10;
    std::fs::write(&snapshot_file, bytes).unwrap();
    {
        let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
        let report = engine.recovery_report().unwrap().clone();
        assert_eq!(report.layouts_restored, LAYERS - 1, "{report}");
        assert_eq!(report.layout_errors.len(), 1, "{report}");
        assert!(report.layout_errors[0].contains("layer-1.pq"), "{report}");
        wait_built(&engine, ctx);
        assert_eq!(answers(&engine, ctx, &synth), before);
        // The next checkpoint writes the retrained layer's snapshot again, and only it: the
        // others are on disk as the restored indexes hold them.
        assert_eq!(engine.checkpoint().unwrap().layouts_written, 1);
    }
    // A background rebuild restores from the snapshots too.
    let config = DurableConfig { index_rebuild: IndexRebuild::Background, ..DurableConfig::default() };
    let engine = Engine::open_with(dir.path(), EngineConfig::default(), config).unwrap();
    assert!(engine.wait_index_rebuild(Duration::from_secs(120)).unwrap());
    for layer in 0..LAYERS {
        assert!(engine.wait_index(ctx, layer, Duration::ZERO).unwrap(), "layer {layer}");
    }
    assert_eq!(answers(&engine, ctx, &synth), before);
    engine.drop_context(ctx).unwrap();
    engine.checkpoint().unwrap();
    assert!(!snapshot_file.exists());
}

#[test]
fn a_checkpoint_during_the_codebook_build_writes_no_snapshot_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape(), PREFILL, 6));
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    // A context too short to build codebooks has nothing to write and nothing pending.
    let ctx = engine.create_context(spec()).unwrap();
    ingest(&engine, ctx, &synth, 0, 200);
    let checkpoint = engine.checkpoint().unwrap();
    assert_eq!((checkpoint.layouts_written, checkpoint.layouts_pending), (0, 0), "{checkpoint:?}");
    // Once long enough, a checkpoint either finds the build running (pending) or done
    // (written): every PQ layer is accounted for, never silently skipped.
    ingest_more(&engine, ctx, &synth);
    let checkpoint = engine.checkpoint().unwrap();
    assert_eq!(checkpoint.layouts_written + checkpoint.layouts_pending, LAYERS, "{checkpoint:?}");
    wait_built(&engine, ctx);
    let rest = engine.checkpoint().unwrap();
    assert_eq!(rest.layouts_written, checkpoint.layouts_pending, "{rest:?}");
    assert_eq!(rest.layouts_pending, 0);
}

fn ingest_more(engine: &Engine, ctx: ContextId, synth: &SynthContext) {
    let (k, v) = synth.slice(200, PREFILL);
    for layer in 0..LAYERS {
        engine.append(ctx, layer, &k, &v).unwrap();
    }
}
