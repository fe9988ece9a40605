//! AVX2 inner loops of [`super::hack_rows`] (built when the target has AVX2, as the
//! workspace's x86-64-v3 target does): the homomorphic products as `vpmaddubsw` integer
//! multiply-adds of 8-bit operands against 2-bit codes unpacked in registers.
//!
//! - **Scores.** A key partition of Π = 64 dims is 16 code bytes, one 128-bit lane; byte
//!   `b` holds dims `4b..4b+4`, so `(x >> 2s) & 3` yields the codes of dims `4b + s`, and the
//!   query is stored *strided* to match (`q_s[b] = q[4b + s]`). Four heads are reduced
//!   together by two rounds of `vphaddd`, giving one integer product per (head, partition).
//! - **Values.** A token quad of a value block is `d` bytes, byte `c` holding channel `c` of
//!   four rows; unpacking the 2-bit fields and interleaving rows `(0,1)` and `(2,3)` gives, per
//!   channel, the pair of codes `vpmaddubsw` multiplies with the pair of 7-bit probabilities.
//!   Sums stay in 16 bits for a block (≤ 2·3·127 per quad pair, 16 quads: 24 384).
//!
//! The module also holds the AVX2 `exp` (`exp8`) the f16/f32 exact kernel's softmax uses
//! (`exp_shifted_sum`).
//!
//! Loads and stores go through `bytemuck` (the SIMD types are plain data), so the only
//! `unsafe` is the call into these `#[target_feature]` functions, in `hack_rows.rs` and
//! `microkernel.rs`.

use super::hack_rows::P_LEVELS;
use std::arch::x86_64::*;

/// 16 bytes as a vector.
#[inline(always)]
pub(crate) fn load16(b: &[u8]) -> __m128i {
    bytemuck::pod_read_unaligned(&b[..16])
}

/// 32 bytes as a vector.
#[inline(always)]
pub(crate) fn load32(b: &[u8]) -> __m256i {
    bytemuck::pod_read_unaligned(&b[..32])
}

/// Per head group (4 heads) and pair type: the strided query codes of both lanes (four
/// shifts × four heads) and the lane constants `sq`, `mq + 128·sq` and `C = sq·Σq + Π·mq`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PairQuery {
    /// `[head][shift]` query codes less 128 (as `i8`, the signed operand of `vpmaddubsw`
    /// against the unsigned 2-bit codes), low lane for the first chunk of a pair, high lane
    /// for the second. The 128 comes back through the key code sums: `mq` below is the
    /// query minimum plus `128·sq`.
    pub codes: [[[u8; 32]; 4]; 4],
    /// Query scale per lane (`[head 0..4 of chunk 0 | head 0..4 of chunk 1]`).
    pub sq: [f32; 8],
    /// Query minimum plus `128·sq` per lane (the coefficient of the key code sum).
    pub mq: [f32; 8],
    /// `sq·Σq8 + Π·mq` per lane.
    pub c: [f32; 8],
}

/// Key metadata of the two rows of a vector (one partition per row, `kp = 1`), each as
/// `[row 0 ×4 | row 1 ×4]`: scale, minimum and code sum.
#[derive(Debug, Clone, Copy)]
struct PairMeta {
    sk: __m256,
    mk: __m256,
    ks: __m256,
}

/// Integer products of one pair of 64-dim key chunks (`x`: chunk 0 in the low lane, chunk 1
/// in the high lane) with four heads' query codes: `[h0..h3 of chunk 0 | h0..h3 of chunk 1]`.
#[inline]
#[target_feature(enable = "avx2")]
fn pair_products(x: __m256i, q: &PairQuery) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    let [h0, h1, h2, h3] = row_products(x, q).map(|v| _mm256_madd_epi16(v, ones));
    _mm256_hadd_epi32(_mm256_hadd_epi32(h0, h1), _mm256_hadd_epi32(h2, h3))
}

