//! The attention shape of one layer: query heads, KV heads (GQA) and head dimension.

use crate::error::{Error, Result};

/// Heads and head dimension of one attention layer. Query heads are grouped over KV heads
/// (GQA): query head `h` reads KV head `h / group()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttnShape {
    /// Number of query heads.
    pub q_heads: usize,
    /// Number of key/value heads.
    pub kv_heads: usize,
    /// Dimension of one head's vectors.
    pub head_dim: usize,
}

impl AttnShape {
    /// Builds a shape, checking that every dimension is positive and that query heads group
    /// evenly over KV heads.
    pub fn new(q_heads: usize, kv_heads: usize, head_dim: usize) -> Result<Self> {
        for (what, v) in [("q_heads", q_heads), ("kv_heads", kv_heads), ("head_dim", head_dim)] {
            if v == 0 {
                return Err(Error::ZeroDimension { what });
            }
        }
        if !q_heads.is_multiple_of(kv_heads) {
            return Err(Error::GqaMismatch { q_heads, kv_heads });
        }
        Ok(Self { q_heads, kv_heads, head_dim })
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    /// `1/√d`, the softmax scale of dot-product attention.
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// Elements of one query batch: `q_heads × head_dim`.
    pub fn query_len(&self) -> usize {
        self.q_heads * self.head_dim
    }

    /// Elements of `tokens` tokens of keys (or values): `kv_heads × tokens × head_dim`.
    pub fn kv_len(&self, tokens: usize) -> usize {
        self.kv_heads * tokens * self.head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uneven_grouping_is_a_gqa_error() {
        assert_eq!(AttnShape::new(6, 4, 8), Err(Error::GqaMismatch { q_heads: 6, kv_heads: 4 }));
        assert!(matches!(AttnShape::new(4, 0, 8), Err(Error::ZeroDimension { what: "kv_heads" })));
        assert_eq!(AttnShape::new(32, 8, 128).unwrap().group(), 4);
    }
}
