//! A small per-connection pool of payload buffers.
//!
//! Write payloads and read replies each need a buffer of up to
//! `max_request_bytes`. Reusing them saves an allocation (and, for large
//! buffers, an mmap and page faults) per request. The pool is bounded in
//! count, buffer size and total bytes (`limits.rs`), so an idle connection
//! pins at most `POOL_BYTES_MAX` bytes.

use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::limits::{POOL_BUFFERS_MAX, POOL_BUFFER_BYTES_MAX, POOL_BYTES_MAX};

#[derive(Default)]
pub(crate) struct BufPool {
    bufs: Mutex<Pooled>,
}

#[derive(Default)]
struct Pooled {
    bufs: Vec<Vec<u8>>,
    /// The sum of the pooled buffers' capacities.
    bytes: usize,
}

impl BufPool {
    fn lock(&self) -> MutexGuard<'_, Pooled> {
        // The pool holds no invariant a panic could break.
        self.bufs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A buffer: a pooled one (its old length and bytes kept), or a new empty one.
    pub(crate) fn take(&self) -> Vec<u8> {
        let mut p = self.lock();
        let buf = p.bufs.pop().unwrap_or_default();
        p.bytes -= buf.capacity();
        buf
    }

    /// Returns a buffer for reuse; oversized or surplus buffers are freed.
    pub(crate) fn give(&self, buf: Vec<u8>) {
        if buf.capacity() == 0 || buf.capacity() > POOL_BUFFER_BYTES_MAX {
            return;
        }
        let mut p = self.lock();
        if p.bufs.len() < POOL_BUFFERS_MAX && p.bytes + buf.capacity() <= POOL_BYTES_MAX {
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
