//! `Core`: the control plane, shared by the pool facade, the maintenance thread and the
//! background workers: the volumes, devices, the commit lock, the scrub's state and error
//! list, the workers, the intent log's chain and log devices. It reaches the disks only
//! through the data plane it owns (`Store`), and volume handles reach it back only
//! through `store::Control`. Here: volume create and destroy, device offline, online and
//! replace, fault injection, `status`, and the maintenance loop (commits on the timer,
//! cleaning, the object tier's checks, eviction); the other rooms add their own methods.
//!
//! `Core`'s fields are the pool room's own (`pub(super)`: pool/ and its folders, which
//! implement `Core`); the rest of the engine asks through `Pool` and `store::Control`
//! (`tests/layers.rs` holds it so).
//!
//! Lock order (outer first): `commit_lock` → `volumes` → a volume's stripe lock →
//! its `tree` → `sb`; the data plane's `reuse_gate` (`Store`) is innermost.
//!
//! "In use" is `VolumeState::clients`: the handles clients and commands hold, never the
//! maintenance thread's references. `quiesce_for_change` makes destroy, rollback, key
//! unload or erase and a shrink refuse a volume in use and wait, bounded, for a scrub or
//! rotation batch over it; the command checks everything before it changes anything.
//!
//! Device commands change `pool.json` (`format::config`: members taken offline stay out
//! across restarts) one at a time, under `device_lock`.
//!
//! Cleaning that gains nothing while writers wait is *stuck* (`CleanGains`,
//! `Store::set_clean_stuck`): after `CLEAN_FUTILE_PASSES` such passes, writers that need
//! new space get ENOSPC at once and `status` says why, until space is freed.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

use super::format::superblock::Superblock;
use super::status::{DeviceStatus, PoolStatus, SpaceStatus, VolumeStatus};
use crate::constants::*;
use crate::device::fault::{Fault, FaultyDevice};
use crate::keys::{wrap, Secret};
use crate::map::{Blkptr, Tree};
use crate::redundancy::DeviceState;
use crate::store::{Control, Store};
use crate::volume::uses::Refused;
use crate::volume::{Volume, VolumeOptions, VolumeState};
use crate::{Error, Result};

pub(crate) struct SbState {
    pub sb: Superblock,
    pub next_volume_id: u64,
    /// Back region offset on every device (behind the data segments).
    pub back_region: u64,
}

/// A volume and the notes a commit took from it (`Core::notes_taken`).
pub(crate) type NotesTaken = (Arc<VolumeState>, Vec<(u64, Blkptr)>);

