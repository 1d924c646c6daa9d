//! `Core`: the state shared by the pool facade, volume handles and the maintenance thread.
//!
//! Lock order (outer first): `commit_lock` → `volumes` → a volume's stripe lock →
//! its `tree` → `sb`. `reuse_gate` is read-held by every read of a block from the
//! time its pointer is looked up until its bytes are verified, and write-held only
//! while freed segments become reusable, so no read ever sees a segment reused
//! under it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex, RwLock};

use super::superblock::Superblock;
use super::{DeviceStatus, PoolStatus, SpaceStatus, VolumeStatus};
use crate::checksum::checksum;
use crate::codec;
use crate::codec::Compression;
use crate::constants::*;
use crate::device::fault::{Fault, FaultyDevice};
use crate::keys::{wrap, Secret};
use crate::log::{Emptied, Log, Stream};
use crate::map::{Blkptr, Node, NodeCache, NodeStore, Tree, ADDR_NONE};
use crate::redundancy::Redundancy;
use crate::volume::{Volume, VolumeOptions, VolumeState};
use crate::{Error, Result};

pub(crate) struct SbState {
    pub sb: Superblock,
    pub next_volume_id: u64,
    /// Back region offset on every device (behind the data segments).
    pub back_region: u64,
}

pub struct Core {
    pub dir: PathBuf,
    pub red: Redundancy,
    pub log: Log,
    pub cache: NodeCache,
    pub volumes: RwLock<BTreeMap<String, Arc<VolumeState>>>,
    pub(crate) sb: Mutex<SbState>,
    pub nonce_next: AtomicU64,
    pub nonce_limit: AtomicU64,
    pub commit_lock: Mutex<()>,
    /// Held by each device command (offline, online, replace) from its checks to its
    /// change of `DIR/pool.json`: two at once could both pass a check that only one may
    /// (taking the last two copies offline), or lose one another's pool.json change.
    pub device_lock: Mutex<()>,
    /// Commits begun and finished, for group commit: a flush that arrives while a commit
    /// runs waits for the next one; one that finds a newer commit finished returns.
    pub commits_begun: AtomicU64,
    pub commits_done: AtomicU64,
    /// Sum of every volume's `dirty_nodes` (kept by `note_dirty`).
    pub(crate) dirty_nodes_total: std::sync::atomic::AtomicUsize,
    pub reuse_gate: RwLock<()>,
    /// A batch of recyclable segments is waiting (`recycle_if_due`).
    pub(crate) recycle_due: AtomicBool,
    pub poisoned: AtomicBool,
    pub closing: AtomicBool,
    /// Background workers (key rotations, scrubs): joined when the pool closes
    /// or is dropped, so none still writes to the devices once the pool lock is
    /// released (a second import of the pool would race it).
    pub(crate) workers: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// The volume table changed (create, destroy, keys) or the cleaner moved it.
    pub table_dirty: AtomicBool,
    /// False when import could not walk every map: segments are then never cleaned.
    pub accounting_complete: bool,
    pub(crate) wake: (Mutex<bool>, Condvar),
    pub(crate) space_wait: Mutex<()>,
    /// A writer waits for space (`wait_for_space`): the maintenance thread cleans.
    pub(crate) space_wanted: AtomicBool,
    /// Rounds of the maintenance thread that committed and cleaned for space: a writer that
    /// sees several pass with no segment freed stops waiting.
    pub(crate) clean_rounds: AtomicU64,
    /// The fault-injection layer of each member (None for a missing device).
    pub faults: RwLock<Vec<Option<Arc<FaultyDevice>>>>,
    pub allow_faults: bool,
    /// A new table key for the next commit to seal the table with and record.
    pub table_key_next: Mutex<Option<[u8; 32]>>,
    pub scrub: Mutex<super::scrub::ScrubState>,
    pub errors: Mutex<Vec<super::scrub::DataError>>,
    /// False while `errors` is surely empty (set under its lock by whoever adds one):
    /// lets a client write skip that lock.
    pub errors_listed: AtomicBool,
    pub scrub_running: AtomicBool,
    /// Scrub throttle and the rate it achieved, bytes per second.
    pub scrub_rate: AtomicU64,
    /// Time between commits of the maintenance loop (`OpenOptions::commit_interval`).
    pub commit_interval: Duration,
    pub scrub_rate_seen: AtomicU64,
    /// Client reads and writes since the scrub last looked (it backs off when non-zero).
    pub client_ops: AtomicU64,
}

