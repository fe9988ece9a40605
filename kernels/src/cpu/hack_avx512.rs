//! AVX-512 inner loops of [`super::hack_rows`], chosen at run time ([`available`]) on CPUs
//! with AVX-512 F/BW, VNNI, VBMI and GFNI (Ice Lake and Sapphire Rapids Xeons, Zen 4): the same
//! products as `hack_avx2.rs`, but `vpdpbusd` multiplies 64 code–operand byte pairs and adds
//! them, in fours, to 32-bit sums in one instruction, where AVX2 needs a `vpmaddubsw` of 32
//! pairs and an add.
//!
//! - **Scores.** A 64-byte vector holds two rows' pair of key partitions:
//!   `[row a, part 2m | row a, part 2m+1 | row b, part 2m | row b, part 2m+1]`, one
//!   partition per 128-bit lane. Four `vpdpbusd` per head (one per 2-bit field) leave four
//!   32-bit sums per lane; a 4×4 transpose-and-add gives `[h0 h1 h2 h3]` per (row,
//!   partition), and the correction terms run on sixteen lanes at once.
//! - **Values.** A token quad's byte `c` holds channel `c` of four rows; widened to one
//!   32-bit lane per channel, `vpmultishiftqb` copies its four 2-bit fields into the lane's
//!   four bytes, so one `vpdpbusd` against the broadcast weights `[w0 w1 w2 w3]` adds the
//!   quad's four rows to sixteen channels' sums. The sums are 32-bit: no bound on rows.
//!
//! The workspace targets x86-64-v3, so these functions are `#[target_feature]` and called
//! only after [`available`] says the CPU has the features (the `unsafe` calls live in
//! `hack_rows.rs`). Tests compare them with the AVX2 kernels; they skip, printing why, on a
//! CPU without AVX-512.

use super::hack_avx2::{load16, load32, meta4, widen_meta, KeyData, PairQuery, EXP_FLOOR, EXP_TAYLOR, LN2_PARTS};
use std::arch::x86_64::*;
use std::sync::OnceLock;

/// True when this CPU has AVX-512 F, BW, VNNI, VBMI and GFNI, so the kernels of this module run,
/// unless the environment sets `ATTNSTORE_HACK_KERNEL=avx2` (to compare the two, e.g. in
/// `probe_hack`). Read once per process.
pub(crate) fn available() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("ATTNSTORE_HACK_KERNEL").map_or(true, |v| v != "avx2") && cpu_has_avx512())
}

/// The CPU's own answer, whatever the environment says (tests of this module use it).
pub(crate) fn cpu_has_avx512() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx512vbmi")
        && is_x86_feature_detected!("gfni")
}

/// 64 bytes as a vector.
#[inline(always)]
fn load64(b: &[u8]) -> __m512i {
    bytemuck::pod_read_unaligned(&b[..64])
}

/// Two 32-byte halves (each row's pair of partitions) as one vector.
#[inline]
#[target_feature(enable = "avx512f")]
fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// `[v | v]`: a 256-bit vector in both halves.
#[inline]
#[target_feature(enable = "avx512f")]
fn twice(v: __m256i) -> __m512i {
    join(v, v)
}

/// One pair type's query for the 512-bit kernel: per head the four strided code vectors of
/// the [`PairQuery`] in both halves (`[part 2m | part 2m+1 | part 2m | part 2m+1]`), and
/// its lane constants likewise, scaled by the score scale.
struct Query512 {
    codes: [[__m512i; 4]; 4],
    /// Per lane `[h0..h3]` of its partition: `sq`, `mq + 128·sq` and `C`, times the scale.
    sq: __m512,
    mq: __m512,
    c: __m512,
}

impl Query512 {
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn new(q: &PairQuery, scale: f32) -> Self {
        let lanes = |x: &[f32; 8]| {
            let v: __m256 = bytemuck::cast(x.map(|v| v * scale));
            _mm512_castsi512_ps(twice(_mm256_castps_si256(v)))
        };
        Self {
            codes: q.codes.map(|h| h.map(|s| twice(load32(&s)))),
            sq: lanes(&q.sq),
            mq: lanes(&q.mq),
            c: lanes(&q.c),
        }
    }
}

