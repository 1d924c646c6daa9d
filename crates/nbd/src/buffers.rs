//! Payload buffers kept for reuse, shared by every connection.
//!
//! Write payloads and read replies each need a buffer of up to
//! `max_request_bytes`. Reusing them saves an allocation (and, for large
//! buffers, an mmap, page faults and a zero-fill) per request. The buffers
//! wait on one shelf for the whole process, bounded in count, buffer size
//! and total bytes (`limits.rs`): an idle connection holds none, and the
//! busy ones share them. (Per-connection pools of up to 32 MiB each once
//! let 20 idle connections pin 660 MB; capping those pools together let
//! the first busy connections keep every pooled byte from the rest.)

use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::limits::{POOL_BUFFERS_MAX, POOL_BUFFER_BYTES_MAX, POOL_BYTES_MAX};

/// The buffers waiting for reuse, and their bounds.
pub(crate) struct Shelf {
    held: Mutex<Held>,
    buffers_max: usize,
    bytes_max: usize,
}

struct Held {
    bufs: Vec<Vec<u8>>,
    /// The sum of the held buffers' capacities.
    bytes: usize,
}

impl Shelf {
    pub(crate) const fn new(buffers_max: usize, bytes_max: usize) -> Self {
        Self {
            held: Mutex::new(Held {
                bufs: Vec::new(),
                bytes: 0,
            }),
            buffers_max,
            bytes_max,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Held> {
        // The shelf holds no invariant a panic could break.
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The shelf of the process.
static PROCESS: Shelf = Shelf::new(POOL_BUFFERS_MAX, POOL_BYTES_MAX);

/// A connection's handle on a shelf.
pub(crate) struct BufPool {
    shelf: &'static Shelf,
}

impl Default for BufPool {
    fn default() -> Self {
        Self::on(&PROCESS)
    }
}

impl BufPool {
    pub(crate) fn on(shelf: &'static Shelf) -> Self {
        Self { shelf }
    }

    /// A buffer: a kept one (its old length and bytes kept), or a new empty one.
    pub(crate) fn take(&self) -> Vec<u8> {
        let mut held = self.shelf.lock();
        let buf = held.bufs.pop().unwrap_or_default();
        held.bytes -= buf.capacity();
        buf
    }

    /// Returns a buffer for reuse; oversized or surplus buffers are freed.
    pub(crate) fn give(&self, buf: Vec<u8>) {
        if buf.capacity() == 0 || buf.capacity() > POOL_BUFFER_BYTES_MAX {
            return;
        }
        let mut held = self.shelf.lock();
        if held.bufs.len() < self.shelf.buffers_max
            && held.bytes + buf.capacity() <= self.shelf.bytes_max
        {
            held.bytes += buf.capacity();
            held.bufs.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_reuse() {
        static SHELF: Shelf = Shelf::new(8, 64 << 20);
        let pool = BufPool::on(&SHELF);
        assert_eq!(pool.take().capacity(), 0);
        let mut b = pool.take();
        b.resize(4096, 7);
        pool.give(b);
        let b = pool.take();
        assert!(b.len() == 4096 && b.capacity() >= 4096);
        pool.give(Vec::with_capacity(POOL_BUFFER_BYTES_MAX + 1));
        assert_eq!(pool.take().capacity(), 0);
        for _ in 0..8 + 5 {
            pool.give(Vec::with_capacity(16));
        }
        assert_eq!(SHELF.lock().bufs.len(), 8);
    }

    /// Connections share one shelf: what one gives back, another takes,
    /// and together they keep no more than its bound.
    #[test]
    fn connections_share_one_bounded_shelf() {
        static SHELF: Shelf = Shelf::new(64, 3 << 20);
        let (a, b) = (BufPool::on(&SHELF), BufPool::on(&SHELF));
        for _ in 0..3 {
            a.give(Vec::with_capacity(1 << 20));
            b.give(Vec::with_capacity(1 << 20));
        }
        assert_eq!(SHELF.lock().bytes, 3 << 20);
        assert_eq!(SHELF.lock().bufs.len(), 3);
        // A connection that gave nothing takes what another gave.
        let c = BufPool::on(&SHELF);
        let taken = c.take();
        assert_eq!(taken.capacity(), 1 << 20);
        assert_eq!(SHELF.lock().bytes, 2 << 20);
        b.give(taken);
        b.give(Vec::with_capacity(1 << 20));
        let held = SHELF.lock();
        assert_eq!(held.bytes, 3 << 20);
        assert_eq!(held.bytes, held.bufs.iter().map(Vec::capacity).sum::<usize>());
    }
}
