//! The body of the `buffer_ops` fuzz target, kept in the crate so the checked-in corpus
//! replays on stable (`tests/fuzz_corpus_replay.rs`) and libFuzzer runs it on nightly.
//!
//! Input bytes are decoded into a sequence of operations (allocate, write, pin, unpin, read,
//! admit, evict, spill, reload, free, store and look up a cluster and log it as a device
//! step's read (as ids, or flagged as a device step writes them), maintain, flip a bit on
//! disk, inject an I/O fault, bad ids) run against a small buffer manager and a model
//! (block → bytes last written). The first byte picks the replacer, and whether `maintain`
//! batches its rounds as with a Gpu tier in device memory (admissions published at the end of
//! the round). It panics when a read returns other bytes than the model's, when a pinned block
//! changes, when the slot table of device-planned reads disagrees with the blocks' tiers, or
//! when an operation succeeds or fails against the rules.

use crate::{
    BlockId, BlockKey, BufferConfig, BufferManager, ClusterKey, DiskConfig, Error, FaultPlan, FaultyIo, FlaggedReads,
    IoChoice, LayerReads, PinGuard, ReplacerKind, Tier,
};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const BLOCK_BYTES: usize = 512;
const HOST_BLOCKS: usize = 6;
const GPU_BLOCKS: usize = 3;
const DISK_BLOCKS: usize = 12;

struct Input<'a> {
    data: &'a [u8],
}

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&first, rest) = self.data.split_first()?;
        self.data = rest;
        Some(first)
    }
}

#[derive(Debug, Clone)]
struct ModelBlock {
    bytes: Vec<u8>,
    /// A fault touched the block: a read may fail (typed error), but never return other bytes.
    may_be_lost: bool,
}

struct Model {
    blocks: HashMap<BlockId, ModelBlock>,
    /// A fault plan is armed: any I/O may fail (with a typed error, never wrong bytes).
    faults_armed: bool,
    freed: HashSet<BlockId>,
    order: Vec<BlockId>,
}

impl Model {
    fn pick(&self, byte: u8) -> Option<BlockId> {
        (!self.order.is_empty()).then(|| self.order[byte as usize % self.order.len()])
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_mul(31).wrapping_add(i as u8)).collect()
}

fn padded(mut bytes: Vec<u8>) -> Vec<u8> {
    bytes.resize(BLOCK_BYTES, 0);
    bytes
}

/// Checks a read against the model: the bytes last written, or (after a fault) a typed error.
fn check_read(model: &mut Model, block: BlockId, result: &Result<PinGuard<'_>, Error>) {
    let faults_armed = model.faults_armed;
    let expected = model.blocks.get_mut(&block).expect("a live block");
    match result {
        Ok(guard) => {
            assert!(guard[..] == expected.bytes[..], "read of {block} from {} returned other bytes", guard.tier())
        }
        Err(Error::Corrupt { .. } | Error::Missing { .. } | Error::Io { .. } | Error::Timeout { .. }) => {
            assert!(expected.may_be_lost || faults_armed, "read of {block} failed without a fault: {result:?}");
            expected.may_be_lost = true;
        }
        Err(e) => panic!("read of {block} failed unexpectedly: {e}"),
    }
}

