//! `Store`: the data plane. It owns where records go and when their space comes back:
//! the redundancy layer (placement per layout), the log (segments, streams, space floors),
//! the node cache, the nonce counter, the reuse gate and the back-pressure on writers.
//!
//! Everything that writes a record goes through one put path ([`Store::put`]): client data
//! (`volume`), map nodes and the volume table (`Store::write_meta_batch`), and the cleaner.
//! Everything that drops a reference goes through one release point ([`Store::release`]):
//! the place where a record's space is given back to the log. Whether a reference dies is
//! decided beside it, in `dies.rs`: `release` takes only a [`Dead`], and only the rules
//! there make one (a pointer a tree drops dies only when no neighbouring tree holds it at
//! the same place, decision 0009; what a tree that goes holds alone; a record never linked;
//! a root, table record or moved record's old copy superseded).
//!
//! The control plane (`pool`: volumes, devices, commits, scrub, rotation, pool.json) sits
//! above and reaches the data plane only through this type; the data plane asks the control
//! plane, through [`Control`], for a commit (to make writes durable or to reserve nonces),
//! a flush (group commit), and to note data errors (a read that found no good copy, and a
//! range a client rewrote whole). Back-pressure on writers (`wait_for`, `hold_nodes`) lives
//! here too.
//!
//! `asks.rs` answers what the pool and the volumes ask of the store (space, cleaning,
//! commits, the intent log's blocks, the local cache's segments, the devices): the fields
//! stay private to this module.
//!
//! With an object tier's local cache ([`Remote`] reads the records of given-back segments):
//! `pace.rs` makes client writes past the cache's size wait for the store to take room
//! back, and `ahead.rs` reads sequential reads of given-back segments ahead (decision 0013).
//!
//! Invariants (checked at run time where cheap):
//! - A record is written only at an address the log handed out for its stream, and a
//!   pointer names only records written whole (`put` fills `addr` after the device write).
//! - A record placed counts toward the next commit's room until its leaf is counted dirty
//!   (`Pending`), so a full pool can always commit.
//! - Nothing is released twice by this layer: `release` ignores holes and refuses pointers
//!   outside the pool (a damaged map), and callers release the pointer a map slot held only
//!   after the map dropped it. With `check_addresses` on (tests, the simulator) a release
//!   of a record released already, or a put over a live one, panics (`live.rs`).
//! - A nonce is handed out at most once under the pool's data keys: `next_nonce` never
//!   passes the limit the last commit made durable.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

pub mod ahead;
mod asks;
pub mod dies;
pub mod gate;
mod live;
pub mod pace;

pub use asks::MapSnapshot;
pub use dies::Dead;

use crate::cachedev::CacheDevice;
use crate::checksum::checksum;
use crate::codec::{self, Compression};
use crate::constants::*;
use crate::log::{Log, Pending, Stream};
use crate::map::{Blkptr, Node, NodeCache, NodeStore, ADDR_NONE};
use crate::redundancy::Redundancy;
use crate::{Error, Result};

/// What the data plane asks of the control plane above it (implemented by the pool).
pub trait Control: Send + Sync {
    /// Commit now: everything acknowledged before the call becomes durable, and a fresh
    /// nonce range is reserved.
    fn commit(&self) -> Result<()>;
    /// A durable point for everything completed before the call (group commit: may return
    /// at once when a commit that began after the call has finished).
    fn flush(&self) -> Result<()>;
    /// A client read found no verifying copy of `length` bytes at `offset` of `volume`.
    fn record_error(&self, volume: &str, offset: u64, length: u64);
    /// A client replaced `length` bytes at `offset` of `volume` whole: forget their errors.
    fn clear_rewritten(&self, volume: &str, offset: u64, length: u64);
}

/// Where the records of segments the local cache gave back are read from (the pool's
/// object tier implements it: `pool::tier`).
pub trait Remote: Send + Sync {
    /// The `len` stored bytes at pool address `addr` (one record, or a run of them, inside
    /// one segment), unverified: the caller checks them.
    fn read(&self, addr: u64, len: usize) -> Result<Vec<u8>>;

    /// `read`, and up to `want` bytes from `addr` in the same request where the store
    /// holds them in one piece (read-ahead: `store::ahead`). At least `len` bytes.
    fn read_ahead(&self, addr: u64, len: usize, want: usize) -> Result<Vec<u8>>;
}

/// Reads served by the object store (`Store::remote_reads`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemoteReads {
    /// Reads of records in segments only the store holds.
    pub reads: u64,
    pub bytes: u64,
    /// Records no local copy verified, read from the store instead.
    pub healed: u64,
    /// Reads served from bytes read ahead (`store::ahead`), no request of their own.
    pub ahead_hits: u64,
}

/// One record for [`Store::put`]: its stored bytes are `buf[at..at + ptr.len]` of the
/// caller's buffer, padded to `RECORD_ALIGN` up to the next record.
#[derive(Debug, Clone, Copy)]
pub struct Put {
    pub at: usize,
    pub ptr: Blkptr,
}

/// Why the last write waiting for space was refused (`status`'s `space.last_refusal`).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Refusal {
    pub unix_secs: u64,
    pub reason: String,
    /// Free segments when it was refused.
    pub free_segments: u32,
}

/// How often a writer's refusal for space is logged with its details. Near full nearly
/// every write is refused (10-18 a second in the live runs), one journal line each.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);

/// Which refusals for space are logged: the first, one whose reason differs from the
/// last logged, and then one per `REFUSAL_LOG_EVERY`, saying how many went unlogged
/// since. `status` still counts every one (`space_refusals`, `last_refusal`).
#[derive(Debug, Default)]
struct RefusalLog {
    last: Option<(std::time::Instant, String)>,
    unlogged: u64,
}

impl RefusalLog {
    /// `Some(n)`: log this refusal, with `n` not logged since the last line; `None`: not.
    fn admit(&mut self, now: std::time::Instant, why: &str) -> Option<u64> {
        match &self.last {
            Some((at, last_why))
                if last_why == why && now.saturating_duration_since(*at) < REFUSAL_LOG_EVERY =>
            {
                self.unlogged += 1;
                None
            }
            _ => {
                self.last = Some((now, why.to_string()));
                Some(std::mem::take(&mut self.unlogged))
            }
        }
    }
}

/// Cleaning cannot gain space (`Store::set_clean_stuck`).
#[derive(Debug, Clone)]
pub struct CleanStuck {
    /// What the maintenance thread saw, for `status`.
    pub why: String,
    /// Live bytes when it was seen: a segment's worth less, and cleaning is tried again.
    pub live_bytes: u64,
    pub since_unix: u64,
}

