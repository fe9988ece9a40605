//! HACK's 2-bit homomorphic quantization (first piece of the codec issue): asymmetric 2-bit
//! codes per partition of Π elements along the inner dimension of a product, with
//! per-partition minimum, scale and integer code sum (summation elimination), stochastic
//! rounding (seeded, unbiased), and the homomorphic product of the paper's Eq. 4 against an
//! 8-bit quantized operand — computed from integer code products and the stored sums,
//! never dequantizing the 2-bit side.
//!
//! For `A ≈ sA·Aq + mA` and `B ≈ sB·Bq + mB` on a partition of `n` elements:
//! `Σ A·B ≈ sA·sB·Σ Aq·Bq + sA·mB·Σ Aq + mA·sB·Σ Bq + n·mA·mB`.

use crate::error::{Error, Result};
use crate::random::SplitMix64;
use half::f16;

/// How the 2-bit codec lays out keys (values are always quantized per channel along blocks
/// of Π tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KeyLayout {
    /// HACK's layout: each key on its own, partitions of Π dims, stochastic rounding.
    #[default]
    PerToken,
    /// Keys normalized per channel over each block of Π tokens (the block's f16 minimum and
    /// range per channel, where outlier channels live), then the normalized rows coded per
    /// token as [`KeyLayout::PerToken`] does, with keys and values rounded to nearest.
    /// `q·k = q·m + (q∘r)·k̃`: the query is scaled by the block's ranges and quantized to
    /// 8 bits once per block, so the homomorphic product runs unchanged on the codes.
    PerChannel,
}

/// Parameters of the 2-bit codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HackParams {
    /// Partition size Π along the inner dimension (HACK uses 64); also the value block and,
    /// with [`KeyLayout::PerChannel`], the key group along the sequence.
    pub partition: usize,
    /// How keys are laid out.
    pub keys: KeyLayout,
}

impl HackParams {
    /// Π must be a positive multiple of 16 (whole 2-bit bytes and aligned int8 groups).
    pub fn new(partition: usize) -> Result<Self> {
        if partition == 0 || !partition.is_multiple_of(16) {
            return Err(Error::InvalidArgument {
                what: "partition",
                message: format!("Π must be a positive multiple of 16 (HACK uses 64), got {partition}"),
            });
        }
        Ok(Self { partition, keys: KeyLayout::PerToken })
    }

    /// The same Π with keys laid out as `keys`.
    pub fn with_keys(self, keys: KeyLayout) -> Self {
        Self { keys, ..self }
    }

    /// True for [`KeyLayout::PerChannel`].
    pub fn per_channel(self) -> bool {
        self.keys == KeyLayout::PerChannel
    }

    /// Whether codes are rounded stochastically (HACK's per-token layout) or to nearest
    /// (the per-channel layout: unbiased rounding adds noise of a good part of a step to
    /// every score, which SmolLM2's answers do not survive; `docs/codec.md`).
    pub fn stochastic(self) -> bool {
        !self.per_channel()
    }
}

impl Default for HackParams {
    fn default() -> Self {
        Self { partition: 64, keys: KeyLayout::PerToken }
    }
}

/// A vector in 2-bit codes: four codes per byte, and per partition an f16 minimum and
/// scale and the sum of its codes.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized2 {
    codes: Vec<u8>,
    mins: Vec<f16>,
    scales: Vec<f16>,
    sums: Vec<u16>,
    len: usize,
    partition: usize,
}

/// A vector in 8-bit codes (queries, softmax probabilities): per partition an f32
/// minimum and scale and the code sum. Rounded to nearest (these are not stored).
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized8 {
    pub(crate) codes: Vec<u8>,
    pub(crate) mins: Vec<f32>,
    pub(crate) scales: Vec<f32>,
    pub(crate) sums: Vec<u32>,
    len: usize,
    partition: usize,
}