impl NodeStore for Core {
    fn load_node(&self, ptr: &Blkptr, level: u8, index: u64) -> Result<Node> {
        crate::map::check_node_ptr(ptr)?;
        let raw = self.read_meta(ptr, crate::map::NODE_BYTES)?;
        Node::decode(&raw, level, index)
    }
}

impl Core {
    pub fn check_poisoned(&self) -> Result<()> {
        if self.poisoned.load(Ordering::Acquire) {
            return Err(Error::Poisoned);
        }
        Ok(())
    }

    /// Record volume `st`'s dirty node count (after every change to its tree: client
    /// writes, the cleaner, commits, destroy); the log keeps back from client data and the
    /// cleaner the segments a commit of every volume's dirty nodes needs (`Log::reserve`), so
    /// a full pool can always commit. O(1): the pool-wide total moves by this volume's
    /// change. Returns the pool-wide total.
    pub fn note_dirty(&self, st: &crate::volume::VolumeState, dirty: usize) -> usize {
        let prev = st.dirty_nodes.swap(dirty, Ordering::Relaxed);
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

    /// Keeps a background worker's handle, to be joined by `stop_background`
    /// (handles of workers that have finished are dropped here).
    pub(crate) fn track_worker(&self, handle: std::thread::JoinHandle<()>) {
        let mut workers = self.workers.lock();
        workers.retain(|h| !h.is_finished());
        workers.push(handle);
    }

    /// Stops the background work: sets `closing`, and waits for the
    /// maintenance thread (`maintenance`, if given) and every worker. Each
    /// checks `closing` between batches, so this waits for one batch at most.
    pub(crate) fn stop_background(&self, maintenance: Option<std::thread::JoinHandle<()>>) {
        self.closing.store(true, Ordering::SeqCst);
        self.wake_maintenance();
        if let Some(h) = maintenance {
            let _ = h.join();
        }
        let workers = std::mem::take(&mut *self.workers.lock());
        for h in workers {
            let _ = h.join();
        }
    }

    pub fn wake_maintenance(&self) {
        *self.wake.0.lock() = true;
        self.wake.1.notify_all();
    }

    /// Tell the log about how many map nodes the volumes have (`Log::set_map_nodes`): per
    /// volume, a leaf per 64 blocks of its size, but no more leaves than it has records
    /// (a thin volume's map is as sparse as its data), and the nodes above them.
    pub fn note_map_size(&self) {
        let nodes: u64 = self
            .volumes
            .read()
            .values()
            .map(|v| {
                let blocks = v.size / v.block_size as u64;
                let records = v.used_bytes.load(Ordering::Relaxed) / 4096 + 1;
                let leaves = blocks.div_ceil(MAP_FANOUT as u64).min(records);
                leaves + leaves / 63 + v.tree.lock().depth as u64
            })
            .sum();
        self.log.set_map_nodes(nodes);
    }

    /// The log footprint of one map node record under this layout (lz4 never grows it).
    pub fn node_record_bytes(&self) -> u32 {
        (self
            .red
            .footprint(crate::map::NODE_BYTES)
            .div_ceil(RECORD_ALIGN as usize)
            * RECORD_ALIGN as usize) as u32
    }

    /// Space in the log for a record of `len` stored bytes (its footprint under the layout).
    pub fn alloc_record(&self, stream: Stream, len: usize) -> Result<u64> {
        self.log.alloc(stream, self.red.footprint(len))
    }

    pub fn release_record(&self, addr: u64, len: usize) {
        match self.log.release_bytes(addr, self.red.footprint(len) as u32) {
            Emptied::Nothing => {}
            Emptied::Commit => self.wake_maintenance(),
            Emptied::Recycle => self.recycle_due.store(true, Ordering::Release),
        }
    }

    /// Free the recyclable segments (`log` module docs) if a batch is waiting. Called by
    /// writers after they freed what they replaced, holding no map lock and not the reuse
    /// gate: it waits out every read that looked up a pointer before the segments emptied.
    pub fn recycle_if_due(&self) {
        if !self.recycle_due.swap(false, Ordering::AcqRel) {
            return;
        }
        let (segs, epoch) = self.log.take_recyclable();
        if segs.is_empty() {
            return;
        }
        drop(self.reuse_gate.write());
        self.log.recycle(&segs, epoch);
    }

    /// Release a record that the in-memory state no longer references.
    pub fn free_ptr(&self, p: &Blkptr) {
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
            self.release_record(a, p.len as usize);
        }
    }

