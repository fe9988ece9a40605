//! PQ contexts whose base rows live in the engine's buffer manager: the same plans and
//! (within summation order) the same answers as rows kept in the index, decode tokens
//! encoded from keys read back out of the blocks, spill to Disk and read back, a typed error
//! and nothing changed when the tiers are full, blocks freed with their context, and a
//! durable engine that reopens into the buffer manager.

mod common;
use common::synth::{SynthContext, SynthParams};

use std::time::Duration;

use attnstore::{
    AttnShape, Budget, BufferSettings, Codec, ContextId, ContextSpec, DType, Engine, EngineConfig, Error, HackParams,
    Method, PqParams, Request, Strategy, Tier,
};
use attnstore_kernels::cpu::reference::rel_l2;

const TOKENS: usize = 4000;
const PREFILL: usize = 3600;

fn shape() -> AttnShape {
    AttnShape::new(8, 2, 32).unwrap()
}

fn spec(dtype: DType) -> ContextSpec {
    let pq = PqParams { min_build_tokens: 512, local_tokens: 64, background: false, ..PqParams::default() };
    ContextSpec::new(shape(), 1).with_dtype(dtype).with_method(Method::Pq(pq))
}

fn engine(buffers: Option<BufferSettings>) -> Engine {
    Engine::in_memory(EngineConfig { buffers, ..EngineConfig::default() }).unwrap()
}

/// No maintainer thread: tests drive maintenance themselves.
fn settings(host_blocks: usize) -> BufferSettings {
    BufferSettings { maintainer_idle: None, ..BufferSettings::new(host_blocks) }
}

/// A prefill, then decode appends: the base's last rows (the local window when the build
/// started) are encoded from keys read back out of the buffer manager.
fn load(engine: &Engine, synth: &SynthContext, spec: ContextSpec) -> ContextId {
    let ctx = engine.create_context(spec).unwrap();
    let (k, v) = synth.slice(0, PREFILL);
    engine.prefill(ctx, 0, &k, &v).unwrap();
    assert!(engine.wait_index(ctx, 0, Duration::from_secs(60)).unwrap());
    for at in (PREFILL..TOKENS).step_by(40) {
        let (k, v) = synth.slice(at, (at + 40).min(TOKENS));
        engine.append(ctx, 0, &k, &v).unwrap();
    }
    ctx
}

fn sparse() -> Budget {
    Budget::default().with_retrieve_floor(0).with_retrieve(0.05)
}

fn run(engine: &Engine, ctx: ContextId, q: &[f32], budget: &Budget) -> attnstore::Result<Vec<f32>> {
    let plan = engine.plan(&[Request::new(ctx, 0, q.to_vec())], budget)?;
    Ok(engine.execute(&plan)?.remove(0))
}

fn close(got: &[f32], want: &[f32], what: &str) {
    let want: Vec<f64> = want.iter().map(|&x| f64::from(x)).collect();
    let err = rel_l2(got, &want);
    assert!(err <= 1e-6, "{what}: {err}");
}

fn host_blocks(engine: &Engine) -> usize {
    engine.buffer_stats().unwrap().tier(Tier::Host).unwrap().used_blocks
}

#[test]
fn pq_rows_in_the_buffer_manager_give_the_plans_and_answers_of_rows_in_the_index() {
    let synth = SynthContext::generate(SynthParams::new(shape(), TOKENS, 21));
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        let (plain, buffered) = (engine(None), engine(Some(settings(8192))));
        let (a, b) = (load(&plain, &synth, spec(dtype)), load(&buffered, &synth, spec(dtype)));
        assert!(host_blocks(&buffered) > 0, "{dtype:?}: no block was stored");
        let (sa, sb) = (plain.stats(a, 0).unwrap(), buffered.stats(b, 0).unwrap());
        assert_eq!((sa.tokens, sa.indexed_tokens), (sb.tokens, sb.indexed_tokens), "{dtype:?}");
        assert_eq!(sb.indexed_tokens, TOKENS - 64 - PqParams::default().sink_tokens, "decode tokens were encoded");
        for step in 0..3 {
            let q = synth.queries(step);
            // The same codes, so the same tokens chosen.
            let pa = plain.plan(&[Request::new(a, 0, q.clone())], &sparse()).unwrap();
            let pb = buffered.plan(&[Request::new(b, 0, q.clone())], &sparse()).unwrap();
            assert!(matches!(pb.requests[0].strategy, Strategy::Sparse { .. }), "{}", pb.explain());
            for (ha, hb) in pa.requests[0].heads.iter().zip(&pb.requests[0].heads) {
                let spans =
                    |h: &attnstore_index::HeadPlan| h.selections.iter().map(|s| s.retrieve.clone()).collect::<Vec<_>>();
                assert_eq!(spans(ha), spans(hb), "{dtype:?} step {step}");
            }
            for budget in [Budget::full(), sparse()] {
                let want = run(&plain, a, &q, &budget).unwrap();
                let got = run(&buffered, b, &q, &budget).unwrap();
                close(&got, &want, &format!("{dtype:?} step {step} exact={}", budget.exact));
            }
        }
        // Sparse reads log their accesses: maintenance admits the retrieved blocks into the
        // Gpu tier and the answers do not change.
        let q = synth.queries(0);
        let first = run(&buffered, b, &q, &sparse()).unwrap();
        buffered.buffer_manager().unwrap().maintain(usize::MAX);
        assert_eq!(run(&buffered, b, &q, &sparse()).unwrap(), first);
        assert!(buffered.buffer_stats().unwrap().tier(Tier::Gpu).unwrap().used_blocks > 0, "{dtype:?}");
    }
}

