//! The remote tier over the in-process store: publish then attach gives the same answers in
//! another engine (every method, codec and layer kind), diverging prefixes share exactly
//! their common chunks, another model's identity never matches, damaged or missing values
//! shorten the prefix and are counted, and a failing or slow store costs nothing local.

mod common;
use common::synth::{SynthContext, SynthParams};

use attnstore::remote::{LayerKv, MemoryStore, ModelId, RemoteConfig, RemoteStore, RemoteTier};
use attnstore::{
    AttnShape, Budget, Codec, ContextId, ContextSpec, Engine, EngineConfig, HackParams, LayerKind, Method, PqParams,
    Request, WaveParams,
};
use std::sync::Arc;
use std::time::Duration;

const CHUNK: usize = 128;
const TOKENS: usize = 2048;

fn shape() -> AttnShape {
    AttnShape::new(4, 2, 16).unwrap()
}

fn wave() -> Method {
    Method::Wave(WaveParams { segment_tokens: 512, decode_segment_tokens: 256, ..WaveParams::default() })
}

fn tier(store: &Arc<MemoryStore>) -> RemoteTier {
    let config = RemoteConfig { chunk_tokens: CHUNK, values_per_call: 16, ..RemoteConfig::default() };
    RemoteTier::new(Arc::clone(store) as Arc<dyn RemoteStore>, config).unwrap()
}

fn engine() -> Engine {
    Engine::in_memory(EngineConfig::default()).unwrap()
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed) % 50_000).collect()
}

/// A context of `spec` in `engine` holding `synth`'s KV on every layer (a window layer its
/// last W tokens), prefilled then appended; returns it with the KV per layer as stored.
fn build(engine: &Engine, spec: &ContextSpec, synth: &SynthContext, prefill: usize) -> (ContextId, Vec<LayerKv>) {
    let ctx = engine.create_context(spec.clone()).unwrap();
    let n = synth.params.tokens;
    let mut kv = Vec::new();
    for (l, kind) in spec.layers.iter().enumerate() {
        let (k0, v0) = synth.slice(0, prefill);
        engine.prefill(ctx, l, &k0, &v0).unwrap();
        engine.wait_index(ctx, l, Duration::from_secs(60)).unwrap();
        if prefill < n {
            let (k1, v1) = synth.slice(prefill, n);
            engine.append(ctx, l, &k1, &v1).unwrap();
        }
        kv.push(match kind {
            LayerKind::Global => synth.slice(0, n),
            LayerKind::SlidingWindow(w) => synth.slice(n - w.min(&n), n),
        });
    }
    (ctx, kv)
}

/// Outputs of a few queries on every layer under the default sparse budget and in full.
fn answers(engine: &Engine, ctx: ContextId, layers: usize, synth: &SynthContext) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    for step in 0..3 {
        for l in 0..layers {
            for budget in [Budget::default().with_retrieve_floor(64), Budget::full()] {
                let plan = engine.plan(&[Request::new(ctx, l, synth.queries(step))], &budget).unwrap();
                out.push(engine.execute(&plan).unwrap().remove(0));
            }
        }
    }
    out
}

fn specs() -> Vec<(&'static str, ContextSpec)> {
    let base = ContextSpec::new(shape(), 2);
    let hack = Codec::Hack2(HackParams::default());
    vec![
        ("wave f16", base.clone().with_method(wave())),
        ("wave f32", base.clone().with_method(wave()).with_dtype(attnstore::DType::F32)),
        ("wave hack2", base.clone().with_method(wave()).with_codec(hack)),
        ("pq f16", base.clone().with_method(Method::Pq(PqParams::default()))),
        ("pq hack2", base.clone().with_method(Method::Pq(PqParams::default())).with_codec(hack)),
        ("flat f16", base.clone().with_method(Method::Flat)),
        (
            "wave with a window layer",
            base.with_method(wave()).with_layers(vec![LayerKind::Global, LayerKind::SlidingWindow(256)]),
        ),
    ]
}

