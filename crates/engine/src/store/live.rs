//! The live-address check: a record's life as the store sees it, kept apart from the log's
//! live byte counts so that a mistake in those counts (a record released twice, or bytes
//! placed over a record still referenced) is caught where it happens, naming the address,
//! its segment and the callers, instead of surfacing later as a wrong count or lost data.
//!
//! Every copy `Store::put` (and `place_log_block`) places is added, keyed by its address,
//! with its footprint and the caller that placed it; every copy `Store::release` gives back
//! is removed and remembered as released, with its caller, until bytes are placed over it
//! again. It panics on:
//! - a release of an address released before in this run and not placed since (a double
//!   release), naming both callers;
//! - a release whose footprint is not the one placed there;
//! - a placement overlapping a record placed in this run and still live.
//!
//! It survives import by checking only what this run did: the records an import found
//! were counted by the recount's walk, not placed here, so their first release is taken
//! on trust (and remembered), and a second one is caught like any other. A placement over
//! such a record is not caught here (the log's live counts and segment states keep that).
//!
//! Off unless switched on (`OpenOptions::check_addresses`: on in debug builds, and in the
//! simulator's runs in release): it takes a lock at every put and release, and memory for
//! every record placed or released in the run, which a daemon should not pay. A runtime
//! switch rather than `#[cfg(debug_assertions)]` alone, because the project's tests and the
//! simulator run in release builds, where a debug-only check would never bite. Switched on
//! before the store places anything; off, each put and release pays one relaxed load.

use std::collections::BTreeMap;
use std::panic::Location;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use crate::constants::SEGMENT_BYTES;

/// A record placed in this run and not released since: its footprint, and who placed it.
#[derive(Clone, Copy)]
struct Placed {
    footprint: u64,
    by: &'static Location<'static>,
}

#[derive(Default)]
struct Addresses {
    /// Records placed and still live, by address.
    live: BTreeMap<u64, Placed>,
    /// Addresses released and not placed over since, with who released them.
    released: BTreeMap<u64, &'static Location<'static>>,
}

/// The set (see the module's doc); empty and unused until `switch_on`.
#[derive(Default)]
pub(super) struct LiveAddresses {
    on: AtomicBool,
    set: Mutex<Addresses>,
}

fn seg(addr: u64) -> u64 {
    addr / SEGMENT_BYTES
}

impl LiveAddresses {
    /// Check from now on (before anything is placed).
    pub(super) fn switch_on(&self) {
        self.on.store(true, Ordering::Relaxed);
    }

    pub(super) fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// A copy of `footprint` bytes was placed at `addr` by `by`'s call.
    pub(super) fn placed(&self, addr: u64, footprint: u64, by: &'static Location<'static>) {
        if !self.is_on() {
            return;
        }
        let mut s = self.set.lock();
        let end = addr + footprint;
        // The record that starts last below `end`: the only one that can overlap, since
        // live records do not overlap each other.
        if let Some((&a, p)) = s.live.range(..end).next_back() {
            assert!(
                a + p.footprint <= addr,
                "live-address check: {by} placed {footprint} bytes at {addr} (segment {}, \
                 offset {}) over the live record at {a} ({} bytes) that {} placed",
                seg(addr),
                addr % SEGMENT_BYTES,
                p.footprint,
                p.by
            );
        }
        let over: Vec<u64> = s.released.range(addr..end).map(|(&a, _)| a).collect();
        for a in over {
            s.released.remove(&a);
        }
        s.live.insert(addr, Placed { footprint, by });
    }

    /// The copy at `addr` of `footprint` bytes is given back by `by`'s call.
    pub(super) fn released(&self, addr: u64, footprint: u64, by: &'static Location<'static>) {
        if !self.is_on() {
            return;
        }
        let mut s = self.set.lock();
        if let Some(first) = s.released.get(&addr) {
            panic!(
                "live-address check: {by} released the record at {addr} (segment {}, offset \
                 {}, {footprint} bytes), which {first} released already (a double release)",
                seg(addr),
                addr % SEGMENT_BYTES
            );
        }
        if let Some(p) = s.live.remove(&addr) {
            assert!(
                p.footprint == footprint,
                "live-address check: {by} released {footprint} bytes at {addr} (segment {}, \
                 offset {}), where {} placed {} bytes",
                seg(addr),
                addr % SEGMENT_BYTES,
                p.by,
                p.footprint
            );
        }
        // Not placed in this run: a record the import found, released for the first time.
        s.released.insert(addr, by);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on() -> LiveAddresses {
        let l = LiveAddresses::default();
        l.switch_on();
        l
    }

    fn message(f: impl FnOnce() + std::panic::UnwindSafe) -> String {
        let e = std::panic::catch_unwind(f).expect_err("the check did not fire");
        e.downcast_ref::<String>().cloned().unwrap_or_default()
    }

    #[test]
    fn a_double_release_names_the_address_segment_and_both_callers() {
        let l = on();
        let addr = 3 * SEGMENT_BYTES + 4096;
        l.placed(addr, 512, Location::caller());
        l.released(addr, 512, Location::caller());
        let m = message(std::panic::AssertUnwindSafe(|| {
            l.released(addr, 512, Location::caller())
        }));
        assert!(m.contains("double release"), "{m}");
        assert!(
            m.contains(&format!("at {addr} (segment 3, offset 4096")),
            "{m}"
        );
        assert!(m.contains("live.rs"), "the callers are named: {m}");
    }

    #[test]
    fn an_imported_record_may_be_released_once_not_twice() {
        let l = on();
        l.released(SEGMENT_BYTES, 64, Location::caller());
        let m = message(std::panic::AssertUnwindSafe(|| {
            l.released(SEGMENT_BYTES, 64, Location::caller())
        }));
        assert!(m.contains("double release"), "{m}");
    }

    #[test]
    fn a_put_over_a_live_record_panics_and_one_after_its_release_does_not() {
        let l = on();
        l.placed(1000 * 16, 4096, Location::caller());
        let m = message(std::panic::AssertUnwindSafe(|| {
            l.placed(1000 * 16 + 2048, 64, Location::caller())
        }));
        assert!(m.contains("over the live record at 16000"), "{m}");
        let l = on();
        l.placed(16000, 4096, Location::caller());
        l.released(16000, 4096, Location::caller());
        // The segment is reused: bytes placed over the released record make it live again.
        l.placed(16000 - 16, 4096 + 16, Location::caller());
        l.released(16000 - 16, 4096 + 16, Location::caller());
    }

    #[test]
    fn a_release_of_another_length_than_placed_panics() {
        let l = on();
        l.placed(0, 4096, Location::caller());
        let m = message(std::panic::AssertUnwindSafe(|| {
            l.released(0, 512, Location::caller())
        }));
        assert!(m.contains("where"), "{m}");
    }

    #[test]
    fn off_it_checks_nothing() {
        let l = LiveAddresses::default();
        l.released(0, 16, Location::caller());
        l.released(0, 16, Location::caller());
    }
}
