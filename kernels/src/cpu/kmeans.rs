//! K-means for both indexes. Spherical (RetroInfer's wave index build): cosine assignment
//! of unit vectors to unit centroids, centroid = normalized member sum; callers centre keys
//! first so the shared offset of post-RoPE keys does not dominate the angles. Euclidean
//! (PQCache's product quantizer): nearest centroid by L2, centroid = member mean. Both share
//! one loop; assignment is a matrix product (`x·c`, minus `|c|²/2` for L2).

use super::gemm::matmul_transposed;
use crate::error::{Error, Result};
use crate::random::SplitMix64;

/// Rows scored against the centroids per matrix product (bounds the similarity buffer).
const ROW_BLOCK: usize = 512;

/// Parameters of one k-means run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KMeansParams {
    /// Number of clusters wanted (capped at the number of rows).
    pub clusters: usize,
    /// Upper bound on iterations; a run stops earlier once no assignment changes.
    pub max_iters: usize,
    /// Seed of the initial centroid choice.
    pub seed: u64,
}

/// The outcome of a k-means run.
#[derive(Debug, Clone, PartialEq)]
pub struct KMeans {
    /// Cluster of every row.
    pub assignment: Vec<u32>,
    /// Unit centroids, `clusters × d`.
    pub centroids: Vec<f32>,
    /// Number of clusters (≤ the requested number when there were fewer rows).
    pub clusters: usize,
    /// Iterations run (assignment passes after the initial one).
    pub iterations: usize,
    /// Whether the last iteration changed no assignment.
    pub converged: bool,
}

/// Subtracts the mean row from every row of `rows` (`n × d`) and scales each row to unit
/// length (zero rows stay zero). Returns the mean.
pub fn center_and_normalize(rows: &mut [f32], d: usize) -> Vec<f32> {
    let n = rows.len() / d.max(1);
    let mut mean = vec![0.0f32; d];
    for r in rows.chunks_exact(d) {
        for (m, x) in mean.iter_mut().zip(r) {
            *m += x;
        }
    }
    mean.iter_mut().for_each(|m| *m /= n.max(1) as f32);
    for r in rows.chunks_exact_mut(d) {
        for (x, m) in r.iter_mut().zip(&mean) {
            *x -= m;
        }
        normalize(r);
    }
    mean
}

fn normalize(r: &mut [f32]) {
    let norm = r.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        r.iter_mut().for_each(|x| *x /= norm);
    }
}

/// Spherical k-means over unit rows `x` (`n × d`). Single-threaded: the index runs many of
/// these (heads × segments) in parallel.
pub fn spherical_kmeans(x: &[f32], d: usize, params: KMeansParams) -> Result<KMeans> {
    kmeans(x, d, params, Metric::Cosine)
}

/// Euclidean (Lloyd) k-means over rows `x` (`n × d`): the codebook training of a product
/// quantizer. Single-threaded, like [`spherical_kmeans`].
pub fn l2_kmeans(x: &[f32], d: usize, params: KMeansParams) -> Result<KMeans> {
    kmeans(x, d, params, Metric::L2)
}

/// Index of the nearest of the `centroids` (`k × d`) by L2 distance for every row of `x`
/// (`n × d`), written to `out` (cleared first). This is how a product quantizer encodes
/// rows with an existing codebook.
pub fn nearest_centroids(x: &[f32], centroids: &[f32], d: usize, out: &mut Vec<u32>) -> Result<()> {
    check_rows("rows to encode", x, d)?;
    check_rows("centroids", centroids, d)?;
    let k = centroids.len() / d;
    if k == 0 {
        return Err(Error::ZeroDimension { what: "centroids" });
    }
    let bias = half_norms(centroids, d);
    let n = x.len() / d;
    out.clear();
    out.resize(n, 0);
    let mut best = vec![0.0f32; n];
    let mut sims = vec![0.0f32; ROW_BLOCK.min(n) * k];
    assign(x, d, &centroids[..k * d], &bias, k, &mut sims, out, &mut best);
    Ok(())
}

/// The `k` rows of `x` (`n × d`, `k ≤ n`) a k-means run seeded with `seed` starts from:
/// distinct rows drawn by a seeded partial Fisher–Yates shuffle. Shared with the GPU k-means
/// so that both start alike.
pub fn initial_centroids(x: &[f32], d: usize, k: usize, seed: u64) -> Vec<f32> {
    initial_rows(x.len() / d.max(1), k, seed).iter().flat_map(|&i| x[i * d..(i + 1) * d].to_vec()).collect()
}

