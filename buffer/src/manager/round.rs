//! A batched maintenance round, for a Gpu tier in device memory: admissions copy their blocks
//! into Gpu slots' host side during the round; at its end one batch of asynchronous device
//! writes (slot bytes, then slot-table entries) on the Gpu pool's stream, one wait, and only then
//! are the admissions published and the victims' slots given up. Synchronous device writes per
//! admission cost three round trips each, which a decode step's misses cannot afford.
//! `docs/buffer-manager.md` ("Device-planned reads") gives the ordering rules this keeps.

use super::{BufferManager, Home, State};
use crate::arena::{SlotWrite, NO_OWNER};
use crate::{BlockId, Error, Tier};
use std::time::Instant;

/// A maintenance round's admissions into a Gpu tier in device memory: copied to the slots'
/// host side during the round, written to the device in one batch at its end, and published
/// only after that (see [`BufferManager::maintain`]).
#[derive(Default)]
pub(super) struct Round<'p> {
    /// Admitted blocks, their Gpu slots still latched and unpublished.
    admitted: Vec<Admitted<'p>>,
    /// Blocks this round admitted or put off: each is handled once per round.
    handled: crate::block::IdSet,
    /// Admissions that found no free Gpu slot: they wait for a later round.
    waiting: usize,
    /// Set once the replacer had no victim to give: the round holds the state lock, so none
    /// appears before it ends, and asking again for each later miss would sweep the replacer
    /// every time (a CLOCK sweep of the whole tier per miss made a 300K-miss round take 100 s).
    out_of_victims: bool,
    /// Gpu slots of this round's victims, given up once their cleared entries are on the device.
    victims: Vec<u32>,
    /// Host slots whose slot-table entries the round changed in the host mirror.
    table_writes: Vec<u32>,
    /// Time per step of the admissions, kept only when rounds are traced.
    times: Option<[(std::time::Duration, usize); 3]>,
    /// Misses not admitted because the round had made its most admissions.
    capped: usize,
}

struct Admitted<'p> {
    block: BlockId,
    home: Home,
    /// The Gpu slot, latched (its owner still empty) until published.
    write: SlotWrite<'p>,
    started: Instant,
}

impl Round<'_> {
    /// An empty round; `traced` keeps the time of each step of its admissions.
    pub(super) fn new(traced: bool) -> Self {
        Self { times: traced.then(Default::default), ..Self::default() }
    }

    /// Admissions made so far (published at the round's end).
    pub(super) fn admitted(&self) -> usize {
        self.admitted.len()
    }

    /// Time and count of each step of the admissions (victims, latches, fills), if traced.
    pub(super) fn times(&self) -> Option<[(std::time::Duration, usize); 3]> {
        self.times
    }

    /// Misses the round left for later rounds (it had made its most admissions).
    pub(super) fn capped(&self) -> usize {
        self.capped
    }

    /// Now, when rounds are traced (a clock read per admission step costs an untraced round
    /// for nothing).
    fn now(&self) -> Option<Instant> {
        self.times.is_some().then(Instant::now)
    }

    fn time(&mut self, step: usize, since: Option<Instant>) {
        if let (Some(times), Some(since)) = (&mut self.times, since) {
            times[step].0 += since.elapsed();
            times[step].1 += 1;
        }
    }
}

