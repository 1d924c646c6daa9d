//! Key rotation: a new data key for every new write at once, old blocks
//! re-encrypted in the background, the old key dropped when no block uses it.
//!
//! `key_rotate` adds a data key generation and makes it current before it
//! returns, and waits for the client writes under way (`VolumeState::drain_writes`: one
//! that read the older key lands in the map before the walk). A worker then walks the map; each block of an older generation is
//! read and rewritten under its stripe lock (the same lock client writes take,
//! so a client write in between wins). The cursor is saved with every commit:
//! after a crash, loading the key resumes the rotation. When the walk ends,
//! older data keys are removed and the table key is replaced (see
//! `forget_old_tables`), so the old data key is gone from the devices.
//!
//! A batch that fails pauses the rotation: the cursor stays before that batch
//! and `Rotation::error` says why. A full pool (`NoSpace`) is waited out: the
//! worker stays, tries again as soon as client data fits again (and every
//! `ROTATE_RETRY` in case the cleaner can make room), and goes on from the
//! cursor. Any other error ends the worker; `key_rotate` on the paused
//! rotation, or the next key load, starts it again from the cursor. One worker
//! per volume at most (`RotationWorker`); like every background worker it is
//! tracked in `Core::workers`, and it looks at `closing` between batches and
//! while paused, so closing the pool waits for it briefly: `Pool::close` (or drop)
//! joins it, and no worker writes once the pool's lock is let go. The worker holds its
//! volume only while it tries a batch (a weak reference between them), so a paused
//! rotation never keeps the volume from `volume destroy`, `key unload` or `key erase`.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::core::Core;
use crate::codec::FLAG_ENCRYPTED;
use crate::keys::ring::{self, KeyRing};
use crate::map::Visit;
use crate::volume::{Volume, VolumeState};
use crate::{Error, Result};

/// Blocks examined per batch.
const ROTATE_BATCH_BLOCKS: u64 = 1024;
/// A rotation paused by a full pool tries again at least this often...
const ROTATE_RETRY: Duration = Duration::from_secs(10);
/// ...and as soon as client data fits again, but not more often than this.
const ROTATE_RETRY_MIN: Duration = Duration::from_secs(1);
/// How often a paused worker looks at the pool (closing, free space, the key).
const ROTATE_PAUSE_POLL: Duration = Duration::from_millis(200);

pub use crate::volume::rotation::Rotation;

/// What one batch of a rotation's walk came to (`Core::rotate_batch`).
enum Batch {
    /// More of the volume to walk.
    More,
    /// No rotation, or it cannot go on now (closing, key unloaded, volume destroyed).
    Stopped,
    /// The walk reached the end: `rotate_finish`.
    End,
}
use crate::volume::rotation::RotationWorker;

impl Core {
    /// Start a key rotation of an unlocked volume.
    pub fn key_rotate(self: &Arc<Self>, name: &str) -> Result<u16> {
        let st = self.find(name)?;
        if !st.is_encrypted() {
            return Err(Error::Invalid(format!(
                "volume '{name}' is not encrypted; it has no keys"
            )));
        }
        let vmk = st.vmk_or_locked()?;
        let current = st.rotation().clone();
        if let Some(r) = current {
            if r.error.is_none() && st.rotation_worker().running() {
                return Err(Error::Busy(format!(
                    "a key rotation of volume '{name}' is already running"
                )));
            }
            // Paused (or its worker gone): go on from the cursor.
            tracing::info!(
                volume = name,
                generation = r.to_generation,
                "key rotation resumed on request"
            );
            self.spawn_rotation(st);
            return Ok(r.to_generation);
        }
        let generation = {
            let mut keys = st.data_keys();
            let g = ring::next_generation(&keys, st.name())?;
            keys.push(ring::new_data_key(&vmk, &st.uuid(), g));
            let ring = KeyRing::open(&vmk, &st.uuid(), &keys, self.store.run_salt())?;
            if !st.set_key_ring(ring) {
                keys.pop();
                return Err(st.locked());
            }
            g
        };
        // A write that read the key ring before may still be sealing under the older key:
        // it must land in the map before the worker walks it, or it would land behind the
        // walk (in a block the walk found a hole) and stay under a key the rotation drops
        // (`volume::stripes`; crates/modelcheck/tests/rotation_writers.rs).
        st.drain_writes();
        let total = st.used_bytes() / st.block_size().max(1) as u64;
        *st.rotation() = Some(Rotation {
            to_generation: generation,
            blocks_total: total,
            ..Default::default()
        });
        self.table_dirty.store(true, Ordering::Release);
        self.commit()?;
        tracing::info!(
            volume = name,
            generation,
            "key rotation started: new writes use the new data key"
        );
        self.spawn_rotation(st);
        Ok(generation)
    }

