//! Wave contexts whose indexed rows live in the engine's buffer manager: the same answers as
//! rows kept in the index, plans that record each retrieved block's tier, spill to Disk and
//! read back, typed errors for full tiers and corrupt blocks, and blocks freed with their
//! context.

mod common;
use common::synth::{SynthContext, SynthParams};

use attnstore::{
    AttnShape, Budget, BufferSettings, ContextId, ContextSpec, DType, Engine, EngineConfig, Error, Request, Tier,
    WaveParams,
};
use attnstore_kernels::cpu::reference::rel_l2;

fn shape() -> AttnShape {
    AttnShape::new(8, 2, 32).unwrap()
}

fn spec(dtype: DType) -> ContextSpec {
    let wave = WaveParams { segment_tokens: 1024, decode_segment_tokens: 256, ..WaveParams::default() };
    ContextSpec::new(shape(), 1).with_dtype(dtype).with_method(attnstore::Method::Wave(wave))
}

fn engine(buffers: Option<BufferSettings>) -> Engine {
    Engine::in_memory(EngineConfig { buffers, ..EngineConfig::default() }).unwrap()
}

/// No maintainer thread: tests drive maintenance themselves, so results do not depend on timing.
fn settings(host_blocks: usize) -> BufferSettings {
    BufferSettings { maintainer_idle: None, ..BufferSettings::new(host_blocks) }
}

fn load(engine: &Engine, synth: &SynthContext, dtype: DType) -> ContextId {
    let ctx = engine.create_context(spec(dtype)).unwrap();
    let split = synth.params.tokens - 300;
    let (k, v) = synth.slice(0, split);
    engine.prefill(ctx, 0, &k, &v).unwrap();
    // Decode appends: pending tokens become a decode segment that is homed in blocks too.
    for at in (split..synth.params.tokens).step_by(50) {
        let (k, v) = synth.slice(at, (at + 50).min(synth.params.tokens));
        engine.append(ctx, 0, &k, &v).unwrap();
    }
    ctx
}

fn run(engine: &Engine, ctx: ContextId, q: &[f32], budget: &Budget) -> attnstore::Result<Vec<f32>> {
    let plan = engine.plan(&[Request::new(ctx, 0, q.to_vec())], budget)?;
    Ok(engine.execute(&plan)?.remove(0))
}

fn sparse() -> Budget {
    Budget::default().with_retrieve_floor(0).with_retrieve(0.05)
}

#[test]
fn rows_in_the_buffer_manager_give_the_answers_of_rows_in_the_index() {
    let synth = SynthContext::generate(SynthParams::new(shape(), 4000, 3));
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        let plain = engine(None);
        let buffered = engine(Some(settings(4096)));
        let (a, b) = (load(&plain, &synth, dtype), load(&buffered, &synth, dtype));
        assert_eq!(plain.stats(a, 0).unwrap().segments, buffered.stats(b, 0).unwrap().segments);
        let host = buffered.buffer_stats().unwrap().tier(Tier::Host).unwrap().used_blocks;
        assert!(host > 0, "{dtype:?}: no block was stored");
        for step in 0..3 {
            let q = synth.queries(step);
            for budget in [Budget::full(), sparse()] {
                let want = run(&plain, a, &q, &budget).unwrap();
                let got = run(&buffered, b, &q, &budget).unwrap();
                let want64: Vec<f64> = want.iter().map(|&x| f64::from(x)).collect();
                let err = rel_l2(&got, &want64);
                assert!(err <= 1e-6, "{dtype:?} step {step} exact={}: {err}", budget.exact);
            }
        }
    }
}

