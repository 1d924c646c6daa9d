//! The object tier (issue 22, decision 0012, docs/object-store.md): a pool whose durable
//! copy is in an object store (S3 and those that speak its dialect), its local devices
//! holding the same bytes (every byte, or, with a cache size, the ones `evict` keeps). The
//! store's own side is `crate::tier` (`ObjectStore`, `probe`).
//!
//! What the bucket holds, all written by the commit (`publish`), before the local labels:
//! - `seg/EPOCH/SEQ`: the bytes `Store::put` wrote since the last commit, as *parts* (runs
//!   of neighbouring writes in a segment, joined), packed into objects of about
//!   `BUNDLE_BYTES` (8 MiB); a segment past `PARTS_PER_SEGMENT_MAX` parts is uploaded whole
//!   as one. Written once, never changed; a segment emptied and reused gets new parts, and
//!   its old ones are left to collection (`collect`).
//! - `table/EPOCH/SEQ`: the segment table, in pages of `PAGE_SEGMENTS` segments: which
//!   parts hold which bytes of each segment. A commit's changes go into the superblock
//!   object as a delta; pages are written again only once the delta passes
//!   `DELTA_BYTES_MAX` (8 KiB).
//! - `superblock`: the one object updated in place, always by compare-and-swap on the
//!   version this writer last wrote: the writer's epoch and name, the generation, every
//!   member's label (the local superblock bytes, MACed under the pool key), and the pages'
//!   names with their blake3. The whole object carries a MAC under a key derived from the
//!   pool key, so the bucket's operator can neither forge nor alter it, and everything
//!   else is reached from it by collision-resistant checksums (decision 0011).
//!
//! Fencing: a takeover (`take`) writes epoch + 1 conditionally on the version it read; it
//! refuses another writer's pool unless exported or forced, and a local copy at another
//! generation. A writer whose conditional write is refused has been taken over: the
//! commit fails with `Fenced`, naming the new holder, and the pool is poisoned (no write
//! is acknowledged again). A refusal that may be our own earlier try, whose reply was
//! lost, is told apart by reading the object back. `check` looks for a takeover while
//! clients come (at most every `TIER_CHECK_INTERVAL`).
//!
//! Also here: `catch_up` (a crash after the store took a commit and before the local
//! labels did), the store's health for `status` (`TierStatus`: HELD, FAILING, UNREACHABLE,
//! FENCED; the pool DEGRADED while it fails), a takeover deferred while the store does not
//! answer and every byte is local (`attach_late`: commits stay local until it answers,
//! then the next one catches it up), `restore` (`pool import --object-store`: device files
//! rebuilt from the bucket and the pool key; with a cache size, client data stays in the
//! store), and `set_opener` (how the binary lets every open reach the store `pool.json`
//! names). `Tier` is the data plane's `store::Remote`: `Store::read_record` reads a record
//! of a given-back segment, or one no local copy verifies, by one ranged GET.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use super::format::superblock::{Check, SbKey, Superblock};
use crate::constants::SEGMENT_BYTES;
use crate::hex::to_hex;
use crate::store::{Extent, Store};
use crate::tier::{Cond, ObjectStore, PutIf, Version};
use crate::{Error, Result};

mod objects;
#[cfg(test)]
mod pool_tests;
mod restore;

pub use objects::{
    decode_delta, decode_page, encode_delta, encode_page, load, object_key, Found, Head, PageRef,
    Part, Requests, Slot, PAGE_SEGMENTS, SUPERBLOCK_OBJECT,
};
use objects::{
    Counted, BUNDLE_BYTES, DELTA_BYTES_MAX, MAGIC, PARTS_PER_SEGMENT_MAX,
    SUPERBLOCK_OBJECT_BYTES_MAX, UPLOADS_AT_ONCE,
};
pub use restore::{restore, RestoreReport};

/// How long one commit may take to upload before it gives up (`StoreUnavailable`): a
/// FLUSH fails by then instead of hanging past the client's own timeout.
const PUBLISH_BUDGET: std::time::Duration = std::time::Duration::from_secs(60);
/// Bytes per second a commit's budget grows by with what it uploads (a slow store's pace).
const PUBLISH_PACE: u64 = 4 << 20;

/// How the pool asks to use its object store (`OpenOptions::tier`).
#[derive(Clone)]
pub struct TierOpen {
    pub store: Arc<dyn ObjectStore>,
    /// Who writes: kept in `pool.json`, shown to a host that finds itself fenced.
    pub writer: String,
    /// A new pool: the store must hold no superblock yet.
    pub create: bool,
    /// Take the pool although another writer holds it and did not export it (its host is
    /// gone: `pool import --force`).
    pub force: bool,
    /// How old an object no commit references must be before it is deleted
    /// (`Tier::collect`): an import on another host reading the commit before may still
    /// fetch it until then.
    pub gc_grace: std::time::Duration,
    /// A FLUSH is made durable by the local intent log, and reaches the store with the
    /// next commit (`ObjectStoreConfig::local_flush`).
    pub local_flush: bool,
    /// The local cache's size (`ObjectStoreConfig::cache_bytes`): past it, segments of
    /// client data the store holds are given back locally (`Core::evict`). `None`: the
    /// local devices keep everything.
    pub cache_bytes: Option<u64>,
    /// A store that does not answer at import does not stop it when every byte is local
    /// (no `cache_bytes`): the pool serves, commits locally, and takes the store once it
    /// answers (`Tier::attach_late`). `serve` sets it; `pool import` and `create` do not.
    pub defer_unreachable: bool,
    /// The store was accepted without honouring conditional writes
    /// (`--object-store-single-host`): a deferred takeover does not probe it again.
    pub single_host: bool,
}

impl std::fmt::Debug for TierOpen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierOpen")
            .field("store", &self.store.describe())
            .field("writer", &self.writer)
            .field("create", &self.create)
            .field("force", &self.force)
            .field("gc_grace", &self.gc_grace)
            .field("local_flush", &self.local_flush)
            .field("cache_bytes", &self.cache_bytes)
            .field("defer_unreachable", &self.defer_unreachable)
            .field("single_host", &self.single_host)
            .finish()
    }
}

/// How this program reaches the store a `pool.json` names (the engine has no client of
/// its own): set once by the binary (`set_opener`), used by every import of a pool with an
/// object store that was not given one (`OpenOptions::tier`), so that no path opens such
/// a pool and commits without publishing.
pub type Opener =
    fn(&std::path::Path, &super::format::config::ObjectStoreConfig) -> Result<TierOpen>;

static OPENER: std::sync::OnceLock<Opener> = std::sync::OnceLock::new();

pub fn set_opener(f: Opener) {
    let _ = OPENER.set(f);
}

/// The store of `conf`, through the opener.
pub(crate) fn open_configured(
    dir: &std::path::Path,
    conf: &super::format::config::ObjectStoreConfig,
) -> Result<TierOpen> {
    match OPENER.get() {
        Some(open) => open(dir, conf),
        None => Err(Error::Invalid(format!(
            "this pool keeps its durable copy in the object store {}, and this program cannot \
             reach object stores",
            conf.url
        ))),
    }
}

