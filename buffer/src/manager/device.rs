//! Device-planned reads: what a GPU step that picks its clusters on the device reads (the Host
//! arena's and the Gpu tier's addresses, the device slot table), the [`DeviceRead`] guard it
//! holds meanwhile, and the cluster reads it logs afterwards ([`LayerReads`], [`FlaggedReads`])
//! for the maintainer, which is woken when they come.

use super::{BufferManager, Home};
use crate::arena::HostMemoryKind;
use crate::device_read::DeviceRead;
use crate::slot_table::DeviceSlotTable;
use crate::{BlockId, ClusterKey, Result};
use std::sync::atomic::Ordering;

impl BufferManager {
    /// What backs the Host arena: anonymous memory, or pinned memory the GPU reads in place
    /// (with the arena's device address).
    pub fn host_memory(&self) -> HostMemoryKind {
        self.host.memory_kind()
    }

    /// Device address of the Gpu tier's slot 0 when the tier lives in device memory (feature
    /// `cuda` and a GPU): slot `s` (`BlockLocation::gpu_slot`) is at `base + s × block_bytes`.
    /// Admissions write the device copy on the pool's own stream before the slot is published.
    pub fn gpu_device_base(&self) -> Option<u64> {
        self.gpu.device_base()
    }

    /// The Host slot of `block` when its home is the Host arena (with [`Self::host_memory`]'s
    /// device base, what a zero-copy GPU gather reads: `base + slot × block_bytes`).
    pub fn host_slot(&self, block: BlockId) -> Result<Option<u32>> {
        let state = self.state()?;
        Ok(match state.meta(block)?.home {
            Home::Host(slot) => Some(slot),
            _ => None,
        })
    }

    /// The device copy of the slot table, for a kernel that chooses its clusters on the
    /// device: an `i32` per Host slot, the Gpu slot of the block homed there (read at
    /// [`Self::gpu_device_base`]) or -1 (read the row from the Host arena,
    /// [`Self::host_memory`]). A kernel reads it only inside a [`DeviceRead`]
    /// ([`Self::device_read`]) taken before its launch. `None` without a Gpu tier in device
    /// memory (no feature `cuda`, no GPU, `gpu_blocks == 0`) or after a failed write to it.
    ///
    /// An entry is cleared on the device before its Gpu slot can be overwritten, and set only
    /// after the slot's new bytes are on the device or ordered before it on the Gpu pool's
    /// stream (the one stream that writes both: standalone operations wait for each write, a
    /// [`Self::maintain`] round enqueues its bytes, then its entries, and waits once), so a
    /// kernel never follows an entry to a half-written slot.
    pub fn device_slot_table(&self) -> Option<DeviceSlotTable> {
        self.slot_table.device()
    }

