//! Separate intent log devices (issue 24 part 2): the intent log's chain blocks on one
//! small device of their own, or mirrored on two, instead of in the main devices'
//! metadata segments. Given at `pool create --log-device`; `txg::logdev` adds, removes
//! and replaces them on a running pool (`bulwark pool log`).
//!
//! Layout of a log device: a label (4 KiB, two copies at the offsets of the main
//! devices' front superblock slots) naming the pool, the device's own id and its role,
//! then from `DEVICE_RESERVED_FRONT` on a ring of `LOG_BLOCK_BYTES` slots. A commit names
//! the log devices (their ids) and the slot where this generation's chain starts in its
//! superblock (`Superblock::log_devices`, `log_dev_head`); block `seq` of the chain lies in
//! slot `(head + seq) % slots`. The blocks are the main chain's (`block::Block`: pool id,
//! generation, sequence number, self-checked), so a slot still holding an older
//! generation's block is simply the end of the chain. A chain never takes the whole ring:
//! a flush that would wrap onto the chain's own head commits instead.
//!
//! A flush writes its blocks to every working log device (one write each, the slots
//! being consecutive, two where the ring wraps) and syncs them. A small flush (at most
//! `INLINE_BYTES_MAX` of records, and an eighth of the ring) puts the stored bytes of the
//! records its entries name into the slots after each block (`Block::data_slots`): read
//! back from the main devices (their page cache) and verified, they make the log device
//! alone enough, and the main devices are not synced. A larger flush names the records
//! only, and the main devices are synced once for them meanwhile. Replay checks every
//! entry's record on the main devices; one that is not there whole is written back from
//! the log's copy when the block carries one (verified against the entry's pointer, to
//! the place the pointer names, which nothing else can have taken since: the flush ended
//! the recycle epoch), and ends the replay otherwise, as a flush that never returned.
//!
//! The log device is never what poisons the pool: a failed write or sync, or its file
//! gone from its path (a deleted file still takes writes, into an inode nobody will
//! find again), takes that device out; with none left the log *falls back*: this flush
//! and every later one go the way of a pool without log devices (a commit now, the main
//! devices' chain after it), a warning is logged once, and `status` says so until the
//! pool is imported again or the log devices are changed (`bulwark pool log`).
//!
//! At import, a log device that is missing, or not this pool's, is reported; with no
//! log device left, the flushes made since the superblock's generation that lived only
//! on the log are lost (the import says so), and the pool is the last commit: consistent,
//! never a mix.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::checksum::{seal_self_checked, verify, SELF_CHECKED};
use crate::constants::{DEVICE_RESERVED_FRONT, SUPERBLOCK_BYTES, SUPERBLOCK_SLOT_OFFSETS};
use crate::device::fault::FaultyDevice;
use crate::device::{Device, FileDevice};
use crate::map::ADDR_NONE;
use crate::pool::intentlog::block::{Block, Entry, ENTRIES_PER_BLOCK, LOG_BLOCK_BYTES};
use crate::{Error, Result};

const MAGIC: &[u8; 8] = b"BWLOGDV1";
/// The device's role: the intent log (a read cache device would be another).
pub const ROLE_INTENT_LOG: u32 = 1;
/// Smallest log device: the label area and 768 slots.
pub const LOG_DEVICE_BYTES_MIN: u64 = 4 << 20;

/// A log device's label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Label {
    pub pool_id: [u8; 16],
    pub device_id: [u8; 16],
    pub role: u32,
    /// Slots of the ring.
    pub slots: u64,
}

impl Label {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; SUPERBLOCK_BYTES];
        b[0..8].copy_from_slice(MAGIC);
        b[8..24].copy_from_slice(&self.pool_id);
        b[24..40].copy_from_slice(&self.device_id);
        b[40..44].copy_from_slice(&self.role.to_le_bytes());
        b[48..56].copy_from_slice(&self.slots.to_le_bytes());
        b[56..64].copy_from_slice(&DEVICE_RESERVED_FRONT.to_le_bytes());
        seal_self_checked(&mut b);
        b
    }

    /// `Ok(None)`: no log device label there.
    pub fn decode(b: &[u8]) -> Result<Option<Label>> {
        if b.len() != SUPERBLOCK_BYTES || &b[0..8] != MAGIC {
            return Ok(None);
        }
        if !verify(&SELF_CHECKED, b) {
            return Err(Error::Corrupt("log device label checksum mismatch".into()));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        let role = u32::from_le_bytes(b[40..44].try_into().unwrap());
        if role != ROLE_INTENT_LOG {
            return Err(Error::Corrupt(format!(
                "log device label has role {role}, unknown to this bulwark"
            )));
        }
        if u64_at(56) != DEVICE_RESERVED_FRONT || u64_at(48) < 2 {
            return Err(Error::Corrupt(format!(
                "log device label has {} slots from offset {}",
                u64_at(48),
                u64_at(56)
            )));
        }
        Ok(Some(Label {
            pool_id: b[8..24].try_into().unwrap(),
            device_id: b[24..40].try_into().unwrap(),
            role,
            slots: u64_at(48),
        }))
    }
}

