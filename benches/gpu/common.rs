//! Pieces the GPU benches share: their arguments, the GPU (or a clean exit without one), the
//! median of samples, and for the tiered ones (`gpu_tiered`, `gpu_wave`) the Gpu tier's LRU
//! over 16-row blocks, kept by the bench on the host.

use attnstore_kernels::cuda::GpuBackend;
use std::collections::{HashMap, HashSet, VecDeque};

/// The context length from the first argument (default 128K).
pub fn tokens_arg() -> usize {
    std::env::args().nth(1).and_then(|t| t.parse().ok()).unwrap_or(131_072)
}

/// The context lengths from the first argument, comma separated (`default` without one).
pub fn tokens_list_arg(default: &str) -> Vec<usize> {
    std::env::args().nth(1).unwrap_or_else(|| default.into()).split(',').filter_map(|t| t.trim().parse().ok()).collect()
}

/// The GPU with kernels for head_dim 128; without one, says why and exits with 2.
pub fn gpu_or_exit() -> GpuBackend {
    GpuBackend::new(128).unwrap_or_else(|e| {
        eprintln!("no GPU: {e}");
        std::process::exit(2)
    })
}

/// Rows per cached block.
pub const BLOCK: usize = 16;

/// The median of `v` (upper median for an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// LRU over (kv head, block) → first cache row of the block.
pub struct Lru {
    /// Where each cached block starts in the cache.
    pub slot_of: HashMap<(usize, usize), u32>,
    order: VecDeque<(usize, usize)>,
    free: Vec<u32>,
}

impl Lru {
    /// An empty LRU over `blocks` cache blocks starting at cache row `first_row`.
    pub fn new(blocks: usize, first_row: u32) -> Self {
        Self {
            slot_of: HashMap::new(),
            order: VecDeque::new(),
            free: (0..blocks as u32).rev().map(|b| first_row + b * BLOCK as u32).collect(),
        }
    }

    /// Marks a cached block as just used.
    pub fn touch(&mut self, key: (usize, usize)) {
        if let Some(i) = self.order.iter().position(|k| *k == key) {
            self.order.remove(i);
            self.order.push_back(key);
        }
    }

    /// A cache block for `key`, evicting the least recently used one not in `busy`; returns
    /// its first cache row and the evicted block, if any.
    pub fn admit(
        &mut self,
        key: (usize, usize),
        busy: &HashSet<(usize, usize)>,
    ) -> Option<(u32, Option<(usize, usize)>)> {
        let (slot, victim) = match self.free.pop() {
            Some(s) => (s, None),
            None => {
                let i = self.order.iter().position(|k| !busy.contains(k))?;
                let victim = self.order.remove(i)?;
                (self.slot_of.remove(&victim)?, Some(victim))
            }
        };
        self.slot_of.insert(key, slot);
        self.order.push_back(key);
        Some((slot, victim))
    }
}
