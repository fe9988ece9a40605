//! Segment rows homed in the buffer manager: each cluster of a wave segment is one entry of
//! the cluster mapping table, its rows in whole blocks of `R` tokens each, a block holding
//! the K rows of its tokens followed by their V rows (`[K × R][V × R]`). Rows never straddle
//! a block, so a pinned block is attended in place (no copy unless it was read from Disk,
//! whose staged bytes need not be aligned), one pin serves both K and V, and a GPU kernel
//! addresses K row `r` of slot `s` and its V row with one index (`s·2R + r`, the V pointer
//! `R` rows after the K pointer).

use crate::error::{Error, Result};
use attnstore_buffer::{BlockLocation, BufferManager, ClusterKey, Locations, PinGuard, Reader, Tier};
use attnstore_kernels::cpu::attention::{attend_spans, Scratch};
use attnstore_kernels::{Element, Partial};
use std::ops::Range;
use std::sync::Arc;

/// Where a wave index of one (context, layer) stores its indexed rows: a buffer manager and
/// the key prefix of its clusters. Cluster `c` of KV head `h` is
/// `ClusterKey { context, layer, head: h, cluster: c }`, `c` the directory id.
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
    pub fn context(&self) -> u64 {
        self.context
    }

    /// The layer of its cluster keys.
    pub fn layer(&self) -> u32 {
        self.layer
    }

    pub(crate) fn key(&self, head: usize, cluster: u32) -> ClusterKey {
        ClusterKey { context: self.context, layer: self.layer, head: head as u32, cluster }
    }

    /// Tokens per block (`R`: a K row and a V row of `row_bytes` each per token), or a typed
    /// error when one token's K and V rows do not fit a block.
    pub(crate) fn rows_per_block(&self, row_bytes: usize) -> Result<usize> {
        let block = self.buffers.layout().block_bytes();
        if row_bytes == 0 || 2 * row_bytes > block {
            return Err(Error::InvalidParameter {
                what: "block size",
                message: format!("a token's K and V rows ({row_bytes} bytes each) must fit one block of {block} bytes"),
            });
        }
        Ok(block / (2 * row_bytes))
    }

    /// Stores one cluster's `n × d` key and value rows: block `b` holds the K rows of tokens
    /// `b·R..(b+1)·R`, then their V rows at `R` rows in.
    pub(crate) fn store<E: Element>(
        &self,
        head: usize,
        cluster: u32,
        keys: &[E],
        values: &[E],
        d: usize,
    ) -> Result<()> {
        let row_bytes = d * E::DTYPE.size_bytes();
        let per_block = self.rows_per_block(row_bytes)?;
        let block = self.buffers.layout().block_bytes();
        let n = keys.len() / d;
        let blocks = n.div_ceil(per_block);
        let mut bytes = vec![0u8; blocks * block];
        for (b, (k, v)) in keys.chunks(per_block * d).zip(values.chunks(per_block * d)).enumerate() {
            let at = b * block;
            bytes[at..at + k.len() * E::DTYPE.size_bytes()].copy_from_slice(bytemuck::cast_slice(k));
            let at = at + per_block * row_bytes;
            bytes[at..at + v.len() * E::DTYPE.size_bytes()].copy_from_slice(bytemuck::cast_slice(v));
        }
        self.buffers.store_cluster(self.key(head, cluster), &bytes)?;
        Ok(())
    }

    /// Stores `bytes` as cluster `cluster` of `head` (in whole blocks, the last zero-padded).
    pub(crate) fn store_bytes(&self, head: usize, cluster: u32, bytes: &[u8]) -> Result<()> {
        self.buffers.store_cluster(self.key(head, cluster), bytes)?;
        Ok(())
    }

    /// Frees clusters `ids` of `head` (after a failed build, or when the index is dropped).
    pub(crate) fn free(&self, head: usize, ids: Range<u32>) {
        for c in ids {
            // Nothing executes against an index being dropped or a build being undone, so no
            // block is pinned; a failure here leaks the blocks, which `inspect` shows.
            let _ = self.buffers.free_cluster(self.key(head, c));
        }
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

pub(crate) fn missing(key: &ClusterKey) -> Error {
    Error::MissingRows(format!(
        "cluster {} of head {} (context {}, layer {}) is not in the buffer manager",
        key.cluster, key.head, key.context, key.layer
    ))
}

/// Rows `rows` of one cluster, whose blocks are `locations`.
pub(crate) struct ClusterRows<'l> {
    pub locations: ClusterBlocks<'l>,
    pub rows: Range<usize>,
}

