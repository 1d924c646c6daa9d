//! Scrub: read every copy of every live record, repair from copies that verify.
//!
//! The contract (docs/scrub.md), enforced here and in `Redundancy::scrub`:
//! - a copy is rewritten only from bytes that verified against the checksum
//!   held in the record's parent pointer, after being read;
//! - when no copy verifies, nothing on any device is written: the record is
//!   listed as unrecoverable with its volume and byte range (`status`);
//! - a later scrub that finds a good copy repairs it and clears the entry.
//!
//! No key is needed: checksums cover stored (encrypted) bytes, so locked
//! volumes are scrubbed too. The scrub walks volumes in id order and each map
//! in logical order, in batches; its cursor is saved in the volume table with
//! every commit, so a scrub interrupted by a restart resumes where it stopped.
//! It is throttled to `rate_bytes` per second and backs off while clients do I/O.
//! A resilver is the same walk after a device comes back or is replaced. Start, pause and
//! cancel commit before they answer, so a crash right after still finds them. The error
//! list (`format::health`) loses a range once a scrub finds it good, or a client rewrites
//! the block whole (`store::Control::clear_rewritten`).
//!
//! With an object store, a record only the store holds (given back, `evict`) is checked
//! there; `scrub --verify-store` also checks the store's copies of local records
//! (`Tier::check_records`, one ranged GET per run of records of one object) and replaces a
//! bad one by moving the record (`clean::move_for_store`), which the next commit uploads.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, UNIX_EPOCH};

use super::core::Core;
pub use super::format::health::{
    DataError, DataErrorKind, ScanKind, ScrubPhase, ScrubState, ScrubStatus, StoreCheck,
};
use crate::constants::MAP_FANOUT_SHIFT;
use crate::map::{At, Blkptr, Visit};
use crate::volume::VolumeState;
use crate::{Error, Result};

/// Logical blocks examined per batch.
const SCRUB_BATCH_BLOCKS: u64 = 4096;

