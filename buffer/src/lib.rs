//! attnstore-buffer: the buffer manager's vocabulary and its first mechanism.
//!
//! It knows blocks and bytes, not attention. This first piece provides the tiers, the block
//! layout that EXPLAIN counts in, and per-tier memory budgets that turn "too big" into a
//! typed error instead of an abort. Frames, the cluster mapping table, pin guards and the
//! replacement policies build on these (see the buffer-manager issue).

#![deny(unsafe_code)]

mod block;
mod budget;
mod tier;

pub use block::BlockLayout;
pub use budget::{MemoryBudget, Reservation};
pub use tier::Tier;

/// Errors of the buffer manager.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A reservation would exceed the tier's budget.
    #[error("out of {tier} memory: requested {requested_bytes} bytes, {available_bytes} of the {limit_bytes}-byte budget available")]
    OutOfMemory {
        /// The tier whose budget is exhausted.
        tier: Tier,
        /// Bytes asked for.
        requested_bytes: usize,
        /// Bytes still free in the budget.
        available_bytes: usize,
        /// The budget.
        limit_bytes: usize,
    },
    /// A block size that is zero or not a multiple of 64 bytes.
    #[error("block size must be a positive multiple of 64 bytes, got {0}")]
    BadBlockSize(usize),
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
