//! Snapshots of a volume: read-only trees that share records with the volume's map.
//!
//! A snapshot is a saved root of the volume's map, taken by a commit that holds the
//! map lock from its first leaf to its root (`pool::txg::commit`), so it holds exactly the
//! writes that finished before `snapshot create` began its commit. Nothing is copied:
//! the snapshot and the volume share every node and record until the volume replaces
//! them (decision 0009).
//!
//! Sharing is decided by place, not by a count or a birth stamp: a record belongs to one
//! logical block and a node to one (level, index), and trees are copies of roots, so two
//! trees of a volume share a record exactly when both hold the same pointer at the same
//! place. Ordered oldest to newest with the volume's own map last (the *head*), the
//! trees that hold a record form one unbroken run: the head only ever drops records,
//! a snapshot is a copy of the head, and a destroyed snapshot leaves its neighbours
//! next to each other. So when a tree drops a record, only its two neighbours can still
//! hold it, and the record's space is released only when neither does. The head's only
//! neighbour is the newest snapshot. The rule itself lives with the release point
//! (`store::dies`, `Store::dropped`); `head_drops` asks it for the head.
//!
//! Locks: the volume's map lock (`VolumeState::tree`) before `VolumeState::snaps`, never
//! the other way. Snapshot trees change only under both (the cleaner moving a record they
//! hold, a commit writing the nodes it dirtied); a reader of a snapshot takes `snaps` alone.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::map::{At, Blkptr, NodeCache, NodeStore, Tree, Visit};
use crate::store::{Dead, Store};
use crate::Result;

/// One snapshot of a volume.
pub struct Snap {
    /// Its name; for a clone's base, `VOL@SNAP` of the origin.
    pub name: String,
    /// A clone's base: its copy of the origin snapshot's tree (first in the list, never
    /// listed, held, destroyed or rolled back to). It lets the clone decide sharing within
    /// its own trees: its writes never lock the origin's.
    pub base: bool,
    /// Seconds since the epoch at creation.
    pub created: u64,
    /// Tags that keep it from being destroyed (`snapshot hold`).
    pub holds: BTreeSet<String>,
    /// Stored bytes of data it references (one copy, after compression), as the volume's
    /// `used_bytes` was at the snapshot.
    pub referenced: u64,
    /// The volume's size at the snapshot: `VOL@SNAP` exports it, a rollback restores it, a
    /// clone starts with it. Its tree's depth is `depth_for` of it, whatever the volume's
    /// size is now (a resize changes only the head's depth: `Tree::set_depth`).
    pub size_bytes: u64,
    /// Its map: the volume's root at the snapshot (moved only by the cleaner).
    pub tree: Tree,
}

/// The snapshot a clone was made from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    pub volume: String,
    pub snapshot: String,
}

/// What `snapshot list` shows of one snapshot.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SnapshotStatus {
    /// `VOL@SNAP`.
    pub name: String,
    pub volume: String,
    pub snapshot: String,
    pub created: u64,
    /// Bytes only this snapshot references: what destroying it frees.
    pub used_bytes: u64,
    /// Bytes it references (shared or not).
    pub referenced_bytes: u64,
    pub holds: Vec<String>,
    /// The volume's size when it was taken (what `VOL@SNAP` exports).
    #[serde(default)]
    pub size_bytes: u64,
}

/// A volume's space, as `volume list --space` shows it (stored data bytes, one copy).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct VolumeSpace {
    pub name: String,
    /// What destroying the volume with its snapshots frees: `referenced + used_by_snapshots`,
    /// less, for a clone, what its base (the origin's snapshot) holds and keeps.
    pub used_bytes: u64,
    /// Bytes the volume's current data references.
    pub referenced_bytes: u64,
    /// Bytes only snapshots hold (the volume replaced or trimmed them since).
    pub used_by_snapshots_bytes: u64,
    /// Bytes written since the newest snapshot (all of `referenced` when there is none).
    pub written_bytes: u64,
    pub snapshots: usize,
}

/// The tree after snapshot `k` of `snaps`: the next snapshot, or the head.
pub fn next_of<'a>(snaps: &'a [Snap], head: &'a Tree, k: usize) -> &'a Tree {
    snaps.get(k + 1).map(|s| &s.tree).unwrap_or(head)
}

/// Under the map lock: the record `p` the head just dropped at `at`, dead unless the
/// newest snapshot holds it there (`Store::dropped`).
pub fn head_drops(store: &Store, snaps: &[Snap], at: At, p: &Blkptr) -> Option<Dead> {
    let newest: Vec<&Tree> = snaps.last().map(|s| &s.tree).into_iter().collect();
    store.dropped(&newest, at, p)
}

/// Stored data bytes of the records `t` holds and none of `others` does.
pub fn unique_data_bytes(
    store: &dyn NodeStore,
    cache: &NodeCache,
    t: &Tree,
    others: &[&Tree],
) -> Result<u64> {
    let mut bytes = 0u64;
    t.walk_unique(store, cache, others, &mut |v| {
        match v {
            Visit::Data { ptr, .. } => bytes += ptr.len as u64,
            Visit::Unreadable { error, .. } => {
                return Err(crate::Error::Corrupt(format!("snapshot space: {error}")))
            }
            Visit::Node { .. } => {}
        }
        Ok(())
    })?;
    Ok(bytes)
}

/// Split `snaps` around snapshot `k`: (its previous tree, itself, its next tree).
pub fn around<'a>(
    snaps: &'a mut [Snap],
    head: &'a Tree,
    k: usize,
) -> (Option<&'a Tree>, &'a mut Snap, &'a Tree) {
    let (before, rest) = snaps.split_at_mut(k);
    let (cur, after) = rest.split_first_mut().expect("k is a snapshot");
    let next = after.first().map(|s| &s.tree).unwrap_or(head);
    (before.last().map(|s| &s.tree), cur, next)
}
