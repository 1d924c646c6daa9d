//! Writer against the cleaner's move: the engine's `pool::relocate` (compiled against
//! shuttle by `bulwark-modelcheck`) driven by shuttle threads playing client writers, a
//! client reader and the cleaner, under the randomized and the PCT schedulers.
//!
//! The parts the threads play are the engine's own steps in its own order, over a model
//! of what lies around them: a volume's map of a few blocks behind one lock (the volume's
//! `tree` lock), and records, each with the value it holds and whether it is still live
//! (not yet released):
//! - a write is `Volume::write`'s part: a new record, the map pointed at it under the map
//!   lock, then the record it replaced released (outside the lock); a trim points the
//!   block at a hole the same way;
//! - a read looks its block up under the map lock and checks the record it finds is live
//!   and holds a value that block was given;
//! - the cleaner is `clean`'s `move_records`: which blocks point where, looked up under
//!   the map lock; the records read and copied elsewhere with the lock released (a copy
//!   holds its record's value at a new address); then `relocate::swap_where_held`, the
//!   engine's code, with the model's map and releases behind `Relocation`.
//!
//! Budget and seeds: `bulwark_modelcheck::check` (`BULWARK_SHUTTLE_ITERATIONS`, default
//! 1000 per scheduler; `BULWARK_SHUTTLE_SEED`; `BULWARK_SHUTTLE_SCHEDULERS`).

use std::collections::HashMap;

use bulwark_modelcheck::check;
use bulwark_modelcheck::relocate::{swap_where_held, Relocation};
use bulwark_modelcheck::sync::Mutex as MapLock;
use bulwark_modelcheck::Result;
use shuttle::sync::{Arc, Mutex};
use shuttle::thread;

/// Where a record lies; `None` in the map is a hole.
type Ptr = Option<u64>;

/// A record: the value its bytes hold, and whether it is live (released: its space may be
/// taken again, so no map may point at it).
struct Record {
    value: u64,
    live: bool,
}

struct Model {
    /// The volume's map: block → the address of its record.
    map: MapLock<Vec<Ptr>>,
    records: Mutex<HashMap<u64, Record>>,
    /// The values each block was given by writes, in order (`0`: a trim).
    given: Mutex<Vec<Vec<u64>>>,
    next_addr: Mutex<u64>,
}

impl Model {
    fn new(blocks: usize) -> Model {
        Model {
            map: MapLock::new(vec![None; blocks]),
            records: Mutex::new(HashMap::new()),
            given: Mutex::new(vec![Vec::new(); blocks]),
            next_addr: Mutex::new(0),
        }
    }

    /// A new live record holding `value`: its address.
    fn record(&self, value: u64) -> u64 {
        let addr = {
            let mut a = self.next_addr.lock().unwrap();
            *a += 1;
            *a
        };
        let rec = Record { value, live: true };
        self.records.lock().unwrap().insert(addr, rec);
        addr
    }

    /// `Store::release`: a record is released once.
    fn release(&self, ptr: &Ptr) {
        let Some(addr) = ptr else { return };
        let mut recs = self.records.lock().unwrap();
        let rec = recs.get_mut(addr).expect("a record released was written");
        assert!(rec.live, "record at {addr} released twice");
        rec.live = false;
    }

    /// A client write of `value` to block `lba` (`0`: a trim).
    fn write(&self, lba: usize, value: u64) {
        let new = (value != 0).then(|| self.record(value));
        self.given.lock().unwrap()[lba].push(value);
        let old = std::mem::replace(&mut self.map.lock()[lba], new);
        self.release(&old);
    }

    /// A client read of block `lba`: the record the map points at is live and holds a value
    /// the block was given.
    fn read(&self, lba: usize) {
        let map = self.map.lock();
        let Some(addr) = map[lba] else { return };
        let recs = self.records.lock().unwrap();
        let rec = &recs[&addr];
        assert!(
            rec.live,
            "block {lba} points at record {addr}, which was released: its space may hold \
             another record's bytes"
        );
        assert!(
            self.given.lock().unwrap()[lba].contains(&rec.value),
            "block {lba} reads {}, a value it was never given",
            rec.value
        );
    }

