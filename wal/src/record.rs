//! Record frames of the log: `[len: u32][crc32c: u32][kind: u8][payload: len bytes]`, little-endian.
//!
//! [`encode_record`] appends one frame; [`RecordReader`] walks frames back out of a buffer and
//! either ends in a [`Tail`] (clean, or torn by a crash) or stops at the first corrupt frame
//! with an [`Error`] carrying its offset. The length is checked against a maximum and against
//! the buffer before it is used, and the checksum before the kind byte is believed.

use std::iter::FusedIterator;

use zerocopy::byteorder::little_endian::U32;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::{Error, FileHeader};

/// Bytes before a frame's payload: length (4), crc32c (4) and kind (1).
pub const FRAME_HEADER_BYTES: usize = 9;

/// Largest payload [`encode_record`] writes and, by default, [`RecordReader`] accepts: 64 MiB.
pub const MAX_RECORD_BYTES: u32 = 64 << 20;

/// The fixed part of a frame; `crc` covers the kind byte and the payload.
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct FrameHeader {
    len: U32,
    crc: U32,
    kind: u8,
}

const _: () = assert!(FRAME_HEADER_BYTES == size_of::<FrameHeader>());

/// What a record says happened. Code 0 is never assigned, so zero-filled space is never a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum RecordKind {
    /// A context (the KV cache of one sequence) was created.
    CreateContext = 1,
    /// A batch of key/value rows was appended to a context.
    AppendKv = 2,
    /// A segment file was written and synced.
    SegmentBuilt = 3,
    /// A context and its data were dropped.
    DropContext = 4,
    /// A checkpoint was taken; replay starts after the last one.
    Checkpoint = 5,
}

impl RecordKind {
    /// Every kind, in code order.
    pub const ALL: [RecordKind; 5] = [
        RecordKind::CreateContext,
        RecordKind::AppendKv,
        RecordKind::SegmentBuilt,
        RecordKind::DropContext,
        RecordKind::Checkpoint,
    ];

    /// The kind's byte in a frame.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The kind with this byte, `None` for a code no kind has.
    pub fn from_code(code: u8) -> Option<RecordKind> {
        RecordKind::ALL.into_iter().find(|kind| kind.code() == code)
    }
}

/// One decoded record; the payload borrows from the reader's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record<'a> {
    /// Offset of the frame's first byte in the reader's buffer.
    pub offset: usize,
    /// What the record says happened.
    pub kind: RecordKind,
    /// The record's bytes, as given to [`encode_record`].
    pub payload: &'a [u8],
}

impl Record<'_> {
    /// Offset just past the frame: where the next frame starts.
    pub fn end(&self) -> usize {
        self.offset + FRAME_HEADER_BYTES + self.payload.len()
    }
}

/// How a log without corruption ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tail {
    /// The last frame ends exactly at the end of the buffer.
    Clean {
        /// The buffer's length.
        valid_up_to: usize,
    },
    /// The last frame is incomplete, or fails its checksum with nothing but zero bytes after
    /// it: what an interrupted append leaves. Recovery truncates the file to `valid_up_to`.
    Torn {
        /// End of the last whole record.
        valid_up_to: usize,
    },
}

impl Tail {
    /// End of the last whole record: where the next append goes after recovery.
    pub fn valid_up_to(self) -> usize {
        match self {
            Tail::Clean { valid_up_to } | Tail::Torn { valid_up_to } => valid_up_to,
        }
    }
}

fn frame_crc(kind_code: u8, payload: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&[kind_code]), payload)
}

/// Appends one frame holding `payload` to `out`; refuses payloads over [`MAX_RECORD_BYTES`].
pub fn encode_record(kind: RecordKind, payload: &[u8], out: &mut Vec<u8>) -> Result<(), Error> {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|&len| len <= MAX_RECORD_BYTES)
        .ok_or(Error::PayloadTooLarge { max_bytes: MAX_RECORD_BYTES as usize, got_bytes: payload.len() })?;
    let header = FrameHeader { len: U32::new(len), crc: U32::new(frame_crc(kind.code(), payload)), kind: kind.code() };
    out.reserve(FRAME_HEADER_BYTES + payload.len());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(payload);
    Ok(())
}

/// Reads record frames out of a buffer, in order, as an iterator of `Result<Record, Error>`.
///
/// Iteration ends with `None` once the records run out; [`tail`](Self::tail) then says
/// whether the end was clean or torn. A corrupt frame is yielded as one `Err` and the
/// reader stops there. The rule between the two: a frame the buffer cuts short is torn;
/// a whole frame failing its checksum is torn only when nothing but zero bytes follows it
/// (a crash can leave a file extended with zeros) and corruption otherwise; a length over
/// the maximum or an unknown kind code is always corruption.
#[derive(Debug, Clone)]
pub struct RecordReader<'a> {
    bytes: &'a [u8],
    position: usize,
    max_record_bytes: u32,
    state: State,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Reading,
    Ended(Tail),
    Failed,
}