#[test]
fn publish_then_attach_in_another_engine_answers_the_same() {
    let model = ModelId::of_bytes(b"model a");
    for (name, spec) in specs() {
        let store = Arc::new(MemoryStore::new());
        let synth = SynthContext::generate(SynthParams::new(shape(), TOKENS, 3));
        let ids = tokens(TOKENS, 1);
        let (first, second) = (engine(), engine());
        let (ctx, kv) = build(&first, &spec, &synth, 1536);
        let t = tier(&store);
        t.publish(&first, ctx, &model, &ids, kv.clone()).unwrap();
        assert!(t.flush(Duration::from_secs(30)), "{name}: publish finished");
        let attached = tier(&store).attach(&second, spec.clone(), &model, &ids).unwrap().expect(name);
        assert_eq!(attached.tokens, TOKENS, "{name}");
        let global = spec.layers.iter().filter(|k| **k == LayerKind::Global).count();
        if !matches!(spec.method, Method::Flat) {
            assert_eq!(attached.layouts_used, global, "{name}: every global layer restored from its layout");
        }
        for l in 0..spec.layers.len() {
            second.wait_index(attached.context, l, Duration::from_secs(60)).unwrap();
            assert_eq!(second.stats(attached.context, l).unwrap(), first.stats(ctx, l).unwrap(), "{name} layer {l}");
        }
        let (a, b) = (
            answers(&first, ctx, spec.layers.len(), &synth),
            answers(&second, attached.context, spec.layers.len(), &synth),
        );
        assert_eq!(a, b, "{name}: the attached context answers exactly as the published one");
        // The attached KV is the published one, rounded to the context's element type.
        for (l, ((k, _), (ka, _))) in kv.iter().zip(&attached.kv).enumerate() {
            assert_eq!(k.len(), ka.len(), "{name} layer {l}");
            let worst = k.iter().zip(ka).map(|(x, y)| (x - y).abs() / x.abs().max(1.0)).fold(0.0f32, f32::max);
            assert!(worst <= 1e-3, "{name} layer {l}: {worst}");
        }
        let s = tier(&store).stats();
        assert_eq!(s.misses + s.corrupt, 0, "{name}");
    }
}

/// A two-layer wave context of [`TOKENS`] tokens (or `spec`'s) in a fresh engine, with a
/// fresh store, its KV and token ids.
struct Fixture {
    model: ModelId,
    store: Arc<MemoryStore>,
    spec: ContextSpec,
    synth: SynthContext,
    e: Engine,
    ctx: ContextId,
    kv: Vec<LayerKv>,
    ids: Vec<u32>,
}

fn fixture_of(spec: ContextSpec) -> Fixture {
    let synth = SynthContext::generate(SynthParams::new(shape(), TOKENS, 3));
    let e = engine();
    let (ctx, kv) = build(&e, &spec, &synth, TOKENS);
    let (model, store, ids) = (ModelId::of_bytes(b"model a"), Arc::new(MemoryStore::new()), tokens(TOKENS, 1));
    Fixture { model, store, spec, synth, e, ctx, kv, ids }
}

fn fixture() -> Fixture {
    fixture_of(ContextSpec::new(shape(), 2).with_method(wave()))
}

#[test]
fn a_second_publish_writes_nothing_new() {
    let Fixture { model, store, e, ctx, kv, ids, .. } = fixture();
    let t = tier(&store);
    t.publish(&e, ctx, &model, &ids, kv.clone()).unwrap();
    t.publish(&e, ctx, &model, &ids, kv).unwrap();
    assert!(t.flush(Duration::from_secs(30)));
    let s = t.stats();
    assert_eq!(s.publishes_done, 2);
    assert_eq!(s.values_present, s.values_out, "the second publish found every value present");
    // 16 chunks × 2 layers of rows, plus layout pieces and their lists.
    assert!(s.values_out >= 32, "{s:?}");
}