    /// A pool-unique nonce. Blocks (commits) when the reserved range is used up.
    pub fn next_nonce(&self) -> Result<u64> {
        loop {
            let n = self.nonce_next.fetch_add(1, Ordering::AcqRel);
            if n < self.nonce_limit.load(Ordering::Acquire) {
                return Ok(n);
            }
            // Give the number back only in spirit: skipping it is harmless, reusing it is not.
            self.commit()?;
        }
    }

    /// Store a metadata record (`METADATA_COPIES` copies in different segments), lz4-compressed.
    pub fn write_meta(&self, raw: &[u8]) -> Result<Blkptr> {
        let mut stored = Vec::new();
        let flags = codec::encode(raw, Compression::Lz4, None, &[], 0, &mut stored)?;
        let sum = checksum(&stored);
        let a0 = self.alloc_record(Stream::Meta, stored.len())?;
        let a1 = if METADATA_COPIES > 1 {
            self.alloc_record(Stream::Meta2, stored.len())?
        } else {
            ADDR_NONE
        };
        let ptr = Blkptr {
            addr: [a0, a1],
            nonce: 0,
            len: stored.len() as u32,
            flags,
            key_gen: 0,
            checksum: sum,
        };
        for &a in ptr.addrs() {
            if let Err(e) = self.red.write(a, &stored) {
                self.free_ptr(&ptr);
                return Err(e);
            }
        }
        Ok(ptr)
    }

    /// Store many metadata records (the map nodes of one level) end to end: one device write
    /// per copy and run instead of one per node. Parity stripes are per record: one by one.
    pub fn write_meta_batch(&self, raws: &[Vec<u8>]) -> Result<Vec<Blkptr>> {
        if matches!(self.red.layout, crate::redundancy::Layout::Parity { .. })
            || METADATA_COPIES != 2
        {
            return raws.iter().map(|r| self.write_meta(r)).collect();
        }
        let mut buf = Vec::new();
        let mut recs: Vec<(usize, Blkptr)> = Vec::with_capacity(raws.len());
        for raw in raws {
            let at = buf.len();
            let flags = codec::encode_append(raw, Compression::Lz4, None, &[], 0, &mut buf)?;
            let len = buf.len() - at;
            let sum = checksum(&buf[at..]);
            buf.resize(
                buf.len().div_ceil(RECORD_ALIGN as usize) * RECORD_ALIGN as usize,
                0,
            );
            recs.push((
                at,
                Blkptr {
                    addr: [0, 0],
                    nonce: 0,
                    len: len as u32,
                    flags,
                    key_gen: 0,
                    checksum: sum,
                },
            ));
        }
        for copy in 0..2 {
            let stream = if copy == 0 {
                Stream::Meta
            } else {
                Stream::Meta2
            };
            let mut placed = 0;
            while placed < recs.len() {
                let lens: Vec<usize> = recs[placed..].iter().map(|r| r.1.len as usize).collect();
                let (addr, n) = self.log.alloc_run(stream, &lens)?;
                let base = recs[placed].0;
                let last = &recs[placed + n - 1];
                let end = last.0 + last.1.len as usize;
                for r in &mut recs[placed..placed + n] {
                    r.1.addr[copy] = addr + (r.0 - base) as u64;
                }
                self.red.write(addr, &buf[base..end])?;
                placed += n;
            }
        }
        Ok(recs.into_iter().map(|r| r.1).collect())
    }