/// The data plane (see the module's doc). Every field is private: callers ask narrow
/// questions and take named steps (`asks.rs` holds those the control plane and the
/// volumes use), so the log, the redundancy layer and the reuse gate are reached only
/// through rules this module keeps. Two accessors hand out an inner part whole, and why:
/// `nodes` (every map operation takes the shared node cache beside the store; it
/// guards itself and no rule of the store's depends on it) and `members` (the pool's
/// device operations act on each member device, which guards its own state). The layer
/// test (`crates/bulwark/tests/layers.rs`) fails if a `pub` field comes back.
pub struct Store {
    red: Redundancy,
    log: Log,
    cache: NodeCache,
    /// Drawn at random for this run (never read from the devices): every data block this
    /// run seals is under its volume's data key salted with it (`keys::ring`), so the
    /// nonce counter below needs to be unique only within the run (decision 0011).
    run_salt: [u8; 16],
    nonce_next: AtomicU64,
    nonce_limit: AtomicU64,
    /// Read-held by every read of a block from the time its pointer is looked up until its
    /// bytes are verified, and write-held only while freed segments become reusable, so no
    /// read ever sees a segment reused under it (`gate`).
    reuse_gate: gate::ReuseGate,
    /// Sum of every volume's dirty node count (kept by `note_dirty`).
    dirty_nodes_total: AtomicUsize,
    poisoned: AtomicBool,
    /// Why, when another writer took the pool in the object store: what every later
    /// operation answers (`Error::Fenced`), rather than a bare "poisoned".
    fenced: Mutex<Option<String>>,
    /// The pool is closing: writers waiting for space give up.
    closing: AtomicBool,
    /// Set in stepped mode (`pool::OpenOptions::stepped`, the simulator's mode: no
    /// maintenance thread runs): the thread's stand-in, one maintenance round, which a
    /// writer short of space runs on its own thread where it would wait for the thread's,
    /// on the simulated clock, under the same rules as a real wait.
    stepper: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// Wakes the maintenance thread (commit, clean).
    wake: (Mutex<bool>, Condvar),
    space_wait: Mutex<()>,
    /// A writer waits for space (`wait_for`): the maintenance thread cleans.
    space_wanted: AtomicBool,
    /// Waits for space that ended in `NoSpace`, and the last one's reason (`status`).
    space_refusals: AtomicU64,
    last_refusal: Mutex<Option<Refusal>>,
    refusal_log: Mutex<RefusalLog>,
    /// Rounds of the maintenance thread that committed and cleaned for space: a writer that
    /// sees several pass with no segment freed stops waiting.
    clean_rounds: AtomicU64,
    /// Why cleaning cannot gain space now (`CleanStuck`): set by the maintenance thread
    /// after passes that freed no more than they wrote while writers waited; writers that
    /// find no room are then answered ENOSPC at once, and `status` says why.
    clean_stuck: Mutex<Option<CleanStuck>>,
    /// Client reads and writes (the scrub backs off while they come).
    client_ops: AtomicU64,
    /// `client_ops` when the scrub last took its count (`take_client_ops`).
    client_ops_taken: AtomicU64,
    /// Bytes thick volumes have reserved and not yet stored (their sizes less their used
    /// bytes), as of the control plane's last count (`Core::count_reservations`: every
    /// commit, and each change of a volume's size or provisioning).
    thick_unused: AtomicU64,
    /// The cache device, once the pool attached one (`set_cachedev`): copies of data
    /// records read, tried before the pool's copies (`read_data`).
    cachedev: std::sync::OnceLock<Arc<CacheDevice>>,
    /// The pool has an object tier (`pool::tier`): every run `put` writes is noted here,
    /// and the next commit uploads it before its superblock.
    tiered: AtomicBool,
    uploads: Mutex<Vec<Extent>>,
    /// The object store, once the pool's tier is taken: segments the local cache gave back
    /// (`Log::is_evicted`) are read from it, and so is a record no local copy verifies.
    remote: std::sync::OnceLock<Arc<dyn Remote>>,
    /// Reads of given-back records, bytes fetched from the store, records healed from
    /// it, reads served from bytes read ahead.
    remote_reads: [AtomicU64; 4],
    /// Bytes read ahead of sequential reads from the store (`ahead`).
    ahead: Mutex<ahead::Ahead>,
    /// Reads from the store per given-back segment since it was last brought back or
    /// asked for (bounded: `COLD_SEGMENTS_TRACKED`), and the segments read often enough
    /// to bring back (`take_wanted_back`).
    cold: Mutex<(std::collections::HashMap<u32, u32>, Vec<u32>)>,
    /// With a local cache of a set size: the maintenance thread woken every so many bytes
    /// written (it commits, so the store has them, and gives back room), and client
    /// writes paced past the size (`pace`).
    pace: pace::Pace,
    /// Every record placed and released in this run, when switched on (`live`: tests and
    /// the simulator), to catch a double release or a put over a live record.
    live: live::LiveAddresses,
}

/// Bytes `Store::put` wrote in one run, for the object tier: segment `seg` from byte `off`,
/// in the segment's incarnation `inc` (`Log::incarnation`: a segment reopened since holds
/// other bytes there, and the extent is dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Extent {
    pub seg: u32,
    pub inc: u64,
    pub off: u32,
    pub len: u32,
}

impl pace::Room for Store {
    fn allocated(&self) -> u64 {
        self.red.allocated_bytes()
    }
    fn wake(&self) {
        self.wake_maintenance();
    }
    fn gone(&self) -> bool {
        self.closing.load(Ordering::Relaxed) || self.is_poisoned()
    }
}

impl NodeStore for Store {
    fn load_node(&self, ptr: &Blkptr, level: u8, index: u64) -> Result<Node> {
        crate::map::check_node_ptr(ptr)?;
        let raw = self.read_meta(ptr, crate::map::NODE_BYTES)?;
        Node::decode(&raw, level, index)
    }
}

impl Store {
    /// A data plane over `red` and `log`; nonces from `nonce_reserved` on are reserved by
    /// the next commit before any is handed out.
    pub fn new(red: Redundancy, log: Log, cache: NodeCache, nonce_reserved: u64) -> Store {
        Store {
            red,
            log,
            cache,
            run_salt: crate::env::random(),
            nonce_next: AtomicU64::new(nonce_reserved),
            nonce_limit: AtomicU64::new(nonce_reserved),
            reuse_gate: gate::ReuseGate::new(),
            dirty_nodes_total: AtomicUsize::new(0),
            poisoned: AtomicBool::new(false),
            fenced: Mutex::new(None),
            closing: AtomicBool::new(false),
            stepper: std::sync::OnceLock::new(),
            wake: (Mutex::new(false), Condvar::new()),
            space_wait: Mutex::new(()),
            space_wanted: AtomicBool::new(false),
            clean_rounds: AtomicU64::new(0),
            space_refusals: AtomicU64::new(0),
            last_refusal: Mutex::new(None),
            refusal_log: Mutex::new(RefusalLog::default()),
            clean_stuck: Mutex::new(None),
            client_ops: AtomicU64::new(0),
            client_ops_taken: AtomicU64::new(0),
            thick_unused: AtomicU64::new(0),
            cachedev: std::sync::OnceLock::new(),
            tiered: AtomicBool::new(false),
            uploads: Mutex::new(Vec::new()),
            remote: std::sync::OnceLock::new(),
            remote_reads: Default::default(),
            ahead: Mutex::new(Default::default()),
            cold: Mutex::new(Default::default()),
            pace: Default::default(),
            live: Default::default(),
        }
    }

    /// Check every placement and release against the records placed and released in this
    /// run (`live`): a double release or a put over a live record panics, naming the
    /// address, its segment and the callers. Before anything is placed (`OpenOptions::
    /// check_addresses`).
    pub fn check_addresses(&self) {
        self.live.switch_on();
    }

    /// Live data (after redundancy, as `status` counts it) and what it may fill at most
    /// (`Log::usable_bytes`).
    pub fn used_and_usable(&self) -> (u64, u64) {
        let per = self.red.data_per_segment_byte();
        (
            self.log.live_bytes_total() * per,
            self.log.usable_bytes() * per,
        )
    }

    /// Whether a thin volume may add data: refused (`NoSpace`) once the pool's live data
    /// and the space thick volumes have reserved but not used fill what live data may
    /// fill. Nothing to check (and nothing counted) while no volume is thick.
    pub fn thin_room(&self) -> Result<()> {
        let unused = self.thick_unused.load(Ordering::Relaxed);
        if unused == 0 {
            return Ok(());
        }
        let (used, usable) = self.used_and_usable();
        if used.saturating_add(unused) >= usable {
            return Err(Error::NoSpace);
        }
        Ok(())
    }

    // --- poisoning ---

