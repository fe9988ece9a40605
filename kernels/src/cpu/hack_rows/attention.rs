//! Attention over 2-bit rows ([`HackView::attend`]): the queries quantized to 8 bits once
//! per step, then per value block the homomorphic scores of the selected rows, their
//! probabilities quantized to 7 bits from zero, and the integer products of those with the
//! value codes of the quads that carry weight. The inner loops run in AVX2 or AVX-512
//! (`hack_avx2.rs`, `hack_avx512.rs`) where they apply, else in the scalar code here.

use super::{HackArrays, HackRows, HackScratch, HackView, P_LEVELS};
use crate::cpu::hack::{quantize8_partition, HackParams};
#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
use crate::cpu::hack_avx2;
#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
use crate::cpu::hack_avx512;
use crate::cpu::partial::Partial;
use crate::cpu::{prefetch, simd};
use crate::error::{Error, Result};
use half::f16;
use half::slice::HalfFloatSliceExt;
use std::ops::Range;

/// Blocks whose largest probability is below `e^NEGLIGIBLE_GAP` of the running maximum are
/// left out of attention: 64 rows of them add less than 2^-85 to a sum of at least 1.
const NEGLIGIBLE_GAP: f32 = -64.0;

impl HackScratch {
    /// Quantizes the `g` query heads of `q` (`g × head_dim`) for rows of `head_dim` values
    /// and partition `params` ([`HackView::quantize_queries`] without a view): a scratch
    /// primed so and then cloned into each task of a step quantizes nothing again.
    pub fn quantize(&mut self, q: &[f32], g: usize, head_dim: usize, params: HackParams) -> Result<()> {
        if q.len() != g * head_dim {
            return Err(Error::ShapeMismatch { what: "queries", expected: g * head_dim, got: q.len() });
        }
        if g == 0 {
            return Ok(());
        }
        HackView::new(head_dim, params, 0, HackArrays::EMPTY)?.quantize_queries(q, g, self);
        Ok(())
    }
}

impl HackRows {
    /// Folds the rows of `ranges` into the partials of the `parts.len()` query heads of `q`
    /// ([`HackView::attend`] over all rows).
    pub fn attend(&self, q: &[f32], scale: f32, ranges: &[Range<usize>], parts: &mut [Partial], s: &mut HackScratch) {
        self.view().attend(q, scale, ranges, parts, s);
    }
}

impl<'a> HackView<'a> {
    /// Folds the rows of `ranges` (any order, not overlapping) into the partials of the
    /// `parts.len()` query heads whose vectors are the rows of `q`, by homomorphic products
    /// (8-bit queries and probabilities against the 2-bit codes). `scale` multiplies every
    /// score (normally `1/√d`).
    pub fn attend(&self, q: &[f32], scale: f32, ranges: &[Range<usize>], parts: &mut [Partial], s: &mut HackScratch) {
        if parts.is_empty() || ranges.iter().all(|r| r.is_empty()) {
            return;
        }
        debug_assert_eq!(q.len(), parts.len() * self.d);
        self.quantize_queries(q, parts.len(), s);
        self.attend_quantized(scale, ranges, parts, s);
    }

    /// [`HackView::attend`] with the queries already quantized into `s` by
    /// [`HackView::quantize_queries`] (of any view with the same head dimension and Π):
    /// rows homed in pieces (one value block each) quantize the step's queries once.
    pub fn attend_quantized(&self, scale: f32, ranges: &[Range<usize>], parts: &mut [Partial], s: &mut HackScratch) {
        let (g, p) = (parts.len(), self.params.partition);
        if g == 0 || ranges.iter().all(|r| r.is_empty()) {
            return;
        }
        debug_assert_eq!(s.quantized_for.0, g, "queries quantized for another head count");
        let mut sorted: Vec<Range<usize>> = ranges.iter().filter(|r| !r.is_empty()).cloned().collect();
        sorted.sort_unstable_by_key(|r| r.start);
        let mut i = 0;
        while i < sorted.len() {
            // Every selected row of one value block, in order.
            let block = sorted[i].start / p;
            let (lo, hi) = (block * p, ((block + 1) * p).min(self.rows));
            s.rows.clear();
            while i < sorted.len() && sorted[i].start < hi {
                let r = &sorted[i];
                s.rows.extend((r.start.max(lo)..r.end.min(hi)).map(|x| (x - lo) as u32));
                if r.end > hi {
                    sorted[i].start = hi;
                    break;
                }
                i += 1;
            }
            if let Some(next) = sorted.get(i) {
                self.prefetch_block(next.start / p);
            }
            self.attend_block(block, g, scale, parts, s);
        }
    }

