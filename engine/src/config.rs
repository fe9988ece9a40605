//! The engine's settings.

use crate::buffers::BufferSettings;
use attnstore_buffer::BlockLayout;

/// Settings of an engine.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Host memory the engine may fill with KV (bytes); beyond it ingest fails with a typed
    /// out-of-memory error.
    pub host_memory_bytes: usize,
    /// Host read bandwidth assumed by the cost model of EXPLAIN (GB/s).
    pub host_read_gbps: f64,
    /// Block size: of the buffer manager's blocks, and used to count blocks in plans.
    pub block: BlockLayout,
    /// A buffer manager homing the indexed rows of wave contexts (`None`: rows stay in the
    /// indexes, as before). See [`BufferSettings`].
    pub buffers: Option<BufferSettings>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self { host_memory_bytes: usize::MAX, host_read_gbps: 10.0, block: BlockLayout::default(), buffers: None }
    }
}
