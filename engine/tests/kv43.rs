//! A `kv43` wave context (keys 4-bit per channel over 128-token groups, values 3-bit over
//! 64-token blocks, `docs/codec.md`): its segments are encoded once when built and attended
//! on their codes, exact and sparse plans answer close to exact attention over the very rows
//! the codes stand for, EXPLAIN counts a quarter of f16's bytes, a durable context is homed
//! in its codes on disk and recovers the same answers, and what it cannot do is a typed
//! error (PQ over kv43: `pq_kv43.rs`).

mod common;

use attnstore::{
    AttnShape, Budget, BufferSettings, Codec, ContextSpec, DurableConfig, Engine, EngineConfig, Error, EstimateShare,
    IndexRebuild, Kv43Params, Method, Request, WaveParams,
};
use attnstore_index::{AccessMethod, WaveIndex};
use attnstore_kernels::cpu::reference::{attend_f64, rel_l2};
use attnstore_kernels::random::SplitMix64;
use attnstore_kernels::Kv43Head;
use common::allocated;
use half::f16;

const TOKENS: usize = 3000;

fn shape() -> AttnShape {
    AttnShape::new(8, 2, 64).unwrap()
}

fn wave() -> WaveParams {
    WaveParams { segment_tokens: 512, decode_segment_tokens: 128, local_tokens: 32, ..WaveParams::default() }
}

fn spec() -> ContextSpec {
    ContextSpec::new(shape(), 1).with_method(Method::Wave(wave())).with_codec(Codec::Kv43(Kv43Params::default()))
}

/// `kv_heads × tokens × d` keys with three outlier channels (as real post-RoPE keys have) and
/// values around per-channel means, and one query per query head.
fn data(seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let s = shape();
    let d = s.head_dim;
    let mut g = SplitMix64::new(seed);
    let mu: Vec<f32> = (0..d).map(|_| g.normal()).collect();
    let k = (0..s.kv_len(TOKENS)).map(|i| g.normal() * if i % d < 3 { 6.0 } else { 1.0 }).collect();
    let v = (0..s.kv_len(TOKENS)).map(|i| mu[i % d] + 0.5 * g.normal()).collect();
    let q = (0..s.query_len()).map(|_| g.normal() * 0.4).collect();
    (k, v, q)
}

fn f16_rows(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| f16::from_f32(v).to_f32()).collect()
}

/// Exact attention (f64) of every query head over the rows a `kv43` wave index of `k`/`v`
/// stands for: the f16 sink and tail, and each segment's rows in storage order encoded as
/// the index encodes them and dequantized. `plain` instead takes the f16 rows themselves.
fn reference(k: &[f32], v: &[f32], q: &[f32], plain: bool) -> Vec<f64> {
    reference_with(k, v, q, (plain, plain))
}

/// [`reference`] with the segments' keys and values each plain or dequantized.
fn reference_with(k: &[f32], v: &[f32], q: &[f32], (plain_keys, plain_values): (bool, bool)) -> Vec<f64> {
    let s = shape();
    let (h, d, g) = (s.kv_heads, s.head_dim, s.group());
    // The same index the engine builds (the same deterministic k-means), for its layout.
    let mut index =
        WaveIndex::<f16>::new(wave(), h, d).unwrap().with_codec(Codec::Kv43(Kv43Params::default())).unwrap();
    index.prefill(k, v).unwrap();
    let layout = index.layout();
    let mut out = Vec::new();
    for head in 0..h {
        let row = |x: &[f32], t: usize| f16_rows(&x[(head * TOKENS + t) * d..(head * TOKENS + t + 1) * d]);
        let (mut rk, mut rv): (Vec<f32>, Vec<f32>) = (Vec::new(), Vec::new());
        for t in 0..layout.sink_len as usize {
            rk.extend(row(k, t));
            rv.extend(row(v, t));
        }
        for seg in &layout.segments {
            let positions = &seg.heads[head].positions;
            let sk: Vec<f32> = positions.iter().flat_map(|&p| row(k, p as usize)).collect();
            let sv: Vec<f32> = positions.iter().flat_map(|&p| row(v, p as usize)).collect();
            let mut coded = Kv43Head::new(d, Kv43Params::default()).unwrap();
            coded.append(&sk, &sv).unwrap();
            let (dk, dv) = coded.dequantize();
            rk.extend(if plain_keys { sk } else { dk });
            rv.extend(if plain_values { sv } else { dv });
        }
        for t in layout.tail_start as usize..TOKENS {
            rk.extend(row(k, t));
            rv.extend(row(v, t));
        }
        for j in 0..g {
            let qh = &q[(head * g + j) * d..(head * g + j + 1) * d];
            out.extend(attend_f64(qh, &rk, &rv, None));
        }
    }
    out
}

