//! `Pool`: what the daemon holds. Each method is one user-visible operation, handed to
//! `Core` (the state every volume handle shares) in the room that does it; opening a pool
//! imports it and starts the maintenance thread.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

use super::core::{self, Core};
use super::options::{DeviceSpec, OpenOptions};
use super::status::{PoolStatus, SnapshotStatus, VolumeSpace, VolumeStatus};
use super::{create, format, import, keys, props, scrub, snapshot};
use crate::keys::Secret;
use crate::redundancy::Layout;
use crate::volume::{Volume, VolumeOptions};
use crate::{Error, Result};

pub struct Pool {
    core: Arc<Core>,
    maintenance: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// What `maintenance_step` carries between rounds in stepped mode (`stepped.rs`).
    steps: Mutex<super::core::MaintenanceState>,
    /// Holds the exclusive lock on `DIR/pool.lock` for the life of the pool.
    _lock: File,
}

impl Pool {
    /// The state every volume handle shares, for the rooms that act on it.
    pub(crate) fn core(&self) -> &Arc<Core> {
        &self.core
    }

    /// Stop the maintenance thread and every background pass (at close, export, drop).
    pub(crate) fn stop_maintenance(&self) {
        self.core.stop_background(self.maintenance.lock().take());
    }

    /// Whether `dir` holds a pool's config (`DIR/pool.json`): the error says what
    /// is there instead (nothing, a pool that lost its pool.json, a corrupt one).
    pub fn check_dir(dir: &Path) -> Result<()> {
        format::config::PoolConfig::read(dir).map(|_| ())
    }

    /// Create a new pool in `dir` (created if missing; must not already hold a pool), named
    /// after the directory (`format::config::default_pool_name`).
    pub fn create(dir: &Path, layout: Layout, devices: DeviceSpec) -> Result<()> {
        create::create(
            dir,
            layout,
            devices,
            &format::config::default_pool_name(dir),
        )
    }

    /// `create` with the pool's name given (`pool create --name`).
    pub fn create_named(dir: &Path, layout: Layout, devices: DeviceSpec, name: &str) -> Result<()> {
        create::create(dir, layout, devices, name)
    }

    /// `create_named` with separate intent log devices (`pool create --log-device`, one,
    /// or two for the log mirrored on both).
    pub fn create_with_log(
        dir: &Path,
        layout: Layout,
        devices: DeviceSpec,
        name: &str,
        log_devices: &[PathBuf],
    ) -> Result<()> {
        create::create_with_log(dir, layout, devices, name, log_devices)
    }

    /// `create_with_log`, with pool.key and pool.anchor in `key_dir` (`pool create
    /// --key-dir`) rather than in `dir`.
    pub fn create_full(
        dir: &Path,
        layout: Layout,
        devices: DeviceSpec,
        name: &str,
        log_devices: &[PathBuf],
        key_dir: Option<&Path>,
    ) -> Result<()> {
        create::create_full(dir, layout, devices, name, log_devices, key_dir)
    }

    /// Import the pool in `dir`, taking its exclusive lock for the life of the `Pool`.
    pub fn open(dir: &Path, opts: OpenOptions) -> Result<Arc<Pool>> {
        let lock = import::lock_pool(dir)?;
        let core = Arc::new(import::import(dir, &opts)?);
        let pool = Arc::new(Pool {
            core: core.clone(),
            maintenance: Mutex::new(None),
            steps: Mutex::new(super::core::MaintenanceState::new()),
            _lock: lock,
        });
        if opts.stepped {
            // A writer short of space runs the round it would wait for (`Store::wait_until`).
            // A round never waits for space itself; were one to, it runs no second round
            // inside the first.
            let weak = Arc::downgrade(&pool);
            core.store.set_stepped(Box::new(move || {
                if let Some(pool) = weak.upgrade() {
                    if let Some(mut steps) = pool.steps.try_lock() {
                        pool.core.maintenance_round(&mut steps);
                    }
                }
            }));
        } else {
            let handle = std::thread::Builder::new()
                .name("bulwark-maintenance".into())
                .spawn(move || core.maintenance_loop())
                .map_err(Error::Io)?;
            *pool.maintenance.lock() = Some(handle);
        }
        {
            // A resilver interrupted by a restart: its device's copies are still known stale.
            let s = pool.core.scrub.lock();
            if s.state == scrub::ScrubPhase::Scanning && s.kind == scrub::ScanKind::Resilver {
                if let Some(dev) = &s.device {
                    for m in pool.core.store.members() {
                        if &m.path() == dev {
                            m.resilvering
                                .store(true, std::sync::atomic::Ordering::Release);
                        }
                    }
                }
            }
        }
        if pool.core.scrub.lock().state == scrub::ScrubPhase::Scanning {
            tracing::info!("resuming the scrub that was running when the pool was last closed");
            pool.core.spawn_scrub();
        }
        Ok(pool)
    }