    pub fn check_poisoned(&self) -> Result<()> {
        if self.poisoned.load(Ordering::Acquire) {
            if let Some(why) = self.fenced.lock().clone() {
                return Err(Error::Fenced(why));
            }
            return Err(Error::Poisoned);
        }
        Ok(())
    }

    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    /// A write or flush to every copy failed: no more writes until the pool is reopened.
    pub fn poison(&self) {
        self.poisoned.store(true, Ordering::Release);
    }

    /// `poison` for `e`: when it is `Error::Fenced`, later operations answer it too.
    pub fn poison_for(&self, e: &Error) {
        if let Error::Fenced(why) = e {
            self.fenced.lock().get_or_insert_with(|| why.clone());
        }
        self.poison();
    }

    // --- the maintenance thread's wake-up ---

    pub fn wake_maintenance(&self) {
        *self.wake.0.lock() = true;
        self.wake.1.notify_all();
    }

    /// The maintenance thread's wait: until woken or `timeout` passes.
    pub fn wait_for_work(&self, timeout: Duration) {
        let mut woken = self.wake.0.lock();
        if !*woken {
            self.wake.1.wait_for(&mut woken, timeout);
        }
        *woken = false;
    }

    /// Stepped mode (`pool::OpenOptions::stepped`): no thread will free space for a waiting
    /// writer, so a writer short of space runs `round` (one maintenance round) where it
    /// would wait for the thread's, and its wait (`wait_until`) moves the clock as it would
    /// have slept: its bounds and its progress rule are the ones production runs.
    pub fn set_stepped(&self, round: Box<dyn Fn() + Send + Sync>) {
        let _ = self.stepper.set(round);
    }

    pub fn stepped(&self) -> bool {
        self.stepper.get().is_some()
    }

    /// Whether a writer waits for space; clears the flag (the caller cleans).
    pub fn take_space_wanted(&self) -> bool {
        self.space_wanted.swap(false, Ordering::AcqRel)
    }

    pub fn space_wanted(&self) -> bool {
        self.space_wanted.load(Ordering::Acquire)
    }

    /// One round of committing and cleaning for space has finished (`wait_for` counts them).
    pub fn note_clean_round(&self) {
        self.clean_rounds.fetch_add(1, Ordering::AcqRel);
    }

    /// Cleaning cannot gain space: say so (`status`), and answer writers that find no
    /// room ENOSPC at once until something frees space (`clean_unstuck_if_freed`).
    pub fn set_clean_stuck(&self, why: String) {
        let mut g = self.clean_stuck.lock();
        if g.is_none() {
            tracing::warn!("{why}");
        }
        *g = Some(CleanStuck {
            why,
            live_bytes: self.log.live_bytes_total(),
            since_unix: crate::env::system_time()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        });
        drop(g);
        // Writers waiting for space look again, and stop.
        self.log.space.notify_all();
    }

    /// A writer's wait for space ended in `NoSpace`: counted, and why, for `status`.
    fn note_refusal(&self, why: &str, free_segments: u32) {
        self.space_refusals.fetch_add(1, Ordering::Relaxed);
        *self.last_refusal.lock() = Some(Refusal {
            unix_secs: crate::env::unix_secs(),
            reason: why.to_string(),
            free_segments,
        });
    }

    /// Waits for space that ended in `NoSpace` since the pool was opened.
    pub fn space_refusals(&self) -> u64 {
        self.space_refusals.load(Ordering::Relaxed)
    }

    /// The last wait for space that ended in `NoSpace`: when, why.
    pub fn last_refusal(&self) -> Option<Refusal> {
        self.last_refusal.lock().clone()
    }

    /// Why cleaning is stuck, if it still is (`clean_unstuck_if_freed`: space freed since
    /// clears it here too, so `status` does not wait for a writer to notice).
    pub fn clean_stuck(&self) -> Option<CleanStuck> {
        if !self.clean_unstuck_if_freed() {
            return None;
        }
        self.clean_stuck.lock().clone()
    }

    /// Whether cleaning is stuck; clears it (and returns false) once live bytes fell by a
    /// segment's worth since (a trim, a destroy, a snapshot gone): cleaning may gain again.
    pub fn clean_unstuck_if_freed(&self) -> bool {
        let mut g = self.clean_stuck.lock();
        let Some(s) = g.as_ref() else {
            return false;
        };
        if self.log.live_bytes_total() + SEGMENT_BYTES <= s.live_bytes {
            tracing::info!("space was freed: cleaning resumes");
            *g = None;
            return false;
        }
        true
    }

    // --- dirty map nodes ---

    /// Record a tree's dirty node count (`slot` holds its last value) after every change to
    /// it: client writes, the cleaner, commits, destroy. The log keeps back from client data
    /// and the cleaner the segments a commit of every dirty node needs (`Log::reserve`), so a
    /// full pool can always commit. O(1). Returns the pool-wide total.
    pub fn note_dirty(&self, slot: &AtomicUsize, dirty: usize) -> usize {
        let prev = slot.swap(dirty, Ordering::Relaxed);
        if prev == dirty {
            return self.dirty_nodes_total.load(Ordering::Relaxed);
        }
        let nodes = if dirty > prev {
            self.dirty_nodes_total
                .fetch_add(dirty - prev, Ordering::Relaxed)
                + (dirty - prev)
        } else {
            self.dirty_nodes_total
                .fetch_sub(prev - dirty, Ordering::Relaxed)
                - (prev - dirty)
        };
        self.log.set_dirty_nodes(nodes);
        nodes
    }

    /// Past the dirty node bound: ask for a commit.
    pub fn commit_if_many_dirty(&self, total: usize) {
        if total > self.log.dirty_nodes_cap() {
            self.wake_maintenance();
        }
    }

    /// The log footprint of one map node record under this layout (lz4 never grows it).
    pub fn node_record_bytes(&self) -> u32 {
        (self
            .red
            .footprint(crate::map::NODE_BYTES)
            .div_ceil(RECORD_ALIGN as usize)
            * RECORD_ALIGN as usize) as u32
    }

    // --- nonces ---

    /// A pool-unique nonce. When the reserved range is used up, `commit` reserves more.
    pub fn next_nonce(&self, commit: impl Fn() -> Result<()>) -> Result<u64> {
        loop {
            let n = self.nonce_next.fetch_add(1, Ordering::AcqRel);
            if n < self.nonce_limit.load(Ordering::Acquire) {
                return Ok(n);
            }
            // Give the number back only in spirit: skipping it is harmless, reusing it is not.
            commit()?;
        }
    }

    /// The first nonce not yet handed out (the next commit reserves a range above it).
    pub fn nonce_next(&self) -> u64 {
        self.nonce_next.load(Ordering::Acquire)
    }

    /// The commit made nonces below `limit` durable as reserved.
    pub fn set_nonce_limit(&self, limit: u64) {
        self.nonce_limit.store(limit, Ordering::Release);
    }

    // --- the put path ---

