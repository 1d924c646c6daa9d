//! A volume: a byte-addressed virtual disk over the block map.
//!
//! A write is cut into blocks. A whole block is encoded (compressed,
//! encrypted with a fresh pool-unique nonce, checksummed), appended to the
//! log, and only then pointed to by the map; the pointer it replaces is
//! released. A partial block is read, merged and written whole under the
//! block's stripe lock (read-modify-write never races another writer of the
//! same block). An all-zero block is stored as a hole. A read verifies every
//! block it returns: checksum first (repairing from another copy), then the
//! AEAD tag; a block with no good copy is an error, never wrong bytes.
//!
//! What lives here: [`VolumeState`], the engine's record of one volume (its map lock,
//! stripe locks, keys, its snapshots `snaps`, oldest first with a clone's base first, and
//! its origin; `rotation.rs` the key-rotation progress it carries), and [`Volume`], a handle
//! that reads, writes, trims, zeroes and answers block status, or reads one snapshot
//! (read-only). A `Volume` holds the `Store` and a `store::Control`, never the pool.
//! `asks.rs`: what the pool asks of a `VolumeState` (its fields are private).
//! `snap.rs`: snapshots, why sharing is decided by place, and the lock order (decision
//! 0009); the rule itself (a pointer a tree drops dies only if neither neighbour holds it
//! at the same place) is the release point's (`store::dies`), `snap::head_drops` asks it.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use zeroize::Zeroizing;

use serde::{Deserialize, Serialize};

use crate::codec;
use crate::constants::*;
use crate::keys::ring::{DataKeyRecord, KeyRing};
use crate::keys::KeySlot;
use crate::log::Stream;
use crate::map::{At, Blkptr, Tree, Visit, ADDR_NONE};
use crate::store::{Control, Dead, Put, Store};
use crate::{Error, Result};

mod asks;
pub mod rotation;
pub mod snap;
pub mod stripes;
pub mod uses;

pub use crate::codec::Compression;

#[derive(Debug, Clone)]
pub struct VolumeOptions {
    pub size_bytes: u64,
    /// 4 KiB .. 128 KiB, a power of two.
    pub block_size: u32,
    pub compression: Compression,
    pub encryption: bool,
}

/// A run of bytes with one allocation state, for NBD block status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u64,
    /// Never written, trimmed or zeroed: reads as zeros and holds no space.
    pub hole: bool,
}

