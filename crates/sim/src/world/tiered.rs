//! The `tier` layout (docs/simulation.md): a `single` pool whose durable copy is in the
//! simulated object store (`objects.rs`), and the operations of its own.
//!
//! Every commit publishes to the store before the local labels (engine `pool/tier/`), so
//! a FLUSH answers once the store holds it. The seed draws:
//! - `TierFault`: a window of store faults (timeouts, 5xx, lost answers, 10 to 100 % of
//!   requests) around one flush, maintenance step or read. A flush may fail
//!   (`StoreUnavailable`: nothing acknowledged, the model unchanged), never succeed
//!   without the store holding it (the next crash checks), and the pool must stay
//!   unpoisoned (an outage is not a fault of the pool) and report the store FAILING
//!   until a commit goes through.
//! - `TierWriter`: a second writer. Another superblock object lands in the bucket: one
//!   sealed under another pool's key, or one of this pool (a host holding a copy of the
//!   directory) claiming a newer epoch, or a real takeover (another host restores from the
//!   bucket and opens the pool, `--force`). The pool must find itself fenced at its next
//!   commit or check and stop (poisoned), and after it stops an import of its directory
//!   must be refused; the world then goes on with the bucket's own head put back, or with
//!   the other host's copy.
//! - `TierRestore`: the local devices are lost; the pool is rebuilt from the bucket alone
//!   (`pool::tier::restore`) under a new writer, which takes it over.
//! - `TierStep`: the tier's clock-driven work, stepped (`Pool::tier_step`): the fencing
//!   check, which must find the pool held, and a garbage collection.
//!
//! After a second writer or a restore, as after a crash, each cell must hold its last
//! durable value or one acknowledged since. A seed may also give the pool a local cache
//! (`cache_bytes`: client data given back to the store, `pool/evict.rs`, and read from it).

use std::path::Path;
use std::sync::Arc;

use bulwark_engine::keys::pool_key::PoolKey;
use bulwark_engine::pool::format::config::{self, ObjectStoreConfig, PoolConfig};
use bulwark_engine::pool::tier::{self, Head, TierOpen, SUPERBLOCK_OBJECT};
use bulwark_engine::{Error, OpenOptions, Pool};

use super::{Kind, World, R};
use crate::objects::{Armed, SimStore, STORE_FAULTS};
use crate::rng::Rng;

/// The tier's kinds and their weights (drawn per seed, `TierStep` always on).
pub const TIER_KINDS: [(Kind, u64); 4] = [
    (Kind::TierFault, 15),
    (Kind::TierWriter, 2),
    (Kind::TierRestore, 2),
    (Kind::TierStep, 15),
];

/// Salt of the tier's own generator.
const TIER_SALT: u64 = 0x7135_0b7e_c7a5_0037;

/// Odds per mille of a request failing in a fault window.
const STORE_ODDS: [u64; 4] = [100, 300, 600, 1000];

/// The store and who writes it.
pub struct TierWorld {
    pub store: Arc<SimStore>,
    writer: String,
    /// The next import is the pool's first: the store must be empty.
    create: bool,
    /// The next import takes the pool from another writer (after a restore).
    force: bool,
    cache_bytes: Option<u64>,
    /// Hosts so far (names of writers and of their directories).
    hosts: u64,
}

/// The tier's draws (the `tier` layout only, else `None`): its kinds into `on`
/// (`LogChange` out: the pool's FLUSH goes to the store), and whether the pool has a local
/// cache. From a generator of their own: the other layouts' seeds are untouched.
pub fn draw(cfg: &super::Config, on: &mut Vec<(Kind, u64)>) -> Option<TierWorld> {
    if cfg.layout != super::SimLayout::Tier {
        return None;
    }
    let (seed, without) = (cfg.seed, &cfg.without);
    let mut t = Rng::new(seed ^ TIER_SALT);
    on.retain(|(k, _)| *k != Kind::LogChange);
    for (k, w) in TIER_KINDS {
        let drawn = k == Kind::TierStep || t.chance(600);
        if drawn && !without.contains(&k) {
            on.push((k, w));
        }
    }
    let cache_bytes = t
        .chance(400)
        .then(|| [4u64, 8, 16][t.below(3) as usize] << 20);
    Some(TierWorld {
        store: Arc::new(SimStore::default()),
        writer: "sim-host-0".into(),
        create: true,
        force: false,
        cache_bytes,
        hosts: 0,
    })
}

