//! Rows of one KV head stored in HACK's 2-bit form, laid out for attention over row runs
//! (what a wave segment or a flat index holds when its context uses the `hack2` codec).
//!
//! Layout, for head dimension `d` and partition Π:
//! - **keys** row by row (the inner dimension of `q·k` is the head dimension): `d/4` code
//!   bytes per row (code `j` in bits `2(j%4)` of byte `j/4`), and per row and key partition
//!   of Π dimensions an f16 minimum, an f16 scale and the code sum;
//! - **values** in blocks of Π rows (the inner dimension of `p·V` is the sequence): per
//!   block, per channel an f16 minimum and scale, and the codes as *token quads*: for rows
//!   `4i..4i+4` of the block, `d` bytes, byte `c` holding channel `c` of the four rows.
//!   A run of selected rows therefore reads only its own quads;
//! - with [`KeyLayout::PerChannel`](crate::KeyLayout::PerChannel), also per block and channel the keys' f16 minimum `m`
//!   and range `r`: the key codes and their per-row metadata then code the normalized rows
//!   `k̃ = (k − m)/r` (each channel in [0, 1] over its block), and `q·k = q·m + (q∘r)·k̃`.
//!
//! Attention never dequantizes: scores come from the homomorphic product of the 8-bit
//! query with the 2-bit keys (integer code products plus the correction terms of the
//! stored sums), and values from integer products of 8-bit probabilities with the 2-bit
//! codes. Probabilities are non-negative, so they are quantized from zero (`p ≈ s·p8`):
//! with a zero minimum the correction terms that need value code sums vanish, and rows a
//! plan did not select contribute exactly nothing to a block's product.
//!
//! This module holds the types and the row store (layout, appending, checks, views); its
//! submodules hold attention (`attention`) and the group layout a buffer manager block holds
//! (`groups`).

mod attention;
mod groups;
#[cfg(test)]
mod tests;

use super::hack::{quantize_partition_with, HackParams};
use crate::element::Element;
use crate::error::{Error, Result};
use crate::random::SplitMix64;
use half::f16;
use std::ops::Range;

/// One head's rows in 2-bit form (see the module docs for the layout).
#[derive(Debug, Clone)]
pub struct HackRows {
    params: HackParams,
    d: usize,
    rows: usize,
    /// Key partitions per row, `ceil(d / Π)`.
    k_parts: usize,
    k_codes: Vec<u8>,
    /// Per row and key partition: minimum, scale (f16 bits as stored) and code sum.
    k_min: Vec<f16>,
    k_scale: Vec<f16>,
    k_sum: Vec<u16>,
    /// Per block: `Π/4` quads of `d` bytes (a short last block is padded with code 0).
    v_codes: Vec<u8>,
    /// Per block and channel: minimum and scale.
    v_min: Vec<f16>,
    v_scale: Vec<f16>,
    /// Per block and channel, with [`KeyLayout::PerChannel`](crate::KeyLayout::PerChannel) (else empty): the keys'
    /// minimum and range.
    kc_min: Vec<f16>,
    kc_range: Vec<f16>,
}

/// The stored arrays of a [`HackRows`] in the layout the module docs describe (for copying
/// to a GPU; the last value block is padded to whole quads with code 0).
#[derive(Debug, Clone, Copy)]
pub struct HackArrays<'a> {
    /// Key codes, `rows × head_dim/4` bytes.
    pub key_codes: &'a [u8],
    /// Key minima, `rows × partitions`.
    pub key_min: &'a [f16],
    /// Key scales, `rows × partitions`.
    pub key_scale: &'a [f16],
    /// Key code sums, `rows × partitions`.
    pub key_sum: &'a [u16],
    /// Value codes, `blocks × Π/4 × head_dim` bytes.
    pub value_codes: &'a [u8],
    /// Value minima, `blocks × head_dim`.
    pub value_min: &'a [f16],
    /// Value scales, `blocks × head_dim`.
    pub value_scale: &'a [f16],
    /// Per-channel key minima, `blocks × head_dim` ([`KeyLayout::PerChannel`](crate::KeyLayout::PerChannel); else empty).
    pub key_channel_min: &'a [f16],
    /// Per-channel key ranges, `blocks × head_dim` ([`KeyLayout::PerChannel`](crate::KeyLayout::PerChannel); else empty).
    pub key_channel_range: &'a [f16],
}

impl HackArrays<'static> {
    /// No rows.
    pub const EMPTY: Self = Self {
        key_codes: &[],
        key_min: &[],
        key_scale: &[],
        key_sum: &[],
        value_codes: &[],
        value_min: &[],
        value_scale: &[],
        key_channel_min: &[],
        key_channel_range: &[],
    };
}

