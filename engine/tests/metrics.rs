//! Metrics through the `metrics` facade: plan and execute latency and request counts move
//! by exactly the calls made, and a publish sets the buffer manager's per-tier numbers to
//! what `buffer_stats` reports.

mod common;
use common::synth::{SynthContext, SynthParams};
use common::{metric, MetricsSnapshot};

use attnstore::{AttnShape, Budget, BufferSettings, ContextSpec, Engine, EngineConfig, Request, Tier};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::MetricKind;

/// A recorded value, comparable.
#[derive(Debug, PartialEq)]
enum V {
    Counter(u64),
    Gauge(f64),
    Samples(usize),
}

fn value(d: &DebugValue) -> V {
    match d {
        DebugValue::Counter(c) => V::Counter(*c),
        DebugValue::Gauge(g) => V::Gauge(g.0),
        DebugValue::Histogram(h) => V::Samples(h.len()),
    }
}

/// The metric `name` of `kind` with exactly `labels` in `snapshot`; a panic naming it when
/// it was never recorded.
fn find(snapshot: &MetricsSnapshot, kind: MetricKind, name: &str, labels: &[(&str, &str)]) -> V {
    metric(snapshot, kind, name, labels).map(value).unwrap_or_else(|| panic!("no {name} {labels:?} in {snapshot:?}"))
}

#[test]
fn metrics_move_by_the_calls_made_and_publish_the_buffer_managers_numbers() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let shape = AttnShape::new(8, 2, 32).unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape, 3000, 11));
    let buffers = BufferSettings { maintainer_idle: None, ..BufferSettings::new(4096) };
    let engine = Engine::in_memory(EngineConfig { buffers: Some(buffers), ..EngineConfig::default() }).unwrap();
    let ctx = engine.create_context(ContextSpec::new(shape, 1)).unwrap();
    engine.prefill(ctx, 0, &synth.keys, &synth.values).unwrap();
    let sparse = Budget::default().with_retrieve_floor(0).with_retrieve(0.05);
    metrics::with_local_recorder(&recorder, || {
        for step in 0..3 {
            let plan = engine.plan(&[Request::new(ctx, 0, synth.queries(step))], &sparse).unwrap();
            engine.execute(&plan).unwrap();
        }
        let exact = engine
            .plan(&[Request::new(ctx, 0, synth.queries(0)), Request::new(ctx, 0, synth.queries(1))], &Budget::full())
            .unwrap();
        engine.execute(&exact).unwrap();
        engine.buffer_manager().unwrap().maintain(usize::MAX);
        engine.publish_metrics();
    });
    let stats = engine.buffer_stats().unwrap();
    let snapshot = snapshotter.snapshot().into_vec();
    let find = |kind, name, labels: &[(&str, &str)]| find(&snapshot, kind, name, labels);
    let wave = [("method", "wave")];
    assert_eq!(find(MetricKind::Histogram, "attnstore_plan_seconds", &wave), V::Samples(4));
    assert_eq!(find(MetricKind::Histogram, "attnstore_execute_seconds", &wave), V::Samples(4));
    let sparse_requests =
        find(MetricKind::Counter, "attnstore_requests_total", &[("method", "wave"), ("strategy", "sparse")]);
    assert_eq!(sparse_requests, V::Counter(3));
    let exact_requests =
        find(MetricKind::Counter, "attnstore_requests_total", &[("method", "wave"), ("strategy", "exact")]);
    assert_eq!(exact_requests, V::Counter(2));
    for (tier, name) in [(Tier::Gpu, "gpu"), (Tier::Host, "host")] {
        let t = stats.tier(tier).unwrap();
        let counter = |metric| find(MetricKind::Counter, metric, &[("tier", name)]);
        assert_eq!(counter("attnstore_buffer_hits_total"), V::Counter(t.hits), "{name}");
        assert_eq!(counter("attnstore_buffer_misses_total"), V::Counter(t.misses), "{name}");
        assert_eq!(counter("attnstore_buffer_bytes_in_total"), V::Counter(t.bytes_in), "{name}");
        let used = find(MetricKind::Gauge, "attnstore_buffer_used_blocks", &[("tier", name)]);
        assert_eq!(used, V::Gauge(t.used_blocks as f64), "{name}");
    }
    assert!(stats.tier(Tier::Host).unwrap().hits > 0, "{stats}");
    assert_eq!(find(MetricKind::Gauge, "attnstore_contexts", &[]), V::Gauge(1.0));
    let dropped = find(MetricKind::Counter, "attnstore_buffer_dropped_access_records_total", &[]);
    assert_eq!(dropped, V::Counter(stats.dropped_access_records));
    // maintain(usize::MAX) above emptied the queue.
    assert_eq!(find(MetricKind::Gauge, "attnstore_buffer_queued_access_records", &[]), V::Gauge(0.0));
    // The maintainer's admissions into the Gpu tier each recorded their latency.
    let admitted = stats.tier(Tier::Gpu).unwrap().moves_in;
    assert!(admitted > 0, "{stats}");
    let moves = find(MetricKind::Histogram, "attnstore_buffer_move_seconds", &[("tier", "gpu")]);
    assert_eq!(moves, V::Samples(admitted as usize));
}

#[test]
fn ingest_metrics_count_the_accepted_batches_tokens_and_time_each_phase() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let shape = AttnShape::new(8, 2, 32).unwrap();
    let synth = SynthContext::generate(SynthParams::new(shape, 3000, 5));
    let engine = Engine::in_memory(EngineConfig::default()).unwrap();
    let ctx = engine.create_context(ContextSpec::new(shape, 1)).unwrap();
    let row = shape.kv_heads * shape.head_dim;
    // `kv_heads × tokens × head_dim`: the first `tokens` tokens of every KV head.
    let first = |x: &[f32], tokens: usize| -> Vec<f32> {
        x.chunks_exact(3000 * shape.head_dim).flat_map(|h| h[..tokens * shape.head_dim].to_vec()).collect()
    };
    metrics::with_local_recorder(&recorder, || {
        engine.prefill(ctx, 0, &synth.keys, &synth.values).unwrap();
        for _ in 0..2 {
            engine.append(ctx, 0, &first(&synth.keys, 5), &first(&synth.values, 5)).unwrap();
        }
        // Refused batches are not counted: a wrong shape, NaN, a second prefill.
        assert!(engine.append(ctx, 0, &synth.keys[..row + 1], &synth.values[..row + 1]).is_err());
        let mut nan = first(&synth.keys, 5);
        nan[3] = f32::NAN;
        assert!(engine.append(ctx, 0, &nan, &first(&synth.values, 5)).is_err());
        assert!(engine.prefill(ctx, 0, &synth.keys, &synth.values).is_err());
    });
    assert_eq!(engine.stats(ctx, 0).unwrap().tokens, 3010);
    let snapshot = snapshotter.snapshot().into_vec();
    let find = |kind, name, labels: &[(&str, &str)]| find(&snapshot, kind, name, labels);
    assert_eq!(find(MetricKind::Counter, "attnstore_ingest_tokens_total", &[("op", "prefill")]), V::Counter(3000));
    assert_eq!(find(MetricKind::Counter, "attnstore_ingest_tokens_total", &[("op", "append")]), V::Counter(10));
    for phase in ["checks", "log", "index"] {
        let seconds = |op| find(MetricKind::Histogram, "attnstore_ingest_seconds", &[("op", op), ("phase", phase)]);
        assert_eq!(seconds("prefill"), V::Samples(1), "{phase}");
        assert_eq!(seconds("append"), V::Samples(2), "{phase}");
    }
}
