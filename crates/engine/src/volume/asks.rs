//! What the control plane asks of a `VolumeState`. Its fields are private to `volume/`:
//! the pool's rooms read what a volume is (`name`, `block_size`, ...), set what a command
//! changes (`set_readonly`, `set_used_bytes`, ...), and take its locks through methods
//! named for what each lock holds (`map`, `snapshots`, `key_ring`, ...), in the order
//! `snap.rs` gives.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use zeroize::Zeroizing;

use super::{rotation, snap, VolumeState};
use crate::keys::ring::{DataKeyRecord, KeyRing};
use crate::keys::KeySlot;
use crate::map::{Blkptr, Tree};

impl VolumeState {
    // --- what the volume is ---

    /// Its number in the volume table.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Its identity, bound into its keys and block encryption.
    pub fn uuid(&self) -> [u8; 16] {
        self.uuid
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Whether its blocks are encrypted.
    pub fn is_encrypted(&self) -> bool {
        self.encryption
    }

    /// Seconds since the epoch when it was created (0: before this was recorded).
    pub fn created(&self) -> u64 {
        self.created.load(Ordering::Relaxed)
    }

    /// At import: when it was created, as the table says.
    pub fn set_created(&self, secs: u64) {
        self.created.store(secs, Ordering::Relaxed);
    }

    /// Whether every write is refused (`volume set readonly=on`).
    pub fn is_readonly(&self) -> bool {
        self.readonly.load(Ordering::Acquire)
    }

    /// `volume set readonly=`.
    pub fn set_readonly(&self, on: bool) {
        self.readonly.store(on, Ordering::Release);
    }

    /// Whether its whole size is reserved in the pool (`volume create --thick`).
    pub fn is_thick(&self) -> bool {
        self.thick.load(Ordering::Acquire)
    }

    /// `volume set` of its provisioning, or the table's at import.
    pub fn set_thick(&self, on: bool) {
        self.thick.store(on, Ordering::Release);
    }

    /// Its free-text description.
    pub fn description(&self) -> String {
        self.description.lock().clone()
    }

    /// `volume set description=`.
    pub fn set_description(&self, text: String) {
        *self.description.lock() = text;
    }

    /// Stored bytes of the data blocks it references (one copy).
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes.load(Ordering::Relaxed)
    }

    /// Its stored bytes as counted anew (import, rollback, clone, destroy).
    pub fn set_used_bytes(&self, bytes: u64) {
        self.used_bytes.store(bytes, Ordering::Relaxed);
    }

    /// Whether it was destroyed (handles still open refuse every operation).
    pub fn is_destroyed(&self) -> bool {
        self.destroyed.load(Ordering::Acquire)
    }

    /// `volume destroy`: every handle still open refuses from now on.
    pub fn mark_destroyed(&self) {
        self.destroyed.store(true, Ordering::Release);
    }

    /// Destroyed but kept (hidden, its map empty) for the clones of its snapshots.
    pub fn is_deferred(&self) -> bool {
        self.deferred.load(Ordering::Acquire)
    }

    /// Its destroy deferred for its clones (or, at import, as the table says).
    pub fn set_deferred(&self, on: bool) {
        self.deferred.store(on, Ordering::Release);
    }

    // --- counters the store keeps for it ---

    /// The head tree's dirty node count as of its last change, the slot
    /// `Store::note_dirty` keeps.
    pub fn head_dirty(&self) -> &AtomicUsize {
        &self.dirty_nodes
    }

    /// Dirty nodes of its snapshot trees (the cleaner's moves), as `head_dirty`.
    pub fn snaps_dirty(&self) -> &AtomicUsize {
        &self.snap_dirty_nodes
    }

    // --- its locks, named for what each holds (lock order: `snap.rs`) ---

