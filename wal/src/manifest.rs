//! The manifest file: a log file holding exactly one `Checkpoint` record, replaced
//! atomically (write a new file, fsync it, rename it over the old one, fsync the directory)
//! so a reader sees the old manifest or the new one, never a mix.
//!
//! The payload (the engine's catalog) is opaque here; the framing gives it a magic, a
//! version and a crc32c, and decoding refuses anything but one whole record.

use std::path::Path;

use crate::storage::Storage;
use crate::{encode_record, Error, FileHeader, RecordKind, RecordReader, Tail};

/// Replaces `dir/name` atomically with a manifest holding `payload` (via `dir/name.tmp`).
pub fn write_manifest(storage: &dyn Storage, dir: &Path, name: &str, payload: &[u8]) -> Result<(), Error> {
    let mut bytes = FileHeader::new().encode().to_vec();
    encode_record(RecordKind::Checkpoint, payload, &mut bytes)?;
    let tmp = dir.join(format!("{name}.tmp"));
    let target = dir.join(name);
    let file = storage.create(&tmp).map_err(|e| Error::io("create", &tmp, &e))?;
    file.write_all_at(&bytes, 0).map_err(|e| Error::io("write", &tmp, &e))?;
    file.sync_data().map_err(|e| Error::io("fsync", &tmp, &e))?;
    drop(file);
    storage.rename(&tmp, &target).map_err(|e| Error::io("rename", &tmp, &e))?;
    storage.sync_dir(dir).map_err(|e| Error::io("fsync dir", dir, &e))
}

/// The payload of a manifest file's bytes: the header must be intact and exactly one whole
/// `Checkpoint` record must follow it. `file` only names the file in errors.
pub fn decode_manifest<'a>(file: &Path, bytes: &'a [u8]) -> Result<&'a [u8], Error> {
    let bad = |detail: String| Error::BadManifest { file: file.to_path_buf(), detail };
    let mut reader = RecordReader::open_log(bytes).map_err(|e| e.in_file(file))?;
    let record = match reader.next() {
        Some(Ok(record)) => record,
        Some(Err(error)) => return Err(error.in_file(file)),
        None => return Err(bad(format!("expected one checkpoint record, got none ({:?})", reader.tail()))),
    };
    if record.kind != RecordKind::Checkpoint {
        return Err(bad(format!("expected a Checkpoint record, got {:?}", record.kind)));
    }
    match (reader.next(), reader.tail()) {
        (None, Some(Tail::Clean { .. })) => Ok(record.payload),
        (Some(Ok(extra)), _) => Err(bad(format!("expected one record, got another at offset {}", extra.offset))),
        (Some(Err(error)), _) => Err(error.in_file(file)),
        (None, tail) => Err(bad(format!("expected the file to end after the record, got {tail:?}"))),
    }
}

/// Reads and decodes the manifest `dir/name`; `Ok(None)` if there is none.
pub fn read_manifest(dir: &Path, name: &str) -> Result<Option<Vec<u8>>, Error> {
    let path = dir.join(name);
    match std::fs::read(&path) {
        Ok(bytes) => Ok(Some(decode_manifest(&path, &bytes)?.to_vec())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io("read", &path, &e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{FaultyStorage, StdStorage};

    #[test]
    fn a_written_manifest_reads_back_and_replaces_the_old_one() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_manifest(dir.path(), "MANIFEST").unwrap(), None);
        write_manifest(&StdStorage, dir.path(), "MANIFEST", b"first").unwrap();
        write_manifest(&StdStorage, dir.path(), "MANIFEST", b"second").unwrap();
        assert_eq!(read_manifest(dir.path(), "MANIFEST").unwrap().as_deref(), Some(&b"second"[..]));
        assert!(!dir.path().join("MANIFEST.tmp").exists());
    }

    #[test]
    fn a_failed_manifest_write_leaves_the_old_manifest_in_place() {
        let dir = tempfile::tempdir().unwrap();
        write_manifest(&StdStorage, dir.path(), "MANIFEST", b"old").unwrap();
        let storage = FaultyStorage::new();
        storage.set_write_budget(10);
        let err = write_manifest(&storage, dir.path(), "MANIFEST", b"new").unwrap_err();
        assert!(matches!(err, Error::Io { kind: std::io::ErrorKind::StorageFull, .. }), "{err}");
        assert_eq!(read_manifest(dir.path(), "MANIFEST").unwrap().as_deref(), Some(&b"old"[..]));
    }

    #[test]
    fn every_truncation_and_bit_flip_of_a_manifest_is_an_error_never_a_wrong_payload() {
        let dir = tempfile::tempdir().unwrap();
        write_manifest(&StdStorage, dir.path(), "M", b"catalog bytes").unwrap();
        let bytes = std::fs::read(dir.path().join("M")).unwrap();
        let path = Path::new("M");
        for cut in 0..bytes.len() {
            assert!(decode_manifest(path, &bytes[..cut]).is_err(), "cut {cut}");
        }
        for bit in 0..bytes.len() * 8 {
            let mut damaged = bytes.clone();
            damaged[bit / 8] ^= 1 << (bit % 8);
            assert!(decode_manifest(path, &damaged).is_err(), "bit {bit}");
        }
        let mut two = bytes.clone();
        encode_record(RecordKind::Checkpoint, b"x", &mut two).unwrap();
        assert!(matches!(decode_manifest(path, &two), Err(Error::BadManifest { .. })));
    }
}
