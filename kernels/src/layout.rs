//! One layer's KV laid out for a whole wave-index decode step on a device: per KV head the
//! indexed tokens cluster after cluster (segmented spherical k-means on the centred keys, as
//! the wave index builds them), then the steady zone (attention sinks, then the local
//! window); beside the rows, the meta index (centroid = mean key, mean value and size of
//! every cluster) and each cluster's row range. The GPU path (`cuda::GpuBackend::upload_wave`)
//! takes it as it is; it is built on the CPU, so it is checked everywhere.

use crate::cpu::kmeans::{center_and_normalize, spherical_kmeans, KMeansParams};
use crate::error::{Error, Result};
use half::f16;
use rayon::prelude::*;

/// How a [`ClusteredLayer`] is cut and clustered (the wave index's defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutParams {
    /// Tokens per segment clustered on its own.
    pub segment_tokens: usize,
    /// About one cluster per this many tokens.
    pub tokens_per_cluster: usize,
    /// Leading tokens kept in the steady zone (attention sinks).
    pub sink_tokens: usize,
    /// Trailing tokens kept in the steady zone (the local window).
    pub local_tokens: usize,
    /// K-means iterations at most.
    pub max_iters: usize,
    /// Seed of the k-means initializations.
    pub seed: u64,
}

impl Default for LayoutParams {
    fn default() -> Self {
        Self { segment_tokens: 8192, tokens_per_cluster: 16, sink_tokens: 4, local_tokens: 64, max_iters: 10, seed: 7 }
    }
}

/// See the module docs. Every array is per KV head, heads one after another; every head has
/// the same number of clusters (a segment of `s` tokens gets `⌈s / tokens_per_cluster⌉`;
/// k-means may leave some empty: size 0, an empty row range).
#[derive(Debug, Clone)]
pub struct ClusteredLayer {
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Rows per head: every token once.
    pub rows: usize,
    /// Rows per head that belong to clusters (`0..indexed`); `indexed..rows` is the steady zone.
    pub indexed: usize,
    /// Clusters per head.
    pub clusters: usize,
    /// Keys, `kv_heads × rows × head_dim`, in the layout's row order.
    pub keys: Vec<f16>,
    /// Values, same layout.
    pub values: Vec<f16>,
    /// Token position of every row, `kv_heads × rows`.
    pub positions: Vec<u32>,
    /// First row of every cluster, then `indexed`: `kv_heads × (clusters + 1)`.
    pub offsets: Vec<u32>,
    /// Mean key of every cluster, `kv_heads × clusters × head_dim` (zero when empty).
    pub centroids: Vec<f16>,
    /// Mean value of every cluster, same layout.
    pub value_means: Vec<f16>,
}

