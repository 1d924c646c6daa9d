//! Redundancy: where the copies of a record live, and verified reads that repair.
//!
//! The log addresses records by `PoolAddr` (segment × SEGMENT_BYTES + offset).
//! This layer maps a pool address onto (device, offset) places: one for
//! `single` (devices concatenated), N for `mirror:N` (same offset on every
//! member), and for `parity:K+M` a Reed–Solomon stripe of shards (`parity.rs`).
//! A record is always written whole and read back verified by a checksum: no
//! read-modify-write, no write hole.
//!
//! What lives here: [`Redundancy`], its members ([`Member`]: READ/WRITE/CKSUM counters,
//! [`DeviceState`], and why a FAULTED one was faulted: `Member::fail_write`, which names a
//! full host file system as such), verified reads with repair, and the scrub of one
//! record. `placement.rs`: one `Placement` per layout (`Concat` for `single`, `Mirror`,
//! `Parity`): segments, footprint, whether records go end to end, where copies lie,
//! write, read and scrub; `Redundancy` names no layout in its I/O paths. `layout.rs`:
//! [`Layout`] (parsing, `members_needed`).
//!
//! Repair rule (after OpenZFS's mirror code): a copy is rewritten only with
//! bytes that verified against the checksum kept in the parent pointer. If the
//! system lost power while rewriting the only good copy, there would be no good
//! copy left, so a copy that verified is never overwritten by repair.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

mod layout;
mod parity;
mod placement;
pub use layout::Layout;
pub use parity::shard_bytes;
use placement::Placement;

use crate::checksum::{verify, Checksum};
use crate::constants::{DEVICE_RESERVED_FRONT, SEGMENT_BYTES};
use crate::device::Device;
use crate::{Error, Result};

/// One member device and its error counters (READ/WRITE/CKSUM, as zpool status shows them).
pub struct Member {
    slot: RwLock<(PathBuf, Option<Arc<dyn Device>>)>,
    pub read_errors: AtomicU64,
    pub write_errors: AtomicU64,
    pub cksum_errors: AtomicU64,
    /// Set once a write or flush to this device failed.
    pub faulted: AtomicBool,
    /// Taken offline by the administrator: not read or written until brought online.
    pub offline: AtomicBool,
    /// Being resilvered: its copies are known stale, so mismatches are not counted as errors.
    pub resilvering: AtomicBool,
    /// Why it was faulted, for `status` (the first failure since it was last brought online).
    pub fault: parking_lot::Mutex<Option<String>>,
}

impl Member {
    pub fn new(path: PathBuf, dev: Option<Arc<dyn Device>>) -> Member {
        Member {
            slot: RwLock::new((path, dev)),
            read_errors: AtomicU64::new(0),
            write_errors: AtomicU64::new(0),
            cksum_errors: AtomicU64::new(0),
            faulted: AtomicBool::new(false),
            offline: AtomicBool::new(false),
            resilvering: AtomicBool::new(false),
            fault: parking_lot::Mutex::new(None),
        }
    }
    pub fn path(&self) -> PathBuf {
        self.slot.read().0.clone()
    }
    pub fn present(&self) -> bool {
        self.slot.read().1.is_some()
    }
    /// The device, unless missing or offline.
    pub fn dev(&self) -> Option<Arc<dyn Device>> {
        if self.offline.load(Ordering::Relaxed) {
            return None;
        }
        self.slot.read().1.clone()
    }
    /// The device for writing: also not when it has failed a write.
    fn writable(&self) -> Option<Arc<dyn Device>> {
        if self.faulted.load(Ordering::Relaxed) {
            return None;
        }
        self.dev()
    }
    /// Put a new device in this member's place (device replace); counters restart.
    pub fn replace(&self, path: PathBuf, dev: Arc<dyn Device>) {
        *self.slot.write() = (path, Some(dev));
        for c in [&self.read_errors, &self.write_errors, &self.cksum_errors] {
            c.store(0, Ordering::Relaxed);
        }
        self.faulted.store(false, Ordering::Relaxed);
        self.offline.store(false, Ordering::Relaxed);
        *self.fault.lock() = None;
    }
    /// A write or flush to this device failed: count it, fault the device (no more writes
    /// go to it) and keep why, in words an administrator can act on.
    pub(crate) fn fail_write(&self, what: &str, e: &std::io::Error) {
        self.write_errors.fetch_add(1, Ordering::Relaxed);
        self.faulted.store(true, Ordering::Relaxed);
        let mut fault = self.fault.lock();
        if fault.is_none() {
            *fault = Some(fault_reason(what, e));
        }
    }
    fn count_cksum(&self) {
        if !self.resilvering.load(Ordering::Relaxed) {
            self.cksum_errors.fetch_add(1, Ordering::Relaxed);
        }
    }
    pub fn state(&self) -> DeviceState {
        if self.offline.load(Ordering::Relaxed) {
            // Taken offline on purpose (and maybe not even opened since).
            DeviceState::Offline
        } else if !self.present() {
            DeviceState::Unavail
        } else if self.faulted.load(Ordering::Relaxed) {
            DeviceState::Faulted
        } else if self.resilvering.load(Ordering::Relaxed) {
            DeviceState::Resilvering
        } else {
            // As zpool: repaired read and checksum errors show in the counters, not the state.
            DeviceState::Online
        }
    }
}

