//! SIEVE (Zhang et al., "SIEVE is Simpler than LRU", NSDI '24): a FIFO queue with one
//! visited bit per entry and a hand that moves from the oldest entry towards the newest.
//! A hit only sets the bit (no list move, unlike LRU); the hand clears set bits and evicts
//! the first unvisited entry, keeping its position for the next eviction (§3 of the paper).

use super::list::SlotList;
use super::Replacer;

/// SIEVE.
pub struct Sieve {
    list: SlotList,
    visited: Vec<bool>,
    hand: Option<u32>,
}

impl Sieve {
    /// An empty policy over `capacity` slots.
    pub fn new(capacity: usize) -> Self {
        Self { list: SlotList::new(capacity), visited: vec![false; capacity], hand: None }
    }

    /// The entry after `slot` in the hand's direction, wrapping from the newest to the oldest.
    fn step(&self, slot: u32) -> Option<u32> {
        self.list.newer(slot).or_else(|| self.list.back())
    }
}

impl Replacer for Sieve {
    fn name(&self) -> &'static str {
        "sieve"
    }
    fn capacity(&self) -> usize {
        self.visited.len()
    }
    fn len(&self) -> usize {
        self.list.len()
    }
    fn insert(&mut self, slot: u32) {
        self.visited[slot as usize] = false;
        self.list.push_front(slot);
    }
    fn access(&mut self, slot: u32) {
        self.visited[slot as usize] = true;
    }
    fn remove(&mut self, slot: u32) {
        if self.hand == Some(slot) {
            // The hand moves on towards the newer end (the paper's `hand = o.prev`).
            self.hand = self.list.newer(slot);
        }
        self.list.unlink(slot);
    }
    fn evict(&mut self, accept: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        let mut at = self.hand.or_else(|| self.list.back())?;
        // Every entry is passed at most twice: once to clear its bit, once to be offered.
        for _ in 0..2 * self.list.len() {
            if self.visited[at as usize] {
                self.visited[at as usize] = false;
            } else if accept(at) {
                self.hand = Some(at);
                self.remove(at);
                return Some(at);
            }
            at = self.step(at)?;
        }
        self.hand = Some(at);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visited_entries_survive_the_hand_and_new_ones_go_first() {
        let mut r = Sieve::new(4);
        (0..4).for_each(|s| r.insert(s)); // oldest 0 … newest 3
        r.access(0);
        r.access(1);
        assert_eq!(r.evict(&mut |_| true), Some(2), "0 and 1 visited, 2 is the oldest unvisited");
        r.insert(2);
        // The hand stopped at 3 (newer than 2): pinned, so it moves on to the newer, unvisited 2.
        assert_eq!(r.evict(&mut |s| s != 3), Some(2), "new entries go first");
        assert_eq!(r.evict(&mut |_| true), Some(0), "hand wrapped to the oldest; its bit was cleared");
        assert_eq!(r.len(), 2);
        assert_eq!(r.evict(&mut |_| false), None);
    }
}