/// The label on `dev`, from either copy; `None` when neither holds one.
pub fn read_label(dev: &dyn Device) -> Option<Label> {
    let mut buf = vec![0u8; SUPERBLOCK_BYTES];
    for off in SUPERBLOCK_SLOT_OFFSETS {
        if dev.read_at(&mut buf, off).is_ok() {
            match Label::decode(&buf) {
                Ok(Some(l)) if l.slots <= slots_of(dev.size()) => return Some(l),
                Ok(_) => {}
                Err(e) => tracing::warn!(device = %dev.path().display(), "{e}"),
            }
        }
    }
    None
}

/// Write `label` to both copies, and sync.
pub fn write_label(dev: &dyn Device, label: &Label) -> Result<()> {
    let bytes = label.encode();
    for off in SUPERBLOCK_SLOT_OFFSETS {
        dev.write_at(&bytes, off)
            .map_err(|e| Error::device(dev.path(), e))?;
    }
    dev.flush().map_err(|e| Error::device(dev.path(), e))
}

/// Zero both label copies (a device `bulwark pool log remove` took out).
pub fn wipe_label(dev: &dyn Device) -> Result<()> {
    let zero = vec![0u8; SUPERBLOCK_BYTES];
    for off in SUPERBLOCK_SLOT_OFFSETS {
        dev.write_at(&zero, off)
            .map_err(|e| Error::device(dev.path(), e))?;
    }
    dev.flush().map_err(|e| Error::device(dev.path(), e))
}

/// Slots a device of `size` bytes holds.
pub fn slots_of(size: u64) -> u64 {
    size.saturating_sub(DEVICE_RESERVED_FRONT) / LOG_BLOCK_BYTES as u64
}

fn slot_offset(slot: u64) -> u64 {
    DEVICE_RESERVED_FRONT + slot * LOG_BLOCK_BYTES as u64
}

/// What names a file or disk whatever the path to it (see `format::config::file_identity`).
fn identity(p: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let m = std::fs::metadata(p).ok()?;
    Some(
        if m.file_type().is_block_device() || m.file_type().is_char_device() {
            (u64::MAX, m.rdev())
        } else {
            (m.dev(), m.ino())
        },
    )
}

/// Check a device for use as a new log device: big enough, and no label of any pool on
/// it (main or log), but a log device label `reuse` accepts (one of this pool's that its
/// superblock does not name: left by a `bulwark pool log` change that did not finish).
/// Returns it opened and claimed.
pub fn open_new(path: &Path, reuse: &dyn Fn(&Label) -> bool) -> Result<FileDevice> {
    if !path.exists() {
        return Err(Error::NotFound(format!(
            "log device {} does not exist (create the file first)",
            path.display()
        )));
    }
    // Absolute, but not canonical: /dev/disk/by-id/... stays what it is (the /dev/sdX
    // it points to today may be another disk after a reboot).
    let abs = std::path::absolute(path).map_err(|e| Error::device(path, e))?;
    let mut d = FileDevice::open(&abs)?;
    d.claim()?;
    if d.size() < LOG_DEVICE_BYTES_MIN {
        return Err(Error::Invalid(format!(
            "log device {} is too small ({}); the minimum is {}",
            path.display(),
            crate::size::format_size(d.size()),
            crate::size::format_size(LOG_DEVICE_BYTES_MIN)
        )));
    }
    if let Some(sb) = crate::pool::format::labels::front_label(&d) {
        return Err(Error::Exists(format!(
            "device {} already belongs to bulwark pool {}; wipe its first MiB to reuse it",
            path.display(),
            crate::hex::to_hex(&sb.pool_id)
        )));
    }
    if let Some(l) = read_label(&d).filter(|l| !reuse(l)) {
        return Err(Error::Exists(format!(
            "device {} is already a log device of bulwark pool {}; wipe its first MiB to reuse it",
            path.display(),
            crate::hex::to_hex(&l.pool_id)
        )));
    }
    Ok(d)
}

