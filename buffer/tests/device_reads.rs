//! Device-planned reads: the slot table (Host slot → Gpu slot) follows every move of every
//! block, a live `DeviceRead` keeps the Gpu slots it may have found through the table from
//! reuse (and admissions fill the tier again once it drops), and logged cluster reads keep
//! the Gpu tier warm through `maintain`. All on the CPU: the host mirror of the table.

use attnstore_buffer::{
    BlockId, BlockKey, BlockLayout, BufferConfig, BufferManager, ClusterKey, DeviceRead, DiskConfig, Error,
    ReplacerKind, Tier,
};
use proptest::prelude::*;
use std::collections::HashMap;

fn key(cluster: u32) -> ClusterKey {
    ClusterKey { context: 4, layer: 0, head: 1, cluster }
}

fn tempdir(name: &str) -> std::path::PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!("attnstore-{name}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)))
}

fn with_disk(mut config: BufferConfig, dir: &std::path::Path) -> BufferConfig {
    let mut disk = DiskConfig::new(dir);
    disk.direct = false; // logic, not O_DIRECT (covered by tests/faults.rs)
    config.disk = Some(disk);
    config
}

/// The Gpu slot serving `block` now, if cached (through a read, so by the public API only).
fn gpu_slot_of(buffers: &BufferManager, block: BlockId) -> Option<u32> {
    let read = buffers.read(block).expect("a live block reads");
    (read.tier() == Tier::Gpu).then(|| read.slot().expect("a Gpu read pins a slot"))
}

/// Checks the slot table against every live block, and returns the pairs it shows
/// (Gpu slot → block), i.e. what a device step could find through it now.
fn check_table(buffers: &BufferManager, blocks: &[BlockId], host_slots: u32) -> HashMap<u32, BlockId> {
    let mut expected: HashMap<u32, (u32, BlockId)> = HashMap::new();
    for &block in blocks {
        if let (Some(host), Some(gpu)) = (buffers.host_slot(block).unwrap(), gpu_slot_of(buffers, block)) {
            expected.insert(host, (gpu, block));
        }
    }
    for host in 0..host_slots {
        let want = expected.get(&host).map(|&(gpu, _)| gpu);
        assert_eq!(buffers.slot_table_entry(host), want, "entry of Host slot {host}");
    }
    assert_eq!(buffers.slot_table_entry(host_slots), None, "out of range");
    expected.into_values().collect()
}

/// Which block holds each Gpu slot now.
fn occupants(buffers: &BufferManager, blocks: &[BlockId]) -> HashMap<u32, BlockId> {
    blocks.iter().filter_map(|&b| gpu_slot_of(buffers, b).map(|slot| (slot, b))).collect()
}