fn answer(engine: &Engine, ctx: attnstore::ContextId, q: &[f32], budget: &Budget) -> Vec<f32> {
    let plan = engine.plan(&[Request::new(ctx, 0, q.to_vec())], budget).unwrap();
    engine.execute(&plan).unwrap().remove(0)
}

#[test]
fn exact_and_sparse_plans_answer_close_to_attention_over_the_rows_the_codes_stand_for() {
    let (k, v, q) = data(3);
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let ctx = engine.create_context(spec()).unwrap();
    let plain = engine.create_context(spec().with_codec(Codec::F16)).unwrap();
    engine.prefill(ctx, 0, &k, &v).unwrap();
    engine.prefill(plain, 0, &k, &v).unwrap();
    let (coded, f16_kv) = (engine.stats(ctx, 0).unwrap(), engine.stats(plain, 0).unwrap());
    assert_eq!(
        (coded.segments, coded.clusters),
        (f16_kv.segments, f16_kv.clusters),
        "the codec does not change the index"
    );
    assert!(coded.segments >= 4, "the test must exercise several segments");

    // Exact over the codes: within the codec's own arithmetic (8-bit queries per key group,
    // 7-bit probabilities per value block) of exact attention over the dequantized rows,
    // which is much nearer than the f16 rows are (the rounding of 4+3 bits).
    let exact = answer(&engine, ctx, &q, &Budget::full());
    let (dequantized, f16_rows_ref) = (reference(&k, &v, &q, false), reference(&k, &v, &q, true));
    let (err_codes, err_rounding) = (rel_l2(&exact, &dequantized), rel_l2(&exact, &f16_rows_ref));
    let rounding = rel_l2(&dequantized.iter().map(|&x| x as f32).collect::<Vec<_>>(), &f16_rows_ref);
    println!("exact over kv43: {err_codes:.5} from the dequantized rows, {err_rounding:.5} from f16 (rounding alone {rounding:.5})");
    assert!(err_codes < 0.01, "exact plan vs attention over the dequantized rows: {err_codes}");
    assert!(err_codes < rounding / 2.0, "{err_codes} vs the rounding's own {rounding}");
    assert!(err_rounding < 0.1, "exact plan vs f16 rows: {err_rounding}");

    // Retrieving every cluster reads the same rows in the same value blocks: the same answer.
    let all =
        Budget::default().with_retrieve(1.0).with_estimate(EstimateShare::Fraction(0.0)).with_exact_threshold(100.0);
    let retrieved = answer(&engine, ctx, &q, &all);
    let err = rel_l2(&retrieved, &exact.iter().map(|&x| f64::from(x)).collect::<Vec<_>>());
    assert!(err < 1e-4, "retrieve-all vs exact over the codes: {err}");

    // A tripartite plan over kv43 rows stays near the same plan over f16 rows.
    let sparse = Budget::default().with_retrieve_floor(64).with_retrieve(0.05).with_exact_threshold(100.0);
    let plan = engine.plan(&[Request::new(ctx, 0, q.clone())], &sparse).unwrap();
    assert!(plan.explain().contains("Retrieve"), "{}", plan.explain());
    // Asked to leave the choice of clusters to the device, the planner keeps kv43 rows on
    // the host (the device step reads f16 and hack2 rows) and says why.
    let on_gpu = engine.plan_gpu(&[Request::new(ctx, 0, q.clone())], &sparse).unwrap();
    let why = on_gpu.requests[0].host_planned.as_deref().expect("kv43 rows are planned on the host");
    assert!(why.starts_with("kv43") && why.contains("the device step reads"), "{why}");
    assert!(on_gpu.requests[0].device.is_none());
    let (a, b) = (answer(&engine, ctx, &q, &sparse), answer(&engine, plain, &q, &sparse));
    let err = rel_l2(&a, &b.iter().map(|&x| f64::from(x)).collect::<Vec<_>>());
    println!("sparse over kv43 vs the same budget over f16: {err:.5}");
    assert!(err < 0.1, "kv43 vs f16 under the same sparse budget: {err}");
}

