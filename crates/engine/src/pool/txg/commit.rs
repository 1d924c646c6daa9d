//! Commit: the one place the in-memory state becomes durable, atomically.
//!
//! 1. Note the sealed segments with no live bytes (free once this commit lands).
//! 2. Write every dirty map node bottom-up (copy-on-write: new places only),
//!    then the volume table, each with `METADATA_COPIES` copies. The dirty
//!    leaves are copied under the map lock and written without it
//!    (`Tree::snapshot_leaves`); writes that change a leaf meanwhile leave it
//!    dirty for the next commit (`Tree::finish_commit`). Every write that
//!    finished before the commit began is in the copy.
//!    The volume's key slots, data keys and rotation cursor are read under
//!    the same lock as its leaves, so the record and the leaves it points to
//!    describe one instant.
//! 3. Flush every device: all data acknowledged so far and all new metadata are durable.
//!    Meanwhile the host's anchor (`format::anchor`) announces generation + 1, synced.
//!    With an object store, the commit is uploaded now (`Tier::publish`), before any
//!    local label names it.
//! 4. Write the superblock, generation + 1, to its slot on every device; flush again.
//!    The anchor is settled at the new generation before anything it holds is answered.
//! 5. Only now release the old table record and the segments of step 1.
//!
//! A crash before step 4 completes leaves the previous superblock, whose
//! records were never overwritten (nothing it references is freed before step
//! 5), so the import finds the last commit whole. A failed flush poisons the
//! pool: durability can no longer be promised.

use std::sync::atomic::Ordering;

use crate::constants::NONCE_RESERVE_STEP;
use crate::map::At;
use crate::pool::core::Core;
use crate::pool::format::superblock::Superblock;
use crate::pool::format::table::{ptr_to_hex, SnapshotRecord, TableRecord, VolumeRecord};
use crate::store::Dead;
use crate::volume::snap;
use crate::{Error, Result};

impl Core {
    pub fn commit(&self) -> Result<()> {
        self.store.check_poisoned()?;
        let _c = self.commit_lock.lock();
        self.commit_held()
    }

    /// `commit`, by a caller that holds the commit lock.
    pub(crate) fn commit_held(&self) -> Result<()> {
        self.store.check_poisoned()?;
        let begun = self.group.begin();
        let result = self.commit_locked();
        match &result {
            // Nothing local names this commit yet: the next one tries again. A flush that
            // arrived before it began must not count on it (`Core::flush`), and the table is
            // left dirty so the background commit retries even when no client writes.
            Err(e @ Error::StoreUnavailable(_)) => {
                self.group.failed(begun);
                self.table_dirty.store(true, Ordering::Release);
                tracing::error!(
                    "commit failed (the pool serves on; the next flush tries again): {e}"
                )
            }
            Err(e) => {
                tracing::error!("commit failed, pool poisoned: {e}");
                self.store.poison_for(e);
            }
            Ok(()) => {}
        }
        // The notes the commit took: durable with it, or (refused by the store, the pool
        // serving on) put back before the newer ones, for the next log flush to write: the
        // map they describe is in no durable commit.
        let taken = std::mem::take(&mut *self.notes_taken.lock());
        if matches!(result, Err(Error::StoreUnavailable(_))) {
            for (v, mut notes) in taken {
                let mut intents = v.intents();
                notes.append(&mut intents);
                *intents = notes;
            }
        }
        self.group.finish();
        // Writers waiting for space re-check now: a commit hands back the room kept for its
        // map nodes even when it frees no segment.
        self.store.wake_space_waiters();
        result
    }

