//! What the remote tier did, as counters (read with [`super::RemoteTier::stats`]) and
//! through the `metrics` facade (`attnstore_remote_*`, `docs/observability.md`).

use super::store::RemoteErrorKind;
use super::value::Fault;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A snapshot of a remote tier's counters since it was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteStats {
    /// Bytes of values written to the store.
    pub bytes_out: u64,
    /// Bytes of values read from the store.
    pub bytes_in: u64,
    /// Values written.
    pub values_out: u64,
    /// Values a publish did not write because the store already held them.
    pub values_present: u64,
    /// Values fetched and used.
    pub hits: u64,
    /// Values asked for that the store did not hold.
    pub misses: u64,
    /// Values refused by their checks (truncated, flipped, another chunk's).
    pub corrupt: u64,
    /// Calls that timed out.
    pub timeouts: u64,
    /// Calls that found no connection.
    pub connection_failures: u64,
    /// Calls the server refused or answered wrongly.
    pub server_failures: u64,
    /// Publishes queued.
    pub publishes_queued: u64,
    /// Publishes written completely.
    pub publishes_done: u64,
    /// Publishes that stopped on a failed call (what was written stays usable).
    pub publishes_failed: u64,
    /// Publishes dropped unwritten because the queue was full (the oldest go first).
    pub publishes_dropped: u64,
    /// Attach calls.
    pub attaches: u64,
    /// Tokens the attach calls asked for (whole chunks).
    pub attach_tokens_asked: u64,
    /// Tokens they reused (the prefixes found).
    pub attach_tokens_reused: u64,
    /// Layers restored from a published index layout instead of clustering or training.
    pub layouts_used: u64,
    /// Store calls made, and their total and longest time.
    pub calls: u64,
    /// Total time of store calls, microseconds.
    pub call_micros: u64,
    /// Longest store call, microseconds.
    pub max_call_micros: u64,
}

impl RemoteStats {
    /// Failed calls of every kind.
    pub fn failures(&self) -> u64 {
        self.timeouts + self.connection_failures + self.server_failures
    }

    /// One line for reports.
    pub fn summary(&self) -> String {
        format!(
            "remote: {} attaches reused {}/{} tokens ({} layouts); values {} hit, {} missing, {} corrupt; \
             published {} values ({:.1} MB, {} already there), {} publishes done, {} failed, {} dropped; \
             {} calls, mean {:.0} us, max {} us; failures {} timeout, {} connection, {} server",
            self.attaches,
            self.attach_tokens_reused,
            self.attach_tokens_asked,
            self.layouts_used,
            self.hits,
            self.misses,
            self.corrupt,
            self.values_out,
            self.bytes_out as f64 / 1e6,
            self.values_present,
            self.publishes_done,
            self.publishes_failed,
            self.publishes_dropped,
            self.calls,
            self.call_micros as f64 / self.calls.max(1) as f64,
            self.max_call_micros,
            self.timeouts,
            self.connection_failures,
            self.server_failures,
        )
    }
}

/// The live counters.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub bytes_out: AtomicU64,
    pub bytes_in: AtomicU64,
    pub values_out: AtomicU64,
    pub values_present: AtomicU64,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub corrupt: AtomicU64,
    pub timeouts: AtomicU64,
    pub connection_failures: AtomicU64,
    pub server_failures: AtomicU64,
    pub publishes_queued: AtomicU64,
    pub publishes_done: AtomicU64,
    pub publishes_failed: AtomicU64,
    pub publishes_dropped: AtomicU64,
    pub attaches: AtomicU64,
    pub attach_tokens_asked: AtomicU64,
    pub attach_tokens_reused: AtomicU64,
    pub layouts_used: AtomicU64,
    pub calls: AtomicU64,
    pub call_micros: AtomicU64,
    pub max_call_micros: AtomicU64,
}

/// Adds `n` to a counter (relaxed: counters are read as a snapshot, nothing orders on them).
pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl Counters {
    pub fn snapshot(&self) -> RemoteStats {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        RemoteStats {
            bytes_out: r(&self.bytes_out),
            bytes_in: r(&self.bytes_in),
            values_out: r(&self.values_out),
            values_present: r(&self.values_present),
            hits: r(&self.hits),
            misses: r(&self.misses),
            corrupt: r(&self.corrupt),
            timeouts: r(&self.timeouts),
            connection_failures: r(&self.connection_failures),
            server_failures: r(&self.server_failures),
            publishes_queued: r(&self.publishes_queued),
            publishes_done: r(&self.publishes_done),
            publishes_failed: r(&self.publishes_failed),
            publishes_dropped: r(&self.publishes_dropped),
            attaches: r(&self.attaches),
            attach_tokens_asked: r(&self.attach_tokens_asked),
            attach_tokens_reused: r(&self.attach_tokens_reused),
            layouts_used: r(&self.layouts_used),
            calls: r(&self.calls),
            call_micros: r(&self.call_micros),
            max_call_micros: r(&self.max_call_micros),
        }
    }

    /// Records one store call of `op` that took `elapsed`.
    pub fn call(&self, op: &'static str, elapsed: Duration) {
        let us = elapsed.as_micros() as u64;
        add(&self.calls, 1);
        add(&self.call_micros, us);
        self.max_call_micros.fetch_max(us, Ordering::Relaxed);
        metrics::histogram!("attnstore_remote_call_seconds", "op" => op).record(elapsed.as_secs_f64());
    }

    /// Records a failed call.
    pub fn failure(&self, kind: RemoteErrorKind) {
        add(
            match kind {
                RemoteErrorKind::Timeout => &self.timeouts,
                RemoteErrorKind::Connection => &self.connection_failures,
                RemoteErrorKind::Server => &self.server_failures,
            },
            1,
        );
        metrics::counter!("attnstore_remote_failures_total", "kind" => kind.name()).increment(1);
    }

    /// Records a value that was not used.
    pub fn fault(&self, fault: Fault) {
        add(if fault == Fault::Missing { &self.misses } else { &self.corrupt }, 1);
        metrics::counter!("attnstore_remote_values_total", "result" => fault.name()).increment(1);
    }

    /// Records `n` values used.
    pub fn hits(&self, n: u64) {
        add(&self.hits, n);
        metrics::counter!("attnstore_remote_values_total", "result" => "hit").increment(n);
    }

    /// Records `bytes` of values read from the store.
    pub fn read(&self, bytes: u64) {
        add(&self.bytes_in, bytes);
        metrics::counter!("attnstore_remote_bytes_in_total").increment(bytes);
    }

    /// Records `n` values written, of `bytes` bytes.
    pub fn written(&self, n: u64, bytes: u64) {
        add(&self.values_out, n);
        add(&self.bytes_out, bytes);
        metrics::counter!("attnstore_remote_bytes_out_total").increment(bytes);
    }
}
