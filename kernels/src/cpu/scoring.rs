//! Centroid scoring and top-r selection: the retrieval step of a cluster index.

use super::simd::dot;
use crate::element::Element;

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

/// Indices of the `r` largest scores, best first (ties broken by lower index; NaN sorts
/// lowest). `r` larger than `scores.len()` returns all indices.
pub fn top_r(scores: &[f32], r: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..scores.len() as u32).collect();
    let r = r.min(idx.len());
    let by_score_desc = |a: &u32, b: &u32| {
        let (x, y) = (scores[*a as usize], scores[*b as usize]);
        let (x, y) = (if x.is_nan() { f32::NEG_INFINITY } else { x }, if y.is_nan() { f32::NEG_INFINITY } else { y });
        y.total_cmp(&x).then(a.cmp(b))
    };
    if r > 0 && r < idx.len() {
        idx.select_nth_unstable_by(r - 1, by_score_desc);
    }
    idx.truncate(r);
    idx.sort_unstable_by(by_score_desc);
    idx
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

    #[test]
    fn score_rows_matches_dot_products() {
        let q = [1.0f32, 2.0, 3.0];
        let rows = [1.0f32, 0.0, 0.0, 0.0, 1.0, 1.0];
        let mut out = Vec::new();
        score_rows(&q, &rows, 0.5, &mut out);
        assert_eq!(out, vec![0.5, 2.5]);
    }
}
