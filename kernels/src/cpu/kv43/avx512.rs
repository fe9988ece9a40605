//! kv43's AVX-512 kernels, chosen at run time where the CPU has AVX-512 F/BW, VNNI, VBMI and GFNI
//! (`crate::cpu::hack_avx512::available`: Ice Lake and Sapphire Rapids Xeons, Zen 4). They
//! compute the AVX2 kernels' integers (`avx2.rs`) with `vpdpbusd`, which multiplies 64
//! unsigned × signed byte pairs and adds them, in fours, to 32-bit sums in one instruction:
//! no 16-bit partial sums, no widening, half the instructions per byte.
//!
//! - **Scores.** One 64-byte load holds two octets of channels of a key tile (eight rows,
//!   one per 32-bit lane, in each 256-bit half); per head two `vpdpbusd` against its query
//!   words for the pair of octets ([`super::attention::GroupQueries`]' `wide`: the low and
//!   the high nibbles' words of each octet broadcast over its half). The halves are added
//!   per partition and combined with the float operations of the AVX2 kernel, in its order,
//!   so the scores are equal bit for bit.
//! - **Values.** Per eight rows each channel's plane bytes are gathered into one 64-bit
//!   word, an 8×8 bit matrix that `gf2p8affineqb` transposes into the eight rows' codes (one
//!   byte each), and one `vpdpbusd` per head and 8 channels adds them four rows to a lane,
//!   weighed by the rows' probability codes broadcast as one word.
//!
//! The workspace targets x86-64-v3, so these functions are `#[target_feature]` and called
//! only after `available()` says the CPU has the features (the `unsafe` calls live in
//! `attention.rs`). Tests compare them with the AVX2 kernels and the references exactly;
//! they skip, printing why, on a CPU without AVX-512.

use std::arch::x86_64::*;

use super::attention::prefetch;
use super::{PART, TILE};

/// 64 bytes as a vector.
#[inline(always)]
fn load64(b: &[u8]) -> __m512i {
    bytemuck::pod_read_unaligned(&b[..64])
}

