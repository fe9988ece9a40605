//! Exact decode attention and partial attention over token ranges (flash-decoding on the CPU).
//!
//! Keys and values are widened from their storage type tile by tile (64 rows) into f32
//! scratch, scored against all query heads of a GQA group, and folded into online-softmax
//! partials. Long ranges are split into chunks processed on rayon threads and merged by
//! log-sum-exp, so the memory system streams K and V once per step.

use super::microkernel;
use super::partial::Partial;
use super::prefetch::prefetch;
use super::simd::{axpy, dot};
use crate::element::Element;
use crate::error::{Error, Result};
use crate::shape::AttnShape;
use crate::view::HeadsView;
use rayon::prelude::*;
use std::ops::Range;
use wide::f32x8;

/// Rows scored, then accumulated, at a time: 128 rows × 128 dims × 2 B = 32 KiB per K or V
/// tile in f16. Against 256 rows, the value pass that fetches nothing from memory is half as
/// long: 0.63–0.72 of the memory-read baseline on two cores against 0.55–0.68 (`bench.md`).
const TILE_ROWS: usize = 128;
/// Rows one rayon task handles in [`exact_attention`]; large enough to amortize scheduling.
const CHUNK_ROWS: usize = 2048;

/// Reusable scratch for [`attend_rows`]: the queries as aligned vectors, the scores of one
/// tile, and (only for head dimensions that are not a multiple of 8) widened rows.
#[derive(Debug, Default, Clone)]
pub struct Scratch {
    queries: Vec<f32x8>,
    scores: Vec<f32>,
    wide: Vec<f32>,
    gather_keys: Vec<f32>,
    gather_values: Vec<f32>,
    /// Buffers of attention over 2-bit rows ([`super::hack_rows::HackRows::attend`]).
    pub hack: super::hack_rows::HackScratch,
}

/// Rows of short spans collected (widened) into one run before they are attended, so the
/// per-tile softmax bookkeeping is paid once per 64 rows instead of once per span.
const GATHER_ROWS: usize = 64;

/// Spans ahead whose first rows are prefetched (retrieved clusters and blocks are short runs
/// scattered in memory that no hardware prefetcher can guess).
const PREFETCH_SPANS: usize = 8;

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
    attend_spans(q, scale, std::iter::once((keys, values)), parts, scratch);
}

/// [`attend_rows`] over many runs of rows (the retrieved clusters of a plan), preparing the
/// queries once for all of them.
pub fn attend_spans<'a, E: Element>(
    q: &[f32],
    scale: f32,
    spans: impl IntoIterator<Item = (&'a [E], &'a [E])>,
    parts: &mut [Partial],
    scratch: &mut Scratch,
) {
    let g = parts.len();
    if g == 0 {
        return;
    }
    let d = q.len() / g;
    debug_assert_eq!(q.len(), g * d);
    if !d.is_multiple_of(8) {
        for (keys, values) in spans {
            attend_rows_unaligned(q, scale, keys, values, parts, scratch);
        }
        return;
    }
    let Scratch { queries, scores, gather_keys, gather_values, .. } = scratch;
    queries.clear();
    queries.extend(q.chunks_exact(8).map(|c| f32x8::from(<[f32; 8]>::try_from(c).unwrap_or_default())));
    scores.resize(TILE_ROWS * g, 0.0);
    gather_keys.resize(GATHER_ROWS * d, 0.0);
    gather_values.resize(GATHER_ROWS * d, 0.0);
    let mut gathered = 0;
    // Retrieved clusters are short runs scattered over the head's storage: no hardware
    // prefetcher can guess the next one, so ask for runs PREFETCH_SPANS ahead before working.
    let spans: Vec<(&[E], &[E])> = spans.into_iter().collect();
    for (i, &(keys, values)) in spans.iter().enumerate() {
        if let Some(&(k, v)) = spans.get(i + PREFETCH_SPANS) {
            prefetch(&k[..k.len().min(TILE_ROWS * d)]);
            prefetch(&v[..v.len().min(TILE_ROWS * d)]);
        }
        debug_assert_eq!(keys.len(), values.len());
        debug_assert_eq!(keys.len() % d, 0);
        let rows = keys.len() / d;
        if rows >= GATHER_ROWS / 2 {
            attend_tiles(queries, scale, keys, values, parts, scores, d);
            continue;
        }
        if gathered + rows > GATHER_ROWS {
            attend_gathered::<E>(queries, scale, (gather_keys, gather_values), gathered * d, parts, scores, d);
            gathered = 0;
        }
        as_elems_mut::<E>(gather_keys)[gathered * d..][..keys.len()].copy_from_slice(keys);
        as_elems_mut::<E>(gather_values)[gathered * d..][..values.len()].copy_from_slice(values);
        gathered += rows;
    }
    if gathered > 0 {
        attend_gathered::<E>(queries, scale, (gather_keys, gather_values), gathered * d, parts, scores, d);
    }
}

