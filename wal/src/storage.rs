//! The file-system calls the durable paths make, behind a small trait so a fault-injecting
//! backend can stand in for the real disk: a full disk part-way through a write, or a
//! failing fsync, become ordinary tests (the pattern of lsm-tree's `Fs` trait).
//!
//! Only writes go through [`Storage`]; recovery reads files with `std::fs` directly.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// One open file that is written at explicit offsets and synced. Shared between threads:
/// a group-commit leader may write while a flusher syncs.
pub trait StorageFile: Send + Sync + fmt::Debug {
    /// Writes all of `bytes` at `offset`; on error a prefix may have been written.
    fn write_all_at(&self, bytes: &[u8], offset: u64) -> io::Result<()>;
    /// Makes the file's data durable (`fdatasync`).
    fn sync_data(&self) -> io::Result<()>;
    /// Cuts or extends the file to `bytes`.
    fn set_len(&self, bytes: u64) -> io::Result<()>;
}

/// The file-system operations of the WAL writer and the durable engine.
pub trait Storage: Send + Sync + fmt::Debug {
    /// Creates `path` empty (truncating an existing file) for writing.
    fn create(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>>;
    /// Opens an existing `path` for writing without truncating it.
    fn open(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>>;
    /// Makes the directory's entries (created, renamed, removed files) durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Atomically renames `from` to `to` (same directory).
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
}

/// The real file system (`std::fs`).
#[derive(Debug, Default, Clone, Copy)]
pub struct StdStorage;

impl StorageFile for File {
    fn write_all_at(&self, bytes: &[u8], offset: u64) -> io::Result<()> {
        FileExt::write_all_at(self, bytes, offset)
    }

    fn sync_data(&self) -> io::Result<()> {
        File::sync_data(self)
    }

    fn set_len(&self, bytes: u64) -> io::Result<()> {
        File::set_len(self, bytes)
    }
}

impl Storage for StdStorage {
    fn create(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        Ok(Arc::new(OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path)?))
    }

    fn open(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        Ok(Arc::new(OpenOptions::new().read(true).write(true).open(path)?))
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }
}

/// A [`StdStorage`] that fails on command, for tests of full disks and failed fsyncs.
///
/// Writes consume a byte budget shared by every file it opened; the write that crosses the
/// budget writes the bytes that still fit (a partial write, as a full disk leaves) and
/// fails with [`io::ErrorKind::StorageFull`]. Syncs fail with an I/O error while
/// [`fail_syncs`](Self::fail_syncs) is set.
#[derive(Debug, Clone, Default)]
pub struct FaultyStorage {
    faults: Arc<Faults>,
}

#[derive(Debug)]
struct Faults {
    write_budget_bytes: AtomicU64,
    fail_syncs: AtomicBool,
}

impl Default for Faults {
    fn default() -> Self {
        Self { write_budget_bytes: AtomicU64::new(u64::MAX), fail_syncs: AtomicBool::new(false) }
    }
}

#[derive(Debug)]
struct FaultyFile {
    file: File,
    faults: Arc<Faults>,
}

impl FaultyStorage {
    /// A storage that does not fail until told to.
    pub fn new() -> Self {
        Self::default()
    }

    /// Lets `bytes` more bytes be written before writes fail as if the disk were full.
    pub fn set_write_budget(&self, bytes: u64) {
        // SeqCst: tests flip faults from another thread and expect the next write to see it.
        self.faults.write_budget_bytes.store(bytes, Ordering::SeqCst);
    }

    /// Makes every later fsync fail (`true`) or succeed again (`false`).
    pub fn fail_syncs(&self, fail: bool) {
        self.faults.fail_syncs.store(fail, Ordering::SeqCst);
    }

    fn wrap(&self, file: File) -> Arc<dyn StorageFile> {
        Arc::new(FaultyFile { file, faults: self.faults.clone() })
    }
}

impl StorageFile for FaultyFile {
    fn write_all_at(&self, bytes: &[u8], offset: u64) -> io::Result<()> {
        let want = bytes.len() as u64;
        let granted = self
            .faults
            .write_budget_bytes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| Some(left.saturating_sub(want)))
            .expect("the update closure always returns Some");
        if granted >= want {
            return FileExt::write_all_at(&self.file, bytes, offset);
        }
        FileExt::write_all_at(&self.file, &bytes[..granted as usize], offset)?;
        Err(io::Error::new(io::ErrorKind::StorageFull, "injected: no space left on device"))
    }

    fn sync_data(&self) -> io::Result<()> {
        if self.faults.fail_syncs.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected: fsync failed"));
        }
        self.file.sync_data()
    }

    fn set_len(&self, bytes: u64) -> io::Result<()> {
        self.file.set_len(bytes)
    }
}

impl Storage for FaultyStorage {
    fn create(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path)?;
        Ok(self.wrap(file))
    }

    fn open(&self, path: &Path) -> io::Result<Arc<dyn StorageFile>> {
        Ok(self.wrap(OpenOptions::new().read(true).write(true).open(path)?))
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        if self.faults.fail_syncs.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected: directory fsync failed"));
        }
        File::open(dir)?.sync_all()
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }
}