const ONLINE: u8 = 0;
const FAULTED: u8 = 1;
const UNAVAIL: u8 = 2;

/// One log device of the pool.
pub(crate) struct LogDevice {
    pub path: PathBuf,
    pub id: [u8; 16],
    /// `None`: missing at import (or not this pool's).
    pub dev: Option<Arc<FaultyDevice>>,
    /// The file or disk its path named when opened: a path that names another (or
    /// nothing) means the device is gone.
    identity: Option<(u64, u64)>,
    state: AtomicU8,
    pub write_errors: AtomicU64,
    pub size_bytes: u64,
    /// The ring's slots, as its label says (every log device of a pool says the same:
    /// block `seq` must lie in the same slot on each, whichever are present).
    pub slots: u64,
}

impl LogDevice {
    /// Open the device at `path` as log device `id` of pool `pool_id`; a device that is
    /// missing, unreadable or not that is kept as `UNAVAIL`, with the reason.
    pub(crate) fn open(
        path: &Path,
        id: [u8; 16],
        pool_id: &[u8; 16],
    ) -> (LogDevice, Option<String>) {
        let missing = |why: String| {
            (
                LogDevice {
                    path: path.to_path_buf(),
                    id,
                    dev: None,
                    identity: None,
                    state: AtomicU8::new(UNAVAIL),
                    write_errors: AtomicU64::new(0),
                    size_bytes: 0,
                    slots: 0,
                },
                Some(why),
            )
        };
        let mut d = match FileDevice::open(path) {
            Ok(d) => d,
            Err(e) => {
                return missing(format!(
                    "log device {} cannot be opened: {e}",
                    path.display()
                ))
            }
        };
        let slots = match read_label(&d) {
            Some(l) if &l.pool_id == pool_id && l.device_id == id => l.slots,
            Some(l) if &l.pool_id == pool_id => {
                return missing(format!(
                    "{} is another log device of this pool (id {}), not the one expected (id {})",
                    path.display(),
                    crate::hex::to_hex(&l.device_id),
                    crate::hex::to_hex(&id)
                ))
            }
            Some(l) => {
                return missing(format!(
                    "{} is a log device of another pool ({})",
                    path.display(),
                    crate::hex::to_hex(&l.pool_id)
                ))
            }
            None => return missing(format!("{} carries no log device label", path.display())),
        };
        if let Err(e) = d.claim() {
            return missing(format!("log device {}: {e}", path.display()));
        }
        let size_bytes = d.size();
        let identity = identity(path);
        let dev = Arc::new(FaultyDevice::new(Box::new(d), size_bytes));
        (
            LogDevice {
                path: path.to_path_buf(),
                id,
                dev: Some(dev),
                identity,
                state: AtomicU8::new(ONLINE),
                write_errors: AtomicU64::new(0),
                size_bytes,
                slots,
            },
            None,
        )
    }

    pub(crate) fn online(&self) -> bool {
        self.state.load(Ordering::Acquire) == ONLINE
    }

    pub(crate) fn state(&self) -> &'static str {
        match self.state.load(Ordering::Acquire) {
            ONLINE => "ONLINE",
            FAULTED => "FAULTED",
            _ => "UNAVAIL",
        }
    }

    /// Take the device out for the rest of this run.
    fn fail(&self, why: &str) {
        self.write_errors.fetch_add(1, Ordering::Relaxed);
        if self.state.swap(FAULTED, Ordering::AcqRel) == ONLINE {
            tracing::error!(device = %self.path.display(), "log device failed, no longer used: {why}");
        }
    }

    /// Whether the path still names the file or disk opened.
    fn still_there(&self) -> bool {
        identity(&self.path) == self.identity
    }
}