#[test]
fn diverging_prefixes_share_exactly_their_common_chunks() {
    let Fixture { model, store, spec, synth, e, ctx, kv, ids: a } = fixture();
    let t = tier(&store);
    t.publish(&e, ctx, &model, &a, kv.clone()).unwrap();
    assert!(t.flush(Duration::from_secs(30)));
    for diverge in [0, 1, CHUNK - 1, CHUNK, 5 * CHUNK + 7, TOKENS - 1] {
        let mut b = a.clone();
        b[diverge] ^= 1;
        b.extend(tokens(300, 9)); // longer than what was published
        let other = engine();
        let got = t.attach(&other, spec.clone(), &model, &b).unwrap();
        let shared = diverge / CHUNK * CHUNK;
        assert_eq!(got.as_ref().map_or(0, |g| g.tokens), shared, "diverging at token {diverge}");
        if let Some(g) = got {
            let (h, d) = (shape().kv_heads, shape().head_dim);
            for head in 0..h {
                let want = &kv[0].0[head * TOKENS * d..(head * TOKENS + shared) * d];
                let have = &g.kv[0].0[head * shared * d..(head + 1) * shared * d];
                let worst = want.iter().zip(have).map(|(x, y)| (x - y).abs() / x.abs().max(1.0)).fold(0.0f32, f32::max);
                assert!(worst <= 1e-3, "head {head}: {worst}");
            }
            // Its prefix plans and answers like a context prefilled with those rows.
            let q = synth.queries(0);
            let plan = other.plan(&[Request::new(g.context, 1, q)], &Budget::full()).unwrap();
            assert_eq!(other.execute(&plan).unwrap()[0].len(), shape().query_len());
        }
    }
    // Another model's identity never matches, and asking costs only misses.
    let before = t.stats();
    let got = t.attach(&engine(), spec, &ModelId::of_bytes(b"model b"), &a).unwrap();
    assert!(got.is_none());
    let after = t.stats();
    assert_eq!(after.hits, before.hits);
    assert!(after.misses > before.misses);
}

#[test]
fn a_prefix_ending_inside_a_published_segment_restores_the_segment_cut_there() {
    let (store, spec, ids, model) = published();
    let t = tier(&store);
    let e = engine();
    // All but the last token, as a runtime asks: 15 whole chunks; the last segment of the
    // published index ends past them and is cut at the prefix's local window.
    let got = t.attach(&e, spec, &model, &ids[..TOKENS - 1]).unwrap().unwrap();
    assert_eq!((got.tokens, got.layouts_used), (15 * CHUNK, 2));
    let stats = e.stats(got.context, 0).unwrap();
    assert!(stats.segments >= 3, "{stats:?}");
    // A full budget over the restored index is exact attention over the attached rows.
    let synth = SynthContext::generate(SynthParams::new(shape(), TOKENS, 3));
    let fresh = engine();
    let ctx = fresh.create_context(ContextSpec::new(shape(), 1).with_method(Method::Flat)).unwrap();
    let (k, v) = synth.slice(0, 15 * CHUNK);
    fresh.prefill(ctx, 0, &k, &v).unwrap();
    for step in 0..3 {
        let q = synth.queries(step);
        let a = e.execute(&e.plan(&[Request::new(got.context, 0, q.clone())], &Budget::full()).unwrap()).unwrap();
        let b = fresh.execute(&fresh.plan(&[Request::new(ctx, 0, q)], &Budget::full()).unwrap()).unwrap();
        let err =
            attnstore_kernels::cpu::reference::rel_l2(&a[0], &b[0].iter().map(|&x| f64::from(x)).collect::<Vec<_>>());
        assert!(err < 1e-3, "step {step}: {err}");
    }
}

/// Publishes a two-layer wave context of [`TOKENS`] tokens into a fresh store.
fn published() -> (Arc<MemoryStore>, ContextSpec, Vec<u32>, ModelId) {
    let Fixture { model, store, spec, e, ctx, kv, ids, .. } = fixture();
    let t = tier(&store);
    t.publish(&e, ctx, &model, &ids, kv).unwrap();
    assert!(t.flush(Duration::from_secs(30)));
    (store, spec, ids, model)
}

/// The key of rows chunk `chunk` (0-based) of layer 1: keys sort by chain hash, so find it
/// by decoding which chunk each rows key is: attach a prefix of `chunk + 1` chunks against
/// a store without the candidate.
fn rows_key(store: &Arc<MemoryStore>, spec: &ContextSpec, ids: &[u32], model: &ModelId, chunk: usize) -> String {
    let candidates: Vec<String> =
        store.keys().into_iter().filter(|k| k.contains(":kv:") && k.contains(":1:g:")).collect();
    for key in candidates {
        let value = store.get(&key).unwrap();
        store.delete(&key);
        let got = tier(store).attach(&engine(), spec.clone(), model, &ids[..(chunk + 1) * CHUNK]).unwrap();
        store.put(&key, value);
        if got.map_or(0, |g| g.tokens) == chunk * CHUNK {
            return key;
        }
    }
    panic!("no rows key of chunk {chunk}");
}