/// Which rows [`initial_centroids`] takes from `n` rows for `k` clusters (`min(k, n)` of
/// them): the device build starts from the same rows without handing the rows to the host.
pub fn initial_rows(n: usize, k: usize, seed: u64) -> Vec<usize> {
    let k = k.min(n);
    let mut rng = SplitMix64::new(seed);
    let mut order: Vec<usize> = (0..n).collect();
    for i in 0..k {
        let j = i + rng.below(n - i);
        order.swap(i, j);
    }
    order.truncate(k);
    order
}

/// Rows grouped by cluster (a counting sort of `assignment`, `k` clusters): the row numbers
/// plus `first`, cluster after cluster in row order, and each cluster's first index in that
/// order, then the row count (`k + 1` bounds; an empty cluster has an empty range).
pub fn cluster_order(assignment: &[u32], k: usize, first: usize) -> (Vec<u32>, Vec<u32>) {
    let mut counts = vec![0u32; k + 1];
    for &a in assignment {
        counts[a as usize + 1] += 1;
    }
    for c in 0..k {
        counts[c + 1] += counts[c];
    }
    let starts = counts.clone();
    let mut order = vec![0u32; assignment.len()];
    for (i, &a) in assignment.iter().enumerate() {
        order[counts[a as usize] as usize] = (first + i) as u32;
        counts[a as usize] += 1;
    }
    (order, starts)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Metric {
    Cosine,
    L2,
}

fn check_rows(what: &'static str, x: &[f32], d: usize) -> Result<()> {
    if d == 0 || !x.len().is_multiple_of(d) {
        return Err(Error::ShapeMismatch { what, expected: x.len() / d.max(1) * d, got: x.len() });
    }
    Ok(())
}

/// `|c|²/2` per centroid: argmin |x−c|² = argmax (x·c − |c|²/2).
fn half_norms(centroids: &[f32], d: usize) -> Vec<f32> {
    centroids.chunks_exact(d).map(|c| 0.5 * c.iter().map(|v| v * v).sum::<f32>()).collect()
}

/// Assigns every row to its best centroid (`x·c − bias[c]`, highest wins); returns how many
/// assignments changed.
#[allow(clippy::too_many_arguments)]
fn assign(
    x: &[f32],
    d: usize,
    centroids: &[f32],
    bias: &[f32],
    k: usize,
    sims: &mut [f32],
    assignment: &mut [u32],
    best: &mut [f32],
) -> usize {
    let mut changed = 0usize;
    for (b, xb) in x.chunks(ROW_BLOCK * d).enumerate() {
        let rows = xb.len() / d;
        let s = &mut sims[..rows * k];
        matmul_transposed(xb, centroids, s, rows, k, d);
        let first = b * ROW_BLOCK;
        changed += scan(s, bias, &mut assignment[first..first + rows], &mut best[first..first + rows]);
    }
    changed
}

/// Each row of `sims` (rows × clusters) to its best centroid (`sims[c] − bias[c]`, highest
/// wins), into `assignment` and `best`; returns how many assignments changed.
fn scan(sims: &[f32], bias: &[f32], assignment: &mut [u32], best: &mut [f32]) -> usize {
    let mut changed = 0usize;
    for ((srow, a), b) in sims.chunks_exact(bias.len()).zip(assignment).zip(best) {
        let (arg, val) = best_centroid(srow, bias);
        *b = val;
        if *a != arg as u32 {
            *a = arg as u32;
            changed += 1;
        }
    }
    changed
}

/// The similarities a k-means run keeps between iterations (`rows × clusters` floats, at
/// most [`KEPT_SIMS`]): after an update only the centroids that moved are multiplied again.
/// Past the first iterations most clusters keep their members, and so their centroids bit
/// for bit (the same sum of the same rows in the same order), so most of the product would
/// recompute the same numbers: a wave segment's run (8,192 rows, 512 clusters) moves about
/// half of its centroids at the third iteration and a few percent by the tenth. Each entry of
/// the product is one row's dot product with one centroid, the same float operations however
/// many centroids share the call, so the similarities, and the run, are those of a full
/// product (a test compares them bit for bit).
struct KeptSims {
    /// `rows × clusters`, row-major.
    sims: Vec<f32>,
    /// The moved centroids, gathered (`moved × d`).
    gathered: Vec<f32>,
    /// One row block's product with the gathered centroids.
    block: Vec<f32>,
}

/// Largest similarity matrix a run keeps ([`KeptSims`]): 8 Mi floats, 32 MiB (a wave
/// segment's run keeps 16 MiB, against 1 MiB of row-block products without it; an index
/// build runs one per thread). Larger runs (a product quantizer's codebooks over every
/// token) multiply every centroid at every iteration.
const KEPT_SIMS: usize = 1 << 23;

impl KeptSims {
    fn new(n: usize, k: usize) -> Option<Self> {
        // No rows (and so no clusters): the plain path, which has nothing to multiply.
        let len = n.checked_mul(k).filter(|&len| len > 0 && len <= KEPT_SIMS)?;
        Some(Self { sims: vec![0.0; len], gathered: Vec::new(), block: Vec::new() })
    }

    /// Brings the similarities of the `moved` centroids up to date (all of them: `None`).
    fn refresh(&mut self, x: &[f32], d: usize, centroids: &[f32], moved: Option<&[usize]>) {
        let k = centroids.len() / d;
        let Some(moved) = moved.filter(|m| m.len() < k) else {
            for (xb, s) in x.chunks(ROW_BLOCK * d).zip(self.sims.chunks_mut(ROW_BLOCK * k)) {
                matmul_transposed(xb, centroids, s, xb.len() / d, k, d);
            }
            return;
        };
        if moved.is_empty() {
            return;
        }
        let m = moved.len();
        self.gathered.clear();
        self.gathered.extend(moved.iter().flat_map(|&c| &centroids[c * d..(c + 1) * d]));
        for (xb, s) in x.chunks(ROW_BLOCK * d).zip(self.sims.chunks_mut(ROW_BLOCK * k)) {
            let rows = xb.len() / d;
            self.block.resize(rows * m, 0.0);
            matmul_transposed(xb, &self.gathered, &mut self.block, rows, m, d);
            for (srow, brow) in s.chunks_exact_mut(k).zip(self.block.chunks_exact(m)) {
                for (&c, &v) in moved.iter().zip(brow) {
                    srow[c] = v;
                }
            }
        }
    }
}

/// Lanes of [`best_centroid`]'s running maxima (one AVX-512 vector, two AVX2 ones).
const LANES: usize = 16;

/// The first centroid with the highest `sims[c] − bias[c]` and that value; `(0, −∞)` when
/// none is above −∞ (NaN never wins). Lane `j` keeps the first maximum of the centroids
/// `c ≡ j (mod LANES)`, with no branch the compiler cannot turn into vector selects; the
/// lanes' maxima are then combined, ties to the lowest centroid, which is the first maximum
/// a scan in order finds: the same centroid as one.
fn best_centroid(sims: &[f32], bias: &[f32]) -> (usize, f32) {
    let whole = sims.len() / LANES * LANES;
    let (top, at) = lane_maxima(&sims[..whole], &bias[..whole]);
    let (mut arg, mut val) = (0usize, f32::NEG_INFINITY);
    for (&v, &c) in top.iter().zip(&at) {
        if v > val || (v == val && v > f32::NEG_INFINITY && (c as usize) < arg) {
            (arg, val) = (c as usize, v);
        }
    }
    for (c, (&s, &b)) in sims.iter().zip(bias).enumerate().skip(whole) {
        let v = s - b;
        if v > val {
            (arg, val) = (c, v);
        }
    }
    (arg, val)
}

/// Per lane `j`, the first maximum of `sims[c] − bias[c]` over `c ≡ j (mod LANES)` and its
/// centroid (`−∞` and 0 where none is above −∞); `sims.len()` a multiple of `LANES`.
#[cfg(not(all(target_arch = "x86_64", target_feature = "avx2")))]
fn lane_maxima(sims: &[f32], bias: &[f32]) -> ([f32; LANES], [u32; LANES]) {
    let mut top = [f32::NEG_INFINITY; LANES];
    let mut at = [0u32; LANES];
    for (c0, (s, b)) in sims.chunks_exact(LANES).zip(bias.chunks_exact(LANES)).enumerate() {
        for j in 0..LANES {
            let v = s[j] - b[j];
            if v > top[j] {
                (top[j], at[j]) = (v, (c0 * LANES + j) as u32);
            }
        }
    }
    (top, at)
}

/// [`lane_maxima`] with AVX2: LLVM turns the plain loop's index selects into a branch per
/// lane, which made the scan ~10% of an index build.
#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
fn lane_maxima(sims: &[f32], bias: &[f32]) -> ([f32; LANES], [u32; LANES]) {
    #[allow(unsafe_code, reason = "the call into a #[target_feature] kernel")]
    // SAFETY: compiled only when the build enables avx2 for the whole program (cfg above),
    // so every CPU that runs the binary has it; every slice read inside is bounds-checked.
    unsafe {
        lane_maxima_avx2(sims, bias)
    }
}

#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
#[target_feature(enable = "avx2")]
fn lane_maxima_avx2(sims: &[f32], bias: &[f32]) -> ([f32; LANES], [u32; LANES]) {
    use std::arch::x86_64::*;
    let load = |x: &[f32]| -> __m256 { bytemuck::pod_read_unaligned(bytemuck::cast_slice(x)) };
    let mut top = [_mm256_set1_ps(f32::NEG_INFINITY); 2];
    let mut at = [_mm256_setzero_si256(); 2];
    let mut ids = [_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)];
    let next = _mm256_set1_epi32(LANES as i32);
    for (s, b) in sims.chunks_exact(LANES).zip(bias.chunks_exact(LANES)) {
        for h in 0..2 {
            let v = _mm256_sub_ps(load(&s[8 * h..8 * h + 8]), load(&b[8 * h..8 * h + 8]));
            // Ordered `>`: false for a NaN, as the scalar comparison.
            let better = _mm256_cmp_ps::<_CMP_GT_OQ>(v, top[h]);
            top[h] = _mm256_blendv_ps(top[h], v, better);
            at[h] = _mm256_blendv_epi8(at[h], ids[h], _mm256_castps_si256(better));
            ids[h] = _mm256_add_epi32(ids[h], next);
        }
    }
    (bytemuck::cast(top), bytemuck::cast(at))
}

