//! The log writer: appends record frames to rotating log files with group commit.
//!
//! Appenders put their frame into a shared pending buffer and wait. The first waiter that
//! finds no flush running becomes the *leader*: it takes everything pending, writes it with
//! one write call, syncs it with one fsync (policy permitting) and wakes the others; whoever
//! arrived meanwhile forms the next group. An append returns its log sequence number (LSN)
//! only once its bytes are durable under the [`SyncPolicy`]. A failed write or fsync poisons
//! the writer: every waiter and every later call gets [`Error::Poisoned`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::record::{encode_unsealed, seal_frame};
use crate::replay::LogReplay;
use crate::storage::{Storage, StorageFile};
use crate::{Error, FileHeader, FileIdentity, RecordKind, FRAME_HEADER_BYTES};

/// Log sequence number: the position of a record in the log, counting from 1 over the
/// whole life of a directory (log file names carry the LSN of their first record).
pub type Lsn = u64;

/// When appended records are made durable, and so when an append returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncPolicy {
    /// fsync before acknowledging: an acknowledged record survives power loss. Concurrent
    /// appenders share one fsync (group commit).
    EveryBatch,
    /// Acknowledge once the bytes are written to the OS; a background thread fsyncs every
    /// interval. A process crash loses nothing acknowledged, power loss up to one interval.
    Interval(Duration),
    /// Acknowledge once written to the OS and never fsync except at rotation, checkpoints and
    /// [`LogWriter::sync`]. Survives process crashes, not power loss.
    None,
}

/// Settings of a [`LogWriter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterConfig {
    /// When records become durable.
    pub policy: SyncPolicy,
    /// A new log file is started once the current one holds this many bytes; each file is
    /// created with this length (sparse, zero-filled), so a crash never leaves it shorter.
    pub max_file_bytes: u64,
}

impl Default for WriterConfig {
    fn default() -> Self {
        Self { policy: SyncPolicy::EveryBatch, max_file_bytes: 64 << 20 }
    }
}

/// Counters of a writer, for benches and reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriterStats {
    /// Records appended.
    pub records: u64,
    /// Group writes (one write call each).
    pub writes: u64,
    /// fsyncs of log files (data-file syncs not counted).
    pub syncs: u64,
    /// Frame bytes written.
    pub bytes: u64,
}

/// Name of the log file whose first record has `first_lsn`: `wal-<20 digits>.log`, so that
/// names sort in log order.
pub fn log_file_name(first_lsn: Lsn) -> String {
    format!("wal-{first_lsn:020}.log")
}

