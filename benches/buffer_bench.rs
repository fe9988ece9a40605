//! `buffer_bench`: figures of the buffer manager, each printed with a baseline measured in
//! the same run and the ratio (see docs/buffer-manager.md for what each figure means).
//!
//! ```text
//! cargo run --release -p attnstore-benches --bin buffer_bench [lookup] [hit] [disk] [plan]
//! ```
//! Sections: `lookup` (mapping-table ns per cluster lookup, 1 and 2 threads, vs a HashMap and
//! a RwLock<HashMap>), `hit` (Gpu-tier hit ratio of LRU, LFU, CLOCK, SIEVE with a 5% cache on
//! a decode-like trace, vs LRU and the offline optimum), `disk` (Disk-tier 2 KiB block reads,
//! sequential and random, vs `dd iflag=direct` and fio on the same file), `plan` (plan-like
//! batch lookup + pin latency p50/p99 without and with maintainer churn). The Disk section
//! writes a 128 MiB file under `$ATTNSTORE_BENCH_DIR` (default: the system temp folder).

use attnstore_buffer::{
    BlockId, BlockLayout, BufferConfig, BufferManager, ClusterKey, DiskConfig, DiskTier, Maintainer, ReplacerKind, Tier,
};
use attnstore_kernels::random::SplitMix64;
use parking_lot::RwLock;
use std::collections::{BTreeSet, HashMap};
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let want = |s: &str| args.is_empty() || args.iter().any(|a| a == s);
    if want("lookup") {
        lookup();
    }
    if want("hit") {
        hit_ratio();
    }
    if want("disk") {
        disk();
    }
    if want("plan") {
        plan_latency();
    }
}

// ---------------------------------------------------------------- mapping-table lookups

fn lookup() {
    // One context of 32 layers × 8 KV heads × 400 clusters (102,400 clusters, 4 blocks each).
    let mut config = BufferConfig::new(409_600, 0);
    config.layout = BlockLayout::new(64).unwrap(); // the table is what is measured, not the bytes
    config.check_replacer = false;
    let buffers = BufferManager::new(config).unwrap();
    let keys: Vec<ClusterKey> = (0..32)
        .flat_map(|layer| {
            (0..8).flat_map(move |head| (0..400).map(move |cluster| ClusterKey { context: 1, layer, head, cluster }))
        })
        .collect();
    for key in &keys {
        buffers.store_cluster(*key, &[1u8; 256]).unwrap();
    }
    let table = buffers.mapping();
    let plain: HashMap<ClusterKey, Vec<_>> = keys.iter().map(|k| (*k, table.get(k).unwrap())).collect();
    let locked = RwLock::new(plain.clone());
    let mut rng = SplitMix64::new(7);
    let order: Vec<usize> = (0..2_000_000).map(|_| rng.below(keys.len())).collect();

    let ours = |order: &[usize]| {
        let mut sum = 0u64;
        for batch in order.chunks(256) {
            let reader = table.reader(); // one epoch pin per plan-sized batch
            for &i in batch {
                sum += reader.get(&keys[i]).map_or(0, |b| b.first().map_or(0, |l| l.block().get()));
            }
        }
        sum
    };
    let batched = |order: &[usize]| {
        let mut sum = 0u64;
        let mut batch_keys = Vec::with_capacity(256);
        for batch in order.chunks(256) {
            let reader = table.reader();
            batch_keys.clear();
            batch_keys.extend(batch.iter().map(|&i| keys[i]));
            let mut out = Vec::with_capacity(256);
            reader.get_many(&batch_keys, &mut out);
            sum += out.iter().map(|b| b.map_or(0, |b| b.first().map_or(0, |l| l.block().get()))).sum::<u64>();
        }
        sum
    };
    let hashmap =
        |order: &[usize]| order.iter().map(|&i| plain.get(&keys[i]).map_or(0, |b| b[0].block().get())).sum::<u64>();
    let rwlock = |order: &[usize]| {
        order.iter().map(|&i| locked.read().get(&keys[i]).map_or(0, |b| b[0].block().get())).sum::<u64>()
    };
    println!("== mapping table: {} clusters, random keys, batches of 256 lookups per epoch pin", keys.len());
    let time1 = |f: &dyn Fn(&[usize]) -> u64| best_of(5, || black_box(f(&order))) / order.len() as f64;
    let (a, m, b, c) = (time1(&ours), time1(&batched), time1(&hashmap), time1(&rwlock));
    println!("lookup 1 thread : mapping table get {a:6.1} ns, get_many {m:6.1} ns | std HashMap (SipHash, no sync) {b:6.1} ns ({:.2}x, {:.2}x) | RwLock<HashMap> {c:6.1} ns ({:.2}x, {:.2}x)", b / a, b / m, c / a, c / m);
    let time2 = |f: &(dyn Fn(&[usize]) -> u64 + Sync)| {
        best_of(5, || {
            std::thread::scope(|s| {
                let halves: Vec<_> = order.chunks(order.len() / 2).map(|h| s.spawn(move || black_box(f(h)))).collect();
                halves.into_iter().for_each(|h| drop(h.join()));
            })
        }) * 2.0
            / order.len() as f64
    };
    let (a2, m2, b2, c2) = (time2(&ours), time2(&batched), time2(&hashmap), time2(&rwlock));
    println!("lookup 2 threads: mapping table get {a2:6.1} ns, get_many {m2:6.1} ns | std HashMap (SipHash, no sync) {b2:6.1} ns ({:.2}x, {:.2}x) | RwLock<HashMap> {c2:6.1} ns ({:.2}x, {:.2}x)   (ns per lookup per thread)", b2 / a2, b2 / m2, c2 / a2, c2 / m2);
}

