//! Log: the pool's address space cut into segments, appended to, and reclaimed.
//!
//! New data never overwrites live data: every record is appended at a head (an
//! open segment). Four heads keep streams apart: client data, blocks relocated
//! by the cleaner (cold data stays together), metadata, and second copies of
//! metadata (so the two copies of a map node never share a segment).
//!
//! Each segment has a count of live bytes: bytes of records that the current
//! in-memory state references. A segment whose count falls to zero is not free
//! yet: the last *committed* state may still reference it. Commit collects the
//! zero segments before it writes, and releases them only after its superblock
//! is durable (`zero_sealed` / `release`).
//!
//! Invariant: a segment in state `Free` holds nothing that any committed or
//! in-memory pointer references.
//!
//! Reuse is most-recently-released first: a segment freed by the last commit
//! was written not long ago, so its pages are likely still in the page cache,
//! and rewriting cached pages costs a copy where fresh ones cost an allocation
//! (first touch of memory is slow on virtual machines). Never-used segments
//! are taken lowest first. Writers wake the committer early once
//! `release_commit_segments` client-data segments have emptied (metadata
//! segments are emptied by commits themselves: counting them would have each
//! commit call the next), so a sustained overwrite
//! recycles a bounded set of segments instead of walking the whole device.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use parking_lot::{Condvar, Mutex};

use crate::constants::{
    RECORD_ALIGN, RELEASE_COMMIT_SEGMENTS_MAX, SEGMENTS_RESERVED, SEGMENT_BYTES,
};
use crate::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Data = 0,
    Clean = 1,
    Meta = 2,
    /// Second copies of metadata: never in the same segment as the first.
    Meta2 = 3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SegState {
    Free,
    Open,
    Sealed,
}

struct Inner {
    free: BTreeSet<u32>,
    /// Free segments in the order `release` freed them; taken from the end first. Every entry
    /// is in `free` (only `alloc_run` takes segments, from here while any are left).
    recent: Vec<u32>,
    state: Vec<SegState>,
    heads: [Option<(u32, u32)>; 4],
    /// One past the highest segment ever allocated (persisted at commit).
    high_water: u32,
}

pub struct Log {
    segments: u32,
    live: Vec<AtomicU32>,
    /// Segments client data may not take on top of `SEGMENTS_RESERVED`: room for the next
    /// commit's map nodes (`Core::note_dirty`).
    meta_reserve: AtomicU32,
    /// Client-data segments whose live count fell to zero since the last `zero_sealed`.
    emptied: AtomicU32,
    /// Whether each segment was last opened for client data (`Stream::Data`).
    holds_data: Vec<AtomicBool>,
    inner: Mutex<Inner>,
    /// Signalled when segments become free.
    pub space: Condvar,
}

pub fn segment_of(addr: u64) -> u32 {
    (addr / SEGMENT_BYTES) as u32
}

impl Log {
    /// A log whose live counts come from a walk of everything reachable (`live_bytes`).
    /// Segments below `high_water` whose accounting is unknown (`trust_zero == false`)
    /// stay sealed so nothing possibly referenced is ever reused.
    pub fn new(live_bytes: Vec<u32>, high_water: u32, trust_zero: bool) -> Log {
        let segments = live_bytes.len() as u32;
        let mut free = BTreeSet::new();
        let mut state = Vec::with_capacity(live_bytes.len());
        for (i, &l) in live_bytes.iter().enumerate() {
            let i = i as u32;
            if l == 0 && (trust_zero || i >= high_water) {
                free.insert(i);
                state.push(SegState::Free);
            } else {
                state.push(SegState::Sealed);
            }
        }
        let live = live_bytes.into_iter().map(AtomicU32::new).collect();
        Log {
            segments,
            live,
            emptied: AtomicU32::new(0),
            meta_reserve: AtomicU32::new(0),
            holds_data: (0..segments).map(|_| AtomicBool::new(false)).collect(),
            inner: Mutex::new(Inner {
                free,
                recent: Vec::new(),
                state,
                heads: [None; 4],
                high_water: high_water.min(segments),
            }),
            space: Condvar::new(),
        }
    }