/// The first LSN named by a log file name, `None` for other names.
pub fn parse_log_file_name(name: &str) -> Option<Lsn> {
    let digits = name.strip_prefix("wal-")?.strip_suffix(".log")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Group-commit writer of one log directory. Cheap to share: all methods take `&self`.
pub struct LogWriter {
    shared: Arc<Shared>,
    flusher: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    dir: PathBuf,
    /// The engine directory's id: in every file header and every frame checksum.
    dir_id: u64,
    storage: Arc<dyn Storage>,
    config: WriterConfig,
    state: Mutex<State>,
    /// Woken when a flush ends (followers) or the writer closes (flusher).
    wake: Condvar,
}

struct State {
    pending: Vec<u8>,
    /// Files whose bytes must be durable before the pending records are written.
    pending_deps: Vec<Arc<dyn StorageFile>>,
    /// Dependencies of records already written but not yet synced (non-durable policies).
    unsynced_deps: Vec<Arc<dyn StorageFile>>,
    next_lsn: Lsn,
    /// Every record below this LSN has been handed to the OS.
    written_end: Lsn,
    /// Every record below this LSN is durable.
    durable_end: Lsn,
    leader: bool,
    file: Arc<dyn StorageFile>,
    file_first_lsn: Lsn,
    file_bytes: u64,
    poisoned: Option<String>,
    closed: bool,
    stats: WriterStats,
}

impl State {
    fn usable(&self) -> Result<(), Error> {
        if let Some(cause) = &self.poisoned {
            return Err(Error::Poisoned { cause: cause.clone() });
        }
        if self.closed {
            return Err(Error::Closed);
        }
        Ok(())
    }
}

fn push_dep(deps: &mut Vec<Arc<dyn StorageFile>>, dep: Arc<dyn StorageFile>) {
    if !deps.iter().any(|d| Arc::ptr_eq(d, &dep)) {
        deps.push(dep);
    }
}

/// fsyncs every file, concurrently when there are several (the device overlaps them).
fn sync_all(files: &[Arc<dyn StorageFile>]) -> std::io::Result<()> {
    match files {
        [] => Ok(()),
        [one] => one.sync_data(),
        [first, rest @ ..] => std::thread::scope(|s| {
            let others: Vec<_> = rest.iter().map(|f| s.spawn(move || f.sync_data())).collect();
            let mut result = first.sync_data();
            for handle in others {
                let synced = handle.join().unwrap_or_else(|_| Err(std::io::Error::other("fsync thread panicked")));
                result = result.and(synced);
            }
            result
        }),
    }
}

/// The metrics of one group flush (`docs/observability.md`): its records and bytes, whether
/// it ended in an fsync, and the records appended but not yet durable after it (the log's lag).
fn record_group(records: u64, bytes: usize, durable: bool, unsynced: u64) {
    if records > 0 {
        metrics::histogram!("attnstore_wal_group_records").record(records as f64);
        metrics::histogram!("attnstore_wal_group_bytes").record(bytes as f64);
    }
    if durable {
        metrics::counter!("attnstore_wal_fsyncs_total").increment(1);
    }
    metrics::gauge!("attnstore_wal_unsynced_records").set(unsynced as f64);
}

/// Queued bytes at which [`LogWriter::submit`] writes them out (without fsync) itself.
pub const SUBMIT_WRITE_BYTES: usize = 4 << 20;

/// Creates log file `first_lsn` in `dir`: its header, its length set to `reserved_bytes`
/// (zero-filled, sparse), synced under a temporary name and then renamed, directory synced.
/// A log file is therefore never seen without its whole header and length, and a shorter
/// one was cut after it was made.
fn create_log_file(
    storage: &dyn Storage,
    dir: &Path,
    dir_id: u64,
    first_lsn: Lsn,
    reserved_bytes: u64,
) -> Result<Arc<dyn StorageFile>, Error> {
    let path = dir.join(log_file_name(first_lsn));
    let tmp = dir.join(format!("{}.tmp", log_file_name(first_lsn)));
    let reserved_bytes = reserved_bytes.max(FileHeader::SIZE as u64);
    let header = FileHeader::new(FileIdentity::log(dir_id, first_lsn), reserved_bytes);
    let file = storage.create(&tmp).map_err(|e| Error::io("create", &tmp, &e))?;
    file.write_all_at(&header.encode(), 0).map_err(|e| Error::io("write", &tmp, &e))?;
    file.set_len(reserved_bytes).map_err(|e| Error::io("extend", &tmp, &e))?;
    file.sync_data().map_err(|e| Error::io("fsync", &tmp, &e))?;
    storage.rename(&tmp, &path).map_err(|e| Error::io("rename", &tmp, &e))?;
    storage.sync_dir(dir).map_err(|e| Error::io("fsync dir", dir, &e))?;
    Ok(file)
}

/// Where a writer starts: the file it writes to and the position in it.
struct Start {
    file: Arc<dyn StorageFile>,
    file_first_lsn: Lsn,
    file_bytes: u64,
    next_lsn: Lsn,
}

impl LogWriter {
    /// Starts a new log file in `dir` (of the engine directory `dir_id`) whose first record
    /// will get `first_lsn`, and the background flusher for [`SyncPolicy::Interval`].
    pub fn create(
        dir: &Path,
        storage: Arc<dyn Storage>,
        config: WriterConfig,
        dir_id: u64,
        first_lsn: Lsn,
    ) -> Result<LogWriter, Error> {
        let file = create_log_file(&*storage, dir, dir_id, first_lsn, config.max_file_bytes)?;
        let start = Start { file, file_first_lsn: first_lsn, file_bytes: FileHeader::SIZE as u64, next_lsn: first_lsn };
        Self::start(dir, storage, config, dir_id, start)
    }

    /// Continues the log that `replay` read from `dir` (already [repaired](LogReplay::repair)):
    /// appends go on in its newest file after the last whole record, so reopening does not
    /// leave a file behind each time; a new file is started only where there is none.
    pub fn resume(
        dir: &Path,
        storage: Arc<dyn Storage>,
        config: WriterConfig,
        dir_id: u64,
        replay: &LogReplay,
    ) -> Result<LogWriter, Error> {
        crate::replay::remove_unfinished_files(dir)?;
        let Some(last) = replay.files.last().filter(|last| last.end > 0) else {
            return Self::create(dir, storage, config, dir_id, replay.next_lsn);
        };
        let file = storage.open(&last.path).map_err(|e| Error::io("open", &last.path, &e))?;
        let start = Start { file, file_first_lsn: last.first_lsn, file_bytes: last.end, next_lsn: replay.next_lsn };
        Self::start(dir, storage, config, dir_id, start)
    }

    fn start(
        dir: &Path,
        storage: Arc<dyn Storage>,
        config: WriterConfig,
        dir_id: u64,
        start: Start,
    ) -> Result<LogWriter, Error> {
        let state = State {
            pending: Vec::new(),
            pending_deps: Vec::new(),
            unsynced_deps: Vec::new(),
            next_lsn: start.next_lsn,
            written_end: start.next_lsn,
            durable_end: start.next_lsn,
            leader: false,
            file: start.file,
            file_first_lsn: start.file_first_lsn,
            file_bytes: start.file_bytes,
            poisoned: None,
            closed: false,
            stats: WriterStats::default(),
        };
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            dir_id,
            storage,
            config,
            state: Mutex::new(state),
            wake: Condvar::new(),
        });
        let flusher = match config.policy {
            SyncPolicy::Interval(every) => {
                let shared = shared.clone();
                let handle = std::thread::Builder::new()
                    .name("attnstore-wal-flusher".into())
                    .spawn(move || shared.flush_every(every))
                    .map_err(|e| Error::io("spawn flusher for", dir, &e))?;
                Some(handle)
            }
            _ => None,
        };
        Ok(LogWriter { shared, flusher: Mutex::new(flusher) })
    }

    /// Appends one record and returns its LSN once it is durable under the policy.
    pub fn append(&self, kind: RecordKind, payload: &[u8]) -> Result<Lsn, Error> {
        self.append_after(kind, payload, None)
    }

    /// Appends one record that refers to bytes in another file (`dependency`, e.g. a KV data
    /// file): under [`SyncPolicy::EveryBatch`] that file is fsynced before the record is
    /// written, so a durable record never points at data that is not.
    pub fn append_after(
        &self,
        kind: RecordKind,
        payload: &[u8],
        dependency: Option<Arc<dyn StorageFile>>,
    ) -> Result<Lsn, Error> {
        let (mut st, lsn) = self.enqueue(kind, payload, dependency)?;
        let durable = self.shared.config.policy == SyncPolicy::EveryBatch;
        self.shared.commit(&mut st, lsn + 1, durable)?;
        Ok(lsn)
    }

    /// Queues one record and returns its LSN at once, without waiting for any write or
    /// fsync: the pipelined form of [`LogWriter::append_after`], for a caller that keeps
    /// several records in flight and is acknowledged later by [`LogWriter::wait_durable`].
    /// A submitted record is **not acknowledged** until then: a crash may lose it (and
    /// every later one), never an earlier acknowledged one. Queued bytes beyond
    /// [`SUBMIT_WRITE_BYTES`] are written out (without fsync) by the submitting thread, so
    /// memory stays bounded whoever waits.
    pub fn submit(
        &self,
        kind: RecordKind,
        payload: &[u8],
        dependency: Option<Arc<dyn StorageFile>>,
    ) -> Result<Lsn, Error> {
        let (mut st, lsn) = self.enqueue(kind, payload, dependency)?;
        if st.pending.len() >= SUBMIT_WRITE_BYTES && !st.leader {
            self.shared.lead(&mut st, false, false);
            st.usable()?;
        }
        Ok(lsn)
    }

    /// Waits until record `lsn` and every record before it are durable (written and
    /// fsynced, with the data files they depend on), whatever the sync policy; concurrent
    /// waiters share one group flush. An LSN not handed out yet is a typed error.
    pub fn wait_durable(&self, lsn: Lsn) -> Result<(), Error> {
        let mut st = self.shared.state.lock();
        if lsn >= st.next_lsn {
            return Err(Error::UnknownLsn { lsn, next: st.next_lsn });
        }
        self.shared.commit(&mut st, lsn + 1, true)
    }

    /// Frames `payload` and queues it under the lock (returned held), with its LSN.
    fn enqueue(
        &self,
        kind: RecordKind,
        payload: &[u8],
        dependency: Option<Arc<dyn StorageFile>>,
    ) -> Result<(MutexGuard<'_, State>, Lsn), Error> {
        let mut frame = Vec::with_capacity(FRAME_HEADER_BYTES + payload.len());
        encode_unsealed(kind, payload, &mut frame)?;
        let mut st = self.shared.state.lock();
        st.usable()?;
        let lsn = st.next_lsn;
        st.next_lsn += 1;
        // Bound to its LSN: a frame is valid at its place in the log only.
        seal_frame(&mut frame, self.shared.dir_id, lsn);
        st.pending.extend_from_slice(&frame);
        st.stats.records += 1;
        if let Some(dep) = dependency {
            push_dep(&mut st.pending_deps, dep);
        }
        Ok((st, lsn))
    }

    /// Makes every record appended so far durable (whatever the policy) and returns the LSN
    /// the next record will get.
    pub fn sync(&self) -> Result<Lsn, Error> {
        let mut st = self.shared.state.lock();
        let end = st.next_lsn;
        self.shared.commit(&mut st, end, true)?;
        Ok(end)
    }

    /// Makes everything durable and starts a new log file; returns its first LSN. Every
    /// record below it lies in older files, which a checkpoint may then delete.
    pub fn rotate(&self) -> Result<Lsn, Error> {
        let mut st = self.shared.state.lock();
        let end = st.next_lsn;
        self.shared.commit(&mut st, end, true)?;
        while st.leader {
            self.shared.wake.wait(&mut st);
        }
        st.usable()?;
        self.shared.lead(&mut st, true, true);
        st.usable()?;
        Ok(st.file_first_lsn)
    }

    /// Deletes the log files that hold only records below `lsn` (never the current file)
    /// and syncs the directory; returns how many were deleted.
    pub fn remove_files_before(&self, lsn: Lsn) -> Result<usize, Error> {
        let current = self.shared.state.lock().file_first_lsn;
        let files = crate::replay::list_log_files(&self.shared.dir)?;
        let mut removed = 0;
        for pair in files.windows(2) {
            let ((first, path), (next_first, _)) = (&pair[0], &pair[1]);
            if *next_first <= lsn && *first != current {
                std::fs::remove_file(path).map_err(|e| Error::io("remove", path, &e))?;
                removed += 1;
            }
        }
        if removed > 0 {
            let dir = &self.shared.dir;
            self.shared.storage.sync_dir(dir).map_err(|e| Error::io("fsync dir", dir, &e))?;
        }
        Ok(removed)
    }

    /// The LSN the next record will get.
    pub fn next_lsn(&self) -> Lsn {
        self.shared.state.lock().next_lsn
    }

    /// Every record below this LSN is durable.
    pub fn durable_end(&self) -> Lsn {
        self.shared.state.lock().durable_end
    }

    /// The writer's counters.
    pub fn stats(&self) -> WriterStats {
        self.shared.state.lock().stats
    }

    /// The poisoning failure, if an earlier write or fsync failed.
    pub fn poisoned(&self) -> Option<String> {
        self.shared.state.lock().poisoned.clone()
    }

    /// Syncs what was written (unless poisoned), stops the flusher and refuses later appends.
    pub fn close(&self) -> Result<(), Error> {
        let synced = {
            let mut st = self.shared.state.lock();
            let end = st.next_lsn;
            let synced =
                if st.poisoned.is_none() && !st.closed { self.shared.commit(&mut st, end, true) } else { Ok(()) };
            st.closed = true;
            self.shared.wake.notify_all();
            synced
        };
        if let Some(handle) = self.flusher.lock().take() {
            // A panic of the flusher thread already poisoned nothing it could have reported.
            let _ = handle.join();
        }
        synced
    }
}

