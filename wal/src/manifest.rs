//! Manifest-framed files: a file header and exactly one `Checkpoint` record, replaced
//! atomically (write a new file, fsync it, rename it over the old one, fsync the directory)
//! so a reader sees the old file or the new one, never a mix. The manifest, the index
//! layouts and the 2-bit homes and segments are such files.
//!
//! The payload is opaque here; the framing gives it a magic, a version, the file's identity
//! (its engine directory and its name, in the header and in the record's checksum) and a
//! crc32c, and decoding refuses anything but one whole record of the expected identity.

use std::path::Path;

use crate::files::read_regular;
use crate::storage::Storage;
use crate::{
    encode_record_in, Error, FileHeader, FileIdentity, RecordKind, RecordReader, Tail, FRAME_HEADER_BYTES,
    MAX_RECORD_BYTES,
};

/// The largest manifest-framed file: a header and one record of the largest payload.
pub const MAX_MANIFEST_FILE_BYTES: u64 = (FileHeader::SIZE + FRAME_HEADER_BYTES) as u64 + MAX_RECORD_BYTES as u64;

/// The bytes of a manifest-framed file of `identity` holding `payload`.
pub fn encode_manifest(identity: FileIdentity, payload: &[u8]) -> Result<Vec<u8>, Error> {
    let mut bytes = FileHeader::new(identity, 0).encode().to_vec();
    encode_record_in(identity, 0, RecordKind::Checkpoint, payload, &mut bytes)?;
    Ok(bytes)
}

/// Replaces `dir/name` atomically with a file of `identity` holding `payload` (via `dir/name.tmp`).
pub fn write_manifest(
    storage: &dyn Storage,
    dir: &Path,
    name: &str,
    identity: FileIdentity,
    payload: &[u8],
) -> Result<(), Error> {
    let bytes = encode_manifest(identity, payload)?;
    let tmp = dir.join(format!("{name}.tmp"));
    let target = dir.join(name);
    let file = storage.create(&tmp).map_err(|e| Error::io("create", &tmp, &e))?;
    file.write_all_at(&bytes, 0).map_err(|e| Error::io("write", &tmp, &e))?;
    file.sync_data().map_err(|e| Error::io("fsync", &tmp, &e))?;
    drop(file);
    storage.rename(&tmp, &target).map_err(|e| Error::io("rename", &tmp, &e))?;
    storage.sync_dir(dir).map_err(|e| Error::io("fsync dir", dir, &e))
}

/// The payload of a manifest-framed file's bytes: the header must be intact and of
/// `identity`, and exactly one whole `Checkpoint` record must follow it. `file` only names
/// the file in errors.
pub fn decode_manifest<'a>(file: &Path, bytes: &'a [u8], identity: FileIdentity) -> Result<&'a [u8], Error> {
    let bad = |detail: String| Error::BadManifest { file: file.to_path_buf(), detail };
    let mut reader = RecordReader::open_log_expecting(bytes, identity).map_err(|e| e.in_file(file))?;
    let record = match reader.next() {
        Some(Ok(record)) => record,
        Some(Err(error)) => return Err(error.in_file(file)),
        None => return Err(bad("expected one checkpoint record after the header, found none".into())),
    };
    if record.kind != RecordKind::Checkpoint {
        return Err(bad(format!("expected a checkpoint record, got a {} record", record.kind)));
    }
    match (reader.next(), reader.tail()) {
        (None, Some(Tail::Clean { valid_up_to })) if valid_up_to == bytes.len() => Ok(record.payload),
        (Some(Ok(extra)), _) => Err(bad(format!("expected one record, got another at offset {}", extra.offset))),
        (Some(Err(error)), _) => Err(error.in_file(file)),
        (None, _) => Err(bad(format!("expected the file to end after its record at offset {}", record.end()))),
    }
}

/// Reads and decodes the manifest-framed file `dir/name` of `identity`; `Ok(None)` if there
/// is none. Never reads more than [`MAX_MANIFEST_FILE_BYTES`], nor anything but a regular file.
pub fn read_manifest(dir: &Path, name: &str, identity: FileIdentity) -> Result<Option<Vec<u8>>, Error> {
    let path = dir.join(name);
    match read_regular(&path, MAX_MANIFEST_FILE_BYTES)? {
        Some(bytes) => Ok(Some(decode_manifest(&path, &bytes, identity)?.to_vec())),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{FaultyStorage, StdStorage};

    const ID: FileIdentity = FileIdentity { dir_id: 0xd1, file_id: 0x3 };

    #[test]
    fn a_written_manifest_reads_back_and_replaces_the_old_one() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_manifest(dir.path(), "MANIFEST", ID).unwrap(), None);
        write_manifest(&StdStorage, dir.path(), "MANIFEST", ID, b"first").unwrap();
        write_manifest(&StdStorage, dir.path(), "MANIFEST", ID, b"second").unwrap();
        assert_eq!(read_manifest(dir.path(), "MANIFEST", ID).unwrap().as_deref(), Some(&b"second"[..]));
        assert!(!dir.path().join("MANIFEST.tmp").exists());
    }

    #[test]
    fn a_failed_manifest_write_leaves_the_old_manifest_in_place() {
        let dir = tempfile::tempdir().unwrap();
        write_manifest(&StdStorage, dir.path(), "MANIFEST", ID, b"old").unwrap();
        let storage = FaultyStorage::new();
        storage.set_write_budget(10);
        let err = write_manifest(&storage, dir.path(), "MANIFEST", ID, b"new").unwrap_err();
        assert!(matches!(err, Error::Io { kind: std::io::ErrorKind::StorageFull, .. }), "{err}");
        assert_eq!(read_manifest(dir.path(), "MANIFEST", ID).unwrap().as_deref(), Some(&b"old"[..]));
    }

    #[test]
    fn every_truncation_and_bit_flip_of_a_manifest_is_an_error_never_a_wrong_payload() {
        let dir = tempfile::tempdir().unwrap();
        write_manifest(&StdStorage, dir.path(), "M", ID, b"catalog bytes").unwrap();
        let bytes = std::fs::read(dir.path().join("M")).unwrap();
        let path = Path::new("M");
        for cut in 0..bytes.len() {
            assert!(decode_manifest(path, &bytes[..cut], ID).is_err(), "cut {cut}");
        }
        for bit in 0..bytes.len() * 8 {
            let mut damaged = bytes.clone();
            damaged[bit / 8] ^= 1 << (bit % 8);
            assert!(decode_manifest(path, &damaged, ID).is_err(), "bit {bit}");
        }
        let mut two = bytes.clone();
        encode_record_in(ID, 1, RecordKind::Checkpoint, b"x", &mut two).unwrap();
        assert!(matches!(decode_manifest(path, &two, ID), Err(Error::BadManifest { .. })));
        let elsewhere = FileIdentity::named(ID.dir_id, "N");
        assert!(matches!(decode_manifest(path, &bytes, elsewhere), Err(Error::InFile { .. })));
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(matches!(decode_manifest(path, &longer, ID), Err(Error::BadManifest { .. })));
    }
}