#[test]
fn plans_record_each_retrieved_blocks_tier_and_explain_shows_them() {
    let synth = SynthContext::generate(SynthParams::new(shape(), 4000, 5));
    let buffered = engine(Some(settings(4096)));
    let ctx = load(&buffered, &synth, DType::F16);
    let q = synth.queries(0);
    let plan = buffered.plan(&[Request::new(ctx, 0, q.clone())], &sparse()).unwrap();
    let r = &plan.requests[0];
    let blocks: usize = r.blocks.iter().flatten().map(Vec::len).sum();
    assert!(blocks > 0 && r.cost.buffered);
    assert_eq!(r.cost.retrieve_blocks, blocks);
    assert_eq!(r.cost.tier_blocks, [0, blocks, 0], "nothing admitted yet: every block is served by Host");
    let text = plan.explain();
    assert!(text.contains(&format!("blocks gpu 0 host {blocks} disk 0 (looked up)")), "{text}");
    // Each selection's block list holds the blocks of every retrieved cluster.
    for (sel, blocks) in r.heads.iter().flat_map(|h| &h.selections).zip(r.blocks.iter().flatten()) {
        assert!(blocks.len() >= sel.retrieve_ids.len());
        assert!(sel.retrieve_ids.windows(2).all(|w| w[0] < w[1]));
    }
    // After the plan's reads are maintained, its blocks are admitted into the Gpu tier, and
    // the next plan's lookups say so (and the answer does not change).
    let first = buffered.execute(&plan).unwrap().remove(0);
    buffered.buffer_manager().unwrap().maintain(usize::MAX);
    let again = buffered.plan(&[Request::new(ctx, 0, q)], &sparse()).unwrap();
    assert!(again.requests[0].cost.tier_blocks[0] > 0, "{}", again.explain());
    assert!(again.requests[0].cost.tier_bytes[0] > 0);
    assert_eq!(buffered.execute(&again).unwrap().remove(0), first);
    let stats = buffered.buffer_stats().unwrap();
    assert!(stats.tier(Tier::Gpu).unwrap().hits > 0, "{stats}");
}

#[test]
fn a_context_larger_than_the_host_arena_spills_to_disk_and_reads_back_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape(), 3000, 9));
    let plain = engine(None);
    let small = BufferSettings { spill_dir: Some(dir.path().to_path_buf()), gpu_blocks: 0, ..settings(64) };
    let buffered = engine(Some(small));
    let (a, b) = (load(&plain, &synth, DType::F16), load(&buffered, &synth, DType::F16));
    let stats = buffered.buffer_stats().unwrap();
    assert_eq!(stats.tier(Tier::Host).unwrap().used_blocks, 64, "{stats}");
    assert!(stats.tier(Tier::Disk).unwrap().used_blocks > 64, "{stats}");
    for step in 0..2 {
        let q = synth.queries(step);
        for budget in [Budget::full(), sparse()] {
            let want: Vec<f64> = run(&plain, a, &q, &budget).unwrap().iter().map(|&x| f64::from(x)).collect();
            let err = rel_l2(&run(&buffered, b, &q, &budget).unwrap(), &want);
            assert!(err <= 1e-6, "step {step}: {err}");
        }
    }
    let plan = buffered.plan(&[Request::new(b, 0, synth.queries(0))], &sparse()).unwrap();
    assert!(plan.requests[0].cost.tier_blocks[2] > 0, "{}", plan.explain());
    assert!(plan.requests[0].cost.tier_bytes[2] > 0);
}

#[test]
fn a_full_arena_without_a_spill_folder_is_a_typed_error_and_changes_nothing() {
    let synth = SynthContext::generate(SynthParams::new(shape(), 3000, 11));
    let buffered = engine(Some(settings(16)));
    let ctx = buffered.create_context(spec(DType::F16)).unwrap();
    let err = buffered.prefill(ctx, 0, &synth.keys, &synth.values).unwrap_err();
    assert!(matches!(err, Error::Buffer(_)), "{err}");
    assert!(err.to_string().contains("full"), "{err}");
    assert_eq!(buffered.stats(ctx, 0).unwrap().tokens, 0);
    assert_eq!(buffered.buffer_stats().unwrap().tier(Tier::Host).unwrap().used_blocks, 0);
    // A prefill that fits still works afterwards.
    let (k, v) = synth.slice(0, 200);
    buffered.prefill(ctx, 0, &k, &v).unwrap();
    assert_eq!(buffered.stats(ctx, 0).unwrap().tokens, 200);
}

#[test]
fn a_corrupt_spilled_block_is_reported_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape(), 3000, 13));
    let small = BufferSettings { spill_dir: Some(dir.path().to_path_buf()), gpu_blocks: 0, ..settings(8) };
    let buffered = engine(Some(small));
    let ctx = load(&buffered, &synth, DType::F16);
    let q = synth.queries(0);
    let plan = buffered.plan(&[Request::new(ctx, 0, q.clone())], &sparse()).unwrap();
    let manager = buffered.buffer_manager().unwrap();
    let on_disk = plan.requests[0]
        .blocks
        .iter()
        .flatten()
        .flatten()
        .find(|l| l.tier() == Tier::Disk)
        .expect("a retrieved block on disk");
    let (path, offset) = manager.disk_location(on_disk.block()).unwrap().unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[offset as usize + 17] ^= 0x10;
    std::fs::write(&path, bytes).unwrap();
    let err = buffered.execute(&plan).unwrap_err();
    assert!(err.to_string().contains("corrupt") || err.to_string().contains("crc"), "{err}");
    // The lost block stays reported on later reads; exact plans hit it too.
    assert!(run(&buffered, ctx, &q, &Budget::full()).is_err());
    assert!(buffered.buffer_stats().unwrap().tier(Tier::Disk).unwrap().failures > 0);
}

