//! A seeded model test near full: on a small pool (single, mirror:2 or parity:2+1), three
//! volumes (plain, encrypted + lz4, lz4 with 16 KiB
//! blocks) fill 75–90% of a small pool's usable space with incompressible data, then a long
//! random mix of overwrites (4 KiB, 64 KiB, odd lengths), trims, write-zeroes, flushes, FUA
//! writes, volume destroy + recreate, clean restarts and crashes (the pool dropped without
//! a close) runs against them, and every read is compared with a model.
//!
//! The model keeps, per 4 KiB cell, the values a read may return now (`cur`) and the values
//! a crash may bring back (`dur`: the value at the last flush and every value written
//! since). After a crash every cell is read and pinned to what it holds.
//!
//! Space: the volumes' sizes fit the pool's usable space, so the live data always fits and
//! no write is answered `NoSpace` (issue 18, part 1): the first one fails the test. (This
//! test found why it used to happen: a cleaner pass cut short emptied no victim, a trim's
//! wait asked more than its hold, and parity's usable space promised more than writes could
//! use.) With `BULWARK_MODEL_STRICT_SPACE=0` a `NoSpace` only has to leave the pool ONLINE,
//! the operation's blocks as they were (a batch of whole blocks) or each old or new, and
//! every later read right: for exploring pools filled past their usable space.
//!
//! Knobs (environment):
//! - `BULWARK_TEST_SEED`: the first seed (default: from the clock; printed, so a failure
//!   can be replayed; background commits and the cleaner run on their own thread, so a
//!   replay takes the same operations, not always the same interleaving);
//! - `BULWARK_MODEL_SEEDS`: how many seeds to run (default 3), each a new pool;
//! - `BULWARK_MODEL_OPS`: operations per seed (default 8000);
//! - `BULWARK_MODEL_STRICT_SPACE=0`: a `NoSpace` is checked, not a failure.

use std::path::Path;
use std::sync::Arc;

use bulwark_engine::{
    Compression, DeviceSpec, Error, Layout, OpenOptions, Pool, Secret, Volume, VolumeOptions,
};
use zeroize::Zeroizing;

const CELL: u64 = 4096;
/// A seed whose operations were answered `NoSpace` this many times ends its mix early (the
/// pool is then checked after a crash): near full the pool can stay out of space.
const NOSPACE_MAX: usize = 8;

mod common;
use common::{env_u64, run_seeds, Rng};

/// The bytes of a cell holding value `tag` (0: zeros): a header naming the value and the
/// cell, then incompressible bytes drawn from both.
fn fill_cell(tag: u64, cell: u64, out: &mut [u8]) {
    if tag == 0 {
        out.fill(0);
        return;
    }
    out[..8].copy_from_slice(&tag.to_le_bytes());
    out[8..16].copy_from_slice(&cell.to_le_bytes());
    let mut r = Rng(tag.wrapping_mul(0xD134_2543_DE82_EF95) ^ cell);
    for c in out[16..].chunks_mut(8) {
        let x = r.next().to_le_bytes();
        c.copy_from_slice(&x[..c.len()]);
    }
}

/// What one cell of a volume may read as.
#[derive(Clone)]
struct Cell {
    /// Values a read may return now (one, except briefly after a failed operation).
    cur: Vec<u64>,
    /// Values a crash may bring back: the value at the last flush and those written since.
    dur: Vec<u64>,
}

impl Cell {
    fn zero() -> Cell {
        Cell {
            cur: vec![0],
            dur: vec![0],
        }
    }
    fn set(&mut self, tag: u64) {
        self.cur.clear();
        self.cur.push(tag);
        if !self.dur.contains(&tag) {
            self.dur.push(tag);
        }
    }
    /// An operation failed: it may or may not have reached this cell.
    fn maybe(&mut self, tag: u64) {
        if !self.cur.contains(&tag) {
            self.cur.push(tag);
        }
        if !self.dur.contains(&tag) {
            self.dur.push(tag);
        }
    }
}

