//! Replays the checked-in `recovery_dir` fuzz corpus through
//! [`attnstore::durable::fuzz_recover`] on stable: each input's faults on a copy of a
//! durable directory must end in a typed error or a recovery that loses nothing.

use std::path::Path;

#[test]
fn every_file_of_the_recovery_dir_corpus_recovers_or_is_refused() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/recovery_dir");
    let mut replayed = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|error| panic!("cannot list {}: {error}", dir.display())) {
        let path = entry.expect("corpus entry").path();
        let bytes = std::fs::read(&path).unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()));
        eprintln!("replaying {}", path.display());
        attnstore::durable::fuzz_recover(&bytes);
        replayed += 1;
    }
    assert!(replayed > 0, "the corpus {} is empty: the replay tests nothing", dir.display());
}
