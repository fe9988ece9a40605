//! The estimation zone (RetroInfer §tripartite attention): a cluster's tokens are treated as
//! if every key equalled the cluster's mean key, so the cluster contributes score mass
//! `size · exp(q·c·scale)` and value mass `exp(q·c·scale) · size · mean_value`.
//! By Jensen's inequality this under-estimates the cluster's true softmax mass.

use super::partial::Partial;
use super::simd::axpy;
use crate::element::Element;

/// One estimated cluster: its scaled score `scale · q·centroid`, its size, and its mean value.
#[derive(Debug, Clone, Copy)]
pub struct EstimateItem<'a, E> {
    /// `scale · q·centroid`.
    pub score: f32,
    /// Number of tokens the cluster stands for.
    pub size: f32,
    /// Mean of the cluster's value vectors (`d` elements).
    pub value_mean: &'a [E],
}

/// Estimation partials of `heads` query heads that share one list of `n` clusters:
/// `scores` holds `heads × n` scaled scores, `sizes` the cluster sizes, and `value_mean(c)`
/// the mean value row of the `c`-th listed cluster (`head_dim` elements). The weights
/// `size·exp(s − m)` are computed with vector exp and folded in with the same register-
/// blocked kernel as exact values, so one read of a value mean serves every head.
/// A score of `-inf` leaves its cluster out (weight zero); if a head's every score is
/// `-inf`, its partial is empty.
pub fn estimate_group<'a, E: Element>(
    scores: &[f32],
    sizes: &[f32],
    value_mean: impl Fn(usize) -> &'a [E] + Copy,
    head_dim: usize,
    heads: usize,
) -> Vec<Partial> {
    estimate_group_strided(scores, sizes.len(), sizes, value_mean, head_dim, heads)
}

/// [`estimate_group`] with head `j`'s scores at `scores[j · score_stride..][..n]`: a run of
/// columns of a wider `heads × score_stride` score matrix, so a long cluster list can be
/// estimated in pieces (on several threads) whose partials merge into the whole.
pub fn estimate_group_strided<'a, E: Element>(
    scores: &[f32],
    score_stride: usize,
    sizes: &[f32],
    value_mean: impl Fn(usize) -> &'a [E] + Copy,
    head_dim: usize,
    heads: usize,
) -> Vec<Partial> {
    let n = sizes.len();
    let mut parts = vec![Partial::empty(head_dim); heads];
    if n == 0 {
        return parts;
    }
    let stride = n.next_multiple_of(8);
    let mut weights = vec![f32::NEG_INFINITY; heads * stride];
    for (j, part) in parts.iter_mut().enumerate() {
        let w = &mut weights[j * stride..(j + 1) * stride];
        w[..n].copy_from_slice(&scores[j * score_stride..][..n]);
        part.m = w[..n].iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if part.m == f32::NEG_INFINITY {
            // Every listed weight is zero (`-inf` scores mark clusters left out): an empty
            // partial, not `exp(-inf + inf)`.
            w.fill(0.0);
            continue;
        }
        super::microkernel::exp_shifted_sum(w, part.m);
        let mut l = 0.0;
        for (x, s) in w.iter_mut().zip(sizes) {
            *x *= s;
            l += *x;
        }
        part.l = l;
    }
    if head_dim.is_multiple_of(8) {
        // The listed clusters' value means lie scattered over the directory, and the
        // register-blocked kernel walks its rows once per 16 columns. Tiles of rows that
        // stay in L1 across those walks, with the next tile asked for ahead, keep it from
        // stalling on one cache miss at a time.
        const TILE: usize = 32;
        let tile_rows = |t0: usize| (t0..(t0 + TILE).min(n)).for_each(|c| super::prefetch::prefetch(value_mean(c)));
        tile_rows(0);
        for t0 in (0..n).step_by(TILE) {
            tile_rows(t0 + TILE);
            let rows = TILE.min(n - t0);
            super::attention::weighted_rows(
                &weights[t0..],
                stride,
                |c| value_mean(t0 + c),
                rows,
                head_dim / 8,
                &mut parts,
            );
        }
    } else {
        let mut wide = vec![0.0f32; head_dim];
        for (j, part) in parts.iter_mut().enumerate() {
            for c in 0..n {
                E::widen(value_mean(c), &mut wide);
                axpy(weights[j * stride + c], &wide, &mut part.o);
            }
        }
    }
    parts
}

