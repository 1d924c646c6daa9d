//! What the control plane asks of the store. `Store` keeps its log, its redundancy, its
//! node cache and its reuse gate private: the pool and the volumes ask these narrow
//! questions and take these steps instead of reaching in, so that every rule the store
//! keeps (a record placed only by `put`, released only by `release`, a segment reused only
//! through the reuse gate) stays inside `store/`.
//!
//! Grouped by who asks: the volumes' reads, the state the daemon shares (closing, client
//! operations, thick reservations), space and cleaning, commits and the intent log, the
//! object tier's local cache and uploads, the devices.

use std::sync::atomic::Ordering;

use crate::checksum::Checksum;
use crate::constants::SEGMENT_BYTES;
use crate::log::{Log, Pending, Stream, Written};
use crate::map::{Blkptr, NodeCache};
use crate::redundancy::{Layout, Member, ScrubOutcome};
use crate::sync::RwLockReadGuard;
use crate::Result;

use super::pace::PaceCounts;
use super::{Extent, Store};

/// A commit's or a flush's snapshot of the map (`Log::begin_snapshot`): nothing is recycled
/// while it is held; ended when dropped, also on errors.
pub struct MapSnapshot<'a>(&'a Store);

impl Drop for MapSnapshot<'_> {
    fn drop(&mut self) {
        self.0.log.end_snapshot();
    }
}

impl Store {
    // --- the volumes' reads ---

    /// The shared node cache every map operation takes next to the store (the tree's
    /// functions take both): it keeps decoded nodes and has its own lock, and no rule of
    /// the store's depends on who reads or fills it.
    pub fn nodes(&self) -> &NodeCache {
        &self.cache
    }

