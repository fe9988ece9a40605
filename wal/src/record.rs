//! Record frames of the log: `[len: u32][kind: u8][crc32c: u32][head crc32c: u32][payload]`,
//! little-endian. The head checksum covers length, kind and payload checksum, so a damaged
//! length is caught before it is used; the payload checksum covers the frame's place.
//!
//! [`encode_record`] appends one frame; [`RecordReader`] walks frames back out of a buffer and
//! either ends in a [`Tail`] (clean, or torn by a crash) or stops at the first damaged frame
//! with an [`Error`] carrying its offset. The length is checked against a maximum and against
//! the buffer before it is used, and the checksum before the kind byte is believed. In a log
//! file the checksum is seeded with the file's identity and the record's position
//! ([`encode_record_in`]), so a frame is only valid where it was written.

use std::iter::FusedIterator;

use zerocopy::byteorder::little_endian::U32;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::{Error, FileHeader, FileIdentity};

/// Bytes before a frame's payload: length (4), kind (1), crc32c (4) and head crc32c (4).
pub const FRAME_HEADER_BYTES: usize = 13;

/// Largest payload [`encode_record`] writes and, by default, [`RecordReader`] accepts: 64 MiB.
pub const MAX_RECORD_BYTES: u32 = 64 << 20;

/// The unit a crash writes whole or not at all: a torn write leaves whole 512-byte sectors
/// of the last group write unwritten (zero in a preallocated log file), never a sector with
/// some of its new bytes and not others (the power-safe-overwrite assumption, as SQLite's).
pub const SECTOR_BYTES: usize = 512;

/// The fixed part of a frame; `crc` covers the file's seed (if any), the kind byte and the
/// payload; `head_crc` covers the 9 bytes before it (no seed, so a frame head is
/// recognisable anywhere).
#[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
struct FrameHeader {
    len: U32,
    kind: u8,
    crc: U32,
    head_crc: U32,
}

impl FrameHeader {
    fn new(len: u32, kind: u8, crc: u32) -> Self {
        let mut header = Self { len: U32::new(len), kind, crc: U32::new(crc), head_crc: U32::ZERO };
        header.head_crc = U32::new(header.computed_head_crc());
        header
    }

    fn computed_head_crc(&self) -> u32 {
        crc32c::crc32c(&self.as_bytes()[..FRAME_HEADER_BYTES - 4])
    }

    fn head_intact(&self) -> bool {
        self.head_crc.get() == self.computed_head_crc()
    }
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

    /// The kind's name, as messages print it.
    pub fn name(self) -> &'static str {
        match self {
            RecordKind::CreateContext => "create-context",
            RecordKind::AppendKv => "append",
            RecordKind::SegmentBuilt => "segment-built",
            RecordKind::DropContext => "drop-context",
            RecordKind::Checkpoint => "checkpoint",
        }
    }
}

impl std::fmt::Display for RecordKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
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

/// How a log without damage ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tail {
    /// Nothing but zero bytes (or nothing) follows the last frame.
    Clean {
        /// End of the last whole record.
        valid_up_to: usize,
    },
    /// The frame after the last whole record is what an interrupted group write leaves: it
    /// fails its checksum (or runs past the buffer) and one of its sectors is wholly unwritten
    /// (zero). Nothing in it was acknowledged; recovery zeroes it from `valid_up_to` on.
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

/// The crc a frame carries: over the seed of its place (if it has one; the seed is the
/// crc32c of the place's 16 bytes, so appending to it continues that crc), then its kind
/// byte and payload. Computed in one pass: no crc combination, whose cost grows with the
/// payload's length in matrix products.
fn frame_crc(seed: Option<u32>, kind_code: u8, payload: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c_append(seed.unwrap_or(0), &[kind_code]), payload)
}

fn encode_frame(kind: RecordKind, payload: &[u8], seed: Option<u32>, out: &mut Vec<u8>) -> Result<(), Error> {
    push_frame(kind, payload, || frame_crc(seed, kind.code(), payload), out)
}

/// Appends the frame of `payload` with the crc `crc` gives, once the length is known to fit.
fn push_frame(kind: RecordKind, payload: &[u8], crc: impl FnOnce() -> u32, out: &mut Vec<u8>) -> Result<(), Error> {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|&len| len <= MAX_RECORD_BYTES)
        .ok_or(Error::PayloadTooLarge { max_bytes: MAX_RECORD_BYTES as usize, got_bytes: payload.len() })?;
    let header = FrameHeader::new(len, kind.code(), crc());
    out.reserve(FRAME_HEADER_BYTES + payload.len());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(payload);
    Ok(())
}

