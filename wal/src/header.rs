//! The fixed header at offset 0 of every log and manifest-framed file: magic, format
//! version, the file's identity, the bytes reserved for it, crc32c.
//!
//! It is written once when a file is created and checked before any record is read, so a
//! reader never takes a foreign file, a damaged header, a newer format, or a file of another
//! engine directory or of another place in this one for records.

use zerocopy::byteorder::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::Error;

/// Magic bytes that open every attnstore log file.
pub const MAGIC: [u8; 8] = *b"ATNSWAL\0";

/// The log format version this build writes and reads. Version 2 added the identity, the
/// reserved length and frame checksums bound to their position.
pub const FORMAT_VERSION: u32 = 2;

/// Who a file belongs to: its engine directory and its place there. Every frame checksum of
/// the file is seeded with it, so a file copied to another place, or into another
/// directory, fails its checks instead of being read as if it belonged there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct FileIdentity {
    /// The engine directory's random identity (its `IDENTITY` file).
    pub dir_id: u64,
    /// The file's place in the directory: a log file's first LSN, or a hash of the file's
    /// name relative to the directory (see [`FileIdentity::named`]).
    pub file_id: u64,
}

impl FileIdentity {
    /// The identity of the log file of `dir_id` whose first record has `first_lsn`.
    pub fn log(dir_id: u64, first_lsn: u64) -> Self {
        Self { dir_id, file_id: first_lsn }
    }

    /// The identity of a manifest-framed file called `name` (relative to the engine
    /// directory, e.g. `index/ctx-3-layer-0.layout`): the name names the file's kind, its
    /// context, layer and unit, so its hash binds the file to all of them.
    pub fn named(dir_id: u64, name: &str) -> Self {
        // FNV-1a, 64-bit: a fixed, well-spread hash (std's hasher may change between releases).
        let file_id =
            name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        Self { dir_id, file_id }
    }

    /// crc32c of the place of the file's `ordinal`-th frame (from 0), which every frame
    /// checksum starts from: the directory, and the file's id plus the ordinal (for a log
    /// file, the record's LSN, so a frame is valid only at its LSN whichever file holds it).
    pub(crate) fn frame_seed(&self, ordinal: u64) -> u32 {
        let mut seed = [0u8; 16];
        seed[..8].copy_from_slice(&self.dir_id.to_le_bytes());
        seed[8..].copy_from_slice(&self.file_id.wrapping_add(ordinal).to_le_bytes());
        crc32c::crc32c(&seed)
    }
}

/// The fixed little-endian header of a log file:
/// `[magic: 8][version: u32][dir id: u64][file id: u64][reserved bytes: u64][crc32c: u32]`,
/// the crc32c taken over everything before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct FileHeader {
    magic: [u8; 8],
    version: U32,
    dir_id: U64,
    file_id: U64,
    reserved_bytes: U64,
    crc: U32,
}

const _: () = assert!(FileHeader::SIZE == size_of::<FileHeader>());

impl FileHeader {
    /// Size of the encoded header in bytes; the first record frame starts at this offset.
    pub const SIZE: usize = 40;

    /// The header of a file of `identity`, written in the current format, [`FORMAT_VERSION`],
    /// whose length was set to `reserved_bytes` when it was created (0: not preallocated).
    pub fn new(identity: FileIdentity, reserved_bytes: u64) -> Self {
        Self::with_version(FORMAT_VERSION, identity, reserved_bytes)
    }