    /// Read a metadata record back, verified, decompressed to `raw_len` bytes (0: any length
    /// up to `META_RAW_BYTES_MAX`; longer is `Corrupt`). The stored length is bounded by
    /// `Redundancy::check_record` before the read buffer is sized.
    pub fn read_meta(&self, ptr: &Blkptr, raw_len: usize) -> Result<Vec<u8>> {
        let mut stored = Vec::new();
        self.red
            .read_verified(ptr.addrs(), ptr.len as usize, &ptr.checksum, &mut stored)?;
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

    pub(crate) fn find(&self, name: &str) -> Result<Arc<VolumeState>> {
        self.volumes
            .read()
            .get(name)
            .cloned()
            .ok_or_else(|| Error::NotFound(format!("volume '{name}' does not exist")))
    }

    pub fn create_volume(
        &self,
        name: &str,
        opts: VolumeOptions,
        secret: Option<&Secret>,
    ) -> Result<()> {
        self.check_poisoned()?;
        validate_name(name)?;
        opts.validate()?;
        if opts.encryption && secret.is_none() {
            return Err(Error::Invalid(
                "an encrypted volume needs a passphrase file or a key file".into(),
            ));
        }
        if !opts.encryption && secret.is_some() {
            return Err(Error::Invalid(
                "a key was given for a volume with encryption off".into(),
            ));
        }
        let uuid = wrap::random_bytes::<16>();
        let keys = secret
            .map(|s| super::keys::new_volume_keys(s, &uuid))
            .transpose()?;
        {
            let mut vols = self.volumes.write();
            if vols.contains_key(name) {
                return Err(Error::Exists(format!("volume '{name}' already exists")));
            }
            let id = {
                let mut sb = self.sb.lock();
                sb.next_volume_id += 1;
                sb.next_volume_id - 1
            };
            let blocks = opts.size_bytes / opts.block_size as u64;
            let tree = Tree::new(id, crate::map::depth_for(blocks), Blkptr::HOLE);
            let (slots, data_keys) = keys
                .as_ref()
                .map(|k| (k.slots.clone(), k.data_keys.clone()))
                .unwrap_or_default();
            let st = VolumeState::new(id, uuid, name.to_string(), &opts, slots, data_keys, tree);
            if let Some(k) = keys {
                *st.ring.write() = Some(Arc::new(k.ring));
                *st.vmk.lock() = Some(k.vmk);
            }
            vols.insert(name.to_string(), Arc::new(st));
        }
        self.table_dirty.store(true, Ordering::Release);
        self.commit()?;
        tracing::info!(
            volume = name,
            size = opts.size_bytes,
            encryption = opts.encryption,
            "volume created"
        );
        Ok(())
    }

    /// Why volume `name` cannot be destroyed or locked now: something holds it
    /// open. (The daemon has already checked for NBD connections; here the
    /// holder is most often a scrub or resilver walking the volume.)
    pub(crate) fn volume_in_use(&self, name: &str) -> Error {
        let by = if self.scrub_running.load(Ordering::Acquire) {
            "a scrub or resilver is reading it; wait for it to finish, or run \
             'bulwark scrub cancel' and try again in a few seconds"
        } else {
            "an NBD client or a key rotation still holds it; detach the clients or wait, \
             and try again"
        };
        Error::Busy(format!("volume '{name}' is in use: {by}"))
    }

    pub fn destroy_volume(&self, name: &str) -> Result<()> {
        self.check_poisoned()?;
        let _c = self.commit_lock.lock();
        let st = self.find(name)?;
        if Arc::strong_count(&st) > 2 {
            // One reference in the table, one here: any other is an open handle.
            return Err(self.volume_in_use(name));
        }
        // Free every record the volume references. Its segments become reusable after the commit.
        {
            let tree = st.tree.lock();
            tree.walk(self, &self.cache, 0, u64::MAX, &mut |v| {
                let p = match v {
                    crate::map::Visit::Node { ptr, .. } => ptr,
                    crate::map::Visit::Data { ptr, .. } => ptr,
                    // Space under an unreadable node leaks until a later import walks it.
                    crate::map::Visit::Unreadable { .. } => return Ok(()),
                };
                self.free_ptr(p);
                Ok(())
            })?;
        }
        // Dirty nodes were never written; their old places were freed by the walk above.
        self.note_dirty(&st, 0);
        self.volumes.write().remove(name);
        st.destroyed.store(true, Ordering::Release);
        self.table_dirty.store(true, Ordering::Release);
        drop(_c);
        self.commit()?;
        tracing::info!(volume = name, "volume destroyed");
        Ok(())
    }

    pub fn volume_handle(self: &Arc<Self>, name: &str) -> Result<Arc<Volume>> {
        self.check_poisoned()?;
        let st = self.find(name)?;
        if st.encryption && st.ring.read().is_none() {
            return Err(Error::Locked(name.to_string()));
        }
        Ok(Arc::new(Volume::new(self.clone(), st)))
    }

    pub fn volume_statuses(&self) -> Vec<VolumeStatus> {
        self.volumes.read().values().map(|v| v.status()).collect()
    }

    pub fn status(&self) -> PoolStatus {
        let sb = self.sb.lock();
        let devices: Vec<DeviceStatus> = self
            .red
            .members
            .iter()
            .map(|m| DeviceStatus {
                path: m.path(),
                state: m.state().to_string(),
                read_errors: m.read_errors.load(Ordering::Relaxed),
                write_errors: m.write_errors.load(Ordering::Relaxed),
                cksum_errors: m.cksum_errors.load(Ordering::Relaxed),
                size_bytes: sb.sb.device_bytes,
            })
            .collect();
        let usable = devices
            .iter()
            .filter(|d| !matches!(d.state.as_str(), "UNAVAIL" | "FAULTED" | "OFFLINE"))
            .count();
        let state = if usable == devices.len() && devices.iter().all(|d| d.state == "ONLINE") {
            "ONLINE"
        } else if match self.red.layout {
            crate::redundancy::Layout::Single => usable == devices.len(),
            crate::redundancy::Layout::Mirror(_) => usable > 0,
            crate::redundancy::Layout::Parity { k, .. } => usable >= k as usize,
        } {
            "DEGRADED"
        } else {
            "FAULTED"
        };
        let per = self.red.data_per_segment_byte();
        let total = self.log.segments() as u64 * SEGMENT_BYTES * per;
        let used = (self.log.live_bytes_total() * per).min(total);
        // The segments client data may not take (`Log::alloc`).
        let reserved =
            (self.log.reserved_segments() as u64 * SEGMENT_BYTES * per).min(total - used);
        let provisioned: u64 = self.volumes.read().values().map(|v| v.size).sum();
        let written = self.log.written();
        PoolStatus {
            pool_id: crate::hex::to_hex(&sb.sb.pool_id),
            dir: self.dir.clone(),
            state: if self.poisoned.load(Ordering::Relaxed) {
                "FAULTED".into()
            } else {
                state.into()
            },
            layout: self.red.layout.to_string(),
            generation: sb.sb.generation,
            devices,
            repaired_blocks: self.red.repaired_blocks.load(Ordering::Relaxed),
            unrecoverable_blocks: self.red.unrecoverable_blocks.load(Ordering::Relaxed),
            space: SpaceStatus {
                total_bytes: total,
                used_bytes: used,
                free_bytes: total - used - reserved,
                reserved_bytes: reserved,
                usable_bytes: total
                    - ((SEGMENTS_RESERVED + self.log.clean_reserve_segments()) as u64
                        * SEGMENT_BYTES
                        * per)
                        .min(total),
                provisioned_bytes: provisioned,
                data_written_bytes: written.data * per,
                clean_written_bytes: written.clean * per,
                meta_written_bytes: written.meta * per,
                write_amplification: written.amplification(),
            },
            volumes: self.volume_statuses(),
            scrub: self.scrub_status(),
            errors: self.data_errors(),
        }
    }

    /// Durable point for everything completed before the call (group commit).
    pub fn flush(&self) -> Result<()> {
        let arrived = self.commits_begun.load(Ordering::Acquire);
        let _g = self.commit_lock.lock();
        // A commit that began after we arrived has finished: it covered us.
        if self.commits_done.load(Ordering::Acquire) > arrived {
            return self.check_poisoned();
        }
        drop(_g);
        self.commit()
    }

    /// Wait until `records` records of client data can be placed, asking the maintenance
    /// thread to commit and clean: back-pressure, never a failure, while space can still be
    /// reclaimed. Answers `NoSpace` when nothing can be: no sealed segment holds dead bytes
    /// worth cleaning, no commit would free a segment or hand back its room (the pool's live
    /// data fills it), or the maintenance thread's rounds of committing and cleaning have
    /// freed nothing `SPACE_WAIT_FUTILE` times in a row, or after `SPACE_WAIT_MAX` without
    /// any progress.
    pub fn wait_for_space(&self, records: usize) -> Result<()> {
        self.wait_for(Stream::Data, records)
    }

    /// Room in the next commit for `nodes` map nodes dirtied without placing a record
    /// (`Log::hold_nodes`), waiting for a commit when the pool is short of it.
    pub fn hold_nodes(&self, nodes: usize) -> Result<crate::log::Pending<'_>> {
        loop {
            match self.log.hold_nodes(nodes) {
                Err(Error::NoSpace) => self.wait_for(Stream::Clean, nodes)?,
                other => return other,
            }
        }
    }

