//! A [`Kv43Head`] taken apart into its arrays and put back together: what a disk format
//! writes of a kv43 segment and reads back. Nothing read back is trusted: every length,
//! every minimum and scale, every key code sum against its codes and the f16 rows are
//! checked, and a mismatch is a typed error naming the array.

use half::f16;

use super::{key_code, key_sum_at, Kv43Head, Kv43Params, Kv43Rows, PART};
use crate::error::{Error, Result};

/// One KV head's kv43 rows as arrays, laid out as [`Kv43Head`] keeps them: `rows` encoded
/// rows (a whole number of key groups) and the partial group after them in f16.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Kv43Arrays<'a> {
    /// Encoded rows (a multiple of the key group; 0 when none are).
    pub rows: usize,
    /// Key codes (their low four bits), two per byte in tiles of 8 rows: `rows × d / 2` bytes.
    pub key_codes: &'a [u8],
    /// With 5-bit keys, each code's fifth bit, one byte per row and 8 channels: `rows × d /
    /// 8` bytes; empty with 4-bit keys.
    pub key_high: &'a [u8],
    /// Per key group and channel: key minimum, `rows / key_group × d`.
    pub key_min: &'a [f16],
    /// Per key group and channel: key scale, as many.
    pub key_scale: &'a [f16],
    /// Per row and 64-channel partition: the sum of its key codes, `rows × d / 64`.
    pub key_sums: &'a [u16],
    /// Value codes as three (four with 4-bit values) bit planes per 8 rows: `rows / 8 ×
    /// value_bits × d` bytes.
    pub value_planes: &'a [u8],
    /// Per value block and channel: value minimum, `rows / value_block × d`.
    pub value_min: &'a [f16],
    /// Per value block and channel: value scale, as many.
    pub value_scale: &'a [f16],
    /// Keys of the partial group after the encoded rows (`tail × d`, fewer than a key group).
    pub tail_keys: &'a [f16],
    /// Values of the partial group, as many.
    pub tail_values: &'a [f16],
}

