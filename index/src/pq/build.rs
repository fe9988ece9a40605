//! Codebook training and encoding, run on a background thread after prefill so it
//! overlaps with the caller (PQCache §3.3); a [`BuildHandle`] tells when it is done.

use crate::build::{BuildReport, BuildState};
use crate::error::{Error, Result};
use crate::pq::adaptive::{BuildShape, IterationModel};
use crate::pq::codes::PackedCodes;
use crate::pq::params::{PqLayout, PqParams};
use attnstore_kernels::cpu::kmeans::{l2_kmeans, nearest_centroids, KMeansParams};
use attnstore_kernels::cpu::pq::transpose_codebooks;
use attnstore_kernels::Element;
use parking_lot::{Condvar, Mutex};
use rayon::prelude::*;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// The trained codebooks and the codes of positions `sink..end` of every head.
#[derive(Debug)]
pub(crate) struct Built {
    pub layout: PqLayout,
    /// Centroids per sub-space.
    pub codes: usize,
    /// Per head: `m × codes × d/m` f32 centroids (encoding).
    pub codebooks: Vec<Vec<f32>>,
    /// Per head: the same transposed to `m × d/m × codes` (lookup tables).
    pub codebooks_t: Vec<Vec<f32>>,
    /// Per head: codes of positions `start..end`.
    pub packed: Vec<PackedCodes>,
    pub end: usize,
    pub report: BuildReport,
}

#[derive(Debug, Default)]
pub(crate) struct BuildSlot {
    built: OnceLock<Arc<Built>>,
    failure: Mutex<Option<Error>>,
    finished: Mutex<bool>,
    done: Condvar,
}

impl BuildSlot {
    pub fn get(&self) -> Option<&Arc<Built>> {
        self.built.get()
    }

    /// A slot whose build is already done (an index restored from a snapshot).
    pub fn ready(built: Built) -> Arc<Self> {
        let slot = Arc::new(Self::default());
        slot.finish(Ok(built));
        slot
    }

    fn finish(&self, result: Result<Built>) {
        match result {
            Ok(b) => {
                let _ = self.built.set(Arc::new(b));
            }
            Err(e) => *self.failure.lock() = Some(e),
        }
        *self.finished.lock() = true;
        self.done.notify_all();
    }
}

impl BuildState for BuildSlot {
    fn report(&self) -> Option<BuildReport> {
        self.get().map(|b| b.report)
    }

    fn wait_until(&self, deadline: Instant) -> Result<bool> {
        let mut finished = self.finished.lock();
        while !*finished {
            if self.done.wait_until(&mut finished, deadline).timed_out() {
                break;
            }
        }
        drop(finished);
        if let Some(e) = self.failure.lock().clone() {
            return Err(e);
        }
        Ok(self.get().is_some())
    }
}

/// The inputs of one build: keys of every head (shared with the index), the token range to
/// encode and the layout.
pub(crate) struct BuildJob<E> {
    pub keys: Vec<Arc<Vec<E>>>,
    pub head_dim: usize,
    pub start: usize,
    pub end: usize,
    pub layout: PqLayout,
    pub params: PqParams,
}

impl<E: Element> BuildJob<E> {
    /// Runs the build now on the calling thread, or on a new thread; either way the result
    /// lands in the returned slot.
    pub fn launch(self, background: bool) -> Arc<BuildSlot> {
        let slot = Arc::new(BuildSlot::default());
        let target = Arc::clone(&slot);
        if background {
            let spawned = std::thread::Builder::new().name("attnstore-pq-build".into()).spawn(move || {
                let result = self.run();
                target.finish(result);
            });
            if let Err(e) = spawned {
                slot.finish(Err(Error::InvalidParameter {
                    what: "background build",
                    message: format!("could not start a thread: {e}"),
                }));
            }
        } else {
            let result = self.run();
            target.finish(result);
        }
        slot
    }

