//! A [`Kv43Head`] cut at key groups (put back together by [`Kv43Head::join`]), and the keys
//! of any of its rows:
//! what a PQ index over kv43 rows needs for its encoded home (pieces of whole key groups,
//! one segment file each) and for the PQ codes of base rows coded after the build (their
//! keys as the codes stand for them).
//!
//! Every array of a head is laid out in whole tiles of 8 rows, in row order (codes, fifth
//! bits, code sums, value planes) or per key group / value block (minima and scales), so the
//! rows of whole key groups are one contiguous slice of each ([`Kv43Head::arrays`]); a piece
//! is rebuilt and checked by [`Kv43Head::from_arrays`], never trusted.

use crate::error::{Error, Result};
use attnstore_kernels::{Kv43Arrays, Kv43Head, Kv43Params};
use std::ops::Range;

fn bad(message: String) -> Error {
    Error::InvalidParameter { what: "kv43 rows", message }
}

/// The slices of `a`'s encoded arrays holding encoded rows `rows` (whole key groups).
fn encoded_slices<'a>(a: &Kv43Arrays<'a>, d: usize, p: Kv43Params, rows: Range<usize>) -> Kv43Arrays<'a> {
    let (r0, r1) = (rows.start, rows.end);
    let parts = d / 64;
    let planes = usize::from(p.value_bits);
    let high = if a.key_high.is_empty() { 0..0 } else { r0 * d / 8..r1 * d / 8 };
    Kv43Arrays {
        rows: r1 - r0,
        key_codes: &a.key_codes[r0 * d / 2..r1 * d / 2],
        key_high: &a.key_high[high],
        key_min: &a.key_min[r0 / p.key_group * d..r1 / p.key_group * d],
        key_scale: &a.key_scale[r0 / p.key_group * d..r1 / p.key_group * d],
        key_sums: &a.key_sums[r0 * parts..r1 * parts],
        value_planes: &a.value_planes[r0 / 8 * planes * d..r1 / 8 * planes * d],
        value_min: &a.value_min[r0 / p.value_block * d..r1 / p.value_block * d],
        value_scale: &a.value_scale[r0 / p.value_block * d..r1 / p.value_block * d],
        tail_keys: &[],
        tail_values: &[],
    }
}

/// Rows `rows` of `head` as a head of their own: `rows.start` a multiple of the key group,
/// `rows.end` one too or the head's last row (the piece then ends in its partial group).
/// The codes are the head's, bit for bit.
pub(crate) fn kv43_piece(head: &Kv43Head, rows: Range<usize>) -> Result<Kv43Head> {
    let (d, p) = (head.head_dim(), head.params());
    let (total, done) = (head.rows(), head.encoded_rows());
    let g = p.key_group;
    let aligned = |r: usize| r.is_multiple_of(g);
    if rows.start > rows.end || rows.end > total || !aligned(rows.start) || !(aligned(rows.end) || rows.end == total) {
        return Err(bad(format!(
            "rows {}..{} of {total} are not whole key groups of {g} (or the rest of the head)",
            rows.start, rows.end
        )));
    }
    let a = head.arrays();
    let coded = rows.start.min(done)..rows.end.min(done);
    let tail = rows.start.max(done) - done..rows.end.max(done) - done;
    let piece = Kv43Arrays {
        tail_keys: &a.tail_keys[tail.start * d..tail.end * d],
        tail_values: &a.tail_values[tail.start * d..tail.end * d],
        ..encoded_slices(&a, d, p, coded)
    };
    Ok(Kv43Head::from_arrays(d, p, piece)?)
}

