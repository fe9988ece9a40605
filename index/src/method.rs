//! The access-method contract and the plan data it produces (decide, then execute).

use crate::error::{Error, Result};
use crate::rows::HeadRows;
use attnstore_kernels::{DType, Element};
use half::f16;

/// How clusters are chosen for the query heads of one GQA group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SelectionMode {
    /// Every query head picks its own clusters (more accurate; reads up to `group×` more KV).
    PerQueryHead,
    /// One choice per KV head from the group's best score per cluster (one read serves all).
    #[default]
    PerKvHead,
}

impl SelectionMode {
    /// Short name for EXPLAIN and JSON.
    pub fn name(self) -> &'static str {
        match self {
            SelectionMode::PerQueryHead => "per-query-head",
            SelectionMode::PerKvHead => "per-kv-head",
        }
    }
}

/// Token budgets of one plan, already resolved from fractions and floors by the planner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZoneBudget {
    /// Tokens to attend exactly in the retrieval zone (beyond the steady zone).
    pub retrieve_tokens: usize,
    /// Tokens to estimate from cluster meta data; `usize::MAX` estimates every cluster
    /// that is not retrieved.
    pub estimate_tokens: usize,
    /// How clusters are chosen across a GQA group.
    pub mode: SelectionMode,
}

/// A run of rows `start..end` in storage unit `unit` (a segment of a wave index, the token
/// array of a flat index) of one KV head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RowSpan {
    /// Storage unit (segment number).
    pub unit: u32,
    /// First row.
    pub start: u32,
    /// One past the last row.
    pub end: u32,
}

impl RowSpan {
    /// Rows in the span.
    pub fn len(&self) -> usize {
        (self.end - self.start) as usize
    }
    /// True for an empty span.
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// Tokens in a batch of `keys`/`values` laid out `kv_heads × tokens × head_dim`, or a
/// shape error naming what was expected. Every access method checks its input with it
/// before changing anything.
pub(crate) fn batch_tokens(kv_heads: usize, head_dim: usize, keys: &[f32], values: &[f32]) -> Result<usize> {
    let row = kv_heads * head_dim;
    if !keys.len().is_multiple_of(row) {
        return Err(Error::ShapeMismatch {
            what: "keys (kv_heads × tokens × head_dim)",
            expected: keys.len() / row * row,
            got: keys.len(),
        });
    }
    if values.len() != keys.len() {
        return Err(Error::ShapeMismatch {
            what: "values (same shape as keys)",
            expected: keys.len(),
            got: values.len(),
        });
    }
    Ok(keys.len() / row)
}

/// Checks the shape every access method is created with.
pub(crate) fn check_shape(kv_heads: usize, head_dim: usize) -> Result<()> {
    if kv_heads == 0 || head_dim == 0 {
        return Err(Error::InvalidParameter {
            what: "shape",
            message: format!("kv_heads ({kv_heads}) and head_dim ({head_dim}) must be positive"),
        });
    }
    Ok(())
}

/// Appends `src` narrowed to the storage type.
pub(crate) fn push_narrow<E: Element>(dst: &mut Vec<E>, src: &[f32]) {
    let at = dst.len();
    dst.resize(at + src.len(), E::default());
    E::narrow(src, &mut dst[at..]);
}

/// Sorts spans and joins those that touch, so execution streams long runs.
pub(crate) fn coalesce(spans: &mut Vec<RowSpan>) {
    spans.sort_unstable();
    let mut out: Vec<RowSpan> = Vec::with_capacity(spans.len());
    for s in spans.drain(..) {
        match out.last_mut() {
            Some(last) if last.unit == s.unit && last.end == s.start => last.end = s.end,
            _ => out.push(s),
        }
    }
    *spans = out;
}

/// What one set of query heads (one head, or a whole GQA group) attends beyond the steady zone.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Selection {
    /// First query head (within the group) this selection serves.
    pub first_head: usize,
    /// Number of query heads it serves.
    pub heads: usize,
    /// Rows attended exactly (retrieval zone), coalesced.
    pub retrieve: Vec<RowSpan>,
    /// Clusters chosen for retrieval.
    pub retrieve_clusters: usize,
    /// Directory ids of the retrieved clusters, ascending (row order).
    pub retrieve_ids: Vec<u32>,
    /// Tokens attended exactly in the retrieval zone.
    pub retrieve_tokens: usize,
    /// Directory ids of the clusters estimated.
    pub estimate: Vec<u32>,
    /// Scaled scores of the estimated clusters, `heads × estimate.len()`.
    pub estimate_scores: Vec<f32>,
    /// Tokens represented by the estimated clusters.
    pub estimate_tokens: usize,
    /// Clusters (or tokens, for flat and PQ indexes) scored to make the choice.
    pub scored: usize,
    /// Bytes of meta data read to score them (centroids, keys, or PQ codes and codebooks).
    pub scored_bytes: usize,
    /// Clusters neither retrieved nor estimated.
    pub dropped_clusters: usize,
    /// Tokens neither attended nor estimated.
    pub dropped_tokens: usize,
}

