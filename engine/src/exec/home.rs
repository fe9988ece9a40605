//! Rows homed in the buffer manager: the engine's [`RowHome`]. Each home cluster of a
//! (context, layer) is one entry of the cluster mapping table, its rows in whole blocks of
//! `R` tokens each, a block holding the K rows of its tokens followed by their V rows
//! (`[K × R][V × R]`). Rows never straddle a block, so a pinned block is attended in place
//! (no copy unless it was read from Disk, whose staged bytes need not be aligned), one pin
//! serves both K and V, and a GPU kernel addresses K row `r` of slot `s` and its V row with
//! one index (`s·2R + r`, the V pointer `R` rows after the K pointer). 2-bit value blocks
//! are stored as opaque bytes, one home cluster each.

use crate::error::Result;
use attnstore_buffer::{BlockLocation, BufferManager, ClusterKey};
use attnstore_index::{HomeError, RowHome};
use std::ops::Range;
use std::sync::Arc;

/// Where the indexed rows of one (context, layer) live: a buffer manager and the key prefix
/// of its clusters. Home cluster `c` of KV head `h` is `ClusterKey { context, layer, head:
/// h, cluster: c }`.
#[derive(Clone)]
pub struct BlockStore {
    buffers: Arc<BufferManager>,
    context: u64,
    layer: u32,
}

impl std::fmt::Debug for BlockStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockStore").field("context", &self.context).field("layer", &self.layer).finish()
    }
}

fn home_err(e: attnstore_buffer::Error) -> attnstore_index::Error {
    attnstore_index::Error::Home(HomeError::new(e))
}

impl BlockStore {
    /// Rows of `context`/`layer` in `buffers`. Keys must be unique per live index: the
    /// engine's context ids are never reused.
    pub fn new(buffers: Arc<BufferManager>, context: u64, layer: u32) -> Self {
        Self { buffers, context, layer }
    }

    /// The buffer manager.
    pub fn buffers(&self) -> &Arc<BufferManager> {
        &self.buffers
    }

    /// The context of its cluster keys.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "the GPU executor's"))]
    pub fn context(&self) -> u64 {
        self.context
    }

    /// The layer of its cluster keys.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "the GPU executor's"))]
    pub fn layer(&self) -> u32 {
        self.layer
    }

    /// The mapping-table key of home cluster `cluster` of KV head `head`.
    pub(crate) fn key(&self, head: usize, cluster: u32) -> ClusterKey {
        ClusterKey { context: self.context, layer: self.layer, head: head as u32, cluster }
    }

    /// Tokens per block (`R`: a K row and a V row of `row_bytes` each per token), or a typed
    /// error when one token's K and V rows do not fit a block.
    pub(crate) fn rows_per_block(&self, row_bytes: usize) -> attnstore_index::Result<usize> {
        let block = self.buffers.layout().block_bytes();
        if row_bytes == 0 || 2 * row_bytes > block {
            return Err(attnstore_index::Error::InvalidParameter {
                what: "block size",
                message: format!("a token's K and V rows ({row_bytes} bytes each) must fit one block of {block} bytes"),
            });
        }
        Ok(block / (2 * row_bytes))
    }

    /// The current block lists of `keys` (for plans: the tier each block is served from).
    pub(crate) fn lookup(&self, keys: &[ClusterKey]) -> Result<Vec<BlockLocation>> {
        Ok(self.lookup_counted(keys)?.0)
    }

    /// The current block lists of `keys`, one after another, and how many blocks each has;
    /// a key not in the mapping table is a typed error.
    pub(crate) fn lookup_counted(&self, keys: &[ClusterKey]) -> Result<(Vec<BlockLocation>, Vec<usize>)> {
        let reader = self.buffers.reader();
        let mut found = Vec::with_capacity(keys.len());
        reader.clusters(keys, &mut found);
        let (mut out, mut counts) = (Vec::new(), Vec::with_capacity(keys.len()));
        for (key, blocks) in keys.iter().zip(found) {
            let blocks = blocks.ok_or_else(|| missing(key))?;
            counts.push(blocks.len());
            out.extend(blocks);
        }
        Ok((out, counts))
    }
}

