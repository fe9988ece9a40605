//! The one matrix product the CPU backend needs (k-means assignment), through the
//! `matrixmultiply` crate behind a checked safe wrapper.

/// `c[m×n] = a[m×k] · b[n×k]ᵀ` for row-major `a`, `b`, `c`.
///
/// Panics if a slice length disagrees with `m`, `n`, `k` (a bug in the caller, which owns
/// all three buffers).
#[allow(unsafe_code, reason = "matrixmultiply's sgemm takes raw pointers and strides")]
pub fn matmul_transposed(a: &[f32], b: &[f32], c: &mut [f32], m: usize, n: usize, k: usize) {
    assert_eq!(a.len(), m * k, "matmul_transposed: a must be m×k");
    assert_eq!(b.len(), n * k, "matmul_transposed: b must be n×k");
    assert_eq!(c.len(), m * n, "matmul_transposed: c must be m×n");
    if m == 0 || n == 0 {
        return;
    }
    // Strides fit in isize because each slice length (≥ the largest stride) does.
    let (ki, ni) = (k as isize, n as isize);
    // SAFETY: `a` holds m×k elements read at (i, l) → i·k + l; `b` is read as a k×n matrix
    // with row stride 1 and column stride k, i.e. (l, j) → j·k + l < n·k; `c` holds m×n
    // elements written at (i, j) → i·n + j. The asserts above guarantee all of these are in
    // bounds, `c` is exclusively borrowed, and with beta = 0 its prior contents are not read.
    unsafe {
        matrixmultiply::sgemm(m, k, n, 1.0, a.as_ptr(), ki, 1, b.as_ptr(), 1, ki, 0.0, c.as_mut_ptr(), ni, 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_naive_product() {
        let (m, n, k) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.5 - 2.0).collect();
        let b: Vec<f32> = (0..n * k).map(|i| 1.0 - i as f32 * 0.1).collect();
        let mut c = vec![f32::NAN; m * n];
        matmul_transposed(&a, &b, &mut c, m, n, k);
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|l| a[i * k + l] * b[j * k + l]).sum();
                assert!((c[i * n + j] - want).abs() < 1e-4);
            }
        }
    }
}
