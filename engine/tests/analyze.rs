//! EXPLAIN ANALYZE on the CPU path: the outputs of `execute`, and per zone the rows and
//! bytes the executor read, checked against counts made independently of the executor
//! (the method's exact positions, the planner's block lookups, the buffer manager's block
//! count), for rows in the index and rows homed in the buffer manager.

mod common;
use common::synth::{SynthContext, SynthParams};

use std::time::Duration;

use attnstore::{
    AttnShape, Budget, BufferSettings, ContextId, ContextSpec, DType, Engine, EngineConfig, Method, PqParams, Request,
    SelectionMode, Strategy, Tier, WaveParams,
};

const TOKENS: usize = 4000;

fn shape() -> AttnShape {
    AttnShape::new(8, 2, 32).unwrap()
}

fn wave() -> ContextSpec {
    let wave = WaveParams { segment_tokens: 1024, decode_segment_tokens: 256, ..WaveParams::default() };
    ContextSpec::new(shape(), 1).with_dtype(DType::F16).with_method(Method::Wave(wave))
}

fn pq() -> ContextSpec {
    let pq = PqParams { min_build_tokens: 512, local_tokens: 64, background: false, ..PqParams::default() };
    ContextSpec::new(shape(), 1).with_dtype(DType::F16).with_method(Method::Pq(pq))
}

fn engine(buffers: Option<BufferSettings>) -> Engine {
    Engine::in_memory(EngineConfig { buffers, ..EngineConfig::default() }).unwrap()
}

fn buffered() -> Engine {
    engine(Some(BufferSettings { maintainer_idle: None, ..BufferSettings::new(8192) }))
}

fn load(engine: &Engine, synth: &SynthContext, spec: ContextSpec) -> ContextId {
    let ctx = engine.create_context(spec).unwrap();
    let (k, v) = synth.slice(0, TOKENS - 300);
    engine.prefill(ctx, 0, &k, &v).unwrap();
    assert!(engine.wait_index(ctx, 0, Duration::from_secs(60)).unwrap());
    for at in (TOKENS - 300..TOKENS).step_by(50) {
        let (k, v) = synth.slice(at, at + 50);
        engine.append(ctx, 0, &k, &v).unwrap();
    }
    ctx
}

fn sparse(mode: SelectionMode) -> Budget {
    Budget::default().with_retrieve_floor(0).with_retrieve(0.05).with_mode(mode)
}

/// Rows attended exactly, counted from the method's exact positions: per selection, the
/// positions of its first query head (a selection's rows are read once for its heads).
fn exact_rows(engine: &Engine, plan: &attnstore::Plan) -> u64 {
    let r = &plan.requests[0];
    let g = r.shape.group();
    if matches!(r.strategy, Strategy::Exact { .. }) {
        return (r.tokens * r.shape.kv_heads) as u64;
    }
    let mut rows = 0;
    for (h, head) in r.heads.iter().enumerate() {
        let steady = head.steady_tokens as u64;
        for sel in &head.selections {
            let positions = engine.exact_positions(plan, 0, h * g + sel.first_head).unwrap();
            rows += positions.len() as u64 - steady;
        }
        rows += steady;
    }
    rows
}

#[test]
fn analyze_gives_the_outputs_of_execute_and_counts_what_each_zone_read() {
    let synth = SynthContext::generate(SynthParams::new(shape(), TOKENS, 41));
    let row_bytes = 2 * 32 * 2; // K and V rows of d = 32 in f16
    for spec in [wave(), pq()] {
        let e = engine(None);
        let ctx = load(&e, &synth, spec.clone());
        for budget in [Budget::full(), sparse(SelectionMode::PerKvHead), sparse(SelectionMode::PerQueryHead)] {
            let what = format!("{} {:?} exact={}", spec.method.name(), budget.mode, budget.exact);
            let plan = e.plan(&[Request::new(ctx, 0, synth.queries(1))], &budget).unwrap();
            let (out, a) = e.execute_analyze(&plan).unwrap();
            assert_eq!(out, e.execute(&plan).unwrap(), "{what}");
            let got = &a.requests[0];
            assert_eq!(got.exact_rows(), exact_rows(&e, &plan), "{what}");
            // Rows in the index's memory: every byte read is a K and a V row.
            assert_eq!(
                got.steady.index_bytes + got.scan.index_bytes + got.retrieve.index_bytes,
                got.exact_rows() * row_bytes,
                "{what}"
            );
            assert_eq!(got.retrieve.blocks, [0; 3], "{what}: nothing is homed");
            let planned = attnstore::PlannedRows::of(&plan.requests[0]).unwrap();
            assert_eq!(
                (planned.steady, planned.retrieve),
                (got.steady.rows + got.scan.rows, got.retrieve.rows),
                "{what}"
            );
            assert_eq!(planned.estimate, got.estimate.rows, "{what}");
            if !budget.exact && spec.method.name() == "wave" {
                assert!(got.estimate.rows > 0 && got.retrieve.rows > 0, "{what}");
            }
            // The JSON form carries the same counts.
            let json = serde_json::to_value(&a).unwrap();
            let z = &json["requests"][0]["retrieve"];
            assert_eq!(z["rows"].as_u64(), Some(got.retrieve.rows), "{json}");
            assert_eq!(z["index_bytes"].as_u64(), Some(got.retrieve.index_bytes), "{json}");
            assert!(z["cpu_us"].as_f64().is_some() && json["wall_us"].as_f64().unwrap() > 0.0, "{json}");
            let text = a.explain(&plan);
            assert!(text.starts_with("EXPLAIN ANALYZE"), "{text}");
            assert_eq!(plan.to_string(), plan.explain(), "Display is the plan tree");
            assert!(text.contains(&format!("actual {:>9}", got.retrieve.rows)), "{text}");
        }
    }
}

