//! Snapshot create and destroy against writers: **a hand-written model of the engine's
//! protocol, not the engine's code.** The protocol lives in `Volume::write` (the map lock,
//! then `snaps` for read, across a batch's sets and its release decisions), in
//! `txg::commit` (a snapshot's commit holds the map lock from the copy of the leaves to the
//! new snapshot's push under `snaps` for write) and in `Core::snapshot_destroy` (the
//! commit lock, the map lock, `snaps` for write across the unique walk and the releases):
//! each is spread through files that reach the whole engine (`Tree`, `Store`, `Core`), so
//! nothing of them is compiled here. What this checks is the lock order and the sharing
//! rule (`volume::snap`: the head releases a record it drops unless the newest snapshot
//! holds it; a destroyed snapshot releases what neither neighbour holds) as the engine
//! plays them, written again over a map of two blocks; a change to those steps in the
//! engine must be made here too by hand.
//!
//! Budget and seeds: `bulwark_modelcheck::check` (`BULWARK_SHUTTLE_ITERATIONS`, default
//! 1000 per scheduler; `BULWARK_SHUTTLE_SEED`; `BULWARK_SHUTTLE_SCHEDULERS`).

use std::collections::HashMap;

use bulwark_modelcheck::check;
use bulwark_modelcheck::sync::{Mutex, RwLock};
use shuttle::sync::Arc;
use shuttle::thread;

/// Blocks in the volume: a client write sets them all under one hold of the map lock (one
/// batch of a request's whole blocks: `Volume::write_blocks_encoded`, up to
/// `BATCH_BYTES_MAX`; a larger request is several batches, each whole to a snapshot).
const BLOCKS: usize = 2;

/// A map: block → record (0: a hole).
type Tree = Vec<u64>;

struct Snap {
    name: u32,
    tree: Tree,
}

struct Model {
    commit_lock: Mutex<()>,
    /// The volume's own map (`VolumeState::tree`).
    head: Mutex<Tree>,
    /// Its snapshots, oldest first (`VolumeState::snaps`).
    snaps: RwLock<Vec<Snap>>,
    /// Record → (the value it holds, live).
    records: Mutex<HashMap<u64, (u64, bool)>>,
    next: Mutex<u64>,
}

impl Model {
    fn new() -> Model {
        Model {
            commit_lock: Mutex::new(()),
            head: Mutex::new(vec![0; BLOCKS]),
            snaps: RwLock::new(Vec::new()),
            records: Mutex::new(HashMap::new()),
            next: Mutex::new(0),
        }
    }

    fn record(&self, value: u64) -> u64 {
        let id = {
            let mut n = self.next.lock();
            *n += 1;
            *n
        };
        self.records.lock().insert(id, (value, true));
        id
    }

    fn release(&self, id: u64) {
        let mut recs = self.records.lock();
        let r = recs.get_mut(&id).expect("released records were written");
        assert!(r.1, "record {id} released twice");
        r.1 = false;
    }

    /// A client write of `value` to every block, one batch (`Volume::write`): new
    /// records, then under the map lock and `snaps` (read) each block set and the record it
    /// dropped released unless the newest snapshot holds it there (`snap::head_drops`, `Store::dropped`),
    /// the releases made once both locks are let go.
    fn write(&self, value: u64) {
        let ids: Vec<u64> = (0..BLOCKS).map(|_| self.record(value)).collect();
        let mut gone = Vec::new();
        {
            let mut head = self.head.lock();
            let snaps = self.snaps.read();
            for (lba, id) in ids.into_iter().enumerate() {
                let old = std::mem::replace(&mut head[lba], id);
                let kept = snaps.last().is_some_and(|s| s.tree[lba] == old);
                if old != 0 && !kept {
                    gone.push(old);
                }
            }
        }
        for id in gone {
            self.release(id);
        }
    }

    /// `snapshot create`: under the commit lock, a commit that holds the map lock from the
    /// copy of the leaves to the push of the new snapshot (`snaps` for write).
    fn snapshot_create(&self, name: u32) {
        let _c = self.commit_lock.lock();
        let head = self.head.lock();
        let tree = head.clone();
        self.snaps.write().push(Snap { name, tree });
        drop(head);
    }