/// The scores of `H` query heads over a run of key tiles, as `avx2::tile_scores` computes
/// them tile by tile (the same integers, the same float operations in the same order):
/// `w[h]` holds head `h`'s query words per pair of octets, low nibbles' then high nibbles'
/// (`2·d/16` vectors, see `GroupQueries::wide`); `out[h]` takes the run's rows (`tiles × 8`); the
/// other arguments as there, for every tile of the run in turn. `ahead`: bytes to ask the
/// caches for (the key codes of a block further on, or nothing), a share per pair of tiles.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) fn tile_scores<const H: usize, const HIGH: bool>(
    (codes, high, sums): (&[u8], &[u8], &[u16]),
    w: [&[[u32; 16]]; H],
    (a, b, qm): ([&[f32]; H], [&[f32]; H], [f32; H]),
    (scale, ahead): (f32, &[u8]),
    out: &mut [&mut [f32]; H],
) {
    // Octet pairs per partition.
    const PAIRS: usize = PART / 16;
    let parts = w[0].len() / (2 * PAIRS);
    let tiles = sums.len() / (TILE * parts);
    assert!(
        w.iter().all(|w| w.len() == 2 * parts * PAIRS) && out.iter().all(|o| o.len() == tiles * TILE),
        "query and output shapes"
    );
    assert!(codes.len() == tiles * parts * PAIRS * 64 && sums.len() == tiles * TILE * parts, "tile shapes");
    assert!(a.iter().chain(&b).all(|x| x.len() == parts), "partition shapes");
    assert!(high.len() == if HIGH { tiles * parts * PART } else { 0 }, "fifth-bit shapes");
    let nibble = _mm512_set1_epi8(0x0f);
    // As in the AVX2 kernel: byte `i` of a row's lane tests bit `i` (low nibbles) or `4 + i`
    // (high nibbles) of the row's fifth-bit byte, copied to the lane's four bytes.
    let (lo_bits, hi_bits) = (_mm512_set1_epi32(0x0804_0201), _mm512_set1_epi32(0x8040_2010_u32 as i32));
    let spread = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
    let sixteen = _mm512_set1_epi8(16);
    // A tile's codes of pair `p` of octets, low nibbles and high ones (with the fifth bits).
    let nibbles = |t: usize, p: usize| {
        let x = load64(&codes[(t * parts * PAIRS + p) * 64..]);
        let mut lo = _mm512_and_si512(x, nibble);
        let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(x), nibble);
        if HIGH {
            // The two octets' eight row bytes each, one per lane.
            let at = t * parts * PART + p * 16;
            let rows: __m128i = bytemuck::pod_read_unaligned(&high[at..at + 16]);
            let x = _mm512_shuffle_epi8(_mm512_cvtepu8_epi32(rows), spread);
            lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(x, lo_bits), lo, sixteen);
            hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(x, hi_bits), hi, sixteen);
        }
        (lo, hi)
    };
    // Tiles two at a time: per head one dependency chain per tile, then both tiles' halves
    // (each row's two octets) added into sixteen lanes, rows of the first tile first, so
    // the float operations run on sixteen rows at once (the same operations per row).
    let (first, second): (__m512i, __m512i) = (
        bytemuck::cast([0u32, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23]),
        bytemuck::cast([8u32, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31]),
    );
    let mut t = 0;
    while t + 1 < tiles {
        // This pair's share of the codes asked for ahead.
        prefetch(&ahead[ahead.len() * t / tiles..ahead.len() * (t + 2) / tiles]);
        let mut s = qm.map(|x| _mm512_set1_ps(x));
        for k in 0..parts {
            let (mut da, mut db) = ([_mm512_setzero_si512(); H], [_mm512_setzero_si512(); H]);
            for p in k * PAIRS..(k + 1) * PAIRS {
                let ((la, ha), (lb, hb)) = (nibbles(t, p), nibbles(t + 1, p));
                for h in 0..H {
                    let (ql, qh): (__m512i, __m512i) = (bytemuck::cast(w[h][2 * p]), bytemuck::cast(w[h][2 * p + 1]));
                    da[h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(da[h], ql, la), qh, ha);
                    db[h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(db[h], ql, lb), qh, hb);
                }
            }
            let (ua, ub): (__m128i, __m128i) = (
                bytemuck::pod_read_unaligned(bytemuck::cast_slice(&sums[(t * parts + k) * TILE..][..TILE])),
                bytemuck::pod_read_unaligned(bytemuck::cast_slice(&sums[((t + 1) * parts + k) * TILE..][..TILE])),
            );
            let u = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm256_set_m128i(ub, ua)));
            for h in 0..H {
                let dot = _mm512_add_epi32(
                    _mm512_permutex2var_epi32(da[h], first, db[h]),
                    _mm512_permutex2var_epi32(da[h], second, db[h]),
                );
                let v = _mm512_add_ps(
                    _mm512_mul_ps(_mm512_set1_ps(a[h][k]), u),
                    _mm512_mul_ps(_mm512_set1_ps(b[h][k]), _mm512_cvtepi32_ps(dot)),
                );
                s[h] = _mm512_add_ps(s[h], v);
            }
        }
        for h in 0..H {
            let scores: [f32; 2 * TILE] = bytemuck::cast(_mm512_mul_ps(s[h], _mm512_set1_ps(scale)));
            out[h][t * TILE..(t + 2) * TILE].copy_from_slice(&scores);
        }
        t += 2;
    }
    if t < tiles {
        prefetch(&ahead[ahead.len() * t / tiles..]);
        // The last, odd tile alone.
        let mut s = qm.map(|x| _mm256_set1_ps(x));
        for k in 0..parts {
            let mut dt = [_mm512_setzero_si512(); H];
            for p in k * PAIRS..(k + 1) * PAIRS {
                let (lo, hi) = nibbles(t, p);
                for h in 0..H {
                    let (ql, qh): (__m512i, __m512i) = (bytemuck::cast(w[h][2 * p]), bytemuck::cast(w[h][2 * p + 1]));
                    dt[h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dt[h], ql, lo), qh, hi);
                }
            }
            let u: __m128i =
                bytemuck::pod_read_unaligned(bytemuck::cast_slice(&sums[(t * parts + k) * TILE..][..TILE]));
            let u = _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(u));
            for h in 0..H {
                // Both octets' halves: a row's integer product over the partition.
                let dot = dt[h];
                let dot8 = _mm256_add_epi32(_mm512_castsi512_si256(dot), _mm512_extracti64x4_epi64::<1>(dot));
                let v = _mm256_add_ps(
                    _mm256_mul_ps(_mm256_set1_ps(a[h][k]), u),
                    _mm256_mul_ps(_mm256_set1_ps(b[h][k]), _mm256_cvtepi32_ps(dot8)),
                );
                s[h] = _mm256_add_ps(s[h], v);
            }
        }
        for h in 0..H {
            let scores: [f32; TILE] = bytemuck::cast(_mm256_mul_ps(s[h], _mm256_set1_ps(scale)));
            out[h][t * TILE..(t + 1) * TILE].copy_from_slice(&scores);
        }
    }
}