/// A host that crashed after the store took a commit and before its own labels did: its
/// devices are one generation behind the store, with every byte of the store's generation
/// (they were synced before the upload). Their labels are brought to the store's; nothing
/// else changes. Only for this writer's own commits (another writer's are judged by
/// `Tier::take`).
pub(crate) fn catch_up(
    dir: &std::path::Path,
    open: &TierOpen,
    pool_id: &[u8; 16],
    devices: &[(std::path::PathBuf, crate::device::FileDevice)],
) -> Result<()> {
    use crate::device::Device;
    let key = crate::keys::pool_key::PoolKey::load(&super::format::config::key_path(dir))?;
    let sb_key = key.superblock_key(pool_id);
    let got = match open
        .store
        .get(SUPERBLOCK_OBJECT, SUPERBLOCK_OBJECT_BYTES_MAX)
    {
        // Not answering: the takeover is deferred (`Tier::take`), and it catches up a
        // commit of ours the labels lack by uploading again.
        Err(e) if open.defer_unreachable && open.cache_bytes.is_none() && unreachable(&e) => {
            return Ok(())
        }
        other => other?,
    };
    let Some((bytes, _)) = got else {
        return Ok(());
    };
    let head = Head::open(&bytes, &object_key(&sb_key))?;
    if head.writer != open.writer {
        return Ok(());
    }
    let labels = head.superblocks(&sb_key)?;
    let raw = head.label_bytes()?;
    // Only a generation this host announced (`anchor`: synced before its devices were
    // flushed and the upload began). Another attempt at the same generation may have been
    // announced since (the store took an attempt whose answer was lost, a later one did
    // not get through): the devices hold the bytes of both (nothing is freed before a
    // commit succeeds), and the anchor is brought to the store's.
    let Some(anchor) = super::format::anchor::read(dir)? else {
        return Ok(());
    };
    if anchor.next.0 != head.generation || anchor.committed.0 + 1 != head.generation {
        return Ok(());
    }
    let digest = super::format::anchor::digest(&labels[0]);
    if anchor.next.1 != digest {
        super::format::anchor::write(
            dir,
            &super::format::anchor::Anchor {
                seq: anchor.seq + 1,
                next: (head.generation, digest),
                nonce_reserved: anchor.nonce_reserved.max(labels[0].nonce_reserved),
                ..anchor
            },
        )?;
    }
    let back_region =
        crate::constants::DEVICE_RESERVED_FRONT + labels[0].segments_per_device * SEGMENT_BYTES;
    for (path, dev) in devices {
        let Some(local) =
            super::format::labels::best_superblock(dev, Some(back_region), Check::Key(&sb_key))
        else {
            continue;
        };
        if local.pool_id != *pool_id || local.generation + 1 != head.generation {
            continue;
        }
        let Some(i) = labels.iter().position(|l| l.device_id == local.device_id) else {
            continue;
        };
        for off in Superblock::slot_offsets(head.generation, back_region) {
            dev.write_at(&raw[i], off)
                .map_err(|e| Error::device(path, e))?;
        }
        dev.flush().map_err(|e| Error::device(path, e))?;
        tracing::warn!(
            device = %path.display(),
            generation = head.generation,
            "label brought to the object store's generation: the last commit reached the store \
             before this host could write its labels"
        );
    }
    Ok(())
}

/// A segment's bytes from the store, part by part: (offset in the segment, bytes).
pub type SegmentBytes = Vec<(u32, Vec<u8>)>;

/// The pool's side of its object store, held by the `Core` while it serves.
pub struct Tier {
    pub store: Arc<dyn ObjectStore>,
    counted: Arc<Counted>,
    key: Zeroizing<[u8; 32]>,
    /// The pool's superblock key: the labels in the store's superblock are checked under it.
    sb_key: SbKey,
    /// How the store has answered commits and checks (`status`).
    health: Mutex<Health>,
    /// Set while the store is not taken yet: it did not answer when the pool was imported
    /// (`TierOpen::defer_unreachable`). Commits are local until `attach_late`.
    pending: Mutex<Option<Pending>>,
    /// Bytes the commit under way is uploading (counted in the lag until it lands).
    uploading_bytes: std::sync::atomic::AtomicU64,
    /// When this run took (or tried to take) the store: the lag counts from here until a
    /// commit reaches it.
    started: std::time::SystemTime,
    /// Set by a deferred takeover that succeeded (`take_catch_up`).
    catch_up_wanted: std::sync::atomic::AtomicBool,
    st: Mutex<State>,
    /// Set once a conditional write was refused for another writer's: why, for `status`.
    pub fenced: Mutex<Option<String>>,
    gc_grace: std::time::Duration,
    local_flush: bool,
    /// When the last collection ran (`None`: not yet in this run), objects deleted, and
    /// commits published as of then.
    collected: Mutex<(Option<std::time::Instant>, u64, u64)>,
    /// The local cache's size (`TierOpen::cache_bytes`).
    pub cache_bytes: Option<u64>,
    /// Segments given back locally in this run.
    pub evicted_total: std::sync::atomic::AtomicU64,
    /// Segments brought back from the store in this run (read often: `Core::bring_back`).
    pub refilled_total: std::sync::atomic::AtomicU64,
    /// No device could give space back (block devices, a file system without hole
    /// punching): the local cache stops trying.
    pub cache_unsupported: std::sync::atomic::AtomicBool,
    /// Held by the local cache's passes (`Core::evict`, `Core::bring_back`): never two
    /// at once, whoever calls them.
    pub cache_lock: Mutex<()>,
    /// The first commit to a store this pool was just given (`TierOpen::create`) may
    /// upload all its data: its budget grows with the bytes. Later commits keep the
    /// minute.
    first_upload: std::sync::atomic::AtomicBool,
}

/// What a fenced host does to serve the pool again: a restart is refused (its local copy
/// is stale), so the pool is imported from the store into a new directory.
pub const TAKE_BACK: &str = "This directory's copy is stale and will not serve again: stop \
    this daemon; to serve the pool on this host, export it on the host that took it \
    ('bulwark pool export'), then 'bulwark pool import --object-store URL \
    --object-store-credentials FILE --pool-key DIR/pool.key --dir NEWDIR' and serve NEWDIR \
    (docs/runbook.md, \"fenced\")";

/// Issue 41: the store and this host's devices at different generations, refused in one
/// line naming both, which side is newer, and the command that keeps it; an import from
/// the store names --min-generation (the binary fills DIR in).
fn generation_refusal(url: &str, s: u64, generation: u64) -> Error {
    let imp = format!(
        "bulwark pool import --object-store {url} --object-store-credentials FILE --pool-key \
         DIR/pool.key --dir NEWDIR --force --min-generation"
    );
    Error::Invalid(if s < generation {
        format!(
            "the object store {url} is at generation {s}, this host's devices at generation \
             {generation}: this host's devices are newer (the store was rolled back: an older \
             copy of its superblock object was put back). To keep the newer devices, give the \
             pool a store that holds them: 'bulwark --pool DIR pool object-store remove \
             --force', then 'bulwark --pool DIR pool object-store add URL2 \
             --object-store-credentials FILE' (URL2: a new prefix, or this one emptied). Do not \
             import from this store: that takes generation {s} and fences this host ('{imp} \
             {generation}' refuses it)"
        )
    } else {
        format!(
            "the object store {url} is at generation {s}, this host's devices at generation \
             {generation}: the store is newer (it took commits these devices do not have: \
             another host, or these devices were restored from an older copy). To keep the \
             store's newer state, import it into a new directory: '{imp} {s}', and serve NEWDIR \
             (this directory's copy is stale)"
        )
    })
}