/// Scores of two rows of one partition each (row 0 in the low lane of `x`, row 1 in the
/// high lane) against four heads: `[h0..h3 of row 0 | h0..h3 of row 1]`, unscaled.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn pair_scores(x: __m256i, q: &PairQuery, k: PairMeta) -> __m256 {
    let qk = _mm256_cvtepi32_ps(pair_products(x, q));
    let sq: __m256 = bytemuck::cast(q.sq);
    let mq: __m256 = bytemuck::cast(q.mq);
    let cc: __m256 = bytemuck::cast(q.c);
    // sk·(sq·QK + mq·Σk) + mk·(sq·Σq + Π·mq)
    let inner = _mm256_fmadd_ps(sq, qk, _mm256_mul_ps(mq, k.ks));
    _mm256_fmadd_ps(k.sk, inner, _mm256_mul_ps(k.mk, cc))
}

/// The four 2-bit fields of every byte of `x`, each in the low bits of a byte:
/// `[x & 3, (x >> 2) & 3, (x >> 4) & 3, (x >> 6) & 3]`.
#[inline]
#[target_feature(enable = "avx2")]
fn unpack2(x: __m256i) -> [__m256i; 4] {
    let m3 = _mm256_set1_epi8(3);
    [
        _mm256_and_si256(x, m3),
        _mm256_and_si256(_mm256_srli_epi16::<2>(x), m3),
        _mm256_and_si256(_mm256_srli_epi16::<4>(x), m3),
        _mm256_and_si256(_mm256_srli_epi16::<6>(x), m3),
    ]
}