fn pinned_on(pins: &[(PinGuard<'_>, Vec<u8>)], block: BlockId, tier: Tier) -> bool {
    pins.iter().any(|(g, _)| g.block() == block && g.tier() == tier)
}

fn check_refusal(result: &Result<(), Error>, pinned: bool, op: &str) {
    match result {
        Err(Error::Pinned { .. }) => assert!(pinned, "{op} refused as pinned, but no pin is held"),
        _ => assert!(!pinned, "{op} of a pinned block was not refused: {result:?}"),
    }
}

static RUN: AtomicU64 = AtomicU64::new(0);

/// Body of the `buffer_ops` fuzz target (see the module docs). Never panics on valid
/// behaviour of the buffer manager; any panic is a bug (or a broken invariant) to fix.
pub fn fuzz_buffer_ops(data: &[u8]) {
    let mut input = Input { data };
    let Some(first) = input.byte() else { return };
    let dir = std::env::temp_dir().join(format!(
        "attnstore-fuzz-{}-{}",
        std::process::id(),
        RUN.fetch_add(1, Ordering::Relaxed)
    ));
    let faults = Arc::new(FaultyIo::new(Box::new(crate::disk::PreadIo), FaultPlan::default()));
    let mut disk = DiskConfig::new(&dir);
    disk.capacity_blocks = DISK_BLOCKS;
    disk.segment_blocks = 8;
    disk.batch_blocks = 4;
    // Buffered I/O: the driver checks logic, and page-cache writes keep it at thousands of runs
    // per second (O_DIRECT is covered by the tests and the bench).
    disk.direct = false;
    disk.io = IoChoice::Custom(faults.clone());
    let mut config = BufferConfig::new(HOST_BLOCKS, GPU_BLOCKS);
    config.layout = crate::BlockLayout::new(BLOCK_BYTES).expect("valid");
    config.replacer = ReplacerKind::ALL[first as usize % 4];
    config.disk = Some(disk);
    config.access_queue_batches = 2;
    config.check_replacer = true;
    let mut buffers = BufferManager::new(config).expect("small config");
    if first & 4 != 0 {
        buffers.force_batched_rounds();
    }
    run_ops(&buffers, &faults, &mut input);
    drop(buffers);
    let _ = std::fs::remove_dir_all(&dir);
}

fn run_ops(buffers: &BufferManager, faults: &FaultyIo, input: &mut Input<'_>) {
    let mut model = Model { blocks: HashMap::new(), faults_armed: false, freed: HashSet::new(), order: Vec::new() };
    let mut pins: Vec<(PinGuard<'_>, Vec<u8>)> = Vec::new();
    let mut clusters = 0u32;
    while let (Some(op), Some(arg)) = (input.byte(), input.byte()) {
        let target = model.pick(arg);
        match op % 16 {
            0 | 1 => match buffers.allocate(BlockKey { context: 1, layer: 0, head: u32::from(arg % 2) }) {
                Ok(block) => {
                    model.blocks.insert(block, ModelBlock { bytes: vec![0; BLOCK_BYTES], may_be_lost: false });
                    model.order.push(block);
                }
                Err(Error::TierFull { .. }) => {
                    let stats = buffers.stats();
                    let used: usize =
                        [Tier::Host, Tier::Disk].iter().map(|&t| stats.tier(t).unwrap().used_blocks).sum();
                    assert_eq!(used, HOST_BLOCKS + DISK_BLOCKS, "TierFull while slots are free");
                }
                Err(e @ Error::Io { .. }) => assert!(model.faults_armed, "allocate failed: {e}"),
                Err(e) => panic!("allocate failed: {e}"),
            },
            2 | 3 => {
                let Some(block) = target else { continue };
                let len = input.byte().map_or(0, |b| b as usize * BLOCK_BYTES / 255);
                let bytes = pattern(arg, len);
                let result = buffers.write(block, &bytes);
                let pinned = pinned_on(&pins, block, Tier::Gpu) || pinned_on(&pins, block, Tier::Host);
                check_refusal(&result, pinned, "write");
                match result {
                    Ok(()) => model.blocks.insert(block, ModelBlock { bytes: padded(bytes), may_be_lost: false }),
                    Err(Error::Io { .. } | Error::Timeout { .. } | Error::TierFull { .. }) => {
                        assert!(
                            model.blocks[&block].may_be_lost
                                || model.faults_armed
                                || buffers.is_lost(block) == Ok(true)
                        );
                        model.blocks.get_mut(&block).unwrap().may_be_lost = true;
                        None
                    }
                    Err(Error::Pinned { .. }) => None,
                    Err(e) => panic!("write failed: {e}"),
                };
            }
            4 | 5 => {
                let Some(block) = target else { continue };
                let result = buffers.read(block);
                check_read(&mut model, block, &result);
                if let Ok(guard) = result {
                    let expected = guard.to_vec();
                    pins.push((guard, expected));
                }
            }
            6 => {
                if !pins.is_empty() {
                    pins.swap_remove(arg as usize % pins.len());
                }
            }
            7 => {
                let Some(block) = target else { continue };
                let result = buffers.admit(block).map(|_| ());
                match &result {
                    Ok(()) => assert_eq!(buffers.tier_of(block), Ok(Tier::Gpu)),
                    Err(Error::TierFull { tier: Tier::Gpu, .. }) => {
                        let gpu_pinned: HashSet<_> =
                            pins.iter().filter(|(g, _)| g.tier() == Tier::Gpu).map(|(g, _)| g.block()).collect();
                        assert_eq!(gpu_pinned.len(), GPU_BLOCKS, "Gpu tier full while a slot is unpinned");
                    }
                    Err(Error::Corrupt { .. } | Error::Missing { .. } | Error::Io { .. } | Error::Timeout { .. }) => {
                        assert!(model.blocks[&block].may_be_lost || model.faults_armed, "admit failed: {result:?}");
                        model.blocks.get_mut(&block).unwrap().may_be_lost = true;
                    }
                    Err(e) => panic!("admit failed: {e}"),
                }
            }
            8 => {
                let Some(block) = target else { continue };
                let was_cached = buffers.tier_of(block) == Ok(Tier::Gpu);
                let result = buffers.evict(block);
                check_refusal(&result, pinned_on(&pins, block, Tier::Gpu), "evict");
                match result {
                    Ok(()) => assert!(was_cached),
                    Err(Error::WrongTier { .. }) => assert!(!was_cached),
                    Err(Error::Pinned { .. }) => {}
                    Err(e) => panic!("evict failed: {e}"),
                }
            }
            9 | 10 => {
                let Some(block) = target else { continue };
                let result = if op % 16 == 9 { buffers.spill(block) } else { buffers.reload(block) };
                if op % 16 == 9 {
                    check_refusal(&result, pinned_on(&pins, block, Tier::Host), "spill");
                }
                match result {
                    Ok(()) | Err(Error::WrongTier { .. } | Error::TierFull { .. } | Error::Pinned { .. }) => {}
                    Err(Error::Corrupt { .. } | Error::Missing { .. } | Error::Io { .. } | Error::Timeout { .. }) => {
                        assert!(model.blocks[&block].may_be_lost || model.faults_armed, "{result:?}");
                        model.blocks.get_mut(&block).unwrap().may_be_lost = true;
                    }
                    Err(e) => panic!("spill/reload failed: {e}"),
                }
            }
            11 => {
                let Some(block) = target else { continue };
                let pinned = pins.iter().any(|(g, _)| g.block() == block && g.slot().is_some());
                let result = buffers.free(block);
                check_refusal(&result, pinned, "free");
                if result.is_ok() {
                    model.blocks.remove(&block);
                    model.order.retain(|&b| b != block);
                    model.freed.insert(block);
                    assert_eq!(buffers.free(block), Err(Error::DoubleFree { block }));
                    assert!(matches!(buffers.read(block), Err(Error::UnknownBlock { .. })));
                }
            }
            12 => {
                let key = ClusterKey { context: 2, layer: 0, head: 0, cluster: clusters };
                clusters += 1;
                let len = (arg as usize % 3) * BLOCK_BYTES + usize::from(arg % 7) * 10;
                let bytes = pattern(arg, len);
                match buffers.store_cluster(key, &bytes) {
                    Ok(blocks) => {
                        for (block, chunk) in blocks.iter().zip(bytes.chunks(BLOCK_BYTES)) {
                            model
                                .blocks
                                .insert(*block, ModelBlock { bytes: padded(chunk.to_vec()), may_be_lost: false });
                            model.order.push(*block);
                        }
                    }
                    Err(Error::TierFull { .. } | Error::Io { .. }) => {}
                    Err(e) => panic!("store_cluster failed: {e}"),
                }
            }
            13 => {
                // Plan path: look up clusters, pin their blocks through the locations.
                let reader = buffers.reader();
                for cluster in 0..clusters {
                    let key = ClusterKey { context: 2, layer: 0, head: 0, cluster };
                    let locations = reader.cluster(&key).map(|l| l.to_vec()).unwrap_or_default();
                    for location in &locations {
                        let block = location.block();
                        assert!(model.blocks.contains_key(&block), "the mapping table lists freed block {block}");
                    }
                    if arg % 2 == 0 {
                        for location in &locations {
                            check_read(&mut model, location.block(), &reader.pin(location));
                        }
                    } else {
                        for (location, result) in locations.iter().zip(reader.pin_all(&locations)) {
                            check_read(&mut model, location.block(), &result);
                        }
                    }
                }
                drop(reader);
                if arg & 4 != 0 {
                    // A device step's reads too (no pins): every other cluster and an
                    // unmapped id, as a layer's selection; the round admits and counts them.
                    let ids: Vec<u32> =
                        (0..clusters).filter(|c| c % 2 == u32::from(arg) % 2).chain([clusters + 7]).collect();
                    if arg & 8 == 0 {
                        buffers.log_layer_reads(vec![LayerReads { context: 2, layer: 0, per_head: vec![ids] }]);
                    } else {
                        // As the device flags them (some misses, a sampled share of the hits,
                        // padding past `real`), after an older step of the layer that the
                        // round supersedes.
                        let flagged = |ids: &[u32]| -> Vec<i32> {
                            ids.iter()
                                .map(|&c| if (c + u32::from(arg)) % 3 == 0 { !(c as i32) } else { c as i32 })
                                .collect()
                        };
                        let reads = |flagged: Vec<i32>| FlaggedReads {
                            context: 2,
                            layer: 0,
                            per_head: flagged.len(),
                            flagged,
                            real: vec![clusters.saturating_sub(u32::from(arg >> 6))],
                            hit_every: u32::from(arg >> 4) % 4,
                            hit_turn: u32::from(arg),
                        };
                        buffers.log_flagged_reads(vec![reads(flagged(&[0, clusters + 3]))]);
                        buffers.log_flagged_reads(vec![reads(flagged(&ids))]);
                    }
                }
                buffers.maintain(usize::MAX);
            }
            14 => {
                // Flip one bit of a block on disk: it must never be served.
                let Some(block) = target else { continue };
                if let Ok(Some((path, offset))) = buffers.disk_location(block) {
                    use std::os::unix::fs::FileExt;
                    let file = std::fs::File::options().read(true).write(true).open(path).expect("segment");
                    let at = offset + u64::from(arg) % BLOCK_BYTES as u64;
                    let mut byte = [0u8];
                    file.read_exact_at(&mut byte, at).expect("read segment");
                    file.write_all_at(&[byte[0] ^ (1 << (arg % 8))], at).expect("write segment");
                    model.blocks.get_mut(&block).unwrap().may_be_lost = true;
                }
            }
            _ => {
                // Faults: fail the next I/O of a block, or every I/O after a few; or bad ids.
                match arg % 4 {
                    0 => {
                        faults.set_plan(FaultPlan::default());
                        model.faults_armed = false;
                    }
                    1 => {
                        if let Some(block) = target {
                            faults.set_plan(FaultPlan { fail_blocks: [block].into(), ..FaultPlan::default() });
                            model.blocks.get_mut(&block).unwrap().may_be_lost = true;
                            model.faults_armed = true; // a block freed and re-allocated is another id: harmless
                        }
                    }
                    2 => {
                        faults.set_plan(FaultPlan { fail_after_ops: Some(u64::from(arg % 5)), ..FaultPlan::default() });
                        model.faults_armed = true;
                    }
                    _ => {
                        let bad = BlockId(u64::MAX - u64::from(arg));
                        assert_eq!(buffers.read(bad).err(), Some(Error::UnknownBlock { block: bad }));
                        assert_eq!(buffers.free(bad), Err(Error::UnknownBlock { block: bad }));
                        assert_eq!(buffers.admit(bad), Err(Error::UnknownBlock { block: bad }));
                        if let Some(block) = target {
                            let too_long = vec![0; BLOCK_BYTES + 1];
                            let expected = Err(Error::WrongLength { expected: BLOCK_BYTES, got: BLOCK_BYTES + 1 });
                            assert_eq!(buffers.write(block, &too_long), expected);
                        }
                    }
                }
            }
        }
        // The slot table stays exact under every operation, faults included.
        if let Err(why) = buffers.check_slot_table() {
            panic!("slot table out of step after operation {}: {why}", op % 16);
        }
        // Pinned bytes never change.
        for (guard, expected) in &pins {
            assert!(guard[..] == expected[..], "pinned block {} changed under its pin", guard.block());
        }
        let stats = buffers.stats();
        for tier in &stats.tiers {
            assert!(tier.used_blocks <= tier.capacity_blocks, "{} over capacity", tier.tier);
        }
    }
}
