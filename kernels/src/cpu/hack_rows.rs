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
//!   A run of selected rows therefore reads only its own quads.
//!
//! Attention never dequantizes: scores come from the homomorphic product of the 8-bit
//! query with the 2-bit keys (integer code products plus the correction terms of the
//! stored sums), and values from integer products of 8-bit probabilities with the 2-bit
//! codes. Probabilities are non-negative, so they are quantized from zero (`p ≈ s·p8`):
//! with a zero minimum the correction terms that need value code sums vanish, and rows a
//! plan did not select contribute exactly nothing to a block's product.

use super::hack::{quantize_partition, HackParams, Quantized8};
use super::partial::Partial;
use crate::element::Element;
use crate::error::{Error, Result};
use crate::random::SplitMix64;
use half::f16;
use half::slice::HalfFloatSliceExt;
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
}

/// Reusable buffers of [`HackRows::attend`]. They remember the queries they last quantized:
/// a clone of a scratch that quantized a step's queries (e.g. one per rayon task of an exact
/// plan) does not quantize them again.
#[derive(Debug, Default, Clone)]
pub struct HackScratch {
    /// The bits of the queries `q8`… were quantized from, and the head count, head dimension
    /// and Π they were quantized for.
    quantized_from: Vec<u32>,
    quantized_for: (usize, usize, usize),
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
}

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
        let empty = HackArrays {
            key_codes: &[],
            key_min: &[],
            key_scale: &[],
            key_sum: &[],
            value_codes: &[],
            value_min: &[],
            value_scale: &[],
        };
        HackView::new(head_dim, params, 0, empty)?.quantize_queries(q, g, self);
        Ok(())
    }
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