/// How often a pool that could not reach its store at import tries again.
const RETRY_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// A takeover left for when the store answers (`Tier::attach_late`).
struct Pending {
    open: TierOpen,
    /// The local generation at import: what the store must hold if it is ours.
    generation: u64,
    tried: std::time::Instant,
}

/// How the store answered this run, for `status`.
#[derive(Default)]
struct Health {
    /// When the current run of failures began (`None`: the last commit or check went
    /// through).
    failing_since: Option<std::time::SystemTime>,
    /// The last failure, one line naming the cause the server gave.
    last_error: Option<String>,
    /// When a commit last reached the store.
    last_commit: Option<std::time::SystemTime>,
    commits_ok: u64,
    commits_failed: u64,
}

/// Whether `e` says the store did not answer (or failed), as against a refusal that
/// judges the pool (another holder, another generation, a bad object).
fn unreachable(e: &Error) -> bool {
    matches!(e, Error::Io(_) | Error::StoreUnavailable(_))
}

fn unix_secs(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// What `Tier::collect` did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Collected {
    pub deleted: usize,
    /// Unreferenced, but younger than the grace period.
    pub young: usize,
    pub referenced: usize,
}

struct State {
    /// What this writer last wrote (or read, at a takeover).
    head: Head,
    /// Its version: the condition of the next write (`None`: create, no object yet).
    version: Option<Version>,
    slots: BTreeMap<u32, Slot>,
    pages: BTreeMap<u32, PageRef>,
    /// The next object sequence number to hand out: advanced by every name given, also
    /// by a commit that failed (its objects may have landed), so no name is used twice.
    named: u64,
    /// Commits published in this run (collection runs only when there were some).
    published: u64,
    /// Segments whose slot changed since their page was written: the head's delta.
    delta_segs: BTreeSet<u32>,
}

/// The object store in `status`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TierStatus {
    /// HELD (commits reach the store), FAILING (the last commit or check did not: see
    /// `last_error`; the pool is DEGRADED), UNREACHABLE (not answering since the pool was
    /// imported: commits are local until it does), FENCED (another host took the pool).
    #[serde(default)]
    pub state: String,
    /// Since when (seconds since the Unix epoch) commits or checks have failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failing_since: Option<u64>,
    /// The last failure, one line naming the cause the server gave.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// When a commit last reached the store (seconds since the Unix epoch; none yet in
    /// this run: absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_commit: Option<u64>,
    /// Commits that reached the store, and that did not, in this run.
    #[serde(default)]
    pub commits_ok: u64,
    #[serde(default)]
    pub commits_failed: u64,
    /// Requests that failed in this run, by kind of cause (`timeout`, `connect`,
    /// `no_such_bucket`, `signature_does_not_match`, ...).
    #[serde(default)]
    pub request_errors: BTreeMap<String, u64>,
    /// Bytes written locally that the store does not hold yet (runs waiting for a commit's
    /// upload, and those the commit under way is uploading).
    #[serde(default)]
    pub lag_bytes: u64,
    /// How long the store has lacked them: seconds since the last commit that reached it
    /// (since the start when none did), 0 when it lacks nothing.
    #[serde(default)]
    pub lag_seconds: f64,
    /// The writer that took the pool, when fenced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fenced_by: Option<String>,
    /// What to do to serve the pool again, when fenced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub take_back: Option<String>,
    pub url: String,
    pub writer: String,
    pub epoch: u64,
    pub generation: u64,
    pub segments_stored: usize,
    pub parts: usize,
    pub fenced: Option<String>,
    /// Objects deleted by garbage collection in this run.
    #[serde(default)]
    pub collected: u64,
    /// Requests made to the store in this run (the takeover's on).
    #[serde(default)]
    pub requests: Requests,
    /// "store" (a FLUSH returns once the store has it) or "local" (once the local devices
    /// do; the store gets it with the next commit).
    #[serde(default)]
    pub flush: String,
    /// The local cache, when the pool has a size for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheStatus>,
    /// Reads the store served: of records in segments given back, and of records no local
    /// copy verified.
    #[serde(default)]
    pub remote_reads: u64,
    #[serde(default)]
    pub remote_read_bytes: u64,
    #[serde(default)]
    pub healed_from_store: u64,
    /// Of `remote_reads`, those served from bytes read ahead of a sequential read (no
    /// request of their own).
    #[serde(default)]
    pub read_ahead_hits: u64,
}

/// The local cache of a pool whose object store holds everything (`pool create
/// --object-store-cache-size`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CacheStatus {
    /// What the local devices may take before segments are given back.
    pub limit_bytes: u64,
    /// What they take now (allocated blocks of the device files).
    pub local_bytes: u64,
    /// Segments whose bytes only the store holds now.
    pub evicted_segments: u64,
    /// Segments given back in this run.
    pub evicted_total: u64,
    /// Segments brought back whole in this run, having been read from the store often.
    #[serde(default)]
    pub refilled_total: u64,
    /// Client writes that waited for the store to take room back (past the size and one
    /// wake interval: `store::pace`), and how long they waited in all.
    #[serde(default)]
    pub paced_writes: u64,
    #[serde(default)]
    pub paced_seconds: f64,
}

impl Tier {
    /// Take the pool at the local generation `local` (the devices' newest superblock): a
    /// new pool (`create`: the store must hold none), or the one in the store, whose
    /// generation must be the local one and whose writer must be `open.writer` unless the
    /// pool was exported or `force`. Writes epoch + 1 conditionally: another host that
    /// takes the pool at the same time makes this fail, never both succeed.
    pub fn take(open: &TierOpen, sb_key: &SbKey, local: &Superblock) -> Result<Tier> {
        let pool_id = to_hex(&local.pool_id);
        let counted = Arc::new(Counted {
            inner: open.store.clone(),
            n: Default::default(),
        });
        let tier = Tier {
            store: counted.clone(),
            counted,
            key: object_key(sb_key),
            sb_key: sb_key.clone(),
            st: Mutex::new(State {
                named: 0,
                published: 0,
                delta_segs: BTreeSet::new(),
                head: Head {
                    magic: MAGIC.into(),
                    pool_id: pool_id.clone(),
                    epoch: 0,
                    writer: open.writer.clone(),
                    session: String::new(),
                    generation: local.generation,
                    seq_next: 0,
                    labels: Vec::new(),
                    pages: Vec::new(),
                    delta: String::new(),
                },
                version: None,
                slots: BTreeMap::new(),
                pages: BTreeMap::new(),
            }),
            fenced: Mutex::new(None),
            gc_grace: open.gc_grace,
            local_flush: open.local_flush,
            collected: Mutex::new((None, 0, 0)),
            cache_bytes: open.cache_bytes,
            evicted_total: Default::default(),
            refilled_total: Default::default(),
            cache_unsupported: Default::default(),
            cache_lock: Mutex::new(()),
            first_upload: std::sync::atomic::AtomicBool::new(open.create),
            health: Mutex::new(Health::default()),
            pending: Mutex::new(None),
            uploading_bytes: Default::default(),
            started: crate::env::system_time(),
            catch_up_wanted: Default::default(),
        };
        match tier.attach(open, local.generation, false) {
            Ok(_) => Ok(tier),
            // Every byte is local (no local cache gives data back): serve, commit locally,
            // and take the store once it answers (`attach_late`).
            Err(e) if open.defer_unreachable && open.cache_bytes.is_none() && unreachable(&e) => {
                tracing::warn!(
                    "{e}. Serving from the local devices: commits stay local (a FLUSH is durable \
                     on them) until the store answers, then it catches up"
                );
                tier.note_failure(&e);
                *tier.pending.lock() = Some(Pending {
                    open: open.clone(),
                    generation: local.generation,
                    tried: crate::env::now(),
                });
                Ok(tier)
            }
            Err(e) => Err(e),
        }
    }

