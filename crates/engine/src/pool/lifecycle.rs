//! A pool's life beyond create and serve, as `zpool` has it: what the devices say of
//! themselves (`scan`, `inspect`), export, import into a pool directory, destroy, and the
//! upgrade of a format 1 pool.
//!
//! The labels (superblocks) are the truth: `scan` reads them from any devices and
//! groups them by pool, each member ONLINE, STALE, SMALL, MISSING or DUPLICATE (its newest
//! label on two devices at once: a copy, which `import_into` refuses), and claimed or not
//! by a running daemon; `inspect` does the same for the pool of one directory.
//! `import_into` (`pool import`) writes a pool directory (`pool.json`, a fresh anchor at
//! the devices' generation) pointing at the devices it found and imports the pool once,
//! which takes it (its commit clears the exported mark); it is refused while a daemon
//! claims a member, and for a pool not exported unless forced, and undone when it fails.
//! `export` marks every member's label exported in one last commit and settles the
//! anchor, so the devices may be moved and imported elsewhere without `--force` (`serve`
//! refuses an exported pool until `import_into` takes it back); `destroy` wipes every
//! member's labels, so nothing imports the pool again. `upgrade` imports a format 1 pool
//! as found, makes its pool key and writes format 2 labels in two commits. No daemon runs
//! any of these: each takes the pool's lock or the devices' claims, and is refused while
//! a daemon holds them.

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::facade::Pool;
use super::format::anchor::{self, Anchor};
use super::format::config::{PoolConfig, CONFIG_FILE};
use super::format::superblock::{Check, Superblock};
use super::options::OpenOptions;
use crate::constants::*;
use crate::device::{Device, DeviceClaim, FileDevice};
use crate::hex::to_hex;
use crate::keys::pool_key::PoolKey;
use crate::redundancy::Layout;
use crate::{Error, Result};

/// One member of a pool as its labels describe it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FoundMember {
    pub index: u32,
    /// The member id (hex) every label of the pool lists.
    pub device_id: String,
    /// Where it was found; `None` when no device given carries its label.
    pub path: Option<PathBuf>,
    /// The generation of its newest label.
    pub generation: Option<u64>,
    /// ONLINE, STALE (missed commits), SMALL (truncated), DUPLICATE (its newest label is
    /// on another device too: a copy) or MISSING.
    pub state: String,
    /// Why the device cannot be claimed now (a running daemon holds it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_use: Option<String>,
    /// DUPLICATE: the other device that carries the same member's newest label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub also_at: Option<PathBuf>,
}

/// A pool found on devices: what `bulwark pool import` shows before it imports.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FoundPool {
    pub pool_id: String,
    /// The name in its labels (empty for pools made before names).
    pub name: String,
    pub layout: String,
    /// The newest generation any member carries.
    pub generation: u64,
    /// Marked exported by `bulwark pool export` (in the newest label).
    pub exported: bool,
    pub members: Vec<FoundMember>,
    /// Usable bytes after redundancy, as `status` counts its total.
    pub capacity_bytes: u64,
    /// Enough members are ONLINE for the layout to run (DEGRADED or not).
    pub runnable: bool,
}

impl FoundPool {
    /// The pool's name, or its id when its labels carry none.
    pub fn display_name(&self) -> &str {
        if self.name.is_empty() {
            &self.pool_id
        } else {
            &self.name
        }
    }

    /// The members found, with their paths.
    pub fn present(&self) -> impl Iterator<Item = (&FoundMember, &Path)> {
        self.members
            .iter()
            .filter_map(|m| m.path.as_deref().map(|p| (m, p)))
    }
}

/// A device that carries a bulwark label, and its newest label.
struct Labelled {
    path: PathBuf,
    size: u64,
    sb: Superblock,
}

/// Files in `dir` that may be devices: regular files of at least a device's minimum
/// size, not the pool's own files (`pool.*`, dot files, logs).
fn device_files_in(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let meta_file = name.to_str().is_none_or(|n| {
            n.starts_with("pool.")
                || n.starts_with('.')
                || n.ends_with(".log")
                || n.ends_with(".json")
        });
        let big_file = e
            .metadata()
            .map(|m| m.is_file() && m.len() >= DEVICE_BYTES_MIN)
            .unwrap_or(false);
        if !meta_file && big_file {
            out.push(e.path());
        }
    }
    out.sort();
    out
}

/// The devices `paths` name: files and block devices as given, directories by the device
/// files in them; each once (by file identity), as an absolute path (symlinks kept).
fn candidates(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    use std::os::unix::fs::MetadataExt;
    let mut out: Vec<PathBuf> = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for p in paths {
        let meta = fs::metadata(p).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                Error::NotFound(format!("{} does not exist", p.display()))
            }
            _ => Error::device(p, e),
        })?;
        let found = if meta.is_dir() {
            device_files_in(p)
        } else {
            vec![p.clone()]
        };
        for f in found {
            let Ok(m) = fs::metadata(&f) else { continue };
            let id = if m.file_type().is_file() {
                (m.dev(), m.ino())
            } else {
                (u64::MAX, m.rdev())
            };
            // Absolute, but not canonical: /dev/disk/by-id/... stays what it is (the
            // /dev/sdX it points to today may be another disk after a reboot).
            if seen.insert(id) {
                out.push(std::path::absolute(&f).unwrap_or(f));
            }
        }
    }
    Ok(out)
}

