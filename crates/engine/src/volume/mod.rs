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

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};

use crate::codec::{self, BlockCipher};
use crate::constants::*;
use crate::keys::KeySlot;
use crate::log::Stream;
use crate::map::{Blkptr, Tree, Visit, ADDR_NONE};
use crate::pool::{Core, VolumeStatus};
use crate::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Compression {
    Off,
    Lz4,
}

impl std::str::FromStr for Compression {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "off" => Ok(Compression::Off),
            "lz4" => Ok(Compression::Lz4),
            _ => Err(crate::Error::Invalid(format!(
                "invalid compression '{s}': expected off or lz4"
            ))),
        }
    }
}

impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Compression::Off => "off",
            Compression::Lz4 => "lz4",
        })
    }
}

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
                "invalid volume size {}: use 1 block to 1 EiB",
                self.size_bytes
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

/// The engine's record of one volume, shared by the table and every handle.
pub struct VolumeState {
    pub id: u64,
    pub uuid: [u8; 16],
    pub name: String,
    pub size: u64,
    pub block_size: u32,
    pub compression: Compression,
    pub encryption: bool,
    pub slots: Mutex<Vec<KeySlot>>,
    /// The map lock.
    pub tree: Mutex<Tree>,
    /// `None` while locked (or for an unencrypted volume).
    pub cipher: RwLock<Option<Arc<BlockCipher>>>,
    stripes: Box<[Mutex<()>]>,
    /// Stored bytes of the data blocks this volume references (one copy).
    pub used_bytes: AtomicU64,
    pub destroyed: AtomicBool,
}

impl VolumeState {
    pub fn new(
        id: u64,
        uuid: [u8; 16],
        name: String,
        opts: &VolumeOptions,
        slots: Vec<KeySlot>,
        tree: Tree,
        cipher: Option<Arc<BlockCipher>>,
    ) -> VolumeState {
        VolumeState {
            id,
            uuid,
            name,
            size: opts.size_bytes,
            block_size: opts.block_size,
            compression: opts.compression,
            encryption: opts.encryption,
            slots: Mutex::new(slots),
            tree: Mutex::new(tree),
            cipher: RwLock::new(cipher),
            stripes: (0..STRIPE_LOCKS).map(|_| Mutex::new(())).collect(),
            used_bytes: AtomicU64::new(0),
            destroyed: AtomicBool::new(false),
        }
    }

    pub fn status(&self) -> VolumeStatus {
        VolumeStatus {
            name: self.name.clone(),
            size_bytes: self.size,
            block_size: self.block_size,
            compression: self.compression.to_string(),
            encryption: self.encryption,
            locked: self.encryption && self.cipher.read().is_none(),
            used_bytes: self.used_bytes.load(Ordering::Relaxed),
        }
    }
}

