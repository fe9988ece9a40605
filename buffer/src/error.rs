//! The buffer manager's one error type. Every variant says what was expected and what came,
//! so a caller (the engine, a test) can act on it: recompute after `Corrupt` or `Timeout`,
//! spill or refuse after `TierFull`, fix its own bug after `UnknownBlock` or `DoubleFree`.

use crate::{BlockId, Tier};

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
    /// Every slot of a tier is taken (and, for `Host`, no `Disk` tier to spill to).
    #[error("{tier} tier is full: all {capacity_blocks} block slots are in use")]
    TierFull {
        /// The full tier.
        tier: Tier,
        /// Its capacity in blocks.
        capacity_blocks: usize,
    },
    /// A block id that was never allocated or was freed.
    #[error("unknown block {block}")]
    UnknownBlock {
        /// The id asked for.
        block: BlockId,
    },
    /// `free` of a block that was already freed.
    #[error("double free of block {block}")]
    DoubleFree {
        /// The block freed twice.
        block: BlockId,
    },
    /// A payload whose length is not the block size (or not within it).
    #[error("payload of {got} bytes for a block of {expected} bytes")]
    WrongLength {
        /// Bytes a block holds.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// An I/O request whose offset, length or buffer address is not aligned for `O_DIRECT`.
    #[error("unaligned I/O request: {what} is {got}, must be a multiple of {expected_multiple}")]
    Unaligned {
        /// Which part of the request (`offset`, `length`, `buffer address`).
        what: &'static str,
        /// The alignment required.
        expected_multiple: usize,
        /// The value given.
        got: usize,
    },
    /// The block is pinned by a reader: it cannot be evicted, overwritten, spilled or freed now.
    #[error("block {block} is pinned ({pins} pins): cannot {op} it now")]
    Pinned {
        /// The pinned block.
        block: BlockId,
        /// Pins held when the request was refused (0: latched by a concurrent writer).
        pins: u32,
        /// What was refused.
        op: &'static str,
    },
    /// A block read back from disk does not match the crc32c written with it. The block is
    /// treated as missing from then on and never served.
    #[error("block {block} is corrupt on disk: crc32c expected {expected_crc:#010x}, got {got_crc:#010x}")]
    Corrupt {
        /// The corrupt block.
        block: BlockId,
        /// Checksum written with the block.
        expected_crc: u32,
        /// Checksum of the bytes read back.
        got_crc: u32,
    },
    /// No Gpu slot can be reused now: the free ones (and the victim just evicted) are held
    /// back for device reads in flight ([`crate::DeviceRead`]), which may still read them. Not
    /// a failure: they come back when those reads end; retry then.
    #[error("no Gpu slot can be reused now: {quarantined_blocks} slots wait for device reads in flight")]
    DeviceReadsInFlight {
        /// Gpu slots held back.
        quarantined_blocks: usize,
    },
    /// A block lost earlier (corrupt or failed write): its bytes are gone; the caller must
    /// recompute or rewrite it.
    #[error("block {block} is missing: its bytes were lost ({reason})")]
    Missing {
        /// The lost block.
        block: BlockId,
        /// Why it was lost.
        reason: &'static str,
    },
    /// An I/O operation failed (or a fault was injected).
    #[error("I/O error during {op} of block {block:?}: {kind:?}: {message}")]
    Io {
        /// `read`, `write`, `open`, ...
        op: &'static str,
        /// The block, when the operation was for one.
        block: Option<BlockId>,
        /// The error's kind.
        kind: std::io::ErrorKind,
        /// The error's text.
        message: String,
    },
    /// An operation did not finish within its bound.
    #[error("{op} did not complete within {limit_ms} ms")]
    Timeout {
        /// What timed out.
        op: &'static str,
        /// The bound.
        limit_ms: u64,
    },
    /// The block is not in the tier the request needs it in.
    #[error("block {block} is not in the {expected} tier (it is in {got})")]
    WrongTier {
        /// The block.
        block: BlockId,
        /// The tier the request needs.
        expected: Tier,
        /// Where the block is.
        got: Tier,
    },
    /// The block already belongs to a cluster of the mapping table.
    #[error("block {block} already belongs to cluster {cluster:?}")]
    AlreadyAttached {
        /// The block.
        block: BlockId,
        /// The cluster it belongs to.
        cluster: crate::ClusterKey,
    },
    /// A configuration value out of range.
    #[error("bad configuration: {what} must be {expected}, got {got}")]
    BadConfig {
        /// The setting.
        what: &'static str,
        /// The allowed range, in words.
        expected: &'static str,
        /// The value given.
        got: u64,
    },
}

impl Error {
    pub(crate) fn io(op: &'static str, block: Option<BlockId>, error: &std::io::Error) -> Self {
        Error::Io { op, block, kind: error.kind(), message: error.to_string() }
    }
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