/// Best wall time of `runs` runs of `f`, in nanoseconds.
fn best_of<T>(runs: usize, mut f: impl FnMut() -> T) -> f64 {
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            black_box(f());
            t.elapsed().as_nanos() as f64
        })
        .fold(f64::INFINITY, f64::min)
}

// ---------------------------------------------------------------- decode trace

const HEADS: u32 = 8;
const CLUSTERS: u32 = 512;
const BLOCKS_PER_CLUSTER: usize = 4;
const DIM: usize = 32;
const TOP_CLUSTERS: usize = 10; // ≈2% of a head's clusters retrieved per step (RetroInfer: 1.8%)
const STEPS: usize = 1000;

/// Per step, the clusters each head retrieves: the top `TOP_CLUSTERS` by `q·centroid + bias`
/// where centroids are random unit vectors, `bias` makes 10% of the clusters persistently hot
/// (+0.35), and each head's query drifts slowly (q ← normalize(q + 0.25·noise/√d)) with a
/// jump to a fresh random query every 250 steps (a new topic).
fn drift() -> f32 {
    std::env::var("DRIFT").ok().and_then(|v| v.parse().ok()).unwrap_or(0.3)
}
fn hot() -> f32 {
    std::env::var("HOT").ok().and_then(|v| v.parse().ok()).unwrap_or(0.2)
}
fn decode_trace(seed: u64) -> Vec<Vec<ClusterKey>> {
    let mut rng = SplitMix64::new(seed);
    let unit = |rng: &mut SplitMix64| {
        let v: Vec<f32> = (0..DIM).map(|_| rng.normal()).collect();
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.into_iter().map(|x| x / n).collect::<Vec<f32>>()
    };
    let centroids: Vec<Vec<Vec<f32>>> = (0..HEADS).map(|_| (0..CLUSTERS).map(|_| unit(&mut rng)).collect()).collect();
    let bias: Vec<Vec<f32>> =
        (0..HEADS).map(|_| (0..CLUSTERS).map(|_| if rng.uniform() < 0.1 { hot() } else { 0.0 }).collect()).collect();
    let mut queries: Vec<Vec<f32>> = (0..HEADS).map(|_| unit(&mut rng)).collect();
    (0..STEPS)
        .map(|step| {
            let mut chosen = Vec::new();
            for h in 0..HEADS as usize {
                if step > 0 && step % 250 == 0 {
                    queries[h] = unit(&mut rng);
                }
                let noise = unit(&mut rng);
                let q: Vec<f32> = queries[h].iter().zip(&noise).map(|(a, b)| a + drift() * b).collect();
                let n = q.iter().map(|x| x * x).sum::<f32>().sqrt();
                queries[h] = q.into_iter().map(|x| x / n).collect();
                let mut scored: Vec<(f32, u32)> = centroids[h]
                    .iter()
                    .zip(&bias[h])
                    .enumerate()
                    .map(|(c, (centroid, b))| {
                        (centroid.iter().zip(&queries[h]).map(|(x, y)| x * y).sum::<f32>() + b, c as u32)
                    })
                    .collect();
                scored.sort_by(|a, b| b.0.total_cmp(&a.0));
                chosen.extend(scored[..TOP_CLUSTERS].iter().map(|&(_, cluster)| ClusterKey {
                    context: 1,
                    layer: 0,
                    head: h as u32,
                    cluster,
                }));
            }
            chosen
        })
        .collect()
}

