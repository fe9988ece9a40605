//! The fixed header at offset 0 of every log file: magic, format version, crc32c.
//!
//! It is written once when a log file is created and checked before any record is read,
//! so a reader never takes a foreign file, a damaged header or a newer format for records.

use zerocopy::byteorder::little_endian::U32;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::Error;

/// Magic bytes that open every attnstore log file.
pub const MAGIC: [u8; 8] = *b"ATNSWAL\0";

/// The log format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// The fixed little-endian header of a log file: `[magic: 8][version: u32][crc32c: u32]`,
/// the crc32c taken over magic and version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct FileHeader {
    magic: [u8; 8],
    version: U32,
    crc: U32,
}

const _: () = assert!(FileHeader::SIZE == size_of::<FileHeader>());

impl FileHeader {
    /// Size of the encoded header in bytes; the first record frame starts at this offset.
    pub const SIZE: usize = 16;

    /// The header of a log written in the current format, [`FORMAT_VERSION`].
    pub fn new() -> Self {
        Self::with_version(FORMAT_VERSION)
    }

    pub(crate) fn with_version(version: u32) -> Self {
        let mut header = Self { magic: MAGIC, version: U32::new(version), crc: U32::ZERO };
        header.crc = U32::new(header.computed_crc());
        header
    }

    fn computed_crc(&self) -> u32 {
        crc32c::crc32c(&self.as_bytes()[..Self::SIZE - size_of::<U32>()])
    }

    /// The format version the log was written in.
    pub fn version(&self) -> u32 {
        self.version.get()
    }

    /// The header's bytes, to be written at offset 0 of a new log file.
    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut bytes = [0; Self::SIZE];
        bytes.copy_from_slice(self.as_bytes());
        bytes
    }

    /// Reads the header from the start of `bytes` (a longer buffer is fine) and checks, in
    /// this order, length, magic, crc32c and version: the version is only believed once the
    /// checksum says the bytes are the ones written.
    pub fn decode(bytes: &[u8]) -> Result<FileHeader, Error> {
        let (header, _records) = FileHeader::read_from_prefix(bytes)
            .map_err(|_| Error::HeaderTruncated { expected_bytes: Self::SIZE, got_bytes: bytes.len() })?;
        if header.magic != MAGIC {
            return Err(Error::BadMagic { expected: MAGIC, got: header.magic });
        }
        let computed = header.computed_crc();
        if header.crc.get() != computed {
            return Err(Error::HeaderChecksumMismatch { expected: header.crc.get(), got: computed });
        }
        if header.version() != FORMAT_VERSION {
            return Err(Error::UnsupportedVersion { expected: FORMAT_VERSION, got: header.version() });
        }
        Ok(header)
    }
}

impl Default for FileHeader {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_header_round_trips_through_its_bytes() {
        let bytes = FileHeader::new().encode();
        assert_eq!(&bytes[..8], b"ATNSWAL\0");
        assert_eq!(bytes[8..12], FORMAT_VERSION.to_le_bytes());
        let decoded = FileHeader::decode(&bytes).unwrap();
        assert_eq!((decoded, decoded.version()), (FileHeader::new(), FORMAT_VERSION));
    }

    #[test]
    fn a_header_cut_short_is_reported_with_its_length() {
        let bytes = FileHeader::new().encode();
        for len in 0..FileHeader::SIZE {
            assert_eq!(
                FileHeader::decode(&bytes[..len]),
                Err(Error::HeaderTruncated { expected_bytes: FileHeader::SIZE, got_bytes: len })
            );
        }
    }

    #[test]
    fn a_foreign_file_is_refused_by_its_magic() {
        let mut bytes = FileHeader::new().encode();
        bytes[..8].copy_from_slice(b"SQLite f");
        assert_eq!(FileHeader::decode(&bytes), Err(Error::BadMagic { expected: MAGIC, got: *b"SQLite f" }));
    }

    #[test]
    fn a_damaged_header_fails_its_checksum() {
        let mut bytes = FileHeader::new().encode();
        bytes[9] ^= 0x40;
        assert!(matches!(FileHeader::decode(&bytes), Err(Error::HeaderChecksumMismatch { .. })));
        let mut bytes = FileHeader::new().encode();
        bytes[15] ^= 0x01;
        assert!(matches!(FileHeader::decode(&bytes), Err(Error::HeaderChecksumMismatch { .. })));
    }

    #[test]
    fn an_intact_header_of_a_newer_version_is_refused_as_unsupported() {
        let bytes = FileHeader::with_version(FORMAT_VERSION + 1).encode();
        assert_eq!(
            FileHeader::decode(&bytes),
            Err(Error::UnsupportedVersion { expected: FORMAT_VERSION, got: FORMAT_VERSION + 1 })
        );
    }
}
