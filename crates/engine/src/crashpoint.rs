//! Named crash points: `BULWARK_CRASH_AT=NAME` in the daemon's environment makes it abort
//! (as `kill -9` would: no destructors, no close) the first time it reaches point `NAME`.
//! Tests use them to crash at exactly one step of a multi-step operation (a commit, a
//! snapshot, a rollback) instead of racing a signal against it. Unset, a point costs one
//! load of a cached flag.
//!
//! Points: `commit.nodes_written` (the maps and table written, nothing flushed),
//! `commit.flushed` (devices and anchor synced, no superblock written),
//! `commit.superblocks_written` (superblocks written, nothing released),
//! `snapshot.destroy.released` (a snapshot's records released, the commit not begun),
//! `rollback.released` (the volume's newer records released, the commit not begun).

use std::sync::OnceLock;

fn wanted() -> Option<&'static str> {
    static AT: OnceLock<Option<String>> = OnceLock::new();
    AT.get_or_init(|| {
        std::env::var("BULWARK_CRASH_AT")
            .ok()
            .filter(|s| !s.is_empty())
    })
    .as_deref()
}

/// Abort the process here if `BULWARK_CRASH_AT` names this point.
pub fn hit(name: &str) {
    if wanted() == Some(name) {
        eprintln!("bulwark: BULWARK_CRASH_AT={name}: aborting here");
        std::process::abort();
    }
}
