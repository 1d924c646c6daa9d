//! The cleaner's move, where it meets client writes: a record the cleaner copied elsewhere
//! goes into the map only where the map still points at the old copy.
//!
//! The cleaner reads a batch of records with the map lock released and writes their
//! copies (`clean`'s `move_records`); meanwhile a client write may point any of those
//! blocks at a newer record and release the old one. So the swap is a compare-and-set,
//! each block looked up and set under one hold of the map lock the writers take
//! (`swap_where_held`): a block still pointing at the old copy takes the new one and the
//! old copy is released; a block a writer changed keeps the writer's pointer and the new
//! copy is released. Either way every copy is released once and no newer write is undone.
//!
//! A record that snapshots or clones share is moved into every tree that holds it
//! (`install_where_held`): for one volume, the run of its trees from the oldest that held
//! the record when the walk found it, stopping at the first that no longer does, looked
//! up and set newest first under one hold of the map lock and the snapshot list; the
//! clones of the snapshots in that run first, recursively, each volume's locks taken
//! alone. A client write to a head in between keeps its pointer: the run stops before it.
//! An error (no room for the nodes the sets dirty, near full) may stop the move between
//! two volumes' runs, never inside one (`set_run`); the copy is released if no tree took
//! it, the old record once none holds it (`move_where_held`).
//!
//! The map and what a swap does around it (the notes for the intent log, the releases)
//! come in through [`Relocation`], the trees of a volume with snapshots and clones
//! through [`SharedTrees`]; the locks are `crate::sync`'s, so `crates/modelcheck` checks
//! this file under shuttle against threads playing writers, snapshots and the cleaner.

use crate::sync::{Mutex, MutexGuard, RwLock};
use crate::Result;

/// What a batch of moves is installed into: a map of blocks to pointers, behind a lock.
pub trait Relocation {
    /// The map (the volume's tree).
    type Map;
    /// A block pointer: equal only to a pointer at the same copy of the same record.
    type Ptr: Copy + PartialEq;
    /// Where block `lba` points now.
    fn lookup(&self, map: &Self::Map, lba: u64) -> Result<Self::Ptr>;
    /// Point block `lba` at `ptr`.
    fn set(&self, map: &mut Self::Map, lba: u64, ptr: Self::Ptr) -> Result<()>;
    /// Block `lba` moved from `old` to `new` (still under the map lock): `old` is released.
    fn swapped(&self, map: &Self::Map, lba: u64, old: &Self::Ptr, new: &Self::Ptr);
    /// The copy `new` did not go in (the block changed, or an error stopped the batch): it
    /// is released.
    fn not_swapped(&self, new: &Self::Ptr);
}

/// Install `moves` (block, old copy, new copy) into `map` under one hold of its lock:
/// each block still pointing at its old copy takes the new one. Returns the lock, still
/// held (the caller counts the nodes the swaps dirtied), and how many moved; on an error
/// the swaps made stay and the copies not yet swapped are given back.
pub fn swap_where_held<'m, R: Relocation>(
    r: &R,
    map: &'m Mutex<R::Map>,
    moves: &[(u64, R::Ptr, R::Ptr)],
) -> (MutexGuard<'m, R::Map>, Result<usize>) {
    let mut m = map.lock();
    let mut moved = 0;
    for (k, &(lba, old, new)) in moves.iter().enumerate() {
        let swapped = r.lookup(&m, lba).and_then(|now| {
            if now != old {
                return Ok(false);
            }
            r.set(&mut m, lba, new)?;
            Ok(true)
        });
        match swapped {
            Ok(true) => {
                r.swapped(&m, lba, &old, &new);
                moved += 1;
            }
            Ok(false) => r.not_swapped(&new),
            Err(e) => {
                for (_, _, new) in &moves[k..] {
                    r.not_swapped(new);
                }
                return (m, Err(e));
            }
        }
    }
    (m, Ok(moved))
}

/// What a move into a volume's snapshot and clone trees is installed into
/// (`install_where_held`): volumes, each a map lock over its head tree and a lock over its
/// snapshots (oldest first, a clone's base first), and the clones of a snapshot, found by
/// its name.
pub trait SharedTrees {
    /// A volume (its locks).
    type Volume;
    /// A volume found as a clone of a snapshot.
    type Handle: std::ops::Deref<Target = Self::Volume>;
    /// A tree: a head or a snapshot's.
    type Tree;
    /// A snapshot: it has a tree.
    type Snap;
    /// A block pointer: equal only to a pointer at the same copy of the same record.
    type Ptr;
    /// What the clones of a snapshot know it by.
    type Name;
    /// Room held for the nodes the sets dirty, kept until they are counted (`installed`).
    type Room;