impl Drop for LogWriter {
    fn drop(&mut self) {
        // Best effort: a caller that needs to know calls `close` itself.
        let _ = self.close();
    }
}

impl Shared {
    /// Waits until every record below `end` is written (or durable, if `durable`), leading a
    /// group flush whenever none is running.
    fn commit(&self, st: &mut MutexGuard<'_, State>, end: Lsn, durable: bool) -> Result<(), Error> {
        let started = Instant::now();
        loop {
            if let Some(cause) = &st.poisoned {
                return Err(Error::Poisoned { cause: cause.clone() });
            }
            let reached = if durable { st.durable_end >= end } else { st.written_end >= end };
            if reached {
                // What a committer waited for its records to be durable (or written).
                metrics::histogram!("attnstore_wal_commit_wait_seconds", "durable" => if durable { "true" } else { "false" })
                    .record(started.elapsed().as_secs_f64());
                return Ok(());
            }
            if st.leader {
                self.wake.wait(st);
            } else {
                self.lead(st, durable, false);
            }
        }
    }

    /// One group flush, run by the caller as leader with the lock released during I/O:
    /// rotate if the file is full (or `force_rotate`), sync dependencies, write everything
    /// pending, fsync if `durable`. Failures poison the writer.
    fn lead(&self, st: &mut MutexGuard<'_, State>, durable: bool, force_rotate: bool) {
        st.leader = true;
        let batch = std::mem::take(&mut st.pending);
        let _span = tracing::trace_span!("wal_group", bytes = batch.len(), durable).entered();
        let mut deps = std::mem::take(&mut st.pending_deps);
        if durable {
            for dep in std::mem::take(&mut st.unsynced_deps) {
                push_dep(&mut deps, dep);
            }
        }
        let batch_end = st.next_lsn;
        let first_lsn = st.written_end;
        let rotate = force_rotate || (!batch.is_empty() && st.file_bytes >= self.config.max_file_bytes);
        let (old_file, old_first, file_bytes) = (st.file.clone(), st.file_first_lsn, st.file_bytes);
        let outcome = MutexGuard::unlocked(st, || -> Result<(Arc<dyn StorageFile>, u64, bool), Error> {
            let (file, mut offset, new_file) = if rotate {
                // A finished file is synced whatever the policy: only the newest file may end torn.
                let old_path = self.dir.join(log_file_name(old_first));
                old_file.sync_data().map_err(|e| Error::io("fsync", &old_path, &e))?;
                let reserved = self.config.max_file_bytes;
                (
                    create_log_file(&*self.storage, &self.dir, self.dir_id, first_lsn, reserved)?,
                    FileHeader::SIZE as u64,
                    true,
                )
            } else {
                (old_file, file_bytes, false)
            };
            let path = || self.dir.join(log_file_name(if new_file { first_lsn } else { old_first }));
            if durable {
                // Data before the records that make it visible; several files sync in parallel.
                sync_all(&deps).map_err(|e| Error::io("fsync data file for", path(), &e))?;
            }
            if !batch.is_empty() {
                let started = Instant::now();
                file.write_all_at(&batch, offset).map_err(|e| Error::io("write", path(), &e))?;
                metrics::histogram!("attnstore_wal_write_seconds").record(started.elapsed().as_secs_f64());
                offset += batch.len() as u64;
            }
            if durable {
                let started = Instant::now();
                file.sync_data().map_err(|e| Error::io("fsync", path(), &e))?;
                metrics::histogram!("attnstore_wal_fsync_seconds").record(started.elapsed().as_secs_f64());
            }
            Ok((file, offset, new_file))
        });
        st.leader = false;
        match outcome {
            Ok((file, offset, new_file)) => {
                if new_file {
                    st.file = file;
                    st.file_first_lsn = first_lsn;
                }
                st.file_bytes = offset;
                st.written_end = batch_end;
                st.stats.bytes += batch.len() as u64;
                st.stats.writes += u64::from(!batch.is_empty());
                if durable {
                    st.durable_end = batch_end;
                    st.stats.syncs += 1;
                } else {
                    for dep in deps {
                        push_dep(&mut st.unsynced_deps, dep);
                    }
                }
                record_group(batch_end - first_lsn, batch.len(), durable, st.next_lsn - st.durable_end);
            }
            Err(error) => {
                let op = match &error {
                    Error::Io { op, .. } => *op,
                    _ => "other",
                };
                metrics::counter!("attnstore_wal_failures_total", "op" => op).increment(1);
                st.poisoned = Some(error.to_string());
            }
        }
        self.wake.notify_all();
    }