fn min_max(x: &[f32]) -> (f32, f32) {
    // Eight independent lanes (the compiler vectorizes them), then the rest.
    let (mut lo, mut hi) = ([f32::INFINITY; 8], [f32::NEG_INFINITY; 8]);
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            // Comparisons, not f32::min/max (whose NaN rules keep them scalar): rows and
            // queries are finite (checked where they enter).
            lo[i] = if c[i] < lo[i] { c[i] } else { lo[i] };
            hi[i] = if c[i] > hi[i] { c[i] } else { hi[i] };
        }
    }
    let init = (lo.iter().copied().fold(f32::INFINITY, f32::min), hi.iter().copied().fold(f32::NEG_INFINITY, f32::max));
    chunks.remainder().iter().fold(init, |(lo, hi), &v| (lo.min(v), hi.max(v)))
}

/// Quantizes one partition to 2-bit codes (`codes[i]` in `0..=3`, same length as `part`)
/// with stochastic rounding: returns the f16 minimum and scale (`x ≈ scale·code + min`) and
/// the code sum. Rounding up happens with probability equal to the fraction, so the
/// expected dequantized value is `x` itself (up to the f16 metadata).
pub(crate) fn quantize_partition(part: &[f32], rng: &mut SplitMix64, codes: &mut [u8]) -> (f16, f16, u16) {
    quantize_partition_with(part, Some(rng), codes)
}

/// [`quantize_partition`], rounding stochastically with `rng` or, without one, to nearest.
pub(crate) fn quantize_partition_with(
    part: &[f32],
    mut rng: Option<&mut SplitMix64>,
    codes: &mut [u8],
) -> (f16, f16, u16) {
    debug_assert_eq!(part.len(), codes.len());
    let (lo, hi) = min_max(part);
    let min = f16::from_f32(lo);
    let scale = f16::from_f32((hi - min.to_f32()).max(0.0) / 3.0);
    let (m, s) = (min.to_f32(), scale.to_f32());
    let mut sum = 0u16;
    for (&v, code) in part.iter().zip(codes.iter_mut()) {
        *code = if s > 0.0 {
            let t = ((v - m) / s).clamp(0.0, 3.0);
            match rng.as_deref_mut() {
                Some(rng) => {
                    let floor = t.floor();
                    (floor + f32::from(rng.uniform() < t - floor)).min(3.0) as u8
                }
                None => t.round() as u8,
            }
        } else {
            0
        };
        sum += u16::from(*code);
    }
    (min, scale, sum)
}

impl Quantized2 {
    /// Quantizes `x` partition by partition with stochastic rounding drawn from `rng`
    /// (so the expected dequantized value is `x` itself, up to the f16 metadata).
    pub fn encode(x: &[f32], params: HackParams, rng: &mut SplitMix64) -> Self {
        let mut out = Self::empty(params);
        for part in x.chunks(params.partition) {
            out.push_partition(part, rng);
        }
        out
    }

    /// An empty vector.
    pub fn empty(params: HackParams) -> Self {
        Self { codes: vec![], mins: vec![], scales: vec![], sums: vec![], len: 0, partition: params.partition }
    }

    /// Appends one partition (at most Π values; only the last may be shorter).
    fn push_partition(&mut self, part: &[f32], rng: &mut SplitMix64) {
        debug_assert!(self.len.is_multiple_of(self.partition) && part.len() <= self.partition);
        let mut codes = vec![0u8; part.len()];
        let (min, scale, sum) = quantize_partition(part, rng, &mut codes);
        self.codes.resize((self.len + part.len()).div_ceil(4), 0);
        for q in codes {
            self.codes[self.len / 4] |= q << (2 * (self.len % 4));
            self.len += 1;
        }
        self.mins.push(min);
        self.scales.push(scale);
        self.sums.push(sum);
    }