fn kmeans(x: &[f32], d: usize, params: KMeansParams, metric: Metric) -> Result<KMeans> {
    kmeans_with(x, d, params, metric, true).map(|(km, _)| km)
}

/// [`kmeans`], keeping the similarities between iterations where they fit when `keep`; also
/// returns how many iterations multiplied only the moved centroids.
fn kmeans_with(x: &[f32], d: usize, params: KMeansParams, metric: Metric, keep: bool) -> Result<(KMeans, usize)> {
    check_rows("k-means rows", x, d)?;
    if params.clusters == 0 {
        return Err(Error::ZeroDimension { what: "clusters" });
    }
    let n = x.len() / d;
    let k = params.clusters.min(n);
    let mut centroids = initial_centroids(x, d, k, params.seed);
    let mut assignment = vec![u32::MAX; n];
    let mut best = vec![0.0f32; n];
    let mut kept = if keep { KeptSims::new(n, k) } else { None };
    let mut partial = 0usize;
    let mut sims = if kept.is_some() { Vec::new() } else { vec![0.0f32; ROW_BLOCK.min(n) * k] };
    // The centroids that moved in the last update (`None`: every one, the first time).
    let mut moved: Option<Vec<usize>> = None;
    let (mut iterations, mut converged) = (0, false);
    loop {
        let bias = match metric {
            Metric::Cosine => vec![0.0; k],
            Metric::L2 => half_norms(&centroids, d),
        };
        let changed = match kept.as_mut() {
            Some(kept) => {
                partial += usize::from(moved.as_ref().is_some_and(|m| m.len() < k));
                kept.refresh(x, d, &centroids, moved.as_deref());
                scan(&kept.sims, &bias, &mut assignment, &mut best)
            }
            None => assign(x, d, &centroids, &bias, k, &mut sims, &mut assignment, &mut best),
        };
        if iterations > 0 && changed == 0 {
            converged = true;
            break;
        }
        if iterations == params.max_iters {
            break;
        }
        iterations += 1;
        let before = kept.is_some().then(|| centroids.clone());
        update_centroids(x, d, k, &assignment, &best, &mut centroids, metric);
        moved = before.map(|before| {
            let same = |c: usize| {
                let (a, b) = (&before[c * d..(c + 1) * d], &centroids[c * d..(c + 1) * d]);
                a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits())
            };
            (0..k).filter(|&c| !same(c)).collect()
        });
    }
    Ok((KMeans { assignment, centroids, clusters: k, iterations, converged }, partial))
}