/// The four 2-bit fields of every byte of `x`, each in the low bits of a byte.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn unpack2(x: __m512i) -> [__m512i; 4] {
    let m3 = _mm512_set1_epi8(3);
    [
        _mm512_and_si512(x, m3),
        _mm512_and_si512(_mm512_srli_epi16::<2>(x), m3),
        _mm512_and_si512(_mm512_srli_epi16::<4>(x), m3),
        _mm512_and_si512(_mm512_srli_epi16::<6>(x), m3),
    ]
}

/// Integer products of two rows' pair of partitions (`x`, see the module docs) with four
/// heads' query codes: per 128-bit lane (one row and partition) `[h0 h1 h2 h3]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn pair_products(x: __m512i, q: &[[__m512i; 4]; 4]) -> __m512i {
    let c = unpack2(x);
    let mut acc = [_mm512_setzero_si512(); 4];
    for (a, qh) in acc.iter_mut().zip(q) {
        for (&cs, &qs) in c.iter().zip(qh) {
            *a = _mm512_dpbusd_epi32(*a, cs, qs);
        }
    }
    // Per lane, heads A..D with four partial sums each: [A0+A2, B0+B2, A1+A3, B1+B3] and
    // the same for C, D; then the 64-bit halves of those add up to [A, B, C, D].
    let ab = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[0], acc[1]), _mm512_unpackhi_epi32(acc[0], acc[1]));
    let cd = _mm512_add_epi32(_mm512_unpacklo_epi32(acc[2], acc[3]), _mm512_unpackhi_epi32(acc[2], acc[3]));
    _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd))
}

/// The scores of four rows against four heads, `[h0: r0..r3 | h1 | h2 | h3]`, from the
/// rows' code vectors (`x01`: rows 0 and 1, `x23`: rows 2 and 3) and their metadata `m8`
/// (`[sk, mk, Σk]`, each `[r0p0 r0p1 r1p0 r1p1 r2p0 r2p1 r3p0 r3p1]`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn four_rows(x01: __m512i, x23: __m512i, m8: &[__m256; 3], q: &Query512) -> __m512 {
    // Metadata entry i of m8 to every lane of 128-bit lane i (of the pair's four).
    let spread = [
        _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
        _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7),
    ];
    let mut s = [_mm512_setzero_ps(); 2];
    for ((out, x), idx) in s.iter_mut().zip([x01, x23]).zip(spread) {
        let qk = _mm512_cvtepi32_ps(pair_products(x, &q.codes));
        let [sk, mk, ks] = m8.map(|v| _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(v)));
        // sk·(sq·QK + mq·Σk) + mk·(sq·Σq + Π·mq), per row and partition.
        let inner = _mm512_fmadd_ps(q.sq, qk, _mm512_mul_ps(q.mq, ks));
        *out = _mm512_fmadd_ps(sk, inner, _mm512_mul_ps(mk, q.c));
    }
    // [r0p0 r0p1 r1p0 r1p1] and [r2p0 r2p1 r3p0 r3p1] → [r0 r1 r2 r3], partitions added.
    let even = _mm512_shuffle_f32x4::<0b10_00_10_00>(s[0], s[1]);
    let odd = _mm512_shuffle_f32x4::<0b11_01_11_01>(s[0], s[1]);
    let rows = _mm512_add_ps(even, odd);
    // Rows × heads to heads × rows.
    _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), rows)
}

