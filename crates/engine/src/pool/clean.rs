//! Cleaner: reclaim segments whose records are mostly dead.
//!
//! A pass asks the log for victims (`log::victims`: cost-benefit of live bytes and age)
//! whose live bytes fit the room the cleaner may use (`Log::clean_budget`), walks every
//! volume's map over them, and moves the live records it finds:
//! - data blocks are copied verbatim (stored bytes, verified by checksum — no key needed,
//!   so locked volumes are cleaned too; the nonce and checksum stay, only the address
//!   changes: relocation never encrypts) and swapped into the map only if the map still
//!   points at the old copy (a client write in between wins);
//! - map nodes in a victim are marked dirty, so the next commit rewrites them;
//! - the volume table is rewritten by every commit anyway.
//!
//! After the commit that follows, the victims hold nothing live and are freed.
//!
//! A volume with snapshots or clones is walked tree by tree, each against the one before
//! it, so a record several trees share is found once; it is moved once and installed in
//! every tree that holds it (clones first, each run of trees newest first), and the old
//! copy released once, after the last. A FLUSH waiting for the commit lock the pass holds
//! is answered between two batches (`answer_waiting_flushes`: an intent-log write or a
//! commit, as `Core::flush_held` chooses), so it never waits for a whole pass. The pass
//! measures the map nodes its moves dirtied (`Log::note_clean_pass`); passes that gain nothing while writers wait make cleaning
//! *stuck* (`core::CleanGains`). `move_for_store` moves a record whose copy in the object
//! store `scrub --verify-store` found bad.
//!
//! Invariants:
//! - The cleaner never takes the room the next commit needs: every record it moves and
//!   every node it dirties is counted against it first (`Log::alloc_run`, `Log::hold_nodes`);
//!   when room runs out the pass stops early, and what it moved is kept. A pass never fails
//!   for space, and so never poisons the pool.
//! - No map lock is held across a disk read: the walk runs a chunk of the map at a time
//!   from cached nodes only, loads what was missing with the lock released, and tries the
//!   chunk again; data records move in batches (`move_records`: up to 64 records of one
//!   victim and volume), read from disk between two short passes under the map lock.
//! - A record moves only as bytes that matched its checksum: records close together are
//!   read in one device read, and one that does not match is read alone (every copy,
//!   repaired) or, when no copy matches, left where it is.

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::core::Core;
use super::relocate::{move_where_held, swap_where_held, Relocation, SharedTrees};
use crate::constants::{CLEAN_BATCH_SEGMENTS, MAP_FANOUT_SHIFT, RECORD_ALIGN};
use crate::log::{segment_of, Stream};
use crate::map::{At, Blkptr, Node, NodeStore, Visit};
use crate::store::{Dead, Put};
use crate::volume::VolumeState;
use crate::{Error, Result};

/// Logical blocks per walk under one hold of a map lock: the span of one level-1 node.
const WALK_CHUNK_BLOCKS: u64 = 1 << (2 * MAP_FANOUT_SHIFT);
/// Tries of a chunk from the cache before it is walked with disk reads under the lock (a
/// cache too small for one chunk's path must not stop the cleaner).
const WALK_CACHED_TRIES: usize = 4;
/// Data records moved under one map lock and written in one run, at most (`move_records`).
const MOVE_BATCH_RECORDS: usize = 64;
/// Stored bytes of one batch, at most (a batch stops at the record that reaches it).
const MOVE_BATCH_BYTES: usize = 256 << 10;
/// Dead bytes between two records to move, at most, for them to be read in one read.
const MOVE_READ_GAP: u64 = 16 << 10;

/// Where a pass's cost is measured from: the cleaner's stream (the map nodes it dirtied
/// are counted as it dirties them: `Core::clean_dirtied`).
struct PassCost {
    clean_at_start: u64,
}

/// A batch's moves into volume `v`'s own map (`relocate::swap_where_held`): a swap notes
/// the move for the intent log and releases the old copy; a copy not swapped in is
/// released.
struct Mover<'a> {
    core: &'a Core,
    v: &'a VolumeState,
}

impl Relocation for Mover<'_> {
    type Map = crate::map::Tree;
    type Ptr = Blkptr;

    fn lookup(&self, tree: &crate::map::Tree, lba: u64) -> Result<Blkptr> {
        tree.lookup(&*self.core.store, self.core.store.nodes(), lba)
    }

    fn set(&self, tree: &mut crate::map::Tree, lba: u64, ptr: Blkptr) -> Result<()> {
        tree.set(&*self.core.store, self.core.store.nodes(), lba, ptr)
            .map(|_| ())
    }

    fn swapped(&self, _tree: &crate::map::Tree, lba: u64, old: &Blkptr, new: &Blkptr) {
        note_move(self.v, lba, new);
        self.core.store.release(Dead::superseded(*old));
    }

    fn not_swapped(&self, new: &Blkptr) {
        self.core.store.release(Dead::unlinked(*new));
    }
}

/// A move into the trees of a volume with snapshots or clones
/// (`relocate::move_where_held`): each tree set dirties one more leaf for the next commit
/// (held first, counted after), a move in the head is noted for the intent log; a copy no
/// tree took is released, and the old record once no tree of the clone graph holds it.
struct Installer<'a> {
    core: &'a Core,
}

impl<'a> SharedTrees for Installer<'a> {
    type Volume = VolumeState;
    type Handle = Arc<VolumeState>;
    type Tree = crate::map::Tree;
    type Snap = crate::volume::snap::Snap;
    type Ptr = Blkptr;
    type Name = String;
    type Room = crate::log::Pending<'a>;