fn trace_manager(kind: ReplacerKind) -> BufferManager {
    let total = (HEADS * CLUSTERS) as usize * BLOCKS_PER_CLUSTER;
    let mut config = BufferConfig::new(total, total / 20); // Gpu tier: 5% of the blocks
    config.replacer = kind;
    config.check_replacer = false;
    let buffers = BufferManager::new(config).unwrap();
    for head in 0..HEADS {
        for cluster in 0..CLUSTERS {
            let key = ClusterKey { context: 1, layer: 0, head, cluster };
            buffers.store_cluster(key, &vec![cluster as u8; BLOCKS_PER_CLUSTER * 2048]).unwrap();
        }
    }
    buffers
}

fn hit_ratio() {
    let trace = decode_trace(42);
    let total = (HEADS * CLUSTERS) as usize * BLOCKS_PER_CLUSTER;
    println!(
        "== Gpu-tier hit ratio: {} blocks of 2 KiB, cache {} blocks (5%), {STEPS} decode steps × {} clusters ({} block reads/step); maintainer applied between steps",
        total,
        total / 20,
        HEADS as usize * TOP_CLUSTERS,
        HEADS as usize * TOP_CLUSTERS * BLOCKS_PER_CLUSTER
    );
    let mut ratios = Vec::new();
    for kind in ReplacerKind::ALL {
        let buffers = trace_manager(kind);
        let (mut hits, mut reads) = (0u64, 0u64);
        for step in &trace {
            let reader = buffers.reader();
            for key in step {
                for location in reader.cluster(key).unwrap() {
                    let pin = reader.pin(&location).unwrap();
                    hits += u64::from(pin.tier() == Tier::Gpu);
                    reads += 1;
                }
            }
            drop(reader);
            buffers.maintain(usize::MAX);
        }
        let ratio = hits as f64 / reads as f64;
        assert_eq!(buffers.stats().dropped_access_records, 0);
        ratios.push((kind.name(), ratio));
    }
    let optimum = belady(&trace, total / 20);
    let lru = ratios[0].1;
    for (name, ratio) in &ratios {
        println!(
            "hit ratio {name:<6}: {:5.1}%  ({:.3}x LRU, {:.2} of the offline optimum)",
            ratio * 100.0,
            ratio / lru,
            ratio / optimum
        );
    }
    println!("hit ratio offline optimum (Belady, admits on demand): {:5.1}%", optimum * 100.0);
}

/// Belady's MIN over the block-level trace: the best any policy could do with the same cache.
fn belady(trace: &[Vec<ClusterKey>], capacity: usize) -> f64 {
    let accesses: Vec<(u32, u32, usize)> = trace
        .iter()
        .flat_map(|step| step.iter().flat_map(|k| (0..BLOCKS_PER_CLUSTER).map(move |b| (k.head, k.cluster, b))))
        .collect();
    let mut next_use = vec![usize::MAX; accesses.len()];
    let mut last: HashMap<(u32, u32, usize), usize> = HashMap::new();
    for (i, a) in accesses.iter().enumerate().rev() {
        next_use[i] = last.get(a).copied().unwrap_or(usize::MAX);
        last.insert(*a, i);
    }
    let mut cached: HashMap<(u32, u32, usize), usize> = HashMap::new();
    let mut by_next: BTreeSet<(usize, (u32, u32, usize))> = BTreeSet::new();
    let mut hits = 0usize;
    for (i, a) in accesses.iter().enumerate() {
        if let Some(old) = cached.remove(a) {
            by_next.remove(&(old, *a));
            hits += 1;
        } else if cached.len() == capacity {
            let (_, victim) = by_next.pop_last().unwrap();
            cached.remove(&victim);
        }
        cached.insert(*a, next_use[i]);
        by_next.insert((next_use[i], *a));
    }
    hits as f64 / accesses.len() as f64
}

// ---------------------------------------------------------------- Disk tier reads

