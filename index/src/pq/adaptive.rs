//! The adaptive iteration limit of PQCache (§3.3, Eq. 1–3): k-means time is linear in
//! tokens × iterations, so a model `t = α·s·T + β` fitted to timings on this machine tells
//! how many iterations fit in the time the caller can hide the build behind.

use attnstore_kernels::cpu::kmeans::{l2_kmeans, KMeansParams};
use attnstore_kernels::random::SplitMix64;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Time of one k-means job (one head's sub-space): `ns = α·rows·iterations + β`, where
/// encoding `n` rows afterwards costs about `α·n` (one assignment pass).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IterationModel {
    /// α: nanoseconds per row per iteration.
    pub ns_per_row_iter: f64,
    /// β: fixed nanoseconds per job (initialization, buffers).
    pub fixed_ns: f64,
}

/// Sizes of a codebook build, as the time model sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuildShape {
    /// Rows each job trains on.
    pub train_rows: usize,
    /// Rows each job encodes after training.
    pub encode_rows: usize,
    /// Jobs (KV heads × sub-spaces).
    pub jobs: usize,
    /// Threads running jobs in parallel.
    pub threads: usize,
}

/// The chosen iteration limit and what the model predicts for it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IterationChoice {
    /// Iterations allowed (≥ 1, ≤ the cap).
    pub iters: usize,
    /// Predicted build time at that limit.
    pub predicted: Duration,
    /// False when even one iteration is predicted to overrun the budget.
    pub within_budget: bool,
}

impl IterationModel {
    /// Least-squares fit of `ns = α·(rows·iters) + β` to `(rows, iters, ns)` samples.
    /// Returns `None` with fewer than two distinct `rows·iters` values.
    pub fn fit(samples: &[(usize, usize, f64)]) -> Option<Self> {
        let xs: Vec<f64> = samples.iter().map(|&(s, t, _)| (s * t) as f64).collect();
        let n = samples.len() as f64;
        let mx = xs.iter().sum::<f64>() / n;
        let my = samples.iter().map(|s| s.2).sum::<f64>() / n;
        let sxx: f64 = xs.iter().map(|x| (x - mx) * (x - mx)).sum();
        if samples.len() < 2 || sxx <= 0.0 {
            return None;
        }
        let sxy: f64 = xs.iter().zip(samples).map(|(x, s)| (x - mx) * (s.2 - my)).sum();
        let alpha = (sxy / sxx).max(1e-3);
        Some(Self { ns_per_row_iter: alpha, fixed_ns: (my - alpha * mx).max(0.0) })
    }

    /// Predicted wall time of a build with `iters` iterations: jobs run in waves of
    /// `threads`, each training then encoding.
    pub fn predict(&self, shape: &BuildShape, iters: usize) -> Duration {
        let waves = shape.jobs.div_ceil(shape.threads.max(1)) as f64;
        let job = self.ns_per_row_iter * (shape.train_rows * iters + shape.encode_rows) as f64 + self.fixed_ns;
        Duration::from_nanos((waves * job) as u64)
    }

    /// PQCache Eq. 3: the largest iteration count whose predicted time fits `budget`,
    /// clipped to `1..=cap` (the run itself still stops early at convergence).
    pub fn choose(&self, shape: &BuildShape, budget: Duration, cap: usize) -> IterationChoice {
        let cap = cap.max(1);
        let waves = shape.jobs.div_ceil(shape.threads.max(1)) as f64;
        let fixed = waves * (self.fixed_ns + self.ns_per_row_iter * shape.encode_rows as f64);
        let per_iter = waves * self.ns_per_row_iter * shape.train_rows.max(1) as f64;
        let fit = ((budget.as_nanos() as f64 - fixed) / per_iter).floor();
        let iters = if fit >= 1.0 { (fit as usize).min(cap) } else { 1 };
        IterationChoice { iters, predicted: self.predict(shape, iters), within_budget: fit >= 1.0 }
    }

    /// Measures this machine: times single-threaded k-means jobs of `dims`-dimensional rows
    /// into `codes` centroids at several sizes and iteration counts, and fits the model.
    /// Cached per `(dims, codes)` for the process (it takes tens of milliseconds).
    pub fn calibrated(dims: usize, codes: usize) -> Self {
        static CACHE: OnceLock<Mutex<HashMap<(usize, usize), IterationModel>>> = OnceLock::new();
        let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
        if let Some(m) = cache.lock().get(&(dims, codes)) {
            return *m;
        }
        let model = Self::measure(dims, codes);
        cache.lock().insert((dims, codes), model);
        model
    }

    fn measure(dims: usize, codes: usize) -> Self {
        let mut g = SplitMix64::new(7);
        let mut samples = Vec::new();
        for rows in [codes * 2, codes * 8] {
            // Uniform noise never converges within 3 iterations, so every run does `iters`.
            let x: Vec<f32> = (0..rows * dims).map(|_| g.normal()).collect();
            for iters in [1usize, 3] {
                let started = Instant::now();
                let km = l2_kmeans(&x, dims.max(1), KMeansParams { clusters: codes, max_iters: iters, seed: 1 });
                let ns = started.elapsed().as_nanos() as f64;
                if let Ok(km) = km {
                    // Assignment passes = iterations + 1 (the initial one).
                    samples.push((rows, km.iterations + 1, ns));
                }
            }
        }
        Self::fit(&samples).unwrap_or(Self { ns_per_row_iter: (dims * codes) as f64 * 0.1, fixed_ns: 0.0 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_recovers_a_linear_model() {
        let samples: Vec<_> = [(1000, 1), (1000, 3), (4000, 2), (8000, 5)]
            .iter()
            .map(|&(s, t)| (s, t, 7.0 * (s * t) as f64 + 5000.0))
            .collect();
        let m = IterationModel::fit(&samples).unwrap();
        assert!((m.ns_per_row_iter - 7.0).abs() < 1e-6 && (m.fixed_ns - 5000.0).abs() < 1e-3, "{m:?}");
        assert!(IterationModel::fit(&samples[..1]).is_none());
    }

    #[test]
    fn chosen_limit_is_the_largest_that_fits_the_budget() {
        let m = IterationModel { ns_per_row_iter: 10.0, fixed_ns: 1e6 };
        let shape = BuildShape { train_rows: 16_384, encode_rows: 131_072, jobs: 32, threads: 2 };
        for budget_ms in [60u64, 100, 250, 1000] {
            let budget = Duration::from_millis(budget_ms);
            let c = m.choose(&shape, budget, 1000);
            assert!(c.within_budget, "{budget_ms} ms");
            assert!(m.predict(&shape, c.iters) <= budget, "{budget_ms} ms: {c:?}");
            assert!(m.predict(&shape, c.iters + 1) > budget, "{budget_ms} ms: one more would still fit");
        }
        // The cap wins over a generous budget; a hopeless budget still runs one iteration.
        assert_eq!(m.choose(&shape, Duration::from_secs(100), 25).iters, 25);
        let tight = m.choose(&shape, Duration::from_millis(1), 25);
        assert_eq!((tight.iters, tight.within_budget), (1, false));
    }

    #[test]
    fn calibration_measures_positive_costs() {
        let m = IterationModel::calibrated(8, 16);
        assert!(m.ns_per_row_iter > 0.0 && m.fixed_ns >= 0.0, "{m:?}");
    }
}
