//! Fuzzes manifest and catalog decoding: framing, bincode catalog and record payloads over
//! arbitrary bytes must never panic nor allocate beyond the input. Run with
//! `cargo fuzz run manifest_decode` (nightly) from `fuzz/`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| attnstore::durable::fuzz_decode_catalog(data));
