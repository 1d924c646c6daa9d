//! Import: find the members, pick the newest superblock, rebuild the in-memory state.
//!
//! Import is also crash recovery: whatever the last complete superblock points
//! to is the pool; records written after it are unreferenced and their
//! segments are free. Space accounting is rebuilt by walking every volume's
//! map (bounded by the metadata size). If a map cannot be walked, segments
//! below the high-water mark are never reused in this session, so nothing
//! possibly referenced is overwritten.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use super::core::{Core, SbState};
use super::format::anchor::{self, Anchor};
use super::format::config::PoolConfig;
use super::format::labels::{
    back_region_of, best_superblock, find_back_region, label_front_or_back,
};
use super::format::superblock::{Check, SbKey, Superblock};
use super::format::table::{ptr_from_hex, TableRecord};
use super::options::OpenOptions;
use crate::constants::*;
use crate::device::fault::FaultyDevice;
use crate::device::{Device, FileDevice};
use crate::hex::to_hex;
use crate::keys::pool_key::PoolKey;
use crate::log::{segment_of, Log};
use crate::map::{depth_for, new_cache, Blkptr, Tree, Visit};
use crate::redundancy::{Member, Redundancy};
use crate::store::Store;
use crate::volume::VolumeState;
use crate::{Error, Result};

/// Take the pool's exclusive lock (`DIR/pool.lock`, flock); refused while another process holds it.
pub fn lock_pool(dir: &Path) -> Result<File> {
    PoolConfig::read(dir)?;
    let path = dir.join("pool.lock");
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| Error::device(&path, e))?;
    // SAFETY: flock on a descriptor we own; no memory is touched.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let holder = fs::read_to_string(&path).unwrap_or_default();
        return Err(Error::Busy(format!(
            "pool {} is in use by another bulwark process{}",
            dir.display(),
            if holder.trim().is_empty() {
                String::new()
            } else {
                format!(" (pid {})", holder.trim())
            }
        )));
    }
    f.set_len(0).ok();
    use std::io::Write;
    (&f).write_all(std::process::id().to_string().as_bytes())
        .ok();
    Ok(f)
}

struct Found {
    path: PathBuf,
    dev: FileDevice,
    sb: Superblock,
}

/// Whether the devices' newest superblock is one this host committed or was committing
/// (`anchor`); returns the anchor the next commit starts from. Devices older than the
/// host's last commit were rolled back (restored from an older copy): refused unless
/// `accept_rollback` (then also returns the devices' generation and the host's). Any other
/// generation or digest was never written by this host.
fn check_anchor(
    dir: &Path,
    newest: &Superblock,
    accept_rollback: bool,
) -> Result<(Anchor, Option<(u64, u64)>)> {
    let at = (newest.generation, anchor::digest(newest));
    let start = |seq: u64, nonce_reserved: u64| Anchor {
        seq,
        pool_id: newest.pool_id,
        committed: at,
        next: (0, [0; 32]),
        nonce_reserved: nonce_reserved.max(newest.nonce_reserved),
    };
    let Some(a) = anchor::read(dir)? else {
        // Pools made before anchors existed: trust the devices once, and anchor them now.
        tracing::warn!(
            generation = newest.generation,
            "no {} in the pool directory: trusting the devices at generation {}; the import \
             writes one",
            anchor::FILE_NAME,
            newest.generation
        );
        return Ok((start(0, 0), None));
    };
    if a.pool_id != newest.pool_id {
        return Err(Error::Invalid(format!(
            "{} belongs to pool {}, not to pool {} on these devices; move it away if the \
             directory now holds another pool",
            anchor::path(dir).display(),
            to_hex(&a.pool_id),
            to_hex(&newest.pool_id)
        )));
    }
    if a.allows(&at) {
        return Ok((start(a.seq, a.nonce_reserved), None));
    }
    let last = a.committed.0.max(a.next.0);
    let what = if at.0 < a.committed.0 {
        format!(
            "the devices are at generation {}, but this host committed generation {}: the \
             host's side is newer; the devices were rolled back (restored from an older \
             copy?) or their newest labels damaged",
            at.0, a.committed.0
        )
    } else {
        format!(
            "the devices are at generation {}, which this host never wrote (it last wrote \
             generation {last}): they were changed by someone else, or another host served \
             the pool since (then that host holds the newer state)",
            at.0
        )
    };
    if accept_rollback {
        tracing::warn!(
            devices = at.0,
            host = last,
            "{what}; taking them as they are (--accept-rollback)"
        );
        return Ok((start(a.seq, a.nonce_reserved), Some((at.0, last))));
    }
    Err(Error::Corrupt(format!(
        "{what}. To keep the newer state (generation {last}), put back the devices that \
         hold it and run 'bulwark serve {}' again; nothing was changed. 'bulwark serve \
         --accept-rollback' would instead take generation {} and drop every commit this host \
         made after it (up to generation {last}) and the writes they held ({})",
        dir.display(),
        at.0,
        anchor::path(dir).display()
    )))
}

/// A format 1 pool is read only by `bulwark pool upgrade`.
fn format_1_refusal(dir: &Path) -> Error {
    Error::Invalid(format!(
        "pool at {} is format 1 (labels and metadata not authenticated); this bulwark serves \
         format {} only. Upgrade it in place with 'bulwark pool upgrade {}' (scrub it first: \
         the upgrade authenticates the pool as it finds it), or copy its volumes out with an \
         older bulwark",
        dir.display(),
        super::format::superblock::VERSION,
        dir.display()
    ))
}

/// No `DIR/pool.key`: a format 1 pool (say how to upgrade) or a lost key (say where it goes).
fn missing_key(dir: &Path, key_path: &Path, opened: &[(PathBuf, FileDevice)]) -> Error {
    // Anyone can write a format 1 label (its checksum is unkeyed): only a pool none of
    // whose labels is format 2 is called format 1, else the key is missing, never "upgrade
    // it" or "use an older bulwark" (which would read the forged labels).
    let mut formats: Vec<u32> = Vec::new();
    let mut buf = vec![0u8; SUPERBLOCK_BYTES];
    for (_, d) in opened {
        for off in SUPERBLOCK_SLOT_OFFSETS {
            if d.read_at(&mut buf, off).is_ok() {
                if let Ok(Some(sb)) = Superblock::decode(&buf, Check::Unkeyed) {
                    formats.push(sb.format);
                }
            }
        }
    }
    let v1 = !formats.is_empty()
        && formats
            .iter()
            .all(|&f| f == super::format::superblock::VERSION_1);
    if v1 {
        return format_1_refusal(dir);
    }
    Error::NotFound(format!(
        "{} is missing: a format {} pool's labels and metadata are authenticated by it, and \
         nothing on the devices can replace it. Restore it from your backup (docs/runbook.md, \
         'The pool key')",
        key_path.display(),
        super::format::superblock::VERSION
    ))
}

