//! Adding, removing and replacing the separate intent log devices of a running pool
//! (`bulwark pool log`); the devices themselves are `intentlog::devices`.

use crate::device::fault::FaultyDevice;
use crate::device::{Device, FileDevice};
use crate::pool::intentlog::devices::*;
use crate::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;

impl crate::pool::core::Core {
    /// Make the devices at `paths` the pool's log devices (none: the log goes back to
    /// the main devices): those already in use stay, the others are labelled (and must
    /// carry no label), the ones not named any more are dropped and their labels wiped.
    /// Under the device and commit locks; durable when it returns. Order, for a crash at
    /// any step: pool.json lists the old and the new devices, a commit names the new set,
    /// pool.json lists only it, the dropped labels are wiped (the import uses the devices
    /// the superblock names, found among pool.json's by their labels).
    pub fn set_log_devices(&self, paths: &[PathBuf]) -> Result<()> {
        use crate::pool::format::superblock::LOG_DEVICES_MAX;
        if paths.len() > LOG_DEVICES_MAX {
            return Err(Error::Invalid(format!(
                "{} log devices; a pool has at most {LOG_DEVICES_MAX} (the log mirrored on both)",
                paths.len()
            )));
        }
        self.store.check_poisoned()?;
        if !paths.is_empty() && self.tier.is_some() {
            // The import refuses log devices beside a store (a flush is a commit there,
            // or local through the intent log on the main devices): the pool would not
            // open again.
            return Err(Error::Invalid(
                "this pool has an object store: its flushes go to the store (or with \
                 --object-store-flush local, to the main devices' log), and it takes no \
                 separate log device"
                    .into(),
            ));
        }
        let _d = self.device_lock.lock();
        let _c = self.commit_lock.lock();
        let pool_id = self.sb.lock().sb.pool_id;
        let old = self.logdev.read().clone();
        let canon = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
        let members: Vec<PathBuf> = self
            .store
            .members()
            .iter()
            .map(|m| canon(&m.path()))
            .collect();
        let mut ids = Vec::new();
        // Canonical paths to compare, the paths as given (absolute) to keep.
        let mut listed: Vec<PathBuf> = Vec::new();
        let mut given: Vec<PathBuf> = Vec::new();
        let mut fresh: Vec<(PathBuf, FileDevice, [u8; 16])> = Vec::new();
        for p in paths {
            let c = canon(p);
            if members.contains(&c) {
                return Err(Error::Invalid(format!(
                    "{} is a device of the pool, not a free device for its log",
                    p.display()
                )));
            }
            if listed.contains(&c) {
                return Err(Error::Invalid(format!(
                    "log device {} is given twice",
                    p.display()
                )));
            }
            let kept = old
                .as_ref()
                .and_then(|l| l.devices.iter().find(|d| canon(&d.path) == c));
            match kept {
                Some(d) if d.online() => ids.push(d.id),
                Some(d) => {
                    return Err(Error::Invalid(format!(
                        "log device {} is {}: remove it first ('bulwark pool log remove {}')",
                        d.path.display(),
                        d.state(),
                        d.path.display()
                    )))
                }
                None => {
                    let named = old.as_ref().map(|l| l.ids()).unwrap_or_default();
                    let dev = open_new(p, &|l: &Label| {
                        l.pool_id == pool_id && !named.contains(&l.device_id)
                    })?;
                    let id = crate::keys::wrap::random_bytes::<16>();
                    ids.push(id);
                    fresh.push((c.clone(), dev, id));
                }
            }
            listed.push(c);
            given.push(std::path::absolute(p).map_err(|e| Error::device(p, e))?);
        }
        let dropped: Vec<PathBuf> = old
            .as_ref()
            .map(|l| {
                l.devices
                    .iter()
                    .filter(|d| !listed.contains(&canon(&d.path)))
                    .map(|d| d.path.clone())
                    .collect()
            })
            .unwrap_or_default();
        // Every device of the new set says the same ring size, the smallest one's. The
        // commit first leaves the current chain empty, so a crash after a kept device's
        // label changed its ring size loses no flush (an empty chain reads the same in
        // any ring).
        self.commit_held()?;
        let kept: Vec<(&LogDevice, Arc<FaultyDevice>)> = old
            .iter()
            .flat_map(|l| l.devices.iter())
            .filter(|d| ids.contains(&d.id))
            .filter_map(|d| d.dev.clone().map(|dev| (d, dev)))
            .collect();
        let slots = fresh
            .iter()
            .map(|(_, d, _)| slots_of(d.size()))
            .chain(kept.iter().map(|(d, _)| slots_of(d.size_bytes)))
            .min()
            .unwrap_or(0);
        for (_, dev, id) in &fresh {
            write_label(
                dev,
                &Label {
                    pool_id,
                    device_id: *id,
                    role: ROLE_INTENT_LOG,
                    slots,
                },
            )?;
        }
        for (d, dev) in &kept {
            if d.slots != slots {
                write_label(
                    &**dev,
                    &Label {
                        pool_id,
                        device_id: d.id,
                        role: ROLE_INTENT_LOG,
                        slots,
                    },
                )?;
            }
        }
        let mut conf = crate::pool::format::config::PoolConfig::read(&self.dir)?;
        let stored = |p: &PathBuf| {
            p.strip_prefix(&self.dir)
                .map(Path::to_path_buf)
                .unwrap_or(p.clone())
        };
        let mut both: Vec<PathBuf> = conf.log_devices.clone();
        for p in &given {
            if !both.contains(&stored(p)) {
                both.push(stored(p));
            }
        }
        conf.log_devices = both;
        conf.write(&self.dir)?;
        let new = if ids.is_empty() {
            None
        } else {
            let (l, problems) = open_all(&given, &ids, &pool_id);
            if let Some(p) = problems.first() {
                return Err(Error::Invalid(p.clone()));
            }
            Some(Arc::new(l))
        };
        if let Some(l) = &old {
            // Whatever its chain holds is in the map: the commit below covers it.
            l.state.lock().chain = None;
        }
        *self.logdev.write() = new;
        self.commit_held()?;
        conf.log_devices = given.iter().map(stored).collect();
        conf.write(&self.dir)?;
        drop(old);
        for p in dropped {
            match FileDevice::open(&p) {
                Ok(d) if read_label(&d).is_some_and(|l| l.pool_id == pool_id) => {
                    if let Err(e) = wipe_label(&d) {
                        tracing::warn!("the label of log device {} stays: {e}", p.display());
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// For tests: a pool in `dir/p` of `count` 64 MiB device files in `layout`, with its
/// intent log on a separate `log_bytes` file `dir/log.img`; returns (pool dir, log path).
#[cfg(test)]
pub(crate) fn test_pool_with_log(
    dir: &std::path::Path,
    layout: crate::pool::Layout,
    count: usize,
    log_bytes: u64,
) -> (PathBuf, PathBuf) {
    let log = dir.join("log.img");
    std::fs::File::create(&log)
        .unwrap()
        .set_len(log_bytes)
        .unwrap();
    let pdir = dir.join("p");
    crate::pool::Pool::create_with_log(
        &pdir,
        layout,
        crate::pool::DeviceSpec::Files {
            count,
            size_bytes: 64 << 20,
        },
        "p",
        std::slice::from_ref(&log),
    )
    .unwrap();
    (pdir, log)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checksum::{seal_self_checked, verify};
    use crate::constants::{DEVICE_RESERVED_FRONT, SUPERBLOCK_BYTES};
    use crate::pool::intentlog::block::ENTRIES_PER_BLOCK;

    #[test]
    fn labels_round_trip_and_refuse_damage() {
        let l = Label {
            pool_id: [1; 16],
            device_id: [2; 16],
            role: ROLE_INTENT_LOG,
            slots: 1000,
        };
        let b = l.encode();
        assert_eq!(Label::decode(&b).unwrap(), Some(l));
        let mut torn = b.clone();
        torn[30] ^= 1;
        assert!(matches!(Label::decode(&torn), Err(Error::Corrupt(_))));
        assert_eq!(Label::decode(&[0u8; SUPERBLOCK_BYTES]).unwrap(), None);
    }

    /// Volume v of the log tests: 4 MiB of 4 KiB blocks, stored as written.
    fn plain_volume() -> crate::volume::VolumeOptions {
        crate::volume::VolumeOptions {
            size_bytes: 4 << 20,
            block_size: 4096,
            compression: crate::codec::Compression::Off,
            encryption: false,
        }
    }

    /// Flushes go to the log device (the main devices hold no chain), a crash replays them
    /// from it; with the log device gone, the import goes on at the last commit, says what
    /// was lost, and the log has fallen back.
    #[test]
    fn flushes_survive_a_crash_on_the_log_device_and_its_loss_is_reported() {
        use crate::pool::{Layout, OpenOptions, Pool};
        let dir = tempfile::tempdir().unwrap();
        let (pdir, log) = test_pool_with_log(dir.path(), Layout::Single, 1, LOG_DEVICE_BYTES_MIN);
        let opts = OpenOptions {
            commit_interval: std::time::Duration::from_secs(3600),
            ..OpenOptions::default()
        };
        let vopts = plain_volume();
        let read = |pool: &Pool, lba: u64| {
            let mut buf = vec![0u8; 4096];
            pool.volume("v")
                .unwrap()
                .read(lba * 4096, &mut buf)
                .unwrap();
            buf[0]
        };
        {
            let pool = Pool::open(&pdir, opts.clone()).unwrap();
            pool.create_volume("v", vopts, None).unwrap();
            let v = pool.volume("v").unwrap();
            // More than a ring's worth of blocks over many flushes: the chain commits when
            // it would wrap, and goes on from there.
            let slots = pool.core().logdev.read().as_ref().unwrap().slots;
            let generation = pool.status().generation;
            for round in 0..(slots / 4 + 3) {
                for lba in 0..(ENTRIES_PER_BLOCK as u64 * 4) {
                    v.write(lba * 4096, &vec![(round % 200) as u8 + 1; 4096], false)
                        .unwrap();
                }
                v.flush().unwrap();
                assert!(
                    pool.core().intent.lock().is_none(),
                    "a chain on the main devices"
                );
            }
            let last = (slots / 4 + 2) % 200 + 1;
            assert!(
                pool.status().generation > generation,
                "the chain filled the ring: a flush committed"
            );
            let head = pool
                .core()
                .logdev
                .read()
                .as_ref()
                .unwrap()
                .state
                .lock()
                .next_head;
            assert!(head < slots);
            assert_eq!(read(&pool, 7), last as u8);
            let st = pool.status();
            assert_eq!(st.log.as_ref().unwrap().state, "ONLINE");
            assert_eq!(st.state, "ONLINE");
            for lba in 0..10u64 {
                v.write(lba * 4096, &vec![0xA1; 4096], false).unwrap();
            }
            v.flush().unwrap();
            drop(v);
            drop(pool); // a crash: no close, no commit
        }
        {
            let pool = Pool::open(&pdir, opts.clone()).unwrap();
            for lba in 0..10 {
                assert_eq!(read(&pool, lba), 0xA1, "block {lba}");
            }
            let v = pool.volume("v").unwrap();
            v.write(0, &vec![0xB2; 4096], false).unwrap();
            v.flush().unwrap();
            drop(v);
            drop(pool);
        }
        std::fs::remove_file(&log).unwrap();
        let pool = Pool::open(&pdir, opts).unwrap();
        // The flush that lived only on the log is lost: the last commit's data.
        assert_eq!(read(&pool, 0), 0xA1);
        let st = pool.status();
        let l = st.log.unwrap();
        assert_eq!(l.state, "FELL_BACK");
        assert_eq!(l.devices[0].state, "UNAVAIL");
        assert!(l.note.unwrap().contains("cannot be replayed"));
        assert_eq!(st.state, "DEGRADED");
        // Flushes go the main devices' way now, and hold.
        let v = pool.volume("v").unwrap();
        v.write(4096, &vec![0xC3; 4096], false).unwrap();
        v.flush().unwrap();
        pool.close().unwrap();
    }

    /// The label's ring size is signed by no key: altered (here to a ring that ends just
    /// past the chain's head), the replay still finds every block and its records, from
    /// the superblock's head and the blocks' own signed links. Before, it computed the
    /// slots from the label's ring, read the wrong ones after the first block, and
    /// stopped there: three flushes lost without a word.
    #[test]
    fn a_label_altered_to_another_ring_size_does_not_shorten_the_replay() {
        use crate::pool::{Layout, OpenOptions, Pool};
        let dir = tempfile::tempdir().unwrap();
        let (pdir, log) = test_pool_with_log(dir.path(), Layout::Single, 1, LOG_DEVICE_BYTES_MIN);
        let opts = OpenOptions {
            commit_interval: std::time::Duration::from_secs(3600),
            ..OpenOptions::default()
        };
        let head = {
            let pool = Pool::open(&pdir, opts.clone()).unwrap();
            pool.create_volume("v", plain_volume(), None).unwrap();
            pool.core().commit().unwrap();
            let head = pool
                .core()
                .logdev
                .read()
                .as_ref()
                .unwrap()
                .state
                .lock()
                .chain
                .unwrap()
                .head;
            let v = pool.volume("v").unwrap();
            for round in 1..=4u8 {
                for lba in 0..4u64 {
                    v.write(lba * 4096, &vec![round; 4096], false).unwrap();
                }
                v.flush().unwrap();
            }
            drop(v);
            drop(pool); // a crash: the four flushes are on the log device only
            head
        };
        let dev = FileDevice::open(&log).unwrap();
        let mut label = read_label(&dev).unwrap();
        assert!(label.slots > head + 2);
        label.slots = head + 2;
        write_label(&dev, &label).unwrap();
        drop(dev);
        let pool = Pool::open(&pdir, opts).unwrap();
        let v = pool.volume("v").unwrap();
        let mut buf = vec![0u8; 4096];
        for lba in 0..4u64 {
            v.read(lba * 4096, &mut buf).unwrap();
            assert_eq!(buf[0], 4, "block {lba}: a flush was not replayed");
        }
    }

    /// A mirrored log device whose half fails while flushes go on: the flush that found
    /// it failed commits, so the next superblock names only the working half. After a
    /// crash with only the failed (stale) half left, the import does not replay its
    /// chain as if whole: it says the flushes on the log are lost, and reads the last
    /// commit (before, it replayed the stale chain and lost the later flushes silently).
    #[test]
    fn a_stale_half_of_a_mirrored_log_is_not_replayed_as_whole() {
        use crate::device::fault::{Fault, FaultMode};
        use crate::pool::{Layout, OpenOptions, Pool};
        let dir = tempfile::tempdir().unwrap();
        let logs: Vec<PathBuf> = ["loga.img", "logb.img"]
            .iter()
            .map(|n| {
                let p = dir.path().join(n);
                std::fs::File::create(&p)
                    .unwrap()
                    .set_len(LOG_DEVICE_BYTES_MIN)
                    .unwrap();
                p
            })
            .collect();
        let pdir = dir.path().join("p");
        Pool::create_with_log(
            &pdir,
            Layout::Single,
            crate::pool::DeviceSpec::Files {
                count: 1,
                size_bytes: 64 << 20,
            },
            "p",
            &logs,
        )
        .unwrap();
        let opts = OpenOptions {
            commit_interval: std::time::Duration::from_secs(3600),
            allow_fault_injection: true,
            ..OpenOptions::default()
        };
        let vopts = plain_volume();
        let fill = |pool: &Pool, b: u8| {
            let v = pool.volume("v").unwrap();
            for lba in 0..8u64 {
                v.write(lba * 4096, &vec![b; 4096], false).unwrap();
            }
            v.flush().unwrap();
        };
        {
            let pool = Pool::open(&pdir, opts.clone()).unwrap();
            pool.create_volume("v", vopts, None).unwrap();
            pool.core().commit().unwrap();
            fill(&pool, 0x11); // on both halves
            let generation = pool.status().generation;
            pool.core()
                .set_faults(
                    &logs[0],
                    vec![Fault {
                        mode: FaultMode::WriteError,
                        probability: 1.0,
                        seed: 1,
                        include_labels: false,
                    }],
                )
                .unwrap();
            fill(&pool, 0x22); // half A fails here
            assert!(
                pool.status().generation > generation,
                "the flush that lost a half did not commit"
            );
            fill(&pool, 0x33); // on half B only
            drop(pool); // a crash
        }
        std::fs::remove_file(&logs[1]).unwrap();
        let pool = Pool::open(&pdir, opts).unwrap();
        let mut buf = vec![0u8; 4096];
        pool.volume("v").unwrap().read(0, &mut buf).unwrap();
        assert_eq!(buf[0], 0x22, "not the last commit's data");
        let l = pool.status().log.unwrap();
        assert!(
            l.note
                .as_deref()
                .is_some_and(|n| n.contains("cannot be replayed")),
            "the lost flushes are not reported: {l:?}"
        );
    }

    /// A small flush carries its records into the log device: with the records lost from
    /// the main devices (never synced there: zeroed here after the crash), the flushed
    /// blocks still come back, written back from the log device by the replay.
    #[test]
    fn a_small_flush_needs_only_the_log_device() {
        use crate::pool::Layout;
        for (layout, count) in [
            (Layout::Single, 1),
            (Layout::Mirror(2), 2),
            (Layout::Parity { k: 2, m: 1 }, 3),
        ] {
            small_flush_on(layout, count);
        }
    }

    fn small_flush_on(layout: crate::pool::Layout, count: usize) {
        use crate::pool::{OpenOptions, Pool};
        let dir = tempfile::tempdir().unwrap();
        let (pdir, log) = test_pool_with_log(dir.path(), layout, count, 16 << 20);
        let opts = OpenOptions {
            commit_interval: std::time::Duration::from_secs(3600),
            ..OpenOptions::default()
        };
        let vopts = plain_volume();
        let (records, footprint) = {
            let pool = Pool::open(&pdir, opts.clone()).unwrap();
            pool.create_volume("v", vopts, None).unwrap();
            let v = pool.volume("v").unwrap();
            for lba in 0..10u64 {
                v.write(lba * 4096, &vec![0xD4; 4096], false).unwrap();
            }
            v.flush().unwrap();
            let l = pool.core().logdev.read().clone().unwrap();
            let chain = l.state.lock().chain.unwrap();
            let (pool_id, chain_id) = {
                let sb = pool.core().sb.lock();
                (sb.sb.pool_id, sb.sb.chain_id)
            };
            let (b, data) = l
                .read_block(
                    chain.head,
                    0,
                    &pool_id,
                    &chain_id,
                    chain.generation,
                    Some(&pool.core().log_key),
                )
                .unwrap()
                .unwrap();
            assert_eq!(b.entries.len(), 10);
            assert!(b.data_slots >= 10, "the records are in the log");
            assert!(inline_records(&b, &data).iter().all(|r| r.is_some()));
            let footprint = pool.core().store.footprint(4096 + 16);
            drop(v);
            drop(pool); // a crash: no close, no commit
            (b.entries, footprint)
        };
        // The records never reached the main devices' media.
        // (Each copy, or each shard, lies at the record's offset in its segment, the
        // segment at the same place on every member: one device of a `single` pool here.)
        for i in 0..count {
            let d = FileDevice::open(&pdir.join(format!("dev{i}.img"))).unwrap();
            for e in &records {
                if !matches!(layout, crate::pool::Layout::Parity { .. }) {
                    let mut was = vec![0u8; e.ptr.len as usize];
                    d.read_at(&mut was, DEVICE_RESERVED_FRONT + e.ptr.addr[0])
                        .unwrap();
                    assert!(
                        verify(&e.ptr.checksum, &was),
                        "the record is where it is zeroed"
                    );
                }
                let zero = vec![0u8; footprint.min(e.ptr.len as usize)];
                d.write_at(&zero, DEVICE_RESERVED_FRONT + e.ptr.addr[0])
                    .unwrap();
            }
        }
        let pool = Pool::open(&pdir, opts.clone()).unwrap();
        let v = pool.volume("v").unwrap();
        let mut buf = vec![0u8; 4096];
        for lba in 0..10u64 {
            v.read(lba * 4096, &mut buf).unwrap();
            assert!(buf.iter().all(|&b| b == 0xD4), "block {lba}");
        }
        drop(v);
        pool.close().unwrap();
        drop(pool);
        // The import's commit made them durable on the main devices.
        std::fs::remove_file(&log).unwrap();
        let pool = Pool::open(&pdir, opts).unwrap();
        let v = pool.volume("v").unwrap();
        v.read(9 * 4096, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0xD4));
        assert_eq!(pool.status().unrecoverable_blocks, 0);
    }

    /// F2 (simulator seed 2040, crates/sim/tests/known_failures.rs): a small flush's
    /// records reach the main devices unsynced (the log device carries them). A power loss
    /// may then keep a record whole on one member of a mirror and lose it on the other;
    /// the replay must put it back on every member, not only when no copy verifies, or
    /// the pool runs on with one copy of a flushed write and loses it with that member.
    #[test]
    fn a_replay_rewrites_a_small_flush_on_every_member() {
        use crate::device::fault::{Fault, FaultMode};
        use crate::pool::{Layout, OpenOptions, Pool};
        let dir = tempfile::tempdir().unwrap();
        let (pdir, _log) = test_pool_with_log(dir.path(), Layout::Mirror(2), 2, 16 << 20);
        let opts = OpenOptions {
            commit_interval: std::time::Duration::from_secs(3600),
            allow_fault_injection: true,
            ..OpenOptions::default()
        };
        let (records, footprint) = {
            let pool = Pool::open(&pdir, opts.clone()).unwrap();
            pool.create_volume("v", plain_volume(), None).unwrap();
            let v = pool.volume("v").unwrap();
            for lba in 0..10u64 {
                v.write(lba * 4096, &vec![0xD4; 4096], false).unwrap();
            }
            v.flush().unwrap();
            let l = pool.core().logdev.read().clone().unwrap();
            let chain = l.state.lock().chain.unwrap();
            let (pool_id, chain_id) = {
                let sb = pool.core().sb.lock();
                (sb.sb.pool_id, sb.sb.chain_id)
            };
            let (b, _) = l
                .read_block(
                    chain.head,
                    0,
                    &pool_id,
                    &chain_id,
                    chain.generation,
                    Some(&pool.core().log_key),
                )
                .unwrap()
                .unwrap();
            let footprint = pool.core().store.footprint(4096 + 16);
            drop(v);
            drop(pool); // a crash: no close, no commit
            (b.entries, footprint)
        };
        // The power loss kept every record on dev0 and lost each on dev1.
        let d = FileDevice::open(&pdir.join("dev1.img")).unwrap();
        for e in &records {
            let zero = vec![0u8; footprint.min(e.ptr.len as usize)];
            d.write_at(&zero, DEVICE_RESERVED_FRONT + e.ptr.addr[0])
                .unwrap();
        }
        drop(d);
        let pool = Pool::open(&pdir, opts).unwrap();
        // dev0 fails: every block must still read from dev1.
        let fault = Fault {
            mode: FaultMode::ReadError,
            probability: 1.0,
            seed: 1,
            include_labels: false,
        };
        pool.set_faults(&pdir.join("dev0.img"), vec![fault])
            .unwrap();
        let v = pool.volume("v").unwrap();
        let mut buf = vec![0u8; 4096];
        for lba in 0..10u64 {
            v.read(lba * 4096, &mut buf)
                .unwrap_or_else(|e| panic!("block {lba}: {e}"));
            assert!(buf.iter().all(|&b| b == 0xD4), "block {lba}");
        }
    }

    #[test]
    fn label_decode_never_panics() {
        let b = Label {
            pool_id: [1; 16],
            device_id: [2; 16],
            role: ROLE_INTENT_LOG,
            slots: 77,
        }
        .encode();
        crate::fuzz::never_panics(
            "logdev::Label::decode",
            &[b],
            3000,
            Some(&|b: &mut Vec<u8>| {
                if b.len() == SUPERBLOCK_BYTES {
                    seal_self_checked(b)
                }
            }),
            &|b| {
                let _ = Label::decode(b);
            },
        );
    }
}
