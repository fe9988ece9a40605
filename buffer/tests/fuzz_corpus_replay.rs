//! Replays the checked-in `buffer_ops` fuzz corpus through [`attnstore_buffer::fuzz::fuzz_buffer_ops`]
//! on stable, so every input the fuzzer (or a person) saved stays a regression test.

use std::path::Path;

#[test]
fn every_file_of_the_buffer_ops_corpus_agrees_with_the_model() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/buffer_ops");
    let mut replayed = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|error| panic!("cannot list {}: {error}", dir.display())) {
        let path = entry.expect("corpus entry").path();
        let bytes = std::fs::read(&path).unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()));
        // A panic names the file, so a failing input can be replayed alone.
        eprintln!("replaying {}", path.display());
        attnstore_buffer::fuzz::fuzz_buffer_ops(&bytes);
        replayed += 1;
    }
    assert!(replayed >= 8, "the corpus {} has {replayed} files: the replay tests too little", dir.display());
}
