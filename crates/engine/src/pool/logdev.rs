//! Separate intent log devices (issue 24 part 2): the intent log's chain blocks on one
//! small device of their own, or mirrored on two, instead of in the main devices'
//! metadata segments.
//!
//! Layout of a log device: a label (4 KiB, two copies at the offsets of the main
//! devices' front superblock slots) naming the pool, the device's own id and its role,
//! then from `DEVICE_RESERVED_FRONT` on a ring of `LOG_BLOCK_BYTES` slots. A commit names
//! the log devices (their ids) and the slot where this generation's chain starts in its
//! superblock (`Superblock::log_devices`, `log_dev_head`); block `seq` of the chain lies in
//! slot `(head + seq) % slots`. The blocks are the main chain's (`intent::Block`: pool id,
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

use super::intent::{Block, Entry, ENTRIES_PER_BLOCK, LOG_BLOCK_BYTES};
use crate::checksum::{seal_self_checked, verify, SELF_CHECKED};
use crate::constants::{DEVICE_RESERVED_FRONT, SUPERBLOCK_BYTES, SUPERBLOCK_SLOT_OFFSETS};
use crate::device::fault::FaultyDevice;
use crate::device::{Device, FileDevice};
use crate::map::ADDR_NONE;
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

/// What names a file or disk whatever the path to it (see `create::file_identity`).
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
    if let Some(sb) = super::format::labels::front_label(&d) {
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
        key: &super::intent::LogKey,
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
        key: Option<&super::intent::LogKey>,
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
        key: Option<&super::intent::LogKey>,
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
    pub(crate) fn status(&self) -> super::LogStatus {
        let devices = self
            .devices
            .iter()
            .map(|d| super::DeviceStatus {
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
        super::LogStatus {
            state: state.into(),
            devices,
            note: self.note.lock().clone(),
        }
    }
}

impl super::core::Core {
    /// Make the devices at `paths` the pool's log devices (none: the log goes back to
    /// the main devices): those already in use stay, the others are labelled (and must
    /// carry no label), the ones not named any more are dropped and their labels wiped.
    /// Under the device and commit locks; durable when it returns. Order, for a crash at
    /// any step: pool.json lists the old and the new devices, a commit names the new set,
    /// pool.json lists only it, the dropped labels are wiped (the import uses the devices
    /// the superblock names, found among pool.json's by their labels).
    pub fn set_log_devices(&self, paths: &[PathBuf]) -> Result<()> {
        use super::format::superblock::LOG_DEVICES_MAX;
        if paths.len() > LOG_DEVICES_MAX {
            return Err(Error::Invalid(format!(
                "{} log devices; a pool has at most {LOG_DEVICES_MAX} (the log mirrored on both)",
                paths.len()
            )));
        }
        self.store.check_poisoned()?;
        if !paths.is_empty() && self.tier.is_some() {
            // The import refuses log devices beside a store (a flush is a commit there,
            // or local through the intent log on the main devices): the pool would not
            // open again.
            return Err(Error::Invalid(
                "this pool has an object store: its flushes go to the store (or with \
                 --object-store-flush local, to the main devices' log), and it takes no \
                 separate log device"
                    .into(),
            ));
        }
        let _d = self.device_lock.lock();
        let _c = self.commit_lock.lock();
        let pool_id = self.sb.lock().sb.pool_id;
        let old = self.logdev.read().clone();
        let canon = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
        let members: Vec<PathBuf> = self
            .store
            .red
            .members
            .iter()
            .map(|m| canon(&m.path()))
            .collect();
        let mut ids = Vec::new();
        // Canonical paths to compare, the paths as given (absolute) to keep.
        let mut listed: Vec<PathBuf> = Vec::new();
        let mut given: Vec<PathBuf> = Vec::new();
        let mut fresh: Vec<(PathBuf, FileDevice, [u8; 16])> = Vec::new();
        for p in paths {
            let c = canon(p);
            if members.contains(&c) {
                return Err(Error::Invalid(format!(
                    "{} is a device of the pool, not a free device for its log",
                    p.display()
                )));
            }
            if listed.contains(&c) {
                return Err(Error::Invalid(format!(
                    "log device {} is given twice",
                    p.display()
                )));
            }
            let kept = old
                .as_ref()
                .and_then(|l| l.devices.iter().find(|d| canon(&d.path) == c));
            match kept {
                Some(d) if d.online() => ids.push(d.id),
                Some(d) => {
                    return Err(Error::Invalid(format!(
                        "log device {} is {}: remove it first ('bulwark pool log remove {}')",
                        d.path.display(),
                        d.state(),
                        d.path.display()
                    )))
                }
                None => {
                    let named = old.as_ref().map(|l| l.ids()).unwrap_or_default();
                    let dev = open_new(p, &|l: &Label| {
                        l.pool_id == pool_id && !named.contains(&l.device_id)
                    })?;
                    let id = crate::keys::wrap::random_bytes::<16>();
                    ids.push(id);
                    fresh.push((c.clone(), dev, id));
                }
            }
            listed.push(c);
            given.push(std::path::absolute(p).map_err(|e| Error::device(p, e))?);
        }
        let dropped: Vec<PathBuf> = old
            .as_ref()
            .map(|l| {
                l.devices
                    .iter()
                    .filter(|d| !listed.contains(&canon(&d.path)))
                    .map(|d| d.path.clone())
                    .collect()
            })
            .unwrap_or_default();
        // Every device of the new set says the same ring size, the smallest one's. The
        // commit first leaves the current chain empty, so a crash after a kept device's
        // label changed its ring size loses no flush (an empty chain reads the same in
        // any ring).
        self.commit_held()?;
        let kept: Vec<(&LogDevice, Arc<FaultyDevice>)> = old
            .iter()
            .flat_map(|l| l.devices.iter())
            .filter(|d| ids.contains(&d.id))
            .filter_map(|d| d.dev.clone().map(|dev| (d, dev)))
            .collect();
        let slots = fresh
            .iter()
            .map(|(_, d, _)| slots_of(d.size()))
            .chain(kept.iter().map(|(d, _)| slots_of(d.size_bytes)))
            .min()
            .unwrap_or(0);
        for (_, dev, id) in &fresh {
            write_label(
                dev,
                &Label {
                    pool_id,
                    device_id: *id,
                    role: ROLE_INTENT_LOG,
                    slots,
                },
            )?;
        }
        for (d, dev) in &kept {
            if d.slots != slots {
                write_label(
                    &**dev,
                    &Label {
                        pool_id,
                        device_id: d.id,
                        role: ROLE_INTENT_LOG,
                        slots,
                    },
                )?;
            }
        }
        let mut conf = super::format::config::PoolConfig::read(&self.dir)?;
        let stored = |p: &PathBuf| {
            p.strip_prefix(&self.dir)
                .map(Path::to_path_buf)
                .unwrap_or(p.clone())
        };
        let mut both: Vec<PathBuf> = conf.log_devices.clone();
        for p in &given {
            if !both.contains(&stored(p)) {
                both.push(stored(p));
            }
        }
        conf.log_devices = both;
        conf.write(&self.dir)?;
        let new = if ids.is_empty() {
            None
        } else {
            let (l, problems) = open_all(&given, &ids, &pool_id);
            if let Some(p) = problems.first() {
                return Err(Error::Invalid(p.clone()));
            }
            Some(Arc::new(l))
        };
        if let Some(l) = &old {
            // Whatever its chain holds is in the map: the commit below covers it.
            l.state.lock().chain = None;
        }
        *self.logdev.write() = new;
        self.commit_held()?;
        conf.log_devices = given.iter().map(stored).collect();
        conf.write(&self.dir)?;
        drop(old);
        for p in dropped {
            match FileDevice::open(&p) {
                Ok(d) if read_label(&d).is_some_and(|l| l.pool_id == pool_id) => {
                    if let Err(e) = wipe_label(&d) {
                        tracing::warn!("the label of log device {} stays: {e}", p.display());
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// For tests: a pool in `dir/p` of `count` 64 MiB device files in `layout`, with its
/// intent log on a separate `log_bytes` file `dir/log.img`; returns (pool dir, log path).
#[cfg(test)]
pub(crate) fn test_pool_with_log(
    dir: &std::path::Path,
    layout: super::Layout,
    count: usize,
    log_bytes: u64,
) -> (PathBuf, PathBuf) {
    let log = dir.join("log.img");
    std::fs::File::create(&log)
        .unwrap()
        .set_len(log_bytes)
        .unwrap();
    let pdir = dir.join("p");
    super::Pool::create_with_log(
        &pdir,
        layout,
        super::DeviceSpec::Files {
            count,
            size_bytes: 64 << 20,
        },
        "p",
        std::slice::from_ref(&log),
    )
    .unwrap();
    (pdir, log)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_round_trip_and_refuse_damage() {
        let l = Label {
            pool_id: [1; 16],
            device_id: [2; 16],
            role: ROLE_INTENT_LOG,
            slots: 1000,
        };
        let b = l.encode();
        assert_eq!(Label::decode(&b).unwrap(), Some(l));
        let mut torn = b.clone();
        torn[30] ^= 1;
        assert!(matches!(Label::decode(&torn), Err(Error::Corrupt(_))));
        assert_eq!(Label::decode(&[0u8; SUPERBLOCK_BYTES]).unwrap(), None);
    }

    /// Volume v of the log tests: 4 MiB of 4 KiB blocks, stored as written.
    fn plain_volume() -> crate::volume::VolumeOptions {
        crate::volume::VolumeOptions {
            size_bytes: 4 << 20,
            block_size: 4096,
            compression: crate::codec::Compression::Off,
            encryption: false,
        }
    }

    /// Flushes go to the log device (the main devices hold no chain), a crash replays them
    /// from it; with the log device gone, the import goes on at the last commit, says what
    /// was lost, and the log has fallen back.
    #[test]
    fn flushes_survive_a_crash_on_the_log_device_and_its_loss_is_reported() {
        use crate::pool::{Layout, OpenOptions, Pool};
        let dir = tempfile::tempdir().unwrap();
        let (pdir, log) = test_pool_with_log(dir.path(), Layout::Single, 1, LOG_DEVICE_BYTES_MIN);
        let opts = OpenOptions {
            commit_interval: std::time::Duration::from_secs(3600),
            ..OpenOptions::default()
        };
        let vopts = plain_volume();
        let read = |pool: &Pool, lba: u64| {
            let mut buf = vec![0u8; 4096];
            pool.volume("v")
                .unwrap()
                .read(lba * 4096, &mut buf)
                .unwrap();
            buf[0]
        };
        {
            let pool = Pool::open(&pdir, opts.clone()).unwrap();
            pool.create_volume("v", vopts, None).unwrap();
            let v = pool.volume("v").unwrap();
            // More than a ring's worth of blocks over many flushes: the chain commits when
            // it would wrap, and goes on from there.
            let slots = pool.core.logdev.read().as_ref().unwrap().slots;
            let generation = pool.status().generation;
            for round in 0..(slots / 4 + 3) {
                for lba in 0..(ENTRIES_PER_BLOCK as u64 * 4) {
                    v.write(lba * 4096, &vec![(round % 200) as u8 + 1; 4096], false)
                        .unwrap();
                }
                v.flush().unwrap();
                assert!(
                    pool.core.intent.lock().is_none(),
                    "a chain on the main devices"
                );
            }
            let last = (slots / 4 + 2) % 200 + 1;
            assert!(
                pool.status().generation > generation,
                "the chain filled the ring: a flush committed"
            );
            let head = pool
                .core
                .logdev
                .read()
                .as_ref()
                .unwrap()
                .state
                .lock()
                .next_head;
            assert!(head < slots);
            assert_eq!(read(&pool, 7), last as u8);
            let st = pool.status();
            assert_eq!(st.log.as_ref().unwrap().state, "ONLINE");
            assert_eq!(st.state, "ONLINE");
            for lba in 0..10u64 {
                v.write(lba * 4096, &vec![0xA1; 4096], false).unwrap();
            }
            v.flush().unwrap();
            drop(v);
            drop(pool); // a crash: no close, no commit
        }
        {
            let pool = Pool::open(&pdir, opts.clone()).unwrap();
            for lba in 0..10 {
                assert_eq!(read(&pool, lba), 0xA1, "block {lba}");
            }
            let v = pool.volume("v").unwrap();
            v.write(0, &vec![0xB2; 4096], false).unwrap();
            v.flush().unwrap();
            drop(v);
            drop(pool);
        }
        std::fs::remove_file(&log).unwrap();
        let pool = Pool::open(&pdir, opts).unwrap();
        // The flush that lived only on the log is lost: the last commit's data.
        assert_eq!(read(&pool, 0), 0xA1);
        let st = pool.status();
        let l = st.log.unwrap();
        assert_eq!(l.state, "FELL_BACK");
        assert_eq!(l.devices[0].state, "UNAVAIL");
        assert!(l.note.unwrap().contains("cannot be replayed"));
        assert_eq!(st.state, "DEGRADED");
        // Flushes go the main devices' way now, and hold.
        let v = pool.volume("v").unwrap();
        v.write(4096, &vec![0xC3; 4096], false).unwrap();
        v.flush().unwrap();
        pool.close().unwrap();
    }

    /// The label's ring size is signed by no key: altered (here to a ring that ends just
    /// past the chain's head), the replay still finds every block and its records, from
    /// the superblock's head and the blocks' own signed links. Before, it computed the
    /// slots from the label's ring, read the wrong ones after the first block, and
    /// stopped there: three flushes lost without a word.
    #[test]
    fn a_label_altered_to_another_ring_size_does_not_shorten_the_replay() {
        use crate::pool::{Layout, OpenOptions, Pool};
        let dir = tempfile::tempdir().unwrap();
        let (pdir, log) = test_pool_with_log(dir.path(), Layout::Single, 1, LOG_DEVICE_BYTES_MIN);
        let opts = OpenOptions {
            commit_interval: std::time::Duration::from_secs(3600),
            ..OpenOptions::default()
        };
        let head = {
            let pool = Pool::open(&pdir, opts.clone()).unwrap();
            pool.create_volume("v", plain_volume(), None).unwrap();
            pool.core.commit().unwrap();
            let head = pool
                .core
                .logdev
                .read()
                .as_ref()
                .unwrap()
                .state
                .lock()
                .chain
                .unwrap()
                .head;
            let v = pool.volume("v").unwrap();
            for round in 1..=4u8 {
                for lba in 0..4u64 {
                    v.write(lba * 4096, &vec![round; 4096], false).unwrap();
                }
                v.flush().unwrap();
            }
            drop(v);
            drop(pool); // a crash: the four flushes are on the log device only
            head
        };
        let dev = FileDevice::open(&log).unwrap();
        let mut label = read_label(&dev).unwrap();
        assert!(label.slots > head + 2);
        label.slots = head + 2;
        write_label(&dev, &label).unwrap();
        drop(dev);
        let pool = Pool::open(&pdir, opts).unwrap();
        let v = pool.volume("v").unwrap();
        let mut buf = vec![0u8; 4096];
        for lba in 0..4u64 {
            v.read(lba * 4096, &mut buf).unwrap();
            assert_eq!(buf[0], 4, "block {lba}: a flush was not replayed");
        }
    }

    /// A mirrored log device whose half fails while flushes go on: the flush that found
    /// it failed commits, so the next superblock names only the working half. After a
    /// crash with only the failed (stale) half left, the import does not replay its
    /// chain as if whole: it says the flushes on the log are lost, and reads the last
    /// commit (before, it replayed the stale chain and lost the later flushes silently).
    #[test]
    fn a_stale_half_of_a_mirrored_log_is_not_replayed_as_whole() {
        use crate::device::fault::{Fault, FaultMode};
        use crate::pool::{Layout, OpenOptions, Pool};
        let dir = tempfile::tempdir().unwrap();
        let logs: Vec<PathBuf> = ["loga.img", "logb.img"]
            .iter()
            .map(|n| {
                let p = dir.path().join(n);
                std::fs::File::create(&p)
                    .unwrap()
                    .set_len(LOG_DEVICE_BYTES_MIN)
                    .unwrap();
                p
            })
            .collect();
        let pdir = dir.path().join("p");
        Pool::create_with_log(
            &pdir,
            Layout::Single,
            super::super::DeviceSpec::Files {
                count: 1,
                size_bytes: 64 << 20,
            },
            "p",
            &logs,
        )
        .unwrap();
        let opts = OpenOptions {
            commit_interval: std::time::Duration::from_secs(3600),
            allow_fault_injection: true,
            ..OpenOptions::default()
        };
        let vopts = plain_volume();
        let fill = |pool: &Pool, b: u8| {
            let v = pool.volume("v").unwrap();
            for lba in 0..8u64 {
                v.write(lba * 4096, &vec![b; 4096], false).unwrap();
            }
            v.flush().unwrap();
        };
        {
            let pool = Pool::open(&pdir, opts.clone()).unwrap();
            pool.create_volume("v", vopts, None).unwrap();
            pool.core.commit().unwrap();
            fill(&pool, 0x11); // on both halves
            let generation = pool.status().generation;
            pool.core
                .set_faults(
                    &logs[0],
                    vec![Fault {
                        mode: FaultMode::WriteError,
                        probability: 1.0,
                        seed: 1,
                        include_labels: false,
                    }],
                )
                .unwrap();
            fill(&pool, 0x22); // half A fails here
            assert!(
                pool.status().generation > generation,
                "the flush that lost a half did not commit"
            );
            fill(&pool, 0x33); // on half B only
            drop(pool); // a crash
        }
        std::fs::remove_file(&logs[1]).unwrap();
        let pool = Pool::open(&pdir, opts).unwrap();
        let mut buf = vec![0u8; 4096];
        pool.volume("v").unwrap().read(0, &mut buf).unwrap();
        assert_eq!(buf[0], 0x22, "not the last commit's data");
        let l = pool.status().log.unwrap();
        assert!(
            l.note
                .as_deref()
                .is_some_and(|n| n.contains("cannot be replayed")),
            "the lost flushes are not reported: {l:?}"
        );
    }

    /// A small flush carries its records into the log device: with the records lost from
    /// the main devices (never synced there: zeroed here after the crash), the flushed
    /// blocks still come back, written back from the log device by the replay.
    #[test]
    fn a_small_flush_needs_only_the_log_device() {
        use crate::pool::Layout;
        for (layout, count) in [
            (Layout::Single, 1),
            (Layout::Mirror(2), 2),
            (Layout::Parity { k: 2, m: 1 }, 3),
        ] {
            small_flush_on(layout, count);
        }
    }

    fn small_flush_on(layout: crate::pool::Layout, count: usize) {
        use crate::pool::{OpenOptions, Pool};
        let dir = tempfile::tempdir().unwrap();
        let (pdir, log) = test_pool_with_log(dir.path(), layout, count, 16 << 20);
        let opts = OpenOptions {
            commit_interval: std::time::Duration::from_secs(3600),
            ..OpenOptions::default()
        };
        let vopts = plain_volume();
        let (records, footprint) = {
            let pool = Pool::open(&pdir, opts.clone()).unwrap();
            pool.create_volume("v", vopts, None).unwrap();
            let v = pool.volume("v").unwrap();
            for lba in 0..10u64 {
                v.write(lba * 4096, &vec![0xD4; 4096], false).unwrap();
            }
            v.flush().unwrap();
            let l = pool.core.logdev.read().clone().unwrap();
            let chain = l.state.lock().chain.unwrap();
            let (pool_id, chain_id) = {
                let sb = pool.core.sb.lock();
                (sb.sb.pool_id, sb.sb.chain_id)
            };
            let (b, data) = l
                .read_block(
                    chain.head,
                    0,
                    &pool_id,
                    &chain_id,
                    chain.generation,
                    Some(&pool.core.log_key),
                )
                .unwrap()
                .unwrap();
            assert_eq!(b.entries.len(), 10);
            assert!(b.data_slots >= 10, "the records are in the log");
            assert!(inline_records(&b, &data).iter().all(|r| r.is_some()));
            let footprint = pool.core.store.red.footprint(4096 + 16);
            drop(v);
            drop(pool); // a crash: no close, no commit
            (b.entries, footprint)
        };
        // The records never reached the main devices' media.
        // (Each copy, or each shard, lies at the record's offset in its segment, the
        // segment at the same place on every member: one device of a `single` pool here.)
        for i in 0..count {
            let d = FileDevice::open(&pdir.join(format!("dev{i}.img"))).unwrap();
            for e in &records {
                if !matches!(layout, crate::pool::Layout::Parity { .. }) {
                    let mut was = vec![0u8; e.ptr.len as usize];
                    d.read_at(&mut was, DEVICE_RESERVED_FRONT + e.ptr.addr[0])
                        .unwrap();
                    assert!(
                        verify(&e.ptr.checksum, &was),
                        "the record is where it is zeroed"
                    );
                }
                let zero = vec![0u8; footprint.min(e.ptr.len as usize)];
                d.write_at(&zero, DEVICE_RESERVED_FRONT + e.ptr.addr[0])
                    .unwrap();
            }
        }
        let pool = Pool::open(&pdir, opts.clone()).unwrap();
        let v = pool.volume("v").unwrap();
        let mut buf = vec![0u8; 4096];
        for lba in 0..10u64 {
            v.read(lba * 4096, &mut buf).unwrap();
            assert!(buf.iter().all(|&b| b == 0xD4), "block {lba}");
        }
        drop(v);
        pool.close().unwrap();
        drop(pool);
        // The import's commit made them durable on the main devices.
        std::fs::remove_file(&log).unwrap();
        let pool = Pool::open(&pdir, opts).unwrap();
        let v = pool.volume("v").unwrap();
        v.read(9 * 4096, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0xD4));
        assert_eq!(pool.status().unrecoverable_blocks, 0);
    }

    #[test]
    fn label_decode_never_panics() {
        let b = Label {
            pool_id: [1; 16],
            device_id: [2; 16],
            role: ROLE_INTENT_LOG,
            slots: 77,
        }
        .encode();
        crate::fuzz::never_panics(
            "logdev::Label::decode",
            &[b],
            3000,
            Some(&|b: &mut Vec<u8>| {
                if b.len() == SUPERBLOCK_BYTES {
                    seal_self_checked(b)
                }
            }),
            &|b| {
                let _ = Label::decode(b);
            },
        );
    }
}