    /// Run the volume's rotation in a worker from its cursor: start one, or, when one runs
    /// already (paused, or about to end), have it go on. A pause reason is cleared.
    pub(crate) fn spawn_rotation(self: &Arc<Self>, st: Arc<VolumeState>) {
        if let Some(r) = st.rotation().as_mut() {
            r.error = None;
            r.retrying = false;
        }
        if self.store.stepped() {
            // No worker: `Pool::rotation_step` runs its batches (`stepped.rs`).
            return;
        }
        {
            let mut w = st.rotation_worker().state.lock();
            if w.running {
                w.resume = true;
                st.rotation_worker().wake.notify_all();
                return;
            }
            w.running = true;
        }
        let core = self.clone();
        let (vol, sync) = (Arc::downgrade(&st), st.rotation_worker().clone());
        let spawned = std::thread::Builder::new()
            .name("bulwark-rotate".into())
            .spawn(move || core.rotate_worker(&vol, &sync));
        match spawned {
            Ok(h) => self.track_worker(h),
            Err(e) => {
                st.rotation_worker().state.lock().running = false;
                tracing::error!(volume = %st.name(), "key rotation paused: cannot start its worker: {e}");
                if let Some(r) = st.rotation().as_mut() {
                    r.error = Some(format!("cannot start the rotation worker: {e}"));
                }
            }
        }
    }

    /// `Pool::rotation_step`: one batch of every key rotation under way; how many ran.
    pub(super) fn rotation_step(self: &Arc<Self>) -> Result<usize> {
        if !self.store.stepped() {
            return Err(Error::Invalid(
                "rotation_step needs a pool opened with OpenOptions::stepped: a worker already rotates".into(),
            ));
        }
        let vols: Vec<_> = self.volumes.read().values().cloned().collect();
        let mut ran = 0;
        for st in vols {
            let paused = match st.rotation().as_ref() {
                None => continue,
                Some(r) => r.error.is_some(),
            };
            if paused && !st.rotation().as_ref().is_some_and(|r| r.retrying) {
                continue;
            }
            let vol = Volume::new(self.store.clone(), self.clone(), st.clone());
            let mut buf = vec![0u8; st.block_size() as usize];
            let mut was_paused = paused;
            ran += 1;
            let done = match self.rotate_batch(&st, &vol, &mut buf, &mut was_paused) {
                Ok(Batch::End) => self.rotate_finish(&st),
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            };
            if let Err(e) = done {
                self.note_rotation_paused(&st, &e);
            }
        }
        Ok(ran)
    }

