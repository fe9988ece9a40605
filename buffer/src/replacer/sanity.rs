//! A wrapper that checks the [`Replacer`] contract around any policy: the caller's side
//! (insert untracked, access/remove tracked) and the policy's side (only tracked slots
//! offered, the returned slot accepted and untracked afterwards, `len` exact, bounded
//! offers). Used by the tests, the fuzz driver and debug builds of the cache.

use super::Replacer;

/// Checks the [`Replacer`] contract; panics with a message naming the broken rule.
pub struct SanityReplacer {
    inner: Box<dyn Replacer>,
    tracked: Vec<bool>,
    len: usize,
}

impl SanityReplacer {
    /// Wraps `inner` (which must track no slot yet).
    pub fn new(inner: Box<dyn Replacer>) -> Self {
        assert_eq!(inner.len(), 0, "sanity: wrap a fresh policy");
        let capacity = inner.capacity();
        Self { inner, tracked: vec![false; capacity], len: 0 }
    }

    /// Whether `slot` is tracked, by the wrapper's own account.
    pub fn is_tracked(&self, slot: u32) -> bool {
        self.tracked.get(slot as usize).copied().unwrap_or(false)
    }

    fn check_len(&self) {
        assert_eq!(self.inner.len(), self.len, "sanity: {} reports a wrong len", self.inner.name());
    }
}

impl Replacer for SanityReplacer {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn capacity(&self) -> usize {
        self.inner.capacity()
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn insert(&mut self, slot: u32) {
        assert!((slot as usize) < self.tracked.len(), "sanity: insert of slot {slot} beyond capacity");
        assert!(!self.tracked[slot as usize], "sanity: caller inserted tracked slot {slot}");
        self.inner.insert(slot);
        self.tracked[slot as usize] = true;
        self.len += 1;
        self.check_len();
    }
    fn access(&mut self, slot: u32) {
        assert!(self.is_tracked(slot), "sanity: caller accessed untracked slot {slot}");
        self.inner.access(slot);
        self.check_len();
    }
    fn remove(&mut self, slot: u32) {
        assert!(self.is_tracked(slot), "sanity: caller removed untracked slot {slot}");
        self.inner.remove(slot);
        self.tracked[slot as usize] = false;
        self.len -= 1;
        self.check_len();
    }
    fn evict(&mut self, accept: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
        let name = self.inner.name();
        let tracked = &self.tracked;
        let mut offers = vec![0u32; tracked.len()];
        let mut accepted = None;
        let victim = self.inner.evict(&mut |slot| {
            assert!(
                tracked.get(slot as usize).copied().unwrap_or(false),
                "sanity: {name} offered untracked slot {slot}"
            );
            assert!(accepted.is_none(), "sanity: {name} kept offering after a slot was accepted");
            offers[slot as usize] += 1;
            assert!(offers[slot as usize] <= 2, "sanity: {name} offered slot {slot} more than twice in one evict");
            let yes = accept(slot);
            if yes {
                accepted = Some(slot);
            }
            yes
        });
        assert_eq!(victim, accepted, "sanity: {name} returned a slot other than the accepted one");
        if let Some(slot) = victim {
            self.tracked[slot as usize] = false;
            self.len -= 1;
        } else {
            let all_offered = self.tracked.iter().zip(&offers).all(|(&t, &n)| !t || n > 0);
            assert!(all_offered, "sanity: {name} gave up without offering every tracked slot");
        }
        self.check_len();
        victim
    }
}