/// The value side of one block folded into `H` heads' partials: per head `h`,
/// `o[c] += sp_h·(sv[c]·A[h][c] + mv[c]·ps_h)` with `A[h][c] = Σ_t w[h·stride + t]·code(t, c)`
/// the integer products over the token quads `quads` (indices into `block`, which holds `d`
/// bytes per quad), `sv`/`mv` the block's per-channel value scale and minimum, `sp_h` the
/// head's probability step and `ps_h` its code sum. `w` holds 7-bit weights (zero for rows
/// the plan did not select); blocks hold at most 64 rows (16 quads), so the products stay in
/// 16 bits (≤ 2·3·127 per quad pair, 16 quads: 24 384).
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_values<const H: usize>(
    block: &[u8],
    d: usize,
    quads: &[u16],
    w: &[u8],
    stride: usize,
    (sv, mv): (&[half::f16], &[half::f16]),
    (sp, ps): (&[f32], &[f32]),
    parts: &mut [super::partial::Partial],
) {
    // Per head and quad, the weight pairs `[w0 w1 w0 w1]` and `[w2 w3 w2 w3]` of its four
    // rows, four quads per byte shuffle; broadcast as 32-bit words inside the loop (a load
    // each), they put a 16-bit pair in every lane.
    let (lo, hi) = (
        _mm_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13),
        _mm_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15),
    );
    let mut pairs = [[[0i32; 16]; 2]; H];
    for (h, ph) in pairs.iter_mut().enumerate() {
        let wh = &w[h * stride..h * stride + stride.min(64)];
        for (c, chunk) in wh.chunks_exact(16).enumerate() {
            let v = load16(chunk);
            let (a, b): ([i32; 4], [i32; 4]) =
                (bytemuck::cast(_mm_shuffle_epi8(v, lo)), bytemuck::cast(_mm_shuffle_epi8(v, hi)));
            ph[0][4 * c..4 * c + 4].copy_from_slice(&a);
            ph[1][4 * c..4 * c + 4].copy_from_slice(&b);
        }
    }
    let (svb, mvb): (&[u8], &[u8]) = (bytemuck::cast_slice(sv), bytemuck::cast_slice(mv));
    for grp in 0..d / 32 {
        let mut lo = [_mm256_setzero_si256(); H];
        let mut hi = [_mm256_setzero_si256(); H];
        for &qi in quads {
            let qi = qi as usize;
            let [c0, c1, c2, c3] = unpack2(load32(&block[qi * d + grp * 32..]));
            let (p01l, p01h) = (_mm256_unpacklo_epi8(c0, c1), _mm256_unpackhi_epi8(c0, c1));
            let (p23l, p23h) = (_mm256_unpacklo_epi8(c2, c3), _mm256_unpackhi_epi8(c2, c3));
            for h in 0..H {
                let (w01, w23) = (_mm256_set1_epi32(pairs[h][0][qi]), _mm256_set1_epi32(pairs[h][1][qi]));
                lo[h] = _mm256_add_epi16(
                    lo[h],
                    _mm256_add_epi16(_mm256_maddubs_epi16(p01l, w01), _mm256_maddubs_epi16(p23l, w23)),
                );
                hi[h] = _mm256_add_epi16(
                    hi[h],
                    _mm256_add_epi16(_mm256_maddubs_epi16(p01h, w01), _mm256_maddubs_epi16(p23h, w23)),
                );
            }
        }
        // Unpacking within 128-bit lanes ordered the channels: `lo` holds channels 0..8 and
        // 16..24 of the group, `hi` channels 8..16 and 24..32.
        for (k, off) in [0, 8, 16, 24].into_iter().enumerate() {
            let c = grp * 32 + off;
            let svc = _mm256_cvtph_ps(load16(&svb[2 * c..]));
            let mvc = _mm256_cvtph_ps(load16(&mvb[2 * c..]));
            for h in 0..H {
                let v = match k {
                    0 => _mm256_castsi256_si128(lo[h]),
                    1 => _mm256_castsi256_si128(hi[h]),
                    2 => _mm256_extracti128_si256::<1>(lo[h]),
                    _ => _mm256_extracti128_si256::<1>(hi[h]),
                };
                let a = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(v));
                let (sph, psh) = (_mm256_set1_ps(sp[h]), _mm256_set1_ps(ps[h]));
                let o = &mut parts[h].o[c..c + 8];
                let prev: __m256 = bytemuck::pod_read_unaligned(bytemuck::cast_slice(o));
                // o + sp·(sv·a + mv·ps)
                let new = _mm256_fmadd_ps(sph, _mm256_fmadd_ps(svc, a, _mm256_mul_ps(mvc, psh)), prev);
                o.copy_from_slice(&bytemuck::cast::<__m256, [f32; 8]>(new));
            }
        }
    }
}

/// `eˣ` in eight lanes for `x ≤ 0`, to about 1e-7 relative: `x = n·ln 2 + r` with
/// `n = round(x·log₂e)` and `r` reduced in two steps (Cody–Waite), `eʳ` by its Taylor
/// polynomial of degree 7 (`|r| ≤ ½ ln 2`, truncation below 5e-9), `2ⁿ` built in the
/// exponent bits. Inputs below `−87.3` give about `2⁻¹²⁶` (the smallest normal float), which
/// rounds to probability 0.
/// Inputs of `exp8` below this give about `2⁻¹²⁶`.
pub(crate) const EXP_FLOOR: f32 = -87.3;
/// ln 2 = 0.693359375 − 2.121944400e-4, the first part exact in 9 bits (Cody–Waite).
pub(crate) const LN2_PARTS: [f32; 2] = [0.693_359_4, -2.121_944_4e-4];
/// `1/k!` for k = 0..=7: the Taylor polynomial of `eʳ`.
pub(crate) const EXP_TAYLOR: [f32; 8] = [1.0, 1.0, 0.5, 1.0 / 6.0, 1.0 / 24.0, 1.0 / 120.0, 1.0 / 720.0, 1.0 / 5040.0];

