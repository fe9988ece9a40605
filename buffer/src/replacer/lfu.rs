//! LFU: evict the slot read least often since it was filled; ties go to the one read least
//! recently. An ordered set keyed by (count, last access) gives O(log n) per operation.

use super::Replacer;
use std::collections::BTreeSet;

/// Least frequently used.
pub struct Lfu {
    count: Vec<u32>,
    last: Vec<u64>,
    tracked: Vec<bool>,
    order: BTreeSet<(u32, u64, u32)>,
    tick: u64,
}

impl Lfu {
    /// An empty policy over `capacity` slots.
    pub fn new(capacity: usize) -> Self {
        Self {
            count: vec![0; capacity],
            last: vec![0; capacity],
            tracked: vec![false; capacity],
            order: BTreeSet::new(),
            tick: 0,
        }
    }

    fn key(&self, slot: u32) -> (u32, u64, u32) {
        (self.count[slot as usize], self.last[slot as usize], slot)
    }
}

impl Replacer for Lfu {
    fn name(&self) -> &'static str {
        "lfu"
    }
    fn capacity(&self) -> usize {
        self.count.len()
    }
    fn len(&self) -> usize {
        self.order.len()
    }
    fn insert(&mut self, slot: u32) {
        self.tick += 1;
        let s = slot as usize;
        (self.count[s], self.last[s], self.tracked[s]) = (1, self.tick, true);
        self.order.insert(self.key(slot));
    }
    fn access(&mut self, slot: u32) {
        self.order.remove(&self.key(slot));
        self.tick += 1;
        let s = slot as usize;
        self.count[s] = self.count[s].saturating_add(1);
        self.last[s] = self.tick;
        self.order.insert(self.key(slot));
    }
    fn remove(&mut self, slot: u32) {
        self.order.remove(&self.key(slot));
        self.tracked[slot as usize] = false;
    }
    fn evict(&mut self, accept: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        let victim = self.order.iter().map(|&(_, _, slot)| slot).find(|&slot| accept(slot))?;
        self.remove(victim);
        Some(victim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_the_least_often_read_slot_and_breaks_ties_by_age() {
        let mut r = Lfu::new(4);
        (0..4).for_each(|s| r.insert(s));
        r.access(0);
        r.access(0);
        r.access(1);
        r.access(3);
        // counts: 0→3, 1→2, 2→1, 3→2 (3 read after 1)
        assert_eq!(r.evict(&mut |_| true), Some(2));
        assert_eq!(r.evict(&mut |s| s != 1), Some(3), "1 is pinned");
        assert_eq!(r.evict(&mut |_| true), Some(1));
        assert_eq!(r.len(), 1);
    }
}