    /// Elements encoded.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn code(&self, i: usize) -> u8 {
        (self.codes[i / 4] >> (2 * (i % 4))) & 3
    }

    /// The dequantized values `s·q + m` (for checks; attention never needs them).
    pub fn decode(&self) -> Vec<f32> {
        (0..self.len)
            .map(|i| {
                let k = i / self.partition;
                self.scales[k].to_f32() * f32::from(self.code(i)) + self.mins[k].to_f32()
            })
            .collect()
    }

    /// Stored bytes: codes plus per partition an f16 minimum, an f16 scale and a one-byte
    /// code sum (≤ 3·Π ≤ 255 for Π = 64; two bytes beyond).
    pub fn bytes(&self) -> usize {
        let sum_bytes = if 3 * self.partition <= 255 { 1 } else { 2 };
        self.codes.len() + self.mins.len() * (2 + 2 + sum_bytes)
    }
}

impl Quantized8 {
    /// Quantizes `x` to 8 bits per partition, rounding to nearest.
    pub fn encode(x: &[f32], params: HackParams) -> Self {
        let p = params.partition;
        let mut out = Self {
            codes: Vec::with_capacity(x.len()),
            mins: vec![],
            scales: vec![],
            sums: vec![],
            len: x.len(),
            partition: p,
        };
        for part in x.chunks(p) {
            let (lo, s, sum) = quantize8_partition(part, &mut out.codes);
            out.mins.push(lo);
            out.scales.push(s);
            out.sums.push(sum);
        }
        out
    }

    /// The dequantized values.
    pub fn decode(&self) -> Vec<f32> {
        self.codes
            .iter()
            .enumerate()
            .map(|(i, &q)| self.scales[i / self.partition] * f32::from(q) + self.mins[i / self.partition])
            .collect()
    }
}

/// Quantizes one partition to 8 bits, rounding to nearest: appends its codes to `codes` and
/// returns its minimum, scale and code sum (what [`Quantized8::encode`] stores per partition;
/// per-channel keys quantize a step's scaled queries once per value block with it, without
/// allocating).
pub(crate) fn quantize8_partition(part: &[f32], codes: &mut Vec<u8>) -> (f32, f32, u32) {
    let (lo, hi) = min_max(part);
    let s = (hi - lo).max(0.0) / 255.0;
    let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
    let at = codes.len();
    codes.resize(at + part.len(), 0);
    let mut sum = 0u32;
    // v ≥ lo: adding ½ and truncating rounds to nearest; sixteen lanes at a time.
    use wide::{f32x8, i16x8, i32x8};
    let (lov, iv, half, top) = (f32x8::splat(lo), f32x8::splat(inv), f32x8::splat(0.5), f32x8::splat(255.0));
    let eight = |c: &[f32]| {
        let x = f32x8::from(<[f32; 8]>::try_from(c).unwrap_or_default());
        ((x - lov) * iv + half).min(top).trunc_int()
    };
    let mut sums = i32x8::ZERO;
    let mut out = codes[at..].chunks_exact_mut(16);
    let mut from = part.chunks_exact(16);
    for (c, v) in (&mut out).zip(&mut from) {
        let (a, b) = (eight(&v[..8]), eight(&v[8..]));
        sums += a + b;
        // 0..=255 in i16 lanes, then wrapped to bytes (the unsigned codes' bit patterns).
        let halves: [i16; 16] = bytemuck::cast([i16x8::from_i32x8_saturate(a), i16x8::from_i32x8_saturate(b)]);
        let bytes: [u8; 16] = std::array::from_fn(|i| halves[i] as u8);
        c.copy_from_slice(&bytes);
    }
    sum += sums.to_array().iter().map(|&x| x as u32).sum::<u32>();
    // The rest (a partition shorter than Π at the end of a head: d is a multiple of 4).
    for (c, &v) in out.into_remainder().iter_mut().zip(from.remainder()) {
        *c = ((v - lo) * inv + 0.5).min(255.0) as u8;
        sum += u32::from(*c);
    }
    (lo, s, sum)
}

