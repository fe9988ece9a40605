//! Helpers shared by the durable-engine integration tests.

use std::path::Path;

/// Copies the directory tree `from` to `to` (files and folders; recovery repairs what it
/// opens, so tests damage and open copies).
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}
