//! Checked read-only views over `[heads, tokens, head_dim]` data.

use crate::error::{Error, Result};

/// A view over `heads × tokens × head_dim` elements laid out head-major, checked once at
/// construction so that row accessors cannot go out of bounds.
#[derive(Debug, Clone, Copy)]
pub struct HeadsView<'a, E> {
    data: &'a [E],
    heads: usize,
    tokens: usize,
    head_dim: usize,
}

impl<'a, E> HeadsView<'a, E> {
    /// Wraps `data`, checking that it holds exactly `heads × tokens × head_dim` elements.
    pub fn new(data: &'a [E], heads: usize, tokens: usize, head_dim: usize) -> Result<Self> {
        if head_dim == 0 {
            return Err(Error::ZeroDimension { what: "head_dim" });
        }
        let expected = heads * tokens * head_dim;
        if data.len() != expected {
            return Err(Error::ShapeMismatch { what: "heads view", expected, got: data.len() });
        }
        Ok(Self { data, heads, tokens, head_dim })
    }

    /// Number of heads.
    pub fn heads(&self) -> usize {
        self.heads
    }
    /// Number of tokens per head.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    /// Dimension of one vector.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// All elements, head-major.
    pub fn data(&self) -> &'a [E] {
        self.data
    }
    /// The `tokens × head_dim` rows of head `h`. Panics if `h >= heads` (an internal bug).
    pub fn head(&self, h: usize) -> &'a [E] {
        assert!(h < self.heads, "head {h} out of range ({} heads)", self.heads);
        let n = self.tokens * self.head_dim;
        &self.data[h * n..(h + 1) * n]
    }
    /// Row `t` of head `h`.
    pub fn row(&self, h: usize, t: usize) -> &'a [E] {
        let head = self.head(h);
        &head[t * self.head_dim..(t + 1) * self.head_dim]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_length_is_a_shape_error() {
        let data = vec![0.0f32; 2 * 3 * 4 + 1];
        assert!(matches!(HeadsView::new(&data, 2, 3, 4), Err(Error::ShapeMismatch { expected: 24, got: 25, .. })));
        let v = HeadsView::new(&data[..24], 2, 3, 4).unwrap();
        assert_eq!(v.row(1, 2).len(), 4);
    }
}