impl Kv43Head {
    /// The head's arrays, as [`Kv43Head::from_arrays`] takes them back.
    pub fn arrays(&self) -> Kv43Arrays<'_> {
        let e = self.encoded.as_ref();
        Kv43Arrays {
            rows: self.encoded_rows(),
            key_codes: e.map_or(&[], |e| &e.key_codes),
            key_high: e.map_or(&[], |e| &e.key_high),
            key_min: e.map_or(&[], |e| &e.key_min),
            key_scale: e.map_or(&[], |e| &e.key_scale),
            key_sums: e.map_or(&[], |e| &e.key_sums),
            value_planes: e.map_or(&[], |e| &e.value_planes),
            value_min: e.map_or(&[], |e| &e.value_min),
            value_scale: e.map_or(&[], |e| &e.value_scale),
            tail_keys: &self.tail_keys,
            tail_values: &self.tail_values,
        }
    }

    /// A head of dimension `d` rebuilt from arrays laid out as [`Kv43Head::arrays`] returns
    /// them (what a checkpoint wrote): equal to the head they were taken from. Checked
    /// before anything is trusted — the parameters, every array's length, finite minima and
    /// finite non-negative scales, every key code sum against its codes, finite f16 rows
    /// and a partial group shorter than a key group; a mismatch is
    /// [`Error::InvalidArgument`] naming what was wrong and what was expected.
    pub fn from_arrays(d: usize, params: Kv43Params, a: Kv43Arrays<'_>) -> Result<Self> {
        params.check(d)?;
        let bad = |message: String| Err(Error::InvalidArgument { what: "kv43 arrays", message });
        let rows = a.rows;
        if !rows.is_multiple_of(params.key_group) {
            return bad(format!("{rows} encoded rows are not a multiple of the key group ({})", params.key_group));
        }
        let lengths = [
            ("key codes", a.key_codes.len(), rows * d / 2),
            ("key fifth bits", a.key_high.len(), if params.high_bit() { rows * d / 8 } else { 0 }),
            ("key minima", a.key_min.len(), rows / params.key_group * d),
            ("key scales", a.key_scale.len(), rows / params.key_group * d),
            ("key code sums", a.key_sums.len(), rows * (d / PART)),
            ("value planes", a.value_planes.len(), rows / 8 * params.planes() * d),
            ("value minima", a.value_min.len(), rows / params.value_block * d),
            ("value scales", a.value_scale.len(), rows / params.value_block * d),
        ];
        for (what, got, want) in lengths {
            if got != want {
                return bad(format!("{what}: {got} entries, expected {want} for {rows} rows of {d}"));
            }
        }
        for (min, scale, what) in [(a.key_min, a.key_scale, "key"), (a.value_min, a.value_scale, "value")] {
            if let Some(i) = min.iter().position(|m| !m.is_finite()) {
                return bad(format!("{what} minimum {i} is {}, expected a finite value", min[i]));
            }
            if let Some(i) = scale.iter().position(|s| !s.is_finite() || s.to_f32() < 0.0) {
                return bad(format!("{what} scale {i} is {}, expected finite and ≥ 0", scale[i]));
            }
        }
        for j in 0..rows {
            for k in 0..d / PART {
                let sum: u16 =
                    (k * PART..(k + 1) * PART).map(|c| u16::from(key_code(a.key_codes, a.key_high, d, j, c))).sum();
                let stored = a.key_sums[key_sum_at(d, j, k)];
                if stored != sum {
                    return bad(format!("row {j} partition {k}: stored key code sum {stored}, its codes sum to {sum}"));
                }
            }
        }
        let (tk, tv) = (a.tail_keys.len(), a.tail_values.len());
        if tk != tv || !tk.is_multiple_of(d) || tk >= params.key_group * d {
            return bad(format!(
                "partial group of {tk} key and {tv} value entries, expected equal whole rows of {d}, \
                 fewer than a key group ({})",
                params.key_group
            ));
        }
        if let Some(i) = a.tail_keys.iter().chain(a.tail_values).position(|x| !x.is_finite()) {
            return bad(format!("partial group entry {i} is not finite"));
        }
        let encoded = (rows > 0).then(|| Kv43Rows {
            d,
            rows,
            params,
            key_codes: a.key_codes.to_vec(),
            key_high: a.key_high.to_vec(),
            key_min: a.key_min.to_vec(),
            key_scale: a.key_scale.to_vec(),
            key_sums: a.key_sums.to_vec(),
            value_planes: a.value_planes.to_vec(),
            value_min: a.value_min.to_vec(),
            value_scale: a.value_scale.to_vec(),
        });
        Ok(Self { encoded, d, params, tail_keys: a.tail_keys.to_vec(), tail_values: a.tail_values.to_vec() })
    }
}

impl Kv43Head {
    /// Heads of dimension `d` and parameters `params` joined in order into one: the rows of
    /// each after the previous one's, codes unchanged (as cut from one head at key groups,
    /// e.g. the pieces of a disk home). Every piece but the last must end at a whole key
    /// group (no f16 partial group); a piece of another dimension or parameters, or a
    /// partial group before the last piece, is [`Error::InvalidArgument`] naming it.
    pub fn join(d: usize, params: Kv43Params, pieces: &[&Kv43Head]) -> Result<Self> {
        let bad = |message: String| Err(Error::InvalidArgument { what: "kv43 pieces", message });
        let mut joined = Self::new(d, params)?;
        for (i, piece) in pieces.iter().enumerate() {
            if piece.d != d || piece.params != params {
                return bad(format!(
                    "piece {i}: d = {} with {:?}, expected d = {d} with {params:?}",
                    piece.d, piece.params
                ));
            }
            if !joined.tail_keys.is_empty() {
                return bad(format!(
                    "piece {} of {} ends in a partial key group of {} rows: only the last may",
                    i - 1,
                    pieces.len(),
                    joined.tail_keys.len() / d
                ));
            }
            if let Some(rows) = &piece.encoded {
                match &mut joined.encoded {
                    Some(all) => all.extend(rows.clone()),
                    None => joined.encoded = Some(rows.clone()),
                }
            }
            joined.tail_keys.clone_from(&piece.tail_keys);
            joined.tail_values.clone_from(&piece.tail_values);
        }
        Ok(joined)
    }
}