    /// The takeover: read what the store holds, check it against this host (`take`), and
    /// write epoch + 1 by compare-and-swap. `late`: the pool has served from its local
    /// devices since it was imported at `generation` (the store was unreachable): another
    /// writer's pool is then a fencing, not a refusal, and a store at another generation
    /// of ours is caught up by uploading every segment that holds data. Ok(whether it
    /// must be).
    fn attach(&self, open: &TierOpen, generation: u64, late: bool) -> Result<bool> {
        let store = &*open.store;
        let pool_id = self.st.lock().head.pool_id.clone();
        let found = load(store, &self.key)?;
        let (mut head, version, (slots, delta_segs)) = match (found, open.create) {
            (Some(_), true) => {
                return Err(Error::Exists(format!(
                    "the object store {} already holds a pool: give each pool its own prefix \
                     (s3://BUCKET/PREFIX)",
                    store.describe()
                )))
            }
            (None, false) => {
                return Err(Error::NotFound(format!(
                    "the object store {} holds no pool (no '{SUPERBLOCK_OBJECT}' object)",
                    store.describe()
                )))
            }
            (None, true) => (self.st.lock().head.clone(), None, Default::default()),
            (Some(f), false) => (f.head, Some(f.version), (f.slots, f.delta_segs)),
        };
        if head.pool_id != pool_id {
            return Err(Error::Invalid(format!(
                "the object store {} holds pool {}, not this pool ({pool_id})",
                store.describe(),
                head.pool_id
            )));
        }
        let mut reseed = false;
        if version.is_some() {
            let exported = head.superblocks(&self.sb_key)?.iter().all(|l| l.exported);
            if head.writer != open.writer && !exported && !open.force {
                if late {
                    let (b, _) = store
                        .get(SUPERBLOCK_OBJECT, SUPERBLOCK_OBJECT_BYTES_MAX)?
                        .unzip();
                    return Err(self.fenced(b));
                }
                return Err(Error::Busy(format!(
                    "the pool in {} is held by '{}' (epoch {}, generation {}), which did not \
                     export it. If that host is gone for good, take the pool over with \
                     'bulwark pool import --object-store URL --force' (its unflushed writes \
                     are lost, and it is fenced: its next flush fails)",
                    store.describe(),
                    head.writer,
                    head.epoch,
                    head.generation
                )));
            }
            if head.generation != generation {
                // Late, ours, and one commit ahead: its answer was lost (below). Further ahead,
                // the store is newer than these devices: refused, never overwritten.
                if !late || head.writer != open.writer || head.generation > generation + 1 {
                    return Err(generation_refusal(
                        &store.describe(),
                        head.generation,
                        generation,
                    ));
                }
                // A commit of ours reached the store before the restart without its local
                // labels (its answer was lost): this run's local commits went on from the
                // generation before. Every segment holding data goes up again whole.
                reseed = true;
            }
        }
        let pages = head.pages.iter().map(|p| (p.index, p.clone())).collect();
        head.epoch += 1;
        head.writer = open.writer.clone();
        head.session = to_hex(&crate::keys::wrap::random_bytes::<16>());
        {
            let mut st = self.st.lock();
            *st = State {
                named: head.seq_next,
                published: 0,
                delta_segs,
                head: head.clone(),
                version: version.clone(),
                slots,
                pages,
            };
        }
        if version.is_some() {
            // The takeover itself: epoch + 1, nothing else changed.
            let v = self.cas(&head, version.as_ref())?;
            self.st.lock().version = Some(v);
            tracing::info!(
                store = %store.describe(),
                epoch = head.epoch,
                generation = head.generation,
                "object store taken"
            );
        }
        Ok(reseed)
    }

    /// Whether the store has not been taken yet (it was unreachable when the pool was
    /// imported): commits are local only until `attach_late` succeeds.
    pub fn is_pending(&self) -> bool {
        self.pending.lock().is_some()
    }

    /// Once after a deferred takeover succeeded: the maintenance thread then commits, so
    /// the store gets what the local commits made meanwhile even if nothing is dirty.
    pub fn take_catch_up(&self) -> bool {
        self.catch_up_wanted
            .swap(false, std::sync::atomic::Ordering::AcqRel)
    }

    /// Whether commits are not reaching the store (the pool is DEGRADED): it failed the
    /// last commit or check, or was not taken yet.
    pub fn is_failing(&self) -> bool {
        self.is_pending() || self.health.lock().failing_since.is_some()
    }

    /// Try the deferred takeover (at most every `RETRY_INTERVAL` unless `now`). Ok(true)
    /// once the store is taken (the next commit publishes what the local commits made
    /// since the import); Ok(false) while it still does not answer; `Fenced` when another
    /// host took the pool meanwhile.
    pub fn attach_late(&self, store: &Store, now: bool) -> Result<bool> {
        let mut pending = self.pending.lock();
        let Some(p) = pending.as_mut() else {
            return Ok(true);
        };
        if !now && crate::env::since(p.tried) < RETRY_INTERVAL {
            return Ok(false);
        }
        p.tried = crate::env::now();
        let open = p.open.clone();
        let generation = p.generation;
        let probe_name = format!("probe/{}", to_hex(&crate::keys::wrap::random_bytes::<8>()));
        let result = (|| {
            if !open.single_host {
                crate::tier::probe(&*self.store, &probe_name)?;
            }
            self.attach(&open, generation, true)
        })();
        match result {
            Ok(reseed) => {
                *pending = None;
                if reseed {
                    let segs = store.note_live_segments();
                    tracing::warn!(
                        segments = segs,
                        "the object store holds a commit of ours this host's labels lack: \
                         uploading every segment that holds data"
                    );
                    self.first_upload
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                }
                // Segments freed since the store's commit leave its table with the next.
                store.note_free_among(self.slot_segments());
                self.health.lock().failing_since = None;
                self.catch_up_wanted
                    .store(true, std::sync::atomic::Ordering::Release);
                tracing::info!("the object store answers again: the next commit catches it up");
                Ok(true)
            }
            Err(e @ Error::Fenced(_)) => Err(e),
            Err(e) if unreachable(&e) => {
                self.note_failure(&e);
                Ok(false)
            }
            Err(e) => {
                self.note_failure(&e);
                Err(e)
            }
        }
    }