#[test]
fn dropping_a_context_frees_its_blocks() {
    let synth = SynthContext::generate(SynthParams::new(shape(), 3000, 17));
    let buffered = engine(Some(settings(4096)));
    let a = load(&buffered, &synth, DType::F16);
    let used = buffered.buffer_stats().unwrap().tier(Tier::Host).unwrap().used_blocks;
    let b = load(&buffered, &synth, DType::F16);
    assert_eq!(buffered.buffer_stats().unwrap().tier(Tier::Host).unwrap().used_blocks, 2 * used);
    buffered.drop_context(a).unwrap();
    assert_eq!(buffered.buffer_stats().unwrap().tier(Tier::Host).unwrap().used_blocks, used);
    // The other context still answers.
    run(&buffered, b, &synth.queries(0), &sparse()).unwrap();
    buffered.drop_context(b).unwrap();
    assert_eq!(buffered.buffer_stats().unwrap().tier(Tier::Host).unwrap().used_blocks, 0);
}

#[test]
fn a_block_that_does_not_hold_one_row_is_a_typed_error() {
    let config = EngineConfig {
        block: attnstore_buffer::BlockLayout::new(512).unwrap(),
        buffers: Some(settings(64)),
        ..EngineConfig::default()
    };
    let engine = Engine::in_memory(config).unwrap();
    let wide = AttnShape::new(2, 1, 256).unwrap();
    let err = engine.create_context(ContextSpec::new(wide, 1).with_dtype(DType::F32)).unwrap_err();
    assert!(err.to_string().contains("must fit one block"), "{err}");
}

#[test]
fn device_selected_plans_leave_the_choice_to_the_gpu_and_run_on_the_cpu_as_the_same_zones() {
    let synth = SynthContext::generate(SynthParams::new(shape(), 4000, 9));
    let buffered = engine(Some(settings(4096)));
    let ctx = load(&buffered, &synth, DType::F16);
    let q = synth.queries(1);
    let request = [Request::new(ctx, 0, q.clone())];
    let plan = buffered.plan_gpu(&request, &sparse()).unwrap();
    let r = &plan.requests[0];
    let dev = r.device.expect("an f16 wave context homed in the buffer manager is planned for the device");
    let stats = buffered.stats(ctx, 0).unwrap();
    assert_eq!((dev.clusters, dev.indexed_tokens), (stats.clusters, stats.indexed_tokens));
    assert!(dev.clusters_per_head >= 1 && dev.clusters_per_head < dev.clusters, "{dev:?}");
    assert!(r.heads.iter().all(|h| h.selections.is_empty()), "nothing is selected at planning time");
    let text = plan.explain();
    assert!(text.contains("chosen on the GPU"), "{text}");
    assert!(text.contains(&format!("top {} of {}", dev.clusters_per_head, dev.clusters)), "{text}");
    // The CPU executor runs it as the same zones chosen on the CPU: the retrieval zone's
    // tokens attended exactly and every other cluster estimated.
    let same = Budget::default()
        .with_retrieve(1e-9)
        .with_retrieve_floor(dev.retrieve_tokens)
        .with_estimate(attnstore::EstimateShare::Rest);
    let want = run(&buffered, ctx, &q, &same).unwrap();
    let got = buffered.execute(&plan).unwrap().remove(0);
    assert_eq!(got, want);
    let exact = run(&buffered, ctx, &q, &Budget::full()).unwrap();
    let err = rel_l2(&got, &exact.iter().map(|&x| f64::from(x)).collect::<Vec<_>>());
    assert!(err < 0.5, "a sparse answer near exact: {err}");
    assert!(r.host_planned.is_none());
    // Where the device cannot read rows in place, plan_gpu plans like plan, and says why.
    let per_query_head = sparse().with_mode(attnstore::SelectionMode::PerQueryHead);
    for (e, dtype, budget, why) in [
        (engine(None), DType::F16, sparse(), "no buffer manager"),
        (engine(Some(settings(4096))), DType::F32, sparse(), "f32 rows"),
        (engine(Some(settings(4096))), DType::F16, per_query_head, "one selection per query head"),
    ] {
        let c = load(&e, &synth, dtype);
        let mut p = e.plan_gpu(&[Request::new(c, 0, q.clone())], &budget).unwrap();
        assert!(p.requests[0].device.is_none());
        let reason = p.requests[0].host_planned.clone().expect("a sparse request planned on the host says why");
        assert!(reason.starts_with(why), "{reason}");
        let text = p.explain();
        assert!(text.contains(&format!("planned on the host, not the device: {reason}")), "{text}");
        p.requests[0].host_planned = None;
        assert_eq!(p, e.plan(&[Request::new(c, 0, q.clone())], &budget).unwrap());
    }
    // So does a full budget, whose exact strategy gives the reason.
    let full = buffered.plan_gpu(&request, &Budget::full()).unwrap();
    assert!(full.requests[0].device.is_none() && full.requests[0].host_planned.is_none());
    // plan never names a reason: it plans on the host by definition.
    assert!(buffered.plan(&request, &sparse()).unwrap().requests[0].host_planned.is_none());
}