impl TierWorld {
    fn config(&self, writer: &str) -> ObjectStoreConfig {
        ObjectStoreConfig {
            url: "sim://bucket".into(),
            credentials: None,
            writer: writer.into(),
            single_host: false,
            local_flush: false,
            cache_bytes: self.cache_bytes,
        }
    }

    /// What the seed drew, for the trace.
    pub fn describe(&self) -> String {
        format!("object store, local cache {:?}", self.cache_bytes)
    }

    /// The new pool's `pool.json` names the store.
    pub fn configure(&self, dir: &Path) -> R {
        let mut conf = PoolConfig::read(dir).map_err(|e| format!("pool.json: {e}"))?;
        conf.object_store = Some(self.config(&self.writer));
        conf.write(dir).map_err(|e| format!("pool.json: {e}"))
    }

    fn open_as(&self, writer: &str, create: bool, force: bool) -> TierOpen {
        TierOpen {
            store: self.store.clone(),
            writer: writer.into(),
            create,
            force,
            // Collected at each step: every object no commit references goes at once.
            gc_grace: std::time::Duration::ZERO,
            local_flush: false,
            cache_bytes: self.cache_bytes,
            defer_unreachable: false,
            single_host: false,
        }
    }

    /// What the next import of the world's pool takes.
    pub fn open(&mut self) -> TierOpen {
        let o = self.open_as(&self.writer, self.create, self.force);
        (self.create, self.force) = (false, false);
        o
    }
}

/// The bucket's superblock object as this pool wrote it: its bytes, the head, and the key
/// of its MAC.
type OurHead = (Vec<u8>, Head, zeroize::Zeroizing<[u8; 32]>);

fn fenced(e: &Error) -> bool {
    matches!(e, Error::Fenced(_))
}

impl World {
    fn tw(&self) -> &TierWorld {
        self.tier.as_ref().expect("the tier layout")
    }

    fn tw_mut(&mut self) -> &mut TierWorld {
        self.tier.as_mut().expect("the tier layout")
    }

    fn store_state(&self) -> String {
        self.pool()
            .status()
            .object_store
            .map(|s| s.state)
            .unwrap_or_default()
    }

    /// `TierFault`: a window of store faults around one flush, maintenance step or read.
    pub(super) fn tier_fault(&mut self, vi: usize) -> R {
        let odds = STORE_ODDS[self.rng.below(4) as usize];
        let modes = if self.rng.chance(500) {
            STORE_FAULTS.to_vec()
        } else {
            vec![STORE_FAULTS[self.rng.below(3) as usize]]
        };
        let seed = self.rng.next_u64();
        let action = self.rng.below(10);
        self.trace
            .text(&format!("store faults {odds} {modes:?} action {action}"));
        if action <= 5 {
            // A write first, so that the flush has something to publish.
            self.write(vi)?;
        }
        let store = self.tw().store.clone();
        let before = store.faults_given();
        store.arm(Some(Armed { seed, odds, modes }));
        let got = match action {
            0..=5 => self.handle(vi).flush(),
            6..=8 => self.pool().maintenance_step(),
            _ => {
                let r = self.tier_read(vi);
                store.arm(None);
                r?;
                Ok(())
            }
        };
        store.arm(None);
        let hit = store.faults_given() - before;
        self.stats.store_windows += 1;
        self.stats.store_windows_hit += (hit > 0) as u64;
        if self.trace.1 {
            // Not in the trace: how many uploads a commit makes depends on record sizes.
            eprintln!("  store requests failed: {hit}");
        }
        if self.pool().status().state == "FAULTED" {
            return Err(format!(
                "the pool is poisoned after a store outage ({hit} requests failed): {got:?}"
            ));
        }
        match got {
            Ok(()) if action <= 5 => {
                self.stats.flushes += 1;
                self.everything_durable();
                self.trace.text("flushed");
            }
            Ok(()) => {}
            Err(Error::StoreUnavailable(m)) if action <= 5 => {
                if hit == 0 {
                    return Err(format!("a flush failed with no store fault given: {m}"));
                }
                // Not acknowledged: the model keeps every value since the last durable
                // point as what a crash may leave (the store may have taken it).
                self.stats.store_commits_failed += 1;
                self.trace.text("flush refused");
                let state = self.store_state();
                if state != "FAILING" {
                    return Err(format!("the store is {state} after a refused flush"));
                }
            }
            Err(e) => return Err(format!("under store faults ({hit} given): {e}")),
        }
        Ok(())
    }

