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
    resume_if_full(&core, &newest.root, &log_slots);
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

/// The import's commit opens both metadata heads afresh: with fewer free segments than
/// copies, the first copies go on after the newest table (`table`) in its segment, past the
/// intent log's slots (`log_slots`); the second ones follow them when no segment can be
/// opened for them (`Store::write_meta_batch`).
fn resume_if_full(core: &Core, table: &Blkptr, log_slots: &[Blkptr]) {
    #[cfg(test)]
    take_free_at_import(core);
    if core.store.free_segments() < METADATA_COPIES as u32 {
        core.store.resume_meta_head(table, log_slots);
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

#[cfg(test)]
mod full_at_import {
    /// A pool that a commit left with no free segment (and the second metadata stream's
    /// head full) imports: the import's commit goes on after the newest volume table in
    /// its segment, both copies there. Before, an import's commit opened both heads afresh
    /// and the pool could not be imported ("the pool is out of space"); a commit near full
    /// may take the last segment, so that state is one a pool can be closed in.
    #[test]
    fn a_pool_with_no_free_segment_left_by_its_last_commit_imports() {
        use super::FREE_AT_IMPORT;
        use crate::pool::OpenOptions;

        let dir = tempfile::tempdir().unwrap();
        let opts = OpenOptions {
            stepped: true,
            ..OpenOptions::default()
        };
        let pool = crate::pool::test_pool(dir.path(), opts.clone());
        pool.create_volume("v", crate::pool::test_volume(1 << 20), None)
            .unwrap();
        let v = pool.volume("v").unwrap();
        v.write(8192, &[9u8; 4096], false).unwrap();
        v.flush().unwrap();
        drop(v);
        pool.close().unwrap();
        drop(pool);
        FREE_AT_IMPORT.with(|f| f.set(Some(0)));
        let opened = crate::pool::Pool::open(dir.path(), opts.clone());
        FREE_AT_IMPORT.with(|f| f.set(None));
        let pool = opened.expect("a pool with no free segment imports");
        let mut got = vec![0u8; 4096];
        pool.volume("v").unwrap().read(8192, &mut got).unwrap();
        assert_eq!(got, vec![9u8; 4096]);
        // Its commits go on in the head the import resumed; closed, it imports again.
        pool.flush().unwrap();
        pool.close().unwrap();
        drop(pool);
        let pool = crate::pool::Pool::open(dir.path(), opts).expect("imports again");
        pool.volume("v").unwrap().read(8192, &mut got).unwrap();
        assert_eq!(got, vec![9u8; 4096]);
    }

    /// The import that resumes the metadata head after the newest table, with the intent
    /// log's chain in that segment: a crash at any write of its commit leaves the chain
    /// whole, and the next import replays it again (the flushed write reads back). The
    /// head resumes after the chain's slots and the slot the superblock names, which a
    /// crash before the import's commit must find as they were.
    #[test]
    fn an_import_resumed_after_the_table_keeps_the_intent_log_it_replays() {
        use super::FREE_AT_IMPORT;
        use crate::device::crash;
        use crate::pool::OpenOptions;

        let base = tempfile::tempdir().unwrap();
        let (saved, work) = (base.path().join("saved"), base.path().join("work"));
        std::fs::create_dir(&saved).unwrap();
        let opts = OpenOptions {
            stepped: true,
            allow_fault_injection: true,
            ..OpenOptions::default()
        };
        {
            let journal = crash::arm(&saved);
            // Mirrored: the intent log's slots have one copy (on a single device, two).
            crate::pool::Pool::create(
                &saved,
                crate::redundancy::Layout::Mirror(2),
                crate::pool::DeviceSpec::Files {
                    count: 2,
                    size_bytes: 64 << 20,
                },
            )
            .unwrap();
            let pool = crate::pool::Pool::open(&saved, opts.clone()).unwrap();
            pool.create_volume("v", crate::pool::test_volume(1 << 20), None)
                .unwrap();
            let v = pool.volume("v").unwrap();
            v.write(4096, &[5u8; 4096], false).unwrap();
            // Durable through the intent log, not a commit.
            v.flush().unwrap();
            journal.freeze();
            drop(v);
            drop(pool);
            journal.crash(&mut |_| 1).unwrap();
        }
        for k in 0..16 {
            let _ = std::fs::remove_dir_all(&work);
            std::fs::create_dir(&work).unwrap();
            for f in std::fs::read_dir(&saved).unwrap() {
                let f = f.unwrap();
                std::fs::copy(f.path(), work.join(f.file_name())).unwrap();
            }
            let journal = crash::arm(&work);
            FREE_AT_IMPORT.with(|f| f.set(Some(0)));
            journal.freeze_after(k);
            let opened = crate::pool::Pool::open(&work, opts.clone());
            FREE_AT_IMPORT.with(|f| f.set(None));
            journal.freeze();
            drop(opened);
            // Every write the import made before the crash kept.
            journal.crash(&mut |_| 0).unwrap();
            drop(journal);
            let pool = crate::pool::Pool::open(&work, opts.clone())
                .unwrap_or_else(|e| panic!("after a crash at write {k} of the import: {e}"));
            let mut got = vec![0u8; 4096];
            pool.volume("v").unwrap().read(4096, &mut got).unwrap();
            assert!(
                got.iter().all(|&b| b == 5),
                "the flushed write lost (reads {:?}...) after a crash at write {k} of an import \
                 that resumed the head",
                &got[..8]
            );
            pool.close().unwrap();
        }
    }
}
