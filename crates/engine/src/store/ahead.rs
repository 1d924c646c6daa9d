//! Read-ahead of sequential reads from the object store (issue 22 part 5): when a
//! volume is read in order (a read that starts where one of its recent reads ended, in
//! the volume's own offsets: `Streams`), a read of a given-back segment fetches the rest
//! of that segment's stored part in the same GET (up to `WINDOW_BYTES`), and the records
//! after it are served from memory (`Ahead`). Random reads fetch exactly their record:
//! sequence is judged by the volume's offsets, never by where records happen to lie (two
//! writers' records sit side by side in a segment).
//!
//! Windows are keyed by segment and its opening (`Log::incarnation`): a segment's bytes
//! in the store never change within one opening, so a window never goes stale; a
//! segment reused since is another key. The records served are verified against their
//! pointers' checksums like any copy. At most `WINDOWS` windows are kept (the oldest
//! goes first), so memory stays bounded; a window is dropped once read to its end.
//!
//! Reads served from a window do not count toward bringing their segment back (`cold`):
//! a sequential scan (a backup, a copy) reads each segment once and must not pull the
//! whole volume into the cache.

use std::cell::Cell;
use std::collections::VecDeque;

use parking_lot::Mutex;

use crate::constants::SEGMENT_BYTES;

/// The most one read-ahead fetches (the rest of a segment at most).
pub const WINDOW_BYTES: usize = 1 << 20;

/// Windows kept (bounded memory: `WINDOWS * WINDOW_BYTES`).
pub const WINDOWS: usize = 16;

/// Streams followed per volume: the end of each of its last reads.
const STREAMS: usize = 16;

/// A read this far past where a stream ended still continues it (reads in flight at
/// once arrive out of order).
const STREAM_SLACK: u64 = 256 << 10;

thread_local! {
    /// The read this thread serves continues a stream (`sequential`).
    static SEQUENTIAL: Cell<bool> = const { Cell::new(false) };
}

/// While it lives, reads from the store on this thread read ahead (`Store::remote_read`).
pub struct Sequential(bool);

/// Mark this thread's read as sequential (or not) until the guard drops.
pub fn sequential(on: bool) -> Sequential {
    Sequential(SEQUENTIAL.with(|s| s.replace(on)))
}

impl Drop for Sequential {
    fn drop(&mut self) {
        SEQUENTIAL.with(|s| s.set(self.0));
    }
}

/// Whether this thread's read continues a stream (`sequential`).
pub fn reading_sequentially() -> bool {
    SEQUENTIAL.with(Cell::get)
}

/// How many bytes a read of `len` at `addr` would fetch to read ahead: the rest of its
/// segment, up to `WINDOW_BYTES`.
fn window_len(addr: u64, len: usize) -> usize {
    let seg_end = (segment(addr) as u64 + 1) * SEGMENT_BYTES;
    len.max(WINDOW_BYTES.min((seg_end - addr) as usize))
}

/// The ends of a volume's recent reads, in its own byte offsets.
#[derive(Default)]
pub struct Streams(Mutex<VecDeque<u64>>);

impl Streams {
    /// A read of `offset..end`: whether it continues one of the recent reads.
    pub fn note(&self, offset: u64, end: u64) -> bool {
        let mut ends = self.0.lock();
        if let Some(e) = ends
            .iter_mut()
            .find(|e| **e <= offset && offset < **e + STREAM_SLACK)
        {
            *e = end;
            return true;
        }
        if ends.len() >= STREAMS {
            ends.pop_front();
        }
        ends.push_back(end);
        false
    }
}

struct Window {
    seg: u32,
    opening: u64,
    addr: u64,
    bytes: Vec<u8>,
}

/// Windows of bytes read ahead, and those being fetched.
#[derive(Default)]
pub struct Ahead {
    windows: VecDeque<Window>,
    /// (segment, opening, first byte, end) of windows being fetched: reads inside one do
    /// not read ahead again (reads in flight at once would each fetch the same rest).
    pending: VecDeque<(u32, u64, u64, u64)>,
}

use crate::log::segment_of as segment;

impl Ahead {
    /// `len` bytes at `addr` from a window of `opening`, if one holds them all.
    pub fn take(&mut self, addr: u64, len: usize, opening: u64) -> Option<Vec<u8>> {
        let seg = segment(addr);
        let i = self.windows.iter().position(|w| {
            w.seg == seg
                && w.opening == opening
                && w.addr <= addr
                && addr + len as u64 <= w.addr + w.bytes.len() as u64
        })?;
        let w = &self.windows[i];
        let at = (addr - w.addr) as usize;
        let out = w.bytes[at..at + len].to_vec();
        if at + len == w.bytes.len() {
            self.windows.remove(i);
        }
        Some(out)
    }

    /// How many bytes a read of `len` at `addr` fetches: `len`, or with `sequential` the
    /// rest of its segment, unless a window of it already holds or is fetching that place
    /// (then that one serves what follows). A read ahead is noted as being fetched until
    /// `keep` or `abandon`.
    pub fn plan(&mut self, addr: u64, len: usize, opening: u64, sequential: bool) -> usize {
        if !sequential {
            return len;
        }
        let seg = segment(addr);
        let end = addr + len as u64;
        let covered = self.windows.iter().any(|w| {
            w.seg == seg
                && w.opening == opening
                && w.addr <= end
                && addr < w.addr + w.bytes.len() as u64
        }) || self
            .pending
            .iter()
            .any(|&(s, o, from, to)| s == seg && o == opening && from <= end && addr < to);
        let want = window_len(addr, len);
        if covered || want == len {
            return len;
        }
        if self.pending.len() >= WINDOWS {
            self.pending.pop_front();
        }
        self.pending
            .push_back((seg, opening, end, addr + want as u64));
        want
    }

