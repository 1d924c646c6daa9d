//! Snapshots: create, destroy, hold and release, roll back, list with their space (split
//! as `zfs list -o space` does); and clones.
//!
//! The sharing rules and the locks are in `volume::snap`; decision 0009 says why
//! sharing is decided by place. Every change here runs under the commit lock and ends
//! with a commit, so a crash leaves either the state before or the state after.
//! Destroying frees, in one step, exactly what the unique walk of the snapshot against
//! its two neighbours finds: the walk runs to its end before anything is released, so
//! an error (a node that cannot be read) leaves everything as it was.
//!
//! A clone is a new volume whose map starts at a snapshot's root, with a base (its own
//! copy of that tree) so that its writers never lock the origin. An encrypted clone has
//! its own uuid, master key and slot, and copies of the origin's data keys with their
//! lineage; the origin moves to a new data key generation at once. An origin destroyed
//! while its snapshots have clones is *deferred*: its own data goes now, the snapshots
//! clones need stay, hidden, until the last clone goes (`reap_deferred`). A clone without
//! snapshots of its own whose rotation has dropped its inherited keys shares nothing with
//! its origin any more and is detached: its base goes (`detach_clone`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::core::Core;
use crate::map::{Blkptr, Tree};
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
        .position(|s| !s.base && s.name == name)
        .ok_or_else(|| Error::NotFound(format!("snapshot '{volume}@{name}' does not exist")))
}

impl Core {
    /// The volumes cloned from `volume@snapshot`.
    pub(crate) fn clones_of(&self, volume: &str, snapshot: &str) -> Vec<Arc<VolumeState>> {
        let want = snap::Origin {
            volume: volume.to_string(),
            snapshot: snapshot.to_string(),
        };
        self.volumes
            .read()
            .values()
            .filter(|v| v.origin().as_ref() == Some(&want))
            .cloned()
            .collect()
    }

    /// `f` over every tree (head and snapshots) of `volumes`, their locks held together:
    /// what a tree of a clone graph drops stays while any tree of the graph holds it at
    /// that place. Callers take these (other volumes') locks before their own volume's.
    pub(crate) fn with_trees_of<R>(
        volumes: &[Arc<VolumeState>],
        f: impl FnOnce(&[&Tree]) -> R,
    ) -> R {
        let heads: Vec<_> = volumes.iter().map(|o| o.map()).collect();
        let lists: Vec<_> = volumes.iter().map(|o| o.snapshots()).collect();
        let trees: Vec<&Tree> = heads
            .iter()
            .map(|h| &**h)
            .chain(lists.iter().flat_map(|l| l.iter().map(|s| &s.tree)))
            .collect();
        f(&trees)
    }

    /// The other volumes of `st`'s clone graph: every volume joined to it by origin links,
    /// up or down, transitively (empty for a volume with no clone relation).
    pub(crate) fn component(&self, st: &VolumeState) -> Vec<Arc<VolumeState>> {
        let all: Vec<Arc<VolumeState>> = self.volumes.read().values().cloned().collect();
        let origin_of: Vec<Option<String>> = all
            .iter()
            .map(|v| v.origin().as_ref().map(|o| o.volume.clone()))
            .collect();
        let mut names = vec![st.name().to_string()];
        let mut i = 0;
        while i < names.len() {
            let n = names[i].clone();
            for (v, o) in all.iter().zip(&origin_of) {
                let joined = o.as_deref() == Some(n.as_str()) || (v.name() == n && o.is_some());
                let next = if o.as_deref() == Some(n.as_str()) {
                    v.name().to_string()
                } else if joined {
                    o.clone().expect("joined through its origin")
                } else {
                    continue;
                };
                if !names.contains(&next) {
                    names.push(next);
                }
            }
            i += 1;
        }
        all.into_iter()
            .filter(|v| v.name() != st.name() && names.iter().any(|n| n == v.name()))
            .collect()
    }

