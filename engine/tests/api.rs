//! The engine's query-plan API end to end: exactness of full budgets, accuracy of sparse
//! plans, EXPLAIN, and typed errors that leave stored data unchanged.

mod common;
use common::synth::{SynthContext, SynthParams};

use attnstore::{
    AttnShape, Budget, Codec, ContextId, ContextSpec, DType, Engine, EngineConfig, Error, EstimateShare, HackParams,
    LayerKind, Request, SelectionMode, Strategy, WaveParams,
};
use attnstore_kernels::cpu::reference::{reference_attention, rel_l2};
use attnstore_kernels::HeadsView;

fn shape() -> AttnShape {
    AttnShape::new(8, 2, 32).unwrap()
}

fn small_wave() -> attnstore::Method {
    attnstore::Method::Wave(WaveParams { segment_tokens: 1024, decode_segment_tokens: 256, ..WaveParams::default() })
}

fn setup(tokens: usize, dtype: DType) -> (Engine, ContextId, SynthContext) {
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let spec = ContextSpec::new(shape(), 2).with_dtype(dtype).with_method(small_wave());
    let ctx = engine.create_context(spec).unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape(), tokens, 7));
    engine.prefill(ctx, 0, &synth.keys, &synth.values).unwrap();
    (engine, ctx, synth)
}

fn reference(synth: &SynthContext, q: &[f32]) -> Vec<f64> {
    let t = synth.params.tokens;
    let k = HeadsView::new(&synth.keys, 2, t, 32).unwrap();
    let v = HeadsView::new(&synth.values, 2, t, 32).unwrap();
    reference_attention(&shape(), q, k, v, None)
}

fn run(engine: &Engine, ctx: ContextId, q: &[f32], budget: &Budget) -> Vec<f32> {
    let plan = engine.plan(&[Request::new(ctx, 0, q.to_vec())], budget).unwrap();
    engine.execute(&plan).unwrap().remove(0)
}

#[test]
fn full_budget_equals_exact_attention_in_f32() {
    let (engine, ctx, synth) = setup(5000, DType::F32);
    assert!(engine.stats(ctx, 0).unwrap().segments >= 4);
    for step in 0..3 {
        let q = synth.queries(step);
        let err = rel_l2(&run(&engine, ctx, &q, &Budget::full()), &reference(&synth, &q));
        assert!(err <= 1e-5, "step {step}: {err}");
    }
}

#[test]
fn sparse_plans_are_close_and_estimating_the_rest_is_closer() {
    let (engine, ctx, synth) = setup(8000, DType::F16);
    let q = synth.queries(1);
    let want = reference(&synth, &q);
    let base = Budget::default().with_retrieve_floor(0).with_retrieve(0.05);
    let plan = engine.plan(&[Request::new(ctx, 0, q.clone())], &base).unwrap();
    assert!(matches!(plan.requests[0].strategy, Strategy::Sparse { .. }), "{}", plan.explain());
    let partly = rel_l2(&engine.execute(&plan).unwrap()[0], &want);
    let rest = rel_l2(&run(&engine, ctx, &q, &base.with_estimate(EstimateShare::Rest)), &want);
    let none = rel_l2(&run(&engine, ctx, &q, &base.with_estimate(EstimateShare::Fraction(0.0))), &want);
    assert!(rest < partly && partly < none, "rest {rest}, 23.2% {partly}, none {none}");
    assert!(rest < 0.1, "{rest}");
    let kv = rel_l2(&run(&engine, ctx, &q, &base.with_mode(SelectionMode::PerKvHead)), &want);
    assert!(kv < 0.5, "{kv}");
}

#[test]
fn decode_appends_build_segments_and_full_budget_stays_exact() {
    let full = SynthContext::generate(SynthParams::new(shape(), 2500, 7));
    // Prefill the first 1500 tokens, then decode the rest one token at a time.
    let engine2 = Engine::in_memory(EngineConfig::default()).unwrap();
    let ctx2 =
        engine2.create_context(ContextSpec::new(shape(), 1).with_dtype(DType::F32).with_method(small_wave())).unwrap();
    let (k, v) = full.slice(0, 1500);
    engine2.prefill(ctx2, 0, &k, &v).unwrap();
    let before = engine2.stats(ctx2, 0).unwrap().segments;
    for t in 1500..2500 {
        let (k, v) = full.slice(t, t + 1);
        engine2.append(ctx2, 0, &k, &v).unwrap();
    }
    let after = engine2.stats(ctx2, 0).unwrap();
    assert!(after.segments >= before + 3, "{before} -> {}", after.segments);
    assert_eq!(after.tokens, 2500);
    let q = full.queries(0);
    assert!(rel_l2(&run(&engine2, ctx2, &q, &Budget::full()), &reference(&full, &q)) <= 1e-5);
}