/// The plan of one KV head for one query group: the steady zone plus selections.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct HeadPlan {
    /// Every token is attended exactly (no selections).
    pub exact: bool,
    /// Tokens in the steady zone (sink, pending and local window), attended exactly.
    pub steady_tokens: usize,
    /// Of the steady tokens, those waiting to be indexed (outside the local window).
    pub pending_tokens: usize,
    /// Retrieval and estimation choices; their head ranges cover the group exactly once.
    pub selections: Vec<Selection>,
}

/// Steady-zone rows for a device copy ([`Clustered::steady_rows_from`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SteadyRows {
    /// Rows in the whole zone.
    pub len: usize,
    /// Keys of the rows asked for, f16 bits, `rows × kv_heads × head_dim`.
    pub keys: Vec<u16>,
    /// Their values, same layout.
    pub values: Vec<u16>,
}

/// Sizes of an access method's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IndexStats {
    /// Tokens per KV head.
    pub tokens: usize,
    /// Bytes of stored keys and values (all heads).
    pub kv_bytes: usize,
    /// Bytes of index meta data: centroids, value means, sizes, offsets, positions.
    pub index_bytes: usize,
    /// Indexed segments per head.
    pub segments: usize,
    /// Clusters per head (summed over segments).
    pub clusters: usize,
    /// Tokens waiting to be indexed (outside the local window, not yet in a segment).
    pub pending_tokens: usize,
    /// Tokens in indexed segments (the rest are in the steady zone).
    pub indexed_tokens: usize,
}

/// An access method over the KV of all KV heads of one layer: it ingests KV, plans, and
/// names the rows a plan reads; it does not execute (the engine's executor does).
///
/// Contract:
/// - `append`/`prefill` validate their input completely before they change anything, and a
///   failure (e.g. the row home is full) leaves the method as it was;
/// - `plan_head` reads only meta data (centroids, codes), never KV rows, and never mutates;
/// - `head_rows` names rows without touching tiers: runs in the method's memory, clusters
///   or value blocks by their [`RowHome`](crate::RowHome) ids, and estimation zones;
/// - a plan made with budgets that cover every token (or `plan_exact`) names every token's
///   row exactly once, so executing it gives exactly the partials of full attention;
/// - only methods that checkpoint an index ([`Snapshots`]) or that a device step plans over
///   ([`Clustered`]) return them; the others implement nothing for it.
pub trait AccessMethod: RowSource + Send + Sync {
    /// Name for EXPLAIN and JSON (`"wave"`, `"flat"`, `"pq"`).
    fn name(&self) -> &'static str;
    /// Sizes of the stored data.
    fn stats(&self) -> IndexStats;
    /// Appends `n` decode tokens: `keys`/`values` are `kv_heads × n × head_dim`.
    fn append(&mut self, keys: &[f32], values: &[f32]) -> Result<()>;
    /// Appends a prefill batch (same layout as [`AccessMethod::append`]); methods that
    /// organize bulk data differently (larger segments) override it.
    fn prefill(&mut self, keys: &[f32], values: &[f32]) -> Result<()> {
        self.append(keys, values)
    }
    /// Chooses what query group `q` (`group × head_dim`) of KV head `kv_head` attends.
    fn plan_head(&self, kv_head: usize, q: &[f32], budget: &ZoneBudget) -> HeadPlan;
    /// A plan that attends every token exactly.
    fn plan_exact(&self) -> HeadPlan;
    /// The cluster directory a device step plans over, for clustered methods (wave).
    fn clustered(&self) -> Option<&dyn Clustered> {
        None
    }
    /// The handle of an index build running in the background, for methods that build one
    /// (PQ); `None` when the method is always ready. While a build runs, plans attend the
    /// tokens it covers exactly.
    fn build_handle(&self) -> Option<crate::BuildHandle> {
        None
    }
    /// Brings the index up to date with a background build that has finished: PQ encodes
    /// the tokens that left the local window while its codebooks trained (until then they
    /// are attended exactly in the steady zone, and the next append would encode them).
    /// `Ok(true)` when that changed what plans see; a no-op for other methods.
    fn catch_up(&mut self) -> Result<bool> {
        Ok(false)
    }
    /// The method's checkpointing, for methods that keep an index worth checkpointing
    /// (wave, PQ); `None`: recovery ingests the KV again.
    fn snapshots(&self) -> Option<&dyn Snapshots> {
        None
    }
    /// [`AccessMethod::snapshots`], to restore into.
    fn snapshots_mut(&mut self) -> Option<&mut dyn Snapshots> {
        None
    }
}

