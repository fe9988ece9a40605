//! Spherical k-means (RetroInfer's wave index build): cosine assignment of unit vectors to
//! unit centroids, centroid = normalized member sum. Callers centre keys first (subtract
//! the segment mean) so the shared offset of post-RoPE keys does not dominate the angles.

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
    if d == 0 || !x.len().is_multiple_of(d) {
        return Err(Error::ShapeMismatch { what: "k-means rows", expected: x.len() / d.max(1) * d, got: x.len() });
    }
    if params.clusters == 0 {
        return Err(Error::ZeroDimension { what: "clusters" });
    }
    let n = x.len() / d;
    let k = params.clusters.min(n);
    let mut rng = SplitMix64::new(params.seed);
    // Initial centroids: k distinct rows (partial Fisher–Yates).
    let mut order: Vec<usize> = (0..n).collect();
    for i in 0..k {
        let j = i + rng.below(n - i);
        order.swap(i, j);
    }
    let mut centroids: Vec<f32> = order[..k].iter().flat_map(|&i| x[i * d..(i + 1) * d].to_vec()).collect();
    let mut assignment = vec![u32::MAX; n];
    let mut best = vec![0.0f32; n];
    let mut sims = vec![0.0f32; ROW_BLOCK.min(n) * k];
    let (mut iterations, mut converged) = (0, false);
    loop {
        let mut changed = 0usize;
        for (b, xb) in x.chunks(ROW_BLOCK * d).enumerate() {
            let rows = xb.len() / d;
            let s = &mut sims[..rows * k];
            matmul_transposed(xb, &centroids, s, rows, k, d);
            for (i, srow) in s.chunks_exact(k).enumerate() {
                let (arg, val) =
                    srow.iter()
                        .enumerate()
                        .fold((0usize, f32::NEG_INFINITY), |acc, (c, &v)| if v > acc.1 { (c, v) } else { acc });
                let row = b * ROW_BLOCK + i;
                best[row] = val;
                if assignment[row] != arg as u32 {
                    assignment[row] = arg as u32;
                    changed += 1;
                }
            }
        }
        if iterations > 0 && changed == 0 {
            converged = true;
            break;
        }
        if iterations == params.max_iters {
            break;
        }
        iterations += 1;
        update_centroids(x, d, k, &assignment, &best, &mut centroids);
    }
    Ok(KMeans { assignment, centroids, clusters: k, iterations, converged })
}

/// Centroid = normalized sum of members; an empty cluster is re-seeded with the row that
/// fits its own centroid worst, so no cluster id is wasted.
fn update_centroids(x: &[f32], d: usize, k: usize, assignment: &[u32], best: &[f32], centroids: &mut [f32]) {
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
    for c in centroids.chunks_exact_mut(d) {
        normalize(c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn more_clusters_than_rows_caps_at_rows_and_zero_clusters_is_an_error() {
        let rows = vec![1.0f32, 0.0, 0.0, 1.0];
        let km = spherical_kmeans(&rows, 2, KMeansParams { clusters: 5, max_iters: 3, seed: 0 }).unwrap();
        assert_eq!(km.clusters, 2);
        assert!(spherical_kmeans(&rows, 2, KMeansParams { clusters: 0, max_iters: 3, seed: 0 }).is_err());
    }
}
