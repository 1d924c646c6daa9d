//! Snapshots: create, destroy, hold and release, roll back, list with their space.
//!
//! The sharing rules and the locks are in `volume::snap`; decision 0009 says why
//! sharing is decided by place. Every change here runs under the commit lock and ends
//! with a commit, so a crash leaves either the state before or the state after.
//! Destroying frees, in one step, exactly what the unique walk of the snapshot against
//! its two neighbours finds: the walk runs to its end before anything is released, so
//! an error (a node that cannot be read) leaves everything as it was.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::core::Core;
use crate::map::{Blkptr, Tree, Visit};
use crate::volume::snap::{self, Snap, SnapshotStatus, VolumeSpace};
use crate::volume::{Volume, VolumeState};
use crate::{Error, Result};

/// Snapshots one volume may have (each costs a few hundred bytes of the table, written
/// at every commit).
pub const SNAPSHOTS_MAX: usize = 1000;

/// `VOL@SNAP` as (volume, snapshot); `None` for a name without `@`.
pub fn split_name(name: &str) -> Option<(&str, &str)> {
    name.split_once('@')
}

/// The rules of volume names, for snapshot names and hold tags.
pub fn validate_snapshot_name(name: &str) -> Result<()> {
    super::core::validate_name(name).map_err(|_| {
        Error::Invalid(format!(
            "invalid snapshot name '{name}': use 1-64 letters, digits, '.', '_' or '-', not \
             starting with '-' or '.'"
        ))
    })
}

fn validate_tag(tag: &str) -> Result<()> {
    super::core::validate_name(tag).map_err(|_| {
        Error::Invalid(format!(
            "invalid hold tag '{tag}': use 1-64 letters, digits, '.', '_' or '-', not \
             starting with '-' or '.'"
        ))
    })
}

fn position(snaps: &[Snap], volume: &str, name: &str) -> Result<usize> {
    snaps
        .iter()
        .position(|s| s.name == name)
        .ok_or_else(|| Error::NotFound(format!("snapshot '{volume}@{name}' does not exist")))
}

impl Core {
    fn next_tree_id(&self) -> u64 {
        let mut sb = self.sb.lock();
        sb.next_volume_id += 1;
        sb.next_volume_id - 1
    }

    /// Snapshot `volume` as `name`: one commit, no data written.
    pub fn snapshot_create(&self, volume: &str, name: &str) -> Result<()> {
        self.store.check_poisoned()?;
        validate_snapshot_name(name)?;
        let _c = self.commit_lock.lock();
        let st = self.find(volume)?;
        {
            let snaps = st.snaps.read();
            if snaps.iter().any(|s| s.name == name) {
                return Err(Error::Exists(format!(
                    "snapshot '{volume}@{name}' already exists"
                )));
            }
            if snaps.len() >= SNAPSHOTS_MAX {
                return Err(Error::Invalid(format!(
                    "volume '{volume}' has {SNAPSHOTS_MAX} snapshots, the most it may have; \
                     destroy some first"
                )));
            }
        }
        let id = self.next_tree_id();
        *st.snapshot_wanted.lock() = Some((name.to_string(), id));
        self.table_dirty.store(true, Ordering::Release);
        let committed = self.commit_held();
        // A commit that failed before it reached this volume leaves the wish behind.
        st.snapshot_wanted.lock().take();
        committed?;
        if !st.snaps.read().iter().any(|s| s.name == name) {
            return Err(Error::Corrupt(format!(
                "snapshot '{volume}@{name}' was not taken by the commit"
            )));
        }
        tracing::info!(volume, snapshot = name, "snapshot created");
        Ok(())
    }

