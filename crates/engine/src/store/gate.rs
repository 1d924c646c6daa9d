//! The reuse gate: a segment freed for reuse is never overwritten under a read that may
//! still read it.
//!
//! Every read of a record (client reads, the cleaner's and the scrub's) read-holds the gate
//! from before it looks its pointer up in a map until the bytes it read are verified
//! (`ReuseGate::read`). Whoever frees segments (a writer recycling segments no commit saw,
//! `recycle_if_due`; a commit freeing those its durable superblock no longer names,
//! `free_committed`; the local cache giving segments back, `pool::evict`) does so only after
//! the map stopped pointing into them (their live count is zero), and only after write-holding
//! the gate once (`drain`): every read that could have looked up a pointer into them has
//! then finished, and every later one finds the map's new pointer. A freer that cannot wait
//! (a read waits for the object store, `GATE_WAIT` passed) frees nothing: the segments stay
//! sealed and empty, and a later commit finds and frees them.
//!
//! This module and `log` are the code `crates/modelcheck` checks under shuttle
//! (`crate::sync`), against readers, writers and commits on threads of its own.

use crate::constants::{GATE_WAIT, GATE_WAIT_DEFERRALS_MAX};
use crate::log::{Emptied, Log};
use crate::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use crate::sync::{RwLock, RwLockReadGuard};

pub struct ReuseGate {
    /// Read-held by every read of a block from the time its pointer is looked up until its
    /// bytes are verified, and write-held only while freed segments become reusable.
    lock: RwLock<()>,
    /// A batch of recyclable segments is waiting (`recycle_if_due`).
    recycle_due: AtomicBool,
    /// Reads from the object store under way (`drain` does not wait for them).
    remote_in_flight: AtomicUsize,
    /// Commits in a row that did not free their empty segments because a read held the
    /// gate past `GATE_WAIT` (one waiting for the object store).
    deferrals: AtomicU64,
}

impl Default for ReuseGate {
    fn default() -> Self {
        ReuseGate::new()
    }
}

impl ReuseGate {
    pub fn new() -> ReuseGate {
        ReuseGate {
            lock: RwLock::new(()),
            recycle_due: AtomicBool::new(false),
            remote_in_flight: AtomicUsize::new(0),
            deferrals: AtomicU64::new(0),
        }
    }

    /// Held by a read from before it looks a pointer up until the bytes it read verified.
    pub fn read(&self) -> RwLockReadGuard<'_, ()> {
        self.lock.read()
    }

    /// `f` is a read from the object store: counted as under way while it runs, so that a
    /// freer does not wait for it past `GATE_WAIT` (`drain`).
    pub fn remote_read<R>(&self, f: impl FnOnce() -> R) -> R {
        self.remote_in_flight.fetch_add(1, Ordering::AcqRel);
        let r = f();
        self.remote_in_flight.fetch_sub(1, Ordering::AcqRel);
        r
    }

    /// Give `len` footprint bytes at `addr` back to `log` (the map no longer points at
    /// them). Answers whether a commit is worth waking for (`Emptied::Commit`); a batch of
    /// recyclable segments is noted for the next `recycle_if_due`.
    pub fn release(&self, log: &Log, addr: u64, len: u32) -> bool {
        match log.release_bytes(addr, len) {
            Emptied::Nothing => false,
            Emptied::Commit => true,
            Emptied::Recycle => {
                self.recycle_due.store(true, Ordering::Release);
                false
            }
        }
    }

    /// Free the recyclable segments (`log` module docs) if a batch is waiting. Called by
    /// writers after they released what they replaced, holding no map lock and not the
    /// gate: it waits out every read that looked up a pointer before the segments emptied.
    /// `remote`: the pool reads from an object store (`drain`).
    pub fn recycle_if_due(&self, log: &Log, remote: bool) {
        if !self.recycle_due.swap(false, Ordering::AcqRel) {
            return;
        }
        let (segs, epoch) = log.take_recyclable();
        if segs.is_empty() {
            return;
        }
        // A read held up by the object store: the segments stay sealed and empty, and the
        // next commit frees them.
        if !self.drain(false, remote) {
            return;
        }
        log.recycle(&segs, epoch);
    }

    /// After a commit's superblocks are durable: free `zero` (the segments it collected,
    /// empty before it began) once every read that looked up a pointer before this call
    /// has finished. A read waiting for the object store holds them up: they then stay
    /// sealed and the next commit frees them (it finds them again), unless too many commits
    /// in a row gave up (`GATE_WAIT_DEFERRALS_MAX`), when this one waits. False when it
    /// gave up.
    pub fn free_committed(&self, log: &Log, zero: &[u32], remote: bool) -> bool {
        let patient = self.deferrals.load(Ordering::Relaxed) >= GATE_WAIT_DEFERRALS_MAX;
        if self.drain(patient, remote) {
            self.deferrals.store(0, Ordering::Relaxed);
            log.release(zero);
            true
        } else {
            self.deferrals.fetch_add(1, Ordering::Relaxed);
            false
        }
    }

    /// Commits in a row that gave up waiting for reads (`free_committed`).
    pub fn deferrals(&self) -> u64 {
        self.deferrals.load(Ordering::Relaxed)
    }

    /// Wait out every read that looked up a pointer before the call (the gate, write-held
    /// once). With an object store (`remote`) a read may be waiting for it (up to its
    /// deadline): unless `patient`, when the gate is not free within `GATE_WAIT` and a read
    /// from the store is under way, give up and answer false (new readers queue behind a
    /// waiting writer, so waiting on would stall every read). Long local reads are waited
    /// out.
    pub fn drain(&self, patient: bool, remote: bool) -> bool {
        if patient || !remote {
            drop(self.lock.write());
            return true;
        }
        if self.lock.try_write_for(GATE_WAIT).is_some() {
            return true;
        }
        if self.remote_in_flight.load(Ordering::Acquire) > 0 {
            return false;
        }
        drop(self.lock.write());
        true
    }
}
