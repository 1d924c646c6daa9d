//! Import, phase 6: the volumes' states, the log with the counted live bytes, the object
//! store taken, `Core` built once, and the import's own commit (a fresh nonce range, every
//! member's labels at one generation, the replayed chain's records made durable).

use super::devices::{Labels, Members, Opened};
use super::recount::{Family, Recounted};
use super::replay::Replayed;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::constants::METADATA_COPIES;
use crate::log::Log;
use crate::map::Blkptr;
use crate::pool::core::{Core, DefragStats, SbState};
use crate::pool::format::config::PoolConfig;
use crate::pool::format::labels::back_region_of;
use crate::pool::format::superblock::Superblock;
use crate::pool::format::table::TableRecord;
use crate::pool::options::OpenOptions;
use crate::store::Store;
use crate::volume::VolumeState;
use crate::{Error, Result};

/// Phase 6: build `Core` from what the phases found, and commit.
#[allow(clippy::too_many_arguments)]
pub(super) fn build(
    dir: &Path,
    opts: &OpenOptions,
    o: Opened,
    labels: Labels,
    m: Members,
    mut store: Store,
    table: &TableRecord,
    r: Recounted<'_>,
    p: Replayed,
) -> Result<Core> {
    let Opened {
        conf, tier_open, ..
    } = o;
    let Labels {
        newest,
        sb_key,
        log_key,
        ..
    } = labels;
    let Members {
        faults,
        anchor,
        rollback_accepted,
        ..
    } = m;
    let Recounted {
        live,
        complete,
        data_segments,
        families,
        errors,
    } = r;
    let Replayed {
        logdev,
        chain_slots,
        replaced,
        replayed,
        replayed_records,
        dev_chain,
        dev_slot,
        log_loss,
    } = p;
    let volumes = volume_states(families, &errors);
    store.install_log(Log::new(live, newest.high_water, complete), &data_segments);
    store.set_fill_holes(opts.fill_holes);
    if opts.holes_first {
        store.set_holes_first(true);
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
            let tier = Arc::new(crate::pool::tier::Tier::take(t, &sb_key, &newest)?);
            store.set_tiered();
            // A pool that had data before it had a store (`pool object-store add`): its
            // first commit uploads every segment that holds some.
            if t.create {
                let segs = store.note_live_segments();
                if segs > 0 {
                    tracing::info!(
                        segments = segs,
                        "uploading the pool's data to its new object store"
                    );
                }
            }
            for p in &replayed_records {
                store.note_record(p);
            }
            // Segments given back to the store before (or never downloaded) are read
            // from it.
            let given_back = crate::pool::evict::mark_holes(&store, &data_segments);
            if given_back > 0 {
                tracing::info!(
                    segments = given_back,
                    "local cache: segments of client data only the object store holds"
                );
            }
            // Segments freed by the last run's final commits are still in the store's
            // table: the next commit drops them (garbage collection takes their objects).
            store.note_free_among(tier.slot_segments());
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
        reach: crate::pool::format::anchor::ReachWriter::start(dir.to_path_buf()),
        sb: Mutex::new(SbState {
            // The import's commit takes the pool: it is no longer exported, and it carries
            // the name pool.json gives it (a pool made before names gets one now).
            sb: Superblock {
                // `pool upgrade`: the import's commit writes the first format 2 labels.
                format: crate::pool::format::superblock::VERSION,
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
        group: Default::default(),
        notes_taken: Default::default(),
        clean_dirtied: Default::default(),
        defrag_stats: DefragStats {
            on: opts.defrag,
            ..Default::default()
        },
        intent: Mutex::new(None),
        // With an object store a flush is a commit, durable once the store has it, unless
        // the pool asks for local flushes (the intent log; the store lags by a commit).
        intent_log: opts.intent_log && tier_open.as_ref().is_none_or(|t| t.local_flush),
        tier,
        logdev: RwLock::new(logdev.clone()),
        device_lock: Mutex::new(()),
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
    // The intent log's slots on the main devices: the replayed chain's and the head the
    // newest superblock names (kept as they are until the import's commit is durable).
    let log_slots: Vec<Blkptr> = chain_slots
        .iter()
        .copied()
        .chain(newest.log_head.map(crate::pool::intentlog::block::slot_ptr))
        .collect();
    // The replayed chain's slots stay counted until the import's commit replaces it.
    if !chain_slots.is_empty() {
        *core.intent.lock() = Some(crate::pool::intentlog::block::Chain {
            generation: newest.generation,
            seq: replayed.0,
            next: [crate::map::ADDR_NONE; 2],
            after: None,
            slots: chain_slots,
        });
    }
    for v in core.volumes.read().values() {
        core.store.note_dirty(v.head_dirty(), v.map().dirty_nodes());
    }
    #[cfg(test)]
    take_free_at_import(&core);
    // Its commit opens both metadata heads afresh: with fewer free segments than copies,
    // the first copies go on after the newest table in its segment (the second ones follow
    // them when no segment can be opened for them, `Store::write_meta_batch`).
    if core.store.free_segments() < METADATA_COPIES as u32 {
        core.store.resume_meta_head(&newest.root, &log_slots);
    }
    // Reserve a fresh nonce range and bring every member's superblock to one generation.
    core.commit()?;
    for dead in replaced {
        core.store.release(dead);
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

/// Each volume's state as the table and the walk left it (its trees, snapshots, space, and
/// whether a data error is listed in it).
fn volume_states(
    families: Vec<Family<'_>>,
    errors: &[crate::pool::format::health::DataError],
) -> BTreeMap<String, Arc<VolumeState>> {
    let mut volumes = BTreeMap::new();
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
        *st.rotation() = rec.rotation.clone();
        st.set_description(rec.description.clone());
        st.set_readonly(rec.readonly);
        st.set_thick(rec.thick);
        st.set_created(rec.created);
        *st.origin() = rec.origin.clone();
        st.set_deferred(rec.deferred);
        st.set_used_bytes(f.used);
        *st.snapshots_mut() = f.snaps;
        st.note_data_errors(errors.iter().any(|e| e.volume == rec.name));
        volumes.insert(rec.name.clone(), Arc::new(st));
    }
    volumes
}

/// Open the cache device (`serve --cache-device`, else the one `pool.json` names) and let
/// the data plane use it. One that is missing or refused is warned about and shown in
/// `status` as UNAVAIL: the pool serves without it (it holds only copies).
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

#[cfg(test)]
mod tests {
    use crate::pool::{test_pool, OpenOptions, Pool};
    use crate::store::Dead;
    use crate::volume::{Compression, VolumeOptions};

    fn checked() -> OpenOptions {
        OpenOptions {
            check_addresses: true,
            ..OpenOptions::default()
        }
    }

    /// The panic's message, from a release expected to be refused.
    fn refused(f: impl FnOnce()) -> String {
        let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
            .expect_err("the live-address check let a double release through");
        e.downcast_ref::<String>().cloned().unwrap_or_default()
    }

    /// The live-address check (`store/live.rs`) bites through the store's one release point:
    /// a record the volume released when it was overwritten, released again, panics naming
    /// its address and segment, the volume's release as the first caller and this test as
    /// the second. After an import it still does: a record the import found (counted by the
    /// recount, not placed in that run) may be released once, not twice.
    #[test]
    fn a_double_release_panics_naming_the_address_and_both_callers_also_after_import() {
        let dir = tempfile::tempdir().unwrap();
        let opts = VolumeOptions {
            size_bytes: 1 << 20,
            block_size: 4096,
            compression: Compression::Off,
            encryption: false,
        };
        let kept = {
            let pool = test_pool(dir.path(), checked());
            pool.create_volume("v", opts, None).unwrap();
            let vol = pool.volume("v").unwrap();
            vol.write(0, &[1; 4096], false).unwrap();
            let old = vol.debug_block_ptr(0).unwrap();
            vol.write(0, &[2; 4096], false).unwrap();
            let m = refused(|| pool.core().store.release(Dead::superseded(old)));
            let addr = old.addr[0];
            let seg = addr / crate::constants::SEGMENT_BYTES;
            assert!(m.contains("double release"), "{m}");
            assert!(m.contains(&format!("at {addr} (segment {seg},")), "{m}");
            assert!(
                m.contains("volume/mod.rs"),
                "the first release's caller: {m}"
            );
            assert!(
                m.contains("import/build.rs"),
                "the second release's caller: {m}"
            );
            vol.write(4096, &[3; 4096], true).unwrap();
            let kept = vol.debug_block_ptr(1).unwrap();
            drop(vol);
            pool.close().unwrap();
            kept
        };
        let pool = Pool::open(dir.path(), checked()).unwrap();
        assert_eq!(pool.volume("v").unwrap().debug_block_ptr(1).unwrap(), kept);
        pool.core().store.release(Dead::superseded(kept));
        let m = refused(|| pool.core().store.release(Dead::superseded(kept)));
        assert!(m.contains("double release"), "{m}");
    }
}

#[cfg(test)]
thread_local! {
    /// For tests: the free segments an import on this thread leaves before its commit
    /// (the rest taken by the second metadata stream, each to its last byte), as a pool
    /// that a commit left this full would have.
    pub(crate) static FREE_AT_IMPORT: std::cell::Cell<Option<u32>> = const { std::cell::Cell::new(None) };
}

#[cfg(test)]
fn take_free_at_import(core: &Core) {
    if let Some(keep) = FREE_AT_IMPORT.with(|f| f.get()) {
        let log = core.store.log_for_tests();
        while log.free_segments() > keep {
            log.alloc(
                crate::log::Stream::Meta2,
                crate::constants::SEGMENT_BYTES as usize,
            )
            .expect("a free segment");
        }
    }
}