#[test]
fn analyze_counts_the_blocks_pinned_from_each_tier() {
    let synth = SynthContext::generate(SynthParams::new(shape(), TOKENS, 43));
    let e = buffered();
    let ctx = load(&e, &synth, wave());
    let stored = e.buffer_stats().unwrap().tier(Tier::Host).unwrap().used_blocks as u64;
    let block = e.buffer_manager().unwrap().layout().block_bytes() as u64;
    // A sparse plan pins exactly the blocks the planner looked up, from the tiers it saw.
    let plan = e.plan(&[Request::new(ctx, 0, synth.queries(2))], &sparse(SelectionMode::PerKvHead)).unwrap();
    let recorded: usize = plan.requests[0].blocks.iter().flatten().map(Vec::len).sum();
    let (out, a) = e.execute_analyze(&plan).unwrap();
    assert_eq!(out, e.execute(&plan).unwrap());
    let got = &a.requests[0];
    assert_eq!(got.retrieve.blocks.iter().sum::<u64>(), recorded as u64);
    assert_eq!(got.retrieve.blocks, plan.requests[0].cost.tier_blocks.map(|b| b as u64));
    assert_eq!(got.retrieve.block_bytes.iter().sum::<u64>(), recorded as u64 * block);
    assert_eq!(got.retrieve.index_bytes, 0, "retrieved rows come from blocks");
    assert_eq!(got.exact_rows(), exact_rows(&e, &plan));
    assert!(a.explain(&plan).contains("retrieve blocks planned (looked up)"));
    // An exact plan scans every stored block once, and counts the steady zone's rows apart.
    let plan = e.plan(&[Request::new(ctx, 0, synth.queries(2))], &Budget::full()).unwrap();
    let (_, a) = e.execute_analyze(&plan).unwrap();
    let got = &a.requests[0];
    assert_eq!(got.steady.blocks.iter().sum::<u64>() + got.scan.blocks.iter().sum::<u64>(), stored);
    assert_eq!(got.exact_rows(), (TOKENS * 2) as u64);
    // A PQ context's retrieved tokens come from its pages' blocks.
    let p = load(&e, &synth, pq());
    let plan = e.plan(&[Request::new(p, 0, synth.queries(2))], &sparse(SelectionMode::PerKvHead)).unwrap();
    let (out, a) = e.execute_analyze(&plan).unwrap();
    assert_eq!(out, e.execute(&plan).unwrap());
    let got = &a.requests[0];
    assert_eq!(got.exact_rows(), exact_rows(&e, &plan));
    let tokens = got.retrieve.rows;
    let pinned = got.retrieve.blocks.iter().sum::<u64>();
    assert!(pinned > 0 && pinned <= tokens, "{pinned} blocks for {tokens} tokens");
    assert_eq!(got.retrieve.block_bytes.iter().sum::<u64>(), pinned * block);
}

#[test]
fn analyze_counts_disk_blocks_of_a_spilled_context_and_works_after_a_durable_reopen() {
    let synth = SynthContext::generate(SynthParams::new(shape(), TOKENS, 47));
    let dir = tempfile::tempdir().unwrap();
    let spill = tempfile::tempdir().unwrap();
    let settings = BufferSettings {
        maintainer_idle: None,
        gpu_blocks: 0,
        spill_dir: Some(spill.path().to_path_buf()),
        ..BufferSettings::new(64)
    };
    let config = || EngineConfig { buffers: Some(settings.clone()), ..EngineConfig::default() };
    let q = synth.queries(3);
    let (ctx, before) = {
        let e = Engine::open(dir.path(), config()).unwrap();
        let ctx = load(&e, &synth, wave());
        e.checkpoint().unwrap();
        let plan = e.plan(&[Request::new(ctx, 0, q.clone())], &sparse(SelectionMode::PerKvHead)).unwrap();
        (ctx, e.execute(&plan).unwrap())
    };
    let e = Engine::open(dir.path(), config()).unwrap();
    let disk = e.buffer_stats().unwrap().tier(Tier::Disk).unwrap().used_blocks;
    assert!(disk > 0, "the reopened context spills past 64 Host blocks");
    let plan = e.plan(&[Request::new(ctx, 0, q.clone())], &sparse(SelectionMode::PerKvHead)).unwrap();
    let (out, a) = e.execute_analyze(&plan).unwrap();
    assert_eq!(out, before, "the same answer after the reopen");
    let got = &a.requests[0];
    assert_eq!(got.exact_rows(), exact_rows(&e, &plan));
    let recorded: usize = plan.requests[0].blocks.iter().flatten().map(Vec::len).sum();
    assert_eq!(got.retrieve.blocks.iter().sum::<u64>(), recorded as u64);
    assert!(got.retrieve.blocks[2] > 0, "some retrieved blocks are read from Disk: {got:?}");
    // An exact plan scans every stored block once, from Host and Disk.
    let stored: u64 = e.buffer_stats().unwrap().tiers.iter().map(|t| t.used_blocks as u64).sum();
    let plan = e.plan(&[Request::new(ctx, 0, q)], &Budget::full()).unwrap();
    let (_, a) = e.execute_analyze(&plan).unwrap();
    let got = &a.requests[0];
    let scanned: [u64; 3] = std::array::from_fn(|t| got.steady.blocks[t] + got.scan.blocks[t]);
    assert_eq!(scanned.iter().sum::<u64>(), stored, "{scanned:?}");
    assert!(scanned[2] > 0 && scanned[0] == 0, "{scanned:?}");
}
