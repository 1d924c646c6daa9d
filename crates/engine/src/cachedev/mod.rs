//! The cache device (issue 24 part 3, an L2ARC for records): copies of hot data records,
//! as stored on the pool (ciphertext for encrypted volumes, never plaintext), on a faster
//! device of its own, so a read that finds its record here does not touch the pool.
//!
//! A cache entry is keyed by the record's pool address and checksum. A record never
//! changes at its address until its segment is reused, and a reused address holds a
//! record with another checksum; so a copy found under (address, checksum) is the record
//! the pointer names. It is still never trusted: every hit is verified against the
//! checksum in the block pointer (`checksum::verify`), like any copy on the pool, and a
//! copy that fails is dropped, counted (`errors`) and read from the pool instead. Nothing
//! here ever returns unverified bytes.
//!
//! Layout (docs/format.md, "Cache device"): a 4 KiB label (magic, version, the cache's
//! uuid, the pool's id, the ring's length; blake3) and a ring of entries after it. An
//! entry is a 128-byte header (the cache's uuid, its log position, the pool address, the
//! stored length, the checksum; xxh3-64 of the header) and the stored bytes, padded to
//! 128 bytes. Entries are written in log order; the ring wraps, and what a write is about
//! to cover is dropped from the index first (first in, first out: a ring, write-around).
//! The index lives in memory (`Index`); at open it is rebuilt by scanning the headers
//! on the device (in the background: reads miss until the scan ends), so the cache
//! survives restarts warm.
//!
//! Filling is off the read path: a read that missed offers the verified stored bytes
//! ([`CacheDevice::offer`]); they wait in a bounded queue (dropped when it is full) for
//! the cache's writer thread, which checks them again and writes them in batches.
//!
//! Who uses it: `Store::read_data` tries it before the pool's copies; `Volume::read_blocks`
//! asks it once per run which blocks it holds. It is configured in `pool.json` or with
//! `serve --cache-device` (docs/cache.md); a missing one is `UNAVAIL` in `status`, and the
//! pool serves from its own devices.
//!
//! Invariants:
//! - An entry is dropped from the index before any byte of it is overwritten (`place`),
//!   and enters the index only after its bytes were written whole; a reader that raced
//!   the overwrite fails verification and finds the entry gone: a miss, not an error.
//! - The label is never rewritten while the cache is open; nothing of the pool (its
//!   superblock, pool.json aside) names the cache device.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

use crate::checksum::{self, Checksum};
use crate::constants::*;
use crate::device::{Device, FileDevice};
use crate::{Error, Result};

const LABEL_MAGIC: [u8; 16] = *b"bulwark-cachedev";
const LABEL_VERSION: u32 = 1;
const ENTRY_MAGIC: [u8; 8] = *b"BWCENTRY";

/// What `status` shows of the cache device.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CacheDeviceStatus {
    pub path: PathBuf,
    /// ONLINE, SCANNING (rebuilding its index at start; reads miss meanwhile), or
    /// UNAVAIL (not found or refused at start: the pool serves without it).
    pub state: String,
    /// Why it is UNAVAIL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Bytes of the ring (the device less its label).
    pub size_bytes: u64,
    /// Bytes the ring's entries take (headers and padding included).
    pub used_bytes: u64,
    pub entries: u64,
    pub hits: u64,
    pub misses: u64,
    /// hits / (hits + misses); 0 before any read.
    pub hit_rate: f64,
    /// Copies that failed verification against their block pointer's checksum (dropped;
    /// the read went to the pool).
    pub errors: u64,
    pub read_errors: u64,
    pub write_errors: u64,
    /// Records written to the cache since start.
    pub fills: u64,
    /// Records offered while the fill queue was full (not cached).
    pub fills_dropped: u64,
}

impl CacheDeviceStatus {
    /// A configured cache device that is not in use, and why.
    pub fn unavailable(path: &Path, reason: String) -> CacheDeviceStatus {
        CacheDeviceStatus {
            path: path.to_path_buf(),
            state: "UNAVAIL".into(),
            reason: Some(reason),
            ..Default::default()
        }
    }
}

/// A cheap hash for pool addresses (16-aligned): the index's lookups sit on the read path.
#[derive(Default, Clone, Copy)]
pub(crate) struct AddrHash;