#[test]
fn a_kv43_context_stores_a_quarter_of_f16_and_explain_says_so() {
    let (k, v, q) = data(4);
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let ctx = engine.create_context(spec()).unwrap();
    let plain = engine.create_context(spec().with_codec(Codec::F16)).unwrap();
    engine.prefill(ctx, 0, &k, &v).unwrap();
    engine.prefill(plain, 0, &k, &v).unwrap();
    let plan = engine.plan(&[Request::new(ctx, 0, q)], &Budget::full()).unwrap();
    let text = plan.explain();
    assert!(text.contains("kv43 (64.0 B per token and kv head, 0.250× f16)"), "{text}");
    // Segment rows at a quarter of f16 (a little more: each segment's partial key group
    // stays f16), the steady zone in f16.
    let (coded, f16_kv) = (engine.stats(ctx, 0).unwrap(), engine.stats(plain, 0).unwrap());
    let steady = 2 * (TOKENS - coded.indexed_tokens) * shape().kv_heads * 64 * 2;
    let (segments, f16_segments) = (coded.kv_bytes - steady, f16_kv.kv_bytes - steady);
    println!("segment rows: {segments} B in kv43, {f16_segments} B in f16");
    assert!(segments as f64 <= 0.32 * f16_segments as f64, "{segments} vs {f16_segments}");
    assert!(segments as f64 >= 0.25 * f16_segments as f64, "{segments} vs {f16_segments}");
}

#[test]
fn what_kv43_cannot_serve_yet_is_a_typed_error() {
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let refused = |spec: ContextSpec, says: &str| match engine.create_context(spec) {
        Err(Error::InvalidSpec(why)) => assert!(why.contains(says), "{why}"),
        other => panic!("expected InvalidSpec saying {says:?}, got {other:?}"),
    };
    refused(spec().with_method(Method::Flat), "kv43 codec encodes indexed rows");
    refused(
        ContextSpec::new(AttnShape::new(4, 2, 32).unwrap(), 1).with_codec(Codec::Kv43(Kv43Params::default())),
        "multiple of 64",
    );
    refused(
        ContextSpec::new(shape(), 1).with_codec(Codec::Kv43(Kv43Params {
            key_bits: 4,
            value_bits: 3,
            key_group: 96,
            value_block: 64,
        })),
        "multiple of the value block",
    );
    let mut f32_steady = spec();
    f32_steady.dtype = attnstore::DType::F32;
    refused(f32_steady, "in f16");
    // Bad rows are refused and change nothing.
    let ctx = engine.create_context(spec()).unwrap();
    let (mut k, v, _) = data(5);
    k[100] = f32::NAN;
    assert!(engine.prefill(ctx, 0, &k, &v).is_err());
    assert_eq!(engine.stats(ctx, 0).unwrap().tokens, 0);
    assert!(engine.prefill(ctx, 0, &k[..64], &v[..65]).is_err());
}