    /// A failed request or commit: the store is failing from now (if it was not already).
    fn note_failure(&self, e: &Error) {
        let mut h = self.health.lock();
        h.failing_since.get_or_insert_with(crate::env::system_time);
        h.last_error = Some(e.to_string());
    }

    /// Write `head` if the superblock object is still `version` (absent when `None`).
    /// Refused: read back. Our own bytes there: an earlier try of this write landed and
    /// its reply was lost (the client retried). Our own writer and epoch with other bytes:
    /// an earlier commit of ours landed although it failed here (its reply was lost and
    /// not retried); nobody else writes our epoch, so it is replaced, on its version.
    /// Anything else: another writer took the pool (`Fenced`).
    fn cas(&self, head: &Head, version: Option<&Version>) -> Result<Version> {
        let body = head.seal(&self.key);
        let mut cond = match version {
            Some(v) => Cond::Matches(v.clone()),
            None => Cond::Absent,
        };
        for _ in 0..3 {
            match self.store.put_if(SUPERBLOCK_OBJECT, body.clone(), &cond)? {
                PutIf::Done(v) => return Ok(v),
                PutIf::Refused => match self
                    .store
                    .get(SUPERBLOCK_OBJECT, SUPERBLOCK_OBJECT_BYTES_MAX)?
                {
                    Some((b, v)) if b == body => return Ok(v),
                    Some((b, v))
                        if Head::open(&b, &self.key).is_ok_and(|h| {
                            h.writer == head.writer
                                && h.epoch == head.epoch
                                && h.session == head.session
                        }) =>
                    {
                        tracing::warn!(
                            "the object store holds a commit of ours whose answer was lost; \
                             replacing it"
                        );
                        cond = Cond::Matches(v);
                    }
                    other => return Err(self.fenced(other.map(|(b, _)| b))),
                },
            }
        }
        Err(Error::StoreUnavailable(format!(
            "the object store {} kept refusing the superblock object's update",
            self.store.describe()
        )))
    }

    /// The error of a writer that lost the pool: `found` is what the store holds now.
    /// Also what `status` shows from then on.
    fn fenced(&self, found: Option<Vec<u8>>) -> Error {
        let why = match found {
            Some(b) => {
                let who = Head::open(&b, &self.key)
                    .map(|h| format!("'{}' (epoch {})", h.writer, h.epoch))
                    .unwrap_or_else(|e| format!("an unreadable writer ({e})"));
                format!(
                    "the pool in {} was taken over by {who}: this daemon stopped writing \
                     (fenced); its flushes fail from now on. {TAKE_BACK}",
                    self.store.describe()
                )
            }
            None => format!(
                "the superblock object in {} is gone: this daemon stopped writing (fenced). \
                 {TAKE_BACK}",
                self.store.describe()
            ),
        };
        *self.fenced.lock() = Some(why.clone());
        Error::Fenced(why)
    }

    /// Is the superblock object still the one this writer wrote? (the periodic check of a
    /// serving daemon: a host taken over stops serving even before it writes).
    pub fn check(&self) -> Result<()> {
        let r = self.check_held();
        match &r {
            Ok(()) => {
                let mut h = self.health.lock();
                // A store that answers a check is reachable; a failing commit still says
                // otherwise until one goes through.
                if h.commits_failed == 0 || h.last_error.is_none() {
                    h.failing_since = None;
                }
            }
            Err(e) if unreachable(e) => self.note_failure(e),
            Err(_) => {}
        }
        r
    }

    fn check_held(&self) -> Result<()> {
        if self.is_pending() {
            return Ok(());
        }
        let (mine, epoch, session) = {
            let st = self.st.lock();
            (st.version.clone(), st.head.epoch, st.head.session.clone())
        };
        let Some(mine) = mine else { return Ok(()) };
        match self
            .store
            .get(SUPERBLOCK_OBJECT, SUPERBLOCK_OBJECT_BYTES_MAX)?
        {
            Some((_, v)) if v == mine => Ok(()),
            // A commit of ours that landed meanwhile (or whose answer was lost): still ours.
            Some((b, _))
                if Head::open(&b, &self.key)
                    .is_ok_and(|h| h.epoch == epoch && h.session == session) =>
            {
                Ok(())
            }
            other => Err(self.fenced(other.map(|(b, _)| b))),
        }
    }

    /// The commit's step between the devices' flush and the local labels: upload what
    /// `Store::put` wrote since the last commit, the table pages that changed, then the
    /// superblock object with `labels` at `generation`, conditionally. Nothing local is
    /// changed by a failure: the runs go back to the store for the next try.
    ///
    /// Before the store was taken (it did not answer at import), the takeover is tried
    /// first; while it still fails the commit stays local (Ok, nothing taken: the runs
    /// and freed segments wait for the commit that reaches the store).
    pub fn publish(&self, store: &Store, labels: Vec<Vec<u8>>, generation: u64) -> Result<()> {
        if self.is_pending() && !self.attach_late(store, true)? {
            return Ok(());
        }
        let taken = store.take_uploads();
        let freed = store.take_freed();
        self.uploading_bytes.store(
            taken.iter().map(|e| e.len as u64).sum(),
            std::sync::atomic::Ordering::Relaxed,
        );
        let result = self.publish_runs(store, &taken, &freed, labels, generation);
        self.uploading_bytes
            .store(0, std::sync::atomic::Ordering::Relaxed);
        if result.is_err() {
            store.return_uploads(taken);
            store.return_freed(freed);
        }
        {
            let mut h = self.health.lock();
            match &result {
                Ok(()) => {
                    h.commits_ok += 1;
                    h.last_commit = Some(crate::env::system_time());
                    h.failing_since = None;
                    h.last_error = None;
                }
                Err(e) => {
                    h.commits_failed += 1;
                    h.failing_since.get_or_insert_with(crate::env::system_time);
                    h.last_error = Some(e.to_string());
                }
            }
        }
        result.map_err(|e| match e {
            // The store failed (after its own retries, by its deadline): nothing local
            // changed, the next commit tries again.
            Error::Io(_) | Error::NotFound(_) | Error::Corrupt(_) => {
                Error::StoreUnavailable(format!(
                    "the object store {} did not take the commit: {e}",
                    self.store.describe()
                ))
            }
            other => other,
        })
    }

