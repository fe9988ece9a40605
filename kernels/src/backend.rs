//! Where CPU and CUDA meet: a [`Backend`] folds rows stored in **row blocks** into
//! online-softmax partials. A row block holds the key rows of `R` tokens followed by their
//! value rows (`[K × R][V × R]`, `R` = rows per block), so one block serves a token's key and
//! value, and row `r` of a block is addressed alike on both sides: the CPU reads it in
//! the block's memory, the GPU at arena row `slot · 2R + r`. The engine's executor gathers
//! (pins) the blocks a plan reads once, describes them in its backend's terms, and merges
//! what the backend returns with the zones it keeps on the CPU; the mechanism (tiers, pins)
//! stays in the engine and the buffer manager.
//!
//! Implementations: [`CpuBackend`] (rows read in place, `cpu::attention::attend_spans`) and,
//! behind the `cuda` feature, `cuda::CudaBlocks` (one kernel launch for every KV head).

use crate::cpu::attention::{attend_spans, Scratch};
use crate::element::Element;
use crate::error::Result;
use crate::Partial;
use std::marker::PhantomData;
use std::ops::Range;

/// Rows `rows` (within the block, below `R`) of one row block, as a backend names the block.
#[derive(Debug, Clone)]
pub struct BlockRows<B> {
    /// The block.
    pub block: B,
    /// Its rows to attend.
    pub rows: Range<usize>,
}

/// Folds the rows of row blocks into partials.
///
/// Contract:
/// - `q` holds the queries of every query head, KV head after KV head (`parts.len() × d`
///   values, `parts.len()` a multiple of `blocks.len()`: the group size);
/// - `blocks[h]` are KV head `h`'s blocks; each listed row is attended exactly once, in any
///   order (the result is the same partial up to summation order);
/// - every row's key and value are folded into the partial of each query head of its group
///   (`parts` keep what they held: a backend merges, it does not overwrite);
/// - a block whose rows lie outside `0..rows_per_block`, or that the backend cannot read,
///   is a typed error and `parts` are then unspecified.
pub trait Backend {
    /// How this backend names a block.
    type Block<'a>;

    /// Folds `blocks` (`R` = `rows_per_block` rows each) into `parts` for queries `q`,
    /// scaled by `scale`.
    fn attend_blocks(
        &mut self,
        q: &[f32],
        scale: f32,
        rows_per_block: usize,
        blocks: &[Vec<BlockRows<Self::Block<'_>>>],
        parts: &mut [Partial],
    ) -> Result<()>;
}

/// The CPU backend over row blocks of element type `E` in host memory: a block is its
/// elements (at least `2R × d`: a block may end in padding), read in place.
#[derive(Debug)]
pub struct CpuBackend<'s, E> {
    scratch: &'s mut Scratch,
    element: PhantomData<E>,
}

impl<'s, E: Element> CpuBackend<'s, E> {
    /// A backend whose kernels use (and keep) the buffers of `scratch`.
    pub fn new(scratch: &'s mut Scratch) -> Self {
        Self { scratch, element: PhantomData }
    }
}

impl<E: Element> Backend for CpuBackend<'_, E> {
    type Block<'a> = &'a [E];

    fn attend_blocks(
        &mut self,
        q: &[f32],
        scale: f32,
        rows_per_block: usize,
        blocks: &[Vec<BlockRows<&[E]>>],
        parts: &mut [Partial],
    ) -> Result<()> {
        if blocks.is_empty() || parts.is_empty() {
            return Ok(());
        }
        let group = parts.len() / blocks.len();
        let d = q.len() / parts.len();
        check_blocks(blocks, parts.len(), rows_per_block, |b| b.len() >= 2 * rows_per_block * d)?;
        for (h, head) in blocks.iter().enumerate() {
            let v_at = rows_per_block * d;
            let spans = head.iter().map(|b| {
                let (k, v) = b.block.split_at(v_at);
                (&k[b.rows.start * d..b.rows.end * d], &v[b.rows.start * d..b.rows.end * d])
            });
            let heads = h * group..(h + 1) * group;
            attend_spans(&q[heads.start * d..heads.end * d], scale, spans, &mut parts[heads], self.scratch);
        }
        Ok(())
    }
}