/// Centroid = normalized sum (cosine) or mean (L2) of its members; an empty cluster is
/// re-seeded with the row that fits its own centroid worst, so no cluster id is wasted.
fn update_centroids(
    x: &[f32],
    d: usize,
    k: usize,
    assignment: &[u32],
    best: &[f32],
    centroids: &mut [f32],
    metric: Metric,
) {
    centroids.iter_mut().for_each(|c| *c = 0.0);
    let mut sizes = vec![0usize; k];
    for (r, &a) in x.chunks_exact(d).zip(assignment) {
        sizes[a as usize] += 1;
        for (c, v) in centroids[a as usize * d..(a as usize + 1) * d].iter_mut().zip(r) {
            *c += v;
        }
    }
    let empty: Vec<usize> = (0..k).filter(|&c| sizes[c] == 0).collect();
    if !empty.is_empty() {
        let mut worst: Vec<usize> = (0..best.len()).collect();
        worst.sort_unstable_by(|a, b| best[*a].total_cmp(&best[*b]));
        for (c, &row) in empty.iter().zip(&worst) {
            centroids[c * d..(c + 1) * d].copy_from_slice(&x[row * d..(row + 1) * d]);
        }
    }
    for (c, &size) in centroids.chunks_exact_mut(d).zip(&sizes) {
        match metric {
            Metric::Cosine => normalize(c),
            Metric::L2 if size > 0 => c.iter_mut().for_each(|v| *v /= size as f32),
            Metric::L2 => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scan in order that `best_centroid` replaces.
    fn first_best(sims: &[f32], bias: &[f32]) -> (usize, f32) {
        sims.iter().zip(bias).enumerate().fold((0, f32::NEG_INFINITY), |acc, (c, (&s, &b))| {
            let v = s - b;
            if v > acc.1 {
                (c, v)
            } else {
                acc
            }
        })
    }

    /// Rows around `topics` random directions (unit rows for the spherical metric).
    fn clustered_rows(n: usize, d: usize, topics: usize, seed: u64, unit: bool) -> Vec<f32> {
        let mut g = SplitMix64::new(seed);
        let centers = g.normals(topics * d);
        let mut rows = Vec::with_capacity(n * d);
        for _ in 0..n {
            let t = g.below(topics);
            let start = rows.len();
            rows.extend(centers[t * d..(t + 1) * d].iter().map(|c| c + 0.6 * g.normal()));
            if unit {
                normalize(&mut rows[start..]);
            }
        }
        rows
    }

    #[test]
    fn kept_similarities_give_the_run_of_full_products_bit_for_bit() {
        // (rows, d, clusters, topics): a wave segment's shape, row counts that are not a
        // multiple of the row block, more clusters than topics (clusters split and settle).
        for (i, &(n, d, k, topics)) in [(8192, 128, 512, 64), (1300, 64, 100, 10), (700, 16, 37, 50)].iter().enumerate()
        {
            for metric in [Metric::Cosine, Metric::L2] {
                let x = clustered_rows(n, d, topics, 11 + i as u64, metric == Metric::Cosine);
                let params = KMeansParams { clusters: k, max_iters: 12, seed: 5 };
                let (kept, partial) = kmeans_with(&x, d, params, metric, true).unwrap();
                let (full, none) = kmeans_with(&x, d, params, metric, false).unwrap();
                assert_eq!(none, 0);
                assert!(partial > 0, "n = {n}, k = {k}, {metric:?}: no iteration multiplied only moved centroids");
                assert_eq!(kept.assignment, full.assignment, "n = {n}, k = {k}, {metric:?}");
                assert_eq!((kept.iterations, kept.converged), (full.iterations, full.converged));
                let bits = |c: &[f32]| c.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&kept.centroids), bits(&full.centroids), "n = {n}, k = {k}, {metric:?}");
            }
        }
    }

    #[test]
    fn no_rows_make_an_empty_run_on_either_path() {
        for keep in [true, false] {
            for metric in [Metric::Cosine, Metric::L2] {
                let (km, _) =
                    kmeans_with(&[], 4, KMeansParams { clusters: 3, max_iters: 5, seed: 1 }, metric, keep).unwrap();
                assert!(km.assignment.is_empty() && km.centroids.is_empty() && km.clusters == 0, "{km:?}");
            }
        }
    }

    #[test]
    fn best_centroid_is_the_first_best_of_a_scan_in_order() {
        let mut g = SplitMix64::new(9);
        for k in [1, 5, 15, 16, 17, 31, 32, 33, 100, 512, 515] {
            for trial in 0..40 {
                // Few distinct values, so ties across lanes and the tail are common; some
                // −∞, NaN and +∞ biases.
                let mut sims: Vec<f32> = (0..k).map(|_| g.below(4) as f32).collect();
                let mut bias: Vec<f32> = (0..k).map(|_| g.below(3) as f32 * 0.5).collect();
                for _ in 0..trial % 4 {
                    let c = g.below(k);
                    match g.below(3) {
                        0 => sims[c] = f32::NEG_INFINITY,
                        1 => sims[c] = f32::NAN,
                        _ => bias[c] = f32::INFINITY,
                    }
                }
                if trial == 39 {
                    sims.iter_mut().for_each(|s| *s = f32::NAN);
                }
                let (want, got) = (first_best(&sims, &bias), best_centroid(&sims, &bias));
                assert_eq!(want.0, got.0, "k = {k}, trial {trial}: {sims:?} − {bias:?}");
                assert_eq!(want.1.to_bits(), got.1.to_bits(), "k = {k}, trial {trial}");
            }
        }
    }

    #[test]
    fn separated_directions_are_recovered_and_converge() {
        let d = 8;
        let mut g = SplitMix64::new(3);
        let mut rows = Vec::new();
        let mut truth = Vec::new();
        for i in 0..400 {
            let c = i % 4;
            for j in 0..d {
                let base = if j == c { 10.0 } else { 0.0 };
                rows.push(base + g.normal() * 0.3);
            }
            truth.push(c);
        }
        for r in rows.chunks_exact_mut(d) {
            normalize(r);
        }
        let km = spherical_kmeans(&rows, d, KMeansParams { clusters: 4, max_iters: 10, seed: 1 }).unwrap();
        assert!(km.converged);
        // Same partition up to relabelling: rows of one true cluster share one label.
        for c in 0..4 {
            let labels: std::collections::HashSet<u32> =
                truth.iter().zip(&km.assignment).filter(|(t, _)| **t == c).map(|(_, a)| *a).collect();
            assert_eq!(labels.len(), 1, "true cluster {c} split into {labels:?}");
        }
    }

    #[test]
    fn l2_kmeans_finds_separated_blobs_and_encoding_picks_the_nearest_centroid() {
        let d = 4;
        let mut g = SplitMix64::new(9);
        let centers = [[0.0f32, 0.0, 0.0, 0.0], [5.0, 5.0, 0.0, 0.0], [0.0, 0.0, -5.0, 5.0]];
        let mut rows = Vec::new();
        for i in 0..300 {
            rows.extend(centers[i % 3].iter().map(|c| c + g.normal() * 0.2));
        }
        let km = l2_kmeans(&rows, d, KMeansParams { clusters: 3, max_iters: 50, seed: 4 }).unwrap();
        assert!(km.converged && km.iterations < 50, "{} iterations", km.iterations);
        // Every centroid sits near one true centre (means, not unit vectors).
        for c in km.centroids.chunks_exact(d) {
            let nearest = centers
                .iter()
                .map(|t| t.iter().zip(c).map(|(a, b)| (a - b) * (a - b)).sum::<f32>())
                .fold(f32::INFINITY, f32::min);
            assert!(nearest < 0.05, "centroid {c:?} is {nearest} from every centre");
        }
        let mut codes = Vec::new();
        nearest_centroids(&rows, &km.centroids, d, &mut codes).unwrap();
        assert_eq!(codes, km.assignment);
        // Brute force on a few off-grid points.
        let probe = [2.4f32, 2.6, 0.1, 0.0, 0.1, -0.2, -4.0, 4.2];
        nearest_centroids(&probe, &km.centroids, d, &mut codes).unwrap();
        for (p, &code) in probe.chunks_exact(d).zip(&codes) {
            let dist = |c: &[f32]| p.iter().zip(c).map(|(a, b)| (a - b) * (a - b)).sum::<f32>();
            let want =
                (0..3).min_by(|&a, &b| dist(&km.centroids[a * d..][..d]).total_cmp(&dist(&km.centroids[b * d..][..d])));
            assert_eq!(Some(code as usize), want);
        }
        assert!(nearest_centroids(&probe[..5], &km.centroids, d, &mut codes).is_err());
    }

    #[test]
    fn more_clusters_than_rows_caps_at_rows_and_zero_clusters_is_an_error() {
        let rows = vec![1.0f32, 0.0, 0.0, 1.0];
        let km = spherical_kmeans(&rows, 2, KMeansParams { clusters: 5, max_iters: 3, seed: 0 }).unwrap();
        assert_eq!(km.clusters, 2);
        assert!(spherical_kmeans(&rows, 2, KMeansParams { clusters: 0, max_iters: 3, seed: 0 }).is_err());
    }
}
