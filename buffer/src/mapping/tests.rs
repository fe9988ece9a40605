//! Tests of the mapping table: lookups, in-place Gpu-slot stores and copy-on-write updates
//! across growth, and reader threads racing writers (no torn entry, no slot of another block).

use super::*;
use std::sync::Arc;

fn key(cluster: u32) -> ClusterKey {
    ClusterKey { context: 1, layer: 2, head: 3, cluster }
}

fn blocks(first: u64, n: usize) -> Vec<BlockLocation> {
    (0..n as u64).map(|i| BlockLocation::new(BlockId(first + i), Tier::Host, (first + i) as u32)).collect()
}

#[test]
fn inserted_clusters_are_found_updated_and_removed_across_growth() {
    let t = MappingTable::new();
    for c in 0..1000 {
        t.insert(key(c), blocks(u64::from(c) * 10 + 1, (c % 5) as usize + 1));
    }
    assert_eq!(t.len(), 1000);
    let r = t.reader();
    for c in 0..1000 {
        assert_eq!(r.get(&key(c)).unwrap().to_vec(), blocks(u64::from(c) * 10 + 1, (c % 5) as usize + 1));
    }
    assert!(r.get(&key(1000)).is_none());
    let keys: Vec<_> = (0..1001).rev().map(key).collect();
    let mut many = Vec::new();
    r.get_many(&keys, &mut many);
    assert_eq!(many.len(), 1001);
    assert!(many.iter().zip(&keys).all(|(got, k)| *got == r.get(k)), "get_many agrees with get");
    drop(r);
    assert!(t.update_block(&key(7), 1, BlockId(72), |l| l.with_gpu_slot(Some(9))));
    assert!(!t.update_block(&key(7), 1, BlockId(99), |l| l.with_gpu_slot(Some(9))), "wrong block id");
    let got = t.get(&key(7)).unwrap();
    assert_eq!((got[1].tier(), got[1].gpu_slot(), got[0].tier()), (Tier::Gpu, Some(9), Tier::Host));
    assert!(t.remove(&key(7)) && !t.remove(&key(7)));
    assert_eq!(t.len(), 999);
}

#[test]
fn a_gpu_slot_change_is_stored_in_place_and_seen_by_an_open_lookup() {
    let t = MappingTable::new();
    t.insert(key(1), blocks(10, 6)); // more than INLINE_BLOCKS: the heap list
    t.insert(key(2), blocks(20, 2));
    let r = t.reader();
    let (long, short) = (r.get(&key(1)).unwrap(), r.get(&key(2)).unwrap());
    assert!(t.update_block(&key(1), 5, BlockId(15), |l| l.with_gpu_slot(Some(3))));
    assert!(t.update_block(&key(2), 0, BlockId(20), |l| l.with_gpu_slot(Some(4))));
    // The lookups made before the updates read the new slots: the same entries, no copy.
    assert_eq!((long.get(5).unwrap().gpu_slot(), short.first().unwrap().gpu_slot()), (Some(3), Some(4)));
    assert!(t.update_block(&key(2), 0, BlockId(20), |l| l.with_gpu_slot(None)));
    assert_eq!(short.first().unwrap().tier(), Tier::Host, "an eviction too");
    // A home change is copy-on-write: the open lookup keeps the old home, a new one sees it.
    assert!(t.update_block(&key(2), 1, BlockId(21), |l| BlockLocation::new(l.block(), Tier::Disk, 7)));
    assert_eq!(short.get(1).unwrap().home(), (Tier::Host, 21));
    drop(r);
    let now = t.get(&key(2)).unwrap();
    assert_eq!((now[1].home(), now[0].gpu_slot(), now.len()), ((Tier::Disk, 7), None, 2));
    assert_eq!(t.get(&key(1)).unwrap()[5].gpu_slot(), Some(3), "other entries untouched");
}

/// Waits (yielding, at most 30 s) until reader threads have counted more than `since`
/// passes in `passes`, and returns the count.
fn passes_after(passes: &std::sync::atomic::AtomicU64, since: u64) -> u64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while passes.load(Ordering::Relaxed) <= since && std::time::Instant::now() < deadline {
        std::thread::yield_now();
    }
    passes.load(Ordering::Relaxed)
}

