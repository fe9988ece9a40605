//! Product-quantization scoring (PQCache): a per-query lookup table of sub-space dot
//! products, `LUT[j][c] = scale · q_j · centroid_j[c]`, and the approximate score of a token
//! as the sum of its `m` table entries. The table keeps one lane per query head of a GQA
//! group, so one pass over a KV head's codes scores the whole group.

use crate::error::{Error, Result};
use wide::f32x4;

/// Entries per sub-space in a lookup table: codes are bytes, so a table row is indexed by
/// any `u8` without a bounds check and unused entries (b < 8) are simply never read.
pub const LUT_ROWS: usize = 256;

/// A lookup table for one query group: `m` sub-spaces × 256 codes × `lanes` query heads.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Lut {
    /// `m × 256 × lanes`, head-minor.
    pub values: Vec<f32>,
    /// Sub-spaces.
    pub subspaces: usize,
    /// Query heads scored (the group).
    pub heads: usize,
    /// Lanes per entry: `heads` rounded up to 1, 2, 4 or 8 (padding lanes copy head 0, so a
    /// maximum over lanes is the maximum over heads); `heads` itself above 8.
    pub lanes: usize,
}

fn lanes_for(heads: usize) -> usize {
    match heads {
        0 | 1 => 1,
        2 => 2,
        3 | 4 => 4,
        5..=8 => 8,
        _ => heads,
    }
}

impl Lut {
    /// Builds the table of the `heads` queries `q` (`heads × d`) against `codebooks`
    /// (`m × codes × d/m`, sub-space major) with `codes` ≤ 256 centroids per sub-space.
    pub fn build(q: &[f32], heads: usize, codebooks: &[f32], m: usize, codes: usize, scale: f32) -> Result<Self> {
        if heads == 0 || m == 0 || codes == 0 || codes > LUT_ROWS {
            return Err(Error::InvalidArgument {
                what: "lookup table",
                message: format!("need heads > 0, sub-spaces > 0 and 1..=256 codes; got {heads}, {m}, {codes}"),
            });
        }
        let d = q.len() / heads;
        if d * heads != q.len() || d == 0 || !d.is_multiple_of(m) {
            return Err(Error::ShapeMismatch {
                what: "queries (heads × d, d a multiple of m)",
                expected: heads * d,
                got: q.len(),
            });
        }
        let sub = d / m;
        if codebooks.len() != m * codes * sub {
            return Err(Error::ShapeMismatch {
                what: "codebooks (m × codes × d/m)",
                expected: m * codes * sub,
                got: codebooks.len(),
            });
        }
        let lanes = lanes_for(heads);
        let mut values = vec![0.0f32; m * LUT_ROWS * lanes];
        // Per sub-space one small matrix product: (heads × sub) · (codes × sub)ᵀ.
        let mut qj = vec![0.0f32; heads * sub];
        let mut dots = vec![0.0f32; heads * codes];
        for j in 0..m {
            for h in 0..heads {
                qj[h * sub..(h + 1) * sub].copy_from_slice(&q[h * d + j * sub..][..sub]);
            }
            super::gemm::matmul_transposed(
                &qj,
                &codebooks[j * codes * sub..(j + 1) * codes * sub],
                &mut dots,
                heads,
                codes,
                sub,
            );
            for c in 0..codes {
                let entry = &mut values[(j * LUT_ROWS + c) * lanes..][..lanes];
                for (lane, e) in entry.iter_mut().enumerate() {
                    let h = if lane < heads { lane } else { 0 };
                    *e = scale * dots[h * codes + c];
                }
            }
        }
        Ok(Self { values, subspaces: m, heads, lanes })
    }
}

