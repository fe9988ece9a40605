//! Bad input gives typed errors, never a panic: unknown blocks, double free, wrong lengths,
//! full tiers (with and without a Disk tier to spill to), pinned blocks, bad configuration.

use attnstore_buffer::{
    BlockId, BlockKey, BlockLayout, BufferConfig, BufferManager, ClusterKey, DiskConfig, Error, ReplacerKind, Tier,
};

const KEY: BlockKey = BlockKey { context: 1, layer: 0, head: 0 };

#[test]
fn unknown_blocks_and_double_frees_are_typed_errors() {
    let buffers = BufferManager::new(BufferConfig::new(4, 2)).unwrap();
    let never = BlockId::from_raw(99);
    assert_eq!(buffers.read(never).err(), Some(Error::UnknownBlock { block: never }));
    assert_eq!(buffers.write(never, &[1]), Err(Error::UnknownBlock { block: never }));
    assert_eq!(buffers.free(never), Err(Error::UnknownBlock { block: never }));
    assert_eq!(buffers.admit(never), Err(Error::UnknownBlock { block: never }));
    assert_eq!(buffers.spill(never), Err(Error::UnknownBlock { block: never }));
    let block = buffers.allocate(KEY).unwrap();
    buffers.free(block).unwrap();
    assert_eq!(buffers.free(block), Err(Error::DoubleFree { block }));
    assert_eq!(buffers.read(block).err(), Some(Error::UnknownBlock { block }));
    assert_eq!(
        buffers.attach(ClusterKey { context: 1, layer: 0, head: 0, cluster: 0 }, &[block]),
        Err(Error::UnknownBlock { block })
    );
}

#[test]
fn wrong_lengths_tiers_and_configurations_are_typed_errors() {
    let buffers = BufferManager::new(BufferConfig::new(2, 1)).unwrap();
    let a = buffers.allocate(KEY).unwrap();
    assert_eq!(buffers.write(a, &[0; 2049]), Err(Error::WrongLength { expected: 2048, got: 2049 }));
    assert_eq!(buffers.evict(a), Err(Error::WrongTier { block: a, expected: Tier::Gpu, got: Tier::Host }));
    assert_eq!(buffers.reload(a), Err(Error::WrongTier { block: a, expected: Tier::Disk, got: Tier::Host }));
    assert_eq!(buffers.spill(a), Err(Error::TierFull { tier: Tier::Disk, capacity_blocks: 0 }), "no Disk tier");
    let b = buffers.allocate(KEY).unwrap();
    // Host full and no Disk tier: a typed error, never an abort.
    assert_eq!(buffers.allocate(KEY), Err(Error::TierFull { tier: Tier::Host, capacity_blocks: 2 }));
    let key = ClusterKey { context: 1, layer: 0, head: 0, cluster: 1 };
    assert_eq!(buffers.store_cluster(key, &[1; 100]), Err(Error::TierFull { tier: Tier::Host, capacity_blocks: 2 }));
    assert!(buffers.mapping().get(&key).is_none(), "a failed store leaves nothing mapped");
    buffers.attach(key, &[a]).unwrap();
    let other = ClusterKey { cluster: 2, ..key };
    assert_eq!(buffers.attach(other, &[b, a]), Err(Error::AlreadyAttached { block: a, cluster: key }));
    assert_eq!(buffers.attach(other, &[b, b]), Err(Error::AlreadyAttached { block: b, cluster: other }));
    // The Gpu tier full of pinned blocks: admission is refused, the pinned block stays.
    buffers.admit(a).unwrap();
    let pin = buffers.read(a).unwrap();
    assert_eq!(pin.tier(), Tier::Gpu);
    assert_eq!(buffers.admit(b), Err(Error::TierFull { tier: Tier::Gpu, capacity_blocks: 1 }));
    assert!(matches!(buffers.evict(a), Err(Error::Pinned { block, pins: 1, op: "evict" }) if block == a));
    assert!(matches!(buffers.write(a, &[2; 8]), Err(Error::Pinned { .. })));
    assert!(matches!(buffers.free(a), Err(Error::Pinned { .. })));
    assert_eq!(&pin[..4], &[0, 0, 0, 0], "pinned bytes unchanged by the refused write");
    drop(pin);
    assert_eq!(buffers.admit(b), Ok(0), "the unpinned slot is reused");
    assert_eq!(buffers.tier_of(a), Ok(Tier::Host));

    let config = |f: &dyn Fn(&mut BufferConfig)| {
        let mut c = BufferConfig::new(4, 2);
        f(&mut c);
        BufferManager::new(c).err()
    };
    assert!(matches!(
        config(&|c| c.access_queue_batches = 0),
        Some(Error::BadConfig { what: "access_queue_batches", .. })
    ));
    let dir = std::env::temp_dir().join(format!("attnstore-badcfg-{}", std::process::id()));
    assert!(matches!(
        config(&|c| c.disk = Some(DiskConfig { batch_blocks: 0, ..DiskConfig::new(&dir) })),
        Some(Error::BadConfig { what: "disk batch_blocks", .. })
    ));
    // The arena is reserved from the engine's host budget: too small a budget is a typed error.
    let budget = attnstore_buffer::MemoryBudget::new(Tier::Host, 4 * 2048 - 1);
    assert!(matches!(
        config(&|c| c.host_budget = Some(budget.clone())),
        Some(Error::OutOfMemory { tier: Tier::Host, requested_bytes: 8192, available_bytes: 8191, .. })
    ));
    let budget = attnstore_buffer::MemoryBudget::new(Tier::Host, 4 * 2048);
    let mut fits = BufferConfig::new(4, 2);
    fits.host_budget = Some(budget.clone());
    let held = BufferManager::new(fits).unwrap();
    assert_eq!(budget.used_bytes(), 8192);
    drop(held);
    assert_eq!(budget.used_bytes(), 0, "released with the manager");
    assert_eq!(BlockLayout::new(100), Err(Error::BadBlockSize(100)));
    assert!(ReplacerKind::Lru.build(u32::MAX as usize).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_full_host_tier_spills_new_blocks_to_disk_and_a_full_disk_is_a_typed_error() {
    let dir = std::env::temp_dir().join(format!("attnstore-full-{}", std::process::id()));
    let mut config = BufferConfig::new(2, 0);
    config.disk = Some(DiskConfig { capacity_blocks: 2, ..DiskConfig::new(&dir) });
    let buffers = BufferManager::new(config).unwrap();
    let tiers: Vec<_> = (0..4).map(|_| buffers.tier_of(buffers.allocate(KEY).unwrap()).unwrap()).collect();
    assert_eq!(tiers, [Tier::Host, Tier::Host, Tier::Disk, Tier::Disk]);
    assert_eq!(buffers.allocate(KEY), Err(Error::TierFull { tier: Tier::Disk, capacity_blocks: 2 }));
    assert_eq!(buffers.admit(BlockId::from_raw(1)), Err(Error::TierFull { tier: Tier::Gpu, capacity_blocks: 0 }));
    drop(buffers);
    let _ = std::fs::remove_dir_all(&dir);
}