    /// Body of the [`SyncPolicy::Interval`] flusher thread.
    fn flush_every(&self, every: Duration) {
        let mut st = self.state.lock();
        let mut deadline = Instant::now() + every;
        loop {
            // The condvar also wakes after every group flush; only a passed deadline syncs.
            let _ = self.wake.wait_until(&mut st, deadline);
            if st.closed || st.poisoned.is_some() {
                return;
            }
            if Instant::now() < deadline {
                continue;
            }
            deadline = Instant::now() + every;
            let end = st.written_end;
            if st.durable_end < end {
                // An error poisons the writer; appenders see it on their next call.
                let _ = self.commit(&mut st, end, true);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{FaultyStorage, StdStorage};

    const DIR_ID: u64 = 0xd0d0;

    fn replay_dir(dir: &Path, from: Lsn) -> Result<crate::LogReplay, Error> {
        crate::replay_dir(dir, DIR_ID, from, crate::RecoveryMode::Strict)
    }

    fn tempdir() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    fn writer(dir: &Path, policy: SyncPolicy, max_file_bytes: u64) -> LogWriter {
        LogWriter::create(dir, Arc::new(StdStorage), WriterConfig { policy, max_file_bytes }, DIR_ID, 1).unwrap()
    }

    #[test]
    fn log_file_names_sort_in_lsn_order_and_parse_back() {
        assert_eq!(parse_log_file_name(&log_file_name(42)), Some(42));
        assert!(log_file_name(9) < log_file_name(10));
        assert_eq!(parse_log_file_name("wal-1.log"), None);
        assert_eq!(parse_log_file_name("MANIFEST"), None);
    }

    #[test]
    fn concurrent_appenders_get_distinct_lsns_and_share_fsyncs() {
        let dir = tempdir();
        let log = writer(dir.path(), SyncPolicy::EveryBatch, 1 << 20);
        let lsns: Vec<Lsn> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8u8)
                .map(|t| {
                    let log = &log;
                    s.spawn(move || {
                        (0..50).map(|i| log.append(RecordKind::AppendKv, &[t, i]).unwrap()).collect::<Vec<_>>()
                    })
                })
                .collect();
            handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        let mut sorted = lsns.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (1..=400).collect::<Vec<_>>());
        let stats = log.stats();
        assert_eq!(stats.records, 400);
        assert!(stats.syncs <= 400, "{stats:?}");
        assert_eq!(log.durable_end(), 401);
        assert_each_thread_in_order(dir.path(), 8, 50);
    }

    /// Replays `dir`: `threads` × `per_thread` records `[thread, i]`, no torn tail, and each
    /// thread's records in its own order.
    fn assert_each_thread_in_order(dir: &Path, threads: u8, per_thread: u8) {
        let replay = replay_dir(dir, 1).unwrap();
        assert_eq!(replay.records.len(), usize::from(threads) * usize::from(per_thread));
        assert!(replay.torn.is_none());
        for t in 0..threads {
            let mine: Vec<u8> = replay.records.iter().filter(|r| r.payload[0] == t).map(|r| r.payload[1]).collect();
            assert_eq!(mine, (0..per_thread).collect::<Vec<u8>>());
        }
    }

    #[test]
    fn submitted_records_are_acknowledged_by_wait_durable_in_shared_fsyncs() {
        let dir = tempdir();
        // `None`: only wait_durable makes anything durable.
        let log = writer(dir.path(), SyncPolicy::None, 1 << 20);
        let window = 16;
        std::thread::scope(|s| {
            for t in 0..4u8 {
                let log = &log;
                s.spawn(move || {
                    let mut inflight = std::collections::VecDeque::new();
                    for i in 0..100u8 {
                        inflight.push_back(log.submit(RecordKind::AppendKv, &[t, i], None).unwrap());
                        if inflight.len() > window {
                            let lsn = inflight.pop_front().unwrap();
                            log.wait_durable(lsn).unwrap();
                            assert!(log.durable_end() > lsn, "acknowledged means durable");
                        }
                    }
                    log.wait_durable(*inflight.back().unwrap()).unwrap();
                });
            }
        });
        assert_eq!(log.durable_end(), 401);
        let stats = log.stats();
        assert!(stats.syncs < 400 / 4, "a window of records shares each fsync: {stats:?}");
        assert!(matches!(log.wait_durable(401), Err(Error::UnknownLsn { lsn: 401, next: 401 })));
        assert_each_thread_in_order(dir.path(), 4, 100);
    }

    #[test]
    fn submit_writes_out_a_large_backlog_and_a_failed_wait_poisons() {
        let dir = tempdir();
        let storage = FaultyStorage::new();
        let config = WriterConfig { policy: SyncPolicy::EveryBatch, max_file_bytes: 64 << 20 };
        let log = LogWriter::create(dir.path(), Arc::new(storage.clone()), config, DIR_ID, 1).unwrap();
        let payload = vec![7u8; 64 << 10];
        let records = SUBMIT_WRITE_BYTES / payload.len() + 2;
        let last = (0..records).map(|_| log.submit(RecordKind::AppendKv, &payload, None).unwrap()).last().unwrap();
        assert!(log.stats().writes >= 1, "the backlog was written out by a submitter");
        assert!(log.durable_end() <= last, "but nothing was acknowledged");
        storage.fail_syncs(true);
        assert!(matches!(log.wait_durable(last), Err(Error::Poisoned { .. })));
        assert!(matches!(log.submit(RecordKind::AppendKv, b"more", None), Err(Error::Poisoned { .. })));
    }

    #[test]
    fn a_full_file_rotates_and_replay_reads_across_files_in_order() {
        let dir = tempdir();
        let log = writer(dir.path(), SyncPolicy::None, 200);
        for i in 0..100u32 {
            assert_eq!(log.append(RecordKind::AppendKv, &i.to_le_bytes()).unwrap(), u64::from(i) + 1);
        }
        log.close().unwrap();
        let files = crate::replay::list_log_files(dir.path()).unwrap();
        assert!(files.len() > 5, "{} files", files.len());
        let replay = replay_dir(dir.path(), 1).unwrap();
        let got: Vec<u32> =
            replay.records.iter().map(|r| u32::from_le_bytes(r.payload[..].try_into().unwrap())).collect();
        assert_eq!(got, (0..100).collect::<Vec<_>>());
        assert_eq!(replay.next_lsn, 101);
        let from_50 = replay_dir(dir.path(), 51).unwrap();
        assert_eq!(from_50.records.first().map(|r| r.lsn), Some(51));
    }

    #[test]
    fn rotate_then_remove_keeps_only_records_from_the_new_file() {
        let dir = tempdir();
        let log = writer(dir.path(), SyncPolicy::EveryBatch, 1 << 20);
        for i in 0..10u8 {
            log.append(RecordKind::AppendKv, &[i]).unwrap();
        }
        let start = log.rotate().unwrap();
        assert_eq!(start, 11);
        log.append(RecordKind::Checkpoint, b"after").unwrap();
        assert_eq!(log.remove_files_before(start).unwrap(), 1);
        let replay = replay_dir(dir.path(), start).unwrap();
        assert_eq!(replay.records.len(), 1);
        assert_eq!((replay.records[0].lsn, &replay.records[0].payload[..]), (11, &b"after"[..]));
        assert!(matches!(replay_dir(dir.path(), 1), Err(Error::LsnGap { expected: 1, got: 11, .. })));
    }

    #[test]
    fn a_failed_fsync_poisons_the_writer_for_good() {
        let dir = tempdir();
        let storage = FaultyStorage::new();
        let config = WriterConfig { policy: SyncPolicy::EveryBatch, max_file_bytes: 1 << 20 };
        let log = LogWriter::create(dir.path(), Arc::new(storage.clone()), config, DIR_ID, 1).unwrap();
        log.append(RecordKind::AppendKv, b"one").unwrap();
        storage.fail_syncs(true);
        let err = log.append(RecordKind::AppendKv, b"two").unwrap_err();
        assert!(matches!(err, Error::Poisoned { ref cause } if cause.contains("fsync")), "{err}");
        storage.fail_syncs(false);
        // Retrying is refused even though fsync would now succeed.
        assert!(matches!(log.append(RecordKind::AppendKv, b"three"), Err(Error::Poisoned { .. })));
        assert!(matches!(log.sync(), Err(Error::Poisoned { .. })));
        assert!(log.poisoned().is_some());
    }

    #[test]
    fn wal_metrics_count_every_group_fsync_and_failure() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let dir = tempdir();
        let storage = FaultyStorage::new();
        let config = WriterConfig { policy: SyncPolicy::EveryBatch, max_file_bytes: 1 << 20 };
        let log = LogWriter::create(dir.path(), Arc::new(storage.clone()), config, DIR_ID, 1).unwrap();
        let stats = metrics::with_local_recorder(&recorder, || {
            // Three lone appends (a group of one each), then five submitted records in one group.
            for i in 0..3u8 {
                log.append(RecordKind::AppendKv, &[i; 10]).unwrap();
            }
            for i in 0..5u8 {
                log.submit(RecordKind::AppendKv, &[i; 10], None).unwrap();
            }
            log.sync().unwrap();
            let stats = log.stats();
            storage.fail_syncs(true);
            assert!(log.append(RecordKind::AppendKv, b"x").is_err());
            stats
        });
        let snapshot = snapshotter.snapshot().into_hashmap();
        let get = |name: &str| {
            snapshot
                .iter()
                .filter(|(k, _)| k.key().name() == name)
                .map(|(k, (_, _, v))| (k.key().labels().map(|l| format!("{}={}", l.key(), l.value())).collect(), v))
                .collect::<Vec<(Vec<String>, &DebugValue)>>()
        };
        assert_eq!((stats.records, stats.writes, stats.syncs), (8, 4, 4));
        assert_eq!(get("attnstore_wal_fsyncs_total"), [(vec![], &DebugValue::Counter(stats.syncs))]);
        let groups = match &get("attnstore_wal_group_records")[..] {
            [(_, DebugValue::Histogram(h))] => h.iter().map(|v| v.0).collect::<Vec<f64>>(),
            other => panic!("{other:?}"),
        };
        // The failed group wrote its record before the fsync failed: not counted as a group.
        assert_eq!(groups, [1.0, 1.0, 1.0, 5.0]);
        match &get("attnstore_wal_fsync_seconds")[..] {
            [(_, DebugValue::Histogram(h))] => assert_eq!(h.len() as u64, stats.syncs),
            other => panic!("{other:?}"),
        }
        assert_eq!(get("attnstore_wal_unsynced_records"), [(vec![], &DebugValue::Gauge(0.0.into()))]);
        assert_eq!(get("attnstore_wal_failures_total"), [(vec!["op=fsync".to_string()], &DebugValue::Counter(1))]);
        let waits = get("attnstore_wal_commit_wait_seconds");
        assert!(
            matches!(&waits[..], [(l, DebugValue::Histogram(h))] if l == &["durable=true"] && h.len() == 4),
            "{waits:?}"
        );
    }