    fn commit_locked(&self) -> Result<()> {
        // Before the empty segments are collected: none of them can be recycled from here on,
        // so none is freed twice, once by a writer and once below after the commit took it.
        let snapshot = self.store.snapshot_map();
        let zero = self.store.zero_sealed_for_commit();
        let cache = self.store.nodes();
        self.table_dirty.store(false, Ordering::Release);
        let volumes: Vec<_> = self.volumes.read().values().cloned().collect();
        let mut records = Vec::with_capacity(volumes.len());
        let started = crate::env::now();
        let mut nodes_written = 0;
        let mut locked = std::time::Duration::ZERO;
        // What this commit's nodes took in the log, for the estimate of the next one's room.
        let mut node_bytes = (0u64, 0u64);
        let mut write = |nodes: &[&crate::map::Node]| {
            let ptrs = self
                .store
                .write_meta_batch(&nodes.iter().map(|n| n.encode()).collect::<Vec<_>>())?;
            node_bytes.0 += ptrs.len() as u64;
            node_bytes.1 += ptrs
                .iter()
                .map(|p| self.store.footprint(p.len as usize) as u64)
                .sum::<u64>();
            Ok(ptrs)
        };
        // The error list is read before any leaves: a client write that replaces a listed
        // block whole clears its entry, and that entry may leave the durable list only with
        // a map that holds the new block (read after, a crash could bring back the bad
        // block with no error listed; read before, an entry outlives its block by at most
        // one commit).
        let errors = self.errors.lock().clone();
        for v in &volumes {
            // The leaves (nearly all dirty nodes) are copied under the map lock and written
            // without it; writers wait only for the copy and for the few nodes above.
            let t = crate::env::now();
            // The volume's keys and rotation cursor are read with the map, under its lock:
            // a block the key rotation rewrote (its cursor is past it) or wrote under a new
            // data key is in these leaves exactly when the record says so. Read later, a
            // cursor could run ahead of the leaves, and after a crash the resumed rotation
            // would skip blocks still under the old key, then destroy that key.
            // (One of those locks at a time, each released before the next: `status` takes
            // them in another order.)
            // A snapshot wanted: this volume's map lock is held from the leaves to the root,
            // so the snapshot is exactly the writes that finished before (`volume::snap`).
            let wanted = v.take_snapshot_wanted();
            let mut whole = wanted.as_ref().map(|_| v.map());
            let mut read = |tree: &crate::map::Tree| {
                // Under the map lock: the client changes noted so far are in these leaves
                // (kept until the commit is durable: `commit_held`).
                let notes = v.take_intents();
                self.notes_taken.lock().push((v.clone(), notes));
                nodes_written += tree.dirty_nodes();
                let slots = v.key_slots().clone();
                let data_keys = v.data_keys().clone();
                let rotation = v.rotation().clone();
                (tree.snapshot_leaves(), slots, data_keys, rotation)
            };
            let (mut leaves, slots, data_keys, rotation) = match &whole {
                Some(tree) => read(tree),
                None => read(&v.map()),
            };
            locked += crate::env::since(t);
            leaves.write(&mut write)?;
            let t = crate::env::now();
            let root = {
                let mut guard;
                let tree = match whole.as_mut() {
                    Some(t) => &mut **t,
                    None => {
                        guard = v.map();
                        &mut *guard
                    }
                };
                let snaps = v.snapshots();
                // Dirty nodes without a dirty leaf: new top levels of a grown map.
                if !leaves.is_empty() || tree.dirty_nodes() > 0 {
                    tree.finish_commit(cache, leaves, &mut write, &mut |l, i, old| {
                        if let Some(dead) =
                            snap::head_drops(&self.store, &snaps, At::Node(l, i), old)
                        {
                            self.store.release(dead)
                        }
                    })?;
                }
                self.store.note_dirty(v.head_dirty(), tree.dirty_nodes());
                tree.root
            };
            if let (Some((name, id)), Some(tree)) = (wanted, whole.take()) {
                debug_assert_eq!(
                    tree.dirty_nodes(),
                    0,
                    "a snapshot's commit writes every node"
                );
                let created = crate::env::system_time()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0);
                v.snapshots_mut().push(snap::Snap {
                    base: false,
                    name,
                    created,
                    holds: Default::default(),
                    referenced: v.used_bytes(),
                    size_bytes: v.size(),
                    tree: crate::map::Tree::new(id, tree.depth, root),
                });
            }
            self.commit_snapshot_trees(v, &mut write)?;
            locked += crate::env::since(t);
            let size_bytes = v.size();
            let snapshots = v
                .snapshots()
                .iter()
                .map(|s| SnapshotRecord::of(s, size_bytes))
                .collect();
            records.push(VolumeRecord {
                id: v.id(),
                uuid: v.uuid(),
                name: v.name().to_string(),
                size_bytes,
                block_size: v.block_size(),
                compression: v.compression(),
                encryption: v.is_encrypted(),
                root: ptr_to_hex(&root),
                slots,
                data_keys,
                rotation,
                snapshots,
                origin: v.origin().clone(),
                deferred: v.is_deferred(),
                description: v.description(),
                readonly: v.is_readonly(),
                created: v.created(),
                thick: v.is_thick(),
            });
        }
        // Every pointer this commit stores has been read: segments opened from now on are
        // the next commit's.
        drop(snapshot);
        // What thick volumes keep from thin ones, recounted with what they now store.
        let unused: u64 = volumes
            .iter()
            .filter(|v| !v.is_deferred())
            .map(|v| v.reservation_unused())
            .sum();
        self.store.set_thick_unused(unused);
        self.estimate_node_bytes(node_bytes.0, node_bytes.1);
        self.note_map_size();
        let next_volume_id = self.sb.lock().next_volume_id;
        let shared = records
            .iter()
            .any(|r| !r.snapshots.is_empty() || r.origin.is_some());
        let resized = records
            .iter()
            .any(|r| r.snapshots.iter().any(|s| s.size_bytes != 0));
        let table = TableRecord {
            format: if resized {
                3
            } else if shared {
                2
            } else {
                1
            },
            next_volume_id,
            volumes: records,
            scrub: self.scrub.lock().clone(),
            errors,
        };
        // The table and the superblock that points to it must carry the same table key: a new
        // key (crypto-erase, end of a rotation) is taken here, under the commit lock, and goes
        // into this commit's superblock below.
        // Taken only once the commit is durable (below): a commit that fails and is tried
        // again must take the same new key.
        let table_key_new = *self.table_key_next.lock();
        let table_key = table_key_new.unwrap_or(self.sb.lock().sb.table_key);
        let nodes_done = crate::env::since(started);
        let table_ptr = self.store.write_meta(&table.seal(&table_key))?;
        crate::crashpoint::hit("commit.nodes_written");

