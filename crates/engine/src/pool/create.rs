//! Pool creation (`pool create`): the directory (0700), the devices (files made at a
//! size, or files and disks given, claimed), the pool key, the first labels on every
//! device and log device, the anchor, and `pool.json` (`format::config`).
//!
//! `DIR/pool.json` says where to look for devices; the labels (superblocks) on
//! the devices are the truth about membership. A device that already carries
//! a bulwark label is refused: it may hold another pool's data.
//!
//! `preallocate` (`pool create --preallocate`) writes zeros into the holes of the device
//! and log device files after checking that the file system has room for them.

use std::fs;
use std::path::{Path, PathBuf};

use super::format::config::{file_identity, validate_pool_name, PoolConfig, CONFIG_FILE};
use super::format::labels::front_label;
use super::format::superblock::Superblock;
use super::options::DeviceSpec;
use crate::constants::*;
use crate::device::{Device, FileDevice};
use crate::keys::wrap;
use crate::map::Blkptr;
use crate::redundancy::Layout;
use crate::{Error, Result};

thread_local! {
    /// Engine tests make format 1 pools on their own thread (`create_format_1`), without
    /// the process-wide environment variable other tests would see.
    static FORMAT_1: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A format 1 pool, for tests of the upgrade.
#[cfg(test)]
pub(crate) fn create_format_1(
    dir: &Path,
    layout: Layout,
    spec: DeviceSpec,
    name: &str,
) -> Result<()> {
    FORMAT_1.with(|f| f.set(true));
    let r = create(dir, layout, spec, name);
    FORMAT_1.with(|f| f.set(false));
    r
}

/// Zeros written into every hole of the pool's device files and log device files
/// (`pool create --preallocate`, as qemu-img's `preallocation=full`), each file synced:
/// the blocks are then allocated in the host's file system, so a FLUSH syncs the records
/// it needs and no allocation of the host's (its journal), and a write never fails there
/// for want of space. Block devices and files without holes are left as they are. Only
/// for a pool no daemon serves (the device claims are taken, so a daemon refuses meanwhile,
/// and one serving refuses this). `progress(done, total)` follows the bytes written.
/// Returns the bytes written.
pub fn preallocate(dir: &Path, progress: &mut dyn FnMut(u64, u64)) -> Result<u64> {
    let conf = PoolConfig::read(dir)?;
    let mut work = Vec::new();
    for path in conf.resolve(dir).into_iter().chain(conf.resolve_log(dir)) {
        let mut dev = FileDevice::open(&path)?;
        dev.claim()?;
        let holes = dev.holes()?;
        let bytes: u64 = holes.iter().map(|(a, b)| b - a).sum();
        if bytes > 0 {
            // What the file system must still find: `fallocate`d ranges read as holes (they
            // still need their zeros) but hold their space already.
            use std::os::unix::fs::MetadataExt;
            let meta = fs::metadata(&path).map_err(|e| Error::device(&path, e))?;
            let new = meta.len().saturating_sub(meta.blocks().saturating_mul(512));
            work.push((path, dev, holes, bytes, new));
        }
    }
    // Room in each file system first (and a margin left for pool.json, the audit log and
    // the file system's own extent records): a fill that runs out of space half way helps
    // no one.
    const MARGIN: u64 = 64 << 20;
    let mut need: Vec<(u64, u64, PathBuf)> = Vec::new();
    for (path, _, _, _, new) in &work {
        let (fs_id, free) = fs_free(path)?;
        let free = free.saturating_sub(MARGIN);
        match need.iter_mut().find(|(id, _, _)| *id == fs_id) {
            Some(n) => n.1 += new,
            None => need.push((fs_id, *new, path.clone())),
        }
        let (_, wanted, _) = need
            .iter()
            .find(|(id, _, _)| *id == fs_id)
            .expect("just put");
        if *wanted > free {
            return Err(Error::Invalid(format!(
                "the device files need {} more on the file system holding {}, which has {} \
                 to spare (64M is kept free there; free some, make the devices smaller, or \
                 leave out --preallocate)",
                crate::size::format_size(*wanted),
                path.display(),
                crate::size::format_size(free)
            )));
        }
    }
    let total: u64 = work.iter().map(|w| w.3).sum();
    let mut done = 0;
    progress(0, total);
    for (_, dev, holes, _, _) in &work {
        dev.fill_holes(holes, &mut |n| {
            done += n;
            progress(done, total);
        })?;
    }
    Ok(total)
}

/// The file system holding `path` (its device number: `statvfs`'s `f_fsid` is zero on
/// some file systems) and the bytes an unprivileged user may still write there.
fn fs_free(path: &Path) -> Result<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::MetadataExt;
    let fs_id = fs::metadata(path)
        .map_err(|e| Error::device(path, e))?
        .dev();
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Error::Invalid(format!("{} holds a NUL byte", path.display())))?;
    // SAFETY: statvfs writes into the zeroed struct we pass; `c` is a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(Error::device(path, std::io::Error::last_os_error()));
    }
    Ok((
        fs_id,
        (st.f_bavail as u64).saturating_mul(st.f_frsize as u64),
    ))
}

