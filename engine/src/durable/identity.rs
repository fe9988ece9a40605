//! The engine directory's identity: `DIR/IDENTITY`, written once when the directory is
//! made, holds a random 64-bit id. Every log, manifest, layout, home and segment file
//! carries it in its header and checksums, and every data-file chunk in its header, so a
//! file from another engine directory is refused instead of served. A directory without
//! this file is not an engine directory: it is only made one when it is new or empty and
//! the caller asked for that.

use std::ops::Deref;
use std::path::{Path, PathBuf};

use attnstore_wal::{decode_manifest, read_regular, write_manifest, FileHeader, FileIdentity, Storage};

use crate::error::{Error, Result};

/// Name of the identity file in an engine directory.
pub const IDENTITY_FILE: &str = "IDENTITY";

/// What the identity file's one record says.
const IDENTITY_PAYLOAD: &[u8] = b"attnstore engine directory";

/// An engine directory: its path and its identity.
#[derive(Debug, Clone)]
pub(crate) struct EngineDir {
    path: PathBuf,
    /// The random id in `IDENTITY`.
    pub id: u64,
}

impl Deref for EngineDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.path
    }
}

impl EngineDir {
    /// The directory at `path` whose identity is `id` (checked by the caller).
    pub(crate) fn new(path: &Path, id: u64) -> Self {
        Self { path: path.to_path_buf(), id }
    }

    /// The identity of the manifest-framed file `name`, relative to the directory.
    pub(crate) fn file(&self, name: &str) -> FileIdentity {
        FileIdentity::named(self.id, name)
    }

    /// The identity of the file `name` in `DIR/index/`.
    pub(crate) fn index_file(&self, name: &str) -> FileIdentity {
        self.file(&format!("{}/{name}", super::layout::INDEX_DIR))
    }

    /// Reads `dir`'s identity; `Ok(None)` when it has no identity file.
    pub(crate) fn read(path: &Path) -> Result<Option<Self>> {
        let file = path.join(IDENTITY_FILE);
        let Some(bytes) = read_regular(&file, 4096)? else { return Ok(None) };
        let header = FileHeader::decode(&bytes).map_err(|e| e.in_file(&file))?;
        let id = header.identity().dir_id;
        let payload = decode_manifest(&file, &bytes, FileIdentity::named(id, IDENTITY_FILE))?;
        if payload != IDENTITY_PAYLOAD {
            return Err(Error::Corrupt {
                file,
                offset: FileHeader::SIZE as u64,
                detail: "not an engine directory's identity record".into(),
            });
        }
        Ok(Some(Self::new(path, id)))
    }

    /// Makes `path` an engine directory: writes a new identity (atomically, directory synced).
    pub(crate) fn create(storage: &dyn Storage, path: &Path) -> Result<Self> {
        let id = random_id();
        write_manifest(storage, path, IDENTITY_FILE, FileIdentity::named(id, IDENTITY_FILE), IDENTITY_PAYLOAD)?;
        Ok(Self::new(path, id))
    }

    /// Opens `path` as an engine directory: its identity when it has one; a new one when it
    /// does not exist or is empty and `create` is set; otherwise a typed error saying what is there.
    pub(crate) fn open(storage: &dyn Storage, path: &Path, create: bool) -> Result<Self> {
        match std::fs::metadata(path) {
            Ok(meta) if !meta.is_dir() => {
                return Err(Error::NotAnEngineDirectory {
                    dir: path.to_path_buf(),
                    found: "a file, not a directory".into(),
                })
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => {
                std::fs::create_dir_all(path).map_err(|e| attnstore_wal::Error::io("create dir", path, &e))?;
                if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                    storage.sync_dir(parent).map_err(|e| attnstore_wal::Error::io("fsync dir", parent, &e))?;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::NotAnEngineDirectory {
                    dir: path.to_path_buf(),
                    found: "nothing (it does not exist)".into(),
                })
            }
            Err(e) => return Err(attnstore_wal::Error::io("stat", path, &e).into()),
        }
        if let Some(dir) = Self::read(path)? {
            return Ok(dir);
        }
        let mut names: Vec<String> = std::fs::read_dir(path)
            .map_err(|e| attnstore_wal::Error::io("list", path, &e))?
            .filter_map(|entry| entry.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            // A crash while the identity was written leaves its temporary file.
            .filter(|name| name != &format!("{IDENTITY_FILE}.tmp"))
            .collect();
        names.sort();
        if names.is_empty() && create {
            return Self::create(storage, path);
        }
        let engine_like = names.iter().any(|n| ["MANIFEST", "wal", "data", "index", "LOCK"].contains(&n.as_str()));
        let found = match names.len() {
            0 => "an empty directory (open it with creation allowed to make it one)".to_string(),
            _ if engine_like => format!(
                "an engine directory without its {IDENTITY_FILE} file ({}): written by a build of log format 1, which this build does not read, or {IDENTITY_FILE} was deleted",
                names.join(", ")
            ),
            _ => {
                let shown: Vec<&str> = names.iter().take(5).map(String::as_str).collect();
                let more = if names.len() > 5 { format!(" and {} more", names.len() - 5) } else { String::new() };
                format!("no {IDENTITY_FILE} file among its {} entries ({}{more})", names.len(), shown.join(", "))
            }
        };
        Err(Error::NotAnEngineDirectory { dir: path.to_path_buf(), found })
    }
}

/// A random non-zero id from the OS (`/dev/urandom`), or from the clock and the process id
/// where that cannot be read.
fn random_id() -> u64 {
    use std::io::Read;
    let mut bytes = [0u8; 8];
    let from_os = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes)).is_ok();
    let mut id = u64::from_le_bytes(bytes);
    if !from_os || id == 0 {
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        id = (nanos ^ (u64::from(std::process::id()) << 32)).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnstore_wal::StdStorage;

    #[test]
    fn a_new_or_empty_directory_is_made_an_engine_directory_only_when_asked() {
        let root = tempfile::tempdir().unwrap();
        let fresh = root.path().join("fresh");
        assert!(matches!(EngineDir::open(&StdStorage, &fresh, false), Err(Error::NotAnEngineDirectory { .. })));
        let made = EngineDir::open(&StdStorage, &fresh, true).unwrap();
        assert_eq!(EngineDir::open(&StdStorage, &fresh, false).unwrap().id, made.id);
        let empty = root.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        assert!(matches!(EngineDir::open(&StdStorage, &empty, false), Err(Error::NotAnEngineDirectory { .. })));
        assert_ne!(EngineDir::open(&StdStorage, &empty, true).unwrap().id, made.id);
    }

    #[test]
    fn a_directory_of_other_files_is_refused_and_left_alone() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("notes.txt"), b"mine").unwrap();
        let err = EngineDir::open(&StdStorage, root.path(), true).unwrap_err();
        assert!(err.to_string().contains("notes.txt"), "{err}");
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 1, "nothing was written");
    }

    #[test]
    fn a_damaged_identity_is_a_typed_error() {
        let root = tempfile::tempdir().unwrap();
        EngineDir::create(&StdStorage, root.path()).unwrap();
        let path = root.path().join(IDENTITY_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert!(EngineDir::open(&StdStorage, root.path(), true).is_err());
    }
}
