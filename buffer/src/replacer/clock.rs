//! CLOCK (second chance): a hand sweeps the slots; a slot read since the hand last passed
//! has its reference bit cleared and survives, one not read is evicted.

use super::Replacer;

/// CLOCK.
pub struct Clock {
    tracked: Vec<bool>,
    referenced: Vec<bool>,
    hand: usize,
    len: usize,
}

impl Clock {
    /// An empty policy over `capacity` slots.
    pub fn new(capacity: usize) -> Self {
        Self { tracked: vec![false; capacity], referenced: vec![false; capacity], hand: 0, len: 0 }
    }
}

impl Replacer for Clock {
    fn name(&self) -> &'static str {
        "clock"
    }
    fn capacity(&self) -> usize {
        self.tracked.len()
    }
    fn len(&self) -> usize {
        self.len
    }
    fn insert(&mut self, slot: u32) {
        self.tracked[slot as usize] = true;
        // Not referenced yet: a block admitted and never read again goes on the next sweep.
        self.referenced[slot as usize] = false;
        self.len += 1;
    }
    fn access(&mut self, slot: u32) {
        self.referenced[slot as usize] = true;
    }
    fn remove(&mut self, slot: u32) {
        self.tracked[slot as usize] = false;
        self.len -= 1;
    }
    fn evict(&mut self, accept: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        let capacity = self.tracked.len();
        // Two full sweeps: the first may only clear reference bits; every tracked slot is
        // offered at most twice.
        for _ in 0..2 * capacity {
            let slot = self.hand;
            self.hand = (self.hand + 1) % capacity;
            if !self.tracked[slot] {
                continue;
            }
            if self.referenced[slot] {
                self.referenced[slot] = false;
            } else if accept(slot as u32) {
                self.remove(slot as u32);
                return Some(slot as u32);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_referenced_slot_gets_a_second_chance_and_pinned_slots_are_skipped() {
        let mut r = Clock::new(4);
        (0..4).for_each(|s| r.insert(s));
        r.access(0);
        assert_eq!(r.evict(&mut |_| true), Some(1), "0 was referenced");
        assert_eq!(r.evict(&mut |s| s != 2), Some(3), "2 is pinned");
        assert_eq!(r.evict(&mut |s| s == 2), Some(2));
        assert_eq!(r.evict(&mut |_| false), None, "all refused: terminates");
        assert_eq!(r.len(), 1);
    }
}
