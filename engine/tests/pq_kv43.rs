//! A PQ context over `kv43` rows, through the engine: sparse plans over the codes answer
//! close to the same plans over f16 rows, EXPLAIN names the codec and its bytes, a durable
//! context lives on disk in its codes after a checkpoint and recovers the same answers bit
//! for bit, a codec per range of layers works with PQ, the buffer manager leaves kv43 rows in
//! the index, and what cannot work is a typed error. (The index itself, exact and retrieve-
//! all plans against attention over the dequantized rows: `index_pq_kv43.rs`.)

mod common;
use common::synth::{SynthContext, SynthParams};

use attnstore::durable::check;
use attnstore::{
    AttnShape, Budget, BufferSettings, Codec, ContextId, ContextSpec, DurableConfig, Engine, EngineConfig, Error,
    HackParams, IndexRebuild, Kv43Params, LayerCodecs, Method, PqParams, Request,
};
use attnstore_kernels::cpu::reference::rel_l2;
use attnstore_kernels::random::SplitMix64;
use std::time::Duration;

fn shape() -> AttnShape {
    AttnShape::new(8, 2, 64).unwrap()
}

fn pq() -> PqParams {
    PqParams { min_build_tokens: 512, local_tokens: 32, ..PqParams::default() }
}

fn kv43() -> Codec {
    Codec::Kv43(Kv43Params::default())
}

fn spec(codec: Codec) -> ContextSpec {
    ContextSpec::new(shape(), 1).with_method(Method::Pq(pq())).with_codec(codec)
}

fn wait_built(engine: &Engine, ctx: ContextId, layers: usize) {
    for layer in 0..layers {
        assert!(engine.wait_index(ctx, layer, Duration::from_secs(120)).unwrap(), "codebooks of layer {layer}");
    }
}

fn answer(engine: &Engine, ctx: ContextId, layer: usize, q: &[f32], budget: &Budget) -> Vec<f32> {
    let plan = engine.plan(&[Request::new(ctx, layer, q.to_vec())], budget).unwrap();
    engine.execute(&plan).unwrap().remove(0)
}

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// A sparse PQ plan: the top 64 tokens per KV head by PQ score, plus sink and local window,
/// never replaced by an exact plan.
fn sparse() -> Budget {
    Budget::default().with_retrieve(0.0).with_retrieve_floor(64).with_exact_threshold(100.0)
}

/// `kv_heads × tokens × d` keys with three 6× outlier channels and values around channel
/// means; per KV head 16 "needle" tokens whose keys point along the direction its query
/// heads share, and queries along it: attention is concentrated on the needles (a clear
/// top-k: scores ≈ 9 against noise of about 0.6).
fn needles(tokens: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<usize>) {
    let s = shape();
    let (h, d, g) = (s.kv_heads, s.head_dim, s.group());
    let mut rng = SplitMix64::new(seed);
    let mu: Vec<f32> = (0..d).map(|_| rng.normal()).collect();
    let mut k: Vec<f32> = (0..h * tokens * d).map(|i| rng.normal() * if i % d < 3 { 6.0 } else { 1.0 }).collect();
    let v: Vec<f32> = (0..h * tokens * d).map(|i| mu[i % d] + 0.5 * rng.normal()).collect();
    let at: Vec<usize> = (0..16).map(|i| 100 + i * (tokens - 300) / 16 + i % 3).collect();
    let mut q = Vec::with_capacity(s.query_len());
    for head in 0..h {
        let u: Vec<f32> = (0..d).map(|_| rng.normal()).collect();
        let norm = u.iter().map(|x| x * x).sum::<f32>().sqrt();
        let u: Vec<f32> = u.iter().map(|x| x / norm).collect();
        for &t in &at {
            let row = &mut k[(head * tokens + t) * d..(head * tokens + t + 1) * d];
            row.iter_mut().zip(&u).for_each(|(x, u)| *x = 24.0 * u);
        }
        for _ in 0..g {
            q.extend(u.iter().map(|u| 3.0 * u + 0.1 * rng.normal()));
        }
    }
    (k, v, q, at)
}

