//! Centroid scoring and top-r selection: the retrieval step of a cluster index.

use super::simd::dot;
use crate::element::Element;
use wide::f32x8;

/// Writes `scale · q·row` for every `d`-element row of `rows` into `out` (cleared first).
/// Rows are widened 64 at a time so narrow storage costs no extra pass.
pub fn score_rows<E: Element>(q: &[f32], rows: &[E], scale: f32, out: &mut Vec<f32>) {
    let d = q.len();
    out.clear();
    out.reserve(rows.len() / d.max(1));
    let mut buf = vec![0.0f32; 64 * d];
    for tile in rows.chunks(64 * d) {
        let wide = &mut buf[..tile.len()];
        E::widen(tile, wide);
        out.extend(wide.chunks_exact(d).map(|r| dot(q, r) * scale));
    }
}

/// Scores of every row of `rows` (`n × d`) against all `g` query heads of `q` (`g × d`)
/// in one pass over `rows`: `out[j]` receives the `n` scaled scores of head `j`. This is
/// the planner's centroid scoring: one read of a head's meta data serves its whole group.
pub fn score_group<E: Element>(q: &[f32], g: usize, rows: &[E], scale: f32, out: &mut [Vec<f32>]) {
    let d = q.len() / g.max(1);
    let n = rows.len() / d.max(1);
    for o in out.iter_mut() {
        o.clear();
        o.resize(n, 0.0);
    }
    let mut slices: Vec<&mut [f32]> = out.iter_mut().map(Vec::as_mut_slice).collect();
    score_group_into(q, g, rows, scale, &mut slices);
}

/// [`score_group`] into slices the caller owns (`out[j]`: at least `n` scores of head `j`),
/// so scores computed in pieces on several threads land in place, with no copies after.
pub fn score_group_into<E: Element>(q: &[f32], g: usize, rows: &[E], scale: f32, out: &mut [&mut [f32]]) {
    let d = q.len() / g.max(1);
    if !d.is_multiple_of(8) {
        let mut one = Vec::new();
        for (j, qj) in q.chunks_exact(d).enumerate() {
            score_rows(qj, rows, scale, &mut one);
            out[j][..one.len()].copy_from_slice(&one);
        }
        return;
    }
    const TILE: usize = 256;
    let qv: Vec<f32x8> = q.chunks_exact(8).map(|c| f32x8::from(<[f32; 8]>::try_from(c).unwrap_or_default())).collect();
    let mut buf = vec![0.0f32; TILE * g];
    for (t, tile) in rows.chunks(TILE * d).enumerate() {
        let m = tile.len() / d;
        // Centroids are a cold stream (a decode step touches them once): ask for rows 32
        // ahead while scoring, as the exact kernel does for keys.
        let ahead = &rows[((t * TILE + 32) * d).min(rows.len())..];
        super::attention::tile_scores(&qv, g, d / 8, tile, m, scale, &mut buf, TILE, [ahead, &[]]);
        for (j, o) in out.iter_mut().enumerate() {
            o[t * TILE..t * TILE + m].copy_from_slice(&buf[j * TILE..j * TILE + m]);
        }
    }
}

/// Indices of the `r` largest scores, best first (ties broken by lower index; NaN sorts
/// lowest). `r` larger than `scores.len()` returns all indices.
///
/// For a small `r` out of many scores (a top-k over every token of a long context) a
/// threshold taken from a strided sample first discards almost every score in one pass, so
/// the exact selection only sorts out a few candidates; when the sample misjudges, the
/// full selection runs instead and the answer is the same.
pub fn top_r(scores: &[f32], r: usize) -> Vec<u32> {
    let r = r.min(scores.len());
    let by_score_desc = |a: &u32, b: &u32| {
        let (x, y) = (key(scores[*a as usize]), key(scores[*b as usize]));
        y.total_cmp(&x).then(a.cmp(b))
    };
    let mut idx = match threshold_candidates(scores, r) {
        Some(candidates) => candidates,
        None => (0..scores.len() as u32).collect(),
    };
    if r > 0 && r < idx.len() {
        idx.select_nth_unstable_by(r - 1, by_score_desc);
    }
    idx.truncate(r);
    idx.sort_unstable_by(by_score_desc);
    idx
}