    fn run(&self) -> Result<Built> {
        let started = Instant::now();
        let (m, d) = (self.layout.subspaces, self.head_dim);
        let sub = d / m;
        let n = self.end - self.start;
        let train_rows = n.min(self.layout.codes() * self.params.train_rows_per_centroid);
        let jobs = self.keys.len() * m;
        let (iters_limit, predicted) = match self.params.build_budget {
            Some(budget) => {
                let model = IterationModel::calibrated(sub, self.layout.codes());
                let shape = BuildShape { train_rows, encode_rows: n, jobs, threads: rayon::current_num_threads() };
                let c = model.choose(&shape, budget, self.params.max_iters);
                (c.iters, Some(c.predicted))
            }
            None => (self.params.max_iters, None),
        };
        let trained = (0..jobs)
            .into_par_iter()
            .map(|job| self.train_and_encode(job / m, job % m, train_rows, iters_limit))
            .collect::<Result<Vec<_>>>()?;
        let codes = trained.first().map_or(1, |t| t.centroids.len() / sub);
        let mut codebooks = Vec::with_capacity(self.keys.len());
        let mut packed = Vec::with_capacity(self.keys.len());
        let mut token_major = vec![0u8; n * m];
        for head in trained.chunks(m) {
            let mut book = Vec::with_capacity(m * codes * sub);
            for (j, t) in head.iter().enumerate() {
                book.extend_from_slice(&t.centroids);
                for (i, &c) in t.codes.iter().enumerate() {
                    token_major[i * m + j] = c;
                }
            }
            let mut p = PackedCodes::new(self.layout);
            p.push(&token_major)?;
            codebooks.push(book);
            packed.push(p);
        }
        let report = BuildReport {
            layout: self.layout,
            codes,
            tokens: n,
            train_rows,
            iters_limit,
            iters_run: trained.iter().map(|t| t.iterations).max().unwrap_or(0),
            converged_jobs: trained.iter().filter(|t| t.converged).count(),
            jobs,
            budget: self.params.build_budget,
            predicted,
            elapsed: started.elapsed(),
        };
        let codebooks_t = codebooks.iter().map(|b| transpose_codebooks(b, m, codes)).collect();
        Ok(Built { layout: self.layout, codes, codebooks, codebooks_t, packed, end: self.end, report })
    }

    /// Trains sub-space `j` of head `h` on evenly spaced rows, then encodes every row.
    fn train_and_encode(&self, h: usize, j: usize, train_rows: usize, iters: usize) -> Result<Trained> {
        let (m, d) = (self.layout.subspaces, self.head_dim);
        let sub = d / m;
        let keys = &self.keys[h];
        let n = self.end - self.start;
        let mut row = vec![0.0f32; d];
        let mut gather = |positions: &mut dyn Iterator<Item = usize>, out: &mut Vec<f32>| {
            out.clear();
            for p in positions {
                E::widen(&keys[p * d..(p + 1) * d], &mut row);
                out.extend_from_slice(&row[j * sub..(j + 1) * sub]);
            }
        };
        let mut x = Vec::with_capacity(train_rows * sub);
        gather(&mut (0..train_rows).map(|i| self.start + i * n / train_rows), &mut x);
        let seed = self.params.seed ^ ((h * m + j) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let km = l2_kmeans(&x, sub, KMeansParams { clusters: self.layout.codes(), max_iters: iters, seed })?;
        const ENCODE_ROWS: usize = 4096;
        let mut codes = Vec::with_capacity(n);
        let mut nearest = Vec::new();
        for s in (self.start..self.end).step_by(ENCODE_ROWS) {
            gather(&mut (s..(s + ENCODE_ROWS).min(self.end)), &mut x);
            nearest_centroids(&x, &km.centroids, sub, &mut nearest)?;
            codes.extend(nearest.iter().map(|&c| c as u8));
        }
        Ok(Trained { centroids: km.centroids, codes, iterations: km.iterations, converged: km.converged })
    }
}

struct Trained {
    centroids: Vec<f32>,
    codes: Vec<u8>,
    iterations: usize,
    converged: bool,
}