/// Reusable buffers of [`HackRows::attend`]. They remember the queries they last quantized:
/// a clone of a scratch that quantized a step's queries (e.g. one per rayon task of an exact
/// plan) does not quantize them again.
#[derive(Debug, Default, Clone)]
pub struct HackScratch {
    /// The bits of the queries `q8`… were quantized from, and the head count, head dimension,
    /// Π and key layout (per channel or not) they were quantized for.
    quantized_from: Vec<u32>,
    quantized_for: (usize, usize, usize, bool),
    q8: Vec<u8>,
    q_min: Vec<f32>,
    q_scale: Vec<f32>,
    q_sum: Vec<f32>,
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    pairs: Vec<super::hack_avx2::PairQuery>,
    keys: Vec<u8>,
    rows: Vec<u32>,
    scores: Vec<f32>,
    p_scale: Vec<f32>,
    p_sum: Vec<f32>,
    weights: Vec<u8>,
    quads: Vec<u16>,
    live: Vec<bool>,
    acc: Vec<i32>,
    column: Vec<f32>,
    codes: Vec<u8>,
    /// With [`KeyLayout::PerChannel`](crate::KeyLayout::PerChannel) (whose step's queries are
    /// `quantized_from`): per head the block's `q·m`, and the queries scaled by the block's
    /// ranges.
    offsets: Vec<f32>,
    scaled: Vec<f32>,
    /// The block's channel minima and ranges as f32.
    channel: Vec<f32>,
}

/// Sum of the 2-bit codes packed in `bytes` (four per byte): per byte the low bits count
/// once and the high bits twice, so two popcounts over eight bytes at a time.
fn code_sum(bytes: &[u8]) -> u16 {
    let (lo, hi) = (0x5555_5555_5555_5555u64, 0xAAAA_AAAA_AAAA_AAAAu64);
    let mut chunks = bytes.chunks_exact(8);
    let mut sum = 0u32;
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().unwrap_or_default());
        sum += (w & lo).count_ones() + 2 * (w & hi).count_ones();
    }
    for &b in chunks.remainder() {
        sum += (b & 0x55).count_ones() + 2 * (b & 0xAA).count_ones();
    }
    sum as u16
}

/// Normalizes each channel of the `rows × d` keys `k` in place to [0, 1] over the rows
/// (`(k − m)/r` with the f16 minimum `m` and range `r` it appends to `min` and `range`; a
/// constant channel becomes 0).
fn normalize_channels(k: &mut [f32], d: usize, min: &mut Vec<f16>, range: &mut Vec<f16>) {
    for c in 0..d {
        let (lo, hi) =
            k.iter().skip(c).step_by(d).fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let m = f16::from_f32(lo);
        let r = f16::from_f32((hi - m.to_f32()).max(0.0));
        let (mf, rf) = (m.to_f32(), r.to_f32());
        let inv = if rf > 0.0 { 1.0 / rf } else { 0.0 };
        k.iter_mut().skip(c).step_by(d).for_each(|v| *v = ((*v - mf) * inv).clamp(0.0, 1.0));
        min.push(m);
        range.push(r);
    }
}

/// The 2-bit codec packs four values per byte.
fn check_head_dim(head_dim: usize) -> Result<()> {
    if head_dim == 0 || !head_dim.is_multiple_of(4) {
        return Err(Error::InvalidArgument {
            what: "head_dim",
            message: format!(
                "the 2-bit codec packs four values per byte: head_dim must be a positive multiple of 4, got {head_dim}"
            ),
        });
    }
    Ok(())
}

/// Probabilities are quantized to 7 bits (0..=127): `vpmaddubsw` multiplies one unsigned
/// and one *signed* byte operand, and the 2-bit codes take the unsigned side.
pub(crate) const P_LEVELS: f32 = 127.0;

impl HackRows {
    /// An empty store for rows of `head_dim` values.
    pub fn new(head_dim: usize, params: HackParams) -> Result<Self> {
        check_head_dim(head_dim)?;
        Ok(Self {
            params,
            d: head_dim,
            rows: 0,
            k_parts: head_dim.div_ceil(params.partition),
            k_codes: vec![],
            k_min: vec![],
            k_scale: vec![],
            k_sum: vec![],
            v_codes: vec![],
            v_min: vec![],
            v_scale: vec![],
            kc_min: vec![],
            kc_range: vec![],
        })
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The codec parameters.
    pub fn params(&self) -> HackParams {
        self.params
    }

    /// The stored arrays (for copying to a GPU).
    pub fn arrays(&self) -> HackArrays<'_> {
        HackArrays {
            key_codes: &self.k_codes,
            key_min: &self.k_min,
            key_scale: &self.k_scale,
            key_sum: &self.k_sum,
            value_codes: &self.v_codes,
            value_min: &self.v_min,
            value_scale: &self.v_scale,
            key_channel_min: &self.kc_min,
            key_channel_range: &self.kc_range,
        }
    }