    /// With per-channel keys, the step's queries for value block `block`: per head the
    /// offset `q·m` and the queries scaled by the block's ranges, quantized to 8 bits.
    fn channel_queries(&self, block: usize, g: usize, s: &mut HackScratch) {
        let d = self.d;
        let meta = block * d..(block + 1) * d;
        s.channel.resize(2 * d, 0.0);
        let (min, range) = s.channel.split_at_mut(d);
        self.a.key_channel_min[meta.clone()].convert_to_f32_slice(min);
        self.a.key_channel_range[meta].convert_to_f32_slice(range);
        s.offsets.clear();
        s.scaled.resize(g * d, 0.0);
        // The step's queries, as `quantize_queries` kept them.
        let raw: &[f32] = bytemuck::cast_slice(&s.quantized_from);
        for (qh, out) in raw.chunks_exact(d).zip(s.scaled.chunks_exact_mut(d)) {
            // Eight lanes of q·m (vectorized), then their sum.
            let mut lanes = [0.0f32; 8];
            for (i, (&q, &m)) in qh.iter().zip(min.iter()).enumerate() {
                lanes[i % 8] += q * m;
            }
            s.offsets.push(lanes.iter().sum());
            out.iter_mut().zip(qh).zip(range.iter()).for_each(|((o, &q), &r)| *o = q * r);
        }
        let scaled = std::mem::take(&mut s.scaled);
        self.quantize_into(&scaled, g, s);
        s.scaled = scaled;
    }

    /// Quantizes the `g` query heads of `q` to 8 bits per key partition (codes, minimum,
    /// scale and code sum) into `s`, for [`HackView::attend_quantized`]. With per-channel
    /// keys the queries are only kept (their bits): each value block scales and quantizes
    /// them anew.
    pub fn quantize_queries(&self, q: &[f32], g: usize, s: &mut HackScratch) {
        let d = self.d;
        let per_channel = self.params.per_channel();
        let key = (g, d, self.params.partition, per_channel);
        let bits: &[u32] = bytemuck::cast_slice(q);
        if s.quantized_for == key && s.quantized_from == bits {
            return; // quantized already (the same queries, bit for bit)
        }
        s.quantized_from.clear();
        if !per_channel {
            self.quantize_into(q, g, s);
        }
        s.quantized_for = key;
        s.quantized_from.extend_from_slice(bits);
    }

    /// The quantization of [`HackView::quantize_queries`], into `s.q8`….
    fn quantize_into(&self, q: &[f32], g: usize, s: &mut HackScratch) {
        let d = self.d;
        s.q8.clear();
        s.q_min.clear();
        s.q_scale.clear();
        s.q_sum.clear();
        for qh in q.chunks_exact(d) {
            // Partitions restart at every head.
            for part in qh.chunks(self.params.partition) {
                let (min, scale, sum) = quantize8_partition(part, &mut s.q8);
                s.q_min.push(min);
                s.q_scale.push(scale);
                s.q_sum.push(sum as f32);
            }
        }
        debug_assert_eq!((s.q8.len(), s.q_min.len()), (g * d, g * self.k_parts));
        #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
        if self.fast_scores() {
            self.pair_queries(g, s);
        }
    }