    /// Held by a read from the lookup of its pointers until its bytes are verified: no
    /// segment is reused under it (`gate`). The cleaner and the scrub take it too.
    pub fn hold_reads(&self) -> RwLockReadGuard<'_, ()> {
        self.reuse_gate.read()
    }

    /// `n` client reads start: counted (the scrub backs off while they come), and held
    /// against segment reuse until the guard drops (`hold_reads`).
    pub fn client_read(&self, n: u64) -> RwLockReadGuard<'_, ()> {
        self.note_client_ops(n);
        self.reuse_gate.read()
    }

    /// `n` client operations came (reads or writes): the scrub backs off.
    pub fn note_client_ops(&self, n: u64) {
        self.client_ops.fetch_add(n, Ordering::Relaxed);
    }

    /// Client operations counted since start: it only grows, so whoever compares two
    /// readings (the defragmenter's quiet time, the object tier's check) sees every
    /// operation between them.
    pub fn client_ops(&self) -> u64 {
        self.client_ops.load(Ordering::Relaxed)
    }

    /// Client operations counted since the last call (the scrub's pacing). It once reset
    /// the count itself, so the defragmenter took a client busy beside a scrub for quiet.
    pub fn take_client_ops(&self) -> u64 {
        let now = self.client_ops.load(Ordering::Relaxed);
        now - self.client_ops_taken.swap(now, Ordering::Relaxed).min(now)
    }

    /// Whether records can be written end to end in one device write per copy.
    pub fn runs_end_to_end(&self) -> bool {
        self.red.runs_end_to_end()
    }

    /// Read `len` bytes lying end to end from `addr` on the devices, unverified (the caller
    /// verifies each record in them).
    pub fn read_run(&self, addr: u64, len: usize, out: &mut Vec<u8>) -> Result<()> {
        self.red.read_run(addr, len, out)
    }

    /// Map nodes a volume may keep dirty before it commits (room in the log for them).
    pub fn dirty_nodes_cap(&self) -> usize {
        self.log.dirty_nodes_cap()
    }

    /// An empty list of records placed and not yet in a commit (`put` adds to it).
    pub fn pending(&self) -> Pending<'_> {
        self.log.pending()
    }

    /// Room in the next commit for `nodes` map nodes, or `NoSpace` at once (the cleaner:
    /// `hold_nodes` waits instead).
    pub fn try_hold_nodes(&self, nodes: usize) -> Result<Pending<'_>> {
        self.log.hold_nodes(nodes)
    }

    // --- what the daemon shares ---

    /// The salt this run seals data blocks under (`keys::ring`).
    pub fn run_salt(&self) -> [u8; 16] {
        self.run_salt
    }

    /// The pool is closing: writers waiting for space give up, background work stops.
    pub fn close(&self) {
        self.closing.store(true, Ordering::SeqCst);
    }

    /// Whether the pool is closing (`close`).
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    /// Bytes thick volumes reserved and have not stored yet, as last counted.
    pub fn thick_unused(&self) -> u64 {
        self.thick_unused.load(Ordering::Relaxed)
    }

    /// The control plane's new count of `thick_unused`.
    pub fn set_thick_unused(&self, bytes: u64) {
        self.thick_unused.store(bytes, Ordering::Relaxed);
    }

    /// What pacing writers to the local cache's size has done (`pace`).
    pub fn pace_counts(&self) -> PaceCounts {
        self.pace.counts()
    }

    /// The size the local cache is held to (0: none).
    pub fn cache_cap(&self) -> u64 {
        self.pace.cap()
    }

    /// The end of a pass of the local cache: writers it paces look at the room again.
    /// `stalled`: the pass could not give room back (its commit failed, or it gave back
    /// nothing: also always on devices that cannot punch holes); paced writers then go on
    /// while the devices are still past the cap.
    pub fn cache_pass_done(&self, stalled: bool) {
        let cap = self.pace.cap();
        if cap > 0 {
            let now = self.red.allocated_bytes();
            self.pace.pass_done(now, stalled && now > cap);
        }
    }

    // --- space and cleaning ---

    /// Segments in the pool.
    pub fn segments(&self) -> u32 {
        self.log.segments()
    }

    /// Segments free now.
    pub fn free_segments(&self) -> u32 {
        self.log.free_segments()
    }

    /// Segments kept back for commits and cleaning.
    pub fn reserved_segments(&self) -> u32 {
        self.log.reserved_segments()
    }

    /// Live bytes over every segment (in segment space).
    pub fn live_bytes_total(&self) -> u64 {
        self.log.live_bytes_total()
    }

    /// Segment space client data may take (what is kept back for commits and cleaning
    /// left out).
    pub fn usable_bytes(&self) -> u64 {
        self.log.usable_bytes()
    }

    /// Usable bytes per byte of segment space (K for parity, 1 otherwise).
    pub fn data_per_segment_byte(&self) -> u64 {
        self.red.data_per_segment_byte()
    }

    /// Bytes each stream has placed so far.
    pub fn written(&self) -> Written {
        self.log.written()
    }

    /// Data segments emptied since the last commit took its snapshot (a commit would free
    /// them). O(1).
    pub fn emptied_since_commit(&self) -> u32 {
        self.log.emptied_since_commit()
    }

    /// Segments the next commit writes for the map nodes dirty now. O(1).
    pub fn commit_segments(&self) -> u32 {
        self.log.commit_need(0)
    }

    /// Sealed segments with nothing live in them.
    pub fn zero_sealed(&self) -> Vec<u32> {
        self.log.zero_sealed()
    }

    /// Map-node bytes written per byte the cleaner moved, lately.
    pub fn clean_cost(&self) -> f64 {
        self.log.clean_cost()
    }

    /// Free bytes in holes and how many (decision 0014), and bytes client writes placed
    /// in them since start.
    pub fn holes(&self) -> crate::log::HoleCounts {
        self.log.holes()
    }

    /// Client writes fill holes when free segments run short (`OpenOptions::fill_holes`).
    pub fn set_fill_holes(&self, on: bool) {
        self.log.set_fill_holes(on);
    }

    /// Holes first (`OpenOptions::holes_first`, `Log::set_holes_first`).
    pub fn set_holes_first(&self, on: bool) {
        self.log.set_holes_first(on);
    }

    /// Whether holes come first (`Log::holes_first`).
    pub fn holes_first(&self) -> bool {
        self.log.holes_first()
    }

    /// Free segments below which writes fill holes and the cleaner may run.
    pub fn low_free_segments(&self) -> u32 {
        self.log.low_free_segments()
    }

    /// Whether a run of client records of `lens` bytes could be placed now without a wait
    /// (`Log::space_available`).
    pub fn data_fits(&self, lens: &[usize]) -> bool {
        self.log.space_available(crate::log::Stream::Data, lens)
    }

    /// Whether background work (key rotation) may take space now.
    pub fn background_space_available(&self) -> bool {
        self.log.background_space_available()
    }

    /// The next cleaning batch: up to `max` victims whose live records fit the cleaner's
    /// room in the log, and that room in segments.
    pub fn clean_victims(&self, max: usize) -> (Vec<u32>, u32) {
        let room = self.log.clean_budget_for_records();
        (self.log.victims(max, room as u64 * SEGMENT_BYTES), room)
    }

    /// A cleaning pass moved `moved` bytes and dirtied `nodes` map nodes (its cost).
    pub fn note_clean_pass(&self, moved: u64, nodes: u64) {
        self.log.note_clean_pass(moved, nodes);
    }

    /// Segment space one stored record of `len` bytes takes over every copy or shard.
    pub fn footprint(&self, len: usize) -> usize {
        self.red.footprint(len)
    }

    /// Refuses a pointer that cannot be in this pool (`Redundancy::check_record`).
    pub fn check_record(&self, p: &Blkptr) -> Result<()> {
        self.red.check_record(p.addrs(), p.len as usize)
    }

    // --- commits and the intent log ---

    /// At import: the log rebuilt from the recount takes the place of the empty one the
    /// store was made with, with the segments that hold client data marked.
    pub fn install_log(&mut self, log: Log, data_segments: &[bool]) {
        self.log = log;
        self.log.set_node_bytes(self.node_record_bytes());
        for (seg, _) in data_segments.iter().enumerate().filter(|(_, &d)| d) {
            self.log.mark_data(seg as u32);
        }
    }

    /// The map nodes dirty over every volume, for the room the next commit keeps.
    pub fn set_map_nodes(&self, nodes: u64) {
        self.log.set_map_nodes(nodes);
    }

    /// The bytes one map node is expected to take, for the room the next commit keeps.
    pub fn set_node_bytes(&self, bytes: u32) {
        self.log.set_node_bytes(bytes);
    }

    /// The highest segment ever opened (the superblock keeps it).
    pub fn high_water(&self) -> u32 {
        self.log.high_water()
    }

    /// Begin a commit's or a flush's snapshot: nothing is recycled until the guard drops.
    pub fn snapshot_map(&self) -> MapSnapshot<'_> {
        self.log.begin_snapshot();
        MapSnapshot(self)
    }

    /// The empty sealed segments a commit frees once durable (none recycled from here on).
    pub fn zero_sealed_for_commit(&self) -> Vec<u32> {
        self.log.zero_sealed_for_commit()
    }

    /// After a durable commit: free `zero` for reuse once reads that may point into them
    /// finished (`ReuseGate::free_committed`). `false`: a read held the gate too long;
    /// the next commit frees them.
    pub fn free_committed(&self, zero: &[u32]) -> bool {
        self.reuse_gate
            .free_committed(&self.log, zero, self.has_remote())
    }

    /// Commits in a row that left their empty segments to a later one because a read held
    /// the reuse gate (`ReuseGate::deferrals`).
    pub fn gate_deferrals(&self) -> u64 {
        self.reuse_gate.deferrals()
    }

    /// A commit ended: writers waiting for space look again.
    pub fn wake_space_waiters(&self) {
        self.log.space.notify_all();
    }

    /// Place one intent-log block of `len` bytes on metadata stream `stream` (`Meta` or
    /// `Meta2`), its address noted for the object tier. Released by `release`.
    #[track_caller]
    pub fn place_log_block(&self, stream: Stream, len: usize) -> Result<u64> {
        let a = self
            .log
            .alloc_chain_block(stream, self.red.footprint(len))?;
        let footprint = self.red.footprint(len) as u64;
        self.live
            .placed(a, footprint, std::panic::Location::caller());
        self.placed_at(a);
        Ok(a)
    }

    /// Write bytes in place at `addr`, placed before by the caller: an intent-log block, a
    /// copy repaired at replay.
    pub fn write_at(&self, addr: u64, bytes: &[u8]) -> Result<()> {
        self.red.write(addr, bytes)
    }

    /// Flush every writable device.
    pub fn flush_devices(&self) -> Result<()> {
        self.red.flush()
    }

    /// Read the copies of a record at `addrs` until one's bytes match `sum` and `accept`
    /// takes them, without repairing or counting errors (`Redundancy::read_quiet`).
    pub fn read_quiet(
        &self,
        addrs: &[u64],
        len: usize,
        sum: &Checksum,
        out: &mut Vec<u8>,
        accept: &dyn Fn(&[u8]) -> bool,
    ) -> Result<bool> {
        self.red.read_quiet(addrs, len, sum, out, accept)
    }

    /// Scrub one record the devices hold (a map node, the volume table: never given back).
    pub fn scrub_local(&self, p: &Blkptr, buf: &mut Vec<u8>) -> ScrubOutcome {
        self.red.scrub(p.addrs(), p.len as usize, &p.checksum, buf)
    }

    // --- the object tier: uploads and the local cache ---

    /// Note every segment holding live data for the next upload (a pool whose store is
    /// new, or behind). Returns how many.
    pub fn note_live_segments(&self) -> usize {
        let segs: Vec<u32> = (0..self.log.segments())
            .filter(|&s| self.log.live_of(s) > 0)
            .collect();
        for &seg in &segs {
            self.note_segment(seg);
        }
        segs.len()
    }

    /// Of `segs` (segments the store's table holds), those free now leave the table with
    /// the next upload.
    pub fn note_free_among(&self, segs: impl IntoIterator<Item = u32>) {
        for seg in segs {
            if self.log.is_free(seg) {
                self.log.note_freed(seg);
            }
        }
    }

    /// Segments freed since the last upload, taken for it (`return_freed` if it fails).
    pub fn take_freed(&self) -> Vec<u32> {
        self.log.take_freed()
    }

    /// Give back what `take_freed` took, for the next upload.
    pub fn return_freed(&self, segs: Vec<u32>) {
        self.log.return_freed(segs);
    }

    /// Whether extent `e` still holds the bytes it was placed with: its segment not freed
    /// nor opened again since.
    pub fn extent_current(&self, e: &Extent) -> bool {
        self.log.incarnation(e.seg) == e.inc && !self.log.is_free(e.seg)
    }

    /// Which opening of segment `seg` it is (`Log::incarnation`).
    pub fn incarnation(&self, seg: u32) -> u64 {
        self.log.incarnation(seg)
    }

    /// Whether segment `seg` is free.
    pub fn is_free(&self, seg: u32) -> bool {
        self.log.is_free(seg)
    }

    /// Whether segment `seg` holds client data the local cache may give back.
    pub fn is_evictable(&self, seg: u32) -> bool {
        self.log.is_evictable(seg)
    }

    /// Whether segment `seg` was given back (its reads go to the object store).
    pub fn is_evicted(&self, seg: u32) -> bool {
        self.log.is_evicted(seg)
    }

    /// Segments given back.
    pub fn evicted_count(&self) -> u32 {
        self.log.evicted_count()
    }

    /// Given-back segments that still hold live data.
    pub fn evicted_live(&self) -> Vec<u32> {
        self.log.evicted_live()
    }

    /// Free segments not given back yet.
    pub fn free_held(&self) -> Vec<u32> {
        self.log.free_held()
    }

    /// Sealed segments of client data the local cache may give back, oldest first.
    pub fn eviction_candidates(&self) -> Vec<u32> {
        self.log.eviction_candidates()
    }

    /// Bytes of local storage the devices take.
    pub fn local_bytes(&self) -> u64 {
        self.red.allocated_bytes()
    }

    /// Bytes of local storage one segment takes over every copy.
    pub fn bytes_per_segment(&self) -> u64 {
        self.red.bytes_per_segment()
    }

    /// Mark segment `seg` given back if it still is what was checked (`Log::mark_for_eviction`).
    pub fn mark_for_eviction(&self, seg: u32, opening: Option<u64>) -> bool {
        self.log.mark_for_eviction(seg, opening)
    }

    /// Read segment `seg` locally again.
    pub fn unmark(&self, seg: u32) {
        self.log.unmark(seg);
    }

    /// Punch marked segment `seg` out of the devices (`Log::give_back`).
    pub fn give_back_segment(&self, seg: u32) -> Result<bool> {
        self.log.give_back(seg, || self.red.discard_segment(seg))
    }

    /// At open: mark segment `seg` given back when it is a hole on a member. Returns
    /// whether it was marked now.
    pub fn mark_if_hole(&self, seg: u32) -> bool {
        self.red.segment_is_hole(seg) && self.log.set_evicted(seg)
    }

    /// Write given-back segment `seg`'s bytes `parts` (offset in the segment, bytes) back
    /// to the devices, only while it is still the marked, sealed segment of `opening`
    /// (`Log::bring_back`). `false`: it changed meanwhile, nothing written.
    pub fn write_back(&self, seg: u32, opening: u64, parts: &[(u32, Vec<u8>)]) -> Result<bool> {
        let base = seg as u64 * SEGMENT_BYTES;
        self.log.bring_back(seg, opening, || {
            for (off, bytes) in parts {
                self.red.write(base + *off as u64, bytes)?;
            }
            Ok(())
        })
    }

    /// Make the segments `write_back` wrote durable, then read them locally again (one
    /// flush for the batch).
    pub fn settle_written_back(&self, written: &[u32]) -> Result<()> {
        if written.is_empty() {
            return Ok(());
        }
        self.red.flush()?;
        for &seg in written {
            self.log.unmark(seg);
        }
        Ok(())
    }

    // --- the devices ---

    /// The member devices, in order. The pool's device operations (status, offline,
    /// online, replace, superblocks and labels) act on each member, which guards its own
    /// state; handing them out whole is the one wide accessor.
    pub fn members(&self) -> &[Member] {
        &self.red.members
    }

    /// The pool's layout.
    pub fn layout(&self) -> Layout {
        self.red.layout
    }

    /// Blocks repaired and blocks found unrecoverable since open.
    pub fn repair_counts(&self) -> (u64, u64) {
        (
            self.red.repaired_blocks.load(Ordering::Relaxed),
            self.red.unrecoverable_blocks.load(Ordering::Relaxed),
        )
    }
}