#[test]
fn a_sparse_pq_plan_over_kv43_answers_close_to_pq_over_f16_where_the_top_k_is_clear() {
    let tokens = 4000;
    let (k, v, q, _) = needles(tokens, 1);
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let coded = engine.create_context(spec(kv43())).unwrap();
    let plain = engine.create_context(spec(Codec::F16)).unwrap();
    for ctx in [coded, plain] {
        engine.prefill(ctx, 0, &k, &v).unwrap();
        wait_built(&engine, ctx, 1);
    }
    let (a, b) = (engine.stats(coded, 0).unwrap(), engine.stats(plain, 0).unwrap());
    assert_eq!((a.indexed_tokens, a.index_bytes), (b.indexed_tokens, b.index_bytes), "the same PQ index");
    println!("kv bytes: kv43 {} against f16 {} ({:.3})", a.kv_bytes, b.kv_bytes, a.kv_bytes as f64 / b.kv_bytes as f64);
    assert!((a.kv_bytes as f64) < 0.27 * b.kv_bytes as f64, "{a:?} {b:?}");

    // The codebooks are trained on the same plain keys, so both contexts score and select
    // the same tokens; what differs is the rows they attend, kv43's or f16's.
    let plan = engine.plan(&[Request::new(coded, 0, q.clone())], &sparse()).unwrap();
    let text = plan.explain();
    assert!(text.contains("Retrieve") && text.contains("kv43 (64.0 B per token and kv head, 0.250× f16)"), "{text}");
    let sparse_f16 = answer(&engine, plain, 0, &q, &sparse());
    let exact_f16 = f64s(&answer(&engine, plain, 0, &q, &Budget::full()));
    let sparse_kv43 = answer(&engine, coded, 0, &q, &sparse());
    let exact_kv43 = answer(&engine, coded, 0, &q, &Budget::full());
    // The top-k is clear: over f16 rows the sparse plan is within 1% of exact attention.
    let selection = rel_l2(&sparse_f16, &exact_f16);
    // The codec's own error: exact attention over kv43 rows against f16 rows.
    let rounding = rel_l2(&exact_kv43, &exact_f16);
    let err = rel_l2(&sparse_kv43, &f64s(&sparse_f16));
    println!("sparse f16 vs exact f16 {selection:.2e}; exact kv43 vs exact f16 {rounding:.2e}; sparse kv43 vs sparse f16 {err:.2e}");
    assert!(selection < 0.01, "the data must have a clear top-k: {selection}");
    // Tolerance: a sparse plan over kv43 adds no error of its own beyond the codec's
    // rounding of the rows it attends. Almost all the weight is on the 16 needles, whose
    // 3-bit values (steps of about a seventh of each channel's range over 64 tokens) carry
    // most of the codec's error; the exact plan's error is the same rounding spread over the
    // same weights, so the two agree within a factor of 2 (plus the 1e-3 of the codes'
    // 8-bit arithmetic), and both stay under 5% here.
    assert!(err < 2.0 * rounding + 1e-3 && err < 0.05, "sparse kv43 vs sparse f16 {err}, rounding {rounding}");
}

/// Batches: a prefill of 2000 tokens, then appends of 40 (every layer of `layers`).
fn feed(engines: &[(&Engine, ContextId)], synth: &SynthContext, (from, to): (usize, usize), layers: usize) {
    let mut at = from;
    while at < to {
        let end = if at == 0 { 2000 } else { (at + 40).min(to) };
        let (k, v) = synth.slice(at, end);
        for &(engine, ctx) in engines {
            for layer in 0..layers {
                match at {
                    0 => engine.prefill(ctx, layer, &k, &v).unwrap(),
                    _ => engine.append(ctx, layer, &k, &v).unwrap(),
                }
            }
        }
        at = end;
    }
}

/// Exact and sparse answers of every layer of `layers` for the synthetic query of `step`.
fn outputs(engine: &Engine, ctx: ContextId, synth: &SynthContext, step: u64, layers: usize) -> Vec<Vec<f32>> {
    let q = synth.queries(step);
    let requests: Vec<Request> = (0..layers).map(|l| Request::new(ctx, l, q.clone())).collect();
    [Budget::full(), sparse()]
        .iter()
        .flat_map(|b| engine.execute(&engine.plan(&requests, b).unwrap()).unwrap())
        .collect()
}