/// The estimation partial of one query head over `items` (single pass, online rescaling).
pub fn estimate_partial<'a, E: Element>(
    head_dim: usize,
    items: impl IntoIterator<Item = EstimateItem<'a, E>>,
) -> Partial {
    let mut p = Partial::empty(head_dim);
    let mut wide = vec![0.0f32; head_dim];
    for it in items {
        if it.size <= 0.0 {
            continue;
        }
        if it.score > p.m {
            p.rescale_to(it.score);
        }
        let w = it.size * (it.score - p.m).exp();
        p.l += w;
        E::widen(it.value_mean, &mut wide);
        axpy(w, &wide, &mut p.o);
    }
    p
}

#[cfg(test)]
mod tests {
    use super::super::attention::{attend_ranges, Scratch};
    use super::*;
    use crate::random::SplitMix64;

    #[test]
    fn minus_infinity_scores_leave_clusters_out() {
        let (d, heads, n) = (16, 4, 67);
        let mut g = SplitMix64::new(9);
        let v: Vec<f32> = (0..n * d).map(|_| g.normal()).collect();
        let sizes: Vec<f32> = (0..n).map(|i| (1 + i % 7) as f32).collect();
        let scores: Vec<f32> = (0..heads * n).map(|_| g.normal() * 2.0).collect();
        let kept: Vec<usize> = (0..n).filter(|i| i % 3 != 0).collect();
        let masked: Vec<f32> =
            (0..heads * n).map(|i| if (i % n) % 3 == 0 { f32::NEG_INFINITY } else { scores[i] }).collect();
        let dense = estimate_group(&masked, &sizes, |c| &v[c * d..(c + 1) * d], d, heads);
        let listed_scores: Vec<f32> =
            (0..heads).flat_map(|j| kept.iter().map(move |&c| j * n + c)).map(|i| scores[i]).collect();
        let listed_sizes: Vec<f32> = kept.iter().map(|&c| sizes[c]).collect();
        let listed = estimate_group(&listed_scores, &listed_sizes, |c| &v[kept[c] * d..(kept[c] + 1) * d], d, heads);
        for (a, b) in dense.iter().zip(&listed) {
            for (x, y) in a.finish().iter().zip(&b.finish()) {
                assert!((x - y).abs() < 1e-5, "{x} vs {y}");
            }
            assert!((a.lse() - b.lse()).abs() < 1e-4, "{} vs {}", a.lse(), b.lse());
        }
        let none = estimate_group(&vec![f32::NEG_INFINITY; heads * n], &sizes, |c| &v[c * d..(c + 1) * d], d, heads);
        for p in &none {
            assert_eq!(p.l, 0.0);
            assert!(p.o.iter().all(|&x| x == 0.0));
        }
    }

    #[test]
    fn group_estimation_equals_per_item_estimation() {
        for d in [12, 64] {
            let (heads, n) = (3, 101);
            let mut g = SplitMix64::new(d as u64);
            let v: Vec<f32> = (0..n * d).map(|_| g.normal()).collect();
            let scores: Vec<f32> = (0..heads * n).map(|_| g.normal() * 3.0).collect();
            let sizes: Vec<f32> = (0..n).map(|i| (1 + i % 20) as f32).collect();
            let group = estimate_group(&scores, &sizes, |c| &v[c * d..(c + 1) * d], d, heads);
            for (j, got) in group.iter().enumerate() {
                let want = estimate_partial(
                    d,
                    (0..n).map(|c| EstimateItem {
                        score: scores[j * n + c],
                        size: sizes[c],
                        value_mean: &v[c * d..(c + 1) * d],
                    }),
                );
                for (a, b) in got.finish().iter().zip(want.finish()) {
                    assert!((a - b).abs() < 1e-5, "d={d} head {j}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn estimation_over_clusters_of_size_one_equals_exact() {
        let (d, n) = (16, 300);
        let mut g = SplitMix64::new(11);
        let k: Vec<f32> = (0..n * d).map(|_| g.normal()).collect();
        let v: Vec<f32> = (0..n * d).map(|_| g.normal()).collect();
        let q: Vec<f32> = (0..d).map(|_| g.normal()).collect();
        let scale = 0.25;
        let exact = attend_ranges(&q, 1, scale, &k, &v, &[0..n], &mut Scratch::default());
        let items = (0..n).map(|t| EstimateItem {
            score: scale * q.iter().zip(&k[t * d..(t + 1) * d]).map(|(a, b)| a * b).sum::<f32>(),
            size: 1.0,
            value_mean: &v[t * d..(t + 1) * d],
        });
        let est = estimate_partial(d, items);
        let (a, b) = (est.finish(), exact[0].finish());
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
    }
}