/// A wave context whose segments are stored in 2-bit form (`hack2`).
fn hack2_spec() -> ContextSpec {
    spec(DType::F16).with_codec(attnstore::Codec::Hack2(attnstore::HackParams::default()))
}

#[test]
fn hack2_rows_live_in_the_buffer_manager_in_2_bit_form_and_give_the_answers_of_rows_in_the_index() {
    let dir = tempfile::tempdir().unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape(), 4000, 11));
    let feed = |engine: &Engine, spec: ContextSpec| {
        let ctx = engine.create_context(spec).unwrap();
        let (k, v) = synth.slice(0, 3700);
        engine.prefill(ctx, 0, &k, &v).unwrap();
        for at in (3700..4000).step_by(50) {
            let (k, v) = synth.slice(at, at + 50);
            engine.append(ctx, 0, &k, &v).unwrap();
        }
        ctx
    };
    let plain = engine(None);
    let a = feed(&plain, hack2_spec());
    let f16 = engine(Some(settings(4096)));
    feed(&f16, spec(DType::F16));
    let f16_blocks = f16.buffer_stats().unwrap().tier(Tier::Host).unwrap().used_blocks;
    // In a Host arena, and spilled to Disk from a small one.
    let spilling = BufferSettings { spill_dir: Some(dir.path().to_path_buf()), gpu_blocks: 0, ..settings(64) };
    for settings in [settings(4096), spilling] {
        let buffered = engine(Some(settings));
        let b = feed(&buffered, hack2_spec());
        assert_eq!(plain.stats(a, 0).unwrap().segments, buffered.stats(b, 0).unwrap().segments);
        let stats = buffered.buffer_stats().unwrap();
        let blocks = |stats: &attnstore::BufferStats, tier| stats.tier(tier).map_or(0, |t| t.used_blocks);
        let used = blocks(&stats, Tier::Host) + blocks(&stats, Tier::Disk);
        // The tiers hold 2-bit bytes: about 0.16 of f16's (2 KiB blocks, padded per value block).
        let ratio = used as f64 / f16_blocks as f64;
        assert!((0.1..0.3).contains(&ratio), "{used} blocks for hack2, {f16_blocks} for f16: {ratio}");
        for step in 0..3 {
            let q = synth.queries(step);
            for budget in [Budget::full(), sparse()] {
                let want = run(&plain, a, &q, &budget).unwrap();
                let got = run(&buffered, b, &q, &budget).unwrap();
                assert_eq!(got, want, "step {step} exact={}", budget.exact);
            }
        }
        // Dropping the context frees its blocks.
        buffered.drop_context(b).unwrap();
        let stats = buffered.buffer_stats().unwrap();
        let left = blocks(&stats, Tier::Host) + blocks(&stats, Tier::Disk);
        assert_eq!(left, 0, "{stats}");
    }
}