#[test]
fn a_durable_pq_kv43_context_is_stored_in_its_codes_and_recovers_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape(), 3000, 7));
    let reference = Engine::in_memory(EngineConfig::default()).unwrap();
    let rctx = reference.create_context(spec(kv43())).unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    let ctx = engine.create_context(spec(kv43())).unwrap();
    feed(&[(&engine, ctx), (&reference, rctx)], &synth, (0, 2000), 1);
    wait_built(&engine, ctx, 1);
    wait_built(&reference, rctx, 1);
    feed(&[(&engine, ctx), (&reference, rctx)], &synth, (2000, 2400), 1);
    // The home (the base's kv43 rows, the f16 sink and decode tokens) and the codebooks go
    // to disk in the same checkpoint; the data file's f16 chunks before it are punched where
    // the file system can.
    let data = dir.path().join(attnstore::durable::DATA_DIR);
    let before = common::allocated(&data);
    let first = engine.checkpoint().unwrap();
    assert_eq!((first.homes_written, first.layouts_written), (1, 1), "{first:?}");
    if first.data_bytes_freed > 0 {
        let f16_bytes = 2400 * 2 * shape().kv_heads * shape().head_dim * 2;
        let on_disk = common::allocated(dir.path()) - common::allocated(&dir.path().join("wal"));
        let ratio = on_disk as f64 / f16_bytes as f64;
        println!(
            "2400 tokens: data file {before} → {} B; {on_disk} B besides the log, {ratio:.3} of f16",
            common::allocated(&data)
        );
        // kv43 base rows (0.25 of f16), 400 decode tokens in f16 (1/6 of the tokens), codes.
        assert!(common::allocated(&data) * 10 < before && ratio < 0.6, "{ratio}");
    } else {
        println!("this file system cannot punch holes: the data file keeps its bytes (unread)");
    }
    let before_restart = outputs(&engine, ctx, &synth, 1, 1);
    assert_eq!(before_restart, outputs(&reference, rctx, &synth, 1, 1));
    drop(engine);

    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    let report = engine.recovery_report().unwrap();
    assert_eq!(report.homes_restored, 1, "{report}");
    assert!(report.layout_errors.is_empty(), "{:?}", report.layout_errors);
    assert_eq!(engine.stats(ctx, 0).unwrap(), reference.stats(rctx, 0).unwrap());
    assert_eq!(outputs(&engine, ctx, &synth, 1, 1), before_restart, "bit for bit after the restart");
    assert_eq!(outputs(&engine, ctx, &synth, 2, 1), outputs(&reference, rctx, &synth, 2, 1));

    // Decode goes on; the next checkpoint writes a new home, no segment and no layout again.
    feed(&[(&engine, ctx), (&reference, rctx)], &synth, (2400, 3000), 1);
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
        assert_eq!(outputs(&engine, ctx, &synth, 3, 1), outputs(&reference, rctx, &synth, 3, 1), "{rebuild:?}");
    }

    // The codebooks are part of what the home relies on: without them it is a typed error.
    common::codebooks_are_needed(dir.path(), ctx);
}

/// Three PQ layers: kv43, kv43 with 4-bit values, f16.
fn layered(codecs: &str) -> ContextSpec {
    ContextSpec::new(shape(), 3).with_method(Method::Pq(pq())).with_layer_codecs(codecs.parse::<LayerCodecs>().unwrap())
}

#[test]
fn a_codec_per_range_of_pq_layers_answers_as_each_codec_alone_and_survives_recovery() {
    let dir = tempfile::tempdir().unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape(), 2400, 9));
    let table = "kv43,1=kv43:v4,2=f16";
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    let ctx = engine.create_context(layered(table)).unwrap();
    assert_eq!(engine.spec(ctx).unwrap().codec_of(1), "kv43:v4".parse().unwrap());
    // One-layer contexts of each codec: each layer answers exactly as its codec alone does.
    let alone: Vec<ContextId> =
        ["kv43", "kv43:v4", "f16"].iter().map(|c| engine.create_context(spec(c.parse().unwrap())).unwrap()).collect();
    feed(&[(&engine, ctx)], &synth, (0, 2000), 3);
    for &c in &alone {
        feed(&[(&engine, c)], &synth, (0, 2000), 1);
        wait_built(&engine, c, 1);
    }
    wait_built(&engine, ctx, 3);
    feed(&[(&engine, ctx)], &synth, (2000, 2400), 3);
    for &c in &alone {
        feed(&[(&engine, c)], &synth, (2000, 2400), 1);
    }
    let q = synth.queries(1);
    let requests: Vec<Request> = (0..3).map(|l| Request::new(ctx, l, q.clone())).collect();
    let text = engine.plan(&requests, &sparse()).unwrap().explain();
    // d = 64: 3-bit values 64.0 B per token and KV head; 4-bit values add d/8 = 8 B.
    assert!(text.contains("kv43 (64.0 B per token and kv head, 0.250× f16)"), "{text}");
    assert!(text.contains("kv43:v4 (72.0 B per token and kv head, 0.281× f16)"), "{text}");
    for budget in [Budget::full(), sparse()] {
        for (layer, &c) in alone.iter().enumerate() {
            assert_eq!(answer(&engine, ctx, layer, &q, &budget), answer(&engine, c, 0, &q, &budget), "layer {layer}");
        }
    }
    let bytes: Vec<usize> = (0..3).map(|l| engine.stats(ctx, l).unwrap().kv_bytes).collect();
    assert!(bytes[0] < bytes[1] && bytes[1] < bytes[2], "{bytes:?}");

    // Layers 0 and 1 get encoded homes, all three their codebooks (and the kv43 contexts
    // alone theirs: 4 homes, 6 layouts); recovery answers alike.
    let report = engine.checkpoint().unwrap();
    assert_eq!((report.homes_written, report.layouts_written), (4, 6), "{report:?}");
    let before = outputs(&engine, ctx, &synth, 2, 3);
    drop(engine);
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    let report = engine.recovery_report().unwrap();
    assert_eq!(report.homes_restored, 4, "{report}");
    assert!(report.layout_errors.is_empty(), "{report}");
    assert_eq!(engine.spec(ctx).unwrap(), layered(table));
    assert_eq!(outputs(&engine, ctx, &synth, 2, 3), before);

    // hack2 PQ layers take kv43 layers beside them too.
    let mixed = engine.create_context(layered("hack2,0-1=kv43")).unwrap();
    feed(&[(&engine, mixed)], &synth, (0, 2000), 3);
    wait_built(&engine, mixed, 3);
    let requests: Vec<Request> = (0..3).map(|l| Request::new(mixed, l, q.clone())).collect();
    let text = engine.plan(&requests, &sparse()).unwrap().explain();
    assert!(text.contains("kv43 (64.0 B") && text.contains("hack2 ("), "{text}");
}