#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp8(x: __m256) -> __m256 {
    let x = _mm256_max_ps(x, _mm256_set1_ps(EXP_FLOOR));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_PARTS[0]), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_PARTS[1]), r);
    let mut p = _mm256_set1_ps(EXP_TAYLOR[7]);
    for &k in EXP_TAYLOR[..7].iter().rev() {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(k));
    }
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
    _mm256_mul_ps(p, _mm256_castsi256_ps(e))
}

/// `exp(s − m)` in place over `s` (a multiple of 8 long), returning the sum: the softmax
/// weights of the f16/f32 exact kernel (`microkernel::exp_shifted_sum`), with `exp8`
/// (~20 instructions for eight lanes, where `wide`'s `exp` took ~80). Inputs below the
/// floor of `exp8` (the −∞ padding of a short tile) give exactly 0.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn exp_shifted_sum(s: &mut [f32], m: f32) -> f32 {
    let (mv, floor) = (_mm256_set1_ps(m), _mm256_set1_ps(EXP_FLOOR));
    let mut sum = _mm256_setzero_ps();
    for lanes in s.chunks_exact_mut(8) {
        let x = _mm256_sub_ps(bytemuck::pod_read_unaligned(bytemuck::cast_slice(lanes)), mv);
        let e = _mm256_and_ps(exp8(x), _mm256_cmp_ps::<_CMP_GE_OQ>(x, floor));
        lanes.copy_from_slice(&bytemuck::cast::<__m256, [f32; 8]>(e));
        sum = _mm256_add_ps(sum, e);
    }
    let half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps::<1>(sum));
    let two = _mm_add_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)))
}

/// The 7-bit probabilities of the scores `x` relative to the running maximum `m` (all
/// `x ≤ m`), in steps of `1/inv`: `codes[i] = round(exp(x[i] − m)·inv)`, at most 127, eight
/// at a time (a short tail padded with −∞, which rounds to 0). Returns their sum.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn quantize_probs(x: &[f32], m: f32, inv: f32, codes: &mut [u8]) -> u32 {
    let (mv, iv, half, top) = (_mm256_set1_ps(m), _mm256_set1_ps(inv), _mm256_set1_ps(0.5), _mm256_set1_ps(P_LEVELS));
    let mut sum = _mm256_setzero_si256();
    let mut one = |v: __m256| {
        let p = exp8(_mm256_sub_ps(v, mv));
        // p ≥ 0: adding ½ and truncating rounds to nearest.
        let q = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_fmadd_ps(p, iv, half), top));
        sum = _mm256_add_epi32(sum, q);
        q
    };
    let (mut xs, mut cs) = (x.chunks_exact(8), codes.chunks_exact_mut(8));
    for (c, out) in (&mut xs).zip(&mut cs) {
        let q = one(bytemuck::pod_read_unaligned(bytemuck::cast_slice(c)));
        // Eight 32-bit codes ≤ 127 narrowed to bytes: saturating packs work per 128-bit lane.
        let w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
        let b: [u8; 16] = bytemuck::cast(_mm_packus_epi16(w, w));
        out.copy_from_slice(&b[..8]);
    }
    let rest = xs.remainder();
    if !rest.is_empty() {
        let mut pad = [f32::NEG_INFINITY; 8];
        pad[..rest.len()].copy_from_slice(rest);
        let q: [i32; 8] = bytemuck::cast(one(bytemuck::cast(pad)));
        for (o, &v) in cs.into_remainder().iter_mut().zip(&q) {
            *o = v as u8;
        }
    }
    let s: [i32; 8] = bytemuck::cast(sum);
    s.iter().map(|&v| v as u32).sum()
}

/// The key side of a [`super::hack_rows::HackView`]: all code bytes and the stored
/// per-(row, partition) metadata (`[row·kp + k]`), with `first_row` the block's first row.
pub(crate) struct KeyData<'a> {
    pub codes: &'a [u8],
    pub sk: &'a [half::f16],
    pub mk: &'a [half::f16],
    pub ks: &'a [u16],
    pub d: usize,
    pub kp: usize,
    pub first_row: usize,
}