struct Vol {
    name: &'static str,
    opts: VolumeOptions,
    key: Option<u8>,
    cells: Vec<Cell>,
    /// Cells reading as zeros (recounted every 50 operations).
    zero_cells: u64,
    handle: Option<Arc<Volume>>,
}

impl Vol {
    fn bs(&self) -> u64 {
        self.opts.block_size as u64
    }
    fn v(&self) -> &Volume {
        self.handle.as_ref().expect("volume open")
    }
}

fn secret(b: u8) -> Secret {
    Secret::KeyFile(Zeroizing::new([b; 32]))
}

#[derive(Default, Debug)]
struct Stats {
    writes: u64,
    fua: u64,
    trims: u64,
    zeroes: u64,
    reads: u64,
    flushes: u64,
    destroys: u64,
    crashes: u64,
    restarts: u64,
    nospace: Vec<String>,
    bytes_written: u64,
    /// MiB placed by client writes, the cleaner and commits (summed over the imports).
    written_mib: (u64, u64, u64),
    /// Lowest and highest used/usable seen (sampled every 100 operations), per mille.
    fill_permille: (u64, u64),
}

struct Run {
    seed: u64,
    dir: tempfile::TempDir,
    rng: Rng,
    pool: Option<Arc<Pool>>,
    vols: Vec<Vol>,
    next_tag: u64,
    op: u64,
    stats: Stats,
    open_opts: OpenOptions,
    strict: bool,
    /// A `NoSpace` was answered and the test is strict: it fails once the operation's
    /// cells were read back (so the report says whether they were left whole).
    nospace_pending: bool,
}

impl Run {
    fn ctx(&self) -> String {
        format!(
            "seed {:#x} (BULWARK_TEST_SEED={:#x} replays it), op {}",
            self.seed, self.seed, self.op
        )
    }

    fn pool(&self) -> &Pool {
        self.pool.as_ref().expect("pool open")
    }

    fn tag(&mut self) -> u64 {
        self.next_tag += 1;
        self.next_tag
    }

    fn open(&mut self) {
        let pool = Pool::open(self.dir.path(), self.open_opts.clone())
            .unwrap_or_else(|e| panic!("{}: the pool does not import: {e}", self.ctx()));
        for v in &mut self.vols {
            if let Some(k) = v.key {
                pool.load_key(v.name, &secret(k)).unwrap();
            }
            v.handle = Some(pool.volume(v.name).unwrap());
        }
        self.pool = Some(pool);
    }

    /// Adds what this import of the pool has written to `stats.written_mib`.
    fn count_written(&mut self) {
        let sp = self.pool().status().space;
        self.stats.written_mib.0 += sp.data_written_bytes >> 20;
        self.stats.written_mib.1 += sp.clean_written_bytes >> 20;
        self.stats.written_mib.2 += sp.meta_written_bytes >> 20;
    }

    fn close_handles(&mut self) {
        for v in &mut self.vols {
            v.handle = None;
        }
    }

    fn fail(&self, what: String) -> ! {
        let st = self.pool.as_ref().map(|p| p.status());
        panic!(
            "{}: {what}\nstats: {:?}\nspace: {:?}\nstate: {:?}",
            self.ctx(),
            self.stats,
            st.as_ref().map(|s| &s.space),
            st.as_ref().map(|s| &s.state)
        );
    }

    /// The error of a failed operation: `NoSpace` is noted (the pool must stay ONLINE),
    /// anything else fails the test.
    fn failed(&mut self, what: &str, e: Error) {
        if !matches!(e, Error::NoSpace) {
            self.fail(format!("{what}: {e:?}"));
        }
        let st = self.pool().status();
        let line = format!(
            "op {} {what}: used {} usable {} free {} reserved {} written data/clean/meta {}/{}/{} MiB",
            self.op,
            st.space.used_bytes >> 10,
            st.space.usable_bytes >> 10,
            st.space.free_bytes >> 10,
            st.space.reserved_bytes >> 10,
            st.space.data_written_bytes >> 20,
            st.space.clean_written_bytes >> 20,
            st.space.meta_written_bytes >> 20,
        );
        eprintln!("NoSpace at {line} (KiB)");
        self.stats.nospace.push(line);
        if st.state != "ONLINE" {
            self.fail(format!(
                "{what} answered NoSpace and left the pool {}",
                st.state
            ));
        }
        self.nospace_pending = self.strict;
    }

