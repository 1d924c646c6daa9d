//! FLUSH against commit: the engine's `pool::group` (compiled against shuttle by
//! `bulwark-modelcheck`) driven by shuttle threads playing clients that write and flush,
//! the background commit (whose upload to the object store may fail without poisoning
//! the pool), and a cleaning pass that holds the commit lock and commits for waiting
//! flushes between two batches.
//!
//! The parts the threads play are the engine's own steps in its own order, over a model
//! of the state: a counter of acknowledged writes (the in-memory map), and what the last
//! successful commit made durable (the counter as its snapshot saw it):
//! - a flush is `Core::flush` and `flush_since` on the commit path: `GroupCommit::arrive`
//!   after the client's write was acknowledged, `lock_or_covered` on the commit lock, and
//!   its own commit when nothing covered it;
//! - a commit is `Core::commit_held`: `GroupCommit::begin`, the snapshot, then `failed`
//!   (the store did not take it) or durable, then `finish`;
//! - the cleaning pass is `clean`'s `answer_waiting_flushes` between two batches,
//!   under the commit lock.
//!
//! Budget and seeds: `bulwark_modelcheck::check` (`BULWARK_SHUTTLE_ITERATIONS`, default
//! 1000 per scheduler; `BULWARK_SHUTTLE_SEED`; `BULWARK_SHUTTLE_SCHEDULERS`).

use bulwark_modelcheck::check;
use bulwark_modelcheck::group::GroupCommit;
use bulwark_modelcheck::sync::Mutex as CommitLock;
use bulwark_modelcheck::Error;
use shuttle::sync::{Arc, Mutex};
use shuttle::thread;

struct Model {
    group: GroupCommit,
    commit_lock: CommitLock<()>,
    /// Writes acknowledged so far: the version of the in-memory state.
    acked: Mutex<u64>,
    /// The version the last successful commit made durable.
    durable: Mutex<u64>,
    /// The writes whose notes were taken (by a commit's read of the map, or by a log
    /// flush): notes of later writes are what the next log flush writes.
    noted: Mutex<u64>,
    /// Ranges of writes (after, up to] whose notes a log flush made durable.
    logged: Mutex<Vec<(u64, u64)>>,
}

/// What the store does with a commit's upload.
#[derive(Clone, Copy)]
enum Store {
    Takes,
    Fails,
}

impl Model {
    fn new() -> Model {
        Model {
            group: GroupCommit::new(),
            commit_lock: CommitLock::new(()),
            acked: Mutex::new(0),
            durable: Mutex::new(0),
            noted: Mutex::new(0),
            logged: Mutex::new(Vec::new()),
        }
    }

    /// A client write, acknowledged: the version it made.
    fn write(&self) -> u64 {
        let mut a = self.acked.lock().unwrap();
        *a += 1;
        *a
    }

    /// `Core::commit_held`, by a holder of the commit lock.
    fn commit_held(&self, store: Store) -> bool {
        let begun = self.group.begin();
        let seen = *self.acked.lock().unwrap();
        // Under the map lock: the notes so far are in these leaves, taken from `intents`.
        let before = std::mem::replace(&mut *self.noted.lock().unwrap(), seen);
        let ok = match store {
            Store::Fails => {
                // Put back before the newer notes (`Core::notes_taken`): the next log flush
                // writes them.
                *self.noted.lock().unwrap() = before;
                self.group.failed(begun);
                false
            }
            Store::Takes => {
                let mut d = self.durable.lock().unwrap();
                *d = (*d).max(seen);
                true
            }
        };
        self.group.finish();
        ok
    }

    /// `Core::commit`: the background commit.
    fn commit(&self, store: Store) {
        let _c = self.commit_lock.lock();
        self.commit_held(store);
    }

    /// `Core::flush` (the commit path): true when it answers that everything acknowledged
    /// before it is durable.
    fn flush(&self) -> bool {
        let arrived = self.group.arrive();
        let Some(_c) = self.group.lock_or_covered(&self.commit_lock, arrived) else {
            return true;
        };
        self.commit_held(Store::Takes)
    }

    /// `Core::flush` with the intent log on: a log flush first (`GroupCommit::log_flush`);
    /// when it could not make everything durable (`log` answers `NoSpace`: no room for a
    /// chain block; or `Ok(false)`: the log devices failed), a commit.
    fn flush_logged(&self, log: Result<(), Error>) -> bool {
        let arrived = self.group.arrive();
        let Some(_c) = self.group.lock_or_covered(&self.commit_lock, arrived) else {
            return true;
        };
        let logged = self.group.log_flush(|| {
            // The notes taken: made durable by the log block, or by nothing.
            let seen = *self.acked.lock().unwrap();
            let after = std::mem::replace(&mut *self.noted.lock().unwrap(), seen);
            log.map(|()| {
                self.logged.lock().unwrap().push((after, seen));
                true
            })
        });
        match logged {
            Ok(true) => true,
            _ => self.commit_held(Store::Takes),
        }
    }

    /// A client: a write, then a FLUSH; what the FLUSH answered must be true.
    fn client(&self) {
        let wrote = self.write();
        self.check_flushed(wrote, self.flush());
    }