#[test]
fn short_contexts_are_planned_exact_and_explain_says_why() {
    let (engine, ctx, synth) = setup(600, DType::F16);
    let plan = engine.plan(&[Request::new(ctx, 0, synth.queries(0))], &Budget::default()).unwrap();
    let text = plan.explain();
    assert!(matches!(plan.requests[0].strategy, Strategy::Exact { .. }), "{text}");
    assert!(text.contains("strategy: exact"), "{text}");
    assert!(text.contains("cheaper than sparse") || text.contains("nothing indexed"), "{text}");
}

#[test]
fn a_short_context_rule_plans_exact_up_to_its_length_only() {
    let (engine, ctx, synth) = setup(8000, DType::F16);
    let q = synth.queries(0);
    let budget = Budget::default().with_retrieve_floor(64);
    let plan_with = |b: &Budget| engine.plan(&[Request::new(ctx, 0, q.clone())], b).unwrap();
    // Off by default, and below the context's length: sparse.
    for b in [budget, budget.with_short_context(7999)] {
        assert!(matches!(plan_with(&b).requests[0].strategy, Strategy::Sparse { .. }), "{}", plan_with(&b).explain());
    }
    // At or above it: exact, and EXPLAIN says why; the output is exact attention's.
    let short = budget.with_short_context(8000);
    let plan = plan_with(&short);
    assert!(matches!(plan.requests[0].strategy, Strategy::Exact { .. }));
    assert!(plan.explain().contains("short context: 8000 tokens"), "{}", plan.explain());
    let exact = engine.execute(&plan_with(&Budget::full())).unwrap().remove(0);
    assert_eq!(engine.execute(&plan).unwrap().remove(0), exact);
}

#[test]
fn explain_lists_every_zone_with_bytes_and_cost() {
    let (engine, ctx, synth) = setup(8000, DType::F16);
    let budget = Budget::default().with_retrieve_floor(64);
    let plan = engine.plan(&[Request::new(ctx, 0, synth.queries(0))], &budget).unwrap();
    let text = plan.explain_verbose();
    for needle in ["Steady", "Retrieve", "Estimate", "Dropped", "Scoring", "Cost", "host", "kv head 1", "% of exact"] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    let c = plan.requests[0].cost;
    assert!(c.total_bytes() < c.exact_bytes, "{c:?}");
    assert!(c.retrieve_blocks > 0 && c.estimate_clusters > 0);
}

#[test]
fn sliding_window_layers_attend_exactly_their_window() {
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let spec = ContextSpec::new(shape(), 2)
        .with_dtype(DType::F32)
        .with_layers(vec![LayerKind::Global, LayerKind::SlidingWindow(100)]);
    let ctx = engine.create_context(spec).unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape(), 700, 3));
    engine.prefill(ctx, 1, &synth.keys, &synth.values).unwrap();
    assert_eq!(engine.stats(ctx, 1).unwrap().tokens, 100);
    let q = synth.queries(0);
    let plan = engine.plan(&[Request::new(ctx, 1, q.clone())], &Budget::default()).unwrap();
    assert!(plan.explain().contains("sliding-window"));
    let out = engine.execute(&plan).unwrap().remove(0);
    let (k, v) = synth.slice(600, 700);
    let want = reference_attention(
        &shape(),
        &q,
        HeadsView::new(&k, 2, 100, 32).unwrap(),
        HeadsView::new(&v, 2, 100, 32).unwrap(),
        None,
    );
    assert!(rel_l2(&out, &want) <= 1e-5);
}