    pub(crate) fn with_version(version: u32, identity: FileIdentity, reserved_bytes: u64) -> Self {
        let mut header = Self {
            magic: MAGIC,
            version: U32::new(version),
            dir_id: U64::new(identity.dir_id),
            file_id: U64::new(identity.file_id),
            reserved_bytes: U64::new(reserved_bytes),
            crc: U32::ZERO,
        };
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

    /// The file's identity.
    pub fn identity(&self) -> FileIdentity {
        FileIdentity { dir_id: self.dir_id.get(), file_id: self.file_id.get() }
    }

    /// The length the file was given when it was created: a crash never leaves it shorter.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved_bytes.get()
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

    /// [`decode`](Self::decode), then checks that the file is the one expected at this
    /// place: its engine directory, then its place in it.
    pub fn decode_expecting(bytes: &[u8], expected: FileIdentity) -> Result<FileHeader, Error> {
        let header = Self::decode(bytes)?;
        let got = header.identity();
        if got.dir_id != expected.dir_id {
            return Err(Error::ForeignDirectory { expected: expected.dir_id, got: got.dir_id });
        }
        if got.file_id != expected.file_id {
            return Err(Error::Misplaced { expected: expected.file_id, got: got.file_id });
        }
        Ok(header)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: FileIdentity = FileIdentity { dir_id: 0x5eed, file_id: 7 };

    #[test]
    fn a_new_header_round_trips_through_its_bytes() {
        let bytes = FileHeader::new(ID, 4096).encode();
        assert_eq!(&bytes[..8], b"ATNSWAL\0");
        assert_eq!(bytes[8..12], FORMAT_VERSION.to_le_bytes());
        let decoded = FileHeader::decode(&bytes).unwrap();
        assert_eq!((decoded, decoded.version()), (FileHeader::new(ID, 4096), FORMAT_VERSION));
        assert_eq!((decoded.identity(), decoded.reserved_bytes()), (ID, 4096));
    }

    #[test]
    fn a_header_cut_short_is_reported_with_its_length() {
        let bytes = FileHeader::new(ID, 0).encode();
        for len in 0..FileHeader::SIZE {
            assert_eq!(
                FileHeader::decode(&bytes[..len]),
                Err(Error::HeaderTruncated { expected_bytes: FileHeader::SIZE, got_bytes: len })
            );
        }
    }

    #[test]
    fn a_foreign_file_is_refused_by_its_magic() {
        let mut bytes = FileHeader::new(ID, 0).encode();
        bytes[..8].copy_from_slice(b"SQLite f");
        assert_eq!(FileHeader::decode(&bytes), Err(Error::BadMagic { expected: MAGIC, got: *b"SQLite f" }));
    }

    #[test]
    fn a_damaged_header_fails_its_checksum() {
        for at in [9, 15, 20, 30, FileHeader::SIZE - 1] {
            let mut bytes = FileHeader::new(ID, 0).encode();
            bytes[at] ^= 0x40;
            assert!(matches!(FileHeader::decode(&bytes), Err(Error::HeaderChecksumMismatch { .. })), "byte {at}");
        }
    }

    #[test]
    fn an_intact_header_of_a_newer_version_is_refused_as_unsupported() {
        let bytes = FileHeader::with_version(FORMAT_VERSION + 1, ID, 0).encode();
        assert_eq!(
            FileHeader::decode(&bytes),
            Err(Error::UnsupportedVersion { expected: FORMAT_VERSION, got: FORMAT_VERSION + 1 })
        );
    }

    #[test]
    fn a_file_of_another_directory_or_place_is_refused_by_its_identity() {
        let bytes = FileHeader::new(ID, 0).encode();
        assert!(FileHeader::decode_expecting(&bytes, ID).is_ok());
        let other_dir = FileIdentity { dir_id: 1, ..ID };
        assert_eq!(
            FileHeader::decode_expecting(&bytes, other_dir),
            Err(Error::ForeignDirectory { expected: 1, got: ID.dir_id })
        );
        let other_place = FileIdentity { file_id: 8, ..ID };
        assert_eq!(FileHeader::decode_expecting(&bytes, other_place), Err(Error::Misplaced { expected: 8, got: 7 }));
        assert_ne!(FileIdentity::named(1, "MANIFEST"), FileIdentity::named(1, "index/ctx-1-layer-0.layout"));
        assert_ne!(FileIdentity::named(1, "ctx-1-layer-0"), FileIdentity::named(1, "ctx-0-layer-1"));
    }
}