#[test]
fn a_durable_kv43_context_is_homed_in_its_codes_and_recovers_the_same_answers() {
    let dir = tempfile::tempdir().unwrap();
    let (k, v, q) = data(6);
    let s = shape();
    let d = s.head_dim;
    // Head-major slices of tokens a..b, as the engine takes batches.
    let slice = |x: &[f32], a: usize, b: usize| -> Vec<f32> {
        (0..s.kv_heads).flat_map(|h| x[(h * TOKENS + a) * d..(h * TOKENS + b) * d].to_vec()).collect()
    };
    let budgets = [Budget::full(), Budget::default().with_retrieve_floor(64).with_retrieve(0.05)];
    let outputs =
        |engine: &Engine, ctx| -> Vec<Vec<f32>> { budgets.iter().map(|b| answer(engine, ctx, &q, b)).collect() };
    let reference = Engine::in_memory(EngineConfig::default()).unwrap();
    let rctx = reference.create_context(spec()).unwrap();
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    let ctx = engine.create_context(spec()).unwrap();
    for e in [(&engine, ctx), (&reference, rctx)] {
        e.0.prefill(e.1, 0, &slice(&k, 0, 2000), &slice(&v, 0, 2000)).unwrap();
        for a in (2000..2400).step_by(40) {
            e.0.append(e.1, 0, &slice(&k, a, a + 40), &slice(&v, a, a + 40)).unwrap();
        }
    }
    // The checkpoint writes the layer's kv43 home (its segments' codes, clusters and f16
    // partial groups, and the f16 steady rows); the data file's bytes before it are punched
    // where the file system can.
    let data = dir.path().join(attnstore::durable::DATA_DIR);
    let before = allocated(&data);
    let report = engine.checkpoint().unwrap();
    assert_eq!(report.homes_written, 1, "{report:?}");
    if report.data_bytes_freed > 0 {
        // 2400 tokens of f16 KV: 2 heads × 64 × 2 B, keys and values.
        let f16_bytes = 2400 * 2 * 64 * 2 * 2;
        let (after, index) = (allocated(&data), allocated(&dir.path().join("index")));
        println!(
            "2400 kv43 tokens: data file {before} → {after} B, index files {index} B: {:.3} of f16's {f16_bytes} B",
            (after + index) as f64 / f16_bytes as f64
        );
        assert!(after * 4 < before, "data file {before} → {after} allocated bytes");
        assert!(((after + index) as f64) < 0.6 * f16_bytes as f64, "{after} + {index} B");
    } else {
        println!("this file system cannot punch holes: the data file keeps its bytes (unread)");
    }
    for a in (2400..2600).step_by(40) {
        for e in [(&engine, ctx), (&reference, rctx)] {
            e.0.append(e.1, 0, &slice(&k, a, a + 40), &slice(&v, a, a + 40)).unwrap();
        }
    }
    let before = outputs(&engine, ctx);
    assert_eq!(before, outputs(&reference, rctx));
    drop(engine);
    // Recovery restores the index from the kv43 home (nothing re-encoded) and replays the
    // tokens appended after the checkpoint: the same codes, so the same answers, bit for bit.
    for rebuild in [IndexRebuild::Blocking, IndexRebuild::Background] {
        let config = DurableConfig { index_rebuild: rebuild, ..DurableConfig::default() };
        let engine = Engine::open_with(dir.path(), EngineConfig::default(), config).unwrap();
        let report = engine.recovery_report().unwrap();
        assert!(report.layout_errors.is_empty(), "{rebuild:?}: {report}");
        assert_eq!((report.homes_restored, report.background_rebuild_layers), (1, 0), "{rebuild:?}: {report}");
        assert!(engine.wait_index_rebuild(std::time::Duration::from_secs(60)).unwrap(), "{rebuild:?}");
        assert_eq!(engine.stats(ctx, 0).unwrap(), reference.stats(rctx, 0).unwrap(), "{rebuild:?}");
        assert_eq!(outputs(&engine, ctx), before, "{rebuild:?}");
    }
}

#[test]
fn with_a_buffer_manager_kv43_segments_stay_in_the_index_and_answer_alike() {
    let (k, v, q) = data(7);
    let config = EngineConfig {
        buffers: Some(BufferSettings { maintainer_idle: None, ..BufferSettings::new(20_000) }),
        ..EngineConfig::default()
    };
    let homed = Engine::in_memory(config).unwrap();
    let memory = Engine::in_memory(EngineConfig::default()).unwrap();
    let (a, b) = (homed.create_context(spec()).unwrap(), memory.create_context(spec()).unwrap());
    homed.prefill(a, 0, &k, &v).unwrap();
    memory.prefill(b, 0, &k, &v).unwrap();
    assert_eq!(homed.stats(a, 0).unwrap(), memory.stats(b, 0).unwrap());
    for budget in [Budget::full(), Budget::default().with_retrieve_floor(64).with_retrieve(0.05)] {
        assert_eq!(answer(&homed, a, &q, &budget), answer(&memory, b, &q, &budget));
    }
}

/// Two layers of the same rows: layer 0 in `kv43`, layer 1 overridden to 5-bit keys (what
/// SmolLM2's layers 17–21 take, `docs/codec.md` round 5).
fn layered() -> ContextSpec {
    let k5 = Codec::Kv43(Kv43Params { key_bits: 5, ..Kv43Params::default() });
    ContextSpec::new(shape(), 2).with_method(Method::Wave(wave())).with_layer_codecs(attnstore::LayerCodecs {
        default: Codec::Kv43(Kv43Params::default()),
        overrides: attnstore::CodecOverrides::default().with(1..=1, k5).unwrap(),
    })
}