#[test]
fn bad_inputs_are_typed_errors_and_leave_stored_data_unchanged() {
    let (engine, ctx, synth) = setup(3000, DType::F16);
    let q = synth.queries(0);
    let before_stats = engine.stats(ctx, 0).unwrap();
    let before_out = run(&engine, ctx, &q, &Budget::default());
    let (k, v) = synth.slice(0, 2);
    let mut nan = k.clone();
    nan[5] = f32::NAN;
    let mut inf = v.clone();
    inf[1] = f32::INFINITY;
    assert!(matches!(engine.append(ctx, 0, &k[..k.len() - 1], &v[..v.len() - 1]), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(engine.append(ctx, 0, &k, &v[..32]), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(engine.append(ctx, 0, &nan, &v), Err(Error::NonFinite { what: "keys", index: 5, .. })));
    assert!(matches!(engine.append(ctx, 0, &k, &inf), Err(Error::NonFinite { what: "values", index: 1, .. })));
    assert!(matches!(engine.append(ctx, 9, &k, &v), Err(Error::UnknownLayer { layer: 9, layers: 2, .. })));
    assert!(matches!(engine.append(ContextId(999), 0, &k, &v), Err(Error::UnknownContext(ContextId(999)))));
    assert!(matches!(engine.prefill(ctx, 0, &k, &v), Err(Error::AlreadyPrefilled { .. })));
    let req = |q: Vec<f32>| [Request::new(ctx, 0, q)];
    assert!(matches!(engine.plan(&req(q[..10].to_vec()), &Budget::default()), Err(Error::ShapeMismatch { .. })));
    let mut qn = q.clone();
    qn[3] = f32::NEG_INFINITY;
    assert!(matches!(engine.plan(&req(qn), &Budget::default()), Err(Error::NonFinite { what: "queries", .. })));
    for bad in [
        Budget::default().with_retrieve(1.5),
        Budget::default().with_retrieve(f64::NAN),
        Budget::default().with_retrieve(0.9),
    ] {
        assert!(matches!(engine.plan(&req(q.clone()), &bad), Err(Error::InvalidBudget(_))));
    }
    assert!(matches!(
        engine.plan(&[Request::new(ctx, 5, q.clone())], &Budget::default()),
        Err(Error::UnknownLayer { .. })
    ));
    let gqa = ContextSpec::new(AttnShape { q_heads: 6, kv_heads: 4, head_dim: 32 }, 1);
    assert!(matches!(engine.create_context(gqa), Err(Error::Kernel(attnstore_kernels::Error::GqaMismatch { .. }))));
    assert!(matches!(engine.create_context(ContextSpec::new(shape(), 0)), Err(Error::InvalidSpec(_))));
    assert_eq!(engine.stats(ctx, 0).unwrap(), before_stats);
    assert_eq!(run(&engine, ctx, &q, &Budget::default()), before_out);
}

#[test]
fn a_plan_made_before_an_append_is_refused_as_stale() {
    let (engine, ctx, synth) = setup(2000, DType::F16);
    let plan = engine.plan(&[Request::new(ctx, 0, synth.queries(0))], &Budget::default()).unwrap();
    let (k, v) = synth.slice(0, 1);
    engine.append(ctx, 0, &k, &v).unwrap();
    assert!(matches!(engine.execute(&plan), Err(Error::StalePlan { planned: 2000, now: 2001, .. })));
    assert!(matches!(engine.exact_positions(&plan, 0, 0), Err(Error::StalePlan { .. })));
}

#[test]
fn the_host_memory_budget_is_a_typed_error_not_an_abort() {
    let kv_bytes = 2 * shape().kv_len(1000) * 2;
    let engine =
        Engine::in_memory(EngineConfig { host_memory_bytes: kv_bytes + kv_bytes / 2, ..EngineConfig::default() })
            .unwrap();
    let ctx = engine.create_context(ContextSpec::new(shape(), 2)).unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape(), 1000, 1));
    engine.prefill(ctx, 0, &synth.keys, &synth.values).unwrap();
    assert_eq!(engine.host_bytes_used(), kv_bytes);
    let err = engine.prefill(ctx, 1, &synth.keys, &synth.values).unwrap_err();
    assert!(matches!(err, Error::Buffer(attnstore_buffer::Error::OutOfMemory { .. })), "{err}");
    assert_eq!(engine.stats(ctx, 1).unwrap().tokens, 0);
    engine.drop_context(ctx).unwrap();
    assert_eq!(engine.host_bytes_used(), 0);
    assert!(matches!(engine.drop_context(ctx), Err(Error::UnknownContext(_))));
}