enum Step<'a> {
    Record(Record<'a>),
    End(Tail),
}

impl<'a> RecordReader<'a> {
    /// Reads frames from the start of `bytes`, which holds no file header.
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, position: 0, max_record_bytes: MAX_RECORD_BYTES, state: State::Reading }
    }

    /// Checks the [`FileHeader`] at the start of a whole log file and reads the frames after
    /// it; offsets are then file offsets.
    pub fn open_log(file: &'a [u8]) -> Result<Self, Error> {
        FileHeader::decode(file)?;
        Ok(Self { position: FileHeader::SIZE, ..Self::new(file) })
    }

    /// Sets the largest payload accepted; a longer length field is reported as corruption.
    pub fn with_max_record_bytes(self, max_record_bytes: u32) -> Self {
        Self { max_record_bytes, ..self }
    }

    /// Offset of the next frame: the end of the last record yielded.
    pub fn position(&self) -> usize {
        self.position
    }

    /// How the log ends, once iteration has returned `None`; `None` before that and after an error.
    pub fn tail(&self) -> Option<Tail> {
        match self.state {
            State::Ended(tail) => Some(tail),
            State::Reading | State::Failed => None,
        }
    }

    fn read_frame(&self) -> Result<Step<'a>, Error> {
        let offset = self.position;
        let rest = &self.bytes[offset..];
        let torn = Step::End(Tail::Torn { valid_up_to: offset });
        if rest.is_empty() {
            return Ok(Step::End(Tail::Clean { valid_up_to: offset }));
        }
        let Ok((header, after_header)) = FrameHeader::ref_from_prefix(rest) else {
            return Ok(torn);
        };
        let len = header.len.get();
        if len > self.max_record_bytes {
            return Err(Error::RecordTooLarge { offset, max_bytes: self.max_record_bytes, got_bytes: len });
        }
        // `len` is at most a u32 and `after_header` is in memory, so a short buffer is a plain comparison.
        let Some((payload, after_frame)) = after_header.split_at_checked(len as usize) else {
            return Ok(torn);
        };
        let computed = frame_crc(header.kind, payload);
        if computed != header.crc.get() {
            if after_frame.iter().all(|&byte| byte == 0) {
                return Ok(torn);
            }
            return Err(Error::ChecksumMismatch { offset, expected: header.crc.get(), got: computed });
        }
        let kind = RecordKind::from_code(header.kind).ok_or(Error::UnknownRecordKind { offset, code: header.kind })?;
        Ok(Step::Record(Record { offset, kind, payload }))
    }
}

impl<'a> Iterator for RecordReader<'a> {
    type Item = Result<Record<'a>, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.state != State::Reading {
            return None;
        }
        match self.read_frame() {
            Ok(Step::Record(record)) => {
                self.position = record.end();
                Some(Ok(record))
            }
            Ok(Step::End(tail)) => {
                self.state = State::Ended(tail);
                None
            }
            Err(error) => {
                self.state = State::Failed;
                Some(Err(error))
            }
        }
    }
}