/// No label of the pool verified under its key: say whether the key is wrong or the labels
/// were altered (every slot's own error, as `best_superblock` logged them).
fn unauthenticated(pool_id: &str, key: &SbKey, listed: &[PathBuf]) -> Error {
    let mut wrong_key = 0;
    let mut altered = 0;
    let mut missing = Vec::new();
    let mut buf = vec![0u8; SUPERBLOCK_BYTES];
    for p in listed {
        let d = match FileDevice::open(p) {
            Ok(d) => d,
            Err(e) => {
                missing.push(format!("{} ({e})", p.display()));
                continue;
            }
        };
        let back = best_superblock(&d, None, Check::Unkeyed)
            .map(|sb| back_region_of(&sb))
            .or_else(|| find_back_region(&d, Check::Unkeyed, true));
        let offsets = match back {
            Some(b) => Superblock::all_slot_offsets(b).to_vec(),
            None => SUPERBLOCK_SLOT_OFFSETS.to_vec(),
        };
        for off in offsets {
            if d.read_at(&mut buf, off).is_err() {
                continue;
            }
            let sb = match Superblock::decode(&buf, Check::Unkeyed) {
                Ok(Some(sb)) => sb,
                // A label's magic, but fields no bulwark writes: altered or damaged.
                Err(_) => {
                    altered += 1;
                    continue;
                }
                Ok(None) => continue,
            };
            // A format 1 label in a pool that has a key was written without it.
            if sb.format == super::format::superblock::VERSION_1
                || Superblock::key_matches(&buf, key)
            {
                altered += 1;
            } else {
                wrong_key += 1;
            }
        }
    }
    if !listed.is_empty() && missing.len() == listed.len() {
        // Not damage: nothing was there to read (docs/runbook.md promises these words).
        Error::NotFound(format!(
            "every device of the pool is missing: no device of pool {pool_id} opens: {}; check \
             the paths in pool.json and that the disks are attached (docs/runbook.md)",
            missing.join(", ")
        ))
    } else if wrong_key == 0 && altered == 0 && !missing.is_empty() {
        Error::Corrupt(format!(
            "no label of pool {pool_id} can be read: {} missing, and every label slot of \
             the others is damaged or wiped",
            missing.join(", ")
        ))
    } else if wrong_key == 0 && altered == 0 {
        Error::Corrupt(format!(
            "no label of pool {pool_id} on {listed:?} can be read: every label slot (two at \
             each device's start, two at its end) is damaged or wiped"
        ))
    } else if wrong_key > 0 && altered == 0 {
        Error::Invalid(format!(
            "no label of pool {pool_id} matches pool.key: it is another pool's key (restore \
             this pool's from your backup)"
        ))
    } else {
        Error::Corrupt(format!(
            "no label of pool {pool_id} on {listed:?} verifies under pool.key ({altered} \
             slots altered or damaged, {wrong_key} under another key): refusing to import \
             labels that were not written with this pool's key"
        ))
    }
}

/// Label slots on `paths` that name pool `pool_id` but fail authentication under `key`.
fn altered_slots(paths: &[PathBuf], pool_id: &[u8; 16], key: &SbKey) -> usize {
    let mut n = 0;
    let mut buf = vec![0u8; SUPERBLOCK_BYTES];
    for p in paths {
        let Ok(d) = FileDevice::open(p) else { continue };
        let Some(front) = best_superblock(&d, None, Check::Unkeyed) else {
            continue;
        };
        let mut offsets = SUPERBLOCK_SLOT_OFFSETS.to_vec();
        offsets.extend(
            SUPERBLOCK_SLOT_OFFSETS
                .iter()
                .map(|o| back_region_of(&front) + o),
        );
        for off in offsets {
            if d.read_at(&mut buf, off).is_err() {
                continue;
            }
            if matches!(Superblock::decode(&buf, Check::Unkeyed), Ok(Some(sb)) if &sb.pool_id == pool_id)
                && Superblock::decode(&buf, Check::Key(key)).is_err()
            {
                n += 1;
            }
        }
    }
    n
}

/// Why a pool marked exported is not served: `bulwark pool import` takes it back.
fn exported_refusal(dir: &Path, name: &str) -> Error {
    Error::Invalid(format!(
        "pool {name} was exported ('bulwark pool export'): it is not served until \
         'bulwark pool import --dir {}' takes it back (on this host or another)",
        dir.display()
    ))
}

