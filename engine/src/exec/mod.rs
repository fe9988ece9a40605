//! The executor: the one place a plan's rows are gathered and attended. For every request
//! and KV head it asks the access method which rows the head's plan reads
//! ([`AccessMethod::head_rows`]), gathers them once (the method's memory, or blocks of the
//! buffer manager pinned through one path), runs the zone kernels (steady, retrieve,
//! estimate) on rayon threads, and merges the partials by log-sum-exp into outputs. The GPU
//! path (`crate::gpu`) takes its inputs from the same descriptions (`device.rs`).

#[cfg(any(feature = "cuda", test))]
#[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "only its 2-bit test runs without CUDA"))]
pub(crate) mod device;
mod gather;
pub(crate) mod home;
mod meter;

use crate::context::Layer;
use crate::error::Result;
use crate::plan::Plan;
use attnstore_buffer::BlockLocation;
use attnstore_index::{EstimateZone, HeadPlan, HeadRows, PlainRows, Run};
use attnstore_kernels::cpu::attention::{attend_spans, Scratch};
use attnstore_kernels::{DType, HackParams, Partial};
use gather::{attend_clusters, attend_groups, attend_homed, ClusterBlocks, ClusterRows};
use half::{bf16, f16};
use home::BlockStore;
use meter::ZoneMeter;
use rayon::prelude::*;
use std::borrow::Cow;
use std::time::Instant;

pub use home::blocks_per_tier;
pub(crate) use meter::{micros, micros_opt};
pub(crate) use meter::{Meter, Zone};
pub use meter::{RequestActual, ZoneActual};

/// Retrieved clusters one rayon task attends while executing a block-homed plan.
const CLUSTER_CHUNK: usize = 64;

/// Estimated clusters one rayon task folds in while executing a plan.
const EST_CHUNK: usize = 512;

/// The blocks a plan recorded for one KV head: per selection, its retrieved clusters'
/// blocks in `retrieve_ids` order (empty when the rows are not homed per cluster).
pub(crate) type HeadBlocks = Vec<Vec<BlockLocation>>;

/// Runs `plan` over the read-locked `layers` (one per request, same order).
pub(crate) fn run(plan: &Plan, layers: &[&Layer]) -> Result<Vec<Vec<f32>>> {
    run_metered(plan, layers, None)
}

/// [`run`], counting what each request reads into `meters` (one per request) when given.
pub(crate) fn run_metered(plan: &Plan, layers: &[&Layer], meters: Option<&[Meter]>) -> Result<Vec<Vec<f32>>> {
    let heads: Vec<_> = plan.requests.iter().zip(layers).map(|(r, l)| cpu_heads(r, l)).collect();
    let jobs: Vec<(usize, usize)> =
        plan.requests.iter().enumerate().flat_map(|(i, r)| (0..r.shape.kv_heads).map(move |h| (i, h))).collect();
    let pieces: Vec<Vec<f32>> = jobs
        .par_iter()
        .map_init(Scratch::default, |scratch, &(i, h)| {
            let r = &plan.requests[i];
            let (g, d) = (r.shape.group(), r.shape.head_dim);
            let q = &r.queries[h * g * d..(h + 1) * g * d];
            let (plans, blocks) = &heads[i];
            let meter = meters.and_then(|m| m.get(i));
            let parts = attend_head(layers[i], r.dtype, h, q, d, &plans[h], &blocks[h], meter, scratch)?;
            Ok(parts.iter().flat_map(|p| p.finish()).collect())
        })
        .collect::<Result<_>>()?;
    let mut out: Vec<Vec<f32>> = plan.requests.iter().map(|r| Vec::with_capacity(r.shape.query_len())).collect();
    for (&(i, _), piece) in jobs.iter().zip(pieces) {
        out[i].extend(piece);
    }
    Ok(out)
}

