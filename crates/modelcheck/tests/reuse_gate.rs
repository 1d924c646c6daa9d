//! Reader against segment reuse, and commit against recycling: the engine's `log` and
//! `store::gate` (compiled against shuttle by `bulwark-modelcheck`) driven by shuttle
//! threads playing a client reader, a client writer and the commit, under the randomized
//! and the PCT schedulers.
//!
//! The parts the threads play are the engine's own steps in its own order, over a model of
//! what lies around them: a map of a few blocks (one lock, as `Tree` behind the volume's
//! map lock), a disk that remembers which record's bytes each address holds, and records
//! of whole segments (each write opens a segment and seals the one before, so a few
//! writes reach every state a segment has):
//! - a write is `Store::put` and `Volume::write`: `Log::alloc_run`, the device write, the
//!   map pointed at the record, then, outside the map lock, `ReuseGate::release` of the
//!   record it replaced and `ReuseGate::recycle_if_due`;
//! - a read is `Volume::read_block`: `ReuseGate::read` held from before the map lookup
//!   until the bytes are checked against the pointer (the checksum);
//! - a commit is `Core::commit_locked`'s part in it: `Log::begin_snapshot`,
//!   `Log::zero_sealed_for_commit`, the map copied under its lock, `Log::end_snapshot`, the
//!   writes and syncs, the superblock durable, then `ReuseGate::free_committed`; under a
//!   commit lock, and a writer that finds no room commits (back-pressure).
//!
//! Budget: `BULWARK_SHUTTLE_ITERATIONS` schedules per scheduler and test (default 1000;
//! each test runs the randomized scheduler and PCT, both seeded: `bulwark_modelcheck::check`).
//! A failure prints the schedule that replays it (`shuttle::replay`).

use std::collections::{HashMap, HashSet};

use bulwark_modelcheck::check;
use bulwark_modelcheck::constants::{RECYCLE_BATCH_SEGMENTS, SEGMENT_BYTES};
use bulwark_modelcheck::gate::ReuseGate;
use bulwark_modelcheck::log::{segment_of, Log, Stream};
use shuttle::sync::{Arc, Mutex};
use shuttle::thread;

/// Segments in the model's pool: enough for the recycle batch twice over, above the
/// floors client data may not take (`Log::reserve`).
const SEGMENTS: usize = 3 * RECYCLE_BATCH_SEGMENTS;

/// A block pointer, as far as these protocols care: where the record lies, and which
/// record it is (its checksum: bytes of any other record there fail it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ptr {
    addr: u64,
    id: u64,
}

struct Model {
    log: Log,
    gate: ReuseGate,
    /// Which record's bytes each address holds.
    disk: Mutex<HashMap<u64, u64>>,
    /// The volume's map: block → pointer.
    map: Mutex<Vec<Option<Ptr>>>,
    /// Segments named by the maps of the last durable commit and of the one being
    /// written: a crash now finds one of them, and reads their records.
    named: Mutex<Vec<(u64, HashSet<u32>)>>,
    /// The commit lock, and commits begun.
    commit_lock: Mutex<u64>,
}

impl Model {
    fn new(blocks: usize) -> Model {
        Model {
            log: Log::new(vec![0; SEGMENTS], 0, true),
            gate: ReuseGate::new(),
            disk: Mutex::new(HashMap::new()),
            map: Mutex::new(vec![None; blocks]),
            named: Mutex::new(Vec::new()),
            commit_lock: Mutex::new(0),
        }
    }

    /// A client write of record `id` to block `lba` (`Store::put`, `Volume::write`).
    fn write(&self, lba: usize, id: u64) {
        let len = SEGMENT_BYTES as usize;
        // Back-pressure (`Store::wait_for`): no room until a commit frees some (segments
        // emptied while a commit's snapshot was under way wait for the next one).
        let (addr, n) = loop {
            match self.log.alloc_run(Stream::Data, &[len]) {
                Ok(placed) => break placed,
                Err(bulwark_modelcheck::Error::NoSpace) => self.commit(),
                Err(e) => panic!("{e}"),
            }
        };
        let mut pending = self.log.pending();
        pending.add(n);
        // Property 2: a segment is opened only when no commit a crash could find names it.
        if addr % SEGMENT_BYTES == 0 {
            let seg = segment_of(addr);
            for (commit, segs) in self.named.lock().unwrap().iter() {
                assert!(
                    !segs.contains(&seg),
                    "segment {seg} opened for new records while commit {commit}, which a \
                     crash may find, still points into it"
                );
            }
        }
        self.disk.lock().unwrap().insert(addr, id);
        let old = self.map.lock().unwrap()[lba].replace(Ptr { addr, id });
        drop(pending);
        if let Some(old) = old {
            self.gate.release(&self.log, old.addr, len as u32);
        }
        self.gate.recycle_if_due(&self.log, false);
    }

    /// A client read of block `lba` (`Volume::read_block`).
    fn read(&self, lba: usize) {
        let _gate = self.gate.read();
        let Some(ptr) = self.map.lock().unwrap()[lba] else {
            return;
        };
        let got = self.disk.lock().unwrap().get(&ptr.addr).copied();
        // Property 1: the bytes a read finds at its pointer are the pointer's record.
        assert_eq!(
            got,
            Some(ptr.id),
            "a read of block {lba} looked up record {} at {:#x} and found another record's \
             bytes there: its segment was freed and written again under the read",
            ptr.id,
            ptr.addr
        );
    }