/// Read the newest label of each device (front slots, then the back ones they point to).
/// The labels on `paths`. `Check::Unkeyed` (scan, destroy) reads format 2 labels without
/// authenticating them: what they say is shown, never trusted for an import.
fn read_labels(paths: &[PathBuf], check: Check) -> Vec<Labelled> {
    let mut out = Vec::new();
    for p in paths {
        let Ok(dev) = FileDevice::open(p) else {
            tracing::debug!(device = %p.display(), "cannot be opened: skipped");
            continue;
        };
        let back = super::format::labels::best_superblock(&dev, None, check)
            .map(|front| DEVICE_RESERVED_FRONT + front.segments_per_device * SEGMENT_BYTES);
        let Some(sb) = super::format::labels::label_front_or_back(&dev, back, check, false) else {
            continue;
        };
        out.push(Labelled {
            path: p.clone(),
            size: dev.size(),
            sb,
        });
    }
    out
}

/// Usable bytes of a pool with these labels, as `status` counts its total.
fn capacity(sb: &Superblock) -> u64 {
    let spd = sb.segments_per_device * SEGMENT_BYTES;
    match sb.layout {
        Layout::Single => spd * sb.member_count as u64,
        Layout::Mirror(_) => spd,
        Layout::Parity { k, .. } => spd * k as u64,
    }
}

/// Whether a pool holds `path` now (a running daemon's claim, or a pool open in this
/// process): what holds it.
fn claimed_elsewhere(path: &Path) -> Option<String> {
    DeviceClaim::in_use(path)
}

/// The pools whose labels are on `devices` (files, block devices, or directories whose
/// device files are read), each with its members present, stale and missing.
pub fn scan(devices: &[PathBuf]) -> Result<Vec<FoundPool>> {
    scan_checked(devices, Check::Unkeyed)
}

/// `scan`, reading only labels that pass `check` (`Check::Key`: what `pool import`
/// decides on once it has the pool's key).
fn scan_checked(devices: &[PathBuf], check: Check) -> Result<Vec<FoundPool>> {
    let labelled = read_labels(&candidates(devices)?, check);
    let mut ids: Vec<[u8; 16]> = labelled.iter().map(|l| l.sb.pool_id).collect();
    ids.sort();
    ids.dedup();
    let mut pools = Vec::new();
    for id in ids {
        let mine: Vec<&Labelled> = labelled.iter().filter(|l| l.sb.pool_id == id).collect();
        let newest = mine
            .iter()
            .max_by_key(|l| l.sb.generation)
            .map(|l| l.sb.clone())
            .expect("at least one label per id");
        let mut members = Vec::new();
        for (i, member_id) in newest.member_ids.iter().enumerate() {
            let found = mine
                .iter()
                .filter(|l| &l.sb.device_id == member_id)
                .max_by_key(|l| l.sb.generation);
            // Another device with the same member's label at the same generation: a copy
            // of the device. Which one the pool should use is the administrator's call.
            let also_at = found.and_then(|f| {
                mine.iter()
                    .find(|l| {
                        &l.sb.device_id == member_id
                            && l.sb.generation == f.sb.generation
                            && l.path != f.path
                    })
                    .map(|l| l.path.clone())
            });
            let member = match found {
                Some(l) => FoundMember {
                    index: i as u32,
                    device_id: to_hex(member_id),
                    path: Some(l.path.clone()),
                    generation: Some(l.sb.generation),
                    state: if also_at.is_some() {
                        "DUPLICATE"
                    } else if l.size < newest.device_bytes {
                        "SMALL"
                    } else if l.sb.generation + 1 < newest.generation {
                        "STALE"
                    } else {
                        "ONLINE"
                    }
                    .into(),
                    in_use: claimed_elsewhere(&l.path),
                    also_at,
                },
                None => FoundMember {
                    index: i as u32,
                    device_id: to_hex(member_id),
                    path: None,
                    generation: None,
                    state: "MISSING".into(),
                    in_use: None,
                    also_at: None,
                },
            };
            members.push(member);
        }
        let online = members.iter().filter(|m| m.state == "ONLINE").count();
        let runnable = online >= newest.layout.members_needed(members.len()) && online > 0;
        pools.push(FoundPool {
            pool_id: to_hex(&id),
            name: newest.name.clone(),
            layout: newest.layout.to_string(),
            generation: newest.generation,
            exported: newest.exported,
            capacity_bytes: capacity(&newest),
            members,
            runnable,
        });
    }
    Ok(pools)
}

/// The devices of the pool in `dir` as their labels say now (no daemon needed, none
/// disturbed): `pool.json`'s devices and the device files in `dir`.
pub fn inspect(dir: &Path) -> Result<FoundPool> {
    let conf = PoolConfig::read(dir)?;
    let mut paths: Vec<PathBuf> = conf
        .resolve(dir)
        .into_iter()
        .filter(|p| p.exists())
        .collect();
    paths.extend(device_files_in(dir));
    let found = scan(&paths)?;
    found
        .into_iter()
        .find(|p| p.pool_id == conf.pool_id)
        .ok_or_else(|| {
            Error::NotFound(format!(
                "no device of pool {} ({}) carries its label: its devices are missing, or \
                 were wiped ('bulwark pool destroy')",
                conf.name.as_deref().unwrap_or(&conf.pool_id),
                dir.display()
            ))
        })
}

/// What `export` did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExportReport {
    pub name: String,
    pub pool_id: String,
    /// The generation the devices were left at, marked exported.
    pub generation: u64,
    pub devices: Vec<PathBuf>,
}