/// `[a ×4 | b ×4]` from two floats.
#[inline]
#[target_feature(enable = "avx")]
fn lanes(a: f32, b: f32) -> __m256 {
    _mm256_set_m128(_mm_set1_ps(b), _mm_set1_ps(a))
}

/// The metadata pairs `(2m, 2m+1)` of four rows, 32 bits each (two f16 or two u16), as
/// `[r0 | r1 | r2 | r3]`; `at` are the pairs' element offsets.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn meta4(bytes: &[u8], at: [usize; 4]) -> __m128i {
    let word = |a: usize| bytemuck::pod_read_unaligned::<i32>(&bytes[a * 2..a * 2 + 4]);
    _mm_setr_epi32(word(at[0]), word(at[1]), word(at[2]), word(at[3]))
}

/// Scaled scores of the key rows `rows` (relative to `k.first_row`) against `g` heads:
/// `out[h·n + i]` for row `rows[i]`. `pairs` holds, per group of four heads, one
/// [`PairQuery`] per pair type: one type `[partition 0 | partition 0]` when a row is one
/// partition (two rows per vector), else `kp/2` types `[2m | 2m+1]` (one vector per row and
/// type, four rows at a time). Requires Π = 64 and `kp` 1 or even.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn block_scores(k: &KeyData<'_>, rows: &[u32], pairs: &[PairQuery], g: usize, scale: f32, out: &mut [f32]) {
    let n = rows.len();
    let types = if k.kp == 1 { 1 } else { k.kp / 2 };
    for hg in 0..g.div_ceil(4) {
        let hn = (g - hg * 4).min(4);
        let pq = &pairs[hg * types..(hg + 1) * types];
        let out = &mut out[hg * 4 * n..(hg * 4 + hn) * n];
        if k.kp == 1 {
            for (i, two) in rows.chunks(2).enumerate() {
                let (t0, t1) = (two[0] as usize, *two.last().unwrap_or(&two[0]) as usize);
                let (r0, r1) = (k.first_row + t0, k.first_row + t1);
                let x = _mm256_set_m128i(load16(&k.codes[r1 * 16..]), load16(&k.codes[r0 * 16..]));
                let f = |a: &[half::f16]| lanes(a[r0].to_f32(), a[r1].to_f32());
                let meta = PairMeta { sk: f(k.sk), mk: f(k.mk), ks: lanes(f32::from(k.ks[r0]), f32::from(k.ks[r1])) };
                let sc: [f32; 8] = bytemuck::cast(pair_scores(x, &pq[0], meta));
                for h in 0..hn {
                    out[h * n + 2 * i] = sc[h] * scale;
                    if two.len() == 2 {
                        out[h * n + 2 * i + 1] = sc[4 + h] * scale;
                    }
                }
            }
        } else {
            for (m, q) in pq.iter().enumerate() {
                rows_by_four(k, rows, m, q, hn, scale, m > 0, out);
            }
        }
    }
}

/// The 16-bit products of one row's pair of 64-dim key chunks (`x`) with each of four heads'
/// query codes, not yet summed across lanes: per head `Σ_s vpmaddubsw(codes_s, q_s)`, eight
/// 16-bit partial sums per chunk. With query codes in −128..127 and 2-bit codes a lane holds
/// at most 4·2·3·128 = 3072 in magnitude, so eight lanes still sum within 16 bits.
#[inline]
#[target_feature(enable = "avx2")]
fn row_products(x: __m256i, q: &PairQuery) -> [__m256i; 4] {
    let c = unpack2(x);
    let mut out = [_mm256_setzero_si256(); 4];
    for (o, qh) in out.iter_mut().zip(&q.codes) {
        let a01 =
            _mm256_add_epi16(_mm256_maddubs_epi16(c[0], load32(&qh[0])), _mm256_maddubs_epi16(c[1], load32(&qh[1])));
        let a23 =
            _mm256_add_epi16(_mm256_maddubs_epi16(c[2], load32(&qh[2])), _mm256_maddubs_epi16(c[3], load32(&qh[3])));
        *o = _mm256_add_epi16(a01, a23);
    }
    out
}