/// Scaled scores of the key rows `rows` (relative to `k.first_row`) against `g` heads,
/// `out[h·n + i]` for row `rows[i]`, as `hack_avx2::block_scores` computes them, for rows
/// of an even number of partitions (Π = 64, `d` a multiple of 128); `pairs` holds per group
/// of four heads `kp/2` [`PairQuery`]s.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) fn block_scores(k: &KeyData<'_>, rows: &[u32], pairs: &[PairQuery], g: usize, scale: f32, out: &mut [f32]) {
    let n = rows.len();
    let types = k.kp / 2;
    for hg in 0..g.div_ceil(4) {
        let hn = (g - hg * 4).min(4);
        let out = &mut out[hg * 4 * n..(hg * 4 + hn) * n];
        for (m, pq) in pairs[hg * types..(hg + 1) * types].iter().enumerate() {
            rows_by_four(k, rows, m, &Query512::new(pq, scale), hn, m > 0, out);
        }
    }
}

/// Pair type `m` of the scores of four heads (`hn` of them live) over `rows`, four rows at a
/// time: a run of consecutive rows of one pair type (`kp = 2`, every exact plan) reads
/// codes and metadata as fixed-size slices, other rows gather theirs row by row. `add` sums
/// into `out` (later pair types of a row).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
fn rows_by_four(k: &KeyData<'_>, rows: &[u32], m: usize, q: &Query512, hn: usize, add: bool, out: &mut [f32]) {
    let n = rows.len();
    let row_bytes = k.d / 4;
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
            let m8 = widen_meta(load16(sk), load16(mk), load16(ks));
            let v: [[f32; 4]; 4] = bytemuck::cast(four_rows(load64(c), load64(&c[64..]), &m8, q));
            for (o, v) in [&mut *o0, &mut *o1, &mut *o2, &mut *o3].into_iter().zip(v) {
                o[4 * i..4 * i + 4].copy_from_slice(&v);
            }
        }
    }
    for (i, four) in rows.chunks(4).enumerate().skip(done / 4) {
        let last = four.len() - 1;
        let r = [four[0], four[1.min(last)], four[2.min(last)], four[last]].map(|t| k.first_row + t as usize);
        let x = r.map(|r| load32(&k.codes[r * row_bytes + m * 32..]));
        let at = r.map(|r| r * k.kp + 2 * m);
        let m8 = widen_meta(meta4(skb, at), meta4(mkb, at), meta4(ksb, at));
        let v: [[f32; 4]; 4] = bytemuck::cast(four_rows(join(x[0], x[1]), join(x[2], x[3]), &m8, q));
        for (h, v) in v.iter().enumerate().take(hn) {
            for (o, &x) in out[h * n + 4 * i..h * n + 4 * i + four.len()].iter_mut().zip(v) {
                *o = if add { *o + x } else { x };
            }
        }
    }
}

/// The value side of one block folded into `H` heads' partials, as
/// `hack_avx2::block_values` computes it (same arguments): per head `h` and channel `c`,
/// `o[c] += sp_h·(sv[c]·A[h][c] + mv[c]·ps_h)` with `A` the integer products of the 7-bit
/// weights with the codes of the quads `quads`, here in 32-bit sums over sixteen channels
/// per vector (`d` a multiple of 32).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi,avx2,fma,f16c")]
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
    // Per head, the weights of each quad's four rows as one 32-bit word (row k in byte k,
    // meeting the code of row k in byte k of each channel's lane).
    let mut words = [[0i32; 16]; H];
    for (h, wh) in words.iter_mut().enumerate() {
        let rows = &w[h * stride..h * stride + stride.min(64)];
        if rows.len() == 64 {
            *wh = bytemuck::pod_read_unaligned(rows); // x86 is little-endian: byte k is row k
        } else {
            for (x, four) in wh.iter_mut().zip(rows.chunks_exact(4)) {
                *x = i32::from_le_bytes([four[0], four[1], four[2], four[3]]);
            }
        }
    }
    let (svb, mvb): (&[u8], &[u8]) = (bytemuck::cast_slice(sv), bytemuck::cast_slice(mv));
    let meta = (svb, mvb, sp, ps);
    // 64 channels a pass over the quads when `d` allows (16 sums live for four heads), else 32.
    if d.is_multiple_of(64) {
        for c0 in (0..d).step_by(64) {
            channel_pass::<H, 4>(block, d, c0, quads, &words, meta, parts);
        }
    } else {
        for c0 in (0..d).step_by(32) {
            channel_pass::<H, 2>(block, d, c0, quads, &words, meta, parts);
        }
    }
}