    /// The volume's map lock, over its head tree.
    fn map_lock<'v>(&self, v: &'v Self::Volume) -> &'v Mutex<Self::Tree>;
    /// The volume's snapshot list's lock (taken after the map lock, never before).
    fn snaps_lock<'v>(&self, v: &'v Self::Volume) -> &'v RwLock<Vec<Self::Snap>>;
    /// A snapshot's tree.
    fn tree<'s>(&self, s: &'s Self::Snap) -> &'s Self::Tree;
    /// A snapshot's tree, to change.
    fn tree_mut<'s>(&self, s: &'s mut Self::Snap) -> &'s mut Self::Tree;
    /// The name the clones of `s` know it by; `None` for a clone's base (never cloned).
    fn clone_name(&self, s: &Self::Snap) -> Option<Self::Name>;
    /// The volumes cloned from snapshot `name` of `v` (no lock of `v` held).
    fn clones_of(&self, v: &Self::Volume, name: &Self::Name) -> Vec<Self::Handle>;
    /// Whether `t` points block `lba` at `p`.
    fn holds(&self, t: &Self::Tree, lba: u64, p: &Self::Ptr) -> Result<bool>;
    /// Point block `lba` of `t` at `p`.
    fn set(&self, t: &mut Self::Tree, lba: u64, p: &Self::Ptr) -> Result<()>;
    /// Room for `trees` more dirty nodes, held before the first set.
    fn hold_room(&self, trees: usize) -> Result<Self::Room>;
    /// The head of `v` points block `lba` at `new` now, its run wholly set (under its
    /// locks).
    fn head_moved(&self, v: &Self::Volume, lba: u64, new: &Self::Ptr);
    /// The sets of this volume's run made (and, after an error, undone), its locks still
    /// held: count what they dirtied.
    fn installed(&self, v: &Self::Volume, head: &Self::Tree, snaps: &[Self::Snap]);
    /// No tree took the copy `new` (none held the old one any more, or an error stopped
    /// the move first): it is released.
    fn copy_unused(&self, new: &Self::Ptr);
    /// Every tree the runs reached points block `lba` at the copy now (no lock held): the
    /// old record `old` is released unless a tree the runs do not reach still holds it.
    fn old_moved(&self, v: &Self::Volume, lba: u64, old: &Self::Ptr);
}

/// The run of `v`'s trees from `k` on (`k` a snapshot's index, or the number of snapshots
/// for the head) that hold `old` at `lba`, stopping at the first that does not.
fn run_holding<S: SharedTrees>(
    s: &S,
    head: &S::Tree,
    snaps: &[S::Snap],
    k: usize,
    lba: u64,
    old: &S::Ptr,
) -> Result<Vec<usize>> {
    let mut holders = Vec::new();
    for j in k..=snaps.len() {
        let t = match snaps.get(j) {
            Some(snap) => s.tree(snap),
            None => head,
        };
        if !s.holds(t, lba, old)? {
            break;
        }
        holders.push(j);
    }
    Ok(holders)
}

/// The trees of `holders` (indices as `run_holding`'s) point block `lba` at `new`, newest
/// first. On an error the trees already set are set back to `old` (a set on a leaf it
/// dirtied reads nothing: in the engine that cannot fail), so a run is set wholly or not
/// at all: left half set past a snapshot with clones, the clones and the newer trees
/// would hold `new` and the snapshot between them `old`, and a client write to the head,
/// which looks only at the newest snapshot (`snap::head_drops`), would release `new` while
/// the clones still point at it. Returns the trees left pointing at `new` (all of
/// `holders`; on an error none, unless setting one back failed too) and what stopped it.
fn set_run<S: SharedTrees>(
    s: &S,
    head: &mut S::Tree,
    snaps: &mut [S::Snap],
    holders: &[usize],
    lba: u64,
    old: &S::Ptr,
    new: &S::Ptr,
) -> (Vec<usize>, Result<()>) {
    let mut set = Vec::with_capacity(holders.len());
    for &j in holders.iter().rev() {
        if let Err(e) = s.set(tree_at(s, head, snaps, j), lba, new) {
            set.retain(|&j| s.set(tree_at(s, head, snaps, j), lba, old).is_err());
            return (set, Err(e));
        }
        set.push(j);
    }
    (set, Ok(()))
}