/// The log devices `ids` (a superblock's), each found among `paths` (pool.json's) by its
/// label; with the problems met (a device missing, not this pool's), for the import to
/// report.
pub(crate) fn open_all(
    paths: &[PathBuf],
    ids: &[[u8; 16]],
    pool_id: &[u8; 16],
) -> (LogDevices, Vec<String>) {
    let mut devices = Vec::with_capacity(ids.len());
    let mut problems = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let mut last = None;
        let mut found = None;
        for p in paths {
            let (d, why) = LogDevice::open(p, *id, pool_id);
            match why {
                None => {
                    found = Some(d);
                    break;
                }
                Some(w) => last = Some((d, w)),
            }
        }
        match (found, last) {
            (Some(d), _) => devices.push(d),
            (None, Some((mut d, why))) => {
                // Named after the path at its place in pool.json, if any.
                if let Some(p) = paths.get(i) {
                    d.path = p.clone();
                }
                problems.push(why);
                devices.push(d);
            }
            (None, None) => {
                let guess = PathBuf::from(format!("<log device {}>", crate::hex::to_hex(id)));
                let (d, _) = LogDevice::open(&guess, *id, pool_id);
                problems.push(format!(
                    "log device {} is not listed in pool.json",
                    crate::hex::to_hex(id)
                ));
                devices.push(d);
            }
        }
    }
    (LogDevices::new(devices), problems)
}

/// Most stored bytes one flush puts into the log (`LogDevices::inline_bytes_max`).
const INLINE_BYTES_MAX: usize = 256 << 10;

/// The records block `b` carries after it (`data`, its `data_slots` slots), one per entry,
/// each verified against the entry's pointer: `None` for a record that does not verify,
/// and for every entry when the block carries none (`data_slots` 0: the records are on
/// the main devices). A hole's record is empty.
pub(crate) fn inline_records<'a>(b: &Block, data: &'a [u8]) -> Vec<Option<&'a [u8]>> {
    let mut at = 0usize;
    b.entries
        .iter()
        .map(|e| {
            if e.ptr.is_hole() {
                return Some(&data[..0]);
            }
            if b.data_slots == 0 {
                return None;
            }
            let len = e.ptr.len as usize;
            let r = data
                .get(at..at + len)
                .filter(|r| verify(&e.ptr.checksum, r));
            at = (at + len).next_multiple_of(16);
            r
        })
        .collect()
}

/// This generation's chain on the log devices.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DevChain {
    pub generation: u64,
    pub head: u64,
    /// Blocks written so far.
    pub seq: u64,
}

/// Where the chain stands and whether the log fell back.
#[derive(Debug, Default)]
pub(crate) struct LogState {
    /// `None` before the first commit of this run, and once the log fell back.
    pub chain: Option<DevChain>,
    /// The slot the next commit's chain starts at (after the current one).
    pub next_head: u64,
}

/// What a flush on the log devices came to.
pub(crate) enum Appended {
    /// Durable on at least one log device.
    Done,
    /// No chain here (none yet, or the log fell back): the caller commits.
    NoChain,
    /// The chain would wrap onto its own head: the caller commits (which starts a new one).
    Full,
    /// Every log device failed: the log fell back; the caller commits.
    Failed,
    /// Durable on the log devices still working, but one failed during it: the caller
    /// commits, so the next superblock names only those (`named_ids`). Otherwise, after a
    /// crash, the failed one (stale: it missed this flush and every later one), found
    /// alone at import, would be replayed as if whole, losing them without a word.
    Degraded,
}

/// The pool's log devices.
pub(crate) struct LogDevices {
    pub devices: Vec<LogDevice>,
    /// Slots of the ring: those of the smallest device.
    pub slots: u64,
    pub state: Mutex<LogState>,
    /// No log device is usable: flushes go the main devices' way.
    pub fell_back: AtomicBool,
    /// Why it fell back, or what the import could not replay: for `status`.
    pub note: Mutex<Option<String>>,
    /// Threads that sync the second log device while the first is synced.
    syncers: crate::device::sync::Syncers,
}

impl LogDevices {
    pub(crate) fn new(devices: Vec<LogDevice>) -> LogDevices {
        let slots = devices
            .iter()
            .filter(|d| d.dev.is_some())
            .map(|d| d.slots)
            .min()
            .unwrap_or(0);
        let usable = devices.iter().any(|d| d.online()) && slots >= 2;
        LogDevices {
            devices,
            slots,
            state: Mutex::new(LogState::default()),
            fell_back: AtomicBool::new(!usable),
            note: Mutex::new(None),
            syncers: Default::default(),
        }
    }