    /// The per-pair query vectors of the AVX2 score kernel (see `hack_avx2::block_scores`).
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    fn pair_queries(&self, g: usize, s: &mut HackScratch) {
        let (d, kp) = (self.d, self.k_parts);
        // Partition pairs (one row of one partition pairs it with itself).
        let types = (0..kp.div_ceil(2)).map(|m| if kp == 1 { (0, 0) } else { (2 * m, 2 * m + 1) });
        s.pairs.clear();
        for hg in 0..g.div_ceil(4) {
            for (k0, k1) in types.clone() {
                let mut pq = hack_avx2::PairQuery { codes: [[[0; 32]; 4]; 4], sq: [0.0; 8], mq: [0.0; 8], c: [0.0; 8] };
                for h in 0..4 {
                    let head = hg * 4 + h;
                    if head >= g {
                        continue;
                    }
                    for (lane, k) in [(0, k0), (1, k1)] {
                        // A 16 × 4 byte transpose: word b holds dims 4b..4b+4, byte sh of
                        // it goes to row sh (the signed query: codes less 128).
                        let part = &s.q8[head * d + k * 64..head * d + (k + 1) * 64];
                        for (b, w) in part.chunks_exact(4).enumerate() {
                            let w = u32::from_le_bytes([w[0], w[1], w[2], w[3]]) ^ 0x8080_8080;
                            for (sh, codes) in pq.codes[h].iter_mut().enumerate() {
                                codes[lane * 16 + b] = (w >> (8 * sh)) as u8;
                            }
                        }
                        let at = head * kp + k;
                        pq.sq[lane * 4 + h] = s.q_scale[at];
                        pq.mq[lane * 4 + h] = s.q_min[at] + 128.0 * s.q_scale[at];
                        pq.c[lane * 4 + h] = s.q_scale[at] * s.q_sum[at] + 64.0 * s.q_min[at];
                    }
                }
                s.pairs.push(pq);
            }
        }
    }