/// `dot[h·d + c] = Σ_t p[h][t]·z[t][c]` for `H` heads over one block's 3- or 4-bit
/// (`FOUR`) value codes, read from their bit planes (`rows/8 × bits × d` bytes, see
/// `Kv43Rows::value_planes`); `p[h]`: head `h`'s `rows` 8-bit probability codes. Sums are
/// 32-bit (≤ 255·15 per row): no bound on the rows.
///
/// Per 8-row group and 32 channels: the planes' bytes of each channel gathered into one
/// 64-bit word (`vpermt2b`: plane `b`'s byte at byte `7 − b`), which is an 8×8 bit matrix
/// whose transpose (`gf2p8affineqb` against the identity's columns) holds row `t`'s code in
/// byte `t`; then one `vpdpbusd` per head and 8 channels adds rows 0–3 and 4–7 of each
/// channel in its two 32-bit lanes, weighed by the group's eight probability codes
/// broadcast as one word. The lane pairs are added once per block. `ahead`: bytes to ask
/// the caches for (the value planes of a block further on, or nothing), a share per 32
/// channels.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi,gfni")]
pub(super) fn weigh_value_planes<const H: usize, const FOUR: bool>(
    (planes, ahead): (&[u8], &[u8]),
    d: usize,
    p: [&[u8]; H],
    dot: &mut [u32],
) {
    let bits = if FOUR { 4 } else { 3 };
    let rows = planes.len() / (bits * d) * 8;
    assert!(d.is_multiple_of(32) && planes.len() == rows / 8 * bits * d, "value plane shapes");
    assert!(p.iter().all(|p| p.len() == rows) && dot.len() == H * d, "probability and output shapes");
    let table = &GATHER[usize::from(FOUR)];
    let gather: [__m512i; 4] = [table[0], table[1], table[2], table[3]].map(bytemuck::cast);
    let keep: u64 = 0xf0f0_f0f0_f0f0_f0f0;
    // Byte t of every word is 1 << t: the transpose's columns.
    let columns = _mm512_set1_epi64(0x8040_2010_0804_0201_u64 as i64);
    // Even (rows 0–3) and odd (rows 4–7) lanes of two accumulators: channels in order.
    let (even, odd): (__m512i, __m512i) = (
        bytemuck::cast([0u32, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30]),
        bytemuck::cast([1u32, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31]),
    );
    for c0 in (0..d).step_by(32) {
        prefetch(&ahead[ahead.len() * c0 / d..ahead.len() * (c0 + 32) / d]);
        let mut acc = [[_mm512_setzero_si512(); 4]; H];
        for i in 0..rows / 8 {
            let group = i * bits * d;
            let plane = |b: usize| -> __m256i { bytemuck::pod_read_unaligned(&planes[group + b * d + c0..][..32]) };
            let first = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(plane(0)), plane(1));
            let second = if FOUR {
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(plane(2)), plane(3))
            } else {
                _mm512_zextsi256_si512(plane(2))
            };
            macro_rules! codes {
                ($k:literal) => {{
                    let words = if FOUR {
                        _mm512_maskz_permutex2var_epi8(keep, first, gather[$k], second)
                    } else {
                        _mm512_permutex2var_epi8(first, gather[$k], second)
                    };
                    _mm512_gf2p8affine_epi64_epi8::<0>(columns, words)
                }};
            }
            let (z0, z1, z2, z3) = (codes!(0), codes!(1), codes!(2), codes!(3));
            for (h, acc) in acc.iter_mut().enumerate() {
                let w = _mm512_set1_epi64(bytemuck::pod_read_unaligned(&p[h][8 * i..8 * i + 8]));
                acc[0] = _mm512_dpbusd_epi32(acc[0], w, z0);
                acc[1] = _mm512_dpbusd_epi32(acc[1], w, z1);
                acc[2] = _mm512_dpbusd_epi32(acc[2], w, z2);
                acc[3] = _mm512_dpbusd_epi32(acc[3], w, z3);
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            for half in 0..2 {
                let (a, b) = (acc[2 * half], acc[2 * half + 1]);
                let sums =
                    _mm512_add_epi32(_mm512_permutex2var_epi32(a, even, b), _mm512_permutex2var_epi32(a, odd, b));
                let at = h * d + c0 + 16 * half;
                dot[at..at + 16].copy_from_slice(&bytemuck::cast::<__m512i, [u32; 16]>(sums));
            }
        }
    }
}