    fn wait_for(&self, stream: Stream, records: usize) -> Result<()> {
        let mut deadline = std::time::Instant::now() + SPACE_WAIT_MAX;
        let mut freed = self.log.freed_total();
        let mut futile = 0;
        while !self.log.space_available(stream, records) {
            self.check_poisoned()?;
            if std::time::Instant::now() >= deadline || self.closing.load(Ordering::Relaxed) {
                return Err(Error::NoSpace);
            }
            let rounds_before = self.clean_rounds.load(Ordering::Acquire);
            self.space_wanted.store(true, Ordering::Release);
            self.wake_maintenance();
            let mut g = self.space_wait.lock();
            self.log.space.wait_for(&mut g, Duration::from_millis(100));
            drop(g);
            if self.log.space_available(stream, records) {
                break;
            }
            let now_freed = self.log.freed_total();
            if now_freed > freed {
                freed = now_freed;
                futile = 0;
                deadline = std::time::Instant::now() + SPACE_WAIT_MAX;
            } else if self.clean_rounds.load(Ordering::Acquire) > rounds_before {
                futile += 1;
                if futile >= SPACE_WAIT_FUTILE {
                    return Err(Error::NoSpace);
                }
            }
            // A full pool answers at once: nothing a commit would free or hand back (its
            // room for map nodes), nothing worth cleaning.
            let reclaimable = self.log.commit_need(0) > 0
                || !self.log.zero_sealed().is_empty()
                || self.log.any_victim();
            if !reclaimable {
                return Err(Error::NoSpace);
            }
        }
        Ok(())
    }