    /// Read cells `[c0, c0+n)` of volume `vi` and compare each with the model; a cell with
    /// several candidates is pinned to the one it holds (`pin_dur`: also as what a crash
    /// brings back, for a read right after an import).
    fn check(&mut self, vi: usize, c0: u64, n: u64, pin_dur: bool) {
        let mut buf = vec![0u8; (n * CELL) as usize];
        if let Err(e) = self.vols[vi].v().read(c0 * CELL, &mut buf) {
            self.fail(format!(
                "read of volume {} cells {c0}..{}: {e:?}",
                self.vols[vi].name,
                c0 + n
            ));
        }
        self.stats.reads += 1;
        let mut want = vec![0u8; CELL as usize];
        for i in 0..n {
            let cell = c0 + i;
            let got = &buf[(i * CELL) as usize..((i + 1) * CELL) as usize];
            let tag = if got.iter().all(|&b| b == 0) {
                0
            } else {
                u64::from_le_bytes(got[..8].try_into().unwrap())
            };
            fill_cell(tag, cell, &mut want);
            let m = &mut self.vols[vi].cells[cell as usize];
            let (ok_bytes, ok_model) = (got == want.as_slice(), m.cur.contains(&tag));
            if !ok_bytes || !ok_model {
                let (cur, dur) = (m.cur.clone(), m.dur.clone());
                self.fail(format!(
                    "volume {} cell {cell} (byte {}): read value {tag} ({}), the model allows {cur:?} (crash candidates {dur:?})",
                    self.vols[vi].name,
                    cell * CELL,
                    if ok_bytes { "whole" } else { "bytes are not that value's: corrupt or torn" }
                ));
            }
            if m.cur.len() > 1 {
                m.cur = vec![tag];
            }
            if pin_dur {
                m.dur = vec![tag];
            }
        }
    }

    fn check_all(&mut self, pin_dur: bool) {
        for vi in 0..self.vols.len() {
            let cells = self.vols[vi].cells.len() as u64;
            let mut c = 0;
            while c < cells {
                let n = (cells - c).min(256);
                self.check(vi, c, n, pin_dur);
                c += n;
            }
        }
    }

    /// Everything completed so far is durable.
    fn model_flushed(&mut self) {
        for v in &mut self.vols {
            for c in &mut v.cells {
                if c.dur.len() != 1 || c.dur != c.cur {
                    c.dur.clone_from(&c.cur);
                }
            }
        }
    }

