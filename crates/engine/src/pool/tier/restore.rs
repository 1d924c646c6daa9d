//! `pool import --object-store`: a pool's device files rebuilt from its bucket and the
//! pool key (with a cache size, only the segments not flagged as client data).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::constants::SEGMENT_BYTES;
use crate::hex::{from_hex, to_hex};
use crate::keys::pool_key::PoolKey;
use crate::pool::format::anchor::{self, Anchor};
use crate::pool::format::config::{ObjectStoreConfig, PoolConfig, CONFIG_FILE, POOL_KEY_FILE};
use crate::pool::format::superblock::Superblock;
use crate::tier::ObjectStore;
use crate::{Error, Result};

use super::objects::*;

/// What `restore` did.
#[derive(Debug, Clone, Serialize)]
pub struct RestoreReport {
    pub pool_id: String,
    pub name: String,
    pub generation: u64,
    pub epoch: u64,
    pub previous_writer: String,
    pub devices: Vec<std::path::PathBuf>,
    pub parts: usize,
    pub bytes: u64,
    /// Bytes of client data left in the store (`--object-store-cache-size`: read from it
    /// when needed).
    pub left_in_store: u64,
}

/// The pool id a superblock object claims (before its MAC can be checked: the MAC key is
/// derived from it; `Head::open` then verifies it).
fn claimed_pool_id(bytes: &[u8]) -> Result<[u8; 16]> {
    #[derive(Deserialize)]
    struct Id {
        pool_id: String,
    }
    let bad = || Error::Corrupt("the object store's superblock names no readable pool id".into());
    let body = &bytes[..bytes.iter().rposition(|&b| b == b'\n').ok_or_else(bad)?];
    let id: Id = serde_json::from_slice(body).map_err(|_| bad())?;
    from_hex(&id.pool_id)
        .and_then(|v| v.try_into().ok())
        .ok_or_else(bad)
}