pub fn create(dir: &Path, layout: Layout, spec: DeviceSpec, name: &str) -> Result<()> {
    create_with_log(dir, layout, spec, name, &[])
}

/// `create`, with separate intent log devices (`intentlog::devices`): existing files or
/// disks, one, or two for the log mirrored on both.
pub fn create_with_log(
    dir: &Path,
    layout: Layout,
    spec: DeviceSpec,
    name: &str,
    log_devices: &[PathBuf],
) -> Result<()> {
    create_full(dir, layout, spec, name, log_devices, None)
}

/// `create_with_log`, with the trust root (pool.key, pool.anchor) put in `key_dir`
/// instead of the pool directory (`pool create --key-dir`); the directory is made (0700)
/// when it does not exist, and recorded in pool.json as an absolute path.
pub fn create_full(
    dir: &Path,
    layout: Layout,
    spec: DeviceSpec,
    name: &str,
    log_devices: &[PathBuf],
    key_dir: Option<&Path>,
) -> Result<()> {
    validate_pool_name(name)?;
    if log_devices.len() > super::format::superblock::LOG_DEVICES_MAX {
        return Err(Error::Invalid(format!(
            "{} log devices given; a pool has at most {} (the log mirrored on both)",
            log_devices.len(),
            super::format::superblock::LOG_DEVICES_MAX
        )));
    }
    let made_dir = !dir.exists();
    fs::create_dir_all(dir).map_err(|e| Error::device(dir, e))?;
    if dir.join(CONFIG_FILE).exists() {
        return Err(Error::Exists(format!(
            "{} already holds a bulwark pool",
            dir.display()
        )));
    }
    // The pool directory holds the grants, the audit log and the sockets:
    // only its owner may list or enter it.
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(|e| Error::device(dir, e))?;
    }
    // The trust root's directory: made 0700 when missing, named by an absolute path.
    let mut made_key_dir = false;
    let key_dir: Option<PathBuf> = match key_dir {
        None => None,
        Some(k) => {
            if !k.exists() {
                use std::os::unix::fs::DirBuilderExt;
                fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(k)
                    .map_err(|e| Error::device(k, e))?;
                made_key_dir = true;
            } else if !k.is_dir() {
                return Err(Error::Invalid(format!(
                    "--key-dir {} is not a directory",
                    k.display()
                )));
            }
            Some(fs::canonicalize(k).map_err(|e| Error::device(k, e))?)
        }
    };
    let root = key_dir.clone().unwrap_or_else(|| dir.to_path_buf());
    let result = create_in(dir, layout, spec, name, log_devices, &root, key_dir.clone());
    if result.is_err() && made_key_dir {
        if let Some(k) = &key_dir {
            let _ = fs::remove_dir(k);
        }
    }
    if result.is_err() && made_dir {
        // Nothing of a failed create stays behind: a retry starts clean.
        let _ = fs::remove_dir(dir);
    }
    result
}