    pub fn segments(&self) -> u32 {
        self.segments
    }

    pub fn free_segments(&self) -> u32 {
        self.inner.lock().free.len() as u32
    }

    pub fn high_water(&self) -> u32 {
        self.inner.lock().high_water
    }

    pub fn live_bytes_total(&self) -> u64 {
        self.live
            .iter()
            .map(|l| l.load(Ordering::Relaxed) as u64)
            .sum()
    }

    /// Allocate `len` bytes at the head of `stream`. Client data (`Stream::Data`) may not
    /// take the last `SEGMENTS_RESERVED` free segments: those keep commits and the cleaner going.
    pub fn alloc(&self, stream: Stream, len: usize) -> Result<u64> {
        assert!(
            len > 0 && len as u64 <= SEGMENT_BYTES,
            "record of {len} bytes"
        );
        self.alloc_run(stream, &[len]).map(|(addr, _)| addr)
    }

    /// Allocate consecutive records of `lens` bytes at the head of `stream`, as many as fit in
    /// one segment (at least one). Returns the first address and how many were placed; record
    /// `i` starts `RECORD_ALIGN`-aligned right after record `i-1`.
    pub fn alloc_run(&self, stream: Stream, lens: &[usize]) -> Result<(u64, usize)> {
        assert!(!lens.is_empty());
        let aligned = |l: usize| (l as u64).div_ceil(RECORD_ALIGN) * RECORD_ALIGN;
        let mut g = self.inner.lock();
        let h = stream as usize;
        let room = g.heads[h]
            .map(|(_, off)| SEGMENT_BYTES - off as u64)
            .unwrap_or(0);
        if room < lens[0] as u64 {
            if let Some((seg, _)) = g.heads[h].take() {
                g.state[seg as usize] = SegState::Sealed;
            }
            let reserve = if stream == Stream::Data {
                SEGMENTS_RESERVED + self.meta_reserve()
            } else {
                0
            };
            if g.free.len() as u32 <= reserve {
                return Err(Error::NoSpace);
            }
            let seg = match g.recent.pop() {
                Some(s) => {
                    let was_free = g.free.remove(&s);
                    debug_assert!(was_free, "segment {s} in `recent` but not free");
                    s
                }
                None => g.free.pop_first().expect("checked non-empty"),
            };
            g.state[seg as usize] = SegState::Open;
            g.high_water = g.high_water.max(seg + 1);
            g.heads[h] = Some((seg, 0));
            self.holds_data[seg as usize].store(stream == Stream::Data, Ordering::Relaxed);
        }
        let (seg, off) = g.heads[h].expect("head is open");
        let mut end = off as u64;
        let mut n = 0;
        let mut bytes = 0u64;
        for &l in lens {
            if end + l as u64 > SEGMENT_BYTES {
                break;
            }
            end += aligned(l);
            bytes += l as u64;
            n += 1;
        }
        g.heads[h] = Some((seg, end.min(SEGMENT_BYTES) as u32));
        self.live[seg as usize].fetch_add(bytes as u32, Ordering::Relaxed);
        Ok((seg as u64 * SEGMENT_BYTES + off as u64, n))
    }

    /// Whether client data can be allocated without waiting for the cleaner.
    pub fn data_space_available(&self) -> bool {
        let g = self.inner.lock();
        if let Some((_, off)) = g.heads[Stream::Data as usize] {
            if (SEGMENT_BYTES - off as u64) >= (128 << 10) + 64 {
                return true;
            }
        }
        g.free.len() as u32 > SEGMENTS_RESERVED + self.meta_reserve()
    }

