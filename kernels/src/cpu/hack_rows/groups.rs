//! The group layout: one value block of 2-bit rows as one run of bytes (its codes, then its
//! f16 and u16 metadata, 2-byte aligned), what a buffer manager's block holds. Rows are cut into
//! groups ([`HackRows::group_bytes`]), a group is viewed in place ([`HackView::from_group`]),
//! and rows are rebuilt from consecutive groups or row runs ([`HackRows::from_groups`]).

use super::{check_head_dim, HackArrays, HackRows, HackView};
use crate::cpu::hack::HackParams;
use crate::error::{Error, Result};
use half::f16;

impl HackRows {
    /// Value blocks (groups of Π rows, the last one possibly short).
    pub fn groups(&self) -> usize {
        self.rows.div_ceil(self.params.partition)
    }

    /// Value block `g` in the group layout, [`HackView::group_len`] bytes: its key codes,
    /// its value codes (padded quads), then, 2-byte aligned, key minima, scales and code
    /// sums (per row and key partition), value minima and scales (per channel) and, with
    /// per-channel keys, the keys' minima and ranges (per channel), all little-endian.
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
        halves(a.key_channel_min, &mut out);
        halves(a.key_channel_range, &mut out);
        out
    }

    /// Rows rebuilt from views of consecutive rows in order: value blocks
    /// ([`HackView::from_group`]) or longer runs ([`HackRows::view_rows`]), each whole blocks
    /// but the last, every array checked as [`HackRows::from_arrays`] does.
    pub fn from_groups(head_dim: usize, params: HackParams, groups: &[HackView<'_>]) -> Result<Self> {
        let mut a = (vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
        let mut channel = (vec![], vec![]);
        let mut rows = 0;
        for (i, v) in groups.iter().enumerate() {
            if (v.d, v.params) != (head_dim, params) {
                return Err(Error::InvalidArgument {
                    what: "2-bit groups",
                    message: format!(
                        "group {i} holds rows of d = {} with Π = {} and {:?} keys, expected d = {head_dim} with Π = {} and {:?} keys",
                        v.d, v.params.partition, v.params.keys, params.partition, params.keys
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
            channel.0.extend_from_slice(v.a.key_channel_min);
            channel.1.extend_from_slice(v.a.key_channel_range);
        }
        let arrays = HackArrays {
            key_codes: &a.0,
            key_min: &a.1,
            key_scale: &a.2,
            key_sum: &a.3,
            value_codes: &a.4,
            value_min: &a.5,
            value_scale: &a.6,
            key_channel_min: &channel.0,
            key_channel_range: &channel.1,
        };
        // Checked like `from_arrays`, then the concatenated arrays move in (no second copy).
        let mut out = Self::checked(head_dim, params, rows, arrays)?;
        (out.k_codes, out.k_min, out.k_scale, out.k_sum, out.v_codes, out.v_min, out.v_scale) = a;
        (out.kc_min, out.kc_range) = channel;
        Ok(out)
    }
}

impl<'a> HackView<'a> {
    /// Bytes of one value block of `rows` (≤ Π) rows in the group layout
    /// ([`HackRows::group_bytes`]).
    pub fn group_len(head_dim: usize, params: HackParams, rows: usize) -> usize {
        let kp = head_dim.div_ceil(params.partition);
        let codes = rows * head_dim / 4 + params.partition / 4 * head_dim;
        let channel = if params.per_channel() { 2 * head_dim } else { 0 };
        codes.next_multiple_of(2) + 2 * (3 * rows * kp + 2 * head_dim + channel)
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
        let (v_min, rest) = rest.split_at(head_dim);
        let (v_scale, rest) = rest.split_at(head_dim);
        let (kc_min, kc_range) = rest.split_at(rest.len() / 2);
        let a = HackArrays {
            key_codes,
            key_min: bytemuck::cast_slice(k_min),
            key_scale: bytemuck::cast_slice(k_scale),
            key_sum,
            value_codes,
            value_min: bytemuck::cast_slice(v_min),
            value_scale: bytemuck::cast_slice(v_scale),
            key_channel_min: bytemuck::cast_slice(kc_min),
            key_channel_range: bytemuck::cast_slice(kc_range),
        };
        Self::new(head_dim, params, rows, a)
    }
}
