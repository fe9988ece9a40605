//! Device reads: a GPU step that chooses its clusters on the device takes no pins, so it
//! holds a [`DeviceRead`] from before its launch until its results are back instead. A Gpu
//! slot given up while an older device read is in flight waits in a quarantine until every
//! read that could have seen it in the slot table has ended: epoch-based reclamation (as in
//! crossbeam-epoch), with a global epoch bumped each time a Gpu slot is given up.

use crate::arena::FramePool;
use parking_lot::Mutex;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The epochs of device reads and the quarantine of Gpu slots.
///
/// A slot given up at epoch `E` may be reused once no live read started before `E`: a read
/// that started at or after `E` registered after the slot's table entry was cleared on the
/// device (every entry naming a slot is cleared before the slot is given up), so its kernel
/// cannot find the slot through the table.
pub(crate) struct Epochs {
    state: Mutex<EpochState>,
    /// Slots in quarantine now (a copy of `state.quarantine.len()` for statistics).
    quarantined: AtomicUsize,
}

struct EpochState {
    /// Bumped each time a Gpu slot is given up.
    epoch: u64,
    /// Start epochs of the live device reads, with how many started at each.
    live: BTreeMap<u64, usize>,
    /// Slots given up while an older read was live, with the epoch they were given up at
    /// (ascending: pushed under the lock with the epoch just bumped).
    quarantine: VecDeque<(u32, u64)>,
}

impl Epochs {
    pub(crate) fn new() -> Self {
        Self {
            state: Mutex::new(EpochState { epoch: 0, live: BTreeMap::new(), quarantine: VecDeque::new() }),
            quarantined: AtomicUsize::new(0),
        }
    }

    /// Registers a device read starting now; returns its start epoch.
    fn begin(&self) -> u64 {
        let mut state = self.state.lock();
        let start = state.epoch;
        *state.live.entry(start).or_default() += 1;
        start
    }

    /// Ends the read that started at `start` and hands the slots no live read protects any
    /// more to `release` (the Gpu pool's free list).
    fn end(&self, start: u64, mut release: impl FnMut(u32)) {
        let mut state = self.state.lock();
        match state.live.get_mut(&start) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                state.live.remove(&start);
            }
            None => panic!("device read of epoch {start} ended twice"),
        }
        let oldest = state.live.keys().next().copied().unwrap_or(u64::MAX);
        while let Some(&(slot, given_up)) = state.quarantine.front() {
            if given_up > oldest {
                break;
            }
            state.quarantine.pop_front();
            release(slot);
        }
        // Relaxed: a statistic.
        self.quarantined.store(state.quarantine.len(), Ordering::Relaxed);
    }

    /// Gives up Gpu slot `slot` (its table entries are cleared, its owner is empty). Returns
    /// `true` when it may be reused at once (no live read started before now), `false` when
    /// it went into the quarantine (from where [`DeviceRead`]'s drop releases it).
    pub(crate) fn retire(&self, slot: u32) -> bool {
        let mut state = self.state.lock();
        state.epoch += 1;
        let given_up = state.epoch;
        match state.live.keys().next() {
            Some(&oldest) if oldest < given_up => {
                state.quarantine.push_back((slot, given_up));
                self.quarantined.store(state.quarantine.len(), Ordering::Relaxed);
                false
            }
            _ => true,
        }
    }

    /// Gpu slots in quarantine now.
    pub(crate) fn quarantined(&self) -> usize {
        self.quarantined.load(Ordering::Relaxed)
    }
}

/// A device read in flight (from [`BufferManager::device_read`](crate::BufferManager::device_read)).
///
/// Take it before launching a GPU step that reads the slot table
/// ([`BufferManager::device_slot_table`](crate::BufferManager::device_slot_table)) and the Gpu
/// tier, and drop it once the step's results are back. While it lives, no Gpu slot whose table
/// entry is cleared after it was taken is reused for another block, so every slot the step can
/// find through the table keeps its bytes. It takes no pins: admissions and evictions go on,
/// and a slot given up meanwhile is reused after the guard drops. `Send`: a step may be
/// collected on another thread.
#[must_use = "a device read protects the Gpu slots only while the guard is alive"]
pub struct DeviceRead<'a> {
    epochs: &'a Epochs,
    gpu: &'a FramePool,
    start: u64,
}

impl<'a> DeviceRead<'a> {
    pub(crate) fn new(epochs: &'a Epochs, gpu: &'a FramePool) -> Self {
        Self { epochs, gpu, start: epochs.begin() }
    }
}

impl Drop for DeviceRead<'_> {
    fn drop(&mut self) {
        self.epochs.end(self.start, |slot| self.gpu.release_slot(slot));
    }
}

impl std::fmt::Debug for DeviceRead<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRead").field("start_epoch", &self.start).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_given_up_during_an_older_read_waits_for_that_read_only() {
        let epochs = Epochs::new();
        assert!(epochs.retire(0), "no read in flight: reused at once");
        let old = epochs.begin();
        assert!(!epochs.retire(1), "given up after the old read started");
        let young = epochs.begin();
        assert!(!epochs.retire(2));
        assert_eq!(epochs.quarantined(), 2);
        let mut released = Vec::new();
        epochs.end(old, |slot| released.push(slot));
        assert_eq!(released, [1], "slot 2 was given up after the young read started");
        epochs.end(young, |slot| released.push(slot));
        assert_eq!(released, [1, 2]);
        assert_eq!(epochs.quarantined(), 0);
        assert!(epochs.retire(3));
    }

    #[test]
    fn the_bytes_of_a_quarantined_gpu_slot_stay_intact_until_the_read_ends() {
        use crate::{BufferConfig, BufferManager, ClusterKey, Error};
        let buffers = BufferManager::new(BufferConfig::new(16, 2)).unwrap();
        let blocks: Vec<_> = (0..4u8)
            .map(|c| {
                let key = ClusterKey { context: 1, layer: 0, head: 0, cluster: u32::from(c) };
                buffers.store_cluster(key, &[c + 1; 2048]).unwrap()[0]
            })
            .collect();
        let slots = [buffers.admit(blocks[0]).unwrap(), buffers.admit(blocks[1]).unwrap()];
        let bytes_of = |slot: u32| buffers.gpu_pool().lock(slot).expect("an unpinned slot").bytes().to_vec();
        let before = slots.map(bytes_of);
        assert_eq!((before[0][0], before[1][0]), (1, 2));
        let read = buffers.device_read();
        // Both admissions evict a victim (LRU: blocks 0, then 1) and cannot reuse it.
        assert_eq!(buffers.admit(blocks[2]), Err(Error::DeviceReadsInFlight { quarantined_blocks: 1 }));
        assert_eq!(buffers.admit(blocks[3]), Err(Error::DeviceReadsInFlight { quarantined_blocks: 2 }));
        assert_eq!(slots.map(bytes_of), before, "an evicted slot keeps its bytes while the read lives");
        drop(read);
        let reused = buffers.admit(blocks[2]).unwrap();
        assert!(slots.contains(&reused));
        assert_eq!(bytes_of(reused)[0], 3, "reused after the read ended");
    }

    #[test]
    fn reads_started_at_the_same_epoch_all_protect_until_the_last_ends() {
        let epochs = Epochs::new();
        let (a, b) = (epochs.begin(), epochs.begin());
        assert_eq!(a, b);
        assert!(!epochs.retire(5));
        let mut released = Vec::new();
        epochs.end(a, |slot| released.push(slot));
        assert!(released.is_empty());
        epochs.end(b, |slot| released.push(slot));
        assert_eq!(released, [5]);
    }
}