    pub fn create_volume(
        &self,
        name: &str,
        opts: VolumeOptions,
        secret: Option<&Secret>,
    ) -> Result<()> {
        self.core.create_volume(name, opts, secret, false)
    }

    /// `create_volume`, with `thick` to reserve the volume's whole size in the pool
    /// (refused when the pool cannot hold it).
    pub fn create_volume_provisioned(
        &self,
        name: &str,
        opts: VolumeOptions,
        secret: Option<&Secret>,
        thick: bool,
    ) -> Result<()> {
        self.core.create_volume(name, opts, secret, thick)
    }

    /// Grow volume `name` to `size` bytes, or with `shrink` make it smaller (only over
    /// holes, with no handle open). See `Core::volume_resize`.
    pub fn volume_resize(&self, name: &str, size: u64, shrink: bool) -> Result<props::Resized> {
        self.core.volume_resize(name, size, shrink)
    }

    /// Everything `volume get` shows of volume `name`.
    pub fn volume_props(&self, name: &str) -> Result<props::VolumeProps> {
        self.core.volume_props(name)
    }

    /// Set one property of volume `name` (`props::SETTABLE`), durably.
    pub fn volume_set(&self, name: &str, property: &str, value: &str) -> Result<()> {
        self.core.volume_set(name, property, value)
    }

    /// Destroy a volume and free its space.
    pub fn destroy_volume(&self, name: &str) -> Result<()> {
        self.core.destroy_volume(name, false).map(|_| ())
    }

    /// Destroy a volume; with `recursive`, its snapshots with it. Returns the snapshots
    /// kept (hidden) for their clones.
    pub fn destroy_volume_recursive(
        &self,
        name: &str,
        recursive: bool,
    ) -> Result<Vec<core::KeptSnapshot>> {
        self.core.destroy_volume(name, recursive)
    }

    /// Snapshot `volume` as `volume@name` (one commit; no data copied).
    pub fn snapshot_create(&self, volume: &str, name: &str) -> Result<()> {
        self.core.snapshot_create(volume, name)
    }

    /// Destroy `volume@name`; returns the data bytes freed.
    pub fn snapshot_destroy(&self, volume: &str, name: &str) -> Result<u64> {
        self.core.snapshot_destroy(volume, name)
    }

    /// Hold (`hold`) or release `volume@name` under `tag`.
    pub fn snapshot_hold(&self, volume: &str, name: &str, tag: &str, hold: bool) -> Result<()> {
        self.core.snapshot_hold(volume, name, tag, hold)
    }

    /// Snapshots of `volume` (or all), oldest first per volume.
    pub fn snapshot_list(&self, volume: Option<&str>) -> Result<Vec<SnapshotStatus>> {
        self.core.snapshot_list(volume)
    }

    /// Snapshots per volume, by volume name, without walking any tree.
    pub fn snapshot_counts(&self) -> Vec<(String, usize)> {
        self.core.snapshot_counts()
    }

    /// Space of `volume` (or all) as used / referenced / by snapshots / written.
    pub fn volume_space(&self, volume: Option<&str>) -> Result<Vec<VolumeSpace>> {
        self.core.volume_space(volume)
    }

    /// Clone `volume@name` as `new` under its own key (`secret`; `None` for an
    /// unencrypted origin). See `Core::volume_clone`.
    pub fn volume_clone(
        &self,
        volume: &str,
        name: &str,
        new: &str,
        secret: Option<&Secret>,
    ) -> Result<()> {
        self.core.volume_clone(volume, name, new, secret)
    }

    /// Roll `volume` back to `volume@name`; returns the newer snapshots destroyed.
    pub fn volume_rollback(
        &self,
        volume: &str,
        name: &str,
        destroy_newer: bool,
    ) -> Result<Vec<String>> {
        self.core.volume_rollback(volume, name, destroy_newer)
    }

