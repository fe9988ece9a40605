//! The one error type of the WAL crate: every way a header or a record frame is refused.
//!
//! Variants carry what was expected and what came, and the byte offset of the frame, so
//! recovery can say exactly where a log went bad instead of "corrupt log".

/// Everything that can go wrong while encoding or decoding the log.
///
/// Offsets are positions in the buffer given to the reader; for a reader made with
/// [`RecordReader::open_log`](crate::RecordReader::open_log) they are file offsets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The buffer ends before the fixed file header does.
    #[error("wal header truncated: expected {expected_bytes} bytes, got {got_bytes}")]
    HeaderTruncated {
        /// Size of the file header.
        expected_bytes: usize,
        /// Bytes that were there.
        got_bytes: usize,
    },
    /// The file does not start with the log magic: it is not an attnstore log.
    #[error("not an attnstore wal: expected magic {expected:?}, got {got:?}")]
    BadMagic {
        /// The log magic, [`MAGIC`](crate::MAGIC).
        expected: [u8; 8],
        /// The first eight bytes of the file.
        got: [u8; 8],
    },
    /// The header's crc32c does not match its bytes.
    #[error("wal header checksum mismatch: stored {expected:#010x}, computed {got:#010x}")]
    HeaderChecksumMismatch {
        /// The crc32c stored in the header.
        expected: u32,
        /// The crc32c computed over the header's bytes.
        got: u32,
    },
    /// The header is intact but names a format version this build cannot read.
    #[error("unsupported wal format version: expected {expected}, got {got}")]
    UnsupportedVersion {
        /// The version this build reads, [`FORMAT_VERSION`](crate::FORMAT_VERSION).
        expected: u32,
        /// The version in the header.
        got: u32,
    },
    /// A frame's crc32c does not match and more log follows it: corruption, not a torn write.
    #[error("wal record at offset {offset}: checksum mismatch, stored {expected:#010x}, computed {got:#010x}")]
    ChecksumMismatch {
        /// Offset of the frame.
        offset: usize,
        /// The crc32c stored in the frame.
        expected: u32,
        /// The crc32c computed over the frame's kind and payload.
        got: u32,
    },
    /// A frame's length field is over the reader's maximum record size.
    #[error("wal record at offset {offset}: length {got_bytes} over the maximum of {max_bytes} bytes")]
    RecordTooLarge {
        /// Offset of the frame.
        offset: usize,
        /// The reader's maximum payload size.
        max_bytes: u32,
        /// The payload length in the frame.
        got_bytes: u32,
    },
    /// A frame passes its checksum but its kind code is not a known [`RecordKind`](crate::RecordKind).
    #[error("wal record at offset {offset}: unknown record kind code {code}")]
    UnknownRecordKind {
        /// Offset of the frame.
        offset: usize,
        /// The kind byte in the frame.
        code: u8,
    },
    /// [`encode_record`](crate::encode_record) was given a payload over [`MAX_RECORD_BYTES`](crate::MAX_RECORD_BYTES).
    #[error("wal payload of {got_bytes} bytes over the maximum of {max_bytes} bytes")]
    PayloadTooLarge {
        /// The largest payload a frame may carry.
        max_bytes: usize,
        /// The payload size given.
        got_bytes: usize,
    },
}

impl Error {
    /// Offset of the bad record frame, for errors that come from one.
    pub fn offset(&self) -> Option<usize> {
        match self {
            Error::ChecksumMismatch { offset, .. }
            | Error::RecordTooLarge { offset, .. }
            | Error::UnknownRecordKind { offset, .. } => Some(*offset),
            _ => None,
        }
    }
}
