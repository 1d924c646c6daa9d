//! Pool creation: devices, labels, and the pool's config file.
//!
//! `DIR/pool.json` says where to look for devices; the labels (superblocks) on
//! the devices are the truth about membership. A device that already carries
//! a bulwark label is refused: it may hold another pool's data.

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::superblock::{Check, Superblock};
use super::{DeviceSpec, Layout};
use crate::constants::*;
use crate::device::{Device, FileDevice};
use crate::keys::wrap;
use crate::map::Blkptr;
use crate::{Error, Result};

pub const CONFIG_FILE: &str = "pool.json";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PoolConfig {
    pub format: u32,
    pub pool_id: String,
    pub layout: String,
    /// Device paths; relative paths are inside the pool directory.
    pub devices: Vec<PathBuf>,
    /// Members taken offline by `bulwark device offline` (their device ids, hex, as in
    /// the labels): they stay offline across restarts until `bulwark device online`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub offline: Vec<String>,
    /// The pool's name (`pool create --name`, also in the labels); absent for pools made
    /// before names, which go by their directory's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `bulwark pool export` ran: the devices are marked exported and no daemon may serve
    /// this directory until `bulwark pool import` takes the pool back.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exported: bool,
    /// Device files `pool create` made (`--devices N --device-size SIZE`), which
    /// `pool destroy` removes; files and disks given with `--device` are never removed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub created: Vec<PathBuf>,
    /// The cache device (`pool create --cache-device`, `pool cache add`); relative paths
    /// are inside the pool directory. Not a member: it holds only copies of records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_device: Option<PathBuf>,
    /// Separate intent log devices (`pool create --log-device`, `bulwark pool log`); the
    /// superblock names which of them the pool uses (their labels' ids).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub log_devices: Vec<PathBuf>,
    /// The pool's object store (`pool create --object-store`, `pool import
    /// --object-store`; issue 22): the durable copy of the pool, written by every commit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object_store: Option<ObjectStoreConfig>,
    /// Where pool.key and pool.anchor live (`pool create --key-dir`, issue 41): a
    /// directory off the devices' file system, so that a copy of the devices does not
    /// carry the trust root. Absent: the pool directory (pools made before it, and pools
    /// made without the flag).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_dir: Option<PathBuf>,
}

/// The directory holding the pool's trust root (pool.key and pool.anchor): `key_dir` in
/// `DIR/pool.json` when it names one (relative paths inside `dir`), else `dir` itself
/// (also when there is no pool.json yet, as during an import into a new directory).
pub fn trust_root_dir(dir: &Path) -> PathBuf {
    #[derive(Deserialize)]
    struct KeyDirOnly {
        #[serde(default)]
        key_dir: Option<PathBuf>,
    }
    match fs::read(dir.join(CONFIG_FILE))
        .ok()
        .and_then(|t| serde_json::from_slice::<KeyDirOnly>(&t).ok())
        .and_then(|c| c.key_dir)
    {
        Some(k) if k.is_absolute() => k,
        Some(k) => dir.join(k),
        None => dir.to_path_buf(),
    }
}

/// The pool key's file: `pool.key` in `trust_root_dir`.
pub fn key_path(dir: &Path) -> PathBuf {
    trust_root_dir(dir).join(super::import::POOL_KEY_FILE)
}

/// Where a pool's object store is and who this host is to it (no secret: credentials are
/// read from the file named here, or from the environment, at each start).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectStoreConfig {
    /// `s3://BUCKET/PREFIX?endpoint=...`.
    pub url: String,
    /// A credentials file (`AWS_ACCESS_KEY_ID=...` lines, mode 0600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials: Option<PathBuf>,
    /// This host's name as a writer of the pool (host name, directory and a random tag),
    /// in the store's superblock object while this host holds the pool.
    pub writer: String,
    /// The store failed the startup probe (it ignores conditional writes) and the
    /// administrator accepted single-host use: no fencing can be promised.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub single_host: bool,
    /// `--object-store-flush local`: a FLUSH is durable on the local devices (the intent
    /// log) and reaches the store with the next commit (every 5 s, or sooner): faster, at
    /// the price of a window another host importing from the store does not see.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub local_flush: bool,
    /// `--object-store-cache-size`: the local devices keep about this much of the pool;
    /// past it, client data the store holds is given back locally (`pool::evict`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_bytes: Option<u64>,
}