#[test]
fn every_dtype_round_trips_through_the_engine() {
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        let (engine, ctx, synth) = setup(1200, dtype);
        let q = synth.queries(2);
        let err = rel_l2(&run(&engine, ctx, &q, &Budget::full()), &reference(&synth, &q));
        let tol = match dtype {
            DType::F32 => 1e-5,
            DType::F16 => 2e-3,
            DType::Bf16 => 2e-2,
        };
        assert!(err <= tol, "{dtype}: {err}");
    }
}

#[test]
fn batched_requests_over_several_contexts_match_single_requests() {
    let (engine, a, sa) = setup(3000, DType::F16);
    let sb = SynthContext::generate(SynthParams::new(shape(), 4000, 99));
    let b = engine.create_context(ContextSpec::new(shape(), 1).with_method(small_wave())).unwrap();
    engine.prefill(b, 0, &sb.keys, &sb.values).unwrap();
    let budget = Budget::default().with_retrieve_floor(128);
    let reqs =
        [Request::new(a, 0, sa.queries(0)), Request::new(b, 0, sb.queries(1)), Request::new(a, 0, sa.queries(2))];
    let batched = engine.execute(&engine.plan(&reqs, &budget).unwrap()).unwrap();
    for (r, out) in reqs.iter().zip(&batched) {
        assert_eq!(&run(&engine, r.context, &r.queries, &budget), out);
    }
}

#[test]
fn pq_contexts_plan_exactly_until_the_build_is_ready_then_sparse() {
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let params = attnstore::PqParams { min_build_tokens: 512, ..attnstore::PqParams::default() };
    let ctx = engine.create_context(ContextSpec::new(shape(), 1).with_method(attnstore::Method::Pq(params))).unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape(), 20_000, 9));
    engine.prefill(ctx, 0, &synth.keys, &synth.values).unwrap();
    let q = synth.queries(0);
    let want = reference(&synth, &q);
    let budget = Budget::default().with_retrieve(0.1);
    let plan = engine.plan(&[Request::new(ctx, 0, q.clone())], &budget).unwrap();
    if let Strategy::Exact { reason } = &plan.requests[0].strategy {
        // Planned while the codebooks were still training: exact, and EXPLAIN says why.
        assert!(reason.contains("still being built"), "{reason}");
        assert!(plan.explain().contains("still being built"));
        assert!(rel_l2(&engine.execute(&plan).unwrap()[0], &want) <= 1e-3);
    }
    assert!(engine.wait_index(ctx, 0, std::time::Duration::from_secs(120)).unwrap());
    let report = engine.index_build(ctx, 0).unwrap().expect("finished build");
    assert_eq!((report.layout.subspaces, report.layout.bits), (4, 8), "PQCache's layout beyond 16K tokens");
    assert!(report.iters_run <= report.iters_limit);
    let plan = engine.plan(&[Request::new(ctx, 0, q.clone())], &budget).unwrap();
    assert!(matches!(plan.requests[0].strategy, Strategy::Sparse { .. }), "{}", plan.explain());
    let text = plan.explain();
    assert!(text.contains("PQ-approximated") && text.contains("token codes"), "{text}");
    let sparse = rel_l2(&engine.execute(&plan).unwrap()[0], &want);
    assert!(sparse < 0.5, "10% of tokens chosen by PQ scores: {sparse}");
    let exact = rel_l2(&run(&engine, ctx, &q, &Budget::full()), &want);
    assert!(exact <= 1e-3, "f16 storage, full budget: {exact}");
    // Decode appends keep working and the full budget stays exact.
    let more = SynthContext::generate(SynthParams::new(shape(), 200, 10));
    engine.append(ctx, 0, &more.keys, &more.values).unwrap();
    assert_eq!(engine.stats(ctx, 0).unwrap().tokens, 20_200);
}

#[test]
fn bad_pq_parameters_are_typed_errors() {
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    for params in [
        attnstore::PqParams { bits: Some(9), ..attnstore::PqParams::default() },
        attnstore::PqParams { subspaces: Some(3), ..attnstore::PqParams::default() },
    ] {
        let err = engine.create_context(ContextSpec::new(shape(), 1).with_method(attnstore::Method::Pq(params)));
        assert!(matches!(err, Err(Error::Index(_))), "{err:?}");
    }
}

