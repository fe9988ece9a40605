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
                or_into_last(&mut out, (block as u32, bits));
                at = end;
            }
        }
        out
    }
}

/// Where each directory cluster of a kv43 layer sits in the layer's device copy, per KV head
/// (heads padded to the largest cluster count with empty clusters): the `(block, mask)`
/// entries of its encoded rows and the side rows holding the rest (rows in a segment's
/// partial key group). Expanding the clusters a step chose through it
/// ([`Kv43ClusterTable::expand`]) gives that step's [`Kv43Lists`] rows, as a device-selected
/// step's expansion would write them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Kv43ClusterTable {
    /// Clusters per KV head.
    pub clusters: usize,
    /// `kv_heads × clusters + 1` offsets into `entries`, head after head.
    pub entry_start: Vec<u32>,
    /// Every cluster's `(block, mask)` entries, blocks ascending within a cluster.
    pub entries: Vec<(u32, u64)>,
    /// Per cluster (`kv_heads × clusters`), its side rows as `(first, count)`.
    pub side: Vec<(u32, u32)>,
}

impl Kv43ClusterTable {
    /// The table of `heads`: per KV head, per cluster in directory order, its rows among
    /// the head's encoded rows in the device copy and its side rows (either may be empty).
    pub fn new(heads: &[Vec<(std::ops::Range<usize>, std::ops::Range<u32>)>]) -> Self {
        let clusters = heads.iter().map(Vec::len).max().unwrap_or(0);
        let mut t = Kv43ClusterTable { clusters, entry_start: vec![0], ..Default::default() };
        for head in heads {
            for c in 0..clusters {
                let (coded, side) = head.get(c).cloned().unwrap_or((0..0, 0..0));
                t.entries.extend(Kv43Lists::block_masks([coded]));
                t.entry_start.push(t.entries.len() as u32);
                t.side.push((side.start, side.end.saturating_sub(side.start)));
            }
        }
        t
    }

    /// KV head `kv_head`'s lists for the clusters `ids` (ids past the table, e.g. a device
    /// selection's padding, add nothing): the blocks their encoded rows touch, ascending, a
    /// block two clusters share once with both masks; and their side rows, ascending.
    pub fn expand(&self, kv_head: usize, ids: &[u32]) -> (Vec<(u32, u64)>, Vec<u32>) {
        let (mut blocks, mut side) = (Vec::new(), Vec::new());
        for &id in ids.iter().filter(|&&id| (id as usize) < self.clusters) {
            let c = kv_head * self.clusters + id as usize;
            blocks.extend_from_slice(&self.entries[self.entry_start[c] as usize..self.entry_start[c + 1] as usize]);
            let (first, count) = self.side[c];
            side.extend(first..first + count);
        }
        blocks.sort_unstable_by_key(|b| b.0);
        let mut merged: Vec<(u32, u64)> = Vec::with_capacity(blocks.len());
        blocks.into_iter().for_each(|b| or_into_last(&mut merged, b));
        side.sort_unstable();
        (merged, side)
    }
}

/// Appends `(block, mask)` to an ascending list, or ORs the mask into the last entry when it
/// is the same block.
fn or_into_last(list: &mut Vec<(u32, u64)>, (block, mask): (u32, u64)) {
    match list.last_mut() {
        Some(last) if last.0 == block => last.1 |= mask,
        _ => list.push((block, mask)),
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

    #[test]
    fn a_cluster_table_expands_chosen_clusters_to_their_blocks_and_side_rows() {
        use super::Kv43ClusterTable;
        // Head 0: three clusters, the second sharing block 1 with the first and holding two
        // side rows; head 1: one cluster (padded to three).
        let t = Kv43ClusterTable::new(&[vec![(0..70, 0..0), (70..100, 5..7), (128..192, 0..0)], vec![(10..20, 0..3)]]);
        assert_eq!((t.clusters, t.entry_start.len(), t.side.len()), (3, 7, 6));
        let low = |n: u32| (1u64 << n) - 1;
        assert_eq!(t.expand(0, &[1, 0]), (vec![(0, u64::MAX), (1, low(36))], vec![5, 6]));
        assert_eq!(t.expand(0, &[2, 7]).0, vec![(2, u64::MAX)], "an id past the table adds nothing");
        assert_eq!(t.expand(1, &[0, 1, 2]), (vec![(0, low(20) & !low(10))], vec![0, 1, 2]));
        assert_eq!(t.expand(1, &[]), (vec![], vec![]));
    }
}
