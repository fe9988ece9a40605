//! The meta index of one head: every cluster of every segment in one flat array, so a
//! query scores all centroids with one pass over contiguous memory.

use crate::method::{RowSpan, Selection};
use crate::segment::ClusterMeta;
use attnstore_kernels::cpu::estimate::estimate_group_strided;
use attnstore_kernels::{Element, Partial};
use std::borrow::Cow;
use std::ops::Range;

/// Per-cluster meta data of one head across all its segments (RetroInfer's meta index):
/// mean key (the centroid used for scoring and estimation), mean value, size, and where the
/// cluster's rows lie. Stored in the context's dtype, so it is ≈ 2/16 of the KV bytes at
/// 16 tokens per cluster.
#[derive(Debug, Clone, Default)]
pub struct Directory<E> {
    pub(crate) centroids: Vec<E>,
    pub(crate) value_means: Vec<E>,
    pub(crate) sizes: Vec<u32>,
    pub(crate) spans: Vec<RowSpan>,
}

impl<E: Element> Directory<E> {
    /// Number of clusters.
    pub fn len(&self) -> usize {
        self.sizes.len()
    }

    /// True when no segment has been indexed yet.
    pub fn is_empty(&self) -> bool {
        self.sizes.is_empty()
    }

    /// Sizes (tokens) of all clusters.
    pub fn sizes(&self) -> &[u32] {
        &self.sizes
    }

    /// Adds the clusters of segment `unit`.
    pub(crate) fn push_segment(&mut self, unit: u32, metas: &[ClusterMeta]) {
        for m in metas {
            let mut row = vec![E::default(); m.centroid.len()];
            E::narrow(&m.centroid, &mut row);
            self.centroids.extend_from_slice(&row);
            E::narrow(&m.value_mean, &mut row);
            self.value_means.extend_from_slice(&row);
            self.sizes.push(m.end - m.start);
            self.spans.push(RowSpan { unit, start: m.start, end: m.end });
        }
    }

    /// The estimation zone of `sel`, ready to be estimated whole or in column ranges.
    ///
    /// When every cluster is either retrieved or estimated (the `rest` share), the zone runs
    /// over the whole directory in order with the retrieved clusters' weights at zero: the
    /// value means then stream from contiguous memory instead of being gathered through the
    /// id list (at 128K tokens, 8K clusters per head, the step's execution went from about
    /// 5.1 to 4.6 ms on a 2-core VM; the pass is bound by memory bandwidth either way).
    pub(crate) fn estimate_zone<'a>(&'a self, sel: &'a Selection) -> ClusterZone<'a, E> {
        let n = sel.estimate.len();
        if n > 0 && n + sel.retrieve_ids.len() == self.len() {
            let all = self.len();
            let mut scores = vec![f32::NEG_INFINITY; sel.heads * all];
            for (dense, listed) in scores.chunks_exact_mut(all).zip(sel.estimate_scores.chunks_exact(n)) {
                for (&id, &s) in sel.estimate.iter().zip(listed) {
                    dense[id as usize] = s;
                }
            }
            let sizes = self.sizes.iter().map(|&s| s as f32).collect();
            return ClusterZone { dir: self, ids: None, scores: Cow::Owned(scores), sizes, heads: sel.heads };
        }
        let sizes = sel.estimate.iter().map(|&id| self.sizes[id as usize] as f32).collect();
        ClusterZone {
            dir: self,
            ids: Some(&sel.estimate),
            scores: Cow::Borrowed(&sel.estimate_scores),
            sizes,
            heads: sel.heads,
        }
    }

    /// Bytes of the meta data.
    pub fn bytes(&self) -> usize {
        (self.centroids.len() + self.value_means.len()) * E::DTYPE.size_bytes()
            + self.sizes.len() * 4
            + self.spans.len() * std::mem::size_of::<RowSpan>()
    }
}

/// The clusters a selection estimates, as columns: each column is one cluster with its size
/// and every query head's score. Estimating disjoint column ranges and merging the partials
/// gives the whole zone's partials (up to rounding), so a long zone can be spread over threads.
pub(crate) struct ClusterZone<'a, E> {
    dir: &'a Directory<E>,
    /// Directory id of each column; `None` when the columns are the whole directory.
    ids: Option<&'a [u32]>,
    /// `heads × len()` scaled scores (`-inf` leaves a column out).
    scores: Cow<'a, [f32]>,
    sizes: Vec<f32>,
    heads: usize,
}

impl<E: Element> crate::rows::EstimateZone for ClusterZone<'_, E> {
    fn len(&self) -> usize {
        self.sizes.len()
    }

    fn partials(&self, cols: Range<usize>, d: usize) -> Vec<Partial> {
        let means = &self.dir.value_means;
        let id = |c: usize| self.ids.map_or(c, |ids| ids[c] as usize);
        estimate_group_strided(
            &self.scores[cols.start..],
            self.len(),
            &self.sizes[cols.clone()],
            |c| &means[id(cols.start + c) * d..][..d],
            d,
            self.heads,
        )
    }
}
