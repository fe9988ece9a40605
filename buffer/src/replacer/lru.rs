//! LRU: evict the slot read least recently. A linked list ordered by last access.

use super::list::SlotList;
use super::Replacer;

/// Least recently used.
pub struct Lru {
    list: SlotList,
    capacity: usize,
}

impl Lru {
    /// An empty policy over `capacity` slots.
    pub fn new(capacity: usize) -> Self {
        Self { list: SlotList::new(capacity), capacity }
    }
}

impl Replacer for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn capacity(&self) -> usize {
        self.capacity
    }
    fn len(&self) -> usize {
        self.list.len()
    }
    fn insert(&mut self, slot: u32) {
        self.list.push_front(slot);
    }
    fn access(&mut self, slot: u32) {
        self.list.unlink(slot);
        self.list.push_front(slot);
    }
    fn remove(&mut self, slot: u32) {
        self.list.unlink(slot);
    }
    fn evict(&mut self, accept: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        // Oldest first; a refused (pinned) slot keeps its place.
        let mut candidate = self.list.back();
        while let Some(slot) = candidate {
            let newer = self.list.newer(slot);
            if accept(slot) {
                self.list.unlink(slot);
                return Some(slot);
            }
            candidate = newer;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_the_least_recently_read_unpinned_slot() {
        let mut r = Lru::new(4);
        (0..4).for_each(|s| r.insert(s));
        r.access(0);
        assert_eq!(r.evict(&mut |s| s != 1), Some(2), "1 is pinned, 2 is next oldest");
        assert_eq!(r.evict(&mut |_| true), Some(1));
        assert_eq!(r.evict(&mut |_| true), Some(3));
        assert_eq!(r.evict(&mut |_| true), Some(0));
        assert_eq!(r.evict(&mut |_| true), None);
    }
}