    /// What the unique walk of `t` against `others` finds: nodes and data records to
    /// release, and the data bytes among them. Nothing is released here.
    fn unique_records(&self, t: &Tree, others: &[&Tree]) -> Result<(Vec<Blkptr>, u64)> {
        let mut gone = Vec::new();
        let mut bytes = 0u64;
        t.walk_unique(&*self.store, &self.store.cache, others, &mut |v| {
            match v {
                Visit::Node { ptr, .. } => gone.push(*ptr),
                Visit::Data { ptr, .. } => {
                    bytes += ptr.len as u64;
                    gone.push(*ptr);
                }
                Visit::Unreadable {
                    level,
                    index,
                    error,
                } => {
                    return Err(Error::Corrupt(format!(
                        "map node ({level}, {index}) cannot be read: {error}"
                    )))
                }
            }
            Ok(())
        })?;
        Ok((gone, bytes))
    }

    /// Destroy snapshot `k` of `snaps` (the caller holds the commit lock, the head's map
    /// lock and `snaps`, and the snapshot trees are clean): release what only it holds.
    /// Returns the data bytes freed.
    fn destroy_at(
        &self,
        volume: &str,
        snaps: &mut Vec<Snap>,
        head: &Tree,
        k: usize,
    ) -> Result<u64> {
        if !snaps[k].holds.is_empty() {
            let tags: Vec<&str> = snaps[k].holds.iter().map(String::as_str).collect();
            return Err(Error::Busy(format!(
                "snapshot '{volume}@{}' is held ({}); release the holds first \
                 ('bulwark snapshot release {volume}@{} TAG')",
                snaps[k].name,
                tags.join(", "),
                snaps[k].name
            )));
        }
        let (gone, bytes) = {
            let prev = k.checked_sub(1).map(|j| &snaps[j].tree);
            let next = snap::next_of(snaps, head, k);
            let others: Vec<&Tree> = prev.into_iter().chain([next]).collect();
            self.unique_records(&snaps[k].tree, &others).map_err(|e| {
                e.within(format!("destroying snapshot '{volume}@{}'", snaps[k].name))
            })?
        };
        for p in &gone {
            self.store.release(p);
        }
        snaps.remove(k);
        Ok(bytes)
    }

    /// Destroy snapshot `volume@name`; returns the data bytes it freed (its `used`).
    pub fn snapshot_destroy(&self, volume: &str, name: &str) -> Result<u64> {
        self.store.check_poisoned()?;
        let _c = self.commit_lock.lock();
        let st = self.find(volume)?;
        position(&st.snaps.read(), volume, name)?;
        // Snapshot trees are clean after a commit (the cleaner, which dirties them, waits
        // for the commit lock).
        self.commit_held()?;
        let freed = {
            let head = st.tree.lock();
            let mut snaps = st.snaps.write();
            let k = position(&snaps, volume, name)?;
            self.destroy_at(volume, &mut snaps, &head, k)?
        };
        crate::crashpoint::hit("snapshot.destroy.released");
        self.table_dirty.store(true, Ordering::Release);
        self.commit_held()?;
        tracing::info!(volume, snapshot = name, freed, "snapshot destroyed");
        Ok(freed)
    }

    /// Add (`hold`) or remove a hold `tag` on `volume@name`.
    pub fn snapshot_hold(&self, volume: &str, name: &str, tag: &str, hold: bool) -> Result<()> {
        self.store.check_poisoned()?;
        validate_tag(tag)?;
        let _c = self.commit_lock.lock();
        let st = self.find(volume)?;
        {
            let _head = st.tree.lock();
            let mut snaps = st.snaps.write();
            let k = position(&snaps, volume, name)?;
            let holds = &mut snaps[k].holds;
            if hold && !holds.insert(tag.to_string()) {
                return Err(Error::Exists(format!(
                    "snapshot '{volume}@{name}' is already held by '{tag}'"
                )));
            }
            if !hold && !holds.remove(tag) {
                return Err(Error::NotFound(format!(
                    "snapshot '{volume}@{name}' has no hold '{tag}'"
                )));
            }
        }
        self.table_dirty.store(true, Ordering::Release);
        self.commit_held()
    }