    /// Rebuilds `rows` rows of `head_dim` values from arrays laid out as [`HackRows::arrays`]
    /// returns them (what a checkpoint wrote to disk). Everything is checked before it is
    /// trusted: every array's length, finite minima and non-negative finite scales, every
    /// key code sum against its codes, and zero padding codes in a short last value block.
    /// A mismatch is a typed error naming the array.
    pub fn from_arrays(head_dim: usize, params: HackParams, rows: usize, a: HackArrays<'_>) -> Result<Self> {
        let mut out = Self::checked(head_dim, params, rows, a)?;
        out.k_codes = a.key_codes.to_vec();
        out.k_min = a.key_min.to_vec();
        out.k_scale = a.key_scale.to_vec();
        out.k_sum = a.key_sum.to_vec();
        out.v_codes = a.value_codes.to_vec();
        out.v_min = a.value_min.to_vec();
        out.v_scale = a.value_scale.to_vec();
        out.kc_min = a.key_channel_min.to_vec();
        out.kc_range = a.key_channel_range.to_vec();
        Ok(out)
    }

    /// An empty store whose row count is `rows`, once the arrays `a` pass every check of
    /// [`HackRows::from_arrays`]; the caller moves or copies them in.
    fn checked(head_dim: usize, params: HackParams, rows: usize, a: HackArrays<'_>) -> Result<Self> {
        let mut out = Self::new(head_dim, params)?;
        HackView::new(head_dim, params, rows, a)?;
        let (d, p) = (head_dim, params.partition);
        let blocks = rows.div_ceil(p);
        let bad = |what: &'static str, message: String| Err(Error::InvalidArgument { what, message });
        let metadata = [
            (a.key_min, a.key_scale, "key"),
            (a.value_min, a.value_scale, "value"),
            (a.key_channel_min, a.key_channel_range, "key channel"),
        ];
        for (min, scale, what) in metadata {
            if let Some(i) = min.iter().position(|m| !m.is_finite()) {
                return bad("2-bit rows", format!("{what} minimum {i} is {}, expected a finite value", min[i]));
            }
            if let Some(i) = scale.iter().position(|s| !s.is_finite() || s.to_f32() < 0.0) {
                return bad("2-bit rows", format!("{what} scale {i} is {}, expected finite and ≥ 0", scale[i]));
            }
        }
        for r in 0..rows {
            let codes = &a.key_codes[r * d / 4..(r + 1) * d / 4];
            for k in 0..out.k_parts {
                // Π and d are multiples of 4: a partition is whole bytes.
                let sum = code_sum(&codes[k * p / 4..((k + 1) * p).min(d) / 4]);
                if sum != a.key_sum[r * out.k_parts + k] {
                    return bad(
                        "2-bit rows",
                        format!(
                            "row {r} partition {k}: stored code sum {}, its codes sum to {sum}",
                            a.key_sum[r * out.k_parts + k]
                        ),
                    );
                }
            }
        }
        if !rows.is_multiple_of(p) {
            // Rows past the end of the short last block: their codes must be 0.
            let block = &a.value_codes[(blocks - 1) * p / 4 * d..];
            let used = rows % p;
            let padded =
                (used..p).any(|t| block[(t / 4) * d..(t / 4 + 1) * d].iter().any(|&b| (b >> (2 * (t % 4))) & 3 != 0));
            if padded {
                return bad(
                    "2-bit rows",
                    format!("the short last value block ({used} of {p} rows) has codes past its rows"),
                );
            }
        }
        out.rows = rows;
        Ok(out)
    }

    /// True once the last value block is short: no more rows can be appended.
    pub fn is_sealed(&self) -> bool {
        !self.rows.is_multiple_of(self.params.partition)
    }

    /// Stored bytes: codes, and per key partition and per value block and channel an f16
    /// minimum and scale, plus one byte of key code sum (≤ 3·Π; two bytes when Π > 85);
    /// with per-channel keys also the keys' minimum and range per block and channel.
    pub fn bytes(&self) -> usize {
        let sum = if 3 * self.params.partition <= 255 { 1 } else { 2 };
        let blocks = self.rows.div_ceil(self.params.partition);
        let channel = if self.params.per_channel() { 4 } else { 0 };
        self.rows * self.d / 4 * 2 + self.k_min.len() * (4 + sum) + blocks * self.d * (4 + channel)
    }

