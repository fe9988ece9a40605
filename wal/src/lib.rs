//! Write-ahead log of attnstore: framing, group-commit writer, replay and the manifest.
//!
//! A log file opens with a fixed [`FileHeader`] and continues with checksummed,
//! length-prefixed record frames ([`encode_record_in`], [`RecordReader`]), each checksum
//! bound to the directory and the record's LSN. Log files are created at their full length
//! (zero-filled), so the reader tells a clean end from a torn tail (what a crash during the
//! last group write leaves: an unwritten sector; recovery zeroes it) and from damage to
//! written records, a truncated file included (an [`Error`] naming file and offset). [`LogWriter`]
//! appends frames to rotating files with group commit under a [`SyncPolicy`];
//! [`replay_dir`] reads a directory of them back; [`write_manifest`] replaces a checkpoint
//! manifest atomically. All writes go through [`Storage`], so tests can inject a full disk
//! or a failing fsync. `docs/wal-format.md` describes the bytes.
//!
//! ```
//! use attnstore_wal::{encode_record_in, FileHeader, FileIdentity, RecordKind, RecordReader, Tail, SECTOR_BYTES};
//!
//! let identity = FileIdentity::log(0x5eed, 1); // directory id, first LSN
//! let mut log = FileHeader::new(identity, 4096).encode().to_vec();
//! encode_record_in(identity, 0, RecordKind::CreateContext, b"context 7", &mut log)?;
//! let first_end = log.len();
//! encode_record_in(identity, 1, RecordKind::AppendKv, &[9; 600], &mut log)?;
//! // A crash during the second write: its second sector never reached the disk.
//! log[SECTOR_BYTES..].fill(0);
//!
//! let mut reader = RecordReader::open_log(&log)?;
//! let first = reader.next().expect("one whole record")?;
//! assert_eq!((first.kind, first.payload), (RecordKind::CreateContext, &b"context 7"[..]));
//! assert!(reader.next().is_none());
//! assert_eq!(reader.tail(), Some(Tail::Torn { valid_up_to: first_end }));
//!
//! // One flipped bit in a whole record is damage, not a torn write.
//! let mut damaged = log.clone();
//! damaged[first_end - 1] ^= 1;
//! assert!(RecordReader::open_log(&damaged)?.next().unwrap().is_err());
//! # Ok::<(), attnstore_wal::Error>(())
//! ```
#![deny(unsafe_code)]

mod error;
mod files;
mod fuzz;
mod header;
mod manifest;
mod record;
mod replay;
#[cfg(test)]
mod sample_log;
mod storage;
mod writer;

pub use error::Error;
pub use files::{open_regular, read_regular, MAX_LOG_FILE_BYTES};
pub use fuzz::fuzz_decode;
pub use header::{FileHeader, FileIdentity, FORMAT_VERSION, MAGIC};
pub use manifest::{decode_manifest, encode_manifest, read_manifest, write_manifest, MAX_MANIFEST_FILE_BYTES};
pub use record::{
    encode_record, encode_record_in, Record, RecordKind, RecordReader, Tail, FRAME_HEADER_BYTES, MAX_RECORD_BYTES,
    SECTOR_BYTES,
};
pub use replay::{
    list_log_files, replay_dir, LogCut, LogFileSummary, LogReplay, RecoveryMode, ReplayedRecord, TornTail,
};
pub use storage::{FaultyStorage, StdStorage, Storage, StorageFile};
pub use writer::{
    log_file_name, parse_log_file_name, LogWriter, Lsn, SyncPolicy, WriterConfig, WriterStats, SUBMIT_WRITE_BYTES,
};
