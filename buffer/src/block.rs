//! The block: the fixed-size unit of storage and transfer (default 2 KiB payload), its id,
//! and the keys that say whose KV it holds: (context, layer, head) per block and
//! (context, layer, head, cluster) per entry of the mapping table.

use crate::{Error, Result};
use std::fmt;

/// Block size and the arithmetic of fitting rows into blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLayout {
    block_bytes: usize,
}

impl Default for BlockLayout {
    fn default() -> Self {
        Self { block_bytes: 2048 }
    }
}

impl BlockLayout {
    /// A layout with `block_bytes` per block (a positive multiple of 64, the cache line).
    pub fn new(block_bytes: usize) -> Result<Self> {
        if block_bytes == 0 || !block_bytes.is_multiple_of(64) {
            return Err(Error::BadBlockSize(block_bytes));
        }
        Ok(Self { block_bytes })
    }

    /// Payload bytes per block.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Blocks needed for a run of `bytes` stored contiguously (one cluster's keys, say).
    pub fn blocks_for(&self, bytes: usize) -> usize {
        bytes.div_ceil(self.block_bytes)
    }
}

/// Hasher of the buffer manager's tables keyed by [`BlockId`] (counters the manager hands
/// out itself, so no adversary chooses them): one multiply by 2^64/φ (Fibonacci hashing),
/// then a rotation, so the low bits the table indexes with come from the product's
/// well-mixed high bits (a product's low bits see only the id's low bits), as rustc's
/// FxHasher does. The default SipHash cost a cold maintenance round a noticeable share of
/// its time (tens of thousands of lookups in the block table).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn finish(&self) -> u64 {
        self.0.rotate_left(26)
    }
}

/// A map keyed by block ids, hashed with [`IdHasher`].
pub(crate) type IdMap<V> = std::collections::HashMap<BlockId, V, std::hash::BuildHasherDefault<IdHasher>>;

/// A set of block ids, hashed with [`IdHasher`].
pub(crate) type IdSet = std::collections::HashSet<BlockId, std::hash::BuildHasherDefault<IdHasher>>;

/// A block's id: unique for the life of a buffer manager, never reused (so a stale
/// reference to a freed block can always be told apart from its slot's next owner).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub(crate) u64);

impl BlockId {
    /// A block id from its raw value, for tools and benches that drive a [`DiskTier`](crate::DiskTier)
    /// directly (a buffer manager only knows the ids its `allocate` returned).
    pub fn from_raw(id: u64) -> Self {
        Self(id)
    }

    /// The raw id (ids start at 1).
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// The owner of a block: one KV head of one layer of one context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey {
    /// Context id (the engine's).
    pub context: u64,
    /// Layer index.
    pub layer: u32,
    /// KV head index.
    pub head: u32,
}

/// A key of the cluster mapping table: one cluster of one head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClusterKey {
    /// Context id.
    pub context: u64,
    /// Layer index.
    pub layer: u32,
    /// KV head index.
    pub head: u32,
    /// Cluster index within the head.
    pub cluster: u32,
}

impl ClusterKey {
    /// The (context, layer, head) that owns the cluster's blocks.
    pub fn block_key(&self) -> BlockKey {
        BlockKey { context: self.context, layer: self.layer, head: self.head }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_round_up_to_whole_blocks_and_bad_sizes_are_rejected() {
        let l = BlockLayout::default();
        assert_eq!((l.blocks_for(0), l.blocks_for(1), l.blocks_for(2048), l.blocks_for(2049)), (0, 1, 1, 2));
        assert_eq!(BlockLayout::new(100), Err(Error::BadBlockSize(100)));
        assert_eq!(BlockLayout::new(0), Err(Error::BadBlockSize(0)));
    }
}
