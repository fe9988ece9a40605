//! Which rows a sparse kv43 decode on the GPU attends, as plain data (built and checked on
//! any machine; launched by `GpuBackend::launch_kv43_listed` under the `cuda` feature).

/// The rows a sparse kv43 decode attends, per KV head: 64-row blocks of the device copy's
/// encoded rows with a mask of the rows they keep, side rows by index, and partials the host
/// computed (e.g. an estimation zone) to fold in.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Kv43Lists {
    /// Per KV head, `(block, mask)`: block `b` covers the head's encoded rows `64b..64b + 64`
    /// of the device copy, bit `r` of the mask keeps row `64b + r`. Blocks ascend.
    pub blocks: Vec<Vec<(u32, u64)>>,
    /// Per KV head, rows of the `Kv43SideRows` attended (each at most once).
    pub side: Vec<Vec<u32>>,
    /// Host partials per query head, `head_dim + 2` floats each (`Σ e^(s−m)·v`, then `m` and
    /// `Σ e^(s−m)`; `m = −∞` for none), or empty.
    pub extra: Vec<f32>,
}

impl Kv43Lists {
    /// The `(block, mask)` list of sorted, disjoint row `ranges` of one KV head's encoded rows.
    pub fn block_masks(ranges: impl IntoIterator<Item = std::ops::Range<usize>>) -> Vec<(u32, u64)> {
        let mut out: Vec<(u32, u64)> = Vec::new();
        for r in ranges {
            let mut at = r.start;
            while at < r.end {
                let block = at / 64;
                let end = r.end.min((block + 1) * 64);
                let (lo, n) = (at % 64, end - at);
                let bits = if n == 64 { u64::MAX } else { ((1u64 << n) - 1) << lo };
                match out.last_mut() {
                    Some(last) if last.0 as usize == block => last.1 |= bits,
                    _ => out.push((block as u32, bits)),
                }
                at = end;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::Kv43Lists;

    #[test]
    fn block_masks_keep_exactly_the_rows_of_the_ranges() {
        let ranges = [3..5, 60..130, 191..192, 256..320];
        let got = Kv43Lists::block_masks(ranges.clone());
        assert_eq!(got.iter().map(|b| b.0).collect::<Vec<_>>(), [0, 1, 2, 4]);
        let kept: Vec<usize> = got
            .iter()
            .flat_map(|&(b, m)| (0..64).filter(move |r| m >> r & 1 == 1).map(move |r| 64 * b as usize + r))
            .collect();
        assert_eq!(kept, ranges.into_iter().flatten().collect::<Vec<_>>());
        assert_eq!(got[3].1, u64::MAX, "a whole block");
        assert!(Kv43Lists::block_masks(std::iter::empty()).is_empty());
    }
}