    #[test]
    fn a_full_disk_mid_write_poisons_and_leaves_a_torn_tail_that_replay_drops() {
        let dir = tempdir();
        let storage = FaultyStorage::new();
        let config = WriterConfig { policy: SyncPolicy::EveryBatch, max_file_bytes: 1 << 20 };
        let log = LogWriter::create(dir.path(), Arc::new(storage.clone()), config, DIR_ID, 1).unwrap();
        log.append(RecordKind::AppendKv, &[1; 100]).unwrap();
        // The disk fills part-way through the next record: its first sectors land, not the rest.
        storage.set_write_budget(1000);
        let err = log.append(RecordKind::AppendKv, &[2; 2000]).unwrap_err();
        assert!(matches!(err, Error::Poisoned { ref cause } if cause.contains("no space left")), "{err}");
        drop(log);
        let replay = replay_dir(dir.path(), 1).unwrap();
        assert_eq!(replay.records.len(), 1);
        let torn = replay.torn.as_ref().expect("the partial frame is a torn tail");
        let first_end = (FileHeader::SIZE + FRAME_HEADER_BYTES + 100) as u64;
        assert_eq!(torn.valid_up_to, first_end);
        assert!(torn.file_bytes > first_end);
        replay.repair(&StdStorage).unwrap();
        let again = replay_dir(dir.path(), 1).unwrap();
        assert!(again.torn.is_none());
        assert_eq!(again.records.len(), 1);
    }

    #[test]
    fn interval_policy_acknowledges_before_sync_and_the_flusher_catches_up() {
        let dir = tempdir();
        let log = writer(dir.path(), SyncPolicy::Interval(Duration::from_millis(5)), 1 << 20);
        let lsn = log.append(RecordKind::AppendKv, b"x").unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while log.durable_end() <= lsn {
            assert!(std::time::Instant::now() < deadline, "the flusher never synced");
            std::thread::sleep(Duration::from_millis(1));
        }
        log.close().unwrap();
        assert!(matches!(log.append(RecordKind::AppendKv, b"y"), Err(Error::Closed)));
    }
}