/// The same indices as [`top_r`], in ascending index order instead of best first: the set a
/// planner turns into row spans, without the cost of ranking it. Works on integer keys
/// (order-preserving bits of the score, then the inverted index for ties), so selection
/// is a plain integer select.
pub fn top_r_set(scores: &[f32], r: usize) -> Vec<u32> {
    let r = r.min(scores.len());
    if r == 0 {
        return Vec::new();
    }
    if r == scores.len() {
        return (0..r as u32).collect();
    }
    let idx = threshold_candidates(scores, r).unwrap_or_else(|| (0..scores.len() as u32).collect());
    top_keys(idx.iter().map(|&i| rank_key(scores[i as usize], i)).collect(), r)
}

/// The selection key of score `x` at index `i`: a larger key is a better candidate (higher
/// score, then lower index; NaN lowest), so a top-k is an integer selection.
pub fn rank_key(x: f32, i: u32) -> u64 {
    ((ordered_bits(x) as u64) << 32) | (u32::MAX - i) as u64
}

/// The indices of the `r` largest keys of [`rank_key`], in ascending index order. Keys
/// given in ascending index order (as every threshold pass produces them) are filtered in
/// place by the `r`-th largest key, with no sort.
pub fn top_keys(keys: Vec<u64>, r: usize) -> Vec<u32> {
    let r = r.min(keys.len());
    if r == 0 {
        return Vec::new();
    }
    let cut = keys.len() - r;
    let least = if cut > 0 {
        let mut scratch = keys.clone();
        *scratch.select_nth_unstable(cut).1
    } else {
        0
    };
    // Keys are distinct (the index is in the low bits), so exactly `r` reach `least`.
    let mut idx: Vec<u32> = keys.iter().filter(|&&k| k >= least).map(|&k| u32::MAX - k as u32).collect();
    if !idx.is_sorted() {
        idx.sort_unstable();
    }
    idx
}

/// The zones of a cluster index's plan, chosen from one score per cluster: the first
/// vector (**retrieval**) takes the best-ranked clusters, best first, until their `sizes`
/// reach `retrieve_tokens` (or every cluster is taken); the second (**estimation**) the
/// next `estimate` clusters in rank order, or every cluster not retrieved when `estimate`
/// is `None`, in ascending index order. Ranks are those of [`rank_key`] (higher score, then
/// lower index; NaN last). `guess` is how many clusters retrieval should need; it doubles
/// while the retrieved sizes fall short.
///
/// A sampled threshold and one vector pass find a candidate set that holds both zones, so
/// only a few thousand of a long context's clusters are ever ranked; no vector of every
/// cluster is built.
pub fn select_zones(
    scores: &[f32],
    sizes: &[u32],
    retrieve_tokens: usize,
    guess: usize,
    estimate: Option<usize>,
) -> (Vec<u32>, Vec<u32>) {
    let n = scores.len().min(sizes.len());
    let scores = &scores[..n];
    let id = |k: u64| u32::MAX - k as u32;
    let desc = |a: &u64, b: &u64| b.cmp(a);
    let mut r1 = if retrieve_tokens == 0 { 0 } else { guess.clamp(1, n.max(1)).min(n) };
    loop {
        let mut cand = candidate_keys(scores, (r1 + estimate.unwrap_or(0)).min(n));
        let top = r1.min(cand.len());
        if top > 0 && top < cand.len() {
            cand.select_nth_unstable_by(top - 1, desc);
        }
        cand[..top].sort_unstable_by(desc);
        let mut retrieve = Vec::new();
        let mut got = 0usize;
        for &k in &cand[..top] {
            if got >= retrieve_tokens {
                break;
            }
            got += sizes[id(k) as usize] as usize;
            retrieve.push(id(k));
        }
        if got < retrieve_tokens && r1 < n {
            r1 = (r1 * 2).min(n);
            continue;
        }
        let m = retrieve.len();
        // Every cluster ranked below the last retrieved one, from `least` on.
        let below = cand[..m].last().copied().unwrap_or(u64::MAX);
        let least = match estimate {
            None => 0,
            Some(c) => {
                let k = (m + c).min(n);
                if k == m {
                    return (retrieve, Vec::new());
                }
                if k <= top {
                    cand[k - 1]
                } else {
                    *cand[top..].select_nth_unstable_by(k - top - 1, desc).1
                }
            }
        };
        let mut est = Vec::with_capacity(match estimate {
            Some(c) => c.min(n - m),
            None => n - m,
        });
        let keep = |i: usize| {
            let k = rank_key(scores[i], i as u32);
            if k >= least && k < below {
                est.push(i as u32);
            }
        };
        // A score filter first, unless the least key is that of -inf or below (NaN ranks as
        // -inf, and no score filter keeps NaN).
        let t = score_of_ordered_bits((least >> 32) as u32);
        if t.is_nan() || t == f32::NEG_INFINITY {
            (0..n).for_each(keep);
        } else {
            collect_at_least(scores, t, keep);
        }
        return (retrieve, est);
    }
}