    /// The trees of other volumes that share places with snapshot `s` of `st`: the origin
    /// snapshot and the other clones' bases, when `s` is a clone's base; the bases of its
    /// clones, when it has clones.
    /// As (volume, index in its snapshot list). A drop from `s` must also check these;
    /// the caller holds the commit lock and may read-lock their snapshot lists (their
    /// writers only ever read-lock them, under their own map lock).
    pub(crate) fn across(&self, st: &VolumeState, s: &Snap) -> Vec<(Arc<VolumeState>, usize)> {
        let bases = |volume: &str, snapshot: &str| -> Vec<(Arc<VolumeState>, usize)> {
            self.clones_of(volume, snapshot)
                .into_iter()
                .filter(|c| !std::ptr::eq(&**c, st))
                .filter(|c| c.snapshots().first().is_some_and(|b| b.base))
                .map(|c| (c, 0))
                .collect()
        };
        if s.base {
            // The origin snapshot, and the bases of its other clones (copies of it too).
            let Some(o) = st.origin().clone() else {
                return Vec::new();
            };
            let Some(ov) = self.find_any(&o.volume) else {
                return Vec::new();
            };
            let k = ov
                .snapshots()
                .iter()
                .position(|t| !t.base && t.name == o.snapshot);
            let mut out: Vec<(Arc<VolumeState>, usize)> = k.map(|k| (ov, k)).into_iter().collect();
            out.extend(bases(&o.volume, &o.snapshot));
            return out;
        }
        bases(st.name(), &s.name)
    }

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
            let snaps = st.snapshots();
            if snaps.iter().any(|s| !s.base && s.name == name) {
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
        st.want_snapshot(name.to_string(), id);
        self.table_dirty.store(true, Ordering::Release);
        let committed = self.commit_held();
        // A commit that failed before it reached this volume leaves the wish behind.
        st.take_snapshot_wanted();
        committed?;
        if !st.snapshots().iter().any(|s| s.name == name) {
            return Err(Error::Corrupt(format!(
                "snapshot '{volume}@{name}' was not taken by the commit"
            )));
        }
        tracing::info!(volume, snapshot = name, "snapshot created");
        Ok(())
    }

    /// Why snapshot `volume@{s.name}` may not be destroyed now, if it may not: it has
    /// clones, or holds. Changes nothing: callers that destroy several snapshots ask this
    /// of every one before they destroy the first.
    fn check_destroyable(&self, volume: &str, s: &snap::Snap) -> Result<()> {
        let clones: Vec<String> = self
            .clones_of(volume, &s.name)
            .iter()
            .map(|c| c.name().to_string())
            .collect();
        if !clones.is_empty() {
            return Err(Error::Busy(format!(
                "snapshot '{volume}@{}' has clones ({}); destroy them first, or make them \
                 independent ('bulwark key rotate CLONE' re-encrypts what they inherited)",
                s.name,
                clones.join(", ")
            )));
        }
        if !s.holds.is_empty() {
            let tags: Vec<&str> = s.holds.iter().map(String::as_str).collect();
            return Err(Error::Busy(format!(
                "snapshot '{volume}@{}' is held ({}); release the holds first \
                 ('bulwark snapshot release {volume}@{} TAG')",
                s.name,
                tags.join(", "),
                s.name
            )));
        }
        Ok(())
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
        self.check_destroyable(volume, &snaps[k])?;
        let (gone, bytes) = {
            let prev = k.checked_sub(1).map(|j| &snaps[j].tree);
            let next = snap::next_of(snaps, head, k);
            let others: Vec<&Tree> = prev.into_iter().chain([next]).collect();
            self.store.unique_to(&snaps[k].tree, &others).map_err(|e| {
                e.within(format!("destroying snapshot '{volume}@{}'", snaps[k].name))
            })?
        };
        for dead in gone {
            self.store.release(dead);
        }
        snaps.remove(k);
        Ok(bytes)
    }