    pub fn set_meta_reserve(&self, segments: u32) {
        self.meta_reserve.store(segments, Ordering::Relaxed);
    }

    pub fn meta_reserve(&self) -> u32 {
        self.meta_reserve.load(Ordering::Relaxed)
    }

    /// A record at `addr` of `len` bytes is no longer referenced by the in-memory state.
    /// True exactly when this emptied the `release_commit_segments`-th client-data segment since the last
    /// `zero_sealed`: time for a commit, so those segments can be reused while still cached.
    pub fn release_bytes(&self, addr: u64, len: u32) -> bool {
        let seg = segment_of(addr) as usize;
        let prev = self.live[seg].fetch_sub(len, Ordering::AcqRel);
        assert!(
            prev >= len,
            "segment {seg} live count underflow ({prev} - {len})"
        );
        prev == len
            && self.holds_data[seg].load(Ordering::Relaxed)
            && self.emptied.fetch_add(1, Ordering::Relaxed) + 1 == self.release_commit_segments()
    }

    /// Emptied segments worth an early commit: an eighth of the pool, within 16..=256.
    pub fn release_commit_segments(&self) -> u32 {
        (self.segments / 8).clamp(16, RELEASE_COMMIT_SEGMENTS_MAX)
    }

    /// `zero_sealed` for the commit that will free them: the early-commit count starts again.
    pub fn zero_sealed_for_commit(&self) -> Vec<u32> {
        self.emptied.store(0, Ordering::Relaxed);
        self.zero_sealed()
    }

    /// Sealed segments with no live bytes: candidates to free once the next commit is durable.
    pub fn zero_sealed(&self) -> Vec<u32> {
        let g = self.inner.lock();
        (0..self.segments)
            .filter(|&s| {
                g.state[s as usize] == SegState::Sealed
                    && self.live[s as usize].load(Ordering::Acquire) == 0
            })
            .collect()
    }

    /// Free segments collected by `zero_sealed` before a commit that is now durable.
    pub fn release(&self, segs: &[u32]) {
        if segs.is_empty() {
            return;
        }
        let mut g = self.inner.lock();
        for &s in segs {
            if g.state[s as usize] == SegState::Sealed
                && self.live[s as usize].load(Ordering::Acquire) == 0
            {
                g.state[s as usize] = SegState::Free;
                g.free.insert(s);
                g.recent.push(s);
            }
        }
        drop(g);
        self.space.notify_all();
    }

    /// Sealed segments worth cleaning, emptiest first: at most `max`, each under `live_max_bytes` live.
    pub fn victims(&self, max: usize, live_max_bytes: u32) -> Vec<u32> {
        let g = self.inner.lock();
        let mut v: Vec<(u32, u32)> = (0..self.segments)
            .filter(|&s| g.state[s as usize] == SegState::Sealed)
            .map(|s| (self.live[s as usize].load(Ordering::Relaxed), s))
            .filter(|&(l, _)| l > 0 && l < live_max_bytes)
            .collect();
        v.sort_unstable();
        v.truncate(max);
        v.into_iter().map(|(_, s)| s).collect()
    }

