//! The pool directory's own files: `pool.json` (where the devices are, the layout, the
//! pool's name, the members `device offline` took out, the cache and log devices, the
//! object store, where the trust root lives) and the names of the others (`pool.key`,
//! with `pool.anchor` beside it, in `key_dir` when `pool.json` names one).
//!
//! The labels (superblocks) on the devices are the truth about membership; `pool.json`
//! only says where to look, and which members stay out: an offline member stays offline
//! across restarts, and a pool left with only offline members does not import (the import
//! says how to go on). Device commands change it one at a time (`Core::device_lock`).
//! Written whole to a temporary file, mode 0600, synced, then renamed over the old one.

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::constants::*;
use crate::device::FileDevice;
use crate::{Error, Result};

use super::labels::front_label;

/// The pool key's file in a pool directory (`keys::pool_key`, decision 0011).
pub const POOL_KEY_FILE: &str = "pool.key";

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
    trust_root_dir(dir).join(POOL_KEY_FILE)
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
pub(crate) fn file_identity(p: &Path) -> Result<(u64, u64)> {
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