impl PoolConfig {
    pub fn read(dir: &Path) -> Result<PoolConfig> {
        let p = dir.join(CONFIG_FILE);
        let text = fs::read(&p).map_err(|e| {
            if e.kind() != std::io::ErrorKind::NotFound {
                return Error::device(&p, e);
            }
            match labelled_files(dir) {
                // Devices of a pool whose pool.json is gone: creating a pool on them
                // would destroy it.
                Some(found) => Error::NotFound(format!(
                    "{} has no {CONFIG_FILE}, but {found}: its {CONFIG_FILE} was lost or \
                     removed; restore it (from a backup), or rebuild it from the labels with \
                     'bulwark pool import --dir {} {} --force', rather than creating a pool on \
                     those devices",
                    dir.display(),
                    dir.display(),
                    dir.display()
                )),
                None => Error::NotFound(format!(
                    "no bulwark pool in {} (create one with 'bulwark pool create {} ...')",
                    dir.display(),
                    dir.display()
                )),
            }
        })?;
        serde_json::from_slice(&text).map_err(|e| {
            Error::Corrupt(format!(
                "{}: {e} (the file lists the pool's devices and layout; restore it from a \
                 backup, or fix it by hand)",
                p.display()
            ))
        })
    }

    pub fn write(&self, dir: &Path) -> Result<()> {
        let p = dir.join(CONFIG_FILE);
        let tmp = dir.join(".pool.json.tmp");
        let text = serde_json::to_vec_pretty(self).expect("config serialises");
        // Mode 0600: the file names the pool's devices and layout, which is
        // nobody else's business (the directory is 0700 too: `create`).
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
            let mut f = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?;
            // A leftover temporary file keeps its old mode through `open`.
            f.set_permissions(fs::Permissions::from_mode(0o600))?;
            f.write_all(&text)
        };
        write().map_err(|e| Error::device(&tmp, e))?;
        fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(|e| Error::device(&tmp, e))?;
        fs::rename(&tmp, &p).map_err(|e| Error::device(&p, e))?;
        if let Ok(d) = fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    /// The cache device's path, resolved like the devices'.
    pub fn cache_device_path(&self, dir: &Path) -> Option<PathBuf> {
        self.cache_device.as_ref().map(|d| {
            if d.is_absolute() {
                d.clone()
            } else {
                dir.join(d)
            }
        })
    }

    /// `log_devices`, relative paths taken inside `dir`.
    pub fn resolve_log(&self, dir: &Path) -> Vec<PathBuf> {
        self.log_devices.iter().map(|d| dir.join(d)).collect()
    }

    pub fn resolve(&self, dir: &Path) -> Vec<PathBuf> {
        self.devices
            .iter()
            .map(|d| {
                if d.is_absolute() {
                    d.clone()
                } else {
                    dir.join(d)
                }
            })
            .collect()
    }
}

/// `dev0.img and dev1.img carry labels of bulwark pool ID`, for files in `dir`
/// that carry a bulwark label; `None` when none does.
fn labelled_files(dir: &Path) -> Option<String> {
    let mut names = Vec::new();
    let mut pool = None;
    for e in fs::read_dir(dir).ok()?.flatten() {
        let is_file = e.file_type().map(|t| t.is_file()).unwrap_or(false);
        if !is_file
            || e.metadata()
                .map(|m| m.len() < DEVICE_BYTES_MIN)
                .unwrap_or(true)
        {
            continue;
        }
        let Ok(d) = FileDevice::open(&e.path()) else {
            continue;
        };
        if let Some(sb) = front_label(&d) {
            names.push(e.file_name().to_string_lossy().into_owned());
            pool = Some(crate::hex::to_hex(&sb.pool_id));
        }
    }
    names.sort();
    Some(format!(
        "{} carr{} labels of bulwark pool {}",
        names.join(", "),
        if names.len() == 1 { "ies" } else { "y" },
        pool?
    ))
}

