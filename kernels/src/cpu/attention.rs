//! Exact decode attention and partial attention over token ranges (flash-decoding on the CPU).
//!
//! Keys and values are widened from their storage type tile by tile (64 rows) into f32
//! scratch, scored against all query heads of a GQA group, and folded into online-softmax
//! partials. Long ranges are split into chunks processed on rayon threads and merged by
//! log-sum-exp, so the memory system streams K and V once per step.

use super::partial::Partial;
use super::simd::{axpy, dot};
use crate::element::Element;
use crate::error::{Error, Result};
use crate::shape::AttnShape;
use crate::view::HeadsView;
use rayon::prelude::*;
use std::ops::Range;

/// Rows widened at a time: 64 rows × 128 dims × 4 B = 32 KiB per K or V tile (fits L2).
const TILE_ROWS: usize = 64;
/// Rows one rayon task handles in [`exact_attention`]; large enough to amortize scheduling.
const CHUNK_ROWS: usize = 2048;

/// Reusable f32 scratch for [`attend_rows`].
#[derive(Debug, Default)]
pub struct Scratch {
    keys: Vec<f32>,
    values: Vec<f32>,
    scores: Vec<f32>,
}

/// Folds the rows `keys`/`values` (each `n × d`, same storage type) into the partials of the
/// `g = parts.len()` query heads whose vectors are the rows of `q` (`g × d`).
/// `scale` multiplies every dot product (normally `1/√d`).
pub fn attend_rows<E: Element>(
    q: &[f32],
    scale: f32,
    keys: &[E],
    values: &[E],
    parts: &mut [Partial],
    scratch: &mut Scratch,
) {
    let g = parts.len();
    if g == 0 || keys.is_empty() {
        return;
    }
    let d = q.len() / g;
    debug_assert_eq!(q.len(), g * d);
    debug_assert_eq!(keys.len(), values.len());
    debug_assert_eq!(keys.len() % d, 0);
    scratch.keys.resize(TILE_ROWS * d, 0.0);
    scratch.values.resize(TILE_ROWS * d, 0.0);
    scratch.scores.resize(TILE_ROWS * g, 0.0);
    for (ktile, vtile) in keys.chunks(TILE_ROWS * d).zip(values.chunks(TILE_ROWS * d)) {
        let n = ktile.len() / d;
        let kbuf = &mut scratch.keys[..n * d];
        E::widen(ktile, kbuf);
        for (t, krow) in kbuf.chunks_exact(d).enumerate() {
            for (j, qrow) in q.chunks_exact(d).enumerate() {
                scratch.scores[j * TILE_ROWS + t] = dot(qrow, krow) * scale;
            }
        }
        for (j, part) in parts.iter_mut().enumerate() {
            let s = &mut scratch.scores[j * TILE_ROWS..j * TILE_ROWS + n];
            let tile_max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            part.rescale_to(part.m.max(tile_max));
            let m = part.m;
            let mut sum = 0.0;
            for x in s.iter_mut() {
                *x = (*x - m).exp();
                sum += *x;
            }
            part.l += sum;
        }
        let vbuf = &mut scratch.values[..n * d];
        E::widen(vtile, vbuf);
        for (t, vrow) in vbuf.chunks_exact(d).enumerate() {
            for (j, part) in parts.iter_mut().enumerate() {
                axpy(scratch.scores[j * TILE_ROWS + t], vrow, &mut part.o);
            }
        }
    }
}

/// Partials of the query heads `q` (`g × d`) over the token ranges `ranges` of one head's
/// rows (`keys`/`values`: `tokens × d`). Single-threaded: callers parallelize across heads.
pub fn attend_ranges<E: Element>(
    q: &[f32],
    g: usize,
    scale: f32,
    keys: &[E],
    values: &[E],
    ranges: &[Range<usize>],
    scratch: &mut Scratch,
) -> Vec<Partial> {
    let d = q.len() / g.max(1);
    let mut parts = vec![Partial::empty(d); g];
    for r in ranges {
        let span = r.start * d..r.end * d;
        attend_rows(q, scale, &keys[span.clone()], &values[span], &mut parts, scratch);
    }
    parts
}

/// Checks the query and KV buffers of an attention call against `shape`.
pub fn check_inputs<E>(shape: &AttnShape, q: &[f32], keys: &HeadsView<'_, E>, values: &HeadsView<'_, E>) -> Result<()> {
    if q.len() != shape.query_len() {
        return Err(Error::ShapeMismatch {
            what: "queries (q_heads × head_dim)",
            expected: shape.query_len(),
            got: q.len(),
        });
    }
    for (what, v) in [("keys", keys), ("values", values)] {
        if v.heads() != shape.kv_heads || v.head_dim() != shape.head_dim {
            return Err(Error::ShapeMismatch {
                what,
                expected: shape.kv_len(v.tokens()),
                got: v.heads() * v.tokens() * v.head_dim(),
            });
        }
    }
    if keys.tokens() != values.tokens() {
        return Err(Error::ShapeMismatch {
            what: "values (same tokens as keys)",
            expected: keys.data().len(),
            got: values.data().len(),
        });
    }
    Ok(())
}