const HOST_BLOCKS: u32 = 8;

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// After every allocate / store / write / admit / evict / free / spill / reload / cluster
    /// read, each Host slot's entry is the Gpu slot of the block homed there (or none); and
    /// while a device read lives, a Gpu slot it could have found through the table holds that
    /// block or nothing, never another block.
    #[test]
    fn the_slot_table_follows_every_move_and_live_reads_keep_their_slots(
        kind in prop::sample::select(ReplacerKind::ALL.to_vec()),
        ops in proptest::collection::vec((0u8..12, any::<u8>()), 1..160),
    ) {
        let dir = tempdir("device-reads-model");
        let mut config = with_disk(BufferConfig::new(HOST_BLOCKS as usize, 4), &dir);
        config.layout = BlockLayout::new(512).unwrap();
        config.replacer = kind;
        let buffers = BufferManager::new(config).unwrap();
        let mut blocks: Vec<BlockId> = Vec::new();
        let mut clusters: Vec<ClusterKey> = Vec::new();
        // Each live device read, with every (Gpu slot → block) the table showed while it lived.
        let mut reads: Vec<(DeviceRead<'_>, HashMap<u32, BlockId>)> = Vec::new();
        for (op, arg) in ops {
            let pick = (!blocks.is_empty()).then(|| blocks[arg as usize % blocks.len()]);
            match op {
                0 => {
                    if let Ok(block) = buffers.allocate(BlockKey { context: 4, layer: 0, head: 0 }) {
                        blocks.push(block);
                    }
                }
                1 => {
                    let k = key(clusters.len() as u32);
                    if let Ok(new) = buffers.store_cluster(k, &vec![arg; 512 * (1 + arg as usize % 2)]) {
                        blocks.extend(new);
                        clusters.push(k);
                    }
                }
                2 => if let Some(b) = pick {
                    match buffers.admit(b) {
                        Ok(_) | Err(Error::TierFull { .. }) => {}
                        Err(Error::DeviceReadsInFlight { .. }) => prop_assert!(!reads.is_empty(), "in flight without a read"),
                        Err(e) => prop_assert!(false, "admit: {e}"),
                    }
                },
                3 => if let Some(b) = pick { let _ = buffers.evict(b); },
                4 => if let Some(b) = pick {
                    buffers.free(b).unwrap();
                    blocks.retain(|&x| x != b);
                },
                5 => if let Some(b) = pick { let _ = buffers.spill(b); },
                6 => if let Some(b) = pick { let _ = buffers.reload(b); },
                7 => if let Some(b) = pick { buffers.write(b, &[arg; 100]).unwrap(); },
                8 => if reads.len() < 3 { reads.push((buffers.device_read(), HashMap::new())); },
                9 => if !reads.is_empty() { drop(reads.swap_remove(arg as usize % reads.len())); },
                10 => {
                    let mut keys: Vec<ClusterKey> = clusters.iter().copied().filter(|c| c.cluster % 3 != u32::from(arg % 3)).collect();
                    keys.push(key(9999)); // never stored
                    buffers.log_cluster_reads(keys);
                    buffers.maintain(usize::MAX);
                }
                _ => if !clusters.is_empty() {
                    let k = clusters.swap_remove(arg as usize % clusters.len());
                    let listed: Vec<BlockId> = buffers.mapping().get(&k).unwrap_or_default().iter().map(|l| l.block()).collect();
                    buffers.free_cluster(k).unwrap();
                    blocks.retain(|b| !listed.contains(b));
                },
            }
            let shown = check_table(&buffers, &blocks, HOST_BLOCKS);
            let now = occupants(&buffers, &blocks);
            for (_, seen) in &mut reads {
                for (slot, block) in seen.iter() {
                    let holder = now.get(slot);
                    prop_assert!(holder.is_none() || holder == Some(block),
                        "Gpu slot {} held {} for a live device read, now {:?}", slot, block, holder);
                }
                seen.extend(shown.iter().map(|(&s, &b)| (s, b)));
            }
            let quarantined = buffers.stats().gpu_quarantined_blocks;
            if reads.is_empty() {
                prop_assert_eq!(quarantined, 0, "quarantine outlives the device reads");
            }
            let gpu = buffers.stats().tier(Tier::Gpu).cloned().unwrap();
            prop_assert_eq!(gpu.used_blocks, now.len() + quarantined, "used = cached + quarantined");
        }
        drop(reads);
        prop_assert_eq!(buffers.stats().gpu_quarantined_blocks, 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// `count` one-block clusters, cluster `c` filled with byte `c`.
fn store(buffers: &BufferManager, count: u32) -> Vec<BlockId> {
    (0..count).map(|c| buffers.store_cluster(key(c), &[c as u8; 2048]).unwrap()[0]).collect()
}

fn gpu_failures(buffers: &BufferManager) -> u64 {
    buffers.stats().tier(Tier::Gpu).unwrap().failures
}

#[test]
fn a_device_read_keeps_the_gpu_slots_it_may_read_from_reuse_until_it_drops() {
    let buffers = BufferManager::new(BufferConfig::new(32, 8)).unwrap(); // LRU
    let blocks = store(&buffers, 16);
    let slot = |b: BlockId| buffers.slot_table_entry(buffers.host_slot(b).unwrap().unwrap());
    for &b in &blocks[..6] {
        buffers.admit(b).unwrap();
    }
    let cached_at_start: HashMap<u32, BlockId> = blocks[..6].iter().map(|&b| (slot(b).unwrap(), b)).collect();
    let old = buffers.device_read();

    // An explicit eviction: the slot goes to the quarantine, not the free list.
    let s0 = slot(blocks[0]).unwrap();
    buffers.evict(blocks[0]).unwrap();
    assert_eq!(slot(blocks[0]), None);
    assert_eq!(buffers.stats().gpu_quarantined_blocks, 1);
    // Free slots are still used, never the quarantined one.
    let fresh: Vec<u32> = blocks[6..8].iter().map(|&b| buffers.admit(b).unwrap()).collect();
    assert!(fresh.iter().all(|s| !cached_at_start.contains_key(s)), "{fresh:?} reuses a slot of {cached_at_start:?}");
    // The tier is full now: an admission evicts a victim (LRU: block 1) into the quarantine
    // and cannot reuse it while the old read lives. Not a failure.
    let s1 = slot(blocks[1]).unwrap();
    assert_eq!(buffers.admit(blocks[8]), Err(Error::DeviceReadsInFlight { quarantined_blocks: 2 }));
    assert_eq!(buffers.tier_of(blocks[1]).unwrap(), Tier::Host, "the victim was evicted");
    assert_eq!(buffers.tier_of(blocks[8]).unwrap(), Tier::Host, "and nothing admitted");
    let s2 = slot(blocks[2]).unwrap();
    assert_eq!(buffers.admit(blocks[9]), Err(Error::DeviceReadsInFlight { quarantined_blocks: 3 }));
    assert_eq!(gpu_failures(&buffers), 0, "waiting for device reads is not a failure");

    // No block holds a slot that was cached when the old read started, other than its own.
    for &b in &blocks {
        if let Some(s) = slot(b) {
            assert!(cached_at_start.get(&s).is_none_or(|&owner| owner == b), "slot {s} reused for {b}");
        }
    }
    // A read taken now cannot have seen slots s0..s2 in the table: it does not hold them.
    let young = buffers.device_read();
    let s3 = slot(blocks[3]).unwrap();
    assert!(matches!(buffers.admit(blocks[10]), Err(Error::DeviceReadsInFlight { quarantined_blocks: 4 })));
    drop(old);
    assert_eq!(buffers.stats().gpu_quarantined_blocks, 1, "only the slot given up after the young read started");
    let mut reused: Vec<u32> = blocks[8..11].iter().map(|&b| buffers.admit(b).unwrap()).collect();
    reused.sort_unstable();
    let mut expected = vec![s0, s1, s2];
    expected.sort_unstable();
    assert_eq!(reused, expected, "the old read's slots are reused once it ended");
    assert_ne!(slot(blocks[10]), Some(s3));
    drop(young);
    assert_eq!(buffers.stats().gpu_quarantined_blocks, 0);

    // Without reads in flight an eviction is reused at once, as before: the tier fills again.
    for &b in &blocks[11..16] {
        buffers.admit(b).unwrap();
    }
    let stats = buffers.stats();
    let gpu = stats.tier(Tier::Gpu).unwrap();
    assert_eq!(gpu.used_blocks, 8);
    assert_eq!(blocks.iter().filter(|&&b| buffers.tier_of(b).unwrap() == Tier::Gpu).count(), 8);
    assert_eq!(gpu.failures, 0);
    assert!(stats.to_string().contains("0 slots quarantined"), "{stats}");
}

#[test]
fn a_device_read_may_end_on_another_thread() {
    let buffers = BufferManager::new(BufferConfig::new(8, 2)).unwrap();
    let blocks = store(&buffers, 3);
    buffers.admit(blocks[0]).unwrap();
    buffers.admit(blocks[1]).unwrap();
    let read = buffers.device_read();
    buffers.evict(blocks[0]).unwrap();
    assert_eq!(buffers.stats().gpu_quarantined_blocks, 1);
    std::thread::scope(|scope| {
        scope.spawn(move || drop(read));
    });
    assert_eq!(buffers.stats().gpu_quarantined_blocks, 0);
    buffers.admit(blocks[2]).unwrap();
}

#[test]
fn without_a_gpu_tier_in_device_memory_there_is_no_device_table() {
    if cfg!(feature = "cuda") && std::env::var("ATTNSTORE_GPU").as_deref() == Ok("1") {
        return; // the GPU test below covers it
    }
    let buffers = BufferManager::new(BufferConfig::new(8, 2)).unwrap();
    assert_eq!(buffers.device_slot_table(), None);
    let blocks = store(&buffers, 1);
    let gpu_slot = buffers.admit(blocks[0]).unwrap();
    assert_eq!(buffers.slot_table_entry(buffers.host_slot(blocks[0]).unwrap().unwrap()), Some(gpu_slot));
}

#[test]
fn logged_cluster_reads_admit_their_blocks_and_count_hits_on_the_next_round() {
    let dir = tempdir("device-reads-clusters");
    let buffers = BufferManager::new(with_disk(BufferConfig::new(64, 16), &dir)).unwrap();
    let keys: Vec<ClusterKey> = (0..4).map(key).collect();
    let mut blocks = Vec::new();
    for &k in &keys {
        blocks.extend(buffers.store_cluster(k, &[k.cluster as u8; 4096]).unwrap());
        // two blocks each
    }
    let spilled = buffers.store_cluster(key(4), &[4; 2048]).unwrap()[0];
    buffers.spill(spilled).unwrap();
    let freed = buffers.store_cluster(key(5), &[5; 2048]).unwrap()[0];
    buffers.free_cluster(key(5)).unwrap();

    let mut logged = keys.clone();
    logged.extend([key(4), key(5), key(77)]); // on Disk, freed, never stored
    buffers.log_cluster_reads(logged.clone());
    assert_eq!(buffers.stats().queued_access_records, 7);
    assert_eq!(buffers.maintain(usize::MAX), 7);
    assert!(blocks.iter().all(|&b| buffers.tier_of(b).unwrap() == Tier::Gpu), "every Host-homed block admitted");
    assert_eq!(buffers.tier_of(spilled).unwrap(), Tier::Disk, "a device step reads no Disk block: not admitted");
    assert!(buffers.tier_of(freed).is_err());
    let stats = buffers.stats();
    let (gpu, host) = (stats.tier(Tier::Gpu).unwrap(), stats.tier(Tier::Host).unwrap());
    assert_eq!((gpu.hits, gpu.misses, gpu.moves_in, host.hits), (0, 8, 8, 8), "{stats}");
    for location in keys.iter().flat_map(|k| buffers.mapping().get(k).unwrap()) {
        let (home, host_slot) = location.home();
        assert_eq!(home, Tier::Host);
        assert!(location.gpu_slot().is_some());
        assert_eq!(buffers.slot_table_entry(host_slot), location.gpu_slot());
    }

    buffers.log_cluster_reads(logged);
    assert_eq!(buffers.maintain(usize::MAX), 7);
    let stats = buffers.stats();
    let gpu = stats.tier(Tier::Gpu).unwrap();
    assert_eq!((gpu.hits, gpu.misses, gpu.moves_in), (8, 8, 8), "second round: hits only");
    assert_eq!(stats.dropped_access_records, 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_long_steps_cluster_reads_admit_and_count_like_a_short_ones() {
    // 2,600 logged clusters in one round (a long context's step): the same outcome as the
    // small round above — Host-homed blocks admitted, Disk and freed ones not, then hits.
    let dir = tempdir("device-reads-many-clusters");
    let n = 2600u32;
    let buffers = BufferManager::new(with_disk(BufferConfig::new(n as usize + 8, n as usize), &dir)).unwrap();
    let blocks: Vec<BlockId> = (0..n).map(|c| buffers.store_cluster(key(c), &[c as u8; 2048]).unwrap()[0]).collect();
    buffers.spill(blocks[7]).unwrap();
    buffers.free_cluster(key(9)).unwrap();
    let logged: Vec<ClusterKey> = (0..n).chain([n + 5]).map(key).collect(); // one never stored
    buffers.log_cluster_reads(logged.clone());
    assert_eq!(buffers.maintain(usize::MAX), n as usize + 1);
    let read = n as u64 - 2; // all but the spilled and the freed block
    for (c, &b) in blocks.iter().enumerate() {
        match c {
            7 => assert_eq!(buffers.tier_of(b).unwrap(), Tier::Disk, "a device step reads no Disk block"),
            9 => assert!(buffers.tier_of(b).is_err()),
            _ => assert_eq!(buffers.tier_of(b).unwrap(), Tier::Gpu, "cluster {c} admitted"),
        }
    }
    let gpu = buffers.stats().tier(Tier::Gpu).unwrap().clone();
    assert_eq!((gpu.hits, gpu.misses, gpu.moves_in), (0, read, read));
    for c in (0..n).filter(|&c| c != 7 && c != 9) {
        let location = buffers.mapping().get(&key(c)).unwrap()[0];
        assert_eq!(buffers.slot_table_entry(location.home().1), location.gpu_slot(), "cluster {c}");
    }
    buffers.log_cluster_reads(logged);
    assert_eq!(buffers.maintain(usize::MAX), n as usize + 1);
    let gpu = buffers.stats().tier(Tier::Gpu).unwrap().clone();
    assert_eq!((gpu.hits, gpu.misses, gpu.moves_in), (read, read, read), "second round: hits only");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_full_cluster_read_queue_drops_and_counts_keys_without_blocking() {
    let mut config = BufferConfig::new(64, 8);
    config.access_queue_batches = 2;
    let buffers = BufferManager::new(config).unwrap();
    store(&buffers, 3);
    for _ in 0..3 {
        buffers.log_cluster_reads(vec![key(0), key(1), key(2)]);
    }
    buffers.log_cluster_reads(Vec::new()); // nothing to log, nothing counted
    let stats = buffers.stats();
    assert_eq!((stats.queued_access_records, stats.dropped_access_records), (6, 3));
    assert_eq!(buffers.maintain(usize::MAX), 6);
    assert_eq!(buffers.stats().queued_access_records, 0);
    assert_eq!(buffers.stats().tier(Tier::Gpu).unwrap().used_blocks, 3);
}

#[test]
fn maintain_takes_access_records_and_cluster_reads_in_turn() {
    let buffers = BufferManager::new(BufferConfig::new(64, 8)).unwrap();
    let blocks = store(&buffers, 4);
    buffers.log_cluster_reads(vec![key(0)]);
    let reader = buffers.reader();
    let location = reader.cluster(&key(1)).unwrap().first().unwrap();
    assert_eq!(reader.pin(&location).unwrap()[0], 1);
    drop(reader);
    buffers.log_cluster_reads(vec![key(2)]);
    // A budget of 2: one access-record batch and one cluster batch, the third waits.
    assert_eq!(buffers.maintain(2), 2);
    assert_eq!(buffers.stats().queued_access_records, 1);
    assert_eq!(buffers.maintain(usize::MAX), 1);
    assert!(blocks[..3].iter().all(|&b| buffers.tier_of(b).unwrap() == Tier::Gpu));
    assert_eq!(buffers.tier_of(blocks[3]).unwrap(), Tier::Host);
}

/// On the GPU machine (`ATTNSTORE_GPU=1`, feature `cuda`): after every admission, eviction,
/// spill, reload and free, the device copy of the slot table equals the host mirror, and each
/// entry it shows leads to the right bytes in the device Gpu tier.
#[cfg(feature = "cuda")]
#[test]
#[allow(unsafe_code, reason = "raw device-to-host copies of the slot table and the Gpu tier, to check them")]
fn the_device_slot_table_equals_the_host_mirror_after_every_move() {
    use cudarc::driver::{result, CudaContext};
    if std::env::var("ATTNSTORE_GPU").as_deref() != Ok("1") {
        eprintln!("skipped: set ATTNSTORE_GPU=1 on a machine with a GPU to run the device slot-table test");
        return;
    }
    let dir = tempdir("device-reads-gpu");
    let buffers = BufferManager::new(with_disk(BufferConfig::new(16, 4), &dir)).unwrap();
    let table = buffers.device_slot_table().expect("ATTNSTORE_GPU=1 but no device slot table");
    let base = buffers.gpu_device_base().expect("a Gpu tier in device memory");
    assert_eq!(table.entries, 16);
    let block = buffers.layout().block_bytes();
    let ctx = CudaContext::new(0).unwrap();
    ctx.bind_to_thread().unwrap();
    let content = |c: u32| -> Vec<u8> { (0..block).map(|i| (i as u32 * 7 + c * 53) as u8).collect() };
    let blocks: Vec<BlockId> = (0..12).map(|c| buffers.store_cluster(key(c), &content(c)).unwrap()[0]).collect();
    let check = |step: &str| {
        let mut on_device = vec![0i32; table.entries];
        // SAFETY: the table holds `entries` i32s at `address` (live while `buffers` is);
        // `on_device` has room for all of them.
        unsafe { result::memcpy_dtoh_sync(&mut on_device, table.address) }.unwrap();
        for (host_slot, &entry) in on_device.iter().enumerate() {
            let mirror = buffers.slot_table_entry(host_slot as u32);
            assert_eq!(u32::try_from(entry).ok(), mirror, "{step}: device entry of Host slot {host_slot}");
        }
        for (c, &b) in blocks.iter().enumerate() {
            let Ok(Some(host_slot)) = buffers.host_slot(b) else { continue };
            let Some(gpu_slot) = buffers.slot_table_entry(host_slot) else { continue };
            let mut bytes = vec![0u8; block];
            // SAFETY: gpu_slot < 4 lies inside the device pool of 4 blocks; `bytes` holds one.
            unsafe { result::memcpy_dtoh_sync(&mut bytes, base + (gpu_slot as usize * block) as u64) }.unwrap();
            assert_eq!(bytes, content(c as u32), "{step}: Gpu slot {gpu_slot} named for block {c}");
        }
    };
    check("start");
    for (round, &b) in blocks.iter().enumerate() {
        buffers.admit(b).unwrap(); // evicts once the 4 slots are full
        check(&format!("admit {round}"));
    }
    let cached: Vec<BlockId> = blocks.iter().copied().filter(|&b| buffers.tier_of(b).unwrap() == Tier::Gpu).collect();
    buffers.spill(cached[0]).unwrap();
    check("spill of a cached block");
    buffers.reload(cached[0]).unwrap();
    check("reload of a cached block");
    buffers.evict(cached[1]).unwrap();
    check("evict");
    buffers.free(cached[2]).unwrap();
    check("free");
    let read = buffers.device_read();
    let _ = buffers.admit(blocks[0]);
    let _ = buffers.admit(blocks[1]);
    check("admissions during a device read");
    drop(read);
    buffers.admit(blocks[1]).unwrap();
    check("admission after the read");
    println!(
        "device slot table: {} entries at {:#x}, equal to the host mirror after every move",
        table.entries, table.address
    );
    let _ = std::fs::remove_dir_all(&dir);
    batched_rounds_write_the_device_before_publishing(&ctx);
}

/// The GPU half of the test above, for `maintain`: a round's device writes are one batch on
/// the Gpu pool's stream and its admissions are published after its one wait, so after every
/// round the device table equals the host mirror and the mapping table, and each entry leads
/// to the block's bytes on the device. Victims of a round during a device read keep their
/// device bytes (quarantined); the next round reuses them. Prints the rounds' times.
#[cfg(feature = "cuda")]
#[allow(unsafe_code, reason = "raw device-to-host copies of the slot table and the Gpu tier, to check them")]
fn batched_rounds_write_the_device_before_publishing(ctx: &std::sync::Arc<cudarc::driver::CudaContext>) {
    use cudarc::driver::result;
    use std::time::Instant;
    const GPU_BLOCKS: usize = 2048;
    let buffers = BufferManager::new(BufferConfig::new(4096, GPU_BLOCKS)).unwrap();
    let table = buffers.device_slot_table().expect("a device slot table");
    let base = buffers.gpu_device_base().expect("a Gpu tier in device memory");
    let block = buffers.layout().block_bytes();
    ctx.bind_to_thread().unwrap();
    let content = |c: u32| -> Vec<u8> { (0..block).map(|i| (i as u32 * 11 + c * 29 + c / 256) as u8).collect() };
    let blocks: Vec<BlockId> = (0..2500).map(|c| buffers.store_cluster(key(c), &content(c)).unwrap()[0]).collect();
    let device_pool = || {
        let mut pool = vec![0u8; GPU_BLOCKS * block];
        // SAFETY: the device pool holds GPU_BLOCKS blocks at `base` (live while `buffers` is).
        unsafe { result::memcpy_dtoh_sync(&mut pool, base) }.unwrap();
        pool
    };
    // Gpu slot → cluster of every cached block, checked against the device; the mapping table,
    // the host mirror and the device table must all agree.
    let check = |step: &str| -> HashMap<u32, u32> {
        let mut on_device = vec![0i32; table.entries];
        // SAFETY: the table holds `entries` i32s at `address`; `on_device` has room for them.
        unsafe { result::memcpy_dtoh_sync(&mut on_device, table.address) }.unwrap();
        for (host_slot, &entry) in on_device.iter().enumerate() {
            assert_eq!(
                u32::try_from(entry).ok(),
                buffers.slot_table_entry(host_slot as u32),
                "{step}: entry {host_slot}"
            );
        }
        let pool = device_pool();
        let mut cached = HashMap::new();
        for (c, &b) in blocks.iter().enumerate() {
            let location = buffers.mapping().get(&key(c as u32)).unwrap()[0];
            let host_slot = buffers.host_slot(b).unwrap().expect("homed on Host");
            assert_eq!(buffers.slot_table_entry(host_slot), location.gpu_slot(), "{step}: cluster {c} published");
            if let Some(g) = location.gpu_slot() {
                let g = g as usize;
                assert_eq!(
                    &pool[g * block..(g + 1) * block],
                    &content(c as u32)[..],
                    "{step}: cluster {c} in slot {g}"
                );
                cached.insert(g as u32, c as u32);
            }
        }
        cached
    };

    buffers.log_cluster_reads((0..2000).map(key).collect());
    let t = Instant::now();
    buffers.maintain(usize::MAX);
    let fill_us = t.elapsed().as_secs_f64() * 1e6;
    let cached = check("a round of 2000 misses");
    assert_eq!(cached.len(), 2000);

    // The tier is full but for 48 slots: 500 misses while a device read lives admit 48 and
    // evict 452 victims, quarantined with their device bytes intact.
    let before = device_pool();
    let read = buffers.device_read();
    buffers.log_cluster_reads((2000..2500).map(key).collect());
    let t = Instant::now();
    buffers.maintain(usize::MAX);
    let evict_us = t.elapsed().as_secs_f64() * 1e6;
    let now = check("a round into a full tier during a device read");
    assert_eq!((now.len(), buffers.stats().gpu_quarantined_blocks), (GPU_BLOCKS - 452, 452));
    let pool = device_pool();
    for slot in cached.keys().filter(|s| !now.contains_key(s)) {
        let s = *slot as usize;
        assert_eq!(&pool[s * block..(s + 1) * block], &before[s * block..(s + 1) * block], "quarantined slot {s}");
    }
    drop(read);
    assert_eq!(buffers.stats().gpu_quarantined_blocks, 0);
    buffers.log_cluster_reads((2000..2500).map(key).collect());
    let t = Instant::now();
    buffers.maintain(usize::MAX);
    let reuse_us = t.elapsed().as_secs_f64() * 1e6;
    let now = check("the round after: the victims' slots reused");
    assert!((2000..2500).all(|c| now.values().any(|&held| held == c)), "every waiting miss admitted");
    assert_eq!(buffers.stats().tier(Tier::Gpu).unwrap().failures, 0);
    println!(
        "maintain rounds on the device: 2000 admissions {fill_us:.0} us ({:.2} us/block); 48 admissions + 452 evictions {evict_us:.0} us; 452 admissions into reused slots {reuse_us:.0} us",
        fill_us / 2000.0
    );
}
