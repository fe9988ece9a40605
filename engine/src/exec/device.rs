//! The GPU executor's inputs, taken from the same row descriptions the CPU executor reads:
//! for a host-planned step the blocks of the exactly attended rows (plain f16 clusters, or
//! 2-bit value blocks with the mask of rows to attend) and the partials of what stays on the
//! CPU (steady and estimation zones); for a device-planned step the layer as the device
//! reads it in the Host arena ([`ArenaLayer`]).

use super::home::{blocks_of_clusters, rows_in_block, BlockStore};
use super::meter::{Meter, Zone};
use super::{attend_plain, plain_size};
use crate::context::Layer;
use crate::error::{Error, Result};
use attnstore_buffer::{BlockLocation, Tier};
use attnstore_index::{Clustered, HeadPlan, HeadRows, HomedGroups, RowStorage, Run, SteadyRows};
use attnstore_kernels::cpu::attention::Scratch;
use attnstore_kernels::{ArenaWave, DType, HackParams, HeadClusters, Kv43Head, Partial};
use std::collections::BTreeMap;

/// What a GPU executor needs for one KV head of a plan whose exactly attended rows beyond
/// the steady zone are f16 clusters homed in the buffer manager ([`gpu_work`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct GpuHeadWork {
    /// Blocks of the other exactly attended rows and the tokens valid in each (the first
    /// `n` of the block's `R`), as the plan (or, for exact plans, a lookup now) found them.
    pub blocks: Vec<(BlockLocation, u32)>,
    /// Tokens per block (`R`).
    pub tokens_per_block: usize,
    /// The partial of each query head of the group over what stays on the CPU: the steady
    /// zone (sink, pending, local window: a few dozen rows, cheaper here than an upload and
    /// a second launch) and the estimation zone.
    pub cpu: Vec<Partial>,
}

/// One value block of a `hack2` layer's 2-bit rows (Π = 64 rows), as a GPU step reads it
/// in place: how many buffer-manager blocks its bytes span (its run of
/// [`GpuHackWork::locations`]), the rows it holds and the rows to attend.
#[derive(Debug, Clone)]
pub(crate) struct GpuHackGroup {
    /// Buffer-manager blocks the group's bytes are spread over.
    pub blocks: u32,
    /// Rows the group holds (Π, or fewer for a segment's last value block).
    pub rows: u32,
    /// The rows to attend: bit `r` for row `r` of the group.
    pub mask: u64,
}

/// The GPU executor's inputs for one KV head of a layer whose indexed rows are 2-bit value
/// blocks homed in the buffer manager ([`gpu_hack_work`]).
#[derive(Debug, Clone)]
pub(crate) struct GpuHackWork {
    /// Value blocks with rows the plan attends exactly, each listed once.
    pub groups: Vec<GpuHackGroup>,
    /// The groups' buffer-manager blocks, group after group, each group's in byte order.
    pub locations: Vec<BlockLocation>,
    /// The partial of each query head of the group over the steady and estimation zones.
    pub cpu: Vec<Partial>,
    /// The plan is exact: its reads are a scan (pinned without logging accesses, so an
    /// exact plan neither admits nor evicts what sparse plans re-read).
    pub scan: bool,
}

/// A wave layer as a GPU step over the buffer manager's Host arena reads it
/// ([`arena_layer`]).
#[derive(Debug, Clone)]
pub(crate) struct ArenaLayer {
    /// Meta index and the arena row of every indexed row: row `i` of a cluster sits in its
    /// block `i / R` at arena row `host slot × 2R + i mod R` (V rows `R` rows later).
    pub wave: ArenaWave,
    /// Tokens per block (`R`).
    pub tokens_per_block: usize,
    /// Real clusters of each head (the device's ids past them are padding).
    pub real_clusters: Vec<usize>,
    /// Context of the buffer manager's cluster keys.
    pub context: u64,
    /// Layer of those keys.
    pub layer: u32,
    /// For 2-bit rows, per KV head and value-block id, the arena blocks the value block
    /// spans (empty for f16 rows).
    pub block_pages: Vec<Vec<u8>>,
}

/// The layer's homed f16 clusters and their store, when its rows are such.
fn homed_f16(layer: &Layer) -> Option<(&BlockStore, &dyn Clustered)> {
    let c = layer.method.clustered()?;
    let store = layer.home.as_ref()?;
    (c.storage() == RowStorage::Homed && c.dtype() == DType::F16).then_some((store, c))
}

/// What stays on the CPU in a GPU step of `kv_head` under `plan`: the partials of the query
/// group `q` over the steady zone and, for a sparse plan, its (one) selection's estimation
/// zone.
/// With `meter` (EXPLAIN ANALYZE), the steady rows and estimated clusters are counted and timed.
fn cpu_zones(rows: &HeadRows<'_>, q: &[f32], d: usize, plan: &HeadPlan, meter: Option<&Meter>) -> Vec<Partial> {
    let scale = 1.0 / (d as f32).sqrt();
    let mut cpu = vec![Partial::empty(d); q.len() / d];
    let mut scratch = Scratch::default();
    let start = meter.map(|_| std::time::Instant::now());
    for run in &rows.steady {
        if let Run::Plain(pieces) = run {
            attend_plain(pieces, q, scale, &mut cpu, &mut scratch);
            if let Some(m) = meter {
                let (n, bytes) = plain_size(pieces, d);
                m.zone(Zone::Steady).index_rows(n, bytes);
            }
        }
    }
    if let (Some(m), Some(t)) = (meter, start) {
        m.zone(Zone::Steady).since(t);
    }
    if !plan.exact {
        fold_estimate(rows, d, &mut cpu, meter);
    }
    cpu
}