#[test]
fn a_layer_with_5_bit_keys_answers_closer_to_f16_and_explain_counts_its_bytes() {
    let (k, v, q) = data(8);
    // Sharp queries (scores spread over several units), so the keys' rounding shows.
    let q: Vec<f32> = q.iter().map(|x| 3.0 * x).collect();
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let ctx = engine.create_context(layered()).unwrap();
    for layer in 0..2 {
        engine.prefill(ctx, layer, &k, &v).unwrap();
    }
    let plan =
        engine.plan(&[Request::new(ctx, 0, q.clone()), Request::new(ctx, 1, q.clone())], &Budget::full()).unwrap();
    let text = plan.explain();
    // d = 64: 4-bit keys 64.0 B per token and kv head; 5-bit keys add d/8 = 8 B.
    assert!(text.contains("kv43 (64.0 B per token and kv head, 0.250× f16)"), "{text}");
    assert!(text.contains("kv43:k5 (72.0 B per token and kv head, 0.281× f16)"), "{text}");
    let out = engine.execute(&plan).unwrap();
    // Against exact attention over the f16 keys and the values as both layers code them
    // (the same 3-bit values): the 5-bit layer is nearer (the keys' step halves).
    let exact = reference_with(&k, &v, &q, (true, false));
    let (four, five) = (rel_l2(&out[0], &exact), rel_l2(&out[1], &exact));
    println!("exact plans against f16 keys: 4-bit keys {four:.2e}, 5-bit keys {five:.2e}");
    assert!(five < 0.8 * four, "5-bit keys {five} vs 4-bit {four}");
    // The layer's own stats count its bytes: more than layer 0's, less than 1.2×.
    let (l0, l1) = (engine.stats(ctx, 0).unwrap(), engine.stats(ctx, 1).unwrap());
    assert!(l1.kv_bytes > l0.kv_bytes && (l1.kv_bytes as f64) < 1.2 * l0.kv_bytes as f64, "{l0:?} {l1:?}");
}

#[test]
fn codec_overrides_survive_checkpoint_and_recovery_and_bad_ones_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (k, v, q) = data(9);
    let budgets = [Budget::full(), Budget::default().with_retrieve_floor(64).with_retrieve(0.05)];
    let outputs = |engine: &Engine, ctx| -> Vec<Vec<f32>> {
        let requests = [Request::new(ctx, 0, q.clone()), Request::new(ctx, 1, q.clone())];
        budgets.iter().flat_map(|b| engine.execute(&engine.plan(&requests, b).unwrap()).unwrap()).collect()
    };
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    let ctx = engine.create_context(layered()).unwrap();
    for layer in 0..2 {
        engine.prefill(ctx, layer, &k, &v).unwrap();
    }
    let report = engine.checkpoint().unwrap();
    assert_eq!(report.homes_written, 2, "{report:?}");
    let before = outputs(&engine, ctx);
    drop(engine);
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    let report = engine.recovery_report().unwrap();
    assert!(report.layout_errors.is_empty(), "{report}");
    assert_eq!(report.homes_restored, 2, "{report}");
    assert_eq!(engine.spec(ctx).unwrap(), layered());
    assert_eq!(outputs(&engine, ctx), before);

    let refused = |spec: ContextSpec, says: &str| match engine.create_context(spec) {
        Err(Error::InvalidSpec(why)) => assert!(why.contains(says), "{why}"),
        other => panic!("expected InvalidSpec saying {says:?}, got {other:?}"),
    };
    let overrides = |s: &str| s.parse::<attnstore::CodecOverrides>().unwrap();
    let mut beyond = layered();
    beyond.codec_overrides = overrides("1-2=kv43:k5");
    refused(beyond, "name layer 2, but the context has 2 layers");
    // PQ takes kv43 layers (`pq_kv43.rs`); flat, the exact oracle, keeps every layer plain.
    let mut flat = layered().with_method(Method::Flat).with_codec(Codec::F16);
    flat.codec_overrides = overrides("1=kv43:k5");
    refused(flat, "layers 1-1: the kv43 codec encodes indexed rows");
    let mut bf16 = layered();
    bf16.codec_overrides = overrides("0=bf16");
    refused(bf16, "codec bf16 stores bf16 rows but the spec's dtype is f16");
}
