//! Where an access method's indexed rows live when it does not keep them itself: a *row
//! home* that the embedding engine provides (its buffer manager). The index names rows by
//! KV head and cluster id and hands their bytes over; the home decides blocks, tiers and
//! pins. So this crate knows vectors, not tiers (DESIGN.md's layering).

use crate::error::{Error, Result};
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// A store for the rows of one (context, layer) that an access method homes outside its
/// own memory.
///
/// Contract:
/// - cluster ids are per KV head; the index never stores an id twice without freeing it;
/// - `store_rows`/`store_bytes` either store the whole cluster or nothing, and fail with
///   [`Error::Home`] (full tiers, I/O) without side effects;
/// - `read` returns each cluster's bytes as stored, in id order, or fails (a corrupt, lost
///   or unreadable block is an error, never data);
/// - `free` never fails visibly: what it cannot free leaks (and the home's inspection
///   shows it), it never loses rows that are still named.
pub trait RowHome: Send + Sync + fmt::Debug {
    /// A typed error when a token's K and V rows of `row_bytes` each cannot be homed (they
    /// must fit one block).
    fn check_row_bytes(&self, row_bytes: usize) -> Result<()>;
    /// Stores one cluster's plain rows as cluster `cluster` of KV head `head`: `keys` and
    /// `values` hold the same number of rows of `row_bytes` each, in row order.
    fn store_rows(&self, head: usize, cluster: u32, keys: &[u8], values: &[u8], row_bytes: usize) -> Result<()>;
    /// Stores opaque `bytes` (a 2-bit value block) as cluster `cluster` of KV head `head`.
    fn store_bytes(&self, head: usize, cluster: u32, bytes: &[u8]) -> Result<()>;
    /// Frees clusters `ids` of KV head `head` (after a failed build, or when the index is
    /// dropped: nothing reads them any more).
    fn free(&self, head: usize, ids: Range<u32>);
    /// Copies of the bytes of clusters `ids` of KV head `head`, each at least as long as
    /// what was stored (blocks are padded), read without disturbing the home's cache (a
    /// scan: checkpoints read every cluster once).
    fn read(&self, head: usize, ids: &[u32]) -> Result<Vec<Vec<u8>>>;
    /// The first `rows` key rows and value rows (`row_bytes` each, as given to
    /// [`RowHome::store_rows`]) of plain cluster `cluster` of KV head `head`, read as a scan
    /// like [`RowHome::read`]. Asking for more rows than the cluster's blocks hold is an error
    /// (rows past those stored but within the last block read as the block's padding).
    fn read_rows(&self, head: usize, cluster: u32, rows: usize, row_bytes: usize) -> Result<(Vec<u8>, Vec<u8>)>;
}

/// A failure of a [`RowHome`], carried through the index unchanged so the engine can
/// report the home's own typed error.
#[derive(Debug, Clone)]
pub struct HomeError(pub Arc<dyn std::error::Error + Send + Sync + 'static>);

impl HomeError {
    /// Wraps the home's error.
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Arc::new(e))
    }
}

impl fmt::Display for HomeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl PartialEq for HomeError {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

impl From<HomeError> for Error {
    fn from(e: HomeError) -> Self {
        Error::Home(e)
    }
}
