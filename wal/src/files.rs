//! Reading the engine's files with bounds: only regular files (a link to a device, a
//! directory or a link to nothing is a typed error, never read), never more than the
//! largest such file the engine writes, and a log file only up to its last written byte
//! (the preallocated rest is a hole that reads as zeros).

use std::fs::File;
use std::io::Read;
use std::path::Path;

use crate::Error;

/// Checks that `path` is a regular file (following links) and at most `max_bytes` long;
/// `Ok(None)` when nothing is there at all (not even a link).
pub fn open_regular(path: &Path, max_bytes: u64) -> Result<Option<(File, u64)>, Error> {
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if std::fs::symlink_metadata(path).is_ok() {
                return Err(Error::NotRegularFile { path: path.to_path_buf(), found: "a link to nothing".into() });
            }
            return Ok(None);
        }
        Err(e) => return Err(Error::io("stat", path, &e)),
    };
    if !meta.is_file() {
        let found = if meta.is_dir() { "a directory" } else { "a device, socket or pipe" };
        return Err(Error::NotRegularFile { path: path.to_path_buf(), found: found.into() });
    }
    if meta.len() > max_bytes {
        return Err(Error::FileTooLarge { path: path.to_path_buf(), max_bytes, got_bytes: meta.len() });
    }
    let file = File::open(path).map_err(|e| Error::io("open", path, &e))?;
    Ok(Some((file, meta.len())))
}

/// Reads a whole regular file of at most `max_bytes`; `Ok(None)` when there is none.
pub fn read_regular(path: &Path, max_bytes: u64) -> Result<Option<Vec<u8>>, Error> {
    let Some((file, len)) = open_regular(path, max_bytes)? else { return Ok(None) };
    let mut bytes = Vec::with_capacity(len as usize);
    // `take` bounds the read even if the file grew after the check.
    file.take(max_bytes).read_to_end(&mut bytes).map_err(|e| Error::io("read", path, &e))?;
    Ok(Some(bytes))
}

/// The largest log file read: its preallocated length plus one group write may pass
/// 64 MiB (a file rotates only once full), never this.
pub const MAX_LOG_FILE_BYTES: u64 = 1 << 30;

/// A log file's bytes up to its last written byte, and its length.
pub(crate) fn read_log_file(path: &Path) -> Result<(Vec<u8>, u64), Error> {
    let Some((file, len)) = open_regular(path, MAX_LOG_FILE_BYTES)? else {
        let e = std::io::Error::new(std::io::ErrorKind::NotFound, "log file vanished while read");
        return Err(Error::io("open", path, &e));
    };
    let end = written_end(&file, len);
    // Finding the end moved the file's position.
    rustix::fs::seek(&file, rustix::fs::SeekFrom::Start(0)).map_err(|e| Error::io("seek", path, &e.into()))?;
    let mut bytes = Vec::with_capacity(end as usize);
    file.take(end).read_to_end(&mut bytes).map_err(|e| Error::io("read", path, &e))?;
    Ok((bytes, len))
}

/// End of the last data extent of `file` (`len` where the file system cannot say): past it
/// the file is a hole, all zeros.
fn written_end(file: &File, len: u64) -> u64 {
    use rustix::fs::{seek, SeekFrom};
    let (mut at, mut end) = (0, 0);
    while at < len {
        let data = match seek(file, SeekFrom::Data(at)) {
            Ok(data) => data,
            Err(rustix::io::Errno::NXIO) => break,
            Err(_) => return len,
        };
        let hole = seek(file, SeekFrom::Hole(data)).unwrap_or(len);
        if hole <= at {
            return len;
        }
        (at, end) = (hole, hole);
    }
    end.min(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_directories_dangling_links_and_oversized_files_are_refused_unread() {
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("zero");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        assert!(matches!(read_regular(&link, 100), Err(Error::NotRegularFile { .. })));
        assert!(matches!(read_regular(dir.path(), 100), Err(Error::NotRegularFile { .. })));
        let dangling = dir.path().join("dangling");
        std::os::unix::fs::symlink(dir.path().join("nothing"), &dangling).unwrap();
        assert!(matches!(read_regular(&dangling, 100), Err(Error::NotRegularFile { .. })));
        assert_eq!(read_regular(&dir.path().join("absent"), 100).unwrap(), None);
        let big = dir.path().join("big");
        std::fs::write(&big, [1u8; 101]).unwrap();
        assert!(matches!(read_regular(&big, 100), Err(Error::FileTooLarge { got_bytes: 101, .. })));
        assert_eq!(read_regular(&big, 101).unwrap().unwrap().len(), 101);
    }

    #[test]
    fn a_sparse_log_file_is_read_up_to_its_written_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let file = std::fs::OpenOptions::new().create(true).truncate(true).write(true).open(&path).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&file, &[7u8; 100], 0).unwrap();
        file.set_len(64 << 20).unwrap();
        let (bytes, len) = read_log_file(&path).unwrap();
        assert_eq!(len, 64 << 20);
        assert!(bytes.len() >= 100 && bytes.len() < 1 << 20, "read {} bytes", bytes.len());
        assert!(bytes[..100].iter().all(|&b| b == 7) && bytes[100..].iter().all(|&b| b == 0));
    }
}