#[test]
fn damaged_or_missing_values_end_the_prefix_there_and_are_counted() {
    let (store, spec, ids, model) = published();
    let key = rows_key(&store, &spec, &ids, &model, 5);
    let good = store.get(&key).unwrap();
    let mut flipped = good.clone();
    flipped[good.len() / 2] ^= 0x40; // SETRANGE of one byte
    let cases: Vec<(&str, Option<Vec<u8>>)> = vec![
        ("a flipped byte", Some(flipped)),
        ("a truncated value", Some(good[..good.len() - 100].to_vec())),
        ("an empty value", Some(Vec::new())),
        ("another chunk's value", Some(store.get(&rows_key(&store, &spec, &ids, &model, 6)).unwrap())),
        ("a deleted key", None),
    ];
    for (what, value) in cases {
        match &value {
            Some(v) => store.put(&key, v.clone()),
            None => {
                store.delete(&key);
            }
        }
        let t = tier(&store);
        let got = t.attach(&engine(), spec.clone(), &model, &ids).unwrap().unwrap();
        assert_eq!(got.tokens, 5 * CHUNK, "{what}: the prefix ends before chunk 5");
        let s = t.stats();
        if value.is_some() {
            assert_eq!((s.corrupt, s.misses), (1, 0), "{what}: {s:?}");
        } else {
            assert_eq!((s.corrupt, s.misses), (0, 1), "{what}: {s:?}");
        }
        store.put(&key, good.clone());
    }
    let got = tier(&store).attach(&engine(), spec, &model, &ids).unwrap().unwrap();
    assert_eq!(got.tokens, TOKENS, "repaired");
}

#[test]
fn damaged_layouts_are_not_used_and_the_layer_is_indexed_from_its_rows() {
    let (store, spec, ids, model) = published();
    for key in store.keys().into_iter().filter(|k| k.contains(":ix:")) {
        let mut v = store.get(&key).unwrap();
        let at = v.len() - 10;
        v[at] ^= 1;
        store.put(&key, v);
    }
    let t = tier(&store);
    let e = engine();
    let got = t.attach(&e, spec, &model, &ids).unwrap().unwrap();
    assert_eq!((got.tokens, got.layouts_used), (TOKENS, 0));
    assert!(t.stats().corrupt > 0);
    assert!(e.stats(got.context, 0).unwrap().segments > 0, "clustered from its rows");
}

#[test]
fn a_failing_store_loses_nothing_local_and_serves_nothing_wrong() {
    let Fixture { model, store, spec, synth, e, ctx, kv, ids } = fixture();
    let before = answers(&e, ctx, 2, &synth);
    let t = tier(&store);
    store.set_down(true);
    t.publish(&e, ctx, &model, &ids, kv.clone()).unwrap();
    assert!(t.flush(Duration::from_secs(30)));
    let s = t.stats();
    assert_eq!((s.publishes_failed, s.publishes_done), (1, 0));
    assert!(s.connection_failures >= 1);
    assert!(t.attach(&engine(), spec.clone(), &model, &ids).unwrap().is_none(), "nothing attached from a down store");
    store.set_down(false);
    t.publish(&e, ctx, &model, &ids, kv).unwrap();
    assert!(t.flush(Duration::from_secs(30)));
    store.clear(); // restarted empty
    assert!(t.attach(&engine(), spec, &model, &ids).unwrap().is_none());
    assert_eq!(answers(&e, ctx, 2, &synth), before, "the local context is untouched");
}

#[test]
fn a_slow_store_never_blocks_a_decode_step_and_a_full_queue_drops_the_oldest() {
    let Fixture { model, store, synth, e, ctx, kv, ids, .. } = fixture();
    let config = RemoteConfig { chunk_tokens: CHUNK, queue_publishes: 1, ..RemoteConfig::default() };
    let t = RemoteTier::new(Arc::clone(&store) as Arc<dyn RemoteStore>, config).unwrap();
    store.set_delay(Duration::from_millis(300));
    for _ in 0..4 {
        t.publish(&e, ctx, &model, &ids, kv.clone()).unwrap();
    }
    // The writer is inside a slow store call: decode steps go on meanwhile.
    for step in 0..5 {
        let (k, v) = (synth.queries(step)[..shape().kv_heads * shape().head_dim].to_vec(), vec![0.5; 32]);
        e.append(ctx, 0, &k, &v).unwrap();
        let plan = e.plan(&[Request::new(ctx, 0, synth.queries(step))], &Budget::default()).unwrap();
        e.execute(&plan).unwrap();
    }
    assert!(!t.flush(Duration::ZERO), "the slow publish is still being written");
    let s = t.stats();
    assert_eq!(s.publishes_queued, 4);
    assert!(s.publishes_dropped >= 2, "{s:?}");
    store.set_delay(Duration::ZERO);
    assert!(t.flush(Duration::from_secs(60)));
}