/// A member's state, as `zpool status` names them (the names are what `status` shows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceState {
    Online,
    /// Taken offline by the administrator.
    Offline,
    /// Missing: not found at import, or removed.
    Unavail,
    /// A write or flush to it failed.
    Faulted,
    /// Its copies are being rebuilt.
    Resilvering,
}

impl DeviceState {
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceState::Online => "ONLINE",
            DeviceState::Offline => "OFFLINE",
            DeviceState::Unavail => "UNAVAIL",
            DeviceState::Faulted => "FAULTED",
            DeviceState::Resilvering => "RESILVERING",
        }
    }
}

/// What scrubbing one record found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScrubOutcome {
    pub bad_copies: usize,
    pub repaired: usize,
    pub unrecoverable: bool,
}

pub struct Redundancy {
    pub layout: Layout,
    /// The layout's placement: where a record's copies or shards go (one implementation
    /// per layout, as OpenZFS has one ops table per vdev type).
    placement: Box<dyn Placement>,
    pub members: Vec<Member>,
    /// Data segments on each device (all members use the same count).
    pub segments_per_device: u64,
    pub repaired_blocks: AtomicU64,
    pub unrecoverable_blocks: AtomicU64,
    /// The threads that sync members beside the flushing one.
    syncers: crate::device::sync::Syncers,
}

/// Why a device was faulted, for `status`: a full host file system (a sparse device
/// file's holes take its space as the pool writes) said so, with what to do; anything else
/// as the system said it.
fn fault_reason(what: &str, e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => format!(
            "{what} found the file system holding it full ({e}): a sparse device file takes \
             host space as the pool writes; free space there, then bring it online; on a \
             file system that overwrites in place (ext4, XFS), pools made with 'pool create \
             --preallocate' do not run into this"
        ),
        _ => format!("{what} failed: {e}"),
    }
}

/// Up to this many places per record (mirror:8).
pub(crate) type Places = smallvec_lite::Places;

mod smallvec_lite {
    /// A fixed-capacity list of (member, device offset) places; avoids an allocation per I/O.
    pub struct Places {
        pub len: usize,
        pub items: [(usize, u64); 8],
    }
    impl Places {
        pub fn iter(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
            self.items[..self.len].iter().copied()
        }
    }
}

impl Redundancy {
    pub fn new(layout: Layout, members: Vec<Member>, segments_per_device: u64) -> Redundancy {
        Redundancy {
            layout,
            placement: placement::for_layout(layout),
            members,
            segments_per_device,
            repaired_blocks: AtomicU64::new(0),
            unrecoverable_blocks: AtomicU64::new(0),
            syncers: Default::default(),
        }
    }