/// The per-KV-head plans the CPU executor runs for `r` and the blocks they read: its own,
/// or for a device-selected plan the same zones chosen on the CPU (the retrieval zone's
/// tokens, every other cluster estimated), their blocks looked up now.
pub(crate) fn cpu_heads<'p>(
    r: &'p crate::plan::RequestPlan,
    layer: &Layer,
) -> (Cow<'p, [HeadPlan]>, Cow<'p, [HeadBlocks]>) {
    let Some(dev) = &r.device else { return (Cow::Borrowed(&r.heads), Cow::Borrowed(&r.blocks)) };
    let zone = attnstore_index::ZoneBudget {
        retrieve_tokens: dev.retrieve_tokens,
        estimate_tokens: usize::MAX,
        mode: attnstore_index::SelectionMode::PerKvHead,
    };
    let (g, d) = (r.shape.group(), r.shape.head_dim);
    let heads: Vec<HeadPlan> = (0..r.shape.kv_heads)
        .map(|h| layer.method.plan_head(h, &r.queries[h * g * d..(h + 1) * g * d], &zone))
        .collect();
    let blocks = record_blocks(layer, &heads);
    (Cow::Owned(heads), Cow::Owned(blocks))
}

/// The blocks of every selection's retrieved clusters as the mapping table has them now,
/// for layers whose plain rows are homed per cluster (plans record them so EXPLAIN shows
/// the tiers and execution pins exactly those). A cluster that cannot be found leaves its
/// selection's list empty: execution looks the clusters up again and reports what is
/// missing.
pub(crate) fn record_blocks(layer: &Layer, heads: &[HeadPlan]) -> Vec<HeadBlocks> {
    heads.iter().enumerate().map(|(h, plan)| record_head_blocks(layer, h, plan)).collect()
}

/// [`record_blocks`] of KV head `kv_head`'s plan.
pub(crate) fn record_head_blocks(layer: &Layer, kv_head: usize, plan: &HeadPlan) -> HeadBlocks {
    let homed = layer
        .home
        .as_ref()
        .filter(|_| layer.method.clustered().is_some_and(|c| c.storage() == attnstore_index::RowStorage::Homed));
    plan.selections
        .iter()
        .map(|sel| match homed {
            Some(store) if !plan.exact => {
                let keys: Vec<_> = sel.retrieve_ids.iter().map(|&id| store.key(kv_head, id)).collect();
                store.lookup(&keys).unwrap_or_default()
            }
            _ => Vec::new(),
        })
        .collect()
}

/// The partials of the query heads `q` (`group × d`) of KV head `kv_head` under `plan`,
/// reading `blocks` where the plan recorded them. Fails only when stored rows cannot be
/// read (a block that is corrupt, lost or unreadable).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_head(
    layer: &Layer,
    dtype: DType,
    kv_head: usize,
    q: &[f32],
    d: usize,
    plan: &HeadPlan,
    blocks: &[Vec<BlockLocation>],
    meter: Option<&Meter>,
    scratch: &mut Scratch,
) -> Result<Vec<Partial>> {
    let rows = layer.method.head_rows(kv_head, plan);
    attend_rows(layer.home.as_ref(), dtype, kv_head, q, d, &rows, blocks, meter, scratch)
}

/// The partials of the query heads `q` (`group × head_dim`) of KV head `kv_head` of
/// `method` under `plan` (a plan `method` made), for a method that keeps its rows in its own
/// memory: what the engine's executor computes for such a layer. Methods and tests that
/// drive an access method directly run their plans with it; rows homed in a buffer manager
/// are read only through an engine ([`crate::Engine::execute`]), which fails here.
pub fn execute_head(
    method: &dyn attnstore_index::AccessMethod,
    kv_head: usize,
    q: &[f32],
    head_dim: usize,
    plan: &HeadPlan,
) -> Result<Vec<Partial>> {
    let rows = method.head_rows(kv_head, plan);
    let dtype = method.clustered().map_or(DType::F32, |c| c.dtype());
    attend_rows(None, dtype, kv_head, q, head_dim, &rows, &[], None, &mut Scratch::default())
}

