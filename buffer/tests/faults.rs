//! Faults are first-class: spill and read back byte-exact, flipped bits on disk, injected
//! I/O failures and timeouts are typed errors; a corrupt block is never served, a failed
//! spill leaves the block intact where it was, and nothing panics.

use attnstore_buffer::disk::{DiskTier, PreadIo};
use attnstore_buffer::{
    BlockId, BlockKey, BufferConfig, BufferManager, ClusterKey, DiskConfig, Error, FaultPlan, FaultyIo, IoBackend,
    IoChoice, Tier,
};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

const KEY: BlockKey = BlockKey { context: 1, layer: 2, head: 3 };

fn tempdir(name: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!("attnstore-{name}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)))
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (seed as usize * 131 + i * 7 + (i >> 8)) as u8).collect()
}

fn manager(dir: &PathBuf, host_blocks: usize, io: IoChoice) -> BufferManager {
    let mut disk = DiskConfig::new(dir);
    disk.io = io;
    disk.capacity_blocks = 256;
    disk.segment_blocks = 32; // several segment files
    let mut config = BufferConfig::new(host_blocks, 4);
    config.disk = Some(disk);
    BufferManager::new(config).unwrap()
}

fn flip_bit(buffers: &BufferManager, block: BlockId, byte: u64, bit: u8) {
    let (path, offset) = buffers.disk_location(block).unwrap().expect("homed on disk");
    let file = std::fs::File::options().read(true).write(true).open(path).unwrap();
    let mut b = [0u8];
    file.read_exact_at(&mut b, offset + byte).unwrap();
    file.write_all_at(&[b[0] ^ (1 << bit)], offset + byte).unwrap();
}

