//! What an access method's plan reads, named without touching tiers: the executor (in the
//! engine) gathers these rows, runs the zone kernels and merges. A [`HeadRows`] lists, for
//! one KV head under one [`HeadPlan`](crate::HeadPlan), the steady zone's runs, an exact
//! plan's scan, and per selection the retrieved runs or clusters and the estimation zone.

use attnstore_kernels::{DType, Element, HackParams, HackRows, HackView, Kv43Head, Partial};
use half::{bf16, f16};
use std::ops::Range;

/// Plain key and value rows of one storage type, `rows × head_dim` each, in the index's
/// memory.
#[derive(Debug, Clone, Copy)]
pub enum PlainRows<'a> {
    /// f32 rows.
    F32(&'a [f32], &'a [f32]),
    /// f16 rows.
    F16(&'a [f16], &'a [f16]),
    /// bf16 rows.
    Bf16(&'a [bf16], &'a [bf16]),
}

impl<'a> PlainRows<'a> {
    /// The rows `keys`/`values` of element type `E`.
    pub fn of<E: Element>(keys: &'a [E], values: &'a [E]) -> Self {
        use bytemuck::cast_slice as c;
        match E::DTYPE {
            DType::F32 => Self::F32(c(keys), c(values)),
            DType::F16 => Self::F16(c(keys), c(values)),
            DType::Bf16 => Self::Bf16(c(keys), c(values)),
        }
    }
}

/// A segment's plain rows homed in the [`RowHome`](crate::RowHome), one home cluster per
/// directory cluster: cluster `first + c` holds the segment's rows `starts[c]..starts[c+1]`.
#[derive(Debug, Clone, Copy)]
pub struct HomedClusters<'a> {
    /// Home cluster id of the segment's first cluster (its clusters have consecutive ids).
    pub first: u32,
    /// First row of every cluster, then the segment's row count.
    pub starts: &'a [u32],
    /// Storage type of the rows.
    pub dtype: DType,
}

impl HomedClusters<'_> {
    /// The home clusters (id, rows within the cluster) that segment rows `range` lie in.
    pub fn clusters_of(&self, range: Range<usize>) -> impl Iterator<Item = (u32, Range<usize>)> + '_ {
        let c0 = self.starts.partition_point(|&s| s as usize <= range.start).saturating_sub(1);
        let end = range.end;
        (c0..self.starts.len().saturating_sub(1)).take_while(move |&c| (self.starts[c] as usize) < end).map(move |c| {
            let (cs, ce) = (self.starts[c] as usize, self.starts[c + 1] as usize);
            (self.first + c as u32, range.start.max(cs) - cs..range.end.min(ce) - cs)
        })
    }
}

/// A segment's 2-bit rows homed in the [`RowHome`](crate::RowHome) as value blocks of Π
/// rows (`HackRows::group_bytes`): value block `b` is home cluster `first + b`. Value blocks
/// span directory clusters, so the unit homed is the value block.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HomedGroups {
    /// Home cluster id of value block 0.
    pub first: u32,
    /// Value blocks.
    pub count: u32,
    /// Rows of the segment.
    pub rows: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// The codec's parameters.
    pub params: HackParams,
}

impl HomedGroups {
    /// Rows of value block `b` (Π, or fewer for the last).
    pub fn rows_in(&self, b: usize) -> usize {
        let p = self.params.partition;
        (self.rows - b * p).min(p)
    }

    /// Bytes of value block `b` in the group layout.
    pub fn len_of(&self, b: usize) -> usize {
        HackView::group_len(self.head_dim, self.params, self.rows_in(b))
    }

    /// Bytes of all value blocks in the group layout: every block but the last holds Π
    /// rows, so two sizes, not one per block (the planner asks for these bytes at every step).
    pub fn bytes(&self) -> usize {
        match self.count as usize {
            0 => 0,
            n => (n - 1) * self.len_of(0) + self.len_of(n - 1),
        }
    }

