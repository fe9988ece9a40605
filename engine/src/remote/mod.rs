//! The remote tier: contexts shared between engines through a distributed key-value store
//! (Redis / Redis Cluster), so a prompt prefilled on one node is attached on another
//! instead of computed again (`docs/remote.md`).
//!
//! [`RemoteTier::publish`] queues a context's KV (whole chunks of
//! [`RemoteConfig::chunk_tokens`] tokens, per layer, in the context's element type) and its
//! index layouts for a background thread that writes what the store does not hold yet;
//! [`RemoteTier::attach`] finds the longest published prefix of a token sequence, checks
//! every value it reads, and builds a context from it with the published layouts, so
//! nothing is clustered or trained again. A value that is missing, stale, truncated or
//! corrupt ends the reusable prefix where it is (the caller prefills the rest); a store that
//! fails or is slow costs a bounded wait, never a wrong answer or a blocked decode step.
//! Keys and values: `keys.rs`, `value.rs`.

mod attach;
mod keys;
mod publish;
mod stats;
mod store;
mod value;

pub use attach::Attached;
pub use keys::ModelId;
pub use stats::RemoteStats;
pub use store::{MemoryStore, RemoteError, RemoteErrorKind, RemoteStore};
pub use value::Fault;

use crate::error::{Error, Result};
use parking_lot::{Condvar, Mutex};
use stats::Counters;
use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One layer's KV as `(keys, values)`, each `kv_heads × tokens × head_dim` f32 (what
/// [`crate::Engine::prefill`] takes).
pub type LayerKv = (Vec<f32>, Vec<f32>);

/// Settings of a [`RemoteTier`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteConfig {
    /// Prefix of every key (several deployments can share one store under different ones).
    pub namespace: String,
    /// Tokens per chunk: the unit of reuse (a prefix is reused in whole chunks) and of
    /// storage (one value per chunk and layer: 256 tokens of SmolLM2's 3 × 64 f16 KV are
    /// 197 KB).
    pub chunk_tokens: usize,
    /// Publishes waiting for the background writer at most; a publish into a full queue
    /// drops the oldest waiting one (counted in [`RemoteStats::publishes_dropped`]).
    pub queue_publishes: usize,
    /// Values per store call (a pipeline).
    pub values_per_call: usize,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        Self { namespace: "attnstore".into(), chunk_tokens: 256, queue_publishes: 4, values_per_call: 64 }
    }
}

impl RemoteConfig {
    fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::InvalidSpec(format!("remote tier: {what}")));
        if self.chunk_tokens == 0 || self.chunk_tokens > 1 << 20 {
            return bad(&format!("chunk_tokens {} must be in 1..=1048576", self.chunk_tokens));
        }
        if self.queue_publishes == 0 || self.values_per_call == 0 {
            return bad("queue_publishes and values_per_call must be at least 1");
        }
        if self.namespace.is_empty() || self.namespace.contains(|c: char| c.is_whitespace() || c == ':') {
            return bad(&format!("namespace {:?} must be non-empty, without spaces or ':'", self.namespace));
        }
        Ok(())
    }
}

/// State shared by the tier's handle and its background writer.
pub(crate) struct Shared {
    pub store: Arc<dyn RemoteStore>,
    pub config: RemoteConfig,
    pub counters: Counters,
    /// Publishes waiting, oldest first, and whether the writer is busy with one.
    queue: Mutex<(VecDeque<publish::Job>, bool)>,
    /// Signals new work, an idle writer, and shutdown.
    changed: Condvar,
    shutdown: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// Runs one store call, timing it and counting its failure.
    pub fn call<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&dyn RemoteStore) -> std::result::Result<T, RemoteError>,
    ) -> std::result::Result<T, RemoteError> {
        let start = Instant::now();
        let out = f(&*self.store);
        self.counters.call(op, start.elapsed());
        if let Err(e) = &out {
            self.counters.failure(e.kind);
            tracing::debug!(op, error = %e, "remote call failed");
        }
        out
    }

    pub fn stopping(&self) -> bool {
        self.shutdown.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A remote tier over a [`RemoteStore`]: publishes contexts in the background and attaches
/// published prefixes. Dropping it stops the writer after its current store call
/// (queued publishes are not written: [`RemoteTier::flush`] first to wait for them).
pub struct RemoteTier {
    shared: Arc<Shared>,
    writer: Option<JoinHandle<()>>,
}

impl RemoteTier {
    /// A tier over `store`, with its background writer started.
    pub fn new(store: Arc<dyn RemoteStore>, config: RemoteConfig) -> Result<Self> {
        config.validate()?;
        let shared = Arc::new(Shared {
            store,
            config,
            counters: Counters::default(),
            queue: Mutex::new((VecDeque::new(), false)),
            changed: Condvar::new(),
            shutdown: false.into(),
        });
        let worker = Arc::clone(&shared);
        let writer = std::thread::Builder::new()
            .name("attnstore-remote".into())
            .spawn(move || publish::run(&worker))
            .map_err(|e| Error::InvalidSpec(format!("remote tier: cannot start its writer thread: {e}")))?;
        Ok(Self { shared, writer: Some(writer) })
    }

    /// The tier's settings.
    pub fn config(&self) -> &RemoteConfig {
        &self.shared.config
    }

    /// Where the store is.
    pub fn describe(&self) -> String {
        self.shared.store.describe()
    }

    /// The counters so far.
    pub fn stats(&self) -> RemoteStats {
        self.shared.counters.snapshot()
    }

    /// Waits up to `timeout` until every queued publish is written (or has failed); whether
    /// the queue is empty and the writer idle.
    pub fn flush(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut q = self.shared.queue.lock();
        while !q.0.is_empty() || q.1 {
            if self.shared.changed.wait_until(&mut q, deadline).timed_out() {
                return q.0.is_empty() && !q.1;
            }
        }
        true
    }

    /// Queues `job`, dropping the oldest waiting publish when the queue is full.
    fn enqueue(&self, job: publish::Job) {
        let mut q = self.shared.queue.lock();
        if q.0.len() >= self.shared.config.queue_publishes {
            q.0.pop_front();
            stats::add(&self.shared.counters.publishes_dropped, 1);
            metrics::counter!("attnstore_remote_publishes_dropped_total").increment(1);
        }
        q.0.push_back(job);
        stats::add(&self.shared.counters.publishes_queued, 1);
        self.shared.changed.notify_all();
    }
}

impl Drop for RemoteTier {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, std::sync::atomic::Ordering::SeqCst);
        {
            let _q = self.shared.queue.lock();
            self.shared.changed.notify_all();
        }
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}
