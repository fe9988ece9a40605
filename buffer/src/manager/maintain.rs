//! The maintainer's round ([`BufferManager::maintain`]): drains the queued access records and
//! the device steps' cluster reads (only the newest of each layer), tells the replacer of hits,
//! and admits misses into the Gpu tier — at once, or batched through `round` when the tier has a
//! device mirror.

use super::device::{ClusterReads, StepReads};
use super::round::Round;
use super::{BufferManager, State, MISS};
use crate::mapping::Locations;
use crate::{ClusterKey, Error, Tier};
use std::sync::atomic::Ordering;
use std::time::Instant;

impl BufferManager {
    /// Processes queued access records and cluster reads (whole batches, taken from both
    /// queues in turn until at least `max_records` or both are empty): hits update the
    /// replacer, misses are admitted into the Gpu tier (evicting by policy). Returns the
    /// records processed (a logged cluster counts as one).
    /// The [`Maintainer`](crate::Maintainer) thread calls this; tests may call it directly.
    ///
    /// With the Gpu tier in device memory a round is *batched*: its device writes (admitted
    /// slots' bytes, then the slot-table entries it changed) go asynchronously on the Gpu
    /// pool's stream, it waits once at the end, and only then publishes its admissions (owner
    /// tags, mapping table) and gives up its victims' slots. So a victim's slot is reused by a
    /// later round, never the round that evicted it: an admission that finds no free slot
    /// evicts for itself and waits, and a round evicts no more victims than it has admissions
    /// waiting beyond the slots already quarantined. A block is admitted once per round. Without
    /// a device mirror each admission is made and published at once, as by [`Self::admit`].
    pub fn maintain(&self, max_records: usize) -> usize {
        let _span = tracing::trace_span!("maintain", max_records).entered();
        let mut records = Vec::new();
        let mut clusters = Vec::new();
        let limit = max_records.min(1 << 16);
        while records.len() < limit {
            let Some(batch) = self.queue.pop() else { break };
            self.queued_records.fetch_sub(batch.len() as u64, Ordering::Relaxed);
            records.extend(batch);
        }
        self.take_cluster_reads(limit.saturating_sub(records.len()), &mut clusters);
        let processed = records.len() + clusters.len();
        if processed == 0 || self.gpu.capacity() == 0 {
            return processed;
        }
        // The previous round's retired mapping buckets are past every reader by now: free
        // them here rather than in a plan thread's epoch pin.
        self.mapping.collect_garbage();
        let Ok(mut state) = self.state() else {
            self.counters(Tier::Gpu).failed(Tier::Gpu, "poisoned");
            return records.len();
        };
        let trace = trace_rounds().then(Instant::now);
        let mut round = self.batched_rounds.then(|| Round::new(trace.is_some()));
        for record in &records {
            if record.gpu_slot != MISS {
                let cached = state.blocks.get(&record.block).and_then(|m| m.gpu_slot);
                if cached == Some(record.gpu_slot) {
                    state.replacer.access(record.gpu_slot);
                }
            } else if let Some(round) = round.as_mut() {
                self.admit_batched(&mut state, record.block, round);
            } else {
                match self.admit_locked(&mut state, record.block) {
                    // Freed or lost since the access: nothing to admit.
                    Ok(_) | Err(Error::UnknownBlock { .. } | Error::Missing { .. }) => {}
                    Err(_) => {} // counted where it failed (full of pinned slots, disk errors)
                }
            }
        }
        let mut counts = ClusterReadCounts::default();
        if !clusters.is_empty() {
            // One epoch pin and overlapping lookups for the round's clusters (those freed since
            // the step are skipped: nothing to keep warm). The lists stay readable under the
            // pin while the round remaps blocks; Gpu slots are read as the round goes.
            let reader = self.mapping.reader();
            let mut lists = Vec::with_capacity(clusters.len());
            reader.get_many(&clusters, &mut lists);
            for locations in lists.into_iter().flatten() {
                self.resolve_cluster_read(&mut state, locations, round.as_mut(), &mut counts);
            }
        }
        counts.add_to(self);
        let admitted = round.as_ref().map_or(0, Round::admitted);
        let capped = round.as_ref().map_or(0, Round::capped);
        let steps = round.as_ref().and_then(Round::times);
        let chosen = trace.map(|t| t.elapsed());
        if let Some(round) = round {
            self.finish_round(&mut state, round);
        }
        drop(state);
        self.mapping.collect_garbage();
        if let (Some(t), Some(chosen)) = (trace, chosen) {
            eprintln!(
                "attnstore-buffer: round of {} records and {} cluster reads: {admitted} batched admissions ({capped} misses past the round's bound); {:.2} ms choosing, {:.2} ms in all",
                records.len(),
                clusters.len(),
                chosen.as_secs_f64() * 1e3,
                t.elapsed().as_secs_f64() * 1e3
            );
            if let Some(steps) = steps {
                let names = ["victims", "latches", "fills"];
                let parts: Vec<String> = names
                    .iter()
                    .zip(steps)
                    .map(|(n, (d, c))| format!("{n} {c} in {:.2} ms", d.as_secs_f64() * 1e3))
                    .collect();
                eprintln!("attnstore-buffer:   {}", parts.join(", "));
            }
        }
        processed
    }