pub(crate) struct AddrHasher(u64);

impl BuildHasher for AddrHash {
    type Hasher = AddrHasher;
    fn build_hasher(&self) -> AddrHasher {
        AddrHasher(0)
    }
}

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        let x = (self.0 >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^ (x >> 29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | b as u64;
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// Where one cached record lies: its log position (`lp % ring` is its offset in the ring),
/// stored length, and the first 8 bytes of its checksum (to tell a reused address apart;
/// the full checksum comes from the block pointer at every read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot {
    pub lp: u64,
    pub len: u32,
    pub fp: u64,
}

fn fingerprint(sum: &Checksum) -> u64 {
    u64::from_le_bytes(sum[..8].try_into().unwrap())
}

/// Bytes an entry of `len` stored bytes takes in the ring.
pub(crate) fn entry_bytes(len: usize) -> u64 {
    ((CACHEDEV_HEADER_BYTES + len) as u64).div_ceil(CACHEDEV_ENTRY_ALIGN) * CACHEDEV_ENTRY_ALIGN
}

/// The in-memory index of a ring of `ring` bytes: which record lies where, and the order
/// entries were written in (eviction is first in, first out). Log positions only grow;
/// the ring offset of position `lp` is `lp % ring`, and an entry never straddles the end
/// of the ring (the lap's tail is skipped).
pub(crate) struct Index {
    ring: u64,
    /// Entries kept at most (`CACHEDEV_INDEX_ENTRIES_MAX`): the oldest go first.
    max: usize,
    map: HashMap<u64, Slot, AddrHash>,
    /// (log position, entry bytes, pool address), oldest first.
    fifo: VecDeque<(u64, u32, u64)>,
    /// The next log position to write.
    head: u64,
    used: u64,
}

impl Index {
    pub fn new(ring: u64) -> Index {
        Index::with_max(ring, CACHEDEV_INDEX_ENTRIES_MAX)
    }

    pub fn with_max(ring: u64, max: usize) -> Index {
        assert!(ring >= 2 * CACHEDEV_FILL_BATCH_BYTES as u64 && max > 0);
        Index {
            ring,
            max,
            map: HashMap::with_hasher(AddrHash),
            fifo: VecDeque::new(),
            head: 0,
            used: 0,
        }
    }

    /// The entry for the record at `addr` with this checksum and length, if cached.
    pub fn get(&self, addr: u64, sum: &Checksum, len: usize) -> Option<Slot> {
        self.map
            .get(&addr)
            .copied()
            .filter(|s| s.fp == fingerprint(sum) && s.len as usize == len)
    }

    /// Reserve the next `bytes` of the ring (`entry_bytes`): returns its log position.
    /// Everything the new entry will overwrite leaves the index now, before the write.
    pub fn place(&mut self, bytes: u64, addr: u64) -> u64 {
        debug_assert!(bytes <= self.ring / 2);
        let mut lp = self.head;
        if lp % self.ring + bytes > self.ring {
            lp += self.ring - lp % self.ring;
        }
        self.head = lp + bytes;
        // An older entry at `q` lies, one lap on, at `q + ring`: overwritten once the
        // head passes it.
        while let Some(&(q, b, a)) = self.fifo.front() {
            if q + self.ring >= self.head {
                break;
            }
            self.fifo.pop_front();
            self.used -= b as u64;
            self.remove_if(a, q);
        }
        self.fifo.push_back((lp, bytes as u32, addr));
        self.used += bytes;
        // Past the memory budget the oldest entries leave the index (their bytes stay
        // until the ring comes round: they are only not found).
        while self.fifo.len() > self.max {
            let Some((q, b, a)) = self.fifo.pop_front() else {
                break;
            };
            self.used -= b as u64;
            self.remove_if(a, q);
        }
        lp
    }

    /// The entry placed at `lp` was written whole: reads may find it. Not if the ring has
    /// already come round over it (then its place holds newer bytes).
    pub fn insert(&mut self, addr: u64, sum: &Checksum, len: usize, lp: u64) {
        if lp + self.ring < self.head {
            return;
        }
        self.map.insert(
            addr,
            Slot {
                lp,
                len: len as u32,
                fp: fingerprint(sum),
            },
        );
    }

    /// Drop the entry of `addr` if it is still the one at `lp`; whether it was.
    pub fn remove_if(&mut self, addr: u64, lp: u64) -> bool {
        if self.map.get(&addr).is_some_and(|s| s.lp == lp) {
            self.map.remove(&addr);
            return true;
        }
        false
    }

    /// Rebuild from the entries a scan found (log position, entry bytes, address, stored
    /// length, checksum fingerprint), in any order: the newest lap's worth is kept.
    pub fn rebuild(ring: u64, found: Vec<(u64, u32, u64, u32, u64)>) -> Index {
        Index::rebuild_max(ring, found, CACHEDEV_INDEX_ENTRIES_MAX)
    }

    /// `rebuild`, keeping the newest `max` entries at most.
    pub fn rebuild_max(ring: u64, mut found: Vec<(u64, u32, u64, u32, u64)>, max: usize) -> Index {
        let mut idx = Index::with_max(ring, max);
        found.sort_unstable_by_key(|e| e.0);
        let head = found.iter().map(|e| e.0 + e.1 as u64).max().unwrap_or(0);
        let mut end = 0;
        // In place (the list may be large): older than a lap (overwritten since), or
        // overlapping an entry kept, is not ours.
        found.retain(|&(lp, bytes, ..)| {
            if lp + ring < head || lp < end {
                return false;
            }
            end = lp + bytes as u64;
            true
        });
        let skip = found.len().saturating_sub(max);
        for (lp, bytes, addr, len, fp) in found.into_iter().skip(skip) {
            idx.fifo.push_back((lp, bytes, addr));
            idx.used += bytes as u64;
            idx.map.insert(addr, Slot { lp, len, fp });
        }
        idx.head = head;
        idx
    }

    pub fn entries(&self) -> usize {
        self.map.len()
    }
}

/// An entry's header, as written before its stored bytes.
fn encode_header(uuid: &[u8; 16], lp: u64, addr: u64, sum: &Checksum, len: u32) -> [u8; 128] {
    let mut h = [0u8; CACHEDEV_HEADER_BYTES];
    h[0..8].copy_from_slice(&ENTRY_MAGIC);
    h[8..24].copy_from_slice(uuid);
    h[24..32].copy_from_slice(&lp.to_le_bytes());
    h[32..40].copy_from_slice(&addr.to_le_bytes());
    h[40..44].copy_from_slice(&len.to_le_bytes());
    h[48..80].copy_from_slice(sum);
    let x = checksum::xxh3_64(&h[..120]);
    h[120..128].copy_from_slice(&x.to_le_bytes());
    h
}

/// (log position, address, stored length, checksum fingerprint) of a header of this cache,
/// or `None` for any other bytes.
fn decode_header(uuid: &[u8; 16], h: &[u8]) -> Option<(u64, u64, u32, u64)> {
    if h.len() < CACHEDEV_HEADER_BYTES || h[0..8] != ENTRY_MAGIC || h[8..24] != uuid[..] {
        return None;
    }
    if checksum::xxh3_64(&h[..120]).to_le_bytes() != h[120..128] {
        return None;
    }
    let lp = u64::from_le_bytes(h[24..32].try_into().unwrap());
    let addr = u64::from_le_bytes(h[32..40].try_into().unwrap());
    let len = u32::from_le_bytes(h[40..44].try_into().unwrap());
    // Bounded, so that no sum of positions and lengths made from it can overflow.
    if len == 0 || len as usize > CACHEDEV_RECORD_BYTES_MAX || lp > CACHEDEV_LOG_POSITION_MAX {
        return None;
    }
    let fp = u64::from_le_bytes(h[48..56].try_into().unwrap());
    Some((lp, addr, len, fp))
}

/// The cache holds what the pool holds (an unencrypted volume's data in the clear): say so
/// when others than its owner may read it (the pool's own device files are mode 0600).
fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    if let Ok(m) = std::fs::metadata(path) {
        if (m.file_type().is_file() || m.file_type().is_block_device()) && m.mode() & 0o077 != 0 {
            tracing::warn!(
                device = %path.display(),
                "cache device has mode {:o}: others than its owner may read the copies it \
                 holds (make it 0600)",
                m.mode() & 0o777
            );
        }
    }
}