const DISK_BLOCKS: usize = 65_536; // 128 MiB of 2 KiB blocks
/// Timed reads per row of the Disk section, each followed by its baseline.
const DISK_REPS: usize = 3;

/// The `p` quantile of `v` (nearest rank below): `0.5` is the median of an odd count.
fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p) as usize]
}

fn disk() {
    let base = std::env::var_os("ATTNSTORE_BENCH_DIR").map_or_else(std::env::temp_dir, Into::into);
    let dir = base.join(format!("attnstore-bench-disk-{}", std::process::id()));
    let mut config = DiskConfig::new(&dir);
    config.capacity_blocks = DISK_BLOCKS;
    config.segment_blocks = DISK_BLOCKS;
    // Batches of up to 4096 blocks (8 MiB of staging): the plan-sized calls of 512 blocks are
    // one batch each, and a whole-file call drains the ring only every 4096 blocks.
    config.batch_blocks = 4096;
    config.queue_depth = 64;
    let disk = DiskTier::open(config, 2048).unwrap();
    let slots: Vec<u32> = (0..DISK_BLOCKS).map(|_| disk.alloc_slot().unwrap()).collect();
    let payload: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 2048]).collect();
    for chunk in slots.chunks(64) {
        let items: Vec<_> =
            chunk.iter().map(|&s| (s, BlockId::from_raw(u64::from(s) + 1), &payload[s as usize % 64][..])).collect();
        assert!(disk.write_blocks(&items).iter().all(Result::is_ok));
    }
    let (path, _) = disk.slot_location(0);
    println!(
        "== Disk tier: {} blocks of 2 KiB in {} ({} MiB), backend {}, O_DIRECT {}, crc32c checked on every read; QD64 = calls of 512 blocks (a plan's batch) with 64 in flight, or one call for the whole file as fio reads it; medians of {DISK_REPS} reads, each right before its baseline",
        DISK_BLOCKS,
        path.display(),
        (DISK_BLOCKS * 2048) >> 20,
        disk.backend_name(),
        disk.is_direct()
    );
    let mut rng = SplitMix64::new(3);
    let mut shuffled = slots.clone();
    for i in (1..shuffled.len()).rev() {
        shuffled.swap(i, rng.below(i + 1));
    }
    let read = |order: &[u32], batch: usize| {
        let t = Instant::now();
        let mut sum = 0u64;
        for chunk in order.chunks(batch) {
            let items: Vec<_> = chunk.iter().map(|&s| (s, BlockId::from_raw(u64::from(s) + 1))).collect();
            let results = disk.read_blocks(&items, |_, bytes| sum += u64::from(bytes[0]));
            assert!(results.iter().all(Result::is_ok));
        }
        black_box(sum);
        (order.len() * 2048) as f64 / t.elapsed().as_secs_f64() / 1e6
    };
    let quarter = DISK_BLOCKS / 4; // QD1 runs read a quarter of the file to bound their time
    let fio = |rw: &str, depth: u32| fio_read(&path, rw, depth);
    let line = |name: &str, ours: f64, base: Option<f64>, base_name: &str| match base {
        Some(b) => println!("{name:<30} {ours:8.1} MB/s | {base_name:<28} {b:8.1} MB/s | ratio {:.2}", ours / b),
        None => println!("{name:<30} {ours:8.1} MB/s | {base_name:<28} (not available)"),
    };
    type Reading<'a> = Box<dyn Fn() -> Option<f64> + 'a>;
    let cases: [(&str, Reading, &str, Reading); 7] = [
        (
            "ours sequential, QD1",
            Box::new(|| Some(read(&slots[..quarter], 1))),
            "dd iflag=direct bs=2k",
            Box::new(|| dd_direct(&path)),
        ),
        (
            "ours sequential, QD1",
            Box::new(|| Some(read(&slots[..quarter], 1))),
            "fio read, io_uring QD1",
            Box::new(|| fio("read", 1)),
        ),
        (
            "ours random, QD1",
            Box::new(|| Some(read(&shuffled[..quarter], 1))),
            "fio randread, io_uring QD1",
            Box::new(|| fio("randread", 1)),
        ),
        (
            "ours sequential, QD64",
            Box::new(|| Some(read(&slots, 512))),
            "fio read, io_uring QD64",
            Box::new(|| fio("read", 64)),
        ),
        (
            "ours random, QD64",
            Box::new(|| Some(read(&shuffled, 512))),
            "fio randread, io_uring QD64",
            Box::new(|| fio("randread", 64)),
        ),
        (
            "ours sequential, QD64, 1 call",
            Box::new(|| Some(read(&slots, DISK_BLOCKS))),
            "fio read, io_uring QD64",
            Box::new(|| fio("read", 64)),
        ),
        (
            "ours random, QD64, 1 call",
            Box::new(|| Some(read(&shuffled, DISK_BLOCKS))),
            "fio randread, io_uring QD64",
            Box::new(|| fio("randread", 64)),
        ),
    ];
    // Each of our reads runs right before its baseline, DISK_REPS times, so the noise of a
    // shared disk lands on both alike; medians are printed.
    for (name, ours, base_name, base) in &cases {
        let (mut o, mut b) = (Vec::new(), Vec::new());
        for _ in 0..DISK_REPS {
            o.extend(ours());
            b.extend(base());
        }
        let base = (b.len() == DISK_REPS).then(|| percentile(b, 0.5));
        line(name, percentile(o, 0.5), base, base_name);
    }
    drop(cases); // they borrow the Disk tier
    drop(disk);
    let _ = std::fs::remove_dir_all(&dir);
}