    /// Write cells `[c0, c0+n)` of volume `vi`, each with a new value (some zeros).
    fn write(&mut self, vi: usize, c0: u64, n: u64, fua: bool) {
        let zero_cells = self.rng.chance(50);
        let tags: Vec<u64> = (0..n)
            .map(|_| {
                if zero_cells && self.rng.chance(300) {
                    0
                } else {
                    self.tag()
                }
            })
            .collect();
        let mut buf = vec![0u8; (n * CELL) as usize];
        for (i, &t) in tags.iter().enumerate() {
            fill_cell(
                t,
                c0 + i as u64,
                &mut buf[i * CELL as usize..(i + 1) * CELL as usize],
            );
        }
        let r = self.vols[vi].v().write(c0 * CELL, &buf, fua);
        self.stats.writes += 1;
        self.stats.fua += fua as u64;
        match r {
            Ok(()) => {
                self.stats.bytes_written += n * CELL;
                let v = &mut self.vols[vi];
                for (i, &t) in tags.iter().enumerate() {
                    v.cells[(c0 + i as u64) as usize].set(t);
                }
                if fua {
                    self.model_flushed();
                }
            }
            Err(e) => {
                let what = format!(
                    "write of volume {} cells {c0}..{} (fua {fua})",
                    self.vols[vi].name,
                    c0 + n
                );
                self.failed(&what, e);
                // One batch of whole blocks is placed whole or not at all.
                let bs = self.vols[vi].bs();
                let whole = (c0 * CELL) % bs == 0 && (n * CELL) % bs == 0;
                let one_block = (c0 * CELL) / bs == ((c0 + n) * CELL - 1) / bs;
                let before: Vec<Vec<u64>> = (0..n)
                    .map(|i| self.vols[vi].cells[(c0 + i) as usize].cur.clone())
                    .collect();
                for (i, &t) in tags.iter().enumerate() {
                    self.vols[vi].cells[(c0 + i as u64) as usize].maybe(t);
                }
                self.check(vi, c0, n, false);
                if whole || one_block {
                    for i in 0..n {
                        let now = &self.vols[vi].cells[(c0 + i) as usize].cur;
                        if !before[i as usize].contains(&now[0]) {
                            self.fail(format!(
                                "{what} answered NoSpace but changed cell {}",
                                c0 + i
                            ));
                        }
                    }
                }
            }
        }
    }

    /// Trim (`zero == false`: whole blocks inside the range become holes, partial blocks
    /// stay) or write zeroes (the whole range reads as zeros) over cells `[c0, c0+n)`.
    fn unmap(&mut self, vi: usize, c0: u64, n: u64, zero: bool, fua: bool) {
        let (off, len) = (c0 * CELL, n * CELL);
        let bs = self.vols[vi].bs();
        let r = if zero {
            self.stats.zeroes += 1;
            self.vols[vi].v().write_zeroes(off, len, fua)
        } else {
            self.stats.trims += 1;
            self.vols[vi].v().trim(off, len)
        };
        // Cells the operation makes zero.
        let (lo, hi) = if zero {
            (c0, c0 + n)
        } else {
            (off.div_ceil(bs) * bs / CELL, (off + len) / bs * bs / CELL)
        };
        match r {
            Ok(()) => {
                for c in lo..hi.max(lo) {
                    self.vols[vi].cells[c as usize].set(0);
                }
                if fua {
                    self.model_flushed();
                }
            }
            Err(e) => {
                let what = format!(
                    "{} of volume {} cells {c0}..{}",
                    if zero { "write_zeroes" } else { "trim" },
                    self.vols[vi].name,
                    c0 + n
                );
                self.failed(&what, e);
                for c in lo..hi.max(lo) {
                    self.vols[vi].cells[c as usize].maybe(0);
                }
                self.check(vi, c0, n, false);
            }
        }
    }

    fn flush(&mut self) {
        self.stats.flushes += 1;
        let r = if self.rng.chance(500) {
            self.pool().flush()
        } else {
            self.vols[0].v().flush()
        };
        if let Err(e) = r {
            self.fail(format!("flush: {e:?}"));
        }
        self.model_flushed();
    }

    /// Drop everything without a close: what a crash leaves is the last commit.
    fn crash(&mut self) {
        self.stats.crashes += 1;
        self.count_written();
        self.close_handles();
        drop(self.pool.take());
        for v in &mut self.vols {
            for c in &mut v.cells {
                c.cur.clone_from(&c.dur);
            }
        }
        self.open();
        self.check_all(true);
    }