    /// A read while the store fails: with a local cache, reads of data given back go to
    /// the store. It may fail; it never returns wrong bytes.
    fn tier_read(&mut self, vi: usize) -> R {
        let cells = self.vols[vi].cells.len() as u64;
        let n = self.rng.range(1, 64.min(cells));
        let c0 = self.rng.below(cells - n + 1);
        let n = self.vols[vi].clip(c0, n);
        self.trace
            .text(&format!("read under store faults {vi} {c0}+{n}"));
        let mut buf = vec![0u8; (n * crate::model::CELL) as usize];
        match self.handle(vi).read(self.vols[vi].offset(c0), &mut buf) {
            Ok(()) => {
                let what = self.vols[vi].name.clone();
                self.check_bytes(vi, None, c0, n, &buf, &what)
            }
            Err(e @ (Error::StoreUnavailable(_) | Error::Io(_) | Error::Unrecoverable(_))) => {
                self.stats.faulty_reads_refused += 1;
                self.trace.text(super::kind_of(&e));
                Ok(())
            }
            Err(e) => Err(format!("read under store faults: {e}")),
        }
    }

    /// `TierStep`: the fencing check (held: no other writer) and a collection.
    pub(super) fn tier_step(&mut self) -> R {
        self.trace.text("tier step");
        self.stats.tier_steps += 1;
        match self.pool().tier_step() {
            Ok(true) => {}
            Ok(false) => return Err("the pool found itself fenced with no other writer".into()),
            Err(e) => return Err(format!("tier step: {e}")),
        }
        if self.trace.1 {
            // Not in the trace: record sizes (random nonces) decide how many there are.
            eprintln!(
                "  objects in the bucket: {}",
                self.tw().store.object_count()
            );
        }
        Ok(())
    }

    /// This pool's superblock object key and its head as the bucket holds it now.
    fn our_head(&self) -> Result<Option<OurHead>, String> {
        let dir = self.dir.path();
        let key = PoolKey::load(&config::key_path(dir)).map_err(|e| format!("pool key: {e}"))?;
        let conf = PoolConfig::read(dir).map_err(|e| format!("pool.json: {e}"))?;
        let id: [u8; 16] = bulwark_engine::hex::from_hex(&conf.pool_id)
            .and_then(|v| v.try_into().ok())
            .ok_or("pool.json's pool id")?;
        let okey = tier::object_key(&key.superblock_key(&id));
        let Some(bytes) = self.tw().store.raw_get(SUPERBLOCK_OBJECT) else {
            return Ok(None);
        };
        let head = Head::open(&bytes, &okey).map_err(|e| format!("our own head: {e}"))?;
        Ok(Some((bytes, head, okey)))
    }

    /// `TierWriter`: another writer's superblock object in the bucket. The pool must
    /// find itself fenced, stop, and refuse to import until the bucket is its own again.
    pub(super) fn tier_writer(&mut self) -> R {
        let Some((ours, head, okey)) = self.our_head()? else {
            return Ok(());
        };
        let how = self.rng.below(3);
        self.trace.text(&format!("second writer {how}"));
        let host = match how {
            // Another pool's head: sealed under its own key.
            0 => {
                let mut other = head.clone();
                other.writer = "another-pool".into();
                other.epoch += 1;
                let key: [u8; 32] = std::array::from_fn(|i| (self.rng.next_u64() >> i) as u8);
                self.tw().store.raw_put(SUPERBLOCK_OBJECT, other.seal(&key));
                None
            }
            // This pool's, from a host with a copy of its directory and key.
            1 => {
                let mut other = head.clone();
                other.writer = "copied-host".into();
                other.epoch += 1;
                other.session = format!("{:016x}", self.rng.next_u64());
                self.tw()
                    .store
                    .raw_put(SUPERBLOCK_OBJECT, other.seal(&okey));
                None
            }
            // A real takeover: another host restores from the bucket and opens the pool.
            _ => Some(self.second_host(true)?),
        };
        self.stats.second_writers += 1;
        self.expect_fenced(host.is_some())?;
        self.power_off()?;
        // Its directory is stale now: an import must refuse it, never serve it.
        let opts = self.options();
        match Pool::open(self.dir.path(), opts) {
            Ok(_) => return Err("the pool imported over another writer's superblock object".into()),
            Err(e) => self.trace.text(super::kind_of(&e)),
        }
        match host {
            None => self.tw().store.raw_put(SUPERBLOCK_OBJECT, ours),
            Some((sub, writer)) => self.move_in(&sub, writer)?,
        }
        self.open()?;
        self.after_crash()
    }

