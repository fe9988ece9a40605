//! What the remote tier needs of a distributed store: moving opaque, already checksummed
//! byte values by key, many keys per round trip, with bounded waits. The Redis / Redis
//! Cluster implementation lives in its own crate (`attnstore-remote`) so the engine pulls in
//! no network client; [`MemoryStore`] is an in-process store with fault injection for tests.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// How a remote call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RemoteErrorKind {
    /// The call did not finish within its bound (a slow or stopped server).
    Timeout,
    /// No connection could be made, or it broke (the server is down or restarting).
    Connection,
    /// The server answered something unexpected or refused the command (out of memory,
    /// cluster slots moving, a wrong type).
    Server,
}

impl RemoteErrorKind {
    /// Name in metrics and reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Connection => "connection",
            Self::Server => "server",
        }
    }
}

/// A failed remote call: its kind and the store's own message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("remote store {kind:?}: {message}")]
pub struct RemoteError {
    /// What went wrong.
    pub kind: RemoteErrorKind,
    /// The store's description of it.
    pub message: String,
}

impl RemoteError {
    /// An error of `kind` saying `message`.
    pub fn new(kind: RemoteErrorKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into() }
    }
}

/// A key-value store the remote tier publishes to and attaches from.
///
/// Contract: values are opaque bytes (the tier checksums them itself, so a store may lose,
/// truncate or evict any value: the tier detects it); every call returns within the store's
/// configured timeout, with [`RemoteErrorKind::Timeout`] when it did not finish; a store
/// whose server restarted reconnects on a later call by itself. Calls may come from several
/// threads at once.
pub trait RemoteStore: Send + Sync {
    /// Where the store is, for reports (e.g. `redis://127.0.0.1:6379`, `cluster of 6 nodes`).
    fn describe(&self) -> String;
    /// The values of `keys`, in order; `None` for a key that holds nothing.
    fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>, RemoteError>;
    /// Which of `keys` hold a value, in order.
    fn exists_many(&self, keys: &[String]) -> Result<Vec<bool>, RemoteError>;
    /// Stores every `(key, value)`, replacing what was there.
    fn set_many(&self, entries: &[(String, Vec<u8>)]) -> Result<(), RemoteError>;
}

/// An in-process [`RemoteStore`] for tests: a map, with failures and delays to inject.
#[derive(Debug, Default)]
pub struct MemoryStore {
    values: Mutex<HashMap<String, Vec<u8>>>,
    /// While set, every call fails with [`RemoteErrorKind::Connection`].
    down: AtomicBool,
    /// Delay added to every call, in microseconds.
    delay_us: AtomicU64,
    /// Calls made (get, exists, set).
    calls: AtomicU64,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes every call fail (`true`, a stopped server) or work again (`false`).
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// Delays every later call by `delay` (a slow server).
    pub fn set_delay(&self, delay: Duration) {
        self.delay_us.store(delay.as_micros() as u64, Ordering::SeqCst);
    }

    /// Every key stored, sorted.
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.values.lock().keys().cloned().collect();
        keys.sort();
        keys
    }

    /// The value of `key`, if any.
    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        self.values.lock().get(key).cloned()
    }

    /// Replaces the value of `key` (e.g. with a corrupted copy).
    pub fn put(&self, key: &str, value: Vec<u8>) {
        self.values.lock().insert(key.to_owned(), value);
    }

    /// Deletes `key`; whether it held a value.
    pub fn delete(&self, key: &str) -> bool {
        self.values.lock().remove(key).is_some()
    }

    /// Deletes everything (a server restarted empty).
    pub fn clear(&self) {
        self.values.lock().clear();
    }

    /// Calls made so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    fn enter(&self) -> Result<(), RemoteError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let delay = self.delay_us.load(Ordering::SeqCst);
        if delay > 0 {
            std::thread::sleep(Duration::from_micros(delay));
        }
        if self.down.load(Ordering::SeqCst) {
            return Err(RemoteError::new(RemoteErrorKind::Connection, "memory store is down"));
        }
        Ok(())
    }
}

impl RemoteStore for MemoryStore {
    fn describe(&self) -> String {
        "in-process memory store".into()
    }

    fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>, RemoteError> {
        self.enter()?;
        let values = self.values.lock();
        Ok(keys.iter().map(|k| values.get(k).cloned()).collect())
    }

    fn exists_many(&self, keys: &[String]) -> Result<Vec<bool>, RemoteError> {
        self.enter()?;
        let values = self.values.lock();
        Ok(keys.iter().map(|k| values.contains_key(k)).collect())
    }

    fn set_many(&self, entries: &[(String, Vec<u8>)]) -> Result<(), RemoteError> {
        self.enter()?;
        let mut values = self.values.lock();
        for (k, v) in entries {
            values.insert(k.clone(), v.clone());
        }
        Ok(())
    }
}
