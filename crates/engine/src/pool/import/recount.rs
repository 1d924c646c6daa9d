//! Import, phase 4: the volume table, and every volume's trees walked to recount the live
//! bytes of each segment (space accounting is not stored; it is rebuilt here, bounded by
//! the metadata's size). A map that cannot be walked leaves the accounting incomplete:
//! segments below the high-water mark are then never reused in this run.
//!
//! The table and the maps are read through a `Store` whose log has every segment taken
//! (nothing is placed during the walk); `build` gives it the log the walk counted. A map
//! node no copy of which verifies is listed in `status` errors at once
//! (`DataErrorKind::Map`), as a scrub would list it.

use crate::constants::*;
use crate::log::{segment_of, Log};
use crate::map::{depth_for, new_cache, Blkptr, Tree, Visit};
use crate::pool::format::anchor::Anchor;
use crate::pool::format::superblock::Superblock;
use crate::pool::format::table::{ptr_from_hex, TableRecord};
use crate::pool::options::OpenOptions;
use crate::redundancy::{Member, Redundancy};
use crate::store::Store;
use crate::{Error, Result};

/// The data plane over the members, with a log that places nothing until the walk has
/// counted the live bytes; and the volume table the newest label names.
pub(super) fn open_table(
    opts: &OpenOptions,
    newest: &Superblock,
    members: Vec<Member>,
    anchor: &Anchor,
) -> Result<(Store, TableRecord, usize)> {
    let red = Redundancy::new(newest.layout, members, newest.segments_per_device);
    let segments = red.segments() as usize;
    let cache = new_cache(opts.cache_bytes);
    // Metadata is read through the data plane before its log is known: a log with every
    // segment taken (nothing is placed during the walk), replaced once the walk counted
    // the live bytes of every segment.
    let store = Store::new(
        red,
        Log::new(vec![0; segments], 0, true),
        cache,
        // Above every nonce the host ever reserved, not only what these devices say.
        anchor.nonce_reserved,
    );
    if opts.check_addresses {
        store.check_addresses();
    }
    let table = if newest.root.is_hole() {
        TableRecord::empty()
    } else {
        TableRecord::open(&store.read_meta(&newest.root, 0)?, &newest.table_key)?
    };
    if table.format > crate::pool::format::table::TABLE_FORMAT_MAX {
        return Err(Error::Invalid(format!(
            "the pool's volume table is format {}, newer than this bulwark reads (up to {}): \
             upgrade bulwark",
            table.format,
            crate::pool::format::table::TABLE_FORMAT_MAX
        )));
    }
    Ok((store, table, segments))
}

/// Count `p`'s copies in the live bytes of the segments they lie in.
pub(super) fn count_live(store: &Store, p: &Blkptr, live: &mut [u32]) {
    for &a in p.addrs() {
        if let Some(l) = live.get_mut(segment_of(a) as usize) {
            // Saturating: forged pointers (or a forged intent log) naming one segment
            // many times must not wrap its count.
            *l = l.saturating_add(store.footprint(p.len as usize) as u32);
        }
    }
}

/// One volume and its snapshots as the walk rebuilds them.
pub(super) struct Family<'a> {
    pub rec: &'a crate::pool::format::table::VolumeRecord,
    pub opts: crate::volume::VolumeOptions,
    pub snaps: Vec<crate::volume::snap::Snap>,
    pub tree: Tree,
    pub used: u64,
}

/// What the walk counted.
pub(super) struct Recounted<'a> {
    pub live: Vec<u32>,
    pub complete: bool,
    pub data_segments: Vec<bool>,
    pub families: Vec<Family<'a>>,
    pub errors: Vec<crate::pool::format::health::DataError>,
}

/// Phase 4: every tree of every volume walked (origins before their clones, each against
/// the one it shares with), the live bytes of each segment counted, the snapshots' and
/// volumes' space recounted, and the map nodes no copy of which verifies listed.
pub(super) fn recount<'a>(
    store: &Store,
    table: &'a TableRecord,
    newest: &Superblock,
    segments: usize,
) -> Result<Recounted<'a>> {
    let mut live = vec![0u32; segments];
    let mut complete = true;
    // Ranges of volumes (or `VOL@SNAP`) under a map node no copy of which verifies: listed
    // in `status` at once, as a scrub would list them, not only after one.
    let mut map_errors: Vec<crate::pool::scrub::DataError> = Vec::new();
    count_live(store, &newest.root, &mut live);
    // Segments holding client data: emptying them counts toward an early commit (`Log`).
    let mut data_segments = vec![false; segments];
    /// The origin volume of `rec`, when `n` is `rec` itself.
    fn f_origin_name<'a>(
        rec: &'a crate::pool::format::table::VolumeRecord,
        n: &str,
    ) -> Option<&'a str> {
        (rec.name == n)
            .then(|| rec.origin.as_ref().map(|o| o.volume.as_str()))
            .flatten()
    }
    // Every volume's trees first, so a clone's base can be walked against its origin.
    let mut families: Vec<Family> = Vec::with_capacity(table.volumes.len());
    let walk_started = crate::env::now();
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
            walked = t.walk_unique(store, store.nodes(), &prev, &mut |v| {
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
                            map_errors.push(crate::pool::scrub::DataError {
                                volume: name.clone(),
                                offset,
                                length: (span * bs).min(rec.size_bytes - offset),
                                kind: crate::pool::scrub::DataErrorKind::Map,
                                seen_epoch: 0,
                            });
                        }
                        return Err(Error::Corrupt(error.to_string()));
                    }
                    Visit::Node { ptr, .. } => {
                        store.check_record(ptr)?;
                        count_live(store, ptr, &mut live)
                    }
                    Visit::Data { ptr, .. } => {
                        // A pointer past the pool would be counted nowhere, or overflow a
                        // segment's count: the walk stops, and nothing is reclaimed.
                        store.check_record(ptr)?;
                        count_live(store, ptr, &mut live);
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
                    match crate::volume::snap::unique_data_bytes(store, store.nodes(), p, &[t]) {
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
        seconds = format!("{:.2}", crate::env::since(walk_started).as_secs_f64()),
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
    Ok(Recounted {
        live,
        complete,
        data_segments,
        families,
        errors,
    })
}