/// What names a file or disk whatever the path to it: the device number of a
/// block or character device, else the file system and inode.
fn file_identity(p: &Path) -> Result<(u64, u64)> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let m = fs::metadata(p).map_err(|e| Error::device(p, e))?;
    Ok(
        if m.file_type().is_block_device() || m.file_type().is_char_device() {
            (u64::MAX, m.rdev())
        } else {
            (m.dev(), m.ino())
        },
    )
}

/// Read whatever superblock is in the front slots (used to refuse devices already in a pool).
pub fn front_label(dev: &dyn Device) -> Option<Superblock> {
    let mut buf = vec![0u8; SUPERBLOCK_BYTES];
    let mut best: Option<Superblock> = None;
    for off in SUPERBLOCK_SLOT_OFFSETS {
        if dev.read_at(&mut buf, off).is_ok() {
            if let Ok(Some(sb)) = Superblock::decode(&buf, Check::Unkeyed) {
                if best.as_ref().is_none_or(|b| sb.generation > b.generation) {
                    best = Some(sb);
                }
            }
        }
    }
    best
}

/// Checks a pool name: 1 to 64 letters, digits, '.', '_' or '-', not starting with '-' or '.'.
pub fn validate_pool_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= super::superblock::NAME_BYTES_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        && !name.starts_with(['-', '.']);
    if !ok {
        return Err(Error::Invalid(format!(
            "invalid pool name '{name}': use 1-64 letters, digits, '.', '_' or '-', not starting with '-' or '.'"
        )));
    }
    Ok(())
}

/// The name a pool in `dir` gets when none is given: the directory's last component,
/// made a valid name (leading '.' and '-' dropped, other characters than letters, digits,
/// '.', '_' and '-' replaced by '_', at most 64 bytes); "pool" when nothing is left.
pub fn default_pool_name(dir: &Path) -> String {
    let abs = if dir.is_absolute() {
        dir.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|c| c.join(dir))
            .unwrap_or_else(|_| dir.to_path_buf())
    };
    let last = abs
        .components()
        .rev()
        .find_map(|c| match c {
            std::path::Component::Normal(n) => Some(n.to_string_lossy().into_owned()),
            _ => None,
        })
        .unwrap_or_default();
    let mut name: String = last
        .trim_start_matches(['.', '-'])
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    name.truncate(super::superblock::NAME_BYTES_MAX);
    if validate_pool_name(&name).is_err() {
        name = "pool".into();
    }
    name
}

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

/// `create`, with separate intent log devices (`logdev`): existing files or disks, one,
/// or two for the log mirrored on both.
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
    if log_devices.len() > super::superblock::LOG_DEVICES_MAX {
        return Err(Error::Invalid(format!(
            "{} log devices given; a pool has at most {} (the log mirrored on both)",
            log_devices.len(),
            super::superblock::LOG_DEVICES_MAX
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
            let d = super::logdev::open_new(p, &|_| false)?;
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
            super::superblock::VERSION_1
        } else {
            super::superblock::VERSION
        };
        let sb_key = if format == super::superblock::VERSION {
            let key_path = root.join(super::import::POOL_KEY_FILE);
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
            .map(|(_, d)| super::logdev::slots_of(d.size()))
            .min()
            .unwrap_or(0);
        for ((_, d), id) in logs.iter().zip(&log_ids) {
            super::logdev::write_label(
                d,
                &super::logdev::Label {
                    pool_id,
                    device_id: *id,
                    role: super::logdev::ROLE_INTENT_LOG,
                    slots: log_slots,
                },
            )?;
        }
        // The host's record of the generation the devices are at (`anchor`).
        if let Some(sb) = first {
            super::anchor::write_first_in(
                root,
                &super::anchor::Anchor {
                    seq: 1,
                    pool_id,
                    committed: (sb.generation, super::anchor::digest(&sb)),
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
