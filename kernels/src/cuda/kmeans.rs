//! Segmented spherical k-means on the GPU (`kmeans.cu`): the wave index's build, every
//! (head, segment) of a layer in one launch per step.

use super::{gpu_err, GpuBackend};
use crate::error::{Error, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// The outcome of [`GpuBackend::segmented_kmeans`].
#[derive(Debug, Clone, PartialEq)]
pub struct SegmentKMeans {
    /// Cluster of every row, numbered within its segment.
    pub assignment: Vec<u32>,
    /// Unit centroids of every segment, one after another (`Σ clusters × head_dim`).
    pub centroids: Vec<f32>,
    /// Update steps run.
    pub iterations: usize,
    /// Whether the last assignment changed nothing.
    pub converged: bool,
}

impl GpuBackend {
    /// Spherical k-means of several segments at once, as the CPU's `spherical_kmeans` runs
    /// each of them: `x` holds unit rows (`head_dim` wide, f32), segment after segment
    /// (`rows[s]` rows each); segment `s` has `clusters[s]` centroids, starting from its rows
    /// of `init` (e.g. `cpu::kmeans::initial_centroids`); at most `max_iters` update steps,
    /// fewer once no assignment changes. A centroid that loses all its members keeps its
    /// place (the CPU re-seeds it), so results can differ from the CPU's when that happens.
    #[allow(unsafe_code, reason = "kernel launches take raw device pointers")]
    pub fn segmented_kmeans(
        &self,
        x: &[f32],
        rows: &[usize],
        clusters: &[usize],
        init: &[f32],
        max_iters: usize,
    ) -> Result<SegmentKMeans> {
        let d = self.head_dim;
        let n: usize = rows.iter().sum();
        let k: usize = clusters.iter().sum();
        if rows.len() != clusters.len() || x.len() != n * d || init.len() != k * d {
            return Err(Error::ShapeMismatch {
                what: "k-means rows / initial centroids",
                expected: n * d,
                got: x.len(),
            });
        }
        if let Some(s) = (0..rows.len()).find(|&s| clusters[s] == 0 || clusters[s] > rows[s]) {
            return Err(Error::InvalidArgument {
                what: "clusters",
                message: format!("segment {s} has {} rows and asks for {} clusters (1..=rows)", rows[s], clusters[s]),
            });
        }
        if n > i32::MAX as usize || k > i32::MAX as usize {
            return Err(Error::InvalidArgument {
                what: "k-means",
                message: "at most 2^31 − 1 rows and clusters".into(),
            });
        }
        if let Some(bad) = crate::first_non_finite(x).or_else(|| crate::first_non_finite(init).map(|i| x.len() + i)) {
            return Err(Error::InvalidArgument {
                what: "k-means rows",
                message: format!("element {bad} is not finite"),
            });
        }
        if n == 0 {
            return Ok(SegmentKMeans { assignment: Vec::new(), centroids: Vec::new(), iterations: 0, converged: true });
        }
        let prefix = |v: &[usize]| {
            std::iter::once(0)
                .chain(v.iter().scan(0usize, |a, &x| {
                    *a += x;
                    Some(*a)
                }))
                .map(|x| x as i32)
                .collect::<Vec<i32>>()
        };
        let row_seg: Vec<i32> = rows.iter().enumerate().flat_map(|(s, &r)| std::iter::repeat_n(s as i32, r)).collect();
        let s = &self.stream;
        let up = |what: &'static str| gpu_err(what);
        let dx = s.clone_htod(x).map_err(up("copying k-means rows"))?;
        let seg_rows = s.clone_htod(&prefix(rows)).map_err(up("copying segments"))?;
        let seg_cents = s.clone_htod(&prefix(clusters)).map_err(up("copying segments"))?;
        let row_seg = s.clone_htod(&row_seg).map_err(up("copying segments"))?;
        let mut cent = s.clone_htod(init).map_err(up("copying centroids"))?;
        let mut assign = s.clone_htod(&vec![-1i32; n]).map_err(up("allocating assignments"))?;
        let mut best = s.alloc_zeros::<f32>(n).map_err(up("allocating k-means buffers"))?;
        let mut changed = s.alloc_zeros::<i32>(1).map_err(up("allocating k-means buffers"))?;
        let mut sums = s.alloc_zeros::<f32>(k * d).map_err(up("allocating k-means buffers"))?;
        let mut counts = s.alloc_zeros::<i32>(k).map_err(up("allocating k-means buffers"))?;
        let longest = rows.iter().copied().max().unwrap_or(0);
        let assign_cfg = LaunchConfig {
            grid_dim: (longest.div_ceil(256) as u32, rows.len() as u32, 1),
            block_dim: (256, 1, 1), // KM_ROWS in kmeans.cu
            shared_mem_bytes: 0,
        };
        let warps = |items: usize| LaunchConfig {
            grid_dim: ((items * 32).div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n32, k32) = (n as i32, k as i32);
        let (mut iterations, mut converged) = (0, false);
        loop {
            s.memset_zeros(&mut changed).map_err(up("clearing the change count"))?;
            let mut b = s.launch_builder(&self.km_assign);
            b.arg(&dx).arg(&seg_rows).arg(&seg_cents).arg(&cent).arg(&mut assign).arg(&mut best).arg(&mut changed);
            // SAFETY: segment s's rows seg_rows[s]..seg_rows[s+1] < n and centroids
            // seg_cents[s]..seg_cents[s+1] ≤ k (prefix sums of checked lengths); x holds n ×
            // head_dim floats, cent k × head_dim, assign and best n.
            unsafe { b.launch(assign_cfg) }.map_err(up("launching kmeans_assign"))?;
            let moved = s.clone_dtoh(&changed).map_err(up("copying the change count"))?[0];
            if iterations > 0 && moved == 0 {
                converged = true;
                break;
            }
            if iterations == max_iters {
                break;
            }
            iterations += 1;
            s.memset_zeros(&mut sums).map_err(up("clearing sums"))?;
            s.memset_zeros(&mut counts).map_err(up("clearing counts"))?;
            let mut b = s.launch_builder(&self.km_accumulate);
            b.arg(&dx).arg(&row_seg).arg(&seg_cents).arg(&assign).arg(&n32).arg(&mut sums).arg(&mut counts);
            // SAFETY: one warp per row < n; every assignment is < its segment's cluster count
            // (written by kmeans_assign), so sums (k × head_dim) and counts (k) are in bounds.
            unsafe { b.launch(warps(n)) }.map_err(up("launching kmeans_accumulate"))?;
            let mut b = s.launch_builder(&self.km_normalize);
            b.arg(&sums).arg(&counts).arg(&k32).arg(&mut cent);
            // SAFETY: one warp per centroid < k; sums, counts and cent hold k rows.
            unsafe { b.launch(warps(k)) }.map_err(up("launching kmeans_normalize"))?;
        }
        let assignment = s.clone_dtoh(&assign).map_err(up("copying assignments back"))?;
        Ok(SegmentKMeans {
            assignment: assignment.into_iter().map(|a| a as u32).collect(),
            centroids: s.clone_dtoh(&cent).map_err(up("copying centroids back"))?,
            iterations,
            converged,
        })
    }
}