    pub fn volumes(&self) -> Vec<VolumeStatus> {
        self.core.volume_statuses()
    }

    /// Unlock an encrypted volume. A wrong secret gives `Error::WrongKey`.
    pub fn load_key(&self, name: &str, secret: &Secret) -> Result<()> {
        self.core.load_key(name, secret)
    }

    /// Lock an encrypted volume again.
    pub fn unload_key(&self, name: &str) -> Result<()> {
        self.core.unload_key(name)
    }

    /// An unlocked volume for I/O. `Error::NotFound` or `Error::Locked` otherwise.
    /// A handle on volume `name`, or a read-only one on snapshot `VOL@SNAP`.
    pub fn volume(&self, name: &str) -> Result<Arc<Volume>> {
        match snapshot::split_name(name) {
            Some((volume, snap)) => self.core.snapshot_handle(volume, snap),
            None => self.core.volume_handle(name),
        }
    }

    /// Names of volumes that may be exported now (unlocked).
    pub fn exportable(&self) -> Vec<String> {
        let open: Vec<String> = self
            .core
            .volume_statuses()
            .into_iter()
            .filter(|v| !v.locked)
            .map(|v| v.name)
            .collect();
        let mut out = open.clone();
        for name in &open {
            if let Ok(st) = self.core.find(name) {
                out.extend(st.snapshots().iter().map(|s| format!("{name}@{}", s.name)));
            }
        }
        out
    }

    /// Segments of data only the object store holds (given back by the local cache, or
    /// never downloaded), and the local bytes bringing them all back would take.
    pub fn given_back(&self) -> (usize, u64) {
        let n = self.core.store.evicted_live().len();
        (n, n as u64 * self.core.store.bytes_per_segment())
    }

    /// Bring back every segment only the object store holds (`pool object-store remove`).
    pub fn bring_back_all(&self) -> Result<usize> {
        self.core.bring_back_all()
    }

    pub fn status(&self) -> PoolStatus {
        self.core.status()
    }

    /// Map-node cache hits refused because the entry came from another place than the
    /// parent's pointer names (`map::NodeCache`): always 0 unless the engine has a bug;
    /// the simulator checks it after every operation.
    pub fn stale_cached_nodes(&self) -> u64 {
        self.core.store.nodes().stale_hits()
    }

    /// Arm injected faults on the device at `path` (an empty list clears them).
    /// Refused unless the pool was opened with `allow_fault_injection`.
    pub fn set_faults(&self, path: &Path, faults: Vec<crate::device::fault::Fault>) -> Result<()> {
        self.core.set_faults(path, faults)
    }

    pub fn list_faults(&self) -> Vec<(PathBuf, Vec<crate::device::fault::Fault>)> {
        self.core.list_faults()
    }

    /// Replace the pool's separate log devices by those at `paths` (none: the log goes
    /// back to the main devices). See `Core::set_log_devices`.
    pub fn set_log_devices(&self, paths: &[PathBuf]) -> Result<()> {
        self.core.set_log_devices(paths)
    }

    /// Stop using a device for maintenance (mirror layouts; never the last copy).
    pub fn device_offline(&self, path: &Path) -> Result<()> {
        self.core.device_offline(path)
    }
    /// Use an offline (or failed) device again; a resilver brings its copies up to date.
    pub fn device_online(&self, path: &Path) -> Result<()> {
        self.core.device_online(path)
    }
    /// Replace device `old` by the existing file or block device `new`; resilvers in the
    /// background (progress in `scrub_status`, kind "resilver").
    pub fn device_replace(&self, old: &Path, new: &Path) -> Result<()> {
        self.core.device_replace(old, new)
    }