impl RowHome for BlockStore {
    fn check_row_bytes(&self, row_bytes: usize) -> attnstore_index::Result<()> {
        self.rows_per_block(row_bytes).map(|_| ())
    }

    fn store_rows(
        &self,
        head: usize,
        cluster: u32,
        keys: &[u8],
        values: &[u8],
        row_bytes: usize,
    ) -> attnstore_index::Result<()> {
        let per_block = self.rows_per_block(row_bytes)?;
        let block = self.buffers.layout().block_bytes();
        let n = keys.len() / row_bytes;
        let mut bytes = vec![0u8; n.div_ceil(per_block) * block];
        for (b, (k, v)) in keys.chunks(per_block * row_bytes).zip(values.chunks(per_block * row_bytes)).enumerate() {
            let at = b * block;
            bytes[at..at + k.len()].copy_from_slice(k);
            let at = at + per_block * row_bytes;
            bytes[at..at + v.len()].copy_from_slice(v);
        }
        self.buffers.store_cluster(self.key(head, cluster), &bytes).map_err(home_err)?;
        Ok(())
    }

    fn store_bytes(&self, head: usize, cluster: u32, bytes: &[u8]) -> attnstore_index::Result<()> {
        self.buffers.store_cluster(self.key(head, cluster), bytes).map_err(home_err)?;
        Ok(())
    }

    fn free(&self, head: usize, ids: Range<u32>) {
        for c in ids {
            // Nothing executes against an index being dropped or a build being undone, so no
            // block is pinned; a failure here leaks the blocks, which `inspect` shows.
            let _ = self.buffers.free_cluster(self.key(head, c));
        }
    }

    fn read(&self, head: usize, ids: &[u32]) -> attnstore_index::Result<Vec<Vec<u8>>> {
        let keys: Vec<_> = ids.iter().map(|&id| self.key(head, id)).collect();
        let (locations, counts) =
            self.lookup_counted(&keys).map_err(|e| attnstore_index::Error::MissingRows(e.to_string()))?;
        // A scan: a checkpoint reads every cluster once and must not flush the Gpu tier.
        let reader = self.buffers.scan_reader();
        let mut pins = reader.pin_all(&locations).into_iter();
        let mut out = Vec::with_capacity(ids.len());
        for n in counts {
            let mut bytes = Vec::new();
            for _ in 0..n {
                let pin = pins.next().expect("one pin per location").map_err(home_err)?;
                bytes.extend_from_slice(&pin);
            }
            out.push(bytes);
        }
        Ok(out)
    }

    fn read_rows(
        &self,
        head: usize,
        cluster: u32,
        rows: usize,
        row_bytes: usize,
    ) -> attnstore_index::Result<(Vec<u8>, Vec<u8>)> {
        let per_block = self.rows_per_block(row_bytes)?;
        let bytes = self.read(head, &[cluster])?.pop().unwrap_or_default();
        let block = self.buffers.layout().block_bytes();
        if bytes.len() < rows.div_ceil(per_block) * block {
            return Err(attnstore_index::Error::MissingRows(format!(
                "cluster {cluster} of head {head} holds {} bytes, fewer than {rows} rows of {row_bytes} bytes need",
                bytes.len()
            )));
        }
        let (mut keys, mut values) = (Vec::with_capacity(rows * row_bytes), Vec::with_capacity(rows * row_bytes));
        for (b, chunk) in bytes.chunks(block).enumerate().take(rows.div_ceil(per_block)) {
            let n = rows_in_block(rows, b, per_block) * row_bytes;
            keys.extend_from_slice(&chunk[..n]);
            values.extend_from_slice(&chunk[per_block * row_bytes..per_block * row_bytes + n]);
        }
        Ok((keys, values))
    }
}

