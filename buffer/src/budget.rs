//! Memory budgets per tier. Every byte of KV a context stores is reserved first; a request
//! over budget fails with [`Error::OutOfMemory`] before anything is allocated.

use crate::{Error, Result, Tier};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A byte budget for one tier, shared by every reservation drawn from it.
#[derive(Debug)]
pub struct MemoryBudget {
    tier: Tier,
    limit_bytes: usize,
    used_bytes: AtomicUsize,
}

impl MemoryBudget {
    /// A budget of `limit_bytes` for `tier` (`usize::MAX` for no limit).
    pub fn new(tier: Tier, limit_bytes: usize) -> Arc<Self> {
        Arc::new(Self { tier, limit_bytes, used_bytes: AtomicUsize::new(0) })
    }

    /// Bytes reserved now.
    pub fn used_bytes(&self) -> usize {
        // Relaxed: a statistic; reservations themselves use compare-exchange.
        self.used_bytes.load(Ordering::Relaxed)
    }

    /// The budget.
    pub fn limit_bytes(&self) -> usize {
        self.limit_bytes
    }

    /// Reserves `bytes`, or fails without reserving anything.
    pub fn reserve(self: &Arc<Self>, bytes: usize) -> Result<Reservation> {
        self.take(bytes)?;
        Ok(Reservation { budget: Arc::clone(self), bytes })
    }

    fn take(&self, bytes: usize) -> Result<()> {
        // Relaxed is enough: the counter guards no other memory, only its own value.
        self.used_bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                used.checked_add(bytes).filter(|&total| total <= self.limit_bytes)
            })
            .map(|_| ())
            .map_err(|used| Error::OutOfMemory {
                tier: self.tier,
                requested_bytes: bytes,
                available_bytes: self.limit_bytes.saturating_sub(used),
                limit_bytes: self.limit_bytes,
            })
    }
}

/// Bytes held against a [`MemoryBudget`]; released when dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<MemoryBudget>,
    bytes: usize,
}

impl Reservation {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Holds `more` bytes in addition, or fails leaving the reservation as it was.
    pub fn grow(&mut self, more: usize) -> Result<()> {
        self.budget.take(more)?;
        self.bytes += more;
        Ok(())
    }
}

impl Reservation {
    /// Takes over the bytes of `other` (drawn from the same budget), so that a batch
    /// reserved up front joins the long-lived reservation only once it is stored.
    ///
    /// Panics if `other` belongs to a different budget (a bug in the caller).
    pub fn absorb(&mut self, mut other: Reservation) {
        assert!(Arc::ptr_eq(&self.budget, &other.budget), "absorb: reservations of different budgets");
        self.bytes += std::mem::take(&mut other.bytes);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.used_bytes.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn over_budget_fails_without_reserving_and_drop_releases() {
        let b = MemoryBudget::new(Tier::Host, 100);
        let mut r = b.reserve(60).unwrap();
        assert!(matches!(
            b.reserve(41),
            Err(Error::OutOfMemory { requested_bytes: 41, available_bytes: 40, limit_bytes: 100, .. })
        ));
        assert_eq!(b.used_bytes(), 60);
        assert!(r.grow(50).is_err());
        assert_eq!(r.bytes(), 60);
        r.grow(40).unwrap();
        assert_eq!(b.used_bytes(), 100);
        drop(r);
        assert_eq!(b.used_bytes(), 0);
        let mut a = b.reserve(10).unwrap();
        a.absorb(b.reserve(5).unwrap());
        assert_eq!((a.bytes(), b.used_bytes()), (15, 15));
        drop(a);
        assert_eq!(b.used_bytes(), 0);
    }
}
