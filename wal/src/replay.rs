//! Reading a log directory back: every log file in LSN order, each record with its LSN,
//! file and offset, and the one torn tail a crash may have left at the end of the newest file.
//!
//! The rules of `docs/wal-format.md` apply per file; across files the LSNs must join up and
//! only the last file may end torn. Anything else is an [`Error`] naming the file and offset.

use std::path::{Path, PathBuf};

use crate::storage::Storage;
use crate::writer::{parse_log_file_name, Lsn};
use crate::{Error, FileHeader, RecordKind, RecordReader, Tail};

/// One record read back from the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayedRecord {
    /// Its log sequence number.
    pub lsn: Lsn,
    /// What it says happened.
    pub kind: RecordKind,
    /// Its payload.
    pub payload: Vec<u8>,
    /// The log file it was read from.
    pub file: PathBuf,
    /// Offset of its frame in that file.
    pub offset: usize,
}

/// The end of the newest log file, cut short by a crash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    /// The log file.
    pub file: PathBuf,
    /// End of its last whole record; recovery truncates the file here.
    pub valid_up_to: u64,
    /// The file's length as found.
    pub file_bytes: u64,
}

/// One log file as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogFileSummary {
    /// The file.
    pub path: PathBuf,
    /// LSN of its first record (from its name).
    pub first_lsn: Lsn,
    /// Whole records in it.
    pub records: u64,
    /// Its length in bytes.
    pub bytes: u64,
}

/// What reading a log directory found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LogReplay {
    /// Records at or after the requested LSN, in LSN order.
    pub records: Vec<ReplayedRecord>,
    /// The files read (files wholly before the requested LSN are not read).
    pub files: Vec<LogFileSummary>,
    /// The LSN after the last whole record: where the writer continues.
    pub next_lsn: Lsn,
    /// The torn tail of the newest file, if a crash left one.
    pub torn: Option<TornTail>,
}

/// The log files of `dir` as `(first LSN, path)`, in LSN order; other files are ignored.
pub fn list_log_files(dir: &Path) -> Result<Vec<(Lsn, PathBuf)>, Error> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("list", dir, &e))?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("list", dir, &e))?;
        if let Some(lsn) = entry.file_name().to_str().and_then(parse_log_file_name) {
            files.push((lsn, entry.path()));
        }
    }
    files.sort();
    Ok(files)
}

/// Reads every record with LSN ≥ `from_lsn` from the log files of `dir`. The log must
/// reach back to `from_lsn` (a missing file is [`Error::LsnGap`]); a torn tail is allowed
/// only in the newest file and is reported in [`LogReplay::torn`], not repaired.
pub fn replay_dir(dir: &Path, from_lsn: Lsn) -> Result<LogReplay, Error> {
    let files = list_log_files(dir)?;
    // Files whose successor starts at or before `from_lsn` hold nothing to replay.
    let skip = files.windows(2).take_while(|pair| pair[1].0 <= from_lsn).count();
    let files = &files[skip..];
    let mut replay = LogReplay { next_lsn: from_lsn, ..LogReplay::default() };
    if let Some((first, path)) = files.first() {
        if *first > from_lsn {
            return Err(Error::LsnGap { file: path.clone(), expected: from_lsn, got: *first });
        }
        replay.next_lsn = *first;
    }
    for (index, (first_lsn, path)) in files.iter().enumerate() {
        let last_file = index + 1 == files.len();
        if *first_lsn != replay.next_lsn {
            return Err(Error::LsnGap { file: path.clone(), expected: replay.next_lsn, got: *first_lsn });
        }
        let bytes = std::fs::read(path).map_err(|e| Error::io("read", path, &e))?;
        let summary =
            LogFileSummary { path: path.clone(), first_lsn: *first_lsn, records: 0, bytes: bytes.len() as u64 };
        let mut reader = match RecordReader::open_log(&bytes) {
            Ok(reader) => reader,
            // A crash while the newest file was being created can leave its header short.
            Err(Error::HeaderTruncated { .. }) if last_file && FileHeader::new().encode().starts_with(&bytes) => {
                replay.torn = Some(TornTail { file: path.clone(), valid_up_to: 0, file_bytes: bytes.len() as u64 });
                replay.files.push(summary);
                break;
            }
            Err(error) => return Err(error.in_file(path)),
        };
        let mut records = 0;
        for item in reader.by_ref() {
            let record = item.map_err(|e| e.in_file(path))?;
            let lsn = first_lsn + records;
            records += 1;
            if lsn >= from_lsn {
                replay.records.push(ReplayedRecord {
                    lsn,
                    kind: record.kind,
                    payload: record.payload.to_vec(),
                    file: path.clone(),
                    offset: record.offset,
                });
            }
        }
        replay.next_lsn = first_lsn + records;
        replay.files.push(LogFileSummary { records, ..summary });
        match reader.tail() {
            Some(Tail::Clean { .. }) => {}
            Some(Tail::Torn { valid_up_to }) if last_file => {
                replay.torn = Some(TornTail {
                    file: path.clone(),
                    valid_up_to: valid_up_to as u64,
                    file_bytes: bytes.len() as u64,
                });
            }
            Some(Tail::Torn { valid_up_to }) => {
                return Err(Error::TornBeforeLastFile { file: path.clone(), offset: valid_up_to })
            }
            None => unreachable!("a reader that yielded no error ends with a tail"),
        }
    }
    if replay.next_lsn < from_lsn {
        let file = files.last().map(|(_, p)| p.clone()).unwrap_or_else(|| dir.to_path_buf());
        return Err(Error::LsnGap { file, expected: from_lsn, got: replay.next_lsn });
    }
    Ok(replay)
}

