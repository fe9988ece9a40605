//! One layer's KV laid out for a whole wave-index decode step on a device: per KV head the
//! indexed tokens cluster after cluster (segmented spherical k-means on the centred keys, as
//! the wave index builds them), then the steady zone (attention sinks, then the local
//! window); beside the rows, the meta index (centroid = mean key, mean value and size of
//! every cluster) and each cluster's row range. The GPU path (`cuda::GpuBackend::upload_wave`)
//! takes it as it is; it is built on the CPU, so it is checked everywhere.

use crate::cpu::kmeans::{center_and_normalize, cluster_order, spherical_kmeans, KMeansParams};
use crate::element::first_non_finite;
use crate::error::{Error, Result};
use half::f16;
use half::slice::HalfFloatSliceExt;
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

impl LayoutParams {
    /// A typed error unless segments and clusters have a positive number of tokens.
    pub fn validate(&self) -> Result<()> {
        if self.segment_tokens == 0 || self.tokens_per_cluster == 0 {
            return Err(Error::InvalidArgument {
                what: "layout params",
                message: format!(
                    "segment_tokens and tokens_per_cluster must be positive, got {} and {}",
                    self.segment_tokens, self.tokens_per_cluster
                ),
            });
        }
        Ok(())
    }
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
    /// on the CPU (heads and segments in parallel).
    pub fn build(keys: &[f32], values: &[f32], kv_heads: usize, head_dim: usize, params: LayoutParams) -> Result<Self> {
        let cut = Cut::new(keys, values, kv_heads, head_dim, params)?;
        let orders = cut
            .jobs()
            .par_iter()
            .map(|&(h, s)| {
                let unit = cut.unit_rows(keys, h, s);
                let km = spherical_kmeans(
                    &unit,
                    head_dim,
                    KMeansParams { clusters: cut.clusters_of(s), max_iters: params.max_iters, seed: cut.seed(h, s) },
                )?;
                Ok(cluster_order(&km.assignment, cut.clusters_of(s), cut.segments[s].start))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(cut.assemble(keys, values, &orders))
    }

    /// [`ClusteredLayer::build`] entirely on the GPU: the f16 KV is copied to device memory
    /// (where a prefill would have left it), [`crate::cuda::GpuBackend::build_layout`] clusters
    /// and lays it out there, and the layout is copied back. Inputs are checked as `build`
    /// checks them.
    #[cfg(feature = "cuda")]
    pub fn build_on_device(
        gpu: &crate::cuda::GpuBackend,
        keys: &[f32],
        values: &[f32],
        kv_heads: usize,
        head_dim: usize,
        params: LayoutParams,
    ) -> Result<Self> {
        Cut::new(keys, values, kv_heads, head_dim, params)?;
        if head_dim != gpu.head_dim() {
            return Err(Error::ShapeMismatch {
                what: "head_dim of the GPU kernels",
                expected: gpu.head_dim(),
                got: head_dim,
            });
        }
        let kv = gpu.upload_f32(keys, values, kv_heads)?;
        gpu.build_layout(&kv, params)?.download(gpu)
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

/// How a layer is cut: validated shape, the segments of the indexed tokens, their clusters.
struct Cut {
    kv_heads: usize,
    d: usize,
    tokens: usize,
    sink: usize,
    steady: usize,
    segments: Vec<std::ops::Range<usize>>,
    params: LayoutParams,
}

impl Cut {
    fn new(keys: &[f32], values: &[f32], kv_heads: usize, d: usize, params: LayoutParams) -> Result<Self> {
        let per_head = kv_heads * d;
        if kv_heads == 0 || d == 0 || keys.len() != values.len() || !keys.len().is_multiple_of(per_head) {
            return Err(Error::ShapeMismatch {
                what: "keys/values (kv_heads × tokens × head_dim, equal lengths)",
                expected: keys.len() / per_head.max(1) * per_head.max(1),
                got: values.len(),
            });
        }
        params.validate()?;
        if let Some(bad) = first_non_finite(keys).or_else(|| first_non_finite(values).map(|i| keys.len() + i)) {
            return Err(Error::InvalidArgument {
                what: "keys/values",
                message: format!("element {bad} is not finite"),
            });
        }
        let tokens = keys.len() / per_head;
        let steady = (params.sink_tokens + params.local_tokens).min(tokens);
        let sink = params.sink_tokens.min(steady);
        let indexed = tokens - steady;
        let segments = (0..indexed)
            .step_by(params.segment_tokens)
            .map(|s| sink + s..sink + (s + params.segment_tokens).min(indexed))
            .collect();
        Ok(Self { kv_heads, d, tokens, sink, steady, segments, params })
    }

    /// Every (head, segment), heads outer.
    fn jobs(&self) -> Vec<(usize, usize)> {
        (0..self.kv_heads).flat_map(|h| (0..self.segments.len()).map(move |s| (h, s))).collect()
    }

    fn clusters_of(&self, s: usize) -> usize {
        self.segments[s].len().div_ceil(self.params.tokens_per_cluster)
    }

    fn seed(&self, h: usize, s: usize) -> u64 {
        self.params.seed ^ ((h as u64) << 32 | s as u64)
    }

    /// Segment `s`'s keys of head `h`, centred and normalized (what k-means clusters).
    fn unit_rows(&self, keys: &[f32], h: usize, s: usize) -> Vec<f32> {
        let (d, r) = (self.d, &self.segments[s]);
        let mut unit = keys[(h * self.tokens + r.start) * d..(h * self.tokens + r.end) * d].to_vec();
        center_and_normalize(&mut unit, d);
        unit
    }

    /// The layer from each job's rows in cluster order and its clusters' bounds (heads in
    /// parallel, then concatenated in order).
    fn assemble(&self, keys: &[f32], values: &[f32], orders: &[(Vec<u32>, Vec<u32>)]) -> ClusteredLayer {
        let (d, tokens, kv_heads) = (self.d, self.tokens, self.kv_heads);
        let indexed = tokens - self.steady;
        let clusters: usize = (0..self.segments.len()).map(|s| self.clusters_of(s)).sum();
        // Every head, also when nothing is indexed (then `orders` is empty and a head is its
        // steady zone alone).
        let per_head = self.segments.len();
        let heads: Vec<ClusteredLayer> = (0..kv_heads)
            .into_par_iter()
            .map(|h| {
                self.assemble_head(
                    &keys[h * tokens * d..(h + 1) * tokens * d],
                    &values[h * tokens * d..(h + 1) * tokens * d],
                    &orders[h * per_head..(h + 1) * per_head],
                )
            })
            .collect();
        let mut layer = ClusteredLayer {
            kv_heads,
            head_dim: d,
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
        for head in heads {
            layer.keys.extend_from_slice(&head.keys);
            layer.values.extend_from_slice(&head.values);
            layer.positions.extend_from_slice(&head.positions);
            layer.offsets.extend_from_slice(&head.offsets);
            layer.centroids.extend_from_slice(&head.centroids);
            layer.value_means.extend_from_slice(&head.value_means);
        }
        layer
    }

    /// One head's part of [`Cut::assemble`] (a one-head layer).
    fn assemble_head(&self, hk: &[f32], hv: &[f32], per_segment: &[(Vec<u32>, Vec<u32>)]) -> ClusteredLayer {
        let (d, tokens) = (self.d, self.tokens);
        let indexed = tokens - self.steady;
        let mut head = ClusteredLayer {
            kv_heads: 1,
            head_dim: d,
            rows: tokens,
            indexed,
            clusters: 0,
            keys: Vec::with_capacity(tokens * d),
            values: Vec::with_capacity(tokens * d),
            positions: Vec::with_capacity(tokens),
            offsets: Vec::new(),
            centroids: Vec::new(),
            value_means: Vec::new(),
        };
        head.keys.resize(tokens * d, f16::ZERO);
        head.values.resize(tokens * d, f16::ZERO);
        // One pass over the rows in cluster order: each row is converted into its place
        // (slice conversion: vectorized, F16C where the CPU has it) and summed into its
        // cluster's mean on the same read.
        let mut sum_k = vec![0.0f32; d];
        let mut sum_v = vec![0.0f32; d];
        let mut base = 0u32;
        let mut at = 0usize;
        let put = |head: &mut ClusteredLayer, t: usize, at: usize| {
            let (k, v) = (&hk[t * d..(t + 1) * d], &hv[t * d..(t + 1) * d]);
            head.keys[at * d..(at + 1) * d].convert_from_f32_slice(k);
            head.values[at * d..(at + 1) * d].convert_from_f32_slice(v);
            head.positions.push(t as u32);
            (k, v)
        };
        for (order, starts) in per_segment {
            for w in starts.windows(2) {
                head.offsets.push(base + w[0]);
                sum_k.fill(0.0);
                sum_v.fill(0.0);
                for &t in &order[w[0] as usize..w[1] as usize] {
                    let (k, v) = put(&mut head, t as usize, at);
                    at += 1;
                    sum_k.iter_mut().zip(k).for_each(|(s, x)| *s += x);
                    sum_v.iter_mut().zip(v).for_each(|(s, x)| *s += x);
                }
                let inv = 1.0 / (w[1] - w[0]).max(1) as f32;
                head.centroids.extend(sum_k.iter().map(|&x| f16::from_f32(x * inv)));
                head.value_means.extend(sum_v.iter().map(|&x| f16::from_f32(x * inv)));
            }
            base += order.len() as u32;
        }
        head.offsets.push(indexed as u32);
        for t in (0..self.sink).chain(tokens - (self.steady - self.sink)..tokens) {
            put(&mut head, t, at);
            at += 1;
        }
        debug_assert_eq!(at, tokens);
        head
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
    fn a_layer_shorter_than_the_steady_zone_is_its_steady_zone_alone() {
        let (kvh, d, tokens) = (2, 8, 50);
        let keys: Vec<f32> = (0..kvh * tokens * d).map(|i| i as f32).collect();
        let l = ClusteredLayer::build(&keys, &keys, kvh, d, LayoutParams::default()).unwrap();
        assert_eq!((l.rows, l.indexed, l.clusters), (tokens, 0, 0));
        assert_eq!(l.positions, (0..kvh).flat_map(|_| 0..tokens as u32).collect::<Vec<_>>());
        assert_eq!(l.offsets, vec![0; kvh]);
        assert_eq!(l.keys.len(), kvh * tokens * d);
        assert_eq!(l.keys[(tokens + 3) * d].to_f32(), ((tokens + 3) * d) as f32);
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
        // A value is counted after every key.
        let mut v = vec![0.0; 8];
        v[2] = f32::INFINITY;
        match ClusteredLayer::build(&[0.0; 8], &v, 1, 4, p) {
            Err(Error::InvalidArgument { message, .. }) => assert!(message.contains("element 10"), "{message}"),
            other => panic!("expected a typed error, got {:?}", other.map(|l| l.rows)),
        }
    }
}