/// The byte indices of `weigh_value_planes`' gathers, for 3-bit values (`[0]`) and 4-bit
/// ones (`[1]`): word `j` of gather `k` (channel `8k + j` of 32) takes plane `b`'s byte at
/// byte `7 − b`, index `32·b + 8k + j` of the two tables (planes 0–1 in the first, 2–3 in
/// the second); its other bytes index byte 96, a zero of the second table with 3-bit
/// values (with 4-bit ones a mask zeroes them).
const GATHER: [[[u8; 64]; 4]; 2] = {
    let mut out = [[[96u8; 64]; 4]; 2];
    let mut four = 0;
    while four < 2 {
        let mut k = 0;
        while k < 4 {
            let mut j = 0;
            while j < 8 {
                let mut b = 0;
                while b < 3 + four {
                    out[four][k][8 * j + 7 - b] = (b * 32 + 8 * k + j) as u8;
                    b += 1;
                }
                j += 1;
            }
            k += 1;
        }
        four += 1;
    }
    out
};

/// Every head's query coded against one key group, as `GroupQuery::prepare` and
/// `quantize_into` compute it (the same float operations, so the same codes, minima, steps
/// and `qm`), sixteen channels at a time: `q` (`heads × d`), the group's channel scales and
/// minima (`d` each) in; per head its `d/4` code words `w`, the AVX-512 score kernel's
/// `d/8` vectors `wide`, per partition `a` (minimum) and `b` (step), and `qm = Σ q·m` out.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) fn prepare_queries(
    q: &[f32],
    (key_scale, key_min): (&[f32], &[f32]),
    w: &mut [u32],
    wide: &mut [[u32; 16]],
    (a, b, qm): (&mut [f32], &mut [f32], &mut [f32]),
) {
    let d = key_scale.len();
    let parts = d / PART;
    assert!(d.is_multiple_of(PART) && key_min.len() == d && q.len() == qm.len() * d, "query shapes");
    assert!(w.len() == q.len() / 4 && wide.len() == q.len() / 8 && a.len() == qm.len() * parts && b.len() == a.len());
    let (zero, top) = (_mm512_setzero_ps(), _mm512_set1_ps(255.0));
    let load = |x: &[f32], at: usize| -> __m512 { bytemuck::pod_read_unaligned(bytemuck::cast_slice(&x[at..at + 16])) };
    // Partition `k` of head `h`'s `q∘s`, sixteen channels per vector.
    let scaled = |qh: &[f32], k: usize| -> [__m512; PART / 16] {
        std::array::from_fn(|i| {
            let at = k * PART + 16 * i;
            _mm512_mul_ps(load(qh, at), load(key_scale, at))
        })
    };
    // In phases over every head and partition, so that their dependency chains (the
    // reductions, the f16 roundings and the divisions) overlap: first `qm` and each
    // partition's least and largest `q∘s` (into `a` and `b` for now),
    for (h, qh) in q.chunks_exact(d).enumerate() {
        // Σ q·m in eight lanes, then the lanes pairwise, as `GroupQuery::prepare`.
        let mut lanes = _mm256_setzero_ps();
        for at in (0..d).step_by(8) {
            let (x, m): (__m256, __m256) = (
                bytemuck::pod_read_unaligned(bytemuck::cast_slice(&qh[at..at + 8])),
                bytemuck::pod_read_unaligned(bytemuck::cast_slice(&key_min[at..at + 8])),
            );
            lanes = _mm256_add_ps(lanes, _mm256_mul_ps(x, m));
        }
        let four = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps::<1>(lanes));
        let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
        qm[h] = _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
        for k in 0..parts {
            let x = scaled(qh, k);
            a[h * parts + k] =
                _mm512_reduce_min_ps(x.iter().copied().reduce(|p, v| _mm512_min_ps(p, v)).unwrap_or(zero));
            b[h * parts + k] =
                _mm512_reduce_max_ps(x.iter().copied().reduce(|p, v| _mm512_max_ps(p, v)).unwrap_or(zero));
        }
    }
    // then, sixteen partitions at a time, `quantize_into`'s f16 minimum and step with 255
    // levels (each lane as the scalar operations would give),
    for at in (0..a.len()).step_by(16) {
        let n = (a.len() - at).min(16);
        let (mut lo, mut hi) = ([0.0f32; 16], [0.0f32; 16]);
        lo[..n].copy_from_slice(&a[at..at + n]);
        hi[..n].copy_from_slice(&b[at..at + n]);
        let round =
            |x: __m512| _mm512_cvtph_ps(_mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x));
        let min = round(bytemuck::cast(lo));
        let step = round(_mm512_div_ps(_mm512_max_ps(_mm512_sub_ps(bytemuck::cast(hi), min), zero), top));
        a[at..at + n].copy_from_slice(&bytemuck::cast::<__m512, [f32; 16]>(min)[..n]);
        b[at..at + n].copy_from_slice(&bytemuck::cast::<__m512, [f32; 16]>(step)[..n]);
    }
    // then the codes.
    for (h, qh) in q.chunks_exact(d).enumerate() {
        let words = &mut w[h * d / 4..(h + 1) * d / 4];
        for k in 0..parts {
            let (m, s) = (a[h * parts + k], b[h * parts + k]);
            let inv = _mm512_set1_ps(1.0 / s);
            for (i, &v) in scaled(qh, k).iter().enumerate() {
                let codes = if s > 0.0 {
                    // `avx2::code_run::<true>`: the step's inverse, round half away from
                    // zero, clamped to 0..=255.
                    let c = _mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(v, _mm512_set1_ps(m)), inv), zero);
                    _mm512_cvtepi32_epi8(round_clamped(c, top))
                } else {
                    _mm_setzero_si128()
                };
                let at = (k * PART + 16 * i) / 4;
                words[at..at + 4].copy_from_slice(&bytemuck::cast::<__m128i, [u32; 4]>(codes));
            }
        }
        // Pair `p` of octets `2p`, `2p + 1`: words `4p`, `4p + 2` (low nibbles) and
        // `4p + 1`, `4p + 3` (high), each over eight lanes; a partition's 16 words hold
        // four pairs.
        for (k, pairs) in wide[h * d / 8..(h + 1) * d / 8].chunks_exact_mut(2 * PART / 16).enumerate() {
            let part: __m512i = bytemuck::pod_read_unaligned(bytemuck::cast_slice(&words[k * 16..k * 16 + 16]));
            for (i, v) in pairs.iter_mut().enumerate() {
                // Vector i: pair i / 2, nibble i % 2.
                let first = 4 * (i / 2) as i32 + (i % 2) as i32;
                let idx = _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(first), _mm512_set1_epi32(first + 2));
                *v = bytemuck::cast(_mm512_permutexvar_epi32(idx, part));
            }
        }
    }
}