/// Blocks whose largest probability is below `e^NEGLIGIBLE_GAP` of the running maximum are
/// left out of attention: 64 rows of them add less than 2^-85 to a sum of at least 1.
const NEGLIGIBLE_GAP: f32 = -64.0;

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
        let metadata = [(a.key_min, a.key_scale, "key"), (a.value_min, a.value_scale, "value")];
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
    /// minimum and scale, plus one byte of key code sum (≤ 3·Π; two bytes when Π > 85).
    pub fn bytes(&self) -> usize {
        let sum = if 3 * self.params.partition <= 255 { 1 } else { 2 };
        let blocks = self.rows.div_ceil(self.params.partition);
        self.rows * self.d / 4 * 2 + self.k_min.len() * (4 + sum) + blocks * self.d * 4
    }

    /// Appends `n` rows (`keys`/`values`: `n × head_dim`), quantizing keys row by row and
    /// values in blocks of Π rows with stochastic rounding from `rng`. Only the last call
    /// may leave a short block; after it the store is sealed. Every value is quantized
    /// exactly once.
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
        let mut wide = vec![0.0f32; p * d];
        let mut codes = vec![0u8; p.max(d)];
        for (kb, vb) in keys.chunks(p * d).zip(values.chunks(p * d)) {
            let n = kb.len() / d;
            E::widen(kb, &mut wide[..n * d]);
            for row in wide[..n * d].chunks_exact(d) {
                let at = self.k_codes.len();
                self.k_codes.resize(at + d / 4, 0);
                for (k, part) in row.chunks(p).enumerate() {
                    let (min, scale, sum) = quantize_partition(part, rng, &mut codes[..part.len()]);
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
                let (min, scale, _) = quantize_partition(&column, rng, &mut codes[..n]);
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
            for j in 0..d {
                let k = r * self.k_parts + j / p;
                let code = (self.k_codes[r * d / 4 + j / 4] >> (2 * (j % 4))) & 3;
                keys.push(self.k_scale[k].to_f32() * f32::from(code) + self.k_min[k].to_f32());
            }
            let (b, t) = (r / p, r % p);
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
        };
        Ok(HackView { params: self.params, d, rows: range.len(), k_parts: kp, a })
    }

    /// Folds the rows of `ranges` into the partials of the `parts.len()` query heads of `q`
    /// ([`HackView::attend`] over all rows).
    pub fn attend(&self, q: &[f32], scale: f32, ranges: &[Range<usize>], parts: &mut [Partial], s: &mut HackScratch) {
        self.view().attend(q, scale, ranges, parts, s);
    }

    /// Value blocks (groups of Π rows, the last one possibly short).
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(self.params.partition)
    }

    /// Value block `g` in the group layout, [`HackView::group_len`] bytes: its key codes,
    /// its value codes (padded quads), then, 2-byte aligned, key minima, scales and code
    /// sums (per row and key partition) and value minima and scales (per channel), all
    /// little-endian.
    pub fn group_bytes(&self, g: usize) -> Vec<u8> {
        let p = self.params.partition;
        let rows = g * p..((g + 1) * p).min(self.rows);
        // One block's range is always on block boundaries.
        let a = self.view_rows(rows.clone()).expect("a value block's rows").a;
        let mut out = Vec::with_capacity(HackView::group_len(self.d, self.params, rows.len()));
        out.extend_from_slice(a.key_codes);
        out.extend_from_slice(a.value_codes);
        if out.len() % 2 == 1 {
            out.push(0);
        }
        let halves = |x: &[f16], out: &mut Vec<u8>| out.extend(x.iter().flat_map(|v| v.to_bits().to_le_bytes()));
        halves(a.key_min, &mut out);
        halves(a.key_scale, &mut out);
        out.extend(a.key_sum.iter().flat_map(|v| v.to_le_bytes()));
        halves(a.value_min, &mut out);
        halves(a.value_scale, &mut out);
        out
    }

    /// Rows rebuilt from views of consecutive rows in order: value blocks
    /// ([`HackView::from_group`]) or longer runs ([`HackRows::view_rows`]), each whole blocks
    /// but the last, every array checked as [`HackRows::from_arrays`] does.
    pub fn from_groups(head_dim: usize, params: HackParams, groups: &[HackView<'_>]) -> Result<Self> {
        let mut a = (vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
        let mut rows = 0;
        for (i, v) in groups.iter().enumerate() {
            if (v.d, v.params) != (head_dim, params) {
                return Err(Error::InvalidArgument {
                    what: "2-bit groups",
                    message: format!(
                        "group {i} holds rows of d = {} with Π = {}, expected d = {head_dim} with Π = {}",
                        v.d, v.params.partition, params.partition
                    ),
                });
            }
            if !v.rows.is_multiple_of(params.partition) && i + 1 < groups.len() {
                return Err(Error::InvalidArgument {
                    what: "2-bit groups",
                    message: format!(
                        "group {i} of {} holds {} rows, not whole blocks of {}: only the last may be short",
                        groups.len(),
                        v.rows,
                        params.partition
                    ),
                });
            }
            rows += v.rows;
            a.0.extend_from_slice(v.a.key_codes);
            a.1.extend_from_slice(v.a.key_min);
            a.2.extend_from_slice(v.a.key_scale);
            a.3.extend_from_slice(v.a.key_sum);
            a.4.extend_from_slice(v.a.value_codes);
            a.5.extend_from_slice(v.a.value_min);
            a.6.extend_from_slice(v.a.value_scale);
        }
        let arrays = HackArrays {
            key_codes: &a.0,
            key_min: &a.1,
            key_scale: &a.2,
            key_sum: &a.3,
            value_codes: &a.4,
            value_min: &a.5,
            value_scale: &a.6,
        };
        // Checked like `from_arrays`, then the concatenated arrays move in (no second copy).
        let mut out = Self::checked(head_dim, params, rows, arrays)?;
        (out.k_codes, out.k_min, out.k_scale, out.k_sum, out.v_codes, out.v_min, out.v_scale) = a;
        Ok(out)
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
        let lengths = [
            ("key codes", a.key_codes.len(), rows * head_dim / 4),
            ("key minima", a.key_min.len(), rows * k_parts),
            ("key scales", a.key_scale.len(), rows * k_parts),
            ("key code sums", a.key_sum.len(), rows * k_parts),
            ("value codes", a.value_codes.len(), blocks * params.partition / 4 * head_dim),
            ("value minima", a.value_min.len(), blocks * head_dim),
            ("value scales", a.value_scale.len(), blocks * head_dim),
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
        }
    }

    /// The arrays in view.
    pub fn arrays(&self) -> HackArrays<'a> {
        self.a
    }

    /// Bytes of one value block of `rows` (≤ Π) rows in the group layout
    /// ([`HackRows::group_bytes`]).
    pub fn group_len(head_dim: usize, params: HackParams, rows: usize) -> usize {
        let kp = head_dim.div_ceil(params.partition);
        let codes = rows * head_dim / 4 + params.partition / 4 * head_dim;
        codes.next_multiple_of(2) + 2 * (3 * rows * kp + 2 * head_dim)
    }

    /// A view of one value block of `rows` rows stored in the group layout
    /// ([`HackRows::group_bytes`]); `bytes` must start 2-byte aligned (its f16 and u16
    /// arrays are viewed in place) and hold at least [`HackView::group_len`] bytes.
    pub fn from_group(head_dim: usize, params: HackParams, rows: usize, bytes: &'a [u8]) -> Result<Self> {
        check_head_dim(head_dim)?;
        let (p, kp) = (params.partition, head_dim.div_ceil(params.partition));
        let need = Self::group_len(head_dim, params, rows);
        if rows == 0 || rows > p || bytes.len() < need {
            return Err(Error::InvalidArgument {
                what: "2-bit group",
                message: format!("{} bytes for {rows} rows (1..={p}): expected at least {need}", bytes.len()),
            });
        }
        let (key_codes, rest) = bytes.split_at(rows * head_dim / 4);
        let (value_codes, _) = rest.split_at(p / 4 * head_dim);
        let at = (rows * head_dim / 4 + p / 4 * head_dim).next_multiple_of(2);
        let words: &[u16] = bytemuck::try_cast_slice(&bytes[at..need]).map_err(|e| Error::InvalidArgument {
            what: "2-bit group",
            message: format!("its metadata must be 2-byte aligned: {e}"),
        })?;
        let (k_min, rest) = words.split_at(rows * kp);
        let (k_scale, rest) = rest.split_at(rows * kp);
        let (key_sum, rest) = rest.split_at(rows * kp);
        let (v_min, v_scale) = rest.split_at(head_dim);
        let a = HackArrays {
            key_codes,
            key_min: bytemuck::cast_slice(k_min),
            key_scale: bytemuck::cast_slice(k_scale),
            key_sum,
            value_codes,
            value_min: bytemuck::cast_slice(v_min),
            value_scale: bytemuck::cast_slice(v_scale),
        };
        Self::new(head_dim, params, rows, a)
    }

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
        debug_assert_eq!(s.q8.len(), g * self.d, "queries quantized for another head count");
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

    /// Quantizes the `g` query heads of `q` to 8 bits per key partition (codes, minimum,
    /// scale and code sum) into `s`, for [`HackView::attend_quantized`].
    pub fn quantize_queries(&self, q: &[f32], g: usize, s: &mut HackScratch) {
        let d = self.d;
        let key = (g, d, self.params.partition);
        let bits: &[u32] = bytemuck::cast_slice(q);
        if s.quantized_for == key && s.quantized_from == bits {
            return; // quantized already (the same queries, bit for bit)
        }
        s.quantized_from.clear();
        s.q8.clear();
        s.q_min.clear();
        s.q_scale.clear();
        s.q_sum.clear();
        for qh in q.chunks_exact(d) {
            // Partitions restart at every head.
            let q8 = Quantized8::encode(qh, self.params);
            s.q8.extend_from_slice(&q8.codes);
            s.q_min.extend_from_slice(&q8.mins);
            s.q_scale.extend_from_slice(&q8.scales);
            s.q_sum.extend(q8.sums.iter().map(|&x| x as f32));
        }
        debug_assert_eq!((s.q8.len(), s.q_min.len()), (g * d, g * self.k_parts));
        #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
        if self.fast_scores() {
            self.pair_queries(g, s);
        }
        s.quantized_for = key;
        s.quantized_from.extend_from_slice(bits);
    }

    /// The per-pair query vectors of the AVX2 score kernel (see `hack_avx2::block_scores`).
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    fn pair_queries(&self, g: usize, s: &mut HackScratch) {
        let (d, kp) = (self.d, self.k_parts);
        let types: Vec<(usize, usize)> =
            if kp == 1 { vec![(0, 0)] } else { (0..kp / 2).map(|m| (2 * m, 2 * m + 1)).collect() };
        s.pairs.clear();
        for hg in 0..g.div_ceil(4) {
            for &(k0, k1) in &types {
                let mut pq =
                    super::hack_avx2::PairQuery { codes: [[[0; 32]; 4]; 4], sq: [0.0; 8], mq: [0.0; 8], c: [0.0; 8] };
                for h in 0..4 {
                    let head = hg * 4 + h;
                    if head >= g {
                        continue;
                    }
                    for (lane, k) in [(0, k0), (1, k1)] {
                        for (sh, codes) in pq.codes[h].iter_mut().enumerate() {
                            for b in 0..16 {
                                codes[lane * 16 + b] = s.q8[head * d + k * 64 + 4 * b + sh] ^ 0x80;
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
        super::prefetch::prefetch(&a.key_codes[rows.start * d / 4..rows.end * d / 4]);
        super::prefetch::prefetch(
            &a.value_codes[block * p / 4 * d..((block + 1) * p / 4 * d).min(a.value_codes.len())],
        );
        let meta = rows.start * kp..rows.end * kp;
        super::prefetch::prefetch(&a.key_scale[meta.clone()]);
        super::prefetch::prefetch(&a.key_min[meta.clone()]);
        super::prefetch::prefetch(&a.key_sum[meta]);
    }

    /// Attention over the selected rows `s.rows` (offsets inside value block `block`).
    fn attend_block(&self, block: usize, g: usize, scale: f32, parts: &mut [Partial], s: &mut HackScratch) {
        let (d, p) = (self.d, self.params.partition);
        let n = s.rows.len();
        s.scores.resize(g * n, 0.0);
        self.block_scores(block, g, scale, s);
        // Probabilities relative to each head's running maximum, quantized from zero.
        s.weights.resize(g * p, 0);
        let first_row = s.rows.first().map_or(0, |&t| t as usize);
        let contiguous = s.rows.last().is_some_and(|&t| t as usize + 1 == first_row + n);
        s.p_scale.resize(g, 0.0);
        s.p_sum.resize(g, 0.0);
        for (h, part) in parts.iter_mut().enumerate() {
            let sc = &s.scores[h * n..(h + 1) * n];
            let block_max = super::simd::max_of(sc);
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
            let keys = super::hack_avx2::KeyData {
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
    keys: &super::hack_avx2::KeyData<'_>,
    rows: &[u32],
    pairs: &[super::hack_avx2::PairQuery],
    g: usize,
    scale: f32,
    out: &mut [f32],
) {
    if keys.kp.is_multiple_of(2) && super::hack_avx512::available() {
        // SAFETY: `available` checked that this CPU has AVX-512 F, BW and VNNI (which imply
        // the AVX2, FMA and F16C the kernel also enables).
        return unsafe { super::hack_avx512::block_scores(keys, rows, pairs, g, scale, out) };
    }
    // SAFETY: this function exists only when the build enables avx2, fma and f16c for the whole
    // program (cfg above), so every CPU that runs the binary has them.
    unsafe { super::hack_avx2::block_scores(keys, rows, pairs, g, scale, out) }
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
        if super::hack_avx512::available() {
            // SAFETY: `available` checked that this CPU has AVX-512 F, BW, VNNI and VBMI
            // (which imply the AVX2, FMA and F16C the kernel also enables).
            unsafe { by_heads!(super::hack_avx512::block_values) }
        } else {
            // SAFETY: compiled only when the build enables avx2, fma and f16c for the whole
            // program (cfg above), so every CPU that runs the binary has them.
            unsafe { by_heads!(super::hack_avx2::block_values) }
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
fn quantize_probs(x: &[f32], m: f32, inv: f32, codes: &mut [u8]) -> u32 {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma", target_feature = "f16c"))]
    if super::hack_avx512::available() {
        #[allow(unsafe_code, reason = "the call into the AVX-512 kernel")]
        // SAFETY: `available` checked that this CPU has AVX-512 F.
        return unsafe { super::hack_avx512::quantize_probs(x, m, inv, codes) };
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    #[allow(unsafe_code, reason = "the one call into a #[target_feature] kernel")]
    // SAFETY: compiled only when the build enables avx2 and fma for the whole program (cfg
    // above), so every CPU that runs the binary has them.
    return unsafe { super::hack_avx2::quantize_probs(x, m, inv, codes) };
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::attention::{attend_rows, Scratch};

    fn randn(n: usize, seed: u64) -> Vec<f32> {
        SplitMix64::new(seed).normals(n)
    }

    fn rel(a: &[f32], b: &[f32]) -> f32 {
        let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
        (num / b.iter().map(|y| y * y).sum::<f32>()).sqrt()
    }

    /// Attention over `ranges` computed in f32 from the dequantized rows, with the same
    /// 8-bit query and probability quantization as the homomorphic path.
    fn dequantized(rows: &HackRows, q: &[f32], g: usize, ranges: &[Range<usize>]) -> Vec<Vec<f32>> {
        let (d, p) = (rows.d, rows.params.partition);
        let scale = 1.0 / (d as f32).sqrt();
        let mut s = HackScratch::default();
        rows.view().quantize_queries(q, g, &mut s);
        let q8: Vec<f32> = (0..g * d)
            .map(|i| {
                let (h, j) = (i / d, i % d);
                let k = h * rows.k_parts + j / p;
                s.q_scale[k] * f32::from(s.q8[i]) + s.q_min[k]
            })
            .collect();
        let mut selected: Vec<usize> = ranges.iter().flat_map(|r| r.clone()).collect();
        selected.sort_unstable();
        (0..g)
            .map(|h| {
                let mut part = Partial::empty(d);
                for block in selected.chunk_by(|a, b| a / p == b / p) {
                    let mut sc = Vec::new();
                    let mut vals = Vec::new();
                    for &r in block {
                        let (k, v) = rows.decode_rows(r..r + 1);
                        sc.push(k.iter().zip(&q8[h * d..(h + 1) * d]).map(|(a, b)| a * b).sum::<f32>() * scale);
                        vals.push(v);
                    }
                    let m = part.m.max(sc.iter().copied().fold(f32::NEG_INFINITY, f32::max));
                    part.rescale_to(m);
                    let pr: Vec<f32> = sc.iter().map(|x| (x - m).exp()).collect();
                    let step = pr.iter().copied().fold(0.0, f32::max) / P_LEVELS;
                    for (w, v) in pr.iter().zip(&vals) {
                        let w = (w / step).round() * step;
                        part.l += w;
                        part.o.iter_mut().zip(v).for_each(|(o, x)| *o += w * x);
                    }
                }
                part.finish()
            })
            .collect()
    }

    fn store(tokens: usize, d: usize, seed: u64) -> (HackRows, Vec<f32>, Vec<f32>) {
        let (k, v) = (randn(tokens * d, seed), randn(tokens * d, seed + 1));
        let mut rows = HackRows::new(d, HackParams::default()).unwrap();
        let mut rng = SplitMix64::new(seed + 2);
        let full = tokens / 64 * 64;
        rows.push_rows(&k[..full * d], &v[..full * d], &mut rng).unwrap();
        rows.push_rows(&k[full * d..], &v[full * d..], &mut rng).unwrap();
        (rows, k, v)
    }

    #[test]
    fn rows_rebuilt_from_their_arrays_attend_identically_and_damaged_arrays_are_refused() {
        let d = 64;
        let (rows, _, _) = store(150, d, 21); // a short last block of 22 rows
        let a = rows.arrays();
        let again = HackRows::from_arrays(d, rows.params(), rows.rows(), a).unwrap();
        let q = randn(2 * d, 5);
        let ranges = [0..150, 3..40, 130..150];
        for r in &ranges {
            let (mut x, mut y) = (vec![Partial::empty(d); 2], vec![Partial::empty(d); 2]);
            rows.attend(&q, 0.125, std::slice::from_ref(r), &mut x, &mut HackScratch::default());
            again.attend(&q, 0.125, std::slice::from_ref(r), &mut y, &mut HackScratch::default());
            for (x, y) in x.iter().zip(&y) {
                assert_eq!(x.finish(), y.finish(), "rows {r:?}");
            }
        }
        assert_eq!(again.bytes(), rows.bytes());
        // One row too many for the arrays.
        let err = HackRows::from_arrays(d, rows.params(), 151, a).unwrap_err();
        assert!(matches!(err, Error::ShapeMismatch { what: "key codes", .. }), "{err}");
        // A flipped key code no longer matches its stored sum.
        let mut codes = a.key_codes.to_vec();
        codes[5] ^= 0b01;
        let err = HackRows::from_arrays(d, rows.params(), 150, HackArrays { key_codes: &codes, ..a }).unwrap_err();
        assert!(err.to_string().contains("code sum"), "{err}");
        // A code in the padding of the short last block.
        let mut codes = a.value_codes.to_vec();
        let last = codes.len() - 1;
        codes[last] |= 0b1100_0000;
        let err = HackRows::from_arrays(d, rows.params(), 150, HackArrays { value_codes: &codes, ..a }).unwrap_err();
        assert!(err.to_string().contains("past its rows"), "{err}");
        // A NaN scale.
        let mut scales = a.value_scale.to_vec();
        scales[3] = f16::NAN;
        let err = HackRows::from_arrays(d, rows.params(), 150, HackArrays { value_scale: &scales, ..a }).unwrap_err();
        assert!(err.to_string().contains("value scale 3"), "{err}");
    }

    #[test]
    fn row_runs_on_block_boundaries_split_and_join_back_to_the_same_rows() {
        for (d, partition, tokens) in [(128, 64, 300), (64, 32, 96), (36, 16, 21)] {
            let params = HackParams::new(partition).unwrap();
            let mut rows = HackRows::new(d, params).unwrap();
            rows.push_rows(&randn(tokens * d, 41), &randn(tokens * d, 42), &mut SplitMix64::new(43)).unwrap();
            // Pieces of two blocks, the last one short when the rows are.
            let cuts: Vec<usize> = (0..tokens).step_by(2 * partition).chain([tokens]).collect();
            let pieces: Vec<HackView<'_>> = cuts.windows(2).map(|w| rows.view_rows(w[0]..w[1]).unwrap()).collect();
            let q = randn(2 * d, 44);
            let scale = 1.0 / (d as f32).sqrt();
            let mut whole = vec![Partial::empty(d); 2];
            rows.attend(&q, scale, &[0..tokens], &mut whole, &mut HackScratch::default());
            let mut parts = vec![Partial::empty(d); 2];
            for v in &pieces {
                v.attend(&q, scale, &[0..v.rows()], &mut parts, &mut HackScratch::default());
            }
            for (a, b) in whole.iter().zip(&parts) {
                let (a, b) = (a.clone().finish(), b.clone().finish());
                let err = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
                assert!(err < 1e-4, "d={d}: pieces attend as the whole ({err})");
            }
            let again = HackRows::from_groups(d, params, &pieces).unwrap();
            assert_eq!(again.rows(), tokens);
            let copies: Vec<HackRows> = pieces.iter().map(HackView::to_rows).collect();
            assert_eq!(copies.iter().map(HackRows::rows).sum::<usize>(), tokens);
            assert_eq!(copies[0].decode_rows(0..pieces[0].rows()), rows.decode_rows(0..pieces[0].rows()));
            assert_eq!(again.decode_rows(0..tokens), rows.decode_rows(0..tokens), "d={d}");
            assert_eq!(again.bytes(), rows.bytes());
            // Off a block boundary, past the end, or pieces of another shape: typed errors.
            assert!(rows.view_rows(1..partition).is_err());
            assert!(rows.view_rows(0..tokens + 1).is_err());
            if tokens > partition + 1 {
                assert!(rows.view_rows(0..partition + 1).is_err());
            }
            let other = HackParams::new(if partition == 16 { 32 } else { 16 }).unwrap();
            assert!(HackRows::from_groups(d, other, &pieces).is_err());
        }
    }

    #[test]
    fn value_blocks_in_the_group_layout_attend_as_the_rows_they_came_from() {
        for (d, partition, tokens) in [(128, 64, 150), (64, 32, 96), (36, 16, 21)] {
            let params = HackParams::new(partition).unwrap();
            let (k, v) = (randn(tokens * d, 31), randn(tokens * d, 32));
            let mut rows = HackRows::new(d, params).unwrap();
            rows.push_rows(&k, &v, &mut SplitMix64::new(33)).unwrap();
            let q = randn(3 * d, 34);
            let scale = 1.0 / (d as f32).sqrt();
            // Each group in a u16 buffer (2-byte aligned), as a buffer manager block would hold it.
            let buffers: Vec<Vec<u16>> = (0..rows.groups())
                .map(|g| {
                    let bytes = rows.group_bytes(g);
                    let n = (g * partition..((g + 1) * partition).min(tokens)).len();
                    assert_eq!(bytes.len(), HackView::group_len(d, params, n), "d={d} group {g}");
                    let mut words = vec![0u16; bytes.len().div_ceil(2)];
                    bytemuck::cast_slice_mut::<u16, u8>(&mut words)[..bytes.len()].copy_from_slice(&bytes);
                    words
                })
                .collect();
            let views: Vec<HackView<'_>> = buffers
                .iter()
                .enumerate()
                .map(|(g, w)| {
                    let n = (g * partition..((g + 1) * partition).min(tokens)).len();
                    HackView::from_group(d, params, n, bytemuck::cast_slice(w)).unwrap()
                })
                .collect();
            // Attending group by group with the queries quantized once = attending the rows.
            let ranges = [0..tokens, 3..(tokens / 2), (tokens - 5)..tokens];
            for r in &ranges {
                let mut whole = vec![Partial::empty(d); 3];
                rows.attend(&q, scale, std::slice::from_ref(r), &mut whole, &mut HackScratch::default());
                let mut pieces = vec![Partial::empty(d); 3];
                let mut s = HackScratch::default();
                views[0].quantize_queries(&q, 3, &mut s);
                for (g, view) in views.iter().enumerate() {
                    let lo = g * partition;
                    let local = r.start.max(lo).saturating_sub(lo)..r.end.min(lo + view.rows()).saturating_sub(lo);
                    if !local.is_empty() {
                        view.attend_quantized(scale, &[local], &mut pieces, &mut s);
                    }
                }
                for (a, b) in whole.iter().zip(&pieces) {
                    assert_eq!(a.finish(), b.finish(), "d={d} Π={partition} rows {r:?}");
                }
            }
            let again = HackRows::from_groups(d, params, &views).unwrap();
            assert_eq!((again.rows(), again.bytes()), (rows.rows(), rows.bytes()));
            assert_eq!(again.group_bytes(views.len() - 1), rows.group_bytes(views.len() - 1));
            // Too few bytes, or a short group before the last, are typed errors.
            let short = &bytemuck::cast_slice::<u16, u8>(&buffers[0])[..10];
            assert!(HackView::from_group(d, params, partition.min(tokens), short).is_err());
            if views.len() > 1 {
                let last = views.len() - 1;
                assert!(
                    HackRows::from_groups(d, params, &[views[last], views[0]]).is_err()
                        || views[last].rows() == partition
                );
            }
        }
    }

    #[test]
    fn homomorphic_attention_equals_dequantize_then_attend_on_any_row_runs() {
        // Head dims and group sizes that take every kernel path: one or two rows per AVX2
        // score vector, head groups padded to four, the scalar path for Π = 32 and for blocks
        // of more than 64 rows (Π = 128).
        for (d, g, partition) in [
            (128, 4, 64),
            (64, 3, 64),
            (256, 1, 64),
            (64, 2, 32),
            (128, 5, 64),
            (192, 2, 64),
            (32, 4, 64),
            (64, 2, 128),
        ] {
            let (k, v) = (randn(300 * d, 1), randn(300 * d, 2));
            let mut rows = HackRows::new(d, HackParams::new(partition).unwrap()).unwrap();
            rows.push_rows(&k, &v, &mut SplitMix64::new(3)).unwrap();
            let q: Vec<f32> = randn(g * d, 9).iter().map(|x| x * 2.0).collect();
            for ranges in [vec![0..300], vec![5..21, 60..70, 200..201, 290..300], vec![100..164, 10..12]] {
                let mut parts = vec![Partial::empty(d); g];
                rows.attend(&q, 1.0 / (d as f32).sqrt(), &ranges, &mut parts, &mut HackScratch::default());
                let want = dequantized(&rows, &q, g, &ranges);
                for (p, w) in parts.iter().zip(&want) {
                    let err = rel(&p.finish(), w);
                    assert!(err < 2e-5, "d={d} g={g} Π={partition} {ranges:?}: homomorphic vs dequantized {err}");
                }
            }
        }
    }

    #[test]
    fn two_bit_attention_is_close_to_exact_and_splits_merge() {
        // Values with per-channel means (as real values have): the attention output is
        // then signal, not an average of noise that 2 bits cannot resolve.
        let (d, g, tokens) = (64, 2, 1000);
        let mu = randn(d, 30);
        let k = randn(tokens * d, 31);
        let v: Vec<f32> = randn(tokens * d, 32).iter().enumerate().map(|(i, x)| 2.0 * mu[i % d] + 0.5 * x).collect();
        let mut rows = HackRows::new(d, HackParams::default()).unwrap();
        rows.push_rows(&k, &v, &mut SplitMix64::new(33)).unwrap();
        let q = randn(g * d, 4);
        let scale = 1.0 / (d as f32).sqrt();
        let mut exact = vec![Partial::empty(d); g];
        attend_rows(&q, scale, &k, &v, &mut exact, &mut Scratch::default());
        let mut whole = vec![Partial::empty(d); g];
        rows.attend(&q, scale, &[0..tokens], &mut whole, &mut HackScratch::default());
        // Split at block boundaries the arithmetic is the same; inside a block each side
        // quantizes its probabilities on its own, which moves the result by about a step.
        let split = |cut: usize, tol: f32| {
            let (mut a, mut b) = (vec![Partial::empty(d); g], vec![Partial::empty(d); g]);
            rows.attend(&q, scale, &[0..cut, 704..1000], &mut a, &mut HackScratch::default());
            rows.attend(&q, scale, &[cut..704], &mut b, &mut HackScratch::default());
            for j in 0..g {
                a[j].merge(&b[j]);
                let err = rel(&a[j].finish(), &whole[j].finish());
                assert!(err < tol, "split at {cut}: {err}");
            }
        };
        split(320, 1e-5);
        split(333, 2e-2);
        for j in 0..g {
            let err = rel(&whole[j].finish(), &exact[j].finish());
            assert!(err < 0.05, "2-bit attention vs exact: {err}");
        }
    }

    #[test]
    fn a_scratch_reused_or_primed_attends_as_a_fresh_one() {
        let (d, g, tokens) = (128, 4, 300);
        let (rows, _, _) = store(tokens, d, 40);
        let scale = 1.0 / (d as f32).sqrt();
        let (q1, q2) = (randn(g * d, 41), randn(g * d, 42));
        let run = |q: &[f32], s: &mut HackScratch| {
            let mut parts = vec![Partial::empty(d); g];
            rows.attend(q, scale, &[3..250], &mut parts, s);
            parts.iter().flat_map(Partial::finish).collect::<Vec<f32>>()
        };
        let fresh = |q: &[f32]| run(q, &mut HackScratch::default());
        assert_ne!(fresh(&q1), fresh(&q2), "the two steps must differ for the test to mean anything");
        // The same scratch, queries changing between steps (and back).
        let mut s = HackScratch::default();
        for q in [&q1, &q2, &q2, &q1] {
            assert_eq!(run(q, &mut s), fresh(q));
        }
        // A scratch primed without a view, then cloned.
        let mut primed = HackScratch::default();
        primed.quantize(&q2, g, d, rows.params()).unwrap();
        assert_eq!(run(&q2, &mut primed.clone()), fresh(&q2));
        assert_eq!(run(&q1, &mut primed.clone()), fresh(&q1));
        assert!(matches!(primed.quantize(&q1[..d], g, d, rows.params()), Err(Error::ShapeMismatch { .. })));
    }

    #[test]
    fn storage_is_under_a_fifth_of_f16_and_rows_round_trip_within_a_step() {
        let d = 128;
        let (rows, k, v) = store(640, d, 5);
        let ratio = rows.bytes() as f64 / (640 * d * 2 * 2) as f64;
        assert!(ratio <= 0.2, "{ratio}");
        let (dk, dv) = rows.decode_rows(0..640);
        // Each value is within one quantization step (range/3) of its partition's range.
        for (orig, dec) in [(&k, &dk), (&v, &dv)] {
            let worst = orig.iter().zip(dec.iter()).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(worst < 3.5, "{worst}");
        }
        assert!(!rows.is_sealed());
        let mut sealed = rows.clone();
        let mut rng = SplitMix64::new(1);
        sealed.push_rows(&k[..3 * d], &v[..3 * d], &mut rng).unwrap();
        assert!(sealed.is_sealed());
        assert!(sealed.push_rows(&k[..d], &v[..d], &mut rng).is_err(), "a short block ends the store");
        assert!(sealed.push_rows(&k[..d + 1], &v[..d], &mut rng).is_err());
        assert!(HackRows::new(30, HackParams::default()).is_err());
    }

    #[test]
    fn probabilities_round_to_seven_bits_in_every_lane_and_remainder() {
        let mut rng = SplitMix64::new(77);
        for n in [0, 1, 7, 8, 15, 16, 17, 31, 33, 64] {
            let x: Vec<f32> = (0..n).map(|_| 3.0 * rng.normal()).collect();
            let m = super::super::simd::max_of(&x);
            assert_eq!(m, x.iter().copied().fold(f32::NEG_INFINITY, f32::max), "n={n}");
            if n == 0 {
                continue;
            }
            let inv = P_LEVELS; // the block max is the running max: its probability is 1 → 127
            let mut codes = vec![0u8; n];
            let sum = quantize_probs(&x, m, inv, &mut codes);
            assert_eq!(sum, codes.iter().map(|&c| u32::from(c)).sum::<u32>(), "n={n}");
            for (i, (&c, &xi)) in codes.iter().zip(&x).enumerate() {
                let want = (xi - m).exp() * inv;
                assert!(c <= 127 && (f32::from(c) - want).abs() <= 0.5 + 1e-4, "n={n} i={i}: {c} for {want}");
                if xi == m {
                    assert_eq!(c, 127, "n={n}: the maximum takes the top code");
                }
            }
        }
    }
}