/// Channels `c0..c0 + 16·V` of [`block_values`]: one pass over the quads with `H × V`
/// sums of sixteen channels, then the correction into the partials.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi,avx2,fma,f16c")]
fn channel_pass<const H: usize, const V: usize>(
    block: &[u8],
    d: usize,
    c0: usize,
    quads: &[u16],
    words: &[[i32; 16]; H],
    (svb, mvb, sp, ps): (&[u8], &[u8], &[f32], &[f32]),
    parts: &mut [super::partial::Partial],
) {
    // Byte k of each 32-bit lane takes the 8 bits at offset 2k of the lane's low byte (the
    // second lane of a 64-bit word starts at bit 32); `& 3` then keeps row k's code.
    let fields = _mm512_set1_epi64(i64::from_le_bytes([0, 2, 4, 6, 32, 34, 36, 38]));
    let m3 = _mm512_set1_epi8(3);
    let mut acc = [[_mm512_setzero_si512(); V]; H];
    for &qi in quads {
        let qi = qi as usize;
        let at = qi * d + c0;
        let codes: [__m512i; V] = std::array::from_fn(|v| {
            let lanes = _mm512_cvtepu8_epi32(load16(&block[at + 16 * v..]));
            _mm512_and_si512(_mm512_multishift_epi64_epi8(fields, lanes), m3)
        });
        for (a, wh) in acc.iter_mut().zip(words) {
            let wv = _mm512_set1_epi32(wh[qi]);
            for (x, &c) in a.iter_mut().zip(&codes) {
                *x = _mm512_dpbusd_epi32(*x, c, wv);
            }
        }
    }
    for v in 0..V {
        let c = c0 + 16 * v;
        let svc = _mm512_cvtph_ps(load32(&svb[2 * c..]));
        let mvc = _mm512_cvtph_ps(load32(&mvb[2 * c..]));
        for (h, (a, part)) in acc.iter().zip(parts.iter_mut()).enumerate() {
            let a = _mm512_cvtepi32_ps(a[v]);
            let o = &mut part.o[c..c + 16];
            let prev: __m512 = bytemuck::pod_read_unaligned(bytemuck::cast_slice(o));
            // o + sp·(sv·a + mv·ps)
            let inner = _mm512_fmadd_ps(svc, a, _mm512_mul_ps(mvc, _mm512_set1_ps(ps[h])));
            let new = _mm512_fmadd_ps(_mm512_set1_ps(sp[h]), inner, prev);
            o.copy_from_slice(&bytemuck::cast::<__m512, [f32; 16]>(new));
        }
    }
}

/// `eˣ` in sixteen lanes for `x ≤ 0`, as `hack_avx2::exp8` computes it (Cody–Waite
/// reduction, Taylor polynomial of degree 7), with `2ⁿ` applied by `vscalefps`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn exp16(x: __m512) -> __m512 {
    let x = _mm512_max_ps(x, _mm512_set1_ps(EXP_FLOOR));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_PARTS[0]), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_PARTS[1]), r);
    let mut p = _mm512_set1_ps(EXP_TAYLOR[7]);
    for &k in EXP_TAYLOR[..7].iter().rev() {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(k));
    }
    _mm512_scalef_ps(p, n)
}

