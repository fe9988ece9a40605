//! A wave index as a GPU decode step reads it when its indexed rows live in a shared arena
//! (the buffer manager's pinned Host blocks) rather than in one array per layer: the cluster
//! meta data, and for every indexed row, in cluster order, the arena row that holds it. The
//! index fills one in ([`ArenaWave::new`] checks it); the CUDA backend uploads it
//! (`GpuBackend::upload_arena_wave`). Plain data, so it exists on every machine.
//!
//! A layer of 2-bit rows (`hack2`) is placed by value blocks instead of rows
//! ([`ArenaWave::new_encoded`], [`ArenaGroups`]): each cluster's rows are a run of its
//! segment's value blocks of Π = 64 rows (the group layout of `HackRows::group_bytes`), each
//! value block spread over a few arena blocks; a device step lists, per retrieved cluster,
//! the value blocks it touches with the mask of its rows in each.

use crate::error::{Error, Result};
use half::f16;

/// The meta index and row placement of one layer's wave index.
///
/// Heads may have different numbers of clusters (k-means drops empty ones); every head is
/// padded to the largest count with empty clusters (size 0, centroid 0), which hold no rows
/// and carry no estimation weight. Every head indexes the same tokens, so each head has
/// `indexed` rows.
#[derive(Debug, Clone, PartialEq)]
pub struct ArenaWave {
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Clusters per head (after padding).
    pub clusters: usize,
    /// Centroids (mean keys), `kv_heads × clusters × head_dim`.
    pub centroids: Vec<f16>,
    /// Mean values, `kv_heads × clusters × head_dim`.
    pub value_means: Vec<f16>,
    /// Tokens per cluster, `kv_heads × clusters`.
    pub sizes: Vec<u32>,
    /// Arena row of every indexed row, `kv_heads × indexed`: head `h`'s clusters in order,
    /// each cluster's rows in storage order. Row `i` of an arena of `R`-token blocks is K row
    /// `i mod 2R` of block `i / 2R` when `i mod 2R < R` (its V row is `R` rows later).
    pub row_map: Vec<u32>,
    /// Indexed rows per head (the sum of each head's sizes).
    pub indexed: usize,
    /// For 2-bit rows, where each cluster's value blocks are (`row_map` is then empty).
    pub groups: Option<ArenaGroups>,
}

/// Arena blocks (pages) one value block may span: 8 of the buffer manager's default 2 KiB
/// blocks hold a group of head dimension 256 (10.5 KiB). `MAX_PAGES` in the CUDA kernels.
pub const GROUP_PAGES: usize = 8;

/// Rows of a value block (Π) the device kernels read.
const GROUP_ROWS: u32 = 64;

/// Where a 2-bit layer's value blocks are in the arena and which of them each cluster
/// touches, built head by head ([`ArenaGroups::push_group`], [`ArenaGroups::push_cluster`],
/// [`ArenaGroups::end_head`]) and checked as it grows.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ArenaGroups {
    /// Bytes of an arena block.
    pub page_bytes: usize,
    /// Every value block's arena blocks, [`GROUP_PAGES`] entries each in its byte order
    /// (−1 past its last).
    pub pages: Vec<i32>,
    /// Rows of every value block (Π, or fewer for a segment's last).
    pub rows: Vec<u32>,
    /// Every value block's id in the buffer manager (numbered per KV head), which a step
    /// reports it read.
    pub ids: Vec<u32>,
    /// Per KV head, the ids' end (one past the highest).
    pub id_end: Vec<u32>,
    /// Per KV head and cluster, the cluster's first piece: `kv_heads × (clusters + 1)`
    /// bounds into `piece_group` / `piece_mask` once padded by [`ArenaWave::new_encoded`].
    pub piece_bounds: Vec<u32>,
    /// Each piece's value block (an index into `rows`).
    pub piece_group: Vec<u32>,
    /// Each piece's rows of its value block (bit `r` = row `r`).
    pub piece_mask: Vec<u64>,
    /// Clusters pushed per head so far (the last head's still open).
    head_clusters: Vec<usize>,
}

impl ArenaGroups {
    /// An empty table over arena blocks of `page_bytes`.
    pub fn new(page_bytes: usize) -> Self {
        Self { page_bytes, head_clusters: vec![0], id_end: vec![0], piece_bounds: vec![0], ..Self::default() }
    }

    fn bad(message: String) -> Error {
        Error::InvalidArgument { what: "arena groups", message }
    }