/// Every head's probabilities over a block of scored rows, as `attention::probabilities`
/// computes them on the AVX2 path (`exp_shifted_sum`, then the codes of
/// `probability_codes` against the block's largest), every head in one call, in phases over
/// the heads (so their reductions and `exp`s overlap): `scores` (`heads × rows`, rows a multiple of 16, `-∞` for rows not attended)
/// become their 8-bit codes `codes` (`heads × rows`), relative to `m[h]`, the running
/// maximum raised to the block's largest score, which is written to `top[h]` (`-∞` for a
/// head with no row attended). The block's largest probability is the `exp` of its largest
/// score, so the step is known before the other rows are raised, and each code is a
/// product with the step's inverse (no division, no second pass). `step[h]` (0 when every
/// probability is 0, and then the codes are all 0) and `sum[h]`, the codes' sum, out.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) fn block_probabilities(
    scores: &[f32],
    (m, top): (&[f32], &mut [f32]),
    codes: &mut [u8],
    (step, sum): (&mut [f32], &mut [u32]),
) {
    let heads = m.len();
    let rows = scores.len() / heads.max(1);
    assert!(rows.is_multiple_of(16) && scores.len() == heads * rows && codes.len() == scores.len(), "block shapes");
    assert!(top.len() == heads && step.len() == heads && sum.len() == heads, "per-head shapes");
    let floor = crate::cpu::hack_avx2::EXP_FLOOR;
    let (levels, zero, floor_v) = (_mm512_set1_ps(super::P_LEVELS), _mm512_setzero_ps(), _mm512_set1_ps(floor));
    let load = |at: usize| -> __m512 { bytemuck::pod_read_unaligned(bytemuck::cast_slice(&scores[at..at + 16])) };
    // In three phases, each over every head, so that the heads' dependency chains (the
    // largest score's reduction, its `exp`, the step's inverse) overlap: first each head's
    // largest score,
    for (h, top) in top.iter_mut().enumerate() {
        let mut hi = _mm512_set1_ps(f32::NEG_INFINITY);
        for at in (h * rows..(h + 1) * rows).step_by(16) {
            hi = _mm512_max_ps(hi, load(at));
        }
        *top = _mm512_reduce_max_ps(hi);
    }
    // then the steps, sixteen heads per `exp` (each lane as one head's own call would give),
    for h0 in (0..heads).step_by(16) {
        let n = (heads - h0).min(16);
        let mut x = [0.0f32; 16];
        for (i, x) in x.iter_mut().enumerate().take(n) {
            *x = top[h0 + i] - m[h0 + i].max(top[h0 + i]);
        }
        let xv: __m512 = bytemuck::cast(x);
        let live = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(xv, floor_v) & ((1u32 << n) - 1) as u16;
        let peaks: [f32; 16] = bytemuck::cast(_mm512_maskz_mov_ps(live, crate::cpu::hack_avx512::exp16(xv)));
        for (step, &peak) in step[h0..h0 + n].iter_mut().zip(&peaks) {
            *step = peak / super::P_LEVELS;
        }
    }
    // then the codes.
    for h in 0..heads {
        let row = h * rows..(h + 1) * rows;
        if step[h] == 0.0 {
            // No row attended (or none within the `exp` floor): no codes.
            sum[h] = 0;
            codes[row].iter_mut().for_each(|c| *c = 0);
            continue;
        }
        let (mv, inv) = (_mm512_set1_ps(m[h].max(top[h])), _mm512_set1_ps(1.0 / step[h]));
        let mut total = _mm512_setzero_si512();
        for at in row.step_by(16) {
            let x = _mm512_sub_ps(load(at), mv);
            let e =
                _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, floor_v), crate::cpu::hack_avx512::exp16(x));
            let c = round_clamped(_mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(e, inv), levels), zero), levels);
            total = _mm512_add_epi32(total, c);
            codes[at..at + 16].copy_from_slice(&bytemuck::cast::<__m128i, [u8; 16]>(_mm512_cvtepi32_epi8(c)));
        }
        sum[h] = _mm512_reduce_add_epi32(total) as u32;
    }
}