/// `bulwark pool import --object-store URL --dir DIR` (issue 22): rebuild a pool from its
/// object store alone, and the pool key, in the new directory `dir`: device files of the
/// labels' size, every part of the segment table written where it belongs, the labels,
/// `pool.json` (naming the store, with `config`) and the anchor at the store's generation.
/// The caller then opens the pool with the store, which takes it (epoch + 1).
pub fn restore(
    dir: &std::path::Path,
    store: &dyn ObjectStore,
    pool_key: &PoolKey,
    config: ObjectStoreConfig,
    force: bool,
    min_generation: Option<u64>,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<RestoreReport> {
    use crate::device::{Device, FileDevice};
    use crate::redundancy::{Member, Redundancy};
    use std::path::PathBuf;
    if dir.join(CONFIG_FILE).exists() {
        return Err(Error::Exists(format!(
            "{} already holds a pool: import from the object store into a new directory",
            dir.display()
        )));
    }
    let Some((bytes, _)) = store.get(SUPERBLOCK_OBJECT, SUPERBLOCK_OBJECT_BYTES_MAX)? else {
        return Err(Error::NotFound(format!(
            "the object store {} holds no pool (no '{SUPERBLOCK_OBJECT}' object)",
            store.describe()
        )));
    };
    let pool_id = claimed_pool_id(&bytes)?;
    let sb_key = pool_key.superblock_key(&pool_id);
    let found = load(store, &object_key(&sb_key))?.ok_or_else(|| {
        Error::NotFound(format!(
            "the object store {} holds no pool",
            store.describe()
        ))
    })?;
    let labels = found.head.superblocks(&sb_key)?;
    let label_bytes = found.head.label_bytes()?;
    let first = labels[0].clone();
    if let Some(min) = min_generation.filter(|&m| found.head.generation < m) {
        return Err(Error::Invalid(format!(
            "the object store {} holds the pool at generation {}, older than the {min} asked \
             for: the store was rolled back (an older version of its superblock object \
             restored), or this is not the store the pool was last written to",
            store.describe(),
            found.head.generation
        )));
    }
    // Refused before anything is downloaded (the takeover checks it again, atomically).
    if !force && !labels.iter().all(|l| l.exported) {
        return Err(Error::Busy(format!(
            "the pool in {} is held by '{}' (epoch {}, generation {}), which did not export \
             it ('bulwark pool export' there first). If that host is gone for good, add \
             --force: this host takes the pool over and that one is fenced (its next flush \
             fails)",
            store.describe(),
            found.head.writer,
            found.head.epoch,
            found.head.generation
        )));
    }
    if labels.len() != first.member_count as usize
        || labels
            .iter()
            .enumerate()
            .any(|(i, l)| l.member_index as usize != i || l.generation != found.head.generation)
    {
        return Err(Error::Corrupt(
            "the object store's superblock: its labels are not one generation of every member"
                .into(),
        ));
    }
    if !dir.exists() {
        std::fs::create_dir_all(dir).map_err(|e| Error::device(dir, e))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| Error::device(dir, e))?;
    }
    let mut made: Vec<PathBuf> = Vec::new();
    let result = (|| {
        let back_region =
            crate::constants::DEVICE_RESERVED_FRONT + first.segments_per_device * SEGMENT_BYTES;
        let mut members = Vec::new();
        let mut names = Vec::new();
        for (i, label) in label_bytes.iter().enumerate() {
            let name = PathBuf::from(format!("dev{i}.img"));
            let path = dir.join(&name);
            if path.exists() {
                return Err(Error::Exists(format!("{} already exists", path.display())));
            }
            let mut d = FileDevice::create_sparse(&path, first.device_bytes)?;
            made.push(path.clone());
            d.claim()?;
            for off in Superblock::slot_offsets(first.generation, back_region) {
                d.write_at(label, off)
                    .map_err(|e| Error::device(&path, e))?;
            }
            names.push(name);
            members.push(Member::new(path, Some(Arc::new(d) as Arc<dyn Device>)));
        }
        let red = Redundancy::new(first.layout, members, first.segments_per_device);
        let segments = red.segments();
        // With a local cache of a set size, client data stays in the store: it is read
        // from there (and its segments are holes here, which the next open finds).
        let lazy = config.cache_bytes.is_some();
        let left_in_store: u64 = found
            .slots
            .values()
            .filter(|s| lazy && s.data)
            .flat_map(|s| s.parts.iter().map(|p| p.len as u64))
            .sum();
        let jobs: Vec<(u32, Part)> = found
            .slots
            .iter()
            .filter(|(_, s)| !(lazy && s.data))
            .flat_map(|(seg, s)| s.parts.iter().map(move |p| (*seg, *p)))
            .collect();
        if let Some((seg, _)) = jobs.iter().find(|(seg, _)| *seg as u64 >= segments) {
            return Err(Error::Corrupt(format!(
                "the object store's segment table names segment {seg}, past the pool's {segments}"
            )));
        }
        let total: u64 = jobs.iter().map(|(_, p)| p.len as u64).sum();
        let done = std::sync::atomic::AtomicU64::new(0);
        // One GET per object (a commit's parts share one), as far as its parts reach;
        // objects spread over the downloaders. A segment's parts never overlap (runs are
        // written once per opening of a segment; one uploaded whole replaces its list),
        // so the order they land in does not matter.
        let mut by_object: BTreeMap<String, Vec<(u32, Part)>> = BTreeMap::new();
        for (seg, p) in &jobs {
            by_object.entry(p.name()).or_default().push((*seg, *p));
        }
        let objects: Vec<(String, Vec<(u32, Part)>)> = by_object.into_iter().collect();
        let chunk = objects.len().div_ceil(UPLOADS_AT_ONCE).max(1);
        let downloads: Vec<crate::env::Job<'_, Result<()>>> = objects
            .chunks(chunk)
            .map(|c| {
                let (red, done) = (&red, &done);
                Box::new(move || -> Result<()> {
                    for (name, parts) in c {
                        let end = parts
                            .iter()
                            .map(|(_, p)| p.at as u64 + p.len as u64)
                            .max()
                            .unwrap_or(0);
                        let b = store.get_range(name, 0, end)?;
                        for (seg, p) in parts {
                            let bytes = &b[p.at as usize..(p.at + p.len) as usize];
                            red.write(*seg as u64 * SEGMENT_BYTES + p.off as u64, bytes)?;
                            let now =
                                done.fetch_add(p.len as u64, std::sync::atomic::Ordering::Relaxed);
                            progress(now + p.len as u64, total);
                        }
                    }
                    Ok(())
                }) as crate::env::Job<'_, Result<()>>
            })
            .collect();
        crate::env::run_jobs(downloads)
            .into_iter()
            .collect::<Result<Vec<()>>>()?;
        red.flush()?;
        let key_path = dir.join(POOL_KEY_FILE);
        pool_key.save(&key_path)?;
        made.push(key_path);
        anchor::write_first(
            dir,
            &Anchor {
                seq: 1,
                pool_id,
                committed: (first.generation, anchor::digest(&first)),
                next: (0, [0; 32]),
                nonce_reserved: first.nonce_reserved,
            },
        )?;
        made.push(anchor::path(dir));
        PoolConfig {
            format: 1,
            pool_id: to_hex(&pool_id),
            layout: first.layout.to_string(),
            devices: names.clone(),
            offline: Vec::new(),
            name: (!first.name.is_empty()).then(|| first.name.clone()),
            exported: false,
            created: names.clone(),
            cache_device: None,
            log_devices: Vec::new(),
            object_store: Some(config),
            key_dir: None,
        }
        .write(dir)?;
        Ok(RestoreReport {
            pool_id: to_hex(&pool_id),
            name: first.name.clone(),
            generation: first.generation,
            epoch: found.head.epoch,
            previous_writer: found.head.writer.clone(),
            devices: names.iter().map(|n| dir.join(n)).collect(),
            parts: jobs.len(),
            bytes: total,
            left_in_store,
        })
    })();
    if result.is_err() {
        for p in made {
            let _ = std::fs::remove_file(p);
        }
        let _ = std::fs::remove_file(dir.join(CONFIG_FILE));
    }
    result
}