/// Appends one bare frame holding `payload` to `out` (checksum over kind and payload only,
/// read by [`RecordReader::new`]); refuses payloads over [`MAX_RECORD_BYTES`].
pub fn encode_record(kind: RecordKind, payload: &[u8], out: &mut Vec<u8>) -> Result<(), Error> {
    encode_frame(kind, payload, None, out)
}

/// Appends the frame of the `ordinal`-th record (from 0) of the file of `identity` to `out`:
/// its checksum is seeded with the file's place, as [`RecordReader::open_log`] checks it.
pub fn encode_record_in(
    identity: FileIdentity,
    ordinal: u64,
    kind: RecordKind,
    payload: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), Error> {
    encode_frame(kind, payload, Some(identity.frame_seed(ordinal)), out)
}

/// A frame with any kind code, for tests of unknown kinds.
#[cfg(test)]
pub(crate) fn encode_raw(identity: FileIdentity, ordinal: u64, kind_code: u8, payload: &[u8], out: &mut Vec<u8>) {
    let crc = frame_crc(Some(identity.frame_seed(ordinal)), kind_code, payload);
    out.extend_from_slice(FrameHeader::new(payload.len() as u32, kind_code, crc).as_bytes());
    out.extend_from_slice(payload);
}

/// A frame whose checksum is left for [`seal_frame`] to fill in.
pub(crate) fn encode_unsealed(kind: RecordKind, payload: &[u8], out: &mut Vec<u8>) -> Result<(), Error> {
    push_frame(kind, payload, || 0, out)
}

/// Seals a frame made by [`encode_unsealed`] (or [`encode_record`]) as the record at `key` (its LSN) of the
/// log of `dir_id`; the writer encodes frames before their LSN is known and seals them under
/// its lock (one crc32c pass over the payload, at memory speed).
pub(crate) fn seal_frame(frame: &mut [u8], dir_id: u64, key: u64) {
    let (head, payload) = frame.split_at_mut(FRAME_HEADER_BYTES);
    let header = FrameHeader::read_from_bytes(head).expect("a frame starts with its header");
    let seed = FileIdentity { dir_id, file_id: key }.frame_seed(0);
    let crc = frame_crc(Some(seed), header.kind, payload);
    head.copy_from_slice(FrameHeader::new(header.len.get(), header.kind, crc).as_bytes());
}

