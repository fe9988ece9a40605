//! Segment rows homed in the buffer manager: each cluster of a wave segment is one entry of
//! the cluster mapping table, its K rows in whole blocks followed by its V rows in as many
//! blocks. Rows never straddle a block, so a pinned block is attended in place (no copy
//! unless it was read from Disk, whose staged bytes need not be aligned).

use crate::error::{Error, Result};
use attnstore_buffer::{BlockLocation, BufferManager, ClusterKey, PinGuard, Reader, Tier};
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

    pub(crate) fn key(&self, head: usize, cluster: u32) -> ClusterKey {
        ClusterKey { context: self.context, layer: self.layer, head: head as u32, cluster }
    }

    /// Rows of `row_bytes` that fit one block, or a typed error when a row does not fit.
    pub(crate) fn rows_per_block(&self, row_bytes: usize) -> Result<usize> {
        let block = self.buffers.layout().block_bytes();
        if row_bytes == 0 || row_bytes > block {
            return Err(Error::InvalidParameter {
                what: "block size",
                message: format!("a KV row of {row_bytes} bytes must fit one block of {block} bytes"),
            });
        }
        Ok(block / row_bytes)
    }

    /// Stores one cluster's `n × d` key and value rows (K blocks, then V blocks).
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
        let mut bytes = vec![0u8; 2 * blocks * block];
        for (part, rows) in [keys, values].into_iter().enumerate() {
            for (b, chunk) in rows.chunks(per_block * d).enumerate() {
                let at = (part * blocks + b) * block;
                bytes[at..at + chunk.len() * E::DTYPE.size_bytes()].copy_from_slice(bytemuck::cast_slice(chunk));
            }
        }
        self.buffers.store_cluster(self.key(head, cluster), &bytes)?;
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
        let reader = self.buffers.reader();
        let mut found = Vec::with_capacity(keys.len());
        reader.clusters(keys, &mut found);
        let mut out = Vec::new();
        for (key, blocks) in keys.iter().zip(found) {
            out.extend_from_slice(blocks.ok_or_else(|| missing(key))?);
        }
        Ok(out)
    }
}

pub(crate) fn missing(key: &ClusterKey) -> Error {
    Error::MissingRows(format!(
        "cluster {} of head {} (context {}, layer {}) is not in the buffer manager",
        key.cluster, key.head, key.context, key.layer
    ))
}

/// Rows `rows` of one cluster, whose blocks are `locations` (K blocks then V blocks).
pub(crate) struct ClusterRows<'l> {
    pub locations: &'l [BlockLocation],
    pub rows: Range<usize>,
}

/// A pinned K/V block pair and the rows of it to attend.
struct Held<'a> {
    key: PinGuard<'a>,
    value: PinGuard<'a>,
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
        let blocks = c.locations.len() / 2;
        let last = c.rows.end.div_ceil(per_block).min(blocks);
        for b in c.rows.start / per_block..last {
            let lo = c.rows.start.max(b * per_block) - b * per_block;
            let hi = c.rows.end.min((b + 1) * per_block) - b * per_block;
            wanted.push(c.locations[b]);
            wanted.push(c.locations[blocks + b]);
            rows.push(lo..hi);
        }
    }
    let mut pins = reader.pin_all(&wanted).into_iter();
    let mut held = Vec::with_capacity(rows.len());
    for r in rows {
        let (Some(key), Some(value)) = (pins.next(), pins.next()) else { break };
        held.push(Held { key: key?, value: value?, rows: r });
    }
    // Disk reads are private staged copies that need not be aligned for `E`: copy those.
    let mut copies: Vec<(Vec<E>, Vec<E>)> = Vec::new();
    for h in &held {
        if bytemuck::try_cast_slice::<u8, E>(&h.key).is_err() || bytemuck::try_cast_slice::<u8, E>(&h.value).is_err() {
            copies.push((aligned_copy(&h.key), aligned_copy(&h.value)));
        }
    }
    let mut copied = copies.iter();
    let spans = held.iter().map(|h| {
        let (k, v): (&[E], &[E]) = match (bytemuck::try_cast_slice(&h.key), bytemuck::try_cast_slice(&h.value)) {
            (Ok(k), Ok(v)) => (k, v),
            _ => {
                let (k, v) = copied.next().expect("one copy per unaligned pair");
                (k, v)
            }
        };
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