/// The gather buffer (f32 storage, so aligned for every element type) seen as elements of
/// the storage type: short spans are copied there as they are, not widened, so the gathered
/// run goes through the same kernel as a long span.
fn as_elems<E: Element>(buf: &[f32]) -> &[E] {
    bytemuck::cast_slice(buf)
}

fn as_elems_mut<E: Element>(buf: &mut [f32]) -> &mut [E] {
    bytemuck::cast_slice_mut(buf)
}

/// Attends the first `n` elements (whole rows) of the gather buffers.
fn attend_gathered<E: Element>(
    q: &[f32x8],
    scale: f32,
    (keys, values): (&[f32], &[f32]),
    n: usize,
    parts: &mut [Partial],
    scores: &mut [f32],
    d: usize,
) {
    attend_tiles(q, scale, &as_elems::<E>(keys)[..n], &as_elems::<E>(values)[..n], parts, scores, d);
}

/// The tile loop of [`attend_spans`] for one run of rows.
fn attend_tiles<E: Element>(
    q: &[f32x8],
    scale: f32,
    keys: &[E],
    values: &[E],
    parts: &mut [Partial],
    scores: &mut [f32],
    d: usize,
) {
    let (g, d8) = (parts.len(), d / 8);
    let tile = TILE_ROWS * d;
    for (i, (ktile, vtile)) in keys.chunks(tile).zip(values.chunks(tile)).enumerate() {
        let n = ktile.len() / d;
        // While scoring row t, ask for key row t + 32 (8 KiB ahead in f16) and for this
        // tile's value row t, which the value pass needs next.
        let start = i * tile;
        let k_ahead = &keys[(start + 32 * d).min(keys.len())..];
        let v_ahead = &values[start..(start + tile).min(values.len())];
        let ahead = [k_ahead, v_ahead];
        tile_scores(q, g, d8, ktile, n, scale, scores, TILE_ROWS, ahead);
        for (j, part) in parts.iter_mut().enumerate() {
            // Only the first n scores are live; pad them to whole vectors with -inf (weight 0).
            let s = &mut scores[j * TILE_ROWS..j * TILE_ROWS + n.next_multiple_of(8)];
            s[n..].fill(f32::NEG_INFINITY);
            let tile_max = super::simd::max_of(&s[..n]);
            part.rescale_to(part.m.max(tile_max));
            part.l += microkernel::exp_shifted_sum(s, part.m);
        }
        tile_values(scores, vtile, n, d8, parts);
    }
}

/// [`attend_rows`] for head dimensions that are not a multiple of 8: plain loops.
fn attend_rows_unaligned<E: Element>(
    q: &[f32],
    scale: f32,
    keys: &[E],
    values: &[E],
    parts: &mut [Partial],
    scratch: &mut Scratch,
) {
    let d = q.len() / parts.len();
    scratch.wide.resize(2 * d, 0.0);
    let (k, v) = scratch.wide.split_at_mut(d);
    for (krow, vrow) in keys.chunks_exact(d).zip(values.chunks_exact(d)) {
        E::widen(krow, k);
        E::widen(vrow, v);
        for (qrow, part) in q.chunks_exact(d).zip(parts.iter_mut()) {
            let s = dot(qrow, k) * scale;
            part.rescale_to(part.m.max(s));
            let p = (s - part.m).exp();
            part.l += p;
            axpy(p, v, &mut part.o);
        }
    }
}

/// Scores of a key tile against all `g` query heads, 4, 2 or 1 heads at a time.
#[allow(clippy::too_many_arguments, reason = "a hot inner kernel: its operands stay separate")]
pub(crate) fn tile_scores<E: Element>(
    q: &[f32x8],
    g: usize,
    d8: usize,
    k: &[E],
    n: usize,
    scale: f32,
    out: &mut [f32],
    stride: usize,
    ahead: [&[E]; 2],
) {
    let mut j = 0;
    while j < g {
        let (qs, os) = (&q[j * d8..], &mut out[j * stride..]);
        // Only the first group of heads prefetches: the rows are the same for every group.
        let ahead = if j == 0 { ahead } else { [&[][..], &[][..]] };
        let heads = match g - j {
            r if r >= 4 => 4,
            r if r >= 2 => 2,
            _ => 1,
        };
        match heads {
            4 => microkernel::scores::<4, E>(qs, k, n, d8, scale, os, stride, ahead),
            2 => microkernel::scores::<2, E>(qs, k, n, d8, scale, os, stride, ahead),
            _ => microkernel::scores::<1, E>(qs, k, n, d8, scale, os, stride, ahead),
        }
        j += heads;
    }
}