    /// Home cluster ids of all value blocks.
    pub fn ids(&self) -> Range<u32> {
        self.first..self.first + self.count
    }
}

/// One run of rows attended in one kernel pass.
#[derive(Debug, Clone)]
pub enum Run<'a> {
    /// Plain rows in the index's memory, all pieces of one type, attended in one pass.
    Plain(Vec<PlainRows<'a>>),
    /// 2-bit rows in the index's memory: rows `ranges` of them.
    Encoded {
        /// The rows.
        rows: &'a HackRows,
        /// Row ranges to attend.
        ranges: Vec<Range<usize>>,
    },
    /// Plain rows of a segment homed per cluster: segment rows `ranges`.
    Homed {
        /// The segment's clusters.
        clusters: HomedClusters<'a>,
        /// Segment row ranges to attend.
        ranges: Vec<Range<usize>>,
    },
    /// kv43 rows in the index's memory: rows `ranges` of them (attended on their codes,
    /// the partial key group's f16 rows exactly).
    Kv43 {
        /// The rows.
        rows: &'a Kv43Head,
        /// Row ranges to attend.
        ranges: Vec<Range<usize>>,
    },
    /// 2-bit rows of a segment homed as value blocks: segment rows `ranges`.
    HomedGroups {
        /// The segment's value blocks.
        groups: HomedGroups,
        /// Segment row ranges to attend.
        ranges: Vec<Range<usize>>,
    },
}

impl Run<'_> {
    /// The 2-bit parameters of an encoded run (queries are quantized for them once a step).
    pub fn hack(&self) -> Option<HackParams> {
        match self {
            Run::Encoded { rows, .. } => Some(rows.params()),
            Run::HomedGroups { groups, .. } => Some(groups.params),
            _ => None,
        }
    }
}

/// The estimation zone of a selection: columns (clusters) whose partials are computed from
/// meta data (mean values, sizes, scores). Disjoint column ranges merge into the whole.
pub trait EstimateZone: Sync {
    /// Columns.
    fn len(&self) -> usize;
    /// True when there is nothing to estimate.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The partials of the selection's query heads over columns `cols` (`d`: head
    /// dimension).
    fn partials(&self, cols: Range<usize>, d: usize) -> Vec<Partial>;
}

/// What one selection (a set of query heads of the group) reads beyond the steady zone.
pub struct SelectionRows<'a> {
    /// First query head (within the group) it serves.
    pub first_head: usize,
    /// Query heads it serves.
    pub heads: usize,
    /// Retrieved rows as jobs: each job's runs are attended in order into fresh partials,
    /// jobs may run in parallel, and their partials merge in job order.
    pub retrieve: Vec<Vec<Run<'a>>>,
    /// Retrieved whole clusters of plain rows homed in the row home, `(home cluster id,
    /// rows)` in the selection's `retrieve_ids` order (the engine reads them from the blocks
    /// the plan recorded). Their jobs come before `retrieve`'s.
    pub clusters: Vec<(u32, usize)>,
    /// The estimation zone (`None`: nothing estimated); its jobs come last.
    pub estimate: Option<Box<dyn EstimateZone + 'a>>,
}

/// Everything a KV head's plan reads, in the order partials are merged.
#[derive(Default)]
pub struct HeadRows<'a> {
    /// Runs attended first, one after another, by every query head of the group (the
    /// steady zone; a whole plan for methods that read everything this way).
    pub steady: Vec<Run<'a>>,
    /// An exact plan's other rows, as independent runs (parallel jobs merged in order).
    pub scan: Vec<Run<'a>>,
    /// A sparse plan's selections.
    pub selections: Vec<SelectionRows<'a>>,
}

impl HeadRows<'_> {
    /// The first 2-bit parameters any run of the scan or of a selection's retrieval uses.
    pub fn hack(&self) -> Option<HackParams> {
        self.scan.iter().chain(self.selections.iter().flat_map(|s| s.retrieve.iter().flatten())).find_map(Run::hack)
    }
}
