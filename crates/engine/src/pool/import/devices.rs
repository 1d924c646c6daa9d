//! Import, phases 1-3: open what pool.json lists (and the device files renamed inside the
//! pool directory), read their labels under the pool key and pick the newest, then take
//! the members that label names (missing, stale, truncated, offline, copied) and check
//! the host's anchor. The refusals of these phases name what to do.
//!
//! The pool key comes from the trust-root directory (`format::config::key_path`), and
//! only labels whose MAC verifies under it are read; where no front slot of a device
//! verifies, its back copies are (`format::labels::find_back_region`). A format 1 pool is
//! refused with a message naming `pool upgrade`; an upgrade needs every member present
//! and online. A pool left with only offline members does not import, and says how to go
//! on. The anchor's nonce reservation is where the next commit's nonces start, above
//! anything this host ever reserved, even under `--accept-rollback`.

use std::fs::{self};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::constants::*;
use crate::device::fault::FaultyDevice;
use crate::device::{Device, FileDevice};
use crate::hex::to_hex;
use crate::keys::pool_key::PoolKey;
use crate::pool::format::anchor::{self, Anchor};
use crate::pool::format::config::PoolConfig;
use crate::pool::format::labels::{
    back_region_of, best_superblock, find_back_region, label_front_or_back,
};
use crate::pool::format::superblock::{Check, SbKey, Superblock};
use crate::pool::options::OpenOptions;
use crate::redundancy::Member;
use crate::{Error, Result};

/// What phase 1 found: the config, the devices it could open, the object store.
pub(super) struct Opened {
    pub conf: PoolConfig,
    pub conf_name: String,
    pub pool_id: [u8; 16],
    pub listed: Vec<PathBuf>,
    pub opened: Vec<(PathBuf, FileDevice)>,
    pub tier_open: Option<crate::pool::tier::TierOpen>,
}

/// Phase 1: pool.json, the devices it lists and the ones found by their labels, and the
/// object store (caught up first, when the pool has one).
pub(super) fn open_devices(dir: &Path, opts: &OpenOptions) -> Result<Opened> {
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
        (None, Some(os)) => Some(crate::pool::tier::open_configured(dir, os)?),
        (None, None) => None,
    };
    if let Some(t) = tier_open.as_ref().filter(|t| !t.create) {
        crate::pool::tier::catch_up(dir, t, &pool_id, &opened)?;
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
    Ok(Opened {
        conf,
        conf_name,
        pool_id,
        listed,
        opened,
        tier_open,
    })
}

/// What phase 2 read: the newest label and the devices that carry this pool's labels, and
/// the keys.
pub(super) struct Labels {
    pub found: Vec<Found>,
    pub newest: Superblock,
    pub sb_key: SbKey,
    pub log_key: SbKey,
}

/// Phase 2: the labels that verify under the pool key, the newest of them (an upgrade's
/// format 1 members one generation behind too), and the refusals they call for.
pub(super) fn read_labels(dir: &Path, opts: &OpenOptions, o: Opened) -> Result<(Opened, Labels)> {
    let Opened {
        conf,
        conf_name,
        pool_id,
        listed,
        opened,
        tier_open,
    } = o;
    // The pool key: only labels that carry its MAC are read (format 2, decision 0011).
    let key_path = crate::pool::format::config::key_path(dir);
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
                && sb.format == crate::pool::format::superblock::VERSION_1
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
                dir.join(crate::pool::format::config::CONFIG_FILE).display()
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
        .filter(|n| n.format == crate::pool::format::superblock::VERSION)
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
    if newest.format == crate::pool::format::superblock::VERSION_1 && !opts.upgrade {
        return Err(format_1_refusal(dir));
    }
    if newest.format == crate::pool::format::superblock::VERSION && opts.upgrade {
        return Err(Error::Invalid(format!(
            "pool {} is already format {}: nothing to upgrade",
            conf_name,
            crate::pool::format::superblock::VERSION
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
    Ok((
        Opened {
            conf,
            conf_name,
            pool_id,
            listed,
            opened: Vec::new(),
            tier_open,
        },
        Labels {
            found,
            newest,
            sb_key,
            log_key,
        },
    ))
}

/// What phase 3 assembled: the members in the newest label's order, their fault layers,
/// and the anchor the next commit starts from.
pub(super) struct Members {
    pub members: Vec<Member>,
    pub faults: Vec<Option<Arc<FaultyDevice>>>,
    pub anchor: Anchor,
    pub rollback_accepted: Option<(u64, u64)>,
}

/// Phase 3: each member the newest label names, found by its label (or missing, stale,
/// truncated, offline, or copied), whether the pool can run with what is here, and the
/// host's anchor against the newest label.
pub(super) fn take_members(
    dir: &Path,
    opts: &OpenOptions,
    o: &Opened,
    labels: &mut Labels,
) -> Result<Members> {
    let Opened {
        conf,
        pool_id,
        listed,
        ..
    } = o;
    let newest = &labels.newest;
    let sb_key = &labels.sb_key;
    let mut found = std::mem::take(&mut labels.found);
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
                let faulty = Arc::new(FaultyDevice::new(Box::new(f.dev), back_region_of(newest)));
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
            dir.join(crate::pool::format::config::CONFIG_FILE).display()
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
        check_anchor(dir, newest, opts.accept_rollback).map_err(|e| match e {
            // The newest labels may have been altered, not rolled back: then say so.
            Error::Corrupt(m) => match altered_slots(listed, pool_id, sb_key) {
                0 => Error::Corrupt(m),
                n => Error::Corrupt(format!(
                    "{m}. Note: {n} label slot(s) of this pool fail authentication under \
                     pool.key and were ignored: the newest labels were altered or damaged on \
                     the devices, which is not a rollback"
                )),
            },
            e => e,
        })?;
    Ok(Members {
        members,
        faults,
        anchor,
        rollback_accepted,
    })
}

pub(super) struct Found {
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
        crate::pool::format::superblock::VERSION,
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
            .all(|&f| f == crate::pool::format::superblock::VERSION_1);
    if v1 {
        return format_1_refusal(dir);
    }
    Error::NotFound(format!(
        "{} is missing: a format {} pool's labels and metadata are authenticated by it, and \
         nothing on the devices can replace it. Restore it from your backup (docs/runbook.md, \
         'The pool key')",
        key_path.display(),
        crate::pool::format::superblock::VERSION
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
            if sb.format == crate::pool::format::superblock::VERSION_1
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