#[test]
fn readers_see_only_published_gpu_slots_while_writers_store_and_copy() {
    // Block b is only ever cached in slot 1000 + b: a reader must never see another slot,
    // and in-place stores must survive the copy-on-write of their bucket's neighbours.
    let t = Arc::new(MappingTable::new());
    for c in 0..64 {
        t.insert(key(c), blocks(u64::from(c) * 8, 5));
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let passes = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let reader = {
        let (t, stop, passes) = (Arc::clone(&t), Arc::clone(&stop), Arc::clone(&passes));
        std::thread::spawn(move || {
            let mut cached = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let r = t.reader();
                for c in 0..64 {
                    for l in r.get(&key(c)).into_iter().flatten() {
                        if let Some(s) = l.gpu_slot() {
                            assert_eq!(u64::from(s), 1000 + l.block().0, "slot of another block");
                            cached += 1;
                        }
                    }
                }
                passes.fetch_add(1, Ordering::Relaxed);
            }
            cached
        })
    };
    // The writes wait for the reader now and then, so its passes interleave with them
    // even when a loaded machine would schedule it only after they are done.
    let mut seen = passes_after(&passes, 0);
    for round in 0..20_000u32 {
        if round % 2_000 == 1_999 {
            seen = passes_after(&passes, seen);
        }
        let c = round % 64;
        let i = (round / 64 % 5) as usize;
        let b = BlockId(u64::from(c) * 8 + i as u64);
        let slot = (round % 3 != 0).then_some(1000 + b.0 as u32);
        assert!(t.update_block(&key(c), i, b, |l| l.with_gpu_slot(slot)));
        if round % 7 == 0 {
            // A copy-on-write neighbour: re-insert another cluster with the same blocks.
            let n = (c + 13) % 64;
            let current = t.get(&key(n)).unwrap();
            t.insert(key(n), current);
        }
    }
    passes_after(&passes, seen); // a pass after the last write sees its slots
    stop.store(true, Ordering::Relaxed);
    assert!(reader.join().unwrap() > 0);
    assert!(passes.load(Ordering::Relaxed) >= 11, "the reader ran between the writes");
    // Every block ends as its last update left it.
    for c in 0..64u32 {
        for (i, l) in t.get(&key(c)).unwrap().iter().enumerate() {
            let last = (0..20_000u32).rev().find(|r| r % 64 == c && (r / 64 % 5) as usize == i);
            let want = last.and_then(|r| (r % 3 != 0).then_some(1000 + l.block().0 as u32));
            assert_eq!(l.gpu_slot(), want, "cluster {c} block {i}");
        }
    }
}

#[test]
fn concurrent_readers_never_see_a_half_written_entry() {
    // Every entry the writer publishes has all blocks on the same home slot; a torn entry
    // would mix two slots.
    let t = Arc::new(MappingTable::new());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let passes = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (t, stop, passes) = (Arc::clone(&t), Arc::clone(&stop), Arc::clone(&passes));
            std::thread::spawn(move || {
                let mut seen = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let r = t.reader();
                    for c in 0..64 {
                        if let Some(b) = r.get(&key(c)) {
                            let first = b.first().expect("entries are never empty");
                            assert!(b.iter().all(|l| l.home() == first.home()), "torn entry {b:?}");
                            seen += 1;
                        }
                    }
                    passes.fetch_add(1, Ordering::Relaxed);
                }
                seen
            })
        })
        .collect();
    // As above: the writes wait for the readers now and then.
    let mut done = passes_after(&passes, 0);
    for round in 0..20_000u32 {
        if round % 2_000 == 1_999 {
            done = passes_after(&passes, done);
        }
        let c = round % 200;
        let v = vec![BlockLocation::new(BlockId(1), Tier::Host, round); 8];
        t.insert(key(c), v);
        if round % 3 == 0 {
            t.remove(&key((round * 7) % 200));
        }
    }
    passes_after(&passes, done);
    stop.store(true, Ordering::Relaxed);
    let seen: u64 = readers.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(seen > 0);
    assert!(passes.load(Ordering::Relaxed) >= 11, "the readers ran between the writes");
}