/// Appends to `out` the best approximate score over the group's heads for every token of
/// `codes` (`n × m` bytes, token-major): the per-KV-head selection score.
pub fn scores_max(lut: &Lut, codes: &[u8], out: &mut Vec<f32>) {
    macro_rules! go {
        ($($m:literal),*; $($p:literal),*) => {
            go!(@m [$($m),*] [$($p),*])
        };
        (@m [$($m:literal),*] $ps:tt) => {
            match lut.subspaces {
                $($m => go!(@p $m $ps),)*
                _ => generic_max(lut, codes, out),
            }
        };
        (@p $m:literal [$($p:literal),*]) => {
            match lut.lanes {
                4 => quad_max::<$m>(&lut.values, codes, out),
                $($p => fixed_max::<$m, $p>(&lut.values, codes, out),)*
                _ => generic_max(lut, codes, out),
            }
        };
    }
    go!(1, 2, 4, 8; 1, 2, 8)
}

/// Appends to `out[h]` the approximate score of head `h` for every token of `codes`
/// (`n × m` bytes): the per-query-head selection scores. `out` has one vector per head.
pub fn scores_each(lut: &Lut, codes: &[u8], out: &mut [Vec<f32>]) {
    let (m, p) = (lut.subspaces, lut.lanes);
    let mut acc = vec![0.0f32; p];
    for c in codes.chunks_exact(m) {
        acc.iter_mut().for_each(|a| *a = 0.0);
        for (j, &code) in c.iter().enumerate() {
            let e = &lut.values[(j * LUT_ROWS + code as usize) * p..][..p];
            acc.iter_mut().zip(e).for_each(|(a, v)| *a += v);
        }
        for (o, a) in out.iter_mut().zip(&acc) {
            o.push(*a);
        }
    }
}

/// The hot loop with the sub-space count and lane count known at compile time: per token,
/// `M` table rows of `P` lanes summed in registers, then the maximum lane.
fn fixed_max<const M: usize, const P: usize>(values: &[f32], codes: &[u8], out: &mut Vec<f32>) {
    let rows: &[[f32; P]] = bytemuck::cast_slice(values);
    let tables: [&[[f32; P]; LUT_ROWS]; M] = std::array::from_fn(|j| {
        rows[j * LUT_ROWS..(j + 1) * LUT_ROWS].try_into().expect("a lookup table holds 256 rows per sub-space")
    });
    let tokens: &[[u8; M]] = bytemuck::cast_slice(&codes[..codes.len() / M * M]);
    out.extend(tokens.iter().map(|c| {
        let mut acc = tables[0][c[0] as usize];
        for j in 1..M {
            let e = &tables[j][c[j] as usize];
            for p in 0..P {
                acc[p] += e[p];
            }
        }
        // A plain comparison (scores are finite) compiles to maxss; f32::max's NaN rule does not.
        let mut best = acc[0];
        for &a in &acc[1..] {
            best = if a > best { a } else { best };
        }
        best
    }));
}

/// The four-head case (the common GQA group), four tokens at a time: each token's four
/// head sums are one vector, and the four vectors are transposed so the maximum over heads
/// is three vertical max operations instead of a horizontal reduction per token.
fn quad_max<const M: usize>(values: &[f32], codes: &[u8], out: &mut Vec<f32>) {
    let rows: &[[f32; 4]] = bytemuck::cast_slice(values);
    let tables: [&[[f32; 4]; LUT_ROWS]; M] = std::array::from_fn(|j| {
        rows[j * LUT_ROWS..(j + 1) * LUT_ROWS].try_into().expect("a lookup table holds 256 rows per sub-space")
    });
    let tokens: &[[u8; M]] = bytemuck::cast_slice(&codes[..codes.len() / M * M]);
    let quads = tokens.len() / 4;
    out.reserve(tokens.len());
    let sum = |c: &[u8; M]| {
        let mut acc = f32x4::from(tables[0][c[0] as usize]);
        for j in 1..M {
            acc += f32x4::from(tables[j][c[j] as usize]);
        }
        acc
    };
    for quad in tokens[..quads * 4].chunks_exact(4) {
        let [h0, h1, h2, h3] = f32x4::transpose([sum(&quad[0]), sum(&quad[1]), sum(&quad[2]), sum(&quad[3])]);
        out.extend_from_slice(&h0.fast_max(h1).fast_max(h2.fast_max(h3)).to_array());
    }
    for c in &tokens[quads * 4..] {
        let a = sum(c).to_array();
        out.push(a[0].max(a[1]).max(a[2].max(a[3])));
    }
}