    /// Place and write records on `stream` (copy `copy` of each: `ptr.addr[copy]` is set):
    /// end to end in runs that fit a segment, one device write per run (per record where the
    /// layout cannot lay records end to end). Every record goes through here: client data,
    /// metadata, the cleaner. Client data waits for space (back-pressure); the cleaner and
    /// metadata do not (`NoSpace` at once). Records placed count in `pending` until the
    /// caller has counted their leaves dirty (client data and the cleaner pass one). On error, what this call placed is released.
    #[track_caller]
    pub fn put(
        &self,
        stream: Stream,
        copy: usize,
        buf: &[u8],
        recs: &mut [Put],
        mut pending: Option<&mut Pending<'_>>,
    ) -> Result<()> {
        let runs = self.red.runs_end_to_end();
        let by = std::panic::Location::caller();
        let mut placed = 0;
        let result = (|| {
            while placed < recs.len() {
                let rest = &recs[placed..];
                // Footprints: a run's records end to end, or one record's shard.
                let lens: Vec<usize> = if runs {
                    rest.iter().map(|r| r.ptr.len as usize).collect()
                } else {
                    vec![self.red.footprint(rest[0].ptr.len as usize)]
                };
                let (addr, count) = loop {
                    match self.log.alloc_run(stream, &lens) {
                        Err(Error::NoSpace) if stream == Stream::Data => {
                            self.wait_for(stream, &lens)?
                        }
                        other => break other?,
                    }
                };
                if let Some(p) = pending.as_deref_mut() {
                    p.add(count);
                }
                self.placed_at(addr);
                let base = rest[0].at;
                let end = rest[count - 1].at + rest[count - 1].ptr.len as usize;
                for r in &mut recs[placed..placed + count] {
                    r.ptr.addr[copy] = addr + (r.at - base) as u64;
                    let footprint = self.red.footprint(r.ptr.len as usize) as u64;
                    self.live.placed(r.ptr.addr[copy], footprint, by);
                }
                placed += count;
                // Cheap invariant, in release too: the log handed out a run that lies inside
                // one segment of this pool (a record never straddles segments).
                assert!(
                    self.red
                        .check_record(&[addr], self.red.footprint(end - base))
                        .is_ok(),
                    "the log placed a run of {} bytes at {addr} outside one segment",
                    end - base
                );
                let wrote = self.red.write(addr, &buf[base..end]);
                if wrote.is_ok() && self.tiered.load(Ordering::Relaxed) {
                    self.note_upload(addr, self.red.footprint(end - base));
                }
                if matches!(stream, Stream::Data | Stream::Clean) {
                    self.log.put_done(addr);
                }
                wrote?;
            }
            Ok(())
        })();
        if result.is_err() {
            for r in &recs[..placed] {
                self.release_addr(r.ptr.addr[copy], r.ptr.len as usize);
            }
        }
        result
    }

    /// Bytes were just placed at `addr` by the log: at a segment's first byte, the segment
    /// has just opened (`Log::alloc_run` opens one only for a run that starts it), and its
    /// devices may read it in before the writes into it (`Redundancy::will_write_segment`).
    /// For every placement that does not go through `put` (intent log slots) too.
    pub fn placed_at(&self, addr: u64) {
        if addr % SEGMENT_BYTES == 0 {
            self.red.will_write_segment(crate::log::segment_of(addr));
        }
    }

    /// The log, for tests that set up its segments by hand.
    #[cfg(test)]
    pub(crate) fn log_for_tests(&self) -> &Log {
        &self.log
    }

    /// At import, with fewer free segments than metadata copies: go on writing the first
    /// metadata stream in the segment of `table`'s first copy (the newest commit's volume
    /// table), after it and after every record of `keep` in that segment (the intent log's
    /// slots there, which a crash before the import's own commit must find as they are).
    /// An import's commit opens its heads afresh: without this it needed a free segment
    /// for its first copies when the pool had none, and the pool could not be imported.
    /// Whatever lies further in that segment was written after the newest commit and is
    /// named by nothing durable. `false`: nothing resumed (no room after them, the segment
    /// is not one the log holds sealed, or the pool has an object tier).
    pub fn resume_meta_head(&self, table: &Blkptr, keep: &[Blkptr]) -> bool {
        let first = table.addr[0];
        // Not with an object tier: a segment's earlier bytes may be the store's alone.
        if first == ADDR_NONE || self.is_tiered() {
            return false;
        }
        let seg = crate::log::segment_of(first);
        let end = std::iter::once(table)
            .chain(keep)
            .flat_map(|p| p.addrs().iter().map(move |&a| (a, p.len)))
            .filter(|&(a, _)| a != ADDR_NONE && crate::log::segment_of(a) == seg)
            .map(|(a, len)| a + self.red.footprint(len as usize) as u64)
            .max()
            .unwrap_or(first);
        let off = (end - seg as u64 * SEGMENT_BYTES).div_ceil(RECORD_ALIGN) * RECORD_ALIGN;
        let resumed = off < SEGMENT_BYTES && self.log.resume_head(Stream::Meta, seg, off as u32);
        if resumed {
            tracing::warn!(
                segment = seg,
                offset = off,
                "fewer free segments than copies of metadata at import: its commit goes on after the last one in the newest volume table's segment"
            );
        }
        resumed
    }

    /// Store metadata records (map nodes, the volume table): lz4-compressed, checksummed,
    /// `METADATA_COPIES` copies in different segments (in one, when no segment can be
    /// opened for the second), end to end per copy.
    #[track_caller]
    pub fn write_meta_batch(&self, raws: &[Vec<u8>]) -> Result<Vec<Blkptr>> {
        let mut buf = Vec::new();
        let mut recs: Vec<Put> = Vec::with_capacity(raws.len());
        for raw in raws {
            let at = buf.len();
            let flags = codec::encode_append(raw, Compression::Lz4, None, &[], 0, &mut buf)?;
            let len = buf.len() - at;
            let sum = checksum(&buf[at..]);
            buf.resize(
                buf.len().div_ceil(RECORD_ALIGN as usize) * RECORD_ALIGN as usize,
                0,
            );
            recs.push(Put {
                at,
                ptr: Blkptr {
                    addr: [ADDR_NONE, ADDR_NONE],
                    nonce: 0,
                    len: len as u32,
                    flags,
                    key_gen: 0,
                    checksum: sum,
                },
            });
        }
        // Metadata is referenced by the commit that writes it, not by a leaf: no `Pending`.
        for (copy, stream) in [Stream::Meta, Stream::Meta2]
            .into_iter()
            .take(METADATA_COPIES)
            .enumerate()
        {
            let mut put = self.put(stream, copy, &buf, &mut recs, None);
            if copy > 0 && matches!(put, Err(Error::NoSpace)) {
                // No segment can be opened for the second copies: they go after the first
                // ones, in their segment (or the next the first stream opens). A commit must
                // not fail for want of a second segment: a pool that cannot commit is
                // poisoned, and one whose import cannot commit is lost to its users. An
                // import opens both heads afresh, so after a commit that took the last
                // segments but one, the next import needed two and failed (found by
                // `bulwark-live --crash` on parity near full). The next commit with room
                // writes its copies apart again.
                tracing::warn!(
                    records = recs.len(),
                    "no free segment for the second copy of metadata: both copies written in one segment"
                );
                put = self.put(Stream::Meta, copy, &buf, &mut recs, None);
            }
            if let Err(e) = put {
                for r in recs.iter().filter(|_| copy > 0) {
                    self.release_addr(r.ptr.addr[0], r.ptr.len as usize);
                }
                return Err(e);
            }
        }
        Ok(recs.into_iter().map(|r| r.ptr).collect())
    }

    /// Store one metadata record (`write_meta_batch`).
    #[track_caller]
    pub fn write_meta(&self, raw: &[u8]) -> Result<Blkptr> {
        Ok(self.write_meta_batch(&[raw.to_vec()])?.remove(0))
    }

    /// Read a metadata record back, verified, decompressed to `raw_len` bytes (0: any length
    /// up to `META_RAW_BYTES_MAX`; longer is `Corrupt`). The stored length is bounded by
    /// `Redundancy::check_record` before the read buffer is sized.
    pub fn read_meta(&self, ptr: &Blkptr, raw_len: usize) -> Result<Vec<u8>> {
        let mut stored = Vec::new();
        self.read_record(ptr.addrs(), ptr.len as usize, &ptr.checksum, &mut stored)?;
        if ptr.flags & codec::FLAG_LZ4 == 0 {
            return Ok(stored);
        }
        if raw_len == 0 {
            return lz4_flex::block::decompress(&stored, META_RAW_BYTES_MAX)
                .map_err(|e| Error::Corrupt(format!("metadata lz4: {e}")));
        }
        let mut out = vec![0u8; raw_len];
        codec::decode(&mut stored, ptr.flags, None, &[], 0, &mut out)?;
        Ok(out)
    }