impl LogReplay {
    /// Cuts the torn tail off the newest file (a torn header leaves an empty file, which
    /// the writer then recreates) and syncs it, so the next append starts after whole records.
    pub fn repair(&self, storage: &dyn Storage) -> Result<(), Error> {
        let Some(torn) = &self.torn else { return Ok(()) };
        let file = storage.open(&torn.file).map_err(|e| Error::io("open", &torn.file, &e))?;
        let keep = if torn.valid_up_to < FileHeader::SIZE as u64 { 0 } else { torn.valid_up_to };
        file.set_len(keep).map_err(|e| Error::io("truncate", &torn.file, &e))?;
        file.sync_data().map_err(|e| Error::io("fsync", &torn.file, &e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::StdStorage;
    use crate::writer::{log_file_name, LogWriter, SyncPolicy, WriterConfig};
    use std::sync::Arc;

    fn log_with(dir: &Path, records: u8, max_file_bytes: u64) {
        let config = WriterConfig { policy: SyncPolicy::None, max_file_bytes };
        let log = LogWriter::create(dir, Arc::new(StdStorage), config, 1).unwrap();
        for i in 0..records {
            log.append(RecordKind::AppendKv, &[i; 20]).unwrap();
        }
        log.close().unwrap();
    }

    #[test]
    fn truncating_the_newest_file_at_every_byte_recovers_the_longest_whole_prefix() {
        let dir = tempfile::tempdir().unwrap();
        log_with(dir.path(), 6, 1 << 20);
        let path = dir.path().join(log_file_name(1));
        let full = std::fs::read(&path).unwrap();
        let frame = crate::FRAME_HEADER_BYTES + 20;
        for cut in 0..full.len() {
            std::fs::write(&path, &full[..cut]).unwrap();
            let replay = replay_dir(dir.path(), 1).unwrap_or_else(|e| panic!("cut {cut}: {e}"));
            let whole = cut.saturating_sub(FileHeader::SIZE) / frame;
            assert_eq!(replay.records.len(), whole, "cut {cut}");
            assert_eq!(replay.next_lsn, 1 + whole as u64);
            let at_boundary = cut >= FileHeader::SIZE && (cut - FileHeader::SIZE).is_multiple_of(frame);
            assert_eq!(replay.torn.is_none(), at_boundary, "cut {cut}");
            replay.repair(&StdStorage).unwrap();
            let again = replay_dir(dir.path(), 1).unwrap();
            assert_eq!(again.records, replay.records, "cut {cut}");
        }
    }

    #[test]
    fn corruption_in_an_older_file_names_the_file_and_offset() {
        let dir = tempfile::tempdir().unwrap();
        log_with(dir.path(), 20, 100);
        let files = list_log_files(dir.path()).unwrap();
        assert!(files.len() >= 3);
        let (_, victim) = &files[1];
        let mut bytes = std::fs::read(victim).unwrap();
        bytes[FileHeader::SIZE + crate::FRAME_HEADER_BYTES + 3] ^= 0x10;
        std::fs::write(victim, &bytes).unwrap();
        match replay_dir(dir.path(), 1) {
            Err(Error::InFile { file, source }) => {
                assert_eq!(&file, victim);
                assert_eq!(source.offset(), Some(FileHeader::SIZE));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_torn_older_file_or_a_missing_middle_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        log_with(dir.path(), 20, 100);
        let files = list_log_files(dir.path()).unwrap();
        let len = std::fs::metadata(&files[0].1).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&files[0].1).unwrap().set_len(len - 3).unwrap();
        assert!(matches!(replay_dir(dir.path(), 1), Err(Error::TornBeforeLastFile { .. })));
        std::fs::remove_file(&files[0].1).unwrap();
        std::fs::remove_file(&files[2].1).unwrap();
        assert!(matches!(replay_dir(dir.path(), files[1].0), Err(Error::LsnGap { .. })));
    }
}
