//! Named crash points: `BULWARK_CRASH_AT=NAME` in the daemon's environment makes it abort
//! (as `kill -9` would: no destructors, no close) the first time it reaches point `NAME`
//! once the pool is imported; `NAME:N` aborts the Nth time instead (snapshot destroy and
//! rollback commit twice: `commit.flushed:2` is their second commit's). Tests use them to
//! crash at exactly one step of a multi-step operation (a commit, a snapshot, a rollback)
//! instead of racing a signal against it. The points are armed only when the import is
//! done: its own commit reaches the `commit.*` points before anything else could. Unset, a
//! point costs one load of a cached flag.
//!
//! Points: `commit.nodes_written` (the maps and table written, nothing flushed),
//! `commit.flushed` (devices and anchor synced, no superblock written),
//! `commit.published` (the object store took the commit, no local superblock written),
//! `commit.superblocks_written` (superblocks written, nothing released),
//! `snapshot.destroy.released` (a snapshot's records released, the commit not begun),
//! `rollback.released` (the volume's newer records released, the commit not begun).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

static ARMED: AtomicBool = AtomicBool::new(false);
static REACHED: AtomicU64 = AtomicU64::new(0);

/// The point named and the how-manieth time to abort there (1 unless `NAME:N`).
fn wanted() -> Option<&'static (String, u64)> {
    static AT: OnceLock<Option<(String, u64)>> = OnceLock::new();
    AT.get_or_init(|| {
        let spec = std::env::var("BULWARK_CRASH_AT").ok()?;
        match spec.rsplit_once(':') {
            Some((name, n)) => match n.parse::<u64>() {
                Ok(n) if n >= 1 && !name.is_empty() => Some((name.to_string(), n)),
                _ => {
                    eprintln!("bulwark: BULWARK_CRASH_AT={spec}: not NAME or NAME:N (N >= 1); ignored");
                    None
                }
            },
            None if spec.is_empty() => None,
            None => Some((spec, 1)),
        }
    })
    .as_ref()
}

/// Arm the crash points (the import calls it once its own commit is done).
pub fn arm() {
    if wanted().is_some() {
        ARMED.store(true, Ordering::SeqCst);
    }
}

/// Abort the process here if `BULWARK_CRASH_AT` names this point (armed, and reached the
/// wanted number of times).
pub fn hit(name: &str) {
    let Some((at, n)) = wanted() else { return };
    if at != name || !ARMED.load(Ordering::SeqCst) {
        return;
    }
    if REACHED.fetch_add(1, Ordering::SeqCst) + 1 == *n {
        eprintln!("bulwark: BULWARK_CRASH_AT={name}:{n}: aborting here");
        std::process::abort();
    }
}