fn create_in(
    dir: &Path,
    layout: Layout,
    spec: DeviceSpec,
    name: &str,
    log_paths: &[PathBuf],
    root: &Path,
    key_dir: Option<PathBuf>,
) -> Result<()> {
    let count = match &spec {
        DeviceSpec::Files { count, .. } => *count,
        DeviceSpec::Paths(p) => p.len(),
    };
    match layout {
        Layout::Single if (1..=DEVICES_MAX).contains(&count) => {}
        Layout::Single => {
            return Err(Error::Invalid(format!(
                "layout single needs 1 to {DEVICES_MAX} devices, got {count}"
            )))
        }
        Layout::Mirror(n) if count == n as usize => {}
        Layout::Mirror(n) => {
            return Err(Error::Invalid(format!(
                "layout mirror:{n} needs exactly {n} devices, got {count}"
            )))
        }
        Layout::Parity { k, m } if count == (k + m) as usize => {}
        Layout::Parity { k, m } => {
            return Err(Error::Invalid(format!(
                "layout parity:{k}+{m} needs exactly {} devices, got {count}",
                k + m
            )))
        }
    }
    let mut created: Vec<PathBuf> = Vec::new();
    let result = (|| {
        let mut devices: Vec<(PathBuf, FileDevice)> = Vec::new();
        match &spec {
            DeviceSpec::Files { count, size_bytes } => {
                if *size_bytes > i64::MAX as u64 {
                    return Err(Error::Invalid(format!(
                        "device size {} is larger than a file can be",
                        crate::size::format_size(*size_bytes)
                    )));
                }
                if *size_bytes < DEVICE_BYTES_MIN {
                    return Err(Error::Invalid(format!(
                        "device size {} is too small: the minimum is {}",
                        crate::size::format_size(*size_bytes),
                        crate::size::format_size(DEVICE_BYTES_MIN)
                    )));
                }
                for i in 0..*count {
                    let name = PathBuf::from(format!("dev{i}.img"));
                    let path = dir.join(&name);
                    if path.exists() {
                        return Err(Error::Exists(format!("{} already exists", path.display())));
                    }
                    let mut d = FileDevice::create_sparse(&path, *size_bytes)?;
                    created.push(path);
                    d.claim()?;
                    devices.push((name, d));
                }
            }
            DeviceSpec::Paths(paths) => {
                // The same file or disk named twice (by two paths, a symlink, a hard
                // link) would hold both copies of a mirror: one device, no redundancy.
                let mut seen: Vec<((u64, u64), &Path)> = Vec::new();
                for p in paths {
                    if !p.exists() {
                        return Err(Error::NotFound(format!("device {} does not exist (create the file first, or use --devices N --device-size SIZE)", p.display())));
                    }
                    let id = file_identity(p)?;
                    if let Some((_, first)) = seen.iter().find(|(i, _)| *i == id) {
                        return Err(Error::Invalid(format!(
                            "device {} is given twice (also as {}): each device of a pool must be a different file or disk",
                            p.display(),
                            first.display()
                        )));
                    }
                    seen.push((id, p));
                    let abs = fs::canonicalize(p).map_err(|e| Error::device(p, e))?;
                    let mut d = FileDevice::open(&abs)?;
                    d.claim()?;
                    if d.size() < DEVICE_BYTES_MIN {
                        return Err(Error::Invalid(format!(
                            "device {} is too small ({}); the minimum is {}",
                            p.display(),
                            crate::size::format_size(d.size()),
                            crate::size::format_size(DEVICE_BYTES_MIN)
                        )));
                    }
                    if let Some(sb) = front_label(&d) {
                        return Err(Error::Exists(format!(
                            "device {} already belongs to bulwark pool {}; wipe its first MiB to reuse it",
                            p.display(),
                            crate::hex::to_hex(&sb.pool_id)
                        )));
                    }
                    let stored = abs
                        .strip_prefix(dir)
                        .map(Path::to_path_buf)
                        .unwrap_or(abs.clone());
                    devices.push((stored, d));
                }
            }
        }
        // Log devices: existing, unlabelled, none the same file or disk as another device.
        let mut logs: Vec<(PathBuf, FileDevice)> = Vec::new();
        let mut seen: Vec<(u64, u64)> = Vec::new();
        for (_, d) in &devices {
            seen.push(file_identity(d.path())?);
        }
        for p in log_paths {
            let d = super::intentlog::devices::open_new(p, &|_| false)?;
            let id = file_identity(d.path())?;
            if seen.contains(&id) {
                return Err(Error::Invalid(format!(
                    "log device {} is given twice, or is also a device of the pool: each must be a different file or disk",
                    p.display()
                )));
            }
            seen.push(id);
            let stored = d
                .path()
                .strip_prefix(dir)
                .map(Path::to_path_buf)
                .unwrap_or(d.path().to_path_buf());
            logs.push((stored, d));
        }
        let log_ids: Vec<[u8; 16]> = logs.iter().map(|_| wrap::random_bytes::<16>()).collect();
        let min = devices
            .iter()
            .map(|(_, d)| d.size())
            .min()
            .expect("at least one device");
        let device_bytes = min / SEGMENT_BYTES * SEGMENT_BYTES;
        let segments_per_device =
            (device_bytes - DEVICE_RESERVED_FRONT - DEVICE_RESERVED_BACK) / SEGMENT_BYTES;
        if segments_per_device < 2 * SEGMENTS_RESERVED as u64 {
            return Err(Error::Invalid(
                "devices are too small to hold a pool".into(),
            ));
        }
        let back_region = DEVICE_RESERVED_FRONT + segments_per_device * SEGMENT_BYTES;
        let pool_id = wrap::random_bytes::<16>();
        // Format 2 (decision 0011): the labels carry a MAC under the pool key, which lives
        // on the host. Format 1 only for tests of `bulwark pool upgrade`.
        let format = if FORMAT_1.with(|f| f.get())
            || std::env::var("BULWARK_CREATE_FORMAT").as_deref() == Ok("1")
        {
            tracing::warn!(
                "creating a FORMAT 1 pool (BULWARK_CREATE_FORMAT=1, for tests of 'bulwark pool \
                 upgrade'): its labels and metadata are not authenticated and this bulwark \
                 will not serve it until it is upgraded"
            );
            super::format::superblock::VERSION_1
        } else {
            super::format::superblock::VERSION
        };
        let sb_key = if format == super::format::superblock::VERSION {
            let key_path = root.join(super::format::config::POOL_KEY_FILE);
            let key = crate::keys::pool_key::PoolKey::create(&key_path)?;
            created.push(key_path);
            Some(key.superblock_key(&pool_id))
        } else {
            None
        };
        let table_key = wrap::random_bytes::<32>();
        let member_ids: Vec<[u8; 16]> =
            devices.iter().map(|_| wrap::random_bytes::<16>()).collect();
        let zero = vec![0u8; SUPERBLOCK_BYTES];
        let mut first: Option<Superblock> = None;
        for (i, (_, d)) in devices.iter().enumerate() {
            let sb = Superblock {
                format,
                chain_id: [0; 16],
                layout,
                pool_id,
                device_id: member_ids[i],
                member_index: i as u32,
                member_count: devices.len() as u32,
                generation: 1,
                device_bytes,
                segments_per_device,
                nonce_reserved: 0,
                high_water: 0,
                root: Blkptr::HOLE,
                member_ids: member_ids.clone(),
                table_key,
                log_head: None,
                log_devices: log_ids.clone(),
                log_dev_head: None,
                name: name.to_string(),
                exported: false,
            };
            for off in Superblock::all_slot_offsets(back_region) {
                d.write_at(&zero, off)
                    .map_err(|e| Error::device(d.path(), e))?;
            }
            for off in Superblock::slot_offsets(1, back_region) {
                d.write_at(&sb.encode(sb_key.as_ref()), off)
                    .map_err(|e| Error::device(d.path(), e))?;
            }
            d.flush().map_err(|e| Error::device(d.path(), e))?;
            first.get_or_insert(sb);
        }
        // One ring size on every log device: the smallest one's.
        let log_slots = logs
            .iter()
            .map(|(_, d)| super::intentlog::devices::slots_of(d.size()))
            .min()
            .unwrap_or(0);
        for ((_, d), id) in logs.iter().zip(&log_ids) {
            super::intentlog::devices::write_label(
                d,
                &super::intentlog::devices::Label {
                    pool_id,
                    device_id: *id,
                    role: super::intentlog::devices::ROLE_INTENT_LOG,
                    slots: log_slots,
                },
            )?;
        }
        // The host's record of the generation the devices are at (`anchor`).
        if let Some(sb) = first {
            super::format::anchor::write_first_in(
                root,
                &super::format::anchor::Anchor {
                    seq: 1,
                    pool_id,
                    committed: (sb.generation, super::format::anchor::digest(&sb)),
                    next: (0, [0; 32]),
                    nonce_reserved: sb.nonce_reserved,
                },
            )?;
        }
        PoolConfig {
            format: 1,
            pool_id: crate::hex::to_hex(&pool_id),
            layout: layout.to_string(),
            devices: devices.iter().map(|(p, _)| p.clone()).collect(),
            offline: Vec::new(),
            name: Some(name.to_string()),
            exported: false,
            cache_device: None,
            created: match &spec {
                DeviceSpec::Files { .. } => devices.iter().map(|(p, _)| p.clone()).collect(),
                DeviceSpec::Paths(_) => Vec::new(),
            },
            log_devices: logs.iter().map(|(p, _)| p.clone()).collect(),
            object_store: None,
            key_dir,
        }
        .write(dir)
    })();
    if result.is_err() {
        for p in created {
            let _ = fs::remove_file(p);
        }
    }
    result
}

/// Name `cache` as the pool's cache device in `DIR/pool.json` (`None`: no cache device).
/// The device must be able to serve as one (`CacheDevice::check`) and must not be one of
/// the pool's members. The next `serve` uses it.
pub fn set_cache_device(dir: &Path, cache: Option<&Path>) -> Result<()> {
    let mut conf = PoolConfig::read(dir)?;
    if let Some(c) = cache {
        let id = file_identity(c)?;
        for m in conf.resolve(dir) {
            if file_identity(&m).ok() == Some(id) {
                return Err(Error::Invalid(format!(
                    "{} is a member of this pool: a cache device must be a device of its own",
                    c.display()
                )));
            }
        }
        crate::cachedev::CacheDevice::check(c)?;
    }
    conf.cache_device = cache.map(Path::to_path_buf);
    conf.write(dir)
}