    pub(crate) fn ids(&self) -> Vec<[u8; 16]> {
        self.devices.iter().map(|d| d.id).collect()
    }

    /// The devices a commit's superblock names: those still working (a device taken out
    /// holds a stale chain), or all of them once none is (the log fell back: flushes
    /// commit, and no chain is trusted to any device).
    pub(crate) fn named_ids(&self) -> Vec<[u8; 16]> {
        let online: Vec<[u8; 16]> = self
            .devices
            .iter()
            .filter(|d| d.online())
            .map(|d| d.id)
            .collect();
        if online.is_empty() {
            self.ids()
        } else {
            online
        }
    }

    /// The head slot the next commit's chain starts at, if the log is usable.
    pub(crate) fn next_head(&self) -> Option<u64> {
        if self.fell_back.load(Ordering::Acquire) {
            return None;
        }
        Some(self.state.lock().next_head)
    }

    /// A commit of `generation` naming `head` (or no chain here) is durable.
    pub(crate) fn committed(&self, generation: u64, head: Option<u64>) {
        let mut st = self.state.lock();
        st.chain = head.map(|head| DevChain {
            generation,
            head,
            seq: 0,
        });
        if let Some(h) = head {
            st.next_head = h;
        }
    }

    /// Whether a chain on the log devices takes flushes now.
    pub(crate) fn has_chain(&self) -> bool {
        !self.fell_back.load(Ordering::Acquire) && self.state.lock().chain.is_some()
    }

    /// Most stored bytes a flush puts into the log beside its entries (`append`): a
    /// quarter of a MiB, and an eighth of the ring. A flush of more names records the
    /// main devices hold, and syncs them.
    pub(crate) fn inline_bytes_max(&self) -> usize {
        (INLINE_BYTES_MAX as u64).min(self.slots / 8 * LOG_BLOCK_BYTES as u64) as usize
    }

    /// Append `entries` to the chain on every working log device and sync them. With
    /// `data` (each entry's record, stored bytes; empty for a hole), the records go into
    /// the log too, after each block, and the flush needs nothing of the main devices;
    /// without, the caller syncs the main devices for them. `written` is called once the
    /// blocks are written, before the syncs (crash point).
    pub(crate) fn append(
        &self,
        pool_id: [u8; 16],
        chain_id: [u8; 16],
        entries: &[Entry],
        data: Option<&[Vec<u8>]>,
        written: &dyn Fn(),
        key: &crate::pool::intentlog::block::LogKey,
    ) -> Appended {
        let mut st = self.state.lock();
        if self.fell_back.load(Ordering::Acquire) {
            return Appended::NoChain;
        }
        let Some(mut chain) = st.chain else {
            return Appended::NoChain;
        };
        let slot = |at: u64| (chain.head + at) % self.slots;
        let mut bytes = Vec::new();
        let mut at = chain.seq;
        for (i, chunk) in entries.chunks(ENTRIES_PER_BLOCK).enumerate() {
            let mut inline = Vec::new();
            if let Some(data) = data {
                for d in &data[i * ENTRIES_PER_BLOCK..i * ENTRIES_PER_BLOCK + chunk.len()] {
                    inline.extend_from_slice(d);
                    inline.resize(inline.len().next_multiple_of(16), 0);
                }
            }
            inline.resize(inline.len().next_multiple_of(LOG_BLOCK_BYTES), 0);
            let data_slots = (inline.len() / LOG_BLOCK_BYTES) as u64;
            if at + 1 + data_slots >= self.slots {
                return Appended::Full;
            }
            bytes.extend(
                Block {
                    pool_id,
                    generation: chain.generation,
                    seq: at,
                    next: [slot(at + 1 + data_slots), ADDR_NONE],
                    data_slots: data_slots as u32,
                    chain: chain_id,
                    after: [ADDR_NONE; 2],
                    flush_first: chain.seq,
                    entries: chunk.to_vec(),
                }
                .encode(key),
            );
            bytes.extend_from_slice(&inline);
            at += 1 + data_slots;
        }
        // One write per device, two where the ring wraps.
        let first = slot(chain.seq);
        let before_end = ((self.slots - first) as usize * LOG_BLOCK_BYTES).min(bytes.len());
        let (a, b) = bytes.split_at(before_end);
        let online_before = self.devices.iter().filter(|d| d.online()).count();
        let mut wrote = 0;
        for d in self.devices.iter().filter(|d| d.online()) {
            let dev = d.dev.as_ref().expect("an online log device is open");
            let r = dev.write_at(a, slot_offset(first)).and_then(|()| {
                if b.is_empty() {
                    Ok(())
                } else {
                    dev.write_at(b, slot_offset(0))
                }
            });
            match r {
                Ok(()) => wrote += 1,
                Err(e) => d.fail(&format!("write: {e}")),
            }
        }
        if wrote > 0 {
            written();
        }
        // Every online log device synced at once (a mirrored log waits for the slower).
        let (online, devs): (Vec<&LogDevice>, Vec<Arc<dyn crate::device::Device>>) = self
            .devices
            .iter()
            .filter(|d| d.online())
            .map(|d| {
                let dev = d.dev.clone().expect("an online log device is open");
                (d, dev as Arc<dyn crate::device::Device>)
            })
            .unzip();
        let mut synced = 0;
        for (d, r) in online.into_iter().zip(self.syncers.flush_all(&devs)) {
            match r {
                Ok(()) if d.still_there() => synced += 1,
                Ok(()) => d.fail("its path no longer names the device (deleted or replaced)"),
                Err(e) => d.fail(&format!("sync: {e}")),
            }
        }
        if synced == 0 {
            st.chain = None;
            drop(st);
            self.fall_back("every log device failed");
            return Appended::Failed;
        }
        chain.seq = at;
        st.chain = Some(chain);
        st.next_head = slot(chain.seq);
        if synced < online_before {
            return Appended::Degraded;
        }
        Appended::Done
    }

