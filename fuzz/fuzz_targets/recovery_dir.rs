//! Fuzzes recovery over damaged engine directories: faults decoded from the input are
//! applied to a copy of a durable directory, and `check` / `Engine::open` must end in a
//! typed error or a recovery that loses no acknowledged batch. Run with
//! `cargo fuzz run recovery_dir` (nightly) from `fuzz/`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| attnstore::durable::fuzz_recover(data));