    /// Key slots of an encrypted volume (nothing secret).
    pub fn key_list(&self, name: &str) -> Result<Vec<keys::SlotInfo>> {
        self.core.key_list(name)
    }
    /// Add a key slot for `secret` (the volume's key must be loaded). Returns the slot number.
    pub fn key_add(&self, name: &str, secret: &Secret) -> Result<usize> {
        self.core.key_add(name, secret)
    }
    /// Remove every slot `secret` opens (their numbers, ascending), so it no longer opens the
    /// volume; refused when no slot would be left.
    pub fn key_remove(&self, name: &str, secret: &Secret) -> Result<Vec<usize>> {
        self.core.key_remove(name, secret)
    }
    /// Change the secret of the slot `old` opens to `new`, without touching data; refused when
    /// `new` already opens another slot.
    pub fn key_change(&self, name: &str, old: &Secret, new: &Secret) -> Result<usize> {
        self.core.key_change(name, old, new)
    }
    /// Start a key rotation: new writes use a new data key at once; old blocks are
    /// re-encrypted in the background; the old key is destroyed when unused. A paused
    /// rotation (`Rotation::error`) is resumed instead; a running one is `Busy`.
    pub fn key_rotate(&self, name: &str) -> Result<u16> {
        self.core.key_rotate(name)
    }
    /// Crypto-erase: destroy every wrapped copy of the volume's keys.
    pub fn key_erase(&self, name: &str) -> Result<()> {
        self.core.key_erase(name)
    }

    /// Start a scrub, or resume a paused one.
    pub fn scrub_start(&self) -> Result<()> {
        self.core.scrub_start()
    }

    /// `scrub_start`, checking the object store's copies of local records too
    /// (`scrub start --verify-store`).
    pub fn scrub_start_with(&self, verify_store: bool) -> Result<()> {
        self.core.scrub_start_with(verify_store)
    }
    pub fn scrub_pause(&self) -> Result<()> {
        self.core.scrub_pause()
    }
    pub fn scrub_cancel(&self) -> Result<()> {
        self.core.scrub_cancel()
    }
    pub fn scrub_status(&self) -> scrub::ScrubStatus {
        self.core.scrub_status()
    }

    /// Stepped pools only (`OpenOptions::stepped`, `stepped.rs`): one round of background
    /// maintenance (commit when dirty or low on space, the object tier's work, cleaning
    /// when low on space, defragmenting when idle). Refused when a maintenance thread runs.
    pub fn maintenance_step(&self) -> Result<()> {
        self.core.maintenance_step(&mut self.steps.lock())
    }

    /// Stepped pools only: the object tier's fencing check and a collection (by the
    /// clock in a serving pool). Ok(false) when another writer took the pool (it is
    /// poisoned then).
    pub fn tier_step(&self) -> Result<bool> {
        self.core.tier_step()
    }

    /// Stepped pools only: run a started (or resumed) scrub to its end on this thread;
    /// nothing when none is scanning.
    pub fn scrub_step(&self) -> Result<()> {
        self.core.scrub_step()
    }

    /// Stepped pools only: one batch of every key rotation under way (a rotation starts
    /// no worker in stepped mode); how many rotations ran a batch.
    pub fn rotation_step(&self) -> Result<usize> {
        self.core.rotation_step()
    }

    /// Make every write completed so far durable through one commit (a client's flush,
    /// `Volume::flush`, takes the intent log instead when it is on).
    pub fn flush(&self) -> Result<()> {
        self.core.commit()
    }

    /// Final commit; stops background work. The pool is unusable afterwards.
    /// `Some((devices, host))` when this import took devices at generation `devices`, older
    /// than generation `host` this host had committed (`OpenOptions::accept_rollback`).
    pub fn rollback_accepted(&self) -> Option<(u64, u64)> {
        self.core.rollback_accepted
    }

    /// What the import found lost from the intent log and took anyway (`accept_log_loss`).
    pub fn log_loss_accepted(&self) -> Option<String> {
        self.core.log_loss.clone()
    }

    pub fn close(&self) -> Result<()> {
        self.core.stop_background(self.maintenance.lock().take());
        self.core.commit()?;
        self.core.settle_anchor()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.stop_maintenance();
    }
}

/// For unit tests: a plain volume of `size_bytes` in 4 KiB blocks, uncompressed.
#[cfg(test)]
pub(crate) fn test_volume(size_bytes: u64) -> crate::volume::VolumeOptions {
    crate::volume::VolumeOptions {
        size_bytes,
        block_size: 4096,
        compression: crate::volume::Compression::Off,
        encryption: false,
    }
}

/// For unit tests: a `single` pool on one 64 MiB device file in `dir`, opened with `opts`.
#[cfg(test)]
pub(crate) fn test_pool(dir: &Path, opts: OpenOptions) -> Arc<Pool> {
    Pool::create(
        dir,
        Layout::Single,
        DeviceSpec::Files {
            count: 1,
            size_bytes: 64 << 20,
        },
    )
    .unwrap();
    Pool::open(dir, opts).unwrap()
}
