//! Where a block lives.

use std::fmt;

/// A storage tier of the buffer manager.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// GPU memory: a cache of blocks.
    Gpu,
    /// Pinned (or, without CUDA, ordinary) host memory: the home of all KV.
    Host,
    /// NVMe: spill and durability.
    Disk,
}

impl Tier {
    /// All tiers, fastest first.
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Host, Tier::Disk];

    /// Position in [`Tier::ALL`] (0 gpu, 1 host, 2 disk): the index of per-tier arrays.
    pub fn index(self) -> usize {
        self as usize
    }

    /// Lower-case name (`gpu`, `host`, `disk`).
    pub fn name(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