#[test]
fn hack2_plans_leave_the_choice_to_the_gpu_where_its_kernels_read_the_rows() {
    let buffered = engine(Some(settings(4096)));
    let wave = WaveParams { segment_tokens: 1024, decode_segment_tokens: 256, ..WaveParams::default() };
    let per_token = attnstore::Codec::Hack2(attnstore::HackParams::default());
    let per_channel =
        attnstore::Codec::Hack2(attnstore::HackParams::default().with_keys(attnstore::KeyLayout::PerChannel));
    let plan_of = |shape: AttnShape, codec| {
        let synth = SynthContext::generate(SynthParams::new(shape, 3000, 13));
        let spec = ContextSpec::new(shape, 1).with_method(attnstore::Method::Wave(wave)).with_codec(codec);
        let ctx = buffered.create_context(spec).unwrap();
        engine_prefill(&buffered, ctx, &synth);
        let q = synth.queries(0);
        let plan = buffered.plan_gpu(&[Request::new(ctx, 0, q.clone())], &sparse()).unwrap();
        (plan, ctx, q)
    };
    // HACK's per-token keys of a head dimension that is a multiple of 64: the device step.
    let (plan, ctx, q) = plan_of(AttnShape::new(8, 2, 64).unwrap(), per_token);
    let dev = plan.requests[0].device.expect("hack2 rows homed in the buffer manager go to the device");
    assert!(plan.explain().contains("chosen on the GPU"), "{}", plan.explain());
    assert!(dev.clusters_per_head >= 1 && dev.clusters_per_head < dev.clusters, "{dev:?}");
    // Without a GPU it runs on the CPU (the same zones chosen there): as near exact as the
    // host-planned sparse plan of the same budget.
    let exact = run(&buffered, ctx, &q, &Budget::full()).unwrap();
    let err = |x: &[f32]| rel_l2(x, &exact.iter().map(|&x| f64::from(x)).collect::<Vec<_>>());
    let device = err(&buffered.execute(&plan).unwrap().remove(0));
    let host = err(&run(&buffered, ctx, &q, &sparse()).unwrap());
    assert!(device <= 1.25 * host + 0.02, "device-selected {device}, host-planned {host}");
    // Per-channel keys, or a head dimension the kernels do not take: planned on the host.
    for (shape, codec) in [(AttnShape::new(8, 2, 64).unwrap(), per_channel), (shape(), per_token)] {
        let (plan, _, _) = plan_of(shape, codec);
        assert!(plan.requests[0].device.is_none(), "{codec:?} at d = {}", shape.head_dim);
    }
}

fn engine_prefill(engine: &Engine, ctx: ContextId, synth: &SynthContext) {
    let (k, v) = synth.slice(0, synth.params.tokens);
    engine.prefill(ctx, 0, &k, &v).unwrap();
}

/// Timing probe (run by hand: `cargo test --release -p attnstore --test buffers
/// plan_gpu_host_time -- --ignored --nocapture`): the host time of `plan_gpu` for one request
/// and of `Engine::stats` (which the planner and the device executor each ask for per
/// request) over a 64K-token context of f16 and of `hack2` rows. Prints, asserts nothing.
#[test]
#[ignore = "timing probe"]
fn plan_gpu_host_time_probe() {
    let shape = AttnShape::new(32, 8, 128).unwrap();
    let tokens = 65536;
    let synth = SynthContext::generate(SynthParams::new(shape, tokens, 3));
    for codec in [attnstore::Codec::F16, attnstore::Codec::Hack2(attnstore::HackParams::default())] {
        let host_blocks = common::blocks_for_context(&shape, DType::F16, tokens, 2048);
        let engine = engine(Some(settings(host_blocks)));
        let ctx = engine.create_context(ContextSpec::new(shape, 1).with_codec(codec)).unwrap();
        engine.prefill(ctx, 0, &synth.keys, &synth.values).unwrap();
        let request = [Request::new(ctx, 0, synth.queries(0))];
        for _ in 0..3 {
            let t = std::time::Instant::now();
            for _ in 0..2000 {
                assert!(engine.plan_gpu(&request, &Budget::default()).unwrap().requests[0].device.is_some());
            }
            let plan = t.elapsed().as_secs_f64() * 1e6 / 2000.0;
            let t = std::time::Instant::now();
            for _ in 0..2000 {
                engine.stats(ctx, 0).unwrap();
            }
            let stats = t.elapsed().as_secs_f64() * 1e6 / 2000.0;
            println!("{codec}: plan_gpu {plan:.1} us per request, stats {stats:.1} us");
        }
    }
}