/// Rank keys ([`rank_key`]) of a set of scores that holds the `want` best, unordered: those
/// at least a threshold from a strided sample (one vector pass), or all of them when the
/// sample cannot tell or the set would not be much smaller.
fn candidate_keys(scores: &[f32], want: usize) -> Vec<u64> {
    let n = scores.len();
    if want == 0 {
        return Vec::new();
    }
    if n >= 2048 && want <= n / 2 {
        let sample: Vec<f32> = scores.iter().step_by(SAMPLE_STRIDE).copied().collect();
        if let Some(t) = threshold_from_sample(&sample, SAMPLE_STRIDE, want) {
            let mut out = Vec::with_capacity(want + want / 2 + 8 * SAMPLE_STRIDE);
            collect_at_least(scores, t, |i| out.push(rank_key(scores[i], i as u32)));
            if out.len() >= want {
                return out;
            }
        }
    }
    scores.iter().enumerate().map(|(i, &x)| rank_key(x, i as u32)).collect()
}

/// The score whose [`ordered_bits`] are `t` (the inverse map; NaN never comes back).
fn score_of_ordered_bits(t: u32) -> f32 {
    f32::from_bits(if t >> 31 == 1 { t & !(1 << 31) } else { !t })
}

/// A score that about `1.25 r` of `n` scores reach, estimated from `sample`, the scores of
/// every `stride`-th of them (+8 sample ranks of slack, so a miss is rare); `None` when
/// the sample cannot tell (too few, or everything qualifies).
pub fn threshold_from_sample(sample: &[f32], stride: usize, r: usize) -> Option<f32> {
    if sample.is_empty() {
        return None;
    }
    let mut bits: Vec<u32> = sample.iter().map(|&x| ordered_bits(x)).collect();
    let rank = ((r as f64 * 1.25) as usize / stride.max(1) + 8).min(bits.len() - 1);
    let at = bits.len() - 1 - rank;
    let (_, t, _) = bits.select_nth_unstable(at);
    // Back from ordered bits to the score (the lowest possible key means no filtering).
    let x = score_of_ordered_bits(*t);
    (x != f32::NEG_INFINITY).then_some(x)
}

/// Bits of `x` as a `u32` that orders like the numbers (NaN lowest).
fn ordered_bits(x: f32) -> u32 {
    let b = key(x).to_bits();
    if b >> 31 == 1 {
        !b
    } else {
        b | 1 << 31
    }
}

/// [`threshold_from_sample`] over every 16th score; `None` when the pre-filter does not pay
/// (short inputs, large `r`).
fn sampled_threshold(scores: &[f32], r: usize) -> Option<f32> {
    let n = scores.len();
    if n < 8192 || r > n / 8 {
        return None;
    }
    let sample: Vec<f32> = scores.iter().step_by(SAMPLE_STRIDE).copied().collect();
    threshold_from_sample(&sample, SAMPLE_STRIDE, r)
}