/// One row's products with four heads reduced to `[h0 h1 h2 h3]` pairs of half sums per
/// chunk (16 bits): two levels of `vphaddw`, so a row leaves one register behind.
#[inline]
#[target_feature(enable = "avx2")]
fn row_tree(x: __m256i, q: &PairQuery) -> __m256i {
    let v = row_products(x, q);
    _mm256_hadd_epi16(_mm256_hadd_epi16(v[0], v[1]), _mm256_hadd_epi16(v[2], v[3]))
}

/// Per partition `j` of a pair, the query constants `[sq, mq, C]` of four heads as
/// `[h0..h3 | h0..h3]`, with the score scale folded in.
type PairConsts = [[__m256; 3]; 2];

/// The scores of four rows against four heads, one `[r0 r1 r2 r3]` vector per head, from
/// the rows' code vectors `x` and their metadata `m8` (`[sk, mk, Σk]`, each
/// `[r0p0 r0p1 r1p0 r1p1 | r2p0 r2p1 r3p0 r3p1]`). Each row's 16-bit products are reduced
/// in registers (`row_tree`), two rows share a last `vphaddw` giving
/// `[r0 h0..h3 | r1 h0..h3]` per partition of the pair, the float correction runs on those
/// eight lanes, and a 4×4 transpose turns rows × heads into heads × rows.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn four_rows(x: &[__m256i; 4], m8: &[__m256; 3], q: &PairQuery, consts: &PairConsts) -> [__m128; 4] {
    // From [r0p0 r0p1 r1p0 r1p1 | r2p0 r2p1 r3p0 r3p1]: per row pair and partition,
    // `[row a ×4 | row b ×4]`.
    let spread = [
        [_mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2), _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3)],
        [_mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6), _mm256_setr_epi32(5, 5, 5, 5, 7, 7, 7, 7)],
    ];
    let ints = [
        _mm256_hadd_epi16(row_tree(x[0], q), row_tree(x[1], q)),
        _mm256_hadd_epi16(row_tree(x[2], q), row_tree(x[3], q)),
    ];
    // Scores of rows (0, 1) and (2, 3): `[row a h0..h3 | row b h0..h3]`.
    let mut sc = [_mm256_setzero_ps(); 2];
    for (pair, (s, &p)) in sc.iter_mut().zip(&ints).enumerate() {
        let halves = [_mm256_castsi256_si128(p), _mm256_extracti128_si256::<1>(p)];
        for j in 0..2 {
            // sk·(sq·QK + mq·Σk) + mk·(sq·Σq + Π·mq) for partition j of the pair.
            let [sq, mq, cc] = consts[j];
            let [sk, mk, ks] = m8.map(|v| _mm256_permutevar8x32_ps(v, spread[pair][j]));
            let qk = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(halves[j]));
            let inner = _mm256_fmadd_ps(sq, qk, _mm256_mul_ps(mq, ks));
            *s = _mm256_add_ps(*s, _mm256_fmadd_ps(sk, inner, _mm256_mul_ps(mk, cc)));
        }
    }
    // [a | b], [c | d] (rows, heads inside) → per head [a b c d].
    let (ac, bd) = (_mm256_permute2f128_ps::<0x20>(sc[0], sc[1]), _mm256_permute2f128_ps::<0x31>(sc[0], sc[1]));
    let (lo, hi) = (_mm256_unpacklo_ps(ac, bd), _mm256_unpackhi_ps(ac, bd));
    let h01 = _mm256_castpd_ps(_mm256_permute4x64_pd::<0b1101_1000>(_mm256_castps_pd(lo)));
    let h23 = _mm256_castpd_ps(_mm256_permute4x64_pd::<0b1101_1000>(_mm256_castps_pd(hi)));
    [
        _mm256_castps256_ps128(h01),
        _mm256_extractf128_ps::<1>(h01),
        _mm256_castps256_ps128(h23),
        _mm256_extractf128_ps::<1>(h23),
    ]
}