/// `Σ a·b` of an 8-bit and a 2-bit vector of equal length and partition, by the
/// homomorphic product: integer code products per partition plus the correction terms
/// from the stored minima, scales and code sums.
pub fn homomorphic_dot(a: &Quantized8, b: &Quantized2) -> Result<f32> {
    if a.len != b.len || a.partition != b.partition {
        return Err(Error::ShapeMismatch { what: "homomorphic product operands", expected: a.len, got: b.len });
    }
    let p = a.partition;
    let mut total = 0.0f64;
    for k in 0..a.mins.len() {
        let range = k * p..((k + 1) * p).min(a.len);
        let n = range.len() as f64;
        let qq: u32 = range.clone().map(|i| u32::from(a.codes[i]) * u32::from(b.code(i))).sum();
        let (sa, ma) = (a.scales[k] as f64, a.mins[k] as f64);
        let (sb, mb) = (b.scales[k].to_f32() as f64, b.mins[k].to_f32() as f64);
        total += sa * sb * qq as f64 + sa * mb * a.sums[k] as f64 + ma * sb * b.sums[k] as f64 + n * ma * mb;
    }
    Ok(total as f32)
}

/// One KV head stored in HACK form: each key quantized on its own (partitions along the
/// head dimension, the inner dimension of `q·k`), values quantized per channel along the
/// sequence (the inner dimension of `p·V`). The last, partial partition of values stays
/// in f16 until Π tokens have arrived, then it is quantized once (requantization
/// elimination).
#[derive(Debug, Clone)]
pub struct HackHead {
    params: HackParams,
    head_dim: usize,
    keys: Vec<Quantized2>,
    /// Per channel: the values of all full token partitions.
    values: Vec<Quantized2>,
    /// Tokens not yet in a full partition, `n × head_dim`, f16.
    tail: Vec<f16>,
    rng: SplitMix64,
    quantized_partitions: usize,
}

