//! Counters of the buffer manager per tier, and the snapshot `attnstore inspect` prints:
//! capacity, used, hits and misses (hit ratio), bytes and latency of moves into the tier,
//! evictions, failures; plus dropped and pending access records of the maintainer's queue.

use crate::Tier;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters of one tier (all Relaxed: statistics, they order nothing).
#[derive(Debug, Default)]
pub(crate) struct TierCounters {
    pub(crate) hits: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) moves_in: AtomicU64,
    pub(crate) bytes_in: AtomicU64,
    pub(crate) move_ns: AtomicU64,
    pub(crate) evictions: AtomicU64,
    pub(crate) failures: AtomicU64,
}

impl TierCounters {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// One block of `bytes` moved into `tier` (these counters' tier) since `started`; the
    /// move's latency also goes to the `attnstore_buffer_move_seconds{tier}` histogram.
    pub(crate) fn moved(&self, tier: Tier, bytes: usize, started: std::time::Instant) {
        let took = started.elapsed();
        Self::add(&self.moves_in, 1);
        Self::add(&self.bytes_in, bytes as u64);
        Self::add(&self.move_ns, took.as_nanos() as u64);
        metrics::histogram!("attnstore_buffer_move_seconds", "tier" => tier.name()).record(took.as_secs_f64());
    }

    /// One failed operation of `tier` (these counters' tier), of `kind` (`disk_write`,
    /// `disk_read`, `corrupt`, `missing`, `full`, `copy`, `slot_table`, `poisoned`), also
    /// counted by kind in `attnstore_buffer_failures_by_kind_total{tier,kind}`.
    pub(crate) fn failed(&self, tier: Tier, kind: &'static str) {
        Self::add(&self.failures, 1);
        metrics::counter!("attnstore_buffer_failures_by_kind_total", "tier" => tier.name(), "kind" => kind)
            .increment(1);
    }

    pub(crate) fn snapshot(&self, tier: Tier, capacity_blocks: usize, used_blocks: usize) -> TierStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TierStats {
            tier,
            capacity_blocks,
            used_blocks,
            hits: get(&self.hits),
            misses: get(&self.misses),
            moves_in: get(&self.moves_in),
            bytes_in: get(&self.bytes_in),
            move_ns: get(&self.move_ns),
            evictions: get(&self.evictions),
            failures: get(&self.failures),
        }
    }
}

/// A snapshot of one tier's counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierStats {
    /// The tier.
    pub tier: Tier,
    /// Block slots.
    pub capacity_blocks: usize,
    /// Block slots in use.
    pub used_blocks: usize,
    /// Reads served by this tier (Gpu: cache hits; Host/Disk: reads that found their block here).
    pub hits: u64,
    /// Reads that wanted this tier and went to a slower one (Gpu: cache misses).
    pub misses: u64,
    /// Blocks moved into this tier (Gpu: admissions; Host: reloads; Disk: spills and writes).
    pub moves_in: u64,
    /// Bytes moved into this tier.
    pub bytes_in: u64,
    /// Total wall time of those moves, in nanoseconds.
    pub move_ns: u64,
    /// Blocks evicted from this tier (Gpu: by policy or on request; Host: spilled).
    pub evictions: u64,
    /// Failed operations: I/O errors, corrupt reads, timeouts, refused admissions.
    pub failures: u64,
}

impl TierStats {
    /// `hits / (hits + misses)`, or `None` before the first read.
    pub fn hit_ratio(&self) -> Option<f64> {
        let total = self.hits + self.misses;
        (total > 0).then(|| self.hits as f64 / total as f64)
    }

    /// Mean latency of one move into the tier, in microseconds.
    pub fn mean_move_us(&self) -> Option<f64> {
        (self.moves_in > 0).then(|| self.move_ns as f64 / self.moves_in as f64 / 1e3)
    }
}

/// A snapshot of the whole buffer manager.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferStats {
    /// Bytes per block.
    pub block_bytes: usize,
    /// One entry per configured tier, fastest first.
    pub tiers: Vec<TierStats>,
    /// Access records dropped because the maintainer's queue was full.
    pub dropped_access_records: u64,
    /// Access records waiting in the queue.
    pub queued_access_records: usize,
    /// Cluster reads of device steps not applied because a newer step of the same layer
    /// was queued behind them (`BufferManager::log_layer_reads`; for
    /// `BufferManager::log_flagged_reads`, every flagged cluster of the step counts).
    pub superseded_cluster_reads: u64,
    /// The replacement policy of the Gpu tier.
    pub replacer: &'static str,
    /// The Disk tier's I/O backend (`io_uring`, `pread`, ...), when there is a Disk tier.
    pub disk_backend: Option<&'static str>,
    /// What backs the Host arena (pinned and device-mapped, or anonymous memory).
    pub host_memory: crate::HostMemoryKind,
    /// The Gpu tier is mirrored in device memory (a GPU is present).
    pub gpu_on_device: bool,
    /// Gpu slots held back (counted as used) for device reads in flight.
    pub gpu_quarantined_blocks: usize,
}

impl BufferStats {
    /// The stats of `tier`, when configured.
    pub fn tier(&self, tier: Tier) -> Option<&TierStats> {
        self.tiers.iter().find(|t| t.tier == tier)
    }
}

impl fmt::Display for BufferStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<5} {:>10} {:>10} {:>10} {:>10} {:>7} {:>10} {:>12} {:>11} {:>10} {:>9}",
            "tier",
            "capacity",
            "used",
            "hits",
            "misses",
            "hit%",
            "moves_in",
            "bytes_in",
            "move_us",
            "evictions",
            "failures"
        )?;
        for t in &self.tiers {
            let ratio = t.hit_ratio().map_or("-".to_string(), |r| format!("{:.1}", r * 100.0));
            let latency = t.mean_move_us().map_or("-".to_string(), |us| format!("{us:.2}"));
            writeln!(
                f,
                "{:<5} {:>10} {:>10} {:>10} {:>10} {:>7} {:>10} {:>12} {:>11} {:>10} {:>9}",
                t.tier.name(),
                t.capacity_blocks,
                t.used_blocks,
                t.hits,
                t.misses,
                ratio,
                t.moves_in,
                t.bytes_in,
                latency,
                t.evictions,
                t.failures
            )?;
        }
        write!(
            f,
            "block {} B, host memory {}, gpu tier in {} ({} slots quarantined), replacer {}, disk I/O {}, access records: {} queued, {} dropped, {} device-step cluster reads superseded",
            self.block_bytes,
            match self.host_memory {
                crate::HostMemoryKind::Anonymous => "anonymous",
                crate::HostMemoryKind::Pinned { .. } => "pinned (device-mapped)",
            },
            if self.gpu_on_device { "device memory" } else { "host memory" },
            self.gpu_quarantined_blocks,
            self.replacer,
            self.disk_backend.unwrap_or("-"),
            self.queued_access_records,
            self.dropped_access_records,
            self.superseded_cluster_reads
        )
    }
}