/// Reads record frames out of a buffer, in order, as an iterator of `Result<Record, Error>`.
///
/// Iteration ends with `None` once the records run out; [`tail`](Self::tail) then says
/// whether the end was clean or torn. A damaged frame is yielded as one `Err` and the reader
/// stops there. Bytes past the end of the buffer read as zeros (a log file is read up to its
/// last written byte; its preallocated rest is zero). The rules, for the frame after the
/// last whole record: nothing but zeros left is a clean end. A frame is torn (what a crash
/// during the last group write leaves) only when both hold: one of its sectors
/// ([`SECTOR_BYTES`], aligned to the buffer's start) is wholly zero where its bytes should
/// be, and no whole frame of a later record follows it. Anything else that fails a checksum,
/// a length over the maximum and an unknown kind code are damage.
#[derive(Debug, Clone)]
pub struct RecordReader<'a> {
    bytes: &'a [u8],
    position: usize,
    max_record_bytes: u32,
    /// The file whose frames these are, for seeded checksums; `None` for bare frames.
    identity: Option<FileIdentity>,
    ordinal: u64,
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
    /// Reads bare frames ([`encode_record`]) from the start of `bytes`, which holds no file header.
    pub fn new(bytes: &'a [u8]) -> Self {
        Self {
            bytes,
            position: 0,
            max_record_bytes: MAX_RECORD_BYTES,
            identity: None,
            ordinal: 0,
            state: State::Reading,
        }
    }

    /// Checks the [`FileHeader`] at the start of a whole log file and reads the frames after
    /// it, their checksums seeded with the header's identity; offsets are then file offsets.
    pub fn open_log(file: &'a [u8]) -> Result<Self, Error> {
        let header = FileHeader::decode(file)?;
        Ok(Self { position: FileHeader::SIZE, identity: Some(header.identity()), ..Self::new(file) })
    }

    /// [`open_log`](Self::open_log) of a file that must have `identity` (its directory and place).
    pub fn open_log_expecting(file: &'a [u8], identity: FileIdentity) -> Result<Self, Error> {
        FileHeader::decode_expecting(file, identity)?;
        Self::open_log(file)
    }

    /// Sets the largest payload accepted; a longer length field is reported as damage.
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

    /// Whether some sector's share of `start..end` is wholly zero (bytes past the buffer
    /// count as zero): the mark of a write that did not land.
    fn has_unwritten_sector(&self, start: usize, end: usize) -> bool {
        let mut at = start;
        while at < end {
            let sector_end = ((at / SECTOR_BYTES) + 1) * SECTOR_BYTES;
            let part_end = sector_end.min(end);
            let in_buffer = &self.bytes[at.min(self.bytes.len())..part_end.min(self.bytes.len())];
            if in_buffer.iter().all(|&byte| byte == 0) {
                return true;
            }
            at = part_end;
        }
        false
    }

    /// Offset of the first whole frame after `from` whose head is intact and whose payload
    /// checksum is that of a record after the current one: evidence that the records before
    /// it were followed by more, so a failing frame there is not a torn last write.
    fn later_record_after(&self, from: usize) -> Option<usize> {
        let end = self.bytes.len().saturating_sub(FRAME_HEADER_BYTES);
        (from + 1..=end).find(|&at| {
            let Ok((header, rest)) = FrameHeader::ref_from_prefix(&self.bytes[at..]) else { return false };
            if !header.head_intact() || header.len.get() > self.max_record_bytes {
                return false;
            }
            let Some(payload) = rest.get(..header.len.get() as usize) else { return false };
            match self.identity {
                // The next records of a log file: the k-th one after the failing frame starts at
                // least k frame heads after it (and a torn group is far shorter than 4096 records).
                Some(identity) => (1..=((at - from) / FRAME_HEADER_BYTES).min(4096) as u64).any(|k| {
                    let seed = identity.frame_seed(self.ordinal + k);
                    frame_crc(Some(seed), header.kind, payload) == header.crc.get()
                }),
                None => frame_crc(None, header.kind, payload) == header.crc.get(),
            }
        })
    }

    fn read_frame(&self) -> Result<Step<'a>, Error> {
        let offset = self.position;
        let rest = &self.bytes[offset..];
        if rest.iter().all(|&byte| byte == 0) {
            return Ok(Step::End(Tail::Clean { valid_up_to: offset }));
        }
        // Bytes past the buffer are zeros: pad a frame header the buffer cuts short.
        let mut padded = [0u8; FRAME_HEADER_BYTES];
        let have = rest.len().min(FRAME_HEADER_BYTES);
        padded[..have].copy_from_slice(&rest[..have]);
        let header = FrameHeader::read_from_bytes(&padded).expect("the padded header has the frame header's size");
        let torn_or = |error: Error, end: usize| {
            if self.has_unwritten_sector(offset, end) && self.later_record_after(offset).is_none() {
                Ok(Step::End(Tail::Torn { valid_up_to: offset }))
            } else {
                Err(error)
            }
        };
        if !header.head_intact() {
            let error =
                Error::FrameHeadMismatch { offset, expected: header.head_crc.get(), got: header.computed_head_crc() };
            return torn_or(error, offset + FRAME_HEADER_BYTES);
        }
        let len = header.len.get();
        if len > self.max_record_bytes {
            return Err(Error::RecordTooLarge { offset, max_bytes: self.max_record_bytes, got_bytes: len });
        }
        let end = offset + FRAME_HEADER_BYTES + len as usize;
        let seed = self.identity.map(|identity| identity.frame_seed(self.ordinal));
        let Some(payload) = self.bytes.get(offset + FRAME_HEADER_BYTES..end) else {
            // An intact head whose payload runs past the written bytes: those are zeros.
            let error = Error::ChecksumMismatch { offset, expected: header.crc.get(), got: 0 };
            return torn_or(error, end);
        };
        let computed = frame_crc(seed, header.kind, payload);
        if computed != header.crc.get() {
            return torn_or(Error::ChecksumMismatch { offset, expected: header.crc.get(), got: computed }, end);
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
                self.ordinal += 1;
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
    use crate::sample_log::{sample_log, Written, SAMPLE_ID};

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

    fn ends(log: &[u8]) -> Vec<usize> {
        let mut ends = vec![FileHeader::SIZE];
        ends.extend(RecordReader::open_log(log).unwrap().map(|record| record.unwrap().end()));
        ends
    }

    #[test]
    fn records_of_random_sizes_round_trip_with_a_clean_end_and_zeros_after_it_are_clean() {
        for seed in 0..8 {
            let (mut log, written) = sample_log(seed, 200, if seed % 2 == 0 { 64 } else { 5000 });
            let valid_up_to = log.len();
            assert_eq!(read_log(&log), (written.clone(), Ok(Tail::Clean { valid_up_to })));
            log.resize(valid_up_to + 3000, 0);
            assert_eq!(read_log(&log), (written, Ok(Tail::Clean { valid_up_to })));
        }
    }

    #[test]
    fn a_crash_that_leaves_any_prefix_of_sectors_of_the_last_write_is_a_torn_tail() {
        // The last group write is every record from `group` on; a crash lands a prefix of its
        // sectors (the rest stays zero, as in a preallocated file).
        let (log, written) = sample_log(7, 40, 300);
        let ends = ends(&log);
        for group in [ends.len() - 2, ends.len() - 4, ends.len() - 9] {
            let start = ends[group];
            let mut landed = start.next_multiple_of(SECTOR_BYTES);
            while landed < log.len() {
                let mut crashed = log.clone();
                crashed[landed..].fill(0);
                let whole = ends.iter().rposition(|&end| end <= landed).unwrap();
                let (records, tail) = read_log(&crashed);
                assert_eq!(records, written[..whole], "group at {start}, landed up to {landed}");
                let expected = if ends[whole] == landed {
                    Tail::Clean { valid_up_to: landed }
                } else {
                    Tail::Torn { valid_up_to: ends[whole] }
                };
                assert_eq!(tail, Ok(expected), "group at {start}, landed up to {landed}");
                landed += SECTOR_BYTES;
            }
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
            // No sector is unwritten: a flipped bit is never taken for a torn write.
            assert_eq!(reader.tail(), None, "bit {bit} was not reported as damage");
        }
    }

    #[test]
    fn a_flipped_bit_in_the_last_record_is_damage_not_a_torn_tail() {
        let (mut log, written) = sample_log(5, 6, 32);
        let (last, last_end) =
            RecordReader::open_log(&log).unwrap().last().unwrap().map(|r| (r.offset, r.end())).unwrap();
        log[last_end - 1] ^= 0x01;
        log.resize(log.len() + 4096, 0);
        let (records, outcome) = read_log(&log);
        assert_eq!(records, written[..5]);
        assert!(matches!(outcome, Err(Error::ChecksumMismatch { offset, .. }) if offset == last), "{outcome:?}");
        let mut length = log.clone();
        length[last + 1] ^= 0x02;
        assert!(matches!(read_log(&length).1, Err(Error::FrameHeadMismatch { .. })));
    }

    #[test]
    fn a_zeroed_sector_followed_by_later_records_is_damage() {
        let (mut log, written) = sample_log(3, 60, 100);
        let ends = ends(&log);
        log[SECTOR_BYTES..2 * SECTOR_BYTES].fill(0);
        let (records, outcome) = read_log(&log);
        let whole = ends.iter().rposition(|&end| end <= SECTOR_BYTES).unwrap();
        assert_eq!(records, written[..whole]);
        assert!(outcome.is_err(), "acknowledged records follow the hole: {outcome:?}");
    }

    #[test]
    fn a_frame_is_valid_only_at_its_own_place() {
        let mut log = FileHeader::new(SAMPLE_ID, 0).encode().to_vec();
        encode_record_in(SAMPLE_ID, 1, RecordKind::AppendKv, b"second", &mut log).unwrap();
        encode_record_in(SAMPLE_ID, 0, RecordKind::AppendKv, b"first", &mut log).unwrap();
        let (records, outcome) = read_log(&log);
        assert!(records.is_empty());
        assert!(matches!(outcome, Err(Error::ChecksumMismatch { offset: FileHeader::SIZE, .. })), "{outcome:?}");
    }

    #[test]
    fn a_length_over_the_maximum_is_damage_even_at_the_tail() {
        let mut log = FileHeader::new(SAMPLE_ID, 0).encode().to_vec();
        encode_record_in(SAMPLE_ID, 0, RecordKind::AppendKv, &[7; 100], &mut log).unwrap();
        let mut reader = RecordReader::open_log(&log).unwrap().with_max_record_bytes(99);
        let expected = Error::RecordTooLarge { offset: FileHeader::SIZE, max_bytes: 99, got_bytes: 100 };
        assert_eq!(reader.next(), Some(Err(expected)));
        assert_eq!((reader.next(), reader.tail()), (None, None));
    }

    #[test]
    fn an_unknown_kind_with_a_valid_checksum_is_a_typed_error() {
        let mut log = FileHeader::new(SAMPLE_ID, 0).encode().to_vec();
        encode_raw(SAMPLE_ID, 0, 42, b"from a newer writer", &mut log);
        let expected = Error::UnknownRecordKind { offset: FileHeader::SIZE, code: 42 };
        assert_eq!(read_log(&log), (vec![], Err(expected)));
    }

    #[test]
    fn a_sealed_bare_frame_equals_the_frame_encoded_at_its_lsn() {
        let mut bare = Vec::new();
        encode_record(RecordKind::AppendKv, b"payload", &mut bare).unwrap();
        seal_frame(&mut bare, 9, 41);
        let mut direct = Vec::new();
        encode_record_in(FileIdentity::log(9, 40), 1, RecordKind::AppendKv, b"payload", &mut direct).unwrap();
        assert_eq!(bare, direct);
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