/// Four rows' metadata pairs (eight f16 scales, eight f16 minima, eight u16 code sums)
/// widened to f32, in the `m8` form `four_rows` takes.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn widen_meta(sk: __m128i, mk: __m128i, ks: __m128i) -> [__m256; 3] {
    [_mm256_cvtph_ps(sk), _mm256_cvtph_ps(mk), _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(ks))]
}

/// Pair type `m` of the scores of four heads (`hn` of them live) over `rows`, four rows at a
/// time (`four_rows`). A run of consecutive rows with one pair type (`kp = 2`, every exact
/// plan) takes a loop over fixed-size slices; other rows gather codes and metadata row by
/// row. `add` sums into `out` (later pair types of a row).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
fn rows_by_four(
    k: &KeyData<'_>,
    rows: &[u32],
    m: usize,
    q: &PairQuery,
    hn: usize,
    scale: f32,
    add: bool,
    out: &mut [f32],
) {
    let n = rows.len();
    let row_bytes = k.d / 4;
    let sv = _mm256_set1_ps(scale);
    let both = |x: &[f32; 8], j: usize| {
        let four: __m128 = bytemuck::pod_read_unaligned(bytemuck::cast_slice(&x[4 * j..4 * j + 4]));
        _mm256_mul_ps(_mm256_set_m128(four, four), sv)
    };
    let consts: PairConsts = [0, 1].map(|j| [both(&q.sq, j), both(&q.mq, j), both(&q.c, j)]);
    let (skb, mkb, ksb): (&[u8], &[u8], &[u8]) =
        (bytemuck::cast_slice(k.sk), bytemuck::cast_slice(k.mk), bytemuck::cast_slice(k.ks));
    let mut done = 0;
    if k.kp == 2 && hn == 4 && !add && n >= 4 && rows[n - 1] as usize == rows[0] as usize + n - 1 {
        done = n / 4 * 4;
        let r0 = k.first_row + rows[0] as usize;
        let codes = &k.codes[r0 * 32..(r0 + done) * 32];
        let span = r0 * 4..(r0 + done) * 4;
        let (sk, mk, ks) = (&skb[span.clone()], &mkb[span.clone()], &ksb[span]);
        let (o0, rest) = out.split_at_mut(n);
        let (o1, rest) = rest.split_at_mut(n);
        let (o2, o3) = rest.split_at_mut(n);
        let rows4 = codes.chunks_exact(128).zip(sk.chunks_exact(16)).zip(mk.chunks_exact(16)).zip(ks.chunks_exact(16));
        for (i, (((c, sk), mk), ks)) in rows4.enumerate() {
            let x = [load32(c), load32(&c[32..]), load32(&c[64..]), load32(&c[96..])];
            let m8 = widen_meta(load16(sk), load16(mk), load16(ks));
            let heads = four_rows(&x, &m8, q, &consts);
            for (o, v) in [&mut *o0, &mut *o1, &mut *o2, &mut *o3].into_iter().zip(heads) {
                o[4 * i..4 * i + 4].copy_from_slice(&bytemuck::cast::<__m128, [f32; 4]>(v));
            }
        }
    }
    for (i, four) in rows.chunks(4).enumerate().skip(done / 4) {
        let last = four.len() - 1;
        let r = [four[0], four[1.min(last)], four[2.min(last)], four[last]].map(|t| k.first_row + t as usize);
        let x = r.map(|r| load32(&k.codes[r * row_bytes + m * 32..]));
        let at = r.map(|r| r * k.kp + 2 * m);
        let m8 = widen_meta(meta4(skb, at), meta4(mkb, at), meta4(ksb, at));
        let heads = four_rows(&x, &m8, q, &consts);
        for (h, &v) in heads.iter().enumerate().take(hn) {
            let v: [f32; 4] = bytemuck::cast(v);
            for (o, &x) in out[h * n + 4 * i..h * n + 4 * i + four.len()].iter_mut().zip(&v) {
                *o = if add { *o + x } else { x };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp8_is_within_3e_7_of_exp_and_underflows_to_nothing() {
        let xs: Vec<f32> = (0..17_400).map(|i| -(i as f32) * 0.005).collect();
        for c in xs.chunks_exact(8) {
            // SAFETY: the test binary is built with the workspace's x86-64-v3 target, which
            // has avx2 and fma.
            #[allow(unsafe_code, reason = "calling a #[target_feature] kernel")]
            let got: [f32; 8] = bytemuck::cast(unsafe { exp8(bytemuck::pod_read_unaligned(bytemuck::cast_slice(c))) });
            for (&x, &y) in c.iter().zip(&got) {
                let want = f64::from(x).exp();
                assert!(((f64::from(y) - want) / want).abs() < 3e-7, "exp({x}) = {y}, want {want}");
            }
        }
        #[allow(unsafe_code, reason = "calling a #[target_feature] kernel")]
        // SAFETY: as above.
        let tiny: [f32; 8] = bytemuck::cast(unsafe {
            exp8(_mm256_setr_ps(-88.0, -100.0, -1e6, f32::NEG_INFINITY, -87.0, -90.0, -200.0, -1e30))
        });
        assert!(tiny.iter().all(|&y| (0.0..=2.0 * f32::MIN_POSITIVE).contains(&y)), "{tiny:?}");
    }

    #[test]
    fn softmax_weights_are_within_3e_7_of_exp_and_padding_weighs_nothing() {
        let mut s: Vec<f32> = (0..40).map(|i| 0.5 - (i as f32) * 0.37).collect();
        s.extend([-100.0, f32::NEG_INFINITY, f32::NEG_INFINITY, f32::NEG_INFINITY]);
        s.extend([f32::NEG_INFINITY; 4]);
        let want: Vec<f64> = s.iter().map(|&x| if x < -50.0 { 0.0 } else { (f64::from(x) - 0.5).exp() }).collect();
        #[allow(unsafe_code, reason = "calling a #[target_feature] kernel")]
        // SAFETY: the workspace's x86-64-v3 target has avx2 and fma.
        let sum = unsafe { exp_shifted_sum(&mut s, 0.5) };
        for (i, (&got, &w)) in s.iter().zip(&want).enumerate() {
            assert!((f64::from(got) - w).abs() <= 3e-7 * w, "weight {i}: {got} vs {w}");
        }
        let total: f64 = want.iter().sum();
        assert!((f64::from(sum) - total).abs() < 1e-6 * total, "{sum} vs {total}");
    }

    #[test]
    fn probabilities_round_like_the_exact_exponential() {
        let x: Vec<f32> = (0..203).map(|i| -((i * 37 % 101) as f32) * 0.07).collect();
        let (m, inv) = (0.0, 127.0);
        let mut codes = vec![0u8; x.len()];
        #[allow(unsafe_code, reason = "calling a #[target_feature] kernel")]
        // SAFETY: the workspace's x86-64-v3 target has avx2 and fma.
        let sum = unsafe { quantize_probs(&x, m, inv, &mut codes) };
        let want: Vec<u8> =
            x.iter().map(|&v| ((f64::from(v - m).exp() * f64::from(inv) + 0.5) as u8).min(127)).collect();
        assert_eq!(codes, want);
        assert_eq!(sum, want.iter().map(|&c| u32::from(c)).sum::<u32>());
    }
}
