//! The engine's `crate::sync` (`crates/engine/src/sync.rs`) over shuttle: the same names,
//! with `parking_lot`'s API (no poisoning; `Condvar::wait_for` and
//! `RwLock::try_write_for` take a duration) on shuttle's primitives.
//!
//! Time does not pass under shuttle: a wait with a deadline is a choice the scheduler
//! makes. `try_write_for` and `try_lock_for` try, yield (any other thread may run, the
//! holder may leave; PCT lowers the yielding thread), and try once more before they
//! answer that the time ran out; `Condvar::wait_for` waits
//! for a notification (shuttle's timed wait never times out) and so models no timeout.

use std::ops::{Deref, DerefMut};
use std::time::Duration;

pub use shuttle::sync::{RwLockReadGuard, RwLockWriteGuard};

/// Atomics (shuttle's: sequentially consistent whatever the ordering asked).
pub mod atomic {
    pub use shuttle::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
}

/// `parking_lot::Mutex` over shuttle's.
#[derive(Default)]
pub struct Mutex<T>(shuttle::sync::Mutex<T>);

/// Held while the lock is; `None` only inside `Condvar::wait_for`.
pub struct MutexGuard<'a, T>(Option<shuttle::sync::MutexGuard<'a, T>>);

impl<T> Mutex<T> {
    pub fn new(value: T) -> Self {
        Mutex(shuttle::sync::Mutex::new(value))
    }

    pub fn lock(&self) -> MutexGuard<'_, T> {
        MutexGuard(Some(self.0.lock().expect("no thread panics holding it")))
    }

    /// Tries, lets the scheduler run any other thread, and tries again (`RwLock::try_write_for`).
    pub fn try_lock_for(&self, _timeout: Duration) -> Option<MutexGuard<'_, T>> {
        if let Ok(g) = self.0.try_lock() {
            return Some(MutexGuard(Some(g)));
        }
        shuttle::thread::yield_now();
        self.0.try_lock().ok().map(|g| MutexGuard(Some(g)))
    }
}

impl<T> Deref for MutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.0.as_ref().expect("held")
    }
}

impl<T> DerefMut for MutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.0.as_mut().expect("held")
    }
}

/// `parking_lot::Condvar` over shuttle's.
#[derive(Default)]
pub struct Condvar(shuttle::sync::Condvar);

/// Whether a `wait_for` timed out (never, under shuttle).
pub struct WaitTimeoutResult(bool);

impl WaitTimeoutResult {
    pub fn timed_out(&self) -> bool {
        self.0
    }
}

impl Condvar {
    pub fn new() -> Self {
        Condvar(shuttle::sync::Condvar::new())
    }

    pub fn notify_all(&self) {
        self.0.notify_all();
    }

    pub fn notify_one(&self) {
        self.0.notify_one();
    }

    pub fn wait_for<T>(
        &self,
        guard: &mut MutexGuard<'_, T>,
        timeout: Duration,
    ) -> WaitTimeoutResult {
        let g = guard.0.take().expect("held");
        let (g, r) = self
            .0
            .wait_timeout(g, timeout)
            .expect("no thread panics holding it");
        guard.0 = Some(g);
        WaitTimeoutResult(r.timed_out())
    }
}

/// `parking_lot::RwLock` over shuttle's.
#[derive(Default)]
pub struct RwLock<T>(shuttle::sync::RwLock<T>);

impl<T> RwLock<T> {
    pub fn new(value: T) -> Self {
        RwLock(shuttle::sync::RwLock::new(value))
    }

    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        self.0.read().expect("no thread panics holding it")
    }

    pub fn write(&self) -> RwLockWriteGuard<'_, T> {
        self.0.write().expect("no thread panics holding it")
    }

    /// Tries, lets the scheduler run any other thread, and tries again: the time given
    /// passes or not as the schedule says.
    pub fn try_write_for(&self, _timeout: Duration) -> Option<RwLockWriteGuard<'_, T>> {
        if let Ok(g) = self.0.try_write() {
            return Some(g);
        }
        shuttle::thread::yield_now();
        self.0.try_write().ok()
    }
}
