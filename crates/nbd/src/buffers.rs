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
    /// Sorted by capacity, largest first: the small buffers of the busiest
    /// requests (4 KiB) are taken from and given back to the end, with no
    /// shift of the others (shifting 128 entries on each take and give
    /// cost 1.8% of the daemon's CPU on 4K random reads).
    bufs: Vec<Vec<u8>>,
    /// The sum of the held buffers' capacities.
    bytes: usize,
}

impl Held {
    /// The number of buffers holding at least `len` bytes; the smallest of
    /// them, if any, is at this index minus one.
    fn fitting(&self, len: usize) -> usize {
        self.bufs.partition_point(|b| b.capacity() >= len)
    }
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

    /// A buffer for `len` bytes: the smallest kept one that holds them (its
    /// old length and bytes kept), or a new empty one with that capacity.
    /// A smaller kept buffer stays on the shelf for a smaller request:
    /// growing it would copy it and touch fresh memory, which is slow here
    /// (~0.4 GiB/s on first touch), and leave the request that fits it
    /// without one.
    pub(crate) fn take(&self, len: usize) -> Vec<u8> {
        let mut held = self.shelf.lock();
        let n = held.fitting(len);
        if n == 0 {
            drop(held);
            return Vec::with_capacity(len);
        }
        let buf = held.bufs.remove(n - 1);
        held.bytes -= buf.capacity();
        buf
    }

    /// Returns a buffer for reuse; oversized or surplus buffers are freed.
    /// When the shelf holds its count of buffers, a larger one takes the
    /// place of the smallest: large buffers are the costly ones to make.
    pub(crate) fn give(&self, buf: Vec<u8>) {
        let cap = buf.capacity();
        if cap == 0 || cap > POOL_BUFFER_BYTES_MAX {
            return;
        }
        let mut held = self.shelf.lock();
        let evicted = if held.bufs.len() < self.shelf.buffers_max {
            None
        } else if held.bufs.last().is_some_and(|b| b.capacity() < cap) {
            held.bufs.pop()
        } else {
            return;
        };
        let freed = evicted.as_ref().map_or(0, Vec::capacity);
        if held.bytes - freed + cap > self.shelf.bytes_max {
            if let Some(e) = evicted {
                held.bufs.push(e);
            }
            return;
        }
        held.bytes = held.bytes - freed + cap;
        let i = held.fitting(cap);
        held.bufs.insert(i, buf);
        drop(held);
        // The evicted buffer, if any, is freed here, outside the lock.
        drop(evicted);
    }
}

impl Shelf {
    /// Frees every kept buffer.
    fn clear(&self) {
        let bufs = {
            let mut held = self.lock();
            held.bytes = 0;
            std::mem::take(&mut held.bufs)
        };
        // Freed outside the lock.
        drop(bufs);
    }
}

/// Gives memory back to the system once connections have closed: with no
/// connection left in the transmission phase (`idle`), the shelf is emptied
/// too; then the allocator returns its free pages (glibc keeps freed
/// memory in per-thread arenas otherwise: 16 connections' replies, once
/// freed, stayed in the daemon's RSS as 436 MiB). Blocking (the trim walks
/// every arena): call it off the async runtime.
pub(crate) fn give_back(idle: bool) {
    if idle {
        PROCESS.clear();
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The held capacities, smallest first; checks the shelf's order and count.
    fn check(shelf: &Shelf) -> Vec<usize> {
        let held = shelf.lock();
        let mut caps: Vec<usize> = held.bufs.iter().map(Vec::capacity).collect();
        assert_eq!(held.bytes, caps.iter().sum::<usize>());
        assert!(
            caps.windows(2).all(|w| w[0] >= w[1]),
            "not sorted largest first: {caps:?}"
        );
        caps.reverse();
        caps
    }

    #[test]
    fn bounded_reuse() {
        static SHELF: Shelf = Shelf::new(8, 64 << 20);
        let pool = BufPool::on(&SHELF);
        assert_eq!(pool.take(0).capacity(), 0);
        let mut b = pool.take(4096);
        assert!(b.capacity() >= 4096);
        b.resize(4096, 7);
        pool.give(b);
        let b = pool.take(4096);
        assert!(b.len() == 4096 && b.capacity() >= 4096 && b[4095] == 7);
        pool.give(Vec::with_capacity(POOL_BUFFER_BYTES_MAX + 1));
        assert!(check(&SHELF).is_empty());
        for _ in 0..8 + 5 {
            pool.give(Vec::with_capacity(16));
        }
        assert_eq!(check(&SHELF), vec![16; 8]);
    }

    /// A request takes the smallest kept buffer that holds it, and leaves
    /// smaller ones for smaller requests. (Taking whichever buffer came back
    /// last, a 1 MiB read was handed a 4 KiB buffer to grow, while the 1 MiB
    /// buffer went to a 4 KiB request.)
    #[test]
    fn a_request_takes_the_smallest_buffer_that_holds_it() {
        static SHELF: Shelf = Shelf::new(16, 64 << 20);
        let pool = BufPool::on(&SHELF);
        for cap in [1 << 20, 4096, 64 << 10, 1 << 20, 4096] {
            pool.give(Vec::with_capacity(cap));
        }
        assert_eq!(check(&SHELF), vec![4096, 4096, 64 << 10, 1 << 20, 1 << 20]);
        assert_eq!(pool.take(1 << 20).capacity(), 1 << 20);
        assert_eq!(pool.take(4096).capacity(), 4096);
        assert_eq!(pool.take(5000).capacity(), 64 << 10);
        assert_eq!(check(&SHELF), vec![4096, 1 << 20]);
        // Nothing kept holds 2 MiB: a new buffer, and the kept ones stay.
        let big = pool.take(2 << 20);
        assert!(big.capacity() >= 2 << 20);
        assert_eq!(check(&SHELF), vec![4096, 1 << 20]);
    }

    /// A shelf at its count keeps the larger buffers; its byte bound holds.
    #[test]
    fn a_full_shelf_keeps_the_larger_buffers() {
        static SHELF: Shelf = Shelf::new(3, (2 << 20) + 8192);
        let pool = BufPool::on(&SHELF);
        for _ in 0..3 {
            pool.give(Vec::with_capacity(4096));
        }
        pool.give(Vec::with_capacity(1 << 20));
        assert_eq!(check(&SHELF), vec![4096, 4096, 1 << 20]);
        pool.give(Vec::with_capacity(1 << 20));
        assert_eq!(check(&SHELF), vec![4096, 1 << 20, 1 << 20]);
        // A third 1 MiB buffer would pass the byte bound: the shelf stays as it was.
        pool.give(Vec::with_capacity(1 << 20));
        assert_eq!(check(&SHELF), vec![4096, 1 << 20, 1 << 20]);
        // No smaller buffer to make room for: a 4 KiB one is freed.
        pool.give(Vec::with_capacity(4096));
        assert_eq!(check(&SHELF), vec![4096, 1 << 20, 1 << 20]);
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
        assert_eq!(check(&SHELF), vec![1 << 20; 3]);
        // A connection that gave nothing takes what another gave.
        let c = BufPool::on(&SHELF);
        let taken = c.take(1 << 20);
        assert_eq!(taken.capacity(), 1 << 20);
        assert_eq!(check(&SHELF), vec![1 << 20; 2]);
        b.give(taken);
        b.give(Vec::with_capacity(1 << 20));
        assert_eq!(check(&SHELF), vec![1 << 20; 3]);
    }
}