    fn publish_runs(
        &self,
        store: &Store,
        taken: &[Extent],
        freed: &[u32],
        labels: Vec<Vec<u8>>,
        generation: u64,
    ) -> Result<()> {
        let started = crate::env::now();
        // Runs still in the segment's current incarnation, by segment and offset, joined
        // where they touch.
        // A segment freed since is dead: its runs are not uploaded.
        let mut runs: Vec<Extent> = taken
            .iter()
            .filter(|e| store.incarnation(e.seg) == e.inc && !store.is_free(e.seg))
            .copied()
            .collect();
        runs.sort();
        runs.dedup();
        let mut joined: Vec<Extent> = Vec::new();
        for e in runs {
            match joined.last_mut() {
                Some(l) if l.seg == e.seg && l.inc == e.inc && l.off + l.len >= e.off => {
                    l.len = l.len.max(e.off + e.len - l.off);
                }
                _ => joined.push(e),
            }
        }
        // Names are handed out under the lock; the uploads run without it (`status`, the
        // fencing check and collection read the state meanwhile; commits are serialised
        // by the commit lock).
        let (mut head, version, mut slots, mut pages, mut delta_segs, parts, bundles) = {
            let mut st = self.st.lock();
            let mut parts: Vec<(Extent, Part, bool)> = Vec::with_capacity(joined.len());
            let mut i = 0;
            while i < joined.len() {
                let seg = joined[i].seg;
                let n = joined[i..].iter().take_while(|e| e.seg == seg).count();
                let new = &joined[i..i + n];
                i += n;
                let kept: Vec<Part> = st
                    .slots
                    .get(&seg)
                    .filter(|s| same_opening(s.inc, new[0].inc))
                    .map(|s| s.parts.clone())
                    .unwrap_or_default();
                let epoch = st.head.epoch;
                // Objects are named below, once the parts are packed into them.
                let name = |e: Extent, replaces: bool| {
                    let p = Part {
                        off: e.off,
                        len: e.len,
                        at: 0,
                        epoch,
                        seq: 0,
                    };
                    (e, p, replaces)
                };
                if kept.len() + new.len() > PARTS_PER_SEGMENT_MAX as usize {
                    // Too many parts for one segment: one part of the whole range instead
                    // (the local devices hold all of it), replacing the segment's list.
                    let lo = kept.iter().map(|p| p.off).chain(new.iter().map(|e| e.off));
                    let hi = kept
                        .iter()
                        .map(|p| p.off + p.len)
                        .chain(new.iter().map(|e| e.off + e.len));
                    let (lo, hi) = (lo.min().unwrap_or(0), hi.max().unwrap_or(0));
                    let whole = Extent {
                        off: lo,
                        len: hi - lo,
                        ..new[0]
                    };
                    parts.push(name(whole, true));
                } else {
                    for e in new {
                        parts.push(name(*e, false));
                    }
                }
            }
            // Pack the parts into objects of about `BUNDLE_BYTES`, each named once.
            let mut bundles: Vec<std::ops::Range<usize>> = Vec::new();
            let mut filled = usize::MAX;
            for (k, (_, part, _)) in parts.iter_mut().enumerate() {
                let len = part.len as usize;
                if filled == usize::MAX || (filled > 0 && filled + len > BUNDLE_BYTES) {
                    bundles.push(k..k);
                    filled = 0;
                    st.named += 1;
                }
                let b = bundles.last_mut().expect("a bundle is open");
                b.end = k + 1;
                part.at = filled as u32;
                part.seq = st.named - 1;
                filled += len;
            }
            (
                st.head.clone(),
                st.version.clone(),
                st.slots.clone(),
                st.pages.clone(),
                st.delta_segs.clone(),
                parts,
                bundles,
            )
        };
        // The table: a segment's parts start over when it was reopened (or compacted).
        // Its changed pages are named now and go up with the parts, in one round: the
        // superblock object that names both is written only after both landed.
        let mut dirty = BTreeSet::new();
        for (e, p, replaces) in &parts {
            let slot = slots.entry(e.seg).or_default();
            if !same_opening(slot.inc, e.inc) || *replaces {
                *slot = Slot {
                    inc: e.inc,
                    parts: Vec::new(),
                    data: false,
                };
            }
            slot.inc = e.inc;
            slot.data = store.is_evictable(e.seg);
            slot.parts.push(*p);
            dirty.insert(e.seg);
        }
        // Segments freed since the last commit: no durable commit from this one on
        // references their parts (garbage collection may take them after the grace). One
        // opened again since keeps the parts of its new opening.
        for &seg in freed {
            let stale = slots.get(&seg).is_some_and(|s| {
                store.is_free(seg) || !same_opening(s.inc, store.incarnation(seg))
            });
            if stale {
                slots.remove(&seg);
                dirty.insert(seg);
            }
        }
        // The changed slots go in the superblock object's delta; once it would pass
        // `DELTA_BYTES_MAX`, the pages of every segment it lists are written instead (in
        // the round of the parts) and it starts over.
        delta_segs.extend(dirty);
        let delta = encode_delta(&delta_segs, &slots);
        let rewrite: BTreeSet<u32> = if delta.len() > DELTA_BYTES_MAX {
            std::mem::take(&mut delta_segs)
                .into_iter()
                .map(|seg| seg / PAGE_SEGMENTS)
                .collect()
        } else {
            BTreeSet::new()
        };
        head.delta = if delta_segs.is_empty() {
            String::new()
        } else {
            to_hex(&delta)
        };
        let mut page_jobs: Vec<(String, Vec<u8>)> = Vec::new();
        for index in rewrite {
            let body = encode_page(index, &slots);
            let seq = {
                let mut st = self.st.lock();
                st.named += 1;
                st.named - 1
            };
            let r = PageRef {
                index,
                name: format!("table/{:08x}/{:012x}", head.epoch, seq),
                blake3: to_hex(blake3::hash(&body).as_bytes()),
            };
            page_jobs.push((r.name.clone(), body));
            pages.insert(index, r);
        }
        // Upload the bundles, several at once, within the commit's budget: a minute, and
        // more for a large commit (the first one of a pool that had data before its store)
        // at the pace of a slow store.
        let bytes: u64 = parts.iter().map(|(_, p, _)| p.len as u64).sum();
        let budget = if self.first_upload.load(std::sync::atomic::Ordering::Relaxed) {
            PUBLISH_BUDGET + std::time::Duration::from_secs(bytes / PUBLISH_PACE)
        } else {
            PUBLISH_BUDGET
        };
        let parts_ref = &parts;
        let chunk = bundles.len().div_ceil(UPLOADS_AT_ONCE).max(1);
        let pages_up: crate::env::Job<'_, Result<()>> = Box::new(|| {
            for (name, body) in &page_jobs {
                self.store.put(name, body.clone())?;
            }
            Ok(())
        });
        let mut jobs: Vec<crate::env::Job<'_, Result<()>>> = bundles
            .chunks(chunk)
            .map(|c| {
                Box::new(move || -> Result<()> {
                    let mut buf = Vec::new();
                    for range in c {
                        if crate::env::since(started) > budget {
                            return Err(Error::StoreUnavailable(format!(
                                "the object store {} took more than {} s for one commit",
                                self.store.describe(),
                                budget.as_secs()
                            )));
                        }
                        let mut body = Vec::new();
                        for (e, p, _) in &parts_ref[range.clone()] {
                            debug_assert_eq!(p.at as usize, body.len());
                            let addr = e.seg as u64 * SEGMENT_BYTES + e.off as u64;
                            // Never upload a hole: a segment given back had every byte
                            // in the store before it was (`pool::evict`).
                            if store.is_evicted(e.seg) {
                                return Err(Error::Unrecoverable(format!(
                                    "segment {} was given back to the object store with \
                                     runs not yet uploaded",
                                    e.seg
                                )));
                            }
                            // A local read that fails is the devices' failure, not the
                            // store's: it poisons the pool like any device error.
                            store
                                .read_run(addr, e.len as usize, &mut buf)
                                .map_err(|err| {
                                    Error::Unrecoverable(format!(
                                        "segment {} could not be read for upload: {err}",
                                        e.seg
                                    ))
                                })?;
                            body.extend_from_slice(&buf[..e.len as usize]);
                        }
                        let name = parts_ref[range.start].1.name();
                        self.store.put(&name, body)?;
                    }
                    Ok(())
                }) as crate::env::Job<'_, Result<()>>
            })
            .collect();
        jobs.push(pages_up);
        crate::env::run_jobs(jobs)
            .into_iter()
            .collect::<Result<Vec<()>>>()?;
        head.seq_next = self.st.lock().named;
        head.generation = generation;
        head.labels = labels.iter().map(|l| to_hex(l)).collect();
        head.pages = pages.values().cloned().collect();
        let version = self.cas(&head, version.as_ref())?;
        let mut st = self.st.lock();
        st.head = head;
        st.version = Some(version);
        st.slots = slots;
        st.pages = pages;
        st.delta_segs = delta_segs;
        st.published += 1;
        self.first_upload
            .store(false, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Whether a collection is due: once early in each run, then every `interval` if
    /// commits were published since (an idle pool asks the store nothing).
    pub fn collect_due(&self, interval: std::time::Duration) -> bool {
        let c = self.collected.lock();
        match c.0 {
            None => true,
            Some(t) => crate::env::since(t) >= interval && self.st.lock().published > c.2,
        }
    }

    /// Garbage collection: delete the parts and pages no commit of this writer references
    /// any more, once they are older than the grace period (by the store's clock of their
    /// last write). Never an object of a newer epoch (another writer's), nor one named
    /// after this writer's last acknowledged commit (a commit whose answer was lost may
    /// reference it). Plain DELETEs: nothing relies on conditional deletes.
    pub fn collect(&self) -> Result<Collected> {
        let (epoch, below, referenced, published) = {
            let st = self.st.lock();
            let mut r: std::collections::HashSet<String> =
                st.pages.values().map(|p| p.name.clone()).collect();
            for s in st.slots.values() {
                r.extend(s.parts.iter().map(|p| p.name()));
            }
            (st.head.epoch, st.head.seq_next, r, st.published)
        };
        let now = crate::env::system_time()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut listed = self.store.list("seg/")?;
        listed.extend(self.store.list("table/")?);
        let mut done = Collected {
            referenced: referenced.len(),
            ..Default::default()
        };
        for l in listed {
            if referenced.contains(&l.name) {
                continue;
            }
            let Some((e, s)) = parse_object_name(&l.name) else {
                continue;
            };
            if e > epoch || (e == epoch && s >= below) {
                continue;
            }
            if now.saturating_sub(l.modified) < self.gc_grace.as_secs() {
                done.young += 1;
                continue;
            }
            self.store.delete(&l.name)?;
            done.deleted += 1;
        }
        let mut c = self.collected.lock();
        *c = (
            Some(crate::env::now()),
            c.1 + done.deleted as u64,
            published,
        );
        if done.deleted > 0 {
            tracing::info!(
                deleted = done.deleted,
                young = done.young,
                "object store: unreferenced objects collected"
            );
        }
        Ok(done)
    }

    pub fn status(&self, store: &Store) -> TierStatus {
        let st = self.st.lock();
        let remote = store.remote_reads();
        let h = self.health.lock();
        let pending = self.is_pending();
        let fenced = self.fenced.lock().clone();
        let lag_bytes = store.pending_upload_bytes()
            + self
                .uploading_bytes
                .load(std::sync::atomic::Ordering::Relaxed);
        let now = crate::env::system_time();
        let behind_since = h.last_commit.unwrap_or(self.started);
        let state = if fenced.is_some() {
            "FENCED"
        } else if pending {
            "UNREACHABLE"
        } else if h.failing_since.is_some() {
            "FAILING"
        } else {
            "HELD"
        };
        TierStatus {
            state: state.into(),
            failing_since: h.failing_since.map(unix_secs),
            last_error: h.last_error.clone(),
            last_commit: h.last_commit.map(unix_secs),
            commits_ok: h.commits_ok,
            commits_failed: h.commits_failed,
            request_errors: self
                .counted
                .inner
                .request_errors()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            lag_bytes,
            lag_seconds: if lag_bytes > 0 || pending {
                now.duration_since(behind_since)
                    .map(|d| d.as_secs_f64())
                    .unwrap_or(0.0)
            } else {
                0.0
            },
            fenced_by: fenced.as_ref().and_then(|_| {
                // The holder named in the fencing message ('writer' (epoch N)).
                let f = fenced.as_deref().unwrap_or("");
                let a = f.find("taken over by '")? + "taken over by '".len();
                let b = f[a..].find('\'')?;
                Some(f[a..a + b].to_string())
            }),
            take_back: fenced.as_ref().map(|_| TAKE_BACK.to_string()),
            url: self.store.describe(),
            writer: st.head.writer.clone(),
            epoch: st.head.epoch,
            generation: st.head.generation,
            segments_stored: st.slots.values().filter(|s| !s.parts.is_empty()).count(),
            parts: st.slots.values().map(|s| s.parts.len()).sum(),
            fenced,
            collected: self.collected.lock().1,
            requests: self.counted.requests(),
            flush: if self.local_flush { "local" } else { "store" }.into(),
            cache: self.cache_bytes.map(|limit| CacheStatus {
                limit_bytes: limit,
                local_bytes: store.local_bytes(),
                evicted_segments: store.evicted_count() as u64,
                evicted_total: self
                    .evicted_total
                    .load(std::sync::atomic::Ordering::Relaxed),
                refilled_total: self
                    .refilled_total
                    .load(std::sync::atomic::Ordering::Relaxed),
                paced_writes: store.pace_counts().waited_writes,
                paced_seconds: store.pace_counts().waited_seconds,
            }),
            remote_reads: remote.reads,
            remote_read_bytes: remote.bytes,
            healed_from_store: remote.healed,
            read_ahead_hits: remote.ahead_hits,
        }
    }

    /// Of `segs`, those whose every byte the store holds as of the last commit: a slot of
    /// the segment's current opening, and no run written since waiting for the next
    /// commit's upload (`pending`). Called under the commit lock (no upload under way).
    /// Each with the opening (`Log::incarnation`) that was checked.
    pub fn stored_segments(
        &self,
        store: &Store,
        segs: &[u32],
        pending: &BTreeSet<u32>,
    ) -> Vec<(u32, u64)> {
        let st = self.st.lock();
        segs.iter()
            .map(|&seg| (seg, store.incarnation(seg)))
            .filter(|(seg, inc)| {
                !pending.contains(seg)
                    && st
                        .slots
                        .get(seg)
                        .is_some_and(|s| !s.parts.is_empty() && same_opening(s.inc, *inc))
            })
            .collect()
    }

    /// The bytes the store holds of segment `seg`'s current opening, part by part (offset
    /// in the segment, bytes): `None` if its slot is of another opening (or none).
    pub fn segment_bytes(&self, store: &Store, seg: u32) -> Result<Option<SegmentBytes>> {
        let parts = {
            let st = self.st.lock();
            match st.slots.get(&seg) {
                Some(s) if same_opening(s.inc, store.incarnation(seg)) => s.parts.clone(),
                _ => return Ok(None),
            }
        };
        let mut out = Vec::with_capacity(parts.len());
        for p in parts {
            let b = self.store.get_range(&p.name(), p.at as u64, p.len as u64)?;
            out.push((p.off, b));
        }
        Ok(Some(out))
    }

    /// Check the store's copies of records still held locally (`scrub --verify-store`):
    /// for each `(address, stored length, checksum)`, `Some(true)` when the bytes the
    /// store holds there verify, `Some(false)` when they do not or their object is gone,
    /// `None` when not checked: not uploaded yet (written since the last commit), of a
    /// segment reopened since, or the store did not answer (then the second value is true
    /// and nothing more is asked of it). Records of one object are read together: one
    /// ranged GET per run of them less than `CHECK_GAP` apart, at most `CHECK_RANGE_MAX`.
    /// No key is needed: the checksums are of the stored bytes.
    pub fn check_records(
        &self,
        store: &Store,
        recs: &[(u64, usize, crate::checksum::Checksum)],
    ) -> (Vec<Option<bool>>, bool) {
        const CHECK_GAP: u64 = 64 << 10;
        const CHECK_RANGE_MAX: u64 = 4 << 20;
        let mut out = vec![None; recs.len()];
        // Object name -> (offset in it, record index, segment, its opening then).
        let mut by_object: BTreeMap<String, Vec<(u64, usize, u32, u64)>> = BTreeMap::new();
        {
            let st = self.st.lock();
            for (i, &(addr, len, _)) in recs.iter().enumerate() {
                let seg = (addr / SEGMENT_BYTES) as u32;
                let off = addr % SEGMENT_BYTES;
                let inc = store.incarnation(seg);
                let Some(slot) = st.slots.get(&seg).filter(|s| same_opening(s.inc, inc)) else {
                    continue;
                };
                let Some(p) = slot.parts.iter().rev().find(|p| {
                    p.off as u64 <= off && off + len as u64 <= p.off as u64 + p.len as u64
                }) else {
                    continue;
                };
                by_object.entry(p.name()).or_default().push((
                    p.at as u64 + (off - p.off as u64),
                    i,
                    seg,
                    inc,
                ));
            }
        }
        // A record whose segment was reopened meanwhile is another record's place now.
        let unchanged = |seg: u32, inc: u64| store.incarnation(seg) == inc;
        for (name, mut at) in by_object {
            at.sort_unstable();
            let mut k = 0;
            while k < at.len() {
                let start = at[k].0;
                let mut end = start + recs[at[k].1].1 as u64;
                let mut j = k + 1;
                while j < at.len() {
                    let (a, i, ..) = at[j];
                    let e = a + recs[i].1 as u64;
                    if a > end + CHECK_GAP || e - start > CHECK_RANGE_MAX {
                        break;
                    }
                    end = end.max(e);
                    j += 1;
                }
                match self.store.get_range(&name, start, end - start) {
                    Ok(b) => {
                        for &(a, i, seg, inc) in &at[k..j] {
                            let (_, len, sum) = &recs[i];
                            let from = (a - start) as usize;
                            let good = b
                                .get(from..from + len)
                                .is_some_and(|r| crate::checksum::verify(sum, r));
                            out[i] = if good {
                                Some(true)
                            } else {
                                unchanged(seg, inc).then_some(false)
                            };
                        }
                    }
                    // Gone, or shorter than the table says.
                    Err(Error::NotFound(_) | Error::Corrupt(_)) => {
                        for &(_, i, seg, inc) in &at[k..j] {
                            out[i] = unchanged(seg, inc).then_some(false);
                        }
                    }
                    Err(_) => return (out, true),
                }
                k = j;
            }
        }
        (out, false)
    }

    /// The segments the store's table lists.
    pub fn slot_segments(&self) -> Vec<u32> {
        self.st.lock().slots.keys().copied().collect()
    }

    /// Where the store holds `len` bytes at pool address `addr`: the object, the offset
    /// in it (the newest part of the segment that covers them all), and how many bytes
    /// from there that part holds.
    fn locate(&self, addr: u64, len: usize) -> Option<(String, u64, u64)> {
        let seg = (addr / SEGMENT_BYTES) as u32;
        let off = addr % SEGMENT_BYTES;
        let st = self.st.lock();
        let slot = st.slots.get(&seg)?;
        slot.parts
            .iter()
            .rev()
            .find(|p| p.off as u64 <= off && off + len as u64 <= p.off as u64 + p.len as u64)
            .map(|p| {
                let end = p.off as u64 + p.len as u64;
                (p.name(), p.at as u64 + (off - p.off as u64), end - off)
            })
    }
}