/// Export the pool in `dir`: import it (the pool's lock and every device's claim, as
/// `serve` takes them: refused while a daemon serves it), mark every member's label
/// exported in one last commit, settle the anchor as a clean close does, mark `pool.json`
/// exported, and let go of everything. `serve` refuses the directory afterwards, and
/// `bulwark pool import` (here or on another host) takes the pool back.
pub fn export(dir: &Path) -> Result<ExportReport> {
    let conf = PoolConfig::read(dir)?;
    if conf.exported {
        return Err(Error::Invalid(format!(
            "pool {} in {} is already exported",
            conf.name.as_deref().unwrap_or(&conf.pool_id),
            dir.display()
        )));
    }
    let pool = Pool::open(dir, OpenOptions::default())?;
    let report = pool.export()?;
    drop(pool);
    let mut conf = PoolConfig::read(dir)?;
    conf.exported = true;
    conf.write(dir)?;
    Ok(report)
}

/// How `import_into` may take a pool.
#[derive(Debug, Clone, Default)]
pub struct ImportOptions {
    /// Import a pool that was not exported (its last host is gone for good).
    pub force: bool,
    /// Give the pool this name.
    pub rename: Option<String>,
    /// The pool's old directory, whose `pool.json` gives the members taken offline (and
    /// whose `pool.key` is taken when `pool_key` is not given).
    pub from_dir: Option<PathBuf>,
    /// The pool's key file (`DIR/pool.key` of the directory it came from): copied into
    /// `dir`. Needed for a format 2 pool unless `dir` or `from_dir` holds it.
    pub pool_key: Option<PathBuf>,
    /// Take devices older than the generation the anchor of `dir` or `from_dir` last
    /// committed (an older copy of the pool, restored on purpose).
    pub accept_rollback: bool,
    /// Refuse devices older than this generation (the one the pool's last host showed in
    /// `bulwark status`): without an anchor, an older authentic copy is otherwise taken.
    pub min_generation: Option<u64>,
}

/// What `import_into` did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImportReport {
    /// The pool as found on the devices, before the import.
    pub found: FoundPool,
    pub name: String,
    pub dir: PathBuf,
    /// The generation after the import's commit.
    pub generation: u64,
    pub volumes: Vec<crate::volume::VolumeStatus>,
}

