//! The remote tier's metrics (`docs/observability.md`) move exactly as its `RemoteStats`
//! do: bytes out and in, values hit / missing / corrupt, failures by kind, calls by
//! operation, the reused prefix. A test binary of its own: the tier's writer and fetcher
//! threads record into the global recorder, which only one test may install.

mod common;
use common::synth::{SynthContext, SynthParams};
use common::{metric, MetricsSnapshot};

use attnstore::remote::{MemoryStore, ModelId, RemoteConfig, RemoteStore, RemoteTier};
use attnstore::{AttnShape, ContextSpec, Engine, EngineConfig};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::MetricKind;
use std::sync::Arc;
use std::time::Duration;

const CHUNK: usize = 128;

/// What the recorder took since the last snapshot (taking one drains counters and
/// histograms alike, so each phase is compared with what the counters moved by).
struct Snap(MetricsSnapshot);

impl Snap {
    fn take(snapshotter: &Snapshotter) -> Self {
        Self(snapshotter.snapshot().into_vec())
    }

    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        read(self, MetricKind::Counter, name, labels)
    }

    fn samples(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        read(self, MetricKind::Histogram, name, labels)
    }
}

/// The counter `name` with exactly `labels`, 0 when never recorded; or the number of
/// samples of a histogram.
fn read(snap: &Snap, kind: MetricKind, name: &str, labels: &[(&str, &str)]) -> u64 {
    metric(&snap.0, kind, name, labels).map_or(0, |v| match v {
        DebugValue::Counter(c) => *c,
        DebugValue::Histogram(h) => h.len() as u64,
        DebugValue::Gauge(g) => g.0 as u64,
    })
}

#[test]
fn remote_metrics_move_with_the_tiers_counters() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::set_global_recorder(recorder).expect("the only recorder of this test binary");

    let shape = AttnShape::new(4, 2, 16).unwrap();
    let tokens = 1024;
    let synth = SynthContext::generate(SynthParams::new(shape, tokens, 3));
    let spec = ContextSpec::new(shape, 1);
    let ids: Vec<u32> = (0..tokens as u32).collect();
    let model = ModelId::of_bytes(b"metrics model");
    let store = Arc::new(MemoryStore::new());
    let config = RemoteConfig { chunk_tokens: CHUNK, values_per_call: 4, ..RemoteConfig::default() };
    let tier = RemoteTier::new(Arc::clone(&store) as Arc<dyn RemoteStore>, config).unwrap();

    let a = Engine::in_memory(EngineConfig::default()).unwrap();
    let ctx = a.create_context(spec.clone()).unwrap();
    a.prefill(ctx, 0, &synth.keys, &synth.values).unwrap();
    tier.publish(&a, ctx, &model, &ids, vec![(synth.keys.clone(), synth.values.clone())]).unwrap();
    assert!(tier.flush(Duration::from_secs(30)));
    let s = tier.stats();
    assert!(s.values_out >= (tokens / CHUNK) as u64 && s.bytes_out > 0, "{s:?}");
    let m = Snap::take(&snapshotter);
    assert_eq!(m.counter("attnstore_remote_bytes_out_total", &[]), s.bytes_out);
    assert!(m.samples("attnstore_remote_call_seconds", &[("op", "exists")]) >= 2);
    assert!(m.samples("attnstore_remote_call_seconds", &[("op", "set")]) >= 2);

    // A whole attach: every rows value a hit, the bytes read counted, the prefix recorded.
    let b = Engine::in_memory(EngineConfig::default()).unwrap();
    let got = tier.attach(&b, spec.clone(), &model, &ids).unwrap().unwrap();
    assert_eq!(got.tokens, tokens);
    let (before, s) = (s, tier.stats());
    assert!(s.hits >= (tokens / CHUNK) as u64, "{s:?}");
    let m = Snap::take(&snapshotter);
    assert_eq!(m.counter("attnstore_remote_values_total", &[("result", "hit")]), s.hits);
    assert_eq!(m.counter("attnstore_remote_bytes_in_total", &[]), s.bytes_in - before.bytes_in);
    assert!(s.bytes_in > 0);
    assert_eq!(m.samples("attnstore_remote_prefix_tokens", &[]), 1);
    assert!(m.samples("attnstore_remote_call_seconds", &[("op", "get")]) >= 2);

    // A corrupt value and a missing one, each where the other prefix is still whole.
    let rows: Vec<String> = store.keys().into_iter().filter(|k| k.contains(":kv:")).collect();
    let mut value = store.get(&rows[0]).unwrap();
    let last = value.len() - 1;
    value[last] ^= 1;
    store.put(&rows[0], value);
    store.delete(&rows[1]);
    let _ = tier.attach(&b, spec.clone(), &model, &ids).unwrap();
    let (before, s) = (s, tier.stats());
    assert!(s.corrupt + s.misses >= 1, "{s:?}");
    let m = Snap::take(&snapshotter);
    assert_eq!(m.counter("attnstore_remote_values_total", &[("result", "corrupt")]), s.corrupt - before.corrupt);
    assert_eq!(m.counter("attnstore_remote_values_total", &[("result", "missing")]), s.misses - before.misses);
    assert_eq!(m.counter("attnstore_remote_values_total", &[("result", "hit")]), s.hits - before.hits);
    assert_eq!(m.counter("attnstore_remote_bytes_in_total", &[]), s.bytes_in - before.bytes_in);

    // A store that is down: failures by kind, the same as the counters.
    store.set_down(true);
    assert!(tier.attach(&b, spec, &model, &ids).unwrap().is_none());
    let (before, s) = (s, tier.stats());
    assert!(s.connection_failures >= 1, "{s:?}");
    let m = Snap::take(&snapshotter);
    let failed = s.connection_failures - before.connection_failures;
    assert_eq!(m.counter("attnstore_remote_failures_total", &[("kind", "connection")]), failed);
    assert_eq!(m.counter("attnstore_remote_failures_total", &[("kind", "timeout")]), s.timeouts - before.timeouts);
    assert_eq!(m.samples("attnstore_remote_prefix_tokens", &[]), 1);
}