/// Partials of every query head over all tokens, multi-threaded over (KV head, chunk).
/// Returns `q_heads` partials in query-head order.
pub fn exact_partials<E: Element>(
    shape: &AttnShape,
    q: &[f32],
    keys: HeadsView<'_, E>,
    values: HeadsView<'_, E>,
) -> Result<Vec<Partial>> {
    check_inputs(shape, q, &keys, &values)?;
    let (g, d, tokens) = (shape.group(), shape.head_dim, keys.tokens());
    let chunks = tokens.div_ceil(CHUNK_ROWS).max(1);
    let scale = shape.scale();
    let per_chunk: Vec<Vec<Partial>> = (0..shape.kv_heads * chunks)
        .into_par_iter()
        .map_init(Scratch::default, |scratch, job| {
            let (h, c) = (job / chunks, job % chunks);
            let rows = c * CHUNK_ROWS..((c + 1) * CHUNK_ROWS).min(tokens);
            let qg = &q[h * g * d..(h + 1) * g * d];
            attend_ranges(qg, g, scale, keys.head(h), values.head(h), &[rows], scratch)
        })
        .collect();
    let mut out = Vec::with_capacity(shape.q_heads);
    for h in 0..shape.kv_heads {
        let mut acc = vec![Partial::empty(d); g];
        for chunk in &per_chunk[h * chunks..(h + 1) * chunks] {
            for (a, p) in acc.iter_mut().zip(chunk) {
                a.merge(p);
            }
        }
        out.extend(acc);
    }
    Ok(out)
}

/// Exact decode attention (GQA): one query vector per query head (`q`: `q_heads × d`)
/// against `tokens` keys and values per KV head. Returns `q_heads × d` outputs.
pub fn exact_attention<E: Element>(
    shape: &AttnShape,
    q: &[f32],
    keys: HeadsView<'_, E>,
    values: HeadsView<'_, E>,
) -> Result<Vec<f32>> {
    let parts = exact_partials(shape, q, keys, values)?;
    Ok(parts.iter().flat_map(|p| p.finish()).collect())
}

#[cfg(test)]
mod tests {
    use super::super::partial::merge_all;
    use super::super::reference::{reference_attention, rel_l2};
    use super::*;
    use crate::random::SplitMix64;

    fn randn(n: usize, seed: u64) -> Vec<f32> {
        let mut g = SplitMix64::new(seed);
        (0..n).map(|_| g.normal()).collect()
    }

    #[test]
    fn exact_attention_matches_f64_reference() {
        let shape = AttnShape::new(8, 2, 64).unwrap();
        let tokens = 5000;
        let k = randn(shape.kv_len(tokens), 1);
        let v = randn(shape.kv_len(tokens), 2);
        let q: Vec<f32> = randn(shape.query_len(), 3).iter().map(|x| x * 3.0).collect();
        let kv = HeadsView::new(&k, 2, tokens, 64).unwrap();
        let vv = HeadsView::new(&v, 2, tokens, 64).unwrap();
        let out = exact_attention(&shape, &q, kv, vv).unwrap();
        let reference = reference_attention(&shape, &q, kv, vv, None);
        assert!(rel_l2(&out, &reference) < 1e-5, "{}", rel_l2(&out, &reference));
    }

    #[test]
    fn merging_partials_of_a_random_split_equals_exact() {
        let (d, tokens) = (32, 700);
        let k = randn(tokens * d, 4);
        let v = randn(tokens * d, 5);
        let q = randn(2 * d, 6);
        let mut scratch = Scratch::default();
        let whole = attend_ranges(&q, 2, 0.2, &k, &v, &[0..tokens], &mut scratch);
        let mut rng = SplitMix64::new(9);
        let mut cuts: Vec<usize> = (0..6).map(|_| rng.below(tokens)).collect();
        cuts.extend([0, tokens]);
        cuts.sort_unstable();
        let pieces: Vec<Vec<Partial>> =
            cuts.windows(2).map(|w| attend_ranges(&q, 2, 0.2, &k, &v, &[w[0]..w[1]], &mut scratch)).rev().collect();
        for j in 0..2 {
            let merged = merge_all(d, pieces.iter().map(|p| &p[j]));
            let (a, b) = (merged.finish(), whole[j].finish());
            let err: f32 = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
            assert!(err < 1e-5, "head {j}: {err}");
        }
    }

    #[test]
    fn wrong_query_length_is_a_shape_error() {
        let shape = AttnShape::new(4, 2, 8).unwrap();
        let k = vec![0.0f32; 2 * 3 * 8];
        let view = HeadsView::new(&k, 2, 3, 8).unwrap();
        assert!(matches!(
            exact_attention(&shape, &[0.0; 31], view, view),
            Err(Error::ShapeMismatch { expected: 32, got: 31, .. })
        ));
    }
}