    /// Starts a device read: hold the guard from before launching a GPU step that reads the
    /// slot table and the Gpu tier until its results are back. While it lives, a Gpu slot whose
    /// table entry is cleared after this call is not reused for another block (it waits in a
    /// quarantine; admissions that would need it fail with [`Error::DeviceReadsInFlight`]).
    /// Without live guards nothing changes: an evicted slot is reused at once. Cheap (one
    /// short lock), meant once per GPU step.
    ///
    /// ```
    /// use attnstore_buffer::{BufferConfig, BufferManager, ClusterKey};
    ///
    /// let buffers = BufferManager::new(BufferConfig::new(64, 8))?;
    /// let key = ClusterKey { context: 1, layer: 0, head: 0, cluster: 0 };
    /// buffers.store_cluster(key, &[1u8; 2048])?;
    /// let step = buffers.device_read(); // before the launch
    /// // ... launch the kernel with buffers.device_slot_table(), wait for its results ...
    /// drop(step);
    /// buffers.log_cluster_reads(vec![key]); // what the step read, for the maintainer
    /// buffers.maintain(usize::MAX);
    /// # Ok::<(), attnstore_buffer::Error>(())
    /// ```
    ///
    /// [`Error::DeviceReadsInFlight`]: crate::Error::DeviceReadsInFlight
    pub fn device_read(&self) -> DeviceRead<'_> {
        DeviceRead::new(&self.epochs, &self.gpu)
    }

    /// Logs the clusters a device-planned step read (it takes no pins, so it logs no access
    /// records), for the maintainer: [`Self::maintain`] counts a hit for each block cached in
    /// the Gpu tier (and tells the replacer), and admits each block homed on Host that is not
    /// (a Gpu miss and a Host hit). Disk-homed or lost blocks count nothing (a device step
    /// reads only the Gpu tier and the Host arena); clusters freed since are skipped. Never
    /// blocks: when the queue is full the keys are dropped and counted with the dropped
    /// access records. A cluster counts as one record.
    pub fn log_cluster_reads(&self, keys: Vec<ClusterKey>) {
        self.push_cluster_reads(ClusterReads::Keys(keys));
    }

    /// [`Self::log_cluster_reads`] for the clusters a device step read, layer by layer (one
    /// entry per request of the step, so one round handles the whole step): the maintainer
    /// makes the keys, so the step's thread hands over its selections as it got them. Ids
    /// without a mapped cluster (padding) are skipped like clusters freed since. A round applies
    /// only the newest queued reads of each layer (see `take_cluster_reads`): a step's reads
    /// that a newer step of its layer overtook in the queue are superseded, not applied.
    pub fn log_layer_reads(&self, layers: Vec<LayerReads>) {
        self.push_cluster_reads(ClusterReads::Layers(layers.into_iter().map(StepReads::Ids).collect()));
    }

    /// [`Self::log_layer_reads`] for selections as a device step flagged them
    /// ([`FlaggedReads`]): the step's thread hands over the flagged words as it got them, and
    /// the maintainer picks the ids to apply (every miss, the hits of the sample) only for the
    /// newest reads of each layer, which a round applies. So a step spends no host time
    /// sorting its selection into reads.
    pub fn log_flagged_reads(&self, layers: Vec<FlaggedReads>) {
        self.push_cluster_reads(ClusterReads::Layers(layers.into_iter().map(StepReads::Flagged).collect()));
    }

    /// Puts `reads` in the queue, counted as queued, or as dropped when the queue is full.
    pub(super) fn queue_cluster_reads(&self, reads: ClusterReads) {
        let n = reads.len() as u64;
        // Relaxed: statistics.
        match self.cluster_reads.push(reads) {
            Ok(()) => self.queued_records.fetch_add(n, Ordering::Relaxed),
            Err(_) => self.dropped.fetch_add(n, Ordering::Relaxed),
        };
    }

    fn push_cluster_reads(&self, reads: ClusterReads) {
        let n = reads.len() as u64;
        if n == 0 {
            return;
        }
        self.queue_cluster_reads(reads);
        // A device step's misses are read from the Host arena until they are admitted: wake
        // the maintainer now rather than at the end of its idle sleep or pause (one futex
        // wake per step when it is parked, nothing when it is busy).
        if let Some(thread) = self.waker.lock().as_ref() {
            thread.unpark();
        }
    }

    /// Names the thread that runs [`Self::maintain`] in the background (a parked maintainer
    /// is unparked when a device step logs its cluster reads); `None` stops the wake-ups.
    /// [`crate::Maintainer`] registers itself.
    pub fn set_waker(&self, thread: Option<std::thread::Thread>) {
        *self.waker.lock() = thread;
    }

    /// Stops the wake-ups if `thread` is the one registered (a maintainer leaving does not
    /// unregister a newer one).
    pub(crate) fn clear_waker(&self, thread: std::thread::ThreadId) {
        let mut waker = self.waker.lock();
        if waker.as_ref().is_some_and(|t| t.id() == thread) {
            *waker = None;
        }
    }
}

/// The clusters a device step read in one layer of one context, for
/// [`BufferManager::log_layer_reads`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerReads {
    /// Context id.
    pub context: u64,
    /// Layer index.
    pub layer: u32,
    /// Cluster ids read, per KV head (`per_head[h]` for head `h`).
    pub per_head: Vec<Vec<u32>>,
}