    /// The worker: runs the rotation, waits out a full pool, and ends when the rotation is
    /// done, the pool closes, the key is unloaded, the volume is destroyed, or on any other
    /// error (the rotation stays recorded, paused, with its reason). It holds the volume
    /// only while it tries a batch: a rotation waiting for space must not keep its volume
    /// from being destroyed, locked or erased, which is how an admin frees space (each of
    /// those refuses a volume something else holds open).
    fn rotate_worker(self: &Arc<Self>, vol: &Weak<VolumeState>, sync: &RotationWorker) {
        let mut paused = false;
        loop {
            let retrying = match vol.upgrade() {
                None => false, // destroyed
                Some(st) => match self.rotate_run(&st, &mut paused) {
                    Ok(()) => false,
                    Err(e) => {
                        self.note_rotation_paused(&st, &e);
                        paused = true;
                        matches!(e, Error::NoSpace)
                    }
                },
            };
            if retrying && self.wait_to_retry(sync) {
                continue;
            }
            // Ending: unless a resume was asked meanwhile (decided under the worker's lock,
            // so a `spawn_rotation` either sees this worker running and is heard, or sees
            // it gone and starts another).
            let mut w = sync.state.lock();
            if w.resume && !self.store.is_closing() {
                w.resume = false;
                continue;
            }
            w.running = false;
            w.resume = false;
            return;
        }
    }

    /// Records why the rotation paused (`Rotation::error`), and logs it once per reason.
    fn note_rotation_paused(&self, st: &VolumeState, e: &Error) {
        let retrying = matches!(e, Error::NoSpace);
        let mut changed = true;
        if let Some(r) = st.rotation().as_mut() {
            let reason = e.to_string();
            changed = r.error.as_deref() != Some(reason.as_str());
            r.error = Some(reason);
            r.retrying = retrying;
        }
        if !changed {
            tracing::debug!(volume = %st.name(), "key rotation still paused: {e}");
        } else if retrying {
            tracing::error!(volume = %st.name(), "key rotation paused: {e}; it goes on once space is free");
        } else {
            tracing::error!(volume = %st.name(), "key rotation paused: {e}");
        }
    }

    /// Wait while the rotation is paused for space, holding no volume. True to try again
    /// (the next batch sees whether the key was unloaded or the volume destroyed
    /// meanwhile): a resume was asked, client data fits again, or `ROTATE_RETRY` passed
    /// (the cleaner may have made room). False to end: the pool closes.
    fn wait_to_retry(&self, w: &RotationWorker) -> bool {
        let since = crate::env::now();
        let mut g = w.state.lock();
        loop {
            if g.resume {
                g.resume = false;
                return true;
            }
            if self.store.is_closing() {
                return false;
            }
            let waited = crate::env::since(since);
            if waited >= ROTATE_RETRY
                || (waited >= ROTATE_RETRY_MIN && self.store.background_space_available())
            {
                return true;
            }
            w.wake.wait_for(&mut g, ROTATE_PAUSE_POLL);
        }
    }

    /// The rotation cannot go on now: the pool closes, the key is unloaded (it resumes at
    /// the next key load), the volume is destroyed, or there is no rotation.
    fn rotation_stopped(&self, st: &VolumeState) -> bool {
        self.store.is_closing() || !st.key_loaded() || st.is_destroyed() || st.rotation().is_none()
    }

    /// Walk the rest of the volume from the cursor, then retire the older data keys.
    /// `paused`: the rotation was paused; the first batch that goes through says it resumed.
    fn rotate_run(self: &Arc<Self>, st: &Arc<VolumeState>, paused: &mut bool) -> Result<()> {
        let vol = Volume::new(self.store.clone(), self.clone(), st.clone());
        let mut buf = vec![0u8; st.block_size() as usize];
        loop {
            match self.rotate_batch(st, &vol, &mut buf, paused)? {
                Batch::More => {}
                Batch::Stopped => return Ok(()), // resumes on the next key load
                Batch::End => return self.rotate_finish(st),
            }
        }
    }