/// `o_j += Σ_t p_j[t]·v_t` for every head of `parts`, 4, 2 or 1 heads at a time.
fn tile_values<E: Element>(p: &[f32], v: &[E], n: usize, d8: usize, parts: &mut [Partial]) {
    let d = d8 * 8;
    if parts.len() == 4 && d8.is_multiple_of(2) {
        // The common GQA group of four over contiguous rows.
        let mut it = parts.iter_mut();
        let mut o: [&mut [f32]; 4] = std::array::from_fn(|_| it.next().map(|p| p.o.as_mut_slice()).unwrap_or_default());
        microkernel::accumulate_tile::<4, 2, E>(p, TILE_ROWS, v, n, d8, &mut o);
        return;
    }
    weighted_rows(p, TILE_ROWS, |t| &v[t * d..(t + 1) * d], n, d8, parts);
}

/// `o_j += Σ_t p[j·stride + t]·row(t)` for every head `j` of `parts` (rows of `8·d8`
/// elements), 4, 2 or 1 heads at a time: the value side of exact and estimated zones.
pub(crate) fn weighted_rows<'a, E: Element>(
    p: &[f32],
    stride: usize,
    row: impl Fn(usize) -> &'a [E] + Copy,
    n: usize,
    d8: usize,
    parts: &mut [Partial],
) {
    fn heads<const G: usize>(parts: &mut [Partial]) -> [&mut [f32]; G] {
        let mut it = parts.iter_mut();
        std::array::from_fn(|_| it.next().map(|p| p.o.as_mut_slice()).unwrap_or_default())
    }
    let mut j = 0;
    while j < parts.len() {
        let (ps, rest) = (&p[j * stride..], &mut parts[j..]);
        j += match rest.len() {
            r if r >= 4 && d8.is_multiple_of(2) => {
                microkernel::accumulate_rows::<4, 2, E>(ps, stride, row, n, d8, &mut heads::<4>(rest));
                4
            }
            r if r >= 2 && d8.is_multiple_of(4) => {
                microkernel::accumulate_rows::<2, 4, E>(ps, stride, row, n, d8, &mut heads::<2>(rest));
                2
            }
            _ if d8.is_multiple_of(8) => {
                microkernel::accumulate_rows::<1, 8, E>(ps, stride, row, n, d8, &mut heads::<1>(rest));
                1
            }
            _ => {
                microkernel::accumulate_rows::<1, 1, E>(ps, stride, row, n, d8, &mut heads::<1>(rest));
                1
            }
        };
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
        SplitMix64::new(seed).normals(n)
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
    fn spans_of_mixed_lengths_equal_attending_their_rows_in_one_run() {
        // Short spans are gathered into 64-row runs, long ones attended in place; the result
        // must equal one run over the same rows (order does not matter to softmax).
        let (d, g) = (64, 4);
        let mut rng = SplitMix64::new(21);
        let mut lens: Vec<usize> = (0..120).map(|_| 1 + rng.below(20)).collect();
        lens.extend([40, 300, 33, 1, 64, 2]);
        let total: usize = lens.iter().sum();
        let k: Vec<half::f16> = crate::narrow_vec(&randn(total * d, 22));
        let v: Vec<half::f16> = crate::narrow_vec(&randn(total * d, 23));
        let q = randn(g * d, 24);
        let mut scratch = Scratch::default();
        let mut spans = Vec::new();
        let mut at = 0;
        for &n in &lens {
            spans.push((&k[at * d..(at + n) * d], &v[at * d..(at + n) * d]));
            at += n;
        }
        let mut by_spans = vec![Partial::empty(d); g];
        attend_spans(&q, 0.125, spans, &mut by_spans, &mut scratch);
        let mut whole = vec![Partial::empty(d); g];
        attend_rows(&q, 0.125, &k, &v, &mut whole, &mut scratch);
        for (a, b) in by_spans.iter().zip(&whole) {
            let (a, b) = (a.finish(), b.finish());
            let err: f32 = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
            assert!(err < 1e-5, "{err}");
        }
    }

    #[test]
    fn every_head_dim_and_group_size_path_matches_the_reference() {
        // d = 12 takes the unaligned path; 24 the 1-vector blocks; 64 and 128 the wide ones.
        // Groups of 1, 3 (2 + 1), 4 and 7 (4 + 2 + 1) cover every head-blocking branch.
        for (d, g) in [(12, 3), (24, 3), (24, 7), (64, 1), (128, 4), (128, 7), (40, 2)] {
            let shape = AttnShape::new(g * 2, 2, d).unwrap();
            let tokens = 301;
            let k = randn(shape.kv_len(tokens), d as u64);
            let v = randn(shape.kv_len(tokens), 100 + d as u64);
            let q = randn(shape.query_len(), 200 + g as u64);
            let kv = HeadsView::new(&k, 2, tokens, d).unwrap();
            let vv = HeadsView::new(&v, 2, tokens, d).unwrap();
            let err =
                rel_l2(&exact_attention(&shape, &q, kv, vv).unwrap(), &reference_attention(&shape, &q, kv, vv, None));
            assert!(err < 1e-5, "d={d} g={g}: {err}");
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