    /// Whether the cleaner should run: free segments are low, or a writer waits for space.
    fn low_on_space(&self) -> bool {
        let free = self.log.free_segments();
        let low = SEGMENTS_FREE_LOW.max(self.log.segments() * FREE_PERCENT_LOW / 100)
            + self.log.reserved_segments();
        free < low || self.space_wanted.load(Ordering::Acquire)
    }

    pub fn any_dirty(&self) -> bool {
        self.table_dirty.load(Ordering::Acquire)
            || self
                .volumes
                .read()
                .values()
                .any(|v| v.tree.lock().dirty_nodes() > 0)
    }

    /// Background work: periodic commits (bounding what an unflushed crash loses), commits when
    /// many map nodes are dirty, and cleaning when free segments run low.
    pub fn maintenance_loop(self: Arc<Self>) {
        loop {
            {
                let mut woken = self.wake.0.lock();
                if !*woken {
                    self.wake.1.wait_for(&mut woken, self.commit_interval);
                }
                *woken = false;
            }
            if self.closing.load(Ordering::SeqCst) {
                return;
            }
            if self.poisoned.load(Ordering::Relaxed) {
                continue;
            }
            // Low on space, a commit also frees the segments emptied since the last one, even
            // when no map node is dirty (a full pool's writers wait for exactly that).
            if self.any_dirty() || (self.low_on_space() && !self.log.zero_sealed().is_empty()) {
                if let Err(e) = self.commit() {
                    tracing::error!("background commit failed: {e}");
                    continue;
                }
            }
            if self.low_on_space() && self.accounting_complete {
                self.space_wanted.store(false, Ordering::Release);
                match self.clean() {
                    Ok(0) => {}
                    Ok(n) => {
                        tracing::debug!(records = n, "cleaned");
                        if let Err(e) = self.commit() {
                            tracing::error!("commit after cleaning failed: {e}");
                        }
                        // More may be needed: go round again at once.
                        *self.wake.0.lock() = true;
                    }
                    Err(e) => tracing::error!("cleaning failed: {e}"),
                }
                self.clean_rounds.fetch_add(1, Ordering::AcqRel);
            }
        }
    }
}

impl Core {
    fn member_index(&self, path: &std::path::Path) -> Result<usize> {
        let canon = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        self.red
            .members
            .iter()
            .position(|m| {
                m.path() == path
                    || std::fs::canonicalize(m.path())
                        .map(|p| p == canon)
                        .unwrap_or(false)
            })
            .ok_or_else(|| {
                Error::NotFound(format!("{} is not a device of this pool", path.display()))
            })
    }

    /// Arm (or with an empty list, clear) injected faults on one device.
    pub fn set_faults(&self, path: &std::path::Path, faults: Vec<Fault>) -> Result<()> {
        if !self.allow_faults {
            return Err(Error::Invalid(
                "fault injection is disabled: start the daemon with 'bulwark serve DIR --allow-fault-injection'".into(),
            ));
        }
        let i = self.member_index(path)?;
        let layers = self.faults.read();
        let dev = layers[i]
            .as_ref()
            .ok_or_else(|| Error::NotFound(format!("device {} is missing", path.display())))?;
        tracing::warn!(device = %path.display(), ?faults, "fault injection set");
        dev.set(faults);
        Ok(())
    }

    pub fn list_faults(&self) -> Vec<(std::path::PathBuf, Vec<Fault>)> {
        self.red
            .members
            .iter()
            .zip(self.faults.read().iter())
            .map(|(m, f)| (m.path(), f.as_ref().map(|f| f.faults()).unwrap_or_default()))
            .collect()
    }
}