    fn map_lock<'v>(&self, v: &'v VolumeState) -> &'v crate::sync::Mutex<crate::map::Tree> {
        v.map_lock()
    }

    fn snaps_lock<'v>(
        &self,
        v: &'v VolumeState,
    ) -> &'v crate::sync::RwLock<Vec<crate::volume::snap::Snap>> {
        v.snaps_lock()
    }

    fn tree<'s>(&self, s: &'s crate::volume::snap::Snap) -> &'s crate::map::Tree {
        &s.tree
    }

    fn tree_mut<'s>(&self, s: &'s mut crate::volume::snap::Snap) -> &'s mut crate::map::Tree {
        &mut s.tree
    }

    fn clone_name(&self, s: &crate::volume::snap::Snap) -> Option<String> {
        (!s.base).then(|| s.name.clone())
    }

    fn clones_of(&self, v: &VolumeState, name: &String) -> Vec<Arc<VolumeState>> {
        self.core.clones_of(v.name(), name)
    }

    fn holds(&self, t: &crate::map::Tree, lba: u64, p: &Blkptr) -> Result<bool> {
        let store = &*self.core.store;
        t.holds(store, store.nodes(), At::Data(lba), p)
    }

    fn set(&self, t: &mut crate::map::Tree, lba: u64, p: &Blkptr) -> Result<()> {
        let store = &*self.core.store;
        t.set(store, store.nodes(), lba, *p).map(|_| ())
    }

    fn hold_room(&self, trees: usize) -> Result<crate::log::Pending<'a>> {
        // Each tree's leaf is one more dirty node for the next commit.
        let core: &'a Core = self.core;
        core.store.try_hold_nodes(trees)
    }

    fn head_moved(&self, v: &VolumeState, lba: u64, new: &Blkptr) {
        note_move(v, lba, new);
    }

    fn installed(
        &self,
        v: &VolumeState,
        head: &crate::map::Tree,
        snaps: &[crate::volume::snap::Snap],
    ) {
        let dirty: usize = snaps.iter().map(|s| s.tree.dirty_nodes()).sum();
        self.core.note_dirty_cleaning(v.snaps_dirty(), dirty);
        self.core
            .note_dirty_cleaning(v.head_dirty(), head.dirty_nodes());
    }

    fn copy_unused(&self, new: &Blkptr) {
        self.core.store.release(Dead::unlinked(*new));
    }

    fn old_moved(&self, v: &VolumeState, lba: u64, old: &Blkptr) {
        // Every holder the runs reach points at the new copy now (the trees around each
        // run do not hold it: the one before was walked against it, and the one after
        // broke the run): the old copy goes, once, unless a tree of the clone graph the
        // runs do not reach still holds it (the bases of clones of two snapshots keep
        // sharing a place after a rotation gave the origin's trees new records there: that
        // base's own walk moves it later).
        if let Some(dead) = self.core.dropped_in_family(v, At::Data(lba), old) {
            self.core.store.release(dead);
        }
    }
}

/// A data record to move: its victim's rank in the pass (best first), its volume, its block.
struct Move {
    rank: usize,
    volume: usize,
    lba: u64,
    ptr: Blkptr,
    /// The oldest tree of the volume that holds it: a snapshot's index, or the number of
    /// snapshots for the volume's own map. `None`: a volume without snapshots.
    tree: Option<usize>,
}

