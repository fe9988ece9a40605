//! The one error type of the WAL crate: every way a header or a record frame is refused.
//!
//! Variants carry what was expected and what came, and the byte offset of the frame, so
//! recovery can say exactly where a log went bad instead of "corrupt log". I/O failures keep
//! the operation, the path and the OS error kind; a failed fsync poisons the writer for good.

use std::path::PathBuf;

/// Everything that can go wrong while encoding or decoding the log.
///
/// Offsets are positions in the buffer given to the reader; for a reader made with
/// [`RecordReader::open_log`](crate::RecordReader::open_log) they are file offsets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The buffer ends before the fixed file header does.
    #[error("file header truncated: expected {expected_bytes} bytes, got {got_bytes}")]
    HeaderTruncated {
        /// Size of the file header.
        expected_bytes: usize,
        /// Bytes that were there.
        got_bytes: usize,
    },
    /// The file does not start with the log magic: it is not an attnstore log.
    #[error("not an attnstore log or manifest file: expected magic {}, got {}", printable(expected), printable(got))]
    BadMagic {
        /// The log magic, [`MAGIC`](crate::MAGIC).
        expected: [u8; 8],
        /// The first eight bytes of the file.
        got: [u8; 8],
    },
    /// The header's crc32c does not match its bytes.
    #[error("file header checksum mismatch: stored {expected:#010x}, computed {got:#010x}")]
    HeaderChecksumMismatch {
        /// The crc32c stored in the header.
        expected: u32,
        /// The crc32c computed over the header's bytes.
        got: u32,
    },
    /// The header is intact but names a format version this build cannot read.
    #[error("unsupported log or manifest format version: expected {expected}, got {got}")]
    UnsupportedVersion {
        /// The version this build reads, [`FORMAT_VERSION`](crate::FORMAT_VERSION).
        expected: u32,
        /// The version in the header.
        got: u32,
    },
    /// A frame's crc32c does not match and no crash can explain it (no unwritten sector, or
    /// later records follow): damage, not a torn write. `got` is 0 when its payload runs past
    /// the file's written bytes.
    #[error("record at offset {offset}: checksum mismatch, stored {expected:#010x}, computed {got:#010x}")]
    ChecksumMismatch {
        /// Offset of the frame.
        offset: usize,
        /// The crc32c stored in the frame.
        expected: u32,
        /// The crc32c computed over the frame's kind and payload.
        got: u32,
    },
    /// A frame's head (length, kind, checksum) does not match its own checksum, and no crash
    /// can explain it.
    #[error("record at offset {offset}: frame head checksum mismatch, stored {expected:#010x}, computed {got:#010x}")]
    FrameHeadMismatch {
        /// Offset of the frame.
        offset: usize,
        /// The head crc32c stored in the frame.
        expected: u32,
        /// The crc32c computed over the frame's head.
        got: u32,
    },
    /// A frame's length field is over the reader's maximum record size.
    #[error("record at offset {offset}: length {got_bytes} over the maximum of {max_bytes} bytes")]
    RecordTooLarge {
        /// Offset of the frame.
        offset: usize,
        /// The reader's maximum payload size.
        max_bytes: u32,
        /// The payload length in the frame.
        got_bytes: u32,
    },
    /// A frame passes its checksum but its kind code is not a known [`RecordKind`](crate::RecordKind).
    #[error("record at offset {offset}: unknown record kind code {code}")]
    UnknownRecordKind {
        /// Offset of the frame.
        offset: usize,
        /// The kind byte in the frame.
        code: u8,
    },
    /// [`encode_record`](crate::encode_record) was given a payload over [`MAX_RECORD_BYTES`](crate::MAX_RECORD_BYTES).
    #[error("record payload of {got_bytes} bytes over the maximum of {max_bytes} bytes")]
    PayloadTooLarge {
        /// The largest payload a frame may carry.
        max_bytes: usize,
        /// The payload size given.
        got_bytes: usize,
    },
    /// An operating-system call on a log, manifest or data file failed.
    #[error("{op} {}: {message}", path.display())]
    Io {
        /// What was being done (`"write"`, `"fsync"`, `"create"`, ...).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error kind, for callers that branch on it (e.g. `StorageFull`).
        kind: std::io::ErrorKind,
        /// The OS error's text.
        message: String,
    },
    /// An earlier write or fsync failed, so the writer refuses all further writes: after a
    /// failed fsync the page cache may have dropped the data, and retrying is not safe.
    #[error("wal writer poisoned by an earlier failure, refusing further writes: {cause}")]
    Poisoned {
        /// The failure that poisoned the writer.
        cause: String,
    },
    /// The writer was closed.
    #[error("wal writer is closed")]
    Closed,
    /// [`crate::LogWriter::wait_durable`] for an LSN that no record has yet.
    #[error("wait for lsn {lsn}: no record has that lsn yet (the next record gets lsn {next})")]
    UnknownLsn {
        /// The LSN asked for.
        lsn: u64,
        /// The LSN the next record will get.
        next: u64,
    },
    /// A record error inside a named file (the inner error carries the offset).
    #[error("{}: {source}", file.display())]
    InFile {
        /// The log or manifest file.
        file: PathBuf,
        /// What is wrong at which offset.
        source: Box<Error>,
    },
    /// A log file other than the last one ends in a torn record: only the newest file can
    /// have been cut short by a crash, so this is damage.
    #[error("{}: torn record at offset {offset} in a log file that is not the newest one (finished files are synced before the next starts: this is damage)", file.display())]
    TornBeforeLastFile {
        /// The log file.
        file: PathBuf,
        /// End of its last whole record.
        offset: usize,
    },
    /// The log sequence numbers of consecutive log files do not join up: a file is missing.
    #[error("{}: log starts at lsn {got}, expected lsn {expected} (a log file is missing)", file.display())]
    LsnGap {
        /// The log file that starts too late.
        file: PathBuf,
        /// The lsn the previous file (or the checkpoint) ends at.
        expected: u64,
        /// The lsn in the file's name.
        got: u64,
    },
    /// A manifest is not exactly one checkpoint record after the file header.
    #[error("{}: malformed: {detail}", file.display())]
    BadManifest {
        /// The manifest file.
        file: PathBuf,
        /// What was expected and what came.
        detail: String,
    },
    /// The file belongs to another engine directory (its header names another directory id).
    #[error("the file belongs to another engine directory: expected directory id {expected:#018x}, got {got:#018x}")]
    ForeignDirectory {
        /// This directory's id.
        expected: u64,
        /// The id in the file's header.
        got: u64,
    },
    /// The file belongs to another place in this directory (another log position, or
    /// another file name: kind, context, layer or unit), e.g. copied or renamed over this one.
    #[error("the file belongs to another place in this directory: expected file id {expected:#018x}, got {got:#018x} (copied or renamed from another file?)")]
    Misplaced {
        /// The id this place expects.
        expected: u64,
        /// The id in the file's header.
        got: u64,
    },
    /// A log file is shorter than the length it was created with: a crash never shortens a
    /// preallocated file, so bytes (possibly acknowledged records) were cut off.
    #[error("{}: log file is {got_bytes} bytes, it was created with {expected_bytes}: cut short after it was written (acknowledged records may be lost; `recover --point-in-time` accepts the loss)", file.display())]
    LogTruncated {
        /// The log file.
        file: PathBuf,
        /// The length it was created with.
        expected_bytes: u64,
        /// Its length now.
        got_bytes: u64,
    },
    /// A file the engine reads is not a regular file (a directory, a device such as
    /// `/dev/zero`, a socket) or is a link to nothing.
    #[error("{}: expected a regular file, found {found}", path.display())]
    NotRegularFile {
        /// The path.
        path: PathBuf,
        /// What is there.
        found: String,
    },
    /// A file is larger than anything the engine writes there: it is not read.
    #[error("{}: {got_bytes} bytes, more than the {max_bytes} such a file can hold: not read", path.display())]
    FileTooLarge {
        /// The path.
        path: PathBuf,
        /// The largest size such a file can have.
        max_bytes: u64,
        /// Its size.
        got_bytes: u64,
    },
}