impl Core {
    fn check_redundant(&self, verb: &str) -> Result<()> {
        if self.red.layout == crate::redundancy::Layout::Single {
            return Err(Error::Invalid(format!(
                "cannot {verb} a device of a single-layout pool: there is no other copy of its data"
            )));
        }
        Ok(())
    }

    /// Stop using a device (maintenance). Refused if no other copy would remain online.
    pub fn device_offline(&self, path: &std::path::Path) -> Result<()> {
        let _d = self.device_lock.lock();
        self.check_redundant("take offline")?;
        let i = self.member_index(path)?;
        let m = &self.red.members[i];
        if m.offline.load(Ordering::Acquire) {
            return Err(Error::Invalid(format!(
                "device {} is already offline",
                path.display()
            )));
        }
        let others = self
            .red
            .members
            .iter()
            .enumerate()
            // A member still being resilvered is not a whole copy yet.
            .filter(|(j, o)| {
                *j != i
                    && o.dev().is_some()
                    && !o.faulted.load(Ordering::Relaxed)
                    && !o.resilvering.load(Ordering::Acquire)
            })
            .count();
        let needed = match self.red.layout {
            crate::redundancy::Layout::Parity { k, .. } => k as usize,
            _ => 1,
        };
        if others < needed {
            return Err(Error::Invalid(format!(
                "device {} holds the last online copy; it cannot go offline",
                path.display()
            )));
        }
        // Remembered in pool.json first, then obeyed: a restart keeps it offline, as
        // zpool offline does, and a failed pool.json write leaves it fully online.
        self.remember_offline(i, true)?;
        m.offline.store(true, Ordering::Release);
        tracing::warn!(device = %path.display(), "device taken offline: the pool is DEGRADED");
        Ok(())
    }

    /// Adds member `i` to (or removes it from) the offline set in `DIR/pool.json`.
    fn remember_offline(&self, i: usize, offline: bool) -> Result<()> {
        let id = crate::hex::to_hex(&self.sb.lock().sb.member_ids[i]);
        let mut conf = super::create::PoolConfig::read(&self.dir)?;
        let had = conf.offline.contains(&id);
        if had == offline {
            return Ok(());
        }
        if offline {
            conf.offline.push(id);
        } else {
            conf.offline.retain(|o| *o != id);
        }
        conf.write(&self.dir)
    }

    /// Use an offline device again; its copies are brought up to date by a resilver.
    pub fn device_online(self: &Arc<Self>, path: &std::path::Path) -> Result<()> {
        let _d = self.device_lock.lock();
        let i = self.member_index(path)?;
        let m = &self.red.members[i];
        if !m.present() {
            // Left out at import (missing then, or stale): reopen it, if it is still ours.
            self.reattach(i, path)?;
        } else if !m.offline.load(Ordering::Acquire) && !m.faulted.load(Ordering::Acquire) {
            return Err(Error::Invalid(format!(
                "device {} is already online",
                path.display()
            )));
        }
        self.remember_offline(i, false)?;
        m.resilvering.store(true, Ordering::Release);
        m.faulted.store(false, Ordering::Release);
        m.offline.store(false, Ordering::Release);
        tracing::info!(device = %path.display(), "device online: resilvering");
        self.scrub_begin("resilver", Some(m.path()))
    }

    /// Open the device at `path` again for member `i`: its label must name this pool and
    /// this member. Its copies are stale; the caller resilvers.
    fn reattach(&self, i: usize, path: &std::path::Path) -> Result<()> {
        use crate::device::{Device, FileDevice};
        let mut dev = FileDevice::open(path)?;
        dev.claim()?;
        let (pool_id, member_id, back_region, need) = {
            let sb = self.sb.lock();
            (
                sb.sb.pool_id,
                sb.sb.member_ids[i],
                sb.back_region,
                sb.sb.device_bytes,
            )
        };
        if dev.size() < need {
            return Err(Error::Invalid(format!(
                "{} is smaller than this pool's devices ({} < {}): restore its size, or use 'bulwark device replace'",
                path.display(),
                crate::size::format_size(dev.size()),
                crate::size::format_size(need)
            )));
        }
        let label = super::import::label_of(&dev, back_region).ok_or_else(|| {
            Error::Invalid(format!(
                "{} carries no bulwark label; use 'bulwark device replace' for a new device",
                path.display()
            ))
        })?;
        if label.pool_id != pool_id || label.device_id != member_id {
            return Err(Error::Invalid(format!(
                "{} is not member {i} of this pool (its label names another pool or member); use 'bulwark device replace'",
                path.display()
            )));
        }
        let faulty = Arc::new(FaultyDevice::new(Box::new(dev), back_region));
        let _c = self.commit_lock.lock();
        self.red.members[i].replace(path.to_path_buf(), faulty.clone());
        self.faults.write()[i] = Some(faulty);
        Ok(())
    }