    /// A commit (`Core::commit`, under the commit lock; `commit_locked`'s part in segment
    /// reuse).
    fn commit(&self) {
        let mut commits = self.commit_lock.lock().unwrap();
        *commits += 1;
        let n = *commits;
        self.log.begin_snapshot();
        let zero = self.log.zero_sealed_for_commit();
        let segs: HashSet<u32> = self
            .map
            .lock()
            .unwrap()
            .iter()
            .flatten()
            .map(|p| segment_of(p.addr))
            .collect();
        self.named.lock().unwrap().push((n, segs));
        self.log.end_snapshot();
        // (Map nodes and the volume table written, devices synced: nothing the protocol
        // shares. No `yield_now` here: PCT lowers a thread that yields, which would hide
        // the schedules where the commit runs on while a reader waits.)
        // The superblock is durable: older commits are no longer found by a crash.
        self.named.lock().unwrap().retain(|(k, _)| *k >= n);
        self.gate.free_committed(&self.log, &zero, false);
    }
}

/// A read that looked up its pointer before a commit freed the segment it points into
/// never finds there the bytes of a record written after the segment was reused: the
/// commit frees only after the reuse gate drained every read under way
/// (`ReuseGate::free_committed`, `drain`).
///
/// Block 0's record lies in a segment an earlier commit saw (so only a commit frees it);
/// a writer overwrites block 0 and then block 1, whose record may land in that very
/// segment once a commit freed it; a reader reads block 0 meanwhile.
///
/// Mutation run once (caught by PCT at the default budget, not by the randomized
/// scheduler, which almost never holds a reader back for the few dozen steps a commit and
/// a write take): `ReuseGate::drain` not waiting for readers (its
/// `drop(self.lock.write())` on the local path deleted): "a read of block 0 looked up
/// record 1 at 0x0 and found another record's bytes there".
#[test]
fn a_read_never_finds_a_segment_a_commit_freed_written_again_under_it() {
    check(|| {
        let m = Arc::new(Model::new(2));
        m.write(0, 1);
        m.write(1, 2);
        m.commit();
        let reader = {
            let m = m.clone();
            thread::spawn(move || {
                m.read(0);
                m.read(0);
            })
        };
        m.write(0, 3);
        m.commit();
        m.write(1, 4);
        reader.join().unwrap();
        m.read(0);
        m.read(1);
    });
}

/// A read that looked up its pointer before a writer recycled the segment it points into
/// (a segment no commit saw, emptied and freed without one: decision 0007) never finds
/// there the bytes of a record written after the segment was reused: the writer frees the
/// batch only after the reuse gate drained every read under way (`recycle_if_due`).
///
/// Blocks 0..31 are written and 0..30 overwritten, so a batch less one of recyclable
/// segments waits, and block 31's record lies in the segment the next allocation takes
/// once the batch is freed (the most recently freed first). The writer overwrites block
/// 31 (the batch is full: it recycles) and block 0 (into block 31's old segment) while a
/// reader reads block 31.
///
/// Mutation run once (caught by PCT, not by the randomized scheduler): the same `drain`
/// that does not wait: "a read of block 31 looked up record 32 at 0x1f00000 and found
/// another record's bytes there".
#[test]
fn a_read_never_finds_a_recycled_segment_written_again_under_it() {
    check(|| {
        let batch = RECYCLE_BATCH_SEGMENTS;
        let m = Arc::new(Model::new(batch));
        for lba in 0..batch {
            m.write(lba, lba as u64 + 1);
        }
        for lba in 0..batch - 1 {
            m.write(lba, (batch + lba) as u64 + 1);
        }
        let last = batch - 1;
        let reader = {
            let m = m.clone();
            thread::spawn(move || {
                m.read(last);
                m.read(last);
            })
        };
        m.write(last, 1000);
        m.write(0, 1001);
        reader.join().unwrap();
        m.read(last);
        m.read(0);
    });
}

/// No segment a commit's map points into is opened for new records before a later commit
/// is durable, whatever a commit's snapshot meets: a writer recycling segments on its own
/// (decision 0007) recycles only segments opened after the last snapshot and emptied
/// before the next begins (`Log`'s epochs: `begin_snapshot`, `end_snapshot`, `born`,
/// `in_this_epoch`, `recycle`'s check that no commit began). A crash after that commit
/// would otherwise find its map pointing at another record's bytes.
///
/// A writer overwrites two blocks in turn, three recycle batches of times, while a commit
/// runs at any point among them (and a reader reads: the drain mutation above is caught
/// here too, by PCT).
///
/// Mutation run once (caught by the randomized scheduler, not by PCT): `alloc_run`
/// stamping a segment opened during a commit's snapshot with the epoch after it
/// (`(self.epoch.load(..) + 1) & !1` for `born`): "segment 2 opened for new records while
/// commit 1, which a crash may find, still points into it". Not caught: `Log::recycle`
/// without its check that no commit began since `take_recyclable` (the harm needs a
/// segment recycled, reopened, named by that commit's snapshot, emptied and sealed again
/// before the commit frees it: deeper than these schedules go).
#[test]
fn no_segment_a_commit_names_is_reused_before_a_later_commit_is_durable() {
    check(|| {
        let m = Arc::new(Model::new(2));
        m.write(0, 1);
        m.write(1, 2);
        let committer = {
            let m = m.clone();
            thread::spawn(move || m.commit())
        };
        let reader = {
            let m = m.clone();
            thread::spawn(move || {
                m.read(0);
                m.read(1);
            })
        };
        let writes = 3 * RECYCLE_BATCH_SEGMENTS as u64;
        for k in 0..writes {
            m.write((k % 2) as usize, 3 + k);
        }
        committer.join().unwrap();
        reader.join().unwrap();
    });
}