#[test]
fn a_pq_context_larger_than_the_host_arena_spills_to_disk_and_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape(), TOKENS, 23));
    let small = BufferSettings { spill_dir: Some(dir.path().to_path_buf()), gpu_blocks: 0, ..settings(64) };
    let (plain, buffered) = (engine(None), engine(Some(small)));
    let (a, b) = (load(&plain, &synth, spec(DType::F16)), load(&buffered, &synth, spec(DType::F16)));
    let stats = buffered.buffer_stats().unwrap();
    assert_eq!(stats.tier(Tier::Host).unwrap().used_blocks, 64, "{stats}");
    assert!(stats.tier(Tier::Disk).unwrap().used_blocks > 64, "{stats}");
    for step in 0..2 {
        let q = synth.queries(step);
        for budget in [Budget::full(), sparse()] {
            close(&run(&buffered, b, &q, &budget).unwrap(), &run(&plain, a, &q, &budget).unwrap(), "spilled");
        }
    }
}

#[test]
fn a_full_arena_fails_the_batch_that_starts_the_build_and_changes_nothing() {
    let synth = SynthContext::generate(SynthParams::new(shape(), TOKENS, 25));
    let buffered = engine(Some(settings(16)));
    let ctx = buffered.create_context(spec(DType::F16)).unwrap();
    // Too few tokens for a build: nothing is homed yet.
    let (k, v) = synth.slice(0, 300);
    buffered.prefill(ctx, 0, &k, &v).unwrap();
    assert_eq!(host_blocks(&buffered), 0);
    // This batch starts the build, whose base does not fit 16 blocks.
    let (k, v) = synth.slice(300, PREFILL);
    let err = buffered.append(ctx, 0, &k, &v).unwrap_err();
    assert!(matches!(err, Error::Buffer(_)), "{err}");
    assert!(err.to_string().contains("full"), "{err}");
    assert_eq!(buffered.stats(ctx, 0).unwrap().tokens, 300);
    assert_eq!(host_blocks(&buffered), 0, "the pages stored before the failure were freed");
    // The context still answers exactly over what it holds.
    let q = synth.queries(0);
    let reference = engine(None);
    let other = reference.create_context(spec(DType::F16)).unwrap();
    let (k, v) = synth.slice(0, 300);
    reference.prefill(other, 0, &k, &v).unwrap();
    assert_eq!(run(&buffered, ctx, &q, &Budget::full()).unwrap(), run(&reference, other, &q, &Budget::full()).unwrap());
}

#[test]
fn dropping_a_pq_context_frees_its_blocks_and_hack2_pq_keeps_its_rows() {
    let synth = SynthContext::generate(SynthParams::new(shape(), TOKENS, 27));
    let buffered = engine(Some(settings(8192)));
    let a = load(&buffered, &synth, spec(DType::F16));
    let used = host_blocks(&buffered);
    assert!(used > 0);
    // A hack2 PQ index keeps its 2-bit rows in the index: no block.
    let hack = spec(DType::F16).with_codec(Codec::Hack2(HackParams::default()));
    let h = load(&buffered, &synth, hack);
    assert_eq!(host_blocks(&buffered), used);
    run(&buffered, h, &synth.queries(0), &sparse()).unwrap();
    buffered.drop_context(a).unwrap();
    assert_eq!(host_blocks(&buffered), 0);
}

#[test]
fn a_durable_pq_engine_reopens_its_base_into_the_buffer_manager() {
    let dir = tempfile::tempdir().unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape(), TOKENS, 29));
    let config = || EngineConfig { buffers: Some(settings(8192)), ..EngineConfig::default() };
    let q = synth.queries(2);
    let (ctx, before) = {
        let engine = Engine::open(dir.path(), config()).unwrap();
        let ctx = load(&engine, &synth, spec(DType::F16));
        engine.checkpoint().unwrap();
        (ctx, [run(&engine, ctx, &q, &sparse()).unwrap(), run(&engine, ctx, &q, &Budget::full()).unwrap()])
    };
    let engine = Engine::open(dir.path(), config()).unwrap();
    assert!(engine.wait_index(ctx, 0, Duration::from_secs(60)).unwrap());
    assert!(host_blocks(&engine) > 0, "the restored base is homed again");
    let after = [run(&engine, ctx, &q, &sparse()).unwrap(), run(&engine, ctx, &q, &Budget::full()).unwrap()];
    assert_eq!(after, before);
}