/// Folds the estimation zone of `rows`' (first) selection into the partials of the query
/// heads it serves (`parts`: the group's); with `meter`, counts and times it.
fn fold_estimate(rows: &HeadRows<'_>, d: usize, parts: &mut [Partial], meter: Option<&Meter>) {
    let Some((sel, zone)) = rows.selections.first().and_then(|sel| sel.estimate.as_ref().map(|z| (sel, z))) else {
        return;
    };
    let start = meter.map(|_| std::time::Instant::now());
    for (i, e) in zone.partials(0..zone.len(), d).iter().enumerate() {
        parts[sel.first_head + i].merge(e);
    }
    if let (Some(m), Some(t)) = (meter, start) {
        m.zone(Zone::Estimate).index_rows(zone.len(), 0);
        m.zone(Zone::Estimate).since(t);
    }
}

/// The GPU executor's inputs for `kv_head` under `plan` (`q`: the group's queries, `blocks`:
/// what the plan recorded), or `None` when the layer cannot serve the plan from the buffer
/// manager on the GPU (rows not homed there, not f16, or one selection per query head): the
/// caller then runs the CPU executor.
pub(crate) fn gpu_work(
    layer: &Layer,
    kv_head: usize,
    q: &[f32],
    d: usize,
    plan: &HeadPlan,
    recorded: &[Vec<BlockLocation>],
    meter: Option<&Meter>,
) -> Option<Result<GpuHeadWork>> {
    let (store, clustered) = homed_f16(layer)?;
    if !plan.exact && plan.selections.len() > 1 {
        return None;
    }
    Some((|| {
        let per_block = store.rows_per_block(d * 2)?;
        let rows = layer.method.head_rows(kv_head, plan);
        let cpu = cpu_zones(&rows, q, d, plan, meter);
        let sizes = clustered.cluster_sizes(kv_head);
        // The clusters attended exactly and their block lists.
        let (ids, found): (Vec<u32>, Vec<BlockLocation>) = if plan.exact {
            let ids: Vec<u32> = (0..sizes.len() as u32).collect();
            let keys: Vec<_> = ids.iter().map(|&id| store.key(kv_head, id)).collect();
            let found = store.lookup(&keys)?;
            (ids, found)
        } else if let Some(sel) = plan.selections.first() {
            let found = match recorded.first().filter(|b| !b.is_empty()) {
                Some(b) => b.clone(),
                None if sel.retrieve_ids.is_empty() => Vec::new(),
                None => {
                    let keys: Vec<_> = sel.retrieve_ids.iter().map(|&id| store.key(kv_head, id)).collect();
                    store.lookup(&keys)?
                }
            };
            (sel.retrieve_ids.clone(), found)
        } else {
            (Vec::new(), Vec::new())
        };
        let clusters = ids.iter().map(|&id| (id, sizes[id as usize] as usize));
        let mut blocks = Vec::with_capacity(found.len());
        for ((_, size), list) in clusters.clone().zip(blocks_of_clusters(&found, clusters, per_block, kv_head)?) {
            blocks.extend(list.iter().enumerate().map(|(b, &l)| (l, rows_in_block(size, b, per_block) as u32)));
        }
        Ok(GpuHeadWork { blocks, tokens_per_block: per_block, cpu })
    })())
}

/// [`gpu_work`] for a layer whose indexed rows are 2-bit (`hack2`, Π = 64; not `hack2c`) value blocks
/// homed in the buffer manager: the blocks a GPU homomorphic kernel reads in place (every
/// row of every block for an exact plan; a selection's retrieved rows otherwise) and the
/// CPU's partials, or `None` when the rows are not such blocks or the plan has one selection
/// per query head (the caller then runs the CPU executor).
pub(crate) fn gpu_hack_work(
    layer: &Layer,
    kv_head: usize,
    q: &[f32],
    d: usize,
    plan: &HeadPlan,
    meter: Option<&Meter>,
) -> Option<Result<GpuHackWork>> {
    let store = layer.home.as_ref()?;
    if layer.method.clustered()?.storage() != RowStorage::HomedEncoded {
        return None;
    }
    // One mask per KV head serves the whole group: one selection for all its heads.
    let one_selection = plan.selections.first().is_none_or(|s| s.first_head == 0 && s.heads == q.len() / d);
    if !plan.exact && (plan.selections.len() > 1 || !one_selection) {
        return None;
    }
    let rows = layer.method.head_rows(kv_head, plan);
    // Every run the plan reads beyond the steady zone: all value blocks of Π = 64 rows.
    let mut runs: Vec<(&HomedGroups, &Vec<std::ops::Range<usize>>)> = Vec::new();
    for run in rows.scan.iter().chain(rows.selections.iter().flat_map(|s| s.retrieve.iter().flatten())) {
        match run {
            // The parameters the GPU kernels read (`prepare_hack_paged`): Π = 64 and HACK's
            // per-token keys. They quantize the query once per step; per-channel keys
            // (`hack2c`) need it per block, so their plans run on the CPU.
            Run::HomedGroups { groups, ranges } if groups.params == HackParams::default() => {
                runs.push((groups, ranges))
            }
            _ => return None,
        }
    }
    Some((|| {
        let cpu = cpu_zones(&rows, q, d, plan, meter);
        // (first home id of the segment, value block) → mask of the rows to attend, in row order.
        let mut wanted = BTreeMap::<(u32, usize), (HomedGroups, u64)>::new();
        for (g, ranges) in &runs {
            let p = g.params.partition;
            for r in ranges.iter() {
                for row in r.clone() {
                    wanted.entry((g.first, row / p)).or_insert((**g, 0)).1 |= 1u64 << (row % p);
                }
            }
        }
        let keys: Vec<_> = wanted.iter().map(|(&(first, b), _)| store.key(kv_head, first + b as u32)).collect();
        let (locations, counts) = store.lookup_counted(&keys)?;
        let groups = counts
            .iter()
            .zip(wanted.iter())
            .map(|(&n, (&(_, b), (g, mask)))| GpuHackGroup { blocks: n as u32, rows: g.rows_in(b) as u32, mask: *mask })
            .collect();
        Ok(GpuHackWork { groups, locations, cpu, scan: plan.exact })
    })())
}