    /// Adds a value block of `rows` rows (1..=64) whose bytes are in arena blocks `pages`
    /// (1..=[`GROUP_PAGES`] of them, in byte order), the current head's block `id`; returns
    /// its index for [`ArenaGroups::push_cluster`].
    pub fn push_group(&mut self, pages: &[u32], rows: usize, id: u32) -> Result<u32> {
        if pages.is_empty() || pages.len() > GROUP_PAGES || rows == 0 || rows > GROUP_ROWS as usize {
            return Err(Self::bad(format!(
                "a value block needs 1..={GROUP_PAGES} arena blocks and 1..={GROUP_ROWS} rows, got {} and {rows}",
                pages.len()
            )));
        }
        if let Some(p) = pages.iter().find(|&&p| p > i32::MAX as u32) {
            return Err(Self::bad(format!("arena block {p} ≥ 2^31")));
        }
        let index = self.rows.len() as u32;
        self.pages.extend(pages.iter().map(|&p| p as i32));
        self.pages.extend(std::iter::repeat_n(-1, GROUP_PAGES - pages.len()));
        self.rows.push(rows as u32);
        self.ids.push(id);
        let end = self.id_end.last_mut().expect("one entry per head");
        *end = (*end).max(id.saturating_add(1));
        Ok(index)
    }

    /// Adds the current head's next cluster (directory order): rows `rows` of a segment
    /// whose value blocks were pushed from index `first_group` on (row `i` of the segment is
    /// row `i mod 64` of block `first_group + i / 64`).
    pub fn push_cluster(&mut self, first_group: u32, rows: std::ops::Range<u32>) -> Result<()> {
        let mut row = rows.start;
        while row < rows.end {
            let g = first_group as usize + (row / GROUP_ROWS) as usize;
            let in_block = row % GROUP_ROWS;
            let until = (rows.end - row).min(GROUP_ROWS - in_block);
            let Some(&n) = self.rows.get(g) else {
                return Err(Self::bad(format!("row {row} of a cluster is in value block {g}, which was not pushed")));
            };
            if in_block + until > n {
                return Err(Self::bad(format!(
                    "rows {in_block}..{} of value block {g}, which holds {n}",
                    in_block + until
                )));
            }
            let mask = if until == 64 { u64::MAX } else { ((1u64 << until) - 1) << in_block };
            self.piece_group.push(g as u32);
            self.piece_mask.push(mask);
            row += until;
        }
        self.piece_bounds.push(self.piece_group.len() as u32);
        *self.head_clusters.last_mut().expect("one entry per head") += 1;
        Ok(())
    }

    /// Closes the current head: clusters pushed next belong to the next KV head.
    pub fn end_head(&mut self) {
        self.head_clusters.push(0);
        self.id_end.push(0);
        self.piece_bounds.push(self.piece_group.len() as u32);
    }

    /// The most pieces `r` clusters of one head can have (the sum of its `r` largest piece
    /// counts, the largest over heads): the room a step retrieving `r` clusters per head
    /// needs per head. For a table padded by [`ArenaWave::new_encoded`].
    pub fn pieces_for(&self, r: usize) -> usize {
        self.summary().pieces_for(r)
    }

    /// One past the highest arena block named.
    pub fn pages_needed(&self) -> usize {
        self.pages.iter().copied().max().map_or(0, |p| (p + 1).max(0) as usize)
    }

    /// What a device copy of this table needs to keep on the host (sizes and ends, a few
    /// hundred KB at 128K tokens instead of the table's ~2 MB).
    pub fn summary(&self) -> GroupSummary {
        let heads = self.id_end.len().max(1);
        let per_head = (self.piece_bounds.len() / heads).max(1);
        let most_pieces = self
            .piece_bounds
            .chunks(per_head)
            .map(|b| {
                let mut counts: Vec<u32> = b.windows(2).map(|w| w[1] - w[0]).collect();
                counts.sort_unstable_by(|a, b| b.cmp(a));
                std::iter::once(0)
                    .chain(counts.iter().scan(0u32, |sum, &c| {
                        *sum += c;
                        Some(*sum)
                    }))
                    .collect()
            })
            .collect();
        GroupSummary {
            page_bytes: self.page_bytes,
            id_end: self.id_end.clone(),
            pages_needed: self.pages_needed(),
            pieces: self.piece_group.len(),
            bounds: self.piece_bounds.len(),
            most_pieces,
        }
    }

