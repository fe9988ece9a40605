//! The engine's buffer manager: where the indexed rows of wave contexts live when
//! [`EngineConfig::buffers`](crate::EngineConfig::buffers) is set.

use crate::error::{Error, Result};
use attnstore_buffer::{BlockLayout, BufferConfig, BufferManager, DiskConfig, Maintainer, ReplacerKind};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Settings of the engine's buffer manager (`docs/buffer-manager.md`).
///
/// With them, every segment a wave context builds moves its rows into the buffer manager:
/// one cluster mapping-table entry per cluster, each block holding `R` tokens' K rows then
/// their V rows, in blocks of
/// [`EngineConfig::block`](crate::EngineConfig::block). Plans record the tier of every
/// retrieved block when they are made; EXPLAIN counts blocks and bytes per tier; execution
/// pins the blocks; `Engine::buffer_stats` is what `attnstore inspect` prints. The steady
/// zone (sink, local window, pending tokens) and the cluster directory stay in the index.
/// A `hack2` wave context homes its 2-bit rows instead, one entry per value block of Π
/// rows. Flat and PQ contexts keep their own storage.
#[derive(Debug, Clone, PartialEq)]
pub struct BufferSettings {
    /// Blocks of the Host arena (mapped once at start). It is sized here, not charged to
    /// [`EngineConfig::host_memory_bytes`](crate::EngineConfig::host_memory_bytes), which
    /// counts rows as they arrive.
    pub host_blocks: usize,
    /// Blocks of the Gpu tier's cache (host memory standing in for it without a GPU).
    /// `hack2` rows need a larger share than f16 rows for the same hit ratio: a device step
    /// reads whole value blocks of 64 rows for clusters of ~16, ~10% of a context's 2-bit
    /// blocks per step against ~2% of its f16 blocks (on the H200 a 5% share hit 4.7% of a
    /// 39-context batch's reads, a 30% share 96%; `docs/bench.md`, session 44).
    pub gpu_blocks: usize,
    /// Replacement policy of the Gpu tier.
    pub replacer: ReplacerKind,
    /// Folder for spill files: a context larger than the Host arena spills blocks there
    /// (io_uring, `O_DIRECT`, crc32c per block). `None`: a full arena is a typed error.
    pub spill_dir: Option<PathBuf>,
    /// Run the asynchronous maintainer (admits missed blocks into the Gpu tier, evicts by
    /// policy) with this idle wait (cut short when a device step logs what it read);
    /// `None` leaves the Gpu tier as it is.
    pub maintainer_idle: Option<Duration>,
    /// Pause of the maintainer after every round that did work (zero: none; a device step's
    /// reads end it early, so device steps' misses are admitted about a step later). Bounds its
    /// share of the CPU and of the memory system, like a database background writer's
    /// delay: on the 16-core device host, 100 µs took the plans' p50 cost of a busy
    /// maintainer from 1.27–1.29× to 1.03–1.07× at the same Gpu hit ratio
    /// (`docs/buffer-manager.md`, interleaved plan latency).
    pub maintainer_pause: Duration,
}

impl BufferSettings {
    /// `host_blocks` in the arena, a Gpu cache of 5% of it, CLOCK, no spill folder, a
    /// maintainer that waits 100 µs when idle and pauses 100 µs after each round of work.
    /// Without a GPU the Gpu tier is host memory and admitting into it only costs CPU
    /// (`BufferStats::gpu_on_device` says which): set `maintainer_idle: None` there unless
    /// you are testing replacement policies.
    pub fn new(host_blocks: usize) -> Self {
        Self {
            host_blocks,
            gpu_blocks: host_blocks / 20,
            replacer: ReplacerKind::Clock,
            spill_dir: None,
            maintainer_idle: Some(Duration::from_micros(100)),
            maintainer_pause: Duration::from_micros(100),
        }
    }
}

/// A running buffer manager and its maintainer.
pub(crate) struct Buffers {
    pub manager: Arc<BufferManager>,
    pub maintainer: Option<Maintainer>,
}

impl Buffers {
    pub fn start(settings: &BufferSettings, layout: BlockLayout) -> Result<Self> {
        let mut config = BufferConfig::new(settings.host_blocks, settings.gpu_blocks);
        config.layout = layout;
        config.replacer = settings.replacer;
        config.check_replacer = false;
        config.disk = settings.spill_dir.as_ref().map(DiskConfig::new);
        let manager = Arc::new(BufferManager::new(config)?);
        let maintainer = match settings.maintainer_idle {
            Some(idle) => Some(
                Maintainer::spawn_paced(Arc::clone(&manager), 256, idle, settings.maintainer_pause)
                    .map_err(|e| Error::InvalidSpec(format!("cannot start the buffer maintainer thread: {e}")))?,
            ),
            None => None,
        };
        Ok(Self { manager, maintainer })
    }
}