        // The next superblock, from what only commits change (under the commit lock).
        let mut next_sb = self.sb.lock().sb.clone();
        next_sb.generation += 1;
        next_sb.root = table_ptr;
        next_sb.table_key = table_key;
        // The next generation's intent log chain starts at a fresh slot (none when the pool
        // has no room for one: flushes then commit).
        // On the log devices when the pool has working ones (`logdev`): no space to take.
        let logdev = self.logdev.read().clone();
        let dev_head = logdev
            .as_ref()
            .filter(|_| self.intent_log)
            .and_then(|l| l.next_head());
        let log_head = if self.intent_log && dev_head.is_none() {
            self.alloc_log_slot().ok()
        } else {
            None
        };
        next_sb.log_head = log_head;
        // The chain this commit starts is this commit's alone (`Superblock::chain_id`).
        next_sb.chain_id = crate::keys::wrap::random_bytes::<16>();
        next_sb.log_dev_head = dev_head;
        next_sb.log_devices = logdev.as_ref().map(|l| l.named_ids()).unwrap_or_default();
        next_sb.high_water = self.store.high_water();
        let nonce_next = self.store.nonce_next();
        if nonce_next.saturating_add(NONCE_RESERVE_STEP / 2) > next_sb.nonce_reserved {
            next_sb.nonce_reserved = nonce_next.saturating_add(NONCE_RESERVE_STEP);
        }
        // The host learns the generation before any device holds it (`anchor`): a crash in
        // between leaves the devices at the committed one or at this one. The anchor is
        // synced while the devices are (both must be durable before any superblock of the
        // generation is written), so it adds no wait of its own to a commit.
        let point = (
            next_sb.generation,
            crate::pool::format::anchor::digest(&next_sb),
        );
        let mut anchor = self.anchor.lock();
        let announce = crate::pool::format::anchor::Anchor {
            seq: anchor.seq + 1,
            next: point,
            nonce_reserved: anchor.nonce_reserved.max(next_sb.nonce_reserved),
            ..anchor.clone()
        };
        let (devices, anchored) = std::thread::scope(|s| {
            let anchoring = s.spawn(|| crate::pool::format::anchor::write(&self.dir, &announce));
            let devices = self.store.flush_devices();
            (
                devices,
                anchoring.join().expect("the anchor writer does not panic"),
            )
        });
        devices?;
        anchored?;
        crate::crashpoint::hit("commit.flushed");
        // The object store has the commit before any local label names it: a host that
        // crashes here still finds its devices at the store's generation or one before.
        if let Some(t) = &self.tier {
            if let Err(e) = t.publish(&self.store, self.labels(&next_sb), next_sb.generation) {
                // This attempt's table record is named by no local label, and the next
                // commit writes its own: released, or every refused commit would leak
                // one. (A store that took it, the answer lost, names it until the next
                // commit replaces it there; no segment is freed before that one lands.)
                self.store.release(Dead::unlinked(table_ptr));
                return Err(e);
            }
            crate::crashpoint::hit("commit.published");
        }
        let flushed = crate::env::since(started);

