//! Pipelined durable appends (`Engine::submit_append` + `Engine::wait_durable`): many
//! batches in flight share fsyncs, every acknowledged batch is recovered byte-exact with
//! the same attention, a failed fsync fails the wait (never a silent acknowledgement), and
//! a ticket the log never handed out is a typed error.

mod common;
use common::synth::{SynthContext, SynthParams};

use std::collections::VecDeque;
use std::sync::Arc;

use attnstore::{
    AttnShape, Budget, ContextId, ContextSpec, DurableConfig, Engine, EngineConfig, Error, Method, Request,
};
use attnstore_wal::FaultyStorage;

const THREADS: usize = 4;
const BATCHES: usize = 60;
const IN_FLIGHT: usize = 8;

fn shape() -> AttnShape {
    AttnShape::new(4, 2, 16).unwrap()
}

fn spec(t: usize) -> ContextSpec {
    let method = if t.is_multiple_of(2) { Method::default() } else { Method::Flat };
    ContextSpec::new(shape(), 1).with_method(method)
}

/// Batch `i` (1..=5 tokens) of a context: tokens `from..to` of its synthetic KV.
fn span(i: usize) -> (usize, usize) {
    let from: usize = (0..i).map(|j| 1 + j % 5).sum();
    (from, from + 1 + i % 5)
}

fn attention(engine: &Engine, ctx: ContextId, synth: &SynthContext) -> Vec<Vec<f32>> {
    [Budget::full(), Budget::default().with_retrieve_floor(8).with_retrieve(0.2)]
        .iter()
        .map(|budget| {
            let plan = engine.plan(&[Request::new(ctx, 0, synth.queries(2))], budget).unwrap();
            engine.execute(&plan).unwrap().remove(0)
        })
        .collect()
}

#[test]
fn pipelined_appends_share_fsyncs_and_every_acknowledged_batch_is_recovered() {
    let dir = tempfile::tempdir().unwrap();
    let synth: Vec<SynthContext> =
        (0..THREADS).map(|t| SynthContext::generate(SynthParams::new(shape(), span(BATCHES).1, t as u64))).collect();
    let (contexts, before) = {
        let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
        let contexts: Vec<ContextId> = (0..THREADS).map(|t| engine.create_context(spec(t)).unwrap()).collect();
        let syncs_before = engine.wal_stats().unwrap().syncs;
        std::thread::scope(|s| {
            for (t, &ctx) in contexts.iter().enumerate() {
                let (engine, synth) = (&engine, &synth[t]);
                s.spawn(move || {
                    let mut inflight = VecDeque::new();
                    for i in 0..BATCHES {
                        let (from, to) = span(i);
                        let (k, v) = synth.slice(from, to);
                        inflight.push_back(engine.submit_append(ctx, 0, &k, &v).unwrap());
                        // Visible at once, before it is acknowledged.
                        assert_eq!(engine.stats(ctx, 0).unwrap().tokens, to);
                        if inflight.len() > IN_FLIGHT {
                            engine.wait_durable(inflight.pop_front().unwrap()).unwrap();
                        }
                    }
                    engine.wait_durable(inflight.pop_back().unwrap()).unwrap();
                });
            }
        });
        let syncs = engine.wal_stats().unwrap().syncs - syncs_before;
        assert!(syncs < (THREADS * BATCHES) as u64 / 2, "{syncs} fsyncs for {} batches", THREADS * BATCHES);
        let before: Vec<_> = contexts.iter().enumerate().map(|(t, &c)| attention(&engine, c, &synth[t])).collect();
        (contexts, before)
    };
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    for (t, &ctx) in contexts.iter().enumerate() {
        let stored = engine.stored_batches(ctx, 0).unwrap();
        assert_eq!(stored.len(), BATCHES, "thread {t}");
        for (i, b) in stored.iter().enumerate() {
            let (from, to) = span(i);
            let (k, _) = synth[t].slice(from, to);
            let f16 = |x: &[f32]| x.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect::<Vec<_>>();
            assert_eq!((b.tokens, &b.keys), (to - from, &f16(&k)), "thread {t} batch {i}");
        }
        assert_eq!(attention(&engine, ctx, &synth[t]), before[t], "thread {t}");
    }
}

#[test]
fn a_failed_fsync_fails_the_wait_and_a_foreign_ticket_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape(), 100, 7));
    let storage = FaultyStorage::new();
    let config = DurableConfig { storage: Arc::new(storage.clone()), ..DurableConfig::default() };
    let engine = Engine::open_with(dir.path(), EngineConfig::default(), config).unwrap();
    let ctx = engine.create_context(spec(1)).unwrap();
    let (k, v) = synth.slice(0, 10);
    let first = engine.submit_append(ctx, 0, &k, &v).unwrap();
    engine.wait_durable(first).unwrap();
    // A ticket of a busier engine names a record this log never handed out.
    let other_dir = tempfile::tempdir().unwrap();
    let other = Engine::open(other_dir.path(), EngineConfig::default()).unwrap();
    let octx = other.create_context(spec(1)).unwrap();
    let mut foreign = None;
    for _ in 0..20 {
        foreign = Some(other.submit_append(octx, 0, &k, &v).unwrap());
    }
    let err = engine.wait_durable(foreign.unwrap()).unwrap_err();
    assert!(matches!(err, Error::Wal(attnstore_wal::Error::UnknownLsn { .. })), "{err}");
    // A failing fsync: the submit succeeds (nothing synced yet), the wait reports it, and
    // the engine refuses further durable writes.
    storage.fail_syncs(true);
    let (k, v) = synth.slice(10, 12);
    let ticket = engine.submit_append(ctx, 0, &k, &v).unwrap();
    assert!(engine.wait_durable(ticket).is_err());
    assert!(engine.append(ctx, 0, &k, &v).is_err());
    // In memory the submitted batch is visible, as documented; on disk only the first one.
    assert_eq!(engine.stats(ctx, 0).unwrap().tokens, 12);
    drop(engine);
    let engine = Engine::open(dir.path(), EngineConfig::default()).unwrap();
    assert!(engine.stats(ctx, 0).unwrap().tokens >= 10);
    // An in-memory engine acknowledges at once.
    let memory = Engine::in_memory(EngineConfig::default()).unwrap();
    let mctx = memory.create_context(spec(1)).unwrap();
    let ticket = memory.submit_append(mctx, 0, &k, &v).unwrap();
    assert_eq!(ticket.lsn(), None);
    memory.wait_durable(ticket).unwrap();
}