impl crate::store::Remote for Tier {
    fn read(&self, addr: u64, len: usize) -> Result<Vec<u8>> {
        self.read_ahead(addr, len, len)
    }

    fn read_ahead(&self, addr: u64, len: usize, want: usize) -> Result<Vec<u8>> {
        let Some((name, at, held)) = self.locate(addr, len) else {
            return Err(Error::Unrecoverable(format!(
                "the {len} bytes at pool address {addr} are in no part of the object store's \
                 segment table"
            )));
        };
        // Past `len`, only what the same part holds: one ranged GET.
        let fetch = (want as u64).min(held).max(len as u64);
        self.store.get_range(&name, at, fetch).map_err(|e| match e {
            Error::Io(_) => Error::StoreUnavailable(format!(
                "reading {len} bytes of '{name}' from the object store {}: {e}",
                self.store.describe()
            )),
            // Deleted under us (this host was fenced and the new holder collected it):
            // the bytes are gone, never replaced by others.
            Error::NotFound(_) => Error::Unrecoverable(format!(
                "'{name}' is no longer in the object store {} (this host no longer holds the \
                 pool?): {e}",
                self.store.describe()
            )),
            other => other,
        })
    }
}

/// Whether a slot's parts (of incarnation `slot`) and a run of incarnation `run` are of
/// one opening of the segment. A slot read from the store is of an earlier process
/// (`u64::MAX`), and a run in a segment this process never opened (0: the intent log's
/// replay) is of that same opening: its parts are kept, not started over.
fn same_opening(slot: u64, run: u64) -> bool {
    slot == run || (slot == u64::MAX && run == 0)
}

/// `seg/EPOCH/SEQ` or `table/EPOCH/SEQ` → (epoch, seq); anything else `None`.
fn parse_object_name(name: &str) -> Option<(u64, u64)> {
    let rest = name
        .strip_prefix("seg/")
        .or_else(|| name.strip_prefix("table/"))?;
    let (e, s) = rest.split_once('/')?;
    if e.len() != 8 || s.len() != 12 {
        return None;
    }
    Some((
        u64::from_str_radix(e, 16).ok()?,
        u64::from_str_radix(s, 16).ok()?,
    ))
}