    /// Takes the queued cluster reads a round applies into `clusters`: logged keys
    /// ([`Self::log_cluster_reads`]) in order while fewer than `budget` are taken (the rest stay
    /// queued for later rounds), and of the device steps' reads ([`Self::log_layer_reads`],
    /// [`Self::log_flagged_reads`]) only the newest of each (context, layer) — all of them are drained, the older ones superseded
    /// (counted in [`BufferStats::superseded_cluster_reads`], not applied). A step logs what it
    /// read so the maintainer admits its misses and keeps its hits warm; when steps come faster
    /// than rounds, a round applying the queued steps one by one works on ever older
    /// selections (at 1M tokens the queue grew through a whole run and the steps found only a
    /// third of their clusters in the Gpu tier), while the newest step of a layer says best
    /// what its next step will read.
    ///
    /// [`BufferStats::superseded_cluster_reads`]: crate::BufferStats::superseded_cluster_reads
    fn take_cluster_reads(&self, budget: usize, clusters: &mut Vec<ClusterKey>) {
        let mut newest: Vec<StepReads> = Vec::new();
        let mut later = Vec::new();
        let mut superseded = 0u64;
        while let Some(reads) = self.cluster_reads.pop() {
            // Relaxed: statistics.
            self.queued_records.fetch_sub(reads.len() as u64, Ordering::Relaxed);
            match reads {
                ClusterReads::Keys(keys) if clusters.len() < budget && later.is_empty() => clusters.extend(keys),
                ClusterReads::Keys(keys) => later.push(ClusterReads::Keys(keys)),
                ClusterReads::Layers(layers) => {
                    for reads in layers {
                        match newest.iter_mut().find(|n| n.layer_key() == reads.layer_key()) {
                            Some(older) => {
                                superseded += older.len() as u64;
                                *older = reads;
                            }
                            None => newest.push(reads),
                        }
                    }
                }
            }
        }
        self.superseded.fetch_add(superseded, Ordering::Relaxed);
        // Keys beyond the budget go back, in order, for the next rounds (a full queue drops and
        // counts them as a push would).
        for keys in later {
            self.queue_cluster_reads(keys);
        }
        ClusterReads::Layers(newest).append_to(clusters);
    }

    /// Applies one cluster read of a device-planned step (see [`Self::log_cluster_reads`]):
    /// the cluster's blocks as the mapping table listed them at the round's lookup, counting
    /// their Gpu hits and misses in `counts`.
    ///
    /// Under the state lock the mapping table says what the blocks' metadata says (every
    /// change of a block's tier or Gpu slot is remapped before the lock is released; a round's
    /// own admissions are published only at its end, and `admit_batched` admits a block once
    /// per round), so a hit costs one replacer touch and an owner-tag read, no metadata
    /// lookup: rounds stay short and the blocks a step missed reach the Gpu tier sooner.
    fn resolve_cluster_read<'s>(
        &'s self,
        state: &mut State,
        locations: Locations<'_>,
        mut round: Option<&mut Round<'s>>,
        counts: &mut ClusterReadCounts,
    ) {
        for location in locations.iter() {
            // Each location is read now, but the slot it names may be mid-move: a cached
            // location counts only while its slot's owner tag still names the block (set when
            // an admission is published, cleared on eviction).
            let cached = location.gpu_slot().filter(|&slot| self.gpu.owner(slot) == location.block().0);
            match (cached, location.home().0) {
                (Some(slot), _) => {
                    debug_assert_eq!(state.blocks.get(&location.block()).and_then(|m| m.gpu_slot), Some(slot));
                    state.replacer.access(slot);
                    counts.gpu_hits += 1;
                }
                (None, Tier::Host) => {
                    counts.gpu_misses += 1;
                    // Refusals for pins or copy errors count as failures where they happen;
                    // waiting for device reads in flight does not.
                    match round.as_deref_mut() {
                        Some(round) => self.admit_batched(state, location.block(), round),
                        None => {
                            let _ = self.admit_locked(state, location.block());
                        }
                    }
                }
                // A device step does not read Disk: nothing was served, nothing to admit.
                (None, _) => {}
            }
        }
    }
}

/// Gpu hits and misses of a round's cluster reads, added to the tier counters once per round
/// (a Gpu miss of a device step is a Host hit: it read the Host arena).
#[derive(Default)]
struct ClusterReadCounts {
    gpu_hits: u64,
    gpu_misses: u64,
}

impl ClusterReadCounts {
    fn add_to(&self, buffers: &BufferManager) {
        buffers.count_reads([self.gpu_hits, self.gpu_misses, self.gpu_misses]);
    }
}

/// Whether `ATTNSTORE_BUFFER_TRACE` asks for a line per maintenance round on stderr (records,
/// admissions, time), read once.
fn trace_rounds() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("ATTNSTORE_BUFFER_TRACE").is_some())
}