/// [`attend_head`] over a described head: the steady runs in order, the exact scan's runs
/// as parallel jobs, then each selection's clusters, runs and estimation columns as
/// parallel jobs, each zone's partials merged in job order.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_rows(
    home: Option<&BlockStore>,
    dtype: DType,
    kv_head: usize,
    q: &[f32],
    d: usize,
    rows: &HeadRows<'_>,
    blocks: &[Vec<BlockLocation>],
    meter: Option<&Meter>,
    scratch: &mut Scratch,
) -> Result<Vec<Partial>> {
    let g = q.len() / d;
    let scale = 1.0 / (d as f32).sqrt();
    let ctx = Gather { home, dtype, kv_head, scale, meter };
    let mut parts = vec![Partial::empty(d); g];
    let start = ctx.clock();
    for run in &rows.steady {
        ctx.attend(run, Zone::Steady, q, &mut parts, scratch)?;
    }
    ctx.timed(Zone::Steady, start);
    if !rows.scan.is_empty() {
        // The queries are quantized once for every task (2-bit rows; plain rows: nothing).
        attend_jobs(&primed(q, g, d, rows.hack())?, &rows.scan, g, d, &mut parts, |run, p, sc| {
            let start = ctx.clock();
            let done = ctx.attend(run, Zone::Scan, q, p, sc);
            ctx.timed(Zone::Scan, start);
            done
        })?;
    }
    for (s, sel) in rows.selections.iter().enumerate() {
        let qs = &q[sel.first_head * d..(sel.first_head + sel.heads) * d];
        let mut sub = vec![Partial::empty(d); sel.heads];
        let est: &dyn EstimateZone = sel.estimate.as_deref().unwrap_or(&NoEstimate);
        let est_jobs = (0..est.len()).step_by(EST_CHUNK).map(|a| a..(a + EST_CHUNK).min(est.len()));
        // The blocks the plan recorded; when it could record none, as the mapping table has
        // them now (a cluster missing now is reported).
        let looked;
        let recorded: &[BlockLocation] = match (home, blocks.get(s).filter(|b| !b.is_empty())) {
            (_, Some(b)) => b,
            (Some(store), None) if !sel.clusters.is_empty() => {
                let keys: Vec<_> = sel.clusters.iter().map(|&(id, _)| store.key(kv_head, id)).collect();
                looked = store.lookup(&keys)?;
                &looked
            }
            _ => &[],
        };
        let clusters = match home {
            Some(store) if !sel.clusters.is_empty() => ctx.cluster_rows(store, d, &sel.clusters, recorded)?,
            _ => Vec::new(),
        };
        let jobs: Vec<Job<'_, '_>> = clusters
            .chunks(CLUSTER_CHUNK)
            .map(Job::Clusters)
            .chain(sel.retrieve.iter().map(|runs| Job::Runs(runs)))
            .chain(est_jobs.map(Job::Estimate))
            .collect();
        let hack = sel.retrieve.iter().flatten().find_map(Run::hack);
        attend_jobs(&primed(qs, sel.heads, d, hack)?, &jobs, sel.heads, d, &mut sub, |job, p, sc| {
            let start = ctx.clock();
            let (zone, done) = match job {
                Job::Clusters(c) => (Zone::Retrieve, ctx.attend_clusters(c, qs, p, sc)),
                Job::Runs(runs) => {
                    (Zone::Retrieve, runs.iter().try_for_each(|run| ctx.attend(run, Zone::Retrieve, qs, p, sc)))
                }
                Job::Estimate(cols) => {
                    p.iter_mut().zip(est.partials(cols.clone(), d)).for_each(|(a, b)| a.merge(&b));
                    if let Some(m) = ctx.zone(Zone::Estimate) {
                        m.index_rows(cols.len(), 0);
                    }
                    (Zone::Estimate, Ok(()))
                }
            };
            ctx.timed(zone, start);
            done
        })?;
        for (i, part) in sub.iter().enumerate() {
            parts[sel.first_head + i].merge(part);
        }
    }
    Ok(parts)
}

/// One parallel task of a selection.
enum Job<'j, 'r> {
    Clusters(&'j [ClusterRows<'j>]),
    Runs(&'j [Run<'r>]),
    Estimate(std::ops::Range<usize>),
}

/// An empty estimation zone.
struct NoEstimate;

impl EstimateZone for NoEstimate {
    fn len(&self) -> usize {
        0
    }
    fn partials(&self, _cols: std::ops::Range<usize>, _d: usize) -> Vec<Partial> {
        Vec::new()
    }
}

/// What every task of one KV head shares: where homed rows are and how to read them.
#[derive(Clone, Copy)]
struct Gather<'h> {
    home: Option<&'h BlockStore>,
    dtype: DType,
    kv_head: usize,
    scale: f32,
    /// Where EXPLAIN ANALYZE counts (`None`: nothing is counted or timed).
    meter: Option<&'h Meter>,
}