pub struct Core {
    pub(super) dir: PathBuf,
    /// The data plane: placement, the log, nonces, the node cache.
    pub(super) store: Arc<Store>,
    pub(super) volumes: RwLock<BTreeMap<String, Arc<VolumeState>>>,
    pub(super) sb: Mutex<SbState>,
    /// Authenticates every superblock this pool writes and reads (from `DIR/pool.key`,
    /// decision 0011).
    pub(super) sb_key: super::format::superblock::SbKey,
    /// Keys the MAC of every intent log block (from `DIR/pool.key`).
    pub(super) log_key: super::format::superblock::SbKey,
    /// What `DIR/pool.anchor` should say next: the generation last committed (the next
    /// commit writes it together with the generation it is about to write).
    pub(super) anchor: Mutex<super::format::anchor::Anchor>,
    /// The import took devices older than the host's anchor (`accept_rollback`): their
    /// generation and the one the host had committed.
    pub(super) rollback_accepted: Option<(u64, u64)>,
    /// The import found acknowledged flushes lost from the intent log and took the pool
    /// anyway (`accept_log_loss`): what was lost, for `status`.
    pub(super) log_loss: Option<String>,
    /// Records how far the intent log reached, after flushes (`anchor::ReachWriter`).
    pub(super) reach: super::format::anchor::ReachWriter,
    pub(super) commit_lock: Mutex<()>,
    /// Commits begun, done and failed, and flushes waiting for `commit_lock`
    /// (`flush_since`): a cleaning pass that holds it commits between two batches of moves
    /// when any wait, which answers them, so a FLUSH never waits for a whole pass (issue 36).
    pub(super) group: super::group::GroupCommit,
    /// Map nodes the running cleaning pass made dirty (its cost besides the moves).
    pub(super) clean_dirtied: std::sync::atomic::AtomicUsize,
    /// The idle defragmenter's switch and counts (`defrag.rs`).
    pub(super) defrag_stats: DefragStats,
    /// The notes (`VolumeState::intents`) the commit under way took as it read each
    /// volume's leaves: put back if the object store refuses it (`commit_held`), so that
    /// a log flush after it still writes them.
    pub(super) notes_taken: Mutex<Vec<NotesTaken>>,
    /// The intent log chain flushes append to (`intentlog::block`); `None` with the log off.
    pub(super) intent: Mutex<Option<super::intentlog::block::Chain>>,
    /// Whether flushes go through the intent log (`OpenOptions::intent_log`).
    pub(super) intent_log: bool,
    /// The separate log devices the intent log's chain goes to, if the pool has any
    /// (`intentlog::devices`); changed only under the commit lock (`set_log_devices`).
    pub(super) logdev: RwLock<Option<Arc<super::intentlog::devices::LogDevices>>>,
    /// Held by each device command (offline, online, replace) from its checks to its
    /// change of `DIR/pool.json`: two at once could both pass a check that only one may
    /// (taking the last two copies offline), or lose one another's pool.json change.
    pub(super) device_lock: Mutex<()>,
    /// Background workers (key rotations, scrubs): joined when the pool closes
    /// or is dropped, so none still writes to the devices once the pool lock is
    /// released (a second import of the pool would race it).
    pub(super) workers: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// The volume table changed (create, destroy, keys) or the cleaner moved it.
    pub(super) table_dirty: AtomicBool,
    /// False when import could not walk every map: segments are then never cleaned.
    pub(super) accounting_complete: bool,
    /// The fault-injection layer of each member (None for a missing device).
    pub(super) faults: RwLock<Vec<Option<Arc<FaultyDevice>>>>,
    pub(super) allow_faults: bool,
    /// A new table key for the next commit to seal the table with and record.
    pub(super) table_key_next: Mutex<Option<[u8; 32]>>,
    pub(super) scrub: Mutex<super::format::health::ScrubState>,
    pub(super) errors: Mutex<Vec<super::format::health::DataError>>,
    /// False while `errors` is surely empty (set under its lock by whoever adds one):
    /// lets a client write skip that lock.
    pub(super) errors_listed: AtomicBool,
    pub(super) scrub_running: AtomicBool,
    /// Scrub throttle and the rate it achieved, bytes per second.
    pub(super) scrub_rate: AtomicU64,
    /// Time between commits of the maintenance loop (`OpenOptions::commit_interval`).
    pub(super) commit_interval: Duration,
    pub(super) scrub_rate_seen: AtomicU64,
    /// A cache device was configured but is not in use, and why (`status` shows it).
    pub(super) cachedev_unavailable: Mutex<Option<crate::cachedev::CacheDeviceStatus>>,
    /// The pool's object store, when it has one (`tier`): every commit publishes to it.
    pub(super) tier: Option<Arc<super::tier::Tier>>,
}