    /// No log device is usable: say so once, and let flushes go the main devices' way.
    pub(crate) fn fall_back(&self, why: &str) {
        if !self.fell_back.swap(true, Ordering::AcqRel) {
            let paths: Vec<String> = self
                .devices
                .iter()
                .map(|d| d.path.display().to_string())
                .collect();
            let msg = format!(
                "the intent log fell back to the main devices: {why} ({}); flushes commit \
                 or use the main devices' log until the pool is imported again with a \
                 working log device, or 'bulwark pool log' changes them",
                paths.join(", ")
            );
            tracing::warn!("{msg}");
            *self.note.lock() = Some(msg);
        }
        self.state.lock().chain = None;
    }

    /// The block `at` slots into the chain of `generation`, lying at slot `slot`, and the
    /// records stored after it (`Block::data_slots`), from the first log device whose
    /// block and records all verify (else the first that holds the block: the replay stops
    /// at the record that does not verify); `Ok(None)`: none holds it (the end of the
    /// chain).
    ///
    /// Where things lie is taken from what a key signs, never from the label's ring size
    /// (which no key signs): the first block's slot from the superblock (`log_dev_head`),
    /// each next one's from the block before (`Block::next`), and whether a block's
    /// records wrap round the ring, and where, from its own `next`. A label altered to
    /// another ring size therefore cannot make the replay read the wrong slots and stop
    /// early, silently dropping flushed writes.
    pub(crate) fn read_block(
        &self,
        slot: u64,
        at: u64,
        pool_id: &[u8; 16],
        chain: &[u8; 16],
        generation: u64,
        key: Option<&crate::pool::intentlog::block::LogKey>,
    ) -> Result<Option<(Block, Vec<u8>)>> {
        if self.slots == 0 {
            return Ok(None);
        }
        let mut buf = vec![0u8; LOG_BLOCK_BYTES];
        let mut damaged = None;
        let mut partial = None;
        for d in &self.devices {
            let Some(dev) = &d.dev else { continue };
            let held = slots_of(dev.size());
            if slot >= held {
                damaged = Some(Error::Corrupt(format!(
                    "intent log block at slot {slot} lies past the log device's {held} slots"
                )));
                continue;
            }
            if dev.read_at(&mut buf, slot_offset(slot)).is_err() || !verify(&SELF_CHECKED, &buf) {
                continue;
            }
            let b = match Block::decode(&buf, key, pool_id, chain, generation, at) {
                Ok(Some(b)) => b,
                Ok(None) => continue,
                Err(e) => {
                    damaged = Some(e);
                    continue;
                }
            };
            // A writer puts at most a flush's inline bytes after a block: a claim of more
            // (a forged block where no key signs it) is not read.
            if b.data_slots as usize > INLINE_BYTES_MAX.div_ceil(LOG_BLOCK_BYTES) {
                damaged = Some(Error::Corrupt(format!(
                    "intent log block {at} claims {} slots of records, more than a flush puts",
                    b.data_slots
                )));
                continue;
            }
            // The ring the writer used, from the block's signed link: `next` is `slot +
            // span` unless the span wrapped, and then the ring was `slot + span - next`.
            let span = b.data_slots as u64 + 1;
            let next = b.next[0];
            let ring = if next == slot + span {
                u64::MAX
            } else {
                (slot + span).wrapping_sub(next)
            };
            if ring != u64::MAX
                && (next >= slot + span || ring <= slot || ring > held || span >= ring)
                || next >= held
            {
                damaged = Some(Error::Corrupt(format!(
                    "intent log block {at} at slot {slot}: its link to slot {next} does not fit \
                     a ring of at most {held} slots with its {} slots of records",
                    b.data_slots
                )));
                continue;
            }
            let mut data = vec![0u8; b.data_slots as usize * LOG_BLOCK_BYTES];
            let mut ok = true;
            for (i, chunk) in data.chunks_mut(LOG_BLOCK_BYTES).enumerate() {
                let s = (slot + 1 + i as u64) % ring;
                ok &= dev.read_at(chunk, slot_offset(s)).is_ok();
            }
            if ok && inline_records(&b, &data).iter().all(|r| r.is_some()) {
                return Ok(Some((b, data)));
            }
            partial.get_or_insert((b, data));
        }
        match (partial, damaged) {
            (Some(p), _) => Ok(Some(p)),
            (None, Some(e)) => Err(e),
            (None, None) => Ok(None),
        }
    }

