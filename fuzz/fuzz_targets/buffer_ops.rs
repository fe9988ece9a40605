//! Fuzzes the buffer manager: random operation sequences (allocate, write, pin, unpin, read,
//! admit, evict, spill, reload, free, cluster lookups, flipped bits, injected I/O faults)
//! against a model. Run with `cargo fuzz run buffer_ops` (nightly) from `fuzz/`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| attnstore_buffer::fuzz::fuzz_buffer_ops(data));