    /// A cleaning pass over every block (`move_records`, one batch).
    fn clean(&self) {
        // Under the map lock: what each block holds now (the walk and `move_records`' look
        // under the reuse gate), and the values read (the records stay readable under the
        // gate until read).
        let seen: Vec<(u64, Ptr, u64)> = {
            let map = self.map.lock();
            let recs = self.records.lock().unwrap();
            map.iter()
                .enumerate()
                .filter_map(|(lba, p)| p.map(|a| (lba as u64, Some(a), recs[&a].value)))
                .collect()
        };
        // The lock released: each record copied to a new address (`Store::put`).
        let moves: Vec<(u64, Ptr, Ptr)> = seen
            .into_iter()
            .map(|(lba, old, value)| (lba, old, Some(self.record(value))))
            .collect();
        let (map, moved) = swap_where_held(self, &self.map, &moves);
        drop(map);
        moved.expect("the model's map does not fail");
    }

    /// After every thread: each block holds the last value written to it, and a record is
    /// live exactly when the map points at it (none leaked, none released under the map).
    fn check_end(&self) {
        let map = self.map.lock();
        let recs = self.records.lock().unwrap();
        let given = self.given.lock().unwrap();
        for (lba, p) in map.iter().enumerate() {
            let last = given[lba].last().copied().unwrap_or(0);
            let value = p.map_or(0, |a| recs[&a].value);
            assert_eq!(
                value, last,
                "block {lba} holds {value} at the end, but the last write to it wrote {last}: \
                 a cleaner's move undid a newer write"
            );
        }
        for (addr, rec) in recs.iter() {
            let held = map.contains(&Some(*addr));
            assert_eq!(
                rec.live,
                held,
                "record {addr} is {} but the map {} it: {}",
                if rec.live { "live" } else { "released" },
                if held {
                    "points at"
                } else {
                    "does not point at"
                },
                if held {
                    "a block reads released space"
                } else {
                    "its space leaked"
                }
            );
        }
    }
}

/// The model as the engine's `relocate` sees it: the map is the vector behind `map`,
/// releases are the model's.
impl Relocation for Model {
    type Map = Vec<Ptr>;
    type Ptr = Ptr;

    fn lookup(&self, map: &Vec<Ptr>, lba: u64) -> Result<Ptr> {
        Ok(map[lba as usize])
    }

    fn set(&self, map: &mut Vec<Ptr>, lba: u64, ptr: Ptr) -> Result<()> {
        map[lba as usize] = ptr;
        Ok(())
    }

    fn swapped(&self, _map: &Vec<Ptr>, _lba: u64, old: &Ptr, _new: &Ptr) {
        self.release(old);
    }

    fn not_swapped(&self, new: &Ptr) {
        self.release(new);
    }
}

/// A cleaner's move never undoes a newer write: at the end each block holds the last value
/// written to it, a read never finds a block pointing at a released record, and every
/// record is released exactly once unless a block still points at it (no double release,
/// no leak). `swap_where_held` looks each block up and sets it under one hold of the map
/// lock the writers take, and swaps only where the block still points at the old copy.
///
/// Three blocks are written; then one writer overwrites block 0 twice and trims block 2,
/// another overwrites block 1 and reads block 0, while the cleaner moves all three.
///
/// Mutations run once (each reverted), each caught by both schedulers at the default
/// budget: the swap without its `now != old` check (the cleaner's copy put in whatever the
/// block points at): "record at 1 released twice" (the writer released the record it
/// replaced, and the swap released it again: the writer's record was lost under the
/// cleaner's copy); the lookup and the set under two holds of the map lock (the check
/// made, the lock let go and taken again to set): "record at 3 released twice".
#[test]
fn a_cleaner_move_never_undoes_a_newer_write() {
    check(|| {
        let m = Arc::new(Model::new(3));
        m.write(0, 1);
        m.write(1, 2);
        m.write(2, 3);
        let cleaner = {
            let m = m.clone();
            thread::spawn(move || m.clean())
        };
        let writer = {
            let m = m.clone();
            thread::spawn(move || {
                m.write(0, 4);
                m.write(2, 0);
                m.write(0, 5);
            })
        };
        m.write(1, 6);
        m.read(0);
        m.read(2);
        cleaner.join().unwrap();
        writer.join().unwrap();
        m.check_end();
    });
}
