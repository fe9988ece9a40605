//! kv43's AVX2 kernels: the 4-bit key codes' integer products against 8-bit query codes
//! (one head, or four heads reduced together) and the 3-bit value codes made from their
//! planes and weighed by 7-bit probabilities.

use std::arch::x86_64::*;

/// The integer product of one 64-dim partition: 32 code bytes against the even- and
/// odd-channel query codes, by `vpmaddubsw` (unsigned 8-bit query codes times the
/// 4-bit key codes, pair sums ≤ 2·255·15, so nothing saturates) and `vpmaddwd`.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn partition_dot(codes: &[u8], even: __m256i, odd: __m256i) -> u32 {
    let x: __m256i = bytemuck::pod_read_unaligned(&codes[..32]);
    let nibble = _mm256_set1_epi8(0x0f);
    let lo = _mm256_and_si256(x, nibble);
    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(x), nibble);
    let pairs = _mm256_add_epi16(_mm256_maddubs_epi16(even, lo), _mm256_maddubs_epi16(odd, hi));
    let s = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s));
    _mm_cvtsi128_si32(s) as u32
}

/// [`partition_dot`] of four heads' query codes against the same 32 code bytes: the
/// nibbles unpacked once, the four sums reduced together by two rounds of `vphaddd`.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn partition_dots4(codes: &[u8], q: &[(__m256i, __m256i); 4]) -> [u32; 4] {
    let x: __m256i = bytemuck::pod_read_unaligned(&codes[..32]);
    let nibble = _mm256_set1_epi8(0x0f);
    let lo = _mm256_and_si256(x, nibble);
    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(x), nibble);
    let ones = _mm256_set1_epi16(1);
    let [a, b, c, e] = q.map(|(even, odd)| {
        let pairs = _mm256_add_epi16(_mm256_maddubs_epi16(even, lo), _mm256_maddubs_epi16(odd, hi));
        _mm256_madd_epi16(pairs, ones)
    });
    // Per 128-bit lane: [Σa, Σb, Σc, Σe] of that lane's four words each; then both lanes.
    let s = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, e));
    let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
    bytemuck::cast(s)
}

/// See `weigh_value_planes`: per eight rows and 32 channels, the three planes loaded
/// once; each row's codes made in registers (bit `r` of every byte to bit 0 by a 16-bit
/// shift and a byte mask, then `b0 + 2·b1 + 4·b2` by byte adds); each row pair
/// interleaved so `vpmaddubsw` multiplies a channel's two codes (≤ 7) by the rows' two
/// probability codes (≤ 127) for each head: pair sums ≤ 1,778, summed in 16 bits over up
/// to 64 rows (≤ 56,896, unsigned) and then widened to 32. Up to eight heads per pass.
#[target_feature(enable = "avx2")]
pub(super) fn weigh_value_planes(planes: &[u8], d: usize, p: &[u8], dot: &mut [u32]) {
    let rows = planes.len() / (3 * d) * 8;
    let heads = p.len() / rows;
    let one = _mm256_set1_epi8(1);
    let zero = _mm256_setzero_si256();
    for h0 in (0..heads).step_by(8) {
        let hn = (heads - h0).min(8);
        for c0 in (0..d).step_by(32) {
            let mut acc = [[zero; 4]; 8];
            let (mut lo, mut hi) = ([zero; 8], [zero; 8]);
            for (i, group) in planes.chunks_exact(3 * d).enumerate() {
                let load = |b: usize| -> __m256i { bytemuck::pod_read_unaligned(&group[b * d + c0..b * d + c0 + 32]) };
                let (p0, p1, p2) = (load(0), load(1), load(2));
                let code = |r: i32| {
                    let n = _mm_cvtsi32_si128(r);
                    let bit = |x: __m256i| _mm256_and_si256(_mm256_srl_epi16(x, n), one);
                    let (b0, b1, b2) = (bit(p0), bit(p1), bit(p2));
                    let b2 = _mm256_add_epi8(b2, b2);
                    _mm256_add_epi8(b0, _mm256_add_epi8(_mm256_add_epi8(b1, b1), _mm256_add_epi8(b2, b2)))
                };
                for r in (0..8).step_by(2) {
                    let (a, b) = (code(r as i32), code(r as i32 + 1));
                    let (ul, uh) = (_mm256_unpacklo_epi8(a, b), _mm256_unpackhi_epi8(a, b));
                    for h in 0..hn {
                        let ph = &p[(h0 + h) * rows + 8 * i + r..(h0 + h) * rows + 8 * i + r + 2];
                        let w = _mm256_set1_epi16((i16::from(ph[1] as i8) << 8) | i16::from(ph[0]));
                        lo[h] = _mm256_add_epi16(lo[h], _mm256_maddubs_epi16(ul, w));
                        hi[h] = _mm256_add_epi16(hi[h], _mm256_maddubs_epi16(uh, w));
                    }
                }
                // Widened every 64 rows (and at the end): 64 rows sum to ≤ 56,896, which
                // 16 bits hold unsigned. lo: channels 0..8 | 16..24, hi: 8..16 | 24..32
                // (unpack works per lane).
                if i % 8 == 7 || i + 1 == rows / 8 {
                    for h in 0..hn {
                        let a = &mut acc[h];
                        let wide = |x: __m128i| _mm256_cvtepu16_epi32(x);
                        a[0] = _mm256_add_epi32(a[0], wide(_mm256_castsi256_si128(lo[h])));
                        a[1] = _mm256_add_epi32(a[1], wide(_mm256_castsi256_si128(hi[h])));
                        a[2] = _mm256_add_epi32(a[2], wide(_mm256_extracti128_si256::<1>(lo[h])));
                        a[3] = _mm256_add_epi32(a[3], wide(_mm256_extracti128_si256::<1>(hi[h])));
                        (lo[h], hi[h]) = (zero, zero);
                    }
                }
            }
            for (h, a) in acc.iter().enumerate().take(hn) {
                for (k, v) in a.iter().enumerate() {
                    let lanes: [u32; 8] = bytemuck::cast(*v);
                    let at = (h0 + h) * d + c0 + 8 * k;
                    dot[at..at + 8].copy_from_slice(&lanes);
                }
            }
        }
    }
}