impl ClusteredLayer {
    /// Lays out `tokens` rows per head of `keys`/`values` (`kv_heads × tokens × head_dim`,
    /// f32), clustering the tokens between the sinks and the local window segment by segment
    /// (heads and segments in parallel).
    pub fn build(keys: &[f32], values: &[f32], kv_heads: usize, head_dim: usize, params: LayoutParams) -> Result<Self> {
        let per_head = kv_heads * head_dim;
        if kv_heads == 0 || head_dim == 0 || keys.len() != values.len() || !keys.len().is_multiple_of(per_head) {
            return Err(Error::ShapeMismatch {
                what: "keys/values (kv_heads × tokens × head_dim, equal lengths)",
                expected: keys.len() / per_head.max(1) * per_head.max(1),
                got: values.len(),
            });
        }
        if params.segment_tokens == 0 || params.tokens_per_cluster == 0 {
            return Err(Error::InvalidArgument {
                what: "layout params",
                message: format!(
                    "segment_tokens and tokens_per_cluster must be positive, got {} and {}",
                    params.segment_tokens, params.tokens_per_cluster
                ),
            });
        }
        if let Some(bad) = keys.iter().chain(values).position(|x| !x.is_finite()) {
            return Err(Error::InvalidArgument {
                what: "keys/values",
                message: format!("element {bad} is not finite"),
            });
        }
        let (d, tokens) = (head_dim, keys.len() / per_head);
        let steady = (params.sink_tokens + params.local_tokens).min(tokens);
        let sink = params.sink_tokens.min(steady);
        let indexed = tokens - steady;
        let segments: Vec<std::ops::Range<usize>> = (0..indexed)
            .step_by(params.segment_tokens)
            .map(|s| sink + s..sink + (s + params.segment_tokens).min(indexed))
            .collect();
        let clusters: usize = segments.iter().map(|s| s.len().div_ceil(params.tokens_per_cluster)).sum();
        // One job per (head, segment): its rows in cluster order and its clusters' bounds.
        let jobs: Vec<(usize, usize)> = (0..kv_heads).flat_map(|h| (0..segments.len()).map(move |s| (h, s))).collect();
        let built: Vec<(Vec<u32>, Vec<u32>)> = jobs
            .par_iter()
            .map(|&(h, s)| {
                let range = segments[s].clone();
                let head_keys = &keys[h * tokens * d..(h + 1) * tokens * d];
                let mut unit = head_keys[range.start * d..range.end * d].to_vec();
                center_and_normalize(&mut unit, d);
                let k = range.len().div_ceil(params.tokens_per_cluster);
                let seed = params.seed ^ ((h as u64) << 32 | s as u64);
                let km = spherical_kmeans(&unit, d, KMeansParams { clusters: k, max_iters: params.max_iters, seed })?;
                let mut counts = vec![0u32; k + 1];
                for &a in &km.assignment {
                    counts[a as usize + 1] += 1;
                }
                for c in 0..k {
                    counts[c + 1] += counts[c];
                }
                let starts = counts.clone();
                let mut order = vec![0u32; range.len()];
                for (i, &a) in km.assignment.iter().enumerate() {
                    order[counts[a as usize] as usize] = (range.start + i) as u32;
                    counts[a as usize] += 1;
                }
                Ok((order, starts))
            })
            .collect::<Result<_>>()?;
        let mut layer = Self {
            kv_heads,
            head_dim,
            rows: tokens,
            indexed,
            clusters,
            keys: Vec::with_capacity(keys.len()),
            values: Vec::with_capacity(keys.len()),
            positions: Vec::with_capacity(kv_heads * tokens),
            offsets: Vec::with_capacity(kv_heads * (clusters + 1)),
            centroids: Vec::with_capacity(kv_heads * clusters * d),
            value_means: Vec::with_capacity(kv_heads * clusters * d),
        };
        let mut sum_k = vec![0.0f32; d];
        let mut sum_v = vec![0.0f32; d];
        for (h, per_segment) in built.chunks(segments.len().max(1)).enumerate().take(kv_heads) {
            let (hk, hv) = (&keys[h * tokens * d..(h + 1) * tokens * d], &values[h * tokens * d..(h + 1) * tokens * d]);
            let mut base = 0u32;
            for (order, starts) in per_segment {
                for w in starts.windows(2) {
                    layer.offsets.push(base + w[0]);
                    sum_k.fill(0.0);
                    sum_v.fill(0.0);
                    for &t in &order[w[0] as usize..w[1] as usize] {
                        let t = t as usize;
                        sum_k.iter_mut().zip(&hk[t * d..(t + 1) * d]).for_each(|(s, x)| *s += x);
                        sum_v.iter_mut().zip(&hv[t * d..(t + 1) * d]).for_each(|(s, x)| *s += x);
                    }
                    let inv = 1.0 / (w[1] - w[0]).max(1) as f32;
                    layer.centroids.extend(sum_k.iter().map(|&x| f16::from_f32(x * inv)));
                    layer.value_means.extend(sum_v.iter().map(|&x| f16::from_f32(x * inv)));
                }
                base += order.len() as u32;
            }
            layer.offsets.push(indexed as u32);
            let steady_rows = (0..sink).chain(tokens - (steady - sink)..tokens);
            let all_rows =
                per_segment.iter().flat_map(|(order, _)| order.iter().map(|&t| t as usize)).chain(steady_rows);
            for t in all_rows {
                layer.keys.extend(hk[t * d..(t + 1) * d].iter().map(|&x| f16::from_f32(x)));
                layer.values.extend(hv[t * d..(t + 1) * d].iter().map(|&x| f16::from_f32(x)));
                layer.positions.push(t as u32);
            }
        }
        Ok(layer)
    }