impl Core {
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
        self.store.close();
        self.store.wake_maintenance();
        if let Some(h) = maintenance {
            let _ = h.join();
        }
        let workers = std::mem::take(&mut *self.workers.lock());
        for h in workers {
            let _ = h.join();
        }
        if let Some(c) = self.store.cachedev() {
            c.close();
        }
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
                let blocks = v.size() / v.block_size() as u64;
                let records = v.used_bytes() / 4096 + 1;
                let leaves = blocks.div_ceil(MAP_FANOUT as u64).min(records);
                leaves + leaves / 63 + v.map().depth as u64
            })
            .sum();
        self.store.set_map_nodes(nodes);
    }

    pub(crate) fn find(&self, name: &str) -> Result<Arc<VolumeState>> {
        self.find_any(name)
            .filter(|v| !v.is_deferred())
            .ok_or_else(|| Error::NotFound(format!("volume '{name}' does not exist")))
    }

    /// `find`, a destroyed volume kept for its snapshots' clones included.
    pub(crate) fn find_any(&self, name: &str) -> Option<Arc<VolumeState>> {
        self.volumes.read().get(name).cloned()
    }

    /// Why `name` cannot name a new volume: a volume has it, or a destroyed one kept for
    /// the clones of its snapshots.
    pub(crate) fn name_taken(&self, name: &str) -> Option<Error> {
        let v = self.find_any(name)?;
        Some(Error::Exists(if v.is_deferred() {
            format!(
                "the name '{name}' is held by a destroyed volume whose snapshots still have \
                 clones; choose another name, or destroy those clones"
            )
        } else {
            format!("volume '{name}' already exists")
        }))
    }

    /// Create volume `name`; `thick` reserves its whole size (refused when the pool
    /// cannot hold it).
    pub fn create_volume(
        &self,
        name: &str,
        opts: VolumeOptions,
        secret: Option<&Secret>,
        thick: bool,
    ) -> Result<()> {
        self.store.check_poisoned()?;
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
            .map(|s| crate::keys::ring::new_volume_keys(s, &uuid, self.store.run_salt()))
            .transpose()?;
        // Held from the reservation check to the commit (after the keys' slow KDF): two
        // thick creates cannot both take the last room.
        let _c = self.commit_lock.lock();
        if self.volumes.read().contains_key(name) {
            return Err(self.name_taken(name).expect("the name is taken"));
        }
        if thick {
            self.check_reservation(opts.size_bytes)?;
        }
        {
            let mut vols = self.volumes.write();
            if vols.contains_key(name) {
                drop(vols);
                return Err(self.name_taken(name).expect("the name is taken"));
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
            st.set_thick(thick);
            st.set_created(crate::volume::now_secs());
            if let Some(k) = keys {
                st.open_keys(k.ring, k.vmk);
            }
            vols.insert(name.to_string(), Arc::new(st));
        }
        self.table_dirty.store(true, Ordering::Release);
        self.commit_held()?;
        self.count_reservations();
        tracing::info!(
            volume = name,
            size = opts.size_bytes,
            encryption = opts.encryption,
            thick,
            "volume created"
        );
        Ok(())
    }

    /// Why volume `name` cannot be destroyed or locked now: something holds it
    /// open. (The daemon has already checked for NBD connections; here the
    /// holder is most often a scrub or resilver walking the volume.)
    pub(crate) fn volume_in_use(&self, name: &str, clients: usize) -> Error {
        Error::Busy(format!(
            "volume '{name}' is in use: {clients} open handle(s) (an NBD client, an image \
             import or export, a bench); detach them first"
        ))
    }

    /// Before a command changes what volume `st` is (destroy, rollback, key unload or
    /// erase, shrink): refused while a client or a command holds it open; a background
    /// batch over it (scrub, key rotation) is waited for, at most `QUIESCE_WAIT_MAX`, and
    /// kept out while the guard lives. Take it before the commit lock.
    pub(crate) fn quiesce_for_change<'a>(
        &self,
        st: &'a VolumeState,
    ) -> Result<crate::sync::RwLockWriteGuard<'a, ()>> {
        let g = st
            .quiesce(crate::constants::QUIESCE_WAIT_MAX)
            .map_err(|why| self.refused(st, why))?;
        if st.is_destroyed() {
            return Err(Error::NotFound(format!(
                "volume '{}' does not exist",
                st.name()
            )));
        }
        Ok(g)
    }

    /// The error for a change to volume `st` that `Uses` refused.
    pub(crate) fn refused(&self, st: &VolumeState, why: Refused) -> Error {
        match why {
            Refused::InUse(clients) => self.volume_in_use(st.name(), clients),
            Refused::Busy => {
                let by = if self.scrub_running.load(Ordering::Acquire) {
                    "a scrub or resilver batch"
                } else {
                    "a key rotation batch"
                };
                Error::Busy(format!(
                    "volume '{}' is busy: {by} over it did not end within {} s; try again, \
                 or pause it ('bulwark scrub pause')",
                    st.name(),
                    crate::constants::QUIESCE_WAIT_MAX.as_secs()
                ))
            }
        }
    }

    /// Destroy volume `name` and free its space. A volume with snapshots needs `recursive` (they go with it),
    /// and none may be held. Snapshots with clones stay, hidden, until their last clone
    /// goes (the volume is *deferred*: its name stays taken, its own data is freed now);
    /// returns what stays that way, as (snapshot, referenced bytes, clones).
    pub fn destroy_volume(&self, name: &str, recursive: bool) -> Result<Vec<KeptSnapshot>> {
        self.store.check_poisoned()?;
        let st = self.find(name)?;
        let _w = self.quiesce_for_change(&st)?;
        let _c = self.commit_lock.lock();
        let mut kept = Vec::new();
        {
            let snaps = st.snapshots();
            let snaps: Vec<&crate::volume::snap::Snap> = snaps.iter().filter(|s| !s.base).collect();
            if let Some(s) = snaps.iter().find(|s| !s.holds.is_empty()) {
                return Err(Error::Busy(format!(
                    "snapshot '{name}@{}' is held; release its holds before destroying the volume",
                    s.name
                )));
            }
            if !snaps.is_empty() && !recursive {
                let names: Vec<String> =
                    snaps.iter().map(|s| format!("{name}@{}", s.name)).collect();
                return Err(Error::Busy(format!(
                    "volume '{name}' has {} snapshot(s): {}; destroy them first, or pass -r to \
                     destroy them with it",
                    names.len(),
                    names.join(", ")
                )));
            }
            for s in snaps {
                let clones: Vec<String> = self
                    .clones_of(name, &s.name)
                    .iter()
                    .map(|c| c.name().to_string())
                    .collect();
                if !clones.is_empty() {
                    kept.push(KeptSnapshot {
                        snapshot: format!("{name}@{}", s.name),
                        referenced_bytes: s.referenced,
                        clones,
                    });
                }
            }
        }
        if kept.is_empty() {
            // Free every record the volume and its snapshots reference. Their segments
            // become reusable after the commit.
            self.release_family(&st);
            // Dirty nodes were never written; their old places were freed by the walk above.
            self.store.note_dirty(st.head_dirty(), 0);
            self.store.note_dirty(st.snaps_dirty(), 0);
            self.volumes.write().remove(name);
            st.mark_destroyed();
        } else {
            self.defer_destroy(&st)?;
        }
        // Clones going may let a deferred volume go too.
        self.reap_deferred()?;
        self.table_dirty.store(true, Ordering::Release);
        self.commit_held()?;
        tracing::info!(volume = name, kept = kept.len(), "volume destroyed");
        Ok(kept)
    }

    pub fn volume_handle(self: &Arc<Self>, name: &str) -> Result<Arc<Volume>> {
        self.store.check_poisoned()?;
        let st = self.find(name)?;
        Ok(Arc::new(Volume::for_client(
            self.store.clone(),
            self.clone(),
            st,
        )?))
    }

    pub fn volume_statuses(&self) -> Vec<VolumeStatus> {
        self.volumes
            .read()
            .values()
            .filter(|v| !v.is_deferred())
            .map(|v| v.status())
            .collect()
    }

    pub fn status(&self) -> PoolStatus {
        let sb = self.sb.lock();
        let states: Vec<DeviceState> = self.store.members().iter().map(|m| m.state()).collect();
        let devices: Vec<DeviceStatus> = self
            .store
            .members()
            .iter()
            .zip(&states)
            .map(|(m, state)| DeviceStatus {
                path: m.path(),
                state: state.as_str().to_string(),
                read_errors: m.read_errors.load(Ordering::Relaxed),
                write_errors: m.write_errors.load(Ordering::Relaxed),
                cksum_errors: m.cksum_errors.load(Ordering::Relaxed),
                size_bytes: sb.sb.device_bytes,
                fault: m.fault.lock().clone(),
            })
            .collect();
        let usable = states
            .iter()
            .filter(|s| {
                !matches!(
                    s,
                    DeviceState::Unavail | DeviceState::Faulted | DeviceState::Offline
                )
            })
            .count();
        let state = if states.iter().all(|s| *s == DeviceState::Online) {
            "ONLINE"
        } else if usable >= self.store.layout().members_needed(devices.len()) {
            "DEGRADED"
        } else {
            "FAULTED"
        };
        // A log device out (failed, missing, fallen back) degrades the pool, as in zpool:
        // nothing is lost while it runs, but a crash now costs what a pool without it does.
        let log = self.logdev.read().as_ref().map(|l| l.status());
        let state = match &log {
            Some(l) if state == "ONLINE" && l.state != "ONLINE" => "DEGRADED",
            _ => state,
        };
        // Commits not reaching the object store degrade the pool: nothing is lost while it
        // runs, but the store lags (`tier::TierStatus`). Fenced poisons it (FAULTED below).
        let state = match &self.tier {
            Some(t) if state == "ONLINE" && t.is_failing() => "DEGRADED",
            _ => state,
        };
        PoolStatus {
            pool_id: crate::hex::to_hex(&sb.sb.pool_id),
            name: if sb.sb.name.is_empty() {
                self.dir
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default()
            } else {
                sb.sb.name.clone()
            },
            dir: self.dir.clone(),
            state: if self.store.is_poisoned() {
                "FAULTED".into()
            } else {
                state.into()
            },
            layout: self.store.layout().to_string(),
            generation: sb.sb.generation,
            devices,
            repaired_blocks: self.store.repair_counts().0,
            unrecoverable_blocks: self.store.repair_counts().1,
            space: self.space_status(),
            volumes: self.volume_statuses(),
            scrub: self.scrub_status(),
            errors: self.data_errors(),
            cache_device: match self.store.cachedev() {
                Some(c) => Some(c.status()),
                None => self.cachedev_unavailable.lock().clone(),
            },
            log,
            lost_flushes: self.log_loss.clone(),
            object_store: self.tier.as_ref().map(|t| t.status(&self.store)),
        }
    }

    /// The pool's space numbers (`status`).
    fn space_status(&self) -> SpaceStatus {
        let per = self.store.data_per_segment_byte();
        let total = self.store.segments() as u64 * SEGMENT_BYTES * per;
        let used = (self.store.live_bytes_total() * per).min(total);
        // The segments client data may not take (`Log::alloc`).
        let reserved =
            (self.store.reserved_segments() as u64 * SEGMENT_BYTES * per).min(total - used);
        let provisioned: u64 = self
            .volumes
            .read()
            .values()
            .filter(|v| !v.is_deferred())
            .map(|v| v.size())
            .sum();
        let written = self.store.written();
        // What thick volumes reserved and have not stored: kept from thin volumes' data.
        let thick = self
            .volumes
            .read()
            .values()
            .filter(|v| !v.is_deferred())
            .map(|v| v.reservation_unused())
            .sum::<u64>()
            .min(total - used - reserved);
        let holes = self.store.holes();
        SpaceStatus {
            total_bytes: total,
            used_bytes: used,
            free_bytes: total - used - reserved - thick,
            reserved_bytes: reserved,
            thick_reserved_bytes: thick,
            usable_bytes: (self.store.usable_bytes() * per).min(total),
            provisioned_bytes: provisioned,
            data_written_bytes: written.data * per,
            clean_written_bytes: written.clean * per,
            meta_written_bytes: written.meta * per,
            write_amplification: written.amplification(),
            cleaning: self.store.clean_stuck().map(|s| s.why),
            clean_cost: self.store.clean_cost(),
            hole_bytes: holes.bytes * per,
            hole_large_bytes: holes.large_bytes * per,
            holes: holes.count as u64,
            hole_filled_bytes: holes.filled_bytes * per,
            defrag_moved_bytes: self.defrag_stats.moved.load(Ordering::Relaxed) * per,
            defrag_passes: self.defrag_stats.passes.load(Ordering::Relaxed),
            refused_writes: self.store.space_refusals(),
            last_refusal: self.store.last_refusal(),
        }
    }

    /// Durable point for everything completed before the call (group commit).
    pub fn flush(&self) -> Result<()> {
        self.flush_since(self.group.arrive())
    }

    /// `flush` by a caller that arrived when `arrived` commits had begun.
    pub(crate) fn flush_since(&self, arrived: u64) -> Result<()> {
        // A commit or log flush that began after we arrived has finished: it covered us,
        // unless one that began after we arrived failed (then it may not have). Waiting,
        // a flush is counted so that a cleaning pass holding the lock commits for it
        // between two batches (`clean`), and looks for that commit as it waits.
        let Some(_g) = self.group.lock_or_covered(&self.commit_lock, arrived) else {
            return self.store.check_poisoned();
        };
        self.flush_held()
    }

    /// Make every write completed before the call durable, by a holder of the commit lock:
    /// through the intent log where it may, else by a commit.
    pub(crate) fn flush_held(&self) -> Result<()> {
        if !self.flush_by_log() {
            return self.commit_held();
        }
        self.store.check_poisoned()?;
        let volumes: Vec<_> = self.volumes.read().values().cloned().collect();
        let logged = self.group.log_flush(|| self.log_flush_held(&volumes));
        match logged {
            Ok(true) => Ok(()),
            // No chain, or no room for a block: a commit makes it all durable.
            Ok(false) | Err(Error::NoSpace) => self.commit_held(),
            Err(e) => {
                tracing::error!("intent log flush failed, pool poisoned: {e}");
                self.store.poison();
                Err(e)
            }
        }
    }

    /// Whether a FLUSH goes to the intent log rather than being a commit. A commit instead
    /// when it gains space: short of free segments, the data segments emptied since the
    /// last commit, which it frees, are at least the segments it writes for the dirty map
    /// nodes. Not otherwise, near full too: a commit rewrites a map leaf for each scattered
    /// block written or moved since the last, so a commit per FLUSH of durable random 4 KiB
    /// writes at 84% (or per FLUSH that waited on a cleaning pass, once its first victim
    /// emptied) cost more in map nodes than cleaning freed, until writes were refused
    /// (issue 36); a log write costs a block per 64 of them. The maintenance round commits
    /// after each cleaning pass writers wait for. Always a commit while thick volumes hold
    /// reservations: the room thin volumes may take is counted against the map's size as
    /// of the last commit, which must stay recent.
    fn flush_by_log(&self) -> bool {
        let thick = self.store.thick_unused() > 0;
        let emptied = self.store.emptied_since_commit();
        let gains = self.low_on_space() && emptied > 0 && emptied >= self.store.commit_segments();
        self.intent_log && !thick && !gains
    }

    /// Whether the cleaner should run: free segments are low, or a writer waits for space.
    pub(super) fn low_on_space(&self) -> bool {
        // Below `low` client writes fill holes (decision 0014) and the cleaner runs as it did
        // before holes: it frees the emptier segments whole (holes are filled only in
        // segments at least 3/4 live), which commits need. A first version let it idle while
        // enough holes were known; it then started with too little room to gain
        // (`bench/full_pool.sh` and `test_space_at_fill` on parity at 90%: writes refused).
        // With holes first (`OpenOptions::holes_first`) it waits until free segments come
        // within a margin of the client floor: it makes the whole segments commits need,
        // and client data goes into holes meanwhile.
        let start = if self.store.holes_first() {
            self.store.reserved_segments() + crate::constants::HOLES_FIRST_CLEAN_MARGIN
        } else {
            self.store.low_free_segments()
        };
        self.store.space_wanted() || self.store.free_segments() < start
    }

    pub fn any_dirty(&self) -> bool {
        self.table_dirty.load(Ordering::Acquire)
            || self
                .volumes
                .read()
                .values()
                .any(|v| v.map().dirty_nodes() > 0)
    }

    /// Background work: periodic commits (bounding what an unflushed crash loses), commits when
    /// many map nodes are dirty, and cleaning when free segments run low. One round of it is
    /// `maintenance_round`, which the deterministic simulator drives itself
    /// (`OpenOptions::stepped`, `pool/stepped.rs`).
    pub fn maintenance_loop(self: Arc<Self>) {
        let mut st = MaintenanceState::new();
        loop {
            self.store.wait_for_work(self.commit_interval);
            if self.store.is_closing() {
                return;
            }
            self.maintenance_round(&mut st);
        }
    }

    /// One round of the maintenance loop, after its wait.
    pub(crate) fn maintenance_round(&self, st: &mut MaintenanceState) {
        if self.store.is_poisoned() {
            return;
        }
        if let Some(t) = &self.tier {
            if !self.tier_round(t, st) {
                return;
            }
        }
        // Low on space, a commit also frees the segments emptied since the last one, even
        // when no map node is dirty (a full pool's writers wait for exactly that).
        if self.any_dirty() || (self.low_on_space() && !self.store.zero_sealed().is_empty()) {
            if let Err(e) = self.commit() {
                tracing::error!("background commit failed: {e}");
                // Writers paced by the local cache wait for no room (the store took
                // nothing): they go on locally until a commit succeeds.
                self.store.cache_pass_done(true);
                return;
            }
        }
        // The local cache of the object store: segments read often brought back, and
        // room given back once past its size.
        if let Err(e) = self.bring_back() {
            tracing::warn!("local cache: bringing back segments failed: {e}");
        }
        let evicted = self.evict();
        if let Err(e) = &evicted {
            tracing::warn!("local cache: giving back room failed: {e}");
        }
        // Writers paced by the cache wait only while a pass can give room back.
        let cannot = match evicted {
            Err(_) => true,
            Ok(done) => done.free + done.data == 0,
        };
        self.store.cache_pass_done(cannot);
        if self.low_on_space() && self.accounting_complete {
            let wanted = self.store.take_space_wanted();
            if self.store.clean_unstuck_if_freed() {
                // Stuck: no pass until something frees space; writers that find no
                // room are answered at once meanwhile.
                self.store.note_clean_round();
                return;
            }
            let before = SpaceMark::of(&self.store);
            match self.clean() {
                Ok(0) => {}
                Ok(n) => {
                    tracing::debug!(records = n, "cleaned");
                    // Writers wait for space (asked before the pass or during it):
                    // free the victims this pass emptied now, before the object
                    // store's checks and collection at the top of the loop. Otherwise
                    // the next round's commit (above) frees them: one commit per pass,
                    // not one after it and another before the next. Under sustained
                    // overwrite the cleaner runs pass after pass, and each commit
                    // writes every leaf dirtied since the last.
                    if wanted || self.store.space_wanted() {
                        if let Err(e) = self.commit() {
                            tracing::error!("commit after cleaning failed: {e}");
                        }
                        // Writers wait: the pass and its commit must gain them room.
                        let after = SpaceMark::of(&self.store);
                        st.gains.note(&self.store, &before, &after);
                    }
                    // More may be needed: go round again at once.
                    self.store.wake_maintenance();
                }
                Err(e) => tracing::error!("cleaning failed: {e}"),
            }
            self.store.note_clean_round();
        }
        // Idle: blocks scattered by random overwrites rewritten in block order.
        self.defrag_round(&mut st.defrag);
    }
}