/// The 7-bit probabilities of the scores `x` relative to the running maximum `m`, as
/// `hack_avx2::quantize_probs` computes them (same codes), sixteen at a time. Returns their
/// sum.
#[target_feature(enable = "avx512f")]
pub(crate) fn quantize_probs(x: &[f32], m: f32, inv: f32, codes: &mut [u8]) -> u32 {
    let (mv, iv, half) = (_mm512_set1_ps(m), _mm512_set1_ps(inv), _mm512_set1_ps(0.5));
    let top = _mm512_set1_ps(super::hack_rows::P_LEVELS);
    let mut sum = _mm512_setzero_si512();
    let mut one = |v: __m512| {
        let p = exp16(_mm512_sub_ps(v, mv));
        // p ≥ 0: adding ½ and truncating rounds to nearest.
        let q = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_fmadd_ps(p, iv, half), top));
        sum = _mm512_add_epi32(sum, q);
        q
    };
    let (mut xs, mut cs) = (x.chunks_exact(16), codes.chunks_exact_mut(16));
    for (c, out) in (&mut xs).zip(&mut cs) {
        let q = one(bytemuck::pod_read_unaligned(bytemuck::cast_slice(c)));
        out.copy_from_slice(&bytemuck::cast::<__m128i, [u8; 16]>(_mm512_cvtepi32_epi8(q)));
    }
    let rest = xs.remainder();
    if !rest.is_empty() {
        let mut pad = [f32::NEG_INFINITY; 16];
        pad[..rest.len()].copy_from_slice(rest);
        let q: [i32; 16] = bytemuck::cast(one(bytemuck::cast(pad)));
        for (o, &v) in cs.into_remainder().iter_mut().zip(&q) {
            *o = v as u8;
        }
    }
    _mm512_reduce_add_epi32(sum) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::partial::Partial;
    use crate::random::SplitMix64;

    /// Whether the kernels can run here; prints why not.
    fn runnable() -> bool {
        let ok = cpu_has_avx512();
        if !ok {
            eprintln!("skipped: this CPU lacks AVX-512 F/BW/VNNI/VBMI/GFNI (the AVX-512 hack2 kernels cannot run)");
        }
        ok
    }

    fn bytes(n: usize, rng: &mut SplitMix64) -> Vec<u8> {
        (0..n).map(|_| (rng.next_u64() >> 56) as u8).collect()
    }

    fn f16s(n: usize, rng: &mut SplitMix64, lo: f32, hi: f32) -> Vec<half::f16> {
        (0..n).map(|_| half::f16::from_f32(lo + (hi - lo) * rng.uniform())).collect()
    }

    fn close(a: &[f32], b: &[f32], what: &str) {
        for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= 1e-5 * (1.0 + x.abs().max(y.abs())), "{what}[{i}]: avx512 {x} vs avx2 {y}");
        }
    }

    #[test]
    fn scores_equal_the_avx2_kernel_on_runs_and_gathered_rows() {
        if !runnable() {
            return;
        }
        let mut rng = SplitMix64::new(7);
        for (d, g) in [(128usize, 4usize), (128, 3), (256, 8), (256, 5)] {
            let (rows_total, kp) = (192, d / 64);
            let codes = bytes(rows_total * d / 4, &mut rng);
            let (sk, mk) = (f16s(rows_total * kp, &mut rng, 0.01, 0.5), f16s(rows_total * kp, &mut rng, -2.0, 0.0));
            let ks: Vec<u16> = (0..rows_total * kp).map(|i| (i * 37 % 193) as u16).collect();
            let k = KeyData { codes: &codes, sk: &sk, mk: &mk, ks: &ks, d, kp, first_row: 64 };
            let pairs: Vec<PairQuery> = (0..g.div_ceil(4) * kp / 2)
                .map(|_| PairQuery {
                    codes: [[[0; 32]; 4]; 4].map(|h| h.map(|_| bytes(32, &mut rng).try_into().unwrap_or([0; 32]))),
                    sq: [0; 8].map(|_| 0.01 + rng.uniform() * 0.02),
                    mq: [0; 8].map(|_| rng.uniform() - 0.5),
                    c: [0; 8].map(|_| rng.uniform() * 3.0),
                })
                .collect();
            let run: Vec<u32> = (0..64).collect();
            let gathered: Vec<u32> = vec![0, 3, 4, 9, 17, 18, 19, 40, 63];
            let short: Vec<u32> = (5..11).collect();
            for rows in [&run, &gathered, &short] {
                let (mut a, mut b) = (vec![0.0; g * rows.len()], vec![0.0; g * rows.len()]);
                // SAFETY: runnable() checked AVX-512 F/BW/VNNI (which imply AVX2, FMA, F16C).
                #[allow(unsafe_code, reason = "calling the #[target_feature] kernels under test")]
                unsafe {
                    block_scores(&k, rows, &pairs, g, 0.09, &mut a);
                    super::super::hack_avx2::block_scores(&k, rows, &pairs, g, 0.09, &mut b);
                }
                close(&a, &b, &format!("scores d={d} g={g} n={}", rows.len()));
            }
        }
    }

    #[test]
    fn probabilities_equal_the_avx2_kernel() {
        if !runnable() {
            return;
        }
        let x: Vec<f32> =
            (0..203).map(|i| -((i * 37 % 101) as f32) * 0.07).chain([-90.0, -1e6, f32::NEG_INFINITY]).collect();
        for n in [x.len(), 64, 16, 7] {
            let (mut a, mut b) = (vec![0u8; n], vec![0u8; n]);
            // SAFETY: runnable() checked AVX-512 F (which implies AVX2 and FMA).
            #[allow(unsafe_code, reason = "calling the #[target_feature] kernels under test")]
            let (sa, sb) = unsafe {
                (
                    quantize_probs(&x[..n], 0.0, 127.0, &mut a),
                    super::super::hack_avx2::quantize_probs(&x[..n], 0.0, 127.0, &mut b),
                )
            };
            assert_eq!((a, sa), (b, sb), "{n} scores");
        }
    }

    #[test]
    fn values_equal_the_avx2_kernel() {
        if !runnable() {
            return;
        }
        let mut rng = SplitMix64::new(8);
        let (sp, ps) = ([0.01f32, 0.02, 0.005, 0.03], [900.0f32, 1200.0, 80.0, 3000.0]);
        // d = 128 runs passes of 64 channels, d = 96 passes of 32; Π = 32 blocks hold 8 quads.
        let cases =
            [(128usize, 64usize, (0..16).collect::<Vec<u16>>()), (128, 64, vec![0, 2, 3, 9, 15])].into_iter().chain([
                (96, 64, (0..16).collect()),
                (96, 64, vec![1, 4, 15]),
                (128, 32, (0..8).collect()),
                (128, 32, vec![0, 5]),
            ]);
        for (d, p, quads) in cases {
            let w: Vec<u8> = (0..4 * p).map(|i| if i % 7 == 3 { 0 } else { (rng.next_u64() % 128) as u8 }).collect();
            let block = bytes(p / 4 * d, &mut rng);
            let (sv, mv) = (f16s(d, &mut rng, 0.01, 0.5), f16s(d, &mut rng, -2.0, 0.0));
            let start: Vec<Partial> = (0..4)
                .map(|_| {
                    let mut p = Partial::empty(d);
                    p.o.iter_mut().for_each(|o| *o = rng.uniform());
                    p
                })
                .collect();
            let (mut a, mut b) = (start.clone(), start);
            // SAFETY: runnable() checked AVX-512 F/BW/VNNI/VBMI/GFNI (which imply AVX2, FMA, F16C).
            #[allow(unsafe_code, reason = "calling the #[target_feature] kernels under test")]
            unsafe {
                block_values::<4>(&block, d, &quads, &w, p, (&sv, &mv), (&sp, &ps), &mut a);
                super::super::hack_avx2::block_values::<4>(&block, d, &quads, &w, p, (&sv, &mv), (&sp, &ps), &mut b);
            }
            for (h, (x, y)) in a.iter().zip(&b).enumerate() {
                close(&x.o, &y.o, &format!("values d={d} head {h}, {} quads", quads.len()));
            }
        }
    }
}
