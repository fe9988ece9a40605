//! The flat index: tokens in arrival order, no meta data. It answers exactly, or with an
//! exact top-k over true scores — the oracle the approximate methods are measured against.

use crate::error::Result;
use crate::method::{
    batch_tokens, check_shape, coalesce, push_narrow, AccessMethod, HeadPlan, IndexStats, RowSource, RowSpan,
    Selection, SelectionMode, ZoneBudget,
};
use crate::rows::{HeadRows, PlainRows, Run, SelectionRows};
use attnstore_kernels::cpu::scoring::{score_group, top_r};
use attnstore_kernels::Element;

/// Exact access method over the KV heads of one layer.
#[derive(Debug, Clone)]
pub struct FlatIndex<E> {
    kv_heads: usize,
    head_dim: usize,
    keys: Vec<Vec<E>>,
    values: Vec<Vec<E>>,
    tokens: usize,
}

impl<E: Element> FlatIndex<E> {
    /// An empty flat index.
    pub fn new(kv_heads: usize, head_dim: usize) -> Result<Self> {
        check_shape(kv_heads, head_dim)?;
        Ok(Self { kv_heads, head_dim, keys: vec![Vec::new(); kv_heads], values: vec![Vec::new(); kv_heads], tokens: 0 })
    }

    fn top_k_selection(&self, first_head: usize, scores: &[f32], k: usize, heads: usize) -> Selection {
        let mut spans: Vec<RowSpan> =
            top_r(scores, k).into_iter().map(|t| RowSpan { unit: 0, start: t, end: t + 1 }).collect();
        let retrieve_tokens = spans.len();
        coalesce(&mut spans);
        Selection {
            first_head,
            heads,
            retrieve: spans,
            retrieve_clusters: 0,
            retrieve_tokens,
            scored: self.tokens,
            scored_bytes: self.tokens * self.head_dim * E::DTYPE.size_bytes(),
            dropped_tokens: self.tokens - retrieve_tokens,
            ..Selection::default()
        }
    }
}

impl<E: Element> AccessMethod for FlatIndex<E> {
    fn name(&self) -> &'static str {
        "flat"
    }

    fn stats(&self) -> IndexStats {
        IndexStats {
            tokens: self.tokens,
            kv_bytes: 2 * self.tokens * self.kv_heads * self.head_dim * E::DTYPE.size_bytes(),
            ..IndexStats::default()
        }
    }

    fn append(&mut self, keys: &[f32], values: &[f32]) -> Result<()> {
        let n = batch_tokens(self.kv_heads, self.head_dim, keys, values)?;
        let d = self.head_dim;
        for h in 0..self.kv_heads {
            for (dst, src) in [(&mut self.keys[h], keys), (&mut self.values[h], values)] {
                push_narrow(dst, &src[h * n * d..(h + 1) * n * d]);
            }
        }
        self.tokens += n;
        Ok(())
    }

    fn plan_exact(&self) -> HeadPlan {
        HeadPlan { exact: true, steady_tokens: 0, pending_tokens: 0, selections: Vec::new() }
    }

    /// Exact top-k: the `retrieve_tokens` tokens with the highest true scores (per query
    /// head, or by the group's best score per token). Estimation budgets are ignored.
    fn plan_head(&self, kv_head: usize, q: &[f32], budget: &ZoneBudget) -> HeadPlan {
        let d = self.head_dim;
        let scale = 1.0 / (d as f32).sqrt();
        let mut scores = vec![Vec::new(); q.len() / d];
        score_group(q, scores.len(), &self.keys[kv_head], scale, &mut scores);
        let k = budget.retrieve_tokens.min(self.tokens);
        let selections = match budget.mode {
            SelectionMode::PerQueryHead => {
                scores.iter().enumerate().map(|(j, s)| self.top_k_selection(j, s, k, 1)).collect()
            }
            SelectionMode::PerKvHead => {
                let best: Vec<f32> =
                    (0..self.tokens).map(|t| scores.iter().map(|s| s[t]).fold(f32::NEG_INFINITY, f32::max)).collect();
                vec![self.top_k_selection(0, &best, k, scores.len())]
            }
        };
        HeadPlan { exact: false, steady_tokens: 0, pending_tokens: 0, selections }
    }
}

impl<E: Element> RowSource for FlatIndex<E> {
    fn head_rows<'a>(&'a self, kv_head: usize, plan: &'a HeadPlan) -> HeadRows<'a> {
        let d = self.head_dim;
        let (keys, values) = (&self.keys[kv_head], &self.values[kv_head]);
        if plan.exact {
            return HeadRows { steady: vec![Run::Plain(vec![PlainRows::of(keys, values)])], ..HeadRows::default() };
        }
        let selections = plan
            .selections
            .iter()
            .map(|sel| {
                let rows = sel
                    .retrieve
                    .iter()
                    .map(|span| {
                        let rows = span.start as usize * d..span.end as usize * d;
                        PlainRows::of(&keys[rows.clone()], &values[rows])
                    })
                    .collect();
                SelectionRows {
                    first_head: sel.first_head,
                    heads: sel.heads,
                    retrieve: vec![vec![Run::Plain(rows)]],
                    clusters: Vec::new(),
                    estimate: None,
                }
            })
            .collect();
        HeadRows { selections, ..HeadRows::default() }
    }

    fn exact_positions(&self, _kv_head: usize, plan: &HeadPlan, j: usize) -> Vec<u32> {
        if plan.exact {
            return (0..self.tokens as u32).collect();
        }
        plan.selections
            .iter()
            .filter(|s| (s.first_head..s.first_head + s.heads).contains(&j))
            .flat_map(|s| s.retrieve.iter().flat_map(|sp| sp.start..sp.end))
            .collect()
    }
}