impl Core {
    /// The object tier's part of a maintenance round; false when the pool stopped
    /// (poisoned: fenced, or a deferred takeover refused).
    fn tier_round(&self, t: &super::tier::Tier, st: &mut MaintenanceState) -> bool {
        // Not taken at import (the store did not answer): try again, and once it
        // answers, a commit catches it up.
        if let Err(e) = t.attach_late(&self.store, false) {
            tracing::error!("{e}");
            self.store.poison_for(&e);
            return false;
        }
        if t.take_catch_up() {
            self.table_dirty.store(true, Ordering::Release);
        }
        // Stepped, the clock-driven check and collection are the caller's steps
        // (`Pool::tier_step`): nothing a stepped round does depends on the clock.
        if self.store.stepped() {
            return true;
        }
        let ops = self.store.client_ops();
        let check = ops != st.tier_checked.1
            && crate::env::since(st.tier_checked.0) >= crate::constants::TIER_CHECK_INTERVAL;
        if check {
            st.tier_checked = (crate::env::now(), ops);
        }
        let collect = t.collect_due(crate::constants::TIER_COLLECT_INTERVAL);
        self.tier_upkeep(t, check, collect)
    }

    /// The fencing check (`check`) and a garbage collection (`collect`); false when
    /// another writer took the pool (then poisoned).
    pub(crate) fn tier_upkeep(&self, t: &super::tier::Tier, check: bool, collect: bool) -> bool {
        if check {
            match t.check() {
                Err(e @ Error::Fenced(_)) => {
                    tracing::error!("{e}");
                    self.store.poison_for(&e);
                    return false;
                }
                Err(e) => tracing::warn!("object store check failed: {e}"),
                Ok(()) => {}
            }
        }
        if collect {
            if let Err(e) = t.collect() {
                tracing::warn!("object store garbage collection failed: {e}");
            }
        }
        true
    }
}

