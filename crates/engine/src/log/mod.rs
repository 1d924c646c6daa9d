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
//! A client-data segment opened after the last commit took its snapshot, and
//! emptied before the next one takes its own, was never referenced by any
//! commit: it needs no commit to be reused. Such a segment is *recyclable*:
//! the writer that empties it frees it after waiting out the reads that may
//! still hold a pointer into it (`Store::recycle_if_due`). An overwrite that comes
//! back within one commit interval thus lands in pages it dirtied itself,
//! which the page cache absorbs, instead of in fresh space that the next
//! commit must write out. The commit epoch (`epoch`, odd while a commit takes
//! its snapshot) and each segment's `born` epoch decide it.
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
//!
//! Space floors ([`Log::reserve`]): client data may not take the segments the next commit
//! needs, the slack `SEGMENTS_RESERVED` keeps, and the cleaner's room; the cleaner may not
//! take the commit's; a commit's own metadata may take every segment. So a full pool can
//! always clean and commit. The cleaning policy (which sealed segments to clean next) is
//! `victims.rs`; the worker that moves their records is `pool::clean`.
//!
//! Its locks and atomics come from `crate::sync`: `crates/modelcheck` compiles this module
//! against shuttle and checks recycling and a commit's freeing against readers and commits.

mod holes;
mod victims;

use crate::constants::{
    CLEAN_RESERVE_MIN, FREE_PERCENT_LOW, MAP_DIRTY_NODES_MAX, METADATA_COPIES, RECORD_ALIGN,
    RECYCLE_BATCH_SEGMENTS, RELEASE_COMMIT_SEGMENTS_MAX, SEGMENTS_FREE_LOW, SEGMENTS_RESERVED,
    SEGMENT_BYTES, TABLE_SEGMENTS,
};
use crate::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use crate::sync::{Condvar, Mutex};
use crate::{Error, Result};
use std::collections::BTreeSet;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Data = 0,
    Clean = 1,
    Meta = 2,
    /// Second copies of metadata: never in the same segment as the first.
    Meta2 = 3,
}

/// How many streams (`Stream`), each with a head segment open.
const STREAMS: usize = 4;

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
    /// Client-data segments emptied in the epoch they were opened in, not yet recycled.
    recyclable: Vec<u32>,
    /// Where each head's room ends: `SEGMENT_BYTES` for a segment taken free, the end of
    /// the hole for a head filling a hole (`hole_head`).
    limits: [u32; STREAMS],
    /// Whether each head is filling a hole of a sealed segment (`holes`) rather than a
    /// segment taken free: closing it gives what is left of the hole back.
    hole_head: [bool; STREAMS],
    /// Free extents of sealed client-data segments (`holes.rs`).
    holes: holes::Holes,
    /// Records released before the commit now under way began (`zero_sealed_for_commit`):
    /// holes once it is durable (`release`).
    committing: Vec<Released>,
}

/// Where `Log::alloc_run` places a run (`Log::plan`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// The head of its stream has room.
    Head,
    /// A hole of a partly-live segment becomes the head (client data, free segments short):
    /// one that holds the whole run (`whole`), else, only when no segment can be opened,
    /// one that holds its first record.
    Hole { whole: bool },
    /// A free segment becomes the head.
    Segment,
}

/// A record's bytes released by the in-memory state: a hole after the next commit.
#[derive(Debug, Clone, Copy)]
struct Released {
    addr: u64,
    /// Its bytes in the log, aligned as `alloc_run` laid it out.
    len: u32,
    /// Its segment's incarnation (`stamp`) at the release: a segment freed and opened again
    /// before the commit holds other bytes there now.
    inc: u64,
}

/// What emptying a record's bytes calls for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Emptied {
    /// Nothing (the segment still holds live bytes, or the batch is not full yet).
    Nothing,
    /// Enough committed client-data segments emptied: a commit would free them.
    Commit,
    /// Enough recyclable segments: `Store::recycle_if_due` frees them without a commit.
    Recycle,
}

pub struct Log {
    segments: u32,
    live: Vec<AtomicU32>,
    /// The sum of `live` (kept with it, so the pool's used bytes cost no walk).
    live_total: AtomicU64,
    /// Map nodes dirty in memory, summed over every volume (`Store::note_dirty`): the next
    /// commit must find room for them (`commit_need`).
    dirty_nodes: AtomicUsize,
    /// Records placed by client writes and the cleaner whose map leaf is not yet counted in
    /// `dirty_nodes` (each may dirty one more leaf): counted when placed, settled by the
    /// placer once the map points at them (`Pending`).
    pending_nodes: AtomicUsize,
    /// Bytes one map node takes in the log (its footprint under the layout, aligned).
    node_bytes: AtomicU32,
    /// Segments kept from client data, on top of the commit's room, for the cleaner.
    clean_reserve: u32,
    /// Segments to rewrite every volume's whole map once (`set_map_nodes`), also kept for
    /// the cleaner: a pass that moves records scattered over a map dirties most of it.
    map_reserve: AtomicU32,
    /// Footprint bytes placed per stream since start (write amplification).
    written: [AtomicU64; STREAMS],
    /// Segments freed since start (by commits and recycling): writers waiting for space
    /// see progress here.
    freed_total: AtomicU64,
    /// `clean_cost` in thousandths.
    clean_cost_milli: AtomicU32,
    /// Bytes placed in the whole log when each segment was last opened (0: before this
    /// process): the cleaner's measure of a segment's age.
    stamp: Vec<AtomicU64>,
    /// Client-data segments whose live count fell to zero since the last `zero_sealed`.
    emptied: AtomicU32,
    /// Whether each segment was last opened for client data (`Stream::Data`).
    holds_data: Vec<AtomicBool>,
    /// Commit epoch: two per commit, odd from the start of a commit until its snapshot of
    /// the map is taken (`begin_snapshot` / `end_snapshot`).
    epoch: AtomicU64,
    /// The epoch each segment was last opened in (`u64::MAX`: opened before this process,
    /// possibly referenced by the last commit).
    born: Vec<AtomicU64>,
    /// Segments below this are never freed in this process (`new`, `trust_zero`).
    reuse_floor: u32,
    /// Whether each segment was last opened for client data or the cleaner's moves of it
    /// (or found holding client data at import): the object tier may evict it.
    evictable: Vec<AtomicBool>,
    /// Segments whose local bytes were given back (`pool::tier`, the local cache of an
    /// object store): their records are read from the store. Cleared when the segment is
    /// opened again. Set, and read by every read of a record, under the reuse gate.
    evicted: Vec<AtomicBool>,
    evicted_count: AtomicU32,
    /// Puts of client data (`Stream::Data`, `Stream::Clean`) placed in each segment and not
    /// yet written and noted for upload (`put_done`): a segment with any is never given
    /// back, even once sealed by another writer's allocation. Counted only for a pool with
    /// an object tier (`track_freed`, set once at import before any put), as `put_done`
    /// settles them.
    inflight: Vec<AtomicU32>,
    /// When each segment was last brought back from the store (the log's byte count, as
    /// `stamp`): the local cache gives back the least recently opened or brought back first.
    touched: Vec<AtomicU64>,
    /// Segments freed since the object tier last asked (`take_freed`; kept only once it
    /// asked to: `track_freed`): their parts leave the store's segment table.
    freed: Mutex<Vec<u32>>,
    track_freed: AtomicBool,
    /// Client writes fill holes when free segments run short (decision 0014); off with an
    /// object tier (`track_freed`: its uploads are whole segments).
    fill_holes: AtomicBool,
    /// Holes first (`set_holes_first`): the cleaner runs only for the whole segments
    /// commits need (`pool::core::Core::low_on_space`).
    holes_first: AtomicBool,
    /// A writer was about to be refused for space with holes free but none usable: until
    /// free segments are back at `low_free_segments`, the holes of any sealed segment that
    /// holds live records may be filled, not only those of nearly full ones
    /// (`open_holes_anywhere`, decision 0014).
    holes_anywhere: AtomicBool,
    /// Records released since the last commit began: holes after the next one.
    released: Mutex<Vec<Released>>,
    /// Footprint bytes placed into holes since start.
    filled: AtomicU64,
    inner: Mutex<Inner>,
    /// Signalled when segments become free.
    pub space: Condvar,
}

/// The hole table's counts (`Log::holes`), in footprint bytes.
#[derive(Debug, Clone, Copy, Default)]
pub struct HoleCounts {
    /// Free bytes in holes.
    pub bytes: u64,
    /// Of those, bytes in holes of at least `holes::HOLE_LARGE_BYTES` (64 KiB) in segments
    /// whose holes writes fill now (`usable_for_holes`): room a 64 KiB write can take.
    pub large_bytes: u64,
    /// Free extents.
    pub count: usize,
    /// Bytes client writes placed into holes since start.
    pub filled_bytes: u64,
    /// Writes may fill the holes of any segment with live records, not only nearly full
    /// ones (`Log::open_holes_anywhere`).
    pub anywhere: bool,
}

/// Footprint bytes placed in the log since start, by what placed them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Written {
    pub data: u64,
    pub clean: u64,
    pub meta: u64,
}

impl Written {
    /// Bytes written to the log per byte of client data (1.0 before any client write).
    pub fn amplification(&self) -> f64 {
        if self.data == 0 {
            return 1.0;
        }
        (self.data + self.clean + self.meta) as f64 / self.data as f64
    }
}

/// Records placed by `Log::alloc_run` whose map leaf is not yet counted as dirty; settles
/// them when dropped (after the placer's `Store::note_dirty`, or on its error path).
pub struct Pending<'a> {
    log: &'a Log,
    n: usize,
}

impl Pending<'_> {
    /// `n` more records were placed under this guard.
    pub fn add(&mut self, n: usize) {
        self.n += n;
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.log.pending_nodes.fetch_sub(self.n, Ordering::Relaxed);
    }
}

/// Bytes a record of `len` bytes takes in the log: records start `RECORD_ALIGN`-aligned.
fn aligned(len: usize) -> u64 {
    (len as u64).div_ceil(RECORD_ALIGN) * RECORD_ALIGN
}

/// Live bytes below which a segment's holes are left to the cleaner (`usable_for_holes`).
const HOLE_LIVE_MIN: u32 = (SEGMENT_BYTES - SEGMENT_BYTES / 4) as u32;
/// `HOLE_LIVE_MIN` with holes first (`Log::set_holes_first`): a segment a quarter live.
const HOLES_FIRST_LIVE_MIN: u32 = (SEGMENT_BYTES / 4) as u32;
/// With holes first, free segments above what client data may not take below which
/// `HOLE_LIVE_MIN` holds again (`Log::hole_live_min`): four times the cleaner's start
/// (`HOLES_FIRST_CLEAN_MARGIN`), so victims have decayed when it starts.
const HOLES_FIRST_KEEP_VICTIMS: u32 = 4 * crate::constants::HOLES_FIRST_CLEAN_MARGIN;

/// Bytes the run `lens` takes laid end to end, at most a segment.
fn run_bytes(lens: &[usize]) -> u32 {
    let bytes: u64 = lens.iter().map(|&l| aligned(l)).sum();
    bytes.min(SEGMENT_BYTES) as u32
}

pub fn segment_of(addr: u64) -> u32 {
    (addr / SEGMENT_BYTES) as u32
}