impl HackHead {
    /// An empty head of dimension `head_dim` (a multiple of Π's 16-alignment is not
    /// required: the last key partition may be short).
    pub fn new(head_dim: usize, params: HackParams, seed: u64) -> Self {
        Self {
            params,
            head_dim,
            keys: vec![],
            values: (0..head_dim).map(|_| Quantized2::empty(params)).collect(),
            tail: vec![],
            rng: SplitMix64::new(seed),
            quantized_partitions: 0,
        }
    }

    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.keys.len()
    }

    /// Value partitions quantized so far (each exactly once).
    pub fn quantized_value_partitions(&self) -> usize {
        self.quantized_partitions
    }

    /// Tokens whose values are still f16.
    pub fn f16_tail_tokens(&self) -> usize {
        self.tail.len() / self.head_dim
    }

    /// Appends `n` tokens: `keys` and `values` are `n × head_dim`.
    pub fn append(&mut self, keys: &[f32], values: &[f32]) -> Result<()> {
        let d = self.head_dim;
        if keys.len() != values.len() || !keys.len().is_multiple_of(d) {
            return Err(Error::ShapeMismatch {
                what: "keys/values (n × head_dim)",
                expected: keys.len() / d * d,
                got: values.len(),
            });
        }
        for (k, v) in keys.chunks_exact(d).zip(values.chunks_exact(d)) {
            self.keys.push(Quantized2::encode(k, self.params, &mut self.rng));
            self.tail.extend(v.iter().map(|&x| f16::from_f32(x)));
            if self.tail.len() == self.params.partition * d {
                let p = self.params.partition;
                for (c, channel) in self.values.iter_mut().enumerate() {
                    let column: Vec<f32> = (0..p).map(|t| self.tail[t * d + c].to_f32()).collect();
                    channel.push_partition(&column, &mut self.rng);
                    self.quantized_partitions += 1;
                }
                self.tail.clear();
            }
        }
        Ok(())
    }

    /// Attention of query `q` over the head: scores by the homomorphic product of the
    /// 8-bit query with every 2-bit key, softmax, then per channel the homomorphic product
    /// of the 8-bit probabilities with the 2-bit values, plus the f16 tail exactly.
    pub fn attend(&self, q: &[f32]) -> Result<Vec<f32>> {
        let d = self.head_dim;
        if q.len() != d {
            return Err(Error::ShapeMismatch { what: "query (head_dim)", expected: d, got: q.len() });
        }
        let scale = 1.0 / (d as f32).sqrt();
        let q8 = Quantized8::encode(q, self.params);
        let scores = self.keys.iter().map(|k| Ok(homomorphic_dot(&q8, k)? * scale)).collect::<Result<Vec<f32>>>()?;
        let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let p: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
        let l: f32 = p.iter().sum();
        let full = self.values[0].len();
        let p8 = Quantized8::encode(&p[..full], self.params);
        let mut out = vec![0.0f32; d];
        for (c, o) in out.iter_mut().enumerate() {
            let quantized = if full > 0 { homomorphic_dot(&p8, &self.values[c])? } else { 0.0 };
            let tail: f32 = p[full..].iter().enumerate().map(|(t, w)| w * self.tail[t * d + c].to_f32()).sum();
            *o = (quantized + tail) / l.max(f32::MIN_POSITIVE);
        }
        Ok(out)
    }

    /// The same attention computed by dequantizing everything first (the check of
    /// [`HackHead::attend`], with the same 8-bit query and probabilities).
    pub fn attend_dequantized(&self, q: &[f32]) -> Vec<f32> {
        let d = self.head_dim;
        let scale = 1.0 / (d as f32).sqrt();
        let q8 = Quantized8::encode(q, self.params).decode();
        let scores: Vec<f32> =
            self.keys.iter().map(|k| k.decode().iter().zip(&q8).map(|(a, b)| a * b).sum::<f32>() * scale).collect();
        let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let p: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
        let l: f32 = p.iter().sum();
        let full = self.values[0].len();
        let p8 = if full > 0 { Quantized8::encode(&p[..full], self.params).decode() } else { vec![] };
        (0..d)
            .map(|c| {
                let v = self.values[c].decode();
                let quantized: f32 = p8.iter().zip(&v).map(|(a, b)| a * b).sum();
                let tail: f32 = p[full..].iter().enumerate().map(|(t, w)| w * self.tail[t * d + c].to_f32()).sum();
                (quantized + tail) / l
            })
            .collect()
    }

    /// Stored bytes (keys, quantized values, f16 tail).
    pub fn bytes(&self) -> usize {
        self.keys.iter().chain(&self.values).map(Quantized2::bytes).sum::<usize>() + self.tail.len() * 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn randn(n: usize, seed: u64) -> Vec<f32> {
        SplitMix64::new(seed).normals(n)
    }

    #[test]
    fn homomorphic_product_equals_dequantize_then_multiply() {
        // An identity on the quantized values: only floating-point rounding may differ.
        for (len, p) in [(128, 64), (200, 64), (96, 32), (37, 16)] {
            let params = HackParams::new(p).unwrap();
            let (x, y) = (randn(len, 1), randn(len, 2));
            let a = Quantized8::encode(&x, params);
            let b = Quantized2::encode(&y, params, &mut SplitMix64::new(3));
            let want: f64 = a.decode().iter().zip(b.decode()).map(|(u, v)| *u as f64 * v as f64).sum();
            let got = homomorphic_dot(&a, &b).unwrap() as f64;
            assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()), "len={len} Π={p}: {got} vs {want}");
        }
    }

    #[test]
    fn stochastic_rounding_is_unbiased() {
        let x = randn(256, 7);
        let params = HackParams::default();
        let seeds = 4000;
        let mut mean = vec![0.0f64; x.len()];
        for s in 0..seeds {
            for (m, v) in mean.iter_mut().zip(Quantized2::encode(&x, params, &mut SplitMix64::new(s)).decode()) {
                *m += v as f64 / seeds as f64;
            }
        }
        // Averaged over 4000 seeds the error shrinks like 1/√seeds (std ≈ 0.8/63 per element)
        // while one draw is off by a good part of a step: unbiased rounding.
        let avg_bias = x.iter().zip(&mean).map(|(a, b)| (*a as f64 - b).abs()).sum::<f64>() / x.len() as f64;
        let one = Quantized2::encode(&x, params, &mut SplitMix64::new(1)).decode();
        let single = x.iter().zip(&one).map(|(a, b)| (a - b).abs() as f64).sum::<f64>() / x.len() as f64;
        assert!(avg_bias < 0.02 && avg_bias < single / 10.0, "mean error {avg_bias}, one draw {single}");
        // Deterministic rounding to nearest would keep a bias: check the test can tell.
        let nearest: Vec<f32> = x
            .chunks(64)
            .flat_map(|part| {
                let (lo, hi) = min_max(part);
                let s = (hi - lo) / 3.0;
                part.iter().map(move |v| ((v - lo) / s).round() * s + lo).collect::<Vec<_>>()
            })
            .collect();
        let nearest_bias = x.iter().zip(&nearest).map(|(a, b)| (a - b).abs() as f64).sum::<f64>() / x.len() as f64;
        assert!(nearest_bias > 3.0 * avg_bias, "round-to-nearest bias {nearest_bias} vs {avg_bias}");
    }

    #[test]
    fn two_bit_storage_is_under_a_fifth_of_f16() {
        let x = randn(128 * 64, 9);
        let q = Quantized2::encode(&x, HackParams::default(), &mut SplitMix64::new(1));
        let ratio = q.bytes() as f64 / (x.len() * 2) as f64;
        assert!(ratio <= 0.2, "{ratio}");
        assert!((ratio - 21.0 / 128.0).abs() < 1e-9, "16 code bytes + 5 metadata bytes per 64 values: {ratio}");
    }

    #[test]
    fn homomorphic_attention_equals_dequantize_then_attend_and_the_tail_stays_f16() {
        let (d, tokens) = (128, 300);
        let params = HackParams::default();
        let mut head = HackHead::new(d, params, 5);
        let (k, v) = (randn(tokens * d, 11), randn(tokens * d, 12));
        // Appended in uneven batches, as decode would.
        let mut at = 0;
        for n in [1, 63, 100, 36, 100] {
            head.append(&k[at * d..(at + n) * d], &v[at * d..(at + n) * d]).unwrap();
            at += n;
        }
        assert_eq!(head.tokens(), 300);
        assert_eq!(head.f16_tail_tokens(), 300 % 64, "the partial partition stays f16");
        assert_eq!(head.quantized_value_partitions(), 300 / 64 * d, "each full partition quantized exactly once");
        let q: Vec<f32> = randn(d, 13).iter().map(|x| x * 2.0).collect();
        let (got, want) = (head.attend(&q).unwrap(), head.attend_dequantized(&q));
        let err = got.iter().zip(&want).map(|(a, b)| (a - b).powi(2)).sum::<f32>().sqrt()
            / want.iter().map(|b| b * b).sum::<f32>().sqrt();
        assert!(err < 1e-4, "homomorphic vs dequantized: {err}");
        assert!(head.bytes() * 4 < tokens * d * 2 * 2, "under a quarter of f16 K+V");
        assert!(head.attend(&q[1..]).is_err());
        assert!(head.append(&k[..5], &v[..5]).is_err());
    }

    #[test]
    fn bad_partitions_and_mismatched_operands_are_typed_errors() {
        assert!(HackParams::new(0).is_err());
        assert!(HackParams::new(40).is_err());
        assert!(HackParams::new(48).is_ok());
        let p = HackParams::default();
        let a = Quantized8::encode(&randn(64, 1), p);
        let b = Quantized2::encode(&randn(128, 2), p, &mut SplitMix64::new(1));
        assert!(homomorphic_dot(&a, &b).is_err());
    }
}