/// What the maintenance loop carries from one round to the next.
pub(crate) struct MaintenanceState {
    /// The object store's fencing check: when clients came since the last one, and at
    /// most every `TIER_CHECK_INTERVAL` (an idle pool asks the store nothing).
    tier_checked: (std::time::Instant, u64),
    gains: CleanGains,
    defrag: DefragCursor,
}

/// Where the defragmenter (`defrag.rs`) is, kept with the maintenance rounds' state.
pub(crate) struct DefragCursor {
    /// Client operations counted at the last look, and since when that count held.
    pub(super) ops: u64,
    pub(super) quiet_since: std::time::Instant,
    /// The volume (name) and block the pass goes on from.
    pub(super) at: Option<(String, u64)>,
    /// Client data written (bytes) when the last whole pass ended: none again until it grows.
    pub(super) done_at: Option<u64>,
}

impl DefragCursor {
    pub(crate) fn new() -> DefragCursor {
        DefragCursor {
            ops: 0,
            quiet_since: crate::env::now(),
            at: None,
            done_at: None,
        }
    }
}

/// The defragmenter's switch (`OpenOptions::defrag`) and what it did since start.
#[derive(Default)]
pub(crate) struct DefragStats {
    pub(super) on: bool,
    /// Bytes the cleaner's stream wrote for it (as `Written::clean` counts them), and
    /// whole passes over every volume done.
    pub(super) moved: AtomicU64,
    pub(super) passes: AtomicU64,
}

