//! Reading a log directory back: every log file in LSN order, each record with its LSN,
//! file and offset, and the one torn tail a crash may have left at the end of the newest file.
//!
//! The rules of `docs/wal-format.md` apply per file; across files the LSNs must join up and
//! only the last file may end torn. Anything else is damage: an [`Error`] naming the file
//! and offset under [`RecoveryMode::Strict`], or under [`RecoveryMode::PointInTime`] a
//! [`LogCut`] that says exactly what recovery would drop.

use std::path::{Path, PathBuf};

use crate::files::read_log_file;
use crate::storage::Storage;
use crate::writer::{parse_log_file_name, Lsn};
use crate::{Error, FileHeader, FileIdentity, RecordKind, RecordReader, Tail};

/// What replay does with damage that may hide acknowledged records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RecoveryMode {
    /// Damage is an error; only a torn tail (an unacknowledged write) is cut.
    #[default]
    Strict,
    /// Damage ends the log: everything from it on is cut, and [`LogReplay::cut`] reports it.
    /// Acknowledged records may be lost; only a user who accepts that should choose it.
    PointInTime,
}

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

/// The end of the newest log file, cut short by a crash during its last group write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    /// The log file.
    pub file: PathBuf,
    /// End of its last whole record; recovery zeroes the file from here.
    pub valid_up_to: u64,
    /// End of the file's written bytes as found (the torn write's bytes lie before it).
    pub file_bytes: u64,
}

/// Damage that [`RecoveryMode::PointInTime`] cut the log at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogCut {
    /// The file the damage is in.
    pub file: PathBuf,
    /// Where the log now ends in it (end of its last good record; 0: the file goes).
    pub offset: u64,
    /// The last LSN kept is the one before this.
    pub next_lsn: Lsn,
    /// The damage, as strict recovery reports it.
    pub damage: String,
    /// Written bytes of the file dropped from `offset` on.
    pub bytes_dropped: u64,
    /// The length the file was created with (restored by the repair).
    pub reserved_bytes: u64,
    /// Later log files removed (their records are after the damage).
    pub later_files: Vec<PathBuf>,
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
    /// End of its last whole record (0 if its header is unusable): where appends continue.
    pub end: u64,
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
    /// Damage cut off under [`RecoveryMode::PointInTime`].
    pub cut: Option<LogCut>,
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

/// Removes log files a crash left half made (`*.log.tmp`: never renamed, never written to).
pub(crate) fn remove_unfinished_files(dir: &Path) -> Result<(), Error> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("list", dir, &e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("list", dir, &e))?;
        let name = entry.file_name();
        let unfinished =
            name.to_str().and_then(|n| n.strip_suffix(".tmp")).is_some_and(|n| parse_log_file_name(n).is_some());
        if unfinished {
            std::fs::remove_file(entry.path()).map_err(|e| Error::io("remove", entry.path(), &e))?;
        }
    }
    Ok(())
}

/// How one file ended.
enum FileEnd {
    Clean,
    Torn,
    Damaged(Error),
}

/// One file as [`read_file`] found it.
struct FileRead {
    end: FileEnd,
    /// End of the last whole record; 0 when the header is unusable.
    valid_up_to: u64,
    /// The length the header says the file was created with.
    reserved_bytes: u64,
}

