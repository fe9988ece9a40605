//! Parameters of the PQ index and the layout (sub-spaces × bits) chosen for a context.

use crate::error::{Error, Result};
use std::time::Duration;

/// Sub-space counts a product quantizer supports.
pub const SUBSPACES: [usize; 4] = [1, 2, 4, 8];
/// Bits per code a product quantizer supports.
pub const BITS: std::ops::RangeInclusive<usize> = 4..=8;

/// Structure and build policy of a PQ index. The defaults are PQCache's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PqParams {
    /// Sub-spaces `m` (1, 2, 4 or 8, dividing the head dimension); `None` picks PQCache's
    /// choice by context length: 2 up to 16K tokens, 4 beyond.
    pub subspaces: Option<usize>,
    /// Bits per code `b` (4..=8); `None` picks 6 up to 16K tokens, 8 beyond.
    pub bits: Option<usize>,
    /// First tokens always attended exactly (attention sinks).
    pub sink_tokens: usize,
    /// Most recent tokens always attended exactly.
    pub local_tokens: usize,
    /// Upper bound on k-means iterations (a run stops earlier once it converges).
    pub max_iters: usize,
    /// Time the caller can hide the codebook build behind (for example the expected prefill
    /// time of the following layers): the iteration limit is the largest count a measured
    /// time model predicts to finish within it (PQCache Eq. 1–3). `None`: `max_iters`.
    pub build_budget: Option<Duration>,
    /// Training rows per centroid: codebooks are trained on at most `2^b ×` this many
    /// evenly spaced keys, then every key is encoded (a standard PQ practice that bounds
    /// build time; all keys are still encoded exactly once).
    pub train_rows_per_centroid: usize,
    /// Tokens beyond the steady zone needed before a codebook is built; shorter contexts
    /// are attended exactly.
    pub min_build_tokens: usize,
    /// Build codebooks on a background thread (`prefill` returns once the KV is stored).
    pub background: bool,
    /// Seed of the k-means initialization.
    pub seed: u64,
}

impl Default for PqParams {
    fn default() -> Self {
        Self {
            subspaces: None,
            bits: None,
            sink_tokens: 4,
            local_tokens: 64,
            max_iters: 25,
            build_budget: None,
            train_rows_per_centroid: 64,
            min_build_tokens: 1024,
            background: true,
            seed: 0x9c_5eed,
        }
    }
}

/// Sub-spaces and bits of one index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PqLayout {
    /// Sub-spaces `m`.
    pub subspaces: usize,
    /// Bits per code `b`.
    pub bits: usize,
}

impl PqLayout {
    /// Centroids per sub-space, `2^b`.
    pub fn codes(&self) -> usize {
        1 << self.bits
    }
    /// Packed bytes per token (`m·b/8`, fractional for odd products).
    pub fn bytes_per_token(&self) -> f64 {
        (self.subspaces * self.bits) as f64 / 8.0
    }
}

impl PqParams {
    /// Checks every value against `head_dim`; errors say what is allowed.
    pub fn validate(&self, head_dim: usize) -> Result<()> {
        let bad = |what, message: String| Err(Error::InvalidParameter { what, message });
        if let Some(m) = self.subspaces {
            if !SUBSPACES.contains(&m) {
                return bad("subspaces", format!("m = {m}: expected one of 1, 2, 4, 8"));
            }
            if head_dim > 0 && !head_dim.is_multiple_of(m) {
                return bad("subspaces", format!("m = {m} does not divide head_dim {head_dim}"));
            }
        } else if head_dim > 0 && !head_dim.is_multiple_of(4) {
            return bad(
                "subspaces",
                format!("the automatic choice (2 or 4) needs head_dim divisible by 4, got {head_dim}"),
            );
        }
        if let Some(b) = self.bits {
            if !BITS.contains(&b) {
                return bad("bits", format!("b = {b}: expected 4..=8 bits per code"));
            }
        }
        if self.max_iters == 0 {
            return bad("max_iters", "must be positive (PQCache clips to a few tens)".into());
        }
        if self.train_rows_per_centroid == 0 {
            return bad("train_rows_per_centroid", "must be positive (64 is usual)".into());
        }
        if self.min_build_tokens == 0 {
            return bad("min_build_tokens", "must be positive".into());
        }
        Ok(())
    }

    /// The layout for a codebook trained at `tokens` tokens.
    pub fn layout(&self, tokens: usize) -> PqLayout {
        let long = tokens > 16 * 1024;
        PqLayout {
            subspaces: self.subspaces.unwrap_or(if long { 4 } else { 2 }),
            bits: self.bits.unwrap_or(if long { 8 } else { 6 }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_parameters_are_typed_errors() {
        let p = PqParams::default();
        assert!(p.validate(128).is_ok());
        for bad in [
            PqParams { bits: Some(9), ..p },
            PqParams { bits: Some(3), ..p },
            PqParams { subspaces: Some(3), ..p },
            PqParams { subspaces: Some(16), ..p },
            PqParams { max_iters: 0, ..p },
        ] {
            assert!(matches!(bad.validate(128), Err(Error::InvalidParameter { .. })), "{bad:?}");
        }
        let err = PqParams { subspaces: Some(8), ..p }.validate(36).unwrap_err();
        assert!(err.to_string().contains("does not divide head_dim 36"), "{err}");
    }

    #[test]
    fn automatic_layout_follows_pqcache() {
        let p = PqParams::default();
        assert_eq!(p.layout(16 * 1024), PqLayout { subspaces: 2, bits: 6 });
        assert_eq!(p.layout(128 * 1024), PqLayout { subspaces: 4, bits: 8 });
        assert_eq!(PqParams { bits: Some(5), ..p }.layout(1 << 20), PqLayout { subspaces: 4, bits: 5 });
    }
}