    /// Segments of the pool's log address space.
    pub fn segments(&self) -> u64 {
        self.placement
            .segments(self.segments_per_device, self.members.len())
    }

    /// Bytes of each device's segment space a record of `len` bytes takes.
    pub fn footprint(&self, len: usize) -> usize {
        self.placement.footprint(len)
    }

    /// Whether records can be written end to end in one device write per copy (a run):
    /// parity stripes each record over its own shards, so it writes one record at a time.
    pub fn runs_end_to_end(&self) -> bool {
        self.placement.runs_end_to_end()
    }

    /// Usable bytes per byte of segment space (K for parity, 1 otherwise).
    pub fn data_per_segment_byte(&self) -> u64 {
        self.placement.data_per_segment_byte()
    }

    /// Refuses a record that cannot be in this pool: each copy inside the pool's segments,
    /// its footprint inside one segment (records never straddle one). Every read by pointer
    /// starts here, so a pointer from disk with an address past the pool or a length past
    /// its segment is a `Corrupt` error before any buffer is sized by it.
    pub fn check_record(&self, addrs: &[u64], len: usize) -> Result<()> {
        let footprint = self.footprint(len) as u64;
        for &addr in addrs {
            self.check_range(addr, footprint)?;
        }
        Ok(())
    }

    /// `check_record` for `bytes` of segment space at `addr`.
    fn check_range(&self, addr: u64, bytes: u64) -> Result<()> {
        let seg = addr / SEGMENT_BYTES;
        if seg >= self.segments() || addr % SEGMENT_BYTES + bytes > SEGMENT_BYTES {
            return Err(Error::Corrupt(format!(
                "record of {bytes} bytes at pool address {addr} is outside the pool's {} segments",
                self.segments()
            )));
        }
        Ok(())
    }

    /// Segment `seg` has just opened for writing: each member holding it may read it into
    /// the page cache in the background (`Device::will_write`), so that the runs written
    /// into it do not each wait for a read of the 4 KiB block their end falls in.
    pub fn will_write_segment(&self, seg: u32) {
        let addr = seg as u64 * SEGMENT_BYTES;
        match self.copies(addr) {
            Ok(places) => {
                for (m, off) in places.iter() {
                    if let Some(dev) = self.members[m].writable() {
                        dev.will_write(off, SEGMENT_BYTES);
                    }
                }
            }
            // Parity: every member holds a shard of each record of the segment, at the
            // segment's own place on it (`parity::shard_place`).
            Err(_) => {
                for member in &self.members {
                    if let Some(dev) = member.writable() {
                        dev.will_write(DEVICE_RESERVED_FRONT + addr, SEGMENT_BYTES);
                    }
                }
            }
        }
    }

    /// Give back the local space of segment `seg` on every member holding it (its bytes
    /// are in the object store: `pool::tier`). `Ok(false)`: no device could, and nothing
    /// was given back; `Ok(true)` once any did (the segment's records must then be read
    /// from the store: that copy reads as zeros).
    pub fn discard_segment(&self, seg: u32) -> Result<bool> {
        let mut any = false;
        let mut failed = None;
        for (m, off) in self.copies(seg as u64 * SEGMENT_BYTES)?.iter() {
            let member = &self.members[m];
            let Some(dev) = member.writable() else {
                continue;
            };
            match dev.discard(off, SEGMENT_BYTES) {
                Ok(done) => any |= done,
                Err(e) => failed = Some(Error::device(&member.path(), e)),
            }
        }
        match failed {
            Some(e) if !any => Err(e),
            _ => Ok(any),
        }
    }

    /// Whether segment `seg` is a hole on every member that holds it and is present: it
    /// was given back (`discard_segment`), or never downloaded (a lazy import). A member
    /// being resilvered is a hole where it was not written yet, but its partner is not:
    /// such a segment is local.
    pub fn segment_is_hole(&self, seg: u32) -> bool {
        let Ok(places) = self.copies(seg as u64 * SEGMENT_BYTES) else {
            return false;
        };
        let mut seen = false;
        for (m, off) in places.iter() {
            let Some(d) = self.members[m].dev() else {
                continue;
            };
            seen = true;
            if !d.is_hole(off, SEGMENT_BYTES) {
                return false;
            }
        }
        seen
    }