#[test]
fn window_rows_are_published_for_the_window_the_context_holds() {
    let Fixture { model, store, spec, e, ctx, kv, ids, .. } = fixture_of(
        ContextSpec::new(shape(), 2)
            .with_method(wave())
            .with_layers(vec![LayerKind::Global, LayerKind::SlidingWindow(300)]),
    );
    let t = tier(&store);
    t.publish(&e, ctx, &model, &ids, kv).unwrap();
    assert!(t.flush(Duration::from_secs(30)));
    // The window layer held tokens 1748..2048: chunks 13 (from row 84) to 15.
    let window_keys = store.keys().into_iter().filter(|k| k.contains(":1:w300:")).count();
    assert_eq!(window_keys, 3);
    let got = t.attach(&engine(), spec.clone(), &model, &ids).unwrap().unwrap();
    assert_eq!(got.tokens, TOKENS);
    assert_eq!(got.kv[1].0.len(), shape().kv_heads * 300 * shape().head_dim);
    // A prefix ending before the published window has no window rows: nothing to attach.
    let mut b = ids.clone();
    b[8 * CHUNK] ^= 1;
    assert!(t.attach(&engine(), spec, &model, &b).unwrap().is_none());
}

#[test]
fn bad_settings_and_bad_publishes_are_typed_errors() {
    let store: Arc<dyn RemoteStore> = Arc::new(MemoryStore::new());
    for config in [
        RemoteConfig { chunk_tokens: 0, ..RemoteConfig::default() },
        RemoteConfig { queue_publishes: 0, ..RemoteConfig::default() },
        RemoteConfig { namespace: "a b".into(), ..RemoteConfig::default() },
    ] {
        assert!(matches!(RemoteTier::new(Arc::clone(&store), config), Err(attnstore::Error::InvalidSpec(_))));
    }
    let t = RemoteTier::new(store, RemoteConfig::default()).unwrap();
    let e = engine();
    let spec = ContextSpec::new(shape(), 2);
    let synth = SynthContext::generate(SynthParams::new(shape(), 600, 3));
    let (ctx, kv) = build(&e, &spec, &synth, 600);
    let model = ModelId::of_bytes(b"m");
    let err = t.publish(&e, ctx, &model, &tokens(599, 1), kv.clone()).unwrap_err();
    assert!(err.to_string().contains("holds 600 tokens"), "{err}");
    assert!(matches!(
        t.publish(&e, ctx, &model, &tokens(600, 1), kv[..1].to_vec()),
        Err(attnstore::Error::ShapeMismatch { .. })
    ));
    let mut short = kv;
    short[1].0.pop();
    assert!(matches!(t.publish(&e, ctx, &model, &tokens(600, 1), short), Err(attnstore::Error::ShapeMismatch { .. })));
    assert!(matches!(
        t.publish(&e, ContextId(999), &model, &tokens(600, 1), Vec::new()),
        Err(attnstore::Error::UnknownContext(_))
    ));
}

#[test]
fn a_context_attached_into_a_durable_engine_survives_a_restart() {
    let (store, spec, ids, model) = published();
    let dir = tempfile::tempdir().unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape(), TOKENS, 3));
    let (ctx, before) = {
        let e = Engine::open(dir.path(), EngineConfig::default()).unwrap();
        let got = tier(&store).attach(&e, spec.clone(), &model, &ids).unwrap().unwrap();
        assert_eq!((got.tokens, got.layouts_used), (TOKENS, 2));
        (got.context, answers(&e, got.context, 2, &synth))
    };
    let e = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    assert!(e.wait_index_rebuild(Duration::from_secs(60)).unwrap());
    assert_eq!(e.spec(ctx).unwrap(), spec);
    let after = answers(&e, ctx, 2, &synth);
    // Recovery replays the attached rows as a prefill and clusters them again: the exact
    // answers are equal, the sparse ones close.
    for (i, (a, b)) in before.iter().zip(&after).enumerate() {
        let err = attnstore_kernels::cpu::reference::rel_l2(b, &a.iter().map(|&x| f64::from(x)).collect::<Vec<_>>());
        assert!(err < if i % 2 == 1 { 1e-6 } else { 0.2 }, "answer {i}: {err}");
    }
}
