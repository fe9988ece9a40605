//! Write-ahead log of attnstore: framing, group-commit writer, replay and the manifest.
//!
//! A log file opens with a fixed [`FileHeader`] and continues with checksummed,
//! length-prefixed record frames ([`encode_record`], [`RecordReader`]). The reader tells a
//! clean end from a torn tail (what a crash leaves; recovery truncates there) and from
//! corruption in the middle of the log (an [`Error`] with its byte offset). [`LogWriter`]
//! appends frames to rotating files with group commit under a [`SyncPolicy`];
//! [`replay_dir`] reads a directory of them back; [`write_manifest`] replaces a checkpoint
//! manifest atomically. All writes go through [`Storage`], so tests can inject a full disk
//! or a failing fsync. `docs/wal-format.md` describes the bytes.
//!
//! ```
//! use attnstore_wal::{encode_record, FileHeader, RecordKind, RecordReader, Tail};
//!
//! let mut log = FileHeader::new().encode().to_vec();
//! encode_record(RecordKind::CreateContext, b"context 7", &mut log)?;
//! encode_record(RecordKind::AppendKv, b"kv rows", &mut log)?;
//! log.truncate(log.len() - 2); // a crash tore the last write
//!
//! let mut reader = RecordReader::open_log(&log)?;
//! let first = reader.next().expect("one whole record")?;
//! assert_eq!((first.kind, first.payload), (RecordKind::CreateContext, &b"context 7"[..]));
//! assert!(reader.next().is_none());
//! assert_eq!(reader.tail(), Some(Tail::Torn { valid_up_to: first.end() }));
//! # Ok::<(), attnstore_wal::Error>(())
//! ```
#![deny(unsafe_code)]

mod error;
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
pub use fuzz::fuzz_decode;
pub use header::{FileHeader, FORMAT_VERSION, MAGIC};
pub use manifest::{decode_manifest, read_manifest, write_manifest};
pub use record::{encode_record, Record, RecordKind, RecordReader, Tail, FRAME_HEADER_BYTES, MAX_RECORD_BYTES};
pub use replay::{list_log_files, replay_dir, LogFileSummary, LogReplay, ReplayedRecord, TornTail};
pub use storage::{FaultyStorage, StdStorage, Storage, StorageFile};
pub use writer::{
    log_file_name, parse_log_file_name, LogWriter, Lsn, SyncPolicy, WriterConfig, WriterStats, SUBMIT_WRITE_BYTES,
};