    /// Bytes of the devices one segment takes (one per whole copy: 1 for `single`, N for
    /// `mirror:N`).
    pub fn bytes_per_segment(&self) -> u64 {
        self.copies(0)
            .map_or(SEGMENT_BYTES, |p| p.len as u64 * SEGMENT_BYTES)
    }

    /// Bytes of local storage the members take (`Device::allocated_bytes`).
    pub fn allocated_bytes(&self) -> u64 {
        self.members
            .iter()
            .filter_map(|m| m.dev())
            .map(|d| d.allocated_bytes())
            .sum()
    }

    /// Write a whole record to every copy. Succeeds if at least one copy was written;
    /// a failed copy marks its device FAULTED and counts a WRITE error.
    pub fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        self.placement.write(self, addr, data)
    }

    /// `write` for layouts that keep whole copies (`places`).
    pub(super) fn write_copies(&self, places: Places, data: &[u8]) -> Result<()> {
        let mut written = 0;
        let mut last_err = None;
        for (m, off) in places.iter() {
            let member = &self.members[m];
            let Some(dev) = member.writable() else {
                continue;
            };
            match dev.write_at(data, off) {
                Ok(()) => written += 1,
                Err(e) => {
                    member.fail_write("a write", &e);
                    tracing::error!(device = %member.path().display(), offset = off, "write failed: {e}");
                    last_err = Some(Error::device(&member.path(), e));
                }
            }
        }
        if written == 0 {
            return Err(last_err.unwrap_or_else(|| {
                Error::Io(std::io::Error::other("no device available for writing"))
            }));
        }
        Ok(())
    }

    /// Read the record at any of `addrs` (extra metadata copies) into `out`, verified against
    /// `sum`. Copies that fail are rewritten from the copy that verified.
    pub fn read_verified(
        &self,
        addrs: &[u64],
        len: usize,
        sum: &Checksum,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        self.check_record(addrs, len)?;
        self.placement.read_verified(self, addrs, len, sum, out)
    }

    /// `read_verified`, quietly: whether some copy of the record verifies, with nothing
    /// counted, logged or repaired. For probing a slot that may never have been written
    /// (the end of the intent log), where a mismatch is the expected answer, not damage.
    /// Striped layouts reconstruct through `read_verified` and get their counters back.
    ///
    /// `accept` may refuse a copy that verifies (a stale block left by another chain on
    /// one member): the next copy is tried.
    pub fn read_quiet(
        &self,
        addrs: &[u64],
        len: usize,
        sum: &Checksum,
        out: &mut Vec<u8>,
        accept: &dyn Fn(&[u8]) -> bool,
    ) -> Result<bool> {
        self.check_record(addrs, len)?;
        if !matches!(self.layout, Layout::Parity { .. }) {
            out.resize(len, 0);
            for &addr in addrs {
                for (m, off) in self.copies(addr)?.iter() {
                    let Some(dev) = self.members[m].dev() else {
                        continue;
                    };
                    if dev.read_at(out, off).is_ok() && verify(sum, out) && accept(out) {
                        return Ok(true);
                    }
                }
            }
            return Ok(false);
        }
        let saved: Vec<(u64, u64)> = self
            .members
            .iter()
            .map(|m| {
                (
                    m.read_errors.load(Ordering::Relaxed),
                    m.cksum_errors.load(Ordering::Relaxed),
                )
            })
            .collect();
        let unrecoverable = self.unrecoverable_blocks.load(Ordering::Relaxed);
        match self.read_verified(addrs, len, sum, out) {
            Ok(()) if accept(out) => Ok(true),
            _ => {
                for (m, (r, c)) in self.members.iter().zip(saved) {
                    m.read_errors.store(r, Ordering::Relaxed);
                    m.cksum_errors.store(c, Ordering::Relaxed);
                }
                self.unrecoverable_blocks
                    .store(unrecoverable, Ordering::Relaxed);
                Ok(false)
            }
        }
    }

    /// `read_verified` for layouts that keep whole copies.
    pub(super) fn read_copies(
        &self,
        addrs: &[u64],
        len: usize,
        sum: &Checksum,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        out.resize(len, 0);
        let mut bad: [(usize, u64); 16] = [(0, 0); 16];
        let mut nbad = 0;
        for &addr in addrs {
            for (m, off) in self.copies(addr)?.iter() {
                let member = &self.members[m];
                let Some(dev) = member.dev() else { continue };
                if let Err(e) = dev.read_at(out, off) {
                    member.read_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(device = %member.path().display(), offset = off, "read failed: {e}");
                    continue;
                }
                if !verify(sum, out) {
                    member.count_cksum();
                    tracing::warn!(device = %member.path().display(), offset = off, len, "checksum mismatch");
                    if nbad < bad.len() {
                        bad[nbad] = (m, off);
                        nbad += 1;
                    }
                    continue;
                }
                // `out` verified: only now may the bad copies be rewritten from it.
                for &(bm, boff) in &bad[..nbad] {
                    let member = &self.members[bm];
                    if let Some(dev) = member.writable() {
                        match dev.write_at(out, boff) {
                            Ok(()) => {
                                self.repaired_blocks.fetch_add(1, Ordering::Relaxed);
                                tracing::info!(device = %member.path().display(), offset = boff, len, "repaired copy");
                            }
                            Err(e) => {
                                member.write_errors.fetch_add(1, Ordering::Relaxed);
                                tracing::error!(device = %member.path().display(), "repair write failed: {e}");
                            }
                        }
                    }
                }
                return Ok(());
            }
        }
        self.unrecoverable_blocks.fetch_add(1, Ordering::Relaxed);
        Err(Error::Unrecoverable(format!(
            "no copy of the {len}-byte record at pool address {} verified",
            addrs[0]
        )))
    }

    /// Read `len` raw bytes at `addr` from the first available copy into `out[..len]`,
    /// unverified: the caller checks each record inside against its checksum (mirror and
    /// single layouts only). `out` grows when shorter, and never shrinks: runs of every
    /// length reuse it without zero-filling.
    pub fn read_run(&self, addr: u64, len: usize, out: &mut Vec<u8>) -> Result<()> {
        self.check_range(addr, len as u64)?;
        if out.len() < len {
            out.resize(len, 0);
        }
        let out = &mut out[..len];
        self.read_first_copy(addr, |dev, off| dev.read_at(out, off))
    }

    /// Read the raw bytes at `addr` into `bufs`, one after another (one `preadv`), from
    /// the first available copy, unverified, like `read_run`.
    pub fn read_run_scattered(&self, addr: u64, bufs: &mut [&mut [u8]]) -> Result<()> {
        self.check_range(addr, bufs.iter().map(|b| b.len() as u64).sum())?;
        self.read_first_copy(addr, |dev, off| dev.read_scattered_at(bufs, off))
    }

    /// Runs `read` on the copies of `addr` in turn until one succeeds (mirror and single
    /// layouts); each failure is counted against its device.
    fn read_first_copy(
        &self,
        addr: u64,
        mut read: impl FnMut(&dyn Device, u64) -> std::io::Result<()>,
    ) -> Result<()> {
        let mut last = None;
        for (m, off) in self.copies(addr)?.iter() {
            let member = &self.members[m];
            let Some(dev) = member.dev() else { continue };
            match read(&*dev, off) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    member.read_errors.fetch_add(1, Ordering::Relaxed);
                    last = Some(Error::device(&member.path(), e));
                }
            }
        }
        Err(last
            .unwrap_or_else(|| Error::Io(std::io::Error::other("no device available for reading"))))
    }

    /// Scrub one record: read *every* copy, verify each, and rewrite the copies that failed
    /// from one that verified. When no copy verifies, nothing is written anywhere.
    pub fn scrub(
        &self,
        addrs: &[u64],
        len: usize,
        sum: &Checksum,
        buf: &mut Vec<u8>,
    ) -> ScrubOutcome {
        if let Err(e) = self.check_record(addrs, len) {
            tracing::warn!("scrub: {e}");
            return ScrubOutcome {
                bad_copies: addrs.len(),
                repaired: 0,
                unrecoverable: true,
            };
        }
        self.placement.scrub(self, addrs, len, sum, buf)
    }

    /// `scrub` for layouts that keep whole copies.
    pub(super) fn scrub_copies(
        &self,
        addrs: &[u64],
        len: usize,
        sum: &Checksum,
        buf: &mut Vec<u8>,
    ) -> ScrubOutcome {
        buf.resize(len, 0);
        let mut good: Option<Vec<u8>> = None;
        let mut bad: Vec<(usize, u64)> = Vec::new();
        for &addr in addrs {
            let Ok(places) = self.copies(addr) else {
                continue;
            };
            for (m, off) in places.iter() {
                let member = &self.members[m];
                let Some(dev) = member.dev() else { continue };
                if let Err(e) = dev.read_at(buf, off) {
                    member.read_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(device = %member.path().display(), offset = off, "scrub read failed: {e}");
                    bad.push((m, off));
                    continue;
                }
                if verify(sum, buf) {
                    if good.is_none() {
                        good = Some(buf.clone());
                    }
                } else {
                    member.count_cksum();
                    tracing::debug!(device = %member.path().display(), offset = off, len, "scrub: checksum mismatch");
                    bad.push((m, off));
                }
            }
        }
        let Some(good) = good else {
            // The scrub-of-death rule: with no verified source, touch nothing.
            self.unrecoverable_blocks.fetch_add(1, Ordering::Relaxed);
            return ScrubOutcome {
                bad_copies: bad.len(),
                repaired: 0,
                unrecoverable: true,
            };
        };
        let mut repaired = 0;
        for (m, off) in &bad {
            let member = &self.members[*m];
            if let Some(dev) = member.writable() {
                match dev.write_at(&good, *off) {
                    Ok(()) => {
                        repaired += 1;
                        self.repaired_blocks.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        member.write_errors.fetch_add(1, Ordering::Relaxed);
                        tracing::error!(device = %member.path().display(), "scrub repair write failed: {e}");
                    }
                }
            }
        }
        ScrubOutcome {
            bad_copies: bad.len(),
            repaired,
            unrecoverable: false,
        }
    }

    /// The places of the whole copies of the record at `addr` (not for striped layouts,
    /// which read and write records whole through their `Placement`).
    fn copies(&self, addr: u64) -> Result<Places> {
        self.placement.copies(self, addr).ok_or_else(|| {
            Error::Invalid(format!(
                "layout {} stripes records: no whole copy to read at pool address {addr}",
                self.layout
            ))
        })
    }

    /// Make all completed writes durable on every available device. The devices sync at
    /// once (a thread each past the first): a FLUSH of a mirror waits for the slowest
    /// device, not for the sum of them.
    pub fn flush(&self) -> Result<()> {
        let (members, devs): (Vec<&Member>, Vec<Arc<dyn Device>>) = self
            .members
            .iter()
            .filter_map(|m| m.writable().map(|d| (m, d)))
            .unzip();
        let results = self.syncers.flush_all(&devs);
        let mut ok = 0;
        for (member, result) in members.into_iter().zip(results) {
            match result {
                Ok(()) => ok += 1,
                Err(e) => {
                    member.fail_write("a sync", &e);
                    tracing::error!(device = %member.path().display(), "flush failed: {e}");
                }
            }
        }
        // Durable only where enough members synced to read every record back: one copy of
        // a mirror, K shards of parity K+M. With 2 of 3 parity:2+1 members failing their
        // sync, one that synced answered the FLUSH (and the intent log told the host's
        // anchor the log had reached its blocks), and after a power loss the import found
        // a flushed record on no device ("the record it names is not on the devices";
        // `bulwark-live --crash`, parity, seed 5011).
        let needed = match self.layout {
            Layout::Parity { k, .. } => k as usize,
            _ => 1,
        };
        if ok < needed {
            return Err(Error::Poisoned);
        }
        Ok(())
    }

    pub fn member_paths(&self) -> Vec<PathBuf> {
        self.members.iter().map(|m| m.path()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::time::Duration;

    /// Flushes that meet: each waits (up to 10 s) until all have begun.
    struct Meet {
        arrived: parking_lot::Mutex<usize>,
        all: parking_lot::Condvar,
        of: usize,
    }

    impl Meet {
        fn wait(&self) -> bool {
            let mut n = self.arrived.lock();
            *n += 1;
            self.all.notify_all();
            let deadline = crate::env::now() + Duration::from_secs(10);
            while *n < self.of {
                if self.all.wait_until(&mut n, deadline).timed_out() {
                    return false;
                }
            }
            true
        }
    }

    fn mirror(fails: &[bool]) -> Redundancy {
        let together = Arc::new(Meet {
            arrived: parking_lot::Mutex::new(0),
            all: parking_lot::Condvar::new(),
            of: fails.len(),
        });
        let members = fails
            .iter()
            .enumerate()
            .map(|(i, &fail)| {
                let dev = Stub {
                    fail_flush: fail,
                    together: Some(together.clone()),
                    ..Stub::new(&format!("/dev/test{i}"))
                };
                Member::new(dev.path.clone(), Some(Arc::new(dev) as Arc<dyn Device>))
            })
            .collect();
        Redundancy::new(Layout::Mirror(fails.len() as u8), members, 8)
    }

    #[test]
    fn a_mirror_syncs_its_devices_at_once_and_a_failed_one_is_faulted() {
        // Each device's flush waits for all the others': this returns only if they run at
        // the same time.
        let r = mirror(&[false, false, false]);
        r.flush().unwrap();
        assert!(r.members.iter().all(|m| !m.faulted.load(Ordering::Relaxed)));

        let r = mirror(&[false, true, false]);
        r.flush().unwrap();
        let faulted: Vec<bool> = r
            .members
            .iter()
            .map(|m| m.faulted.load(Ordering::Relaxed))
            .collect();
        assert_eq!(faulted, [false, true, false]);
        assert_eq!(r.members[1].write_errors.load(Ordering::Relaxed), 1);

        // Every copy failed: nothing is durable.
        let r = mirror(&[true, true]);
        assert!(matches!(r.flush(), Err(Error::Poisoned)));
    }

    /// A device that writes nothing: each write fails as on a full host file system when
    /// `full`; a flush meets the others' of `together` (flushes run one after another
    /// would all time out), then fails when `fail_flush`; the ranges it is told will be
    /// written are noted.
    #[derive(Default)]
    struct Stub {
        path: PathBuf,
        full: bool,
        fail_flush: bool,
        together: Option<Arc<Meet>>,
        noted: parking_lot::Mutex<Vec<(u64, u64)>>,
    }
    impl Stub {
        fn new(path: &str) -> Stub {
            Stub {
                path: PathBuf::from(path),
                ..Stub::default()
            }
        }
        /// A device file whose host file system is full.
        fn full(path: &str) -> Stub {
            Stub {
                full: true,
                ..Stub::new(path)
            }
        }
    }
    impl Device for Stub {
        fn path(&self) -> &Path {
            &self.path
        }
        fn size(&self) -> u64 {
            64 << 20
        }
        fn read_at(&self, _: &mut [u8], _: u64) -> std::io::Result<()> {
            Ok(())
        }
        fn write_at(&self, _: &[u8], _: u64) -> std::io::Result<()> {
            if self.full {
                return Err(std::io::Error::from_raw_os_error(libc::ENOSPC));
            }
            Ok(())
        }
        fn flush(&self) -> std::io::Result<()> {
            if self.together.as_ref().is_some_and(|t| !t.wait()) {
                return Err(std::io::Error::other(
                    "the other devices did not sync meanwhile",
                ));
            }
            if self.fail_flush {
                return Err(std::io::Error::other("flush failed"));
            }
            Ok(())
        }
        fn will_write(&self, offset: u64, len: u64) {
            self.noted.lock().push((offset, len));
        }
    }

    /// A FLUSH of parity:2+1 is durable only when two members synced: with two of three
    /// failing their sync it is refused, not answered by the one that synced. With one
    /// failing it goes on (degraded). A mirror needs one copy.
    #[test]
    fn a_flush_needs_as_many_synced_members_as_the_layout_reads_from() {
        let make = |layout: Layout, failing: &[bool]| {
            let members = failing
                .iter()
                .enumerate()
                .map(|(i, &fail)| {
                    let d = Arc::new(Stub {
                        fail_flush: fail,
                        ..Stub::new(&format!("/dev/test{i}"))
                    });
                    Member::new(d.path.clone(), Some(d as Arc<dyn Device>))
                })
                .collect();
            Redundancy::new(layout, members, 8)
        };
        let parity = Layout::Parity { k: 2, m: 1 };
        assert!(make(parity, &[true, false, true]).flush().is_err());
        assert!(make(parity, &[false, false, true]).flush().is_ok());
        assert!(make(Layout::Mirror(2), &[true, false]).flush().is_ok());
        assert!(make(Layout::Mirror(2), &[true, true]).flush().is_err());
    }

    /// A segment that opens is announced to every member that holds part of it, at the
    /// segment's place there: each copy of a mirror, each shard of parity (parity's
    /// records have no whole copy, and its members were once left out).
    #[test]
    fn an_opened_segment_is_announced_to_every_member_holding_it() {
        for (layout, n) in [(Layout::Mirror(2), 2), (Layout::Parity { k: 2, m: 1 }, 3)] {
            let devs: Vec<Arc<Stub>> = (0..n)
                .map(|i| Arc::new(Stub::new(&format!("/dev/test{i}"))))
                .collect();
            let members = devs
                .iter()
                .map(|d| Member::new(d.path.clone(), Some(d.clone() as Arc<dyn Device>)))
                .collect();
            let r = Redundancy::new(layout, members, 8);
            r.will_write_segment(3);
            for d in &devs {
                assert_eq!(
                    *d.noted.lock(),
                    [(DEVICE_RESERVED_FRONT + 3 * SEGMENT_BYTES, SEGMENT_BYTES)],
                    "{layout:?}"
                );
            }
        }
    }

    #[test]
    fn a_device_whose_file_system_is_full_says_so() {
        let t = tempfile::tempdir().unwrap();
        let good =
            crate::device::FileDevice::create_sparse(&t.path().join("good"), 64 << 20).unwrap();
        let members = vec![
            Member::new(
                t.path().join("good"),
                Some(Arc::new(good) as Arc<dyn Device>),
            ),
            Member::new(
                PathBuf::from("/srv/full/dev1.img"),
                Some(Arc::new(Stub::full("/srv/full/dev1.img")) as Arc<dyn Device>),
            ),
        ];
        let r = Redundancy::new(Layout::Mirror(2), members, 8);
        r.write(0, &[7u8; 4096]).unwrap();
        assert_eq!(r.members[0].fault.lock().clone(), None);
        let why = r.members[1].fault.lock().clone().expect("a reason");
        assert!(why.contains("file system holding it full"), "{why}");
        assert!(why.contains("--preallocate"), "{why}");
        assert!(r.members[1].faulted.load(Ordering::Relaxed));
        // The first reason stays; bringing the device back clears it.
        r.members[1].fail_write("a sync", &std::io::Error::other("later"));
        assert!(r.members[1]
            .fault
            .lock()
            .as_deref()
            .unwrap()
            .contains("full"));
        r.members[1].replace(
            PathBuf::from("/srv/new.img"),
            Arc::new(Stub::full("/srv/new.img")),
        );
        assert_eq!(r.members[1].fault.lock().clone(), None);
    }
}