    /// Make `volume` what it was at snapshot `name`. Snapshots newer than it are refused,
    /// or destroyed with `destroy_newer`; returns the names destroyed. The volume must be
    /// detached (no handle on it open; handles on its snapshots may be: the snapshots that
    /// stay do not change, and the caller refuses to destroy one a client has open) and not
    /// rotating its key.
    pub fn volume_rollback(
        &self,
        volume: &str,
        name: &str,
        destroy_newer: bool,
    ) -> Result<Vec<String>> {
        self.store.check_poisoned()?;
        let _c = self.commit_lock.lock();
        let st = self.find(volume)?;
        // One reference in the table, one here, one per snapshot handle: any other holds
        // the volume itself. Under `snaps`, a snapshot handle being opened or dropped counts
        // as a reference and not a snapshot handle, never the other way round.
        let in_use = {
            let _snaps = st.snaps.write();
            Arc::strong_count(&st).saturating_sub(st.snapshot_views.load(Ordering::Acquire)) > 2
        };
        if in_use {
            return Err(self.volume_in_use(volume));
        }
        if st.rotation.lock().is_some() {
            return Err(Error::Busy(format!(
                "volume '{volume}' is rotating its key; roll back after the rotation finishes"
            )));
        }
        {
            let snaps = st.snaps.read();
            let k = position(&snaps, volume, name)?;
            let newer: Vec<String> = snaps[k + 1..]
                .iter()
                .map(|s| format!("{volume}@{}", s.name))
                .collect();
            if !newer.is_empty() && !destroy_newer {
                return Err(Error::Invalid(format!(
                    "'{volume}@{name}' is not the newest snapshot ({} newer: {}); pass \
                     --destroy-newer to destroy them and roll back",
                    newer.len(),
                    newer.join(", ")
                )));
            }
            if let Some(s) = snaps[k + 1..].iter().find(|s| !s.holds.is_empty()) {
                return Err(Error::Busy(format!(
                    "snapshot '{volume}@{}' is newer and held; release its holds first",
                    s.name
                )));
            }
        }
        // The head is clean after this commit: nothing writes a volume with no handle,
        // and the cleaner waits for the commit lock.
        self.commit_held()?;
        let new_id = self.next_tree_id();
        let destroyed = {
            let mut head = st.tree.lock();
            let mut snaps = st.snaps.write();
            let k = position(&snaps, volume, name)?;
            let mut destroyed = Vec::new();
            while snaps.len() > k + 1 {
                let j = snaps.len() - 1;
                let n = snaps[j].name.clone();
                self.destroy_at(volume, &mut snaps, &head, j)?;
                destroyed.push(n);
            }
            let target = &snaps[k];
            let (gone, _) = self
                .unique_records(&head, &[&target.tree])
                .map_err(|e| e.within(format!("rolling '{volume}' back")))?;
            for p in &gone {
                self.store.release(p);
            }
            // A fresh id: the node cache keys nodes by tree and place, not by address.
            *head = Tree::new(new_id, head.depth, target.tree.root);
            st.used_bytes.store(target.referenced, Ordering::Relaxed);
            self.store.note_dirty(&st.dirty_nodes, 0);
            destroyed
        };
        crate::crashpoint::hit("rollback.released");
        self.table_dirty.store(true, Ordering::Release);
        self.commit_held()?;
        tracing::info!(
            volume,
            snapshot = name,
            destroyed = destroyed.len(),
            "volume rolled back"
        );
        Ok(destroyed)
    }

    fn volumes_named(&self, volume: Option<&str>) -> Result<Vec<Arc<VolumeState>>> {
        Ok(match volume {
            Some(v) => vec![self.find(v)?],
            None => self.volumes.read().values().cloned().collect(),
        })
    }