    /// Destroy snapshot `volume@name`; returns the data bytes it freed (its `used`).
    pub fn snapshot_destroy(&self, volume: &str, name: &str) -> Result<u64> {
        self.store.check_poisoned()?;
        let _c = self.commit_lock.lock();
        let st = self.find(volume)?;
        position(&st.snapshots(), volume, name)?;
        // Snapshot trees are clean after a commit (the cleaner, which dirties them, waits
        // for the commit lock).
        self.commit_held()?;
        let freed = {
            let head = st.map();
            let mut snaps = st.snapshots_mut();
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
            let _head = st.map();
            let mut snaps = st.snapshots_mut();
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
        let st = self.find(volume)?;
        // Handles on its snapshots may stay open: the snapshots that stay do not change.
        let _w = self.quiesce_for_change(&st)?;
        let _c = self.commit_lock.lock();
        if st.rotation().is_some() {
            return Err(Error::Busy(format!(
                "volume '{volume}' is rotating its key; roll back after the rotation finishes"
            )));
        }
        self.check_rollback(volume, name, destroy_newer, &st.snapshots())?;
        // The head is clean after this commit: nothing writes a volume with no handle,
        // and the cleaner waits for the commit lock.
        self.commit_held()?;
        let new_id = self.next_tree_id();
        let destroyed = {
            let mut head = st.map();
            let mut snaps = st.snapshots_mut();
            let k = position(&snaps, volume, name)?;
            for s in &snaps[k + 1..] {
                self.check_destroyable(volume, s)?;
            }
            // Everything that goes is found before anything is released, so a map node
            // that cannot be read stops the rollback with the volume as it was. What goes
            // is what the newer snapshots and the head hold and the target does not; a
            // record held by several of them (always by a run of neighbours) is counted
            // at the newest tree of its run, where the next tree up no longer holds it.
            let mut gone = Vec::new();
            for j in k + 1..snaps.len() {
                let next = snap::next_of(&snaps, &head, j);
                let (g, _) = self
                    .store
                    .unique_to(&snaps[j].tree, &[&snaps[k].tree, next])
                    .map_err(|e| {
                        e.within(format!("destroying snapshot '{volume}@{}'", snaps[j].name))
                    })?;
                gone.extend(g);
            }
            let (g, _) = self
                .store
                .unique_to(&head, &[&snaps[k].tree])
                .map_err(|e| e.within(format!("rolling '{volume}' back")))?;
            gone.extend(g);
            // Newest first, as they used to go one by one.
            let destroyed: Vec<String> = snaps.drain(k + 1..).rev().map(|s| s.name).collect();
            for dead in gone {
                self.store.release(dead);
            }
            let target = &snaps[k];
            // A fresh id: the node cache keys nodes by tree and place, not by address.
            *head = Tree::new(new_id, target.tree.depth, target.tree.root);
            // The size it had at the snapshot comes back with its data.
            st.set_size(target.size_bytes);
            st.set_used_bytes(target.referenced);
            self.store.note_dirty(st.head_dirty(), 0);
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

    /// Whether `volume` may roll back to snapshot `name` (with `destroy_newer`), every
    /// snapshot that would go checked before the first goes: a refusal changes nothing (a
    /// newer snapshot with clones used to be found after the ones above it were already
    /// destroyed).
    fn check_rollback(
        &self,
        volume: &str,
        name: &str,
        destroy_newer: bool,
        snaps: &[Snap],
    ) -> Result<()> {
        let k = position(snaps, volume, name)?;
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
        for s in &snaps[k + 1..] {
            self.check_destroyable(volume, s).map_err(|e| match e {
                Error::Busy(m) => Error::Busy(format!("{m}; nothing was rolled back or destroyed")),
                e => e,
            })?;
        }
        Ok(())
    }

    fn volumes_named(&self, volume: Option<&str>) -> Result<Vec<Arc<VolumeState>>> {
        Ok(match volume {
            Some(v) => vec![self.find(v)?],
            None => self
                .volumes
                .read()
                .values()
                .filter(|v| !v.is_deferred())
                .cloned()
                .collect(),
        })
    }

    /// How many snapshots each volume has, by volume name: what `snapshot_list` would
    /// count, without walking any tree (for metrics, read at every scrape).
    pub fn snapshot_counts(&self) -> Vec<(String, usize)> {
        self.volumes
            .read()
            .values()
            .filter(|v| !v.is_deferred())
            .map(|v| {
                let n = v.snapshots().iter().filter(|s| !s.base).count();
                (v.name().to_string(), n)
            })
            .collect()
    }

    /// Every snapshot of `volume` (or of every volume), oldest first per volume, with the
    /// bytes each alone holds.
    pub fn snapshot_list(&self, volume: Option<&str>) -> Result<Vec<SnapshotStatus>> {
        let mut out = Vec::new();
        for st in self.volumes_named(volume)? {
            let head = st.map();
            let snaps = st.snapshots();
            for (k, s) in snaps.iter().enumerate().filter(|(_, s)| !s.base) {
                let prev = k.checked_sub(1).map(|j| &snaps[j].tree);
                let next = snap::next_of(&snaps, &head, k);
                let others: Vec<&Tree> = prev.into_iter().chain([next]).collect();
                let used =
                    snap::unique_data_bytes(&*self.store, self.store.nodes(), &s.tree, &others)?;
                out.push(SnapshotStatus {
                    name: format!("{}@{}", st.name(), s.name),
                    volume: st.name().to_string(),
                    snapshot: s.name.clone(),
                    created: s.created,
                    used_bytes: used,
                    referenced_bytes: s.referenced,
                    holds: s.holds.iter().cloned().collect(),
                    size_bytes: s.size_bytes,
                });
            }
        }
        Ok(out)
    }

    /// The space of `volume` (or of every volume) split as `zfs list -o space` does.
    pub fn volume_space(&self, volume: Option<&str>) -> Result<Vec<VolumeSpace>> {
        let mut out = Vec::new();
        for st in self.volumes_named(volume)? {
            let head = st.map();
            let snaps = st.snapshots();
            let referenced = st.used_bytes();
            // A clone's USED is what destroying it frees (issue 42): not what its base
            // (the origin's snapshot) holds, which stays.
            let base = snaps.first().filter(|s| s.base).map(|s| &s.tree);
            let mut by_snapshots = 0;
            for (k, s) in snaps.iter().enumerate().filter(|(_, s)| !s.base) {
                let others: Vec<&Tree> = [snap::next_of(&snaps, &head, k)]
                    .into_iter()
                    .chain(base)
                    .collect();
                by_snapshots +=
                    snap::unique_data_bytes(&*self.store, self.store.nodes(), &s.tree, &others)?;
            }
            let own = match base {
                Some(b) => snap::unique_data_bytes(&*self.store, self.store.nodes(), &head, &[b])?,
                None => referenced,
            };
            let written = match snaps.last() {
                Some(s) => {
                    snap::unique_data_bytes(&*self.store, self.store.nodes(), &head, &[&s.tree])?
                }
                None => referenced,
            };
            out.push(VolumeSpace {
                name: st.name().to_string(),
                used_bytes: own + by_snapshots,
                referenced_bytes: referenced,
                used_by_snapshots_bytes: by_snapshots,
                written_bytes: written,
                snapshots: snaps.iter().filter(|s| !s.base).count(),
            });
        }
        Ok(out)
    }

    /// Clone `volume@name` as volume `new`: instant (one commit, no data written). An
    /// encrypted clone gets its own uuid, master key and slot under `secret`, and opens with
    /// that alone: it holds copies of the origin's data keys (all of its generations, which
    /// seal what it shares with the origin) wrapped under its own master key, and writes
    /// under a generation of its own. The origin moves to a new generation at once, so no
    /// data key is ever written by two volumes. The origin's key must be loaded.
    pub fn volume_clone(
        &self,
        volume: &str,
        name: &str,
        new: &str,
        secret: Option<&crate::keys::Secret>,
    ) -> Result<()> {
        self.store.check_poisoned()?;
        super::core::validate_name(new)?;
        let _c = self.commit_lock.lock();
        let st = self.find(volume)?;
        position(&st.snapshots(), volume, name)?;
        if let Some(e) = self.name_taken(new) {
            return Err(e);
        }
        match (st.is_encrypted(), secret.is_some()) {
            (true, false) => {
                return Err(Error::Invalid(format!(
                    "'{volume}@{name}' is encrypted: its clone needs a key file or passphrase \
                     file of its own"
                )))
            }
            (false, true) => {
                return Err(Error::Invalid(format!(
                    "'{volume}@{name}' is not encrypted: a clone of it would read its \
                     unauthenticated blocks; import the image encrypted (image import \
                     --key-file) and clone that, or clone with --encryption off"
                )))
            }
            _ => {}
        }
        if st.rotation().is_some() {
            return Err(Error::Busy(format!(
                "volume '{volume}' is rotating its key; clone it after the rotation finishes"
            )));
        }
        let (uuid, salt) = (
            crate::keys::wrap::random_bytes::<16>(),
            self.store.run_salt(),
        );
        // Keys: the origin's generations inherited, one new generation each.
        let keys = match secret {
            None => None,
            Some(secret) => {
                let (from_vmk, ouid) = (st.vmk_or_locked()?, st.uuid());
                let origin_keys = st.data_keys().clone();
                let next_gen = crate::keys::ring::next_generation(&origin_keys, volume)?;
                let mut k = crate::keys::ring::new_volume_keys(secret, &uuid, salt)?;
                let mut data_keys = Vec::with_capacity(origin_keys.len() + 1);
                for r in &origin_keys {
                    data_keys.push(crate::keys::ring::inherit(
                        &from_vmk, &ouid, r, &k.vmk, &uuid,
                    )?);
                }
                data_keys.push(crate::keys::ring::new_data_key(&k.vmk, &uuid, next_gen));
                k.ring = crate::keys::ring::KeyRing::open(&k.vmk, &uuid, &data_keys, salt)?;
                k.data_keys = data_keys;
                // The origin writes under a new generation of its own from now on.
                let mut ok = st.data_keys();
                ok.push(crate::keys::ring::new_data_key(&from_vmk, &ouid, next_gen));
                let ring = crate::keys::ring::KeyRing::open(&from_vmk, &ouid, &ok, salt)?;
                if !st.set_key_ring(ring) {
                    ok.pop();
                    return Err(st.locked());
                }
                Some(k)
            }
        };
        // The snapshot trees are clean after a commit.
        self.commit_held()?;
        let (head_id, base_id) = (self.next_tree_id(), self.next_tree_id());
        let (base, used, opts) = {
            let snaps = st.snapshots();
            let k = position(&snaps, volume, name)?;
            let s = &snaps[k];
            let base = Snap {
                name: format!("{volume}@{name}"),
                base: true,
                created: s.created,
                holds: Default::default(),
                referenced: s.referenced,
                size_bytes: s.size_bytes,
                tree: Tree::new(base_id, s.tree.depth, s.tree.root),
            };
            let opts = crate::volume::VolumeOptions {
                size_bytes: s.size_bytes,
                block_size: st.block_size(),
                compression: st.compression(),
                encryption: st.is_encrypted(),
            };
            (base, s.referenced, opts)
        };
        let (slots, data_keys) = keys
            .as_ref()
            .map(|k| (k.slots.clone(), k.data_keys.clone()))
            .unwrap_or_default();
        let head = Tree::new(head_id, base.tree.depth, base.tree.root);
        let clone = VolumeState::new(
            head_id,
            uuid,
            new.to_string(),
            &opts,
            slots,
            data_keys,
            head,
        );
        if let Some(k) = keys {
            clone.open_keys(k.ring, k.vmk);
        }
        clone.set_used_bytes(used);
        clone.set_created(crate::volume::now_secs());
        *clone.origin() = Some(snap::Origin {
            volume: volume.to_string(),
            snapshot: name.to_string(),
        });
        clone.snapshots_mut().push(base);
        self.volumes
            .write()
            .insert(new.to_string(), Arc::new(clone));
        self.table_dirty.store(true, Ordering::Release);
        self.commit_held()?;
        tracing::info!(volume = new, origin = %format!("{volume}@{name}"), "clone created");
        Ok(())
    }

    /// After a rotation of clone `st` finished and dropped its inherited keys: it shares
    /// nothing with its origin any more (every block it holds is under its own key, so
    /// every leaf and node above it was written anew), unless its own snapshots still do.
    /// Then its base goes (what only the base held is released) and it has no origin.
    pub(crate) fn detach_clone(&self, st: &VolumeState) -> Result<()> {
        let _c = self.commit_lock.lock();
        // Destroyed meanwhile (a rotation's worker finishing as `volume destroy` ran): the
        // destroy released what the clone held alone, and the clone is out of the pool, so
        // its clone graph would come out empty and the base's every record, the origin
        // snapshot's too, would be released (`an_independent_clone_destroyed_as_its_
        // rotation_finishes_leaves_the_origin_whole`).
        if st.is_destroyed() || st.origin().is_none() || st.snapshots().iter().any(|s| !s.base) {
            return Ok(());
        }
        self.commit_held()?;
        {
            let head = st.map();
            let snaps = st.snapshots();
            let Some(base) = snaps.first().filter(|b| b.base) else {
                return Ok(());
            };
            // Nothing the head holds may still be the base's.
            let mut all = 0u64;
            head.walk_unique(&*self.store, self.store.nodes(), &[], &mut |_| {
                all += 1;
                Ok(())
            })?;
            let mut own = 0u64;
            head.walk_unique(&*self.store, self.store.nodes(), &[&base.tree], &mut |_| {
                own += 1;
                Ok(())
            })?;
            if all != own {
                tracing::info!(volume = %st.name(), shared = all - own, "clone still shares records with its origin");
                return Ok(());
            }
        }
        self.release_family_base(st)?;
        self.reap_deferred()?;
        self.table_dirty.store(true, Ordering::Release);
        self.commit_held()?;
        tracing::info!(volume = %st.name(), "clone shares nothing with its origin any more: detached");
        Ok(())
    }

    /// Destroy `st` as far as its snapshots' clones allow (caller: `destroy_volume`, with
    /// the commit lock): its own data and every snapshot without clones go now; the
    /// snapshots with clones stay, hidden, and the volume is marked deferred.
    pub(crate) fn defer_destroy(&self, st: &VolumeState) -> Result<()> {
        self.commit_held()?;
        let new_id = self.next_tree_id();
        let mut head = st.map();
        let mut snaps = st.snapshots_mut();
        for k in (0..snaps.len()).rev() {
            if !snaps[k].base && self.clones_of(st.name(), &snaps[k].name).is_empty() {
                self.destroy_at(st.name(), &mut snaps, &head, k)?;
            }
        }
        let last = snaps.last().map(|s| &s.tree);
        let (gone, _) = self
            .store
            .unique_to(&head, &last.into_iter().collect::<Vec<_>>())?;
        for dead in gone {
            self.store.release(dead);
        }
        *head = Tree::new(new_id, head.depth, Blkptr::HOLE);
        st.set_used_bytes(0);
        self.store.note_dirty(st.head_dirty(), 0);
        st.set_deferred(true);
        Ok(())
    }

    /// Let deferred volumes go as far as their clones allow: each snapshot no clone needs
    /// any more is destroyed, and a volume left with none is removed. Caller holds the
    /// commit lock and commits after.
    pub(crate) fn reap_deferred(&self) -> Result<()> {
        let deferred: Vec<Arc<VolumeState>> = self
            .volumes
            .read()
            .values()
            .filter(|v| v.is_deferred())
            .cloned()
            .collect();
        for st in deferred {
            let empty = {
                let head = st.map();
                let mut snaps = st.snapshots_mut();
                for k in (0..snaps.len()).rev() {
                    if !snaps[k].base && self.clones_of(st.name(), &snaps[k].name).is_empty() {
                        self.destroy_at(st.name(), &mut snaps, &head, k)?;
                    }
                }
                !snaps.iter().any(|s| !s.base)
            };
            if empty {
                self.release_family(&st);
                self.store.note_dirty(st.head_dirty(), 0);
                self.store.note_dirty(st.snaps_dirty(), 0);
                self.volumes.write().remove(st.name());
                st.mark_destroyed();
                tracing::info!(volume = %st.name(), "destroyed volume's last clone went: its snapshots are freed");
            }
        }
        Ok(())
    }

    /// A read-only handle on `volume@name` (its key must be loaded, as for the volume).
    pub fn snapshot_handle(self: &Arc<Self>, volume: &str, name: &str) -> Result<Arc<Volume>> {
        self.store.check_poisoned()?;
        let st = self.find(volume)?;
        if st.is_encrypted() && !st.key_loaded() {
            return Err(st.locked());
        }
        position(&st.snapshots(), volume, name)?;
        Ok(Arc::new(Volume::snapshot_view(
            self.store.clone(),
            self.clone(),
            st,
            name,
        )))
    }

    /// Drop a detached clone's base: release what only it holds (not shared with the
    /// origin), then forget the origin.
    ///
    /// What the base shares may be held by any tree of the clone graph, not only by the
    /// origin snapshot: the bases of clones of the origin's other snapshots are copies of
    /// trees that shared places with it, and keep sharing them after a rotation or the
    /// cleaner gave the origin's own trees new nodes there (sim seed 710054: a leaf the
    /// bases of two clones of two snapshots still shared was released by the first
    /// detach, and again when the other base's copy was rewritten).
    fn release_family_base(&self, st: &VolumeState) -> Result<()> {
        let origin_found = match st.snapshots().first() {
            Some(b) if b.base => !self.across(st, b).is_empty(),
            _ => false,
        };
        if !origin_found {
            return Err(Error::Corrupt(format!(
                "clone '{}' has a base but its origin snapshot is gone",
                st.name()
            )));
        }
        Core::with_trees_of(&self.component(st), |far| {
            let head = st.map();
            let mut snaps = st.snapshots_mut();
            if !snaps.first().is_some_and(|b| b.base) {
                return Ok(());
            }
            // The origin snapshot is one of them: with none, every record of the base
            // would count as the base's alone.
            if far.is_empty() {
                return Err(Error::Corrupt(format!(
                    "clone '{}': its origin's trees were not found; its base is kept",
                    st.name()
                )));
            }
            let (gone, _) = self.store.unique_to(&snaps[0].tree, far)?;
            for dead in gone {
                self.store.release(dead);
            }
            drop(head);
            snaps.remove(0);
            *st.origin() = None;
            Ok(())
        })
    }

    /// Release every record of `st`'s snapshots and map (its destruction), each once:
    /// every tree is walked against the one before it, so a shared record is found only
    /// in the oldest tree that holds it.
    pub(crate) fn release_family(&self, st: &VolumeState) {
        // What the base shares with any tree of the other volumes of its clone graph (the
        // origin snapshot, sibling and nephew clones) stays.
        let component = if st.snapshots().first().is_some_and(|b| b.base) {
            self.component(st)
        } else {
            Vec::new()
        };
        Core::with_trees_of(&component, |far| {
            let origin_tree = (!far.is_empty()).then_some(());
            let head = st.map();
            let snaps = st.snapshots();
            let trees: Vec<&Tree> = snaps.iter().map(|s| &s.tree).chain([&*head]).collect();
            for (k, t) in trees.iter().enumerate() {
                let prev: Vec<&Tree> = match k.checked_sub(1) {
                    Some(j) => vec![trees[j]],
                    // A clone's base: what it shares with the origin stays.
                    None if snaps.first().is_some_and(|b| b.base) => {
                        if origin_tree.is_none() {
                            tracing::error!(volume = %st.name(), "the origin snapshot is gone; keeping what the clone's base holds");
                            continue;
                        }
                        far.to_vec()
                    }
                    None => vec![],
                };
                // Space under an unreadable node leaks until a later import walks it.
                if let Err(e) = self.store.walk_unique_dead(t, &prev) {
                    tracing::error!(volume = %st.name(), "part of the destroyed volume's space leaks until the pool is imported again: {e}");
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::map::At;
    use crate::pool::{test_pool, OpenOptions};
    use crate::volume::{Compression, VolumeOptions};

    /// The rules of `store::dies` on a volume with a snapshot: what the head drops dies
    /// only when the snapshot does not hold it, and what a snapshot holds alone is what its
    /// destroy would release.
    #[test]
    fn a_record_dies_only_when_no_neighbouring_tree_holds_it() {
        let dir = tempfile::tempdir().unwrap();
        let pool = test_pool(dir.path(), OpenOptions::default());
        let opts = VolumeOptions {
            size_bytes: 1 << 20,
            block_size: 4096,
            compression: Compression::Off,
            encryption: false,
        };
        pool.create_volume("v", opts, None).unwrap();
        let vol = pool.volume("v").unwrap();
        vol.write(0, &[1; 4096], false).unwrap();
        vol.write(4096, &[2; 4096], false).unwrap();
        let a = vol.debug_block_ptr(0).unwrap();
        let shared = vol.debug_block_ptr(1).unwrap();
        pool.snapshot_create("v", "s").unwrap();
        vol.write(0, &[3; 4096], false).unwrap();
        let b = vol.debug_block_ptr(0).unwrap();
        assert_ne!(a, b);

        let core = pool.core();
        let st = core.find("v").unwrap();
        let head = st.map();
        let snaps = st.snapshots();
        let s = &snaps[0].tree;
        let store = &core.store;
        // The head dropped `a`; the snapshot holds it there: not dead.
        assert!(store.dropped(&[s], At::Data(0), &a).is_none());
        // Without the snapshot it would be; and a record held elsewhere is not held here.
        assert_eq!(
            store.dropped(&[], At::Data(0), &a).map(|d| *d.ptr()),
            Some(a)
        );
        assert!(store.dropped(&[s], At::Data(1), &a).is_some());
        // A hole never dies.
        assert!(store
            .dropped(&[], At::Data(2), &crate::map::Blkptr::HOLE)
            .is_none());
        // The snapshot goes: `a` is its alone (with the map nodes above it), `shared` and
        // `b` are not.
        let (gone, bytes) = store.unique_to(s, &[&*head]).unwrap();
        let ptrs: Vec<_> = gone.iter().map(|d| *d.ptr()).collect();
        assert!(ptrs.contains(&a), "{ptrs:?}");
        assert!(!ptrs.contains(&shared) && !ptrs.contains(&b), "{ptrs:?}");
        assert_eq!(bytes, a.len as u64);
        // `unique_to` only decides: nothing was released, the snapshot still reads it.
        drop((head, snaps));
        let mut buf = [0; 4096];
        pool.volume("v@s").unwrap().read(0, &mut buf).unwrap();
        assert_eq!(buf, [1; 4096]);
    }
}
