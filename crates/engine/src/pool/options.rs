//! What `Pool::create` and `Pool::open` take: where the devices come from, and how the
//! pool is imported and run (with the scrub's default throttle, `SCRUB_RATE_DEFAULT`).

use std::path::PathBuf;

use super::tier;

/// The scrub's default throttle, bytes per second (`scrub_rate_bytes`).
pub const SCRUB_RATE_DEFAULT: u64 = 256 << 20;

/// Where a new pool's devices come from.
#[derive(Debug, Clone)]
pub enum DeviceSpec {
    /// Create `count` sparse files of `size_bytes` each inside the pool directory.
    Files { count: usize, size_bytes: u64 },
    /// Use existing files or block devices (files that do not exist are refused).
    Paths(Vec<PathBuf>),
}

#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// Bound on the clean block-map node cache, in bytes.
    pub cache_bytes: u64,
    /// Let `set_faults` arm the fault-injection layer (drills and tests only).
    pub allow_fault_injection: bool,
    /// Scrub throttle, bytes per second.
    pub scrub_rate_bytes: u64,
    /// Longest time dirty data waits for a commit when nothing else asks for one
    /// (a flush, the dirty-node bound, low space): what an unflushed crash can lose.
    pub commit_interval: std::time::Duration,
    /// Take the devices even when they are older than the generation this host last
    /// committed (`DIR/pool.anchor`): the administrator restored them on purpose.
    pub accept_rollback: bool,
    /// Take the pool even when its intent log lost acknowledged flushes (a block missing
    /// or altered in a chain that goes on, or a chain shorter than the host's anchor
    /// records): the administrator accepts that those writes read as before them.
    pub accept_log_loss: bool,
    /// Make a FLUSH durable with an intent log block and one sync, not a commit
    /// (`txg::intent`, decision 0010). Off: every flush is a commit.
    pub intent_log: bool,
    /// Take a pool that `bulwark pool export` marked exported (`bulwark pool import`); a
    /// plain `serve` refuses it, so an exported pool is not taken back by accident.
    pub take_exported: bool,
    /// Give the pool this name at import (its labels; `bulwark pool import --name`).
    pub rename: Option<String>,
    /// `bulwark pool upgrade`: take a format 1 pool, make its pool key, and write format 2
    /// labels (decision 0011). Refused on a pool that is already format 2.
    pub upgrade: bool,
    /// A cache device for this run (`serve --cache-device`), in place of the one
    /// `pool.json` names. One that cannot be opened is warned about; the pool serves.
    pub cache_device: Option<PathBuf>,
    /// The pool's object store (issue 22, `tier`): taken at import, published to by every
    /// commit. `None`: local devices only.
    pub tier: Option<tier::TierOpen>,
    /// Tests and the simulator only (`crates/sim`, `pool/stepped.rs`): start no maintenance
    /// or scrub thread; the caller drives that work with `Pool::maintenance_step` and
    /// `Pool::scrub_step`, and a writer short of space gets `NoSpace` at once.
    pub stepped: bool,
    /// Client writes fill holes (free extents of partly-live segments) when free segments
    /// run short, instead of waiting for the cleaner (decision 0014). The daemon turns it on
    /// (`serve --no-fill-holes` leaves it off), as does the simulator; off in this default,
    /// so the engine's tests of the cleaner measure the cleaner alone.
    pub fill_holes: bool,
    /// Holes first (experimental; implies `fill_holes`): below the cleaner's usual start,
    /// client data goes into the holes of any segment at least a quarter live, and the
    /// cleaner runs only for the whole segments commits need, when free segments come
    /// within `HOLES_FIRST_CLEAN_MARGIN` of the client floor or a writer waits
    /// (`Log::set_holes_first`; BENCHMARKS.md, "Holes first"). Off by default (`serve
    /// --holes-first`).
    pub holes_first: bool,
    /// When no client has asked anything for a while, rewrite blocks that random
    /// overwrites scattered in block order (`pool/defrag.rs`). On by default (`serve
    /// --no-defrag` turns it off).
    pub defrag: bool,
    /// Tests and the simulator: every record placed and released is checked against the
    /// others of this run (`store/live.rs`): a double release, or a put over a live record,
    /// panics naming the address, its segment and the callers. On in debug builds.
    pub check_addresses: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            cache_bytes: crate::constants::CACHE_BYTES_DEFAULT,
            allow_fault_injection: false,
            scrub_rate_bytes: SCRUB_RATE_DEFAULT,
            commit_interval: std::time::Duration::from_millis(crate::constants::COMMIT_INTERVAL_MS),
            accept_rollback: false,
            accept_log_loss: false,
            intent_log: true,
            take_exported: false,
            upgrade: false,
            rename: None,
            cache_device: None,
            tier: None,
            stepped: false,
            fill_holes: false,
            holes_first: false,
            defrag: true,
            check_addresses: cfg!(debug_assertions),
        }
    }
}
