//! A reference for the next codec of issue 43 (`docs/codec.md`, "Round 3"): keys quantized
//! to 4 bits (or 5, [`Kv43Params::key_bits`]) **per channel** over groups of `key_group`
//! tokens (KIVI's layout, because outliers live in channels), values to 3 bits (or 4,
//! [`Kv43Params::value_bits`]) per channel over blocks of `value_block` tokens, and
//! attention computed on the codes without dequantizing:
//!
//! - a key is `k_jc = m_c + s_c·u_jc` (`u` in 0..=15, or 0..=31 with 5-bit keys; `m`, `s` per
//!   channel and key group, f16),
//!   so `q·k_j = Σ_c q_c m_c + Σ_c (q_c s_c) u_jc`: the query is scaled by the group's channel
//!   scales, quantized once per group to 8 bits per 64-dimension partition
//!   (`q_c s_c ≈ a + b·w_c`), and `Σ_c (q_c s_c) u_jc ≈ a·U_j + b·Σ_c w_c u_jc` with the
//!   stored code sums `U_j` per partition — an integer dot product per row;
//! - a value is `v_tc = m'_c + s'_c·z_tc` (`z` in 0..=7), so with each block's probabilities
//!   coded to 8 bits (`p_t ≈ step·P_t`), `Σ_t p_t v_tc = step·(m'_c Σ_t P_t + s'_c Σ_t P_t z_tc)`,
//!   again an integer product per channel.
//!
//! Plain data: the format, the encoder, the dequantizer, the homomorphic scores and decode
//! (scalar references here, and the fast path for a GQA group at once in `attention.rs`,
//! [`Kv43Rows::attend_runs`], with AVX2 kernels where the target has them), with tests that
//! the homomorphic arithmetic equals dequantize-then-multiply and the fast paths their
//! references; and
//! [`Kv43Head`], rows as they arrive (each key group encoded once, when it fills), which is
//! what a `kv43` wave segment stores per KV head (`Codec::Kv43`); plans attend any of its
//! row runs on the codes ([`Kv43Head::attend_runs`]); [`Kv43Head::arrays`] and
//! [`Kv43Head::from_arrays`] take a head apart for a disk format and check it back
//! (`arrays.rs`). The GPU decode over the same arrays is `cuda/kv43.cu` (feature `cuda`).

use half::f16;
use std::ops::Range;

use crate::cpu::partial::Partial;
use crate::error::{Error, Result};

/// Dimensions of a partition of the 8-bit query.
const PART: usize = 64;
/// Levels of a block's probabilities.
const P_LEVELS: f32 = 255.0;
/// Rows of a key tile: the key codes and code sums are laid out per 8 rows so that SIMD
/// holds one row per 32-bit lane (a tile divides every key group, a multiple of 8 rows).
const TILE: usize = 8;

/// Key bits and group sizes of the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Kv43Params {
    /// Bits per key code: 4, or 5 where a layer's keys need the extra level (it halves the
    /// key error; `docs/codec.md` session 50); a 5-bit code is the 4-bit nibble plus one
    /// bit plane per 8 rows.
    pub key_bits: u8,
    /// Bits per value code: 3, or 4 where a layer's values need the extra level (SmolLM2's
    /// layers 3–10, `docs/codec.md` session 50); one bit plane each per 8 rows.
    pub value_bits: u8,
    /// Tokens sharing each channel's key minimum and scale (a multiple of `value_block`).
    pub key_group: usize,
    /// Tokens sharing each channel's value minimum and scale (a multiple of 8).
    pub value_block: usize,
}

impl Default for Kv43Params {
    /// 4-bit keys over 128 tokens, values over 64: the study's best layout under 0.25× f16.
    fn default() -> Self {
        Self { key_bits: 4, value_bits: 3, key_group: 128, value_block: 64 }
    }
}

impl Kv43Params {
    /// Keys over groups of `key_group` tokens (a positive multiple of the 64-token value
    /// block), values over the default 64-token blocks.
    pub fn with_key_group(key_group: usize) -> Result<Self> {
        let params = Self { key_group, ..Self::default() };
        params.check_groups()?;
        Ok(params)
    }

    /// Checks the parameters for heads of dimension `d` (a positive multiple of 64).
    pub fn check(&self, d: usize) -> Result<()> {
        if d == 0 || !d.is_multiple_of(PART) {
            return Err(Error::InvalidArgument {
                what: "kv43 parameters",
                message: format!("the head dimension must be a positive multiple of {PART}, got {d}"),
            });
        }
        self.check_groups()
    }