        let (old_root, generation) = {
            let mut st = self.sb.lock();
            let old = st.sb.root;
            st.sb = next_sb;
            self.write_superblocks(&st.sb, st.back_region)?;
            // Settled before anything this generation holds is acknowledged (this commit's
            // flush, the intent log blocks of its chain): from here devices put back to
            // the generation before are refused as rolled back. Left announced, the
            // anchor would accept them until the next commit, losing what was flushed in
            // between.
            let settled = crate::pool::format::anchor::Anchor {
                seq: announce.seq + 1,
                committed: point,
                next: (0, [0; 32]),
                ..announce
            };
            crate::pool::format::anchor::write(&self.dir, &settled)?;
            *anchor = settled;
            drop(anchor);
            self.store.set_nonce_limit(st.sb.nonce_reserved);
            (old, st.sb.generation)
        };
        crate::crashpoint::hit("commit.superblocks_written");
        if let Some(k) = table_key_new {
            let mut next = self.table_key_next.lock();
            if *next == Some(k) {
                *next = None;
            }
        }
        self.store.release(Dead::superseded(old_root));
        // The old chain is replaced: its blocks go with the next commit.
        let new_chain = log_head.map(|head| crate::pool::intentlog::block::Chain {
            generation,
            seq: 0,
            next: head,
            after: None,
            slots: vec![crate::pool::intentlog::block::slot_ptr(head)],
        });
        if let Some(l) = &logdev {
            l.committed(generation, dev_head);
        }
        if let Some(old) = std::mem::replace(&mut *self.intent.lock(), new_chain) {
            for p in &old.slots {
                self.store.release(Dead::superseded(*p));
            }
        }
        // Wait out reads that looked up a pointer before this commit. A read waiting for
        // the object store holds them up: the empty segments then stay sealed and the next
        // commit frees them (it finds them again), unless too many commits in a row gave up.
        if !self.store.free_committed(&zero) {
            tracing::debug!(
                segments = zero.len(),
                "empty segments freed by a later commit: a read holds the reuse gate"
            );
        }
        tracing::debug!(
            generation,
            freed_segments = zero.len(),
            map_nodes = nodes_written,
            map_nodes_ms = nodes_done.as_millis() as u64,
            map_locked_ms = locked.as_millis() as u64,
            flush_ms = (flushed - nodes_done).as_millis() as u64,
            "committed"
        );
        Ok(())
    }

    /// Write the snapshot trees' dirty nodes (the cleaner's moves), newest first, whole
    /// under the volume's locks: each node a snapshot drops is released only when neither
    /// neighbour holds it, and going newest first keeps the trees that hold a node in one
    /// unbroken run while it is replaced (`volume::snap`).
    fn commit_snapshot_trees(
        &self,
        v: &crate::volume::VolumeState,
        write: &mut dyn FnMut(&[&crate::map::Node]) -> Result<Vec<crate::map::Blkptr>>,
    ) -> Result<()> {
        if v.snaps_dirty().load(Ordering::Acquire) == 0 {
            return Ok(());
        }
        // Every tree of the volumes this one shares with through clones (the whole clone
        // graph it is part of): a node a snapshot tree drops here is released only when no
        // tree anywhere in it holds the node at that place. Neighbours alone do not
        // suffice across clones: a snapshot with clones is a bridge, and a node it drops
        // may still be held on both sides of it. Other volumes' locks first, then this one's.
        Core::with_trees_of(&self.component(v), |far| -> Result<()> {
            let head = v.map();
            let mut snaps = v.snapshots_mut();
            for k in (0..snaps.len()).rev() {
                if snaps[k].tree.dirty_nodes() == 0 {
                    continue;
                }
                let (before, rest) = snaps.split_at_mut(k);
                let (cur, after) = rest.split_first_mut().expect("k is a snapshot");
                let others: Vec<&crate::map::Tree> = before
                    .iter()
                    .chain(after.iter())
                    .map(|s| &s.tree)
                    .chain([&*head])
                    .chain(far.iter().copied())
                    .collect();
                let mut leaves = cur.tree.snapshot_leaves();
                leaves.write(write)?;
                let mut gone = Vec::new();
                cur.tree
                    .finish_commit(self.store.nodes(), leaves, write, &mut |l, i, old| {
                        gone.extend(self.store.dropped(&others, At::Node(l, i), old));
                    })?;
                for dead in gone {
                    self.store.release(dead);
                }
            }
            Ok(())
        })?;
        self.store.note_dirty(v.snaps_dirty(), 0);
        Ok(())
    }

    /// Tell the anchor the last commit is on the devices (`Pool::close`): with no
    /// generation announced, devices left at the one before it are refused as rolled back.
    pub(crate) fn settle_anchor(&self) -> Result<()> {
        let _c = self.commit_lock.lock();
        let mut anchor = self.anchor.lock();
        let settled = crate::pool::format::anchor::Anchor {
            seq: anchor.seq + 1,
            ..anchor.clone()
        };
        crate::pool::format::anchor::write(&self.dir, &settled)?;
        *anchor = settled;
        Ok(())
    }

    /// The room kept for a commit counts each dirty node at twice the average a node took in
    /// the last commit that wrote any, plus 512 bytes, never more than a whole node: sparse
    /// leaves (a thin volume's) compress to a few hundred bytes, and counting them whole
    /// would keep back from a nearly full pool many times what its commits write. A leaf
    /// grows by one pointer per write, so a commit's nodes are rarely much larger than the
    /// last's; if they are, `SEGMENTS_RESERVED` absorbs it.
    fn estimate_node_bytes(&self, nodes: u64, bytes: u64) {
        if nodes == 0 {
            return;
        }
        let full = self.store.node_record_bytes() as u64;
        let estimate = (bytes.div_ceil(nodes) * 2 + 512).min(full);
        self.store.set_node_bytes(estimate as u32);
    }

    /// Write `sb` (with each member's own identity) to its slots on every device, then flush.
    /// Every member's label for `sb` (what `write_superblocks` writes), for the object store.
    fn labels(&self, sb: &Superblock) -> Vec<Vec<u8>> {
        (0..self.store.members().len())
            .map(|i| {
                Superblock {
                    member_index: i as u32,
                    device_id: sb.member_ids[i],
                    ..sb.clone()
                }
                .encode(Some(&self.sb_key))
            })
            .collect()
    }

    pub(crate) fn write_superblocks(&self, sb: &Superblock, back_region: u64) -> Result<()> {
        let mut written = 0;
        for (i, m) in self.store.members().iter().enumerate() {
            let Some(dev) = m.dev() else { continue };
            if m.faulted.load(Ordering::Relaxed) {
                continue;
            }
            let mine = Superblock {
                member_index: i as u32,
                device_id: sb.member_ids[i],
                ..sb.clone()
            };
            let bytes = mine.encode(Some(&self.sb_key));
            let mut ok = true;
            for off in Superblock::slot_offsets(sb.generation, back_region) {
                if let Err(e) = dev.write_at(&bytes, off) {
                    tracing::error!(device = %m.path().display(), "superblock write failed: {e}");
                    ok = false;
                }
            }
            if ok && dev.flush().is_ok() {
                written += 1;
            } else {
                m.write_errors.fetch_add(1, Ordering::Relaxed);
                m.faulted.store(true, Ordering::Relaxed);
            }
        }
        if written == 0 {
            return Err(Error::Poisoned);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::constants::SEGMENT_BYTES;
    use crate::log::Stream;

    /// A commit with one free segment left and both metadata heads full: its first copies
    /// take the last segment, and the second copies, with no segment to open, go there too.
    /// Before, the commit failed with `NoSpace` and poisoned the pool; at an import (whose
    /// commit opens both heads afresh) the pool could not be imported at all ("the pool is
    /// out of space", `bulwark-live --crash --layout parity`, seeds 2, 4 and 6). Its data
    /// reads back after a close and an import.
    #[test]
    fn a_commit_with_one_free_segment_writes_both_metadata_copies_in_it() {
        use crate::pool::OpenOptions;
        let dir = tempfile::tempdir().unwrap();
        let opts = OpenOptions {
            stepped: true,
            intent_log: false,
            ..OpenOptions::default()
        };
        let pool = crate::pool::test_pool(dir.path(), opts.clone());
        pool.create_volume("v", crate::pool::test_volume(1 << 20), None)
            .unwrap();
        let v = pool.volume("v").unwrap();
        v.write(0, &[7u8; 4096], false).unwrap();
        drop(v);
        let core = pool.core().clone();
        let log = core.store.log_for_tests();
        // Both heads full: a whole segment each (a record never straddles segments, so a
        // run of SEGMENT_BYTES opens a segment and fills it), then every free segment
        // but one taken by the second stream.
        log.alloc(Stream::Meta, SEGMENT_BYTES as usize).unwrap();
        while log.free_segments() > 1 {
            log.alloc(Stream::Meta2, SEGMENT_BYTES as usize).unwrap();
        }
        assert_eq!(log.free_segments(), 1);
        core.commit().expect("a commit with one free segment left");
        assert_eq!(log.free_segments(), 0);
        pool.close().unwrap();
        drop(pool);
        let pool = crate::pool::Pool::open(dir.path(), opts).expect("the pool imports");
        let mut got = vec![0u8; 4096];
        pool.volume("v").unwrap().read(0, &mut got).unwrap();
        assert_eq!(got, vec![7u8; 4096]);
    }
}