fn printable(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|&b| if b.is_ascii_graphic() { char::from(b).to_string() } else { format!("\\x{b:02x}") })
        .collect()
}

impl Error {
    /// Wraps an OS error with the operation and the path it was about.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, error: &std::io::Error) -> Self {
        Error::Io { op, path: path.into(), kind: error.kind(), message: error.to_string() }
    }

    /// Names the file a record error was found in.
    pub fn in_file(self, file: impl Into<PathBuf>) -> Self {
        match self {
            Error::InFile { .. }
            | Error::Io { .. }
            | Error::TornBeforeLastFile { .. }
            | Error::LsnGap { .. }
            | Error::BadManifest { .. }
            | Error::LogTruncated { .. }
            | Error::NotRegularFile { .. }
            | Error::FileTooLarge { .. } => self,
            other => Error::InFile { file: file.into(), source: Box::new(other) },
        }
    }

    /// Offset of the bad record frame, for errors that come from one.
    pub fn offset(&self) -> Option<usize> {
        match self {
            Error::ChecksumMismatch { offset, .. }
            | Error::FrameHeadMismatch { offset, .. }
            | Error::RecordTooLarge { offset, .. }
            | Error::UnknownRecordKind { offset, .. } => Some(*offset),
            Error::InFile { source, .. } => source.offset(),
            _ => None,
        }
    }
}