/// The GPU executor's inputs for one KV head of an exact plan over a layer whose indexed
/// rows are kv43 codes held by its index ([`gpu_kv43_work`]).
pub(crate) struct GpuKv43Work<'a> {
    /// The head's kv43 pieces in row order (a wave index's segments): the kernel reads their
    /// encoded rows from the layer's device copy.
    pub pieces: Vec<&'a Kv43Head>,
    layer: &'a Layer,
    kv_head: usize,
    plan: &'a HeadPlan,
}

impl GpuKv43Work<'_> {
    /// Rows of every piece's partial key group (f16, not yet encoded), together.
    pub fn partial_group_rows(&self) -> usize {
        self.pieces.iter().map(|p| p.rows() - p.encoded_rows()).sum()
    }

    /// Counts what the step reads of this head into `meter`: the steady zone's rows and the
    /// pieces' rows (the scan).
    pub fn meter(&self, d: usize, meter: &Meter) {
        for run in &self.layer.method.head_rows(self.kv_head, self.plan).steady {
            if let Run::Plain(pieces) = run {
                let (n, bytes) = plain_size(pieces, d);
                meter.zone(Zone::Steady).index_rows(n, bytes);
            }
        }
        let (n, bytes) = self.pieces.iter().fold((0, 0), |(n, b), head| (n + head.rows(), b + head.bytes()));
        meter.zone(Zone::Scan).index_rows(n, bytes);
    }
}

/// The f16 rows of an exact kv43 step that its kernel over codes leaves out, from row `from`
/// on, in the device's side-row layout (row after row, a row's KV heads together: what
/// `GpuBackend::append_kv43_side` takes): first every piece's partial key group in piece
/// order (`works`: one per KV head, as [`gpu_kv43_work`] made them), then the layer's steady
/// zone (sink, then tail). `len` is the rows there are in all. `None` when the layer keeps
/// its steady rows in another element type than f16.
pub(crate) fn kv43_side_rows(layer: &Layer, works: &[GpuKv43Work<'_>], from: usize) -> Option<SteadyRows> {
    let groups = works.first().map_or(0, GpuKv43Work::partial_group_rows);
    let steady = layer.method.clustered()?.steady_rows_from(from.saturating_sub(groups))?;
    if from >= groups {
        return Some(SteadyRows { len: groups + steady.len, ..steady });
    }
    let mut out = SteadyRows { len: groups + steady.len, keys: Vec::new(), values: Vec::new() };
    let d = works[0].pieces.first().map_or(0, |p| p.head_dim());
    for p in 0..works[0].pieces.len() {
        let n = works[0].pieces[p].rows() - works[0].pieces[p].encoded_rows();
        for r in 0..n {
            for w in works {
                let (k, v) = w.pieces[p].partial_group();
                out.keys.extend(k[r * d..(r + 1) * d].iter().map(|x| x.to_bits()));
                out.values.extend(v[r * d..(r + 1) * d].iter().map(|x| x.to_bits()));
            }
        }
    }
    let skip = from * works.len() * d;
    out.keys.drain(..skip);
    out.values.drain(..skip);
    out.keys.extend_from_slice(&steady.keys);
    out.values.extend_from_slice(&steady.values);
    Some(out)
}

/// The kv43 pieces a plan over a layer whose indexed rows are kv43 codes reads (a wave
/// index's segments: an exact plan scans each whole besides the plain steady zone, a sparse
/// plan's one selection per KV head retrieves rows of them, [`GpuKv43Work::listed`]), or
/// `None` when the plan or the rows are not that (one selection per query head; the caller
/// then looks for another path). The pieces come from the index directly: describing the
/// scan's runs (`head_rows`) cost ~70 µs per 128K-token step on the H100 host.
pub(crate) fn gpu_kv43_work<'a>(layer: &'a Layer, kv_head: usize, plan: &'a HeadPlan) -> Option<GpuKv43Work<'a>> {
    if !plan.exact && plan.selections.len() > 1 {
        return None;
    }
    let pieces = layer.method.clustered()?.kv43_segments(kv_head)?;
    Some(GpuKv43Work { pieces, layer, kv_head, plan })
}

/// The [`attnstore_kernels::Kv43ClusterTable`] of a layer whose indexed rows are kv43
/// segments of a wave index: per KV head and directory cluster, its encoded rows in the
/// layer's device copy (every segment's encoded rows, one after another, as
/// `GpuBackend::upload_kv43_pieces` lays them) and its side rows (its rows in a segment's
/// partial key group, among the partial groups in segment order, as [`kv43_side_rows`] puts
/// them first). `None` for other rows. A sparse kv43 step expands its chosen clusters
/// through it ([`GpuKv43Work::listed`]; a device-selected step would do the same on the
/// device).
#[cfg_attr(not(any(feature = "cuda", test)), allow(dead_code, reason = "the GPU path is built with cuda"))]
pub(crate) fn kv43_cluster_table(layer: &Layer, kv_heads: usize) -> Option<attnstore_kernels::Kv43ClusterTable> {
    let clustered = layer.method.clustered()?;
    let heads = (0..kv_heads)
        .map(|h| {
            let pieces = clustered.kv43_segments(h)?;
            let (mut coded_at, mut side_at) = (Vec::with_capacity(pieces.len()), Vec::with_capacity(pieces.len()));
            let (mut coded, mut side) = (0, 0);
            for p in &pieces {
                coded_at.push(coded);
                side_at.push(side);
                coded += p.encoded_rows();
                side += p.rows() - p.encoded_rows();
            }
            let spans = clustered.kv43_clusters(h)?;
            spans
                .iter()
                .map(|s| {
                    let (u, enc) = (s.unit as usize, pieces.get(s.unit as usize)?.encoded_rows());
                    let (start, end) = (s.start as usize, s.end as usize);
                    let rows = coded_at[u] + start.min(enc)..coded_at[u] + end.min(enc);
                    let first = side_at[u] + start.max(enc) - enc;
                    let last = side_at[u] + end.max(enc) - enc;
                    Some((rows, first as u32..last as u32))
                })
                .collect::<Option<Vec<_>>>()
        })
        .collect::<Option<Vec<_>>>()?;
    Some(attnstore_kernels::Kv43ClusterTable::new(&heads))
}

/// What a sparse kv43 step reads of one KV head ([`GpuKv43Work::listed`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Kv43HeadList {
    /// The retrieved encoded rows as 64-row blocks of the head's rows in the device copy
    /// (every piece's encoded rows, one after another) with the mask of rows kept.
    pub blocks: Vec<(u32, u64)>,
    /// The side rows attended: retrieved rows of the pieces' partial key groups, then the
    /// steady zone.
    pub side: Vec<u32>,
    /// Per query head of the group, the estimation zone's partial (empty where none).
    pub estimate: Vec<Partial>,
}