    /// Flush, close and import again: the space the import counts (a walk of every map) is
    /// what the running pool counted.
    fn restart(&mut self) {
        self.stats.restarts += 1;
        self.flush();
        // A commit: until one, the running count also holds the intent log's blocks since
        // the last commit, which the import (after the close's commit) has no more.
        if let Err(e) = self.pool().flush() {
            self.fail(format!("commit before a restart: {e:?}"));
        }
        let before = self.pool().status().space;
        self.count_written();
        self.close_handles();
        let pool = self.pool.take().unwrap();
        if let Err(e) = pool.close() {
            self.fail(format!("close: {e:?}"));
        }
        drop(pool);
        self.open();
        let after = self.pool().status().space;
        // The volume table is rewritten by the import's own commit; allow a few records.
        // And one batch of the cleaner in flight when `before` was read: the pool is not
        // stepped, so a pass that began after the commit above may have placed a batch's
        // copies (at most 256 KiB of stored bytes and the record that reaches it, the
        // engine's `MOVE_BATCH_BYTES`) and not yet released the records they replace; the
        // close finishes the pass. Seen once: 262,584 bytes over (seed 0x18ee688da54bd482,
        // whose replay then passed). A drift, unlike that, grows with every restart.
        let diff = after.used_bytes.abs_diff(before.used_bytes);
        if diff > (64 << 10) + (256 << 10) + (16 << 10) {
            self.fail(format!(
                "used bytes {} before a clean restart, {} after (the running pool's count drifted)",
                before.used_bytes, after.used_bytes
            ));
        }
        self.check_all(true);
    }

    fn destroy_recreate(&mut self, vi: usize) {
        self.stats.destroys += 1;
        let name = self.vols[vi].name;
        self.vols[vi].handle = None;
        if let Err(e) = self.pool().destroy_volume(name) {
            self.fail(format!("destroy of {name}: {e:?}"));
        }
        // Destroy commits: everything completed is durable, the volume gone.
        self.vols[vi]
            .cells
            .iter_mut()
            .for_each(|c| *c = Cell::zero());
        self.model_flushed();
        let opts = self.vols[vi].opts.clone();
        let key = self.vols[vi].key;
        if let Err(e) = self
            .pool()
            .create_volume(name, opts, key.map(secret).as_ref())
        {
            self.fail(format!("create of {name}: {e:?}"));
        }
        self.vols[vi].handle = Some(self.pool().volume(name).unwrap());
        // Filled again at once and flushed, so the pool stays near full.
        self.fill_volume(vi);
        self.flush();
    }

    /// Write every cell of volume `vi`, 1 MiB at a time.
    fn fill_volume(&mut self, vi: usize) {
        let cells = self.vols[vi].cells.len() as u64;
        let mut c = 0;
        while c < cells {
            let n = (cells - c).min(256);
            self.write(vi, c, n, false);
            c += n;
        }
    }

    /// A cell to start an operation of `n` cells at: uniform, or in the volume's hot tenth.
    fn start(&mut self, vi: usize, n: u64) -> u64 {
        let cells = self.vols[vi].cells.len() as u64;
        self.pick(vi, n, cells)
    }

    /// A cell to start a write of `n` cells at: while trims have left more than a twentieth
    /// of the volume's cells zero, half the writes start at one of them (found by sampling),
    /// so the pool stays near full.
    fn write_start(&mut self, vi: usize, n: u64) -> u64 {
        let cells = self.vols[vi].cells.len() as u64;
        if self.vols[vi].zero_cells * 20 > cells && self.rng.chance(500) {
            for _ in 0..16 {
                let c = self.rng.below(cells - n + 1);
                if self.vols[vi].cells[c as usize].cur == [0] {
                    return c;
                }
            }
        }
        self.pick(vi, n, cells)
    }

    fn pick(&mut self, _vi: usize, n: u64, cells: u64) -> u64 {
        let span = if self.rng.chance(300) {
            (cells / 10).max(n)
        } else {
            cells
        };
        self.rng.below(span - n + 1)
    }