pub fn import(dir: &Path, opts: &OpenOptions) -> Result<Core> {
    let conf = PoolConfig::read(dir)?;
    let conf_name = conf.name.clone().unwrap_or_else(|| conf.pool_id.clone());
    if conf.exported && !opts.take_exported {
        return Err(exported_refusal(dir, &conf_name));
    }
    let pool_id: [u8; 16] = crate::hex::from_hex(&conf.pool_id)
        .and_then(|v| v.try_into().ok())
        .ok_or_else(|| {
            Error::Corrupt(format!(
                "pool.json has a malformed pool id '{}'",
                conf.pool_id
            ))
        })?;
    let listed = conf.resolve(dir);
    let mut opened: Vec<(PathBuf, FileDevice)> = Vec::new();
    for p in &listed {
        match FileDevice::open(p) {
            Ok(d) => opened.push((p.clone(), d)),
            Err(e) => tracing::warn!("device {} cannot be opened: {e}", p.display()),
        }
    }
    // A pool with an object store is never opened without it: every commit publishes.
    let tier_open = match (&opts.tier, &conf.object_store) {
        (Some(t), _) => Some(t.clone()),
        (None, Some(os)) => Some(super::tier::open_configured(dir, os)?),
        (None, None) => None,
    };
    if let Some(t) = tier_open.as_ref().filter(|t| !t.create) {
        super::tier::catch_up(dir, t, &pool_id, &opened)?;
    }
    // Members renamed or moved inside the pool directory are found by their labels.
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            let is_file = e.file_type().map(|t| t.is_file()).unwrap_or(false);
            let known = opened.iter().any(|(q, _)| q == &p);
            let name = e.file_name();
            let meta_file = name.to_str().is_some_and(|n| {
                n.starts_with("pool.") || n.starts_with('.') || n.ends_with(".log")
            });
            if is_file
                && !known
                && !meta_file
                && e.metadata()
                    .map(|m| m.len() >= DEVICE_BYTES_MIN)
                    .unwrap_or(false)
            {
                if let Ok(d) = FileDevice::open(&p) {
                    opened.push((p, d));
                }
            }
        }
    }
    // The pool key: only labels that carry its MAC are read (format 2, decision 0011).
    let key_path = super::format::config::key_path(dir);
    // With a key, only labels under it are read, also by an upgrade: format 1 labels in a
    // pool that has a key were written without it (altered), or an upgrade was cut short
    // before its first commit.
    let pool_key = if key_path.exists() {
        Some(PoolKey::load(&key_path)?)
    } else if opts.upgrade {
        None
    } else {
        return Err(missing_key(dir, &key_path, &opened));
    };
    let sb_key: Option<SbKey> = pool_key.as_ref().map(|k| k.superblock_key(&pool_id));
    let check = match &sb_key {
        Some(k) => Check::Key(k),
        None => Check::Unkeyed,
    };
    // Front slots first: they tell where the back slots are.
    let spd = opened
        .iter()
        .filter_map(|(_, d)| best_superblock(d, None, check))
        .map(|sb| sb.segments_per_device)
        .max();
    let back = spd.map(|s| DEVICE_RESERVED_FRONT + s * SEGMENT_BYTES);
    let mut found: Vec<Found> = Vec::new();
    let mut v1_members: Vec<Found> = Vec::new();
    for (path, dev) in opened {
        let listed_here = listed.contains(&path);
        // A device none of whose labels verify: another pool's (say so), or this pool's
        // with labels altered or damaged (not used: it may say anything).
        let label = label_front_or_back(&dev, back, check, true).or_else(|| {
            let sb = label_front_or_back(&dev, back, Check::Unkeyed, true)?;
            if to_hex(&sb.pool_id) == conf.pool_id
                && sb.format == super::format::superblock::VERSION_1
            {
                // Perhaps a member an upgrade had not reached when it stopped: taken below
                // only if it is exactly one generation behind a label that verifies.
                v1_members.push(Found {
                    path: path.clone(),
                    dev: FileDevice::open(&path).ok()?,
                    sb,
                });
                None
            } else if to_hex(&sb.pool_id) == conf.pool_id {
                tracing::warn!(
                    device = %path.display(),
                    "no label of this device verifies under the pool key: altered or damaged, \
                     not used"
                );
                None
            } else {
                Some(sb)
            }
        });
        match label {
            Some(sb) if to_hex(&sb.pool_id) == conf.pool_id => found.push(Found { path, dev, sb }),
            Some(sb) if listed_here => {
                return Err(Error::Invalid(format!(
                "device {} belongs to another pool ({}), not to this one ({}); remove it from {}",
                path.display(),
                to_hex(&sb.pool_id),
                conf.pool_id,
                dir.join(super::format::config::CONFIG_FILE).display()
            )))
            }
            None if listed_here => {
                tracing::warn!("device {} carries no bulwark label", path.display())
            }
            _ => {}
        }
    }
    let newest = found
        .iter()
        .max_by_key(|f| f.sb.generation)
        .map(|f| f.sb.clone());
    // An upgrade that stopped in its first commit: members it had written carry format 2
    // labels of generation g+1, the others still format 1 labels of g. Those are members
    // one generation behind, as after any commit cut short (their contents are checked
    // through the tree of the newest label like any member's); the next commit writes
    // their format 2 labels.
    if let Some(n) = newest
        .as_ref()
        .filter(|n| n.format == super::format::superblock::VERSION)
    {
        for f in v1_members.drain(..) {
            if f.sb.generation + 1 == n.generation && n.member_ids.contains(&f.sb.device_id) {
                tracing::warn!(
                    device = %f.path.display(),
                    "device still carries format 1 labels (an upgrade stopped before it \
                     reached it): taken one generation behind; the next commit writes its \
                     format 2 labels"
                );
                found.push(f);
            }
        }
    }
    let newest = newest.ok_or_else(|| match &sb_key {
        Some(_) if opts.upgrade => Error::Invalid(format!(
            "{} exists, but no label verifies under it: the labels were written without \
                 this key (altered on the devices), or an upgrade was interrupted before it \
                 wrote any label. Only in the latter case: move that file away and run the \
                 upgrade again",
            key_path.display()
        )),
        Some(k) => unauthenticated(&conf.pool_id, k, &listed),
        None => Error::NotFound(format!(
            "no device of pool {} could be read: {:?}",
            conf.pool_id, listed
        )),
    })?;
    if newest.format == super::format::superblock::VERSION_1 && !opts.upgrade {
        return Err(format_1_refusal(dir));
    }
    if newest.format == super::format::superblock::VERSION && opts.upgrade {
        return Err(Error::Invalid(format!(
            "pool {} is already format {}: nothing to upgrade",
            conf_name,
            super::format::superblock::VERSION
        )));
    }
    // The upgrade makes the pool key now (kept if an interrupted upgrade made it), and
    // the import's commit writes the first authenticated labels.
    let (pool_key, sb_key) = match (pool_key, sb_key) {
        (Some(k), Some(s)) => (k, s),
        _ => {
            let k = PoolKey::create(&key_path)?;
            let s = k.superblock_key(&pool_id);
            (k, s)
        }
    };
    let log_key = pool_key.log_key(&pool_id);
    if newest.exported && !opts.take_exported {
        let name = if newest.name.is_empty() {
            &conf_name
        } else {
            &newest.name
        };
        return Err(exported_refusal(dir, name));
    }
    let mut members: Vec<Member> = Vec::new();
    let mut faults: Vec<Option<Arc<FaultyDevice>>> = Vec::new();
    let mut stale: Vec<String> = Vec::new();
    let mut paths_changed = false;
    // Two devices with one member's label: a `cp` or `dd` of one over the other. One is
    // used as that member; the other member is then missing, and the copy is why.
    let copies: String = found
        .iter()
        .enumerate()
        .filter_map(|(k, f)| {
            let first = found[..k]
                .iter()
                .find(|g| g.sb.device_id == f.sb.device_id)?;
            Some(format!(
                "; {} and {} carry the same member's label (one is a copy of the other), and \
                 only one of them is used",
                first.path.display(),
                f.path.display()
            ))
        })
        .collect();
    for (i, id) in newest.member_ids.iter().enumerate() {
        let pos = found.iter().position(|f| &f.sb.device_id == id);
        match pos {
            Some(pos) => {
                let mut f = found.swap_remove(pos);
                // A member that cannot be used as it is: its copies would be wrong or
                // out of reach. Mirror and parity pools run without it (DEGRADED).
                let unusable = if f.dev.size() < newest.device_bytes {
                    // Truncated, or a volume shrunk under it: its end (back labels, the
                    // last segments) is gone, and writes there would fail or grow a file.
                    Some(format!(
                        "device {} is smaller than this pool's devices ({} < {}): it was truncated or shrunk, \
                         and is not used; restore its size, or replace it with 'bulwark device replace'",
                        f.path.display(),
                        crate::size::format_size(f.dev.size()),
                        crate::size::format_size(newest.device_bytes)
                    ))
                } else if f.sb.generation + 1 < newest.generation {
                    Some(format!(
                        "device {} is a stale member of this pool (generation {}, the pool is at {}): it missed writes \
                         and is not used; bring it back with 'bulwark device online' (resilver) or replace it",
                        f.path.display(),
                        f.sb.generation,
                        newest.generation
                    ))
                } else {
                    None
                };
                if let Some(msg) = unusable {
                    if newest.layout == crate::redundancy::Layout::Single {
                        return Err(Error::Invalid(msg));
                    }
                    tracing::warn!("{msg}");
                    stale.push(msg);
                    faults.push(None);
                    members.push(Member::new(f.path, None));
                    continue;
                }
                if listed.get(i) != Some(&f.path) {
                    paths_changed = true;
                }
                f.dev.claim()?;
                let faulty = Arc::new(FaultyDevice::new(Box::new(f.dev), back_region_of(&newest)));
                faults.push(Some(faulty.clone()));
                members.push(Member::new(f.path, Some(faulty)));
            }
            None => {
                let guess = listed
                    .get(i)
                    .cloned()
                    .unwrap_or_else(|| PathBuf::from(format!("<member {i}>")));
                if newest.layout == crate::redundancy::Layout::Single {
                    return Err(Error::NotFound(format!(
                        "device {} (member {i} of {}) is missing; a single-layout pool cannot run without it{copies}",
                        guess.display(),
                        newest.member_count
                    )));
                }
                tracing::warn!(
                    "device {} (member {i}) is missing: the pool is DEGRADED{copies}",
                    guess.display()
                );
                faults.push(None);
                members.push(Member::new(guess, None));
            }
        }
    }
    let present = members.iter().filter(|m| m.present()).count();
    // Members 'bulwark device offline' took out (pool.json) stay out. An offline member
    // gets no superblocks, so when the pool cannot run without it, it is not used
    // silently: its copies are as old as its going offline, and whatever was written
    // since is on the members that are gone. The admin decides, as with zpool.
    let offline: Vec<bool> = (0..members.len())
        .map(|i| conf.offline.contains(&to_hex(&newest.member_ids[i])))
        .collect();
    // An upgrade writes every member's labels: a member missing, stale or offline would
    // keep format 1 labels that no later import reads.
    if opts.upgrade && (!stale.is_empty() || offline.iter().any(|&o| o) || present < members.len())
    {
        return Err(Error::Invalid(
            "the upgrade needs every member of the pool present and online: bring the \
             missing, stale or offline devices back first (with the bulwark that made the \
             pool: 'bulwark device online' or a resilver)"
                .into(),
        ));
    }
    // A single pool with a member missing still imports (DEGRADED, its records there
    // unreadable), as before: one usable member is enough to start.
    let needed = newest.layout.members_needed(1);
    let usable = members
        .iter()
        .zip(&offline)
        .filter(|(m, &off)| m.present() && !off)
        .count();
    if usable < needed && present >= needed {
        let held: Vec<String> = members
            .iter()
            .enumerate()
            .filter(|(i, m)| offline[*i] && m.present())
            .map(|(i, m)| {
                format!(
                    "{} (member {i}, id {})",
                    m.path().display(),
                    to_hex(&newest.member_ids[i])
                )
            })
            .collect();
        return Err(Error::Invalid(format!(
            "the pool cannot run: the devices it could use are offline ('bulwark device offline'): {}, \
             and the others are missing or stale{}. Bring the others back and start again; or, to run from \
             the offline devices as they were when they went offline (what was written since is lost), \
             remove their ids from \"offline\" in {}",
            held.join(", "),
            stale.iter().map(|s| format!("; {s}")).collect::<String>(),
            dir.join(super::format::config::CONFIG_FILE).display()
        )));
    }
    if let crate::redundancy::Layout::Parity { k, m } = newest.layout {
        if present < k as usize {
            return Err(Error::NotFound(format!(
                "{} of the {} devices of this parity:{k}+{m} pool are missing or stale; at most {m} may be{}",
                members.len() - present,
                members.len(),
                stale.iter().map(|s| format!("; {s}")).collect::<String>()
            )));
        }
    }
    if present == 0 && !stale.is_empty() {
        return Err(Error::Invalid(stale.join("; ")));
    }
    if present == 0 {
        return Err(Error::NotFound(
            "every device of the pool is missing".into(),
        ));
    }
    if paths_changed {
        let mut c = conf.clone();
        c.devices = members
            .iter()
            .map(|m| {
                m.path()
                    .strip_prefix(dir)
                    .map(Path::to_path_buf)
                    .unwrap_or(m.path())
            })
            .collect();
        c.write(dir)?;
    }

    for (i, m) in members.iter().enumerate() {
        if offline[i] {
            m.offline.store(true, Ordering::Release);
            tracing::warn!(
                "device {} (member {i}) is offline, as 'bulwark device offline' left it: the pool is DEGRADED \
                 until 'bulwark device online'",
                m.path().display()
            );
        }
    }
    // After the checks of which members are here (a more precise reason to refuse, such
    // as an offline device alone): are these devices at a generation this host wrote?
    let (anchor, rollback_accepted) =
        check_anchor(dir, &newest, opts.accept_rollback).map_err(|e| match e {
            // The newest labels may have been altered, not rolled back: then say so.
            Error::Corrupt(m) => match altered_slots(&listed, &pool_id, &sb_key) {
                0 => Error::Corrupt(m),
                n => Error::Corrupt(format!(
                    "{m}. Note: {n} label slot(s) of this pool fail authentication under \
                     pool.key and were ignored: the newest labels were altered or damaged on \
                     the devices, which is not a rollback"
                )),
            },
            e => e,
        })?;
    let red = Redundancy::new(newest.layout, members, newest.segments_per_device);
    let segments = red.segments() as usize;
    let cache = new_cache(opts.cache_bytes);
    // Metadata is read through the data plane before its log is known: a log with every
    // segment taken (nothing is placed during the walk), replaced once the walk counted
    // the live bytes of every segment.
    let mut store = Store::new(
        red,
        Log::new(vec![0; segments], 0, true),
        cache,
        // Above every nonce the host ever reserved, not only what these devices say.
        anchor.nonce_reserved,
    );
    let table = if newest.root.is_hole() {
        TableRecord::empty()
    } else {
        TableRecord::open(&store.read_meta(&newest.root, 0)?, &newest.table_key)?
    };
    if table.format > super::format::table::TABLE_FORMAT_MAX {
        return Err(Error::Invalid(format!(
            "the pool's volume table is format {}, newer than this bulwark reads (up to {}): \
             upgrade bulwark",
            table.format,
            super::format::table::TABLE_FORMAT_MAX
        )));
    }
    let mut live = vec![0u32; segments];
    let footprint = |len: usize| store.red.footprint(len);
    let mut complete = true;
    // Ranges of volumes (or `VOL@SNAP`) under a map node no copy of which verifies: listed
    // in `status` at once, as a scrub would list them, not only after one.
    let mut map_errors: Vec<super::scrub::DataError> = Vec::new();
    let count = |p: &Blkptr, live: &mut Vec<u32>| {
        for &a in p.addrs() {
            if let Some(l) = live.get_mut(segment_of(a) as usize) {
                // Saturating: forged pointers (or a forged intent log) naming one segment
                // many times must not wrap its count.
                *l = l.saturating_add(footprint(p.len as usize) as u32);
            }
        }
    };
    count(&newest.root, &mut live);
    // Segments holding client data: emptying them counts toward an early commit (`Log`).
    let mut data_segments = vec![false; segments];
    let mut volumes = BTreeMap::new();
    /// The origin volume of `rec`, when `n` is `rec` itself.
    fn f_origin_name<'a>(rec: &'a super::format::table::VolumeRecord, n: &str) -> Option<&'a str> {
        (rec.name == n)
            .then(|| rec.origin.as_ref().map(|o| o.volume.as_str()))
            .flatten()
    }
    // Every volume's trees first, so a clone's base can be walked against its origin.
    struct Family<'a> {
        rec: &'a super::format::table::VolumeRecord,
        opts: crate::volume::VolumeOptions,
        snaps: Vec<crate::volume::snap::Snap>,
        tree: Tree,
        used: u64,
    }
    let mut families: Vec<Family> = Vec::with_capacity(table.volumes.len());
    let walk_started = std::time::Instant::now();
    for rec in &table.volumes {
        let opts = rec.options()?;
        let root = ptr_from_hex(&rec.root)?;
        let blocks = rec.size_bytes / rec.block_size as u64;
        let depth = depth_for(blocks);
        let mut snaps = Vec::with_capacity(rec.snapshots.len());
        for s in &rec.snapshots {
            let root = ptr_from_hex(&s.root)
                .map_err(|e| e.within(format!("snapshot '{}@{}'", rec.name, s.name)))?;
            let size_bytes = rec.snapshot_bytes(s)?;
            let depth = depth_for(size_bytes / rec.block_size as u64);
            snaps.push(crate::volume::snap::Snap {
                size_bytes,
                base: s.base,
                name: s.name.clone(),
                created: s.created,
                holds: s.holds.iter().cloned().collect(),
                referenced: s.referenced,
                tree: Tree::new(s.id, depth, root),
            });
        }
        let tree = Tree::new(rec.id, depth, root);
        families.push(Family {
            rec,
            opts,
            snaps,
            tree,
            used: 0,
        });
    }
    // Origins before their clones (a clone is always younger: a larger id).
    families.sort_by_key(|f| f.rec.id);
    for fi in 0..families.len() {
        let (done, rest) = families.split_at_mut(fi);
        let f = &mut rest[0];
        let rec = f.rec;
        // A clone's base is walked against the origin snapshot it copies, and against the
        // bases of the origin's older clones (copies of it too): what they share is
        // counted once.
        let origin: Option<(&Tree, u64)> = rec.origin.as_ref().and_then(|o| {
            let of = done.iter().find(|d| d.rec.name == o.volume)?;
            let s = of.snaps.iter().find(|s| !s.base && s.name == o.snapshot)?;
            Some((&s.tree, s.referenced))
        });
        // ... and every tree of the volumes of its clone graph counted before it: a record
        // shared across clones is counted once, by the first of them.
        let siblings: Vec<&Tree> = match &rec.origin {
            Some(_) => {
                let mut names: Vec<&str> = vec![rec.name.as_str()];
                let mut i = 0;
                while i < names.len() {
                    let n = names[i];
                    for d in done.iter() {
                        let o = d.rec.origin.as_ref().map(|o| o.volume.as_str());
                        let mine = f_origin_name(rec, n);
                        let next = if o == Some(n) {
                            Some(d.rec.name.as_str())
                        } else if d.rec.name == n {
                            o
                        } else if mine == Some(d.rec.name.as_str()) {
                            Some(d.rec.name.as_str())
                        } else {
                            None
                        };
                        if let Some(x) = next {
                            if !names.contains(&x) {
                                names.push(x);
                            }
                        }
                    }
                    i += 1;
                }
                done.iter()
                    .filter(|d| names.contains(&d.rec.name.as_str()))
                    .flat_map(|d| d.snaps.iter().map(|s| &s.tree).chain([&d.tree]))
                    .filter(|t| origin.is_none_or(|o| !std::ptr::eq(*t, o.0)))
                    .collect()
            }
            None => Vec::new(),
        };
        if rec.origin.is_some() && origin.is_none() {
            return Err(Error::Corrupt(format!(
                "volume table: clone '{}' names an origin snapshot that is not there",
                rec.name
            )));
        }
        // Each tree is walked against the one before it: a record shared by several is
        // counted once, in the oldest that holds it (`volume::snap`). What each tree
        // references follows from the one before: plus what it adds, minus what it dropped.
        let trees: Vec<&Tree> = f.snaps.iter().map(|s| &s.tree).chain([&f.tree]).collect();
        let mut referenced = Vec::with_capacity(trees.len());
        let mut walked = Ok(());
        for (k, t) in trees.iter().enumerate() {
            let prev: Vec<&Tree> = match k.checked_sub(1) {
                Some(j) => vec![trees[j]],
                None => origin
                    .iter()
                    .map(|o| o.0)
                    .chain(siblings.iter().copied())
                    .collect(),
            };
            let mut added = 0u64;
            let tree_name = match f.snaps.get(k) {
                Some(s) if !s.base => Some(format!("{}@{}", rec.name, s.name)),
                Some(_) => None,
                None => Some(rec.name.clone()),
            };
            walked = t.walk_unique(&store, &store.cache, &prev, &mut |v| {
                match v {
                    Visit::Unreadable {
                        error,
                        level,
                        index,
                    } => {
                        if let Some(name) = &tree_name {
                            let bs = rec.block_size as u64;
                            let span = 1u64 << (MAP_FANOUT_SHIFT * (level as u32 + 1));
                            let offset = (index * span * bs).min(rec.size_bytes);
                            map_errors.push(super::scrub::DataError {
                                volume: name.clone(),
                                offset,
                                length: (span * bs).min(rec.size_bytes - offset),
                                kind: super::scrub::DataErrorKind::Map,
                                seen_epoch: 0,
                            });
                        }
                        return Err(Error::Corrupt(error.to_string()));
                    }
                    Visit::Node { ptr, .. } => {
                        store.red.check_record(ptr.addrs(), ptr.len as usize)?;
                        count(ptr, &mut live)
                    }
                    Visit::Data { ptr, .. } => {
                        // A pointer past the pool would be counted nowhere, or overflow a
                        // segment's count: the walk stops, and nothing is reclaimed.
                        store.red.check_record(ptr.addrs(), ptr.len as usize)?;
                        count(ptr, &mut live);
                        for &a in ptr.addrs() {
                            if let Some(d) = data_segments.get_mut(segment_of(a) as usize) {
                                *d = true;
                            }
                        }
                        added += ptr.len as u64;
                    }
                }
                Ok(())
            });
            if walked.is_err() {
                break;
            }
            let dropped = match prev.first() {
                Some(p) => {
                    match crate::volume::snap::unique_data_bytes(&store, &store.cache, p, &[t]) {
                        Ok(b) => b,
                        Err(e) => {
                            walked = Err(e);
                            break;
                        }
                    }
                }
                None => 0,
            };
            let before = match (k, origin) {
                (0, Some((_, r))) => r,
                (0, None) => 0,
                _ => referenced.last().copied().unwrap_or(0u64),
            };
            referenced.push((before + added).saturating_sub(dropped));
        }
        if walked.is_ok() {
            f.used = referenced.last().copied().unwrap_or(0);
            for (s, r) in f.snaps.iter_mut().zip(&referenced) {
                if s.referenced != *r {
                    tracing::warn!(
                        volume = rec.name,
                        snapshot = s.name,
                        table = s.referenced,
                        counted = r,
                        "snapshot's referenced bytes recounted"
                    );
                    s.referenced = *r;
                }
            }
        }
        if let Err(e) = walked {
            tracing::error!(volume = rec.name, "cannot walk the block map ({e}); space will not be reclaimed until this is repaired");
            complete = false;
        }
    }
    tracing::info!(
        volumes = families.len(),
        seconds = format!("{:.2}", walk_started.elapsed().as_secs_f64()),
        "space accounting rebuilt: every block map walked"
    );
    let mut errors = table.errors.clone();
    for mut e in map_errors {
        if !errors
            .iter()
            .any(|x| (&x.volume, x.offset, x.length) == (&e.volume, e.offset, e.length))
        {
            e.seen_epoch = table.scrub.epoch;
            errors.push(e);
        }
    }
    // The separate log devices the superblock names, found among pool.json's by label.
    let logdev = if newest.log_devices.is_empty() {
        for p in conf.resolve_log(dir) {
            tracing::warn!(
                "{} is listed as a log device in pool.json, but the pool does not use it \
                 (a 'bulwark pool log' change that did not finish); ignored",
                p.display()
            );
        }
        None
    } else {
        let (l, problems) = super::intentlog::devices::open_all(
            &conf.resolve_log(dir),
            &newest.log_devices,
            &newest.pool_id,
        );
        for p in &problems {
            tracing::warn!("{p}");
        }
        if l.fell_back.load(Ordering::Acquire) {
            *l.note.lock() = Some(format!(
                "no log device could be used at import ({}): flushes commit or use the main \
                 devices' log; 'bulwark pool log remove' forgets the log devices, 'bulwark \
                 pool log add' adds new ones",
                problems.join("; ")
            ));
        }
        Some(Arc::new(l))
    };
    // Replay the intent log: the flushed client writes after the last commit.
    let mut chain_slots: Vec<Blkptr> = Vec::new();
    // Records replayed entries replaced: the committed generation still points at them
    // until the import's own commit, so they are released only after it.
    let mut replaced: Vec<Blkptr> = Vec::new();
    let mut replayed = (0u64, 0usize);
    // The records the replay put back in the maps: with an object store, uploaded by the
    // import's commit (the process that wrote them died before its own could).
    let mut replayed_records: Vec<Blkptr> = Vec::new();
    // The replay stopped at something other than the log's end: said as a warning.
    let mut alarm = false;
    // Format 1 chains (no MAC) are replayed only by `pool upgrade`: the labels that name
    // them were verified by their checksum, not by a key.
    let block_key = (newest.format == super::format::superblock::VERSION).then_some(&log_key);
    // Records written back from the log devices.
    let mut rewritten = 0usize;
    // The chain on the log devices, when this generation's is there and one is readable.
    let dev_chain = match (newest.log_dev_head, &logdev) {
        (Some(head), Some(l)) if l.devices.iter().any(|d| d.dev.is_some()) => {
            Some((head, l.clone()))
        }
        (Some(_), _) => {
            let msg = format!(
                "the intent log of generation {} was on the log devices, and none of them is \
                 here: the writes that FLUSHes made durable after that generation's commit \
                 (at most one commit interval of them, as of the crash) cannot be replayed and \
                 read as they were at that commit; the pool is consistent as of it",
                newest.generation
            );
            tracing::error!("{msg}");
            if let Some(l) = &logdev {
                *l.note.lock() = Some(msg);
            }
            None
        }
        (None, _) => None,
    };
    // On the log devices: the next block, in slots from the head, and the slot it lies at
    // (from the signed links: the superblock's head, then each block's `next`).
    let mut dev_at = 0u64;
    let mut dev_slot = dev_chain.as_ref().map_or(0, |(head, _)| *head);
    let main_head = newest
        .log_head
        .or(dev_chain.as_ref().map(|_| [crate::map::ADDR_NONE; 2]));
    // The loss of acknowledged flushes, found after the replay stopped: a message that
    // names what was lost (`lost_flushes`), refused without `accept_log_loss`.
    let mut log_loss: Option<String> = None;
    if let Some(head) = main_head {
        let mut at = head;
        let mut buf = Vec::new();
        // The block whose entries are being applied (a record that fails stops the replay
        // inside it), and the slot the last applied block named after its next.
        let mut stopped_in: Option<super::intentlog::block::Block> = None;
        let mut prev_after: Option<[u64; 2]> = None;
        let why = 'replay: loop {
            // The records a block on a log device carries (`logdev`), verified.
            let mut inline = Vec::new();
            let block = if let Some((_, l)) = &dev_chain {
                match l.read_block(
                    dev_slot,
                    dev_at,
                    &newest.pool_id,
                    &newest.chain_id,
                    newest.generation,
                    block_key,
                ) {
                    Ok(Some((b, data))) => {
                        inline = super::intentlog::devices::inline_records(&b, &data)
                            .into_iter()
                            .map(|r| r.map(<[u8]>::to_vec))
                            .collect();
                        dev_at += 1 + b.data_slots as u64;
                        dev_slot = b.next[0];
                        b
                    }
                    Ok(None) => break "the end of the log".to_string(),
                    Err(e) => {
                        alarm = true;
                        break format!("block {}, which is damaged ({e})", replayed.0);
                    }
                }
            } else {
                let slot = super::intentlog::block::slot_ptr(at);
                if let Err(e) = store.red.check_record(slot.addrs(), slot.len as usize) {
                    break format!("block {} has a bad address ({e})", replayed.0);
                }
                chain_slots.push(slot);
                count(&slot, &mut live);
                let (pool_id, generation, seq) = (newest.pool_id, newest.generation, replayed.0);
                let chain_id = newest.chain_id;
                // A copy with the log's magic that fails its MAC (or is malformed) was not
                // written by this pool's key: replay stops there, and says so loudly.
                let unauthentic = std::cell::Cell::new(false);
                let this_block = |b: &[u8]| match super::intentlog::block::Block::decode(
                    b, block_key, &pool_id, &chain_id, generation, seq,
                ) {
                    Ok(Some(_)) => true,
                    Ok(None) => false,
                    Err(_) => {
                        unauthentic.set(true);
                        false
                    }
                };
                match store.red.read_quiet(
                    slot.addrs(),
                    slot.len as usize,
                    &crate::checksum::SELF_CHECKED,
                    &mut buf,
                    &this_block,
                ) {
                    Ok(true) => {}
                    Ok(false) if unauthentic.get() => {
                        alarm = true;
                        break format!(
                            "block {}, which fails authentication under the pool key or is \
                             malformed (altered on the devices?): flushes made after it are \
                             not replayed",
                            replayed.0
                        );
                    }
                    Ok(false) => break "the end of the log".to_string(),
                    Err(e) => {
                        alarm = true;
                        break format!("block {}, which cannot be read ({e})", replayed.0);
                    }
                }
                let block = match super::intentlog::block::Block::decode(
                    &buf,
                    block_key,
                    &newest.pool_id,
                    &newest.chain_id,
                    newest.generation,
                    replayed.0,
                ) {
                    Ok(Some(b)) => b,
                    Ok(None) => break "the end of the log".to_string(),
                    Err(e) => {
                        alarm = true;
                        break format!("block {}, which is damaged ({e})", replayed.0);
                    }
                };
                block
            };
            stopped_in = Some(block.clone());
            for (i, e) in block.entries.iter().enumerate() {
                let Some(f) = families.iter_mut().find(|f| f.rec.id == e.volume) else {
                    break 'replay format!(
                        "block {} entry {i} names volume id {}, which the table does not have",
                        replayed.0, e.volume
                    );
                };
                let blocks = f.rec.size_bytes / f.rec.block_size as u64;
                if e.lba >= blocks {
                    break 'replay format!(
                        "block {} entry {i} is past the end of volume '{}'",
                        replayed.0, f.rec.name
                    );
                }
                if !e.ptr.is_hole() {
                    // The record must be there, whole: a flush that never returned may have
                    // left its log block durable without it.
                    if let Err(err) = store.red.check_record(e.ptr.addrs(), e.ptr.len as usize) {
                        break 'replay format!("block {} entry {i}: {err}", replayed.0);
                    }
                    let mut rec = Vec::new();
                    let on_devices = store
                        .red
                        .read_quiet(
                            e.ptr.addrs(),
                            e.ptr.len as usize,
                            &e.ptr.checksum,
                            &mut rec,
                            &|_| true,
                        )
                        .unwrap_or(false);
                    match inline.get(i) {
                        _ if on_devices => {}
                        // The log device carries it (the flush did not sync the main
                        // devices): written back where its pointer says, made durable by
                        // the import's commit. Replay again after a crash writes the same.
                        Some(Some(bytes)) => {
                            for &a in e.ptr.addrs() {
                                if let Err(err) = store.red.write(a, bytes) {
                                    break 'replay format!(
                                        "block {} entry {i}: its record cannot be written back \
                                         from the log device ({err})",
                                        replayed.0
                                    );
                                }
                            }
                            rewritten += 1;
                        }
                        _ => {
                            break 'replay format!(
                                "block {} entry {i}: the record it names is not on the devices \
                                 (a flush that never finished)",
                                replayed.0
                            )
                        }
                    }
                }
                let old = match f.tree.set(&store, &store.cache, e.lba, e.ptr) {
                    Ok(old) => old,
                    Err(err) => break 'replay format!("block {} entry {i}: {err}", replayed.0),
                };
                count(&e.ptr, &mut live);
                if !e.ptr.is_hole() {
                    replayed_records.push(e.ptr);
                }
                for &a in e.ptr.addrs() {
                    if let Some(d) = data_segments.get_mut(segment_of(a) as usize) {
                        *d = true;
                    }
                }
                f.used = (f.used + e.ptr.len as u64).saturating_sub(old.len as u64);
                let kept = crate::volume::snap::head_keeps(
                    &store,
                    &store.cache,
                    &f.snaps,
                    crate::map::At::Data(e.lba),
                    &old,
                );
                if !old.is_hole() && !kept {
                    replaced.push(old);
                }
                replayed.1 += 1;
            }
            stopped_in = None;
            replayed.0 += 1;
            prev_after = Some(block.after);
            at = block.next;
        };
        // Did the chain go on past where the replay stopped? A later block of this chain
        // written by a later flush proves that the flush the replay stopped in returned:
        // what it and every flush after it made durable is lost, not unfinished.
        let k = match (&stopped_in, &dev_chain) {
            (Some(b), _) => b.seq,
            (None, Some(_)) => dev_at,
            (None, None) => replayed.0,
        };
        let later: Vec<super::intentlog::block::Block> = match &dev_chain {
            Some((_, l)) => l.blocks_after(
                k,
                &newest.pool_id,
                &newest.chain_id,
                newest.generation,
                block_key,
            ),
            None => {
                let mut starts = Vec::new();
                match &stopped_in {
                    Some(b) => {
                        starts.push((k + 1, b.next));
                        starts.push((k + 2, b.after));
                    }
                    None => starts.extend(prev_after.map(|a| (k + 1, a))),
                }
                later_main_blocks(&store, starts, &newest, block_key)
            }
        };
        let reach = match super::format::anchor::read_reach(dir) {
            Some(r) if r.generation == newest.generation && r.chain == newest.chain_id => {
                Some(r.blocks)
            }
            _ => None,
        };
        // On the log devices a block's sequence number counts slots; `replayed.0` counts
        // blocks on the main devices. The reach record counts what `Chain::seq` counts.
        let reached = if dev_chain.is_some() {
            dev_at
        } else {
            replayed.0
        };
        let proof = later.iter().any(|b| b.proves_acknowledged(k));
        let short = reach.filter(|&r| r > reached);
        if proof || short.is_some() {
            let mut names: Vec<String> = later
                .iter()
                .flat_map(|b| b.entries.iter().map(|e| e.volume))
                .chain(
                    stopped_in
                        .iter()
                        .flat_map(|b| b.entries.iter().map(|e| e.volume)),
                )
                .filter_map(|id| families.iter().find(|f| f.rec.id == id))
                .map(|f| f.rec.name.clone())
                .collect();
            names.sort();
            names.dedup();
            let mut flushes: Vec<u64> = later
                .iter()
                .filter(|b| b.proves_acknowledged(k))
                .map(|b| b.flush_first)
                .collect();
            flushes.sort();
            flushes.dedup();
            let lost_flushes = flushes.len() + 1;
            let evidence = match (proof, short) {
                (true, _) => format!(
                    "{} later block(s) of the same chain verify under the pool key",
                    later.len()
                ),
                (false, Some(r)) => format!(
                    "the host's anchor records that the log reached {r} (it stops at {reached})"
                ),
                (false, None) => unreachable!(),
            };
            let volumes = if names.is_empty() {
                "volumes not known (the blocks that named them are gone)".to_string()
            } else {
                format!("volume(s) {}", names.join(", "))
            };
            // Not "a flush that never finished": a later flush returned after it.
            let why = why.replace(" (a flush that never finished)", "");
            log_loss = Some(format!(
                "the intent log of generation {} stops at {why}, but the chain goes on: \
                 {evidence}. At least {lost_flushes} acknowledged FLUSH(es) after block {k} \
                 are lost ({volumes}): their writes read as they were before them. The log \
                 was altered or damaged on the devices{}",
                newest.generation,
                if dev_chain.is_some() {
                    " or the log device"
                } else {
                    ""
                },
            ));
        }
        if let Some(msg) = &log_loss {
            tracing::warn!(blocks = replayed.0, entries = replayed.1, "{msg}");
            if !opts.accept_log_loss {
                return Err(Error::Corrupt(format!(
                    "{msg}. Nothing was committed. Restore the devices{} as they were, or take \
                     the pool without those flushes with 'bulwark serve --accept-log-loss' \
                     (audited)",
                    if dev_chain.is_some() {
                        " and the log device"
                    } else {
                        ""
                    },
                )));
            }
        } else if alarm {
            tracing::warn!(
                blocks = replayed.0,
                entries = replayed.1,
                "intent log replay stopped at {why}"
            );
        } else if replayed.0 > 0 {
            tracing::info!(
                blocks = replayed.0,
                entries = replayed.1,
                records_written_back = rewritten,
                "intent log replayed{}: flushed writes since generation {} restored; stopped at {why}",
                if dev_chain.is_some() { " from the log devices" } else { "" },
                newest.generation
            );
        } else {
            tracing::debug!("intent log empty: {why}");
        }
    }
    for f in families {
        let rec = f.rec;
        let st = VolumeState::new(
            rec.id,
            rec.uuid,
            rec.name.clone(),
            &f.opts,
            rec.slots.clone(),
            rec.data_keys.clone(),
            f.tree,
        );
        *st.rotation.lock() = rec.rotation.clone();
        *st.description.lock() = rec.description.clone();
        st.readonly.store(rec.readonly, Ordering::Release);
        st.thick.store(rec.thick, Ordering::Release);
        st.created.store(rec.created, Ordering::Relaxed);
        *st.origin.lock() = rec.origin.clone();
        st.deferred.store(rec.deferred, Ordering::Release);
        st.used_bytes.store(f.used, Ordering::Relaxed);
        *st.snaps.write() = f.snaps;
        volumes.insert(rec.name.clone(), Arc::new(st));
    }
    store.log = Log::new(live, newest.high_water, complete);
    store.log.set_node_bytes(store.node_record_bytes());
    for (seg, _) in data_segments.iter().enumerate().filter(|(_, &d)| d) {
        store.log.mark_data(seg as u32);
    }
    // The object store (issue 22): taken before the import's commit, which publishes.
    let tier = match &tier_open {
        Some(t) => {
            if logdev.is_some() {
                return Err(Error::Invalid(
                    "a pool with an object store has no separate log device: its flushes are \
                     durable in the store ('bulwark pool log remove' first)"
                        .into(),
                ));
            }
            let tier = Arc::new(super::tier::Tier::take(t, &sb_key, &newest)?);
            store.set_tiered();
            // A pool that had data before it had a store (`pool object-store add`): its
            // first commit uploads every segment that holds some.
            if t.create {
                let segs: Vec<u32> = (0..store.log.segments())
                    .filter(|&s| store.log.live_of(s) > 0)
                    .collect();
                if !segs.is_empty() {
                    tracing::info!(
                        segments = segs.len(),
                        "uploading the pool's data to its new object store"
                    );
                }
                for seg in segs {
                    store.note_segment(seg);
                }
            }
            for p in &replayed_records {
                store.note_record(p);
            }
            // Segments given back to the store before (or never downloaded) are read
            // from it.
            let given_back = super::evict::mark_holes(&store, &data_segments);
            if given_back > 0 {
                tracing::info!(
                    segments = given_back,
                    "local cache: segments of client data only the object store holds"
                );
            }
            // Segments freed by the last run's final commits are still in the store's
            // table: the next commit drops them (garbage collection takes their objects).
            for seg in tier.slot_segments() {
                if store.log.is_free(seg) {
                    store.log.note_freed(seg);
                }
            }
            store.set_remote(tier.clone());
            if let Some(limit) = t.cache_bytes {
                store.set_cache_limit(limit);
            }
            Some(tier)
        }
        None => None,
    };
    let core = Core {
        dir: dir.to_path_buf(),
        store: Arc::new(store),
        volumes: RwLock::new(volumes),
        anchor: Mutex::new(anchor),
        rollback_accepted,
        log_loss: log_loss.clone(),
        reach: super::format::anchor::ReachWriter::start(dir.to_path_buf()),
        sb: Mutex::new(SbState {
            // The import's commit takes the pool: it is no longer exported, and it carries
            // the name pool.json gives it (a pool made before names gets one now).
            sb: Superblock {
                // `pool upgrade`: the import's commit writes the first format 2 labels.
                format: super::format::superblock::VERSION,
                exported: false,
                name: match (&opts.rename, &conf.name) {
                    (Some(new), _) => new.clone(),
                    (None, Some(n)) if newest.name.is_empty() => n.clone(),
                    _ => newest.name.clone(),
                },
                ..newest.clone()
            },
            next_volume_id: table.next_volume_id,
            back_region: back_region_of(&newest),
        }),
        sb_key,
        log_key,
        commit_lock: Mutex::new(()),
        flush_waiters: Default::default(),
        clean_dirtied: Default::default(),
        intent: Mutex::new(None),
        // With an object store a flush is a commit, durable once the store has it, unless
        // the pool asks for local flushes (the intent log; the store lags by a commit).
        intent_log: opts.intent_log && tier_open.as_ref().is_none_or(|t| t.local_flush),
        tier,
        logdev: RwLock::new(logdev.clone()),
        device_lock: Mutex::new(()),
        commits_begun: AtomicU64::new(0),
        commits_done: AtomicU64::new(0),
        commit_failed_at: AtomicU64::new(0),
        gate_deferrals: AtomicU64::new(0),
        workers: Mutex::new(Vec::new()),
        table_dirty: AtomicBool::new(true),
        accounting_complete: complete,
        faults: RwLock::new(faults),
        allow_faults: opts.allow_fault_injection,
        table_key_next: Mutex::new(None),
        scrub: Mutex::new(table.scrub.clone()),
        errors: Mutex::new(errors.clone()),
        errors_listed: AtomicBool::new(!errors.is_empty()),
        scrub_running: AtomicBool::new(false),
        scrub_rate: AtomicU64::new(opts.scrub_rate_bytes),
        commit_interval: opts.commit_interval,
        scrub_rate_seen: AtomicU64::new(0),
        cachedev_unavailable: Mutex::new(None),
    };
    // The next chain on the log devices starts after the replayed one.
    if let (Some(_), Some(l)) = (&dev_chain, &logdev) {
        l.state.lock().next_head = dev_slot % l.slots.max(1);
    }
    // The replayed chain's slots stay counted until the import's commit replaces it.
    if !chain_slots.is_empty() {
        *core.intent.lock() = Some(super::intentlog::block::Chain {
            generation: newest.generation,
            seq: replayed.0,
            next: [crate::map::ADDR_NONE; 2],
            after: None,
            slots: chain_slots,
        });
    }
    for v in core.volumes.read().values() {
        core.store
            .note_dirty(&v.dirty_nodes, v.tree.lock().dirty_nodes());
    }
    // Reserve a fresh nonce range and bring every member's superblock to one generation.
    core.commit()?;
    for p in &replaced {
        core.store.release(p);
    }
    attach_cachedev(&core, &conf, opts, &newest.pool_id);
    // Crash points count from here: this commit is the import's, not an operation's.
    crate::crashpoint::arm();
    tracing::info!(
        pool = conf.pool_id,
        generation = core.sb.lock().sb.generation,
        volumes = table.volumes.len(),
        "pool imported"
    );
    Ok(core)
}