impl GpuKv43Work<'_> {
    /// The rows a sparse plan reads of this head on the device ([`Kv43HeadList`]): the
    /// selection's retrieved clusters expanded through the layer's cluster `table`
    /// ([`kv43_cluster_table`], made with its device copy) into blocks of the copy's codes
    /// and side rows of partial key groups, every steady row, and the estimation zone
    /// computed here (it is a few thousand centroids). `None` when the plan reads rows
    /// that are not a plain steady zone (the CPU then runs it). With `meter`, counts the
    /// steady, retrieved and estimated rows.
    pub fn listed(
        &self,
        d: usize,
        group: usize,
        table: &attnstore_kernels::Kv43ClusterTable,
        meter: Option<&Meter>,
    ) -> Option<Kv43HeadList> {
        let mut out = Kv43HeadList { blocks: Vec::new(), side: Vec::new(), estimate: vec![Partial::empty(d); group] };
        let rows = self.layer.method.head_rows(self.kv_head, self.plan);
        if let Some(sel) = self.plan.selections.first() {
            (out.blocks, out.side) = table.expand(self.kv_head, &sel.retrieve_ids);
            if let Some(m) = meter {
                let (n, bytes) = self.pieces.iter().fold((0, 0), |(n, b), p| (n + p.rows(), b + p.bytes()));
                m.zone(Zone::Retrieve).index_rows(sel.retrieve_tokens, sel.retrieve_tokens * bytes / n.max(1));
            }
        }
        fold_estimate(&rows, d, &mut out.estimate, meter);
        let (groups, mut steady) = (self.partial_group_rows(), 0);
        for run in &rows.steady {
            let Run::Plain(pieces) = run else { return None };
            let (n, bytes) = plain_size(pieces, d);
            steady += n;
            if let Some(m) = meter {
                m.zone(Zone::Steady).index_rows(n, bytes);
            }
        }
        out.side.extend((groups..groups + steady).map(|x| x as u32));
        Some(out)
    }
}

/// The layer as a GPU decode step that selects its clusters on the device reads it, or
/// `None` when it cannot be served that way (not a wave index, rows not homed in the buffer
/// manager, neither f16 rows nor `hack2` rows of a head dimension that is a multiple of 64,
/// nothing indexed). An error when a block is not in the Host arena (spilled or lost): run
/// on the CPU.
pub(crate) fn arena_layer(layer: &Layer, kv_heads: usize, d: usize) -> Option<Result<ArenaLayer>> {
    let clustered = layer.method.clustered()?;
    let store = layer.home.as_ref()?;
    // For 2-bit rows, each head's clusters in their value blocks (None: f16 rows).
    let encoded = match clustered.storage() {
        RowStorage::Homed if clustered.dtype() == DType::F16 => None,
        // The GPU kernels read HACK's per-token keys in value blocks of Π = 64 rows (as
        // gpu_hack_work), and the steady zone as f16 rows.
        RowStorage::HomedEncoded if clustered.dtype() == DType::F16 && d.is_multiple_of(64) => {
            let heads = (0..kv_heads).map(|h| clustered.encoded_clusters(h)).collect::<Option<Vec<_>>>()?;
            if !heads.iter().flatten().all(|(g, _)| g.params == HackParams::default()) {
                return None;
            }
            Some(heads)
        }
        _ => return None,
    };
    if clustered.indexed_tokens() == 0 {
        return None;
    }
    Some((|| {
        let row_bytes = d * 2;
        let per_block = store.rows_per_block(row_bytes)?;
        let block_bytes = store.buffers().layout().block_bytes();
        if 2 * per_block * row_bytes != block_bytes {
            return Err(Error::Index(attnstore_index::Error::InvalidParameter {
                what: "block size",
                message: format!(
                    "a device step addresses arena rows as slot × 2R + row: blocks of {block_bytes} bytes are not 2 × {per_block} rows of {row_bytes} bytes"
                ),
            }));
        }
        let stride = 2 * per_block;
        let mut rows: Vec<Vec<u32>> = Vec::with_capacity(kv_heads);
        let mut metas = Vec::with_capacity(kv_heads);
        let mut groups = encoded.as_ref().map(|_| attnstore_kernels::ArenaGroups::new(block_bytes));
        let mut block_pages: Vec<Vec<u8>> = Vec::new();
        for h in 0..kv_heads {
            metas.push(clustered.directory_f16(h));
            if let (Some(groups), Some(clusters)) = (groups.as_mut(), encoded.as_ref()) {
                block_pages.push(encoded_head(store, &clusters[h], h, groups)?);
                rows.push(Vec::new());
                continue;
            }
            let sizes = clustered.cluster_sizes(h);
            let keys: Vec<_> = (0..sizes.len() as u32).map(|id| store.key(h, id)).collect();
            let found = store.lookup(&keys)?;
            let mut map = Vec::with_capacity(clustered.indexed_tokens());
            let clusters = sizes.iter().enumerate().map(|(id, &size)| (id as u32, size as usize));
            for ((id, size), list) in clusters.clone().zip(blocks_of_clusters(&found, clusters, per_block, h)?) {
                for (b, location) in list.iter().enumerate() {
                    let (tier, slot) = location.home();
                    if tier != Tier::Host {
                        return Err(missing_rows(format!(
                            "cluster {id} of head {h} has a block homed on {tier:?}, not in the Host arena"
                        )));
                    }
                    let n = rows_in_block(size, b, per_block);
                    map.extend((0..n).map(|i| (slot as usize * stride + i) as u32));
                }
            }
            rows.push(map);
        }
        let heads: Vec<HeadClusters<'_>> = (0..kv_heads)
            .map(|h| HeadClusters {
                sizes: clustered.cluster_sizes(h),
                centroids: &metas[h].0,
                value_means: &metas[h].1,
                rows: &rows[h],
            })
            .collect();
        let wave = match groups {
            Some(groups) => ArenaWave::new_encoded(d, &heads, groups)?,
            None => ArenaWave::new(d, &heads)?,
        };
        Ok(ArenaLayer {
            wave,
            tokens_per_block: per_block,
            real_clusters: (0..kv_heads).map(|h| clustered.cluster_sizes(h).len()).collect(),
            context: store.context(),
            layer: store.layer(),
            block_pages,
        })
    })())
}