    /// One batch of the walk from the cursor (`ROTATE_BATCH_BLOCKS` blocks): each block
    /// under an older data key rewritten, the cursor moved past them.
    fn rotate_batch(
        self: &Arc<Self>,
        st: &Arc<VolumeState>,
        vol: &Volume,
        buf: &mut [u8],
        paused: &mut bool,
    ) -> Result<Batch> {
        let blocks = st.size() / st.block_size() as u64;
        {
            // No command changes the volume under a batch (`quiesce_for_change`): a key
            // unload or a destroy waits for it, and the next one sees it stopped.
            let _batch = st.background_batch();
            let Some(rot) = st.rotation().clone() else {
                return Ok(Batch::Stopped);
            };
            if self.rotation_stopped(st) {
                return Ok(Batch::Stopped);
            }
            if rot.lba >= blocks {
                return Ok(Batch::End);
            }
            // Holes are stepped over, not walked a batch at a time (a thin volume of 1E).
            let mut old: Vec<u64> = Vec::new();
            let tree = st.map();
            let start = tree.next_mapped(&*self.store, self.store.nodes(), rot.lba, blocks)?;
            let hi = (start + ROTATE_BATCH_BLOCKS).min(blocks);
            tree.walk(&*self.store, self.store.nodes(), start, hi, &mut |v| {
                match v {
                    Visit::Data { lba, ptr }
                        if ptr.flags & FLAG_ENCRYPTED != 0 && ptr.key_gen != rot.to_generation =>
                    {
                        old.push(lba)
                    }
                    Visit::Unreadable { error, .. } => {
                        return Err(Error::Corrupt(format!("key rotation: {error}")))
                    }
                    _ => {}
                }
                Ok(())
            })?;
            drop(tree);
            // A batch that fails leaves the cursor before it: the blocks it rewrote are
            // under the new generation and are skipped when it is tried again.
            let mut done = 0u64;
            let result = old.iter().try_for_each(|&lba| {
                // Background work leaves the pool's last free space to client writes.
                if !self.store.background_space_available() {
                    return Err(Error::NoSpace);
                }
                vol.rewrite_block(lba, buf)?;
                done += 1;
                Ok::<(), Error>(())
            });
            {
                let mut r = st.rotation();
                if let Some(r) = r.as_mut() {
                    r.blocks_done += done;
                    if result.is_ok() {
                        r.lba = hi;
                        r.error = None;
                        r.retrying = false;
                    }
                }
            }
            self.table_dirty.store(true, Ordering::Release);
            result?;
            if std::mem::take(paused) {
                tracing::info!(volume = %st.name(), "key rotation resumed");
            }
        }
        Ok(Batch::More)
    }

    /// The walk reached the end: every block is under the new generation, so drop the
    /// others (unless snapshots still hold blocks under them) and forget the old tables.
    fn rotate_finish(self: &Arc<Self>, st: &Arc<VolumeState>) -> Result<()> {
        let to = st.rotation().as_ref().map(|r| r.to_generation).unwrap_or(0);
        {
            let vmk = st.vmk_or_locked()?;
            crate::pause::point_at(&self.dir, "rotate.finish");
            // Snapshots still hold blocks under the older keys: those stay until a rotation
            // finishes with no snapshot left.
            let snapshots = st.snapshots().iter().filter(|s| !s.base).count();
            let mut keys = st.data_keys();
            let kept: Vec<_> = keys
                .iter()
                .filter(|k| snapshots > 0 || k.generation == to)
                .cloned()
                .collect();
            let ring = KeyRing::open(&vmk, &st.uuid(), &kept, self.store.run_salt())?;
            if !st.set_key_ring(ring) {
                // `key unload` took the key after the master key was read: the volume stays
                // unloaded, its keys as they were, and the rotation finishes at the next
                // load (its walk is done).
                tracing::info!(volume = %st.name(), "key rotation finishes at the next key load");
                return Ok(());
            }
            *keys = kept;
            if snapshots > 0 {
                tracing::info!(volume = %st.name(), snapshots, "older data keys kept: snapshots hold blocks encrypted under them");
            }
        }
        *st.rotation() = None;
        self.forget_old_tables()?;
        // A clone whose inherited blocks are all re-encrypted shares nothing with its
        // origin any more (`--independent`).
        crate::pause::point_at(&self.dir, "rotate.detach");
        self.detach_clone(st)?;
        tracing::info!(volume = %st.name(), generation = to, "key rotation finished: new writes and the volume's blocks use the new data key");
        Ok(())
    }
}