    // --- the object tier ---

    /// Note every run written from now on for upload (`take_uploads`).
    pub fn set_tiered(&self) {
        self.log.track_freed();
        self.tiered.store(true, Ordering::Release);
    }

    pub fn is_tiered(&self) -> bool {
        self.tiered.load(Ordering::Acquire)
    }

    fn note_upload(&self, addr: u64, len: usize) {
        let seg = (addr / SEGMENT_BYTES) as u32;
        let e = Extent {
            seg,
            inc: self.log.incarnation(seg),
            off: (addr % SEGMENT_BYTES) as u32,
            len: len as u32,
        };
        self.uploads.lock().push(e);
        if self.pace.note_written(len as u64) {
            self.wake_maintenance();
        }
    }

    /// A local cache of `limit` bytes: the maintenance thread is woken as writes near it,
    /// and client writes wait past it (`pace`).
    pub fn set_cache_limit(&self, limit: u64) {
        self.pace.set_limit(limit, self.red.allocated_bytes());
    }

    /// A client write's wait for room in the local cache (`pace::Pace::wait_for_room`):
    /// at once without a cache or under its cap, and in stepped mode (no maintenance
    /// thread to wait for: the simulator runs its steps itself).
    pub fn wait_for_cache_room(&self) {
        if self.pace.cap() > 0 && !self.stepped() {
            self.pace.wait_for_room(self);
        }
    }

    /// Note the whole of segment `seg`, written before this process, for upload (a pool
    /// that had data before it had an object store: its first commit uploads it all).
    pub fn note_segment(&self, seg: u32) {
        if self.is_tiered() {
            self.note_upload(seg as u64 * SEGMENT_BYTES, SEGMENT_BYTES as usize);
        }
    }

    /// Note a record written before this process for upload (the intent log's replay: the
    /// process that wrote it died before its commit could upload it).
    pub fn note_record(&self, p: &Blkptr) {
        if p.is_hole() || !self.is_tiered() {
            return;
        }
        for &a in p.addrs() {
            self.note_upload(a, self.red.footprint(p.len as usize));
        }
    }

    /// The runs written since the last call (each at most once).
    pub fn take_uploads(&self) -> Vec<Extent> {
        std::mem::take(&mut *self.uploads.lock())
    }

    /// Bytes of the runs waiting for the next commit's upload (the object store's lag).
    pub fn pending_upload_bytes(&self) -> u64 {
        self.uploads.lock().iter().map(|e| e.len as u64).sum()
    }

    /// Segments with runs waiting for the next commit's upload.
    pub fn pending_upload_segments(&self) -> std::collections::BTreeSet<u32> {
        self.uploads.lock().iter().map(|e| e.seg).collect()
    }

    /// Put back runs a failed upload took (`take_uploads`): the next commit tries them again.
    pub fn return_uploads(&self, mut extents: Vec<Extent>) {
        let mut u = self.uploads.lock();
        extents.append(&mut u);
        *u = extents;
    }

    // --- the cache device ---

    /// Use `c` as the pool's cache device (once; false if one is already in use).
    pub fn set_cachedev(&self, c: Arc<CacheDevice>) -> bool {
        self.cachedev.set(c).is_ok()
    }

    /// The cache device, if one is in use. Without one, reads cost one atomic load more.
    pub fn cachedev(&self) -> Option<&CacheDevice> {
        self.cachedev.get().map(|c| &**c)
    }

    /// Read the data record `ptr` points to into `out`, verified by its checksum: from the
    /// cache device when it holds a copy that verifies, else from the pool's copies
    /// (repairing bad ones), then offered to the cache. Returns whether it came from the
    /// cache (a caller that then finds it undecodable calls `CacheDevice::reject` and reads
    /// again with `from_pool`).
    pub fn read_data(&self, ptr: &Blkptr, out: &mut Vec<u8>) -> Result<bool> {
        let len = ptr.len as usize;
        let Some(c) = self.cachedev() else {
            self.read_record(ptr.addrs(), len, &ptr.checksum, out)?;
            return Ok(false);
        };
        // Bounded like any read by pointer before the cache sizes a buffer by it.
        self.red.check_record(ptr.addrs(), len)?;
        if c.read(ptr.addr[0], len, &ptr.checksum, out) {
            return Ok(true);
        }
        self.read_record(ptr.addrs(), len, &ptr.checksum, out)?;
        c.offer(ptr.addr[0], &ptr.checksum, &[&out[..len]]);
        Ok(false)
    }

    /// `read_data` from the pool's copies only.
    pub fn read_data_from_pool(&self, ptr: &Blkptr, out: &mut Vec<u8>) -> Result<()> {
        self.read_record(ptr.addrs(), ptr.len as usize, &ptr.checksum, out)
    }

    // --- records the local devices no longer hold (the object tier's local cache) ---

    /// Read the pool's copies of the record of `len` stored bytes at `addrs` (checked
    /// against `sum`, bad copies repaired: `Redundancy::read_verified`), or, with an object
    /// store, the store's when its segment was given back, or when no local copy verifies.
    /// The caller holds the reuse gate.
    pub fn read_record(
        &self,
        addrs: &[u64],
        len: usize,
        sum: &crate::checksum::Checksum,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        self.read_record_noting(addrs, len, sum, out, true)
    }

    /// `read_record` for the cleaner: a record it moves out of a given-back segment does
    /// not count toward bringing that segment back (it is being emptied).
    pub fn read_record_to_move(
        &self,
        addrs: &[u64],
        len: usize,
        sum: &crate::checksum::Checksum,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        self.read_record_noting(addrs, len, sum, out, false)
    }

    /// Read the bytes at `addr..addr + buf.len()` (one segment), unverified, in one device
    /// read, for the cleaner to take several records out of (each then verified against its
    /// checksum; one that fails is read alone, `read_record_to_move`, which repairs).
    /// `Ok(false)`: not read, because the layout does not lay records end to end (parity)
    /// or the segment was given back to the object store: read the records one by one.
    pub fn read_span_to_move(&self, addr: u64, buf: &mut [u8]) -> Result<bool> {
        if !self.red.runs_end_to_end() || self.given_back(&[addr]) {
            return Ok(false);
        }
        self.red.check_record(&[addr], buf.len())?;
        self.red.read_run_scattered(addr, &mut [buf])?;
        Ok(true)
    }