/// Reads every record with LSN ≥ `from_lsn` from the log files of `dir`, the log of the
/// engine directory `dir_id`. The log must reach back to `from_lsn` (a missing file is
/// [`Error::LsnGap`]); a torn tail is allowed only in the newest file and is reported in
/// [`LogReplay::torn`], not repaired. Damage is an error, or under
/// [`RecoveryMode::PointInTime`] the end of the log, reported in [`LogReplay::cut`].
pub fn replay_dir(dir: &Path, dir_id: u64, from_lsn: Lsn, mode: RecoveryMode) -> Result<LogReplay, Error> {
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
        let later = || files[index + 1..].iter().map(|(_, p)| p.clone()).collect::<Vec<_>>();
        if *first_lsn != replay.next_lsn {
            let gap = Error::LsnGap { file: path.clone(), expected: replay.next_lsn, got: *first_lsn };
            if mode == RecoveryMode::Strict {
                return Err(gap);
            }
            let prior = replay.files.last().map_or((path.clone(), 0), |f| (f.path.clone(), f.end));
            let reserved_bytes = 0;
            let later_files = files[index..].iter().map(|(_, p)| p.clone()).collect();
            replay.cut = Some(LogCut {
                file: prior.0,
                offset: prior.1,
                next_lsn: replay.next_lsn,
                damage: gap.to_string(),
                bytes_dropped: 0,
                reserved_bytes,
                later_files,
            });
            break;
        }
        let (bytes, file_len) = read_log_file(path)?;
        let mut summary =
            LogFileSummary { path: path.clone(), first_lsn: *first_lsn, records: 0, bytes: file_len, end: 0 };
        let written = bytes.len() as u64;
        let read =
            read_file(path, &bytes, file_len, FileIdentity::log(dir_id, *first_lsn), &mut |offset, kind, payload| {
                let lsn = first_lsn + summary.records;
                summary.records += 1;
                if lsn >= from_lsn {
                    replay.records.push(ReplayedRecord {
                        lsn,
                        kind,
                        payload: payload.to_vec(),
                        file: path.clone(),
                        offset,
                    });
                }
            });
        replay.next_lsn = first_lsn + summary.records;
        summary.end = read.valid_up_to;
        replay.files.push(summary);
        let damage = match read.end {
            FileEnd::Clean => None,
            FileEnd::Torn if last_file => {
                replay.torn = Some(TornTail { file: path.clone(), valid_up_to: read.valid_up_to, file_bytes: written });
                None
            }
            FileEnd::Torn => Some(Error::TornBeforeLastFile { file: path.clone(), offset: read.valid_up_to as usize }),
            FileEnd::Damaged(error) => Some(error.in_file(path)),
        };
        if let Some(error) = damage {
            if mode == RecoveryMode::Strict {
                return Err(error);
            }
            replay.cut = Some(LogCut {
                file: path.clone(),
                offset: read.valid_up_to,
                next_lsn: replay.next_lsn,
                damage: error.to_string(),
                bytes_dropped: written.saturating_sub(read.valid_up_to),
                reserved_bytes: read.reserved_bytes,
                later_files: later(),
            });
            break;
        }
    }
    if replay.next_lsn < from_lsn {
        let file = files.last().map(|(_, p)| p.clone()).unwrap_or_else(|| dir.to_path_buf());
        return Err(Error::LsnGap { file, expected: from_lsn, got: replay.next_lsn });
    }
    Ok(replay)
}

/// Reads one log file's records into `each` (offset, kind, payload) and says how it ends.
fn read_file(
    path: &Path,
    bytes: &[u8],
    file_len: u64,
    identity: FileIdentity,
    each: &mut dyn FnMut(usize, RecordKind, &[u8]),
) -> FileRead {
    let header = match FileHeader::decode_expecting(bytes, identity) {
        Ok(header) => header,
        Err(error) => return FileRead { end: FileEnd::Damaged(error), valid_up_to: 0, reserved_bytes: 0 },
    };
    let reserved_bytes = header.reserved_bytes();
    let mut reader = RecordReader::open_log(bytes).expect("the header was checked above");
    let mut failed = None;
    for item in reader.by_ref() {
        match item {
            Ok(record) => each(record.offset, record.kind, record.payload),
            Err(error) => failed = Some(error),
        }
    }
    let valid_up_to = reader.position() as u64;
    let end = match (failed, reader.tail()) {
        // A crash never shortens a file that was created at its reserved length (and a cut
        // explains any damage at the end).
        _ if file_len < reserved_bytes => FileEnd::Damaged(Error::LogTruncated {
            file: path.to_path_buf(),
            expected_bytes: reserved_bytes,
            got_bytes: file_len,
        }),
        (Some(error), _) => FileEnd::Damaged(error),
        (None, Some(Tail::Torn { .. })) => FileEnd::Torn,
        (None, _) => FileEnd::Clean,
    };
    FileRead { end, valid_up_to, reserved_bytes }
}