fn now_unix() -> u64 {
    crate::env::system_time()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Core {
    /// Note an unrecoverable range (from a client read or a scrub).
    pub fn record_error(&self, volume: &str, offset: u64, length: u64, kind: DataErrorKind) {
        let epoch = self.scrub.lock().epoch;
        // The volume's state is looked up before the error list's lock is taken (that lock
        // is never held while the volume map's is taken).
        let state = self.volumes.read().get(volume).cloned();
        let mut errs = self.errors.lock();
        if let Some(st) = &state {
            st.note_data_errors(true);
        }
        if let Some(e) = errs
            .iter_mut()
            .find(|e| e.volume == volume && e.offset == offset && e.length == length)
        {
            e.seen_epoch = epoch;
            return;
        }
        errs.push(DataError {
            volume: volume.to_string(),
            offset,
            length,
            kind,
            seen_epoch: epoch,
        });
        self.errors_listed.store(true, Ordering::Release);
        self.table_dirty.store(true, Ordering::Release);
    }

    /// Forget the data errors of blocks a client has just replaced (written or zeroed
    /// whole): they read back what was written now. Errors of map nodes stay: a node's
    /// range covers more than the blocks written. Called by a client write only while
    /// the volume has a data error listed (`VolumeState::has_data_errors`).
    pub(crate) fn clear_rewritten(&self, volume: &str, offset: u64, length: u64) {
        self.forget_errors(|e| {
            e.volume == volume
                && e.kind == DataErrorKind::Data
                && offset <= e.offset
                && e.offset + e.length <= offset + length
        });
    }

    fn clear_error(&self, volume: &str, offset: u64, length: u64) {
        self.forget_errors(|e| {
            e.volume == volume && e.offset < offset + length && offset < e.offset + e.length
        });
    }

    /// Drops the listed errors `gone` picks; the table records it at the next commit.
    fn forget_errors(&self, gone: impl Fn(&DataError) -> bool) {
        if !self.errors_listed.load(Ordering::Acquire) {
            return;
        }
        let states: Vec<Arc<VolumeState>> = self.volumes.read().values().cloned().collect();
        let mut errs = self.errors.lock();
        let before = errs.len();
        errs.retain(|e| !gone(e));
        if errs.len() != before {
            self.table_dirty.store(true, Ordering::Release);
            // Under the list's lock, so that a concurrent `record_error` sets its flag after.
            for st in &states {
                st.note_data_errors(errs.iter().any(|e| e.volume == st.name()));
            }
        }
        if errs.is_empty() {
            self.errors_listed.store(false, Ordering::Release);
        }
    }

    pub fn scrub_status(&self) -> ScrubStatus {
        let s = self.scrub.lock().clone();
        let rate = self.scrub_rate_seen.load(Ordering::Relaxed);
        let eta = (s.state == ScrubPhase::Scanning && rate > 0)
            .then(|| s.bytes_total.saturating_sub(s.bytes_done) / rate);
        ScrubStatus {
            kind: s.kind.as_str().into(),
            device: s.device.clone(),
            state: s.state.as_str().into(),
            bytes_done: s.bytes_done,
            bytes_total: s.bytes_total,
            rate_bytes_per_sec: rate,
            eta_seconds: eta,
            repaired: s.repaired,
            unrecoverable: s.unrecoverable,
            started_unix: s.started_unix,
            finished_unix: s.finished_unix,
            store: s.verify_store.then_some(s.store),
        }
    }

    pub fn data_errors(&self) -> Vec<DataError> {
        self.errors.lock().clone()
    }

    /// Begin a scrub (or resume a paused one).
    pub fn scrub_start(self: &Arc<Self>) -> Result<()> {
        self.scrub_begin(ScanKind::Scrub, None, false)
    }

    /// `scrub_start`; with `verify_store`, the object store's copies of the records the
    /// local devices hold are checked too (one ranged GET per run of them), and a bad one
    /// is replaced by writing the record again from its verified local copy. A paused
    /// scrub resumed this way checks the store from where it stands.
    pub fn scrub_start_with(self: &Arc<Self>, verify_store: bool) -> Result<()> {
        if verify_store && self.tier.is_none() {
            return Err(Error::Invalid(
                "--verify-store: this pool has no object store".into(),
            ));
        }
        self.scrub_begin(ScanKind::Scrub, None, verify_store)
    }

    /// Start a scrub of `kind`; a resilver restarts any scrub from the beginning.
    pub(crate) fn scrub_begin(
        self: &Arc<Self>,
        kind: ScanKind,
        device: Option<std::path::PathBuf>,
        verify_store: bool,
    ) -> Result<()> {
        if kind == ScanKind::Resilver {
            // Let a running pass stop at its next batch; the new one starts from the top.
            self.scrub.lock().state = ScrubPhase::Restarting;
            while self.scrub_running.load(Ordering::Acquire) {
                crate::env::sleep(Duration::from_millis(5));
            }
        }
        {
            let mut s = self.scrub.lock();
            match s.state {
                ScrubPhase::Scanning if self.scrub_running.load(Ordering::Acquire) => {
                    return Err(Error::Busy(
                        "a scrub is already running; see 'bulwark scrub status'".into(),
                    ))
                }
                ScrubPhase::Paused | ScrubPhase::Scanning => {}
                _ => {
                    let total = self.volumes.read().values().map(|v| v.used_bytes()).sum();
                    *s = ScrubState {
                        state: ScrubPhase::Scanning,
                        started_unix: now_unix(),
                        bytes_total: total,
                        epoch: s.epoch + 1,
                        kind,
                        device: device.clone(),
                        verify_store,
                        ..Default::default()
                    };
                }
            }
            s.state = ScrubPhase::Scanning;
            s.verify_store |= verify_store;
        }
        // Durable before the command returns: a crash in the scan's first seconds
        // resumes it on restart instead of forgetting it was asked for.
        self.table_dirty.store(true, Ordering::Release);
        self.commit()?;
        self.spawn_scrub();
        Ok(())
    }

    pub fn scrub_pause(&self) -> Result<()> {
        let mut s = self.scrub.lock();
        if s.state != ScrubPhase::Scanning {
            return Err(Error::Invalid("no scrub is running".into()));
        }
        s.state = ScrubPhase::Paused;
        drop(s);
        self.table_dirty.store(true, Ordering::Release);
        self.commit()
    }

    pub fn scrub_cancel(&self) -> Result<()> {
        let mut s = self.scrub.lock();
        if s.state != ScrubPhase::Scanning && s.state != ScrubPhase::Paused {
            return Err(Error::Invalid("no scrub is running".into()));
        }
        s.state = ScrubPhase::Canceled;
        s.finished_unix = now_unix();
        drop(s);
        self.table_dirty.store(true, Ordering::Release);
        self.commit()
    }

    pub(crate) fn spawn_scrub(self: &Arc<Self>) {
        if self.store.stepped() {
            // The simulator runs the scrub itself (`Pool::scrub_step`).
            return;
        }
        if self.scrub_running.swap(true, Ordering::AcqRel) {
            return;
        }
        let core = self.clone();
        let spawned = std::thread::Builder::new()
            .name("bulwark-scrub".into())
            .spawn(move || loop {
                if let Err(e) = core.scrub_run() {
                    tracing::error!("scrub stopped: {e}");
                }
                core.scrub_running.store(false, Ordering::Release);
                // A scrub started while this one was finishing found us running and left the
                // work to us: take it, unless another thread already did.
                let rearmed =
                    core.scrub.lock().state == ScrubPhase::Scanning && !core.store.is_closing();
                if !rearmed || core.scrub_running.swap(true, Ordering::AcqRel) {
                    return;
                }
            });
        match spawned {
            Ok(h) => self.track_worker(h),
            Err(_) => self.scrub_running.store(false, Ordering::Release),
        }
    }

    fn keep_going(&self) -> bool {
        !self.store.is_closing() && self.scrub.lock().state == ScrubPhase::Scanning
    }

    pub(super) fn scrub_run(&self) -> Result<()> {
        tracing::info!("scrub started");
        let run_start = crate::env::now();
        let done_at_start = self.scrub.lock().bytes_done;
        let mut buf = Vec::new();
        // Records only the object store holds that it did not answer for: after the first,
        // the store is not asked again in this run (each would wait for its deadline).
        let unchecked = AtomicU64::new(0);
        // The volume table itself.
        let root = self.sb.lock().sb.root;
        if !root.is_hole() {
            let _gate = self.store.hold_reads();
            let o = self.store.scrub_local(&root, &mut buf);
            self.count_outcome(o.repaired, o.unrecoverable, 0);
        }
        let mut volumes: Vec<_> = self.volumes.read().values().cloned().collect();
        volumes.sort_by_key(|v| v.id());
        for v in volumes {
            let (cursor_vol, cursor_lba) = {
                let s = self.scrub.lock();
                (s.volume_id, s.lba)
            };
            if v.id() < cursor_vol {
                continue;
            }
            let blocks = v.size() / v.block_size() as u64;
            let bs = v.block_size() as u64;
            let mut lba = if v.id() == cursor_vol { cursor_lba } else { 0 };
            while lba < blocks {
                if !self.keep_going() {
                    tracing::info!("scrub paused or stopped at volume {} block {lba}", v.name());
                    return Ok(());
                }
                // No command changes the volume under a batch (`quiesce_for_change`).
                let _batch = v.background_batch();
                if v.is_destroyed() {
                    break;
                }
                let batch_start = crate::env::now();
                // Batches wholly in holes are stepped over (a thin volume of 1E is 2^36
                // batches), batches starting at multiples of the batch as before.
                let next = v
                    .map()
                    .next_mapped(&*self.store, self.store.nodes(), lba, blocks)
                    // A node on the way that no copy verifies: the batch is walked,
                    // which lists the range it covers.
                    .unwrap_or(lba);
                lba = lba.max(next / SCRUB_BATCH_BLOCKS * SCRUB_BATCH_BLOCKS);
                if lba >= blocks {
                    break;
                }
                let hi = (lba + SCRUB_BATCH_BLOCKS).min(blocks);
                let mut data: Vec<(u64, Blkptr)> = Vec::new();
                let mut batch_bytes = 0u64;
                {
                    // Map nodes are scrubbed under the map lock: a node is freed only by a
                    // commit, which cannot run while we hold it.
                    let tree = v.map();
                    tree.walk(&*self.store, self.store.nodes(), lba, hi, &mut |visit| {
                        match visit {
                            Visit::Data { lba, ptr } => data.push((lba, *ptr)),
                            Visit::Node { level, index, ptr } => {
                                let o = self.store.scrub_local(ptr, &mut buf);
                                batch_bytes += ptr.len as u64;
                                let span = 1u64 << (MAP_FANOUT_SHIFT * (level as u32 + 1));
                                let (off, len) = ((index * span) * bs, span * bs);
                                self.count_outcome(o.repaired, o.unrecoverable, 0);
                                if o.unrecoverable {
                                    self.record_error(
                                        v.name(),
                                        off,
                                        len.min(v.size() - off.min(v.size())),
                                        DataErrorKind::Map,
                                    );
                                }
                            }
                            Visit::Unreadable { level, index, .. } => {
                                let span = 1u64 << (MAP_FANOUT_SHIFT * (level as u32 + 1));
                                let off = index * span * bs;
                                self.record_error(
                                    v.name(),
                                    off,
                                    (span * bs).min(v.size() - off.min(v.size())),
                                    DataErrorKind::Map,
                                );
                            }
                        }
                        Ok(())
                    })?;
                }
                let verify_store = self.scrub.lock().verify_store;
                // Records held locally whose copy in the store is to be checked after the
                // loop: (block, pointer, whether the local copy verified).
                let mut in_store: Vec<(u64, Blkptr, bool)> = Vec::new();
                for (l, ptr) in data {
                    let _gate = self.store.hold_reads();
                    // The client may have replaced the block since the walk; scrub only what is live.
                    if v.map().lookup(&*self.store, self.store.nodes(), l)? != ptr {
                        continue;
                    }
                    batch_bytes += ptr.len as u64;
                    // A record only the object store holds is checked there (`None`: the
                    // store did not answer; not counted as checked or as an error).
                    let Some(mut o) = self.store.scrub_record(
                        ptr.addrs(),
                        ptr.len as usize,
                        &ptr.checksum,
                        &mut buf,
                        unchecked.load(Ordering::Relaxed) == 0,
                    ) else {
                        unchecked.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    // A record whose flags break the volume's policy (plaintext in an
                    // encrypted volume) is not this volume's data, however well it checksums.
                    if let Err(e) = crate::codec::check_policy(v.is_encrypted(), ptr.flags) {
                        tracing::error!(volume = %v.name(), lba = l, "scrub: {e}");
                        o.unrecoverable = true;
                    }
                    if o.unrecoverable {
                        self.record_error(v.name(), l * bs, bs, DataErrorKind::Data);
                    } else {
                        self.clear_error(v.name(), l * bs, bs);
                    }
                    self.count_outcome(o.repaired, o.unrecoverable, ptr.len as u64);
                    if verify_store && !self.store.given_back_record(&ptr) {
                        in_store.push((l, ptr, !o.unrecoverable));
                    }
                }
                if !in_store.is_empty() && unchecked.load(Ordering::Relaxed) == 0 {
                    batch_bytes += self.check_store_copies(&v, &in_store, &unchecked)?;
                }
                lba = hi;
                {
                    let mut s = self.scrub.lock();
                    s.volume_id = v.id();
                    s.lba = lba;
                }
                self.table_dirty.store(true, Ordering::Release);
                drop(_batch);
                self.throttle(batch_start, batch_bytes);
                let done = self.scrub.lock().bytes_done - done_at_start;
                let secs = crate::env::since(run_start).as_secs_f64().max(0.001);
                self.scrub_rate_seen
                    .store((done as f64 / secs) as u64, Ordering::Relaxed);
            }
            if !v.is_destroyed() {
                self.scrub_snapshot_records(&v, &mut buf, &unchecked)?;
                if !self.keep_going() {
                    return Ok(());
                }
            }
            let mut s = self.scrub.lock();
            s.volume_id = v.id() + 1;
            s.lba = 0;
        }
        let mut s = self.scrub.lock();
        if s.state == ScrubPhase::Scanning {
            if s.kind == ScanKind::Resilver {
                for m in self.store.members() {
                    m.resilvering.store(false, Ordering::Release);
                }
            }
            s.state = ScrubPhase::Finished;
            s.finished_unix = now_unix();
            s.bytes_done = s.bytes_done.max(s.bytes_total);
            let epoch = s.epoch;
            drop(s);
            let unchecked = unchecked.load(Ordering::Relaxed);
            if unchecked == 0 {
                self.errors.lock().retain(|e| e.seen_epoch >= epoch);
            } else {
                // Errors of records not checked this run stay listed.
                tracing::warn!(
                    records = unchecked,
                    "scrub: records only the object store holds were not checked (it did not \
                     answer); the errors listed before are kept"
                );
            }
            self.table_dirty.store(true, Ordering::Release);
            self.commit()?;
            tracing::info!("scrub finished");
        }
        Ok(())
    }

    /// Scrub the records only snapshots hold (the walk of the volume's own map saw the
    /// rest): each snapshot against the tree after it, so a record is read once. Found
    /// under the map lock, read without it, each only if its snapshot still holds it.
    fn scrub_snapshot_records(
        &self,
        v: &VolumeState,
        buf: &mut Vec<u8>,
        unchecked: &AtomicU64,
    ) -> Result<()> {
        let bs = v.block_size() as u64;
        let mut found: Vec<(String, At, Blkptr)> = Vec::new();
        {
            let head = v.map();
            let snaps = v.snapshots();
            for (k, s) in snaps.iter().enumerate() {
                let next = crate::volume::snap::next_of(&snaps, &head, k);
                s.tree
                    .walk_unique(&*self.store, self.store.nodes(), &[next], &mut |visit| {
                        match visit {
                            Visit::Data { lba, ptr } => {
                                found.push((s.name.clone(), At::Data(lba), *ptr))
                            }
                            Visit::Node { level, index, ptr } => {
                                found.push((s.name.clone(), At::Node(level, index), *ptr))
                            }
                            Visit::Unreadable { level, index, .. } => {
                                let span = 1u64 << (MAP_FANOUT_SHIFT * (level as u32 + 1));
                                let off = index * span * bs;
                                self.record_error(
                                    &format!("{}@{}", v.name(), s.name),
                                    off,
                                    (span * bs).min(v.size() - off.min(v.size())),
                                    DataErrorKind::Map,
                                );
                            }
                        }
                        Ok(())
                    })?;
            }
        }
        for (name, at, ptr) in found {
            if !self.keep_going() {
                return Ok(());
            }
            let _gate = self.store.hold_reads();
            let held = v.snapshots().iter().any(|s| {
                s.name == name
                    && s.tree
                        .holds(&*self.store, self.store.nodes(), at, &ptr)
                        .unwrap_or(false)
            });
            if !held {
                continue;
            }
            let Some(mut o) = self.store.scrub_record(
                ptr.addrs(),
                ptr.len as usize,
                &ptr.checksum,
                buf,
                unchecked.load(Ordering::Relaxed) == 0,
            ) else {
                unchecked.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let (off, len, kind) = match at {
                At::Data(lba) => {
                    if let Err(e) = crate::codec::check_policy(v.is_encrypted(), ptr.flags) {
                        tracing::error!(volume = %v.name(), snapshot = name, lba, "scrub: {e}");
                        o.unrecoverable = true;
                    }
                    (lba * bs, bs, DataErrorKind::Data)
                }
                At::Node(level, index) => {
                    let span = 1u64 << (MAP_FANOUT_SHIFT * (level as u32 + 1));
                    let off = index * span * bs;
                    (
                        off,
                        (span * bs).min(v.size() - off.min(v.size())),
                        DataErrorKind::Map,
                    )
                }
            };
            if o.unrecoverable {
                self.record_error(&format!("{}@{name}", v.name()), off, len, kind);
            }
            let data = matches!(at, At::Data(_));
            self.count_outcome(
                o.repaired,
                o.unrecoverable,
                if data { ptr.len as u64 } else { 0 },
            );
        }
        Ok(())
    }

    /// `scrub --verify-store`: check the store's copies of `recs` (blocks of `v`'s own
    /// map, held locally; whether each local copy verified), count what was found, and
    /// write again, from the local copy, each record whose store copy is bad (the
    /// cleaner's move: same stored bytes at a new place, uploaded by the next commit; the
    /// bad copy is then referenced by nothing). Returns the bytes read from the store.
    fn check_store_copies(
        &self,
        v: &Arc<VolumeState>,
        recs: &[(u64, Blkptr, bool)],
        unchecked: &AtomicU64,
    ) -> Result<u64> {
        let Some(tier) = &self.tier else {
            return Ok(0);
        };
        // Every copy of a mirrored record is uploaded on its own: check each.
        let mut copies = Vec::new();
        let mut owner = Vec::new();
        for (k, (_, ptr, _)) in recs.iter().enumerate() {
            for &a in ptr.addrs() {
                copies.push((a, ptr.len as usize, ptr.checksum));
                owner.push(k);
            }
        }
        let (found, unavailable) = tier.check_records(&self.store, &copies);
        if unavailable {
            tracing::warn!(
                "scrub: the object store did not answer; its copies are not checked for the \
                 rest of this run"
            );
            unchecked.fetch_add(1, Ordering::Relaxed);
        }
        // A record is bad if a copy of it is; verified if every copy checked verified.
        let (mut bad, mut good) = (vec![false; recs.len()], vec![false; recs.len()]);
        let mut bytes = 0u64;
        for ((k, f), (_, len, _)) in owner.iter().zip(&found).zip(&copies) {
            match f {
                Some(true) => {
                    good[*k] = true;
                    bytes += *len as u64;
                }
                Some(false) => bad[*k] = true,
                None => {}
            }
        }
        let verified = good.iter().zip(&bad).filter(|(g, b)| **g && !**b).count() as u64;
        let mut stored = Vec::new();
        let (mut n_bad, mut rewritten) = (0u64, 0u64);
        for ((lba, ptr, local_ok), bad) in recs.iter().zip(bad) {
            if !bad {
                continue;
            }
            // Only a record still live is judged: one replaced since the walk may lie in
            // a segment reopened and published since, whose bytes are another record's.
            let live = {
                let _gate = self.store.hold_reads();
                v.map().lookup(&*self.store, self.store.nodes(), *lba)? == *ptr
            };
            if !live {
                continue;
            }
            n_bad += 1;
            let bs = v.block_size() as u64;
            tracing::error!(
                volume = %v.name(),
                offset = lba * bs,
                "scrub: the object store's copy of this block does not verify{}",
                if *local_ok { "; writing it again from the local copy" } else { "" }
            );
            if *local_ok && self.move_for_store(v, *lba, *ptr, &mut stored)? {
                rewritten += 1;
            }
        }
        let mut s = self.scrub.lock();
        s.store.verified += verified;
        s.store.bad += n_bad;
        s.store.rewritten += rewritten;
        Ok(bytes)
    }

    fn count_outcome(&self, repaired: usize, unrecoverable: bool, bytes: u64) {
        let mut s = self.scrub.lock();
        s.repaired += repaired as u64;
        s.unrecoverable += unrecoverable as u64;
        s.bytes_done += bytes;
    }

    /// Sleep long enough to hold the configured rate, and a little longer while clients are busy.
    fn throttle(&self, batch_start: Instant, bytes: u64) {
        if self.store.stepped() {
            return;
        }
        let rate = self.scrub_rate.load(Ordering::Relaxed).max(1 << 20);
        let want = Duration::from_secs_f64(bytes as f64 / rate as f64);
        let took = crate::env::since(batch_start);
        let ops = self.store.take_client_ops();
        let extra = if ops > 0 {
            Duration::from_millis(5)
        } else {
            Duration::ZERO
        };
        let deadline = crate::env::now() + want.saturating_sub(took) + extra;
        // Sleep the whole debt (a batch can hold many MiB), in slices so pause and shutdown
        // are noticed promptly.
        while crate::env::now() < deadline && self.keep_going() {
            crate::env::sleep((deadline - crate::env::now()).min(Duration::from_millis(100)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::{test_pool, OpenOptions};
    use crate::volume::{Compression, VolumeOptions};

    fn listed(core: &Core) -> Vec<(String, u64)> {
        core.errors
            .lock()
            .iter()
            .map(|e| (e.volume.clone(), e.offset))
            .collect()
    }

    /// A block a client replaces whole leaves the error list, in the volume written only,
    /// also after a restart (the list comes back from the table); and a volume with no
    /// error listed is never asked about (its flag is down), so its writes do not call up
    /// into the control plane.
    #[test]
    fn a_write_clears_its_own_blocks_errors_and_only_a_listed_volume_is_asked() {
        let t = tempfile::tempdir().unwrap();
        let pool = test_pool(t.path(), OpenOptions::default());
        let o = VolumeOptions {
            size_bytes: 1 << 20,
            block_size: 4096,
            compression: Compression::Off,
            encryption: false,
        };
        for v in ["a", "b", "c"] {
            pool.create_volume(v, o.clone(), None).unwrap();
            pool.volume(v).unwrap().write(0, &[7; 8192], true).unwrap();
        }
        let core = pool.core();
        for v in ["a", "b"] {
            core.record_error(v, 4096, 4096, DataErrorKind::Data);
        }
        let flag = |v: &str| core.find(v).unwrap().has_data_errors();
        assert!(flag("a") && flag("b") && !flag("c"));
        // Block 0 of "a" is not the listed one; block 1 of "b" belongs to another volume.
        pool.volume("a")
            .unwrap()
            .write(0, &[1; 4096], true)
            .unwrap();
        pool.volume("c")
            .unwrap()
            .write(4096, &[1; 4096], true)
            .unwrap();
        assert_eq!(listed(core), [("a".into(), 4096), ("b".into(), 4096)]);
        pool.volume("a")
            .unwrap()
            .write(4096, &[1; 4096], true)
            .unwrap();
        assert_eq!(listed(core), [("b".to_string(), 4096)]);
        assert!(!flag("a") && flag("b") && !flag("c"));
        pool.flush().unwrap();
        drop(pool);

        let pool = crate::pool::Pool::open(t.path(), OpenOptions::default()).unwrap();
        let core = pool.core();
        assert_eq!(listed(core), [("b".to_string(), 4096)]);
        assert!(core.find("b").unwrap().has_data_errors());
        assert!(!core.find("a").unwrap().has_data_errors());
        pool.volume("b")
            .unwrap()
            .write(4096, &[2; 4096], true)
            .unwrap();
        assert!(listed(core).is_empty());
        assert!(!core.find("b").unwrap().has_data_errors());
    }
}