    /// Rows of cluster `c` of head `h` (within the head).
    pub fn cluster_rows(&self, h: usize, c: usize) -> std::ops::Range<usize> {
        let o = &self.offsets[h * (self.clusters + 1)..];
        o[c] as usize..o[c + 1] as usize
    }

    /// Tokens of cluster `c` of head `h`.
    pub fn size(&self, h: usize, c: usize) -> usize {
        self.cluster_rows(h, c).len()
    }

    /// The largest cluster of any head.
    pub fn largest_cluster(&self) -> usize {
        (0..self.kv_heads)
            .flat_map(|h| (0..self.clusters).map(move |c| (h, c)))
            .map(|(h, c)| self.size(h, c))
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::SplitMix64;

    #[test]
    fn every_token_appears_once_clusters_are_contiguous_and_meta_is_their_mean() {
        let (kvh, d, tokens) = (2, 16, 700);
        let mut rng = SplitMix64::new(3);
        let keys: Vec<f32> = (0..kvh * tokens * d).map(|_| rng.normal()).collect();
        let values: Vec<f32> = (0..kvh * tokens * d).map(|_| rng.normal()).collect();
        let params = LayoutParams { segment_tokens: 256, ..LayoutParams::default() };
        let l = ClusteredLayer::build(&keys, &values, kvh, d, params).unwrap();
        assert_eq!((l.rows, l.indexed), (tokens, tokens - 68));
        // Segments of 256, 256, 120 tokens: 16 + 16 + 8 clusters.
        assert_eq!(l.clusters, 40);
        for h in 0..kvh {
            let pos = &l.positions[h * tokens..(h + 1) * tokens];
            let mut sorted = pos.to_vec();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..tokens as u32).collect::<Vec<_>>(), "a permutation of the tokens");
            assert_eq!(&pos[l.indexed..l.indexed + 4], &[0, 1, 2, 3], "sinks first in the steady zone");
            assert_eq!(pos[tokens - 1], tokens as u32 - 1, "local window last");
            assert_eq!(l.cluster_rows(h, l.clusters - 1).end, l.indexed);
            for c in 0..l.clusters {
                let rows = l.cluster_rows(h, c);
                assert!(rows.start <= rows.end);
                if rows.is_empty() {
                    continue;
                }
                for j in [0, d - 1] {
                    let mean = rows.clone().map(|r| keys[(h * tokens + pos[r] as usize) * d + j]).sum::<f32>()
                        / rows.len() as f32;
                    let got = l.centroids[(h * l.clusters + c) * d + j].to_f32();
                    assert!((got - mean).abs() < 2e-3, "centroid = mean key ({got} vs {mean})");
                }
                let row = rows.start;
                assert_eq!(l.keys[(h * tokens + row) * d], f16::from_f32(keys[(h * tokens + pos[row] as usize) * d]));
            }
        }
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        let p = LayoutParams::default();
        assert!(matches!(ClusteredLayer::build(&[0.0; 10], &[0.0; 10], 2, 4, p), Err(Error::ShapeMismatch { .. })));
        let zero = LayoutParams { tokens_per_cluster: 0, ..p };
        assert!(matches!(ClusteredLayer::build(&[0.0; 8], &[0.0; 8], 1, 4, zero), Err(Error::InvalidArgument { .. })));
        let mut k = vec![0.0; 8];
        k[5] = f32::NAN;
        assert!(matches!(ClusteredLayer::build(&k, &[0.0; 8], 1, 4, p), Err(Error::InvalidArgument { .. })));
    }
}
