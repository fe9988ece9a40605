//! Model-based property tests of the tiers: random operation sequences (the `buffer_ops`
//! fuzz driver's decoding) against a model of "bytes last written", and a direct test that
//! moves every block through every tier and reads it back after each move.

use attnstore_buffer::fuzz::fuzz_buffer_ops;
use attnstore_buffer::{BlockKey, BlockLayout, BufferConfig, BufferManager, DiskConfig, ReplacerKind, Tier};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Every read returns the bytes last written, pinned blocks never change, and every
    /// refusal or failure is the typed error the rules call for (the driver asserts all of it).
    #[test]
    fn random_operation_sequences_agree_with_the_model(ops in proptest::collection::vec(any::<u8>(), 0..600)) {
        fuzz_buffer_ops(&ops);
    }

}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Blocks written, spilled, reloaded, admitted and evicted in any order read back exactly.
    #[test]
    fn every_read_after_any_move_returns_the_bytes_last_written(
        kind in prop::sample::select(ReplacerKind::ALL.to_vec()),
        moves in proptest::collection::vec((0usize..24, 0u8..5, any::<u8>()), 1..150),
    ) {
        let dir = tempdir("model");
        let mut config = BufferConfig::new(8, 4);
        config.layout = BlockLayout::new(1024).unwrap();
        config.replacer = kind;
        config.disk = Some(DiskConfig::new(&dir));
        let buffers = BufferManager::new(config).unwrap();
        let key = BlockKey { context: 9, layer: 1, head: 2 };
        // 24 blocks over 8 Host slots: most start on Disk (allocation spills).
        let blocks: Vec<_> = (0..24).map(|_| buffers.allocate(key).unwrap()).collect();
        let mut model = vec![vec![0u8; 1024]; 24];
        for (i, action, seed) in moves {
            let block = blocks[i];
            match action {
                0 => {
                    let bytes: Vec<u8> = (0..1024).map(|j| seed.wrapping_add((j * 7) as u8)).collect();
                    buffers.write(block, &bytes).unwrap();
                    model[i] = bytes;
                }
                1 => { let _ = buffers.spill(block); }
                2 => { let _ = buffers.reload(block); }
                3 => { buffers.admit(block).unwrap(); prop_assert_eq!(buffers.tier_of(block).unwrap(), Tier::Gpu); }
                _ => { let _ = buffers.evict(block); }
            }
            for (j, &b) in blocks.iter().enumerate() {
                let read = buffers.read(b).unwrap();
                prop_assert!(read[..] == model[j][..], "block {} differs after moves", j);
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn tempdir(name: &str) -> std::path::PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!("attnstore-{name}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)))
}