    pub(crate) fn check_groups(&self) -> Result<()> {
        let bad = |message: String| Err(Error::InvalidArgument { what: "kv43 parameters", message });
        if !matches!(self.key_bits, 4 | 5) {
            return bad(format!("keys take 4 or 5 bits, got {}", self.key_bits));
        }
        if !matches!(self.value_bits, 3 | 4) {
            return bad(format!("values take 3 or 4 bits, got {}", self.value_bits));
        }
        if self.value_block == 0 || !self.value_block.is_multiple_of(8) {
            return bad(format!("value blocks must be a positive multiple of 8 tokens, got {}", self.value_block));
        }
        if self.key_group == 0 || !self.key_group.is_multiple_of(self.value_block) {
            return bad(format!(
                "key groups must be a positive multiple of the value block ({}), got {}",
                self.value_block, self.key_group
            ));
        }
        Ok(())
    }

    /// Bytes per token and head of dimension `d`, metadata included: 4- or 5-bit key codes,
    /// a u16 code sum per key partition, 3- or 4-bit value codes, and per channel an f16
    /// minimum and scale per key group and per value block.
    pub fn bytes_per_token(&self, d: usize) -> f64 {
        let keys = f64::from(self.key_bits) * d as f64 / 8.0;
        let codes = keys + f64::from(self.value_bits) * d as f64 / 8.0 + 2.0 * (d / PART) as f64;
        let meta = 4.0 * d as f64 / self.key_group as f64 + 4.0 * d as f64 / self.value_block as f64;
        codes + meta
    }

    /// Rows whose probabilities are coded together against their largest: 64 where value
    /// blocks are whole multiples of 64 (so 128-token value blocks halve their metadata
    /// without coarsening the probabilities), else the value block.
    pub fn probability_rows(&self) -> usize {
        if self.value_block.is_multiple_of(PART) {
            PART
        } else {
            self.value_block
        }
    }

    /// Largest value code: 7 or 15.
    fn value_levels(&self) -> f32 {
        f32::from((1u8 << self.value_bits) - 1)
    }

    /// Value bit planes per 8 rows.
    fn planes(&self) -> usize {
        usize::from(self.value_bits)
    }

    /// Largest key code: 15 or 31.
    fn key_levels(&self) -> f32 {
        f32::from((1u8 << self.key_bits) - 1)
    }

    /// True for 5-bit keys (a high-bit plane beside the nibbles).
    fn high_bit(&self) -> bool {
        self.key_bits == 5
    }
}

/// One head's rows in the layout (a whole number of key groups).
#[derive(Debug, Clone, PartialEq)]
pub struct Kv43Rows {
    d: usize,
    rows: usize,
    params: Kv43Params,
    /// Key codes, two per byte, per tile of `TILE` = 8 rows (`TILE·d/2` bytes) and in it per
    /// octet of channels `8o..8o + 8` (32 bytes): byte `4r + i` holds row `r`'s channel
    /// `8o + i` in its low nibble and `8o + 4 + i` in its high nibble (`i` in 0..4), so a
    /// 32-byte load holds eight rows' codes of eight channels, one row per 32-bit lane.
    /// The low four bits of each code with 5-bit keys.
    key_codes: Vec<u8>,
    /// With 5-bit keys, each code's fifth bit (empty with 4-bit keys): per tile of 8 rows
    /// `d` bytes, per octet of channels `o` eight (one per row `r`, byte `8o + r`), bit `i`
    /// of which is channel `8o + i`'s.
    key_high: Vec<u8>,
    /// Per key group and channel: minimum and scale.
    key_min: Vec<f16>,
    key_scale: Vec<f16>,
    /// Per row and partition: the sum of its key codes; per tile, partition-major
    /// (`d/64 × TILE`), so a partition's sums of a tile are contiguous.
    key_sums: Vec<u16>,
    /// Value codes as bit planes: per 8 rows, three (four with 4-bit values) planes of `d`
    /// bytes (byte `c` of plane `b` holds bit `b` of channel `c`'s codes of the eight rows,
    /// row `t mod 8` in bit `t mod 8`), plane-major so SIMD reads 32 channels of a plane at
    /// once: `rows/8 × value_bits × d`.
    value_planes: Vec<u8>,
    /// Per value block and channel: minimum and scale.
    value_min: Vec<f16>,
    value_scale: Vec<f16>,
}

/// Minimum and scale of `levels`-level codes over `x` (f16, as stored), and the codes.
fn quantize_run(x: impl Iterator<Item = f32>, levels: f32) -> (f16, f16, Vec<u8>) {
    let x: Vec<f32> = x.collect();
    let mut codes = vec![0; x.len()];
    let (min, scale) = quantize_into(&x, levels, &mut codes);
    (min, scale, codes)
}

