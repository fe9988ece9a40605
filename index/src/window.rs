//! The sliding-window store: keeps only the last `w` tokens of each head and always attends
//! them exactly (the local layers of Gemma-style models).

use crate::error::{Error, Result};
use crate::method::{batch_tokens, push_narrow, AccessMethod, HeadPlan, IndexStats, RowSource, ZoneBudget};
use crate::rows::{HeadRows, PlainRows, Run};
use attnstore_kernels::Element;

/// Exact attention over the most recent `window` tokens of each KV head.
#[derive(Debug, Clone)]
pub struct WindowIndex<E> {
    window: usize,
    kv_heads: usize,
    head_dim: usize,
    keys: Vec<Vec<E>>,
    values: Vec<Vec<E>>,
    /// Tokens ever appended; positions of the kept rows are `seen - kept ..seen`.
    seen: usize,
    kept: usize,
}

impl<E: Element> WindowIndex<E> {
    /// An empty window of `window` tokens.
    pub fn new(window: usize, kv_heads: usize, head_dim: usize) -> Result<Self> {
        if window == 0 || kv_heads == 0 || head_dim == 0 {
            return Err(Error::InvalidParameter {
                what: "sliding window",
                message: format!("window ({window}), kv_heads ({kv_heads}) and head_dim ({head_dim}) must be positive"),
            });
        }
        Ok(Self {
            window,
            kv_heads,
            head_dim,
            keys: vec![Vec::new(); kv_heads],
            values: vec![Vec::new(); kv_heads],
            seen: 0,
            kept: 0,
        })
    }
}

impl<E: Element> AccessMethod for WindowIndex<E> {
    fn name(&self) -> &'static str {
        "window"
    }

    fn stats(&self) -> IndexStats {
        IndexStats {
            tokens: self.kept,
            kv_bytes: 2 * self.kept * self.kv_heads * self.head_dim * E::DTYPE.size_bytes(),
            ..IndexStats::default()
        }
    }

    fn append(&mut self, keys: &[f32], values: &[f32]) -> Result<()> {
        let n = batch_tokens(self.kv_heads, self.head_dim, keys, values)?;
        let d = self.head_dim;
        let take = n.min(self.window);
        let drop_rows = (self.kept + take).saturating_sub(self.window);
        for h in 0..self.kv_heads {
            for (dst, src) in [(&mut self.keys[h], keys), (&mut self.values[h], values)] {
                dst.drain(..drop_rows * d);
                push_narrow(dst, &src[(h * n + n - take) * d..(h + 1) * n * d]);
            }
        }
        self.kept = self.kept + take - drop_rows;
        self.seen += n;
        Ok(())
    }

    fn plan_exact(&self) -> HeadPlan {
        HeadPlan { exact: true, steady_tokens: self.kept, pending_tokens: 0, selections: Vec::new() }
    }

    /// A window is always attended whole: budgets do not apply.
    fn plan_head(&self, _kv_head: usize, _q: &[f32], _budget: &ZoneBudget) -> HeadPlan {
        self.plan_exact()
    }
}

impl<E: Element> RowSource for WindowIndex<E> {
    fn head_rows<'a>(&'a self, kv_head: usize, _plan: &'a HeadPlan) -> HeadRows<'a> {
        HeadRows {
            steady: vec![Run::Plain(vec![PlainRows::of(&self.keys[kv_head], &self.values[kv_head])])],
            ..HeadRows::default()
        }
    }

    fn exact_positions(&self, _kv_head: usize, _plan: &HeadPlan, _j: usize) -> Vec<u32> {
        ((self.seen - self.kept) as u32..self.seen as u32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_the_last_window_tokens() {
        let mut w = WindowIndex::<f32>::new(3, 1, 2).unwrap();
        for t in 0..5 {
            let x = [t as f32, 0.0];
            w.append(&x, &x).unwrap();
        }
        assert_eq!(w.exact_positions(0, &w.plan_exact(), 0), vec![2, 3, 4]);
        assert_eq!(w.keys[0], vec![2.0, 0.0, 3.0, 0.0, 4.0, 0.0]);
        w.append(&[9.0, 9.0, 8.0, 8.0, 7.0, 7.0, 6.0, 6.0], &[0.0; 8]).unwrap();
        assert_eq!(w.keys[0], vec![8.0, 8.0, 7.0, 7.0, 6.0, 6.0]);
        assert_eq!(w.stats().tokens, 3);
    }
}