impl LogReplay {
    /// Makes the directory what the replay says the log is: zeroes a torn tail (the file
    /// keeps its length) and, after a [point-in-time cut](LogCut), the damaged file from the
    /// cut on (restoring its length) or the file itself when its header is unusable, and the
    /// later files; then syncs. The next append starts after the last whole record.
    pub fn repair(&self, storage: &dyn Storage) -> Result<(), Error> {
        if let Some(torn) = &self.torn {
            zero_from(storage, &torn.file, torn.valid_up_to, torn.file_bytes, None)?;
        }
        let Some(cut) = &self.cut else { return Ok(()) };
        for path in &cut.later_files {
            std::fs::remove_file(path).map_err(|e| Error::io("remove", path, &e))?;
        }
        if cut.offset < FileHeader::SIZE as u64 {
            match std::fs::remove_file(&cut.file) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io("remove", &cut.file, &e)),
            }
        } else {
            let written = cut.offset + cut.bytes_dropped;
            zero_from(storage, &cut.file, cut.offset, written, Some(cut.reserved_bytes))?;
        }
        if let Some(dir) = cut.file.parent() {
            storage.sync_dir(dir).map_err(|e| Error::io("fsync dir", dir, &e))?;
        }
        Ok(())
    }
}

/// Zeroes `path` from `from` to `to` (punching a hole where the file system can), restores
/// its length to at least `length`, and syncs it.
fn zero_from(storage: &dyn Storage, path: &Path, from: u64, to: u64, length: Option<u64>) -> Result<(), Error> {
    let file = storage.open(path).map_err(|e| Error::io("open", path, &e))?;
    if to > from {
        let punched = file.punch_hole(from, to - from).map_err(|e| Error::io("zero", path, &e))?;
        if !punched {
            let zeros = vec![0u8; (to - from) as usize];
            file.write_all_at(&zeros, from).map_err(|e| Error::io("zero", path, &e))?;
        }
    }
    if let Some(length) = length {
        let meta = std::fs::metadata(path).map_err(|e| Error::io("stat", path, &e))?;
        if meta.len() < length {
            file.set_len(length).map_err(|e| Error::io("extend", path, &e))?;
        }
    }
    file.sync_data().map_err(|e| Error::io("fsync", path, &e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::StdStorage;
    use crate::writer::{log_file_name, LogWriter, SyncPolicy, WriterConfig};
    use crate::SECTOR_BYTES;
    use std::sync::Arc;

    const DIR_ID: u64 = 0xfeed;

    fn config(max_file_bytes: u64) -> WriterConfig {
        WriterConfig { policy: SyncPolicy::None, max_file_bytes }
    }

    fn log_with(dir: &Path, records: u8, max_file_bytes: u64) {
        let log = LogWriter::create(dir, Arc::new(StdStorage), config(max_file_bytes), DIR_ID, 1).unwrap();
        for i in 0..records {
            log.append(RecordKind::AppendKv, &[i; 20]).unwrap();
        }
        log.close().unwrap();
    }

    fn strict(dir: &Path) -> Result<LogReplay, Error> {
        replay_dir(dir, DIR_ID, 1, RecoveryMode::Strict)
    }

    #[test]
    fn a_crash_in_the_last_write_is_zeroed_and_appends_go_on_in_the_same_file() {
        let dir = tempfile::tempdir().unwrap();
        log_with(dir.path(), 60, 1 << 20);
        let path = dir.path().join(log_file_name(1));
        let full = std::fs::read(&path).unwrap();
        let written = strict(dir.path()).unwrap();
        let end = written.files[0].end as usize;
        // The last sectors of the records never landed.
        let mut crashed = full.clone();
        let landed = (end - 1) / SECTOR_BYTES * SECTOR_BYTES;
        crashed[landed..].fill(0);
        std::fs::write(&path, &crashed).unwrap();
        let replay = strict(dir.path()).unwrap();
        let torn = replay.torn.clone().expect("a torn tail");
        assert!(replay.records.len() < 60 && replay.records == written.records[..replay.records.len()]);
        assert_eq!(torn.valid_up_to, replay.files[0].end);
        replay.repair(&StdStorage).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), full.len() as u64, "the file keeps its length");
        let log = LogWriter::resume(dir.path(), Arc::new(StdStorage), config(1 << 20), DIR_ID, &replay).unwrap();
        let lsn = log.append(RecordKind::AppendKv, b"after").unwrap();
        log.close().unwrap();
        assert_eq!(lsn, replay.next_lsn);
        let again = strict(dir.path()).unwrap();
        assert_eq!((again.torn.clone(), again.files.len()), (None, 1), "one file, no new one per open");
        assert_eq!(again.records.last().unwrap().payload, b"after");
        assert_eq!(again.records.len(), replay.records.len() + 1);
    }

    #[test]
    fn a_truncated_newest_file_is_damage_and_point_in_time_recovery_reports_the_cut() {
        let dir = tempfile::tempdir().unwrap();
        log_with(dir.path(), 30, 1 << 20);
        let path = dir.path().join(log_file_name(1));
        let full = std::fs::read(&path).unwrap();
        let all = strict(dir.path()).unwrap();
        let end = all.files[0].end as usize;
        for cut in [0, 10, FileHeader::SIZE, FileHeader::SIZE + 30, end - 1, end, end + 100] {
            std::fs::write(&path, &full[..cut]).unwrap();
            let error = strict(dir.path()).unwrap_err();
            match cut < FileHeader::SIZE {
                true => assert!(
                    matches!(&error, Error::InFile { source, .. } if matches!(**source, Error::HeaderTruncated { .. })),
                    "cut {cut}: {error}"
                ),
                false => assert!(matches!(error, Error::LogTruncated { .. }), "cut {cut}: {error}"),
            }
            let pit = replay_dir(dir.path(), DIR_ID, 1, RecoveryMode::PointInTime).unwrap();
            let cut_at = pit.cut.clone().expect("a cut");
            assert_eq!(pit.records, all.records[..pit.records.len()], "cut {cut}");
            assert_eq!(cut_at.next_lsn, 1 + pit.records.len() as u64);
            pit.repair(&StdStorage).unwrap();
            let log = LogWriter::resume(dir.path(), Arc::new(StdStorage), config(1 << 20), DIR_ID, &pit).unwrap();
            log.append(RecordKind::AppendKv, b"after").unwrap();
            log.close().unwrap();
            let again = strict(dir.path()).unwrap();
            assert_eq!(again.records.len(), pit.records.len() + 1, "cut {cut}");
            std::fs::write(&path, &full).unwrap();
        }
    }

    #[test]
    fn damage_in_an_older_file_names_the_file_and_offset() {
        let dir = tempfile::tempdir().unwrap();
        log_with(dir.path(), 20, 100);
        let files = list_log_files(dir.path()).unwrap();
        assert!(files.len() >= 3);
        let (_, victim) = &files[1];
        let mut bytes = std::fs::read(victim).unwrap();
        bytes[FileHeader::SIZE + crate::FRAME_HEADER_BYTES + 3] ^= 0x10;
        std::fs::write(victim, &bytes).unwrap();
        match strict(dir.path()) {
            Err(Error::InFile { file, source }) => {
                assert_eq!(&file, victim);
                assert_eq!(source.offset(), Some(FileHeader::SIZE));
            }
            other => panic!("{other:?}"),
        }
        let pit = replay_dir(dir.path(), DIR_ID, 1, RecoveryMode::PointInTime).unwrap();
        let cut = pit.cut.expect("a cut");
        assert_eq!((cut.file, cut.offset), (victim.clone(), FileHeader::SIZE as u64));
        assert_eq!(cut.later_files.len(), files.len() - 2);
    }

    #[test]
    fn a_swapped_file_a_missing_middle_file_or_another_directory_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        log_with(dir.path(), 20, 100);
        let files = list_log_files(dir.path()).unwrap();
        let second = std::fs::read(&files[1].1).unwrap();
        let third = std::fs::read(&files[2].1).unwrap();
        std::fs::write(&files[1].1, &third).unwrap();
        assert!(
            matches!(strict(dir.path()), Err(Error::InFile { source, .. }) if matches!(*source, Error::Misplaced { .. }))
        );
        std::fs::write(&files[1].1, &second).unwrap();
        assert!(
            matches!(replay_dir(dir.path(), DIR_ID + 1, 1, RecoveryMode::Strict), Err(Error::InFile { source, .. }) if matches!(*source, Error::ForeignDirectory { .. }))
        );
        std::fs::remove_file(&files[0].1).unwrap();
        std::fs::remove_file(&files[2].1).unwrap();
        assert!(matches!(replay_dir(dir.path(), DIR_ID, files[1].0, RecoveryMode::Strict), Err(Error::LsnGap { .. })));
    }
}