/// The keys rows `rows` of `head` stand for (encoded rows dequantized, the partial group's
/// f16 rows widened), appended to `out`: only the key groups they lie in are decoded.
pub(crate) fn kv43_keys(head: &Kv43Head, rows: Range<usize>, out: &mut Vec<f32>) -> Result<()> {
    let (d, g, done) = (head.head_dim(), head.params().key_group, head.encoded_rows());
    if rows.start > rows.end || rows.end > head.rows() {
        return Err(bad(format!("rows {}..{} of a head of {}", rows.start, rows.end, head.rows())));
    }
    let coded = rows.start.min(done)..rows.end.min(done);
    if !coded.is_empty() {
        let groups = coded.start / g * g..coded.end.div_ceil(g) * g;
        let (keys, _) = kv43_piece(head, groups.clone())?.dequantize();
        out.extend_from_slice(&keys[(coded.start - groups.start) * d..(coded.end - groups.start) * d]);
    }
    let tail = rows.start.max(done) - done..rows.end.max(done) - done;
    out.extend(head.arrays().tail_keys[tail.start * d..tail.end * d].iter().map(|x| x.to_f32()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnstore_kernels::random::SplitMix64;

    fn head(rows: usize, d: usize, p: Kv43Params, seed: u64) -> Kv43Head {
        let mut g = SplitMix64::new(seed);
        let (k, v) = (g.normals(rows * d), g.normals(rows * d));
        let mut h = Kv43Head::new(d, p).unwrap();
        h.append(&k, &v).unwrap();
        h
    }

    #[test]
    fn pieces_of_whole_key_groups_join_back_to_the_same_head_for_every_layout() {
        let layouts = [
            Kv43Params::default(),
            Kv43Params { key_bits: 5, value_bits: 4, ..Kv43Params::default() },
            Kv43Params { key_bits: 4, value_bits: 3, key_group: 256, value_block: 128 },
        ];
        for (i, p) in layouts.into_iter().enumerate() {
            for (rows, d) in [(1000, 64), (768, 128), (90, 64)] {
                let h = head(rows, d, p, i as u64);
                let per = 2 * p.key_group;
                let pieces: Vec<Kv43Head> = (0..rows.div_ceil(per))
                    .map(|u| kv43_piece(&h, u * per..((u + 1) * per).min(rows)).unwrap())
                    .collect();
                assert_eq!(pieces.iter().map(Kv43Head::rows).sum::<usize>(), rows);
                let refs: Vec<&Kv43Head> = pieces.iter().collect();
                assert_eq!(Kv43Head::join(d, p, &refs).unwrap(), h, "{p:?} rows {rows} d {d}");
                // Each piece's codes stand for the same rows as the head's.
                let (all, _) = h.dequantize();
                let (first, _) = pieces[0].dequantize();
                assert_eq!(first, all[..first.len()]);
            }
        }
    }

    #[test]
    fn the_keys_of_any_rows_are_the_heads_dequantized_keys() {
        let p = Kv43Params::default();
        let (rows, d) = (700, 64);
        let h = head(rows, d, p, 9);
        let (all, _) = h.dequantize();
        for r in [0..1, 5..130, 127..129, 250..700, 640..700, 699..700, 300..300] {
            let mut out = vec![1.0];
            kv43_keys(&h, r.clone(), &mut out).unwrap();
            assert_eq!(out[1..], all[r.start * d..r.end * d], "rows {r:?}");
        }
        assert!(kv43_keys(&h, 600..701, &mut Vec::new()).is_err());
    }

    #[test]
    fn pieces_that_do_not_fit_are_typed_errors() {
        let p = Kv43Params::default();
        let h = head(300, 64, p, 2);
        let why = kv43_piece(&h, 64..256).unwrap_err().to_string();
        assert!(why.contains("not whole key groups of 128"), "{why}");
        assert!(kv43_piece(&h, 128..301).is_err());
        let (a, b) = (kv43_piece(&h, 0..300).unwrap(), kv43_piece(&h, 0..128).unwrap());
        let why = Kv43Head::join(64, p, &[&a, &b]).unwrap_err().to_string();
        assert!(why.contains("partial key group"), "{why}");
        let other = Kv43Params { key_bits: 5, ..p };
        let why = Kv43Head::join(64, other, &[&b]).unwrap_err().to_string();
        assert!(why.contains("expected d = 64"), "{why}");
    }
}