    /// Every snapshot of `volume` (or of every volume), oldest first per volume, with the
    /// bytes each alone holds.
    pub fn snapshot_list(&self, volume: Option<&str>) -> Result<Vec<SnapshotStatus>> {
        let mut out = Vec::new();
        for st in self.volumes_named(volume)? {
            let head = st.tree.lock();
            let snaps = st.snaps.read();
            for (k, s) in snaps.iter().enumerate() {
                let prev = k.checked_sub(1).map(|j| &snaps[j].tree);
                let next = snap::next_of(&snaps, &head, k);
                let others: Vec<&Tree> = prev.into_iter().chain([next]).collect();
                let used =
                    snap::unique_data_bytes(&*self.store, &self.store.cache, &s.tree, &others)?;
                out.push(SnapshotStatus {
                    name: format!("{}@{}", st.name, s.name),
                    volume: st.name.clone(),
                    snapshot: s.name.clone(),
                    created: s.created,
                    used_bytes: used,
                    referenced_bytes: s.referenced,
                    holds: s.holds.iter().cloned().collect(),
                });
            }
        }
        Ok(out)
    }

    /// The space of `volume` (or of every volume) split as `zfs list -o space` does.
    pub fn volume_space(&self, volume: Option<&str>) -> Result<Vec<VolumeSpace>> {
        let mut out = Vec::new();
        for st in self.volumes_named(volume)? {
            let head = st.tree.lock();
            let snaps = st.snaps.read();
            let referenced = st.used_bytes.load(Ordering::Relaxed);
            let mut by_snapshots = 0;
            for (k, s) in snaps.iter().enumerate() {
                let next = snap::next_of(&snaps, &head, k);
                by_snapshots +=
                    snap::unique_data_bytes(&*self.store, &self.store.cache, &s.tree, &[next])?;
            }
            let written = match snaps.last() {
                Some(s) => {
                    snap::unique_data_bytes(&*self.store, &self.store.cache, &head, &[&s.tree])?
                }
                None => referenced,
            };
            out.push(VolumeSpace {
                name: st.name.clone(),
                used_bytes: referenced + by_snapshots,
                referenced_bytes: referenced,
                used_by_snapshots_bytes: by_snapshots,
                written_bytes: written,
                snapshots: snaps.len(),
            });
        }
        Ok(out)
    }

    /// A read-only handle on `volume@name` (its key must be loaded, as for the volume).
    pub fn snapshot_handle(self: &Arc<Self>, volume: &str, name: &str) -> Result<Arc<Volume>> {
        self.store.check_poisoned()?;
        let st = self.find(volume)?;
        if st.encryption && st.ring.read().is_none() {
            return Err(Error::Locked(volume.to_string()));
        }
        position(&st.snaps.read(), volume, name)?;
        Ok(Arc::new(Volume::snapshot_view(
            self.store.clone(),
            self.clone(),
            st,
            name,
        )))
    }

    /// Release every record of `st`'s snapshots and map (its destruction), each once:
    /// every tree is walked against the one before it, so a shared record is found only
    /// in the oldest tree that holds it.
    pub(crate) fn release_family(&self, st: &VolumeState) {
        let head = st.tree.lock();
        let snaps = st.snaps.read();
        let trees: Vec<&Tree> = snaps.iter().map(|s| &s.tree).chain([&*head]).collect();
        for (k, t) in trees.iter().enumerate() {
            let prev: Vec<&Tree> = k.checked_sub(1).map(|j| trees[j]).into_iter().collect();
            let walked = t.walk_unique(&*self.store, &self.store.cache, &prev, &mut |v| {
                match v {
                    Visit::Node { ptr, .. } | Visit::Data { ptr, .. } => self.store.release(ptr),
                    // Space under an unreadable node leaks until a later import walks it.
                    Visit::Unreadable { .. } => {}
                }
                Ok(())
            });
            if let Err(e) = walked {
                tracing::error!(volume = %st.name, "part of the destroyed volume's space leaks until the pool is imported again: {e}");
            }
        }
    }
}