/// The refusal of a device that holds something else than a cache device label.
fn foreign(path: &Path) -> Error {
    Error::Invalid(format!(
        "{} holds something other than a bulwark cache device label (data? a pool member? a \
         damaged label?); to use it as a cache device, zero its first 4 KiB (dd if=/dev/zero \
         of={} bs=4096 count=1 conv=notrunc)",
        path.display(),
        path.display()
    ))
}

struct Label {
    uuid: [u8; 16],
    pool_id: [u8; 16],
    ring: u64,
}

fn encode_label(l: &Label) -> Vec<u8> {
    let mut b = vec![0u8; CACHEDEV_LABEL_BYTES];
    b[0..16].copy_from_slice(&LABEL_MAGIC);
    b[16..20].copy_from_slice(&LABEL_VERSION.to_le_bytes());
    b[24..40].copy_from_slice(&l.uuid);
    b[40..56].copy_from_slice(&l.pool_id);
    b[56..64].copy_from_slice(&l.ring.to_le_bytes());
    let n = CACHEDEV_LABEL_BYTES - 32;
    let sum = checksum::checksum(&b[..n]);
    b[n..].copy_from_slice(&sum);
    b
}

/// `Ok(None)`: not a cache label; `Err`: a cache label this build cannot use.
fn decode_label(b: &[u8]) -> Result<Option<Label>> {
    let n = CACHEDEV_LABEL_BYTES - 32;
    if b.len() != CACHEDEV_LABEL_BYTES
        || b[0..16] != LABEL_MAGIC
        || checksum::checksum(&b[..n])[..] != b[n..]
    {
        return Ok(None);
    }
    let version = u32::from_le_bytes(b[16..20].try_into().unwrap());
    if version != LABEL_VERSION {
        return Err(Error::Invalid(format!(
            "cache device label version {version}; this build knows {LABEL_VERSION}"
        )));
    }
    Ok(Some(Label {
        uuid: b[24..40].try_into().unwrap(),
        pool_id: b[40..56].try_into().unwrap(),
        ring: u64::from_le_bytes(b[56..64].try_into().unwrap()),
    }))
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    errors: AtomicU64,
    read_errors: AtomicU64,
    write_errors: AtomicU64,
    fills: AtomicU64,
    fills_dropped: AtomicU64,
}