    /// Pads every head to `clusters` clusters (empty ones after its own) and checks that
    /// the table has `kv_heads` heads with `sizes[h]` clusters each; `piece_bounds` then
    /// holds `kv_heads × (clusters + 1)` bounds.
    fn pad(&mut self, kv_heads: usize, clusters: usize, own: &[usize]) -> Result<()> {
        // A head is closed by end_head, the last one may be left open.
        if self.head_clusters.last() == Some(&0) && self.head_clusters.len() > kv_heads {
            self.head_clusters.pop();
            self.id_end.pop();
            self.piece_bounds.pop();
        }
        if self.head_clusters != own {
            return Err(Self::bad(format!(
                "clusters pushed per head {:?}, the directory has {own:?}",
                self.head_clusters
            )));
        }
        let mut bounds = Vec::with_capacity(kv_heads * (clusters + 1));
        let mut at = 0;
        for &n in own {
            let head = &self.piece_bounds[at..at + n + 1];
            bounds.extend_from_slice(head);
            bounds.extend(std::iter::repeat_n(head[n], clusters - n));
            at += n + 1;
        }
        self.piece_bounds = bounds;
        Ok(())
    }
}

/// The host's part of a value-block table copied to the device ([`ArenaGroups::summary`]).
#[derive(Debug, Clone, PartialEq)]
pub struct GroupSummary {
    /// Bytes of an arena block.
    pub page_bytes: usize,
    /// Per KV head, the value-block ids' end ([`ArenaGroups::id_end`]).
    pub id_end: Vec<u32>,
    /// One past the highest arena block named ([`ArenaGroups::pages_needed`]).
    pub pages_needed: usize,
    /// Pieces of every cluster of every head.
    pub pieces: usize,
    /// Entries of [`ArenaGroups::piece_bounds`].
    pub bounds: usize,
    /// Per KV head, entry `r`: the most pieces `r` of its clusters have.
    most_pieces: Vec<Vec<u32>>,
}

impl GroupSummary {
    /// [`ArenaGroups::pieces_for`] of the table this summarizes.
    pub fn pieces_for(&self, r: usize) -> usize {
        self.most_pieces.iter().map(|p| p.get(r).or(p.last()).copied().unwrap_or(0) as usize).max().unwrap_or(0)
    }
}