/// Adds KV head `h`'s value blocks (each segment's, in its Host-arena blocks) and its
/// `clusters` (`Clustered::encoded_clusters`) to `groups`; returns, per value-block id of
/// the head, the arena blocks it spans.
fn encoded_head(
    store: &BlockStore,
    clusters: &[(HomedGroups, std::ops::Range<u32>)],
    h: usize,
    groups: &mut attnstore_kernels::ArenaGroups,
) -> Result<Vec<u8>> {
    // Each segment's value blocks, pushed once, at the first cluster of the segment.
    let mut first_index = BTreeMap::<u32, u32>::new();
    let mut pages_of: Vec<u8> = Vec::new();
    for (g, range) in clusters {
        let first = match first_index.get(&g.first) {
            Some(&i) => i,
            None => {
                let keys: Vec<_> = g.ids().map(|id| store.key(h, id)).collect();
                let (locations, counts) = store.lookup_counted(&keys)?;
                let mut at = 0;
                let mut index = None;
                for (b, &n) in counts.iter().enumerate() {
                    let mut pages = Vec::with_capacity(n);
                    for location in &locations[at..at + n] {
                        let (tier, slot) = location.home();
                        if tier != Tier::Host {
                            return Err(missing_rows(format!(
                                "value block {} of head {h} has a block homed on {tier:?}, not in the Host arena",
                                g.first + b as u32
                            )));
                        }
                        pages.push(slot);
                    }
                    at += n;
                    let id = g.first + b as u32;
                    let i = groups.push_group(&pages, g.rows_in(b), id)?;
                    index.get_or_insert(i);
                    if pages_of.len() <= id as usize {
                        pages_of.resize(id as usize + 1, 0);
                    }
                    pages_of[id as usize] = n as u8;
                }
                let i = index.ok_or_else(|| missing_rows(format!("a segment of head {h} has no value block")))?;
                first_index.insert(g.first, i);
                i
            }
        };
        groups.push_cluster(first, range.clone())?;
    }
    groups.end_head();
    Ok(pages_of)
}