    /// Appends `n` rows (`keys`/`values`: `n × head_dim`), quantizing keys row by row
    /// (per-channel keys normalized over their block first) and values in blocks of Π rows,
    /// with stochastic rounding from `rng` or to nearest as the layout says
    /// ([`HackParams::stochastic`]). Only the last call may leave a short block; after it
    /// the store is sealed. Every value is quantized exactly once.
    pub fn push_rows<E: Element>(&mut self, keys: &[E], values: &[E], rng: &mut SplitMix64) -> Result<()> {
        let d = self.d;
        if keys.len() != values.len() || !keys.len().is_multiple_of(d) {
            return Err(Error::ShapeMismatch {
                what: "keys/values (n × head_dim)",
                expected: keys.len() / d * d,
                got: values.len(),
            });
        }
        if self.is_sealed() && !keys.is_empty() {
            return Err(Error::InvalidArgument {
                what: "rows",
                message: format!("the last block of these {} rows is short (sealed): no rows can follow", self.rows),
            });
        }
        let p = self.params.partition;
        let stochastic = self.params.stochastic();
        let mut wide = vec![0.0f32; p * d];
        let mut codes = vec![0u8; p.max(d)];
        for (kb, vb) in keys.chunks(p * d).zip(values.chunks(p * d)) {
            let n = kb.len() / d;
            E::widen(kb, &mut wide[..n * d]);
            if self.params.per_channel() {
                normalize_channels(&mut wide[..n * d], d, &mut self.kc_min, &mut self.kc_range);
            }
            for row in wide[..n * d].chunks_exact(d) {
                let at = self.k_codes.len();
                self.k_codes.resize(at + d / 4, 0);
                for (k, part) in row.chunks(p).enumerate() {
                    let rng = stochastic.then_some(&mut *rng);
                    let (min, scale, sum) = quantize_partition_with(part, rng, &mut codes[..part.len()]);
                    for (j, &c) in codes[..part.len()].iter().enumerate() {
                        let j = k * p + j;
                        self.k_codes[at + j / 4] |= c << (2 * (j % 4));
                    }
                    self.k_min.push(min);
                    self.k_scale.push(scale);
                    self.k_sum.push(sum);
                }
            }
            E::widen(vb, &mut wide[..n * d]);
            let at = self.v_codes.len();
            self.v_codes.resize(at + p / 4 * d, 0);
            let mut column = vec![0.0f32; n];
            for c in 0..d {
                column.iter_mut().enumerate().for_each(|(t, x)| *x = wide[t * d + c]);
                let rng = stochastic.then_some(&mut *rng);
                let (min, scale, _) = quantize_partition_with(&column, rng, &mut codes[..n]);
                for (t, &code) in codes[..n].iter().enumerate() {
                    self.v_codes[at + (t / 4) * d + c] |= code << (2 * (t % 4));
                }
                self.v_min.push(min);
                self.v_scale.push(scale);
            }
            self.rows += n;
        }
        Ok(())
    }

    /// The dequantized rows `range` as `(keys, values)`, each `rows × head_dim` (for checks
    /// and the dequantize-then-attend baseline; attention never needs them).
    pub fn decode_rows(&self, range: Range<usize>) -> (Vec<f32>, Vec<f32>) {
        let (d, p) = (self.d, self.params.partition);
        let mut keys = Vec::with_capacity(range.len() * d);
        let mut values = Vec::with_capacity(range.len() * d);
        for r in range {
            let (b, t) = (r / p, r % p);
            for j in 0..d {
                let k = r * self.k_parts + j / p;
                let code = (self.k_codes[r * d / 4 + j / 4] >> (2 * (j % 4))) & 3;
                let x = self.k_scale[k].to_f32() * f32::from(code) + self.k_min[k].to_f32();
                keys.push(if self.params.per_channel() {
                    self.kc_min[b * d + j].to_f32() + self.kc_range[b * d + j].to_f32() * x
                } else {
                    x
                });
            }
            for c in 0..d {
                let code = (self.v_codes[b * p / 4 * d + (t / 4) * d + c] >> (2 * (t % 4))) & 3;
                values.push(self.v_scale[b * d + c].to_f32() * f32::from(code) + self.v_min[b * d + c].to_f32());
            }
        }
        (keys, values)
    }