/// Calls `push(i)` for every `i` with `scores[i] >= t`, eight scores per comparison.
fn collect_at_least(scores: &[f32], t: f32, mut push: impl FnMut(usize)) {
    let tv = f32x8::splat(t);
    let chunks = scores.chunks_exact(8);
    let rest = chunks.remainder();
    for (c, chunk) in chunks.enumerate() {
        let v = f32x8::from(<[f32; 8]>::try_from(chunk).unwrap_or_default());
        let mut mask = v.simd_ge(tv).to_bitmask();
        while mask != 0 {
            push(c * 8 + mask.trailing_zeros() as usize);
            mask &= mask - 1;
        }
    }
    let base = scores.len() - rest.len();
    for (i, &x) in rest.iter().enumerate() {
        if x >= t {
            push(base + i);
        }
    }
}

/// NaN ranks below every number.
fn key(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x
    }
}

/// Sample stride of the threshold pre-filter.
const SAMPLE_STRIDE: usize = 16;

/// Every index whose score is at least a threshold estimated from every 16th score, when
/// that keeps at least `r` of them (so it contains the true top `r`: every score left out
/// is below every score kept); `None` when the pre-filter does not apply or fails.
fn threshold_candidates(scores: &[f32], r: usize) -> Option<Vec<u32>> {
    let t = sampled_threshold(scores, r)?;
    let mut out = Vec::with_capacity(r * 2);
    collect_at_least(scores, t, |i| out.push(i as u32));
    (out.len() >= r).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn top_r_equals_a_full_sort_prefix(scores in proptest::collection::vec(-100.0f32..100.0, 0..300), r in 0usize..320) {
            let got = top_r(&scores, r);
            let mut all: Vec<u32> = (0..scores.len() as u32).collect();
            all.sort_by(|a, b| scores[*b as usize].total_cmp(&scores[*a as usize]).then(a.cmp(b)));
            all.truncate(r);
            prop_assert_eq!(got, all);
        }
    }

    proptest! {
        #[test]
        fn top_keys_is_the_ascending_top_set_in_any_input_order(
            scores in proptest::collection::vec(-4i8..4, 0..200),
            r in 0usize..220,
            seed in any::<u64>(),
        ) {
            // Coarse scores force ties; a shuffled input order takes the sorting path.
            let keys: Vec<u64> = scores.iter().enumerate().map(|(i, &x)| rank_key(f32::from(x), i as u32)).collect();
            let mut all: Vec<u32> = (0..scores.len() as u32).collect();
            all.sort_by(|a, b| scores[*b as usize].cmp(&scores[*a as usize]).then(a.cmp(b)));
            all.truncate(r);
            all.sort_unstable();
            prop_assert_eq!(top_keys(keys.clone(), r), all.clone());
            let mut shuffled = keys;
            let mut g = crate::random::SplitMix64::new(seed);
            for i in (1..shuffled.len()).rev() {
                shuffled.swap(i, g.below(i + 1));
            }
            prop_assert_eq!(top_keys(shuffled, r), all);
        }
    }

    /// What [`select_zones`] must return, from a full sort.
    fn zones_by_sorting(scores: &[f32], sizes: &[u32], tokens: usize, estimate: Option<usize>) -> (Vec<u32>, Vec<u32>) {
        let mut all: Vec<u32> = (0..scores.len() as u32).collect();
        all.sort_by(|a, b| key(scores[*b as usize]).total_cmp(&key(scores[*a as usize])).then(a.cmp(b)));
        let mut got = 0;
        let m = all
            .iter()
            .take_while(|&&i| {
                let more = got < tokens;
                got += sizes[i as usize] as usize;
                more
            })
            .count();
        let end = estimate.map_or(all.len(), |c| (m + c).min(all.len()));
        let mut est = all[m..end].to_vec();
        est.sort_unstable();
        (all[..m].to_vec(), est)
    }

    proptest! {
        #[test]
        fn select_zones_equals_ranking_every_cluster(
            scores in proptest::collection::vec(-8i8..8, 0..400),
            sizes in proptest::collection::vec(0u32..40, 400),
            tokens in 0usize..600,
            guess in 0usize..40,
            estimate in proptest::option::of(0usize..450),
        ) {
            // Coarse scores force ties at both zone boundaries.
            let scores: Vec<f32> = scores.iter().map(|&x| f32::from(x) / 2.0).collect();
            let sizes = &sizes[..scores.len()];
            prop_assert_eq!(
                select_zones(&scores, sizes, tokens, guess, estimate),
                zones_by_sorting(&scores, sizes, tokens, estimate)
            );
        }
    }

    #[test]
    fn select_zones_on_long_inputs_takes_the_sampled_path_and_agrees() {
        let mut g = crate::random::SplitMix64::new(5);
        for (n, tokens, guess, estimate) in [
            (8192usize, 2440usize, 313usize, Some(1900usize)),
            (8192, 2440, 20, Some(1900)),
            (8192, 2440, 313, None),
            (20_000, 100, 10, Some(4000)),
            (4096, 0, 0, Some(1000)),
            (4096, 50_000, 8, Some(10)),
        ] {
            let mut scores: Vec<f32> = (0..n).map(|_| (g.normal() * 20.0).round() / 4.0).collect();
            for i in (0..n).step_by(991) {
                scores[i] = f32::NAN;
            }
            let sizes: Vec<u32> = (0..n).map(|_| 1 + g.below(31) as u32).collect();
            assert_eq!(
                select_zones(&scores, &sizes, tokens, guess, estimate),
                zones_by_sorting(&scores, &sizes, tokens, estimate),
                "n={n} tokens={tokens} guess={guess} estimate={estimate:?}"
            );
        }
    }

    #[test]
    fn prefiltered_top_r_equals_a_full_sort_prefix_on_long_inputs() {
        let mut g = crate::random::SplitMix64::new(11);
        for (n, r) in [(8192usize, 1usize), (20_000, 37), (50_000, 2500), (50_000, 6250), (9000, 1125)] {
            // Coarse values force many ties at the threshold; a few NaNs must rank last.
            let mut scores: Vec<f32> = (0..n).map(|_| (g.normal() * 20.0).round() / 4.0).collect();
            for i in (0..n).step_by(997) {
                scores[i] = f32::NAN;
            }
            let got = top_r(&scores, r);
            let mut all: Vec<u32> = (0..n as u32).collect();
            all.sort_by(|a, b| key(scores[*b as usize]).total_cmp(&key(scores[*a as usize])).then(a.cmp(b)));
            all.truncate(r);
            assert_eq!(got, all, "n={n} r={r}");
            all.sort_unstable();
            assert_eq!(top_r_set(&scores, r), all, "n={n} r={r}: the set in index order");
        }
    }

    #[test]
    fn group_scoring_matches_per_head_scoring() {
        for d in [8, 12, 64] {
            let q: Vec<f32> = (0..3 * d).map(|i| (i % 7) as f32 - 3.0).collect();
            let rows: Vec<f32> = (0..300 * d).map(|i| ((i * 31) % 11) as f32 * 0.1).collect();
            let mut group = vec![Vec::new(); 3];
            score_group(&q, 3, &rows, 0.5, &mut group);
            for (j, got) in group.iter().enumerate() {
                let mut want = Vec::new();
                score_rows(&q[j * d..(j + 1) * d], &rows, 0.5, &mut want);
                for (a, b) in got.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-3 * (1.0 + b.abs()), "d={d}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn score_rows_matches_dot_products() {
        let q = [1.0f32, 2.0, 3.0];
        let rows = [1.0f32, 0.0, 0.0, 0.0, 1.0, 1.0];
        let mut out = Vec::new();
        score_rows(&q, &rows, 0.5, &mut out);
        assert_eq!(out, vec![0.5, 2.5]);
    }
}