    fn read_record_noting(
        &self,
        addrs: &[u64],
        len: usize,
        sum: &crate::checksum::Checksum,
        out: &mut Vec<u8>,
        note: bool,
    ) -> Result<()> {
        let Some(remote) = self.remote.get() else {
            return self.red.read_verified(addrs, len, sum, out);
        };
        self.red.check_record(addrs, len)?;
        if self.given_back(addrs) {
            let read_ahead = self.read_remote(&**remote, addrs, len, sum, out, false)?;
            if note && !read_ahead {
                self.note_cold(crate::log::segment_of(addrs[0]));
            }
            return Ok(());
        }
        match self.red.read_verified(addrs, len, sum, out) {
            Err(Error::Unrecoverable(local)) => {
                self.read_remote(&**remote, addrs, len, sum, out, false)
                    .map_err(|e| Error::Unrecoverable(format!("{local}; {e}")))?;
                self.remote_reads[2].fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    address = addrs[0],
                    len,
                    "no local copy verified: read from the object store"
                );
                Ok(())
            }
            other => other,
        }
    }

    /// Whether record `p` is read from the object store (a copy of it lies in a segment
    /// the local cache gave back).
    pub fn given_back_record(&self, p: &Blkptr) -> bool {
        self.remote.get().is_some() && self.given_back(p.addrs())
    }

    /// Whether a copy of the record at `addrs` lies in a segment given back to the store.
    fn given_back(&self, addrs: &[u64]) -> bool {
        addrs
            .iter()
            .any(|&a| self.log.is_evicted(crate::log::segment_of(a)))
    }

    /// `len` bytes at `addr` from the object store: from a window read ahead when one
    /// holds them (`true`), else one request, which reads ahead when the read continues a
    /// stream (`store::ahead`). Unverified.
    fn remote_read(&self, remote: &dyn Remote, addr: u64, len: usize) -> Result<(Vec<u8>, bool)> {
        let opening = self.log.incarnation(crate::log::segment_of(addr));
        let want = {
            let mut a = self.ahead.lock();
            if let Some(b) = a.take(addr, len, opening) {
                self.remote_reads[3].fetch_add(1, Ordering::Relaxed);
                return Ok((b, true));
            }
            a.plan(addr, len, opening, ahead::reading_sequentially())
        };
        if want == len {
            return Ok((self.remote_fetch(remote, addr, len, len)?, false));
        }
        let after = addr + len as u64;
        match self.remote_fetch(remote, addr, len, want) {
            Ok(mut b) if b.len() >= len && b.len() <= want => {
                let rest = b.split_off(len);
                self.ahead.lock().keep(after, opening, rest);
                Ok((b, false))
            }
            // A read ahead that failed, or came back longer than asked, costs the read
            // nothing: the record alone is asked for (a store out of reach fails both).
            Ok(_) | Err(Error::Unrecoverable(_) | Error::Corrupt(_) | Error::NotFound(_)) => {
                self.ahead.lock().abandon(after, opening);
                Ok((self.remote_fetch(remote, addr, len, len)?, false))
            }
            Err(e) => {
                self.ahead.lock().abandon(after, opening);
                Err(e)
            }
        }
    }

    /// One request to the store (`want` > `len`: reading ahead), counted as under way
    /// while it runs (`drain_reads`) and in the bytes read from the store.
    fn remote_fetch(
        &self,
        remote: &dyn Remote,
        addr: u64,
        len: usize,
        want: usize,
    ) -> Result<Vec<u8>> {
        let r = self.reuse_gate.remote_read(|| {
            if want > len {
                remote.read_ahead(addr, len, want)
            } else {
                remote.read(addr, len)
            }
        });
        if let Ok(b) = &r {
            self.remote_reads[1].fetch_add(b.len() as u64, Ordering::Relaxed);
        }
        r
    }

    /// The record from the object store, verified by `sum`; `true` when it came from
    /// bytes read ahead. `fresh`: asked of the store itself, never of bytes read ahead
    /// (the scrub checks what the store holds now).
    fn read_remote(
        &self,
        remote: &dyn Remote,
        addrs: &[u64],
        len: usize,
        sum: &crate::checksum::Checksum,
        out: &mut Vec<u8>,
        fresh: bool,
    ) -> Result<bool> {
        let mut last = None;
        for &a in addrs {
            let mut got = if fresh {
                self.remote_fetch(remote, a, len, len).map(|b| (b, false))
            } else {
                self.remote_read(remote, a, len)
            };
            if let Ok((b, true)) = &got {
                if b.len() != len || !crate::checksum::verify(sum, b) {
                    // Never expected (windows are keyed by the segment's opening): ask
                    // the store itself rather than fail on a window's word.
                    self.ahead.lock().forget(crate::log::segment_of(a));
                    got = self.remote_fetch(remote, a, len, len).map(|b| (b, false));
                }
            }
            match got {
                Ok((b, ahead)) if b.len() == len && crate::checksum::verify(sum, &b) => {
                    self.remote_reads[0].fetch_add(1, Ordering::Relaxed);
                    out.clear();
                    out.extend_from_slice(&b);
                    return Ok(ahead);
                }
                Ok(_) => {
                    last = Some(Error::Unrecoverable(format!(
                        "the object store's copy of the {len}-byte record at pool address {a} \
                         does not match its checksum"
                    )))
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| Error::Invalid("a record with no address".into())))
    }

    /// Read the run of `bufs` (concatenated) at `addr`, unverified like
    /// `Redundancy::read_run_scattered`: from the object store in one ranged read when its
    /// segment was given back.
    pub fn read_run_scattered(&self, addr: u64, bufs: &mut [&mut [u8]]) -> Result<()> {
        let remote = self.remote.get().filter(|_| self.given_back(&[addr]));
        let Some(remote) = remote else {
            return self.red.read_run_scattered(addr, bufs);
        };
        let len: usize = bufs.iter().map(|b| b.len()).sum();
        self.red.check_record(&[addr], len)?;
        let (b, read_ahead) = self.remote_read(&**remote, addr, len)?;
        if b.len() != len {
            return Err(Error::Corrupt(format!(
                "the object store gave {} bytes for a run of {len}",
                b.len()
            )));
        }
        self.remote_reads[0].fetch_add(1, Ordering::Relaxed);
        if !read_ahead {
            self.note_cold(crate::log::segment_of(addr));
        }
        let mut at = 0;
        for buf in bufs.iter_mut() {
            buf.copy_from_slice(&b[at..at + buf.len()]);
            at += buf.len();
        }
        Ok(())
    }

    /// Scrub one record (`Redundancy::scrub`); for a record of a segment given back to the
    /// object store, verify the store's copy instead (one ranged GET: no key needed, the
    /// checksum is of the stored bytes). `None`: not checked (the store did not answer).
    /// With `check_store` false, such a record is not checked (`None`): the scrub stops
    /// asking a store that did not answer.
    pub fn scrub_record(
        &self,
        addrs: &[u64],
        len: usize,
        sum: &crate::checksum::Checksum,
        buf: &mut Vec<u8>,
        check_store: bool,
    ) -> Option<crate::redundancy::ScrubOutcome> {
        let remote = self.remote.get().filter(|_| self.given_back(addrs));
        let Some(remote) = remote else {
            return Some(self.scrub_held(addrs, len, sum, buf, check_store));
        };
        if !check_store {
            return None;
        }
        let outcome = |bad: bool| crate::redundancy::ScrubOutcome {
            bad_copies: usize::from(bad),
            repaired: 0,
            unrecoverable: bad,
        };
        match self.read_remote(&**remote, addrs, len, sum, buf, true) {
            Ok(_) => Some(outcome(false)),
            // Bytes that fail their checksum, a missing object, a short one.
            Err(Error::Unrecoverable(e) | Error::Corrupt(e)) => {
                tracing::error!("scrub: {e}");
                Some(outcome(true))
            }
            Err(e) => {
                tracing::warn!("scrub: a record in the object store was not checked: {e}");
                None
            }
        }
    }

    /// `scrub_record` of a record held locally. With an object store, one that no local
    /// copy verifies is judged by the store's copy, as a read takes it (`read_record`):
    /// a segment the local cache was bringing back when the machine stopped
    /// (`pool/evict.rs`) is neither given back (not a hole throughout) nor whole, and its
    /// records are served from the store. Verified there, it is not unrecoverable: the
    /// local copies are left as they are (counted bad), and reads keep going to the store.
    fn scrub_held(
        &self,
        addrs: &[u64],
        len: usize,
        sum: &crate::checksum::Checksum,
        buf: &mut Vec<u8>,
        check_store: bool,
    ) -> crate::redundancy::ScrubOutcome {
        let counted = self.red.unrecoverable_blocks.load(Ordering::Relaxed);
        let local = self.red.scrub(addrs, len, sum, buf);
        let Some(remote) = self
            .remote
            .get()
            .filter(|_| local.unrecoverable && check_store)
        else {
            return local;
        };
        if let Err(e) = self.read_remote(&**remote, addrs, len, sum, buf, true) {
            tracing::warn!("scrub: no local copy verified, nor the object store's: {e}");
            return local;
        }
        if self.red.unrecoverable_blocks.load(Ordering::Relaxed) > counted {
            self.red
                .unrecoverable_blocks
                .fetch_sub(1, Ordering::Relaxed);
        }
        self.remote_reads[2].fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            address = addrs[0],
            len,
            "scrub: no local copy verified; the object store's did (reads take it from there)"
        );
        crate::redundancy::ScrubOutcome {
            unrecoverable: false,
            ..local
        }
    }

    /// A read of given-back segment `seg` went to the store: once it has had
    /// `REFILL_AFTER_READS`, it is wanted back (the maintenance thread brings it back).
    fn note_cold(&self, seg: u32) {
        let mut c = self.cold.lock();
        let (counts, wanted) = &mut *c;
        if counts.len() >= COLD_SEGMENTS_TRACKED {
            counts.clear();
        }
        let n = counts.entry(seg).or_insert(0);
        *n += 1;
        if *n >= REFILL_AFTER_READS && wanted.len() < REFILL_WANTED_MAX && !wanted.contains(&seg) {
            counts.remove(&seg);
            wanted.push(seg);
            drop(c);
            self.wake_maintenance();
        }
    }

    /// The given-back segments read often enough to bring back (each once).
    pub fn take_wanted_back(&self) -> Vec<u32> {
        std::mem::take(&mut self.cold.lock().1)
    }

    /// Whether some given-back segment is wanted back (`note_cold`).
    pub fn wants_back(&self) -> bool {
        !self.cold.lock().1.is_empty()
    }

    /// Put back what `take_wanted_back` gave and was not brought back yet.
    pub fn return_wanted_back(&self, segs: &[u32]) {
        let mut c = self.cold.lock();
        for &s in segs {
            if c.1.len() < REFILL_WANTED_MAX && !c.1.contains(&s) {
                c.1.push(s);
            }
        }
    }

    /// Whether some records may be read from the object store (a local cache gave
    /// segments back): reads then follow streams to read ahead (`ahead`).
    pub fn reads_from_store(&self) -> bool {
        self.remote.get().is_some() && self.log.evicted_count() > 0
    }

    /// Read records of given-back segments from `remote` (once).
    pub fn set_remote(&self, remote: Arc<dyn Remote>) {
        let _ = self.remote.set(remote);
    }

    pub fn remote_reads(&self) -> RemoteReads {
        RemoteReads {
            reads: self.remote_reads[0].load(Ordering::Relaxed),
            bytes: self.remote_reads[1].load(Ordering::Relaxed),
            healed: self.remote_reads[2].load(Ordering::Relaxed),
            ahead_hits: self.remote_reads[3].load(Ordering::Relaxed),
        }
    }

    // --- the release point ---

    /// The one place a reference dies: the record `dead` names (decided in `dies.rs`) is no
    /// longer referenced by the in-memory state, and its space goes back to the log (the
    /// segment it lies in becomes reusable after the next commit, or at once if no commit
    /// ever saw it).
    #[track_caller]
    pub fn release(&self, dead: Dead) {
        let p = &dead.into_ptr();
        if p.is_hole() {
            return;
        }
        // A pointer read from a damaged map may lie outside the pool: there is nothing of
        // ours to release (indexing the segment table with it would panic).
        if let Err(e) = self.red.check_record(p.addrs(), p.len as usize) {
            tracing::error!("not releasing a block pointer outside the pool: {e}");
            return;
        }
        for &a in p.addrs() {
            self.release_addr(a, p.len as usize);
        }
    }

    /// Give one copy's space back (a record of `len` stored bytes at `addr`).
    #[track_caller]
    fn release_addr(&self, addr: u64, len: usize) {
        if addr == ADDR_NONE {
            return;
        }
        let footprint = self.red.footprint(len) as u32;
        self.live
            .released(addr, footprint as u64, std::panic::Location::caller());
        if self.reuse_gate.release(&self.log, addr, footprint) {
            self.wake_maintenance();
        }
    }

    /// Free the recyclable segments (`log` module docs) if a batch is waiting
    /// (`gate::ReuseGate::recycle_if_due`). Called by writers after they released what they
    /// replaced, holding no map lock and not the reuse gate.
    pub fn recycle_if_due(&self) {
        self.reuse_gate.recycle_if_due(&self.log, self.has_remote());
    }

    /// Wait out every read that looked up a pointer before the call
    /// (`gate::ReuseGate::drain`): false when a read waits for the object store and
    /// `patient` is not set.
    pub fn drain_reads(&self, patient: bool) -> bool {
        self.reuse_gate.drain(patient, self.has_remote())
    }

    /// Whether records may be read from an object store (`set_remote`).
    pub fn has_remote(&self) -> bool {
        self.remote.get().is_some()
    }

    // --- back-pressure ---

    /// Room in the next commit for `nodes` map nodes dirtied without placing a record
    /// (`Log::hold_nodes`), waiting for a commit when the pool is short of it.
    pub fn hold_nodes(&self, nodes: usize) -> Result<Pending<'_>> {
        loop {
            match self.log.hold_nodes(nodes) {
                // Wait for exactly what `hold_nodes` checks (a stricter wait would give up
                // while the hold could already succeed).
                Err(Error::NoSpace) => self.wait_until(|| self.log.can_hold_nodes(nodes))?,
                other => return other,
            }
        }
    }

    /// Wait until the run `lens` (footprints) can be placed on `stream`, asking the maintenance
    /// thread to commit and clean: back-pressure, never a failure, while space can still be
    /// reclaimed. Answers `NoSpace` when nothing can be: no sealed segment holds dead bytes
    /// worth cleaning, no commit would free a segment or hand back its room (the pool's live
    /// data fills it), or the maintenance thread's rounds of committing and cleaning have
    /// freed nothing `SPACE_WAIT_FUTILE` times in a row, or after `SPACE_WAIT_MAX` without
    /// any progress.
    fn wait_for(&self, stream: Stream, lens: &[usize]) -> Result<()> {
        self.wait_until(|| self.log.space_available(stream, lens))
    }

    /// A writer's wait would be refused (`why`): let client data into the holes of any
    /// segment with live records until free segments recover (`Log::open_holes_anywhere`,
    /// decision 0014). Whether they may be filled now: false when holes are not filled at
    /// all (off, or an object tier).
    fn open_holes_anywhere(&self, why: &str) -> bool {
        if self.log.open_holes_anywhere() {
            tracing::info!(
                holes = ?self.log.holes(),
                "space is short ({why}): client writes fill the holes of any segment that \
                 holds live data until free segments recover"
            );
        }
        self.log.holes_anywhere()
    }

    /// What the next commit gives writers without the cleaner, now (`CommitRoom`).
    fn commit_room(&self) -> CommitRoom {
        CommitRoom {
            emptied: self.log.zero_sealed().len(),
            holes_anywhere: self.log.holes_anywhere(),
            commit_need: self.log.commit_need(0),
            holes_bytes: self.log.holes().bytes,
            holes_pending: self.log.holes_pending(),
            holes_committing: self.log.holes_committing(),
        }
    }

    /// `wait_for` until `ready`. Progress is free space gained net: the deadline
    /// (`SPACE_WAIT_MAX`) moves out only when free segments rise above the most seen
    /// since the wait began, never past `SPACE_WAIT_HARD` from its start (a count of
    /// segments freed, which a cleaner that writes what it frees keeps raising, kept a
    /// writer waiting forever: issue 36). Stuck cleaning answers at once, unless the next
    /// commit gives room without the cleaner: segments whose every record is gone (freed
    /// whole: overwrites empty segments while the live total, which is what unsticks the
    /// cleaner, stays the same), or holes (`CommitRoom`).
    fn wait_until(&self, ready: impl Fn() -> bool) -> Result<()> {
        let refused = |why: &str| {
            // Before refusing: the holes of any segment with live records, not only of
            // nearly full ones (decision 0014).
            if self.open_holes_anywhere(why) && ready() {
                return Ok(());
            }
            let free = self.log.free_segments();
            // The one record of why: what the pool looked like when it refused.
            if let Some(unlogged) = self.refusal_log.lock().admit(crate::env::now(), why) {
                tracing::warn!(
                    free,
                    client_floor = self.log.reserve(Stream::Data, 0),
                    commit_need = self.log.commit_need(0),
                    clean_budget = self.log.clean_budget(),
                    clean_for_records = self.log.clean_budget_for_records(),
                    holes = ?self.log.holes(),
                    next_commit = ?self.commit_room(),
                    victim = self.log.any_victim(),
                    unlogged,
                    "a writer's wait for space refused: {why}"
                );
            }
            self.note_refusal(why, free);
            Err(Error::NoSpace)
        };
        let start = crate::env::now();
        let hard = start + SPACE_WAIT_HARD;
        let mut deadline = start + SPACE_WAIT_MAX;
        let mut best_free = self.log.free_segments();
        let mut futile = 0;
        while !ready() {
            self.check_poisoned()?;
            let now = crate::env::now();
            if now >= deadline || now >= hard || self.closing.load(Ordering::Relaxed) {
                return refused(
                    "waited its bound (30 s without a free segment gained, or 90 s in all)",
                );
            }
            if self.clean_unstuck_if_freed() && !self.commit_room().gives_room() {
                return refused("cleaning is stuck (the cleaning line says why)");
            }
            let rounds_before = self.clean_rounds.load(Ordering::Acquire);
            self.space_wanted.store(true, Ordering::Release);
            if let Some(round) = self.stepper.get() {
                // Stepped: nothing runs beside us. Run the round we would wait for, as long
                // as the wait would have slept.
                crate::env::sleep(SPACE_WAIT_TICK);
                round();
            } else {
                self.wake_maintenance();
                let mut g = self.space_wait.lock();
                self.log.space.wait_for(&mut g, SPACE_WAIT_TICK);
                drop(g);
            }
            if ready() {
                break;
            }
            let free = self.log.free_segments();
            if free > best_free {
                best_free = free;
                futile = 0;
                deadline = (crate::env::now() + SPACE_WAIT_MAX).min(hard);
            } else if self.clean_rounds.load(Ordering::Acquire) > rounds_before {
                futile += 1;
                if futile >= SPACE_WAIT_FUTILE {
                    return refused("cleaning rounds gained no free segment: at this fill, moving records and rewriting the map nodes that point at them costs what cleaning frees (random small writes); trim, destroy snapshots or add space");
                }
            }
            // A full pool answers at once: nothing a commit would free or hand back (its
            // room for map nodes), nothing worth cleaning.
            let reclaimable = self.log.commit_need(0) > 0
                || self.commit_room().gives_room()
                || self.log.any_victim();
            if !reclaimable {
                return refused("nothing to reclaim: no dead bytes worth cleaning, nothing for a commit to free");
            }
        }
        Ok(())
    }
}

