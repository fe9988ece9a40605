//! Replays the checked-in `manifest_decode` fuzz corpus through
//! [`attnstore::durable::fuzz_decode_catalog`] on stable.

use std::path::Path;

#[test]
fn every_file_of_the_manifest_decode_corpus_decodes_without_panicking() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/manifest_decode");
    let mut replayed = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|error| panic!("cannot list {}: {error}", dir.display())) {
        let path = entry.expect("corpus entry").path();
        let bytes = std::fs::read(&path).unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()));
        eprintln!("replaying {}", path.display());
        attnstore::durable::fuzz_decode_catalog(&bytes);
        replayed += 1;
    }
    assert!(replayed > 0, "the corpus {} is empty: the replay tests nothing", dir.display());
}
