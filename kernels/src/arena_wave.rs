//! A wave index as a GPU decode step reads it when its indexed rows live in a shared arena
//! (the buffer manager's pinned Host blocks) rather than in one array per layer: the cluster
//! meta data, and for every indexed row, in cluster order, the arena row that holds it. The
//! index fills one in ([`ArenaWave::new`] checks it); the CUDA backend uploads it
//! (`GpuBackend::upload_arena_wave`). Plain data, so it exists on every machine.

use crate::error::{Error, Result};
use half::f16;

/// The meta index and row placement of one layer's wave index.
///
/// Heads may have different numbers of clusters (k-means drops empty ones); every head is
/// padded to the largest count with empty clusters (size 0, centroid 0), which hold no rows
/// and carry no estimation weight. Every head indexes the same tokens, so each head has
/// `indexed` rows.
#[derive(Debug, Clone, PartialEq)]
pub struct ArenaWave {
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Clusters per head (after padding).
    pub clusters: usize,
    /// Centroids (mean keys), `kv_heads × clusters × head_dim`.
    pub centroids: Vec<f16>,
    /// Mean values, `kv_heads × clusters × head_dim`.
    pub value_means: Vec<f16>,
    /// Tokens per cluster, `kv_heads × clusters`.
    pub sizes: Vec<u32>,
    /// Arena row of every indexed row, `kv_heads × indexed`: head `h`'s clusters in order,
    /// each cluster's rows in storage order. Row `i` of an arena of `R`-token blocks is K row
    /// `i mod 2R` of block `i / 2R` when `i mod 2R < R` (its V row is `R` rows later).
    pub row_map: Vec<u32>,
    /// Indexed rows per head (the sum of each head's sizes).
    pub indexed: usize,
}

impl ArenaWave {
    /// Pads each head's clusters (`heads[h]` = (sizes, centroids, value means, arena rows)
    /// of head `h`) to the largest count and checks the shapes: equal indexed rows per head,
    /// `head_dim` values per centroid and mean, one arena row per token, finite meta data.
    pub fn new(head_dim: usize, heads: &[HeadClusters<'_>]) -> Result<Self> {
        let bad = |message: String| Err(Error::InvalidArgument { what: "arena wave", message });
        if head_dim == 0 || heads.is_empty() {
            return bad(format!("needs a head dimension and at least one head, got {head_dim} and {}", heads.len()));
        }
        let clusters = heads.iter().map(|h| h.sizes.len()).max().unwrap_or(0);
        let indexed = heads[0].sizes.iter().map(|&s| s as usize).sum::<usize>();
        if clusters == 0 || indexed == 0 || indexed > i32::MAX as usize {
            return bad(format!("needs 1..2^31 indexed rows in at least one cluster, got {indexed}"));
        }
        let kv_heads = heads.len();
        let mut out = Self {
            kv_heads,
            head_dim,
            clusters,
            centroids: vec![f16::ZERO; kv_heads * clusters * head_dim],
            value_means: vec![f16::ZERO; kv_heads * clusters * head_dim],
            sizes: vec![0; kv_heads * clusters],
            row_map: Vec::with_capacity(kv_heads * indexed),
            indexed,
        };
        for (h, head) in heads.iter().enumerate() {
            let n = head.sizes.len();
            let rows = head.sizes.iter().map(|&s| s as usize).sum::<usize>();
            if rows != indexed || head.rows.len() != indexed {
                return bad(format!(
                    "head {h} has {rows} rows in its clusters and {} arena rows; head 0 has {indexed}",
                    head.rows.len()
                ));
            }
            if head.centroids.len() != n * head_dim || head.value_means.len() != n * head_dim {
                return bad(format!("head {h}: {n} clusters need {} centroid and mean values", n * head_dim));
            }
            if let Some(i) = head.centroids.iter().chain(head.value_means).position(|x| !x.is_finite()) {
                return bad(format!("head {h}: meta data element {i} is not finite"));
            }
            let at = h * clusters * head_dim;
            out.centroids[at..at + n * head_dim].copy_from_slice(head.centroids);
            out.value_means[at..at + n * head_dim].copy_from_slice(head.value_means);
            out.sizes[h * clusters..h * clusters + n].copy_from_slice(head.sizes);
            out.row_map.extend_from_slice(head.rows);
        }
        Ok(out)
    }

    /// Row bounds of every cluster in the head's cluster order, `kv_heads × (clusters + 1)`.
    pub fn offsets(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.kv_heads * (self.clusters + 1));
        for sizes in self.sizes.chunks(self.clusters) {
            let mut at = 0u32;
            out.push(0);
            for &s in sizes {
                at += s;
                out.push(at);
            }
        }
        out
    }

    /// The largest cluster.
    pub fn largest_cluster(&self) -> usize {
        self.sizes.iter().copied().max().unwrap_or(0) as usize
    }

    /// One past the highest arena row named.
    pub fn arena_rows_needed(&self) -> usize {
        self.row_map.iter().copied().max().map_or(0, |r| r as usize + 1)
    }
}

/// One KV head's clusters for [`ArenaWave::new`].
#[derive(Debug, Clone, Copy)]
pub struct HeadClusters<'a> {
    /// Tokens per cluster.
    pub sizes: &'a [u32],
    /// Centroids, `clusters × head_dim`.
    pub centroids: &'a [f16],
    /// Mean values, `clusters × head_dim`.
    pub value_means: &'a [f16],
    /// Arena row of each indexed row, clusters in order.
    pub rows: &'a [u32],
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head<'a>(sizes: &'a [u32], meta: &'a [f16], rows: &'a [u32]) -> HeadClusters<'a> {
        HeadClusters { sizes, centroids: &meta[..sizes.len() * 2], value_means: &meta[..sizes.len() * 2], rows }
    }

    #[test]
    fn heads_are_padded_to_the_largest_cluster_count_and_offsets_follow_the_sizes() {
        let meta = vec![f16::ONE; 6];
        let w = ArenaWave::new(2, &[head(&[2, 1, 1], &meta, &[0, 1, 8, 9]), head(&[3, 1], &meta, &[16, 17, 18, 24])])
            .unwrap();
        assert_eq!((w.clusters, w.indexed), (3, 4));
        assert_eq!(w.sizes, [2, 1, 1, 3, 1, 0]);
        assert_eq!(w.offsets(), [0, 2, 3, 4, 0, 3, 4, 4]);
        assert_eq!(w.centroids[10..12], [f16::ZERO, f16::ZERO], "the padded cluster's centroid is zero");
        assert_eq!((w.largest_cluster(), w.arena_rows_needed()), (3, 25));
    }

    #[test]
    fn bad_shapes_and_meta_data_are_typed_errors() {
        let meta = vec![f16::ONE; 6];
        let nan = vec![f16::NAN; 6];
        for heads in [
            vec![head(&[2], &meta, &[0, 1]), head(&[3], &meta, &[0, 1, 2])], // unequal rows
            vec![head(&[2], &meta, &[0])],                                   // a row missing
            vec![head(&[2], &nan, &[0, 1])],                                 // NaN centroid
            vec![head(&[0], &meta, &[])],                                    // nothing indexed
            vec![],
        ] {
            assert!(matches!(ArenaWave::new(2, &heads), Err(Error::InvalidArgument { .. })));
        }
    }
}