/// What a checkpoint keeps of an access method and how recovery restores it.
///
/// Contract: `layout`/`encoded_home` read and never mutate; `restore`/`restore_encoded`
/// take an *empty* method, check everything they are given before changing anything, and
/// fail with a typed error that leaves the method empty; a method restored from what it
/// reported plans and answers exactly as the method it came from.
pub trait Snapshots {
    /// The index structure a checkpoint keeps so recovery need not rebuild it (`None`:
    /// nothing worth keeping, or not built yet; recovery rebuilds from the KV).
    fn layout(&self) -> Option<IndexLayout>;
    /// The [`IndexLayout::indexed_end`] that [`Snapshots::layout`] would report, without
    /// copying the layout: a checkpoint asks first and copies only layouts that changed.
    fn layout_end(&self) -> Option<u64> {
        self.layout().map(|l| l.indexed_end())
    }
    /// Rebuilds this empty method from a checkpointed `layout` and the KV of the first
    /// [`IndexLayout::tokens`] tokens (same layout as [`AccessMethod::append`]). `Ok(false)`
    /// when the method keeps no layout (the caller then ingests the KV normally); a layout
    /// of another method, or one that does not fit, is a typed error that changes nothing.
    fn restore(&mut self, layout: &IndexLayout, keys: &[f32], values: &[f32]) -> Result<bool>;
    /// True when the encoded home holds rows only and a restore also needs the index's
    /// [`Snapshots::layout`] (a PQ index's codebooks); a wave home carries its whole
    /// index.
    fn home_needs_layout(&self) -> bool {
        false
    }
    /// Segments the index holds in 2-bit form (`hack2`), or `None` when it has no encoded
    /// home to checkpoint (see [`crate::WaveIndex::encoded_home`],
    /// [`crate::PqIndex::encoded_home`]).
    fn encoded_segments(&self) -> Option<usize> {
        None
    }
    /// The encoded home a checkpoint writes: zones, plain rows, segments `from_segment..`
    /// (an error when rows in the row home cannot be read back).
    fn encoded_home(&self, from_segment: usize) -> Option<Result<crate::EncodedHome>> {
        let _ = from_segment;
        None
    }
    /// Rebuilds this empty method from a checkpointed encoded home holding every segment.
    /// `Ok(false)` when the method keeps none; one that does not fit is a typed error that
    /// changes nothing.
    fn restore_encoded(&mut self, home: crate::EncodedHome) -> Result<bool> {
        let _ = home;
        Ok(false)
    }
}

/// The rows a plan of an access method reads, named without touching tiers (the executor's
/// view of a method).
///
/// Contract: for a plan the method made for `kv_head`, `head_rows` lists every row the plan
/// attends exactly once (steady runs, then an exact plan's scan, or per selection its
/// retrieved runs or home clusters and its estimation zone), in the order the executor
/// merges their partials; `exact_positions` names the same rows by token position.
pub trait RowSource {
    /// The rows the group's query heads read under `plan` (a plan this method made for
    /// `kv_head`), in the order their partials merge.
    fn head_rows<'a>(&'a self, kv_head: usize, plan: &'a HeadPlan) -> HeadRows<'a>;
    /// Token positions attended exactly by query head `j` of the group under `plan`
    /// (for recall measurements).
    fn exact_positions(&self, kv_head: usize, plan: &HeadPlan, j: usize) -> Vec<u32>;
}

/// Where a clustered method's indexed rows are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowStorage {
    /// In the method's memory (plain or 2-bit).
    Memory,
    /// Plain rows in the row home, one home cluster per directory cluster (same ids).
    Homed,
    /// 2-bit rows in the row home, one home cluster per value block.
    HomedEncoded,
}