/// The one pool on `devices`, refused with what is wrong when there is none or several.
pub fn one_pool(devices: &[PathBuf]) -> Result<FoundPool> {
    let mut found = scan(devices)?;
    let shown: Vec<String> = devices.iter().map(|d| d.display().to_string()).collect();
    match found.len() {
        0 => Err(Error::NotFound(format!(
            "no bulwark label on {}: nothing to import (a destroyed pool's labels are wiped)",
            shown.join(", ")
        ))),
        1 => Ok(found.remove(0)),
        _ => Err(Error::Invalid(format!(
            "devices of {} pools were given ({}): give the devices of one pool",
            found.len(),
            found
                .iter()
                .map(|p| format!("{} (id {})", p.display_name(), p.pool_id))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// Why the pool found cannot be imported as it is, if it cannot.
pub fn import_refusal(found: &FoundPool, force: bool) -> Option<Error> {
    let name = found.display_name();
    let in_use: Vec<String> = found
        .members
        .iter()
        .filter(|m| m.in_use.is_some())
        .filter_map(|m| m.path.as_ref().map(|p| p.display().to_string()))
        .collect();
    if !in_use.is_empty() {
        return Some(Error::Busy(format!(
            "pool {name} is in use: a running bulwark daemon holds {} (its device claims); \
             stop that daemon, or export the pool there ('bulwark pool export') first",
            in_use.join(", ")
        )));
    }
    let copies: Vec<String> = found
        .members
        .iter()
        .filter_map(|m| match (&m.path, &m.also_at) {
            (Some(p), Some(q)) => Some(format!(
                "member {} is on both {} and {}",
                m.index,
                p.display(),
                q.display()
            )),
            _ => None,
        })
        .collect();
    if !copies.is_empty() {
        return Some(Error::Invalid(format!(
            "pool {name}: {} (a copy of a device?): give only the devices the pool should use",
            copies.join("; ")
        )));
    }
    if !found.runnable {
        let missing: Vec<String> = found
            .members
            .iter()
            .filter(|m| m.state != "ONLINE")
            .map(|m| match &m.path {
                Some(p) => format!("member {} {} ({})", m.index, p.display(), m.state),
                None => format!("member {} (id {}) MISSING", m.index, m.device_id),
            })
            .collect();
        return Some(Error::NotFound(format!(
            "pool {name} ({}) cannot run from these devices: {}; give the missing devices too",
            found.layout,
            missing.join(", ")
        )));
    }
    if !found.exported && !force {
        return Some(Error::Invalid(format!(
            "pool {name} (id {}) was not exported: it may be in use by another host (its \
             devices are at generation {}). Export it there with 'bulwark pool export'; if \
             that host is gone for good, import with --force",
            found.pool_id, found.generation
        )));
    }
    None
}

/// The log devices a pool imported into `dir` lists: those of the old pool.json
/// (`dir`'s or `--from-dir`'s), and any of `devices` that carries this pool's log label
/// (the import uses the ones its superblock names: `intentlog::devices`).
fn import_log_devices(
    conf: Option<(&PoolConfig, &Path)>,
    devices: &[PathBuf],
    found: &FoundPool,
) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = conf.map(|(c, d)| c.resolve_log(d)).unwrap_or_default();
    for p in candidates(devices).unwrap_or_default() {
        let Ok(d) = FileDevice::open(&p) else {
            continue;
        };
        if super::intentlog::devices::read_label(&d)
            .is_some_and(|l| to_hex(&l.pool_id) == found.pool_id)
            && !out.contains(&p)
        {
            out.push(p);
        }
    }
    out
}

/// Import the pool on `devices` into `dir`: refused unless exactly one pool's labels are
/// there, enough of its members, none claimed by a running daemon, and the pool exported
/// (or `force`). Writes `dir` (0700) with a `pool.json` naming the devices found and an
/// anchor at their generation (the devices are trusted as found: that is what an import
/// means), imports the pool once (its commit clears the exported mark and writes the
/// name), and closes it. `dir` may be the pool's own directory (an exported pool taken
/// back in place); one that holds another pool, or this one not exported, is refused.
/// Whatever fails after `dir` was written leaves it as it was.
pub fn import_into(dir: &Path, devices: &[PathBuf], opts: &ImportOptions) -> Result<ImportReport> {
    let found = one_pool(devices)?;
    if let Some(e) = import_refusal(&found, opts.force) {
        return Err(e);
    }
    if let Some(n) = &opts.rename {
        super::format::config::validate_pool_name(n)?;
    }
    let old = match PoolConfig::read(dir) {
        Ok(c) => Some(c),
        Err(Error::NotFound(_)) if !dir.join(CONFIG_FILE).exists() => None,
        Err(e) => return Err(e),
    };
    if let Some(c) = &old {
        if c.pool_id != found.pool_id {
            return Err(Error::Exists(format!(
                "{} holds another pool ({}, id {}): import into a new directory",
                dir.display(),
                c.name.as_deref().unwrap_or("unnamed"),
                c.pool_id
            )));
        }
        if !c.exported {
            return Err(Error::Exists(format!(
                "pool {} is already imported in {}: serve it with 'bulwark serve {}'",
                found.display_name(),
                dir.display(),
                dir.display()
            )));
        }
    }
    let name = match (&opts.rename, found.name.is_empty()) {
        (Some(n), _) => n.clone(),
        (None, false) => found.name.clone(),
        (None, true) => super::format::config::default_pool_name(dir),
    };
    // Members taken offline stay offline: the old pool.json (this directory's, or the
    // one the pool came from) says which.
    let from = match &opts.from_dir {
        Some(d) => PoolConfig::read(d)
            .ok()
            .filter(|c| c.pool_id == found.pool_id),
        None => None,
    };
    let offline = old
        .as_ref()
        .or(from.as_ref())
        .map(|c| c.offline.clone())
        .unwrap_or_default();

    let made_dir = !dir.exists();
    fs::create_dir_all(dir).map_err(|e| Error::device(dir, e))?;
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(|e| Error::device(dir, e))?;
    }
    let dir_abs = fs::canonicalize(dir).map_err(|e| Error::device(dir, e))?;
    let devices_listed: Vec<PathBuf> = found
        .members
        .iter()
        .map(|m| match &m.path {
            Some(p) => p
                .strip_prefix(&dir_abs)
                .map(Path::to_path_buf)
                .unwrap_or(p.clone()),
            None => old
                .as_ref()
                .and_then(|c| c.devices.get(m.index as usize).cloned())
                .unwrap_or_else(|| PathBuf::from(format!("missing-member-{}", m.index))),
        })
        .collect();
    let conf = PoolConfig {
        format: 1,
        pool_id: found.pool_id.clone(),
        layout: found.layout.clone(),
        devices: devices_listed,
        offline,
        name: Some(name.clone()),
        exported: false,
        created: old.as_ref().map(|c| c.created.clone()).unwrap_or_default(),
        cache_device: old.as_ref().and_then(|c| c.cache_device.clone()),
        object_store: old.as_ref().and_then(|c| c.object_store.clone()),
        key_dir: old.as_ref().and_then(|c| c.key_dir.clone()),
        log_devices: import_log_devices(
            match (&old, &opts.from_dir) {
                (Some(c), _) => Some((c, dir)),
                (None, Some(d)) => from.as_ref().map(|c| (c, d.as_path())),
                (None, None) => None,
            },
            devices,
            &found,
        ),
    };
    let old_anchor = anchor::read(dir).ok().flatten();
    // The pool key: the directory's own, or the one given, or the old directory's.
    let key_dst = super::format::config::key_path(dir);
    let key_src = opts.pool_key.clone().or_else(|| {
        opts.from_dir
            .as_ref()
            .map(|d| super::format::config::key_path(d))
            .filter(|p| p.exists())
    });
    let key = match (key_dst.exists(), &key_src) {
        (true, _) => Some(PoolKey::load(&key_dst)?),
        (false, Some(src)) => Some(PoolKey::load(src)?),
        (false, None) => None,
    };
    let key_made = !key_dst.exists() && key.is_some();
    let sb_key = key.as_ref().map(|k| {
        let id: [u8; 16] = crate::hex::from_hex(&found.pool_id)
            .and_then(|v| v.try_into().ok())
            .unwrap_or([0; 16]);
        k.superblock_key(&id)
    });
    let check = match &sb_key {
        Some(k) => Check::Key(k),
        None => Check::Unkeyed,
    };
    let undo = |dir: &Path| match &old {
        Some(c) => {
            let _ = c.write(dir);
        }
        None => {
            let _ = fs::remove_file(dir.join(CONFIG_FILE));
            let _ = fs::remove_file(anchor::path(dir));
            let _ = fs::remove_file(dir.join("pool.lock"));
            if key_made {
                let _ = fs::remove_file(&key_dst);
            }
            if made_dir {
                let _ = fs::remove_dir(dir);
            }
        }
    };
    let result = (|| {
        // The first look read the labels without the key (they may be forged): with the
        // key, the decisions are taken again on the labels that verify.
        if sb_key.is_some() {
            let verified = scan_checked(devices, check)?
                .into_iter()
                .find(|p| p.pool_id == found.pool_id)
                .ok_or_else(|| {
                    Error::Corrupt(format!(
                        "no label of pool {} verifies under its pool key: the key is not \
                         this pool's, or the labels were altered",
                        found.display_name()
                    ))
                })?;
            if let Some(e) = import_refusal(&verified, opts.force) {
                return Err(e);
            }
            if verified.name != found.name || verified.exported != found.exported {
                return Err(Error::Corrupt(format!(
                    "the labels of pool {} disagree once verified under its key (name or \
                     exported mark): some were altered without the key; not imported",
                    found.display_name()
                )));
            }
        }
        let newest = newest_label(&found, check)?;
        // An anchor of this pool (the directory's own, or the old directory's) knows the
        // generation last committed: devices older than it are an older copy.
        let from_anchor = opts
            .from_dir
            .as_ref()
            .and_then(|d| anchor::read(d).ok().flatten());
        let known = [old_anchor.as_ref(), from_anchor.as_ref()]
            .into_iter()
            .flatten()
            .filter(|a| a.pool_id == newest.pool_id)
            .map(|a| a.committed.0)
            .max();
        if let Some(min) = opts.min_generation.filter(|&m| newest.generation < m) {
            return Err(Error::Corrupt(format!(
                "the devices of pool {} are at generation {}, older than --min-generation \
                 {min}: the newer state (generation {min} or later) is elsewhere. Keep it: \
                 give the devices that hold it ('bulwark pool scan' shows each device's \
                 generation), or go on serving it on the host that has it; nothing was imported",
                found.display_name(),
                newest.generation
            )));
        }
        if let Some(last) = known.filter(|&g| newest.generation < g) {
            if !opts.accept_rollback {
                return Err(Error::Corrupt(format!(
                    "the devices of pool {} are at generation {}, but its anchor says \
                     generation {last} was committed: the anchor's side is newer, the devices \
                     are an older copy (restored from a backup?). To keep the newer state, \
                     give the devices that hold generation {last} to 'bulwark pool import \
                     --min-generation {last}'. --accept-rollback would import this copy and \
                     drop every commit after generation {} (up to {last}) and the writes they \
                     held",
                    found.display_name(),
                    newest.generation,
                    newest.generation
                )));
            }
            tracing::warn!(
                devices = newest.generation,
                anchor = last,
                "importing devices older than the pool's anchor (--accept-rollback): the \
                 commits after generation {} up to {last} are dropped",
                newest.generation
            );
        }
        if newest.format != super::format::superblock::VERSION_1 && key.is_none() {
            return Err(Error::NotFound(format!(
                "pool {} is format {}: its labels and metadata are authenticated by its pool \
                 key, which is not on the devices. Give it with --pool-key FILE (the pool.key \
                 of the directory it was exported from, or your backup of it)",
                found.display_name(),
                newest.format
            )));
        }
        // Said once the import is going ahead (after the refusals above and the key's).
        if known.is_none() && opts.min_generation.is_none() {
            tracing::warn!(
                "no anchor of pool {} here and no --min-generation: the devices are taken at \
                 generation {} as found; if the pool's last host showed a higher generation \
                 in 'bulwark status', this is an older copy (import again with \
                 --min-generation N to refuse one)",
                found.display_name(),
                newest.generation
            );
        }
        if let (true, Some(k)) = (key_made, &key) {
            k.save(&key_dst)?;
        }
        conf.write(dir)?;
        // The devices as found are the pool now: the anchor starts at their generation,
        // above every nonce this directory's anchor ever announced.
        let pool_id: [u8; 16] = newest.pool_id;
        let nonce = old_anchor
            .as_ref()
            .filter(|a| a.pool_id == pool_id)
            .map(|a| a.nonce_reserved)
            .unwrap_or(0)
            .max(newest.nonce_reserved);
        anchor::write_first(
            dir,
            &Anchor {
                seq: old_anchor.as_ref().map(|a| a.seq + 1).unwrap_or(1),
                pool_id,
                committed: (newest.generation, anchor::digest(&newest)),
                next: (0, [0; 32]),
                nonce_reserved: nonce,
            },
        )?;
        let pool = Pool::open(
            dir,
            OpenOptions {
                take_exported: true,
                rename: Some(name.clone()),
                ..OpenOptions::default()
            },
        )?;
        let generation = pool.status().generation;
        let volumes = pool.volumes();
        pool.close()?;
        Ok((generation, volumes))
    })();
    match result {
        Ok((generation, volumes)) => Ok(ImportReport {
            found,
            name,
            dir: dir_abs,
            generation,
            volumes,
        }),
        Err(e) => {
            undo(dir);
            Err(e)
        }
    }
}

/// The newest label among the members found (the one import takes).
fn newest_label(found: &FoundPool, check: Check) -> Result<Superblock> {
    let paths: Vec<PathBuf> = found.present().map(|(_, p)| p.to_path_buf()).collect();
    read_labels(&paths, check)
        .into_iter()
        .map(|l| l.sb)
        .filter(|sb| to_hex(&sb.pool_id) == found.pool_id)
        .max_by_key(|sb| sb.generation)
        .ok_or_else(|| {
            Error::NotFound(format!(
                "the labels of pool {} can no longer be read",
                found.display_name()
            ))
        })
}

/// What `upgrade` did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UpgradeReport {
    pub format: u32,
    pub generation: u64,
    /// The pool key it made.
    pub key: PathBuf,
}

/// Upgrade the format 1 pool in `dir` to format 2 in place (decision 0011): import it once
/// as found (every map walked and verified), make `DIR/pool.key`, and write format 2
/// labels in two commits (the import's and the close's), so neither superblock slot keeps
/// a format 1 label. Refused once `DIR/pool.key` exists.
pub fn upgrade(dir: &Path) -> Result<UpgradeReport> {
    let key = super::format::config::key_path(dir);
    let had_key = key.exists();
    let opened = Pool::open(
        dir,
        OpenOptions {
            upgrade: true,
            ..OpenOptions::default()
        },
    );
    let pool = match opened {
        Ok(p) => p,
        Err(e) => {
            // A key the failed upgrade made names no label: left behind, it would make
            // the next import call the format 1 labels altered.
            if !had_key {
                let _ = fs::remove_file(&key);
            }
            return Err(e);
        }
    };
    // The import's commit wrote format 2 labels to one slot; the close's commit writes
    // the other.
    pool.close()?;
    let generation = pool.core().sb.lock().sb.generation;
    Ok(UpgradeReport {
        format: super::format::superblock::VERSION,
        generation,
        key: super::format::config::key_path(dir),
    })
}

/// What `destroy` did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DestroyReport {
    pub name: String,
    pub pool_id: String,
    /// Devices whose labels were wiped.
    pub wiped: Vec<PathBuf>,
    /// Device files bulwark had created in the directory, removed.
    pub removed: Vec<PathBuf>,
    /// Members not found (their labels, if they still exist somewhere, were not wiped).
    pub missing: Vec<String>,
}

/// Destroy the pool in `dir`: refused while a daemon serves it (the pool's lock, the
/// devices' claims) and, unless `force`, when its devices were written by another host
/// since this one last did (its anchor: the pool may be in use there). Every member's
/// labels (all four superblock slots) are zeroed, so no import finds the pool again; the
/// device files `pool create` made in `dir` are removed, and so are `pool.json`,
/// `pool.anchor` and `pool.lock`. The data on devices given with `--device` stays
/// where it was, unlabelled (it is encrypted for encrypted volumes).
pub fn destroy(dir: &Path, force: bool) -> Result<DestroyReport> {
    let conf = PoolConfig::read(dir)?;
    let name = conf.name.clone().unwrap_or_else(|| conf.pool_id.clone());
    let lock = super::import::lock_pool(dir)?;
    let mut paths: Vec<PathBuf> = conf
        .resolve(dir)
        .into_iter()
        .filter(|p| p.exists())
        .collect();
    paths.extend(device_files_in(dir));
    let labelled: Vec<Labelled> = read_labels(&candidates(&paths)?, Check::Unkeyed)
        .into_iter()
        .filter(|l| to_hex(&l.sb.pool_id) == conf.pool_id)
        .collect();
    let newest = labelled
        .iter()
        .map(|l| &l.sb)
        .max_by_key(|sb| sb.generation);
    if let (Some(newest), false) = (newest, force) {
        if let Some(a) = anchor::read(dir)? {
            let at = (newest.generation, anchor::digest(newest));
            if a.pool_id == newest.pool_id && !a.allows(&at) && !newest.exported {
                return Err(Error::Busy(format!(
                    "the devices of pool {name} are at generation {}, which this host did not \
                     write (it last wrote generation {}): another host may have imported the \
                     pool and use it; destroy it there, or pass --force",
                    newest.generation,
                    a.committed.0.max(a.next.0)
                )));
            }
        }
    }
    // Claims first, on every member: nothing is wiped unless all of them can be.
    let mut claimed = Vec::new();
    for l in &labelled {
        let mut d = FileDevice::open(&l.path)?;
        d.claim()?;
        claimed.push((l, d));
    }
    let zero = vec![0u8; SUPERBLOCK_BYTES];
    let mut wiped = Vec::new();
    for (l, d) in &claimed {
        let back = DEVICE_RESERVED_FRONT + l.sb.segments_per_device * SEGMENT_BYTES;
        for off in Superblock::all_slot_offsets(back) {
            if off + SUPERBLOCK_BYTES as u64 <= d.size() {
                d.write_at(&zero, off)
                    .map_err(|e| Error::device(&l.path, e))?;
            }
        }
        d.flush().map_err(|e| Error::device(&l.path, e))?;
        wiped.push(l.path.clone());
    }
    drop(claimed);
    // This pool's log devices lose their labels too: another pool may take them.
    for p in conf.resolve_log(dir) {
        let Ok(mut d) = FileDevice::open(&p) else {
            continue;
        };
        if super::intentlog::devices::read_label(&d)
            .is_some_and(|l| to_hex(&l.pool_id) == conf.pool_id)
        {
            d.claim()?;
            super::intentlog::devices::wipe_label(&d)?;
            wiped.push(p);
        }
    }
    let member_ids: Vec<String> = newest
        .map(|sb| sb.member_ids.iter().map(|id| to_hex(id)).collect())
        .unwrap_or_default();
    let missing: Vec<String> = member_ids
        .iter()
        .enumerate()
        .filter(|(_, id)| !labelled.iter().any(|l| to_hex(&l.sb.device_id) == **id))
        .map(|(i, id)| {
            let guess = conf
                .devices
                .get(i)
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            format!("member {i} {guess} (id {id})")
        })
        .collect();
    // Files bulwark made: listed as created, or (pools made before the list) the
    // devN.img files `pool create --devices` names inside the directory.
    let made: Vec<PathBuf> = if conf.created.is_empty() {
        conf.devices
            .iter()
            .filter(|p| {
                p.is_relative()
                    && p.components().count() == 1
                    && p.to_str().is_some_and(|s| {
                        s.strip_prefix("dev")
                            .and_then(|r| r.strip_suffix(".img"))
                            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                    })
            })
            .cloned()
            .collect()
    } else {
        conf.created.clone()
    };
    let mut removed = Vec::new();
    for p in made {
        let full = if p.is_absolute() {
            p.clone()
        } else {
            dir.join(&p)
        };
        if (full.parent() == Some(dir) || p.is_relative()) && fs::remove_file(&full).is_ok() {
            removed.push(full);
        }
    }
    // A trust root kept elsewhere (`--key-dir`) goes with the pool (read before pool.json
    // is removed); the directory itself is left.
    let root = super::format::config::trust_root_dir(dir);
    if root != dir {
        let _ = fs::remove_file(root.join(anchor::FILE_NAME));
        let _ = fs::remove_file(root.join(super::format::config::POOL_KEY_FILE));
    }
    for f in [
        CONFIG_FILE,
        anchor::FILE_NAME,
        super::format::config::POOL_KEY_FILE,
        ".pool.json.tmp",
    ] {
        let _ = fs::remove_file(dir.join(f));
    }
    drop(lock);
    let _ = fs::remove_file(dir.join("pool.lock"));
    tracing::info!(pool = name, wiped = wiped.len(), "pool destroyed");
    Ok(DestroyReport {
        name,
        pool_id: conf.pool_id,
        wiped,
        removed,
        missing,
    })
}

impl Pool {
    /// Mark the pool exported on every member in one last commit, settle the anchor as a
    /// clean close does, and stop: the pool is unusable afterwards (drop it to release
    /// the lock and the device claims). `lifecycle::export` also marks `pool.json`.
    pub fn export(&self) -> Result<ExportReport> {
        let core = &self.core();
        self.stop_maintenance();
        core.sb.lock().sb.exported = true;
        core.table_dirty
            .store(true, std::sync::atomic::Ordering::Release);
        let result = core.commit().and_then(|()| core.settle_anchor());
        if let Err(e) = result {
            core.sb.lock().sb.exported = false;
            return Err(e);
        }
        let sb = core.sb.lock();
        tracing::info!(
            pool = sb.sb.name,
            generation = sb.sb.generation,
            "pool exported"
        );
        Ok(ExportReport {
            name: sb.sb.name.clone(),
            pool_id: to_hex(&sb.sb.pool_id),
            generation: sb.sb.generation,
            devices: core
                .store
                .members()
                .iter()
                .filter(|m| m.present())
                .map(|m| m.path())
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::Compression;
    use crate::pool::DeviceSpec;
    use crate::volume::VolumeOptions;

    fn plain(size: u64) -> VolumeOptions {
        VolumeOptions {
            size_bytes: size,
            block_size: 4096,
            compression: Compression::Off,
            encryption: false,
        }
    }

    /// An older exported copy of the devices, imported where the pool's anchor knows a
    /// newer generation: refused as rolled back unless accepted. (It used to be taken as
    /// found, losing every write since the copy without a word.)
    #[test]
    fn an_older_copy_is_not_imported_over_the_anchor() {
        let t = tempfile::tempdir().unwrap();
        let a = t.path().join("a");
        make(&a, Layout::Single, 1);
        export(&a).unwrap();
        let dev = a.join("dev0.img");
        let old = std::fs::read(&dev).unwrap();
        let in_place = ImportOptions::default();
        import_into(&a, std::slice::from_ref(&a), &in_place).unwrap();
        {
            let pool = Pool::open(&a, OpenOptions::default()).unwrap();
            pool.create_volume("v", plain(1 << 20), None).unwrap();
            pool.close().unwrap();
        }
        export(&a).unwrap();
        std::fs::write(&dev, &old).unwrap();
        let e = import_into(&a, std::slice::from_ref(&a), &in_place).unwrap_err();
        assert!(e.to_string().contains("older copy"), "{e}");
        let accept = ImportOptions {
            accept_rollback: true,
            ..Default::default()
        };
        import_into(&a, std::slice::from_ref(&a), &accept).unwrap();
        let pool = Pool::open(&a, OpenOptions::default()).unwrap();
        assert!(pool.volume("v").is_err(), "the copy is from before 'v'");
        pool.close().unwrap();
    }

    /// A copy of a member's device given beside it: the import names both and refuses
    /// (it used to take whichever came first).
    #[test]
    fn a_copied_device_given_beside_its_original_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let a = t.path().join("a");
        make(&a, Layout::Mirror(2), 2);
        export(&a).unwrap();
        let copy = t.path().join("copy-of-dev0.img");
        std::fs::copy(a.join("dev0.img"), &copy).unwrap();
        let given = vec![a.join("dev0.img"), a.join("dev1.img"), copy.clone()];
        let found = one_pool(&given).unwrap();
        let m0 = &found.members[0];
        assert_eq!(m0.state, "DUPLICATE", "{m0:?}");
        let e = import_into(&a, &given, &ImportOptions::default()).unwrap_err();
        assert!(
            e.to_string().contains("on both") && e.to_string().contains("copy-of-dev0"),
            "{e}"
        );
        // Without the copy: imported.
        import_into(&a, &given[..2], &ImportOptions::default()).unwrap();
    }

    fn make(dir: &Path, layout: Layout, n: usize) {
        Pool::create_named(
            dir,
            layout,
            DeviceSpec::Files {
                count: n,
                size_bytes: 64 << 20,
            },
            "tank",
        )
        .unwrap();
    }

    /// Export, then import the devices alone into a fresh directory: the name, the
    /// volumes and their data come along; the exported mark is gone after the import.
    #[test]
    fn export_then_import_elsewhere() {
        let t = tempfile::tempdir().unwrap();
        let a = t.path().join("a");
        make(&a, Layout::Mirror(2), 2);
        {
            let pool = Pool::open(&a, OpenOptions::default()).unwrap();
            pool.create_volume("v", plain(8 << 20), None).unwrap();
            let v = pool.volume("v").unwrap();
            v.write(4096, &[7u8; 8192], true).unwrap();
            drop(v);
            pool.close().unwrap();
        }
        let before = scan(std::slice::from_ref(&a)).unwrap();
        assert_eq!(before.len(), 1);
        assert!(!before[0].exported && before[0].name == "tank");
        // Not exported: refused without force.
        let b = t.path().join("b");
        let e = import_into(&b, std::slice::from_ref(&a), &ImportOptions::default()).unwrap_err();
        assert!(e.to_string().contains("was not exported"), "{e}");
        assert!(!b.exists(), "a refused import leaves nothing");

        let r = export(&a).unwrap();
        assert_eq!(r.name, "tank");
        let e = Pool::open(&a, OpenOptions::default()).err().unwrap();
        assert!(e.to_string().contains("was exported"), "{e}");
        let found = scan(std::slice::from_ref(&a)).unwrap();
        assert!(found[0].exported);
        assert_eq!(found[0].members.len(), 2);

        // The pool key is not on the devices: without it the import is refused, and leaves
        // nothing behind.
        let e = import_into(&b, std::slice::from_ref(&a), &ImportOptions::default()).unwrap_err();
        assert!(e.to_string().contains("--pool-key"), "{e}");
        assert!(!b.exists(), "a refused import leaves nothing");
        let with_key = ImportOptions {
            pool_key: Some(a.join(super::super::format::config::POOL_KEY_FILE)),
            ..Default::default()
        };
        let report = import_into(&b, std::slice::from_ref(&a), &with_key).unwrap();
        assert_eq!(report.name, "tank");
        assert!(
            b.join("pool.key").exists(),
            "the key is copied into the new directory"
        );
        assert_eq!(report.volumes.len(), 1);
        assert!(!scan(std::slice::from_ref(&a)).unwrap()[0].exported);
        let pool = Pool::open(&b, OpenOptions::default()).unwrap();
        let mut buf = vec![0u8; 8192];
        pool.volume("v").unwrap().read(4096, &mut buf).unwrap();
        assert!(buf.iter().all(|&x| x == 7));
        assert_eq!(pool.status().name, "tank");
        // Imported and open here: a second import is refused (the claims, then the mark).
        let c = t.path().join("c");
        let e = import_into(
            &c,
            std::slice::from_ref(&a),
            &ImportOptions {
                force: true,
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("in use"), "{e}");
        pool.close().unwrap();
        drop(pool);
        let e = import_into(&c, std::slice::from_ref(&a), &ImportOptions::default()).unwrap_err();
        assert!(e.to_string().contains("was not exported"), "{e}");

        // Destroy wipes the labels: nothing imports any more; files made by create go.
        let d = destroy(&b, false).unwrap();
        assert_eq!(d.wiped.len(), 2);
        assert!(d.removed.is_empty(), "the devices live in a, not in b");
        assert!(!b.join(CONFIG_FILE).exists());
        let e = import_into(
            &c,
            std::slice::from_ref(&a),
            &ImportOptions {
                force: true,
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("no bulwark label"), "{e}");
    }

    /// An exported pool taken back in its own directory, renamed on the way.
    #[test]
    fn reimport_in_place_and_rename() {
        let t = tempfile::tempdir().unwrap();
        let a = t.path().join("a");
        make(&a, Layout::Single, 1);
        export(&a).unwrap();
        assert!(PoolConfig::read(&a).unwrap().exported);
        let e = export(&a).unwrap_err();
        assert!(e.to_string().contains("already exported"), "{e}");
        let r = import_into(
            &a,
            std::slice::from_ref(&a),
            &ImportOptions {
                rename: Some("tank2".into()),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(r.name, "tank2");
        let conf = PoolConfig::read(&a).unwrap();
        assert!(!conf.exported);
        assert_eq!(conf.name.as_deref(), Some("tank2"));
        assert_eq!(conf.created, vec![PathBuf::from("dev0.img")]);
        assert_eq!(inspect(&a).unwrap().name, "tank2");
        // Already imported here: refused.
        let e = import_into(
            &a,
            std::slice::from_ref(&a),
            &ImportOptions {
                force: true,
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("already imported"), "{e}");
        let d = destroy(&a, false).unwrap();
        assert_eq!(d.removed, vec![a.join("dev0.img")]);
        assert!(scan(std::slice::from_ref(&a)).unwrap().is_empty());
    }
}
