//! The trained state of a PQ index that a checkpoint keeps ([`PqSnapshot`]): the codebooks
//! and the codes of the base region. With the same KV it restores the index without
//! training (k-means is the whole cost of a PQ build); decode tokens after the base are
//! encoded again with the restored codebooks, as they were the first time.

use super::build::{BuildSlot, Built};
use super::codes::PackedCodes;
use super::params::PqLayout;
use super::PqIndex;
use crate::build::BuildReport;
use crate::error::{Error, Result};
use crate::method::{batch_tokens, push_narrow};
use attnstore_kernels::cpu::pq::transpose_codebooks;
use attnstore_kernels::Element;
use std::time::Instant;

/// A PQ index's codebooks and base codes. `tokens` is the base region (every token present
/// when the build started), always a batch boundary of the KV the index was given.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PqSnapshot {
    /// Tokens of the base region (positions `0..tokens`).
    pub tokens: u64,
    /// Sub-spaces `m`.
    pub subspaces: u32,
    /// Bits per code `b`.
    pub bits: u32,
    /// Centroids per sub-space (≤ `2^b`).
    pub codes: u32,
    /// First coded position (the sink ends here).
    pub start: u64,
    /// One past the last coded position of the base region.
    pub end: u64,
    /// Rows each codebook was trained on (for the build report).
    pub train_rows: u64,
    /// The build's iteration limit (for the build report).
    pub iters_limit: u32,
    /// Most iterations any sub-space ran (for the build report).
    pub iters_run: u32,
    /// Sub-space jobs that converged (for the build report).
    pub converged_jobs: u32,
    /// Per KV head: `m × codes × d/m` centroids, sub-space major.
    pub codebooks: Vec<Vec<f32>>,
    /// Per KV head: the packed codes of positions `start..end`
    /// ([`PackedCodes::packed_bytes`]).
    pub packed: Vec<Vec<u8>>,
}

impl<E: Element> PqIndex<E> {
    /// The trained state a checkpoint keeps, once the codebook build is done (`None` before).
    pub fn snapshot(&self) -> Option<PqSnapshot> {
        let built = self.built()?;
        let r = &built.report;
        Some(PqSnapshot {
            tokens: self.base_len as u64,
            subspaces: built.layout.subspaces as u32,
            bits: built.layout.bits as u32,
            codes: built.codes as u32,
            start: self.base_sink as u64,
            end: built.end as u64,
            train_rows: r.train_rows as u64,
            iters_limit: r.iters_limit as u32,
            iters_run: r.iters_run as u32,
            converged_jobs: r.converged_jobs as u32,
            codebooks: built.codebooks.clone(),
            packed: built.packed.iter().map(|p| p.packed_bytes().to_vec()).collect(),
        })
    }

    /// Rebuilds this empty index from `snapshot` and the KV of its base region
    /// (`kv_heads × tokens × head_dim`): the same codebooks, codes, rows and answers as the
    /// index the snapshot came from, with no training. A snapshot that does not fit these
    /// parameters or this KV (layout, ranges, codebook sizes, non-finite centroids, codes
    /// naming no centroid) is a typed error and changes nothing.
    pub fn restore(&mut self, snapshot: &PqSnapshot, keys: &[f32], values: &[f32]) -> Result<()> {
        let started = Instant::now();
        if self.tokens > 0 {
            return Err(bad_snapshot("only an empty index can be restored".into()));
        }
        let (h, d) = (self.kv_heads, self.head_dim);
        let n = batch_tokens(h, d, keys, values)?;
        if n as u64 != snapshot.tokens {
            return Err(bad_snapshot(format!("the snapshot covers {} tokens, the KV given has {n}", snapshot.tokens)));
        }
        let (start, built) = self.checked_built(snapshot, started)?;
        // Everything is checked: from here on nothing fails but the codec's own row checks,
        // which the same KV passed when it was first ingested.
        for (hh, kv) in self.heads.iter_mut().enumerate() {
            push_narrow(&mut kv.tail_keys, &keys[hh * n * d..(hh + 1) * n * d]);
            push_narrow(&mut kv.tail_values, &values[hh * n * d..(hh + 1) * n * d]);
        }
        self.tokens = n;
        if let Err(e) = self.make_base(start, built.layout) {
            self.emptied()?;
            return Err(e);
        }
        self.build = Some(BuildSlot::ready(built));
        Ok(())
    }