    fn step(&mut self) {
        if self.nospace_pending {
            self.fail(format!(
                "an operation in a pool whose live data fits was answered NoSpace: {}",
                self.stats.nospace.join("; ")
            ));
        }
        self.op += 1;
        let vi = self.rng.below(self.vols.len() as u64) as usize;
        let dice = self.rng.below(1000);
        match dice {
            // Overwrites: 4 KiB, 64 KiB, odd lengths; some FUA.
            0..=549 => {
                let n = match self.rng.below(10) {
                    0..=4 => 1,
                    5..=8 => 16,
                    _ => self.rng.range(2, 48),
                };
                let c0 = self.write_start(vi, n);
                let fua = self.rng.chance(20);
                self.write(vi, c0, n, fua);
            }
            550..=619 => {
                let n = self.rng.range(1, 32);
                let c0 = self.start(vi, n);
                self.unmap(vi, c0, n, false, false);
            }
            620..=679 => {
                let n = self.rng.range(1, 32);
                let c0 = self.start(vi, n);
                let fua = self.rng.chance(50);
                self.unmap(vi, c0, n, true, fua);
            }
            680..=939 => {
                let n = self.rng.range(1, 64);
                let c0 = self.start(vi, n);
                self.check(vi, c0, n, false);
            }
            940..=984 => self.flush(),
            985..=990 => self.crash(),
            991..=993 => self.restart(),
            994..=995 => self.destroy_recreate(vi),
            _ => {
                // Read a whole volume.
                let cells = self.vols[vi].cells.len() as u64;
                let mut c = 0;
                while c < cells {
                    let n = (cells - c).min(256);
                    self.check(vi, c, n, false);
                    c += n;
                }
            }
        }
        if self.op % 50 == 0 {
            for v in &mut self.vols {
                v.zero_cells = v.cells.iter().filter(|c| c.cur == [0]).count() as u64;
            }
        }
        if self.op % 100 == 0 {
            let st = self.pool().status();
            let fill = st.space.used_bytes * 1000 / st.space.usable_bytes.max(1);
            self.stats.fill_permille.0 = self.stats.fill_permille.0.min(fill);
            self.stats.fill_permille.1 = self.stats.fill_permille.1.max(fill);
            if st.state != "ONLINE" || !st.errors.is_empty() || st.unrecoverable_blocks > 0 {
                self.fail(format!(
                    "pool {} with errors {:?}, {} unrecoverable blocks",
                    st.state, st.errors, st.unrecoverable_blocks
                ));
            }
        }
    }
}

/// Map bytes (both copies of every node) for `blocks` blocks: a leaf per 64 and the nodes
/// above, 4 KiB each.
fn map_bytes(blocks: u64) -> u64 {
    let leaves = blocks.div_ceil(64);
    (leaves + leaves / 63 + 4) * 4096 * 2
}