/// Tree `j` of a volume: its snapshot `j`'s, or the head's (`j` the number of snapshots).
fn tree_at<'t, S: SharedTrees>(
    s: &S,
    head: &'t mut S::Tree,
    snaps: &'t mut [S::Snap],
    j: usize,
) -> &'t mut S::Tree {
    match snaps.get_mut(j) {
        Some(snap) => s.tree_mut(snap),
        None => head,
    }
}

/// Point every tree that holds `old` at block `lba` at `new`: the run of `v`'s trees from
/// tree `k` on that hold it, and the runs of the clones of every snapshot in it (from
/// their bases, recursively). Clones first, then `v`'s run, each run newest first, so the
/// trees holding `old` stay one connected run while it shrinks; `v`'s run is looked up
/// again and set under one hold of its map lock and its snapshot list (for write), so a
/// client write to the head in between keeps its pointer. Takes each volume's locks
/// alone, never two volumes' at once (the map lock, then the snapshots: the order of
/// `Volume::write` and a snapshot's commit).
///
/// Returns the number of trees changed, and what stopped it. An error (`NoSpace` from
/// `hold_room`, near full; a map node unreadable) leaves the runs set before it set and
/// the one it stopped unset (`set_run`): the clones already moved hold `new`, `v` and the
/// clones not reached yet hold `old` (`v`'s run is set last), each volume's trees in one
/// piece, so both records stay live and each is released once its last tree drops it.
/// None changed: `new` went nowhere, and the caller gives it back (`move_where_held`).
///
/// Snapshots are neither taken nor destroyed meanwhile (the caller holds the commit
/// lock): `k` names the same tree from the walk that found `old` to the set.
pub fn install_where_held<S: SharedTrees>(
    s: &S,
    v: &S::Volume,
    k: usize,
    lba: u64,
    old: &S::Ptr,
    new: &S::Ptr,
) -> (usize, Result<()>) {
    let mut changed = 0;
    let result = install_counting(s, v, k, lba, old, new, &mut changed);
    (changed, result)
}

/// `install_where_held`, adding the trees it changes to `changed` as it goes.
fn install_counting<S: SharedTrees>(
    s: &S,
    v: &S::Volume,
    k: usize,
    lba: u64,
    old: &S::Ptr,
    new: &S::Ptr,
    changed: &mut usize,
) -> Result<()> {
    let cloned: Vec<S::Name> = {
        let head = s.map_lock(v).lock();
        let snaps = s.snaps_lock(v).read();
        run_holding(s, &head, &snaps, k, lba, old)?
            .into_iter()
            .filter_map(|j| snaps.get(j).and_then(|snap| s.clone_name(snap)))
            .collect()
    };
    for name in cloned {
        for c in s.clones_of(v, &name) {
            install_counting(s, &c, 0, lba, old, new, changed)?;
        }
    }
    let mut head = s.map_lock(v).lock();
    let mut snaps = s.snaps_lock(v).write();
    let holders = run_holding(s, &head, &snaps, k, lba, old)?;
    if holders.is_empty() {
        return Ok(());
    }
    let _room = s.hold_room(holders.len())?;
    let (set, result) = set_run(s, &mut head, &mut snaps, &holders, lba, old, new);
    if set.contains(&snaps.len()) {
        s.head_moved(v, lba, new);
    }
    s.installed(v, &head, &snaps);
    *changed += set.len();
    result
}

/// The cleaner's move of record `old`, found at tree `k` of `v` (block `lba`), whose copy
/// `new` is written: installed in every tree that holds it (`install_where_held`), then
/// the copy released if no tree took it (`copy_unused`), else the old record
/// (`old_moved`). Returns whether it moved. On an error after some trees took the copy
/// (`v`'s run is set last, so `v` still holds `old`) neither is released: the trees set
/// point at `new`, the rest at `old`.
pub fn move_where_held<S: SharedTrees>(
    s: &S,
    v: &S::Volume,
    k: usize,
    lba: u64,
    old: &S::Ptr,
    new: &S::Ptr,
) -> Result<bool> {
    let (changed, result) = install_where_held(s, v, k, lba, old, new);
    if changed == 0 {
        s.copy_unused(new);
        return result.map(|()| false);
    }
    result?;
    s.old_moved(v, lba, old);
    Ok(true)
}
