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
//! Loads and stores go through `bytemuck` (the SIMD types are plain data), so the only
//! `unsafe` is the call into these `#[target_feature]` functions, in `hack_rows.rs`.

use std::arch::x86_64::*;

/// 16 bytes as a vector.
#[inline(always)]
fn load16(b: &[u8]) -> __m128i {
    bytemuck::pod_read_unaligned(&b[..16])
}

/// 32 bytes as a vector.
#[inline(always)]
fn load32(b: &[u8]) -> __m256i {
    bytemuck::pod_read_unaligned(&b[..32])
}

/// Per head group (4 heads) and pair type: the strided query codes of both lanes (four
/// shifts × four heads) and the lane constants `sq`, `mq` and `C = sq·Σq + Π·mq`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PairQuery {
    /// `[head][shift]` query codes, low lane for the first chunk of a pair, high lane for
    /// the second.
    pub codes: [[[u8; 32]; 4]; 4],
    /// Query scale per lane (`[head 0..4 of chunk 0 | head 0..4 of chunk 1]`).
    pub sq: [f32; 8],
    /// Query minimum per lane.
    pub mq: [f32; 8],
    /// `sq·Σq8 + Π·mq` per lane.
    pub c: [f32; 8],
}

/// Key metadata of the two chunks of a pair, each as a vector `[chunk 0 ×4 | chunk 1 ×4]`:
/// scale, minimum and code sum.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PairMeta {
    pub sk: __m256,
    pub mk: __m256,
    pub ks: __m256,
}

/// Scores of one pair of 64-dim key chunks (`x`: chunk 0 in the low lane, chunk 1 in the
/// high lane) against four heads: `[h0..h3 of chunk 0 | h0..h3 of chunk 1]`, unscaled.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn pair_scores(x: __m256i, q: &PairQuery, k: PairMeta) -> __m256 {
    let m3 = _mm256_set1_epi8(3);
    let c = [
        _mm256_and_si256(x, m3),
        _mm256_and_si256(_mm256_srli_epi16::<2>(x), m3),
        _mm256_and_si256(_mm256_srli_epi16::<4>(x), m3),
        _mm256_and_si256(_mm256_srli_epi16::<6>(x), m3),
    ];
    let ones = _mm256_set1_epi16(1);
    let head = |h: usize| {
        let qh = &q.codes[h];
        let a01 =
            _mm256_add_epi16(_mm256_maddubs_epi16(load32(&qh[0]), c[0]), _mm256_maddubs_epi16(load32(&qh[1]), c[1]));
        let a23 =
            _mm256_add_epi16(_mm256_maddubs_epi16(load32(&qh[2]), c[2]), _mm256_maddubs_epi16(load32(&qh[3]), c[3]));
        _mm256_madd_epi16(_mm256_add_epi16(a01, a23), ones)
    };
    let t = _mm256_hadd_epi32(_mm256_hadd_epi32(head(0), head(1)), _mm256_hadd_epi32(head(2), head(3)));
    let qk = _mm256_cvtepi32_ps(t);
    let sq: __m256 = bytemuck::cast(q.sq);
    let mq: __m256 = bytemuck::cast(q.mq);
    let cc: __m256 = bytemuck::cast(q.c);
    // sk·(sq·QK + mq·Σk) + mk·(sq·Σq + Π·mq)
    let inner = _mm256_fmadd_ps(sq, qk, _mm256_mul_ps(mq, k.ks));
    _mm256_fmadd_ps(k.sk, inner, _mm256_mul_ps(k.mk, cc))
}

