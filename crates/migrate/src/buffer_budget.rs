//! A cap on the frame bytes a destination holds at once, across all the
//! channels and decoders of one receive: a peer that sends many large
//! frames (or claims large decompressed sizes) waits for the decoders
//! instead of making the destination allocate more.
//!
//! Only readers wait on the budget, each holding nothing else of it while
//! it waits; decoders only give back. So readers wait for decoders, never
//! the other way round, and there is no cycle. (Decoders' own output
//! buffers are bounded apart: ≤ 2 MiB each, ≤ 64 decoders.)

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Frame bytes in flight (read, not yet applied) across one receive.
pub const IN_FLIGHT_LIMIT: usize = 256 << 20;
/// Capacity a buffer keeps when it goes back for reuse; larger ones are
/// freed, so idle buffers hold at most this each. A normal frame (256
/// pages and their headers) fits.
pub const KEEP_CAPACITY: usize = 1152 << 10;

/// Bytes reserved for frames in flight, shared by one receive's threads.
#[derive(Debug)]
pub struct BufferBudget {
    limit: usize,
    used: Mutex<usize>,
    freed: Condvar,
}

impl BufferBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Arc<BufferBudget> {
        Arc::new(BufferBudget { limit, used: Mutex::new(0), freed: Condvar::new() })
    }

    /// Reserves `bytes`, waiting while the budget is spent; `stop` is
    /// asked now and then and ends the wait with `None` (the receive
    /// failed). A request larger than the whole budget waits until
    /// nothing else is held. A caller holds nothing else while it waits.
    pub fn reserve(self: &Arc<Self>, bytes: usize, stop: &dyn Fn() -> bool) -> Option<Lease> {
        let mut used = self.used.lock().unwrap();
        while *used > 0 && *used + bytes > self.limit {
            if stop() {
                return None;
            }
            used = self.freed.wait_timeout(used, Duration::from_millis(100)).unwrap().0;
        }
        *used += bytes;
        Some(Lease { budget: self.clone(), bytes })
    }

    /// Bytes reserved now.
    pub fn used(&self) -> usize {
        *self.used.lock().unwrap()
    }

    fn give_back(&self, bytes: usize) {
        let mut used = self.used.lock().unwrap();
        *used -= bytes;
        drop(used);
        self.freed.notify_all();
    }
}

/// Bytes held from a [`BufferBudget`]; given back when dropped.
#[derive(Debug)]
pub struct Lease {
    budget: Arc<BufferBudget>,
    bytes: usize,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.budget.give_back(self.bytes);
    }
}

/// Empties a buffer for reuse, freeing it if it grew past [`KEEP_CAPACITY`].
pub fn recycle(buf: &mut Vec<u8>) {
    buf.clear();
    if buf.capacity() > KEEP_CAPACITY {
        *buf = Vec::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn a_full_budget_waits_for_a_lease_to_drop() {
        let budget = BufferBudget::new(100);
        let first = budget.reserve(70, &|| false).unwrap();
        let b = budget.clone();
        let waiter = std::thread::spawn(move || b.reserve(50, &|| false).map(|l| l.bytes));
        std::thread::sleep(Duration::from_millis(150));
        assert!(!waiter.is_finished(), "70 + 50 bytes must not fit in 100");
        assert_eq!(budget.used(), 70);
        drop(first);
        assert_eq!(waiter.join().unwrap(), Some(50));
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_request_larger_than_the_budget_goes_alone() {
        let budget = BufferBudget::new(100);
        let big = budget.reserve(500, &|| false).unwrap();
        assert_eq!(budget.used(), 500);
        drop(big);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn stop_ends_a_wait() {
        let budget = BufferBudget::new(100);
        let lease = budget.reserve(60, &|| false).unwrap();
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| budget.reserve(60, &|| stop.load(Ordering::Relaxed)).is_none());
            std::thread::sleep(Duration::from_millis(50));
            stop.store(true, Ordering::Relaxed);
            assert!(waiter.join().unwrap(), "a stopped wait returns None");
        });
        assert_eq!(budget.used(), 60);
        drop(lease);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn recycle_frees_only_grown_buffers() {
        let mut small = Vec::with_capacity(4096);
        small.extend_from_slice(&[1, 2, 3]);
        recycle(&mut small);
        assert!(small.is_empty() && small.capacity() >= 4096);
        let mut large = vec![0u8; KEEP_CAPACITY + 1];
        recycle(&mut large);
        assert_eq!(large.capacity(), 0);
    }
}