    /// True when the AVX2 score kernel applies: Π = 64, whole partitions, and one or an
    /// even number of them per row.
    #[cfg_attr(
        not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c")),
        allow(dead_code)
    )]
    fn fast_scores(&self) -> bool {
        cfg!(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))
            && self.params.partition == 64
            && self.d.is_multiple_of(64)
            && (self.k_parts == 1 || self.k_parts.is_multiple_of(2))
    }

    /// True when the AVX2 value kernel applies: blocks of at most 64 rows (16-bit sums
    /// cannot overflow) and 32-channel groups.
    fn fast_values(&self) -> bool {
        cfg!(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))
            && self.params.partition <= 64
            && self.d.is_multiple_of(32)
    }

    /// Asks for the codes and metadata of value block `block` ahead of its turn: attention
    /// over a block takes a couple of microseconds, time for the lines to arrive. The
    /// hardware prefetchers restart at every 4 KiB page of each of the seven arrays, and
    /// the metadata arrays advance only 256 bytes a block (on the GPU machine's 16-core
    /// host, exact plans over 128K cold rows: 3.4 ms with this against 3.9–4.2 ms without).
    fn prefetch_block(&self, block: usize) {
        let (d, p, kp) = (self.d, self.params.partition, self.k_parts);
        let rows = block * p..((block + 1) * p).min(self.rows);
        let a = &self.a;
        prefetch::prefetch(&a.key_codes[rows.start * d / 4..rows.end * d / 4]);
        prefetch::prefetch(&a.value_codes[block * p / 4 * d..((block + 1) * p / 4 * d).min(a.value_codes.len())]);
        let meta = rows.start * kp..rows.end * kp;
        prefetch::prefetch(&a.key_scale[meta.clone()]);
        prefetch::prefetch(&a.key_min[meta.clone()]);
        prefetch::prefetch(&a.key_sum[meta]);
    }

    /// Attention over the selected rows `s.rows` (offsets inside value block `block`).
    fn attend_block(&self, block: usize, g: usize, scale: f32, parts: &mut [Partial], s: &mut HackScratch) {
        let (d, p) = (self.d, self.params.partition);
        let n = s.rows.len();
        s.scores.resize(g * n, 0.0);
        if self.params.per_channel() {
            self.channel_queries(block, g, s);
            self.block_scores(block, g, scale, s);
            for (sc, &o) in s.scores.chunks_exact_mut(n).zip(&s.offsets) {
                sc.iter_mut().for_each(|x| *x += o * scale);
            }
        } else {
            self.block_scores(block, g, scale, s);
        }
        // Probabilities relative to each head's running maximum, quantized from zero.
        s.weights.resize(g * p, 0);
        let first_row = s.rows.first().map_or(0, |&t| t as usize);
        let contiguous = s.rows.last().is_some_and(|&t| t as usize + 1 == first_row + n);
        s.p_scale.resize(g, 0.0);
        s.p_sum.resize(g, 0.0);
        for (h, part) in parts.iter_mut().enumerate() {
            let sc = &s.scores[h * n..(h + 1) * n];
            let block_max = simd::max_of(sc);
            part.rescale_to(part.m.max(block_max));
            // The largest probability is exp(block max − m): exp is monotonic. A block whose
            // largest is below e^-64 cannot change the f32 sums and is left out, which also
            // keeps subnormal steps (slow on x86) out of the products.
            let gap = block_max - part.m;
            let step = if gap >= NEGLIGIBLE_GAP { gap.exp() / P_LEVELS } else { 0.0 };
            let w = &mut s.weights[h * p..(h + 1) * p];
            let mut sum = 0u32;
            if step > 0.0 {
                let inv = 1.0 / step;
                if contiguous {
                    // Quantized in place; only the rows outside the run are cleared.
                    w[..first_row].fill(0);
                    w[first_row + n..].fill(0);
                    sum = quantize_probs(sc, part.m, inv, &mut w[first_row..first_row + n]);
                } else {
                    w.fill(0);
                    s.codes.resize(n, 0);
                    sum = quantize_probs(sc, part.m, inv, &mut s.codes);
                    s.rows.iter().zip(&s.codes).for_each(|(&t, &c)| w[t as usize] = c);
                }
            } else {
                w.fill(0);
            }
            part.l += step * sum as f32;
            s.p_scale[h] = step;
            s.p_sum[h] = sum as f32;
        }
        // Values: integer products of the weights with the codes of the selected rows' quads.
        // Rows whose probability rounds to zero contribute nothing: only quads with a
        // nonzero weight for some head are read (with peaked attention, most are not).
        live_quads(&s.weights, p, &mut s.live);
        s.quads.clear();
        if contiguous {
            s.quads.extend((first_row / 4..(first_row + n).div_ceil(4)).filter(|&q| s.live[q]).map(|q| q as u16));
        } else {
            for &t in &s.rows {
                let q = (t / 4) as u16;
                if s.quads.last() != Some(&q) && s.live[q as usize] {
                    s.quads.push(q);
                }
            }
        }
        let quads = &self.a.value_codes[block * p / 4 * d..(block + 1) * p / 4 * d];
        let (sv, mv) = (&self.a.value_scale[block * d..(block + 1) * d], &self.a.value_min[block * d..(block + 1) * d]);
        if self.fast_values() {
            values_simd(quads, d, &s.quads, &s.weights, p, (sv, mv), (&s.p_scale, &s.p_sum), parts);
            return;
        }
        s.acc.resize(g * d, 0);
        values_scalar(quads, d, &s.quads, &s.weights, p, &mut s.acc, &mut s.codes);
        s.column.resize(2 * d, 0.0);
        let (svf, mvf) = s.column.split_at_mut(d);
        sv.convert_to_f32_slice(svf);
        mv.convert_to_f32_slice(mvf);
        for (h, part) in parts.iter_mut().enumerate() {
            let (sp, ps) = (s.p_scale[h], s.p_sum[h]);
            if ps == 0.0 {
                continue;
            }
            let acc = &s.acc[h * d..(h + 1) * d];
            for (((o, &a), &sv), &mv) in part.o.iter_mut().zip(acc).zip(svf.iter()).zip(mvf.iter()) {
                *o += sp * (sv * a as f32 + mv * ps);
            }
        }
    }

    /// Scaled scores of the selected rows of `block`: `s.scores[h·n + i]`.
    fn block_scores(&self, block: usize, g: usize, scale: f32, s: &mut HackScratch) {
        let (d, p, kp) = (self.d, self.params.partition, self.k_parts);
        let n = s.rows.len();
        let first = block * p;
        #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
        if self.fast_scores() {
            let a = &self.a;
            let keys = hack_avx2::KeyData {
                codes: a.key_codes,
                sk: a.key_scale,
                mk: a.key_min,
                ks: a.key_sum,
                d,
                kp,
                first_row: first,
            };
            scores_simd(&keys, &s.rows, &s.pairs, g, scale, &mut s.scores);
            return;
        }
        s.keys.resize(d, 0);
        for (i, &t) in s.rows.iter().enumerate() {
            let r = first + t as usize;
            for (j, k) in s.keys.iter_mut().enumerate() {
                *k = (self.a.key_codes[r * d / 4 + j / 4] >> (2 * (j % 4))) & 3;
            }
            for h in 0..g {
                let mut score = 0.0f32;
                for k in 0..kp {
                    let dims = k * p..((k + 1) * p).min(d);
                    let qk = int_dot(&s.q8[h * d + dims.start..h * d + dims.end], &s.keys[dims.clone()]);
                    let at = r * kp + k;
                    let (sk, mk, ks) =
                        (self.a.key_scale[at].to_f32(), self.a.key_min[at].to_f32(), f32::from(self.a.key_sum[at]));
                    let (sq, mq, qs) = (s.q_scale[h * kp + k], s.q_min[h * kp + k], s.q_sum[h * kp + k]);
                    score += sq * sk * qk as f32 + sq * mk * qs + mq * sk * ks + dims.len() as f32 * mq * mk;
                }
                s.scores[h * n + i] = score * scale;
            }
        }
    }
}