    /// After another writer: the pool's next commit or check must say it was fenced, and
    /// the pool stop (poisoned).
    fn expect_fenced(&mut self, takeover: bool) -> R {
        let got = if self.rng.chance(500) {
            // A flush with something to publish.
            let vi = self.rng.below(self.vols.len() as u64) as usize;
            self.write_one(vi)?;
            match self.handle(vi).flush() {
                Err(e) if fenced(&e) => Ok(()),
                other => Err(format!("flush after another writer: {other:?}")),
            }
        } else {
            match self.pool().tier_step() {
                Ok(false) => Ok(()),
                other => Err(format!("tier check after another writer: {other:?}")),
            }
        };
        got.map_err(|e| format!("{e} (a real takeover: {takeover})"))?;
        let st = self.pool().status();
        let store = st.object_store.map(|s| s.state).unwrap_or_default();
        if st.state != "FAULTED" || store != "FENCED" {
            return Err(format!(
                "fenced, yet the pool is {} and its store {store}",
                st.state
            ));
        }
        self.stats.fenced += 1;
        self.trace.text("fenced");
        Ok(())
    }

    /// One cell written (not FUA): something for the next commit to publish.
    fn write_one(&mut self, vi: usize) -> R {
        let c = self.rng.below(self.vols[vi].cells.len() as u64);
        let v = self.new_value();
        let mut buf = vec![0u8; crate::model::CELL as usize];
        crate::model::fill_cell(v, c, &mut buf);
        self.trace.text(&format!("write {vi} {c} value {v}"));
        let got = self.handle(vi).write(self.vols[vi].offset(c), &buf, false);
        let cell = &mut self.vols[vi].cells[c as usize];
        match got {
            Ok(()) => cell.set(v),
            Err(e) => {
                cell.maybe(v);
                self.trace.text(super::kind_of(&e));
            }
        }
        Ok(())
    }

    /// Another host rebuilds the pool from the bucket alone into a directory of its own
    /// (`pool import --object-store --force`); `open`: it also takes the pool over and
    /// closes it. Its directory and writer name.
    fn second_host(&mut self, open: bool) -> Result<(std::path::PathBuf, String), String> {
        self.tw_mut().hosts += 1;
        let n = self.tw().hosts;
        let writer = format!("sim-host-{n}");
        let sub = self.dir.path().join(format!("host-{n}"));
        let key = PoolKey::load(&config::key_path(self.dir.path()))
            .map_err(|e| format!("pool key: {e}"))?;
        let conf = self.tw().config(&writer);
        let report = tier::restore(&sub, &*self.tw().store, &key, conf, true, None, &|_, _| {})
            .map_err(|e| format!("restore from the bucket: {e}"))?;
        self.trace.text(&format!(
            "restored generation {} epoch {}",
            report.generation, report.epoch
        ));
        if open {
            let opts = OpenOptions {
                stepped: true,
                tier: Some(self.tw().open_as(&writer, false, true)),
                ..OpenOptions::default()
            };
            let pool =
                Pool::open(&sub, opts).map_err(|e| format!("the other host's import: {e}"))?;
            pool.close()
                .map_err(|e| format!("the other host's close: {e}"))?;
        }
        Ok((sub, writer))
    }

    /// The files of the pool in `sub` replace the world's (device files, `pool.json`,
    /// the key and the anchor: devices are named relative to the directory); `writer`
    /// writes it from now on. A cache device starts blank.
    fn move_in(&mut self, sub: &Path, writer: String) -> R {
        let dir = self.dir.path().to_path_buf();
        let entries = std::fs::read_dir(sub).map_err(|e| format!("{}: {e}", sub.display()))?;
        for e in entries.flatten() {
            let to = dir.join(e.file_name());
            std::fs::rename(e.path(), &to).map_err(|err| format!("{}: {err}", to.display()))?;
        }
        let _ = std::fs::remove_dir(sub);
        if let Some(c) = &self.cache {
            std::fs::File::create(c)
                .and_then(|f| f.set_len(super::CACHE_DEVICE_BYTES))
                .map_err(|e| format!("cache device file: {e}"))?;
        }
        self.tw_mut().writer = writer;
        Ok(())
    }

    /// `TierRestore`: the machine stops and its devices are lost; the pool is rebuilt
    /// from the bucket alone under a new writer, which takes it over.
    pub(super) fn tier_restore(&mut self) -> R {
        self.trace.text("restore from the bucket");
        self.power_off()?;
        let (sub, writer) = self.second_host(false)?;
        self.move_in(&sub, writer)?;
        self.tw_mut().force = true;
        self.stats.restores += 1;
        self.open()?;
        self.after_crash()
    }
}
