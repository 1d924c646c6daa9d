//! A small per-connection pool of payload buffers.
//!
//! Write payloads and read replies each need a buffer of up to
//! `max_request_bytes`. Reusing them saves an allocation (and, for large
//! buffers, an mmap and page faults) per request. The pool is bounded in
//! count, buffer size and total bytes (`limits.rs`), so an idle connection
//! pins at most `POOL_BYTES_MAX` bytes; and the pools of all connections
//! together hold at most `POOL_BYTES_PROCESS_MAX` (a `Budget`), so a
//! hundred idle connections do not pin 32 MiB each.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::limits::{POOL_BUFFERS_MAX, POOL_BUFFER_BYTES_MAX, POOL_BYTES_MAX, POOL_BYTES_PROCESS_MAX};

/// Bytes pooled by many pools together, and their bound.
pub(crate) struct Budget {
    used: AtomicUsize,
    max: usize,
}

impl Budget {
    pub(crate) const fn new(max: usize) -> Self {
        Self {
            used: AtomicUsize::new(0),
            max,
        }
    }

    /// Takes `bytes` if they fit.
    fn take(&self, bytes: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&n| n <= self.max)
            })
            .is_ok()
    }

    fn give(&self, bytes: usize) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
    }
}

/// The budget every connection's pool draws on.
static PROCESS: Budget = Budget::new(POOL_BYTES_PROCESS_MAX);

pub(crate) struct BufPool {
    bufs: Mutex<Pooled>,
    budget: &'static Budget,
}

impl Default for BufPool {
    fn default() -> Self {
        Self::with_budget(&PROCESS)
    }
}

impl Drop for BufPool {
    fn drop(&mut self) {
        let bytes = self.lock().bytes;
        self.budget.give(bytes);
    }
}

#[derive(Default)]
struct Pooled {
    bufs: Vec<Vec<u8>>,
    /// The sum of the pooled buffers' capacities.
    bytes: usize,
}

impl BufPool {
    pub(crate) fn with_budget(budget: &'static Budget) -> Self {
        Self {
            bufs: Mutex::new(Pooled::default()),
            budget,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Pooled> {
        // The pool holds no invariant a panic could break.
        self.bufs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A buffer: a pooled one (its old length and bytes kept), or a new empty one.
    pub(crate) fn take(&self) -> Vec<u8> {
        let mut p = self.lock();
        let buf = p.bufs.pop().unwrap_or_default();
        p.bytes -= buf.capacity();
        self.budget.give(buf.capacity());
        buf
    }

    /// Returns a buffer for reuse; oversized or surplus buffers are freed.
    pub(crate) fn give(&self, buf: Vec<u8>) {
        if buf.capacity() == 0 || buf.capacity() > POOL_BUFFER_BYTES_MAX {
            return;
        }
        let mut p = self.lock();
        if p.bufs.len() < POOL_BUFFERS_MAX
            && p.bytes + buf.capacity() <= POOL_BYTES_MAX
            && self.budget.take(buf.capacity())
        {
            p.bytes += buf.capacity();
            p.bufs.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_reuse() {
        let pool = BufPool::default();
        assert_eq!(pool.take().capacity(), 0);
        let mut b = pool.take();
        b.resize(4096, 7);
        pool.give(b);
        let b = pool.take();
        assert!(b.len() == 4096 && b.capacity() >= 4096);
        pool.give(Vec::with_capacity(POOL_BUFFER_BYTES_MAX + 1));
        assert_eq!(pool.take().capacity(), 0);
        for _ in 0..POOL_BUFFERS_MAX + 5 {
            pool.give(Vec::with_capacity(16));
        }
        assert_eq!(pool.lock().bufs.len(), POOL_BUFFERS_MAX);
    }

    /// Pools sharing a budget hold no more than it together, and a pool
    /// that is dropped or taken from gives its share back.
    #[test]
    fn pools_share_one_budget() {
        static BUDGET: Budget = Budget::new(3 << 20);
        let (a, b) = (BufPool::with_budget(&BUDGET), BufPool::with_budget(&BUDGET));
        for _ in 0..3 {
            a.give(Vec::with_capacity(1 << 20));
            b.give(Vec::with_capacity(1 << 20));
        }
        let held = |p: &BufPool| p.lock().bytes;
        assert_eq!(held(&a) + held(&b), 3 << 20);
        assert_eq!(BUDGET.used.load(Ordering::SeqCst), 3 << 20);
        let taken = a.take();
        assert_eq!(BUDGET.used.load(Ordering::SeqCst), (3 << 20) - taken.capacity());
        b.give(taken);
        assert_eq!(BUDGET.used.load(Ordering::SeqCst), 3 << 20);
        drop(b);
        assert_eq!(BUDGET.used.load(Ordering::SeqCst), held(&a));
        a.give(Vec::with_capacity(1 << 20));
        assert_eq!(BUDGET.used.load(Ordering::SeqCst), held(&a));
        drop(a);
        assert_eq!(BUDGET.used.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn pooled_bytes_are_bounded() {
        let pool = BufPool::default();
        let big = POOL_BUFFER_BYTES_MAX;
        for _ in 0..POOL_BYTES_MAX / big + 3 {
            pool.give(Vec::with_capacity(big));
        }
        let held = pool.lock().bufs.iter().map(Vec::capacity).sum::<usize>();
        assert!(held <= POOL_BYTES_MAX, "{held} bytes pooled");
        assert!(held > POOL_BYTES_MAX - big, "only {held} bytes pooled");
        // Taking gives the room back.
        let b = pool.take();
        pool.give(Vec::with_capacity(16));
        let p = pool.lock();
        let small = p.bufs.last().map_or(0, Vec::capacity);
        assert_eq!(p.bytes, held - b.capacity() + small);
    }
}
