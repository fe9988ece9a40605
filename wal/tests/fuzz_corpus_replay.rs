//! Replays the checked-in `wal_decode` fuzz corpus through [`attnstore_wal::fuzz_decode`] on
//! stable, so every input the fuzzer (or a person) saved stays a regression test.

use std::path::Path;

#[test]
fn every_file_of_the_wal_decode_corpus_decodes_consistently() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/wal_decode");
    let mut replayed = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|error| panic!("cannot list {}: {error}", dir.display())) {
        let path = entry.expect("corpus entry").path();
        let bytes = std::fs::read(&path).unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()));
        // A panic names the file, so a failing input can be replayed alone.
        eprintln!("replaying {}", path.display());
        attnstore_wal::fuzz_decode(&bytes);
        replayed += 1;
    }
    assert!(replayed > 0, "the corpus {} is empty: the replay tests nothing", dir.display());
}