    pub fn live_of(&self, seg: u32) -> u32 {
        self.live[seg as usize].load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_free_only_after_release() {
        let log = Log::new(vec![0; 8], 0, true);
        let a = log.alloc(Stream::Data, 4096).unwrap();
        let b = log.alloc(Stream::Data, 4112).unwrap();
        assert_eq!(segment_of(a), segment_of(b));
        assert_eq!(b - a, 4096);
        // Fill the segment so it seals.
        while segment_of(log.alloc(Stream::Data, 65536).unwrap()) == segment_of(a) {}
        log.release_bytes(a, 4096);
        log.release_bytes(b, 4112);
        let before = log.free_segments();
        // Still referenced by bytes of the third-sized records in the first segment.
        let zero = log.zero_sealed();
        assert!(
            zero.is_empty(),
            "segment still has the 64K records: {zero:?}"
        );
        assert_eq!(log.free_segments(), before);
    }

    #[test]
    fn reuse_takes_the_most_recently_released_segment_first() {
        let log = Log::new(vec![0; 64], 0, true);
        let seg = |a: u64| segment_of(a);
        let whole = SEGMENT_BYTES as usize;
        let addrs: Vec<u64> = (0..6)
            .map(|_| log.alloc(Stream::Data, whole).unwrap())
            .collect();
        assert_eq!(
            addrs.iter().map(|&a| seg(a)).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4, 5]
        );
        // Seal the last one, then empty segments 1 and 4 (in that order) and free them.
        log.alloc(Stream::Data, whole).unwrap();
        for &s in &[1u64, 4] {
            log.release_bytes(addrs[s as usize], whole as u32);
        }
        let zero = log.zero_sealed();
        assert_eq!(zero, [1, 4]);
        log.release(&zero);
        // 4 was released last: its pages are the likeliest still cached. Then 1, then never-used 7.
        let next: Vec<u32> = (0..3)
            .map(|_| seg(log.alloc(Stream::Data, whole).unwrap()))
            .collect();
        assert_eq!(next, [4, 1, 7]);
    }

    #[test]
    fn emptying_enough_segments_asks_for_a_commit_once() {
        let log = Log::new(vec![0; 512], 0, true);
        let whole = SEGMENT_BYTES as usize;
        let n = log.release_commit_segments() as usize;
        assert_eq!(n, 64, "an eighth of 512 segments");
        let addrs: Vec<u64> = (0..2 * n + 2)
            .map(|_| log.alloc(Stream::Data, whole).unwrap())
            .collect();
        let release = |range: std::ops::Range<usize>| -> Vec<bool> {
            addrs[range]
                .iter()
                .map(|&a| log.release_bytes(a, whole as u32))
                .collect()
        };
        let asks = release(0..n + 1);
        assert_eq!(asks.iter().filter(|&&b| b).count(), 1);
        assert!(asks[n - 1], "the {n}th emptied segment asks");
        // A commit's collection starts the count again; merely looking (as a writer waiting
        // for space does) does not.
        log.zero_sealed_for_commit();
        assert!(!release(n + 1..2 * n).contains(&true));
        log.zero_sealed();
        assert_eq!(
            release(2 * n..2 * n + 1),
            [true],
            "the {n}th since the commit"
        );
    }

    /// Commits empty the segments of the map nodes they replaced; counting those would have
    /// every commit of a random-write load ask for the next one (a commit storm).
    #[test]
    fn emptied_metadata_segments_do_not_ask_for_a_commit() {
        let log = Log::new(vec![0; 512], 0, true);
        let whole = SEGMENT_BYTES as usize;
        let n = log.release_commit_segments() as usize;
        for stream in [Stream::Meta, Stream::Meta2, Stream::Clean] {
            let addrs: Vec<u64> = (0..n + 1)
                .map(|_| log.alloc(stream, whole).unwrap())
                .collect();
            for &a in &addrs[..n] {
                assert!(!log.release_bytes(a, whole as u32), "{stream:?}");
            }
        }
    }

    #[test]
    fn data_cannot_take_reserved_segments() {
        let log = Log::new(vec![0; SEGMENTS_RESERVED as usize + 1], 0, true);
        log.alloc(Stream::Data, SEGMENT_BYTES as usize).unwrap();
        assert!(matches!(log.alloc(Stream::Data, 4096), Err(Error::NoSpace)));
        assert!(log.alloc(Stream::Meta, 4096).is_ok());
    }

    #[test]
    fn unknown_accounting_keeps_used_segments_sealed() {
        let log = Log::new(vec![0; 10], 6, false);
        assert_eq!(log.free_segments(), 4);
        assert_eq!(segment_of(log.alloc(Stream::Meta, 16).unwrap()), 6);
    }
}