/// What the next commit gives a writer without the cleaner (`Store::wait_until`): with
/// cleaning stuck, a writer short of space is refused at once unless it does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct CommitRoom {
    /// Sealed segments whose every record is gone: freed whole by the next commit
    /// (overwrites empty segments while the live total, which is what unsticks the
    /// cleaner, stays the same).
    emptied: usize,
    /// Writes may fill the holes of any live segment (`Log::open_holes_anywhere`).
    holes_anywhere: bool,
    /// Segments the next commit needs for the map nodes dirty now.
    commit_need: u32,
    /// Bytes in holes known now.
    holes_bytes: u64,
    /// Records released since the last commit began: holes after the next.
    holes_pending: bool,
    /// Records a commit under way took when it began: holes once it is durable.
    holes_committing: bool,
}

impl CommitRoom {
    /// Whether waiting for the next commit (bounded by `SPACE_WAIT_FUTILE` rounds, as every
    /// wait) can give room: emptied segments, or, with holes anywhere, holes that the
    /// commit's room for dirty map nodes keeps writers from, records that become holes
    /// after it, or those of a commit under way (then nothing is dirty and nothing is
    /// pending, yet holes are a moment away).
    fn gives_room(&self) -> bool {
        self.emptied > 0
            || (self.holes_anywhere
                && ((self.commit_need > 0 && (self.holes_bytes > 0 || self.holes_pending))
                    || self.holes_committing))
    }
}