/// Open the cache device (`serve --cache-device`, else the one `pool.json` names) and let
/// the data plane use it. One that is missing or refused is warned about and shown in
/// `status` as UNAVAIL: the pool serves without it (it holds only copies).
/// The blocks of `newest`'s chain on the main devices reachable from `starts` (each a
/// sequence number and the slot that block would lie at), following every block's `next`
/// and `after`: what lies past a block the replay could not apply. Bounded by
/// `LATER_BLOCKS_MAX` reads.
fn later_main_blocks(
    store: &Store,
    starts: Vec<(u64, [u64; 2])>,
    newest: &Superblock,
    key: Option<&super::intentlog::block::LogKey>,
) -> Vec<super::intentlog::block::Block> {
    const LATER_BLOCKS_MAX: usize = 1 << 16;
    let mut todo = starts;
    let mut seen = std::collections::HashSet::new();
    let mut found = std::collections::BTreeMap::new();
    let mut buf = Vec::new();
    while let Some((seq, slot)) = todo.pop() {
        if seen.len() >= LATER_BLOCKS_MAX || !seen.insert((seq, slot)) || found.contains_key(&seq) {
            continue;
        }
        let ptr = super::intentlog::block::slot_ptr(slot);
        if slot[0] == crate::map::ADDR_NONE
            || store
                .red
                .check_record(ptr.addrs(), ptr.len as usize)
                .is_err()
        {
            continue;
        }
        let decode = |b: &[u8]| {
            super::intentlog::block::Block::decode(
                b,
                key,
                &newest.pool_id,
                &newest.chain_id,
                newest.generation,
                seq,
            )
        };
        let ok = store.red.read_quiet(
            ptr.addrs(),
            ptr.len as usize,
            &crate::checksum::SELF_CHECKED,
            &mut buf,
            &|b| matches!(decode(b), Ok(Some(_))),
        );
        if !matches!(ok, Ok(true)) {
            continue;
        }
        if let Ok(Some(b)) = decode(&buf) {
            todo.push((seq + 1, b.next));
            todo.push((seq + 2, b.after));
            found.insert(seq, b);
        }
    }
    found.into_values().collect()
}

fn attach_cachedev(core: &Core, conf: &PoolConfig, opts: &OpenOptions, pool_id: &[u8; 16]) {
    let Some(path) = opts
        .cache_device
        .clone()
        .or_else(|| conf.cache_device_path(&core.dir))
    else {
        return;
    };
    let uuid = crate::keys::wrap::random_bytes::<16>();
    match crate::cachedev::CacheDevice::open(&path, *pool_id, uuid) {
        Ok(c) => {
            tracing::info!(device = %path.display(), "cache device in use");
            core.store.set_cachedev(c);
        }
        Err(e) => {
            tracing::warn!(
                device = %path.display(),
                "cache device not in use: {e}; the pool serves without it"
            );
            *core.cachedev_unavailable.lock() = Some(
                crate::cachedev::CacheDeviceStatus::unavailable(&path, e.to_string()),
            );
        }
    }
}