thread_local! {
    /// Per-thread buffers for stored bytes and merged blocks: freshly touched memory is slow here.
    static SCRATCH: RefCell<(Vec<u8>, Vec<u8>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// An open, unlocked volume. Cheap to clone behind an `Arc`; one per NBD connection.
pub struct Volume {
    core: Arc<Core>,
    st: Arc<VolumeState>,
    cipher: Option<Arc<BlockCipher>>,
}

fn is_zero(b: &[u8]) -> bool {
    let (pre, mid, post) = unsafe { b.align_to::<u64>() };
    pre.iter().all(|&x| x == 0) && mid.iter().all(|&x| x == 0) && post.iter().all(|&x| x == 0)
}

impl Volume {
    pub(crate) fn new(
        core: Arc<Core>,
        st: Arc<VolumeState>,
        cipher: Option<Arc<BlockCipher>>,
    ) -> Volume {
        Volume { core, st, cipher }
    }

    pub fn name(&self) -> &str {
        &self.st.name
    }
    pub fn size(&self) -> u64 {
        self.st.size
    }
    pub fn block_size(&self) -> u32 {
        self.st.block_size
    }

    fn check(&self, offset: u64, length: u64) -> Result<()> {
        self.core.check_poisoned()?;
        if self.st.destroyed.load(Ordering::Acquire) {
            return Err(Error::NotFound(format!(
                "volume '{}' was destroyed",
                self.st.name
            )));
        }
        if offset
            .checked_add(length)
            .is_none_or(|end| end > self.st.size)
        {
            return Err(Error::OutOfRange {
                offset,
                length,
                size: self.st.size,
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

    fn stripe(&self, lba: u64) -> parking_lot::MutexGuard<'_, ()> {
        self.st.stripes[(lba as usize) % STRIPE_LOCKS].lock()
    }

    fn aad(&self, lba: u64) -> [u8; 24] {
        codec::block_aad(&self.st.uuid, lba)
    }

    /// Read and decode one whole block into `out` (zeros for a hole).
    fn read_block(&self, lba: u64, out: &mut [u8], stored: &mut Vec<u8>) -> Result<()> {
        self.core.client_ops.fetch_add(1, Ordering::Relaxed);
        let _gate = self.core.reuse_gate.read();
        let ptr = self
            .st
            .tree
            .lock()
            .lookup(&*self.core, &self.core.cache, lba)?;
        if ptr.is_hole() {
            out.fill(0);
            return Ok(());
        }
        self.core
            .red
            .read_verified(ptr.addrs(), ptr.len as usize, &ptr.checksum, stored)
            .map_err(|e| match e {
                Error::Unrecoverable(_) => {
                    let bs = self.st.block_size as u64;
                    self.core.record_error(&self.st.name, lba * bs, bs, "data");
                    Error::Unrecoverable(format!(
                        "volume '{}' bytes {}..{}: no copy verified",
                        self.st.name,
                        lba * bs,
                        (lba + 1) * bs
                    ))
                }
                e => e,
            })?;
        drop(_gate);
        codec::decode(stored, ptr.flags, self.cipher.as_deref(), &self.aad(lba), ptr.nonce, out).map_err(|e| {
            tracing::error!(volume = %self.st.name, lba, "block verified by checksum but failed to decode: {e}");
            e
        })
    }

    /// Encode and store one whole block, then point the map at it.
    fn write_block(&self, lba: u64, plain: &[u8], stored: &mut Vec<u8>) -> Result<()> {
        let ptr = if is_zero(plain) {
            Blkptr::HOLE
        } else {
            let nonce = if self.cipher.is_some() {
                self.core.next_nonce()?
            } else {
                0
            };
            let flags = codec::encode(
                plain,
                self.st.compression,
                self.cipher.as_deref(),
                &self.aad(lba),
                nonce,
                stored,
            )?;
            let sum = codec::checksum(stored);
            let addr = loop {
                match self.core.alloc_record(Stream::Data, stored.len()) {
                    Ok(a) => break a,
                    Err(Error::NoSpace) => self.core.wait_for_space()?,
                    Err(e) => return Err(e),
                }
            };
            let ptr = Blkptr {
                addr: [addr, ADDR_NONE],
                nonce,
                len: stored.len() as u32,
                flags,
                checksum: sum,
            };
            if let Err(e) = self.core.red.write(addr, stored) {
                self.core.free_ptr(&ptr);
                return Err(e);
            }
            ptr
        };
        self.set_ptr(lba, ptr)
    }

    fn set_ptr(&self, lba: u64, ptr: Blkptr) -> Result<()> {
        let (old, dirty) = {
            let mut tree = self.st.tree.lock();
            let old = match tree.set(&*self.core, &self.core.cache, lba, ptr) {
                Ok(old) => old,
                Err(e) => {
                    drop(tree);
                    self.core.free_ptr(&ptr);
                    return Err(e);
                }
            };
            self.core.free_ptr(&old);
            (old, tree.dirty_nodes())
        };
        self.st
            .used_bytes
            .fetch_add(ptr.len as u64, Ordering::Relaxed);
        self.st
            .used_bytes
            .fetch_sub(old.len as u64, Ordering::Relaxed);
        if dirty > MAP_DIRTY_NODES_MAX {
            self.core.wake_maintenance();
        }
        Ok(())
    }

    /// Fill `buf` from `offset`. Every block read is verified; never returns wrong bytes.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check(offset, buf.len() as u64)?;
        let bs = self.st.block_size as usize;
        SCRATCH.with(|s| {
            let (stored, block) = &mut *s.borrow_mut();
            let mut at = 0;
            for (lba, within, n) in self.pieces(offset, buf.len() as u64) {
                if n == bs {
                    self.read_block(lba, &mut buf[at..at + n], stored)?;
                } else {
                    block.resize(bs, 0);
                    self.read_block(lba, block, stored)?;
                    buf[at..at + n].copy_from_slice(&block[within..within + n]);
                }
                at += n;
            }
            Ok(())
        })
    }

    /// Write `data` at `offset`; with `fua` it is durable when this returns.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.check(offset, data.len() as u64)?;
        let bs = self.st.block_size as usize;
        SCRATCH.with(|s| {
            let (stored, block) = &mut *s.borrow_mut();
            let mut at = 0;
            for (lba, within, n) in self.pieces(offset, data.len() as u64) {
                let _stripe = self.stripe(lba);
                if n == bs {
                    self.write_block(lba, &data[at..at + n], stored)?;
                } else {
                    block.resize(bs, 0);
                    self.read_block(lba, block, stored)?;
                    block[within..within + n].copy_from_slice(&data[at..at + n]);
                    self.write_block(lba, block, stored)?;
                }
                at += n;
            }
            Ok::<(), Error>(())
        })?;
        if fua {
            self.core.flush()?;
        }
        Ok(())
    }

    /// Make the range read as zeros (whole blocks are freed).
    pub fn write_zeroes(&self, offset: u64, length: u64, fua: bool) -> Result<()> {
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
                    self.write_block(lba, block, stored)?;
                }
            }
            Ok::<(), Error>(())
        })?;
        if fua {
            self.core.flush()?;
        }
        Ok(())
    }

    /// Discard the range: whole blocks are freed; partial blocks are left as they are.
    pub fn trim(&self, offset: u64, length: u64) -> Result<()> {
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

    /// The block pointer of logical block `lba` (for tests and diagnostics).
    #[doc(hidden)]
    pub fn debug_block_ptr(&self, lba: u64) -> Result<Blkptr> {
        self.st
            .tree
            .lock()
            .lookup(&*self.core, &self.core.cache, lba)
    }

    /// Everything written so far (by any connection) becomes durable.
    pub fn flush(&self) -> Result<()> {
        self.core.flush()
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
        self.st
            .tree
            .lock()
            .walk(&*self.core, &self.core.cache, lo, hi, &mut |v| {
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