    /// Put `new` in the place of `old` and resilver every live record onto it.
    pub fn device_replace(
        self: &Arc<Self>,
        old: &std::path::Path,
        new: &std::path::Path,
    ) -> Result<()> {
        use crate::device::{Device, FileDevice};
        let _d = self.device_lock.lock();
        self.check_redundant("replace")?;
        let i = self.member_index(old)?;
        if !new.exists() {
            return Err(Error::NotFound(format!(
                "new device {} does not exist (for a file: truncate -s SIZE {})",
                new.display(),
                new.display()
            )));
        }
        let new_abs = std::fs::canonicalize(new).map_err(|e| Error::device(new, e))?;
        // NEW may be OLD's own path: a dead disk swapped for a blank one in the same
        // slot (as `zpool replace POOL DEV`). The label check below refuses it while
        // the old disk, still labelled, is there.
        let in_place = match self.member_index(&new_abs) {
            Ok(j) if j == i => true,
            Ok(_) => {
                return Err(Error::Invalid(format!(
                    "{} is already a device of this pool",
                    new.display()
                )))
            }
            Err(_) => false,
        };
        let mut dev = FileDevice::open(&new_abs)?;
        dev.claim()?;
        let (need, back_region) = {
            let sb = self.sb.lock();
            (sb.sb.device_bytes, sb.back_region)
        };
        if dev.size() < need {
            return Err(Error::Invalid(format!(
                "new device {} is too small: {} needed, {} available",
                new.display(),
                crate::size::format_size(need),
                crate::size::format_size(dev.size())
            )));
        }
        if let Some(sb) = super::create::front_label(&dev) {
            let ours = {
                let s = self.sb.lock();
                sb.pool_id == s.sb.pool_id && sb.device_id == s.sb.member_ids[i]
            };
            let m = &self.red.members[i];
            let healthy = m.dev().is_some()
                && !m.faulted.load(Ordering::Acquire)
                && !m.resilvering.load(Ordering::Acquire);
            if in_place && ours && healthy {
                return Err(Error::Exists(format!(
                    "device {} is an online member of this pool, in use: there is nothing to replace \
                     (a blank disk put in its place is rebuilt with this command)",
                    new.display()
                )));
            }
            if in_place && ours {
                return Err(Error::Exists(format!(
                    "device {} still carries its label of this pool: 'bulwark device online {}' \
                     brings it up to date; to rebuild it from nothing, wipe its first MiB first",
                    new.display(),
                    new.display()
                )));
            }
            return Err(Error::Exists(format!(
                "device {} already belongs to bulwark pool {}; wipe its first MiB to reuse it",
                new.display(),
                crate::hex::to_hex(&sb.pool_id)
            )));
        }
        let faulty = Arc::new(FaultyDevice::new(Box::new(dev), back_region));
        self.remember_offline(i, false)?;
        {
            let _c = self.commit_lock.lock();
            let m = &self.red.members[i];
            m.resilvering.store(true, Ordering::Release);
            m.offline.store(false, Ordering::Release);
            m.replace(new_abs.clone(), faulty.clone());
            self.faults.write()[i] = Some(faulty);
            self.sb.lock().sb.member_ids[i] = wrap::random_bytes::<16>();
        }
        let mut conf = super::create::PoolConfig::read(&self.dir)?;
        conf.devices = self
            .red
            .members
            .iter()
            .map(|m| {
                let p = m.path();
                p.strip_prefix(&self.dir)
                    .map(|p| p.to_path_buf())
                    .unwrap_or(p)
            })
            .collect();
        conf.write(&self.dir)?;
        self.table_dirty.store(true, Ordering::Release);
        self.commit()?;
        tracing::info!(old = %old.display(), new = %new_abs.display(), "device replaced: resilvering");
        self.scrub_begin("resilver", Some(new_abs))
    }
}

pub fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        && !name.starts_with(['-', '.']);
    if !ok {
        return Err(Error::Invalid(format!(
            "invalid volume name '{name}': use 1-64 letters, digits, '.', '_' or '-', not starting with '-' or '.'"
        )));
    }
    Ok(())
}