    /// The rows as a view attention runs on.
    pub fn view(&self) -> HackView<'_> {
        HackView { params: self.params, d: self.d, rows: self.rows, k_parts: self.k_parts, a: self.arrays() }
    }

    /// Rows `range` as a view of their own (row 0 of the view is row `range.start`), for
    /// storing long row runs in pieces. The range must lie on value-block boundaries: it
    /// starts at a multiple of Π and ends at one or at the last row; anything else is a
    /// typed error.
    pub fn view_rows(&self, range: Range<usize>) -> Result<HackView<'_>> {
        let p = self.params.partition;
        let whole = range.start.is_multiple_of(p) && (range.end.is_multiple_of(p) || range.end == self.rows);
        if range.start > range.end || range.end > self.rows || !whole {
            return Err(Error::InvalidArgument {
                what: "2-bit row range",
                message: format!(
                    "rows {range:?} of {}: expected a range within them on value-block boundaries (multiples of Π = {p})",
                    self.rows
                ),
            });
        }
        let (d, kp) = (self.d, self.k_parts);
        let blocks = range.start / p..range.end.div_ceil(p);
        let meta = range.start * kp..range.end * kp;
        let a = HackArrays {
            key_codes: &self.k_codes[range.start * d / 4..range.end * d / 4],
            key_min: &self.k_min[meta.clone()],
            key_scale: &self.k_scale[meta.clone()],
            key_sum: &self.k_sum[meta],
            value_codes: &self.v_codes[blocks.start * p / 4 * d..blocks.end * p / 4 * d],
            value_min: &self.v_min[blocks.start * d..blocks.end * d],
            value_scale: &self.v_scale[blocks.start * d..blocks.end * d],
            key_channel_min: self.kc_min.get(blocks.start * d..blocks.end * d).unwrap_or_default(),
            key_channel_range: self.kc_range.get(blocks.start * d..blocks.end * d).unwrap_or_default(),
        };
        Ok(HackView { params: self.params, d, rows: range.len(), k_parts: kp, a })
    }
}

/// 2-bit rows borrowed as arrays laid out as [`HackRows::arrays`] returns them: attention
/// runs on this view, over a whole [`HackRows`] or over one value block homed elsewhere
/// (e.g. a buffer manager's block, [`HackView::from_group`]).
#[derive(Debug, Clone, Copy)]
pub struct HackView<'a> {
    params: HackParams,
    d: usize,
    rows: usize,
    k_parts: usize,
    a: HackArrays<'a>,
}

impl<'a> HackView<'a> {
    /// A view of `rows` rows of `head_dim` values; every array's length is checked (the
    /// codes are trusted: [`HackRows::from_arrays`] checks them too).
    pub fn new(head_dim: usize, params: HackParams, rows: usize, a: HackArrays<'a>) -> Result<Self> {
        check_head_dim(head_dim)?;
        let k_parts = head_dim.div_ceil(params.partition);
        let blocks = rows.div_ceil(params.partition);
        let channel_meta = if params.per_channel() { blocks * head_dim } else { 0 };
        let lengths = [
            ("key codes", a.key_codes.len(), rows * head_dim / 4),
            ("key minima", a.key_min.len(), rows * k_parts),
            ("key scales", a.key_scale.len(), rows * k_parts),
            ("key code sums", a.key_sum.len(), rows * k_parts),
            ("value codes", a.value_codes.len(), blocks * params.partition / 4 * head_dim),
            ("value minima", a.value_min.len(), blocks * head_dim),
            ("value scales", a.value_scale.len(), blocks * head_dim),
            ("key channel minima", a.key_channel_min.len(), channel_meta),
            ("key channel ranges", a.key_channel_range.len(), channel_meta),
        ];
        if let Some(&(what, got, expected)) = lengths.iter().find(|(_, got, expected)| got != expected) {
            return Err(Error::ShapeMismatch { what, expected, got });
        }
        Ok(Self { params, d: head_dim, rows, k_parts, a })
    }

    /// Rows in view.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The rows in view as a store of their own (a copy of the arrays; no checks are
    /// repeated: a view's lengths were checked when it was made).
    pub fn to_rows(&self) -> HackRows {
        let a = self.a;
        HackRows {
            params: self.params,
            d: self.d,
            rows: self.rows,
            k_parts: self.k_parts,
            k_codes: a.key_codes.to_vec(),
            k_min: a.key_min.to_vec(),
            k_scale: a.key_scale.to_vec(),
            k_sum: a.key_sum.to_vec(),
            v_codes: a.value_codes.to_vec(),
            v_min: a.value_min.to_vec(),
            v_scale: a.value_scale.to_vec(),
            kc_min: a.key_channel_min.to_vec(),
            kc_range: a.key_channel_range.to_vec(),
        }
    }

    /// The arrays in view.
    pub fn arrays(&self) -> HackArrays<'a> {
        self.a
    }
}