/// Cuts `found`, the blocks of clusters `(id, rows)` one after another (as a lookup or a
/// plan lists them), into each cluster's blocks; a cluster of `rows` rows has
/// `rows.div_ceil(per_block)` blocks, the last holding the remainder. A list that ends
/// early is a typed error naming the cluster and KV head `kv_head`.
pub(crate) fn blocks_of_clusters(
    found: &[BlockLocation],
    clusters: impl IntoIterator<Item = (u32, usize)>,
    per_block: usize,
    kv_head: usize,
) -> Result<Vec<&[BlockLocation]>> {
    let mut at = 0;
    clusters
        .into_iter()
        .map(|(id, rows)| {
            let n = rows.div_ceil(per_block);
            let blocks = found.get(at..at + n).ok_or_else(|| {
                crate::Error::Index(attnstore_index::Error::MissingRows(format!(
                    "the block list ends before cluster {id} of head {kv_head}"
                )))
            })?;
            at += n;
            Ok(blocks)
        })
        .collect()
}

/// Rows of block `b` of a cluster of `rows` rows (`per_block`, or the remainder for the
/// last).
pub(crate) fn rows_in_block(rows: usize, b: usize, per_block: usize) -> usize {
    (rows - b * per_block).min(per_block)
}

/// The error of a cluster the mapping table does not have.
pub(crate) fn missing(key: &ClusterKey) -> crate::Error {
    crate::Error::Index(attnstore_index::Error::MissingRows(format!(
        "cluster {} of head {} (context {}, layer {}) is not in the buffer manager",
        key.cluster, key.head, key.context, key.layer
    )))
}

/// Blocks per tier (`[gpu, host, disk]`) of `locations`, as they were when looked up.
pub fn blocks_per_tier(locations: &[BlockLocation]) -> [usize; 3] {
    let mut out = [0; 3];
    for l in locations {
        out[l.tier().index()] += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use attnstore_buffer::BufferConfig;

    #[test]
    fn plain_rows_read_back_as_stored_and_a_short_cluster_is_a_typed_error() {
        let config = BufferConfig { pinned_host: false, ..BufferConfig::new(64, 0) };
        let store = BlockStore::new(Arc::new(BufferManager::new(config).unwrap()), 7, 3);
        // 96-byte rows: 10 per 2 KiB block, so 23 rows span three blocks, the last partly.
        let row_bytes = 96;
        let rows = 23;
        let keys: Vec<u8> = (0..rows * row_bytes).map(|i| (i % 251) as u8).collect();
        let values: Vec<u8> = (0..rows * row_bytes).map(|i| (i % 241) as u8 ^ 0x5a).collect();
        store.store_rows(1, 4, &keys, &values, row_bytes).unwrap();
        let (k, v) = store.read_rows(1, 4, rows, row_bytes).unwrap();
        assert_eq!((k, v), (keys.clone(), values.clone()));
        let (k, v) = store.read_rows(1, 4, 11, row_bytes).unwrap();
        assert_eq!((&k[..], &v[..]), (&keys[..11 * row_bytes], &values[..11 * row_bytes]));
        assert!(matches!(store.read_rows(1, 4, 31, row_bytes), Err(attnstore_index::Error::MissingRows(_))));
        assert!(matches!(store.read_rows(1, 5, 1, row_bytes), Err(attnstore_index::Error::MissingRows(_))));
    }

    #[test]
    fn a_block_list_is_cut_per_cluster_and_a_short_one_names_the_cluster() {
        let config = BufferConfig { pinned_host: false, ..BufferConfig::new(64, 0) };
        let store = BlockStore::new(Arc::new(BufferManager::new(config).unwrap()), 1, 0);
        // 96-byte rows, 10 per block: clusters of 23, 10 and 1 rows have 3, 1 and 1 blocks.
        let sizes = [(4u32, 23usize), (9, 10), (2, 1)];
        for &(id, n) in &sizes {
            store.store_rows(0, id, &vec![1; n * 96], &vec![2; n * 96], 96).unwrap();
        }
        let found = store.lookup(&sizes.map(|(id, _)| store.key(0, id))).unwrap();
        let cut = blocks_of_clusters(&found, sizes, 10, 0).unwrap();
        assert_eq!(cut.iter().map(|b| b.len()).collect::<Vec<_>>(), [3, 1, 1]);
        assert_eq!(cut.concat(), found);
        assert_eq!([0, 1, 2].map(|b| rows_in_block(23, b, 10)), [10, 10, 3]);
        let err = blocks_of_clusters(&found[..4], sizes, 10, 0).unwrap_err();
        assert!(err.to_string().contains("before cluster 2 of head 0"), "{err}");
    }
}