impl ArenaWave {
    /// Pads each head's clusters (`heads[h]` = (sizes, centroids, value means, arena rows)
    /// of head `h`) to the largest count and checks the shapes: equal indexed rows per head,
    /// `head_dim` values per centroid and mean, one arena row per token, finite meta data.
    pub fn new(head_dim: usize, heads: &[HeadClusters<'_>]) -> Result<Self> {
        Self::build(head_dim, heads, true)
    }

    /// A layer of 2-bit rows: the directory of `heads` (their `rows` empty) with its value
    /// blocks placed by `groups` (one head of clusters per head of `heads`, each cluster
    /// covering exactly its size in rows), padded like the directory.
    pub fn new_encoded(head_dim: usize, heads: &[HeadClusters<'_>], mut groups: ArenaGroups) -> Result<Self> {
        let mut out = Self::build(head_dim, heads, false)?;
        let own: Vec<usize> = heads.iter().map(|h| h.sizes.len()).collect();
        groups.pad(heads.len(), out.clusters, &own)?;
        for (h, head) in heads.iter().enumerate() {
            for (c, &size) in head.sizes.iter().enumerate() {
                let at = h * (out.clusters + 1) + c;
                let rows: u32 = (groups.piece_bounds[at]..groups.piece_bounds[at + 1])
                    .map(|p| groups.piece_mask[p as usize].count_ones())
                    .sum();
                if rows != size {
                    return Err(ArenaGroups::bad(format!(
                        "cluster {c} of head {h} has {size} rows, its value blocks {rows}"
                    )));
                }
            }
        }
        out.groups = Some(groups);
        Ok(out)
    }

    fn build(head_dim: usize, heads: &[HeadClusters<'_>], with_rows: bool) -> Result<Self> {
        let bad = |message: String| Err(Error::InvalidArgument { what: "arena wave", message });
        if head_dim == 0 || heads.is_empty() {
            return bad(format!("needs a head dimension and at least one head, got {head_dim} and {}", heads.len()));
        }
        let clusters = heads.iter().map(|h| h.sizes.len()).max().unwrap_or(0);
        let indexed = heads[0].sizes.iter().map(|&s| s as usize).sum::<usize>();
        if clusters == 0 || indexed == 0 || indexed > i32::MAX as usize {
            return bad(format!("needs 1..2^31 indexed rows in at least one cluster, got {indexed}"));
        }
        let kv_heads = heads.len();
        let mut out = Self {
            kv_heads,
            head_dim,
            clusters,
            centroids: vec![f16::ZERO; kv_heads * clusters * head_dim],
            value_means: vec![f16::ZERO; kv_heads * clusters * head_dim],
            sizes: vec![0; kv_heads * clusters],
            row_map: Vec::with_capacity(if with_rows { kv_heads * indexed } else { 0 }),
            indexed,
            groups: None,
        };
        for (h, head) in heads.iter().enumerate() {
            let n = head.sizes.len();
            let rows = head.sizes.iter().map(|&s| s as usize).sum::<usize>();
            if rows != indexed || head.rows.len() != if with_rows { indexed } else { 0 } {
                return bad(format!(
                    "head {h} has {rows} rows in its clusters and {} arena rows; head 0 has {indexed}",
                    head.rows.len()
                ));
            }
            if head.centroids.len() != n * head_dim || head.value_means.len() != n * head_dim {
                return bad(format!("head {h}: {n} clusters need {} centroid and mean values", n * head_dim));
            }
            if let Some(i) = head.centroids.iter().chain(head.value_means).position(|x| !x.is_finite()) {
                return bad(format!("head {h}: meta data element {i} is not finite"));
            }
            let at = h * clusters * head_dim;
            out.centroids[at..at + n * head_dim].copy_from_slice(head.centroids);
            out.value_means[at..at + n * head_dim].copy_from_slice(head.value_means);
            out.sizes[h * clusters..h * clusters + n].copy_from_slice(head.sizes);
            out.row_map.extend_from_slice(head.rows);
        }
        Ok(out)
    }

    /// Row bounds of every cluster in the head's cluster order, `kv_heads × (clusters + 1)`.
    pub fn offsets(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.kv_heads * (self.clusters + 1));
        for sizes in self.sizes.chunks(self.clusters) {
            let mut at = 0u32;
            out.push(0);
            for &s in sizes {
                at += s;
                out.push(at);
            }
        }
        out
    }

    /// The largest cluster.
    pub fn largest_cluster(&self) -> usize {
        self.sizes.iter().copied().max().unwrap_or(0) as usize
    }

    /// One past the highest arena row named.
    pub fn arena_rows_needed(&self) -> usize {
        self.row_map.iter().copied().max().map_or(0, |r| r as usize + 1)
    }
}

/// One KV head's clusters for [`ArenaWave::new`].
#[derive(Debug, Clone, Copy)]
pub struct HeadClusters<'a> {
    /// Tokens per cluster.
    pub sizes: &'a [u32],
    /// Centroids, `clusters × head_dim`.
    pub centroids: &'a [f16],
    /// Mean values, `clusters × head_dim`.
    pub value_means: &'a [f16],
    /// Arena row of each indexed row, clusters in order.
    pub rows: &'a [u32],
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head<'a>(sizes: &'a [u32], meta: &'a [f16], rows: &'a [u32]) -> HeadClusters<'a> {
        HeadClusters { sizes, centroids: &meta[..sizes.len() * 2], value_means: &meta[..sizes.len() * 2], rows }
    }

    #[test]
    fn heads_are_padded_to_the_largest_cluster_count_and_offsets_follow_the_sizes() {
        let meta = vec![f16::ONE; 6];
        let w = ArenaWave::new(2, &[head(&[2, 1, 1], &meta, &[0, 1, 8, 9]), head(&[3, 1], &meta, &[16, 17, 18, 24])])
            .unwrap();
        assert_eq!((w.clusters, w.indexed), (3, 4));
        assert_eq!(w.sizes, [2, 1, 1, 3, 1, 0]);
        assert_eq!(w.offsets(), [0, 2, 3, 4, 0, 3, 4, 4]);
        assert_eq!(w.centroids[10..12], [f16::ZERO, f16::ZERO], "the padded cluster's centroid is zero");
        assert_eq!((w.largest_cluster(), w.arena_rows_needed()), (3, 25));
    }

    #[test]
    fn bad_shapes_and_meta_data_are_typed_errors() {
        let meta = vec![f16::ONE; 6];
        let nan = vec![f16::NAN; 6];
        for heads in [
            vec![head(&[2], &meta, &[0, 1]), head(&[3], &meta, &[0, 1, 2])], // unequal rows
            vec![head(&[2], &meta, &[0])],                                   // a row missing
            vec![head(&[2], &nan, &[0, 1])],                                 // NaN centroid
            vec![head(&[0], &meta, &[])],                                    // nothing indexed
            vec![],
        ] {
            assert!(matches!(ArenaWave::new(2, &heads), Err(Error::InvalidArgument { .. })));
        }
    }
    #[test]
    fn encoded_clusters_become_value_block_pieces_with_row_masks_padded_per_head() {
        let meta = [f16::ONE; 8];
        let mut g = ArenaGroups::new(2048);
        // Head 0: one segment of 100 rows in two value blocks (64 + 36), three clusters.
        let a = g.push_group(&[5, 6, 7], 64, 0).unwrap();
        g.push_group(&[9, 10], 36, 1).unwrap();
        for rows in [0..10, 10..70, 70..100] {
            g.push_cluster(a, rows).unwrap();
        }
        g.end_head();
        // Head 1: the same rows in one cluster of the first block and one across both.
        let b = g.push_group(&[1, 2, 3], 64, 4).unwrap();
        g.push_group(&[4], 36, 5).unwrap();
        g.push_cluster(b, 0..64).unwrap();
        g.push_cluster(b, 64..100).unwrap();
        let heads = [
            HeadClusters { sizes: &[10, 60, 30], centroids: &meta[..6], value_means: &meta[..6], rows: &[] },
            HeadClusters { sizes: &[64, 36], centroids: &meta[..4], value_means: &meta[..4], rows: &[] },
        ];
        let w = ArenaWave::new_encoded(2, &heads, g.clone()).unwrap();
        let g = w.groups.as_ref().unwrap();
        assert_eq!((w.clusters, w.indexed), (3, 100));
        assert_eq!(g.piece_bounds, [0, 1, 3, 4, 4, 5, 6, 6], "head 1 padded with an empty cluster");
        assert_eq!(g.piece_group, [0, 0, 1, 1, 2, 3]);
        let low = |n: u32| if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
        assert_eq!(g.piece_mask, [low(10), low(64) & !low(10), low(6), low(36) & !low(6), u64::MAX, low(36)]);
        assert_eq!(g.pages[..GROUP_PAGES], [5, 6, 7, -1, -1, -1, -1, -1]);
        assert_eq!((g.id_end.clone(), g.pages_needed()), (vec![2, 6], 11));
        assert_eq!((g.pieces_for(1), g.pieces_for(2), g.pieces_for(9)), (2, 3, 4));
        // What a device copy keeps instead of the table answers as the sum of each head's r
        // largest piece counts, the largest over heads.
        let sum = g.summary();
        let per_head = g.piece_bounds.len() / g.id_end.len();
        for r in 0..12 {
            let want = g
                .piece_bounds
                .chunks(per_head)
                .map(|b| {
                    let mut counts: Vec<u32> = b.windows(2).map(|w| w[1] - w[0]).collect();
                    counts.sort_unstable_by(|a, b| b.cmp(a));
                    counts.iter().take(r).sum::<u32>() as usize
                })
                .max()
                .unwrap();
            assert_eq!(sum.pieces_for(r), want, "r = {r}");
        }
        let sizes = (sum.page_bytes, sum.id_end.clone(), sum.pages_needed, sum.pieces, sum.bounds);
        assert_eq!(sizes, (2048, vec![2, 6], 11, 6, 8));
    }

    #[test]
    fn value_block_tables_that_do_not_match_the_directory_are_typed_errors() {
        let meta = [f16::ONE; 4];
        let head =
            |sizes: &'static [u32]| HeadClusters { sizes, centroids: &meta[..2], value_means: &meta[..2], rows: &[] };
        let mut g = ArenaGroups::new(2048);
        assert!(g.push_group(&[], 64, 0).is_err());
        assert!(g.push_group(&[1; GROUP_PAGES + 1], 64, 0).is_err());
        assert!(g.push_group(&[1], 65, 0).is_err());
        let a = g.push_group(&[1], 40, 0).unwrap();
        assert!(g.push_cluster(a, 30..50).is_err(), "rows past the block's 40");
        assert!(g.push_cluster(a, 60..70).is_err(), "a block never pushed");
        g.push_cluster(a, 0..40).unwrap();
        assert!(matches!(ArenaWave::new_encoded(2, &[head(&[39])], g.clone()), Err(Error::InvalidArgument { .. })));
        assert!(matches!(
            ArenaWave::new_encoded(2, &[head(&[40]), head(&[40])], g.clone()),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(ArenaWave::new_encoded(2, &[head(&[40])], g).is_ok());
    }
}