#[test]
fn with_a_buffer_manager_pq_kv43_rows_stay_in_the_index_and_answer_alike() {
    let synth = SynthContext::generate(SynthParams::new(shape(), 2400, 11));
    let config = EngineConfig {
        buffers: Some(BufferSettings { maintainer_idle: None, ..BufferSettings::new(20_000) }),
        ..EngineConfig::default()
    };
    let homed = Engine::in_memory(config).unwrap();
    let memory = Engine::in_memory(EngineConfig::default()).unwrap();
    let (a, b) = (homed.create_context(spec(kv43())).unwrap(), memory.create_context(spec(kv43())).unwrap());
    feed(&[(&homed, a), (&memory, b)], &synth, (0, 2000), 1);
    wait_built(&homed, a, 1);
    wait_built(&memory, b, 1);
    feed(&[(&homed, a), (&memory, b)], &synth, (2000, 2400), 1);
    assert_eq!(homed.stats(a, 0).unwrap(), memory.stats(b, 0).unwrap());
    assert_eq!(outputs(&homed, a, &synth, 1, 1), outputs(&memory, b, &synth, 1, 1));
}

#[test]
fn what_pq_over_kv43_cannot_take_is_a_typed_error() {
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let refused = |spec: ContextSpec, says: &str| match engine.create_context(spec) {
        Err(Error::InvalidSpec(why)) => assert!(why.contains(says), "{why}"),
        other => panic!("expected InvalidSpec saying {says:?}, got {other:?}"),
    };
    let small = ContextSpec::new(AttnShape::new(4, 2, 32).unwrap(), 2).with_method(Method::Pq(pq()));
    refused(small.clone().with_codec(kv43()), "multiple of 64");
    refused(small.clone().with_layer_codecs("f16,1=kv43".parse().unwrap()), "layers 1-1: the kv43 codec");
    let mut f32_steady = spec(kv43());
    f32_steady.dtype = attnstore::DType::F32;
    refused(f32_steady, "in f16");
    refused(spec(kv43()).with_method(Method::Flat), "kv43 codec encodes indexed rows");
    // hack2 with pq keeps its own checks.
    refused(
        ContextSpec::new(AttnShape::new(2, 1, 6).unwrap(), 1)
            .with_method(Method::Pq(PqParams { subspaces: Some(1), ..pq() }))
            .with_codec(Codec::Hack2(HackParams::default())),
        "multiple of 4",
    );
    // Bad rows are refused and change nothing.
    let ctx = engine.create_context(spec(kv43())).unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape(), 600, 3));
    let (mut k, v) = synth.slice(0, 600);
    k[100] = f32::NAN;
    assert!(engine.prefill(ctx, 0, &k, &v).is_err());
    assert_eq!(engine.stats(ctx, 0).unwrap().tokens, 0);
    assert!(engine.prefill(ctx, 0, &k[..64], &v[..65]).is_err());
}
