//! Stress: 4 reader threads run plan-like batches (cluster lookups, then pinned reads of
//! every block, held for the batch) while the maintainer admits and evicts in the Gpu tier
//! and a mover thread spills blocks to Disk and reloads them. Over 10^6 pinned reads, every
//! byte must be the block's own, and no pinned block may change while pinned.

use attnstore_buffer::{BufferConfig, BufferManager, ClusterKey, DiskConfig, Maintainer, ReplacerKind, Tier};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CLUSTERS: u32 = 512;
const BLOCKS_PER_CLUSTER: usize = 8;
const READERS: usize = 4;
const READS_PER_READER: u64 = 260_000;

fn key(cluster: u32) -> ClusterKey {
    ClusterKey { context: 5, layer: 3, head: cluster % 4, cluster }
}

/// Byte `i` of block `id`: any byte from another block or a half-written slot shows up.
fn expected_byte(id: u64, i: usize) -> u8 {
    (id.wrapping_mul(0x9E37_79B9) as usize ^ (i * 131)).to_le_bytes()[0] ^ (i >> 8) as u8
}

fn check(id: u64, bytes: &[u8]) -> u64 {
    bytes.iter().enumerate().filter(|&(i, &b)| b != expected_byte(id, i)).count() as u64
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Skewed: small cluster numbers are read far more often (like hot clusters of a query).
    fn cluster(&mut self) -> u32 {
        let u = (self.next() % 1_000_000) as f64 / 1_000_000.0;
        ((u * u * u) * f64::from(CLUSTERS)) as u32 % CLUSTERS
    }
}

#[test]
fn readers_never_see_wrong_bytes_while_the_maintainer_and_a_mover_churn() {
    let dir = std::env::temp_dir().join(format!("attnstore-stress-{}", std::process::id()));
    let total_blocks = CLUSTERS as usize * BLOCKS_PER_CLUSTER;
    let mut config = BufferConfig::new(total_blocks, total_blocks / 20); // Gpu: 5%
    config.replacer = ReplacerKind::Clock;
    config.disk = Some(DiskConfig::new(&dir));
    config.access_queue_batches = 64;
    config.check_replacer = true;
    let buffers = Arc::new(BufferManager::new(config).unwrap());
    let block_bytes = buffers.layout().block_bytes();
    for cluster in 0..CLUSTERS {
        // Allocate, then write each block's own pattern (ids are known only after allocation).
        let blocks = buffers.store_cluster(key(cluster), &vec![0u8; BLOCKS_PER_CLUSTER * block_bytes]).unwrap();
        for block in blocks {
            let bytes: Vec<u8> = (0..block_bytes).map(|i| expected_byte(block.get(), i)).collect();
            buffers.write(block, &bytes).unwrap();
        }
    }

    let maintainer = Maintainer::spawn(Arc::clone(&buffers), 512, Duration::from_micros(50)).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let moves = Arc::new(AtomicU64::new(0));
    let mover = {
        let (buffers, stop, moves) = (Arc::clone(&buffers), Arc::clone(&stop), Arc::clone(&moves));
        std::thread::spawn(move || {
            let mut rng = Rng(7);
            let mut spilled = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let cluster = (rng.next() % u64::from(CLUSTERS)) as u32;
                if let Some(location) = buffers.mapping().get(&key(cluster)).and_then(|b| b.first().copied()) {
                    if buffers.spill(location.block()).is_ok() {
                        spilled.push(location.block());
                        moves.fetch_add(1, Ordering::Relaxed);
                    }
                }
                if spilled.len() > 64 {
                    let block = spilled.swap_remove((rng.next() % 64) as usize);
                    buffers.reload(block).unwrap();
                    moves.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    };

    let started = Instant::now();
    let readers: Vec<_> = (0..READERS)
        .map(|t| {
            let buffers = Arc::clone(&buffers);
            std::thread::spawn(move || {
                let mut rng = Rng(0x1234_5678 + t as u64);
                let (mut reads, mut wrong, mut per_tier) = (0u64, 0u64, [0u64; 3]);
                while reads < READS_PER_READER {
                    let reader = buffers.reader();
                    let mut pins = Vec::new();
                    for batch in 0..4 {
                        let locations = reader.cluster(&key(rng.cluster())).expect("every cluster is mapped");
                        // Half the batches pin one by one, half as a plan's set (Disk reads batched).
                        let pinned: Vec<_> = if batch % 2 == 0 {
                            locations.iter().map(|l| reader.pin(&l)).collect()
                        } else {
                            reader.pin_all(&locations.to_vec())
                        };
                        for pin in pinned {
                            let pin = pin.expect("no faults injected: every pin succeeds");
                            wrong += check(pin.block().get(), &pin);
                            per_tier[Tier::ALL.iter().position(|&x| x == pin.tier()).unwrap()] += 1;
                            pins.push(pin);
                            reads += 1;
                        }
                    }
                    // Pinned for the whole batch: nothing may have changed under the pins.
                    wrong += pins.iter().map(|pin| check(pin.block().get(), pin)).sum::<u64>();
                }
                (reads, wrong, per_tier)
            })
        })
        .collect();
    let (mut reads, mut wrong, mut per_tier) = (0, 0, [0u64; 3]);
    for handle in readers {
        let (r, w, t) = handle.join().unwrap();
        reads += r;
        wrong += w;
        (0..3).for_each(|i| per_tier[i] += t[i]);
    }
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    mover.join().unwrap();
    assert!(!maintainer.stop(), "the maintainer panicked");
    let stats = buffers.stats();
    eprintln!(
        "{reads} pinned reads in {elapsed:?}; per tier (gpu, host, disk) {per_tier:?}; {} moves\n{stats}",
        moves.load(Ordering::Relaxed)
    );
    assert_eq!(wrong, 0, "wrong bytes served");
    assert!(reads >= 1_000_000);
    let gpu = stats.tier(Tier::Gpu).unwrap();
    assert!(per_tier[0] > 0 && gpu.evictions > 0, "the maintainer admitted and evicted: {gpu:?}");
    assert!(per_tier[2] > 0 && moves.load(Ordering::Relaxed) > 0, "blocks were served from Disk while moving");
    drop(buffers);
    let _ = std::fs::remove_dir_all(&dir);
}
