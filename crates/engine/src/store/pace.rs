//! Pacing client writes to the local cache of a pool in an object store (issue 22 part 5,
//! `--object-store-cache-size`).
//!
//! Room comes back only once the store holds a segment: the maintenance thread commits
//! (uploading what was written), then gives back segments past the cache's size. A writer
//! faster than the upload would fill the devices far past the size asked for, with bytes
//! no other host can read yet. So past a cap (the size and one wake interval more) a
//! client write waits for the maintenance thread's next pass, as a ZFS writer waits for
//! its transaction group: the writers go at the store's pace.
//!
//! A write never waits for nothing: not while the last pass could not give room back
//! (its commit failed: a store outage stalls uploads, and the devices are the durable
//! copy until it ends; or nothing more can be given back: devices that cannot punch
//! holes, or a cache smaller than the metadata), not while the pool closes, and never
//! past `WRITE_WAIT_MAX` in all (a store that hangs: the writers after it go on at once
//! until a pass ends). Then the devices pass the cap for a while (they hold the pool
//! anyway).
//!
//! Cheap when under the cap: the local size is the devices' allocated bytes as of the
//! last pass plus the bytes noted written since (an upper bound: a reused segment does
//! not grow the files); only past the cap is it measured again (`fstat` per member).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

/// The longest a client write waits for room in all (then it goes on past the cap).
pub const WRITE_WAIT_MAX: Duration = Duration::from_secs(10);

/// One wait for the maintenance thread's pass; the local size is measured again after.
const WAIT_SLICE: Duration = Duration::from_millis(50);

/// The cache's pacing state (all zero: no cache, nothing paced).
#[derive(Default)]
pub struct Pace {
    /// Wake the maintenance thread every this many bytes written (0: no cache).
    wake_every: AtomicU64,
    written_since_wake: AtomicU64,
    /// Client writes wait while the devices take more than this (0: never).
    cap: AtomicU64,
    /// The devices' allocated bytes at the last measure, and bytes written since.
    measured: AtomicU64,
    written_since_measure: AtomicU64,
    /// The last commit failed (the store is out of reach): waiting would not help.
    stalled: AtomicBool,
    /// Client writes that waited for room, and how long in all (nanoseconds).
    waited_writes: AtomicU64,
    waited_ns: AtomicU64,
    /// Writes that waited `WRITE_WAIT_MAX` and went on.
    gave_up: AtomicU64,
    /// Bumped and notified at the end of each maintenance pass.
    passes: Mutex<u64>,
    pass_done: Condvar,
}

/// What `Pace::wait_for_room` needs of the data plane.
pub trait Room {
    /// The devices' allocated bytes now.
    fn allocated(&self) -> u64;
    /// Ask the maintenance thread for a pass (commit, give back).
    fn wake(&self);
    /// The pool is closing or poisoned: no pass will come.
    fn gone(&self) -> bool;
}

/// Writes that waited for room, for status and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PaceCounts {
    pub waited_writes: u64,
    pub waited_seconds: f64,
    /// Of those, writes that waited `WRITE_WAIT_MAX` and went on.
    pub gave_up: u64,
}

impl Pace {
    /// A cache of `limit` bytes: the maintenance thread is woken every eighth of it (at
    /// least 8 MiB), and client writes wait past the limit and one such interval.
    pub fn set_limit(&self, limit: u64, allocated_now: u64) {
        let every = (limit / 8).max(8 << 20);
        self.wake_every.store(every, Ordering::Relaxed);
        self.measured.store(allocated_now, Ordering::Relaxed);
        self.written_since_measure.store(0, Ordering::Relaxed);
        self.cap.store(limit + every, Ordering::Relaxed);
    }

    /// The cap client writes wait at (0: none).
    pub fn cap(&self) -> u64 {
        self.cap.load(Ordering::Relaxed)
    }

