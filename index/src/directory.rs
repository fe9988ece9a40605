//! The meta index of one head: every cluster of every segment in one flat array, so a
//! query scores all centroids with one pass over contiguous memory.

use crate::method::RowSpan;
use crate::segment::ClusterMeta;
use attnstore_kernels::Element;

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

    /// Bytes of the meta data.
    pub fn bytes(&self) -> usize {
        (self.centroids.len() + self.value_means.len()) * E::DTYPE.size_bytes()
            + self.sizes.len() * 4
            + self.spans.len() * std::mem::size_of::<RowSpan>()
    }
}