    /// The fetch that `plan` noted from `addr` (the byte after the read) in the segment's
    /// opening `opening` failed.
    pub fn abandon(&mut self, addr: u64, opening: u64) {
        self.pending.retain(|p| (p.2, p.1) != (addr, opening));
    }

    /// Keep what was fetched past the read (`bytes`, from `addr`) as a window.
    pub fn keep(&mut self, addr: u64, opening: u64, bytes: Vec<u8>) {
        self.abandon(addr, opening);
        if bytes.is_empty() {
            return;
        }
        if self.windows.len() >= WINDOWS {
            self.windows.pop_front();
        }
        self.windows.push_back(Window {
            seg: segment(addr),
            opening,
            addr,
            bytes,
        });
    }

    /// Drop the windows of segment `seg` (their bytes failed a checksum).
    pub fn forget(&mut self, seg: u32) {
        self.windows.retain(|w| w.seg != seg);
    }

    #[cfg(test)]
    pub fn held_bytes(&self) -> usize {
        self.windows.iter().map(|w| w.bytes.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEG: u64 = SEGMENT_BYTES;

    #[test]
    fn only_a_read_continuing_a_stream_reads_ahead() {
        let streams = Streams::default();
        // Random offsets: none continues another.
        for off in [5 << 30, 9 << 20, 2 << 30, 7 << 20] {
            assert!(!streams.note(off, off + 4096));
        }
        // In order, or a little out of order (reads in flight), they do.
        assert!(!streams.note(100 << 20, (100 << 20) + 65536));
        assert!(streams.note((100 << 20) + 65536, (100 << 20) + 131072));
        assert!(streams.note((100 << 20) + 196608, (100 << 20) + 262144));
        // Going back is not continuing.
        assert!(!streams.note(100 << 20, (100 << 20) + 4096));
        // Bounded.
        for i in 0..(STREAMS as u64 * 4) {
            streams.note(i << 32, (i << 32) + 1);
        }
        assert_eq!(streams.0.lock().len(), STREAMS);

        assert!(!reading_sequentially());
        {
            let _s = sequential(true);
            assert!(reading_sequentially());
        }
        assert!(!reading_sequentially(), "the guard dropped");
    }

    #[test]
    fn reads_in_flight_at_once_read_ahead_once() {
        let mut a = Ahead::default();
        let base = 3 * SEG;
        assert_eq!(
            a.plan(base + 8192, 4112, 1, false),
            4112,
            "not sequential: exact"
        );
        // The first of eight 128 KiB reads reads the rest of the segment ahead ...
        let first = a.plan(base, 131072, 1, true);
        assert_eq!(first as u64, SEG);
        // ... and the seven sent with it, inside what it fetches, fetch only themselves.
        for k in 1..8u64 {
            assert_eq!(a.plan(base + k * 131072, 131072, 1, true), 131072);
        }
        // Another opening of the segment is another key; the last bytes of a segment
        // have nothing to read ahead.
        assert_eq!(a.plan(base + 131072, 4096, 2, true) as u64, SEG - 131072);
        assert_eq!(a.plan(5 * SEG - 4096, 4096, 1, true), 4096);
        // A fetch that failed no longer stands in the way; one kept becomes a window.
        a.abandon(base + 131072, 1);
        let again = a.plan(base + 131072, 4096, 1, true);
        assert_eq!(
            again as u64,
            SEG - 131072,
            "the failed fetch no longer covers it"
        );
        let from = base + 131072 + 4096;
        a.keep(from, 1, vec![7; again - 4096]);
        assert_eq!(a.pending.len(), 1, "opening 2's fetch is still under way");
        assert_eq!(
            a.plan(base + 262144, 4096, 1, true),
            4096,
            "the window serves it"
        );
    }

    #[test]
    fn windows_serve_the_records_after_a_read_under_the_same_opening() {
        let mut a = Ahead::default();
        let at = 3 * SEG + 65536;
        let fetched: Vec<u8> = (0..(SEG - 65536) as usize)
            .map(|i| (i % 251) as u8)
            .collect();
        a.keep(at, 7, fetched.clone());
        assert!(a.take(at, 4096, 8).is_none(), "another opening's window");
        assert!(
            a.take(at - 16, 4096, 7).is_none(),
            "bytes before the window"
        );
        assert_eq!(a.take(at, 4096, 7).expect("served"), fetched[..4096]);
        assert!(a.take(at + 4096, 100_000, 7).is_some());
        // Read to its end, the window goes.
        let rest = fetched.len() - 4096 - 100_000;
        assert_eq!(
            a.take(at + 104_096, rest, 7).expect("the rest"),
            fetched[104_096..]
        );
        assert_eq!(a.held_bytes(), 0);
        assert!(a.take(4 * SEG, 16, 7).is_none());
    }

    #[test]
    fn windows_are_bounded_and_forgotten() {
        let mut a = Ahead::default();
        for i in 0..(WINDOWS as u64 * 3) {
            a.keep(i * SEG, 1, vec![0; 4096]);
        }
        assert_eq!(a.held_bytes(), WINDOWS * 4096);
        assert!(a.take(0, 4096, 1).is_none(), "the oldest went first");
        let last = (WINDOWS as u64 * 3 - 1) * SEG;
        a.forget(segment(last));
        assert!(a.take(last, 4096, 1).is_none());
        assert!(a.take(last - SEG, 4096, 1).is_some());
    }
}