#[cfg(test)]
mod tests {
    use super::{CommitRoom, RefusalLog, REFUSAL_LOG_EVERY};

    /// Near full, refusals came 10-18 a second, each a journal line: now the first, one
    /// per `REFUSAL_LOG_EVERY` after it (saying how many went unlogged), and any with a
    /// new reason.
    #[test]
    fn refusals_for_space_are_logged_once_per_interval_with_the_count_left_out() {
        let t0 = std::time::Instant::now();
        let mut log = RefusalLog::default();
        let stuck = "cleaning is stuck";
        assert_eq!(log.admit(t0, stuck), Some(0), "the first is logged");
        for ms in 1..=15 {
            let at = t0 + std::time::Duration::from_millis(ms * 60);
            assert_eq!(
                log.admit(at, stuck),
                None,
                "refusal {ms} within the interval"
            );
        }
        let other = "waited its bound";
        assert_eq!(
            log.admit(t0 + std::time::Duration::from_secs(1), other),
            Some(15),
            "a new reason is logged at once, with those left out"
        );
        assert_eq!(
            log.admit(t0 + std::time::Duration::from_secs(2), other),
            None
        );
        assert_eq!(
            log.admit(
                t0 + std::time::Duration::from_secs(1) + REFUSAL_LOG_EVERY,
                other
            ),
            Some(1),
            "one interval after the last line, the next is logged"
        );
    }

    /// With cleaning stuck, the writers of `test_space_at_fill` (`single-fill-holes-0.9`,
    /// random 4 KiB overwrites at 90%) were refused in three states the next commit would
    /// have ended; each is a reason to wait now, and a state with none is not.
    #[test]
    fn stuck_cleaning_waits_for_a_commit_that_gives_room() {
        // 54e2bc1: segments emptied by overwrites, nothing else.
        let emptied = CommitRoom {
            emptied: 2,
            ..Default::default()
        };
        assert!(emptied.gives_room());
        // 765c912: holes known, the commit's room for dirty nodes keeps writers from them.
        let known = CommitRoom {
            holes_anywhere: true,
            commit_need: 2,
            holes_bytes: 8 << 20,
            ..Default::default()
        };
        assert!(known.gives_room());
        // The refusal logged with nothing dirty and 0.5 MB of holes no write could take,
        // 0.64 s after 11 MB of holes were opened: the commit under way had taken the
        // records those writes released (refused before this was looked at).
        let committing = CommitRoom {
            holes_anywhere: true,
            commit_need: 0,
            holes_bytes: 522_224,
            holes_committing: true,
            ..Default::default()
        };
        assert!(committing.gives_room());
        // Nothing coming: refused at once.
        let none = CommitRoom {
            holes_committing: false,
            ..committing
        };
        assert!(!none.gives_room());
        // Holes opened only for writers about to be refused: without, they wait for no
        // commit (the cleaner's stuck answer stands).
        assert!(!CommitRoom {
            holes_anywhere: false,
            ..committing
        }
        .gives_room());
    }
}