/// The checks of [`Backend`]'s contract every backend makes: `parts` a multiple of the KV
/// heads, rows within blocks, and each block readable (`fits`).
pub(crate) fn check_blocks<B>(
    blocks: &[Vec<BlockRows<B>>],
    parts: usize,
    rows_per_block: usize,
    fits: impl Fn(&B) -> bool,
) -> Result<()> {
    let bad = |message: String| crate::Error::InvalidArgument { what: "row blocks", message };
    if !parts.is_multiple_of(blocks.len()) {
        return Err(bad(format!("{parts} query heads do not split into {} KV heads", blocks.len())));
    }
    for (h, head) in blocks.iter().enumerate() {
        for (i, b) in head.iter().enumerate() {
            if b.rows.start > b.rows.end || b.rows.end > rows_per_block {
                return Err(bad(format!("block {i} of KV head {h}: rows {:?} outside 0..{rows_per_block}", b.rows)));
            }
            if !fits(&b.block) {
                return Err(bad(format!("block {i} of KV head {h} holds fewer than 2 × {rows_per_block} rows")));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::reference::{reference_attention, rel_l2};
    use crate::random::SplitMix64;
    use crate::{AttnShape, HeadsView};
    use half::f16;

    #[test]
    fn rows_in_blocks_give_the_attention_of_the_same_rows_in_order() {
        let (kv_heads, group, d, per) = (2, 3, 16, 4);
        let shape = AttnShape::new(kv_heads * group, kv_heads, d).unwrap();
        let mut rng = SplitMix64::new(9);
        let q = rng.normals(shape.q_heads * d);
        // Per KV head 5 blocks of R = 4 rows; attend rows 1..4 of block 0, all of 1..4.
        let blocks: Vec<Vec<Vec<f16>>> = (0..kv_heads)
            .map(|_| (0..5).map(|_| rng.normals(2 * per * d).into_iter().map(f16::from_f32).collect()).collect())
            .collect();
        let rows = |b: usize| if b == 0 { 1..4 } else { 0..per };
        // The same rows as plain K and V, in order, for the f64 reference.
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for head in &blocks {
            for (b, block) in head.iter().enumerate() {
                for r in rows(b) {
                    keys.extend(block[r * d..(r + 1) * d].iter().map(|x| x.to_f32()));
                    values.extend(block[(per + r) * d..(per + r + 1) * d].iter().map(|x| x.to_f32()));
                }
            }
        }
        let tokens = keys.len() / (kv_heads * d);
        let (k, v) = (
            HeadsView::new(&keys, kv_heads, tokens, d).unwrap(),
            HeadsView::new(&values, kv_heads, tokens, d).unwrap(),
        );
        let want = reference_attention(&shape, &q, k, v, None);
        let described: Vec<Vec<BlockRows<&[f16]>>> = blocks
            .iter()
            .map(|head| head.iter().enumerate().map(|(b, x)| BlockRows { block: &x[..], rows: rows(b) }).collect())
            .collect();
        let mut scratch = Scratch::default();
        let mut parts = vec![Partial::empty(d); shape.q_heads];
        let scale = 1.0 / (d as f32).sqrt();
        CpuBackend::<f16>::new(&mut scratch).attend_blocks(&q, scale, per, &described, &mut parts).unwrap();
        let got: Vec<f32> = parts.iter().flat_map(|p| p.finish()).collect();
        assert!(rel_l2(&got, &want) < 1e-5, "{}", rel_l2(&got, &want));
        // Rows outside a block, a short block and heads that do not split are typed errors.
        let mut bad = described.clone();
        bad[1][2].rows = 2..5;
        assert!(CpuBackend::<f16>::new(&mut scratch).attend_blocks(&q, scale, per, &bad, &mut parts).is_err());
        let mut short = described.clone();
        short[0][0].block = &blocks[0][0][..per * d];
        assert!(CpuBackend::<f16>::new(&mut scratch).attend_blocks(&q, scale, per, &short, &mut parts).is_err());
        let mut odd = vec![Partial::empty(d); 5];
        assert!(CpuBackend::<f16>::new(&mut scratch)
            .attend_blocks(&q[..5 * d], scale, per, &described, &mut odd)
            .is_err());
    }
}