impl VolumeOptions {
    pub fn validate(&self) -> Result<()> {
        let bs = self.block_size;
        if !(BLOCK_BYTES_MIN..=BLOCK_BYTES_MAX).contains(&bs) || !bs.is_power_of_two() {
            return Err(Error::Invalid(format!(
                "invalid block size {bs}: use a power of two from {}K to {}K",
                BLOCK_BYTES_MIN >> 10,
                BLOCK_BYTES_MAX >> 10
            )));
        }
        if self.size_bytes == 0 || self.size_bytes > VOLUME_BYTES_MAX {
            return Err(Error::Invalid(format!(
                "invalid volume size {} ({} bytes): use 1 block to {}",
                crate::size::format_size(self.size_bytes),
                self.size_bytes,
                crate::size::format_size(VOLUME_BYTES_MAX)
            )));
        }
        if self.size_bytes % bs as u64 != 0 {
            return Err(Error::Invalid(format!(
                "volume size {} is not a multiple of the block size {}",
                self.size_bytes, bs
            )));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct VolumeStatus {
    pub name: String,
    pub size_bytes: u64,
    pub block_size: u32,
    pub compression: String,
    pub encryption: bool,
    pub locked: bool,
    /// Stored bytes referenced by this volume (after compression, one copy).
    pub used_bytes: u64,
    /// Data key generation new writes use (encrypted volumes).
    #[serde(default)]
    pub key_generation: u16,
    /// Key slots (encrypted volumes); 0 after a crypto-erase.
    #[serde(default)]
    pub key_slots: usize,
    /// A key rotation in progress.
    #[serde(default)]
    pub rotation: Option<rotation::Rotation>,
    /// The snapshot this volume was cloned from, as `VOL@SNAP`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<String>,
    /// `volume set readonly=on`: exported read-only, writes refused.
    #[serde(default)]
    pub readonly: bool,
    /// Its whole size is reserved in the pool (`volume create --thick`).
    #[serde(default)]
    pub thick: bool,
}

/// The engine's record of one volume, shared by the table and every handle.
///
/// Every field is private to `volume/`; the pool asks through `asks.rs`: what the volume
/// is (`name`, `block_size`, `is_encrypted`...), what a command changes (`set_readonly`,
/// `want_snapshot`, `open_keys`, `mark_destroyed`...). Some of its locks are handed out,
/// each named for what it holds (`map`, `snapshots`, `origin`, `intents`, `key_slots`,
/// `data_keys`, `rotation`), because the pool's rooms (commit, snapshot, clean, scrub,
/// keys, rotate) hold several together, in the order `snap.rs` gives, around work of their
/// own; so are the two dirty-node counters, the slots `Store::note_dirty` keeps for it. The
/// layer test (`crates/bulwark/tests/layers.rs`) fails if a `pub` field comes back.
pub struct VolumeState {
    id: u64,
    uuid: [u8; 16],
    name: String,
    /// Bytes (`size()`); changed only by `volume resize`, under the commit lock.
    size: AtomicU64,
    block_size: u32,
    /// How new writes are stored (`compression()`; `volume set compression=`).
    compression: std::sync::atomic::AtomicU8,
    encryption: bool,
    /// `volume set readonly=on`: every write through any handle is refused.
    readonly: AtomicBool,
    /// Its whole size is reserved in the pool (`volume create --thick`).
    thick: AtomicBool,
    /// Free text (`volume set description=`).
    description: Mutex<String>,
    /// Seconds since the epoch when it was created (0: before this was recorded).
    created: AtomicU64,
    slots: Mutex<Vec<KeySlot>>,
    /// The map lock.
    tree: Mutex<Tree>,
    /// Wrappings of the volume master key.
    /// The VMK while the volume is unlocked (to add slots and rotate).
    vmk: Mutex<Option<Zeroizing<[u8; 32]>>>,
    /// Data keys by generation, wrapped by the VMK (persisted in the table).
    data_keys: Mutex<Vec<DataKeyRecord>>,
    /// `None` while locked (or for an unencrypted volume).
    ring: RwLock<Option<Arc<KeyRing>>>,
    /// A key rotation in progress: blocks of older generations are being re-encrypted.
    rotation: Mutex<Option<rotation::Rotation>>,
    /// Whether a worker runs that rotation (never persisted).
    rotation_worker: Arc<rotation::RotationWorker>,
    /// The stripe locks client writes and key rotation's rewrites take (`stripes`).
    stripes: stripes::Stripes,
    /// Stored bytes of the data blocks this volume references (one copy).
    used_bytes: AtomicU64,
    /// The tree's dirty node count as of its last change (`Store::note_dirty`).
    dirty_nodes: std::sync::atomic::AtomicUsize,
    destroyed: AtomicBool,
    /// The map changes clients made since the last durable point, in order (block, new
    /// pointer): what a flush writes to the intent log (`pool::txg::intent`). Appended under the
    /// map lock; a commit clears them when it takes the leaves they are in.
    intents: Mutex<Vec<(u64, Blkptr)>>,
    /// Snapshots, oldest first (`snap` module: sharing, locks).
    snaps: RwLock<Vec<snap::Snap>>,
    /// Dirty nodes of the snapshot trees (the cleaner's moves), as `dirty_nodes` for the head.
    snap_dirty_nodes: std::sync::atomic::AtomicUsize,
    /// A snapshot the next commit takes: its name and tree id.
    snapshot_wanted: Mutex<Option<(String, u64)>>,
    /// The snapshot this volume was cloned from (its base, `snaps[0]`, copies it).
    origin: Mutex<Option<snap::Origin>>,
    /// Destroyed, but kept (hidden, its map empty) for the clones of its snapshots: gone
    /// when the last of them goes.
    deferred: AtomicBool,
    /// Open read-only handles on its snapshots (`VOL@SNAP`): of the references to this
    /// state, those that do not hold the volume itself (a rollback goes ahead under them).
    /// It changes under `snaps` (read), inside the lifetime of the handle's reference, so
    /// that under `snaps` (write) `strong_count - snapshot_views` never undercounts.
    snapshot_views: std::sync::atomic::AtomicUsize,
    /// Who uses the volume: the handles clients and commands hold (what "in use" means
    /// to `volume destroy`, `rollback`, `key unload`, `key erase` and a shrink) and the
    /// background batches over it a change waits for (`uses`: model-checked).
    uses: uses::Uses,
    /// The control plane lists a data error in this volume (`note_data_errors`): only then
    /// does a write tell it which blocks were replaced whole (`Control::clear_rewritten`),
    /// so a write to a volume without errors never calls up into the control plane.
    data_errors: AtomicBool,
    /// Whether this volume's recent writes compressed (lz4 sampling).
    guess: codec::CompressGuess,
    /// Where its recent reads ended: a read continuing one reads ahead from the object
    /// store (`store::ahead`; followed only in pools that read from one).
    read_streams: crate::store::ahead::Streams,
}

impl VolumeState {
    /// Why this encrypted volume cannot be used without its key: locked (`key load`
    /// opens it), or its keys were erased (nothing opens it: `key load` would only say so).
    pub fn locked(&self) -> Error {
        if self.slots.lock().is_empty() {
            Error::Invalid(format!(
                "the keys of volume '{}' were erased: its data is unrecoverable with any \
                 secret; destroy it ('bulwark volume destroy {}')",
                self.name, self.name
            ))
        } else {
            Error::Locked(self.name.clone())
        }
    }

    pub fn new(
        id: u64,
        uuid: [u8; 16],
        name: String,
        opts: &VolumeOptions,
        slots: Vec<KeySlot>,
        data_keys: Vec<DataKeyRecord>,
        tree: Tree,
    ) -> VolumeState {
        VolumeState {
            id,
            uuid,
            name,
            size: AtomicU64::new(opts.size_bytes),
            block_size: opts.block_size,
            compression: std::sync::atomic::AtomicU8::new(compression_code(opts.compression)),
            encryption: opts.encryption,
            readonly: AtomicBool::new(false),
            thick: AtomicBool::new(false),
            description: Mutex::new(String::new()),
            created: AtomicU64::new(0),
            slots: Mutex::new(slots),
            tree: Mutex::new(tree),
            vmk: Mutex::new(None),
            data_keys: Mutex::new(data_keys),
            ring: RwLock::new(None),
            rotation: Mutex::new(None),
            rotation_worker: Default::default(),
            stripes: stripes::Stripes::new(STRIPE_LOCKS),
            used_bytes: AtomicU64::new(0),
            dirty_nodes: Default::default(),
            destroyed: AtomicBool::new(false),
            intents: Mutex::new(Vec::new()),
            snaps: RwLock::new(Vec::new()),
            snap_dirty_nodes: Default::default(),
            snapshot_wanted: Mutex::new(None),
            origin: Mutex::new(None),
            deferred: AtomicBool::new(false),
            snapshot_views: Default::default(),
            uses: uses::Uses::new(),
            data_errors: AtomicBool::new(false),
            guess: Default::default(),
            read_streams: Default::default(),
        }
    }

    /// The control plane says whether it lists a data error in this volume (it does so
    /// under its error list's lock, after each change of the list).
    pub fn note_data_errors(&self, listed: bool) {
        self.data_errors.store(listed, Ordering::Release);
    }

    /// Whether a write must tell the control plane which blocks it replaced.
    pub fn has_data_errors(&self) -> bool {
        self.data_errors.load(Ordering::Acquire)
    }

    /// How many client or command handles hold the volume itself open.
    pub fn clients(&self) -> usize {
        self.uses.clients()
    }

    /// A background batch over this volume (scrub, key rotation): held while it reads or
    /// rewrites the volume's records, so that no command changes the volume under it.
    pub fn background_batch(&self) -> crate::sync::RwLockReadGuard<'_, ()> {
        self.uses.background_batch()
    }

    /// Before a command changes what the volume is: refused while a handle holds it open;
    /// a background batch over it is waited for, at most `max`, and kept out while the
    /// guard lives.
    pub fn quiesce(
        &self,
        max: std::time::Duration,
    ) -> std::result::Result<crate::sync::RwLockWriteGuard<'_, ()>, uses::Refused> {
        self.uses.quiesce(max)
    }

    /// Wait for every client write under way to end (`Stripes::drain`): after a new data
    /// key is made current, none sealed under an older one is still to land in the map.
    pub fn drain_writes(&self) {
        self.stripes.drain();
    }

    /// Key unload and erase: the key ring taken away, refused while a handle holds the
    /// volume open (`Uses::take_key_unused`).
    pub fn take_key(&self) -> std::result::Result<Option<Arc<KeyRing>>, uses::Refused> {
        self.uses.take_key_unused(&self.ring)
    }

    /// The volume's size in bytes.
    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// `volume resize`: the caller holds the commit lock and has made the map fit.
    pub(crate) fn set_size(&self, bytes: u64) {
        self.size.store(bytes, Ordering::Release);
    }

    /// How new writes are stored.
    pub fn compression(&self) -> Compression {
        match self.compression.load(Ordering::Relaxed) {
            0 => Compression::Off,
            _ => Compression::Lz4,
        }
    }

    pub fn set_compression(&self, c: Compression) {
        self.compression
            .store(compression_code(c), Ordering::Relaxed);
    }

    /// Bytes the pool keeps for this volume beyond what it stores: a thick volume's size
    /// less its used bytes; nothing for a thin one.
    pub fn reservation_unused(&self) -> u64 {
        if self.thick.load(Ordering::Acquire) {
            self.size()
                .saturating_sub(self.used_bytes.load(Ordering::Relaxed))
        } else {
            0
        }
    }

    pub fn status(&self) -> VolumeStatus {
        VolumeStatus {
            name: self.name.clone(),
            size_bytes: self.size(),
            block_size: self.block_size,
            compression: self.compression().to_string(),
            encryption: self.encryption,
            locked: self.encryption && self.ring.read().is_none(),
            used_bytes: self.used_bytes.load(Ordering::Relaxed),
            key_generation: self
                .data_keys
                .lock()
                .iter()
                .map(|k| k.generation)
                .max()
                .unwrap_or(0),
            key_slots: self.slots.lock().len(),
            rotation: self.rotation.lock().clone(),
            origin: self
                .origin
                .lock()
                .as_ref()
                .map(|o| format!("{}@{}", o.volume, o.snapshot)),
            readonly: self.readonly.load(Ordering::Acquire),
            thick: self.thick.load(Ordering::Acquire),
        }
    }
}

/// Seconds since the epoch, now (0 if the clock is before it).
pub fn now_secs() -> u64 {
    crate::env::system_time()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn compression_code(c: Compression) -> u8 {
    match c {
        Compression::Off => 0,
        Compression::Lz4 => 1,
    }
}

thread_local! {
    /// Per-thread buffers for stored bytes and merged blocks: freshly touched memory is slow here.
    static SCRATCH: RefCell<(Vec<u8>, Vec<u8>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    /// Per-thread buffer that write batches are encoded into. Kept apart from `SCRATCH`'s
    /// read buffer so reads (which size that one to each run) never shrink it: at its
    /// high-water length it is reused without zero-filling (`codec::encode_at`).
    static RECORDS: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// An open, unlocked volume. Cheap to clone behind an `Arc`; one per NBD connection.
pub struct Volume {
    store: Arc<Store>,
    control: Arc<dyn Control>,
    st: Arc<VolumeState>,
    /// The snapshot this handle reads (`VOL@SNAP`, read-only); `None`: the volume itself.
    view: Option<String>,
    /// The snapshot's size (it keeps the size it was taken at; the volume may have been
    /// resized since); 0 for the volume itself.
    view_bytes: u64,
    /// Counted in `VolumeState::clients` (a client's or a command's handle).
    client: bool,
}

impl Drop for Volume {
    fn drop(&mut self) {
        if self.client {
            self.st.uses.close();
        }
        if self.view.is_some() {
            // Under the snapshot list's lock, before `st` is dropped (`snapshot_views`).
            let _snaps = self.st.snaps.read();
            self.st.snapshot_views.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

fn is_zero(b: &[u8]) -> bool {
    let (pre, mid, post) = unsafe { b.align_to::<u64>() };
    pre.iter().all(|&x| x == 0) && mid.iter().all(|&x| x == 0) && post.iter().all(|&x| x == 0)
}

impl Volume {
    pub(crate) fn new(
        store: Arc<Store>,
        control: Arc<dyn Control>,
        st: Arc<VolumeState>,
    ) -> Volume {
        Volume {
            store,
            control,
            st,
            view: None,
            view_bytes: 0,
            client: false,
        }
    }

    /// A handle for a client or a command: counted as a use of the volume
    /// (`VolumeState::clients`) until it is dropped; refused while an encrypted volume's
    /// key is not loaded.
    pub(crate) fn for_client(
        store: Arc<Store>,
        control: Arc<dyn Control>,
        st: Arc<VolumeState>,
    ) -> Result<Volume> {
        if !st.uses.open_while_loaded(&st.ring, st.encryption) {
            return Err(st.locked());
        }
        Ok(Volume {
            store,
            control,
            st,
            view: None,
            view_bytes: 0,
            client: true,
        })
    }

    /// A read-only handle on snapshot `snap` of the volume.
    pub(crate) fn snapshot_view(
        store: Arc<Store>,
        control: Arc<dyn Control>,
        st: Arc<VolumeState>,
        snap: &str,
    ) -> Volume {
        // Counted under the snapshot list's lock, after `st` was cloned (`snapshot_views`).
        let view_bytes = {
            let snaps = st.snaps.read();
            st.snapshot_views.fetch_add(1, Ordering::AcqRel);
            snaps
                .iter()
                .find(|s| !s.base && s.name == snap)
                .map_or(0, |s| s.size_bytes)
        };
        Volume {
            store,
            control,
            st,
            view: Some(snap.to_string()),
            view_bytes,
            client: false,
        }
    }

    /// Whether this handle reads a snapshot (and so refuses writes).
    pub fn is_snapshot(&self) -> bool {
        self.view.is_some()
    }

    /// Under the map lock: whether the data record `old` the head just dropped at `lba`
    /// lives on in the newest snapshot of `snaps` (then it must not be released).
    fn data_drops(&self, snaps: &[snap::Snap], lba: u64, old: &Blkptr) -> Option<Dead> {
        snap::head_drops(&self.store, snaps, At::Data(lba), old)
    }

    /// Run `f` on the tree this handle reads: the volume's map (under the map lock) or its
    /// snapshot's (under the snapshot list's read lock).
    fn with_tree<T>(&self, f: impl FnOnce(&Tree) -> Result<T>) -> Result<T> {
        match &self.view {
            None => f(&self.st.tree.lock()),
            Some(name) => {
                let snaps = self.st.snaps.read();
                let s = snaps.iter().find(|s| &s.name == name).ok_or_else(|| {
                    Error::NotFound(format!("snapshot '{}@{name}' was destroyed", self.st.name))
                })?;
                f(&s.tree)
            }
        }
    }

    fn refuse_if_snapshot(&self) -> Result<()> {
        match &self.view {
            Some(name) => Err(Error::Invalid(format!(
                "snapshot '{}@{name}' is read-only",
                self.st.name
            ))),
            None => Ok(()),
        }
    }

    /// Client writes (not the key rotation's rewrites): refused on a snapshot, on a volume
    /// set readonly=on, and, for a thin volume, once the pool's live data reaches into
    /// what thick volumes have reserved (`Store::thin_room`).
    fn refuse_client_write(&self, adds_data: bool) -> Result<()> {
        self.refuse_if_snapshot()?;
        if self.st.readonly.load(Ordering::Acquire) {
            return Err(Error::ReadOnly(format!(
                "volume '{}' is read-only (readonly=on)",
                self.st.name
            )));
        }
        if adds_data && !self.st.thick.load(Ordering::Relaxed) {
            self.store.thin_room()?;
        }
        Ok(())
    }

    /// The key ring for this request; an encrypted volume locked under us is an error, never
    /// a reason to write plaintext.
    fn ring(&self) -> Result<Option<Arc<KeyRing>>> {
        let ring = self.st.ring.read().clone();
        if self.st.encryption && ring.is_none() {
            return Err(self.st.locked());
        }
        Ok(ring)
    }

    pub fn name(&self) -> &str {
        &self.st.name
    }
    /// Bytes: the volume's size now, or for a snapshot's view the size it was taken at.
    pub fn size(&self) -> u64 {
        match self.view {
            Some(_) => self.view_bytes,
            None => self.st.size(),
        }
    }

    /// Whether writes are refused: a snapshot's view, or a volume set readonly=on.
    pub fn is_read_only(&self) -> bool {
        self.view.is_some() || self.st.readonly.load(Ordering::Acquire)
    }
    pub fn block_size(&self) -> u32 {
        self.st.block_size
    }

    fn check(&self, offset: u64, length: u64) -> Result<()> {
        self.store.check_poisoned()?;
        if self.st.destroyed.load(Ordering::Acquire) {
            return Err(Error::NotFound(format!(
                "volume '{}' was destroyed",
                self.st.name
            )));
        }
        let size = self.size();
        if offset.checked_add(length).is_none_or(|end| end > size) {
            return Err(Error::OutOfRange {
                offset,
                length,
                size,
            });
        }
        Ok(())
    }

    /// Split `[offset, offset+length)` into (block, offset in block, length) pieces.
    fn pieces(&self, offset: u64, length: u64) -> impl Iterator<Item = (u64, usize, usize)> {
        let bs = self.st.block_size as u64;
        let end = offset + length;
        let mut pos = offset;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let lba = pos / bs;
            let within = pos % bs;
            let n = (bs - within).min(end - pos);
            pos += n;
            Some((lba, within as usize, n as usize))
        })
    }

    fn stripe(&self, lba: u64) -> crate::sync::MutexGuard<'_, ()> {
        self.st.stripes.one(lba)
    }

    fn aad(&self, lba: u64) -> [u8; 24] {
        codec::block_aad(&self.st.uuid, lba)
    }

    /// Read and decode one whole block into `out` (zeros for a hole).
    fn read_block(&self, lba: u64, out: &mut [u8], stored: &mut Vec<u8>) -> Result<()> {
        let _gate = self.store.client_read(1);
        let ptr = self.with_tree(|t| t.lookup(&*self.store, self.store.nodes(), lba))?;
        self.read_ptr(lba, &ptr, out, stored)
    }

    /// Read, verify (repairing bad copies) and decode the block `ptr` points to. The caller
    /// holds the reuse gate.
    fn read_ptr(&self, lba: u64, ptr: &Blkptr, out: &mut [u8], stored: &mut Vec<u8>) -> Result<()> {
        if ptr.is_hole() {
            out.fill(0);
            return Ok(());
        }
        let unrecoverable = |e| match e {
            Error::Unrecoverable(_) => {
                let bs = self.st.block_size as u64;
                self.control.record_error(&self.st.name, lba * bs, bs);
                Error::Unrecoverable(format!(
                    "volume '{}' bytes {}..{}: no copy verified",
                    self.st.name,
                    lba * bs,
                    (lba + 1) * bs
                ))
            }
            e => e,
        };
        let cached = self.store.read_data(ptr, stored).map_err(unrecoverable)?;
        if !cached {
            return self.decode_into(lba, ptr, stored, out);
        }
        if self.decode_quiet(lba, ptr, stored, out).is_ok() {
            return Ok(());
        }
        // A cached copy that verified by its checksum but does not decode: read the pool's
        // copies (which say what is wrong, if they fail too) and drop the cached one,
        // counted as the cache's error only when the pool's decoded.
        self.store
            .read_data_from_pool(ptr, stored)
            .map_err(unrecoverable)?;
        let decoded = self.decode_into(lba, ptr, stored, out);
        if let Some(c) = self.store.cachedev() {
            c.reject(
                ptr.addr[0],
                &ptr.checksum,
                ptr.len as usize,
                decoded.is_ok(),
            );
        }
        decoded
    }

    /// `decode_into` without logging or noting an error (a cache hit tried first).
    fn decode_quiet(
        &self,
        lba: u64,
        ptr: &Blkptr,
        stored: &mut [u8],
        out: &mut [u8],
    ) -> Result<()> {
        codec::check_policy(self.st.encryption, ptr.flags)?;
        let (cipher, aad) = self.cipher_and_aad(lba, ptr)?;
        // Opened in place: a retry reads `stored` again from the pool.
        codec::decode(stored, ptr.flags, cipher.as_deref(), &aad, ptr.nonce, out)
    }

    /// The cipher that opens block `lba`'s record `ptr` (its generation and run salt; none
    /// for an unencrypted volume) and the associated data it was sealed with: a block a
    /// clone inherited names its first volume.
    fn cipher_and_aad(
        &self,
        lba: u64,
        ptr: &Blkptr,
    ) -> Result<(Option<Arc<crate::codec::BlockCipher>>, [u8; 24])> {
        let ring = self.ring()?;
        Ok(match ring.as_deref() {
            Some(r) => {
                let salt = crate::checksum::salt_of(&ptr.checksum);
                let (c, lineage) = r.cipher_for(ptr.key_gen, salt).ok_or_else(|| {
                    Error::Corrupt(format!(
                        "block {lba} is encrypted under key generation {}, which this volume \
                         no longer has",
                        ptr.key_gen
                    ))
                })?;
                (Some(c), codec::block_aad(&lineage, lba))
            }
            None => (None, self.aad(lba)),
        })
    }

    fn decode_into(&self, lba: u64, ptr: &Blkptr, stored: &mut [u8], out: &mut [u8]) -> Result<()> {
        if let Err(e) = codec::check_policy(self.st.encryption, ptr.flags) {
            let bs = self.st.block_size as u64;
            tracing::error!(volume = %self.st.name, lba, "{e}");
            self.control.record_error(&self.st.name, lba * bs, bs);
            return Err(e);
        }
        let (cipher, aad) = self.cipher_and_aad(lba, ptr)?;
        codec::decode(stored, ptr.flags, cipher.as_deref(), &aad, ptr.nonce, out).map_err(|e| {
            tracing::error!(volume = %self.st.name, lba, "block verified by checksum but failed to decode: {e}");
            e
        })
    }

    /// Read whole blocks `first..first+n` into `out`: one map-lock pass, and one device read
    /// per run of records that lie end to end in the log (a sequential write's blocks do).
    /// Each record is still verified by its own checksum; one that fails is read again
    /// through `read_ptr`, which tries the other copies and repairs.
    fn read_blocks(&self, first: u64, out: &mut [u8], stored: &mut Vec<u8>) -> Result<()> {
        let bs = self.st.block_size as usize;
        let n = out.len() / bs;
        let _gate = self.store.client_read(n as u64);
        let mut ptrs = vec![Blkptr::HOLE; n];
        self.with_tree(|t| t.lookup_run(&*self.store, self.store.nodes(), first, &mut ptrs))?;
        let contiguous = self.store.runs_end_to_end();
        // With a cache device, blocks it holds are read one by one from it (`read_ptr`),
        // the rest in runs from the pool as ever. Without one, nothing is looked up.
        let cache = self.store.cachedev();
        let mut cached: Vec<bool> = Vec::new();
        if let Some(c) = cache {
            c.cached(
                ptrs.iter().map(|p| (p.addr[0], p.checksum, p.len as usize)),
                &mut cached,
            );
        }
        let in_cache = |k: usize| cached.get(k).copied().unwrap_or(false);
        let mut i = 0;
        while i < n {
            let p = ptrs[i];
            if p.is_hole() || !contiguous || in_cache(i) {
                self.read_ptr(first + i as u64, &p, &mut out[i * bs..(i + 1) * bs], stored)?;
                i += 1;
                continue;
            }
            let start = p.addr[0];
            let mut end = start + p.len as u64;
            let mut j = i + 1;
            while j < n
                && !ptrs[j].is_hole()
                && !in_cache(j)
                && ptrs[j].addr[0] == end.div_ceil(RECORD_ALIGN) * RECORD_ALIGN
            {
                end = ptrs[j].addr[0] + ptrs[j].len as u64;
                j += 1;
            }
            if self.read_sealed_run(
                first + i as u64,
                &ptrs[i..j],
                start,
                &mut out[i * bs..j * bs],
                stored,
            )? {
                i = j;
                continue;
            }
            let raw = j - i > 1
                && self
                    .store
                    .read_run(start, (end - start) as usize, stored)
                    .is_ok();
            for k in i..j {
                let q = &ptrs[k];
                let dst = &mut out[k * bs..(k + 1) * bs];
                if raw {
                    let at = (q.addr[0] - start) as usize;
                    let rec = &mut stored[at..at + q.len as usize];
                    if crate::checksum::verify(&q.checksum, rec) {
                        if let Some(c) = cache {
                            c.count_misses(1);
                            c.offer(q.addr[0], &q.checksum, &[rec]);
                        }
                        self.decode_into(first + k as u64, q, rec, dst)?;
                        continue;
                    }
                }
                let mut one = Vec::new();
                self.read_ptr(first + k as u64, q, dst, &mut one)?;
            }
            i = j;
        }
        Ok(())
    }

    /// Reads a run of records lying end to end at `addr` (blocks `first..`, pointed to by
    /// `ptrs`) straight into `out`, when every one holds its block encrypted and
    /// uncompressed (`codec::sealed_whole`): one `preadv` puts each ciphertext where its
    /// plaintext goes and each tag in `tags`, and each block is opened in place. No copy
    /// of the block, and no checksum: the AEAD tag verifies a block more strongly than
    /// its checksum (decision 0006). A block whose tag fails (or whose key generation
    /// this volume no longer has) is read again through `read_ptr`, which checks every
    /// copy by its checksum, repairs the bad ones, and reports what cannot be read.
    /// When the read fails on every copy, each block is read through `read_ptr` too.
    /// Returns false, having read nothing, when the run does not qualify: the caller
    /// then reads it as any other run.
    fn read_sealed_run(
        &self,
        first: u64,
        ptrs: &[Blkptr],
        addr: u64,
        out: &mut [u8],
        tags: &mut Vec<u8>,
    ) -> Result<bool> {
        let bs = self.st.block_size as usize;
        let tb = codec::TAG_BYTES;
        let Some(ring) = self.ring()? else {
            return Ok(false);
        };
        // Records of a run start at the end of the one before, rounded up to RECORD_ALIGN.
        let end_to_end = (bs + tb) as u64 % RECORD_ALIGN == 0;
        if !end_to_end
            || !ptrs
                .iter()
                .all(|p| codec::sealed_whole(p.flags, p.len as usize, bs))
        {
            return Ok(false);
        }
        if tags.len() < ptrs.len() * tb {
            tags.resize(ptrs.len() * tb, 0);
        }
        let mut bufs: Vec<&mut [u8]> = Vec::with_capacity(2 * ptrs.len());
        for (block, tag) in out.chunks_exact_mut(bs).zip(tags.chunks_exact_mut(tb)) {
            bufs.push(block);
            bufs.push(tag);
        }
        let read = match self.store.read_run_scattered(addr, &mut bufs) {
            Ok(()) => true,
            // The object store did not answer (by its deadline): block by block would ask
            // it again for each.
            Err(e @ Error::StoreUnavailable(_)) => return Err(e),
            Err(_) => false,
        };
        drop(bufs);
        // With a cache device, each block's stored bytes (ciphertext and tag) are kept
        // before they are opened in place, and offered once the tag verified them.
        let cache = self.store.cachedev().filter(|_| read);
        let mut sealed: Vec<u8> = Vec::new();
        for (k, (block, tag)) in out
            .chunks_exact_mut(bs)
            .zip(tags.chunks_exact(tb))
            .enumerate()
        {
            let (lba, p) = (first + k as u64, &ptrs[k]);
            if cache.is_some() {
                sealed.clear();
                sealed.extend_from_slice(block);
            }
            let opened = read
                && ring
                    .cipher_for(p.key_gen, crate::checksum::salt_of(&p.checksum))
                    .is_some_and(|(cipher, lineage)| {
                        let aad = codec::block_aad(&lineage, lba);
                        codec::open_sealed(&cipher, &aad, p.nonce, block, tag).is_ok()
                    });
            if !opened {
                self.read_ptr(lba, p, block, &mut Vec::new())?;
            } else if let Some(c) = cache {
                c.count_misses(1);
                c.offer(p.addr[0], &p.checksum, &[&sealed, tag]);
            }
        }
        Ok(true)
    }

    /// Write whole blocks `first..` from `data`: encoded end to end into one buffer, placed
    /// in runs that fit a segment (one device write per copy per run), then pointed to under
    /// one map-lock pass. Stripe locks are taken in index order, so batches cannot deadlock.
    fn write_blocks(&self, first: u64, data: &[u8]) -> Result<()> {
        let bs = self.st.block_size as usize;
        let n = data.len() / bs;
        let _locks = self.st.stripes.run(first, n as u64);
        self.write_blocks_locked(first, data)
    }

    /// `write_blocks` with the stripe locks of every block already held by the caller.
    fn write_blocks_locked(&self, first: u64, data: &[u8]) -> Result<()> {
        RECORDS.with(|r| self.write_blocks_encoded(first, data, &mut r.borrow_mut()))
    }

    /// `write_blocks_locked`, encoding into `stored`.
    fn write_blocks_encoded(&self, first: u64, data: &[u8], stored: &mut Vec<u8>) -> Result<()> {
        let bs = self.st.block_size as usize;
        let n = data.len() / bs;
        self.store.note_client_ops(n as u64);
        struct Rec {
            lba: u64,
            at: usize,
            ptr: Blkptr,
        }
        // `stored` keeps its length between writes (it only grows): records are encoded
        // at `end`, and the bytes past it are stale, never written out.
        let mut end = 0;
        let ring = self.ring()?;
        let key_gen = ring.as_ref().map(|r| r.current).unwrap_or(0);
        let mut recs: Vec<Rec> = Vec::with_capacity(n);
        let mut holes: Vec<u64> = Vec::new();
        for i in 0..n {
            let lba = first + i as u64;
            let plain = &data[i * bs..(i + 1) * bs];
            if is_zero(plain) {
                holes.push(lba);
                continue;
            }
            let nonce = if ring.is_some() {
                self.store.next_nonce(|| self.control.commit())?
            } else {
                0
            };
            let at = end;
            let (flags, len) = codec::encode_at(
                plain,
                self.st.compression(),
                &self.st.guess,
                ring.as_deref().map(KeyRing::current),
                &self.aad(lba),
                nonce,
                stored,
                at,
            )?;
            let checksum = if let Some(r) = ring.as_deref() {
                crate::checksum::checksum_salted(&stored[at..at + len], &r.salt)
            } else {
                crate::checksum::checksum(&stored[at..at + len])
            };
            end = (at + len).div_ceil(RECORD_ALIGN as usize) * RECORD_ALIGN as usize;
            // Alignment padding goes to disk: zeros, not stale bytes.
            stored[at + len..end].fill(0);
            recs.push(Rec {
                lba,
                at,
                ptr: Blkptr {
                    addr: [0, ADDR_NONE],
                    nonce,
                    len: len as u32,
                    flags,
                    key_gen,
                    checksum,
                },
            });
        }
        // Records placed count toward the next commit's room until the map points at them
        // and `note_dirty` has counted their leaves (`Log::alloc_run`).
        let mut pending = self.store.pending();
        let mut puts: Vec<Put> = recs
            .iter()
            .map(|r| Put {
                at: r.at,
                ptr: r.ptr,
            })
            .collect();
        self.store
            .put(Stream::Data, 0, stored, &mut puts, Some(&mut pending))?;
        for (r, p) in recs.iter_mut().zip(&puts) {
            r.ptr = p.ptr;
        }
        let fail = |recs: &[Rec], placed: usize| {
            for r in &recs[..placed] {
                self.store.release(Dead::unlinked(r.ptr));
            }
        };
        // What the map dropped and no snapshot holds: released once the map lock is let go.
        let mut gone = Vec::with_capacity(recs.len() + holes.len());
        // Blocks of zeros become holes: their leaves need room in the next commit too.
        let held = match holes.len() {
            0 => None,
            n => match self.store.hold_nodes(n) {
                Ok(held) => Some(held),
                Err(e) => {
                    fail(&recs, recs.len());
                    return Err(e);
                }
            },
        };
        let dirty_total = {
            let mut tree = self.st.tree.lock();
            let snaps = self.st.snaps.read();
            let drop_old = |lba: u64, new_len: u32, old: Blkptr, gone: &mut Vec<Dead>| {
                self.st
                    .used_bytes
                    .fetch_add(new_len as u64, Ordering::Relaxed);
                self.st
                    .used_bytes
                    .fetch_sub(old.len as u64, Ordering::Relaxed);
                gone.extend(self.data_drops(&snaps, lba, &old));
            };
            for (i, r) in recs.iter().enumerate() {
                match tree.set(&*self.store, self.store.nodes(), r.lba, r.ptr) {
                    Ok(old) => drop_old(r.lba, r.ptr.len, old, &mut gone),
                    Err(e) => {
                        // What the map took before the failure is noted like any write:
                        // an older note for those blocks names what `gone` releases.
                        self.st
                            .intents
                            .lock()
                            .extend(recs[..i].iter().map(|r| (r.lba, r.ptr)));
                        drop((snaps, tree));
                        for r in &recs[i..] {
                            self.store.release(Dead::unlinked(r.ptr));
                        }
                        for old in gone {
                            self.store.release(old);
                        }
                        return Err(e);
                    }
                }
            }
            for (k, &lba) in holes.iter().enumerate() {
                match tree.set(&*self.store, self.store.nodes(), lba, Blkptr::HOLE) {
                    Ok(old) => drop_old(lba, 0, old, &mut gone),
                    Err(e) => {
                        let mut intents = self.st.intents.lock();
                        intents.extend(recs.iter().map(|r| (r.lba, r.ptr)));
                        intents.extend(holes[..k].iter().map(|&lba| (lba, Blkptr::HOLE)));
                        drop(intents);
                        drop((snaps, tree));
                        for old in gone {
                            self.store.release(old);
                        }
                        return Err(e);
                    }
                }
            }
            {
                let mut intents = self.st.intents.lock();
                intents.extend(recs.iter().map(|r| (r.lba, r.ptr)));
                intents.extend(holes.iter().map(|&lba| (lba, Blkptr::HOLE)));
            }
            self.store
                .note_dirty(&self.st.dirty_nodes, tree.dirty_nodes())
        };
        drop((pending, held));
        for old in gone {
            self.store.release(old);
        }
        if dirty_total > self.store.dirty_nodes_cap() {
            self.store.wake_maintenance();
        }
        self.store.recycle_if_due();
        Ok(())
    }

    fn set_ptr(&self, lba: u64, ptr: Blkptr) -> Result<()> {
        // The leaf this dirties needs room in the next commit.
        let held = self.store.hold_nodes(1)?;
        let dirty_total = {
            let mut tree = self.st.tree.lock();
            let old = match tree.set(&*self.store, self.store.nodes(), lba, ptr) {
                Ok(old) => old,
                Err(e) => {
                    drop(tree);
                    self.store.release(Dead::unlinked(ptr));
                    return Err(e);
                }
            };
            let snaps = self.st.snaps.read();
            if let Some(dead) = self.data_drops(&snaps, lba, &old) {
                self.store.release(dead);
            }
            self.st.intents.lock().push((lba, ptr));
            self.st
                .used_bytes
                .fetch_add(ptr.len as u64, Ordering::Relaxed);
            self.st
                .used_bytes
                .fetch_sub(old.len as u64, Ordering::Relaxed);
            self.store
                .note_dirty(&self.st.dirty_nodes, tree.dirty_nodes())
        };
        drop(held);
        if dirty_total > self.store.dirty_nodes_cap() {
            self.store.wake_maintenance();
        }
        Ok(())
    }

    /// Fill `buf` from `offset`. Every block read is verified; never returns wrong bytes.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check(offset, buf.len() as u64)?;
        let bs = self.st.block_size as usize;
        // Reads of given-back segments read ahead while the volume is read in order.
        let _sequential = self.store.reads_from_store().then(|| {
            crate::store::ahead::sequential(
                self.st.read_streams.note(offset, offset + buf.len() as u64),
            )
        });
        SCRATCH.with(|s| {
            let (stored, block) = &mut *s.borrow_mut();
            let mut at = 0;
            let mut run: Option<(u64, usize)> = None; // whole blocks not yet read: (first lba, bytes)
            for (lba, within, n) in self.pieces(offset, buf.len() as u64) {
                if n == bs && run.is_some_and(|(_, len)| len < BATCH_BYTES_MAX) {
                    run = run.map(|(f, len)| (f, len + n));
                } else {
                    if let Some((f, len)) = run.take() {
                        self.read_blocks(f, &mut buf[at - len..at], stored)?;
                    }
                    if n == bs {
                        run = Some((lba, n));
                    } else {
                        block.resize(bs, 0);
                        self.read_block(lba, block, stored)?;
                        buf[at..at + n].copy_from_slice(&block[within..within + n]);
                    }
                }
                at += n;
            }
            if let Some((f, len)) = run {
                self.read_blocks(f, &mut buf[at - len..at], stored)?;
            }
            Ok(())
        })
    }

    /// Write `data` at `offset`; with `fua` it is durable when this returns.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.refuse_client_write(true)?;
        self.check(offset, data.len() as u64)?;
        // Before any lock: past a local cache's size, the store's pace.
        self.store.wait_for_cache_room();
        let bs = self.st.block_size as usize;
        SCRATCH.with(|s| {
            let (stored, block) = &mut *s.borrow_mut();
            let mut at = 0;
            let mut run: Option<(u64, usize)> = None;
            for (lba, within, n) in self.pieces(offset, data.len() as u64) {
                if n == bs && run.is_some_and(|(_, len)| len < BATCH_BYTES_MAX) {
                    run = run.map(|(f, len)| (f, len + n));
                } else {
                    if let Some((f, len)) = run.take() {
                        self.write_blocks(f, &data[at - len..at])?;
                    }
                    if n == bs {
                        run = Some((lba, n));
                    } else {
                        let _stripe = self.stripe(lba);
                        block.resize(bs, 0);
                        self.read_block(lba, block, stored)?;
                        block[within..within + n].copy_from_slice(&data[at..at + n]);
                        self.write_blocks_locked(lba, block)?;
                    }
                }
                at += n;
            }
            if let Some((f, len)) = run {
                self.write_blocks(f, &data[at - len..at])?;
            }
            Ok::<(), Error>(())
        })?;
        if self.st.has_data_errors() {
            self.control
                .clear_rewritten(&self.st.name, offset, data.len() as u64);
        }
        if fua {
            self.control.flush()?;
        }
        Ok(())
    }

    /// Make the range read as zeros (whole blocks are freed).
    pub fn write_zeroes(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
        self.refuse_client_write(false)?;
        self.check(offset, length)?;
        let bs = self.st.block_size as usize;
        SCRATCH.with(|s| {
            let (stored, block) = &mut *s.borrow_mut();
            for (lba, within, n) in self.pieces(offset, length) {
                let _stripe = self.stripe(lba);
                if n == bs {
                    self.set_ptr(lba, Blkptr::HOLE)?;
                } else {
                    block.resize(bs, 0);
                    self.read_block(lba, block, stored)?;
                    block[within..within + n].fill(0);
                    self.write_blocks_locked(lba, block)?;
                }
            }
            Ok::<(), Error>(())
        })?;
        if self.st.has_data_errors() {
            self.control.clear_rewritten(&self.st.name, offset, length);
        }
        if fua {
            self.control.flush()?;
        }
        Ok(())
    }

    /// Discard the range: whole blocks are freed; partial blocks are left as they are.
    pub fn trim(&self, offset: u64, length: u64) -> Result<()> {
        self.refuse_client_write(false)?;
        self.check(offset, length)?;
        let bs = self.st.block_size as usize;
        for (lba, _, n) in self.pieces(offset, length) {
            if n == bs {
                let _stripe = self.stripe(lba);
                self.set_ptr(lba, Blkptr::HOLE)?;
            }
        }
        Ok(())
    }

    /// Re-encrypt one block under the current key generation (key rotation), atomically
    /// with respect to client writes of that block.
    pub(crate) fn rewrite_block(&self, lba: u64, buf: &mut [u8]) -> Result<()> {
        self.refuse_if_snapshot()?;
        let _stripe = self.stripe(lba);
        SCRATCH.with(|s| {
            let (stored, _) = &mut *s.borrow_mut();
            self.read_block(lba, buf, stored)?;
            self.write_blocks_locked(lba, buf)
        })
    }

    /// The block pointer of logical block `lba` (for tests and diagnostics).
    #[doc(hidden)]
    pub fn debug_block_ptr(&self, lba: u64) -> Result<Blkptr> {
        self.with_tree(|t| t.lookup(&*self.store, self.store.nodes(), lba))
    }

    /// Everything written so far (by any connection) becomes durable.
    pub fn flush(&self) -> Result<()> {
        self.control.flush()
    }

    /// Allocation map of `[offset, offset+length)` as consecutive extents.
    pub fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>> {
        self.check(offset, length)?;
        if length == 0 {
            return Ok(Vec::new());
        }
        let bs = self.st.block_size as u64;
        let (lo, hi) = (offset / bs, (offset + length).div_ceil(bs));
        let mut allocated: Vec<(u64, u64)> = Vec::new();
        self.with_tree(|t| {
            t.walk(&*self.store, self.store.nodes(), lo, hi, &mut |v| {
                if let Visit::Unreadable { error, .. } = v {
                    return Err(Error::Corrupt(format!("block status: {error}")));
                }
                if let Visit::Data { lba, .. } = v {
                    match allocated.last_mut() {
                        Some((_, end)) if *end == lba => *end = lba + 1,
                        _ => allocated.push((lba, lba + 1)),
                    }
                }
                Ok(())
            })
        })?;
        let end = offset + length;
        let mut out: Vec<Extent> = Vec::new();
        let mut push = |from: u64, to: u64, hole: bool| {
            let (from, to) = (from.max(offset), to.min(end));
            if to <= from {
                return;
            }
            match out.last_mut() {
                Some(e) if e.hole == hole => e.length += to - from,
                _ => out.push(Extent {
                    length: to - from,
                    hole,
                }),
            }
        };
        let mut pos = offset;
        for (a, b) in allocated {
            push(pos, a * bs, true);
            push(a * bs, b * bs, false);
            pos = pos.max(b * bs);
        }
        push(pos, end, true);
        Ok(out)
    }
}