/// A cluster's blocks: as a plan recorded them, or as a lookup finds them now.
#[derive(Clone, Copy)]
pub(crate) enum ClusterBlocks<'l> {
    /// Recorded at planning time (EXPLAIN showed these tiers).
    Recorded(&'l [BlockLocation]),
    /// From the mapping table, each Gpu slot read when the block is pinned.
    Live(Locations<'l>),
}

impl ClusterBlocks<'_> {
    fn len(&self) -> usize {
        match self {
            Self::Recorded(l) => l.len(),
            Self::Live(l) => l.len(),
        }
    }

    fn get(&self, i: usize) -> Option<BlockLocation> {
        match self {
            Self::Recorded(l) => l.get(i).copied(),
            Self::Live(l) => l.get(i),
        }
    }
}

/// A pinned block and the rows of it to attend.
struct Held<'a> {
    block: PinGuard<'a>,
    rows: Range<usize>,
}

/// Attends the rows of `clusters` (pinned through `reader`, Disk reads batched) into `parts`.
pub(crate) fn attend_clusters<E: Element>(
    reader: &Reader<'_>,
    per_block: usize,
    q: &[f32],
    scale: f32,
    clusters: &[ClusterRows<'_>],
    parts: &mut [Partial],
    scratch: &mut Scratch,
) -> Result<()> {
    let d = q.len() / parts.len().max(1);
    let mut wanted = Vec::new();
    let mut rows = Vec::new();
    for c in clusters {
        let last = c.rows.end.div_ceil(per_block).min(c.locations.len());
        for b in c.rows.start / per_block..last {
            let lo = c.rows.start.max(b * per_block) - b * per_block;
            let hi = c.rows.end.min((b + 1) * per_block) - b * per_block;
            wanted.extend(c.locations.get(b));
            rows.push(lo..hi);
        }
    }
    let mut held = Vec::with_capacity(rows.len());
    for (pin, r) in reader.pin_all(&wanted).into_iter().zip(rows) {
        held.push(Held { block: pin?, rows: r });
    }
    // Disk reads are private staged copies that need not be aligned for `E`: copy those.
    let copies: Vec<Vec<E>> = held
        .iter()
        .filter(|h| bytemuck::try_cast_slice::<u8, E>(&h.block).is_err())
        .map(|h| aligned_copy(&h.block))
        .collect();
    let mut copied = copies.iter();
    let spans = held.iter().map(|h| {
        let all: &[E] = match bytemuck::try_cast_slice(&h.block) {
            Ok(all) => all,
            Err(_) => copied.next().expect("one copy per unaligned block"),
        };
        let (k, v) = all.split_at(per_block * d);
        (&k[h.rows.start * d..h.rows.end * d], &v[h.rows.start * d..h.rows.end * d])
    });
    attend_spans(q, scale, spans, parts, scratch);
    Ok(())
}

fn aligned_copy<E: Element>(bytes: &[u8]) -> Vec<E> {
    let n = bytes.len() / E::DTYPE.size_bytes();
    let mut out = vec![E::default(); n];
    bytemuck::cast_slice_mut::<E, u8>(&mut out).copy_from_slice(&bytes[..n * E::DTYPE.size_bytes()]);
    out
}

/// Blocks per tier (`[gpu, host, disk]`) of `locations`, as they were when looked up.
pub fn blocks_per_tier(locations: &[BlockLocation]) -> [usize; 3] {
    let mut out = [0; 3];
    for l in locations {
        out[match l.tier() {
            Tier::Gpu => 0,
            Tier::Host => 1,
            Tier::Disk => 2,
        }] += 1;
    }
    out
}