impl FusedIterator for RecordReader<'_> {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample_log::{sample_log, Written};

    /// Reads a whole log: the records as owned pairs, then the tail or the error.
    fn read_log(log: &[u8]) -> (Written, Result<Tail, Error>) {
        let mut reader = RecordReader::open_log(log).unwrap();
        let mut records = Vec::new();
        for item in reader.by_ref() {
            match item {
                Ok(record) => records.push((record.kind, record.payload.to_vec())),
                Err(error) => return (records, Err(error)),
            }
        }
        (records, Ok(reader.tail().unwrap()))
    }

    #[test]
    fn records_of_random_sizes_round_trip_with_a_clean_end() {
        for seed in 0..8 {
            let (log, written) = sample_log(seed, 200, if seed % 2 == 0 { 64 } else { 5000 });
            assert_eq!(read_log(&log), (written, Ok(Tail::Clean { valid_up_to: log.len() })));
        }
    }

    #[test]
    fn every_truncation_point_is_a_clean_end_or_a_torn_tail_at_the_last_whole_record() {
        let (log, written) = sample_log(7, 40, 48);
        let mut ends = vec![FileHeader::SIZE];
        ends.extend(RecordReader::open_log(&log).unwrap().map(|record| record.unwrap().end()));
        for cut in FileHeader::SIZE..=log.len() {
            let whole = ends.iter().rposition(|&end| end <= cut).unwrap();
            let expected = if ends[whole] == cut {
                Tail::Clean { valid_up_to: cut }
            } else {
                Tail::Torn { valid_up_to: ends[whole] }
            };
            assert_eq!(read_log(&log[..cut]), (written[..whole].to_vec(), Ok(expected)), "cut at {cut}");
        }
    }

    #[test]
    fn a_flipped_bit_anywhere_never_reads_as_an_intact_log_nor_yields_a_wrong_record() {
        let (log, written) = sample_log(11, 24, 40);
        for bit in 0..log.len() * 8 {
            let mut damaged = log.clone();
            damaged[bit / 8] ^= 1 << (bit % 8);
            let Ok(mut reader) = RecordReader::open_log(&damaged) else {
                assert!(bit < FileHeader::SIZE * 8, "only a header flip fails the header, bit {bit}");
                continue;
            };
            let records: Written =
                reader.by_ref().map_while(Result::ok).map(|r| (r.kind, r.payload.to_vec())).collect();
            assert!(written.starts_with(&records), "bit {bit} yielded a wrong record");
            assert_ne!(reader.tail(), Some(Tail::Clean { valid_up_to: damaged.len() }), "bit {bit} went unnoticed");
        }
    }

    #[test]
    fn a_checksum_mismatch_followed_by_more_records_is_corruption_at_its_offset() {
        let (mut log, written) = sample_log(3, 10, 32);
        let (third, third_end) =
            RecordReader::open_log(&log).unwrap().nth(2).unwrap().map(|r| (r.offset, r.end())).unwrap();
        let expected = u32::from_le_bytes(log[third + 4..third + 8].try_into().unwrap());
        log[third_end - 1] ^= 0xff;
        let (records, outcome) = read_log(&log);
        assert_eq!(records, written[..2]);
        let Err(Error::ChecksumMismatch { offset, expected: stored, got }) = outcome else { panic!("{outcome:?}") };
        assert_eq!((offset, stored), (third, expected));
        assert_ne!(got, expected);
    }

    #[test]
    fn a_checksum_mismatch_in_the_last_frame_or_before_zero_fill_is_a_torn_tail() {
        let (mut log, written) = sample_log(5, 6, 32);
        let (last, last_end) =
            RecordReader::open_log(&log).unwrap().last().unwrap().map(|r| (r.offset, r.end())).unwrap();
        log[last_end - 1] ^= 0x01;
        let torn = Ok(Tail::Torn { valid_up_to: last });
        assert_eq!(read_log(&log), (written[..5].to_vec(), torn.clone()));
        log.resize(log.len() + 4096, 0);
        assert_eq!(read_log(&log), (written[..5].to_vec(), torn));
    }

    #[test]
    fn a_zero_filled_tail_after_whole_records_is_a_torn_tail() {
        let (mut log, written) = sample_log(9, 4, 32);
        let valid_up_to = log.len();
        log.resize(valid_up_to + 100, 0);
        assert_eq!(read_log(&log), (written, Ok(Tail::Torn { valid_up_to })));
    }

    #[test]
    fn a_length_over_the_maximum_is_corruption_even_at_the_tail() {
        let mut log = FileHeader::new().encode().to_vec();
        encode_record(RecordKind::AppendKv, &[7; 100], &mut log).unwrap();
        let mut reader = RecordReader::open_log(&log).unwrap().with_max_record_bytes(99);
        let expected = Error::RecordTooLarge { offset: FileHeader::SIZE, max_bytes: 99, got_bytes: 100 };
        assert_eq!(reader.next(), Some(Err(expected)));
        assert_eq!((reader.next(), reader.tail()), (None, None));
    }

    #[test]
    fn an_unknown_kind_with_a_valid_checksum_is_a_typed_error() {
        let mut log = FileHeader::new().encode().to_vec();
        let payload = b"from a newer writer";
        log.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        log.extend_from_slice(&frame_crc(42, payload).to_le_bytes());
        log.push(42);
        log.extend_from_slice(payload);
        let expected = Error::UnknownRecordKind { offset: FileHeader::SIZE, code: 42 };
        assert_eq!(read_log(&log), (vec![], Err(expected)));
    }

    #[test]
    fn every_kind_code_maps_back_to_its_kind_and_zero_is_unassigned() {
        for kind in RecordKind::ALL {
            assert_eq!(RecordKind::from_code(kind.code()), Some(kind));
        }
        assert_eq!(RecordKind::from_code(0), None);
    }

    #[test]
    fn a_payload_over_the_maximum_is_refused_before_anything_is_written() {
        let payload = vec![0; MAX_RECORD_BYTES as usize + 1];
        let mut out = Vec::new();
        let expected = Error::PayloadTooLarge { max_bytes: MAX_RECORD_BYTES as usize, got_bytes: payload.len() };
        assert_eq!(encode_record(RecordKind::AppendKv, &payload, &mut out), Err(expected));
        assert!(out.is_empty());
    }
}
