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
