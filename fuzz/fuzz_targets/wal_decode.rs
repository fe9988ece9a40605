//! Fuzzes WAL decoding: header and record frames over arbitrary bytes must never panic and
//! must stay self-consistent. Run with `cargo fuzz run wal_decode` (nightly) from `fuzz/`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| attnstore_wal::fuzz_decode(data));
