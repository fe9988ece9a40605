//! attnstore-buffer: the buffer manager. It knows blocks and bytes, not attention.
//!
//! - [`BlockLayout`], [`BlockId`], [`BlockKey`], [`ClusterKey`]: fixed-size blocks (2 KiB by
//!   default), each owned by one (context, layer, head).
//! - Tiers ([`Tier`]): a Host arena of block slots (the home of all KV), a Gpu tier that is a
//!   fixed pool of slots used as a cache, and a Disk tier of segment files ([`DiskTier`],
//!   io_uring + `O_DIRECT`, crc32c per block) for what does not fit.
//! - [`MappingTable`]: (context, layer, head, cluster) → blocks with their tier and slot;
//!   lock-free reads.
//! - [`Replacer`] policies (LRU, LFU, CLOCK, SIEVE) choose Gpu victims; [`Maintainer`] applies
//!   them asynchronously from the plans' access records.
//! - [`BufferManager`] joins them; [`Reader`] and [`PinGuard`] are the plan path;
//!   [`BufferStats`] is what `attnstore inspect` prints. `docs/buffer-manager.md` explains why.
//! - Device-planned reads (a GPU step that picks its clusters on the device, without pins):
//!   [`DeviceSlotTable`] (Host slot → Gpu slot), [`DeviceRead`] (keeps the Gpu slots it may
//!   read from reuse), [`BufferManager::log_cluster_reads`] (what it read, for the maintainer).

#![deny(unsafe_code)]

mod arena;
mod block;
mod budget;
#[cfg(feature = "cuda")]
mod cuda;
mod device_read;
pub mod disk;
mod error;
pub mod fuzz;
mod maintainer;
mod manager;
mod mapping;
pub mod replacer;
mod slot_table;
mod stats;
mod tier;

pub use arena::HostMemoryKind;
pub use block::{BlockId, BlockKey, BlockLayout, ClusterKey};
pub use budget::{MemoryBudget, Reservation};
pub use device_read::DeviceRead;
pub use disk::{DiskConfig, DiskTier, FaultPlan, FaultyIo, IoBackend, IoChoice};
pub use error::{Error, Result};
pub use maintainer::Maintainer;
pub use manager::{BufferConfig, BufferManager, FlaggedReads, LayerReads, PinGuard, Reader, ROUND_ADMISSIONS};
pub use mapping::{BlockLocation, Locations, LocationsIter, MappingReader, MappingTable};
pub use replacer::{Replacer, ReplacerKind};
pub use slot_table::DeviceSlotTable;
pub use stats::{BufferStats, TierStats};
pub use tier::Tier;
