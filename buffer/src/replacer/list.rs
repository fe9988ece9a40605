//! A doubly linked list over slot numbers kept in two arrays (no allocation after
//! construction), shared by the list-ordered policies (LRU, SIEVE). Front = newest.

const NIL: u32 = u32::MAX;

pub(crate) struct SlotList {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl SlotList {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            prev: vec![NIL; capacity],
            next: vec![NIL; capacity],
            linked: vec![false; capacity],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn push_front(&mut self, slot: u32) {
        debug_assert!(!self.linked[slot as usize], "slot {slot} linked twice");
        let s = slot as usize;
        self.prev[s] = NIL;
        self.next[s] = self.head;
        if self.head != NIL {
            self.prev[self.head as usize] = slot;
        } else {
            self.tail = slot;
        }
        self.head = slot;
        self.linked[s] = true;
        self.len += 1;
    }

    pub(crate) fn unlink(&mut self, slot: u32) {
        debug_assert!(self.linked[slot as usize], "slot {slot} not linked");
        let s = slot as usize;
        let (p, n) = (self.prev[s], self.next[s]);
        if p != NIL {
            self.next[p as usize] = n;
        } else {
            self.head = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        } else {
            self.tail = p;
        }
        self.linked[s] = false;
        self.len -= 1;
    }

    /// The oldest slot.
    pub(crate) fn back(&self) -> Option<u32> {
        (self.tail != NIL).then_some(self.tail)
    }

    /// The next newer slot than `slot` (towards the front).
    pub(crate) fn newer(&self, slot: u32) -> Option<u32> {
        let p = self.prev[slot as usize];
        (p != NIL).then_some(p)
    }
}
