//! `bulwark-modelcheck`: the engine's concurrency protocols, checked under every
//! interleaving a seeded scheduler reaches (`shuttle`: randomized and PCT schedulers), as
//! AWS ShardStore checks its storage node (issue 37, point 3; docs/simulation.md).
//!
//! The code checked is the engine's own: this crate compiles the engine's source files of
//! each protocol a second time (`#[path]` below), with [`sync`] in the place of the
//! engine's `crate::sync`, so their locks and atomics are shuttle's and every lock, wait
//! and atomic step is a point where the scheduler may switch threads. Nothing else of the
//! engine is built here: a protocol is checked only once its synchronization lives in files
//! that name nothing above them (today `log`, `store::gate`, `pool::group`, `pool::relocate`, `volume::uses` and `volume::stripes`, over
//! `constants` and `error`). The tests (`tests/`) drive those files from shuttle threads playing the parts
//! of readers, writers and commits, and check the property a user relies on.
//!
//! The engine files carry their own unit tests, which need the real primitives: this
//! library is built without its test harness (`test = false`), so they run only in
//! `bulwark-engine`.

pub mod sync;

/// The engine's bounds and sizes (`crates/engine/src/constants.rs`).
#[path = "../../engine/src/constants.rs"]
pub mod constants;

/// The engine's error type (`crates/engine/src/error.rs`; its crate-private helpers go
/// unused here).
#[allow(dead_code)]
#[path = "../../engine/src/error.rs"]
pub mod error;

pub use error::{Error, Result};

/// Segments, their states, live bytes, epochs, recycling (`crates/engine/src/log/`).
#[path = "../../engine/src/log/mod.rs"]
pub mod log;

/// The reuse gate (`crates/engine/src/store/gate.rs`).
#[path = "../../engine/src/store/gate.rs"]
pub mod gate;

/// Group commit: which commit covers a FLUSH (`crates/engine/src/pool/group.rs`).
#[path = "../../engine/src/pool/group.rs"]
pub mod group;

/// The cleaner's move against client writes: the swap where the map still points at the
/// old copy, and the move into every snapshot and clone tree that still holds it
/// (`crates/engine/src/pool/relocate.rs`).
#[path = "../../engine/src/pool/relocate.rs"]
pub mod relocate;

/// Who uses a volume: handles, background batches, and the changes that wait for none
/// (`crates/engine/src/volume/uses.rs`).
#[path = "../../engine/src/volume/uses.rs"]
pub mod uses;

/// A volume's stripe locks: client writes against key rotation's rewrites
/// (`crates/engine/src/volume/stripes.rs`).
#[path = "../../engine/src/volume/stripes.rs"]
pub mod stripes;

/// Run `f` under shuttle's randomized scheduler, then under PCT (depth 3: a bug that needs
/// two preemptions at the right steps is found with good odds), both seeded, each for
/// `BULWARK_SHUTTLE_ITERATIONS` schedules (default 1000). `BULWARK_SHUTTLE_SEED` sets the
/// seed (fixed by default: every run explores the same schedules, so a failure in CI
/// replays as it is); `BULWARK_SHUTTLE_SCHEDULERS=random` or `pct` runs one alone.
pub fn check(f: impl Fn() + Send + Sync + 'static) {
    let iterations = env("BULWARK_SHUTTLE_ITERATIONS").unwrap_or(1000) as usize;
    let seed = env("BULWARK_SHUTTLE_SEED").unwrap_or(0x0062_756c_7761_726b);
    let wants =
        |s: &str| std::env::var("BULWARK_SHUTTLE_SCHEDULERS").map_or(true, |v| v.contains(s));
    let f = std::sync::Arc::new(f);
    if wants("random") {
        let g = f.clone();
        shuttle::check_random_with_seed(move || g(), seed, iterations);
    }
    if wants("pct") {
        let pct = shuttle::scheduler::PctScheduler::new_from_seed(seed, 3, iterations);
        shuttle::Runner::new(pct, shuttle::Config::new()).run(move || f());
    }
}

fn env(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}
