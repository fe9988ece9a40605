//! f64 reference attention: the yardstick that accuracy tests and benchmarks measure
//! approximate plans (and the f32 kernels themselves) against.

use crate::element::Element;
use crate::shape::AttnShape;
use crate::view::HeadsView;
use rayon::prelude::*;

/// Scaled scores `scale · q·k_t` in f64 of one query head against all rows of one head.
pub fn scores_f64<E: Element>(q: &[f32], rows: &[E], scale: f64) -> Vec<f64> {
    let d = q.len();
    rows.chunks_exact(d)
        .map(|k| {
            let s: f64 = q.iter().zip(k).map(|(a, b)| f64::from(*a) * f64::from(b.to_f32())).sum();
            s * scale
        })
        .collect()
}

/// Softmax attention of one query head in f64 over `tokens` (all rows when `None`).
pub fn attend_f64<E: Element>(q: &[f32], keys: &[E], values: &[E], tokens: Option<&[u32]>) -> Vec<f64> {
    let d = q.len();
    let scale = 1.0 / (d as f64).sqrt();
    let scores = scores_f64(q, keys, scale);
    let all: Vec<u32>;
    let ids = match tokens {
        Some(t) => t,
        None => {
            all = (0..scores.len() as u32).collect();
            &all
        }
    };
    let m = ids.iter().map(|&t| scores[t as usize]).fold(f64::NEG_INFINITY, f64::max);
    let mut out = vec![0.0f64; d];
    let mut l = 0.0;
    for &t in ids {
        let w = (scores[t as usize] - m).exp();
        l += w;
        for (o, v) in out.iter_mut().zip(&values[t as usize * d..(t as usize + 1) * d]) {
            *o += w * f64::from(v.to_f32());
        }
    }
    if l > 0.0 {
        out.iter_mut().for_each(|o| *o /= l);
    }
    out
}

/// Exact attention of every query head in f64 (`q`: `q_heads × d`); `subsets`, when given,
/// restricts query head `h` to the token ids `subsets[h]`. Returns `q_heads × d` values.
pub fn reference_attention<E: Element>(
    shape: &AttnShape,
    q: &[f32],
    keys: HeadsView<'_, E>,
    values: HeadsView<'_, E>,
    subsets: Option<&[Vec<u32>]>,
) -> Vec<f64> {
    let d = shape.head_dim;
    (0..shape.q_heads)
        .into_par_iter()
        .flat_map_iter(|h| {
            let kv = h / shape.group();
            let subset = subsets.map(|s| s[h].as_slice());
            attend_f64(&q[h * d..(h + 1) * d], keys.head(kv), values.head(kv), subset)
        })
        .collect()
}

/// Relative L2 error `‖a − b‖ / ‖b‖` of an output against its f64 reference.
pub fn rel_l2(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (f64::from(*x) - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}