impl Gather<'_> {
    /// The counters of `zone`, when counting.
    fn zone(&self, zone: Zone) -> Option<&ZoneMeter> {
        self.meter.map(|m| m.zone(zone))
    }

    /// The time now, when counting.
    fn clock(&self) -> Option<Instant> {
        self.meter.map(|_| Instant::now())
    }

    /// Adds the time since `start` to `zone`.
    fn timed(&self, zone: Zone, start: Option<Instant>) {
        if let (Some(m), Some(t)) = (self.zone(zone), start) {
            m.since(t);
        }
    }

    fn store(&self) -> Result<&BlockStore> {
        self.home.ok_or_else(|| {
            crate::Error::Index(attnstore_index::Error::MissingRows(
                "rows homed in a buffer manager the layer does not have".into(),
            ))
        })
    }

    /// Folds one run of `zone` into `parts` (`q`: their query heads). Steady and scan reads
    /// pin without logging accesses.
    fn attend(&self, run: &Run<'_>, zone: Zone, q: &[f32], parts: &mut [Partial], sc: &mut Scratch) -> Result<()> {
        let (scan, meter) = (zone.is_scan(), self.zone(zone));
        match run {
            Run::Plain(pieces) => {
                attend_plain(pieces, q, self.scale, parts, sc);
                if let Some(m) = meter {
                    let d = q.len() / parts.len().max(1);
                    let (rows, bytes) = plain_size(pieces, d);
                    m.index_rows(rows, bytes);
                }
                Ok(())
            }
            Run::Encoded { rows, ranges } => {
                rows.attend(q, self.scale, ranges, parts, &mut sc.hack);
                if let Some(m) = meter {
                    let n: usize = ranges.iter().map(|r| r.len()).sum();
                    m.index_rows(n, n * rows.bytes() / rows.rows().max(1));
                }
                Ok(())
            }
            Run::Kv43 { rows, ranges } => {
                // The GQA group at once, on the codes (the partial key group's f16 rows
                // exactly), folded into the same partials as every other run.
                rows.attend_runs(q, self.scale, ranges, parts)?;
                if let Some(m) = meter {
                    let n: usize = ranges.iter().map(|r| r.len()).sum();
                    m.index_rows(n, n * rows.bytes() / rows.rows().max(1));
                }
                Ok(())
            }
            Run::Homed { clusters, ranges } => {
                let (store, h, scale) = (self.store()?, self.kv_head, self.scale);
                let read = gather::Read { scan, meter };
                match clusters.dtype {
                    DType::F32 => attend_homed::<f32>(store, h, clusters, ranges, read, q, scale, parts, sc),
                    DType::F16 => attend_homed::<f16>(store, h, clusters, ranges, read, q, scale, parts, sc),
                    DType::Bf16 => attend_homed::<bf16>(store, h, clusters, ranges, read, q, scale, parts, sc),
                }
            }
            Run::HomedGroups { groups, ranges } => {
                let read = gather::Read { scan, meter };
                attend_groups(self.store()?, self.kv_head, groups, ranges, read, q, self.scale, parts, sc)
            }
        }
    }

    /// The retrieved whole clusters `(id, rows)` over their blocks `recorded` (each
    /// cluster's blocks in turn).
    fn cluster_rows<'b>(
        &self,
        store: &BlockStore,
        d: usize,
        clusters: &[(u32, usize)],
        recorded: &'b [BlockLocation],
    ) -> Result<Vec<ClusterRows<'b>>> {
        let per_block = store.rows_per_block(d * self.dtype.size_bytes())?;
        let blocks = home::blocks_of_clusters(recorded, clusters.iter().copied(), per_block, self.kv_head)?;
        Ok(blocks
            .into_iter()
            .zip(clusters)
            .map(|(locations, &(_, size))| ClusterRows { locations: ClusterBlocks::Recorded(locations), rows: 0..size })
            .collect())
    }

    fn attend_clusters(&self, c: &[ClusterRows<'_>], q: &[f32], p: &mut [Partial], sc: &mut Scratch) -> Result<()> {
        let store = self.store()?;
        let d = q.len() / p.len().max(1);
        let per_block = store.rows_per_block(d * self.dtype.size_bytes())?;
        let reader = store.buffers().reader();
        let m = self.zone(Zone::Retrieve);
        match self.dtype {
            DType::F32 => attend_clusters::<f32>(&reader, per_block, q, self.scale, c, m, p, sc),
            DType::F16 => attend_clusters::<f16>(&reader, per_block, q, self.scale, c, m, p, sc),
            DType::Bf16 => attend_clusters::<bf16>(&reader, per_block, q, self.scale, c, m, p, sc),
        }
    }
}