    /// The build `snapshot` describes, once it passes every check against this index's
    /// parameters at `snapshot.tokens` tokens, and the first coded position.
    pub(super) fn checked_built(&self, snapshot: &PqSnapshot, started: Instant) -> Result<(usize, Built)> {
        let (h, d) = (self.kv_heads, self.head_dim);
        let n = usize::try_from(snapshot.tokens)
            .map_err(|_| bad_snapshot(format!("{} tokens do not fit in memory", snapshot.tokens)))?;
        let layout = self.params.layout(n);
        if snapshot.layout() != layout {
            return Err(bad_snapshot(format!(
                "m = {}, b = {} does not match this index's layout at {n} tokens (m = {}, b = {})",
                snapshot.subspaces, snapshot.bits, layout.subspaces, layout.bits
            )));
        }
        let Some((start, end)) = self.build_range(n) else {
            return Err(bad_snapshot(format!("{n} tokens are too few for a codebook build")));
        };
        if (snapshot.start, snapshot.end) != (start as u64, end as u64) {
            return Err(bad_snapshot(format!(
                "coded range {}..{} is not this index's {start}..{end} at {n} tokens",
                snapshot.start, snapshot.end
            )));
        }
        let codes = snapshot.codes as usize;
        if codes == 0 || codes > layout.codes() {
            return Err(bad_snapshot(format!("{codes} centroids per sub-space: expected 1..={}", layout.codes())));
        }
        let book_len = layout.subspaces * codes * (d / layout.subspaces);
        if snapshot.codebooks.len() != h || snapshot.packed.len() != h {
            return Err(bad_snapshot(format!(
                "{} codebooks and {} code streams for {h} KV heads",
                snapshot.codebooks.len(),
                snapshot.packed.len()
            )));
        }
        if let Some(i) = snapshot.codebooks.iter().position(|b| b.len() != book_len) {
            return Err(Error::ShapeMismatch {
                what: "pq snapshot codebook (m × codes × d/m)",
                expected: book_len,
                got: snapshot.codebooks[i].len(),
            });
        }
        if snapshot.codebooks.iter().flatten().any(|c| !c.is_finite()) {
            return Err(bad_snapshot("a codebook holds a non-finite centroid".into()));
        }
        let packed = snapshot
            .packed
            .iter()
            .map(|bytes| PackedCodes::from_packed(layout, end - start, bytes.clone(), codes))
            .collect::<Result<Vec<_>>>()?;
        let codebooks = snapshot.codebooks.clone();
        let codebooks_t = codebooks.iter().map(|b| transpose_codebooks(b, layout.subspaces, codes)).collect();
        let report = BuildReport {
            layout,
            codes,
            tokens: end - start,
            train_rows: snapshot.train_rows as usize,
            iters_limit: snapshot.iters_limit as usize,
            iters_run: snapshot.iters_run as usize,
            converged_jobs: snapshot.converged_jobs as usize,
            jobs: h * layout.subspaces,
            budget: None,
            predicted: None,
            elapsed: started.elapsed(),
        };
        Ok((start, Built { layout, codes, codebooks, codebooks_t, packed, end, report }))
    }
}

fn bad_snapshot(message: String) -> Error {
    Error::InvalidParameter { what: "pq snapshot", message }
}

impl PqSnapshot {
    /// Sub-spaces and bits.
    pub fn layout(&self) -> PqLayout {
        PqLayout { subspaces: self.subspaces as usize, bits: self.bits as usize }
    }
}