/// Integer value products of one block for `H` heads: `acc[h·d + c] = Σ_t w[h·stride + t]·code(t, c)`
/// over the token quads `quads` (indices into `block`, which holds `d` bytes per quad).
/// `w` holds 7-bit weights (zero for rows the plan did not select); blocks hold at most 64
/// rows (16 quads).
#[target_feature(enable = "avx2")]
pub(crate) fn block_values<const H: usize>(
    block: &[u8],
    d: usize,
    quads: &[u16],
    w: &[u8],
    stride: usize,
    acc: &mut [i32],
) {
    let m3 = _mm256_set1_epi8(3);
    // The weight pairs of every live quad, broadcast once for all channel groups.
    let mut pairs = [[[_mm256_setzero_si256(); 2]; H]; 16];
    for (slot, &qi) in pairs.iter_mut().zip(quads) {
        for (h, wp) in slot.iter_mut().enumerate() {
            let wq = &w[h * stride + qi as usize * 4..h * stride + qi as usize * 4 + 4];
            wp[0] = _mm256_set1_epi16(i16::from_le_bytes([wq[0], wq[1]]));
            wp[1] = _mm256_set1_epi16(i16::from_le_bytes([wq[2], wq[3]]));
        }
    }
    for grp in 0..d / 32 {
        let mut lo = [_mm256_setzero_si256(); H];
        let mut hi = [_mm256_setzero_si256(); H];
        for (slot, &qi) in pairs.iter().zip(quads) {
            let qi = qi as usize;
            let x = load32(&block[qi * d + grp * 32..]);
            let c0 = _mm256_and_si256(x, m3);
            let c1 = _mm256_and_si256(_mm256_srli_epi16::<2>(x), m3);
            let c2 = _mm256_and_si256(_mm256_srli_epi16::<4>(x), m3);
            let c3 = _mm256_and_si256(_mm256_srli_epi16::<6>(x), m3);
            let (p01l, p01h) = (_mm256_unpacklo_epi8(c0, c1), _mm256_unpackhi_epi8(c0, c1));
            let (p23l, p23h) = (_mm256_unpacklo_epi8(c2, c3), _mm256_unpackhi_epi8(c2, c3));
            for h in 0..H {
                let [w01, w23] = slot[h];
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
        for h in 0..H {
            let out = &mut acc[h * d + grp * 32..h * d + grp * 32 + 32];
            let parts = [
                (_mm256_castsi256_si128(lo[h]), 0),
                (_mm256_castsi256_si128(hi[h]), 8),
                (_mm256_extracti128_si256::<1>(lo[h]), 16),
                (_mm256_extracti128_si256::<1>(hi[h]), 24),
            ];
            for (v, at) in parts {
                let wide: [i32; 8] = bytemuck::cast(_mm256_cvtepi16_epi32(v));
                out[at..at + 8].copy_from_slice(&wide);
            }
        }
    }
}

/// The key side of one value block of a [`super::hack_rows::HackRows`]: all code bytes,
/// and the block's per-(row, partition) metadata widened to f32 (`[row·kp + k]`, rows
/// relative to `first_row`).
pub(crate) struct KeyData<'a> {
    pub codes: &'a [u8],
    pub sk: &'a [f32],
    pub mk: &'a [f32],
    pub ks: &'a [f32],
    pub d: usize,
    pub kp: usize,
    pub first_row: usize,
}

/// `[a ×4 | b ×4]` from two adjacent floats `ab[0..2]`.
#[inline]
#[target_feature(enable = "avx2")]
fn spread2(ab: &[f32]) -> __m256 {
    let a = f64::from_bits(bytemuck::pod_read_unaligned::<u64>(bytemuck::cast_slice(&ab[..2])));
    // Broadcast the 8 bytes, then pick lanes 0,0,0,0,1,1,1,1.
    _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_set1_pd(a)), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1))
}

/// `[a ×4 | b ×4]` from two floats.
#[inline]
#[target_feature(enable = "avx")]
fn lanes(a: f32, b: f32) -> __m256 {
    _mm256_set_m128(_mm_set1_ps(b), _mm_set1_ps(a))
}

/// Scaled scores of the key rows `rows` (relative to `k.first_row`) against `g` heads:
/// `out[h·n + i]` for row `rows[i]`. `pairs` holds, per group of four heads, one
/// [`PairQuery`] per pair type: one type `[partition 0 | partition 0]` when a row is one
/// partition (two rows per vector), else `kp/2` types `[2m | 2m+1]` (one row per `kp/2`
/// vectors). Requires Π = 64 and `kp` 1 or even.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn block_scores(k: &KeyData<'_>, rows: &[u32], pairs: &[PairQuery], g: usize, scale: f32, out: &mut [f32]) {
    let n = rows.len();
    let types = if k.kp == 1 { 1 } else { k.kp / 2 };
    let row_bytes = k.d / 4;
    let sv = _mm_set1_ps(scale);
    for hg in 0..g.div_ceil(4) {
        let hn = (g - hg * 4).min(4);
        let pq = &pairs[hg * types..(hg + 1) * types];
        if k.kp == 1 {
            for (i, two) in rows.chunks(2).enumerate() {
                let (t0, t1) = (two[0] as usize, *two.last().unwrap_or(&two[0]) as usize);
                let (r0, r1) = (k.first_row + t0, k.first_row + t1);
                let x = _mm256_set_m128i(load16(&k.codes[r1 * 16..]), load16(&k.codes[r0 * 16..]));
                let meta = PairMeta {
                    sk: lanes(k.sk[t0], k.sk[t1]),
                    mk: lanes(k.mk[t0], k.mk[t1]),
                    ks: lanes(k.ks[t0], k.ks[t1]),
                };
                let sc: [f32; 8] = bytemuck::cast(pair_scores(x, &pq[0], meta));
                for h in 0..hn {
                    out[(hg * 4 + h) * n + 2 * i] = sc[h] * scale;
                    if two.len() == 2 {
                        out[(hg * 4 + h) * n + 2 * i + 1] = sc[4 + h] * scale;
                    }
                }
            }
        } else {
            for (i, &t) in rows.iter().enumerate() {
                let t = t as usize;
                let r = k.first_row + t;
                let mut acc = _mm256_setzero_ps();
                for (m, q) in pq.iter().enumerate() {
                    let x = load32(&k.codes[r * row_bytes + m * 32..]);
                    let at = t * k.kp + 2 * m;
                    let meta =
                        PairMeta { sk: spread2(&k.sk[at..]), mk: spread2(&k.mk[at..]), ks: spread2(&k.ks[at..]) };
                    acc = _mm256_add_ps(acc, pair_scores(x, q, meta));
                }
                let four = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc)), sv);
                let sc: [f32; 4] = bytemuck::cast(four);
                for h in 0..hn {
                    out[(hg * 4 + h) * n + i] = sc[h];
                }
            }
        }
    }
}