#[cfg(test)]
thread_local! {
    /// Chunks `find_moves` walked on this thread (a test counts them).
    static CHUNKS_WALKED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// Set by a test: the node cache is emptied before each step over holes, as other
    /// threads' walks evict a small cache's nodes between two steps.
    static EVICT_BEFORE_STEP: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A node store that answers only from the cache: a node not there is noted, for loading
/// after the map lock is released, and reported as unreadable to the walk.
struct CachedOnly {
    misses: RefCell<Vec<(u8, u64, Blkptr)>>,
}

impl NodeStore for CachedOnly {
    fn load_node(&self, ptr: &Blkptr, level: u8, index: u64) -> Result<Node> {
        self.misses.borrow_mut().push((level, index, *ptr));
        Err(Error::Corrupt("node not cached".into()))
    }
}

/// Under the map lock: the volume's map now points block `lba` at the moved copy `new`.
/// While the volume has notes for the intent log, note the move too: a note made before it
/// names the old copy, whose segment the move may empty and a writer recycle before the
/// next commit; the flush keeps the last note per block, this one.
fn note_move(v: &VolumeState, lba: u64, new: &Blkptr) {
    let mut notes = v.intents();
    if !notes.is_empty() {
        notes.push((lba, *new));
    }
}

/// The victims of one pass, looked up for every pointer of every map: a bit per segment
/// first (most pointers are in no victim), then a short sorted list for the rank.
struct Victims {
    /// (segment, rank), by segment.
    rank: Vec<(u32, usize)>,
    bits: Vec<u64>,
}

impl Victims {
    /// `victims` best first.
    fn new(victims: &[u32]) -> Victims {
        let mut rank: Vec<(u32, usize)> =
            victims.iter().enumerate().map(|(i, &s)| (s, i)).collect();
        rank.sort_unstable();
        let words = rank.last().map_or(0, |&(s, _)| s as usize / 64 + 1);
        let mut bits = vec![0u64; words];
        for &(s, _) in &rank {
            bits[s as usize / 64] |= 1 << (s % 64);
        }
        Victims { rank, bits }
    }

    /// The rank of the best victim holding a copy of `p`; `None`: no victim does.
    fn rank_of(&self, p: &Blkptr) -> Option<usize> {
        p.addrs()
            .iter()
            .filter_map(|&a| {
                let seg = segment_of(a);
                let word = self.bits.get(seg as usize / 64)?;
                if word & (1 << (seg % 64)) == 0 {
                    return None;
                }
                self.rank
                    .binary_search_by_key(&seg, |&(s, _)| s)
                    .ok()
                    .map(|i| self.rank[i].1)
            })
            .min()
    }
}

impl Core {
    /// One cleaning pass; returns how many records it moved or marked for rewriting
    /// (0: nothing worth cleaning, or no room to clean in).
    ///
    /// Every map is walked first (map nodes in victims are marked for rewriting as the walk
    /// finds them), then the data records are moved victim by victim, best victim first: a
    /// pass cut short by the cleaner's room has still emptied its first victims, which the
    /// next commit frees, instead of leaving every victim partly full.
    pub fn clean(&self) -> Result<usize> {
        let _c = self.commit_lock.lock();
        let n = self.clean_held()?;
        crate::pause::point_at(&self.dir, "clean.end");
        Ok(n)
    }

    /// A flush waits for the commit lock this pass holds: make it durable now (between two
    /// batches, or two volumes' walks), which answers it (`Core::flush_since`). The moves
    /// still to make stay right: each is made only if its map still points at the old copy,
    /// looked up under the reuse gate, and no snapshot comes or goes while the pass holds
    /// the lock.
    pub(super) fn answer_waiting_flushes(&self) -> Result<()> {
        if self.group.waiting() {
            self.flush_held()?;
        }
        Ok(())
    }

    /// `Store::note_dirty` for a tree the cleaner changed (under its map lock): the nodes
    /// it made dirty that were clean are the map cost of its moves (`Log::note_clean_pass`).
    fn note_dirty_cleaning(&self, slot: &std::sync::atomic::AtomicUsize, now: usize) {
        let before = slot.load(Ordering::Relaxed);
        self.store.note_dirty(slot, now);
        self.clean_dirtied
            .fetch_add(now.saturating_sub(before), Ordering::Relaxed);
    }

    fn clean_held(&self) -> Result<usize> {
        let (victims, budget_segments) = self.store.clean_victims(CLEAN_BATCH_SEGMENTS);
        tracing::debug!(
            free = self.store.free_segments(),
            budget_segments,
            victims = victims.len(),
            "cleaning pass"
        );
        self.clean_victims_held(&victims)
    }

    /// One cleaning pass over `victims` (best first), under the commit lock.
    fn clean_victims_held(&self, victims: &[u32]) -> Result<usize> {
        if victims.is_empty() {
            return Ok(0);
        }
        let rank = Victims::new(victims);
        let cost = PassCost {
            clean_at_start: self.store.written().clean,
        };
        self.clean_dirtied.store(0, Ordering::Relaxed);
        let volumes: Vec<_> = self.volumes.read().values().cloned().collect();
        let mut done = 0;
        let mut moves: Vec<Move> = Vec::new();
        for (vi, v) in volumes.iter().enumerate() {
            self.answer_waiting_flushes()?;
            let found = if v.snapshots().is_empty() {
                self.find_moves(v, vi, &rank, &mut moves, &mut done)
            } else {
                self.find_moves_family(v, vi, &rank, &mut moves, &mut done)
            };
            match found {
                Ok(()) => {}
                Err(Error::NoSpace) => break,
                Err(e) => return Err(e),
            }
        }
        moves.sort_unstable_by_key(|m| (m.rank, m.volume, m.lba));
        let mut stored = Vec::new();
        let mut batch: Vec<(u64, Blkptr)> = Vec::new();
        let mut i = 0;
        while i < moves.len() {
            crate::pause::point_at(&self.dir, "clean.batch");
            self.answer_waiting_flushes()?;
            let m = &moves[i];
            let moved = match m.tree {
                // Records of one victim and one volume without snapshots move in batches.
                None => {
                    batch.clear();
                    let mut bytes = 0;
                    // A victim given back to the object store: one record at a time, as
                    // each read is a GET made under the reuse gate, which writers that
                    // recycle (and so every client read behind them) may wait for.
                    let most = if self.store.given_back_record(&m.ptr) {
                        1
                    } else {
                        MOVE_BATCH_RECORDS
                    };
                    while let Some(n) = moves.get(i + batch.len()).filter(|n| {
                        n.tree.is_none()
                            && (n.rank, n.volume) == (m.rank, m.volume)
                            && batch.len() < most
                            && bytes < MOVE_BATCH_BYTES
                    }) {
                        bytes += n.ptr.len as usize;
                        batch.push((n.lba, n.ptr));
                    }
                    i += batch.len();
                    self.move_records(&volumes[m.volume], &batch, &mut stored)
                }
                Some(k) => {
                    i += 1;
                    self.move_shared(&volumes[m.volume], k, m.lba, m.ptr, &mut stored)
                        .map(usize::from)
                }
            };
            match moved {
                Ok(n) => done += n,
                Err(Error::NoSpace) => break,
                Err(e) => return Err(e),
            }
        }
        if done > 0 {
            self.table_dirty.store(true, Ordering::Release);
        }
        self.answer_waiting_flushes()?;
        let moved = self.store.written().clean - cost.clean_at_start;
        let dirtied = self.clean_dirtied.swap(0, Ordering::Relaxed);
        self.store.note_clean_pass(moved, dirtied as u64);
        Ok(done)
    }

    /// `find_moves` for a volume with snapshots: every tree of the volume is walked
    /// against the one before it, so a record or node shared by several trees is found
    /// once, in the oldest that holds it. A node in a victim is marked for rewriting in
    /// every tree that holds it. The walk runs under the volume's locks, reading nodes
    /// from disk as needed (writers of the volume wait for it).
    fn find_moves_family(
        &self,
        v: &Arc<VolumeState>,
        vi: usize,
        rank: &Victims,
        moves: &mut Vec<Move>,
        done: &mut usize,
    ) -> Result<()> {
        let rank_of = |p: &Blkptr| rank.rank_of(p);
        let mut head = v.map();
        let mut snaps = v.snapshots_mut();
        let n = snaps.len();
        let mut nodes: Vec<(usize, u8, u64, Blkptr)> = Vec::new();
        // A clone's base is walked against the origin snapshot: what they share is found
        // (and moved, into both) by the origin's walk. Against that alone, not the bases
        // of the origin's other clones: a map node the origin's trees no longer hold (the
        // cleaner rewrites nodes tree by tree) but two such bases still share would be
        // skipped by each base's walk as the other's, and its segment never emptied. Each
        // base's run rewrites it; the commit releases it once, after the last holder.
        let mut across = match snaps.first() {
            Some(b) if b.base => self.across(v, b),
            _ => Vec::new(),
        };
        let origin_volume = v.origin().as_ref().map(|o| o.volume.clone());
        across.retain(|(o, _)| origin_volume.as_deref() == Some(o.name()));
        let guards: Vec<_> = across.iter().map(|(o, i)| (o.snapshots(), *i)).collect();
        let origin: Vec<&crate::map::Tree> = guards.iter().map(|(g, i)| &g[*i].tree).collect();
        for k in 0..=n {
            let t = if k < n { &snaps[k].tree } else { &*head };
            let prev: Vec<&crate::map::Tree> = match k.checked_sub(1) {
                Some(j) => vec![&snaps[j].tree],
                None => origin.clone(),
            };
            t.walk_unique(&*self.store, self.store.nodes(), &prev, &mut |visit| {
                match visit {
                    Visit::Unreadable { error, .. } => {
                        return Err(Error::Corrupt(format!("cleaner: {error}")))
                    }
                    Visit::Data { lba, ptr } => {
                        if let Some(rank) = rank_of(ptr) {
                            moves.push(Move {
                                rank,
                                volume: vi,
                                lba,
                                ptr: *ptr,
                                tree: Some(k),
                            });
                        }
                    }
                    Visit::Node { level, index, ptr } => {
                        if rank_of(ptr).is_some() {
                            nodes.push((k, level, index, *ptr));
                        }
                    }
                }
                Ok(())
            })?;
        }
        let mut result = Ok(());
        'nodes: for (k, level, index, ptr) in nodes {
            for j in k..=n {
                let t = if j < n {
                    &mut snaps[j].tree
                } else {
                    &mut *head
                };
                if !t.holds(
                    &*self.store,
                    self.store.nodes(),
                    At::Node(level, index),
                    &ptr,
                )? {
                    break;
                }
                let _held = match self.store.try_hold_nodes(1) {
                    Ok(held) => held,
                    Err(e) => {
                        result = Err(e);
                        break 'nodes;
                    }
                };
                t.touch(&*self.store, self.store.nodes(), level, index)?;
                let dirty: usize = snaps.iter().map(|s| s.tree.dirty_nodes()).sum();
                self.store.note_dirty(v.snaps_dirty(), dirty);
                self.store.note_dirty(v.head_dirty(), head.dirty_nodes());
                *done += 1;
            }
        }
        result
    }

    /// `move_record` for a record of a volume with snapshots, found in tree `k` (the
    /// oldest that holds it): written once and swapped into every tree that holds it,
    /// newest first, so it stays shared; the old copy is released once, after the last.
    fn move_shared(
        &self,
        v: &VolumeState,
        k: usize,
        lba: u64,
        old: Blkptr,
        stored: &mut Vec<u8>,
    ) -> Result<bool> {
        let holds_at = |head: &crate::map::Tree, snaps: &[crate::volume::snap::Snap], j: usize| {
            let t = if j < snaps.len() {
                &snaps[j].tree
            } else {
                head
            };
            t.holds(&*self.store, self.store.nodes(), At::Data(lba), &old)
        };
        let held = || {
            let head = v.map();
            let snaps = v.snapshots();
            holds_at(&head, &snaps, k)
        };
        let Some((new, _pending)) = self.copy_if(v, lba, &old, stored, held)? else {
            return Ok(false);
        };
        crate::pause::point_at(&self.dir, "clean.install");
        // Installed in every tree that holds it; the copy released if none took it (an
        // error, `NoSpace` near full, may stop the move before any did: released, not
        // left counted live with nothing pointing at it until the pool is imported again),
        // else the old record once no tree holds it. An error after some clones took it
        // leaves both live: the clones point at the new copy, `v` at the old.
        move_where_held(&Installer { core: self }, v, k, lba, &old, &new)
    }

    /// `Store::dropped` against every tree of the other volumes of `v`'s clone graph
    /// (their locks taken together, under the commit lock the pass holds).
    fn dropped_in_family(&self, v: &VolumeState, at: At, p: &Blkptr) -> Option<Dead> {
        Core::with_trees_of(&self.component(v), |far| self.store.dropped(far, at, p))
    }

    /// Read record `old` (block `lba` of `v`) to move it: verified, from any copy (a bad
    /// one repaired). `Ok(false)`: no copy verifies; it is logged and stays where it is.
    fn read_to_move(
        &self,
        v: &VolumeState,
        lba: u64,
        old: &Blkptr,
        out: &mut Vec<u8>,
    ) -> Result<bool> {
        match self
            .store
            .read_record_to_move(old.addrs(), old.len as usize, &old.checksum, out)
        {
            Ok(()) => Ok(true),
            Err(Error::Unrecoverable(e)) => {
                tracing::error!(volume = %v.name(), lba, "cannot move an unrecoverable block: {e}");
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Copy the record `old` (block `lba` of `v`) to the cleaner's head if `held` still
    /// says a tree points at it: read verified (by checksum: no key needed) and written
    /// again as it is (same stored bytes, nonce and checksum; only its address changes).
    /// Returns the new copy and its hold on the next commit's room, which the caller keeps
    /// until its leaves are counted dirty; `None` when no tree holds it any more or no
    /// copy verifies (it stays where it is).
    fn copy_if(
        &self,
        v: &VolumeState,
        lba: u64,
        old: &Blkptr,
        stored: &mut Vec<u8>,
        held: impl FnOnce() -> Result<bool>,
    ) -> Result<Option<(Blkptr, crate::log::Pending<'_>)>> {
        {
            // Like a client read: a block replaced since the walk may lie in a segment a
            // writer has recycled (`Store::recycle_if_due`) and rewritten.
            let _gate = self.store.hold_reads();
            if !held()? || !self.read_to_move(v, lba, old, stored)? {
                return Ok(None);
            }
        }
        let mut pending = self.store.pending();
        let mut rec = [Put { at: 0, ptr: *old }];
        self.store
            .put(Stream::Clean, 0, stored, &mut rec, Some(&mut pending))?;
        Ok(Some((rec[0].ptr, pending)))
    }

    /// Walk volume `v` (number `vi` of the pass) a chunk of its map at a time: mark its map
    /// nodes in a victim for rewriting, and note its data records in a victim in `moves`.
    /// `NoSpace`: the commit's room for marked nodes ran out (not an error of the pool).
    fn find_moves(
        &self,
        v: &Arc<VolumeState>,
        vi: usize,
        rank: &Victims,
        moves: &mut Vec<Move>,
        done: &mut usize,
    ) -> Result<()> {
        let rank_of = |p: &Blkptr| rank.rank_of(p);
        let blocks = v.size() / v.block_size() as u64;
        let tree_id = v.map().id;
        let mut lo = 0;
        while lo < blocks {
            // Chunks wholly in holes are stepped over, not walked one by one (a thin
            // volume of 1E would hold the commit lock for 2^36 of them).
            let skip_to = self.next_mapped_loading(v, lo, blocks);
            // Chunks start at multiples of the chunk (upper nodes are touched once, by
            // the chunk that starts where they do).
            lo = lo.max(skip_to / WALK_CHUNK_BLOCKS * WALK_CHUNK_BLOCKS);
            if lo >= blocks {
                break;
            }
            let hi = (lo + WALK_CHUNK_BLOCKS).min(blocks);
            #[cfg(test)]
            CHUNKS_WALKED.with(|n| n.set(n.get() + 1));
            let found = moves.len();
            let mut tries = 0;
            loop {
                moves.truncate(found);
                let cached = CachedOnly {
                    misses: RefCell::new(Vec::new()),
                };
                let disk_ok = tries >= WALK_CACHED_TRIES;
                let store: &dyn NodeStore = if disk_ok { &*self.store } else { &cached };
                let mut touch: Vec<(u8, u64)> = Vec::new();
                let mut tree = v.map();
                tree.walk(store, self.store.nodes(), lo, hi, &mut |visit| {
                    match visit {
                        Visit::Unreadable { error, .. } if disk_ok => {
                            return Err(Error::Corrupt(format!("cleaner: {error}")))
                        }
                        Visit::Unreadable { .. } => {}
                        Visit::Data { lba, ptr } => {
                            if let Some(rank) = rank_of(ptr) {
                                moves.push(Move {
                                    rank,
                                    volume: vi,
                                    lba,
                                    ptr: *ptr,
                                    tree: None,
                                });
                            }
                        }
                        Visit::Node { level, index, ptr } if rank_of(ptr).is_some() => {
                            touch.push((level, index))
                        }
                        _ => {}
                    }
                    Ok(())
                })?;
                let misses = cached.misses.into_inner();
                if misses.is_empty() {
                    // Upper nodes are visited by every chunk below them: touch each once.
                    touch.retain(|&(level, index)| {
                        level == 0 || {
                            let first = index << (MAP_FANOUT_SHIFT * (level as u32 + 1));
                            first >= lo
                        }
                    });
                    // One node at a time, each within the commit's room: a victim full of
                    // map nodes is cleaned as far as the room goes, not refused whole.
                    for &(level, index) in &touch {
                        let _held = match self.store.try_hold_nodes(1) {
                            Ok(held) => held,
                            Err(e) => {
                                self.store.note_dirty(v.head_dirty(), tree.dirty_nodes());
                                return Err(e);
                            }
                        };
                        tree.touch(&*self.store, self.store.nodes(), level, index)?;
                        self.store.note_dirty(v.head_dirty(), tree.dirty_nodes());
                        *done += 1;
                    }
                    break;
                }
                drop(tree);
                // Load what the walk missed without the map lock, then walk the chunk again.
                self.cache_missed(tree_id, misses);
                tries += 1;
            }
            lo = hi;
        }
        Ok(())
    }

    /// `Tree::next_mapped` of `v`'s map from `lo`, as the walks read: from cached nodes
    /// under the map lock, what they miss loaded without it, and after `WALK_CACHED_TRIES`
    /// tries from the devices under it. Before, a miss gave up the step and walked the
    /// chunk at `lo`: with a cache that could not keep the map's upper nodes (a small
    /// `--cache-size`, other volumes' walks) a pass stepped through a 1E thin volume a
    /// chunk at a time, holding the commit lock, and every FLUSH waited behind it. `lo` on
    /// an error: the walk of the chunk there reports it.
    fn next_mapped_loading(&self, v: &VolumeState, lo: u64, end: u64) -> u64 {
        let tree_id = v.map().id;
        #[cfg(test)]
        if EVICT_BEFORE_STEP.with(|e| e.get()) {
            self.store.nodes().clear();
        }
        for tries in 0..=WALK_CACHED_TRIES {
            let cached = CachedOnly {
                misses: RefCell::new(Vec::new()),
            };
            let disk_ok = tries == WALK_CACHED_TRIES;
            let store: &dyn NodeStore = if disk_ok { &*self.store } else { &cached };
            let found = v.map().next_mapped(store, self.store.nodes(), lo, end);
            let misses = cached.misses.into_inner();
            if misses.is_empty() {
                return found.unwrap_or(lo);
            }
            self.cache_missed(tree_id, misses);
        }
        lo
    }

    /// Read the nodes of tree `tree_id` a `CachedOnly` walk missed into the node cache
    /// (called without the map lock). One that does not read stays out: the walk that
    /// reads it from the devices reports it.
    fn cache_missed(&self, tree_id: u64, misses: Vec<(u8, u64, Blkptr)>) {
        for (level, index, ptr) in misses {
            if let Ok(node) = self.store.load_node(&ptr, level, index) {
                self.store
                    .nodes()
                    .insert((tree_id, level, index), ptr, Arc::new(node));
            }
        }
    }

    /// Write record `old` (block `lba` of `v`, which `v`'s own map holds) again at a new
    /// place, for every tree that holds it: `scrub --verify-store` found its copy in the
    /// object store bad, and the new place is uploaded by the next commit. `Ok(false)`: no
    /// longer held, no local copy verifies, or no room now (a later scrub tries again).
    pub(super) fn move_for_store(
        &self,
        v: &VolumeState,
        lba: u64,
        old: Blkptr,
        stored: &mut Vec<u8>,
    ) -> Result<bool> {
        // As the cleaner: no commit, snapshot destroy or other move meanwhile (a destroy
        // counts on snapshot trees staying clean under this lock, and the index `k` below
        // must still name the same tree when the move installs it).
        let _c = self.commit_lock.lock();
        // The oldest tree of the run of trees holding it that ends at `v`'s own.
        let k = {
            let head = v.map();
            let snaps = v.snapshots();
            if !head.holds(&*self.store, self.store.nodes(), At::Data(lba), &old)? {
                return Ok(false);
            }
            let mut k = snaps.len();
            while k > 0
                && snaps[k - 1]
                    .tree
                    .holds(&*self.store, self.store.nodes(), At::Data(lba), &old)?
            {
                k -= 1;
            }
            // Held by a clone's base: the origin's snapshot (and its other clones) hold
            // it too, which a move from here would not reach. Left where it is (reported;
            // the origin's own scrub finds it if its map still holds it).
            if k == 0 && snaps.first().is_some_and(|s| s.base) {
                return Ok(false);
            }
            k
        };
        match self.move_shared(v, k, lba, old, stored) {
            Err(Error::NoSpace) => Ok(false),
            other => other,
        }
    }

    /// Move a batch of data records of `v` (block, pointer), which `v`'s own map holds (no
    /// snapshots), to the cleaner's head: which are still held is looked up under one map
    /// lock, they are read (verified by checksum) with it released, written end to end in
    /// one run (one device write per copy where the layout allows), and swapped in under
    /// one more map lock where the map still points at the old copy (a client write in
    /// between wins). Returns how many moved; `NoSpace`: the cleaner's room ran out (none
    /// of this batch moved). One record at a time, the cleaner spent two map locks, one
    /// read and one device write per 4 KiB block. The records are written in the batch's
    /// order (by block: `in_block_order`), so a sequential read of them is one read.
    pub(super) fn move_records(
        &self,
        v: &VolumeState,
        batch: &[(u64, Blkptr)],
        stored: &mut Vec<u8>,
    ) -> Result<usize> {
        stored.clear();
        let mut one = Vec::new();
        let mut recs: Vec<(u64, Blkptr)> = Vec::with_capacity(batch.len());
        let mut puts: Vec<Put> = Vec::with_capacity(batch.len());
        {
            // Like a client read: a block replaced since the walk may lie in a segment a
            // writer has recycled (`Store::recycle_if_due`) and rewritten; so what is
            // still held is read before the gate is let go.
            let _gate = self.store.hold_reads();
            let held: Vec<bool> = {
                let tree = v.map();
                batch
                    .iter()
                    .map(|(lba, old)| {
                        Ok(tree.lookup(&*self.store, self.store.nodes(), *lba)? == *old)
                    })
                    .collect::<Result<_>>()?
            };
            // In device order: records that lie close together are read in one read.
            let mut live: Vec<(u64, Blkptr)> = batch
                .iter()
                .zip(held)
                .filter(|(_, h)| *h)
                .map(|(r, _)| *r)
                .collect();
            live.sort_unstable_by_key(|(_, p)| p.addr[0]);
            let mut span = Vec::new();
            let mut g = 0;
            while g < live.len() {
                // A group: records of one segment with at most MOVE_READ_GAP bytes between.
                let start = live[g].1.addr[0];
                let mut end = start + live[g].1.len as u64;
                let mut n = 1;
                while let Some((_, p)) = live.get(g + n) {
                    let at = p.addr[0];
                    if segment_of(at) != segment_of(start) || at < end || at - end > MOVE_READ_GAP {
                        break;
                    }
                    end = at + p.len as u64;
                    n += 1;
                }
                let group = &live[g..g + n];
                g += n;
                // A span not read (or whose read failed): each record is read alone, which
                // tries every copy, repairs, and reports what it cannot.
                let spanned = n > 1 && {
                    span.resize((end - start) as usize, 0);
                    matches!(self.store.read_span_to_move(start, &mut span), Ok(true))
                };
                for &(lba, old) in group {
                    let off = (old.addr[0] - start) as usize;
                    let bytes = spanned
                        .then(|| &span[off..off + old.len as usize])
                        .filter(|b| crate::checksum::verify(&old.checksum, b));
                    let bytes = match bytes {
                        Some(b) => b,
                        None if self.read_to_move(v, lba, &old, &mut one)? => &one[..],
                        None => continue,
                    };
                    // Records of a run start at the end of the one before, rounded up to
                    // RECORD_ALIGN (as `Log::alloc_run` lays them out).
                    let at = stored.len().div_ceil(RECORD_ALIGN as usize) * RECORD_ALIGN as usize;
                    stored.resize(at, 0);
                    stored.extend_from_slice(bytes);
                    puts.push(Put { at, ptr: old });
                    recs.push((lba, old));
                }
            }
        }
        if recs.is_empty() {
            return Ok(0);
        }
        in_block_order(stored, &mut puts, &mut recs);
        let mut pending = self.store.pending();
        // Near the end of the cleaner's room a whole batch may not fit where part of it
        // does (`Log::alloc_run` counts every record of a run against the reserve): halve
        // it until it fits, so a pass moves as much as the room allows (the records kept
        // keep their bytes where they lie in `stored`).
        loop {
            match self
                .store
                .put(Stream::Clean, 0, stored, &mut puts, Some(&mut pending))
            {
                Ok(()) => break,
                Err(Error::NoSpace) if puts.len() > 1 => {
                    let keep = puts.len() / 2;
                    puts.truncate(keep);
                    recs.truncate(keep);
                }
                Err(e) => return Err(e),
            }
        }
        let moves: Vec<(u64, Blkptr, Blkptr)> = recs
            .iter()
            .zip(&puts)
            .map(|(&(lba, old), put)| (lba, old, put.ptr))
            .collect();
        let (tree, moved) = swap_where_held(&Mover { core: self, v }, v.map_lock(), &moves);
        self.note_dirty_cleaning(v.head_dirty(), tree.dirty_nodes());
        drop(tree);
        drop(pending);
        moved
    }
}

/// Lay records read for a move (`puts` into `stored`, in device order) out in block order
/// (`recs`: block and old pointer, one per put), each at the next `RECORD_ALIGN` boundary
/// as `Log::alloc_run` places a run: blocks moved together then read back in one read.
fn in_block_order(stored: &mut Vec<u8>, puts: &mut Vec<Put>, recs: &mut Vec<(u64, Blkptr)>) {
    if recs.windows(2).all(|w| w[0].0 < w[1].0) {
        return;
    }
    let mut order: Vec<usize> = (0..recs.len()).collect();
    order.sort_unstable_by_key(|&i| recs[i].0);
    let mut out = Vec::with_capacity(stored.len());
    let mut laid = Vec::with_capacity(puts.len());
    for &i in &order {
        let Put { at, ptr } = puts[i];
        let to = out.len().div_ceil(RECORD_ALIGN as usize) * RECORD_ALIGN as usize;
        out.resize(to, 0);
        out.extend_from_slice(&stored[at..at + ptr.len as usize]);
        laid.push(Put { at: to, ptr });
    }
    *recs = order.iter().map(|&i| recs[i]).collect();
    *puts = laid;
    *stored = out;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::constants::SEGMENT_BYTES;
    use crate::map::ADDR_NONE;

    fn at(segs: &[u64]) -> Blkptr {
        let mut p = Blkptr {
            addr: [ADDR_NONE, ADDR_NONE],
            ..Blkptr::default()
        };
        for (i, &s) in segs.iter().enumerate() {
            p.addr[i] = s * SEGMENT_BYTES + 4096;
        }
        p
    }

    /// A pointer's rank is its best victim's (either copy), and a pointer in no victim
    /// has none, also past the last victim's segment and in a victim's neighbours.
    #[test]
    fn a_pointer_is_ranked_by_the_best_victim_holding_a_copy() {
        // Best first: segment 70, then 3, then 64.
        let v = Victims::new(&[70, 3, 64]);
        assert_eq!(v.rank_of(&at(&[70])), Some(0));
        assert_eq!(v.rank_of(&at(&[3])), Some(1));
        assert_eq!(v.rank_of(&at(&[64])), Some(2));
        assert_eq!(v.rank_of(&at(&[64, 70])), Some(0));
        assert_eq!(v.rank_of(&at(&[5, 3])), Some(1));
        for seg in [0, 2, 4, 63, 65, 69, 71, 127, 128, 1 << 30] {
            assert_eq!(v.rank_of(&at(&[seg])), None, "segment {seg}");
        }
        assert_eq!(Victims::new(&[]).rank_of(&at(&[0])), None);
    }

    /// The trees of `pool` (`VOLUME:TREE`) that hold a node or record in segment `seg`.
    fn held_in(pool: &crate::pool::Pool, seg: u32) -> Vec<String> {
        let core = pool.core();
        let mut out = Vec::new();
        let vols: Vec<_> = core.volumes.read().values().cloned().collect();
        for v in vols {
            let head = v.map();
            let snaps = v.snapshots();
            let trees = snaps
                .iter()
                .map(|s| (s.name.clone(), &s.tree))
                .chain([("head".to_string(), &*head)]);
            for (name, t) in trees {
                t.walk_unique(&*core.store, core.store.nodes(), &[], &mut |visit| {
                    if let Visit::Node { ptr, .. } | Visit::Data { ptr, .. } = visit {
                        if ptr.addrs().iter().any(|&a| segment_of(a) == seg) {
                            out.push(format!("{}:{name}", v.name()));
                        }
                    }
                    Ok(())
                })
                .unwrap();
            }
        }
        out.sort();
        out.dedup();
        out
    }

    /// A victim the cleaner was given holds nothing live after its pass and the commit,
    /// also when two clones of one snapshot share its map nodes: each base is walked
    /// against the origin snapshot, whose own walk moved them into its trees alone (the
    /// cleaner moves nodes tree by tree), so the bases still held the old nodes, and each
    /// base's walk skipped them as held by the other base: the segment never emptied.
    #[test]
    fn a_victim_whose_nodes_two_clones_of_one_snapshot_share_is_emptied() {
        use crate::pool::OpenOptions;
        use crate::volume::{Compression, VolumeOptions};

        let dir = tempfile::tempdir().unwrap();
        let opts = OpenOptions {
            check_addresses: true,
            ..OpenOptions::default()
        };
        let pool = crate::pool::test_pool(dir.path(), opts);
        let o = VolumeOptions {
            size_bytes: 4 << 20,
            block_size: 4096,
            compression: Compression::Off,
            encryption: false,
        };
        pool.create_volume("v", o, None).unwrap();
        let v = pool.volume("v").unwrap();
        for lba in 0..1024u64 {
            v.write(lba * 4096, &[lba as u8 | 1; 4096], false).unwrap();
        }
        pool.snapshot_create("v", "s").unwrap();
        pool.volume_clone("v", "s", "c1", None).unwrap();
        pool.volume_clone("v", "s", "c2", None).unwrap();
        let core = pool.core();
        let root = core.find("v").unwrap().snapshots()[0].tree.root;
        let seg = segment_of(root.addr[0]);
        assert!(held_in(&pool, seg).contains(&"c1:v@s".to_string()));
        // Commits of the volume's own writes fill the segment the snapshot's nodes lie in.
        for i in 0.. {
            assert!(i < 5000, "the map nodes never left segment {seg}");
            v.write(i % 1024 * 4096, &[i as u8 | 1; 4096], false)
                .unwrap();
            core.commit().unwrap();
            if segment_of(core.find("v").unwrap().map().root.addr[0]) != seg {
                break;
            }
        }
        drop(v);
        for _ in 0..3 {
            {
                let _c = core.commit_lock.lock();
                core.clean_victims_held(&[seg]).unwrap();
            }
            core.commit().unwrap();
        }
        assert_eq!(held_in(&pool, seg), Vec::<String>::new(), "segment {seg}");
        let mut buf = vec![0u8; 4096];
        for name in ["v@s", "c1", "c2"] {
            let c = pool.volume(name).unwrap();
            for lba in [0u64, 511, 1023] {
                c.read(lba * 4096, &mut buf).unwrap();
                assert_eq!(buf, vec![lba as u8 | 1; 4096], "{name} block {lba}");
            }
        }
    }

    /// A pass over a thin volume steps over its holes also when the node cache cannot
    /// keep the map's upper nodes. Before, the step gave up on a cache miss and walked
    /// the chunk instead, one chunk of 4096 blocks per miss: with the cache emptied
    /// before each step (as other threads' walks evict a small cache's nodes) this 1 TiB
    /// volume took 65,536 chunk walks, a 1E one 2^36 (the live run with `--huge-spread 56
    /// --tiny-cache` held the commit lock for minutes, every FLUSH waiting).
    #[test]
    fn a_pass_steps_over_holes_with_a_cache_too_small_for_the_map() {
        let dir = tempfile::tempdir().unwrap();
        let opts = crate::pool::OpenOptions {
            cache_bytes: 0,
            ..crate::pool::OpenOptions::default()
        };
        let pool = crate::pool::test_pool(dir.path(), opts);
        let blocks = 1u64 << 28;
        pool.create_volume("huge", crate::pool::test_volume(blocks * 4096), None)
            .unwrap();
        let v = pool.volume("huge").unwrap();
        let far = blocks - 1;
        for lba in [0, blocks / 2, far] {
            v.write(lba * 4096, &[lba as u8 | 1; 4096], false).unwrap();
        }
        let core = pool.core();
        core.commit().unwrap();
        let st = core.find("huge").unwrap();
        let ptr = st
            .map()
            .lookup(&*core.store, core.store.nodes(), far)
            .unwrap();
        let seg = segment_of(ptr.addr[0]);
        let before = CHUNKS_WALKED.with(|n| n.get());
        EVICT_BEFORE_STEP.with(|e| e.set(true));
        {
            let _c = core.commit_lock.lock();
            core.clean_victims_held(&[seg]).unwrap();
        }
        EVICT_BEFORE_STEP.with(|e| e.set(false));
        let walked = CHUNKS_WALKED.with(|n| n.get()) - before;
        assert!(
            walked <= 8,
            "the pass walked {walked} chunks of a volume with three blocks written"
        );
        core.commit().unwrap();
        let mut buf = vec![0u8; 4096];
        for lba in [0, blocks / 2, far] {
            v.read(lba * 4096, &mut buf).unwrap();
            assert_eq!(buf, vec![lba as u8 | 1; 4096], "block {lba}");
        }
    }

    /// Cleaning marked stuck refuses a writer short of space at once, but not while the
    /// next commit frees segments whose every record is gone: that room needs no cleaner.
    /// Overwrites empty segments that way while the live total (what unsticks the cleaner)
    /// stays the same; holes anywhere made it common (decision 0014: a refusal with
    /// nothing dirty, free segments at the client floor and holes known only in such
    /// segments). Before, the write below was refused ("cleaning is stuck") with two whole
    /// segments to be freed by the round it would have waited for.
    #[test]
    fn a_writer_waits_for_the_commit_that_frees_emptied_segments_while_cleaning_is_stuck() {
        use crate::pool::OpenOptions;
        use crate::volume::{Compression, VolumeOptions};

        let dir = tempfile::tempdir().unwrap();
        let opts = OpenOptions {
            stepped: true,
            intent_log: false,
            check_addresses: true,
            ..OpenOptions::default()
        };
        let pool = crate::pool::test_pool(dir.path(), opts);
        let o = VolumeOptions {
            size_bytes: 64 << 20,
            block_size: 4096,
            compression: Compression::Off,
            encryption: false,
        };
        pool.create_volume("v", o, None).unwrap();
        let v = pool.volume("v").unwrap();
        let block = |lba: u64, round: u64| {
            let mut b = vec![0u8; 4096];
            let mut x = lba.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ round.wrapping_add(1);
            for c in b.chunks_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                c.copy_from_slice(&x.to_le_bytes());
            }
            b
        };
        // Written in order until full: nothing dead, so the refusal is at once.
        let mut end = 0u64;
        loop {
            match v.write(end * 4096, &block(end, 0), false) {
                Ok(()) => end += 1,
                Err(Error::NoSpace) => break,
                Err(e) => panic!("block {end}: {e}"),
            }
        }
        assert!(end > 1024, "only {end} blocks fit");
        v.flush().unwrap();
        // Two segments' worth of records gone: whole segments for the next commit to free.
        v.trim(0, 2 * SEGMENT_BYTES + 4096 * 256).unwrap();
        let core = pool.core();
        assert!(
            core.store.zero_sealed().len() >= 2,
            "{:?}",
            core.store.zero_sealed()
        );
        core.store
            .set_clean_stuck("cleaning is stuck (set by the test)".into());
        assert!(
            !core.store.data_fits(&[4096]),
            "the write below needs no wait ({} segments free)",
            core.store.free_segments()
        );
        v.write(end * 4096, &block(end, 0), false)
            .expect("the round's commit frees the emptied segments");
        assert!(core.store.zero_sealed().is_empty());
        let mut buf = vec![0u8; 4096];
        for lba in [2 * 256 + 256, end / 2, end - 1, end] {
            v.read(lba * 4096, &mut buf).unwrap();
            assert_eq!(buf, block(lba, 0), "block {lba}");
        }
        drop(v);
        pool.close().unwrap();
    }

    /// A FLUSH never waits for a whole cleaning pass (issue 36, part 3): the cleaner is
    /// stopped holding the commit lock between two batches of moves, a flush comes, the
    /// cleaner goes on and stops again at the pass's end, the lock still held: the flush
    /// has been answered by then (by the commit the pass made for it). Before, a flush
    /// waited for the commit lock, so for the whole pass.
    #[test]
    fn a_flush_is_answered_while_a_cleaning_pass_holds_the_commit_lock() {
        use crate::pool::OpenOptions;
        use crate::volume::{Compression, VolumeOptions};
        use std::time::Duration;

        let dir = tempfile::tempdir().unwrap();
        let pool = crate::pool::test_pool(dir.path(), OpenOptions::default());
        let size = 32u64 << 20;
        let o = VolumeOptions {
            size_bytes: size,
            block_size: 4096,
            compression: Compression::Off,
            encryption: false,
        };
        pool.create_volume("v", o, None).unwrap();
        let batch = crate::pause::arm_at(dir.path(), "clean.batch");
        // Fill, then overwrite at random until the cleaner runs (it stops at its first batch).
        let writer = {
            let v = pool.volume("v").unwrap();
            std::thread::spawn(move || {
                let mut x = 1u64;
                let mut data = vec![0u8; 64 << 10];
                for (i, b) in data.iter_mut().enumerate() {
                    *b = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes()[3];
                }
                for off in (0..size).step_by(64 << 10) {
                    if v.write(off, &data, false).is_err() {
                        return;
                    }
                }
                for _ in 0..20_000 {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    data[..8].copy_from_slice(&x.to_le_bytes());
                    let off = (x >> 20) % (size / 4096) * 4096;
                    if v.write(off, &data[..4096], false).is_err() {
                        return;
                    }
                }
            })
        };
        assert!(
            batch.wait_reached(Duration::from_secs(300)),
            "the cleaner never ran under random overwrites of a nearly full pool"
        );
        // The cleaner holds the commit lock, stopped. Its pass will stop again at its end.
        let end = crate::pause::arm_at(dir.path(), "clean.end");
        // A flush comes.
        let (tx, rx) = std::sync::mpsc::channel();
        {
            // A client's FLUSH (NBD FLUSH, or a FUA write): `Volume::flush`.
            let v = pool.volume("v").unwrap();
            std::thread::spawn(move || {
                let _ = tx.send(v.flush());
            });
        }
        while !pool.core().group.waiting() {
            std::thread::yield_now();
        }
        batch.release();
        assert!(
            end.wait_reached(Duration::from_secs(300)),
            "the pass did not end"
        );
        // The pass is at its end and still holds the commit lock: the flush was answered.
        let answered = rx.recv_timeout(Duration::from_secs(300));
        end.release();
        match answered {
            Ok(r) => r.unwrap(),
            Err(_) => panic!("a flush waited for the whole cleaning pass"),
        }
        writer.join().unwrap();
        pool.close().unwrap();
    }

    /// A cleaning pass that runs out of room while it moves a record a snapshot shares
    /// leaves the pool's live bytes as a recount finds them: the copy it had written is
    /// released when no tree took it. The pass is stopped after the copy is written and
    /// before it is installed (`clean.install`), the test takes the room left for dirty
    /// nodes (what a client write near full takes meanwhile), and the install's
    /// `try_hold_nodes` answers `NoSpace`. Before, `move_shared` returned that error
    /// without releasing the copy: counted live with nothing pointing at it, its segment
    /// could not empty until the pool was imported again (the live bytes after the pass
    /// were one 4 KiB record over, and over the recount at import by as much).
    #[test]
    fn a_pass_out_of_room_for_a_shared_record_releases_the_copy_it_did_not_install() {
        use crate::pool::OpenOptions;
        use crate::volume::{Compression, VolumeOptions};
        use std::time::Duration;

        let dir = tempfile::tempdir().unwrap();
        let opts = OpenOptions {
            stepped: true,
            intent_log: false,
            check_addresses: true,
            ..OpenOptions::default()
        };
        let pool = crate::pool::test_pool(dir.path(), opts.clone());
        let o = VolumeOptions {
            size_bytes: 4 << 20,
            block_size: 4096,
            compression: Compression::Off,
            encryption: false,
        };
        pool.create_volume("v", o, None).unwrap();
        let v = pool.volume("v").unwrap();
        for lba in 0..64u64 {
            v.write(lba * 4096, &[lba as u8 | 1; 4096], false).unwrap();
        }
        drop(v);
        pool.snapshot_create("v", "s").unwrap();
        let core = pool.core().clone();
        core.commit().unwrap();
        let seg = {
            let v = core.find("v").unwrap();
            let p = v.map().lookup(&*core.store, core.store.nodes(), 0).unwrap();
            segment_of(p.addr[0])
        };
        let live_before = core.store.live_bytes_total();
        let install = crate::pause::arm_at(dir.path(), "clean.install");
        let pass = {
            let core = core.clone();
            std::thread::spawn(move || {
                let _c = core.commit_lock.lock();
                core.clean_victims_held(&[seg])
            })
        };
        assert!(
            install.wait_reached(Duration::from_secs(60)),
            "the pass moved no record the snapshot shares"
        );
        // The copy is written; the room for the nodes its install dirties is taken.
        let mut held = Vec::new();
        let mut n = 1 << 20;
        while n > 0 {
            match core.store.try_hold_nodes(n) {
                Ok(p) => held.push(p),
                Err(Error::NoSpace) => n /= 2,
                Err(e) => panic!("{e}"),
            }
        }
        install.release();
        assert_eq!(pass.join().unwrap().unwrap(), 0, "no record moved");
        drop(held);
        drop(install);
        assert_eq!(
            core.store.live_bytes_total(),
            live_before,
            "the live bytes grew by a pass that moved nothing: the copy leaked"
        );
        // The live bytes as the pool counts them are what an import recounts.
        core.commit().unwrap();
        let live = core.store.live_bytes_total();
        drop(core);
        pool.close().unwrap();
        drop(pool);
        let pool = crate::pool::Pool::open(dir.path(), opts).unwrap();
        assert_eq!(
            pool.core().store.live_bytes_total(),
            live,
            "live bytes vs the recount"
        );
        let s = pool.volume("v@s").unwrap();
        let mut buf = vec![0u8; 4096];
        for lba in [0u64, 63] {
            s.read(lba * 4096, &mut buf).unwrap();
            assert_eq!(buf, vec![lba as u8 | 1; 4096], "v@s block {lba}");
        }
        drop(s);
        pool.close().unwrap();
    }
}
