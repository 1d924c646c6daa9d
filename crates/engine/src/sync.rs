//! The locks and atomics of the protocols that are model-checked (`crates/modelcheck`):
//! the log's segment states (`log`), the reuse gate (`store::gate`), group commit
//! (`pool::group`), the cleaner's swap and moves (`pool::relocate`), a volume's uses
//! (`volume::uses`) and its stripe locks (`volume::stripes`) take theirs from here, not
//! from `parking_lot` or `std` directly.
//!
//! In the engine these are `parking_lot`'s and `std`'s, unchanged. `bulwark-modelcheck`
//! compiles those same source files a second time, with its own `sync` module in this
//! one's place: the same names and the same `parking_lot`-like API over `shuttle`'s
//! primitives, so the code its tests explore is the code that runs. (A cargo feature of
//! this crate switching to shuttle would not do: `cargo test --workspace` unifies
//! features, and every other test would then run on shuttle's primitives.)
//!
//! Keep this module's surface small: every name here needs its twin there.

pub use parking_lot::{Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Atomics (`std`'s).
pub mod atomic {
    pub use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
}