/// [`quantize_run`] of a contiguous run into `codes` (no allocation): its f16 minimum and scale.
fn quantize_into(x: &[f32], levels: f32, codes: &mut [u8]) -> (f16, f16) {
    quantize_run_into::<false>(x, levels, codes)
}

/// [`quantize_into`] for a query's channels: the codes are `(x − min)·(1/step)`, a product
/// with the step's inverse instead of a quotient (a query is coded for every key group and
/// head at every step, keys once: one division per partition instead of one per channel).
fn quantize_query_into(x: &[f32], codes: &mut [u8]) -> (f16, f16) {
    quantize_run_into::<true>(x, 255.0, codes)
}

/// [`quantize_into`] (`INVERSE`: [`quantize_query_into`]).
fn quantize_run_into<const INVERSE: bool>(x: &[f32], levels: f32, codes: &mut [u8]) -> (f16, f16) {
    let (lo, hi) = min_max(x);
    let min = f16::from_f32(lo);
    let scale = f16::from_f32((hi - min.to_f32()).max(0.0) / levels);
    let (m, s) = (min.to_f32(), scale.to_f32());
    if s > 0.0 {
        code_run::<INVERSE>(x, m, if INVERSE { 1.0 / s } else { s }, levels, codes);
    } else {
        codes[..x.len()].iter_mut().for_each(|c| *c = 0);
    }
    (min, scale)
}

/// The smallest and largest of `x` (NaNs ignored, as `f32::min` and `max` do), in eight
/// lanes so the compiler can keep them in registers: the same values as one fold. The lanes
/// take `v` only where it compares below (above) them, a select that compiles to
/// `vminps` / `vmaxps` (`f32::min`'s NaN rule does not vectorize).
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut lo, mut hi) = ([f32::INFINITY; 8], [f32::NEG_INFINITY; 8]);
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for ((l, h), &v) in lo.iter_mut().zip(hi.iter_mut()).zip(c) {
            *l = if v < *l { v } else { *l };
            *h = if v > *h { v } else { *h };
        }
    }
    let rest = chunks.remainder().iter();
    let lo = lo.iter().chain(rest.clone()).fold(f32::INFINITY, |a, &v| a.min(v));
    let hi = hi.iter().chain(rest).fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    (lo, hi)
}

/// The largest of `x` (`-∞` when empty; NaNs ignored), in eight lanes as [`min_max`]: the
/// same value as `f32::max` folded one at a time, which does not vectorize and left a
/// 64-step dependency chain per head and block in `fold_block`.
fn max_of(x: &[f32]) -> f32 {
    let mut hi = [f32::NEG_INFINITY; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (h, &v) in hi.iter_mut().zip(c) {
            *h = if v > *h { v } else { *h };
        }
    }
    hi.iter().chain(chunks.remainder()).fold(f32::NEG_INFINITY, |a, &v| a.max(v))
}