#[test]
fn spilled_blocks_read_back_byte_exact_with_both_backends() {
    for io in [IoChoice::Auto, IoChoice::Pread] {
        let dir = tempdir("spill");
        let buffers = manager(&dir, 16, io.clone());
        let blocks: Vec<_> = (0..100).map(|_| buffers.allocate(KEY).unwrap()).collect();
        // 16 on Host, the rest spilled at allocation; write them all, then spill the Host ones.
        for (i, &block) in blocks.iter().enumerate() {
            buffers.write(block, &pattern(i as u64, 2048)).unwrap();
        }
        assert_eq!(buffers.stats().tier(Tier::Host).unwrap().used_blocks, 16);
        for &block in &blocks[..16] {
            buffers.spill(block).unwrap();
            assert_eq!(buffers.tier_of(block).unwrap(), Tier::Disk);
        }
        for (i, &block) in blocks.iter().enumerate() {
            let read = buffers.read(block).unwrap();
            assert_eq!((read.tier(), &read[..]), (Tier::Disk, &pattern(i as u64, 2048)[..]), "{io:?} block {i}");
        }
        for (i, &block) in blocks.iter().enumerate().take(16) {
            buffers.reload(block).unwrap();
            let read = buffers.read(block).unwrap();
            assert_eq!((read.tier(), &read[..]), (Tier::Host, &pattern(i as u64, 2048)[..]));
        }
        let stats = buffers.stats();
        assert_eq!(stats.tier(Tier::Disk).unwrap().used_blocks, 84);
        assert_eq!(stats.tier(Tier::Disk).unwrap().failures, 0);
        drop(buffers);
        assert!(std::fs::read_dir(&dir).unwrap().next().is_none(), "spill files removed on drop");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn a_plan_reads_a_spilled_cluster_in_one_batch_byte_exact_and_corrupt_blocks_are_refused() {
    let dir = tempdir("pin-all");
    let buffers = manager(&dir, 64, IoChoice::Auto);
    let key = ClusterKey { context: 4, layer: 1, head: 0, cluster: 7 };
    let bytes = pattern(3, 40 * 2048);
    let blocks = buffers.store_cluster(key, &bytes).unwrap();
    for &block in &blocks[..30] {
        buffers.spill(block).unwrap();
    }
    buffers.admit(blocks[35]).unwrap();
    flip_bit(&buffers, blocks[10], 5, 1);
    let reader = buffers.reader();
    let locations = reader.cluster(&key).unwrap().to_vec();
    let pins = reader.pin_all(&locations);
    for (i, pin) in pins.iter().enumerate() {
        match pin {
            Ok(pin) => {
                assert_eq!(&pin[..], &bytes[i * 2048..][..2048], "block {i}");
                let expected = if i < 30 {
                    Tier::Disk
                } else if i == 35 {
                    Tier::Gpu
                } else {
                    Tier::Host
                };
                assert_eq!(pin.tier(), expected, "block {i}");
            }
            Err(e) => assert!(i == 10 && matches!(e, Error::Corrupt { .. }), "block {i}: {e}"),
        }
    }
    assert!(pins[10].is_err());
    drop((pins, reader));
    assert!(buffers.is_lost(blocks[10]).unwrap());
    assert_eq!(buffers.stats().tier(Tier::Disk).unwrap().hits, 29);
    drop(buffers);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_flipped_bit_on_disk_is_a_typed_error_and_the_block_is_never_served() {
    let dir = tempdir("flip");
    let buffers = manager(&dir, 4, IoChoice::Auto);
    let key = ClusterKey { context: 1, layer: 0, head: 0, cluster: 0 };
    let blocks = buffers.store_cluster(key, &pattern(5, 3 * 2048)).unwrap();
    for &block in &blocks {
        buffers.spill(block).unwrap();
    }
    flip_bit(&buffers, blocks[1], 1000, 3);
    let err = buffers.read(blocks[1]).unwrap_err();
    assert!(
        matches!(err, Error::Corrupt { block, expected_crc, got_crc } if block == blocks[1] && expected_crc != got_crc),
        "{err}"
    );
    // From now on it is missing: not served by any path, and not admitted.
    assert!(matches!(buffers.read(blocks[1]), Err(Error::Missing { .. })));
    assert!(matches!(buffers.reload(blocks[1]), Err(Error::Missing { .. })));
    assert!(matches!(buffers.admit(blocks[1]), Err(Error::Missing { .. })));
    let reader = buffers.reader();
    let locations = reader.cluster(&key).unwrap().to_vec();
    assert!(matches!(reader.pin(&locations[1]), Err(Error::Missing { .. })));
    assert_eq!(&reader.pin(&locations[0]).unwrap()[..], &pattern(5, 3 * 2048)[..2048], "neighbours intact");
    drop(reader);
    // A flip found at reload time is the same typed error.
    flip_bit(&buffers, blocks[2], 0, 0);
    assert!(matches!(buffers.reload(blocks[2]), Err(Error::Corrupt { .. })));
    assert!(buffers.is_lost(blocks[2]).unwrap());
    assert_eq!(buffers.stats().tier(Tier::Disk).unwrap().failures, 2);
    // Rewriting a lost block restores it.
    buffers.write(blocks[1], &pattern(9, 2048)).unwrap();
    assert_eq!(&buffers.read(blocks[1]).unwrap()[..], &pattern(9, 2048)[..]);
    drop(buffers);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn injected_io_failures_are_reported_and_leave_blocks_intact_or_missing_never_wrong() {
    let dir = tempdir("faults");
    let faults = Arc::new(FaultyIo::new(Box::new(PreadIo), FaultPlan::default()));
    let buffers = manager(&dir, 8, IoChoice::Custom(faults.clone()));
    let blocks: Vec<_> = (0..8).map(|_| buffers.allocate(KEY).unwrap()).collect();
    for (i, &block) in blocks.iter().enumerate() {
        buffers.write(block, &pattern(i as u64, 2048)).unwrap();
    }
    // A failed spill write: the block stays on Host, intact.
    faults.set_plan(FaultPlan { fail_blocks: [blocks[0]].into(), ..FaultPlan::default() });
    assert!(matches!(buffers.spill(blocks[0]), Err(Error::Io { block: Some(b), .. }) if b == blocks[0]));
    assert_eq!(buffers.tier_of(blocks[0]).unwrap(), Tier::Host);
    assert_eq!(&buffers.read(blocks[0]).unwrap()[..], &pattern(0, 2048)[..]);
    // Other blocks are unaffected by a per-block fault.
    buffers.spill(blocks[1]).unwrap();
    // A failed read: a typed error, the block is still on disk and readable once the fault is gone.
    faults.set_plan(FaultPlan {
        fail_blocks: [blocks[1]].into(),
        only: Some(attnstore_buffer::disk::IoKind::Read),
        ..FaultPlan::default()
    });
    assert!(matches!(buffers.reload(blocks[1]), Err(Error::Io { .. })));
    assert!(matches!(buffers.read(blocks[1]), Err(Error::Io { .. })));
    assert!(!buffers.is_lost(blocks[1]).unwrap());
    faults.set_plan(FaultPlan::default());
    assert_eq!(&buffers.read(blocks[1]).unwrap()[..], &pattern(1, 2048)[..]);
    // Fail every operation after two: the first two spills succeed, then typed errors.
    faults.set_plan(FaultPlan { fail_after_ops: Some(2), ..FaultPlan::default() });
    let results: Vec<_> = blocks[2..6].iter().map(|&b| buffers.spill(b)).collect();
    assert!(results[0].is_ok() && results[1].is_ok(), "{results:?}");
    assert!(results[2..].iter().all(|r| matches!(r, Err(Error::Io { .. }))), "{results:?}");
    // A timeout is a typed error the caller can handle (e.g. by recomputing).
    faults.set_plan(FaultPlan { fail_blocks: [blocks[2]].into(), as_timeout: true, ..FaultPlan::default() });
    assert!(matches!(buffers.read(blocks[2]), Err(Error::Timeout { .. })));
    // A failed write to a block homed on disk loses it (old bytes may be torn): Missing, not stale bytes.
    assert!(matches!(buffers.write(blocks[2], &[1; 10]), Err(Error::Timeout { .. })));
    assert!(matches!(buffers.read(blocks[2]), Err(Error::Missing { .. })));
    faults.set_plan(FaultPlan::default());
    for (i, &block) in blocks.iter().enumerate().filter(|&(i, _)| i != 2) {
        assert_eq!(&buffers.read(block).unwrap()[..], &pattern(i as u64, 2048)[..], "block {i}");
    }
    let stats = buffers.stats();
    assert!(stats.tier(Tier::Disk).unwrap().failures >= 5, "{stats}");
    assert!(faults.injected() >= 6);
    drop(buffers);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unaligned_requests_and_sizes_are_typed_errors() {
    // Blocks must be a multiple of the direct-I/O sector to live on Disk.
    let mut config = BufferConfig::new(4, 0);
    config.layout = attnstore_buffer::BlockLayout::new(192).unwrap();
    config.disk = Some(DiskConfig::new(tempdir("unaligned")));
    assert_eq!(
        BufferManager::new(config).err(),
        Some(Error::Unaligned { what: "block size for O_DIRECT", expected_multiple: 512, got: 192 })
    );
    // A raw request at an unaligned offset fails alone.
    let dir = tempdir("unaligned-raw");
    let disk = DiskTier::open(DiskConfig::new(&dir), 2048).unwrap();
    let slot = disk.alloc_slot().unwrap();
    assert_eq!(disk.write_blocks(&[(slot, BlockId::from_raw(1), &[1; 2048][..])]), vec![Ok(())]);
    let (path, _) = disk.slot_location(slot);
    let file = std::fs::File::open(path).unwrap();
    let request = attnstore_buffer::disk::IoRequest {
        kind: attnstore_buffer::disk::IoKind::Read,
        offset: 100,
        buffer_offset: 0,
        len: 2048,
        block: None,
    };
    let aligned = attnstore_buffer::disk::IoRequest { offset: 0, ..request };
    let backends: Vec<Box<dyn IoBackend>> =
        vec![Box::new(PreadIo), Box::new(attnstore_buffer::disk::UringIo::new().expect("io_uring on this kernel"))];
    for backend in backends {
        let staging = attnstore_buffer::disk::StagingBuffer::new(4096).unwrap();
        let (staging, results) = backend.submit(&file, &[request, aligned], staging, std::time::Duration::from_secs(5));
        let expected = Err(Error::Unaligned { what: "offset", expected_multiple: 512, got: 100 });
        assert_eq!((&results[0], &results[1]), (&expected, &Ok(())), "{}", backend.name());
        assert_eq!(&staging.unwrap().bytes()[..2048], &[1; 2048][..], "{}", backend.name());
    }
    drop(disk);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn move_latencies_and_failures_by_kind_reach_the_metrics_facade() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let dir = tempdir("metrics");
    let buffers = manager(&dir, 16, IoChoice::Pread);
    let blocks = metrics::with_local_recorder(&recorder, || {
        let blocks: Vec<_> = (0..40).map(|_| buffers.allocate(KEY).unwrap()).collect();
        for (i, &block) in blocks.iter().enumerate() {
            buffers.write(block, &pattern(i as u64, 2048)).unwrap();
        }
        for &block in &blocks[..4] {
            buffers.spill(block).unwrap();
        }
        for &block in &blocks[..2] {
            buffers.reload(block).unwrap();
        }
        flip_bit(&buffers, blocks[30], 100, 3);
        assert!(matches!(buffers.read(blocks[30]), Err(Error::Corrupt { .. })));
        blocks
    });
    assert_eq!(blocks.len(), 40);
    let stats = buffers.stats();
    let snapshot = snapshotter.snapshot().into_vec();
    let find = |name: &str, labels: &[(&str, &str)]| {
        snapshot
            .iter()
            .find(|(k, ..)| {
                k.key().name() == name
                    && labels.iter().all(|(l, v)| k.key().labels().any(|x| x.key() == *l && x.value() == *v))
            })
            .map(|(.., v)| v)
    };
    for tier in [Tier::Host, Tier::Disk] {
        let moves = stats.tier(tier).unwrap().moves_in;
        assert!(moves > 0, "{tier:?}");
        match find("attnstore_buffer_move_seconds", &[("tier", tier.name())]) {
            Some(DebugValue::Histogram(h)) => assert_eq!(h.len() as u64, moves, "{tier:?}"),
            other => panic!("{tier:?}: {other:?}"),
        }
    }
    let disk = stats.tier(Tier::Disk).unwrap();
    assert_eq!(disk.failures, 1);
    assert!(matches!(
        find("attnstore_buffer_failures_by_kind_total", &[("tier", "disk"), ("kind", "corrupt")]),
        Some(DebugValue::Counter(1))
    ));
    drop(buffers);
    std::fs::remove_dir_all(&dir).unwrap();
}