impl MaintenanceState {
    pub(crate) fn new() -> MaintenanceState {
        MaintenanceState {
            tier_checked: (crate::env::now(), 0),
            gains: CleanGains::default(),
            defrag: DefragCursor::new(),
        }
    }
}

impl Core {
    fn member_index(&self, path: &std::path::Path) -> Result<usize> {
        let canon = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        self.store
            .members()
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
        if let Some(dev) = self.log_device_fault_layer(path) {
            tracing::warn!(device = %path.display(), ?faults, "fault injection set (log device)");
            dev.set(faults);
            return Ok(());
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
        let mut out: Vec<_> = self
            .store
            .members()
            .iter()
            .zip(self.faults.read().iter())
            .map(|(m, f)| (m.path(), f.as_ref().map(|f| f.faults()).unwrap_or_default()))
            .collect();
        if let Some(l) = self.logdev.read().as_ref() {
            out.extend(l.devices.iter().map(|d| {
                (
                    d.path.clone(),
                    d.dev.as_ref().map(|f| f.faults()).unwrap_or_default(),
                )
            }));
        }
        out
    }

    /// The fault layer of the log device at `path`, if it is one (and present).
    fn log_device_fault_layer(&self, path: &std::path::Path) -> Option<Arc<FaultyDevice>> {
        let canon = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        let l = self.logdev.read().clone()?;
        let d = l
            .devices
            .iter()
            .find(|d| d.path == path || std::fs::canonicalize(&d.path).is_ok_and(|p| p == canon))?;
        d.dev.clone()
    }
}

impl Core {
    fn check_redundant(&self, verb: &str) -> Result<()> {
        if self.store.layout() == crate::redundancy::Layout::Single {
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
        let m = &self.store.members()[i];
        if m.offline.load(Ordering::Acquire) {
            return Err(Error::Invalid(format!(
                "device {} is already offline",
                path.display()
            )));
        }
        let others = self
            .store
            .members()
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
        // Single layouts are refused above (`check_redundant`).
        let needed = self.store.layout().members_needed(1);
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
        let mut conf = super::format::config::PoolConfig::read(&self.dir)?;
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
        let m = &self.store.members()[i];
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
        *m.fault.lock() = None;
        tracing::info!(device = %path.display(), "device online: resilvering");
        self.scrub_begin(
            super::format::health::ScanKind::Resilver,
            Some(m.path()),
            false,
        )
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
        let label = super::format::labels::label_of(
            &dev,
            back_region,
            super::format::superblock::Check::Key(&self.sb_key),
        )
        .ok_or_else(|| {
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
        self.store.members()[i].replace(path.to_path_buf(), faulty.clone());
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
        if let Some(sb) = super::format::labels::front_label(&dev) {
            let ours = {
                let s = self.sb.lock();
                sb.pool_id == s.sb.pool_id && sb.device_id == s.sb.member_ids[i]
            };
            let m = &self.store.members()[i];
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
            let m = &self.store.members()[i];
            m.resilvering.store(true, Ordering::Release);
            m.offline.store(false, Ordering::Release);
            m.replace(new_abs.clone(), faulty.clone());
            self.faults.write()[i] = Some(faulty);
            self.sb.lock().sb.member_ids[i] = wrap::random_bytes::<16>();
        }
        let mut conf = super::format::config::PoolConfig::read(&self.dir)?;
        conf.devices = self
            .store
            .members()
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
        self.scrub_begin(
            super::format::health::ScanKind::Resilver,
            Some(new_abs),
            false,
        )
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

/// A snapshot a destroyed volume keeps for its clones.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct KeptSnapshot {
    /// `VOL@SNAP`.
    pub snapshot: String,
    pub referenced_bytes: u64,
    pub clones: Vec<String>,
}

/// The control plane's side of the data plane's requests (`store::Control`).
impl Control for Core {
    fn commit(&self) -> Result<()> {
        Core::commit(self)
    }
    fn flush(&self) -> Result<()> {
        Core::flush(self)
    }
    fn record_error(&self, volume: &str, offset: u64, length: u64) {
        Core::record_error(
            self,
            volume,
            offset,
            length,
            super::format::health::DataErrorKind::Data,
        )
    }
    fn clear_rewritten(&self, volume: &str, offset: u64, length: u64) {
        Core::clear_rewritten(self, volume, offset, length)
    }
}

/// Free space as a cleaning pass changes it: segments free or emptied (the next commit
/// frees those), and the bytes each stream has placed.
struct SpaceMark {
    free_or_empty: i64,
    written: crate::log::Written,
}

impl SpaceMark {
    fn of(store: &crate::store::Store) -> SpaceMark {
        SpaceMark {
            free_or_empty: (store.free_segments() as usize + store.zero_sealed().len()) as i64,
            written: store.written(),
        }
    }
}

/// What the cleaner's passes gained while writers waited: when the last
/// `CLEAN_FUTILE_PASSES` of them gained nothing together, cleaning stops and says so
/// (`Store::set_clean_stuck`) instead of running forever near full (issue 36).
#[derive(Default)]
struct CleanGains {
    /// What the last passes made while writers waited gained, newest last (at most
    /// `CLEAN_FUTILE_PASSES`): cleaning is stuck when they gained nothing together (one
    /// pass may gain nothing and the next two segments: its victims are freed a commit
    /// later).
    recent: std::collections::VecDeque<i64>,
}

impl CleanGains {
    fn note(&mut self, store: &crate::store::Store, before: &SpaceMark, after: &SpaceMark) {
        let moved = after.written.clean.saturating_sub(before.written.clean);
        let meta = after.written.meta.saturating_sub(before.written.meta);
        // Segments gained, with what client writes took meanwhile given back: room a
        // writer used is room the pass made.
        // In bytes: writers that got a little room each pass are progress too.
        let data = after.written.data.saturating_sub(before.written.data);
        let gained = (after.free_or_empty - before.free_or_empty)
            * crate::constants::SEGMENT_BYTES as i64
            + data as i64;
        tracing::debug!(
            gained,
            moved,
            meta,
            cost = store.clean_cost(),
            "cleaning pass while writers wait"
        );
        let window = crate::constants::CLEAN_FUTILE_PASSES as usize;
        self.recent.push_back(gained);
        if self.recent.len() > window {
            self.recent.pop_front();
        }
        if self.recent.len() == window && self.recent.iter().sum::<i64>() <= 0 {
            self.recent.clear();
            store.set_clean_stuck(format!(
                "cleaning is stuck: the last {} passes freed no more space than their moves \
                 and rewritten map nodes used ({:.1} bytes of map nodes per byte moved); \
                 writes that need new space get ENOSPC until space is freed (destroy \
                 snapshots or volumes, or trim)",
                crate::constants::CLEAN_FUTILE_PASSES,
                store.clean_cost()
            ));
        }
    }
}