fn missing_rows(message: String) -> Error {
    Error::Index(attnstore_index::Error::MissingRows(message))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::Layer;
    use crate::spec::LayerKind;
    use attnstore_buffer::{BufferConfig, BufferManager};
    use attnstore_index::{AccessMethod, SelectionMode, WaveIndex, WaveParams, ZoneBudget};
    use attnstore_kernels::cpu::reference::rel_l2;
    use attnstore_kernels::random::SplitMix64;
    use attnstore_kernels::{AttnShape, HackParams, HackScratch, HackView, GROUP_PAGES};
    use half::f16;
    use std::sync::Arc;

    fn randn(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut g = SplitMix64::new(seed);
        (0..n).map(|_| g.normal() * scale).collect()
    }

    fn layer(method: Box<dyn AccessMethod>, home: Option<BlockStore>) -> Layer {
        Layer {
            kind: LayerKind::Global,
            method,
            home,
            reservation: None,
            version: 0,
            prefilled: true,
            rebuilding: false,
        }
    }

    /// Segments of 512 tokens (128 for decode) over 8 q / 2 kv heads of 64 dimensions.
    fn hack2_setup() -> (WaveParams, AttnShape) {
        let params = WaveParams { segment_tokens: 512, decode_segment_tokens: 128, ..WaveParams::default() };
        (params, AttnShape::new(8, 2, 64).unwrap())
    }

    /// A buffer manager of 8,192 2 KiB blocks in ordinary host memory, no Gpu tier.
    fn test_manager() -> Arc<BufferManager> {
        let config = BufferConfig { pinned_host: false, ..BufferConfig::new(8192, 0) };
        Arc::new(BufferManager::new(config).unwrap())
    }

    /// A wave index of 2-bit rows (`codec`) prefilled with `k`, `v` and homed in `manager` as
    /// context `context`, with its store.
    fn hack2_wave(
        manager: &Arc<BufferManager>,
        context: u64,
        codec: HackParams,
        k: &[f32],
        v: &[f32],
    ) -> (WaveIndex<f16>, BlockStore) {
        let (params, shape) = hack2_setup();
        let store = BlockStore::new(Arc::clone(manager), context, 0);
        let mut wave = WaveIndex::<f16>::new(params, shape.kv_heads, shape.head_dim)
            .unwrap()
            .with_codec(Some(codec))
            .unwrap()
            .with_home(Arc::new(store.clone()))
            .unwrap();
        wave.prefill(k, v).unwrap();
        (wave, store)
    }

    /// What a GPU homomorphic kernel computes from [`gpu_hack_work`], done here on the CPU:
    /// each listed value block's bytes read from its buffer-manager blocks, its masked rows
    /// attended with the 8-bit query, merged with the CPU's partials.
    fn emulate_gpu_hack_step(manager: &BufferManager, work: &GpuHackWork, q: &[f32], d: usize) -> (Vec<f32>, usize) {
        let mut parts = work.cpu.clone();
        let mut scratch = HackScratch::default();
        let reader = manager.reader();
        let mut rows = 0;
        let mut at = 0;
        for group in &work.groups {
            let mut bytes = Vec::new();
            let locations = &work.locations[at..at + group.blocks as usize];
            at += group.blocks as usize;
            for pin in reader.pin_all(locations) {
                bytes.extend_from_slice(&pin.expect("a block in memory pins"));
            }
            let aligned: Vec<u16> =
                bytes.chunks(2).map(|b| u16::from_le_bytes([b[0], *b.get(1).unwrap_or(&0)])).collect();
            let view =
                HackView::from_group(d, HackParams::default(), group.rows as usize, bytemuck::cast_slice(&aligned))
                    .unwrap();
            view.quantize_queries(q, parts.len(), &mut scratch);
            let runs: Vec<_> = (0..64).filter(|r| group.mask >> r & 1 == 1).map(|r| r..r + 1).collect();
            rows += runs.len();
            let mut sub = vec![Partial::empty(d); parts.len()];
            view.attend_quantized(1.0 / (d as f32).sqrt(), &runs, &mut sub, &mut scratch);
            parts.iter_mut().zip(&sub).for_each(|(p, s)| p.merge(s));
        }
        (parts.iter().flat_map(Partial::finish).collect(), rows)
    }

    #[test]
    fn gpu_hack_work_lists_the_blocks_and_rows_that_attend_as_the_cpu_executor_does() {
        let (params, shape) = hack2_setup();
        let (g, d) = (shape.group(), shape.head_dim);
        let (k, v) = (randn(shape.kv_len(3000), 51, 1.0), randn(shape.kv_len(3000), 52, 1.0));
        let manager = test_manager();
        let (wave, store) = hack2_wave(&manager, 1, HackParams::default(), &k, &v);
        let indexed = wave.stats().indexed_tokens;
        assert!(wave.stats().segments >= 3 && indexed > 2000, "{:?}", wave.stats());
        let layer = layer(Box::new(wave), Some(store));
        let wave = &layer.method;
        let sparse = ZoneBudget { retrieve_tokens: 300, estimate_tokens: usize::MAX, mode: SelectionMode::PerKvHead };
        for step in 0..3u64 {
            let q = randn(shape.query_len(), 60 + step, 2.0);
            for h in 0..shape.kv_heads {
                let qg = &q[h * g * d..(h + 1) * g * d];
                for plan in [wave.plan_exact(), wave.plan_head(h, qg, &sparse)] {
                    let mut scratch = attnstore_kernels::cpu::attention::Scratch::default();
                    let want: Vec<f64> =
                        super::super::attend_head(&layer, DType::F16, h, qg, d, &plan, &[], None, &mut scratch)
                            .unwrap()
                            .iter()
                            .flat_map(|p| p.finish())
                            .map(f64::from)
                            .collect();
                    let work = gpu_hack_work(&layer, h, qg, d, &plan, None).expect("homed 2-bit rows").unwrap();
                    assert_eq!(work.scan, plan.exact);
                    let (got, rows) = emulate_gpu_hack_step(&manager, &work, qg, d);
                    let expected_rows = if plan.exact { indexed } else { plan.selections[0].retrieve_tokens };
                    assert_eq!(rows, expected_rows, "step {step} head {h} exact={}", plan.exact);
                    let err = rel_l2(&got, &want);
                    assert!(err <= 1e-5, "step {step} head {h} exact={}: {err}", plan.exact);
                }
            }
        }
        // One selection per query head cannot share one row mask per KV head: the CPU runs it.
        let q = randn(shape.query_len(), 70, 2.0);
        let per_q = ZoneBudget { mode: SelectionMode::PerQueryHead, ..sparse };
        assert!(gpu_hack_work(&layer, 0, &q[..g * d], d, &wave.plan_head(0, &q[..g * d], &per_q), None).is_none());
        // Plain rows, or 2-bit rows kept in the index, are not served this way.
        let mut unhomed =
            WaveIndex::<f16>::new(params, 2, 64).unwrap().with_codec(Some(HackParams::default())).unwrap();
        unhomed.prefill(&k, &v).unwrap();
        let exact = unhomed.plan_exact();
        let unhomed = self::layer(Box::new(unhomed), None);
        assert!(gpu_hack_work(&unhomed, 0, &q[..g * d], d, &exact, None).is_none());
        // Homed blocks with per-channel keys (hack2c) have no GPU kernel: the CPU runs them.
        let per_channel = HackParams::default().with_keys(attnstore_kernels::KeyLayout::PerChannel);
        let (channel, store) = hack2_wave(&manager, 2, per_channel, &k, &v);
        let exact = channel.plan_exact();
        let channel = self::layer(Box::new(channel), Some(store));
        assert!(gpu_hack_work(&channel, 0, &q[..g * d], d, &exact, None).is_none());
    }

    /// A wave layer of 3,000 random rows (8 query / 2 KV heads, d = 64, `seed`) stored as kv43
    /// codes in segments of 512 prefill and 128 decode tokens: its parameters, shape, keys,
    /// values and the layer.
    fn kv43_wave_layer(seed: u64) -> (WaveParams, AttnShape, Vec<f32>, Vec<f32>, Layer) {
        let params = WaveParams { segment_tokens: 512, decode_segment_tokens: 128, ..WaveParams::default() };
        let shape = AttnShape::new(8, 2, 64).unwrap();
        let (k, v) = (randn(shape.kv_len(3000), seed, 1.0), randn(shape.kv_len(3000), seed + 1, 1.0));
        let kv43 = attnstore_kernels::Codec::Kv43(attnstore_kernels::Kv43Params::default());
        let mut wave = WaveIndex::<f16>::new(params, shape.kv_heads, shape.head_dim).unwrap().with_codec(kv43).unwrap();
        wave.prefill(&k, &v).unwrap();
        (params, shape, k, v, layer(Box::new(wave), None))
    }

    /// What the GPU kv43 step computes from [`gpu_kv43_work`] and [`kv43_side_rows`], its
    /// kernels emulated on the CPU (the CPU kernel over the pieces' encoded rows, plain
    /// attention over each KV head's side rows), equals the CPU executor's exact plan; the
    /// pieces are every segment, each read whole; the side rows from any row on are the tail
    /// of all of them; sparse plans and plain rows are not served.
    #[test]
    fn the_kv43_gpu_work_with_the_kernel_emulated_equals_the_cpu_executor() {
        let (params, shape, k, v, layer) = kv43_wave_layer(91);
        let (g, d, kvh) = (shape.group(), shape.head_dim, shape.kv_heads);
        let exact = layer.method.plan_exact();
        let stats = layer.method.stats();
        let q = randn(shape.query_len(), 93, 2.0);
        let works: Vec<_> =
            (0..kvh).map(|h| gpu_kv43_work(&layer, h, &exact).expect("kv43 rows in the index")).collect();
        let groups = works[0].partial_group_rows();
        assert!(groups > 0, "a segment with a partial key group");
        let side = kv43_side_rows(&layer, &works, 0).expect("f16 steady rows");
        assert_eq!(side.len, groups + (stats.tokens - stats.indexed_tokens), "partial groups, then sink and tail");
        assert_eq!(side.keys.len(), side.len * kvh * d);
        for from in [1, groups - 1, groups, groups + 3, side.len] {
            let tail = kv43_side_rows(&layer, &works, from).unwrap();
            assert_eq!(
                (tail.len, &tail.keys[..], &tail.values[..]),
                (side.len, &side.keys[from * kvh * d..], &side.values[from * kvh * d..]),
                "from {from}"
            );
        }
        let scale = 1.0 / (d as f32).sqrt();
        for (h, work) in works.iter().enumerate() {
            let qg = &q[h * g * d..(h + 1) * g * d];
            let mut scratch = attnstore_kernels::cpu::attention::Scratch::default();
            let want: Vec<f64> =
                super::super::attend_head(&layer, DType::F16, h, qg, d, &exact, &[], None, &mut scratch)
                    .unwrap()
                    .iter()
                    .flat_map(|p| p.finish())
                    .map(f64::from)
                    .collect();
            assert_eq!(
                work.pieces.iter().map(|p| p.rows()).sum::<usize>(),
                stats.indexed_tokens,
                "every segment, once"
            );
            let mut parts = vec![Partial::empty(d); g];
            for p in &work.pieces {
                p.attend_runs(qg, scale, &[0..p.encoded_rows()], &mut parts).unwrap();
            }
            // KV head h's side rows, out of the rows of every head.
            let head = |x: &[u16]| -> Vec<f16> {
                x.chunks_exact(d).skip(h).step_by(kvh).flatten().map(|&b| f16::from_bits(b)).collect()
            };
            let (sk, sv) = (head(&side.keys), head(&side.values));
            attnstore_kernels::cpu::attention::attend_spans(qg, scale, [(&sk[..], &sv[..])], &mut parts, &mut scratch);
            let got: Vec<f32> = parts.iter().flat_map(|p| p.finish()).collect();
            let err = rel_l2(&got, &want);
            assert!(err <= 1e-5, "head {h}: {err}");
        }
        // A plan of one selection per query head, or plain rows, are not served this way.
        let per_query =
            ZoneBudget { retrieve_tokens: 300, estimate_tokens: usize::MAX, mode: SelectionMode::PerQueryHead };
        assert!(gpu_kv43_work(&layer, 0, &layer.method.plan_head(0, &q[..g * d], &per_query)).is_none());
        let mut plain = WaveIndex::<f16>::new(params, kvh, d).unwrap();
        plain.prefill(&k, &v).unwrap();
        let plain = self::layer(Box::new(plain), None);
        assert!(gpu_kv43_work(&plain, 0, &plain.method.plan_exact()).is_none());
    }

    /// What the GPU step of a sparse plan over kv43 rows computes from
    /// [`GpuKv43Work::listed`], its kernels emulated on the CPU (the CPU kernel over the
    /// listed blocks' kept rows of each piece, plain attention over the listed side rows, the
    /// estimation partials folded in), equals the CPU executor's, with some retrieved rows in
    /// the pieces' partial key groups; the lists name each retrieved row once.
    #[test]
    fn the_kv43_sparse_gpu_lists_with_the_kernel_emulated_equal_the_cpu_executor() {
        let (_, shape, _, _, layer) = kv43_wave_layer(94);
        let (g, d, kvh) = (shape.group(), shape.head_dim, shape.kv_heads);
        let q = randn(shape.query_len(), 96, 2.0);
        let scale = 1.0 / (d as f32).sqrt();
        let budget = ZoneBudget { retrieve_tokens: 1200, estimate_tokens: usize::MAX, mode: SelectionMode::PerKvHead };
        let plans: Vec<HeadPlan> =
            (0..kvh).map(|h| layer.method.plan_head(h, &q[h * g * d..(h + 1) * g * d], &budget)).collect();
        let works: Vec<_> = (0..kvh).map(|h| gpu_kv43_work(&layer, h, &plans[h]).expect("kv43 rows")).collect();
        let side = kv43_side_rows(&layer, &works, 0).expect("f16 steady rows");
        let groups = works[0].partial_group_rows();
        let table = kv43_cluster_table(&layer, kvh).expect("kv43 segments");
        let mut in_groups = 0;
        for (h, work) in works.iter().enumerate() {
            let qg = &q[h * g * d..(h + 1) * g * d];
            let mut scratch = attnstore_kernels::cpu::attention::Scratch::default();
            let want: Vec<f64> =
                super::super::attend_head(&layer, DType::F16, h, qg, d, &plans[h], &[], None, &mut scratch)
                    .unwrap()
                    .iter()
                    .flat_map(|p| p.finish())
                    .map(f64::from)
                    .collect();
            let list = work.listed(d, g, &table, None).expect("one selection per KV head over kv43 pieces");
            assert!(list.blocks.windows(2).all(|w| w[0].0 < w[1].0), "blocks ascend");
            let mut side_rows = list.side.clone();
            side_rows.sort_unstable();
            side_rows.dedup();
            assert_eq!(side_rows.len(), list.side.len(), "each side row once");
            in_groups += list.side.iter().filter(|&&r| (r as usize) < groups).count();
            // The listed rows back in piece coordinates, as runs of consecutive rows.
            let mut parts = vec![Partial::empty(d); g];
            let mut first = 0;
            for p in &work.pieces {
                let enc = first..first + p.encoded_rows();
                let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
                for &(b, mask) in &list.blocks {
                    for r in (0..64).filter(|r| mask >> r & 1 == 1).map(|r| 64 * b as usize + r) {
                        if enc.contains(&r) {
                            match runs.last_mut() {
                                Some(last) if last.end == r - first => last.end += 1,
                                _ => runs.push(r - first..r - first + 1),
                            }
                        }
                    }
                }
                p.attend_runs(qg, scale, &runs, &mut parts).unwrap();
                first = enc.end;
            }
            let row = |x: &[u16], r: u32| -> Vec<f16> {
                let at = (r as usize * kvh + h) * d;
                x[at..at + d].iter().map(|&b| f16::from_bits(b)).collect()
            };
            let sk: Vec<f16> = list.side.iter().flat_map(|&r| row(&side.keys, r)).collect();
            let sv: Vec<f16> = list.side.iter().flat_map(|&r| row(&side.values, r)).collect();
            attnstore_kernels::cpu::attention::attend_spans(qg, scale, [(&sk[..], &sv[..])], &mut parts, &mut scratch);
            for (p, e) in parts.iter_mut().zip(&list.estimate) {
                p.merge(e);
            }
            assert!(list.estimate.iter().all(|e| e.l > 0.0), "every query head estimates some clusters");
            let got: Vec<f32> = parts.iter().flat_map(|p| p.finish()).collect();
            let err = rel_l2(&got, &want);
            assert!(err <= 1e-5, "head {h}: {err}");
        }
        assert!(in_groups > 0, "some retrieved rows in the pieces' partial key groups");
    }

    #[test]
    fn the_device_value_block_table_lists_what_the_host_planned_path_reads_for_any_selection() {
        let (_, shape) = hack2_setup();
        let (g, d) = (shape.group(), shape.head_dim);
        let (k, v) = (randn(shape.kv_len(3000), 81, 1.0), randn(shape.kv_len(3000), 82, 1.0));
        // 2 KiB blocks: 2 × 8 f16 rows of 64 dims, as the device step addresses the arena.
        let manager = test_manager();
        let (wave, store) = hack2_wave(&manager, 1, HackParams::default(), &k, &v);
        let layer = layer(Box::new(wave), Some(store));
        let arena = arena_layer(&layer, shape.kv_heads, d).expect("homed hack2 rows").unwrap();
        let groups = arena.wave.groups.as_ref().expect("a value-block table");
        assert!(arena.wave.row_map.is_empty());
        let clusters = arena.wave.clusters;
        let clustered = layer.method.clustered().unwrap();
        let q = randn(shape.query_len(), 83, 2.0);
        for h in 0..shape.kv_heads {
            let n = clustered.cluster_sizes(h).len();
            // Every cluster, the even ones, and a handful: the pieces of the chosen clusters,
            // merged per value block, are the blocks and rows the host-planned path reads.
            for chosen in [(0..n as u32).collect::<Vec<_>>(), (0..n as u32).step_by(2).collect(), vec![0, 3, 7]] {
                let qg = &q[h * g * d..(h + 1) * g * d];
                let plan = clustered.plan_head_retrieving(h, qg, &chosen);
                let work = gpu_hack_work(&layer, h, qg, d, &plan, None).unwrap().unwrap();
                let mut device = BTreeMap::<u32, (Vec<i32>, u32, u64)>::new();
                for &c in &chosen {
                    let at = h * (clusters + 1) + c as usize;
                    for p in groups.piece_bounds[at]..groups.piece_bounds[at + 1] {
                        let i = groups.piece_group[p as usize] as usize;
                        let pages = groups.pages[i * GROUP_PAGES..(i + 1) * GROUP_PAGES].to_vec();
                        let e = device.entry(groups.ids[i]).or_insert((pages, groups.rows[i], 0));
                        e.2 |= groups.piece_mask[p as usize];
                    }
                }
                assert_eq!(device.len(), work.groups.len(), "head {h}, {} clusters", chosen.len());
                let mut at = 0;
                for ((id, (pages, rows, mask)), want) in device.iter().zip(&work.groups) {
                    let slots: Vec<i32> =
                        work.locations[at..at + want.blocks as usize].iter().map(|l| l.home().1 as i32).collect();
                    at += want.blocks as usize;
                    assert_eq!((*rows, *mask), (want.rows, want.mask), "value block {id} of head {h}");
                    assert_eq!(pages[..slots.len()], slots[..], "value block {id} of head {h}");
                    assert!(pages[slots.len()..].iter().all(|&p| p == -1));
                    let spanned = arena.block_pages[h][*id as usize] as usize;
                    assert_eq!(spanned, slots.len());
                }
            }
        }
        // Per-channel keys have no device step.
        let per_channel = HackParams::default().with_keys(attnstore_kernels::KeyLayout::PerChannel);
        let (channel, store) = hack2_wave(&manager, 2, per_channel, &k, &v);
        assert!(arena_layer(&self::layer(Box::new(channel), Some(store)), shape.kv_heads, d).is_none());
    }
}