impl BufferManager {
    /// An admission inside a batched round: the block's bytes go to a free Gpu slot's host
    /// side now and are published by [`Self::finish_round`]. With no free slot the admission
    /// waits for a later round, and a victim is evicted for it (given up at the round's end,
    /// so reused by a later round) only while the slots on their way back — quarantined, or
    /// this round's victims — are fewer than the admissions waiting: a round never evicts
    /// more than it can use, whatever the device reads in flight hold.
    pub(super) fn admit_batched<'s>(&'s self, state: &mut State, block: BlockId, round: &mut Round<'s>) {
        // Freed since the access: nothing to admit.
        let Some(meta) = state.blocks.get(&block) else { return };
        if let Some(slot) = meta.gpu_slot {
            state.replacer.access(slot);
            return;
        }
        let home = meta.home;
        // A bounded round: the state lock is held until its device writes are done.
        if round.admitted.len() + round.waiting >= self.round_admissions {
            round.capped += 1;
            return;
        }
        if matches!(home, Home::Lost(_)) || !round.handled.insert(block) {
            return;
        }
        let started = Instant::now();
        let Some(slot) = self.gpu.alloc_slot() else {
            round.waiting += 1;
            if !round.out_of_victims && self.epochs.quarantined() + round.victims.len() < round.waiting {
                let t = round.now();
                let taken = self.take_victim(state, Some(&mut round.table_writes));
                round.time(0, t);
                match taken {
                    Ok(w) => round.victims.push(w.slot()),
                    Err(e) => {
                        round.out_of_victims = true;
                        // Every tracked slot pinned, and none held by this round's admissions.
                        // Otherwise the round's admissions and victims hold the rest: waiting.
                        if matches!(e, Error::TierFull { .. }) && round.admitted.is_empty() && round.victims.is_empty()
                        {
                            self.counters(Tier::Gpu).failed(Tier::Gpu, "full");
                        }
                    }
                }
            }
            return;
        };
        let t = round.now();
        let locked = self.lock_slot(&self.gpu, slot, BlockId(NO_OWNER), "admit");
        round.time(1, t);
        let mut w = match locked {
            Ok(w) => w,
            Err(_) => {
                self.gpu.release_slot(slot);
                return;
            }
        };
        let t = round.now();
        let filled = self.fill_from_home(state, block, home, &mut w);
        round.time(2, t);
        if filled.is_err() {
            drop(w);
            self.gpu.release_slot(slot);
            return;
        }
        round.admitted.push(Admitted { block, home, write: w, started });
    }

    /// Ends a batched round. One batch of device writes on the Gpu pool's stream — the admitted
    /// slots' bytes, then every slot-table entry the round changed (victims cleared, admissions
    /// set) — and one wait; stream order puts each entry after the bytes it names. Only then
    /// are the admissions published to CPU-planned readers (owner tags, replacer, mapping
    /// table), and the victims' slots given up: their cleared entries are on the device, so the
    /// quarantine's epochs mean what they did with synchronous writes. A failed batch fails
    /// every admission of the round and turns the device slot table off.
    pub(super) fn finish_round(&self, state: &mut State, round: Round<'_>) {
        let Round { admitted, victims, mut table_writes, .. } = round;
        if admitted.is_empty() && table_writes.is_empty() {
            // Nothing for the device (hits only, or Disk-homed victims, which no entry names).
            for slot in victims {
                self.retire_gpu_slot(slot);
            }
            return;
        }
        for a in &admitted {
            if let Home::Host(host_slot) = a.home {
                self.slot_table.stage(host_slot, Some(a.write.slot()));
                table_writes.push(host_slot);
            }
        }
        let latched: Vec<&SlotWrite<'_>> = admitted.iter().map(|a| &a.write).collect();
        let mut table_failed = false;
        let copied = self.gpu.mirror_batch(&latched, |batch| {
            table_failed = self.slot_table.write_staged(batch, &mut table_writes).is_err();
        });
        drop(latched);
        let gpu = self.counters(Tier::Gpu);
        if table_failed {
            gpu.failed(Tier::Gpu, "slot_table");
        }
        if let Err(why) = &copied {
            self.slot_table.mark_broken(why);
        }
        for Admitted { block, home, mut write, started } in admitted {
            let slot = write.slot();
            if copied.is_err() {
                if let Home::Host(host_slot) = home {
                    self.slot_table.stage(host_slot, None);
                }
                drop(write);
                self.retire_gpu_slot(slot);
                gpu.failed(Tier::Gpu, "copy");
                continue;
            }
            write.set_owner(block.0);
            drop(write);
            state.replacer.insert(slot);
            let meta = state.blocks.get_mut(&block).expect("a block admitted this round is live (state lock held)");
            meta.gpu_slot = Some(slot);
            self.remap(block, meta);
            gpu.moved(Tier::Gpu, self.layout.block_bytes(), started);
        }
        for slot in victims {
            self.retire_gpu_slot(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{BlockId, BlockLayout, BufferConfig, BufferManager, ClusterKey, DeviceRead, ReplacerKind, Tier};
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn key(cluster: u32) -> ClusterKey {
        ClusterKey { context: 9, layer: 0, head: 2, cluster }
    }

    /// A manager whose `maintain` runs batched rounds, as with a Gpu tier in device memory.
    fn batched(config: BufferConfig) -> BufferManager {
        let mut buffers = BufferManager::new(config).unwrap();
        buffers.force_batched_rounds();
        buffers
    }

    /// `blocks` blocks of cluster `c`, every byte telling the cluster and the block apart.
    fn content(c: u32, blocks: usize) -> Vec<u8> {
        (0..blocks * 2048).map(|i| (c as usize * 37 + i / 2048 * 11 + i) as u8).collect()
    }

    fn gpu_stat(buffers: &BufferManager) -> crate::TierStats {
        buffers.stats().tier(Tier::Gpu).cloned().unwrap()
    }

    /// Host time of a cold round like a 1M step's first (tens of thousands of admissions),
    /// per admission: `cargo test --release -p attnstore-buffer -- --ignored --nocapture
    /// cold_round`. A probe, not a check: it asserts only that every block was admitted.
    #[test]
    #[ignore = "timing probe"]
    fn cold_round_time_per_admission() {
        let clusters = 10_000u32;
        let buffers = batched(BufferConfig::new(60_000, 50_000));
        let bytes = vec![7u8; 4 * 2048];
        for c in 0..clusters {
            buffers.store_cluster(key(c), &bytes).unwrap();
        }
        let mut times = Vec::new();
        for rep in 0..3 {
            // Cold again: every block evicted before the round.
            for c in 0..clusters {
                for l in buffers.reader().cluster(&key(c)).unwrap().iter() {
                    let _ = buffers.evict(l.block());
                }
            }
            buffers.log_cluster_reads((0..clusters).map(key).collect());
            let t = std::time::Instant::now();
            let done = buffers.maintain(usize::MAX);
            times.push(t.elapsed().as_secs_f64() * 1e6 / f64::from(4 * clusters));
            assert_eq!(done, clusters as usize, "rep {rep}");
            assert_eq!(gpu_stat(&buffers).used_blocks, 4 * clusters as usize);
        }
        eprintln!("cold round: {times:.3?} us per admitted block");
    }

    #[test]
    fn a_round_with_many_misses_publishes_every_admitted_block_with_its_slot_table_entry() {
        let buffers = batched(BufferConfig::new(4096, 1024));
        for c in 0..300 {
            buffers.store_cluster(key(c), &content(c, 3)).unwrap();
        }
        // Half the misses as a device step's cluster reads, half as a CPU plan's pins.
        buffers.log_cluster_reads((0..150).map(key).collect());
        let reader = buffers.reader();
        for c in 150..300 {
            for location in reader.cluster(&key(c)).unwrap() {
                assert_eq!(reader.pin(&location).unwrap().tier(), Tier::Host);
            }
        }
        drop(reader);
        assert_eq!(buffers.maintain(usize::MAX), 150 + 450);
        buffers.check_slot_table().unwrap();
        let reader = buffers.reader();
        let mut gpu_slots = std::collections::HashSet::new();
        for c in 0..300 {
            let want = content(c, 3);
            for (i, location) in reader.cluster(&key(c)).unwrap().iter().enumerate() {
                let (home, host_slot) = location.home();
                assert_eq!((location.tier(), home), (Tier::Gpu, Tier::Host), "cluster {c} block {i}");
                let gpu_slot = location.gpu_slot().expect("published in the mapping table");
                assert!(gpu_slots.insert(gpu_slot), "Gpu slot {gpu_slot} published twice");
                assert_eq!(buffers.slot_table_entry(host_slot), Some(gpu_slot), "cluster {c} block {i}");
                assert_eq!(buffers.tier_of(location.block()).unwrap(), Tier::Gpu);
                let pin = reader.pin(&location).unwrap();
                assert_eq!((pin.tier(), pin.slot()), (Tier::Gpu, Some(gpu_slot)));
                assert_eq!(&pin[..], &want[i * 2048..(i + 1) * 2048], "cluster {c} block {i}");
            }
        }
        drop(reader);
        let gpu = gpu_stat(&buffers);
        assert_eq!((gpu.used_blocks, gpu.moves_in, gpu.evictions, gpu.failures), (900, 900, 0, 0));
    }

    #[test]
    fn a_round_admits_at_most_its_bound_and_later_rounds_admit_the_rest() {
        let mut buffers = batched(BufferConfig::new(64, 32));
        buffers.set_round_admissions(4);
        let blocks: Vec<BlockId> = (0..10).map(|c| buffers.store_cluster(key(c), &content(c, 1)).unwrap()[0]).collect();
        let cached =
            |buffers: &BufferManager| blocks.iter().filter(|&&b| buffers.tier_of(b).unwrap() == Tier::Gpu).count();
        for (round, want) in [4, 8, 10].into_iter().enumerate() {
            // A step that keeps reading the ten clusters logs them again.
            buffers.log_cluster_reads((0..10).map(key).collect());
            buffers.maintain(usize::MAX);
            buffers.check_slot_table().unwrap();
            assert_eq!(cached(&buffers), want, "round {round}");
        }
        // Hits past the bound still count as hits: nothing is admitted twice.
        buffers.log_cluster_reads((0..10).map(key).collect());
        buffers.maintain(usize::MAX);
        let gpu = gpu_stat(&buffers);
        assert_eq!((gpu.moves_in, gpu.used_blocks, gpu.failures), (10, 10, 0));
        for (c, &b) in blocks.iter().enumerate() {
            let reader = buffers.reader();
            let pin = reader.pin(&buffers.mapping().get(&key(c as u32)).unwrap()[0]).unwrap();
            assert_eq!(&pin[..], &content(c as u32, 1)[..], "block {b:?} of cluster {c}");
        }
    }

    #[test]
    fn a_full_tier_evicts_only_for_the_admissions_waiting_and_the_next_round_reuses_the_victims() {
        let buffers = batched(BufferConfig::new(64, 8)); // LRU
        let blocks: Vec<BlockId> = (0..20).map(|c| buffers.store_cluster(key(c), &content(c, 1)).unwrap()[0]).collect();
        let tier = |range: std::ops::Range<usize>| -> Vec<Tier> {
            blocks[range].iter().map(|&b| buffers.tier_of(b).unwrap()).collect()
        };
        let round = |clusters: std::ops::Range<u32>| {
            buffers.log_cluster_reads(clusters.map(key).collect());
            buffers.maintain(usize::MAX);
            buffers.check_slot_table().unwrap();
        };
        round(0..8);
        assert_eq!(tier(0..8), [Tier::Gpu; 8]);

        // Five misses, no free slot: five victims (LRU: clusters 0..5), given up at the end of
        // the round; the misses wait, and the next round admits them into those slots.
        round(8..13);
        assert_eq!(tier(0..5), [Tier::Host; 5]);
        assert_eq!(tier(8..13), [Tier::Host; 5]);
        assert_eq!((gpu_stat(&buffers).evictions, gpu_stat(&buffers).used_blocks), (5, 3));
        round(8..13);
        assert_eq!(tier(8..13), [Tier::Gpu; 5]);
        assert_eq!(gpu_stat(&buffers).evictions, 5, "the freed slots were enough");

        // While a device read lives, the victims go to the quarantine, and a round that finds
        // them there evicts only for the admissions they do not cover.
        let cached: Vec<(u32, Vec<u8>)> = (5..8)
            .chain(8..13)
            .map(|c| {
                let slot = buffers.mapping().get(&key(c)).unwrap()[0].gpu_slot().unwrap();
                (slot, content(c, 1))
            })
            .collect();
        let read = buffers.device_read();
        round(13..18);
        assert_eq!((gpu_stat(&buffers).evictions, buffers.stats().gpu_quarantined_blocks), (10, 5));
        round(13..18);
        assert_eq!(gpu_stat(&buffers).evictions, 10, "5 quarantined slots cover the 5 waiting");
        round(13..20);
        assert_eq!((gpu_stat(&buffers).evictions, buffers.stats().gpu_quarantined_blocks), (12, 7));
        assert_eq!(tier(13..20), [Tier::Host; 7]);
        for (slot, bytes) in &cached {
            let intact = buffers.gpu_pool().lock(*slot).expect("unpinned").bytes().to_vec();
            assert_eq!(&intact, bytes, "Gpu slot {slot} keeps its bytes while the read lives");
        }
        drop(read);
        assert_eq!(buffers.stats().gpu_quarantined_blocks, 0);
        round(13..20);
        assert_eq!(tier(13..20), [Tier::Gpu; 7]);
        let gpu = gpu_stat(&buffers);
        assert_eq!((gpu.evictions, gpu.used_blocks, gpu.failures), (12, 8, 0));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Store(u8),
        PinCluster(u8),
        LogClusters(u8),
        Maintain,
        BeginRead,
        EndRead(u8),
        Evict(u8),
        FreeCluster(u8),
        Admit(u8),
        Write(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            2 => any::<u8>().prop_map(Op::Store),
            3 => any::<u8>().prop_map(Op::PinCluster),
            3 => any::<u8>().prop_map(Op::LogClusters),
            2 => Just(Op::Maintain),
            1 => Just(Op::BeginRead),
            1 => any::<u8>().prop_map(Op::EndRead),
            1 => any::<u8>().prop_map(Op::Evict),
            1 => any::<u8>().prop_map(Op::FreeCluster),
            1 => any::<u8>().prop_map(Op::Admit),
            1 => any::<u8>().prop_map(Op::Write),
        ]
    }

    const BLOCK: usize = 512;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

        /// Batched rounds among every other operation: the slot table equals the blocks' truth
        /// after each, every read returns the bytes last written, a Gpu slot a live device read
        /// could have found through the table holds that block or nothing, and the quarantine
        /// empties with the reads.
        #[test]
        fn batched_rounds_keep_the_slot_table_exact_and_live_reads_slots_intact(
            kind in prop::sample::select(ReplacerKind::ALL.to_vec()),
            ops in proptest::collection::vec(op(), 1..150),
        ) {
            let mut config = BufferConfig::new(12, 4);
            config.layout = BlockLayout::new(BLOCK).unwrap();
            config.replacer = kind;
            let buffers = batched(config);
            let mut model: HashMap<BlockId, Vec<u8>> = HashMap::new();
            let mut clusters: Vec<ClusterKey> = Vec::new();
            let mut next = 0;
            let mut reads: Vec<(DeviceRead<'_>, HashMap<u32, BlockId>)> = Vec::new();
            for op in ops {
                let live: Vec<BlockId> = {
                    let mut b: Vec<BlockId> = model.keys().copied().collect();
                    b.sort_unstable();
                    b
                };
                let block = |arg: u8| (!live.is_empty()).then(|| live[arg as usize % live.len()]);
                let cluster = |arg: u8| (!clusters.is_empty()).then(|| clusters[arg as usize % clusters.len()]);
                match op {
                    Op::Store(arg) => {
                        let k = key(next);
                        next += 1;
                        let bytes: Vec<u8> = (0..BLOCK * (1 + arg as usize % 2)).map(|i| arg.wrapping_add(i as u8)).collect();
                        if let Ok(stored) = buffers.store_cluster(k, &bytes) {
                            for (b, chunk) in stored.iter().zip(bytes.chunks(BLOCK)) {
                                model.insert(*b, chunk.to_vec());
                            }
                            clusters.push(k);
                        }
                    }
                    Op::PinCluster(arg) => if let Some(k) = cluster(arg) {
                        let reader = buffers.reader();
                        for location in reader.cluster(&k).unwrap() {
                            let pin = reader.pin(&location).unwrap();
                            prop_assert_eq!(&pin[..], &model[&location.block()][..]);
                        }
                    },
                    Op::LogClusters(arg) => {
                        let keys: Vec<ClusterKey> = clusters.iter().copied().filter(|c| c.cluster % 3 != u32::from(arg % 3)).collect();
                        buffers.log_cluster_reads(keys);
                        buffers.maintain(usize::MAX);
                    }
                    Op::Maintain => {
                        buffers.maintain(usize::MAX);
                    }
                    Op::BeginRead => if reads.len() < 3 {
                        reads.push((buffers.device_read(), HashMap::new()));
                    },
                    Op::EndRead(arg) => if !reads.is_empty() {
                        drop(reads.swap_remove(arg as usize % reads.len()));
                    },
                    Op::Evict(arg) => if let Some(b) = block(arg) {
                        let _ = buffers.evict(b);
                    },
                    Op::FreeCluster(arg) => if let Some(k) = cluster(arg) {
                        let listed: Vec<BlockId> = buffers.mapping().get(&k).unwrap().iter().map(|l| l.block()).collect();
                        buffers.free_cluster(k).unwrap();
                        clusters.retain(|&c| c != k);
                        for b in listed {
                            model.remove(&b);
                        }
                    },
                    Op::Admit(arg) => if let Some(b) = block(arg) {
                        let _ = buffers.admit(b);
                    },
                    Op::Write(arg) => if let Some(b) = block(arg) {
                        let bytes = vec![arg; BLOCK];
                        buffers.write(b, &bytes).unwrap();
                        model.insert(b, bytes);
                    },
                }
                buffers.check_slot_table().map_err(TestCaseError::fail)?;
                // What a device step could find through the table now, and who holds each slot.
                let (shown, holders) = {
                    let state = buffers.state().unwrap();
                    let mut shown = HashMap::new();
                    let mut holders = HashMap::new();
                    for (&b, meta) in &state.blocks {
                        if let Some(g) = meta.gpu_slot {
                            holders.insert(g, b);
                            if matches!(meta.home, super::Home::Host(_)) {
                                shown.insert(g, b);
                            }
                        }
                    }
                    (shown, holders)
                };
                for (_, seen) in &mut reads {
                    for (slot, b) in seen.iter() {
                        let holder = holders.get(slot);
                        prop_assert!(holder.is_none() || holder == Some(b), "Gpu slot {} held {} for a live read, now {:?}", slot, b, holder);
                    }
                    seen.extend(shown.iter().map(|(&s, &b)| (s, b)));
                }
                if reads.is_empty() {
                    prop_assert_eq!(buffers.stats().gpu_quarantined_blocks, 0);
                }
                let reader = buffers.reader();
                for (&b, bytes) in &model {
                    prop_assert_eq!(&buffers.read(b).unwrap()[..], &bytes[..]);
                }
                drop(reader);
            }
            drop(reads);
            prop_assert_eq!(buffers.stats().gpu_quarantined_blocks, 0);
            prop_assert_eq!(gpu_stat(&buffers).failures, 0);
        }
    }
}
