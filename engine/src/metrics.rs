//! Metrics for embedders through the `metrics` facade: the library records and installs
//! nothing; the application installs any recorder or exporter (Prometheus, StatsD, ...).
//!
//! Recorded on every call: `attnstore_plan_seconds{method}` and
//! `attnstore_execute_seconds{method}` (histograms of [`Engine::plan`] and
//! [`Engine::execute`] latency; `method` is the requests' access method, or `mixed`),
//! `attnstore_requests_total{method, strategy}` (requests executed), and per accepted
//! prefill or append `attnstore_ingest_tokens_total{op}` and
//! `attnstore_ingest_seconds{op, phase}` (`checks`: shape, finiteness and host memory;
//! `log`: the durable engine's data file and log record; `index`: the access method's
//! prefill, append or layout restore; `device_layout`: [`Engine::prefill_gpu`]'s clustering
//! on the GPU, its copies included). Published when the
//! application asks ([`Engine::publish_metrics`], e.g. from its scrape handler): the buffer
//! manager's numbers per tier as gauges (`attnstore_buffer_capacity_blocks`,
//! `attnstore_buffer_used_blocks`) and counters set to their totals
//! (`attnstore_buffer_hits_total`, `_misses_total`, `_evictions_total`, `_failures_total`,
//! `_bytes_in_total`), the maintainer's dropped and queued access records, and
//! `attnstore_contexts`. With no recorder installed each call costs a check of the global
//! recorder. The buffer and WAL crates record their I/O where it happens
//! (`attnstore_buffer_move_seconds{tier}`, `attnstore_buffer_failures_by_kind_total`,
//! `attnstore_wal_*`; `docs/observability.md` lists them).

use crate::engine::Engine;
use crate::plan::{Plan, Strategy};
use std::time::Duration;

/// The method label of a plan: its requests' access method, or `mixed`.
fn method_of(plan: &Plan) -> &'static str {
    match plan.requests.split_first() {
        Some((first, rest)) if rest.iter().all(|r| r.method == first.method) => first.method,
        Some(_) => "mixed",
        None => "none",
    }
}

/// Records one accepted batch of `tokens` tokens stored by `op` (`prefill` or `append`) and
/// the time of each of its phases.
pub(crate) fn ingested<const N: usize>(op: &'static str, tokens: usize, phases: [(&'static str, Duration); N]) {
    metrics::counter!("attnstore_ingest_tokens_total", "op" => op).increment(tokens as u64);
    for (phase, took) in phases {
        ingest_phase(op, phase, took);
    }
}

/// Records the time one phase of a batch's ingest by `op` took.
pub(crate) fn ingest_phase(op: &'static str, phase: &'static str, took: Duration) {
    metrics::histogram!("attnstore_ingest_seconds", "op" => op, "phase" => phase).record(took.as_secs_f64());
}

/// Records one [`Engine::plan`] call that made `plan`.
pub(crate) fn planned(plan: &Plan, elapsed: Duration) {
    metrics::histogram!("attnstore_plan_seconds", "method" => method_of(plan)).record(elapsed.as_secs_f64());
}

/// Records one [`Engine::execute`] call of `plan` (`gpu`: an `Engine::execute_gpu` call,
/// timed in `attnstore_execute_gpu_seconds`).
pub(crate) fn executed(plan: &Plan, elapsed: Duration, gpu: bool) {
    let name = if gpu { "attnstore_execute_gpu_seconds" } else { "attnstore_execute_seconds" };
    metrics::histogram!(name, "method" => method_of(plan)).record(elapsed.as_secs_f64());
    for r in &plan.requests {
        let strategy = match r.strategy {
            Strategy::Exact { .. } => "exact",
            Strategy::Sparse { .. } => "sparse",
        };
        metrics::counter!("attnstore_requests_total", "method" => r.method, "strategy" => strategy).increment(1);
    }
}

impl Engine {
    /// Publishes the engine's current state to the installed `metrics` recorder: per tier
    /// of the buffer manager (when there is one) its capacity and use as gauges and its
    /// hits, misses, evictions, failures and bytes moved in as counters set to their
    /// totals, and the number of contexts. Call it when the metrics are read (a scrape).
    pub fn publish_metrics(&self) {
        metrics::gauge!("attnstore_contexts").set(self.contexts().len() as f64);
        let Some(stats) = self.buffer_stats() else { return };
        for t in &stats.tiers {
            let tier = t.tier.name();
            metrics::gauge!("attnstore_buffer_capacity_blocks", "tier" => tier).set(t.capacity_blocks as f64);
            metrics::gauge!("attnstore_buffer_used_blocks", "tier" => tier).set(t.used_blocks as f64);
            metrics::counter!("attnstore_buffer_hits_total", "tier" => tier).absolute(t.hits);
            metrics::counter!("attnstore_buffer_misses_total", "tier" => tier).absolute(t.misses);
            metrics::counter!("attnstore_buffer_evictions_total", "tier" => tier).absolute(t.evictions);
            metrics::counter!("attnstore_buffer_failures_total", "tier" => tier).absolute(t.failures);
            metrics::counter!("attnstore_buffer_bytes_in_total", "tier" => tier).absolute(t.bytes_in);
        }
        // Admission drops: access records the maintainer never saw (its queue was full),
        // and the queue's depth now.
        metrics::counter!("attnstore_buffer_dropped_access_records_total").absolute(stats.dropped_access_records);
        metrics::gauge!("attnstore_buffer_queued_access_records").set(stats.queued_access_records as f64);
    }
}
