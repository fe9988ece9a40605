//! EXPLAIN ANALYZE's counters: what the executor actually read and how long it took, per
//! request and zone. The executor takes an optional [`Meter`] per request; without one it
//! counts nothing (one branch per run or job). Counts are atomics because a request's KV
//! heads and a selection's jobs run on rayon threads.

use attnstore_buffer::Tier;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// The zones a request's rows are read in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Zone {
    /// Sink, pending and local tokens (every sparse plan), or all of an exact plan's rows a
    /// method reads in one pass.
    Steady,
    /// An exact plan's other rows, as parallel runs.
    Scan,
    /// A sparse plan's retrieved rows.
    Retrieve,
    /// A sparse plan's estimated clusters.
    Estimate,
}

impl Zone {
    /// Pins of this zone log no accesses (a scan must not flush the Gpu tier).
    pub(crate) fn is_scan(self) -> bool {
        matches!(self, Zone::Steady | Zone::Scan)
    }
}

/// What one zone of one request actually read and cost (serialized with `cpu_time` in
/// microseconds, as `cpu_us`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ZoneActual {
    /// Rows attended exactly, summed over KV heads and selections (for the estimation zone:
    /// clusters estimated).
    pub rows: u64,
    /// Bytes of rows read from the access method's own memory.
    pub index_bytes: u64,
    /// Blocks pinned from each tier (`[gpu, host, disk]`).
    pub blocks: [u64; 3],
    /// Bytes of those blocks, per tier.
    pub block_bytes: [u64; 3],
    /// Time of the zone's tasks, summed over threads (CPU time, not wall time).
    #[serde(rename = "cpu_us", serialize_with = "micros")]
    pub cpu_time: Duration,
    /// Wall time of the zone's GPU work, from its launch until its results were on the host
    /// (host-planned requests on the GPU; zero on the CPU and for device-selected steps,
    /// whose fused step is timed whole in [`crate::Analysis::device_time`]).
    #[serde(rename = "gpu_us", serialize_with = "micros")]
    pub gpu_time: Duration,
}

impl ZoneActual {
    /// Bytes read from anywhere.
    pub fn bytes(&self) -> u64 {
        self.index_bytes + self.block_bytes.iter().sum::<u64>()
    }
}

/// A duration as microseconds (f64), for JSON.
pub(crate) fn micros<S: serde::Serializer>(d: &Duration, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e6)
}

/// `d` (if any) as microseconds, for JSON (`null` when unknown).
pub(crate) fn micros_opt<S: serde::Serializer>(d: &Option<Duration>, s: S) -> std::result::Result<S::Ok, S::Error> {
    match d {
        Some(d) => micros(d, s),
        None => s.serialize_none(),
    }
}

/// One zone's counters.
#[derive(Debug, Default)]
pub(crate) struct ZoneMeter {
    rows: AtomicU64,
    index_bytes: AtomicU64,
    blocks: [AtomicU64; 3],
    block_bytes: [AtomicU64; 3],
    nanos: AtomicU64,
    gpu_nanos: AtomicU64,
}

impl ZoneMeter {
    /// `rows` rows read from the method's memory, `bytes` bytes of them.
    pub(crate) fn index_rows(&self, rows: usize, bytes: usize) {
        self.rows.fetch_add(rows as u64, Relaxed);
        self.index_bytes.fetch_add(bytes as u64, Relaxed);
    }

    /// `rows` rows read from pinned blocks (counted with [`ZoneMeter::pinned`]).
    pub(crate) fn block_rows(&self, rows: usize) {
        self.rows.fetch_add(rows as u64, Relaxed);
    }

    /// One block of `bytes` bytes pinned from `tier`.
    pub(crate) fn pinned(&self, tier: Tier, bytes: usize) {
        let t = tier.index();
        self.blocks[t].fetch_add(1, Relaxed);
        self.block_bytes[t].fetch_add(bytes as u64, Relaxed);
    }

    /// Adds the time since `start`.
    pub(crate) fn since(&self, start: Instant) {
        self.nanos.fetch_add(start.elapsed().as_nanos() as u64, Relaxed);
    }

    /// Adds the time since `start` as GPU wall time (launch to results).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "the GPU executor's"))]
    pub(crate) fn gpu_since(&self, start: Instant) {
        self.gpu_nanos.fetch_add(start.elapsed().as_nanos() as u64, Relaxed);
    }

    fn actual(&self) -> ZoneActual {
        let load = |a: &[AtomicU64; 3]| [a[0].load(Relaxed), a[1].load(Relaxed), a[2].load(Relaxed)];
        ZoneActual {
            rows: self.rows.load(Relaxed),
            index_bytes: self.index_bytes.load(Relaxed),
            blocks: load(&self.blocks),
            block_bytes: load(&self.block_bytes),
            cpu_time: Duration::from_nanos(self.nanos.load(Relaxed)),
            gpu_time: Duration::from_nanos(self.gpu_nanos.load(Relaxed)),
        }
    }
}

/// The counters of one request.
#[derive(Debug, Default)]
pub(crate) struct Meter {
    zones: [ZoneMeter; 4],
}

impl Meter {
    /// The counters of `zone`.
    pub(crate) fn zone(&self, zone: Zone) -> &ZoneMeter {
        &self.zones[zone as usize]
    }

    /// What was counted.
    pub(crate) fn actual(&self) -> RequestActual {
        let z = |zone| self.zone(zone).actual();
        RequestActual {
            steady: z(Zone::Steady),
            scan: z(Zone::Scan),
            retrieve: z(Zone::Retrieve),
            estimate: z(Zone::Estimate),
        }
    }
}

/// What executing one request of a plan actually read, per zone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RequestActual {
    /// The steady zone (sink, pending, local; an exact plan's one-pass rows).
    pub steady: ZoneActual,
    /// An exact plan's other rows.
    pub scan: ZoneActual,
    /// A sparse plan's retrieved rows.
    pub retrieve: ZoneActual,
    /// A sparse plan's estimated clusters (`rows` counts clusters).
    pub estimate: ZoneActual,
}

impl RequestActual {
    /// Rows attended exactly in any zone.
    pub fn exact_rows(&self) -> u64 {
        self.steady.rows + self.scan.rows + self.retrieve.rows
    }
}
