//! The CUDA [`Backend`]: row blocks read by the decode kernel where the buffer manager keeps
//! them, zero-copy in its pinned Host arena or in the device copy of its Gpu tier, every KV
//! head in one launch. A block is named by its tier and slot; its row `r` is arena (or
//! cache) row `slot · 2R + r`, its value row `R` rows later ([`SharedRows`]).

use super::{GpuBackend, RowRef, SharedRows};
use crate::backend::{check_blocks, Backend, BlockRows};
use crate::error::{Error, Result};
use crate::{AttnShape, Partial};

/// A row block as the device reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaBlock {
    /// Slot of the pinned Host arena (read over the bus, zero-copy).
    Host(u32),
    /// Slot of the Gpu tier's device copy.
    Cache(u32),
}

/// The CUDA backend over the rows `host` (the Host arena) and `cache` (the Gpu tier, when
/// it has a device copy), launched on `gpu`.
pub struct CudaBlocks<'g> {
    gpu: &'g GpuBackend,
    host: SharedRows,
    cache: Option<SharedRows>,
}

impl<'g> CudaBlocks<'g> {
    /// A backend reading `host` and `cache` rows on `gpu`.
    pub fn new(gpu: &'g GpuBackend, host: SharedRows, cache: Option<SharedRows>) -> Self {
        Self { gpu, host, cache }
    }
}

impl Backend for CudaBlocks<'_> {
    type Block<'a> = CudaBlock;

    /// The kernel scales scores by `1/√d`: another `scale` is a typed error.
    fn attend_blocks(
        &mut self,
        q: &[f32],
        scale: f32,
        rows_per_block: usize,
        blocks: &[Vec<BlockRows<CudaBlock>>],
        parts: &mut [Partial],
    ) -> Result<()> {
        if blocks.iter().all(Vec::is_empty) || parts.is_empty() {
            return Ok(());
        }
        let d = q.len() / parts.len();
        if scale != 1.0 / (d as f32).sqrt() {
            return Err(Error::InvalidArgument {
                what: "scale",
                message: format!("the CUDA decode kernel scales by 1/√d = {}, got {scale}", 1.0 / (d as f32).sqrt()),
            });
        }
        check_blocks(blocks, parts.len(), rows_per_block, |_| true)?;
        let stride = 2 * rows_per_block;
        let lists: Vec<Vec<RowRef>> = blocks
            .iter()
            .map(|head| {
                let mut list = Vec::with_capacity(head.len() * rows_per_block);
                for b in head {
                    let (slot, row): (u32, fn(u32) -> RowRef) = match b.block {
                        CudaBlock::Host(slot) => (slot, RowRef::Kv),
                        CudaBlock::Cache(slot) => (slot, RowRef::Cache),
                    };
                    let base = slot as usize * stride;
                    list.extend(b.rows.clone().map(|r| row((base + r) as u32)));
                }
                list
            })
            .collect();
        let shape = AttnShape::new(parts.len(), blocks.len(), d)?;
        let cache_rows = self.cache.map_or(0, |c| c.rows);
        let mut job = self.gpu.prepare_refs(&shape, q, self.host.rows, Some(&lists), cache_rows)?;
        self.gpu.launch_shared(self.host, self.cache, &mut job)?;
        for (p, got) in parts.iter_mut().zip(self.gpu.fetch_partials(&job)?) {
            p.merge(&got);
        }
        Ok(())
    }
}