    /// The map lock: its head tree.
    pub fn map(&self) -> MutexGuard<'_, Tree> {
        self.tree.lock()
    }

    /// The map lock itself, for the cleaner's swap (`pool::relocate::swap_where_held`, which
    /// takes it once for a whole batch and hands the guard back).
    pub fn map_lock(&self) -> &Mutex<Tree> {
        &self.tree
    }

    /// Its snapshots, oldest first, to read.
    pub fn snapshots(&self) -> RwLockReadGuard<'_, Vec<snap::Snap>> {
        self.snaps.read()
    }

    /// Its snapshots, to change.
    pub fn snapshots_mut(&self) -> RwLockWriteGuard<'_, Vec<snap::Snap>> {
        self.snaps.write()
    }

    /// The snapshot list's lock itself, for the cleaner's move into snapshot and clone
    /// trees (`pool::relocate::install_where_held`, which takes it after `map_lock`).
    pub fn snaps_lock(&self) -> &RwLock<Vec<snap::Snap>> {
        &self.snaps
    }

    /// `snapshot create`: the next commit takes a snapshot of the head, named `name`,
    /// its tree numbered `tree_id`.
    pub fn want_snapshot(&self, name: String, tree_id: u64) {
        *self.snapshot_wanted.lock() = Some((name, tree_id));
    }

    /// The snapshot the next commit takes (name, tree id), taken away: the commit takes
    /// it, or a `snapshot create` that failed withdraws it.
    pub fn take_snapshot_wanted(&self) -> Option<(String, u64)> {
        self.snapshot_wanted.lock().take()
    }

    /// The snapshot it was cloned from, if any.
    pub fn origin(&self) -> MutexGuard<'_, Option<snap::Origin>> {
        self.origin.lock()
    }

    /// The client changes since the last durable point (the intent log's notes), under
    /// their lock (the cleaner adds its moves, a commit drops the ones it covers).
    pub fn intents(&self) -> MutexGuard<'_, Vec<(u64, Blkptr)>> {
        self.intents.lock()
    }

    /// Those changes, taken away: a flush writes them to the intent log, a commit whose
    /// leaves hold them drops them.
    pub fn take_intents(&self) -> Vec<(u64, Blkptr)> {
        std::mem::take(&mut *self.intents.lock())
    }

    /// Its key slots (wrappings of the volume master key).
    pub fn key_slots(&self) -> MutexGuard<'_, Vec<KeySlot>> {
        self.slots.lock()
    }

    /// Its volume master key (a copy), or why there is none: the volume is locked, or its
    /// keys were erased (`locked`).
    pub fn vmk_or_locked(&self) -> crate::Result<Zeroizing<[u8; 32]>> {
        let vmk = self.vmk.lock().clone();
        vmk.ok_or_else(|| self.locked())
    }

    /// `key load`, and a volume created or cloned with its keys: its ring and master key
    /// open, so that handles may be taken and slots added.
    pub fn open_keys(&self, ring: KeyRing, vmk: Zeroizing<[u8; 32]>) {
        *self.ring.write() = Some(Arc::new(ring));
        *self.vmk.lock() = Some(vmk);
    }

    /// A key ring with a new set of data keys (a rotation begins or ends, a clone's origin
    /// takes a generation of its own), in place of the one open; only while one is open,
    /// under the lock `key unload` takes it under. False when none is: the key was unloaded
    /// meanwhile (a rotation's worker that read the master key just before would otherwise
    /// open the volume again, unloaded as `key unload` had answered).
    #[must_use]
    pub fn set_key_ring(&self, ring: KeyRing) -> bool {
        let mut open = self.ring.write();
        if open.is_none() {
            return false;
        }
        *open = Some(Arc::new(ring));
        true
    }

    /// `key unload` and `key erase`, after `take_key` took the ring: the master key goes too.
    pub fn forget_vmk(&self) {
        *self.vmk.lock() = None;
    }

    /// Whether its key ring is open (`key load`ed, or never locked).
    pub fn key_loaded(&self) -> bool {
        self.ring.read().is_some()
    }

    /// Its data keys by generation, wrapped by the VMK.
    pub fn data_keys(&self) -> MutexGuard<'_, Vec<DataKeyRecord>> {
        self.data_keys.lock()
    }

    /// Its key rotation in progress, if any.
    pub fn rotation(&self) -> MutexGuard<'_, Option<rotation::Rotation>> {
        self.rotation.lock()
    }

    /// The worker that runs its rotation (never persisted).
    pub(crate) fn rotation_worker(&self) -> &Arc<rotation::RotationWorker> {
        &self.rotation_worker
    }
}
