//! The asynchronous maintainer: a background thread that drains the access-record queue
//! ([`BufferManager::maintain`]) — admitting missed blocks into the Gpu tier and evicting by
//! policy — so plans never wait for cache maintenance. A panic in it poisons the handle
//! (reported, not silently lost); dropping the handle stops and joins the thread.

use crate::BufferManager;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Handle of a running maintainer thread.
pub struct Maintainer {
    stop: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
    poisoned: Arc<AtomicBool>,
    processed: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl Maintainer {
    /// Starts the thread. It processes up to `batch` records per round and waits `idle`
    /// when the queue is empty (cut short when a device step logs its cluster reads, see
    /// [`BufferManager::log_cluster_reads`]).
    pub fn spawn(buffers: Arc<BufferManager>, batch: usize, idle: Duration) -> std::io::Result<Self> {
        Self::spawn_paced(buffers, batch, idle, Duration::ZERO)
    }

    /// [`Maintainer::spawn`] that also waits `pause` after every round that did work (cut short
    /// like the idle wait), which
    /// bounds the thread's share of the CPU and of the memory system (like a database's
    /// background writer with a delay per round): plans that run back to back then lose less
    /// to it, at the price of admitting misses later (records beyond what it keeps up with
    /// are dropped and counted, as for a full queue).
    pub fn spawn_paced(
        buffers: Arc<BufferManager>,
        batch: usize,
        idle: Duration,
        pause: Duration,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let paused = Arc::new(AtomicBool::new(false));
        let poisoned = Arc::new(AtomicBool::new(false));
        let processed = Arc::new(AtomicU64::new(0));
        let (s, p, n, halt) = (Arc::clone(&stop), Arc::clone(&poisoned), Arc::clone(&processed), Arc::clone(&paused));
        let thread = std::thread::Builder::new().name("attnstore-maintainer".into()).spawn(move || {
            buffers.set_waker(Some(std::thread::current()));
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // Relaxed: the flag carries no data; a late stop only costs one more round.
                while !s.load(Ordering::Relaxed) {
                    if halt.load(Ordering::Relaxed) {
                        std::thread::sleep(idle);
                        continue;
                    }
                    let done = buffers.maintain(batch);
                    n.fetch_add(done as u64, Ordering::Relaxed);
                    // Parked rather than asleep: a device step's cluster reads end the wait.
                    if done == 0 {
                        std::thread::park_timeout(idle);
                    } else if !pause.is_zero() {
                        std::thread::park_timeout(pause);
                    }
                }
            }));
            buffers.clear_waker(std::thread::current().id());
            if run.is_err() {
                p.store(true, Ordering::Relaxed);
            }
        })?;
        Ok(Self { stop, paused, poisoned, processed, thread: Some(thread) })
    }

    /// Pauses (`true`) or resumes (`false`) the maintenance rounds; the thread keeps
    /// running and checks again every `idle`. While paused, plans still log their accesses:
    /// records beyond the queue's capacity are dropped and counted, and the Gpu tier keeps
    /// what it holds. For latency-critical phases, and for measuring what maintenance costs
    /// the plans running beside it.
    pub fn set_paused(&self, paused: bool) {
        // Relaxed: the flag carries no data; a round already started finishes.
        self.paused.store(paused, Ordering::Relaxed);
    }

    /// Whether the maintenance rounds are paused.
    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::Relaxed)
    }

    /// Whether the thread died of a panic (the buffer manager still serves reads; nothing is
    /// admitted any more).
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Relaxed)
    }

    /// Access records processed so far.
    pub fn processed(&self) -> u64 {
        self.processed.load(Ordering::Relaxed)
    }

    /// Stops the thread and waits for it; returns whether it had panicked.
    pub fn stop(mut self) -> bool {
        self.shutdown();
        self.is_poisoned()
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            // End a wait in progress now rather than after its idle period.
            thread.thread().unpark();
            if thread.join().is_err() {
                self.poisoned.store(true, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for Maintainer {
    fn drop(&mut self) {
        self.shutdown();
    }
}
