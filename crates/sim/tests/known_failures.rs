//! Seeds that found a bug not yet fixed: each replays it, and passes once it is fixed
//! (then it moves to `tests/regressions.rs`). Ignored so that CI stays green while the
//! bug is open; `cargo test --release -p bulwark-sim -- --ignored` runs them.
//!
//! F1 (seeds 10 and 1025, a live count underflow) and F2 (seed 2040, a small flush's
//! record left whole on one member only by a crash) are fixed and their seeds are in
//! `tests/regressions.rs`, as is F5 (seed 60213, a replayed record torn on one member
//! of a mirror). None is open.