/// `o[c] += step·(m[c]·sum + s[c]·dot[c])` for every channel, sixteen at a time with
/// `fold_block`'s float operations in its order (so the same sums): a value block's
/// weighed codes `dot` folded into one head's output with the block's channel minima `m`
/// and scales `s`, its probability step and code sum.
#[target_feature(enable = "avx512f")]
pub(super) fn fold_values(o: &mut [f32], dot: &[u32], (m, s): (&[f32], &[f32]), (step, sum): (f32, f32)) {
    assert!(o.len().is_multiple_of(16) && [dot.len(), m.len(), s.len()].iter().all(|&n| n == o.len()), "fold shapes");
    let (step, sum) = (_mm512_set1_ps(step), _mm512_set1_ps(sum));
    let load = |x: &[f32], at: usize| -> __m512 { bytemuck::pod_read_unaligned(bytemuck::cast_slice(&x[at..at + 16])) };
    for at in (0..o.len()).step_by(16) {
        // Sums of at most 255·15 per row: exact as signed 32-bit integers and as floats.
        let x = _mm512_cvtepi32_ps(bytemuck::pod_read_unaligned(bytemuck::cast_slice(&dot[at..at + 16])));
        let v = _mm512_mul_ps(step, _mm512_add_ps(_mm512_mul_ps(load(m, at), sum), _mm512_mul_ps(load(s, at), x)));
        let out = _mm512_add_ps(load(o, at), v);
        o[at..at + 16].copy_from_slice(&bytemuck::cast::<__m512, [f32; 16]>(out));
    }
}

/// `min(round(q), top)` as integers, for `q ≥ 0`, rounding half away from zero as
/// `f32::round` does: `trunc` plus one where the fraction is at least ½ (the rounding of
/// the AVX2 kernels' `code_run` and `probability_codes`).
#[inline]
#[target_feature(enable = "avx512f")]
fn round_clamped(q: __m512, top: __m512) -> __m512i {
    let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(q);
    let frac = _mm512_sub_ps(q, t);
    let up = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, _mm512_set1_ps(0.5)), _mm512_set1_ps(1.0));
    _mm512_cvttps_epi32(_mm512_min_ps(_mm512_add_ps(t, up), top))
}