impl Log {
    /// A log whose live counts come from a walk of everything reachable (`live_bytes`).
    /// When that walk was incomplete (`trust_zero == false`: a map node could not be read),
    /// every segment below `high_water` stays sealed for this process's life, whatever its
    /// count says: the nodes not read may point into any of them.
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
        let live_total = live_bytes.iter().map(|&l| l as u64).sum();
        let live = live_bytes.into_iter().map(AtomicU32::new).collect();
        Log {
            segments,
            live,
            live_total: AtomicU64::new(live_total),
            emptied: AtomicU32::new(0),
            dirty_nodes: AtomicUsize::new(0),
            pending_nodes: AtomicUsize::new(0),
            node_bytes: AtomicU32::new(4096),
            clean_reserve: CLEAN_RESERVE_MIN.max(segments / 64),
            map_reserve: AtomicU32::new(0),
            written: Default::default(),
            freed_total: AtomicU64::new(0),
            clean_cost_milli: AtomicU32::new(0),
            stamp: (0..segments).map(|_| AtomicU64::new(0)).collect(),
            holds_data: (0..segments).map(|_| AtomicBool::new(false)).collect(),
            epoch: AtomicU64::new(0),
            born: (0..segments).map(|_| AtomicU64::new(u64::MAX)).collect(),
            evictable: (0..segments).map(|_| AtomicBool::new(false)).collect(),
            evicted: (0..segments).map(|_| AtomicBool::new(false)).collect(),
            evicted_count: AtomicU32::new(0),
            inflight: (0..segments).map(|_| AtomicU32::new(0)).collect(),
            touched: (0..segments).map(|_| AtomicU64::new(0)).collect(),
            freed: Mutex::new(Vec::new()),
            track_freed: AtomicBool::new(false),
            fill_holes: AtomicBool::new(true),
            holes_first: AtomicBool::new(false),
            holes_anywhere: AtomicBool::new(false),
            released: Mutex::new(Vec::new()),
            filled: AtomicU64::new(0),
            reuse_floor: if trust_zero {
                0
            } else {
                high_water.min(segments)
            },
            inner: Mutex::new(Inner {
                free,
                recent: Vec::new(),
                state,
                heads: [None; 4],
                high_water: high_water.min(segments),
                recyclable: Vec::new(),
                limits: [SEGMENT_BYTES as u32; STREAMS],
                hole_head: [false; STREAMS],
                holes: holes::Holes::default(),
                committing: Vec::new(),
            }),
            space: Condvar::new(),
        }
    }

    /// Segment `seg`, found at import, holds client data: when it empties, it counts toward
    /// an early commit like a segment this process wrote data to (never recycled: `born`).
    pub fn mark_data(&self, seg: u32) {
        if let Some(d) = self.holds_data.get(seg as usize) {
            d.store(true, Ordering::Relaxed);
            self.evictable[seg as usize].store(true, Ordering::Relaxed);
        }
    }

    // --- the local cache of an object store (`pool::tier`) ---

    /// Whether segment `seg` holds client data (its opening's stream, or import's walk).
    pub fn is_evictable(&self, seg: u32) -> bool {
        self.evictable
            .get(seg as usize)
            .is_some_and(|e| e.load(Ordering::Relaxed))
    }

    /// Whether segment `seg`'s bytes are in the object store only.
    pub fn is_evicted(&self, seg: u32) -> bool {
        self.evicted
            .get(seg as usize)
            .is_some_and(|e| e.load(Ordering::Acquire))
    }

    /// A put of client data placed at `addr` (by `alloc_run`) is written and noted for
    /// upload, or failed.
    pub fn put_done(&self, addr: u64) {
        if !self.track_freed.load(Ordering::Relaxed) {
            return;
        }
        if let Some(n) = self.inflight.get(segment_of(addr) as usize) {
            n.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Mark segment `seg` to be given back (`give_back`), under the log's lock and only if
    /// it is still what the caller checked: free (`opening` `None`), or sealed client data
    /// of the opening `opening` (`incarnation`) with live bytes and no put under way. From
    /// the mark on, its records are read from the store. False if it was not marked.
    pub fn mark_for_eviction(&self, seg: u32, opening: Option<u64>) -> bool {
        let g = self.inner.lock();
        let s = seg as usize;
        let Some(&state) = g.state.get(s) else {
            return false;
        };
        let still = match opening {
            None => state == SegState::Free,
            Some(inc) => {
                state == SegState::Sealed
                    && self.evictable[s].load(Ordering::Relaxed)
                    && self.live[s].load(Ordering::Acquire) > 0
                    && self.inflight[s].load(Ordering::Acquire) == 0
                    && self.incarnation(seg) == inc
            }
        };
        still && self.set_evicted(seg)
    }

    /// Bring segment `seg` back from the store with `write` (its bytes, written to the
    /// devices), under the log's lock and only while it is still marked given back (a
    /// segment opened again since holds new bytes, which must stay). The caller makes the
    /// bytes durable, then `unmark`s it.
    pub fn bring_back(
        &self,
        seg: u32,
        opening: u64,
        write: impl FnOnce() -> Result<()>,
    ) -> Result<bool> {
        let g = self.inner.lock();
        // Still the sealed segment of the opening whose bytes were fetched: not freed (its
        // bytes dead) nor opened again (new bytes) since.
        if !self.is_evicted(seg)
            || g.state.get(seg as usize) != Some(&SegState::Sealed)
            || self.incarnation(seg) != opening
        {
            return Ok(false);
        }
        write()?;
        self.touched[seg as usize].store(self.written_total(), Ordering::Relaxed);
        Ok(true)
    }

    /// Take back a mark no hole was punched for yet (the pass that set it gave up).
    pub fn unmark(&self, seg: u32) {
        let _g = self.inner.lock();
        if self.evicted[seg as usize].swap(false, Ordering::AcqRel) {
            self.evicted_count.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Note that segment `seg`'s local bytes are given back (at open: found a hole): its
    /// records are read from the store. False if it was already.
    pub fn set_evicted(&self, seg: u32) -> bool {
        let Some(e) = self.evicted.get(seg as usize) else {
            return false;
        };
        let newly = !e.swap(true, Ordering::AcqRel);
        if newly {
            self.evicted_count.fetch_add(1, Ordering::Relaxed);
        }
        newly
    }

    /// Segments whose bytes are in the store only (free ones given back included).
    pub fn evicted_count(&self) -> u32 {
        self.evicted_count.load(Ordering::Relaxed)
    }

    /// Segments given back that hold live bytes (their records only the store has).
    pub fn evicted_live(&self) -> Vec<u32> {
        (0..self.segments)
            .filter(|&s| {
                self.evicted[s as usize].load(Ordering::Relaxed)
                    && self.live[s as usize].load(Ordering::Relaxed) > 0
            })
            .collect()
    }

    /// Sealed segments of client data still held locally, oldest opening first: what the
    /// local cache gives back first once its bytes are in the store.
    pub fn eviction_candidates(&self) -> Vec<u32> {
        let g = self.inner.lock();
        let mut v: Vec<u32> = (0..self.segments)
            .filter(|&s| {
                g.state[s as usize] == SegState::Sealed
                    && self.evictable[s as usize].load(Ordering::Relaxed)
                    && !self.evicted[s as usize].load(Ordering::Relaxed)
                    && self.live[s as usize].load(Ordering::Relaxed) > 0
            })
            .collect();
        drop(g);
        v.sort_by_key(|&s| {
            let s = s as usize;
            self.stamp[s]
                .load(Ordering::Relaxed)
                .max(self.touched[s].load(Ordering::Relaxed))
        });
        v
    }

    /// Give back segment `seg`'s local bytes with `discard`, once `set_evicted` marked it
    /// and every read that could have missed the mark has finished (the reuse gate): under
    /// the log's lock, and only if it was not opened again meanwhile (which clears the mark,
    /// and its new bytes must stay). `discard` answering that nothing was given back (the
    /// device cannot) clears the mark; an error leaves it (some copy may be a hole: reads
    /// go to the store).
    pub fn give_back(&self, seg: u32, discard: impl FnOnce() -> Result<bool>) -> Result<bool> {
        let _g = self.inner.lock();
        if !self.is_evicted(seg) {
            return Ok(false);
        }
        let done = discard()?;
        if !done && self.evicted[seg as usize].swap(false, Ordering::AcqRel) {
            self.evicted_count.fetch_sub(1, Ordering::Relaxed);
        }
        Ok(done)
    }

    /// Keep the segments freed from now on for `take_freed` (the object tier).
    pub fn track_freed(&self) {
        self.track_freed.store(true, Ordering::Relaxed);
    }

    /// The segments freed since the last call (each may have been opened again since).
    pub fn take_freed(&self) -> Vec<u32> {
        std::mem::take(&mut *self.freed.lock())
    }

    /// Note `seg` as freed (at open: free, and still in the store's table).
    pub fn note_freed(&self, seg: u32) {
        self.freed.lock().push(seg);
    }

    /// Put back what a failed upload took (`take_freed`).
    pub fn return_freed(&self, mut segs: Vec<u32>) {
        self.freed.lock().append(&mut segs);
    }

    /// Whether segment `seg` is free.
    pub fn is_free(&self, seg: u32) -> bool {
        self.inner
            .lock()
            .state
            .get(seg as usize)
            .is_some_and(|s| *s == SegState::Free)
    }

    /// Free segments not yet given back (their old bytes still take local room).
    pub fn free_held(&self) -> Vec<u32> {
        let g = self.inner.lock();
        g.free
            .iter()
            .copied()
            .filter(|&s| !self.evicted[s as usize].load(Ordering::Relaxed))
            .collect()
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
        self.live_total.load(Ordering::Relaxed)
    }

    /// Allocate `len` bytes at the head of `stream` (see `alloc_run`).
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
    ///
    /// Client data and the cleaner's moves may not eat into the room the next commit needs
    /// (`reserve`): each record they place may dirty one map leaf, so it is counted in
    /// `pending_nodes` here, before the check of the next record, and its placer settles it
    /// (`Pending`) once `dirty_nodes` counts the leaf. The check runs on every call, not only
    /// when a head opens: records added to an open head raise what the commit needs too.
    pub fn alloc_run(&self, stream: Stream, lens: &[usize]) -> Result<(u64, usize)> {
        self.alloc_run_above(stream, lens, 0)
    }

    /// One intent-log chain block of `len` bytes on the main devices' metadata stream
    /// (`Stream::Meta` or `Meta2`). A commit's metadata may take the very last segment; a
    /// chain block may not open a segment the next commit needs (`TABLE_SEGMENTS` and
    /// `commit_need`): the flush that asked for it commits instead (`NoSpace`). Without this
    /// floor, near full a run of log flushes took free segments below what the commit after
    /// them had to write, and that commit, which is what frees the chain, had no room.
    pub fn alloc_chain_block(&self, stream: Stream, len: usize) -> Result<u64> {
        debug_assert!(matches!(stream, Stream::Meta | Stream::Meta2));
        let floor = TABLE_SEGMENTS + self.commit_need(0);
        self.alloc_run_above(stream, &[len], floor)
            .map(|(addr, _)| addr)
    }

    /// `alloc_run`, where metadata opens a segment only while more than `meta_floor` are
    /// free (the rule for client data and the cleaner is `plan`'s own).
    fn alloc_run_above(
        &self,
        stream: Stream,
        lens: &[usize],
        meta_floor: u32,
    ) -> Result<(u64, usize)> {
        assert!(!lens.is_empty());
        let counted = matches!(stream, Stream::Data | Stream::Clean);
        let mut g = self.inner.lock();
        let h = stream as usize;
        match self.plan(&g, stream, lens, meta_floor)? {
            Plan::Head => {}
            Plan::Hole { whole } => {
                let Some((seg, start, end)) = self.take_hole(&mut g, lens, whole) else {
                    debug_assert!(false, "`plan` found a hole `take` did not");
                    return Err(Error::NoSpace);
                };
                self.close_head(&mut g, h, stream);
                // A sealed segment that still holds live records: its incarnation, epoch
                // and stream stay (commits have seen it; it is never recycled).
                g.state[seg as usize] = SegState::Open;
                g.heads[h] = Some((seg, start));
                g.limits[h] = end;
                g.hole_head[h] = true;
            }
            Plan::Segment => {
                self.close_head(&mut g, h, stream);
                self.open_segment(&mut g, h, stream)?;
            }
        }
        let (seg, off) = g.heads[h].expect("head is open");
        let limit = g.limits[h] as u64;
        let mut end = off as u64;
        let mut n = 0;
        let mut bytes = 0u64;
        for &l in lens {
            if end + l as u64 > limit {
                break;
            }
            end += aligned(l);
            bytes += l as u64;
            n += 1;
        }
        assert!(
            n > 0,
            "a record of {} bytes does not fit a segment",
            lens[0]
        );
        debug_assert!(
            !g.holes.overlaps(seg, off, end.min(limit) as u32),
            "segment {seg}: placing {off}..{end} over a known hole"
        );
        g.heads[h] = Some((seg, end.min(limit) as u32));
        if counted {
            self.pending_nodes.fetch_add(n, Ordering::Relaxed);
        }
        // Under the lock: a segment sealed after this returns still shows the put. Only
        // with an object tier (`track_freed`, set with it), the only reader.
        if counted && self.track_freed.load(Ordering::Relaxed) {
            self.inflight[seg as usize].fetch_add(1, Ordering::AcqRel);
        }
        self.written[h].fetch_add(end - off as u64, Ordering::Relaxed);
        if g.hole_head[h] {
            self.filled.fetch_add(end - off as u64, Ordering::Relaxed);
        }
        self.live[seg as usize].fetch_add(bytes as u32, Ordering::Relaxed);
        self.live_total.fetch_add(bytes, Ordering::Relaxed);
        Ok((seg as u64 * SEGMENT_BYTES + off as u64, n))
    }

    /// Make sealed segment `seg` the head of `stream` again from byte `off` (at import:
    /// `Store::resume_meta_head`). `false`, and nothing changed, when the stream has a head
    /// already, `seg` is not sealed, or `off` leaves no room. Like a head that fills a
    /// hole, the segment keeps its incarnation, epoch and stream.
    pub fn resume_head(&self, stream: Stream, seg: u32, off: u32) -> bool {
        let mut g = self.inner.lock();
        let h = stream as usize;
        if g.heads[h].is_some()
            || g.state.get(seg as usize) != Some(&SegState::Sealed)
            || off as u64 >= SEGMENT_BYTES
        {
            return false;
        }
        g.state[seg as usize] = SegState::Open;
        g.heads[h] = Some((seg, off));
        g.limits[h] = SEGMENT_BYTES as u32;
        g.hole_head[h] = false;
        true
    }

    /// Where the run `lens` of `stream` goes now, or `NoSpace`: the one decision behind
    /// `alloc_run` and `space_available`, so a writer woken by the second finds room in
    /// the first. Client data and the cleaner's moves may not eat into what the next commit
    /// needs (`reserve`): each record they place may dirty one map leaf, so it is counted
    /// (`extra`) on every call, not only when a head opens. Data in a hole, or in the rest of
    /// one, takes no segment: it needs only the commit's room, not the cleaner's.
    fn plan(&self, g: &Inner, stream: Stream, lens: &[usize], meta_floor: u32) -> Result<Plan> {
        let h = stream as usize;
        let free = g.free.len() as u32;
        let fits_head = g.heads[h].is_some_and(|(_, off)| g.limits[h] - off >= lens[0] as u32);
        if !matches!(stream, Stream::Data | Stream::Clean) {
            // A commit's metadata may take the very last segment; past it the pool is full.
            // An intent-log chain block leaves the next commit its room (`alloc_chain_block`).
            return match fits_head {
                true => Ok(Plan::Head),
                false if free <= meta_floor => Err(Error::NoSpace),
                false => Ok(Plan::Segment),
            };
        }
        // At most this call's records (bounded by what fits in a segment).
        let extra = lens
            .len()
            .clamp(1, SEGMENT_BYTES as usize / RECORD_ALIGN as usize);
        let floor = self.reserve(stream, extra);
        let commit_floor = self.hole_floor(extra);
        if fits_head && (free >= floor || (g.hole_head[h] && free >= commit_floor)) {
            return Ok(Plan::Head);
        }
        // A run goes into one hole that holds it whole, or into a free segment: a run spread
        // one record per small hole costs a random write per record and a map leaf each,
        // which is how 64 KiB writes once crawled after 4 KiB ones. Spread it only when no
        // segment can be opened.
        let holes = stream == Stream::Data && self.fills_holes(free) && free >= commit_floor;
        let usable = |seg| self.hole_usable(g, seg);
        if holes && g.holes.fits(run_bytes(lens), usable) {
            return Ok(Plan::Hole { whole: true });
        }
        if !fits_head && free > floor {
            return Ok(Plan::Segment);
        }
        if holes && g.holes.fits(lens[0] as u32, usable) {
            return Ok(Plan::Hole { whole: false });
        }
        Err(Error::NoSpace)
    }

    /// Free segments a write into a hole must leave: the next commit's room for the map
    /// nodes it dirties (`extra` more) and `SEGMENTS_RESERVED`; once writers were about to
    /// be refused (`open_holes_anywhere`), only the volume table's part of it, as for a
    /// trim (`hold_nodes`). An overwrite placed in a hole takes no segment and releases
    /// the record it replaces, so it frees space as a trim does, for the same map cost.
    /// Without it, a pool whose commits and cleaner had taken free segments down to the
    /// commit's floor refused 4 KiB overwrites at 90% fill with 18 MB of holes known
    /// (`test_space_at_fill`, `single-fill-holes-0.9`: free 5, floor 6).
    fn hole_floor(&self, extra: usize) -> u32 {
        if self.holes_anywhere.load(Ordering::Acquire) {
            TABLE_SEGMENTS + self.commit_need(extra)
        } else {
            self.reserve(Stream::Clean, extra)
        }
    }

    /// Seal the head of `stream` (if any). A head that filled a hole gives back what is
    /// left of it; one emptied while it was the head (trimmed, or its writes failed) in the
    /// epoch it opened in is recyclable.
    fn close_head(&self, g: &mut Inner, h: usize, stream: Stream) {
        let Some((seg, off)) = g.heads[h].take() else {
            return;
        };
        g.state[seg as usize] = SegState::Sealed;
        if std::mem::take(&mut g.hole_head[h]) {
            let limit = std::mem::replace(&mut g.limits[h], SEGMENT_BYTES as u32);
            if off < limit {
                let added = g.holes.insert(seg, off, limit);
                debug_assert_eq!(added, holes::Added::Yes, "the rest of a hole given back");
            }
            return;
        }
        if stream == Stream::Data
            && self.live[seg as usize].load(Ordering::Acquire) == 0
            && self.in_this_epoch(seg)
        {
            g.recyclable.push(seg);
        }
    }

    /// Open a free segment as the head of `stream`: the most recently freed first, else
    /// the lowest never used.
    fn open_segment(&self, g: &mut Inner, h: usize, stream: Stream) -> Result<()> {
        let seg = match g.recent.pop() {
            Some(s) => {
                let was_free = g.free.remove(&s);
                debug_assert!(was_free, "segment {s} in `recent` but not free");
                s
            }
            None => match g.free.pop_first() {
                Some(s) => s,
                // Metadata may take the very last segment; past it the pool is full.
                None => return Err(Error::NoSpace),
            },
        };
        g.state[seg as usize] = SegState::Open;
        g.high_water = g.high_water.max(seg + 1);
        g.heads[h] = Some((seg, 0));
        g.limits[h] = SEGMENT_BYTES as u32;
        self.holds_data[seg as usize].store(stream == Stream::Data, Ordering::Relaxed);
        self.evictable[seg as usize].store(
            matches!(stream, Stream::Data | Stream::Clean),
            Ordering::Relaxed,
        );
        // A segment given back is a hole again: written from here on, read locally.
        if self.evicted[seg as usize].swap(false, Ordering::AcqRel) {
            self.evicted_count.fetch_sub(1, Ordering::Relaxed);
        }
        self.stamp[seg as usize].store(self.written_total(), Ordering::Relaxed);
        // SeqCst pairs with `begin_snapshot`: a commit whose snapshot could see records
        // placed here either bumped the epoch before this load, or bumps it later.
        self.born[seg as usize].store(self.epoch.load(Ordering::SeqCst), Ordering::Relaxed);
        Ok(())
    }

    // --- holes (`holes.rs`, decision 0014) ---

    /// Whether client data fills holes now, with `free` segments free: below the fill at
    /// which the cleaner would otherwise start (`low_free_segments`).
    fn fills_holes(&self, free: u32) -> bool {
        if free >= self.low_free_segments() {
            // Space recovered: back to the holes of nearly full segments only.
            if self.holes_anywhere.load(Ordering::Relaxed) {
                self.holes_anywhere.store(false, Ordering::Relaxed);
            }
            return false;
        }
        self.fill_holes.load(Ordering::Relaxed) && !self.track_freed.load(Ordering::Relaxed)
    }

    /// A writer's wait for space is about to be refused (`Store::wait_until`): let client
    /// data into the holes of any sealed segment that still holds live records, until free
    /// segments are back at `low_free_segments`. True when that is new (the writer should
    /// look for room once more); false when holes are not filled at all, or already may be
    /// anywhere. It cannot make a refusal worse, and each overwrite it takes frees the
    /// record it replaces: a new hole after the next commit.
    pub fn open_holes_anywhere(&self) -> bool {
        self.fill_holes.load(Ordering::Relaxed)
            && !self.track_freed.load(Ordering::Relaxed)
            && !self.holes_anywhere.swap(true, Ordering::AcqRel)
    }

    /// Free segments below which space is short: `SEGMENTS_FREE_LOW` or `FREE_PERCENT_LOW`
    /// of the pool, whichever is more, above what client data may not take. Below it client
    /// data fills holes, and the cleaner runs when they run short too (`pool::core`).
    pub fn low_free_segments(&self) -> u32 {
        SEGMENTS_FREE_LOW.max(self.segments * FREE_PERCENT_LOW / 100) + self.reserved_segments()
    }

    /// Take a hole for the run `lens` (the whole run, or its first record at least), in a
    /// sealed segment that still holds live records: one with none is freed whole by the
    /// next commit, and the commit under way may have collected it already.
    fn take_hole(&self, g: &mut Inner, lens: &[usize], whole: bool) -> Option<(u32, u32, u32)> {
        let want = run_bytes(lens);
        let min = if whole { want } else { lens[0] as u32 };
        let live_min = self.hole_live_min(g.free.len() as u32);
        let Inner { holes, state, .. } = g;
        holes.take(want, min, |seg| self.usable_with(state, seg, live_min))
    }

    /// Whether writes may fill the holes of any live segment now (`open_holes_anywhere`).
    pub fn holes_anywhere(&self) -> bool {
        self.holes_anywhere.load(Ordering::Acquire)
    }

    /// Whether the next commit turns released records into holes (each overwrite since
    /// the last one released the record it replaced).
    pub fn holes_pending(&self) -> bool {
        !self.released.lock().is_empty()
    }

    /// Whether a commit under way turns released records into holes once it is durable
    /// (it took them when it began: `zero_sealed_for_commit`). From then until it frees
    /// them, nothing is dirty and nothing is pending, yet holes are on their way.
    pub fn holes_committing(&self) -> bool {
        !self.inner.lock().committing.is_empty()
    }

    /// Whether a hole of `seg` may be filled now (`take_hole`).
    fn hole_usable(&self, g: &Inner, seg: u32) -> bool {
        self.usable_for_holes(g, seg)
    }

    /// A segment's holes are filled only while it holds at least `HOLE_LIVE_MIN` live
    /// bytes: an emptier one is the cleaner's best victim (it frees a whole segment for
    /// little copying), and filling it would leave the cleaner only full segments to gain
    /// from while commits still need whole ones (at 90% fill with every hole filled, free
    /// segments fell to the commit's floor and 64 KiB writes were refused).
    ///
    /// Once a writer was about to be refused (`open_holes_anywhere`), any sealed segment
    /// with live records will do. Never one with none: the next commit frees it whole, and
    /// the commit under way may have collected it already (a fill adds to the live count
    /// under the lock that takes the hole, so a segment being filled never counts zero).
    fn usable_for_holes(&self, g: &Inner, seg: u32) -> bool {
        self.usable_with(&g.state, seg, self.hole_live_min(g.free.len() as u32))
    }

    /// `usable_for_holes` with the live bytes a segment must hold, `live_min`, worked out.
    fn usable_with(&self, state: &[SegState], seg: u32, live_min: u32) -> bool {
        let live = self.live[seg as usize].load(Ordering::Acquire);
        state[seg as usize] == SegState::Sealed
            && seg >= self.reuse_floor
            && (live >= live_min || (live > 0 && self.holes_anywhere.load(Ordering::Acquire)))
    }

    /// Client writes fill holes when free segments run short (on unless set off: tests that
    /// measure the cleaner alone).
    pub fn set_fill_holes(&self, on: bool) {
        self.fill_holes.store(on, Ordering::Relaxed);
    }

    /// Holes first (`OpenOptions::holes_first`, experimental): the holes of any segment at
    /// least a quarter live take client data (`HOLES_FIRST_LIVE_MIN`), and the cleaner
    /// runs only when free segments come within `HOLES_FIRST_CLEAN_MARGIN` of what client
    /// data may not take, or a writer waits (`pool::core::Core::low_on_space`): it makes
    /// the whole segments commits need, and the data goes into holes, as F2FS's threaded
    /// logging does. Implies `set_fill_holes(true)`.
    pub fn set_holes_first(&self, on: bool) {
        self.holes_first.store(on, Ordering::Relaxed);
        if on {
            self.set_fill_holes(true);
        }
    }

    /// Live bytes a segment must hold for its holes to be filled (`usable_for_holes`), with
    /// `free` segments free.
    ///
    /// With holes first, a quarter while free segments stay `HOLES_FIRST_KEEP_VICTIMS` above
    /// what client data may not take; closer to it, 3/4 again, as without. Filling every
    /// quarter-live segment to the brim left the cleaner, when it started, only segments
    /// about as live as the pool (83%): with 4 KiB records each byte it moved cost a byte of
    /// map nodes, so no pass gained, commits took the last free segments and 4 KiB writes
    /// were refused at 83% of usable (`bench/fragmentation.sh 0.8 5 4k`, and at 0.84 on a
    /// 640M device). Near the cleaner's start the half-live segments are left to decay into
    /// victims it gains from, as the default does all along. A half there instead of 3/4
    /// copied less (at 64 KiB and 81% fill the cleaner moved 0.13 bytes per client byte,
    /// not 0.49) but was refused again: at a byte of map nodes per byte moved a victim a
    /// little under half live gains next to nothing (4 KiB at 0.84 on 640M refused in 2
    /// runs of 3 on one CPU, and `test_space_at_fill`'s durable 84% cases, pinned, in 2 of
    /// 2 runs; 3/4 took the same runs unrefused).
    fn hole_live_min(&self, free: u32) -> u32 {
        if self.holes_first.load(Ordering::Relaxed)
            && free >= self.reserve(Stream::Data, 0) + HOLES_FIRST_KEEP_VICTIMS
        {
            HOLES_FIRST_LIVE_MIN
        } else {
            HOLE_LIVE_MIN
        }
    }

    /// Whether holes come first (`set_holes_first`): never on a pool with an object tier,
    /// which fills no holes (`track_freed`), so its cleaner starts at `low` as before.
    pub fn holes_first(&self) -> bool {
        self.holes_first.load(Ordering::Relaxed) && !self.track_freed.load(Ordering::Relaxed)
    }

    /// What the hole table holds, and what client writes placed into holes since start.
    pub fn holes(&self) -> HoleCounts {
        let g = self.inner.lock();
        HoleCounts {
            bytes: g.holes.bytes(),
            large_bytes: g
                .holes
                .large_bytes_usable(|seg| self.usable_for_holes(&g, seg), u64::MAX),
            count: g.holes.count(),
            filled_bytes: self.filled.load(Ordering::Relaxed),
            anywhere: self.holes_anywhere.load(Ordering::Relaxed),
        }
    }

    /// Segments `stream` may not take: for client data the commit's room (`commit_need`,
    /// counting `extra` more nodes), `SEGMENTS_RESERVED` (the volume table and slack) and the
    /// cleaner's room; for the cleaner the same less its own room; metadata (the commit
    /// itself) may take every segment.
    pub fn reserve(&self, stream: Stream, extra: usize) -> u32 {
        let commit = SEGMENTS_RESERVED + self.commit_need(extra);
        match stream {
            Stream::Data => commit + self.clean_reserve_segments(),
            Stream::Clean => commit,
            Stream::Meta | Stream::Meta2 => 0,
        }
    }

    /// Segments the next commit writes for the dirty map nodes, with `extra` more (the volume
    /// table's record comes out of `SEGMENTS_RESERVED`).
    pub fn commit_need(&self, extra: usize) -> u32 {
        let nodes = self.dirty_nodes.load(Ordering::Relaxed)
            + self.pending_nodes.load(Ordering::Relaxed)
            + extra;
        if nodes == 0 {
            return 0;
        }
        // Records never straddle segments: each new segment holds at least this much (what
        // the head had left goes first, so it needs no segment of its own).
        let node = self.node_bytes.load(Ordering::Relaxed) as u64;
        let per_copy = (nodes as u64 * node).div_ceil(SEGMENT_BYTES - node);
        (per_copy * METADATA_COPIES as u64).min(u32::MAX as u64) as u32
    }

    /// Whether the run `lens` (footprints, as `alloc_run` takes them) of `stream` can be
    /// placed (or, for `Stream::Clean`, that many map leaves dirtied) without waiting for a
    /// commit or the cleaner: exactly what `alloc_run` checks, so a writer woken by this
    /// finds its room.
    pub fn space_available(&self, stream: Stream, lens: &[usize]) -> bool {
        let g = self.inner.lock();
        self.plan(&g, stream, lens, 0).is_ok()
    }

    /// Whether background rewrites (key rotation) may go on: free segments exceed what
    /// client data may not take by a 64th of the pool (at least 2). Below that they
    /// pause, so client writes keep the pool's last free space and the cleaner is not
    /// driven by work nobody waits for.
    pub fn background_space_available(&self) -> bool {
        let g = self.inner.lock();
        g.free.len() as u32 > self.reserve(Stream::Data, 1) + (self.segments / 64).max(2)
    }

    /// Room in the next commit for `nodes` map nodes that a change dirties without placing
    /// a record (a trim, zeroes, the cleaner's touch of a node in a victim): counted pending
    /// like placed records. Freeing space may use the room kept for the cleaner and all of
    /// `SEGMENTS_RESERVED` but the volume table's segments: never the commit's.
    pub fn hold_nodes(&self, nodes: usize) -> Result<Pending<'_>> {
        let g = self.inner.lock();
        if !self.nodes_fit(g.free.len(), nodes) {
            return Err(Error::NoSpace);
        }
        self.pending_nodes.fetch_add(nodes, Ordering::Relaxed);
        Ok(Pending {
            log: self,
            n: nodes,
        })
    }

    /// Whether `hold_nodes(nodes)` would succeed now.
    pub fn can_hold_nodes(&self, nodes: usize) -> bool {
        let free = self.inner.lock().free.len();
        self.nodes_fit(free, nodes)
    }

    fn nodes_fit(&self, free: usize, nodes: usize) -> bool {
        free as u32 >= TABLE_SEGMENTS + self.commit_need(nodes)
    }

    /// The log footprint of one map node (set once the layout is known).
    pub fn set_node_bytes(&self, bytes: u32) {
        self.node_bytes.store(bytes.max(1), Ordering::Relaxed);
    }

    /// The pool-wide count of dirty map nodes (`Store::note_dirty`).
    pub fn set_dirty_nodes(&self, nodes: usize) {
        self.dirty_nodes.store(nodes, Ordering::Relaxed);
    }

    /// Past this many dirty nodes a commit runs: `MAP_DIRTY_NODES_MAX`, and on a small pool
    /// no more than an eighth of it for one commit's map nodes (all copies), so the room kept
    /// for a commit never crowds out client data.
    pub fn dirty_nodes_cap(&self) -> usize {
        let per_node = self.node_bytes.load(Ordering::Relaxed) as u64 * METADATA_COPIES as u64;
        let cap = self.segments as u64 * SEGMENT_BYTES / 8 / per_node.max(1);
        (cap as usize).clamp(256, MAP_DIRTY_NODES_MAX)
    }

    /// Segments kept from client data for the cleaner: a 64th of the pool (at least
    /// `CLEAN_RESERVE_MIN`) for the records it moves, and room to rewrite every map once.
    pub fn clean_reserve_segments(&self) -> u32 {
        self.clean_reserve + self.map_reserve.load(Ordering::Relaxed)
    }

    /// About `nodes` map nodes exist over all volumes: keep room for the cleaner to rewrite
    /// them all (at the current estimate of a node's size, every copy). Without it a pass
    /// on a nearly full pool is cut short after a few victims, and a few victims' records,
    /// scattered over the map, cost more map nodes to commit than the victims give back.
    pub fn set_map_nodes(&self, nodes: u64) {
        // Rounded per copy, as `commit_need` counts: records never straddle segments.
        let node = self.node_bytes.load(Ordering::Relaxed) as u64;
        let per_copy = (nodes * node).div_ceil(SEGMENT_BYTES - node);
        let segs = (per_copy * METADATA_COPIES as u64).min((self.segments / 4) as u64);
        self.map_reserve.store(segs as u32, Ordering::Relaxed);
    }

    /// Footprint bytes client data can keep live at most, in the long run: every segment
    /// but those kept back from it (the commit's smallest room, the cleaner's), one open head
    /// per stream, and in each the part the cleaner leaves dead (`victims::LIVE_MAX`: a
    /// segment fuller than that is never cleaned). Writes near this fill wait on the cleaner.
    pub fn usable_bytes(&self) -> u64 {
        let kept = SEGMENTS_RESERVED as u64
            + METADATA_COPIES as u64
            + self.clean_reserve_segments() as u64
            + STREAMS as u64;
        // An upper bound: the victims the cleaner can still gain from (`set_clean_cost`)
        // are the emptiest, well below the average fill, so a cost-aware bound per segment
        // would promise far less than writes get (measured: issue 36's note). Where the
        // map cost of moves stops writes short of it, `status` shows that cost.
        (self.segments as u64).saturating_sub(kept) * victims::LIVE_MAX as u64
    }

    /// Map-node bytes the cleaner writes per byte it moves, as last measured
    /// (`set_clean_cost`; 0 until then).
    pub fn clean_cost(&self) -> f64 {
        self.clean_cost_milli.load(Ordering::Relaxed) as f64 / 1000.0
    }

    /// Segments kept back from client writes (the commit's room and the cleaner's), now.
    pub fn reserved_segments(&self) -> u32 {
        self.reserve(Stream::Data, 0)
    }

    /// Records placed but not yet settled (see `alloc_run`): a guard that settles them.
    pub fn pending(&self) -> Pending<'_> {
        Pending { log: self, n: 0 }
    }

    fn written_total(&self) -> u64 {
        self.written.iter().map(|w| w.load(Ordering::Relaxed)).sum()
    }

    /// Footprint bytes placed since start: client data, the cleaner's moves, metadata.
    pub fn written(&self) -> Written {
        let w = |s: Stream| self.written[s as usize].load(Ordering::Relaxed);
        Written {
            data: w(Stream::Data),
            clean: w(Stream::Clean),
            meta: w(Stream::Meta) + w(Stream::Meta2),
        }
    }

    /// Segments freed since start.
    pub fn freed_total(&self) -> u64 {
        self.freed_total.load(Ordering::Acquire)
    }

    /// A record at `addr` of `len` bytes is no longer referenced by the in-memory state.
    /// When this empties a client-data segment: `Recycle` when it is the
    /// `RECYCLE_BATCH_SEGMENTS`-th recyclable one waiting, `Commit` when it is the
    /// `release_commit_segments`-th committed one since the last `zero_sealed_for_commit`
    /// (time for a commit, so those segments can be reused while still cached).
    pub fn release_bytes(&self, addr: u64, len: u32) -> Emptied {
        let seg = segment_of(addr) as usize;
        let prev = self.live[seg].fetch_sub(len, Ordering::AcqRel);
        assert!(
            prev >= len,
            "segment {seg} live count underflow ({prev} - {len})"
        );
        self.live_total.fetch_sub(len as u64, Ordering::Relaxed);
        if prev != len {
            self.note_released(seg as u32, addr, len);
        }
        if prev != len || !self.holds_data[seg].load(Ordering::Relaxed) {
            return Emptied::Nothing;
        }
        if self.in_this_epoch(seg as u32) {
            let mut g = self.inner.lock();
            g.recyclable.push(seg as u32);
            return if g.recyclable.len() >= RECYCLE_BATCH_SEGMENTS {
                Emptied::Recycle
            } else {
                Emptied::Nothing
            };
        }
        if self.emptied.fetch_add(1, Ordering::Relaxed) + 1 == self.release_commit_segments() {
            Emptied::Commit
        } else {
            Emptied::Nothing
        }
    }

    /// A record of client data at `addr` (`len` bytes) was released from `seg`, which still
    /// holds others: its bytes become a hole once the next commit is durable (`release`).
    /// A segment that empties instead is freed whole.
    fn note_released(&self, seg: u32, addr: u64, len: u32) {
        if !self.fill_holes.load(Ordering::Relaxed)
            || self.track_freed.load(Ordering::Relaxed)
            || seg < self.reuse_floor
            || !self.evictable[seg as usize].load(Ordering::Relaxed)
        {
            return;
        }
        self.released.lock().push(Released {
            addr,
            len: aligned(len as usize) as u32,
            inc: self.stamp[seg as usize].load(Ordering::Relaxed),
        });
    }

    /// Whether `seg` was opened after the last commit's snapshot and no commit began since.
    fn in_this_epoch(&self, seg: u32) -> bool {
        let e = self.epoch.load(Ordering::SeqCst);
        e % 2 == 0 && self.born[seg as usize].load(Ordering::Relaxed) == e
    }

    /// A commit starts: nothing opened so far may be recycled any more (its snapshot may
    /// reference it), nor anything opened until `end_snapshot`.
    pub fn begin_snapshot(&self) {
        let e = self.epoch.fetch_add(1, Ordering::SeqCst);
        debug_assert!(e % 2 == 0, "nested commit snapshot");
    }

    /// The commit's references are fixed: segments opened from now on are its successor's.
    pub fn end_snapshot(&self) {
        let e = self.epoch.fetch_add(1, Ordering::SeqCst);
        debug_assert!(e % 2 == 1, "snapshot end without a start");
    }

    /// The recyclable segments waiting, for `recycle`: those sealed, empty and opened in the
    /// current epoch now (a sealed segment's live count cannot rise again), and that epoch.
    /// An entry that no longer qualifies is dropped: a segment still open when it emptied
    /// is queued again when it seals; one a commit has seen is freed by that commit.
    pub fn take_recyclable(&self) -> (Vec<u32>, u64) {
        let mut g = self.inner.lock();
        let epoch = self.epoch.load(Ordering::SeqCst);
        let mut segs = std::mem::take(&mut g.recyclable);
        segs.retain(|&s| {
            g.state[s as usize] == SegState::Sealed
                && self.live[s as usize].load(Ordering::Acquire) == 0
                && self.in_this_epoch(s)
        });
        segs.sort_unstable();
        segs.dedup();
        (segs, epoch)
    }

    /// Free the segments `take_recyclable` returned with `epoch`, unless a commit has begun
    /// since (it frees them itself: they are still sealed and empty when it collects).
    /// The caller has waited out every read that looked up a pointer into them
    /// (`Store::recycle_if_due`). Returns how many were freed.
    pub fn recycle(&self, segs: &[u32], epoch: u64) -> usize {
        let mut g = self.inner.lock();
        if self.epoch.load(Ordering::SeqCst) != epoch {
            return 0;
        }
        let mut freed = 0;
        for &s in segs {
            // Still true with the epoch unchanged (a sealed segment's count cannot rise, and
            // only a commit frees a sealed one otherwise); checked as `release` checks.
            if g.state[s as usize] == SegState::Sealed
                && self.live[s as usize].load(Ordering::Acquire) == 0
            {
                g.state[s as usize] = SegState::Free;
                g.free.insert(s);
                g.recent.push(s);
                g.holes.forget(s);
                freed += 1;
                if self.track_freed.load(Ordering::Relaxed) {
                    self.freed.lock().push(s);
                }
            }
        }
        drop(g);
        if freed > 0 {
            self.freed_total.fetch_add(freed as u64, Ordering::AcqRel);
            self.space.notify_all();
        }
        freed
    }

    /// Emptied segments worth an early commit: an eighth of the pool, within 16..=256.
    pub fn release_commit_segments(&self) -> u32 {
        (self.segments / 8).clamp(16, RELEASE_COMMIT_SEGMENTS_MAX)
    }

    /// `zero_sealed` for the commit that will free them: the early-commit count starts again,
    /// and segments waiting to be recycled are this commit's to free (called after
    /// `begin_snapshot`: none of them can be recycled any more).
    pub fn zero_sealed_for_commit(&self) -> Vec<u32> {
        self.emptied.store(0, Ordering::Relaxed);
        // Released before this commit's snapshot: no pointer of it names them, so they are
        // holes once it is durable (a commit that gives up freeing keeps them for the next).
        let released = std::mem::take(&mut *self.released.lock());
        let mut g = self.inner.lock();
        g.recyclable.clear();
        g.committing.extend(released);
        drop(g);
        self.zero_sealed()
    }

    /// Committed data segments emptied since the last `zero_sealed_for_commit`.
    pub fn emptied_since_commit(&self) -> u32 {
        self.emptied.load(Ordering::Relaxed)
    }

    /// Which opening of segment `seg` its bytes are from: the log's byte count when it was
    /// last opened, different at every opening (each opening places a record before the
    /// next can begin); 0 for a segment not opened by this process.
    pub fn incarnation(&self, seg: u32) -> u64 {
        self.stamp
            .get(seg as usize)
            .map_or(0, |s| s.load(Ordering::Relaxed))
    }

    /// Sealed segments with no live bytes: candidates to free once the next commit is durable.
    pub fn zero_sealed(&self) -> Vec<u32> {
        let g = self.inner.lock();
        (self.reuse_floor..self.segments)
            .filter(|&s| {
                g.state[s as usize] == SegState::Sealed
                    && self.live[s as usize].load(Ordering::Acquire) == 0
            })
            .collect()
    }

    /// Free segments collected by `zero_sealed` before a commit that is now durable.
    pub fn release(&self, segs: &[u32]) {
        let mut g = self.inner.lock();
        let mut freed = 0;
        for &s in segs {
            if g.state[s as usize] == SegState::Sealed
                && self.live[s as usize].load(Ordering::Acquire) == 0
            {
                g.state[s as usize] = SegState::Free;
                g.free.insert(s);
                g.recent.push(s);
                g.holes.forget(s);
                freed += 1;
                if self.track_freed.load(Ordering::Relaxed) {
                    self.freed.lock().push(s);
                }
            }
        }
        let holes = self.free_released(&mut g);
        drop(g);
        self.freed_total.fetch_add(freed, Ordering::AcqRel);
        if freed > 0 || holes {
            self.space.notify_all();
        }
    }

    /// The records released before the commit now durable become holes, except in segments
    /// freed (and perhaps opened again) since: those hold other bytes, or none. Answers
    /// whether any became one.
    fn free_released(&self, g: &mut Inner) -> bool {
        let mut any = false;
        for r in std::mem::take(&mut g.committing) {
            let seg = segment_of(r.addr);
            if g.state[seg as usize] == SegState::Free
                || self.stamp[seg as usize].load(Ordering::Relaxed) != r.inc
            {
                continue;
            }
            let start = (r.addr % SEGMENT_BYTES) as u32;
            let end = start + r.len;
            // The rest of a hole a head is filling is not in the table: nothing released
            // can lie there.
            for h in 0..STREAMS {
                if let (true, Some((hs, off))) = (g.hole_head[h], g.heads[h]) {
                    assert!(
                        hs != seg || end <= off || start >= g.limits[h],
                        "segment {seg}: released {start}..{end} inside a hole being filled"
                    );
                }
            }
            match g.holes.insert(seg, start, end) {
                holes::Added::Yes => any = true,
                holes::Added::Full => {}
                holes::Added::Overlaps => {
                    // The same bytes released twice: a live count was wrong somewhere. Not
                    // added (placing two records there would lose one).
                    debug_assert!(false, "segment {seg}: {start}..{end} released twice");
                }
            }
        }
        any
    }

    /// Sealed segments worth cleaning, best first (`victims::pick`: cost-benefit of their
    /// live bytes and age), whose live bytes together fit in `budget_bytes`, at most `max`.
    pub fn victims(&self, max: usize, budget_bytes: u64) -> Vec<u32> {
        let now = self.written_total();
        let candidates: Vec<victims::Candidate> = {
            let g = self.inner.lock();
            (self.reuse_floor..self.segments)
                .filter(|&s| g.state[s as usize] == SegState::Sealed)
                .map(|s| victims::Candidate {
                    seg: s,
                    live: self.live[s as usize].load(Ordering::Relaxed),
                    age: now.saturating_sub(self.stamp[s as usize].load(Ordering::Relaxed)),
                })
                .filter(|c| c.live > 0)
                .collect()
        };
        // Segments given back to an object store are cleaned only when no other is worth
        // it: each of their live records is a request to the store.
        let (local, remote): (Vec<_>, Vec<_>) = candidates
            .into_iter()
            .partition(|c| !self.evicted[c.seg as usize].load(Ordering::Relaxed));
        let picked = victims::pick(local, max, budget_bytes);
        if !picked.is_empty() {
            return picked;
        }
        victims::pick(remote, max, budget_bytes)
    }

    /// What moving a victim's records costs besides the records: `meta_per_moved` bytes of
    /// map nodes (every copy) written per byte moved, as the cleaner measured it.
    ///
    /// Measured, shown in `status`, not yet used to pick: the nodes a pass rewrites free
    /// their old copies, so over several passes they cost far less than right after one
    /// (a filter on this cost refused writes at 90% fill that the cleaner serves). Stuck
    /// cleaning is caught by its gain over passes instead (`pool::core::CleanGains`).
    pub fn set_clean_cost(&self, meta_per_moved: f64) {
        let m = meta_per_moved.clamp(0.0, 16.0);
        self.clean_cost_milli
            .store((m * 1000.0) as u32, Ordering::Relaxed);
    }

    /// A cleaning pass moved `moved` bytes (log space) and dirtied `nodes` map nodes that
    /// were clean: fold its cost into the average (`set_clean_cost`).
    pub fn note_clean_pass(&self, moved: u64, nodes: u64) {
        if moved == 0 {
            return;
        }
        let node = self.node_bytes.load(Ordering::Relaxed) as u64;
        let m = (nodes * node * METADATA_COPIES as u64) as f64 / moved as f64;
        let before = self.clean_cost();
        let avg = if before == 0.0 { m } else { (before + m) / 2.0 };
        self.set_clean_cost(avg);
    }

    /// Whether any sealed segment holds dead bytes worth cleaning.
    pub fn any_victim(&self) -> bool {
        !self.victims(1, SEGMENT_BYTES).is_empty()
    }

    /// Free segments in excess of what the cleaner may not take: its budget, in segments.
    pub fn clean_budget(&self) -> u32 {
        self.free_segments()
            .saturating_sub(self.reserve(Stream::Clean, 0))
    }

    /// The part of `clean_budget` the victims' live records may fill: the rest is for the
    /// map nodes their moves dirty (room to rewrite every map once, `set_map_nodes`), which
    /// cost as much as the records moved when each 4 KiB record lies under its own leaf.
    /// The maps grow while writes fill the pool, and that room with them, past what the
    /// cleaner has: then records get the share that leaves their own nodes room (at the
    /// measured cost, at least a node byte per byte), never nothing while writers wait.
    pub fn clean_budget_for_records(&self) -> u32 {
        let budget = self.clean_budget();
        let whole_maps = budget.saturating_sub(self.map_reserve.load(Ordering::Relaxed));
        let per_byte = 1.0 + self.clean_cost().max(1.0);
        whole_maps.max((budget as f64 / per_byte) as u32)
    }

    pub fn live_of(&self, seg: u32) -> u32 {
        self.live[seg as usize].load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_and_count(log: &Log) -> (u64, usize) {
        let h = log.holes();
        (h.bytes, h.count)
    }

    #[test]
    fn segments_free_only_after_release() {
        let log = Log::new(vec![0; 64], 0, true);
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
        // A commit has seen them: emptying them no longer recycles them.
        log.begin_snapshot();
        log.end_snapshot();
        let release = |range: std::ops::Range<usize>| -> Vec<bool> {
            addrs[range]
                .iter()
                .map(|&a| log.release_bytes(a, whole as u32) == Emptied::Commit)
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
                assert_eq!(
                    log.release_bytes(a, whole as u32),
                    Emptied::Nothing,
                    "{stream:?}"
                );
            }
            assert!(log.take_recyclable().0.is_empty(), "{stream:?}");
        }
    }

    /// Allocates `n` whole segments of client data and seals the last one.
    /// A commit's freeing, as `pool::txg::commit` drives it (the snapshot, the collection,
    /// then, durable and the reads drained, `release`).
    fn commit(log: &Log) {
        log.begin_snapshot();
        let zero = log.zero_sealed_for_commit();
        log.end_snapshot();
        log.release(&zero);
    }

    /// Quarter-segment records until free segments fall below where holes are filled: the
    /// addresses, four per sealed segment (one released leaves a segment 3/4 live, as full
    /// as `HOLE_LIVE_MIN` asks of a segment whose holes are filled).
    fn fill_to_holes(log: &Log) -> Vec<u64> {
        let mut addrs = Vec::new();
        while log.free_segments() >= log.low_free_segments() || addrs.len() % 4 != 0 {
            addrs.push(log.alloc(Stream::Data, QUARTER).unwrap());
        }
        addrs
    }

    const QUARTER: usize = SEGMENT_BYTES as usize / 4;

    /// Issue 36 part 5, the flaky half: the room kept to rewrite every map node
    /// (`set_map_nodes`) grows with the maps while writes fill the pool. Once it exceeded
    /// what the cleaner had, the cleaner's share for records was nothing: writers waited, the
    /// cleaner moved nothing, and writes were refused at 77% of usable bytes (1 run in 3 of
    /// `engine_under_pressure`). A pass that moves fewer records dirties fewer nodes: some
    /// room is always left to records.
    #[test]
    fn the_cleaner_moves_records_when_the_maps_outgrow_their_reserve() {
        let log = Log::new(vec![0; 512], 0, true);
        log.set_node_bytes(4096);
        let mut addrs = Vec::new();
        while let Ok(a) = log.alloc(Stream::Data, QUARTER) {
            addrs.push(a);
        }
        // Three quarters of the first 16 segments overwritten elsewhere: good victims.
        for (i, &a) in addrs[..64].iter().enumerate() {
            if i % 4 != 0 {
                log.release_bytes(a, QUARTER as u32);
            }
        }
        commit(&log);
        log.set_map_nodes(1 << 20);
        assert!(
            log.free_segments() < log.reserve(Stream::Data, 1),
            "writes wait"
        );
        let room = log.clean_budget_for_records();
        assert!(room > 0, "the cleaner has no room for records");
        let victims = log.victims(16, room as u64 * SEGMENT_BYTES);
        assert!(!victims.is_empty(), "nothing to clean with {room} segments");
    }

    #[test]
    fn a_released_record_is_filled_only_after_the_commit_that_follows_its_release() {
        let log = Log::new(vec![0; 64], 0, true);
        let half = QUARTER;
        let addrs = fill_to_holes(&log);
        let hole = addrs[4];
        log.release_bytes(hole, half as u32);
        // The last commit may still name it: a fresh segment, not the hole.
        let a = log.alloc(Stream::Data, half).unwrap();
        assert_ne!(a, hole);
        for _ in 0..3 {
            log.alloc(Stream::Data, half).unwrap();
        }
        assert_eq!(bytes_and_count(&log), (0, 0));
        commit(&log);
        assert_eq!(bytes_and_count(&log), (half as u64, 1));
        let free = log.free_segments();
        assert_eq!(
            log.alloc(Stream::Data, half).unwrap(),
            hole,
            "the hole is filled"
        );
        assert_eq!(log.free_segments(), free, "no segment taken");
        assert_eq!(log.live_of(segment_of(hole)), SEGMENT_BYTES as u32);
        assert_eq!(bytes_and_count(&log), (0, 0));
    }

    /// A segment less than 3/4 live is the cleaner's: its holes are not filled (filling
    /// every hole at 90% fill left the cleaner nothing cheap to free whole segments from).
    #[test]
    fn an_emptier_segments_holes_are_left_to_the_cleaner() {
        let log = Log::new(vec![0; 64], 0, true);
        let addrs = fill_to_holes(&log);
        log.release_bytes(addrs[4], QUARTER as u32);
        log.release_bytes(addrs[9], QUARTER as u32);
        log.release_bytes(addrs[10], QUARTER as u32);
        commit(&log);
        assert_eq!(bytes_and_count(&log), (3 * QUARTER as u64, 2));
        // Segment 1 (3/4 live) takes the next quarter; segment 2 (half live) does not.
        assert_eq!(log.alloc(Stream::Data, QUARTER).unwrap(), addrs[4]);
        let free = log.free_segments();
        let next = log.alloc(Stream::Data, QUARTER).unwrap();
        assert!(next != addrs[9] && next != addrs[10]);
        assert_eq!(
            log.free_segments(),
            free - 1,
            "a free segment, not the half-empty one"
        );
        assert_eq!(bytes_and_count(&log), (2 * QUARTER as u64, 1));
    }

    /// With holes first (`set_holes_first`) a half-live segment's holes take writes: the
    /// cleaner runs only for the segments commits need, so the data goes into holes. A
    /// segment less than a quarter live is still the cleaner's.
    #[test]
    fn holes_first_fills_a_half_live_segment() {
        // Enough segments that free ones stay `HOLES_FIRST_KEEP_VICTIMS` above the client
        // floor once holes are filled (`fill_to_holes` stops just below `low`).
        let log = Log::new(vec![0; 256], 0, true);
        log.set_holes_first(true);
        let addrs = fill_to_holes(&log);
        // Segment 2 half live; segment 3 less than a quarter.
        log.release_bytes(addrs[9], QUARTER as u32);
        log.release_bytes(addrs[10], QUARTER as u32);
        log.release_bytes(addrs[12], QUARTER as u32);
        log.release_bytes(addrs[13], QUARTER as u32);
        log.release_bytes(addrs[14], QUARTER as u32);
        log.release_bytes(addrs[15], 4096);
        commit(&log);
        let free = log.free_segments();
        let a = log.alloc(Stream::Data, QUARTER).unwrap();
        assert!(
            a == addrs[9] || a == addrs[10],
            "the half-live segment's hole"
        );
        assert_eq!(log.free_segments(), free, "no segment taken");
        let b = log.alloc(Stream::Data, QUARTER).unwrap();
        assert!(b == addrs[9] || b == addrs[10], "and its other one");
        let c = log.alloc(Stream::Data, QUARTER).unwrap();
        assert!(
            !(addrs[12]..addrs[15] + QUARTER as u64).contains(&c),
            "not the segment less than a quarter live"
        );
        assert_eq!(log.free_segments(), free - 1);
    }

    /// With holes first, once free segments come within `HOLES_FIRST_KEEP_VICTIMS` of the
    /// client floor a half-live segment is the cleaner's again: its holes are not filled,
    /// so it decays into a victim the cleaner gains from. Before, every segment a quarter
    /// live was filled to the brim, the cleaner found only segments about as live as the
    /// pool, and 4 KiB writes were refused at 83% of usable (`bench/fragmentation.sh 0.8 5
    /// 4k` with `serve --holes-first`); here the last write took the half-live hole.
    #[test]
    fn holes_first_leaves_half_live_segments_to_the_cleaner_near_its_start() {
        let log = Log::new(vec![0; 256], 0, true);
        log.set_holes_first(true);
        let addrs = fill_to_holes(&log);
        // Segments 2 and 3 half live.
        for i in [8, 9, 12, 13] {
            log.release_bytes(addrs[i], QUARTER as u32);
        }
        commit(&log);
        let in_seg = |a: u64, i: usize| (addrs[i]..addrs[i] + 2 * QUARTER as u64).contains(&a);
        let keep = log.reserved_segments() + HOLES_FIRST_KEEP_VICTIMS;
        assert!(log.free_segments() >= keep, "room to fill half-live holes");
        let a = log.alloc(Stream::Data, QUARTER).unwrap();
        assert!(in_seg(a, 8) || in_seg(a, 12), "a half-live segment's hole");
        // Commits take free segments down to just below the mark.
        while log.free_segments() >= keep {
            log.alloc(Stream::Meta, QUARTER).unwrap();
        }
        let (three_quarters, half) = if in_seg(a, 8) { (8, 12) } else { (12, 8) };
        let b = log.alloc(Stream::Data, QUARTER).unwrap();
        assert!(
            in_seg(b, three_quarters),
            "a 3/4-live segment's hole is still filled"
        );
        let free = log.free_segments();
        let c = log.alloc(Stream::Data, QUARTER).unwrap();
        assert!(
            !in_seg(c, half),
            "the half-live segment is left to the cleaner"
        );
        assert_eq!(log.free_segments(), free - 1, "a free segment instead");
    }

    /// Once writers were about to be refused (holes anywhere), a write into a hole needs
    /// only the commit's room for its map nodes and the volume table's segments, as a trim
    /// does (`hold_nodes`), not all of `SEGMENTS_RESERVED`: commits and intent-log blocks
    /// may take free segments below that, and the overwrites that would give them back
    /// were refused with holes known. `test_space_at_fill` (`single-fill-holes-0.9`)
    /// refused 4 KiB overwrites with 5 segments free, a floor of 6 and 18 MB of holes; here
    /// the write into the hole below was refused before.
    #[test]
    fn holes_anywhere_take_writes_down_to_the_commits_own_room() {
        let log = Log::new(vec![0; 64], 0, true);
        let mut addrs = Vec::new();
        while let Ok(a) = log.alloc(Stream::Data, QUARTER) {
            addrs.push(a);
        }
        let (a, b) = (addrs[8], addrs[9]);
        log.release_bytes(a, QUARTER as u32);
        log.release_bytes(b, QUARTER as u32);
        commit(&log);
        // Metadata takes what the commit's floor kept from client data.
        let room = TABLE_SEGMENTS + log.commit_need(1);
        while log.free_segments() > room {
            log.alloc(Stream::Meta, SEGMENT_BYTES as usize).unwrap();
        }
        assert!(log.free_segments() < log.reserve(Stream::Clean, 1));
        assert!(!log.space_available(Stream::Data, &[QUARTER]));
        assert!(log.open_holes_anywhere());
        assert!(
            log.space_available(Stream::Data, &[QUARTER]),
            "{} free, the commit needs {room}",
            log.free_segments()
        );
        let got = log.alloc(Stream::Data, QUARTER).unwrap();
        assert!(got == a || got == b, "{got} not in the hole");
        assert_eq!(log.free_segments(), room, "no segment taken");
        // Never the commit's own room: with one segment less, the hole is refused.
        log.alloc(Stream::Meta, SEGMENT_BYTES as usize).unwrap();
        assert!(!log.space_available(Stream::Data, &[QUARTER]));
        assert!(matches!(
            log.alloc(Stream::Data, QUARTER),
            Err(Error::NoSpace)
        ));
    }

    /// Near full, FLUSHes go to the intent log (a commit there costs more than it frees),
    /// and on the main devices each chain block is metadata, which could take the last
    /// segments: then the commit that follows, the one that frees the chain, found no room
    /// for its map nodes. A chain block now leaves the commit its room, and the flush that
    /// asked for it is answered `NoSpace` (it commits instead); the commit's own metadata
    /// still takes every segment.
    #[test]
    fn a_chain_block_leaves_the_next_commit_its_room() {
        let log = Log::new(vec![0; 64], 0, true);
        log.set_node_bytes(4096);
        while log.alloc(Stream::Data, QUARTER).is_ok() {}
        // Client writes dirtied leaves for two segments of map nodes per copy.
        log.set_dirty_nodes(400);
        let room = TABLE_SEGMENTS + log.commit_need(0);
        assert!(
            room > TABLE_SEGMENTS && log.free_segments() > room,
            "{} free",
            log.free_segments()
        );
        let block = 4096;
        let mut blocks = 0;
        while log.alloc_chain_block(Stream::Meta, block).is_ok() {
            blocks += 1;
            assert!(blocks < 64 * 256, "chain blocks took every segment");
        }
        assert_eq!(log.free_segments(), room, "after {blocks} chain blocks");
        assert!(matches!(
            log.alloc_chain_block(Stream::Meta2, block),
            Err(Error::NoSpace)
        ));
        // The commit writes its nodes into what the chain left.
        for _ in 0..room {
            log.alloc(Stream::Meta, SEGMENT_BYTES as usize).unwrap();
        }
        assert_eq!(log.free_segments(), 0);
    }

    /// Decision 0014, "holes anywhere": a writer about to be refused with holes free but
    /// only in emptier segments (the cleaner's) is let into them, until free segments are
    /// back at `low_free_segments`. Before, its write was refused with half a segment free
    /// in holes (CI, `test_random_overwrite_at_fill_never_faults[single-0.9]`).
    #[test]
    fn a_writer_about_to_be_refused_fills_the_holes_of_any_live_segment() {
        let log = Log::new(vec![0; 64], 0, true);
        let mut addrs = Vec::new();
        while let Ok(a) = log.alloc(Stream::Data, QUARTER) {
            addrs.push(a);
        }
        assert!(!log.space_available(Stream::Data, &[QUARTER]));
        // Half of one segment freed: a hole the cleaner's, not writes'.
        let (a, b) = (addrs[8], addrs[9]);
        assert_eq!(segment_of(a), segment_of(b));
        log.release_bytes(a, QUARTER as u32);
        log.release_bytes(b, QUARTER as u32);
        commit(&log);
        assert_eq!(bytes_and_count(&log), (2 * QUARTER as u64, 1));
        assert!(
            !log.space_available(Stream::Data, &[QUARTER]),
            "left to the cleaner"
        );
        assert!(log.open_holes_anywhere(), "newly opened");
        assert!(!log.open_holes_anywhere(), "once per spell");
        assert!(log.holes().anywhere);
        assert!(log.space_available(Stream::Data, &[QUARTER]));
        let free = log.free_segments();
        let got = [
            log.alloc(Stream::Data, QUARTER).unwrap(),
            log.alloc(Stream::Data, QUARTER).unwrap(),
        ];
        assert!(
            got.contains(&a) && got.contains(&b),
            "{got:?} not in the hole"
        );
        assert_eq!(log.free_segments(), free, "no segment taken");
        assert!(matches!(
            log.alloc(Stream::Data, QUARTER),
            Err(Error::NoSpace)
        ));
        // A segment with no live record is never filled: the next commit frees it whole.
        let empty: Vec<u64> = addrs
            .iter()
            .copied()
            .filter(|&x| segment_of(x) == segment_of(addrs[20]))
            .collect();
        assert_eq!(empty.len(), 4);
        for &x in &empty[..3] {
            log.release_bytes(x, QUARTER as u32);
        }
        commit(&log);
        log.release_bytes(empty[3], QUARTER as u32);
        assert!(
            !log.space_available(Stream::Data, &[QUARTER]),
            "a segment whose last record is gone is not filled"
        );
        // Space back: the holes of emptier segments are the cleaner's again.
        commit(&log);
        for &x in &addrs[24..] {
            log.release_bytes(x, QUARTER as u32);
        }
        commit(&log);
        assert!(log.free_segments() >= log.low_free_segments());
        assert!(log.space_available(Stream::Data, &[QUARTER]));
        assert!(!log.holes().anywhere, "closed once free segments recovered");
    }

    #[test]
    fn a_hole_takes_a_write_that_free_segments_no_longer_can() {
        let log = Log::new(vec![0; 64], 0, true);
        let half = QUARTER;
        let mut addrs = Vec::new();
        // Fill until client data may take no more segments (the commit's and the
        // cleaner's room are left).
        while let Ok(a) = log.alloc(Stream::Data, half) {
            addrs.push(a);
        }
        assert!(!log.space_available(Stream::Data, &[half]));
        log.release_bytes(addrs[10], half as u32);
        commit(&log);
        // The hole needs no segment: the write neither waits nor fails.
        assert!(log.space_available(Stream::Data, &[half]));
        assert!(
            !log.space_available(Stream::Data, &[half + 16]),
            "no hole holds it"
        );
        let free = log.free_segments();
        assert_eq!(log.alloc(Stream::Data, half).unwrap(), addrs[10]);
        assert_eq!(log.free_segments(), free);
        assert!(matches!(log.alloc(Stream::Data, half), Err(Error::NoSpace)));
    }

    /// A run goes into one hole that holds it whole, else into a free segment; it is
    /// spread one record per small hole only once no segment can be opened. Spread first,
    /// 64 KiB writes after 4 KiB ones crawled and were refused at 90% fill.
    #[test]
    fn a_run_takes_a_hole_whole_or_a_segment_and_small_holes_only_last() {
        let log = Log::new(vec![0; 64], 0, true);
        let rec = 4112usize;
        let run = [rec; 16];
        let mut addrs = Vec::new();
        while log.free_segments() >= log.low_free_segments() {
            addrs.push(log.alloc(Stream::Data, rec).unwrap());
        }
        let small = [addrs[100], addrs[300], addrs[500]];
        for a in small {
            log.release_bytes(a, rec as u32);
        }
        for &a in &addrs[1000..1016] {
            log.release_bytes(a, rec as u32);
        }
        commit(&log);
        let h = log.holes();
        assert_eq!((h.count, h.large_bytes), (4, 16 * rec as u64));
        // Once the head is full, the run goes into the 64 KiB hole whole: no segment.
        let free = log.free_segments();
        loop {
            let (addr, n) = log.alloc_run(Stream::Data, &run).unwrap();
            assert!(
                !small.contains(&addr),
                "a 4 KiB hole taken while a segment was free"
            );
            if addr == addrs[1000] {
                assert_eq!(n, 16);
                break;
            }
            assert_eq!(
                log.free_segments(),
                free,
                "a segment opened while a hole held the run"
            );
        }
        // The next opens a free segment rather than spread over the 4 KiB holes.
        let (addr, n) = log.alloc_run(Stream::Data, &run).unwrap();
        assert!(!small.contains(&addr) && n == 16);
        assert_eq!(log.free_segments(), free - 1);
        // Until no segment can be opened: then a small hole takes the first record.
        loop {
            let (addr, n) = log.alloc_run(Stream::Data, &run).unwrap();
            if small.contains(&addr) {
                assert_eq!(n, 1, "a 4 KiB hole holds one record");
                assert!(!log.space_available(Stream::Data, &[16 * rec]));
                break;
            }
            assert!(
                log.free_segments() > 0,
                "segments ran out before a small hole was used"
            );
        }
    }

    /// A writer woken because `space_available` says its run fits must find room in
    /// `alloc_run`, and one told to wait must not: else it spins (a first version did, at
    /// 90% fill, while its head still had room but not the floor and a hole fit).
    #[test]
    fn space_available_and_alloc_run_always_agree() {
        let mut filled = 0;
        for seed in 1..=20u64 {
            let log = Log::new(vec![0; 48], 0, true);
            let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let mut next = |n: u64| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng % n
            };
            let mut live: Vec<(u64, u32)> = Vec::new();
            for step in 0..4000 {
                let lens: Vec<usize> = (0..1 + next(16))
                    .map(|_| [4112usize, 8224, 65536 + 256, 131_072][next(4) as usize])
                    .collect();
                let said = log.space_available(Stream::Data, &lens);
                match log.alloc_run(Stream::Data, &lens) {
                    Ok((addr, n)) => {
                        assert!(said, "seed {seed} step {step}: placed after a 'wait'");
                        let mut a = addr;
                        for &l in &lens[..n] {
                            live.push((a, l as u32));
                            a += aligned(l);
                        }
                    }
                    Err(Error::NoSpace) => {
                        assert!(!said, "seed {seed} step {step}: refused after 'room'")
                    }
                    Err(e) => panic!("{e}"),
                }
                // The placer's leaves counted dirty and committed (what `Pending` settles).
                log.pending_nodes.store(0, Ordering::Relaxed);
                // Fewer records released than placed, on average: the log fills, and stays
                // near full once the floors refuse.
                for _ in 0..next(10) {
                    if live.is_empty() {
                        break;
                    }
                    let i = next(live.len() as u64) as usize;
                    let (a, l) = live.swap_remove(i);
                    log.release_bytes(a, l);
                }
                if next(8) == 0 {
                    commit(&log);
                }
            }
            filled += log.holes().filled_bytes;
        }
        assert!(filled > 0, "no run filled a hole: the test proves nothing");
    }

    #[test]
    fn holes_wait_while_free_segments_are_plenty() {
        let log = Log::new(vec![0; 64], 0, true);
        let half = SEGMENT_BYTES as usize / 2;
        let a = log.alloc(Stream::Data, half).unwrap();
        log.alloc(Stream::Data, half).unwrap();
        log.release_bytes(a, half as u32);
        commit(&log);
        assert_eq!(bytes_and_count(&log), (half as u64, 1));
        assert_ne!(log.alloc(Stream::Data, half).unwrap(), a);
        // Off: released bytes are not even noted.
        log.set_fill_holes(false);
        let b = log.alloc(Stream::Data, half).unwrap();
        log.alloc(Stream::Data, half).unwrap();
        log.release_bytes(b, half as u32);
        commit(&log);
        assert_eq!(bytes_and_count(&log), (half as u64, 1));
    }

    #[test]
    fn a_segment_that_empties_is_freed_whole_never_filled() {
        let log = Log::new(vec![0; 64], 0, true);
        let half = SEGMENT_BYTES as u32 / 2;
        let addrs = fill_to_holes(&log);
        let (a, b) = (addrs[4], addrs[5]);
        assert_eq!(segment_of(a), segment_of(b));
        log.release_bytes(a, half);
        commit(&log);
        assert_eq!(bytes_and_count(&log), (half as u64, 1));
        // Its last record goes: the segment is empty, the next commit frees it whole (the
        // one under way may have collected it), so its hole is not taken meanwhile.
        log.release_bytes(b, half);
        let c = log.alloc(Stream::Data, half as usize).unwrap();
        assert_ne!(segment_of(c), segment_of(a));
        commit(&log);
        assert!(log.is_free(segment_of(a)));
        assert_eq!(bytes_and_count(&log), (0, 0), "a free segment has no holes");
    }

    #[test]
    fn bytes_released_from_a_segment_recycled_before_the_commit_never_become_a_hole() {
        let log = Log::new(vec![0; 256], 0, true);
        let whole = SEGMENT_BYTES as u32;
        let quarter = whole / 4;
        // A segment of this epoch with four records: one released (noted for the next
        // commit), then the rest, so it is recycled and opened again before any commit.
        let recs: Vec<u64> = (0..4)
            .map(|_| log.alloc(Stream::Data, quarter as usize).unwrap())
            .collect();
        let seg = segment_of(recs[0]);
        let mut others = whole_segments(&log, RECYCLE_BATCH_SEGMENTS - 1);
        others.iter().for_each(|&a| {
            log.release_bytes(a, whole);
        });
        for &r in &recs {
            log.release_bytes(r, quarter);
        }
        let (segs, epoch) = log.take_recyclable();
        assert!(segs.contains(&seg));
        log.recycle(&segs, epoch);
        assert!(log.is_free(seg));
        others.clear();
        // Opened again (most recently freed first) and written whole.
        let again = (0..RECYCLE_BATCH_SEGMENTS)
            .map(|_| log.alloc(Stream::Data, whole as usize).unwrap())
            .find(|&a| segment_of(a) == seg);
        assert!(again.is_some(), "segment {seg} opened again");
        commit(&log);
        assert_eq!(
            bytes_and_count(&log),
            (0, 0),
            "the released bytes are another record's now"
        );
    }

    fn whole_segments(log: &Log, n: usize) -> Vec<u64> {
        let whole = SEGMENT_BYTES as usize;
        let addrs = (0..n)
            .map(|_| log.alloc(Stream::Data, whole).unwrap())
            .collect();
        log.alloc(Stream::Data, 4096).unwrap();
        addrs
    }

    #[test]
    fn a_segment_emptied_in_the_epoch_it_was_opened_in_is_recycled_without_a_commit() {
        let log = Log::new(vec![0; 256], 0, true);
        let whole = SEGMENT_BYTES as u32;
        let addrs = whole_segments(&log, RECYCLE_BATCH_SEGMENTS);
        let free = log.free_segments();
        let asks: Vec<Emptied> = addrs.iter().map(|&a| log.release_bytes(a, whole)).collect();
        assert!(asks[..RECYCLE_BATCH_SEGMENTS - 1]
            .iter()
            .all(|&e| e == Emptied::Nothing));
        assert_eq!(
            asks[RECYCLE_BATCH_SEGMENTS - 1],
            Emptied::Recycle,
            "a full batch asks"
        );
        let (segs, epoch) = log.take_recyclable();
        assert_eq!(segs.len(), RECYCLE_BATCH_SEGMENTS);
        assert_eq!(log.recycle(&segs, epoch), RECYCLE_BATCH_SEGMENTS);
        assert_eq!(log.free_segments(), free + RECYCLE_BATCH_SEGMENTS as u32);
        // The most recently recycled segment is taken first (its pages are cached).
        assert_eq!(
            segment_of(log.alloc(Stream::Data, whole as usize).unwrap()),
            segment_of(addrs[RECYCLE_BATCH_SEGMENTS - 1])
        );
    }

    #[test]
    fn a_segment_a_commit_may_reference_is_never_recycled() {
        let log = Log::new(vec![0; 256], 0, true);
        let whole = SEGMENT_BYTES as u32;
        // Opened before a commit's snapshot, emptied after it began.
        let before = whole_segments(&log, 2);
        log.begin_snapshot();
        // Opened while the snapshot is taken.
        let during = whole_segments(&log, 2);
        assert_eq!(log.release_bytes(before[0], whole), Emptied::Nothing);
        log.end_snapshot();
        // Emptied after the snapshot: still not recyclable, for either.
        for a in [before[1], during[0], during[1]] {
            assert_eq!(log.release_bytes(a, whole), Emptied::Nothing);
        }
        assert!(log.take_recyclable().0.is_empty());
        // Emptied before the commit began, but recycled after: the commit frees it instead.
        let after = whole_segments(&log, 1);
        assert_eq!(log.release_bytes(after[0], whole), Emptied::Nothing);
        let (segs, epoch) = log.take_recyclable();
        assert_eq!(segs, [segment_of(after[0])]);
        log.begin_snapshot();
        assert_eq!(log.recycle(&segs, epoch), 0, "a commit began since");
        // The commit's own collection (taken after its snapshot began) has them all.
        assert_eq!(log.zero_sealed_for_commit().len(), 5);
        log.end_snapshot();
    }

    /// An entry left waiting when a commit freed its segment must not recycle the segment
    /// once it is reused: it is live again, and a reader may look a block up in it after
    /// the recycler waited out the readers and before its last block is overwritten.
    #[test]
    fn a_recycled_entry_never_outlives_its_segment() {
        let log = Log::new(vec![0; 256], 0, true);
        let whole = SEGMENT_BYTES as u32;
        let first = whole_segments(&log, 1)[0];
        let seg = segment_of(first);
        assert_eq!(log.release_bytes(first, whole), Emptied::Nothing);
        // A commit collects it, becomes durable and frees it; it is reused at once.
        log.begin_snapshot();
        let zero = log.zero_sealed_for_commit();
        log.end_snapshot();
        assert!(zero.contains(&seg));
        log.release(&zero);
        let again = log.alloc(Stream::Data, whole as usize).unwrap();
        assert_eq!(segment_of(again), seg, "most recently freed first");
        log.alloc(Stream::Data, 4096).unwrap();
        // Live again: nothing to recycle, now or after its last block goes.
        let (segs, epoch) = log.take_recyclable();
        assert!(segs.is_empty(), "{segs:?}");
        log.release_bytes(again, whole);
        assert_eq!(log.recycle(&segs, epoch), 0);
        assert_eq!(log.take_recyclable().0, [seg], "emptied in its new epoch");
    }

    /// A head segment emptied while still open (its blocks trimmed) is recycled once sealed,
    /// not while it can still take records.
    #[test]
    fn a_segment_emptied_while_open_is_recycled_once_sealed() {
        let log = Log::new(vec![0; 256], 0, true);
        let a = log.alloc(Stream::Data, 4096).unwrap();
        log.release_bytes(a, 4096);
        assert!(log.take_recyclable().0.is_empty(), "still the head");
        let b = log.alloc(Stream::Data, 4096).unwrap();
        assert_eq!(segment_of(a), segment_of(b));
        log.release_bytes(b, 4096);
        // Sealed by the next record that does not fit.
        let c = log.alloc(Stream::Data, SEGMENT_BYTES as usize).unwrap();
        assert_ne!(segment_of(c), segment_of(a));
        assert_eq!(log.take_recyclable().0, [segment_of(a)]);
    }

    #[test]
    fn segments_written_before_this_process_are_never_recycled() {
        let whole = SEGMENT_BYTES as u32;
        let log = Log::new(vec![whole; 64], 64, true);
        // Imported segments hold committed client data; the process empties them.
        for s in 0..64 {
            log.mark_data(s);
        }
        let n = log.release_commit_segments();
        let asks: Vec<Emptied> = (0..n)
            .map(|s| log.release_bytes(s as u64 * SEGMENT_BYTES, whole))
            .collect();
        assert!(log.take_recyclable().0.is_empty());
        // They wait for a commit, and enough of them ask for one early.
        assert_eq!(asks.last(), Some(&Emptied::Commit));
        assert_eq!(log.zero_sealed().len(), n as usize);
    }

    #[test]
    fn data_cannot_take_reserved_segments() {
        // One segment more than client data may not take when it places a record.
        let reserved = Log::new(vec![0; 64], 0, true).reserve(Stream::Data, 1);
        assert!(reserved >= SEGMENTS_RESERVED + CLEAN_RESERVE_MIN);
        let log = Log::new(vec![0; reserved as usize + 1], 0, true);
        log.alloc(Stream::Data, SEGMENT_BYTES as usize).unwrap();
        assert!(matches!(log.alloc(Stream::Data, 4096), Err(Error::NoSpace)));
        // The cleaner may take its room; metadata everything.
        log.alloc(Stream::Clean, SEGMENT_BYTES as usize).unwrap();
        assert!(log.alloc(Stream::Meta, 4096).is_ok());
    }

    /// Records placed raise what the next commit needs before their leaves are dirty: client
    /// data stops short of the commit's room even while its head segment has space.
    #[test]
    fn placed_records_count_toward_the_commit_room_until_settled() {
        let segs = 64u32;
        let log = Log::new(vec![0; segs as usize], 0, true);
        log.set_node_bytes(4096);
        let base = log.reserve(Stream::Data, 0);
        let mut pending = log.pending();
        // 4 KiB nodes: 256 leaves fill a segment per copy.
        let mut placed = 0usize;
        loop {
            match log.alloc_run(Stream::Data, &[16; 256]) {
                Ok((_, n)) => {
                    pending.add(n);
                    placed += n;
                }
                Err(Error::NoSpace) => break,
                Err(e) => panic!("{e}"),
            }
            assert!(placed < 1 << 20, "never refused");
        }
        // Each record may dirty a leaf: the commit then needs room for all of them, and
        // client data stopped before taking it.
        let need = log.reserve(Stream::Data, 0);
        assert!(need > base, "{need} > {base}");
        assert!(log.free_segments() >= log.commit_need(0) + SEGMENTS_RESERVED);
        drop(pending);
        assert_eq!(log.reserve(Stream::Data, 0), base, "settled");
        assert!(log.alloc_run(Stream::Data, &[16; 256]).is_ok());
    }

    #[test]
    fn unknown_accounting_keeps_used_segments_sealed() {
        let log = Log::new(vec![0; 10], 6, false);
        assert_eq!(log.free_segments(), 4);
        assert_eq!(segment_of(log.alloc(Stream::Meta, 16).unwrap()), 6);
        // Not even a commit frees them: an unreadable map node may still point into them
        // (the import's own commit did, before).
        log.begin_snapshot();
        let zero = log.zero_sealed_for_commit();
        log.end_snapshot();
        assert!(zero.is_empty(), "{zero:?}");
        log.release(&zero);
        assert_eq!(log.free_segments(), 3);
    }

    #[test]
    fn a_segment_opened_again_after_its_mark_is_never_given_back() {
        let log = Log::new(vec![0; 64], 0, true);
        let seg = log.free_held()[0];
        assert!(log.set_evicted(seg));
        assert_eq!(log.evicted_count(), 1);
        // A writer opens it before the hole is punched: the mark goes, and so does the
        // punch (its new bytes stay).
        let addr = log.alloc(Stream::Data, 4096).unwrap();
        assert_eq!(
            segment_of(addr),
            seg,
            "the log did not take the marked segment"
        );
        assert!(!log.is_evicted(seg));
        assert_eq!(log.evicted_count(), 0);
        let punched = log
            .give_back(seg, || panic!("a segment opened again was given back"))
            .unwrap();
        assert!(!punched);
    }

    #[test]
    fn a_device_that_cannot_give_back_clears_the_mark() {
        let log = Log::new(vec![0; 8], 0, true);
        let seg = log.free_held()[0];
        assert!(log.set_evicted(seg));
        assert!(!log.give_back(seg, || Ok(false)).unwrap());
        assert!(
            !log.is_evicted(seg),
            "reads would go to the store for local bytes"
        );
        assert!(log.set_evicted(seg));
        assert!(log.give_back(seg, || Ok(true)).unwrap());
        assert!(log.is_evicted(seg));
        assert!(!log.free_held().contains(&seg));
    }

    #[test]
    fn a_segment_is_marked_for_eviction_only_as_checked() {
        let log = Log::new(vec![0; 64], 0, true);
        log.track_freed(); // an object tier: puts under way are counted
                           // Listed free, then opened by a writer before the mark: not marked.
        let seg = log.free_held()[0];
        let first = log.alloc(Stream::Data, 4096).unwrap();
        assert_eq!(segment_of(first), seg);
        assert!(
            !log.mark_for_eviction(seg, None),
            "an open segment marked as free"
        );
        let inc = log.incarnation(seg);
        assert!(
            !log.mark_for_eviction(seg, Some(inc)),
            "the open head was marked"
        );
        // Sealed by later allocations while the first put is still under way: not marked.
        loop {
            let a = log.alloc(Stream::Data, 65536).unwrap();
            if segment_of(a) != seg {
                log.put_done(a);
                break;
            }
            log.put_done(a);
        }
        assert!(
            !log.mark_for_eviction(seg, Some(inc)),
            "a segment with a put under way was marked"
        );
        log.put_done(first);
        assert!(
            !log.mark_for_eviction(seg, Some(inc + 1)),
            "marked although opened again since the check"
        );
        assert!(log.mark_for_eviction(seg, Some(inc)));
        assert!(log.is_evicted(seg));
    }

    #[test]
    fn a_segment_opened_again_is_never_overwritten_by_bringing_it_back() {
        let log = Log::new(vec![0; 64], 0, true);
        let seg = log.free_held()[0];
        assert!(log.mark_for_eviction(seg, None));
        let a = log.alloc(Stream::Data, 4096).unwrap();
        assert_eq!(segment_of(a), seg);
        let wrote = log
            .bring_back(seg, 0, || {
                panic!("old bytes written over a segment opened again")
            })
            .unwrap();
        assert!(!wrote);
    }
}