    /// A client of a pool with the intent log, whose log flushes answer `log`.
    fn client_logged(&self, log: Result<(), Error>) {
        let wrote = self.write();
        self.check_flushed(wrote, self.flush_logged(log));
    }

    fn check_flushed(&self, wrote: u64, answered: bool) {
        if answered {
            let durable = *self.durable.lock().unwrap();
            let logged = self.logged.lock().unwrap().clone();
            let missing =
                (1..=wrote).find(|&v| v > durable && !logged.iter().any(|&(a, b)| a < v && v <= b));
            assert!(
                missing.is_none(),
                "a FLUSH returned success after write {wrote} was acknowledged, but write \
                 {missing:?} is neither in the last durable commit ({durable}) nor in the \
                 intent log ({logged:?})"
            );
        }
    }

    /// A cleaning pass of two batches under the commit lock, committing for waiting flushes
    /// between them (`clean`'s `answer_waiting_flushes`).
    fn clean_pass(&self) {
        let _c = self.commit_lock.lock();
        for _batch in 0..2 {
            if self.group.waiting() {
                self.commit_held(Store::Takes);
            }
        }
    }
}

/// A FLUSH that returns success finds durable every write acknowledged before it, whether
/// its own commit made it so or one it waited for: group commit counts only a commit that
/// began after the flush arrived (`GroupCommit::covered`: its snapshot came after the
/// write) and that the object store took (a failed one covers nothing).
///
/// Two clients write and flush while the background commit runs twice (the first upload
/// refused by the store, the pool serving on) and a cleaning pass holds the commit lock.
///
/// Mutations run once: `covered` counting a commit that began before the flush arrived
/// (`>=` for `>`): caught by both schedulers; `covered` without its `failed_at` check (a
/// failed commit covers): caught by both. Each: "a FLUSH returned success after write 1
/// was acknowledged, but write Some(1) is neither in the last durable commit (0) nor in the
/// intent log ([])".
#[test]
fn a_flush_that_returns_finds_every_earlier_write_durable() {
    check(|| {
        let m = Arc::new(Model::new());
        let clients: Vec<_> = (0..2)
            .map(|_| {
                let m = m.clone();
                thread::spawn(move || m.client())
            })
            .collect();
        let committer = {
            let m = m.clone();
            thread::spawn(move || {
                m.commit(Store::Fails);
                m.commit(Store::Takes);
            })
        };
        m.clean_pass();
        for c in clients {
            c.join().unwrap();
        }
        committer.join().unwrap();
    });
}

/// With the intent log: a FLUSH that returns success finds durable every write
/// acknowledged before it, also when the log flush that ran while it waited made nothing
/// durable (no room for a chain block near full, `NoSpace`, or log devices that failed) and
/// the flush holding the lock went on to commit: that log flush covers no one
/// (`GroupCommit::log_flush`).
///
/// Found by this test, and fixed with it: `log_flush` counted every log flush as a commit
/// done, so a FLUSH waiting for the lock took one that had failed (its notes taken and
/// written nowhere) as covering it, and returned success while the commit that would
/// make its write durable was still running: a crash then lost an acknowledged, flushed
/// write. The randomized scheduler and PCT each find it on that code (the check left out
/// of `log_flush`): "a FLUSH returned success after write 1 was acknowledged, but write
/// Some(1) is neither in the last durable commit (0) nor in the intent log ([])".
#[test]
fn a_flush_is_never_covered_by_a_log_flush_that_made_nothing_durable() {
    check(|| {
        let m = Arc::new(Model::new());
        let full = {
            let m = m.clone();
            thread::spawn(move || m.client_logged(Err(Error::NoSpace)))
        };
        let waiting = {
            let m = m.clone();
            thread::spawn(move || m.client_logged(Ok(())))
        };
        m.client_logged(Ok(()));
        full.join().unwrap();
        waiting.join().unwrap();
    });
}

/// With the intent log and an object store (`--object-store-flush local`): a FLUSH that
/// returns success finds durable every write acknowledged before it, also after a commit
/// the store refused. That commit took the notes of the writes before it (under the map
/// lock, as every commit does) and made nothing durable: it puts them back
/// (`Core::notes_taken`, played here by `commit_held`), so the log flush after it writes
/// them.
///
/// Found by this test, and fixed with it: the refused commit had cleared the notes, the
/// FLUSH went through the intent log, found none of those writes, and answered success:
/// a crash then lost them (their map in no durable commit, their notes in no log block).
/// Both schedulers find it on that code (the notes not put back), e.g. "a FLUSH returned
/// success after write 2 was acknowledged, but write Some(1) is neither in the last
/// durable commit (0) nor in the intent log ([(1, 2)])". The putting back is the engine's
/// `commit_held` as this model plays it, not code compiled here.
#[test]
fn a_flush_after_a_refused_commit_finds_every_earlier_write_durable() {
    check(|| {
        let m = Arc::new(Model::new());
        let committer = {
            let m = m.clone();
            thread::spawn(move || {
                m.commit(Store::Fails);
                m.commit(Store::Takes);
            })
        };
        let other = {
            let m = m.clone();
            thread::spawn(move || m.client_logged(Ok(())))
        };
        m.client_logged(Ok(()));
        m.client_logged(Ok(()));
        committer.join().unwrap();
        other.join().unwrap();
    });
}