/// A record waiting to be written to the cache.
struct Fill {
    addr: u64,
    sum: Checksum,
    bytes: Vec<u8>,
}

#[derive(Default)]
struct Queue {
    fills: Vec<Fill>,
    bytes: usize,
    /// The writer thread is writing a batch it took.
    writing: bool,
    closing: bool,
}

/// An open cache device: its index, counters and writer thread.
pub struct CacheDevice {
    path: PathBuf,
    dev: Arc<dyn Device>,
    uuid: [u8; 16],
    ring: u64,
    index: Mutex<Index>,
    /// The index is rebuilt (the scan at open ended): fills are taken.
    ready: AtomicBool,
    counters: Counters,
    queue: Mutex<Queue>,
    queued: Condvar,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl CacheDevice {
    /// Open the cache device at `path` for pool `pool_id`, claiming it for this process.
    /// A device with this pool's label is kept (its index is rebuilt by a scan in the
    /// background); one whose first 4 KiB are zeros, or that carries another pool's cache
    /// label, is formatted with the label `uuid`. Anything else is refused: it may be a
    /// disk holding data (a pool member starts with its superblock).
    pub fn open(path: &Path, pool_id: [u8; 16], uuid: [u8; 16]) -> Result<Arc<CacheDevice>> {
        let mut file = FileDevice::open(path)?;
        file.claim()?;
        let size = file.size();
        warn_if_readable_by_others(path);
        if size < CACHEDEV_BYTES_MIN {
            return Err(Error::Invalid(format!(
                "cache device {} is {} bytes: the minimum is {}",
                path.display(),
                size,
                CACHEDEV_BYTES_MIN
            )));
        }
        let ring =
            (size - CACHEDEV_LABEL_BYTES as u64) / CACHEDEV_ENTRY_ALIGN * CACHEDEV_ENTRY_ALIGN;
        let mut raw = vec![0u8; CACHEDEV_LABEL_BYTES];
        file.read_at(&mut raw, 0)
            .map_err(|e| Error::device(path, e))?;
        let (label, warm) = match decode_label(&raw)? {
            Some(l) if l.pool_id == pool_id && l.ring == ring => (l, true),
            Some(l) => {
                tracing::warn!(
                    device = %path.display(),
                    "cache device was another pool's ({}) or of another size: formatting it",
                    crate::hex::to_hex(&l.pool_id)
                );
                (
                    Label {
                        uuid,
                        pool_id,
                        ring,
                    },
                    false,
                )
            }
            None if raw.iter().all(|&b| b == 0) => (
                Label {
                    uuid,
                    pool_id,
                    ring,
                },
                false,
            ),
            None => return Err(foreign(path)),
        };
        if !warm {
            file.write_at(&encode_label(&label), 0)
                .and_then(|()| file.flush())
                .map_err(|e| Error::device(path, e))?;
        }
        let cache = Arc::new(CacheDevice {
            path: path.to_path_buf(),
            dev: Arc::new(file),
            uuid: label.uuid,
            ring,
            index: Mutex::new(Index::new(ring)),
            ready: AtomicBool::new(!warm),
            counters: Counters::default(),
            queue: Mutex::new(Queue::default()),
            queued: Condvar::new(),
            writer: Mutex::new(None),
        });
        let c = cache.clone();
        let handle = std::thread::Builder::new()
            .name("bulwark-cachedev".into())
            .spawn(move || {
                if warm {
                    c.scan();
                }
                c.writer_loop();
            })
            .map_err(Error::Io)?;
        *cache.writer.lock() = Some(handle);
        Ok(cache)
    }

    /// Whether `path` can serve as a cache device, writing nothing: it exists, is large
    /// enough, and starts with zeros or a bulwark cache label (`open` formats the former).
    pub fn check(path: &Path) -> Result<()> {
        if !path.exists() {
            return Err(Error::NotFound(format!(
                "cache device {} does not exist (create it first: a file, e.g. 'truncate -s 1G \
                 {}', or a block device)",
                path.display(),
                path.display()
            )));
        }
        let file = FileDevice::open(path)?;
        if file.size() < CACHEDEV_BYTES_MIN {
            return Err(Error::Invalid(format!(
                "cache device {} is {} bytes: the minimum is {}",
                path.display(),
                file.size(),
                CACHEDEV_BYTES_MIN
            )));
        }
        let mut raw = vec![0u8; CACHEDEV_LABEL_BYTES];
        file.read_at(&mut raw, 0)
            .map_err(|e| Error::device(path, e))?;
        if decode_label(&raw)?.is_none() && raw.iter().any(|&b| b != 0) {
            return Err(foreign(path));
        }
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the record at `addr` with this checksum and length is cached (for a run of
    /// reads deciding which blocks to take from here): one short lock per run.
    pub fn cached(&self, keys: impl Iterator<Item = (u64, Checksum, usize)>, out: &mut Vec<bool>) {
        let idx = self.index.lock();
        out.clear();
        out.extend(keys.map(|(addr, sum, len)| idx.get(addr, &sum, len).is_some()));
    }

    /// Read the record at pool address `addr` (`len` stored bytes, checksum `sum`) from the
    /// cache into `out`, verified. False on a miss, and on a copy that failed verification
    /// (counted, dropped): the caller reads the pool.
    pub fn read(&self, addr: u64, len: usize, sum: &Checksum, out: &mut Vec<u8>) -> bool {
        let slot = self.index.lock().get(addr, sum, len);
        let Some(slot) = slot else {
            self.counters.misses.fetch_add(1, Ordering::Relaxed);
            return false;
        };
        out.resize(len, 0);
        let off = self.offset(slot.lp) + CACHEDEV_HEADER_BYTES as u64;
        let verified = match self.dev.read_at(&mut out[..len], off) {
            Ok(()) => checksum::verify(sum, &out[..len]),
            Err(e) => {
                self.counters.read_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(device = %self.path.display(), offset = off, "cache device read failed: {e}");
                false
            }
        };
        if verified {
            self.counters.hits.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        // Still indexed at the same place: the bytes were bad (not overwritten by a fill
        // that raced this read, which drops the entry first).
        if self.index.lock().remove_if(addr, slot.lp) {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(device = %self.path.display(), offset = off, len, "cache device copy failed its checksum: dropped, read from the pool");
        }
        self.counters.misses.fetch_add(1, Ordering::Relaxed);
        false
    }

    /// A copy that verified by its checksum failed to decode (its AEAD tag, say): drop it,
    /// counted as an error when the pool's copy decoded (`count`).
    pub fn reject(&self, addr: u64, sum: &Checksum, len: usize, count: bool) {
        let mut idx = self.index.lock();
        if let Some(slot) = idx.get(addr, sum, len) {
            if idx.remove_if(addr, slot.lp) && count {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Count `n` reads that did not look here (blocks read as a run from the pool).
    pub fn count_misses(&self, n: u64) {
        self.counters.misses.fetch_add(n, Ordering::Relaxed);
    }

    /// Offer the stored bytes of the record at `addr` (the concatenation of `parts`),
    /// read from the pool and verified, for the cache. Queued for the writer thread;
    /// dropped when the queue is full or the index is still being rebuilt.
    pub fn offer(&self, addr: u64, sum: &Checksum, parts: &[&[u8]]) {
        if !self.ready.load(Ordering::Relaxed) {
            return;
        }
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len == 0 || len > CACHEDEV_RECORD_BYTES_MAX {
            return;
        }
        let mut q = self.queue.lock();
        if q.closing || q.bytes + len > CACHEDEV_FILL_QUEUE_BYTES {
            self.counters.fills_dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let mut bytes = Vec::with_capacity(len);
        for p in parts {
            bytes.extend_from_slice(p);
        }
        q.bytes += len;
        q.fills.push(Fill {
            addr,
            sum: *sum,
            bytes,
        });
        drop(q);
        self.queued.notify_one();
    }

    /// Stop the writer thread (what waits in its queue is dropped). The pool's close.
    pub fn close(&self) {
        self.queue.lock().closing = true;
        self.queued.notify_all();
        if let Some(h) = self.writer.lock().take() {
            let _ = h.join();
        }
    }

    /// Wait until the fill queue is empty and written (tests).
    #[doc(hidden)]
    pub fn settle(&self) {
        loop {
            {
                let q = self.queue.lock();
                if (q.fills.is_empty() && !q.writing && self.ready.load(Ordering::Acquire))
                    || q.closing
                {
                    return;
                }
            }
            crate::env::sleep(std::time::Duration::from_millis(5));
        }
    }

    pub fn status(&self) -> CacheDeviceStatus {
        let c = &self.counters;
        let (used, entries) = {
            let idx = self.index.lock();
            (idx.used, idx.entries() as u64)
        };
        let hits = c.hits.load(Ordering::Relaxed);
        let misses = c.misses.load(Ordering::Relaxed);
        CacheDeviceStatus {
            path: self.path.clone(),
            state: if self.ready.load(Ordering::Relaxed) {
                "ONLINE"
            } else {
                "SCANNING"
            }
            .into(),
            reason: None,
            size_bytes: self.ring,
            used_bytes: used,
            entries,
            hits,
            misses,
            hit_rate: if hits + misses == 0 {
                0.0
            } else {
                hits as f64 / (hits + misses) as f64
            },
            errors: c.errors.load(Ordering::Relaxed),
            read_errors: c.read_errors.load(Ordering::Relaxed),
            write_errors: c.write_errors.load(Ordering::Relaxed),
            fills: c.fills.load(Ordering::Relaxed),
            fills_dropped: c.fills_dropped.load(Ordering::Relaxed),
        }
    }

    /// Device offset of log position `lp`.
    fn offset(&self, lp: u64) -> u64 {
        CACHEDEV_LABEL_BYTES as u64 + lp % self.ring
    }

    /// Rebuild the index from the entry headers on the device (a warm start).
    fn scan(&self) {
        let mut found = Vec::new();
        let mut chunk = vec![0u8; CACHEDEV_SCAN_CHUNK_BYTES];
        // Ring offsets chunk[..] holds: [at, at + valid).
        let (mut at, mut valid) = (0u64, 0usize);
        let mut pos = 0u64;
        let hb = CACHEDEV_HEADER_BYTES as u64;
        while pos + hb <= self.ring {
            if pos < at || pos + hb > at + valid as u64 {
                if self.queue.lock().closing {
                    return; // the pool closes: no need of an index
                }
                at = pos;
                valid = (self.ring - pos).min(chunk.len() as u64) as usize;
                if let Err(e) = self.dev.read_at(&mut chunk[..valid], self.offset(pos)) {
                    // The entries in an unreadable stretch are lost; the rest are kept.
                    self.counters.read_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(device = %self.path.display(), offset = self.offset(pos), "cache device scan: {e}; skipping {valid} bytes");
                    pos += valid as u64;
                    valid = 0;
                    continue;
                }
            }
            let h = &chunk[(pos - at) as usize..(pos - at + hb) as usize];
            match decode_header(&self.uuid, h) {
                Some((lp, addr, len, fp))
                    if lp % self.ring == pos && pos + entry_bytes(len as usize) <= self.ring =>
                {
                    let bytes = entry_bytes(len as usize);
                    found.push((lp, bytes as u32, addr, len, fp));
                    pos += bytes;
                    // Bounded while scanning too: only the newest entries can be kept.
                    if found.len() >= CACHEDEV_INDEX_ENTRIES_MAX + CACHEDEV_INDEX_ENTRIES_MAX / 4 {
                        found.sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
                        found.truncate(CACHEDEV_INDEX_ENTRIES_MAX);
                    }
                }
                _ => pos += CACHEDEV_ENTRY_ALIGN,
            }
        }
        let idx = Index::rebuild(self.ring, found);
        tracing::info!(device = %self.path.display(), entries = idx.entries(), "cache device index rebuilt");
        *self.index.lock() = idx;
        self.ready.store(true, Ordering::Release);
    }

    fn writer_loop(&self) {
        let mut buf: Vec<u8> = Vec::with_capacity(CACHEDEV_FILL_BATCH_BYTES);
        loop {
            let fills = {
                let mut q = self.queue.lock();
                while q.fills.is_empty() && !q.closing {
                    self.queued.wait(&mut q);
                }
                if q.closing {
                    return;
                }
                q.bytes = 0;
                q.writing = true;
                std::mem::take(&mut q.fills)
            };
            // Entries placed but not yet written: (address, checksum, length, log position).
            let mut run: Vec<(u64, Checksum, usize, u64)> = Vec::new();
            let mut run_lp = 0;
            buf.clear();
            for f in fills {
                // Bytes that do not verify are never written (they were offered verified;
                // this is the cache's own check before it keeps them).
                if !checksum::verify(&f.sum, &f.bytes) {
                    continue;
                }
                let bytes = entry_bytes(f.bytes.len());
                let lp = {
                    let mut idx = self.index.lock();
                    if idx.get(f.addr, &f.sum, f.bytes.len()).is_some() {
                        continue;
                    }
                    idx.place(bytes, f.addr)
                };
                // Not right after the run (the ring wrapped), or the batch is full.
                if !run.is_empty()
                    && (lp != run_lp + buf.len() as u64
                        || buf.len() + bytes as usize > CACHEDEV_FILL_BATCH_BYTES)
                {
                    self.write_run(run_lp, &buf, &mut run);
                    buf.clear();
                }
                if run.is_empty() {
                    run_lp = lp;
                }
                buf.extend_from_slice(&encode_header(
                    &self.uuid,
                    lp,
                    f.addr,
                    &f.sum,
                    f.bytes.len() as u32,
                ));
                buf.extend_from_slice(&f.bytes);
                buf.resize((lp - run_lp + bytes) as usize, 0);
                run.push((f.addr, f.sum, f.bytes.len(), lp));
            }
            if !run.is_empty() {
                self.write_run(run_lp, &buf, &mut run);
            }
            self.queue.lock().writing = false;
        }
    }

    /// Write the entries placed at `lp..` (in `buf`) and index them.
    fn write_run(&self, lp: u64, buf: &[u8], run: &mut Vec<(u64, Checksum, usize, u64)>) {
        match self.dev.write_at(buf, self.offset(lp)) {
            Ok(()) => {
                let mut idx = self.index.lock();
                for (addr, sum, len, lp) in run.iter() {
                    idx.insert(*addr, sum, *len, *lp);
                }
                self.counters
                    .fills
                    .fetch_add(run.len() as u64, Ordering::Relaxed);
            }
            Err(e) => {
                self.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(device = %self.path.display(), "cache device write failed: {e}");
            }
        }
        run.clear();
    }
}

#[cfg(test)]
mod tests;
