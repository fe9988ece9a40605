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

/// Per-chunk key metadata: scale, minimum and code sum, as f32.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KeyMeta {
    pub sk: f32,
    pub mk: f32,
    pub ks: f32,
}

/// Scores of one pair of 64-dim key chunks (`x`: chunk 0 in the low lane, chunk 1 in the
/// high lane) against four heads: `[h0..h3 of chunk 0 | h0..h3 of chunk 1]`, unscaled.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn pair_scores(x: __m256i, q: &PairQuery, k0: KeyMeta, k1: KeyMeta) -> [f32; 8] {
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
        let a01 = _mm256_add_epi16(
            _mm256_maddubs_epi16(load32(&qh[0]), c[0]),
            _mm256_maddubs_epi16(load32(&qh[1]), c[1]),
        );
        let a23 = _mm256_add_epi16(
            _mm256_maddubs_epi16(load32(&qh[2]), c[2]),
            _mm256_maddubs_epi16(load32(&qh[3]), c[3]),
        );
        _mm256_madd_epi16(_mm256_add_epi16(a01, a23), ones)
    };
    let t = _mm256_hadd_epi32(_mm256_hadd_epi32(head(0), head(1)), _mm256_hadd_epi32(head(2), head(3)));
    let qk = _mm256_cvtepi32_ps(t);
    let lanes = |a: f32, b: f32| _mm256_set_m128(_mm_set1_ps(b), _mm_set1_ps(a));
    let (sk, mk, ks) = (lanes(k0.sk, k1.sk), lanes(k0.mk, k1.mk), lanes(k0.ks, k1.ks));
    let sq: __m256 = bytemuck::cast(q.sq);
    let mq: __m256 = bytemuck::cast(q.mq);
    let cc: __m256 = bytemuck::cast(q.c);
    // sk·(sq·QK + mq·Σk) + mk·(sq·Σq + Π·mq)
    let inner = _mm256_fmadd_ps(sq, qk, _mm256_mul_ps(mq, ks));
    bytemuck::cast(_mm256_fmadd_ps(sk, inner, _mm256_mul_ps(mk, cc)))
}

/// 16 key bytes of each of two chunks as one vector.
#[target_feature(enable = "avx2")]
pub(crate) fn two_chunks(lo: &[u8], hi: &[u8]) -> __m256i {
    _mm256_set_m128i(load16(hi), load16(lo))
}

/// 32 key bytes (one row of 128 dims, or two partitions of a longer row) as one vector.
#[target_feature(enable = "avx2")]
pub(crate) fn one_pair(b: &[u8]) -> __m256i {
    load32(b)
}

/// Integer value products of one block for `H` heads: `acc[h·d + c] = Σ_t w[h·stride + t]·code(t, c)`
/// over the token quads `quads` (indices into `block`, which holds `d` bytes per quad).
/// `w` holds 7-bit weights (zero for rows the plan did not select).
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
    for grp in 0..d / 32 {
        let mut lo = [_mm256_setzero_si256(); H];
        let mut hi = [_mm256_setzero_si256(); H];
        for &qi in quads {
            let qi = qi as usize;
            let x = load32(&block[qi * d + grp * 32..]);
            let c0 = _mm256_and_si256(x, m3);
            let c1 = _mm256_and_si256(_mm256_srli_epi16::<2>(x), m3);
            let c2 = _mm256_and_si256(_mm256_srli_epi16::<4>(x), m3);
            let c3 = _mm256_and_si256(_mm256_srli_epi16::<6>(x), m3);
            let (p01l, p01h) = (_mm256_unpacklo_epi8(c0, c1), _mm256_unpackhi_epi8(c0, c1));
            let (p23l, p23h) = (_mm256_unpacklo_epi8(c2, c3), _mm256_unpackhi_epi8(c2, c3));
            for h in 0..H {
                let wq = &w[h * stride + qi * 4..h * stride + qi * 4 + 4];
                let w01 = _mm256_set1_epi16(i16::from_le_bytes([wq[0], wq[1]]));
                let w23 = _mm256_set1_epi16(i16::from_le_bytes([wq[2], wq[3]]));
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

/// The key side of a [`super::hack_rows::HackRows`]: codes and per-(row, partition) metadata.
pub(crate) struct KeyData<'a> {
    pub codes: &'a [u8],
    pub min: &'a [half::f16],
    pub scale: &'a [half::f16],
    pub sum: &'a [u16],
    pub d: usize,
    pub kp: usize,
}

impl KeyData<'_> {
    #[inline(always)]
    fn meta(&self, r: usize, k: usize) -> KeyMeta {
        let at = r * self.kp + k;
        KeyMeta { sk: self.scale[at].to_f32(), mk: self.min[at].to_f32(), ks: f32::from(self.sum[at]) }
    }
}

/// Scaled scores of the key rows `rows` against `g` heads: `out[h·n + i]` for row `rows[i]`.
/// `pairs` holds, per group of four heads, one [`PairQuery`] per pair type: one type
/// `[partition 0 | partition 0]` when a row is one partition (two rows per vector), else
/// `kp/2` types `[2m | 2m+1]` (one row per `kp/2` vectors). Requires Π = 64 and `kp` 1 or even.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn block_scores(k: &KeyData<'_>, rows: &[usize], pairs: &[PairQuery], g: usize, scale: f32, out: &mut [f32]) {
    let n = rows.len();
    let types = if k.kp == 1 { 1 } else { k.kp / 2 };
    for hg in 0..g.div_ceil(4) {
        let hn = (g - hg * 4).min(4);
        let pq = &pairs[hg * types..(hg + 1) * types];
        if k.kp == 1 {
            for (i, two) in rows.chunks(2).enumerate() {
                let (r0, r1) = (two[0], *two.last().unwrap_or(&two[0]));
                let x = two_chunks(&k.codes[r0 * 16..], &k.codes[r1 * 16..]);
                let sc = pair_scores(x, &pq[0], k.meta(r0, 0), k.meta(r1, 0));
                for h in 0..hn {
                    out[(hg * 4 + h) * n + 2 * i] = sc[h] * scale;
                    if two.len() == 2 {
                        out[(hg * 4 + h) * n + 2 * i + 1] = sc[4 + h] * scale;
                    }
                }
            }
        } else {
            for (i, &r) in rows.iter().enumerate() {
                let mut acc = [0.0f32; 4];
                for (m, q) in pq.iter().enumerate() {
                    let x = one_pair(&k.codes[r * k.d / 4 + m * 32..]);
                    let sc = pair_scores(x, q, k.meta(r, 2 * m), k.meta(r, 2 * m + 1));
                    for h in 0..4 {
                        acc[h] += sc[h] + sc[4 + h];
                    }
                }
                for h in 0..hn {
                    out[(hg * 4 + h) * n + i] = acc[h] * scale;
                }
            }
        }
    }
}