fn generic_max(lut: &Lut, codes: &[u8], out: &mut Vec<f32>) {
    let (m, p) = (lut.subspaces, lut.lanes);
    let mut acc = vec![0.0f32; p];
    out.extend(codes.chunks_exact(m).map(|c| {
        acc.iter_mut().for_each(|a| *a = 0.0);
        for (j, &code) in c.iter().enumerate() {
            let e = &lut.values[(j * LUT_ROWS + code as usize) * p..][..p];
            acc.iter_mut().zip(e).for_each(|(a, v)| *a += v);
        }
        acc.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::SplitMix64;

    /// Scores by reconstructing each token's key from its codes and taking dot products.
    fn reconstructed(
        q: &[f32],
        heads: usize,
        cb: &[f32],
        m: usize,
        k: usize,
        codes: &[u8],
        scale: f32,
    ) -> Vec<Vec<f32>> {
        let d = q.len() / heads;
        let sub = d / m;
        let mut out = vec![Vec::new(); heads];
        for c in codes.chunks_exact(m) {
            let key: Vec<f32> = (0..m).flat_map(|j| cb[(j * k + c[j] as usize) * sub..][..sub].to_vec()).collect();
            for (h, o) in out.iter_mut().enumerate() {
                o.push(scale * q[h * d..(h + 1) * d].iter().zip(&key).map(|(a, b)| a * b).sum::<f32>());
            }
        }
        out
    }

    #[test]
    fn table_scores_equal_dot_products_with_reconstructed_keys() {
        let mut g = SplitMix64::new(5);
        for (heads, m, k) in [(1, 1, 16), (3, 2, 64), (4, 4, 256), (7, 8, 32), (12, 2, 16)] {
            let d = 32;
            let q: Vec<f32> = (0..heads * d).map(|_| g.normal()).collect();
            let cb: Vec<f32> = (0..m * k * (d / m)).map(|_| g.normal()).collect();
            let codes: Vec<u8> = (0..100 * m).map(|_| g.below(k) as u8).collect();
            let lut = Lut::build(&q, heads, &cb, m, k, 0.25).unwrap();
            let want = reconstructed(&q, heads, &cb, m, k, &codes, 0.25);
            let mut each = vec![Vec::new(); heads];
            scores_each(&lut, &codes, &mut each);
            let mut best = Vec::new();
            scores_max(&lut, &codes, &mut best);
            for t in 0..100 {
                let mut mx = f32::NEG_INFINITY;
                for h in 0..heads {
                    assert!(
                        (each[h][t] - want[h][t]).abs() < 1e-4,
                        "heads={heads} m={m}: {} vs {}",
                        each[h][t],
                        want[h][t]
                    );
                    mx = mx.max(want[h][t]);
                }
                assert!((best[t] - mx).abs() < 1e-4, "heads={heads} m={m}: max {} vs {mx}", best[t]);
            }
        }
    }

    #[test]
    fn bad_tables_are_rejected() {
        let q = vec![0.0f32; 2 * 8];
        assert!(Lut::build(&q, 2, &[0.0; 3 * 4 * 2], 3, 4, 1.0).is_err(), "m must divide d");
        assert!(Lut::build(&q, 2, &vec![0.0; 2 * 300 * 4], 2, 300, 1.0).is_err(), "at most 256 codes");
        assert!(Lut::build(&q, 2, &[0.0; 5], 2, 4, 1.0).is_err(), "codebook size");
    }
}