#[test]
fn hack2_contexts_store_a_fifth_of_the_bytes_explain_encoded_sizes_and_stay_close() {
    // The synthetic values are pure noise, the worst case for 2 bits (an attention output
    // averages noise that 2 bits cannot resolve); real values carry per-channel means, so
    // give them one here. Real-trace figures are in docs/codec.md.
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let mut synth = SynthContext::generate(SynthParams::new(shape(), 8000, 7));
    let mu: Vec<f32> = (0..32).map(|c| ((c * 7 % 11) as f32 - 5.0) * 0.4).collect();
    synth.values.iter_mut().enumerate().for_each(|(i, v)| *v = 0.5 * *v + mu[i % 32]);
    let spec = ContextSpec::new(shape(), 2).with_method(small_wave());
    let plain = engine.create_context(spec.clone()).unwrap();
    let hack = engine.create_context(spec.with_codec(Codec::Hack2(HackParams::default()))).unwrap();
    for ctx in [plain, hack] {
        engine.prefill(ctx, 0, &synth.keys, &synth.values).unwrap();
    }
    let (ps, hs) = (engine.stats(plain, 0).unwrap(), engine.stats(hack, 0).unwrap());
    assert!(hs.kv_bytes * 4 < ps.kv_bytes, "{} vs {}", hs.kv_bytes, ps.kv_bytes);
    let q = synth.queries(2);
    let want = reference(&synth, &q);
    let budget = Budget::default().with_retrieve_floor(0).with_retrieve(0.05);
    let plan = |ctx| engine.plan(&[Request::new(ctx, 0, q.clone())], &budget).unwrap();
    let (pp, hp) = (plan(plain), plan(hack));
    let text = hp.explain();
    assert!(text.contains("hack2"), "{text}");
    let (pc, hc) = (&pp.requests[0].cost, &hp.requests[0].cost);
    assert!(hc.retrieve_tokens == pc.retrieve_tokens && hc.retrieve_bytes * 4 < pc.retrieve_bytes, "{text}");
    let (pe, he) = (rel_l2(&engine.execute(&pp).unwrap()[0], &want), rel_l2(&engine.execute(&hp).unwrap()[0], &want));
    let exact = rel_l2(&run(&engine, hack, &q, &Budget::full()), &want);
    // 2-bit keys lose most of a score's detail next to the generator's outlier channels, so
    // the bound is loose: it catches broken arithmetic (errors ≥ 1), not a 2-bit regression.
    assert!(he < 0.3 && exact < 0.3, "hack2: sparse {he} (f16 sparse {pe}), full budget {exact}");
    // Keys normalized per channel (hack2c) keep the outlier channels' detail: closer to exact,
    // for 4 more bytes per token and head; EXPLAIN gives the codec's bytes.
    let channel = Codec::Hack2(HackParams::default().with_keys(attnstore::KeyLayout::PerChannel));
    let hack_c =
        engine.create_context(ContextSpec::new(shape(), 2).with_method(small_wave()).with_codec(channel)).unwrap();
    engine.prefill(hack_c, 0, &synth.keys, &synth.values).unwrap();
    let text = plan(hack_c).explain();
    assert!(text.contains("hack2c (25.0 B per token and kv head, 0.195× f16)"), "{text}");
    let exact_c = rel_l2(&run(&engine, hack_c, &q, &Budget::full()), &want);
    assert!(exact_c < exact / 2.0, "full budget: hack2c {exact_c} vs hack2 {exact}");
    // Specs the codec cannot serve are typed errors.
    let hack2 = Codec::Hack2(HackParams::default());
    for bad in [
        ContextSpec::new(shape(), 1).with_codec(hack2).with_method(attnstore::Method::Flat),
        ContextSpec::new(shape(), 1).with_codec(hack2).with_dtype(DType::Bf16),
        ContextSpec::new(AttnShape::new(2, 1, 30).unwrap(), 1).with_codec(hack2),
    ] {
        assert!(matches!(engine.create_context(bad), Err(Error::InvalidSpec(_))));
    }
}