fn run_seed(seed: u64, ops: u64) {
    let mut rng = Rng(seed);
    let dir = if Path::new("/dev/shm").is_dir() {
        tempfile::tempdir_in("/dev/shm").unwrap()
    } else {
        tempfile::tempdir().unwrap()
    };
    let device_mib = rng.range(40, 96);
    let (layout, devices, device_mib) = match rng.below(4) {
        0 | 1 => (Layout::Single, 1, device_mib),
        2 => (Layout::Mirror(2), 2, device_mib),
        _ => (Layout::Parity { k: 2, m: 1 }, 3, device_mib / 2 + 8),
    };
    Pool::create(
        dir.path(),
        layout,
        DeviceSpec::Files {
            count: devices,
            size_bytes: device_mib << 20,
        },
    )
    .unwrap();
    // Background commits every few ms to every few seconds: crashes find different
    // durable states.
    let commit_interval = std::time::Duration::from_millis(match rng.below(3) {
        0 => 20,
        1 => 300,
        _ => 5000,
    });
    let open_opts = OpenOptions {
        commit_interval,
        // Every put and release checked against the others of the run (`store/live.rs`).
        check_addresses: true,
        ..OpenOptions::default()
    };
    let fill_pct = rng.range(78, 92);
    let mut run = Run {
        seed,
        dir,
        rng,
        pool: None,
        vols: Vec::new(),
        next_tag: 0,
        op: 0,
        stats: Stats {
            fill_permille: (1000, 0),
            ..Stats::default()
        },
        open_opts,
        strict: env_u64("BULWARK_MODEL_STRICT_SPACE").unwrap_or(1) != 0,
        nospace_pending: false,
    };
    run.open();
    let usable0 = run.pool().status().space.usable_bytes;
    // Live data (stored bytes and map) of fill% of the usable space, less the room kept to
    // rewrite the maps (which grows with them): volume bytes `d` store about `d` (the
    // encrypted one 16 bytes a block more) and add `map_bytes` of map.
    let mut data = usable0 * fill_pct / 100;
    for _ in 0..3 {
        let map = map_bytes(data / 4096);
        let map_reserve = map.div_ceil(1 << 20) << 20;
        data = (usable0 - map_reserve) * fill_pct / 100 - map;
    }
    // Shares: a plain volume, an encrypted lz4 one, an lz4 one with 16 KiB blocks.
    let shares = [
        run.rng.range(20, 40),
        run.rng.range(20, 40),
        run.rng.range(20, 40),
    ];
    let total: u64 = shares.iter().sum();
    let specs: [(&str, u32, Compression, bool); 3] = [
        ("plain", 4096, Compression::Off, false),
        ("sealed", 4096, Compression::Lz4, true),
        ("packed", 16384, Compression::Lz4, false),
    ];
    for (i, (name, bs, compression, encryption)) in specs.into_iter().enumerate() {
        let mut size = data * shares[i] / total;
        if encryption {
            size = size * 4096 / 4112;
        }
        let size = (size / (64 << 10)).max(1) * (64 << 10);
        let opts = VolumeOptions {
            size_bytes: size,
            block_size: bs,
            compression,
            encryption,
        };
        let key = encryption.then_some(i as u8 + 1);
        run.pool()
            .create_volume(name, opts.clone(), key.map(secret).as_ref())
            .unwrap();
        run.vols.push(Vol {
            name,
            opts,
            key,
            cells: vec![Cell::zero(); (size / CELL) as usize],
            zero_cells: 0,
            handle: None,
        });
    }
    run.close_handles();
    let pool = run.pool.take().unwrap();
    pool.close().unwrap();
    drop(pool);
    run.open();
    for vi in 0..run.vols.len() {
        run.fill_volume(vi);
    }
    run.flush();
    let st = run.pool().status().space;
    eprintln!(
        "seed {seed:#x}: {layout}, {devices}x {device_mib} MiB, commit every {commit_interval:?}, volumes {:?} KiB; filled: used {} KiB of {} usable ({:.1}%, aimed at {fill_pct}%), {ops} operations",
        run.vols.iter().map(|v| v.opts.size_bytes >> 10).collect::<Vec<_>>(),
        st.used_bytes >> 10,
        st.usable_bytes >> 10,
        st.used_bytes as f64 * 100.0 / st.usable_bytes as f64,
    );
    run.check_all(false);
    while run.op < ops && run.stats.nospace.len() < NOSPACE_MAX {
        run.step();
    }
    if !run.stats.nospace.is_empty() {
        // The known gap near full (ARCHITECTURE.md): the pool must still be whole.
        eprintln!(
            "seed {seed:#x}: {} operations answered NoSpace{}; checking the pool after a crash",
            run.stats.nospace.len(),
            if run.op < ops {
                ", mix ended early"
            } else {
                ""
            }
        );
        run.crash();
    }
    run.restart();
    let st = run.pool().status();
    eprintln!(
        "seed {seed:#x}: done: {:?}; used {} KiB of {} usable",
        run.stats,
        st.space.used_bytes >> 10,
        st.space.usable_bytes >> 10
    );
    run.close_handles();
    run.pool.take().unwrap().close().unwrap();
}

#[test]
fn random_overwrites_trims_destroys_and_crashes_near_full_match_the_model() {
    run_seeds(
        "BULWARK_MODEL_SEEDS",
        3,
        "BULWARK_MODEL_OPS",
        8000,
        run_seed,
    );
}
