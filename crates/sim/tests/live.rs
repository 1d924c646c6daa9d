//! The live run in CI: the engine on its real threads (maintenance, rotation, scrub), three
//! writers per volume and an operator's key cycles, snapshots, rotations and flushes beside
//! them, every read checked (`bulwark_sim::live`). A few seconds per layout; `bulwark-live`
//! runs it long. The interleavings are the machine's: a failure here does not replay, and
//! its message says which cell, what it read and what it expected.

use std::time::Duration;

use bulwark_sim::live::{live, LiveConfig, HUGE_SPREAD};

fn run(layout: &str, tiny_cache: bool, holes_first: bool, crash: bool, huge_spread: u64) {
    let seconds: u64 = std::env::var("BULWARK_LIVE_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    let cfg = LiveConfig {
        seed: 1,
        duration: Duration::from_secs(seconds),
        layout: layout.into(),
        writers: 3,
        // The system's temporary directory, not /dev/shm (the binary's default): four
        // pools of 96-144 MiB at once may not fit a container's small /dev/shm.
        dir: Some(
            std::env::var_os("BULWARK_LIVE_DIR")
                .map(Into::into)
                .unwrap_or_else(std::env::temp_dir),
        ),
        tiny_cache,
        holes_first,
        huge_spread,
        crash,
    };
    match live(&cfg) {
        Ok(r) => {
            // The run did what it is for: writes acknowledged and read back, the key
            // cycled, snapshots read back.
            assert!(r.writes > 0 && r.cells_checked > 0, "{r:?}");
            assert!(r.key_cycles > 0 && r.snapshots > 0, "{r:?}");
            eprintln!("{layout}: {r:?}");
        }
        Err(f) => panic!("live run on {layout}:\n{}", f.join("\n")),
    }
}

#[test]
fn live_single_holds() {
    run("single", false, true, false, HUGE_SPREAD);
}

/// The smallest node cache and a 1E thin volume: the cleaner's steps over its holes lost
/// the upper nodes between two steps and walked it a chunk at a time (2^36 chunks, the
/// commit lock held, every FLUSH waiting; `Core::next_mapped_loading`).
#[test]
fn live_mirror_with_the_smallest_cache_a_1e_volume_and_a_crash_holds() {
    run("mirror", true, false, true, 1 << 56);
}

#[test]
fn live_log_device_with_a_crash_holds() {
    run("log", false, true, true, HUGE_SPREAD);
}

/// Parity near full, then a crash: where the first crash runs left pools that could not be
/// imported ("the pool is out of space", fixed in `Store::write_meta_batch` and
/// `Store::resume_meta_head`).
#[test]
fn live_parity_with_a_crash_holds() {
    run("parity", false, true, true, HUGE_SPREAD);
}
