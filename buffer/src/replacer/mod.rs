//! Replacement policies of the Gpu tier's block cache, behind one trait ([`Replacer`]): the
//! policy decides *which* slot to give up, the cache (mechanism) does the moving and checks
//! pins. One file per policy; [`SanityReplacer`] wraps any policy and checks the contract.

mod clock;
mod lfu;
mod list;
mod lru;
mod sanity;
mod sieve;

pub use clock::Clock;
pub use lfu::Lfu;
pub use lru::Lru;
pub use sanity::SanityReplacer;
pub use sieve::Sieve;

use crate::{Error, Result};

/// A replacement policy over the slots `0..capacity` of a cache.
///
/// # Contract
///
/// The caller (the Gpu tier's cache) guarantees:
/// - `insert(slot)` is called only for a slot `< capacity()` that is not tracked now (it was
///   just filled); afterwards it is tracked;
/// - `access(slot)` and `remove(slot)` are called only for tracked slots; after `remove` the
///   slot is no longer tracked;
/// - `accept` (the argument of `evict`) returns `false` for a slot that must stay (pinned by
///   a reader, or latched by a writer) and `true` only after it has taken the slot over.
///
/// The implementation MUST:
/// - in `evict`, offer only tracked slots to `accept`, return the first slot it accepted (or
///   `None`), and stop tracking exactly that slot; a refused slot stays tracked;
/// - terminate: offer each tracked slot a bounded number of times per `evict` (at most
///   twice), so `evict` returns `None` when every slot is refused;
/// - never evict a slot `accept` did not accept — this is how pinned blocks are never evicted;
/// - keep `len()` equal to the number of tracked slots;
/// - do O(1) amortized work per `insert`/`access`/`remove` (O(log n) allowed), no allocation
///   after construction on those paths.
pub trait Replacer: Send {
    /// The policy's name (`lru`, `lfu`, `clock`, `sieve`).
    fn name(&self) -> &'static str;
    /// Number of slots the policy was built for.
    fn capacity(&self) -> usize;
    /// Number of slots tracked now.
    fn len(&self) -> usize;
    /// Whether no slot is tracked.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A slot was filled with a block.
    fn insert(&mut self, slot: u32);
    /// A tracked slot's block was read (a cache hit).
    fn access(&mut self, slot: u32);
    /// A tracked slot was emptied by the cache itself (invalidation, explicit eviction).
    fn remove(&mut self, slot: u32);
    /// Picks a victim: offers candidates in the policy's order to `accept` until one is taken.
    fn evict(&mut self, accept: &mut dyn FnMut(u32) -> bool) -> Option<u32>;
}

/// The policies this crate provides, to choose one per engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplacerKind {
    /// Least recently used.
    Lru,
    /// Least frequently used (ties: least recently used).
    Lfu,
    /// CLOCK (second chance).
    Clock,
    /// SIEVE (Zhang et al., NSDI '24): FIFO with a visited bit and a moving hand.
    Sieve,
}

impl ReplacerKind {
    /// Every policy.
    pub const ALL: [ReplacerKind; 4] = [ReplacerKind::Lru, ReplacerKind::Lfu, ReplacerKind::Clock, ReplacerKind::Sieve];

    /// A fresh policy over `capacity` slots.
    pub fn build(self, capacity: usize) -> Result<Box<dyn Replacer>> {
        if u32::try_from(capacity).is_err() || capacity == u32::MAX as usize {
            return Err(Error::BadConfig { what: "replacer capacity", expected: "< 2^32 - 1", got: capacity as u64 });
        }
        Ok(match self {
            ReplacerKind::Lru => Box::new(Lru::new(capacity)),
            ReplacerKind::Lfu => Box::new(Lfu::new(capacity)),
            ReplacerKind::Clock => Box::new(Clock::new(capacity)),
            ReplacerKind::Sieve => Box::new(Sieve::new(capacity)),
        })
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            ReplacerKind::Lru => "lru",
            ReplacerKind::Lfu => "lfu",
            ReplacerKind::Clock => "clock",
            ReplacerKind::Sieve => "sieve",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u32),
        Access(u32),
        Remove(u32),
        Evict(Vec<u32>),
    }

    fn op(capacity: u32) -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..capacity).prop_map(Op::Insert),
            (0..capacity).prop_map(Op::Access),
            (0..capacity).prop_map(Op::Remove),
            proptest::collection::vec(0..capacity, 0..4).prop_map(Op::Evict),
        ]
    }

    proptest! {
        /// Random operation sequences keep every policy within the contract (checked by the
        /// sanity wrapper); pinned slots (the `Evict` lists) are never returned.
        #[test]
        fn every_policy_keeps_the_contract_and_never_evicts_a_pinned_slot(
            kind in prop::sample::select(ReplacerKind::ALL.to_vec()),
            ops in proptest::collection::vec(op(8), 1..200),
        ) {
            let mut r = SanityReplacer::new(kind.build(8).unwrap());
            for op in ops {
                match op {
                    // The wrapper panics on contract breaks by the caller too: only call validly.
                    Op::Insert(s) if !r.is_tracked(s) => r.insert(s),
                    Op::Access(s) if r.is_tracked(s) => r.access(s),
                    Op::Remove(s) if r.is_tracked(s) => r.remove(s),
                    Op::Evict(pinned) => {
                        let tracked_unpinned = (0..8).filter(|s| r.is_tracked(*s) && !pinned.contains(s)).count();
                        let victim = r.evict(&mut |s| !pinned.contains(&s));
                        prop_assert_eq!(victim.is_some(), tracked_unpinned > 0, "evicts iff some slot is evictable");
                        if let Some(v) = victim { prop_assert!(!pinned.contains(&v)); }
                    }
                    _ => {}
                }
            }
        }
    }
}