/// Rows and bytes (keys and values) of plain row pieces of head dimension `d`.
fn plain_size(pieces: &[PlainRows<'_>], d: usize) -> (usize, usize) {
    let (mut rows, mut bytes) = (0, 0);
    for p in pieces {
        let (elements, size) = match p {
            PlainRows::F32(k, _) => (k.len(), 4),
            PlainRows::F16(k, _) => (k.len(), 2),
            PlainRows::Bf16(k, _) => (k.len(), 2),
        };
        rows += elements / d.max(1);
        bytes += 2 * elements * size;
    }
    (rows, bytes)
}

/// Attends plain pieces (all of one type: a method builds a run from one array type) in
/// one pass.
fn attend_plain(pieces: &[PlainRows<'_>], q: &[f32], scale: f32, parts: &mut [Partial], sc: &mut Scratch) {
    macro_rules! typed {
        ($variant:ident) => {{
            let spans = pieces.iter().filter_map(|p| match *p {
                PlainRows::$variant(k, v) => Some((k, v)),
                _ => None,
            });
            attend_spans(q, scale, spans, parts, sc)
        }};
    }
    match pieces.first() {
        None => {}
        Some(PlainRows::F32(..)) => typed!(F32),
        Some(PlainRows::F16(..)) => typed!(F16),
        Some(PlainRows::Bf16(..)) => typed!(Bf16),
    }
}

/// A scratch holding the queries `q` (`g × d`) quantized for 2-bit rows of `hack`, to
/// clone into every task of a step; empty for plain rows.
fn primed(q: &[f32], g: usize, d: usize, hack: Option<HackParams>) -> Result<Scratch> {
    let mut scratch = Scratch::default();
    if let Some(params) = hack {
        scratch.hack.quantize(q, g, d, params)?;
    }
    Ok(scratch)
}

/// Runs `jobs` on rayon threads, each attending into fresh partials of `heads` query heads
/// with a scratch cloned from `primed`, and merges them all into `parts` in job order. With
/// fewer busy threads than cores this spreads one KV head's work; when every thread is busy
/// rayon runs the jobs in turn on the caller's.
fn attend_jobs<J: Sync>(
    primed: &Scratch,
    jobs: &[J],
    heads: usize,
    d: usize,
    parts: &mut [Partial],
    run: impl Fn(&J, &mut [Partial], &mut Scratch) -> Result<()> + Sync + Send,
) -> Result<()> {
    let partials: Vec<Vec<Partial>> = jobs
        .par_iter()
        .map_init(
            || PooledScratch::from(primed),
            |sc, job| {
                let mut p = vec![Partial::empty(d); heads];
                run(job, &mut p, sc.get())?;
                Ok(p)
            },
        )
        .collect::<Result<_>>()?;
    for p in &partials {
        parts.iter_mut().zip(p).for_each(|(a, b)| a.merge(b));
    }
    Ok(())
}

thread_local! {
    /// Each thread's attention scratch between tasks: a fresh one would allocate and zero its
    /// tile and gather buffers (~70 KB) again for every rayon split of every step.
    static SCRATCH: std::cell::RefCell<Option<Scratch>> = const { std::cell::RefCell::new(None) };
}

/// A task's scratch: the thread's kept one (or a new one) with `primed`'s 2-bit query state,
/// handed back to the thread when the task's split is done. Scratch contents never leak
/// between uses: every kernel sizes and fills what it reads.
struct PooledScratch(Option<Scratch>);

impl PooledScratch {
    fn from(primed: &Scratch) -> Self {
        let mut s = SCRATCH.with(|c| c.borrow_mut().take()).unwrap_or_default();
        s.hack.clone_from(&primed.hack);
        Self(Some(s))
    }

    fn get(&mut self) -> &mut Scratch {
        self.0.get_or_insert_with(Scratch::default)
    }
}

impl Drop for PooledScratch {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            SCRATCH.with(|c| *c.borrow_mut() = Some(s));
        }
    }
}