fn dd_direct(path: &std::path::Path) -> Option<f64> {
    let t = Instant::now();
    let out = std::process::Command::new("dd")
        .arg(format!("if={}", path.display()))
        .args(["of=/dev/null", "bs=2048", "iflag=direct"])
        .arg(format!("count={}", DISK_BLOCKS / 4))
        .output()
        .ok()?;
    out.status.success().then(|| (DISK_BLOCKS / 4 * 2048) as f64 / t.elapsed().as_secs_f64() / 1e6)
}

fn fio_read(path: &std::path::Path, rw: &str, depth: u32) -> Option<f64> {
    let size = if depth == 1 { DISK_BLOCKS / 4 * 2048 } else { DISK_BLOCKS * 2048 };
    let out = std::process::Command::new("fio")
        .args(["--name=bench", "--bs=2k", "--direct=1", "--ioengine=io_uring", "--readonly", "--output-format=json"])
        .arg(format!("--filename={}", path.display()))
        .arg(format!("--rw={rw}"))
        .arg(format!("--iodepth={depth}"))
        // The same queue discipline as ours: submit and reap in groups of a quarter of the depth.
        .arg(format!("--iodepth_batch_submit={}", (depth / 4).max(1)))
        .arg(format!("--iodepth_batch_complete_min={}", (depth / 4).max(1)))
        .arg(format!("--size={}", DISK_BLOCKS * 2048))
        .arg(format!("--io_size={size}"))
        .output()
        .ok()?;
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    json["jobs"][0]["read"]["bw_bytes"].as_f64().map(|b| b / 1e6)
}

// ---------------------------------------------------------------- plan latency