    /// Every block of the chain `(pool_id, chain, generation)` with a sequence number above
    /// `k` that verifies (MAC included) anywhere in the ring of any log device: after the
    /// replay stopped at `k`, a block here that `proves_acknowledged(k)` means the chain
    /// went on, and what the replay did not apply was acknowledged (a lost block, not a
    /// flush that never finished). The whole ring the device holds is read (its label's
    /// size is not signed), in pieces of `SCAN_BYTES`, at import only.
    pub(crate) fn blocks_after(
        &self,
        k: u64,
        pool_id: &[u8; 16],
        chain: &[u8; 16],
        generation: u64,
        key: Option<&crate::pool::intentlog::block::LogKey>,
    ) -> Vec<Block> {
        const SCAN_BYTES: usize = 1 << 20;
        let mut found: std::collections::BTreeMap<u64, Block> = Default::default();
        for d in &self.devices {
            let Some(dev) = &d.dev else { continue };
            let held = slots_of(dev.size());
            let per = (SCAN_BYTES / LOG_BLOCK_BYTES) as u64;
            let mut buf = vec![0u8; SCAN_BYTES];
            let mut slot = 0u64;
            while slot < held {
                let n = per.min(held - slot);
                let part = &mut buf[..n as usize * LOG_BLOCK_BYTES];
                if dev.read_at(part, slot_offset(slot)).is_err() {
                    slot += n;
                    continue;
                }
                for b in part.chunks(LOG_BLOCK_BYTES) {
                    let Some(seq) = Block::claimed_seq(b) else {
                        continue;
                    };
                    if seq <= k || found.contains_key(&seq) || !verify(&SELF_CHECKED, b) {
                        continue;
                    }
                    if let Ok(Some(block)) = Block::decode(b, key, pool_id, chain, generation, seq)
                    {
                        found.insert(seq, block);
                    }
                }
                slot += n;
            }
        }
        found.into_values().collect()
    }

    /// `log` in `status`.
    pub(crate) fn status(&self) -> crate::pool::status::LogStatus {
        let devices = self
            .devices
            .iter()
            .map(|d| crate::pool::status::DeviceStatus {
                path: d.path.clone(),
                state: d.state().to_string(),
                read_errors: 0,
                write_errors: d.write_errors.load(Ordering::Relaxed),
                cksum_errors: 0,
                size_bytes: d.size_bytes,
                fault: None,
            })
            .collect::<Vec<_>>();
        let state = if self.fell_back.load(Ordering::Acquire) {
            "FELL_BACK"
        } else if self.devices.iter().all(|d| d.online()) {
            "ONLINE"
        } else {
            "DEGRADED"
        };
        crate::pool::status::LogStatus {
            state: state.into(),
            devices,
            note: self.note.lock().clone(),
        }
    }
}
