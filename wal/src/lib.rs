//! Write-ahead log of attnstore: the on-disk framing of the append-only log file.
//!
//! A log file opens with a fixed [`FileHeader`] and continues with checksummed,
//! length-prefixed record frames ([`encode_record`], [`RecordReader`]). The reader tells a
//! clean end from a torn tail (what a crash leaves; recovery truncates there) and from
//! corruption in the middle of the log (an [`Error`] with its byte offset). Group commit,
//! fsync and replay build on this framing; `docs/wal-format.md` describes the bytes.
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
mod record;
#[cfg(test)]
mod sample_log;

pub use error::Error;
pub use fuzz::fuzz_decode;
pub use header::{FileHeader, FORMAT_VERSION, MAGIC};
pub use record::{encode_record, Record, RecordKind, RecordReader, Tail, FRAME_HEADER_BYTES, MAX_RECORD_BYTES};