fn plan_latency() {
    let trace = decode_trace(43);
    let buffers = Arc::new(trace_manager(ReplacerKind::Clock));
    // Warm the cache with the first steps, maintained synchronously.
    let run_plan = |step: &[ClusterKey]| {
        let t = Instant::now();
        let reader = buffers.reader();
        let mut pins = Vec::with_capacity(step.len() * BLOCKS_PER_CLUSTER);
        for key in step {
            for location in reader.cluster(key).unwrap() {
                pins.push(reader.pin(&location).unwrap());
            }
        }
        let sum: u64 = pins.iter().map(|p| u64::from(p[0]) + u64::from(p[2047])).sum();
        black_box(sum);
        drop(pins);
        t.elapsed().as_nanos() as f64 / 1e3
    };
    for step in &trace[..100] {
        run_plan(step);
        buffers.maintain(usize::MAX);
    }
    println!(
        "== plan latency: one decode step = {} cluster lookups + {} pinned block reads (CLOCK, 5% Gpu cache)",
        HEADS as usize * TOP_CLUSTERS,
        HEADS as usize * TOP_CLUSTERS * BLOCKS_PER_CLUSTER
    );
    // Every condition runs in blocks of one pass over the trace, the conditions taking turns
    // block by block, so that the machine's noise (a shared VM's bursts) hits all of them
    // alike: the ratios compare samples taken side by side, not minutes apart.
    //   quiet      : every maintainer paused; records pile up and are dropped, the cache is frozen;
    //   maintained : a maintainer admits the plans' own misses and evicts while they run;
    //   paced      : as maintained, with a 100 µs pause after every round of work;
    //   churned    : as maintained, plus a second plan stream reading random clusters (misses).
    // A block that follows a quiet one starts with the backlog the quiet block left: that is
    // counted, not skipped.
    const CYCLES: usize = 6;
    let gpu_evictions = || buffers.stats().tier(Tier::Gpu).unwrap().evictions;
    let gpu_counts = || {
        let s = buffers.stats();
        let g = s.tier(Tier::Gpu).unwrap();
        (g.hits, g.misses)
    };
    let maintainer = Maintainer::spawn(Arc::clone(&buffers), 256, Duration::from_micros(200)).unwrap();
    let paced_maintainer =
        Maintainer::spawn_paced(Arc::clone(&buffers), 256, Duration::from_micros(200), Duration::from_micros(100))
            .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let second_stream = Arc::new(AtomicBool::new(false));
    let churn = {
        let (buffers, stop, on) = (Arc::clone(&buffers), Arc::clone(&stop), Arc::clone(&second_stream));
        std::thread::spawn(move || {
            let mut rng = SplitMix64::new(9);
            while !stop.load(Ordering::Relaxed) {
                if on.load(Ordering::Relaxed) {
                    let reader = buffers.reader();
                    for _ in 0..20 {
                        let key = ClusterKey {
                            context: 1,
                            layer: 0,
                            head: rng.below(HEADS as usize) as u32,
                            cluster: rng.below(CLUSTERS as usize) as u32,
                        };
                        for location in reader.cluster(&key).unwrap() {
                            black_box(reader.pin(&location).unwrap().first().unwrap());
                        }
                    }
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    };
    const NAMES: [&str; 4] = ["quiet", "maintained", "paced", "churned"];
    let mut times: [Vec<f64>; 4] = Default::default();
    let mut evictions = [0u64; 4];
    let mut hits = [(0u64, 0u64); 4];
    // One untimed cycle first: every maintainer works off the warm-up's backlog once.
    for timed in std::iter::once(false).chain(std::iter::repeat_n(true, CYCLES)) {
        for (c, name) in NAMES.iter().enumerate() {
            maintainer.set_paused(!matches!(*name, "maintained" | "churned"));
            paced_maintainer.set_paused(*name != "paced");
            second_stream.store(*name == "churned", Ordering::Relaxed);
            let (e0, h0) = (gpu_evictions(), gpu_counts());
            let block: Vec<f64> = trace[100..].iter().map(|s| run_plan(s)).collect();
            if timed {
                times[c].extend(block);
                let h = gpu_counts();
                evictions[c] += gpu_evictions() - e0;
                hits[c] = (hits[c].0 + h.0 - h0.0, hits[c].1 + h.1 - h0.1);
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    churn.join().unwrap();
    assert!(!maintainer.stop() && !paced_maintainer.stop(), "a maintainer panicked");
    if std::env::var("PCTL").is_ok() {
        for (name, v) in NAMES.iter().zip(&times) {
            let p: Vec<String> = [0.5, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999]
                .iter()
                .map(|&q| format!("{q}:{:.1}", percentile(v.clone(), q)))
                .collect();
            println!("{name}: {}", p.join(" "));
        }
    }
    let (q50, q99) = (percentile(times[0].clone(), 0.5), percentile(times[0].clone(), 0.99));
    println!("{CYCLES} cycles × {} plans per condition, conditions interleaved block by block", trace.len() - 100);
    println!("plan latency, no maintainer (frozen cache)   : p50 {q50:7.1} us  p99 {q99:7.1} us");
    let labels =
        ["maintainer running             ", "maintainer paced (100 us/round)", "maintainer + 2nd reader stream "];
    for (c, label) in (1..4).zip(labels) {
        let (p50, p99) = (percentile(times[c].clone(), 0.5), percentile(times[c].clone(), 0.99));
        let (h, m) = hits[c];
        println!(
            "plan latency, {label}: p50 {p50:7.1} us  p99 {p99:7.1} us  ({} Gpu evictions, Gpu hits {:.1}%)  ratio p50 {:.2} p99 {:.2}",
            evictions[c],
            100.0 * h as f64 / (h + m).max(1) as f64,
            p50 / q50,
            p99 / q99
        );
    }
}
