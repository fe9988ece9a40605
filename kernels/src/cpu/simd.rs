//! Vectorizable inner loops: a dot product, an axpy and a maximum over f32 slices.
//!
//! Sixteen independent accumulators let LLVM keep two 8-wide FMA chains in flight (with the
//! workspace's x86-64-v3 target) instead of one serial sum.

const LANES: usize = 16;

/// `Σ a[i]·b[i]`; `a` and `b` have the same length.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..LANES {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail = x.mul_add(*y, tail);
    }
    acc.iter().sum::<f32>() + tail
}

/// `y += alpha · x`.
#[inline]
pub(crate) fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = alpha.mul_add(*xi, *yi);
    }
}

/// `y *= alpha`.
#[inline]
pub(crate) fn scale_in_place(alpha: f32, y: &mut [f32]) {
    for yi in y.iter_mut() {
        *yi *= alpha;
    }
}

/// The largest of `x` (−∞ when empty), eight lanes at a time (scores are finite, so the
/// plain `vmaxps` of `fast_max` is exact; a checked array conversion per chunk tripled the
/// instructions: ~100 per block and head, callgrind).
pub(crate) fn max_of(x: &[f32]) -> f32 {
    let mut chunks = x.chunks_exact(8);
    let mut m = wide::f32x8::splat(f32::NEG_INFINITY);
    for c in &mut chunks {
        m = m.fast_max(bytemuck::pod_read_unaligned::<wide::f32x8>(bytemuck::cast_slice(c)));
    }
    // Finite inputs: a plain compare (`f32::max` also handles NaN, at 3 instructions a lane).
    let larger = |a: f32, b: f32| if b > a { b } else { a };
    let rest = chunks.remainder().iter().copied().fold(f32::NEG_INFINITY, larger);
    m.to_array().into_iter().fold(rest, larger)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_a_plain_sum_for_odd_lengths() {
        for n in [0, 1, 15, 16, 17, 128, 131] {
            let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
            let b: Vec<f32> = (0..n).map(|i| 1.0 - i as f32 * 0.25).collect();
            let plain: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(x * y)).sum();
            assert!((f64::from(dot(&a, &b)) - plain).abs() < 1e-3 * (1.0 + plain.abs()));
        }
    }
}