    /// `len` bytes written: true when the maintenance thread should be woken.
    pub fn note_written(&self, len: u64) -> bool {
        let every = self.wake_every.load(Ordering::Relaxed);
        if every == 0 {
            return false;
        }
        self.written_since_measure.fetch_add(len, Ordering::Relaxed);
        if self.written_since_wake.fetch_add(len, Ordering::Relaxed) + len >= every {
            self.written_since_wake.store(0, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// The end of a maintenance pass: the devices measured again, `stalled` when its
    /// commit failed; waiting writers look again.
    pub fn pass_done(&self, allocated_now: u64, stalled: bool) {
        if self.cap() == 0 {
            return;
        }
        self.measured.store(allocated_now, Ordering::Relaxed);
        self.written_since_measure.store(0, Ordering::Relaxed);
        self.stalled.store(stalled, Ordering::Relaxed);
        *self.passes.lock() += 1;
        self.pass_done.notify_all();
    }

    /// A client write's wait: while the devices take more than the cap, wake the
    /// maintenance thread and wait for its passes (see the module docs for when it stops
    /// waiting). Returns at once under the cap.
    pub fn wait_for_room(&self, room: &dyn Room) {
        let cap = self.cap();
        if cap == 0 {
            return;
        }
        let estimate = self.measured.load(Ordering::Relaxed)
            + self.written_since_measure.load(Ordering::Relaxed);
        if estimate <= cap || self.stalled.load(Ordering::Relaxed) {
            return;
        }
        let over = |pace: &Pace| {
            let now = room.allocated();
            pace.measured.store(now, Ordering::Relaxed);
            pace.written_since_measure.store(0, Ordering::Relaxed);
            now > cap
        };
        if !over(self) {
            return;
        }
        let start = crate::env::now();
        while !self.stalled.load(Ordering::Relaxed) && !room.gone() {
            if crate::env::since(start) >= WRITE_WAIT_MAX {
                tracing::warn!(
                    cap,
                    "local cache: a write waited {}s for the object store to take room back; \
                     going on past the cache's size",
                    WRITE_WAIT_MAX.as_secs()
                );
                // A pass that takes this long (a store that hangs rather than fails) makes
                // the writers after this one go on at once, until a pass ends.
                self.stalled.store(true, Ordering::Relaxed);
                self.gave_up.fetch_add(1, Ordering::Relaxed);
                break;
            }
            room.wake();
            let mut passes = self.passes.lock();
            let seen = *passes;
            self.pass_done
                .wait_while_for(&mut passes, |p| *p == seen, WAIT_SLICE);
            drop(passes);
            if !over(self) {
                break;
            }
        }
        self.waited_writes.fetch_add(1, Ordering::Relaxed);
        self.waited_ns.fetch_add(
            crate::env::since(start).as_nanos() as u64,
            Ordering::Relaxed,
        );
    }

    pub fn counts(&self) -> PaceCounts {
        PaceCounts {
            waited_writes: self.waited_writes.load(Ordering::Relaxed),
            waited_seconds: self.waited_ns.load(Ordering::Relaxed) as f64 / 1e9,
            gave_up: self.gave_up.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    /// Devices whose size a test sets, and a count of wake-ups.
    #[derive(Default)]
    struct Fake {
        allocated: AtomicU64,
        wakes: AtomicU64,
        gone: AtomicBool,
    }

    impl Room for Fake {
        fn allocated(&self) -> u64 {
            self.allocated.load(Ordering::SeqCst)
        }
        fn wake(&self) {
            self.wakes.fetch_add(1, Ordering::SeqCst);
        }
        fn gone(&self) -> bool {
            self.gone.load(Ordering::SeqCst)
        }
    }

    const MIB: u64 = 1 << 20;

    /// A 16 MiB cache (a 24 MiB cap) whose devices take 40 MiB.
    fn over_the_cap() -> (Arc<Pace>, Arc<Fake>) {
        let pace = Arc::new(Pace::default());
        let fake = Arc::new(Fake::default());
        pace.set_limit(16 * MIB, 0);
        fake.allocated.store(40 * MIB, Ordering::SeqCst);
        pace.note_written(40 * MIB);
        (pace, fake)
    }

    /// A client write on a thread of its own.
    fn spawn_writer(pace: &Arc<Pace>, fake: &Arc<Fake>) -> std::thread::JoinHandle<()> {
        let (pace, fake) = (pace.clone(), fake.clone());
        std::thread::spawn(move || pace.wait_for_room(&*fake))
    }

    #[test]
    fn no_cache_never_waits_and_under_the_cap_measures_nothing() {
        let pace = Pace::default();
        let fake = Fake::default();
        fake.allocated.store(u64::MAX, Ordering::SeqCst);
        pace.wait_for_room(&fake);
        assert!(!pace.note_written(1 << 40));
        assert_eq!(pace.counts(), PaceCounts::default());

        pace.set_limit(64 * MIB, 10 * MIB);
        assert_eq!(pace.cap(), 72 * MIB);
        // Under the cap by the estimate: no measure, no wait.
        assert!(!pace.note_written(8 * MIB - 1));
        pace.wait_for_room(&fake);
        assert_eq!(fake.wakes.load(Ordering::SeqCst), 0);
        assert_eq!(pace.counts().waited_writes, 0);
        // Every eighth of the limit written wakes the maintenance thread once.
        assert!(pace.note_written(1));
        assert!(!pace.note_written(MIB));
    }

    #[test]
    fn past_the_cap_a_write_waits_until_a_pass_gives_room_back() {
        let (pace, fake) = over_the_cap();
        let writer = spawn_writer(&pace, &fake);
        // The writer wakes the maintenance thread and keeps waiting while passes leave
        // the devices over the cap.
        while fake.wakes.load(Ordering::SeqCst) < 3 {
            pace.pass_done(40 * MIB, false);
            std::thread::yield_now();
        }
        assert!(!writer.is_finished(), "a write went on past the cap");
        fake.allocated.store(20 * MIB, Ordering::SeqCst);
        pace.pass_done(20 * MIB, false);
        writer.join().unwrap();
        assert_eq!(pace.counts().waited_writes, 1);
        // Now under the cap: the next write does not wait.
        let wakes = fake.wakes.load(Ordering::SeqCst);
        pace.wait_for_room(&*fake);
        assert_eq!(fake.wakes.load(Ordering::SeqCst), wakes);
        assert_eq!(pace.counts().waited_writes, 1);
    }

    #[test]
    fn a_stalled_store_or_a_closing_pool_lets_writes_go_on() {
        let (pace, fake) = over_the_cap();
        let writer = spawn_writer(&pace, &fake);
        while fake.wakes.load(Ordering::SeqCst) < 2 {
            std::thread::yield_now();
        }
        // The pass's commit failed: the store takes nothing, waiting cannot help.
        pace.pass_done(40 * MIB, true);
        writer.join().unwrap();
        pace.wait_for_room(&*fake);
        assert_eq!(
            pace.counts().waited_writes,
            1,
            "a stalled store paced a write"
        );

        // The store answers again; the pool closes while a writer waits.
        pace.pass_done(40 * MIB, false);
        let writer = spawn_writer(&pace, &fake);
        while fake.wakes.load(Ordering::SeqCst) < 4 {
            std::thread::yield_now();
        }
        fake.gone.store(true, Ordering::SeqCst);
        writer.join().unwrap();
        assert_eq!(pace.counts().waited_writes, 2);
    }
}