/// The SIMD score kernel: AVX-512 (`hack_avx512.rs`) where the CPU has it and rows hold an
/// even number of partitions, else AVX2 (`hack_avx2.rs`).
#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
#[allow(unsafe_code, reason = "the one call into a #[target_feature] kernel")]
fn scores_simd(
    keys: &hack_avx2::KeyData<'_>,
    rows: &[u32],
    pairs: &[hack_avx2::PairQuery],
    g: usize,
    scale: f32,
    out: &mut [f32],
) {
    if keys.kp.is_multiple_of(2) && hack_avx512::available() {
        // SAFETY: `available` checked that this CPU has AVX-512 F, BW and VNNI (which imply
        // the AVX2, FMA and F16C the kernel also enables).
        return unsafe { hack_avx512::block_scores(keys, rows, pairs, g, scale, out) };
    }
    // SAFETY: this function exists only when the build enables avx2, fma and f16c for the whole
    // program (cfg above), so every CPU that runs the binary has them.
    unsafe { hack_avx2::block_scores(keys, rows, pairs, g, scale, out) }
}

/// The SIMD value kernel, four heads at a time: AVX-512 where the CPU has it, else AVX2.
#[allow(unsafe_code, reason = "the one call into a #[target_feature] kernel")]
#[allow(clippy::too_many_arguments)]
fn values_simd(
    quads: &[u8],
    d: usize,
    active: &[u16],
    w: &[u8],
    stride: usize,
    meta: (&[f16], &[f16]),
    (sp, ps): (&[f32], &[f32]),
    parts: &mut [Partial],
) {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    for (i, parts) in parts.chunks_mut(4).enumerate() {
        let (w, heads) = (&w[4 * i * stride..], 4 * i..4 * i + parts.len());
        let p = (&sp[heads.clone()], &ps[heads]);
        // The kernel for this group's head count (1 to 4).
        macro_rules! by_heads {
            ($($kernel:ident)::+) => {
                match parts.len() {
                    1 => $($kernel)::+::<1>(quads, d, active, w, stride, meta, p, parts),
                    2 => $($kernel)::+::<2>(quads, d, active, w, stride, meta, p, parts),
                    3 => $($kernel)::+::<3>(quads, d, active, w, stride, meta, p, parts),
                    _ => $($kernel)::+::<4>(quads, d, active, w, stride, meta, p, parts),
                }
            };
        }
        if hack_avx512::available() {
            // SAFETY: `available` checked that this CPU has AVX-512 F, BW, VNNI, VBMI and GFNI
            // (which imply the AVX2, FMA and F16C the kernel also enables).
            unsafe { by_heads!(hack_avx512::block_values) }
        } else {
            // SAFETY: compiled only when the build enables avx2, fma and f16c for the whole
            // program (cfg above), so every CPU that runs the binary has them.
            unsafe { by_heads!(hack_avx2::block_values) }
        }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c")))]
    let _ = (quads, d, active, w, stride, meta, sp, ps, parts);
}

/// Per quad of a block, whether any head gives one of its four rows a nonzero weight (`w`
/// holds each head's `stride` weights; Π, a multiple of 16, may exceed 64 on the scalar path).
fn live_quads(w: &[u8], stride: usize, live: &mut Vec<bool>) {
    live.clear();
    live.resize(stride / 4, false);
    for wh in w.chunks_exact(stride) {
        for (l, c) in live.iter_mut().zip(wh.chunks_exact(4)) {
            *l |= c != [0; 4];
        }
    }
}

/// `acc[h·d + c] = Σ_t w[h][t]·code(t, c)` over the rows of the quads `active`.
fn values_scalar(
    quads: &[u8],
    d: usize,
    active: &[u16],
    w: &[u8],
    stride: usize,
    acc: &mut [i32],
    codes: &mut Vec<u8>,
) {
    acc.iter_mut().for_each(|a| *a = 0);
    codes.resize(d, 0);
    for &qi in active {
        let qi = qi as usize;
        for r in 0..4 {
            for (c, &b) in codes.iter_mut().zip(&quads[qi * d..(qi + 1) * d]) {
                *c = (b >> (2 * r)) & 3;
            }
            for (h, wh) in w.chunks_exact(stride).enumerate() {
                let x = i32::from(wh[qi * 4 + r]);
                if x != 0 {
                    for (a, &c) in acc[h * d..(h + 1) * d].iter_mut().zip(codes.iter()) {
                        *a += x * i32::from(c);
                    }
                }
            }
        }
    }
}

/// The 7-bit probabilities of the scores `x` relative to the running maximum `m`, in steps
/// of `1/inv`: `codes[i] = round(exp(x[i] − m)·inv)`, at most 127. Returns their sum.
pub(super) fn quantize_probs(x: &[f32], m: f32, inv: f32, codes: &mut [u8]) -> u32 {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    if hack_avx512::available() {
        #[allow(unsafe_code, reason = "the call into the AVX-512 kernel")]
        // SAFETY: `available` checked that this CPU has AVX-512 F.
        return unsafe { hack_avx512::quantize_probs(x, m, inv, codes) };
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    #[allow(unsafe_code, reason = "the one call into a #[target_feature] kernel")]
    // SAFETY: compiled only when the build enables avx2 and fma for the whole program (cfg
    // above), so every CPU that runs the binary has them.
    return unsafe { hack_avx2::quantize_probs(x, m, inv, codes) };
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma")))]
    quantize_probs_portable(x, m, inv, codes)
}

/// [`quantize_probs`] on `wide`'s eight lanes (targets without AVX2), sixteen at a time (two
/// 8-lane vectors narrowed to 16 bytes by saturating packs).
#[cfg_attr(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"), allow(dead_code))]
fn quantize_probs_portable(x: &[f32], m: f32, inv: f32, codes: &mut [u8]) -> u32 {
    use wide::{f32x8, i16x8, i32x8, i8x16};
    let (mv, iv, half, top) = (f32x8::splat(m), f32x8::splat(inv), f32x8::splat(0.5), f32x8::splat(P_LEVELS));
    // p ≥ 0: adding ½ and truncating rounds to nearest.
    let quantize = |c: &[f32]| {
        let p = (f32x8::from(<[f32; 8]>::try_from(c).unwrap_or_default()) - mv).exp();
        (p * iv + half).min(top).trunc_int()
    };
    let mut sum = i32x8::ZERO;
    let (mut xs, mut cs) = (x.chunks_exact(16), codes.chunks_exact_mut(16));
    for (c, out) in (&mut xs).zip(&mut cs) {
        let (lo, hi) = (quantize(&c[..8]), quantize(&c[8..]));
        sum += lo + hi;
        let halves = [i16x8::from_i32x8_saturate(lo), i16x8::from_i32x8_saturate(hi)];
        let bytes = i8x16::from_i16x16_saturate(bytemuck::cast(halves));
        out.copy_from_slice(&bytemuck::cast::<i8x16, [u8; 16]>(bytes));
    }
    let mut total: u32 = sum.to_array().iter().map(|&v| v as u32).sum();
    for (o, &v) in cs.into_remainder().iter_mut().zip(xs.remainder()) {
        *o = ((v - m).exp() * inv + 0.5).min(P_LEVELS) as u8;
        total += u32::from(*o);
    }
    total
}

/// `Σ a[j]·b[j]` of 8-bit query codes and 2-bit key codes (each product ≤ 765, so a
/// partition of up to 85 values fits 16 bits; wider partitions sum in 32).
#[inline]
fn int_dot(a: &[u8], b: &[u8]) -> u32 {
    a.iter().zip(b).map(|(&x, &y)| u32::from(x) * u32::from(y)).sum()
}