/// A device step's retrieved clusters in one layer of one context as its kernels flagged
/// them, for [`BufferManager::log_flagged_reads`]. A round applies every real miss and, of the
/// real hits, those whose id ≡ `hit_turn` (mod `hit_every`): a step that logs a rotating
/// share of its hits keeps the clusters it keeps retrieving recent without resolving each of
/// them at every step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlaggedReads {
    /// Context id.
    pub context: u64,
    /// Layer index.
    pub layer: u32,
    /// `per_head` words per KV head, head after head: cluster `c` as `c` when the step read it
    /// wholly from the Gpu tier (a hit), as `!c` (that is −c−1) when it read a row of it from
    /// elsewhere (a miss).
    pub flagged: Vec<i32>,
    /// Words per KV head (the last head may be cut short by a short `flagged`).
    pub per_head: usize,
    /// Real clusters per KV head: ids at or past it are padding and skipped (a head with no
    /// entry has none).
    pub real: Vec<u32>,
    /// One in this many hits is applied (0 or 1: every hit).
    pub hit_every: u32,
    /// Which residue of the ids, mod `hit_every`, the applied hits have.
    pub hit_turn: u32,
}

impl FlaggedReads {
    /// The ids a round applies: per KV head, every real miss and the real hits of the sample,
    /// in the order flagged.
    pub fn resolve(&self) -> LayerReads {
        let every = self.hit_every.max(1);
        let turn = self.hit_turn % every;
        let per_head = if self.per_head == 0 {
            Vec::new()
        } else {
            self.flagged
                .chunks(self.per_head)
                .enumerate()
                .map(|(h, words)| {
                    let real = self.real.get(h).copied().unwrap_or(0);
                    words
                        .iter()
                        .filter_map(|&w| {
                            let (c, missed) = if w < 0 { (!w as u32, true) } else { (w as u32, false) };
                            (c < real && (missed || c % every == turn)).then_some(c)
                        })
                        .collect()
                })
                .collect()
        };
        LayerReads { context: self.context, layer: self.layer, per_head }
    }
}

/// One step's reads of one layer as queued: ids, or flagged words resolved by the round.
pub(super) enum StepReads {
    Ids(LayerReads),
    Flagged(FlaggedReads),
}

impl StepReads {
    pub(super) fn layer_key(&self) -> (u64, u32) {
        match self {
            StepReads::Ids(r) => (r.context, r.layer),
            StepReads::Flagged(r) => (r.context, r.layer),
        }
    }

    /// Records: ids logged, or every flagged cluster (before the round's sampling).
    pub(super) fn len(&self) -> usize {
        match self {
            StepReads::Ids(r) => r.per_head.iter().map(Vec::len).sum(),
            StepReads::Flagged(r) => r.flagged.len(),
        }
    }
}

/// A batch of cluster reads in the maintainer's queue.
pub(super) enum ClusterReads {
    /// Keys as logged ([`BufferManager::log_cluster_reads`]).
    Keys(Vec<ClusterKey>),
    /// Device steps' reads per layer ([`BufferManager::log_layer_reads`],
    /// [`BufferManager::log_flagged_reads`]).
    Layers(Vec<StepReads>),
}

impl ClusterReads {
    /// Clusters read (each counts as one record).
    pub(super) fn len(&self) -> usize {
        match self {
            ClusterReads::Keys(keys) => keys.len(),
            ClusterReads::Layers(layers) => layers.iter().map(StepReads::len).sum(),
        }
    }

    /// Appends the reads as keys.
    pub(super) fn append_to(self, out: &mut Vec<ClusterKey>) {
        match self {
            ClusterReads::Keys(keys) => out.extend(keys),
            ClusterReads::Layers(layers) => {
                for reads in layers {
                    let LayerReads { context, layer, per_head } = match reads {
                        StepReads::Ids(r) => r,
                        StepReads::Flagged(r) => r.resolve(),
                    };
                    for (head, ids) in per_head.into_iter().enumerate() {
                        let head = head as u32;
                        out.extend(ids.into_iter().map(|cluster| ClusterKey { context, layer, head, cluster }));
                    }
                }
            }
        }
    }
}
