//! The block: the fixed-size unit of storage and transfer (default 2 KiB payload).

use crate::{Error, Result};

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
