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
    /// Frees the disk space of bytes `offset..offset + len` (they read back as zeros; the
    /// file keeps its length). `Ok(false)` when the file system cannot punch holes: the
    /// bytes then stay as they were, which is never wrong, only larger.
    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<bool>;
}

/// `fallocate(PUNCH_HOLE | KEEP_SIZE)` on `file`; `Ok(false)` where it is not supported.
fn punch(file: &File, offset: u64, len: u64) -> io::Result<bool> {
    use rustix::fs::FallocateFlags;
    if len == 0 {
        return Ok(true);
    }
    match rustix::fs::fallocate(file, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, offset, len) {
        Ok(()) => Ok(true),
        Err(rustix::io::Errno::OPNOTSUPP | rustix::io::Errno::NOSYS) => Ok(false),
        Err(errno) => Err(errno.into()),
    }
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

    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<bool> {
        punch(self, offset, len)
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
/// budget writes the whole sectors ([`SECTOR_BYTES`](crate::SECTOR_BYTES), by file offset)
/// that still fit (a partial write, as a full disk leaves: the file system allocates whole
/// blocks) and fails with [`io::ErrorKind::StorageFull`]. Syncs fail with an I/O error while
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
        // Whole sectors only: where the granted bytes end is rounded down to a sector boundary.
        let sector = crate::SECTOR_BYTES as u64;
        let fits = ((offset + granted) / sector * sector).saturating_sub(offset).min(granted);
        FileExt::write_all_at(&self.file, &bytes[..fits as usize], offset)?;
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

    fn punch_hole(&self, offset: u64, len: u64) -> io::Result<bool> {
        punch(&self.file, offset, len)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_punched_range_reads_as_zeros_keeps_the_length_and_frees_its_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let bytes: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8 + 1).collect();
        for storage in [Arc::new(StdStorage) as Arc<dyn Storage>, Arc::new(FaultyStorage::new())] {
            let file = storage.create(&path).unwrap();
            file.write_all_at(&bytes, 0).unwrap();
            file.sync_data().unwrap();
            let before = std::fs::metadata(&path).unwrap().blocks();
            let freed = file.punch_hole(0, 768 << 10).unwrap();
            let back = std::fs::read(&path).unwrap();
            assert_eq!(back.len(), bytes.len(), "the length stays");
            if freed {
                assert!(back[..768 << 10].iter().all(|&b| b == 0));
                let after = std::fs::metadata(&path).unwrap().blocks();
                assert!(after * 2 < before, "blocks {before} → {after}");
            } else {
                assert_eq!(back[..768 << 10], bytes[..768 << 10], "unsupported: nothing changes");
            }
            assert_eq!(back[768 << 10..], bytes[768 << 10..], "bytes after the hole stay");
        }
    }
}