    /// `snapshot destroy`: under the commit lock, the map lock and `snaps` (write), release
    /// what the snapshot holds and neither neighbour does (the older snapshot; the newer
    /// one, or the head), then drop it.
    fn snapshot_destroy(&self, name: u32) {
        let _c = self.commit_lock.lock();
        let head = self.head.lock();
        let mut snaps = self.snaps.write();
        let Some(k) = snaps.iter().position(|s| s.name == name) else {
            return;
        };
        for lba in 0..BLOCKS {
            let p = snaps[k].tree[lba];
            let prev = k.checked_sub(1).map(|j| snaps[j].tree[lba]);
            let next = snaps.get(k + 1).map_or(head[lba], |s| s.tree[lba]);
            if p != 0 && prev != Some(p) && next != p {
                self.release(p);
            }
        }
        snaps.remove(k);
    }

    /// A reader of every snapshot (`snaps` alone): each holds one batch's blocks wholly
    /// (every block the same value), and only live records.
    fn read_snapshots(&self) {
        let snaps = self.snaps.read();
        let recs = self.records.lock();
        for s in snaps.iter() {
            let values: Vec<Option<u64>> = s
                .tree
                .iter()
                .map(|&id| (id != 0).then(|| recs[&id]))
                .map(|r| {
                    r.map(|(v, live)| {
                        assert!(
                            live,
                            "snapshot {} holds a released record: a write released what \
                             the snapshot still held",
                            s.name
                        );
                        v
                    })
                })
                .collect();
            assert!(
                values.iter().all(|v| *v == values[0]),
                "snapshot {} holds parts of two writes ({values:?}): it was taken in the \
                 middle of one",
                s.name
            );
        }
    }

    /// At the end: a record is live exactly when some tree holds it.
    fn check_end(&self) {
        let head = self.head.lock();
        let snaps = self.snaps.read();
        let recs = self.records.lock();
        for (&id, &(_, live)) in recs.iter() {
            let held = head.contains(&id) || snaps.iter().any(|s| s.tree.contains(&id));
            assert_eq!(
                live,
                held,
                "record {id} is {} but {} tree holds it",
                if live { "live" } else { "released" },
                if held { "a" } else { "no" }
            );
        }
    }
}

/// A snapshot holds each concurrent write wholly before or after it (a batch's blocks all
/// or none), a write never releases a record a snapshot still holds, a destroy
/// releases exactly what only its snapshot held, and at the end every record is live
/// exactly when some tree holds it. (A model of the engine's steps: see the file's doc.)
///
/// A writer writes both blocks three times while snapshots a and b are created and a is
/// destroyed, and a reader reads every snapshot.
///
/// Mutations of the model's steps run once (each reverted), as the engine could get them
/// wrong: a snapshot's commit letting the map lock go between the copy of the leaves and
/// the push (without `whole` in `txg::commit`): both schedulers ("snapshot 2 holds a
/// released record: a write released what the snapshot still held", "record 1 released
/// twice"); a writer taking the map lock once per block instead of once per batch: both
/// ("snapshot 2 holds parts of two writes ([Some(2), Some(1)])"); a writer deciding its
/// releases after letting the map lock go (`snaps` read after the sets): the randomized
/// scheduler ("record 1 released twice"; PCT passed 1000).
#[test]
fn a_snapshot_holds_each_write_wholly_and_no_write_releases_what_it_holds() {
    check(|| {
        let m = Arc::new(Model::new());
        m.write(1);
        let snapshots = {
            let m = m.clone();
            thread::spawn(move || {
                m.snapshot_create(1);
                m.snapshot_create(2);
                m.snapshot_destroy(1);
            })
        };
        let writer = {
            let m = m.clone();
            thread::spawn(move || {
                for v in 2..5 {
                    m.write(v);
                }
            })
        };
        m.read_snapshots();
        snapshots.join().unwrap();
        writer.join().unwrap();
        m.read_snapshots();
        m.check_end();
    });
}
