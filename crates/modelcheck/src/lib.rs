//! `bulwark-modelcheck`: the engine's concurrency protocols, checked under every
//! interleaving a seeded scheduler reaches (`shuttle`: randomized and PCT schedulers), as
//! AWS ShardStore checks its storage node (issue 37, point 3; docs/simulation.md).
//!
//! The code checked is the engine's own: this crate compiles the engine's source files of
//! each protocol a second time (`#[path]` below), with [`sync`] in the place of the
//! engine's `crate::sync`, so their locks and atomics are shuttle's and every lock, wait
//! and atomic step is a point where the scheduler may switch threads. Nothing else of the
//! engine is built here: a protocol is checked only once its synchronization lives in files
//! that name nothing above them (today `log` and `store::gate`, over `constants` and
//! `error`). The tests (`tests/`) drive those files from shuttle threads playing the parts
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
