//! The maintainer: misses are admitted asynchronously, hits feed the policy, pinned blocks
//! are never evicted however hard the queue pushes, and a full queue drops (and counts)
//! records instead of blocking the plan.

use attnstore_buffer::{
    BufferConfig, BufferManager, ClusterKey, FlaggedReads, LayerReads, Maintainer, ReplacerKind, Tier,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn key(cluster: u32) -> ClusterKey {
    ClusterKey { context: 3, layer: 1, head: 0, cluster }
}

/// A manager (64 Host slots, 16 Gpu) holding clusters `0..clusters` of `bytes` each, every
/// byte of cluster `c` equal to `c`.
fn stored(clusters: u32, bytes: usize) -> Arc<BufferManager> {
    let buffers = Arc::new(BufferManager::new(BufferConfig::new(64, 16)).unwrap());
    for c in 0..clusters {
        buffers.store_cluster(key(c), &vec![c as u8; bytes]).unwrap();
    }
    buffers
}

/// Polls `done` every millisecond; fails with `what` if it is not true within 10 s.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Which tier serves each block of clusters `0..clusters`, read now (plans that log).
fn tiers_now(buffers: &BufferManager, clusters: u32) -> Vec<Tier> {
    let reader = buffers.reader();
    (0..clusters)
        .flat_map(|c| reader.cluster(&key(c)).unwrap().to_vec())
        .map(|l| reader.pin(&l).unwrap().tier())
        .collect()
}

#[test]
fn pinned_blocks_are_never_evicted_by_any_policy() {
    for kind in ReplacerKind::ALL {
        let mut config = BufferConfig::new(64, 4);
        config.replacer = kind;
        let buffers = BufferManager::new(config).unwrap();
        for c in 0..32 {
            buffers.store_cluster(key(c), &[c as u8; 2048]).unwrap();
        }
        let reader = buffers.reader();
        let hot = reader.cluster(&key(0)).unwrap().first().unwrap();
        drop(reader);
        buffers.admit(hot.block()).unwrap();
        let reader = buffers.reader();
        let location = reader.cluster(&key(0)).unwrap().first().unwrap();
        let pin = reader.pin(&location).unwrap();
        assert_eq!(pin.tier(), Tier::Gpu, "{}", kind.name());
        // Every other cluster misses, many times over: the maintainer must evict 3 slots only.
        for round in 0..20 {
            for c in 1..32 {
                let location = reader.cluster(&key(c)).unwrap().first().unwrap();
                assert_eq!(reader.pin(&location).unwrap()[0], c as u8);
            }
            reader.flush(); // hand this round's records to the queue
            buffers.maintain(usize::MAX);
            assert_eq!(buffers.tier_of(hot.block()).unwrap(), Tier::Gpu, "{} round {round}", kind.name());
            assert!(pin.iter().all(|&b| b == 0), "pinned bytes unchanged");
        }
        // Synchronous rounds churn the 3 slots many times each round; batched rounds (a Gpu
        // tier in device memory) give their victims up at the end, so every other round evicts
        // 3 and the next admits into them.
        let stats = buffers.stats();
        assert!(stats.tier(Tier::Gpu).unwrap().evictions >= 20, "{}: {stats}", kind.name());
        drop(pin);
        drop(reader);
    }
}

#[test]
fn misses_are_admitted_in_the_background_and_hits_follow() {
    let buffers = stored(8, 4096);
    let maintainer = Maintainer::spawn(Arc::clone(&buffers), 64, Duration::from_micros(100)).unwrap();
    let read_all = || tiers_now(&buffers, 8);
    assert!(read_all().iter().all(|&t| t == Tier::Host), "first reads miss");
    wait_until("the maintainer never admitted the missed blocks", || read_all().iter().all(|&t| t == Tier::Gpu));
    assert!(maintainer.processed() >= 16);
    assert!(!maintainer.stop());
    let stats = buffers.stats();
    let gpu = stats.tier(Tier::Gpu).unwrap();
    assert_eq!((gpu.used_blocks, gpu.moves_in, gpu.bytes_in), (16, 16, 16 * 2048));
    assert!(gpu.hit_ratio().unwrap() > 0.0);
    let shown = stats.to_string();
    assert!(shown.contains("gpu") && shown.contains("hit%") && shown.contains("dropped"), "{shown}");
}

#[test]
fn a_paused_maintainer_admits_nothing_until_resumed() {
    let buffers = stored(8, 2048);
    let maintainer = Maintainer::spawn(Arc::clone(&buffers), 64, Duration::from_micros(100)).unwrap();
    maintainer.set_paused(true);
    assert!(maintainer.is_paused());
    // A round that started before the pause may still finish: let it.
    std::thread::sleep(Duration::from_millis(5));
    let processed = maintainer.processed();
    // One block per cluster.
    let tiers = || tiers_now(&buffers, 8);
    for _ in 0..20 {
        assert!(tiers().iter().all(|&t| t == Tier::Host), "nothing is admitted while paused");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(maintainer.processed(), processed, "no records processed while paused");
    maintainer.set_paused(false);
    wait_until("the resumed maintainer never admitted the misses", || tiers().iter().all(|&t| t == Tier::Gpu));
    assert!(!maintainer.stop());
}

#[test]
fn a_full_access_queue_drops_and_counts_records_without_blocking() {
    let mut config = BufferConfig::new(64, 4);
    config.access_queue_batches = 2;
    let buffers = BufferManager::new(config).unwrap();
    buffers.store_cluster(key(0), &[1; 2048 * 20]).unwrap();
    let started = Instant::now();
    for _ in 0..10 {
        // One plan: 20 pins, logged as one batch when the reader drops.
        let reader = buffers.reader();
        for location in reader.cluster(&key(0)).unwrap() {
            reader.pin(&location).unwrap();
        }
    }
    assert!(started.elapsed() < Duration::from_secs(1), "pins never wait for the maintainer");
    let stats = buffers.stats();
    assert_eq!((stats.queued_access_records, stats.dropped_access_records), (40, 160));
    assert_eq!(stats.tier(Tier::Host).unwrap().hits, 200, "every pin is counted, queued or not");
    assert_eq!(buffers.maintain(usize::MAX), 40);
    assert_eq!(buffers.stats().queued_access_records, 0);
}

#[test]
fn a_scan_reader_counts_its_reads_but_admits_and_evicts_nothing() {
    let buffers = BufferManager::new(BufferConfig::new(64, 4)).unwrap();
    for c in 0..16 {
        buffers.store_cluster(key(c), &[c as u8; 2048]).unwrap();
    }
    // A sparse plan's reads admit its blocks.
    let reader = buffers.reader();
    for c in 0..4 {
        let location = reader.cluster(&key(c)).unwrap().first().unwrap();
        assert_eq!(reader.pin(&location).unwrap()[0], c as u8);
    }
    drop(reader);
    assert_eq!(buffers.maintain(usize::MAX), 4);
    let cached: Vec<_> = (0..4).map(|c| buffers.reader().cluster(&key(c)).unwrap().first().unwrap().block()).collect();
    assert!(cached.iter().all(|&b| buffers.tier_of(b).unwrap() == Tier::Gpu));
    // A scan over every block reads the right bytes, logs nothing, and leaves the cache alone.
    let hits_before = buffers.stats().tier(Tier::Host).unwrap().hits;
    let scan = buffers.scan_reader();
    for c in 0..16 {
        let location = scan.cluster(&key(c)).unwrap().first().unwrap();
        assert_eq!(scan.pin(&location).unwrap()[0], c as u8);
    }
    drop(scan);
    assert_eq!(buffers.maintain(usize::MAX), 0, "a scan logs no access records");
    assert!(cached.iter().all(|&b| buffers.tier_of(b).unwrap() == Tier::Gpu));
    let stats = buffers.stats();
    assert_eq!(stats.tier(Tier::Host).unwrap().hits, hits_before + 12, "{stats}");
    assert_eq!(stats.tier(Tier::Gpu).unwrap().hits, 4, "{stats}");
}

#[test]
fn a_device_steps_cluster_reads_wake_a_waiting_maintainer() {
    let buffers = stored(4, 4096);
    // An idle wait longer than the deadlines below: only the wake-ups can meet them.
    let maintainer = Maintainer::spawn(Arc::clone(&buffers), 64, Duration::from_secs(30)).unwrap();
    // Let the thread reach its first wait (an empty queue).
    std::thread::sleep(Duration::from_millis(50));
    buffers.log_cluster_reads((0..4).map(key).collect());
    wait_until("the maintainer slept through the cluster reads", || maintainer.processed() >= 4);
    assert_eq!(tiers_now(&buffers, 4), vec![Tier::Gpu; 8], "every block of the read clusters admitted");
    // Stopping ends the wait too.
    let stopping = Instant::now();
    assert!(!maintainer.stop());
    assert!(stopping.elapsed() < Duration::from_secs(10), "stop waited out the idle period");
}

#[test]
fn a_layers_reads_per_head_act_like_their_cluster_keys() {
    let heads_key = |head: u32, cluster: u32| ClusterKey { context: 3, layer: 1, head, cluster };
    let make = || {
        let buffers = BufferManager::new(BufferConfig::new(64, 8)).unwrap();
        for head in 0..2 {
            for c in 0..4 {
                buffers.store_cluster(heads_key(head, c), &[(head * 4 + c) as u8; 4096]).unwrap();
            }
        }
        buffers
    };
    let (by_keys, by_layer) = (make(), make());
    // Head 0 reads clusters 2 and 0, head 1 reads cluster 3 and an unmapped id (padding).
    by_keys.log_cluster_reads(vec![heads_key(0, 2), heads_key(0, 0), heads_key(1, 3), heads_key(1, 9)]);
    by_layer.log_layer_reads(vec![LayerReads { context: 3, layer: 1, per_head: vec![vec![2, 0], vec![3, 9]] }]);
    assert_eq!(by_keys.maintain(usize::MAX), 4);
    assert_eq!(by_layer.maintain(usize::MAX), 4);
    let tiers = |b: &BufferManager| {
        let reader = b.reader();
        (0..2)
            .flat_map(|h| (0..4).map(move |c| heads_key(h, c)))
            .map(|k| reader.cluster(&k).unwrap().iter().map(|l| l.tier()).collect::<Vec<_>>())
            .collect::<Vec<_>>()
    };
    assert_eq!(tiers(&by_layer), tiers(&by_keys));
    let gpu = |b: &BufferManager| {
        let stats = b.stats();
        let t = stats.tier(Tier::Gpu).unwrap().clone();
        (t.hits, t.misses, t.used_blocks)
    };
    assert_eq!(gpu(&by_layer), gpu(&by_keys));
    assert_eq!(gpu(&by_layer), (0, 6, 6), "three clusters of two blocks admitted");
    // Read again: all hits now, the same way.
    by_layer.log_layer_reads(vec![LayerReads { context: 3, layer: 1, per_head: vec![vec![2, 0], vec![3]] }]);
    assert_eq!(by_layer.maintain(usize::MAX), 3);
    assert_eq!(gpu(&by_layer), (6, 6, 6));
}

#[test]
fn a_round_applies_only_the_newest_queued_reads_of_each_layer() {
    let key = |layer: u32, cluster: u32| ClusterKey { context: 5, layer, head: 0, cluster };
    let buffers = BufferManager::new(BufferConfig::new(64, 16)).unwrap();
    for layer in 0..2 {
        for c in 0..6 {
            buffers.store_cluster(key(layer, c), &[(layer * 8 + c) as u8; 2048]).unwrap();
        }
    }
    let reads = |layer: u32, ids: Vec<u32>| LayerReads { context: 5, layer, per_head: vec![ids] };
    // Three steps of layer 0 queued (the maintainer fell behind), one of layer 1 between them,
    // and logged keys, which are applied as they are.
    buffers.log_layer_reads(vec![reads(0, vec![0, 1])]);
    buffers.log_layer_reads(vec![reads(1, vec![4])]);
    buffers.log_layer_reads(vec![reads(0, vec![1, 2])]);
    buffers.log_cluster_reads(vec![key(1, 5)]);
    buffers.log_layer_reads(vec![reads(0, vec![2, 3])]);
    assert_eq!(buffers.stats().queued_access_records, 8);
    // Layer 0's newest step (2, 3), layer 1's only one (4) and the key (1, 5): four clusters.
    assert_eq!(buffers.maintain(usize::MAX), 4);
    let stats = buffers.stats();
    assert_eq!((stats.queued_access_records, stats.superseded_cluster_reads), (0, 4));
    let tier = |layer: u32, c: u32| buffers.reader().cluster(&key(layer, c)).unwrap().iter().next().unwrap().tier();
    let admitted: Vec<(u32, u32)> =
        (0..2).flat_map(|l| (0..6).map(move |c| (l, c))).filter(|&(l, c)| tier(l, c) == Tier::Gpu).collect();
    assert_eq!(admitted, vec![(0, 2), (0, 3), (1, 4), (1, 5)], "superseded steps admit nothing");
    // Keys beyond a round's budget stay queued, in order, for the next rounds.
    buffers.log_cluster_reads(vec![key(0, 0)]);
    buffers.log_cluster_reads(vec![key(0, 1)]);
    buffers.log_layer_reads(vec![reads(1, vec![0])]);
    assert_eq!(buffers.maintain(1), 2, "one key and the layer's newest step");
    assert_eq!(tier(0, 0), Tier::Gpu);
    assert_eq!(tier(0, 1), Tier::Host);
    assert_eq!(buffers.maintain(1), 1);
    assert_eq!(tier(0, 1), Tier::Gpu);
}

/// Flagged words of one head: `c` for a hit, `!c` for a miss.
fn flag(hits: &[u32], misses: &[u32]) -> Vec<i32> {
    hits.iter().map(|&c| c as i32).chain(misses.iter().map(|&c| !(c as i32))).collect()
}

#[test]
fn flagged_reads_resolve_to_every_real_miss_and_a_rotating_share_of_the_real_hits() {
    // Head 0: 20 real clusters, hits 0..13 and misses 13, 14, 15 (one word per cluster,
    // 16 a head). Head 1: 10 real clusters, hits 1, 2, 12 (padding), misses 9, 15 (padding).
    let mut flagged = flag(&(0..13).collect::<Vec<_>>(), &[13, 14, 15]);
    let head1 = flag(&[1, 2, 12], &[9, 15]);
    flagged.extend(head1.iter().chain(std::iter::repeat(&12)).take(16));
    let mut touched = [std::collections::BTreeSet::new(), std::collections::BTreeSet::new()];
    for turn in 0..8 {
        let reads = FlaggedReads {
            context: 1,
            layer: 2,
            flagged: flagged.clone(),
            per_head: 16,
            real: vec![20, 10],
            hit_every: 8,
            hit_turn: turn,
        }
        .resolve();
        assert_eq!((reads.context, reads.layer, reads.per_head.len()), (1, 2, 2));
        let mut want: Vec<u32> = (0..16).filter(|&c| c >= 13 || c % 8 == turn).collect();
        let mut got = reads.per_head[0].clone();
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want, "turn {turn}: every miss, the hits of this turn");
        assert!(reads.per_head[1].contains(&9), "turn {turn}: the real miss of head 1");
        assert!(reads.per_head[1].iter().all(|&c| c < 10), "turn {turn}: padding applied: {:?}", reads.per_head[1]);
        for (h, ids) in reads.per_head.iter().enumerate() {
            touched[h].extend(ids.iter().copied());
        }
    }
    // Over `hit_every` turns every real cluster was applied at least once.
    assert_eq!(touched[0], (0..16).collect());
    assert_eq!(touched[1], [1, 2, 9].into_iter().collect());
    // hit_every 0 or 1: every real hit, every real miss.
    for every in [0, 1] {
        let reads = FlaggedReads {
            context: 1,
            layer: 2,
            flagged: head1.clone(),
            per_head: 5,
            real: vec![10],
            hit_every: every,
            hit_turn: 3,
        }
        .resolve();
        assert_eq!(reads.per_head, vec![vec![1, 2, 9]]);
    }
}

#[test]
fn flagged_reads_act_like_the_ids_they_resolve_to_and_supersede_older_steps_of_their_layer() {
    let key = |cluster: u32| ClusterKey { context: 5, layer: 0, head: 0, cluster };
    let make = || {
        let buffers = BufferManager::new(BufferConfig::new(64, 16)).unwrap();
        for c in 0..8 {
            buffers.store_cluster(key(c), &[c as u8; 4096]).unwrap();
        }
        buffers
    };
    let flagged = |words: Vec<i32>| FlaggedReads {
        context: 5,
        layer: 0,
        per_head: words.len(),
        flagged: words,
        real: vec![8],
        hit_every: 2,
        hit_turn: 0,
    };
    let (by_ids, by_flags) = (make(), make());
    // Misses 1 and 3, hits 2 and 5: the round applies 1, 3 and the even hit 2.
    by_ids.log_layer_reads(vec![LayerReads { context: 5, layer: 0, per_head: vec![vec![1, 3, 2]] }]);
    by_flags.log_flagged_reads(vec![flagged(vec![!1, !3, 2, 5])]);
    assert_eq!(by_flags.stats().queued_access_records, 4, "every flagged cluster is a record");
    by_ids.maintain(usize::MAX);
    by_flags.maintain(usize::MAX);
    let tiers = |b: &BufferManager| {
        (0..8).map(|c| b.reader().cluster(&key(c)).unwrap().iter().next().unwrap().tier()).collect::<Vec<_>>()
    };
    assert_eq!(tiers(&by_flags), tiers(&by_ids));
    assert_eq!(tiers(&by_flags).iter().filter(|&&t| t == Tier::Gpu).count(), 3);
    // A newer step of the layer, flagged or not, supersedes an older one of either kind.
    by_flags.log_flagged_reads(vec![flagged(vec![!6])]);
    by_flags.log_layer_reads(vec![LayerReads { context: 5, layer: 0, per_head: vec![vec![7]] }]);
    by_flags.maintain(usize::MAX);
    by_flags.log_layer_reads(vec![LayerReads { context: 5, layer: 0, per_head: vec![vec![0]] }]);
    by_flags.log_flagged_reads(vec![flagged(vec![4, 5])]);
    by_flags.maintain(usize::MAX);
    let gpu: Vec<u32> = (0..8).filter(|&c| tiers(&by_flags)[c as usize] == Tier::Gpu).collect();
    assert_eq!(gpu, vec![1, 2, 3, 4, 7], "the superseded steps (6, 0) and the odd hit 5 admitted nothing");
    assert_eq!(by_flags.stats().superseded_cluster_reads, 2);
}

#[test]
fn a_maintainer_that_stops_leaves_a_newer_ones_wake_ups_in_place() {
    let buffers = stored(2, 2048);
    let older = Maintainer::spawn(Arc::clone(&buffers), 64, Duration::from_secs(30)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let newer = Maintainer::spawn(Arc::clone(&buffers), 64, Duration::from_secs(30)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(!older.stop());
    buffers.log_cluster_reads(vec![key(0), key(1)]);
    wait_until("the newer maintainer was not woken", || newer.processed() >= 2);
    assert_eq!(tiers_now(&buffers, 2), vec![Tier::Gpu; 2]);
    assert!(!newer.stop());
}