/// `codes[i] = clamp(round((x[i] − min) / step), 0, levels)` (`step > 0`), or with
/// `INVERSE` `clamp(round((x[i] − min)·step), 0, levels)` (`step`: the inverse of the
/// step): with AVX2 eight at a time where the target has it, equal to [`code_run_scalar`]
/// exactly.
fn code_run<const INVERSE: bool>(x: &[f32], min: f32, step: f32, levels: f32, codes: &mut [u8]) {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    {
        #[allow(unsafe_code, reason = "the call into a #[target_feature] kernel")]
        // SAFETY: compiled only when the build enables avx2 for the whole program (cfg
        // above), so every CPU that runs the binary has it; every slice read inside is
        // bounds-checked.
        unsafe {
            avx2::code_run::<INVERSE>(x, min, step, levels, codes)
        }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2")))]
    code_run_scalar::<INVERSE>(x, min, step, levels, codes)
}

/// [`code_run`] one value at a time: the reference.
fn code_run_scalar<const INVERSE: bool>(x: &[f32], min: f32, step: f32, levels: f32, codes: &mut [u8]) {
    for (c, &v) in codes.iter_mut().zip(x) {
        let q = if INVERSE { (v - min) * step } else { (v - min) / step };
        *c = q.round().clamp(0.0, levels) as u8;
    }
}

/// The 8-bit codes of probabilities `x` (≥ 0) in steps of `step` (> 0), `min(round(x /
/// step), 127)`, into `codes`; returns their sum. With AVX2 eight at a time where the target
/// has it, equal to [`probability_codes_scalar`] exactly.
fn probability_codes(x: &[f32], step: f32, codes: &mut [u8]) -> u32 {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    {
        #[allow(unsafe_code, reason = "the call into a #[target_feature] kernel")]
        // SAFETY: compiled only when the build enables avx2 for the whole program (cfg
        // above); every slice read inside is bounds-checked.
        unsafe {
            avx2::probability_codes(x, step, codes)
        }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2")))]
    probability_codes_scalar(x, step, codes)
}

/// [`probability_codes`] one value at a time: the reference.
fn probability_codes_scalar(x: &[f32], step: f32, codes: &mut [u8]) -> u32 {
    let mut sum = 0;
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = (v / step).round().min(P_LEVELS) as u8;
        sum += u32::from(*c);
    }
    sum
}

/// Quantizes every channel of `rows` (`n × d`) over runs of `run` rows to `levels` levels,
/// pushing each run's per-channel minimum and scale (run-major) and handing each code to
/// `put(row, channel, code)`.
fn quantize_columns(
    rows: &[f32],
    d: usize,
    run: usize,
    levels: f32,
    (min, scale): (&mut Vec<f16>, &mut Vec<f16>),
    mut put: impl FnMut(usize, usize, u8),
) {
    for base in (0..rows.len() / d).step_by(run) {
        for c in 0..d {
            let (m, s, codes) = quantize_run((base..base + run).map(|j| rows[j * d + c]), levels);
            min.push(m);
            scale.push(s);
            codes.iter().enumerate().for_each(|(i, &code)| put(base + i, c, code));
        }
    }
}

impl Kv43Rows {
    /// Encodes `rows` rows of `keys` and `values` (`rows × d` each, finite) rounding to
    /// nearest. `rows` must be a positive multiple of the key group.
    pub fn encode(keys: &[f32], values: &[f32], d: usize, params: Kv43Params) -> Result<Self> {
        params.check(d)?;
        if keys.len() != values.len() || !keys.len().is_multiple_of(d) {
            return Err(Error::ShapeMismatch {
                what: "kv43 keys and values (rows × d each)",
                expected: keys.len(),
                got: values.len(),
            });
        }
        let rows = keys.len() / d;
        if rows == 0 || !rows.is_multiple_of(params.key_group) {
            return Err(Error::InvalidArgument {
                what: "kv43 rows",
                message: format!("{rows} rows are not a positive multiple of the key group ({})", params.key_group),
            });
        }
        if let Some(i) = keys.iter().chain(values).position(|x| !x.is_finite()) {
            return Err(Error::InvalidArgument { what: "kv43 rows", message: format!("element {i} is not finite") });
        }
        let mut out = Self {
            d,
            rows,
            params,
            key_codes: vec![0; rows * d / 2],
            key_high: vec![0; if params.high_bit() { rows * d / 8 } else { 0 }],
            key_min: Vec::new(),
            key_scale: Vec::new(),
            key_sums: vec![0; rows * (d / PART)],
            value_planes: vec![0; rows / 8 * d * params.planes()],
            value_min: Vec::new(),
            value_scale: Vec::new(),
        };
        let (mut kmin, mut kscale) = (Vec::new(), Vec::new());
        quantize_columns(keys, d, params.key_group, params.key_levels(), (&mut kmin, &mut kscale), |j, c, u| {
            let (at, shift) = key_code_at(d, j, c);
            out.key_codes[at] |= (u & 0xf) << shift;
            if u > 15 {
                let (at, bit) = key_high_at(d, j, c);
                out.key_high[at] |= 1 << bit;
            }
            out.key_sums[key_sum_at(d, j, c / PART)] += u16::from(u);
        });
        let (mut vmin, mut vscale) = (Vec::new(), Vec::new());
        let planes = params.planes();
        quantize_columns(values, d, params.value_block, params.value_levels(), (&mut vmin, &mut vscale), |t, c, z| {
            for bit in 0..planes {
                out.value_planes[((t / 8) * planes + bit) * d + c] |= ((z >> bit) & 1) << (t % 8);
            }
        });
        (out.key_min, out.key_scale, out.value_min, out.value_scale) = (kmin, kscale, vmin, vscale);
        Ok(out)
    }

    /// Rows encoded.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes held (codes and metadata).
    pub fn bytes(&self) -> usize {
        self.key_codes.len()
            + self.key_high.len()
            + self.value_planes.len()
            + 2 * self.key_sums.len()
            + 2 * (self.key_min.len() + self.key_scale.len() + self.value_min.len() + self.value_scale.len())
    }

    fn key_code(&self, j: usize, c: usize) -> u8 {
        key_code(&self.key_codes, &self.key_high, self.d, j, c)
    }

    /// Row `j`'s code sum over partition `k`.
    fn key_sum(&self, j: usize, k: usize) -> u16 {
        self.key_sums[key_sum_at(self.d, j, k)]
    }

    fn value_code(&self, t: usize, c: usize) -> u8 {
        let planes = self.params.planes();
        (0..planes).map(|bit| ((self.value_planes[((t / 8) * planes + bit) * self.d + c] >> (t % 8)) & 1) << bit).sum()
    }

    /// The rows the codes stand for (`rows × d` keys, then values).
    pub fn dequantize(&self) -> (Vec<f32>, Vec<f32>) {
        let (d, p) = (self.d, self.params);
        let mut keys = Vec::with_capacity(self.rows * d);
        let mut values = Vec::with_capacity(self.rows * d);
        for j in 0..self.rows {
            let (g, b) = (j / p.key_group, j / p.value_block);
            for c in 0..d {
                let (m, s) = (self.key_min[g * d + c].to_f32(), self.key_scale[g * d + c].to_f32());
                keys.push(m + s * f32::from(self.key_code(j, c)));
            }
            for c in 0..d {
                let (m, s) = (self.value_min[b * d + c].to_f32(), self.value_scale[b * d + c].to_f32());
                values.push(m + s * f32::from(self.value_code(j, c)));
            }
        }
        (keys, values)
    }

    /// Key group `g`'s channel scales and minima as f32, into `scale` and `min` (`d` each).
    fn group_channels(&self, g: usize, scale: &mut [f32], min: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        let d = self.d;
        self.key_scale[g * d..(g + 1) * d].convert_to_f32_slice(scale);
        self.key_min[g * d..(g + 1) * d].convert_to_f32_slice(min);
    }

    /// Homomorphic scores of query `q` (`d` values, times `scale`) against every row, with
    /// the multi-head path's tile kernel (one head); equal to [`Kv43Rows::scores_reference`]
    /// exactly (the integer products are exact and the float operations the same, in the
    /// same order).
    pub fn scores(&self, q: &[f32], scale: f32) -> Vec<f32> {
        let mut out = vec![0.0; self.rows];
        self.scores_heads(q, 1, scale, &mut out);
        out
    }

    /// Appends `other`'s rows (same head dimension and parameters) after these.
    fn extend(&mut self, other: Kv43Rows) {
        debug_assert!(self.d == other.d && self.params == other.params);
        self.rows += other.rows;
        self.key_codes.extend(other.key_codes);
        self.key_high.extend(other.key_high);
        self.key_min.extend(other.key_min);
        self.key_scale.extend(other.key_scale);
        self.key_sums.extend(other.key_sums);
        self.value_planes.extend(other.value_planes);
        self.value_min.extend(other.value_min);
        self.value_scale.extend(other.value_scale);
    }

    /// [`Kv43Rows::scores`] one code at a time: the reference the fast path must equal.
    pub fn scores_reference(&self, q: &[f32], scale: f32) -> Vec<f32> {
        let (d, p) = (self.d, self.params);
        let mut out = Vec::with_capacity(self.rows);
        let mut gq = GroupQuery::new(d);
        for g in 0..self.rows / p.key_group {
            self.group_channels(g, &mut gq.key_scale, &mut gq.key_min);
            gq.prepare(q);
            for j in g * p.key_group..(g + 1) * p.key_group {
                let mut s = gq.qm;
                for (k, &(a, b)) in gq.ab.iter().enumerate() {
                    let dot: u32 =
                        (k * PART..(k + 1) * PART).map(|c| u32::from(gq.w[c]) * u32::from(self.key_code(j, c))).sum();
                    s += a * f32::from(self.key_sum(j, k)) + b * dot as f32;
                }
                out.push(s * scale);
            }
        }
        out
    }

    /// Homomorphic decode attention of query `q` over every row: softmax of
    /// [`Kv43Rows::scores`], the probabilities of each block of
    /// [`Kv43Params::probability_rows`] rows coded to 8 bits, values never dequantized, one
    /// code at a time: the reference of [`Kv43Rows::attend_runs`]. Returns `d` values.
    pub fn attend(&self, q: &[f32], scale: f32) -> Vec<f32> {
        let (d, vb) = (self.d, self.params.probability_rows());
        let scores = self.scores(q, scale);
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let p: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
        let (mut out, mut total) = (vec![0.0f32; d], 0.0f32);
        let (mut codes, mut dot, mut z) = (vec![0u8; vb], vec![0u32; d], vec![0u8; vb * d]);
        for b in 0..self.rows / vb {
            let block = &p[b * vb..(b + 1) * vb];
            let step = block.iter().copied().fold(0.0f32, f32::max) / P_LEVELS;
            if step == 0.0 {
                continue;
            }
            for (c, &x) in codes.iter_mut().zip(block) {
                *c = (x / step).round().min(P_LEVELS) as u8;
            }
            let sum: u32 = codes.iter().map(|&c| u32::from(c)).sum();
            total += step * sum as f32;
            let np = self.params.planes();
            let planes = &self.value_planes[b * vb / 8 * np * d..(b + 1) * vb / 8 * np * d];
            unpack_value_codes(planes, d, np, &mut z);
            weigh_value_codes(&z, d, &codes, &mut dot);
            // The value block the probability block lies in.
            let mb = b * vb / self.params.value_block;
            for (c, o) in out.iter_mut().enumerate() {
                let (m, s) = (self.value_min[mb * d + c].to_f32(), self.value_scale[mb * d + c].to_f32());
                *o += step * (m * sum as f32 + s * dot[c] as f32);
            }
        }
        out.iter_mut().for_each(|o| *o /= total);
        out
    }
}

/// One KV head's rows as they arrive: every full key group encoded once, when it fills, and
/// never again; the rows of the partial group after it kept in f16 until it fills (as the
/// codec keeps a segment's unencoded rows) and attended exactly.
#[derive(Debug, Clone, PartialEq)]
pub struct Kv43Head {
    encoded: Option<Kv43Rows>,
    d: usize,
    params: Kv43Params,
    tail_keys: Vec<f16>,
    tail_values: Vec<f16>,
}

impl Kv43Head {
    /// An empty head of dimension `d`.
    pub fn new(d: usize, params: Kv43Params) -> Result<Self> {
        params.check(d)?;
        Ok(Self { encoded: None, d, params, tail_keys: Vec::new(), tail_values: Vec::new() })
    }

    /// Rows held (encoded and in f16).
    pub fn rows(&self) -> usize {
        self.encoded_rows() + self.tail_keys.len() / self.d
    }

    /// Rows encoded (a whole number of key groups).
    pub fn encoded_rows(&self) -> usize {
        self.encoded.as_ref().map_or(0, Kv43Rows::rows)
    }

    /// The encoded rows, if any.
    pub fn encoded(&self) -> Option<&Kv43Rows> {
        self.encoded.as_ref()
    }

    /// Bytes held: the codes and metadata, and 4 per f16 row value of the partial group.
    pub fn bytes(&self) -> usize {
        self.encoded.as_ref().map_or(0, Kv43Rows::bytes) + 2 * (self.tail_keys.len() + self.tail_values.len())
    }

    /// Appends rows (`n × d` keys and values, finite); each key group that fills is encoded.
    pub fn append(&mut self, keys: &[f32], values: &[f32]) -> Result<()> {
        let d = self.d;
        if keys.len() != values.len() || !keys.len().is_multiple_of(d) {
            return Err(Error::ShapeMismatch {
                what: "kv43 appended keys and values (n × d each)",
                expected: keys.len(),
                got: values.len(),
            });
        }
        if let Some(i) = keys.iter().chain(values).position(|x| !x.is_finite()) {
            return Err(Error::InvalidArgument { what: "kv43 rows", message: format!("element {i} is not finite") });
        }
        self.tail_keys.extend(keys.iter().map(|&x| f16::from_f32(x)));
        self.tail_values.extend(values.iter().map(|&x| f16::from_f32(x)));
        let group = self.params.key_group * d;
        while self.tail_keys.len() >= group {
            let k: Vec<f32> = self.tail_keys.drain(..group).map(f16::to_f32).collect();
            let v: Vec<f32> = self.tail_values.drain(..group).map(f16::to_f32).collect();
            let rows = Kv43Rows::encode(&k, &v, d, self.params)?;
            match &mut self.encoded {
                Some(e) => e.extend(rows),
                None => self.encoded = Some(rows),
            }
        }
        Ok(())
    }

    /// Decode attention of `heads` query heads (`heads × d`) over every row: the encoded
    /// rows on their codes ([`Kv43Rows::attend_heads`]' arithmetic), the partial group
    /// exactly, merged. Returns `heads × d`; an empty head is an error.
    pub fn attend(&self, q: &[f32], heads: usize, scale: f32) -> Result<Vec<f32>> {
        let d = self.d;
        if heads == 0 || q.len() != heads * d {
            return Err(Error::ShapeMismatch {
                what: "kv43 queries (heads × d)",
                expected: heads.max(1) * d,
                got: q.len(),
            });
        }
        if self.rows() == 0 {
            return Err(Error::InvalidArgument { what: "kv43 head", message: "no rows to attend".into() });
        }
        let mut parts = vec![Partial::empty(d); heads];
        self.attend_runs(q, scale, &[0..self.rows()], &mut parts)?;
        Ok(parts.iter().flat_map(Partial::finish).collect())
    }

    /// Folds rows `ranges` (within `0..rows()`) into the partials `parts` of `parts.len()`
    /// query heads (`q`: `heads × d`): the encoded rows among them on their codes
    /// ([`Kv43Rows::attend_runs`]), the rows of the partial group in f16 exactly.
    pub fn attend_runs(&self, q: &[f32], scale: f32, ranges: &[Range<usize>], parts: &mut [Partial]) -> Result<()> {
        let (d, rows, done) = (self.d, self.rows(), self.encoded_rows());
        check_runs(q, d, rows, ranges, parts)?;
        if let Some(e) = &self.encoded {
            let coded: Vec<Range<usize>> =
                ranges.iter().map(|r| r.start.min(done)..r.end.min(done)).filter(|r| !r.is_empty()).collect();
            if !coded.is_empty() {
                e.attend_runs(q, scale, &coded, parts)?;
            }
        }
        // The partial group's f16 rows: the plain kernel, every head at once.
        let spans = ranges.iter().filter(|r| r.end > done).map(|r| {
            let t = (r.start.max(done) - done) * d..(r.end - done) * d;
            (&self.tail_keys[t.clone()], &self.tail_values[t])
        });
        crate::cpu::attention::attend_spans(q, scale, spans, parts, &mut crate::cpu::attention::Scratch::default());
        Ok(())
    }

    /// The rows the head stands for (`rows() × d` keys, then values): the encoded rows
    /// dequantized, then the partial group's f16 rows.
    pub fn dequantize(&self) -> (Vec<f32>, Vec<f32>) {
        let (mut keys, mut values) = self.encoded.as_ref().map(Kv43Rows::dequantize).unwrap_or_default();
        keys.extend(self.tail_keys.iter().map(|x| x.to_f32()));
        values.extend(self.tail_values.iter().map(|x| x.to_f32()));
        (keys, values)
    }

    /// The partial key group's f16 rows (`(rows() − encoded_rows()) × d` keys and values),
    /// not yet encoded.
    pub fn partial_group(&self) -> (&[f16], &[f16]) {
        (&self.tail_keys, &self.tail_values)
    }

    /// Head dimension.
    pub fn head_dim(&self) -> usize {
        self.d
    }

    /// The group sizes.
    pub fn params(&self) -> Kv43Params {
        self.params
    }
}

/// One query's preparation for a key group, in buffers reused from group to group: the
/// group's channel scales and minima (f32), and for the query its 8-bit code `w` of `q∘s`
/// per 64-dim partition with the partition's minimum and step `ab`, and `qm = Σ_c q_c m_c`.
struct GroupQuery {
    key_scale: Vec<f32>,
    key_min: Vec<f32>,
    scaled: Vec<f32>,
    w: Vec<u8>,
    ab: Vec<(f32, f32)>,
    qm: f32,
}

impl GroupQuery {
    fn new(d: usize) -> Self {
        let f = || vec![0.0f32; d];
        Self { key_scale: f(), key_min: f(), scaled: f(), w: vec![0; d], ab: vec![(0.0, 0.0); d / PART], qm: 0.0 }
    }

    /// Codes query `q` (`d` values) against the group in `key_scale` / `key_min`. `qm` is
    /// summed in eight lanes, then the lanes pairwise (one order, which the fast path shares).
    fn prepare(&mut self, q: &[f32]) {
        let mut lanes = [0.0f32; 8];
        for (qs, ms) in q.chunks_exact(8).zip(self.key_min.chunks_exact(8)) {
            for ((l, a), b) in lanes.iter_mut().zip(qs).zip(ms) {
                *l += a * b;
            }
        }
        let [a, b, c, d, e, f, g, h] = lanes;
        self.qm = ((a + e) + (c + g)) + ((b + f) + (d + h));
        for ((x, a), b) in self.scaled.iter_mut().zip(q).zip(&self.key_scale) {
            *x = a * b;
        }
        for ((part, w), ab) in self.scaled.chunks_exact(PART).zip(self.w.chunks_exact_mut(PART)).zip(&mut self.ab) {
            let (min, step) = quantize_query_into(part, w);
            *ab = (min.to_f32(), step.to_f32());
        }
    }
}

/// Where channel `c` of row `j`'s key code lies (see `Kv43Rows::key_codes`): the byte and
/// the nibble's shift.
fn key_code_at(d: usize, j: usize, c: usize) -> (usize, u32) {
    let (tile, r, octet, i) = (j / TILE, j % TILE, c / 8, c % 8);
    (tile * TILE * d / 2 + octet * 32 + 4 * r + i % 4, 4 * (i / 4) as u32)
}

/// Where channel `c` of row `j`'s fifth key bit lies (see `Kv43Rows::key_high`): the byte
/// and the bit.
fn key_high_at(d: usize, j: usize, c: usize) -> (usize, u32) {
    ((j / TILE) * d + (c / 8) * TILE + j % TILE, (c % 8) as u32)
}

/// Row `j`'s key code of channel `c` from nibbles `codes` and, with 5-bit keys, the fifth
/// bits `high` (empty with 4-bit keys); the rows of both may start at any tile.
fn key_code(codes: &[u8], high: &[u8], d: usize, j: usize, c: usize) -> u8 {
    let (at, shift) = key_code_at(d, j, c);
    let nibble = codes[at] >> shift & 0xf;
    if high.is_empty() {
        return nibble;
    }
    let (at, bit) = key_high_at(d, j, c);
    nibble | (high[at] >> bit & 1) << 4
}

/// Where row `j`'s code sum over partition `k` lies (see `Kv43Rows::key_sums`).
fn key_sum_at(d: usize, j: usize, k: usize) -> usize {
    (j / TILE) * TILE * (d / PART) + k * TILE + j % TILE
}

/// The codes of one value block from its `bits` planes per 8 rows (`rows/8 × bits × d`
/// bytes) into `z` (`rows × d`, one code per byte).
fn unpack_value_codes(planes: &[u8], d: usize, bits: usize, z: &mut [u8]) {
    for (i, group) in planes.chunks_exact(bits * d).enumerate() {
        for r in 0..8 {
            let zr = &mut z[(8 * i + r) * d..(8 * i + r + 1) * d];
            for (c, x) in zr.iter_mut().enumerate() {
                *x = (0..bits).map(|b| (group[b * d + c] >> r & 1) << b).sum();
            }
        }
    }
}

/// The value codes of `planes` (`bits` planes per 8 rows, as `Kv43Rows` keeps them) as one
/// word per 8 rows and channel (`rows/8 × d` words): byte `i` holds row `i`'s code in its
/// low nibble and row `i + 4`'s in its high nibble. The GPU keeps values this way (a mask
/// and a shift give `dp4a` its four codes, where the planes need eleven operations per
/// plane); the codes are the same, only their bits are moved.
#[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "the GPU upload and its test use it"))]
pub(crate) fn value_nibble_words(planes: &[u8], d: usize, bits: usize) -> Vec<u32> {
    // Bits 0..3 of x, each to bit 0 of its own byte.
    let spread = |x: u8| (u32::from(x & 0xf) * 0x0020_4081) & 0x0101_0101;
    let mut words = vec![0u32; planes.len() / bits];
    for (group, out) in planes.chunks_exact(bits * d).zip(words.chunks_exact_mut(d)) {
        for (c, w) in out.iter_mut().enumerate() {
            *w = (0..bits).fold(0, |acc, b| {
                let x = group[b * d + c];
                acc | spread(x) << b | spread(x >> 4) << (b + 4)
            });
        }
    }
    words
}

/// `dot[h·d + c] = Σ_t P[h][t]·z[t][c]` for every head `h` of `p` (`heads × rows` 8-bit
/// probability codes) over one value block's codes `z` (`rows × d`).
fn weigh_value_codes(z: &[u8], d: usize, p: &[u8], dot: &mut [u32]) {
    let rows = z.len() / d;
    for (ph, dh) in p.chunks_exact(rows).zip(dot.chunks_exact_mut(d)) {
        dh.iter_mut().for_each(|x| *x = 0);
        for (t, &pt) in ph.iter().enumerate() {
            for (x, &zc) in dh.iter_mut().zip(&z[t * d..(t + 1) * d]) {
                *x += u32::from(pt) * u32::from(zc);
            }
        }
    }
}

mod arrays;
mod attention;
#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
mod avx2;
#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
mod avx512;

pub use arrays::Kv43Arrays;
pub use attention::prefetch;

/// The checks of an `attend_runs` call: `parts.len()` heads (at least one) of `d`-dim
/// partials and queries, row ranges within `rows`.
fn check_runs(q: &[f32], d: usize, rows: usize, ranges: &[Range<usize>], parts: &[Partial]) -> Result<()> {
    let heads = parts.len();
    if heads == 0 || q.len() != heads * d || parts.iter().any(|x| x.o.len() != d) {
        return Err(Error::ShapeMismatch {
            what: "kv43 queries (heads × d) and their partials",
            expected: heads.max(1) * d,
            got: q.len(),
        });
    }
    if let Some(r) = ranges.iter().find(|r| r.start > r.end || r.end > rows) {
        return Err(Error::InvalidArgument {
            what: "kv43 row ranges",
            message: format!("{r:?} is not a range within the {rows} rows"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