/// A method organized in clusters with a directory of their meta data (wave): what a
/// device step needs to choose clusters itself and read their rows in place.
///
/// Contract: `cluster_sizes` and `directory_f16` list the same clusters in directory order;
/// with [`RowStorage::Homed`] cluster `c`'s rows are home cluster `c` of the KV head;
/// `plan_head_retrieving` plans exactly as `plan_head` would have with that choice.
pub trait Clustered: Sync {
    /// Where the indexed rows are.
    fn storage(&self) -> RowStorage;
    /// Storage type of plain rows.
    fn dtype(&self) -> DType;
    /// Tokens of every cluster of `kv_head`, in directory order.
    fn cluster_sizes(&self, kv_head: usize) -> &[u32];
    /// Centroids and value means of `kv_head`'s clusters as f16, `clusters × head_dim`.
    fn directory_f16(&self, kv_head: usize) -> (Vec<f16>, Vec<f16>);
    /// The first token after the last segment: it moves exactly when the indexed part
    /// changes, so a device copy of the directory is current while it is equal.
    fn indexed_end(&self) -> usize;
    /// Tokens in indexed segments.
    fn indexed_tokens(&self) -> usize;
    /// Steady-zone rows (sink, then pending and local tokens) from row `from` on, as f16
    /// bits row-major over KV heads, with the zone's length; `None` unless the method's
    /// element type is f16 (the steady zone is kept plain under every codec).
    fn steady_rows_from(&self, from: usize) -> Option<SteadyRows>;
    /// Every indexed segment's kv43 rows of `kv_head`, in row order (what an exact plan scans
    /// besides the steady zone); `None` unless every segment holds kv43 rows (and there is
    /// one).
    fn kv43_segments(&self, kv_head: usize) -> Option<Vec<&attnstore_kernels::Kv43Head>>;
    /// Per directory cluster of `kv_head`, in directory order, its rows as a span of its
    /// segment (the segment's place in [`Clustered::kv43_segments`]' list, the rows it
    /// occupies there: clusters are contiguous in their segment); `None` unless every
    /// segment holds kv43 rows (what a device step expands a chosen cluster through).
    fn kv43_clusters(&self, kv_head: usize) -> Option<Vec<RowSpan>>;
    /// With [`RowStorage::HomedEncoded`]: per directory cluster of `kv_head`, in directory
    /// order, the value blocks of the segment holding its rows and the rows it occupies
    /// there (clusters are contiguous in their segment); `None` for other storage.
    fn encoded_clusters(&self, kv_head: usize) -> Option<Vec<(crate::HomedGroups, std::ops::Range<u32>)>>;
    /// The plan of `kv_head` that retrieves exactly the directory clusters `retrieve` for
    /// the whole group and estimates every other cluster (what a device-selected step
    /// computed). Ids past the directory are ignored (the device's padding).
    fn plan_head_retrieving(&self, kv_head: usize, q: &[f32], retrieve: &[u32]) -> HeadPlan;
}

/// What a checkpoint keeps of an access method's index, so that recovery restores it from
/// the KV without training or clustering again.
#[derive(Debug, Clone, PartialEq)]
pub enum IndexLayout {
    /// A wave index's segments and clusters.
    Wave(crate::WaveLayout),
    /// A PQ index's codebooks and base codes.
    Pq(crate::PqSnapshot),
}

impl IndexLayout {
    /// The access method it belongs to (`"wave"`, `"pq"`).
    pub fn method(&self) -> &'static str {
        match self {
            IndexLayout::Wave(_) => "wave",
            IndexLayout::Pq(_) => "pq",
        }
    }

    /// Tokens whose KV a restore takes (a batch boundary of the KV the index was given).
    pub fn tokens(&self) -> u64 {
        match self {
            IndexLayout::Wave(l) => l.tokens,
            IndexLayout::Pq(s) => s.tokens,
        }
    }

    /// The end of the indexed range: it moves exactly when the kept structure changes, so
    /// a checkpoint rewrites a layout only when this differs from the one on disk.
    pub fn indexed_end(&self) -> u64 {
        match self {
            IndexLayout::Wave(l) => l.tail_start,
            IndexLayout::Pq(s) => s.end,
        }
    }

    /// True when it holds nothing a restore would save (a wave index without segments).
    pub fn is_empty(&self) -> bool {
        match self {
            IndexLayout::Wave(l) => l.segments.is_empty(),
            IndexLayout::Pq(_) => false,
        }
    }

    /// The error of restoring this layout into an access method `into` of another kind.
    pub(crate) fn wrong_method(&self, into: &'static str) -> Error {
        Error::InvalidParameter {
            what: "index layout",
            message: format!("a {} layout cannot restore a {into} index", self.method()),
        }
    }
}
