//! A seeded model test of snapshots and clones: on a small pool kept busy enough that the
//! cleaner moves records (shared ones included), two volumes (plain, encrypted + lz4) and
//! clones of their snapshots (under keys of their own) take a random mix of overwrites,
//! trims, flushes, snapshot create / destroy / hold / release, clone create / destroy,
//! rollbacks, resizes (grow across map depths, shrink over holes: snapshots keep their
//! size, a rollback brings it back, a clone starts at its snapshot's), clean restarts and
//! crashes; what clones need is refused. Every read of a volume
//! or of a snapshot
//! (`VOL@SNAP`, read-only) is compared with a model, and the space numbers are compared
//! with a brute-force recount from the block pointers of every tree:
//! - a snapshot's `used` is the bytes of the blocks whose pointer differs from the trees
//!   on both sides of it, and destroying it frees exactly that;
//! - `referenced`, `used by snapshots` and `written` likewise;
//! - the pool's used bytes once closed for a clean restart equal, to the byte, what the
//!   import recounts.
//!
//! Knobs: `BULWARK_TEST_SEED` (first seed; printed), `BULWARK_SNAP_SEEDS` (default 3),
//! `BULWARK_SNAP_OPS` (operations per seed, default 2500).

use std::path::Path;
use std::sync::Arc;

use bulwark_engine::{
    Compression, DeviceSpec, Error, Layout, OpenOptions, Pool, Secret, Volume, VolumeOptions,
};
use zeroize::Zeroizing;

const CELL: u64 = 4096;
/// Snapshots a volume keeps at most in this test: the worst case (each snapshot holding a
/// whole copy) still fits the pool.
const SNAPS_MAX: usize = 2;
/// Volumes at most: the two first ones and their clones.
const VOLS_MAX: usize = 4;

mod common;
use common::{run_seeds, Rng};

/// The bytes of a cell holding value `tag` (0: zeros): the tag, then incompressible bytes.
fn fill_cell(tag: u64, cell: u64, out: &mut [u8]) {
    if tag == 0 {
        out.fill(0);
        return;
    }
    let mut r = Rng(tag.wrapping_mul(0x1000_0000_01b3) ^ cell);
    for chunk in out.chunks_mut(8) {
        let v = r.next().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    out[..8].copy_from_slice(&tag.to_le_bytes());
}

fn tag_of(b: &[u8]) -> u64 {
    if b.iter().all(|&x| x == 0) {
        0
    } else {
        u64::from_le_bytes(b[..8].try_into().unwrap())
    }
}

fn secret(b: u8) -> Secret {
    Secret::KeyFile(Zeroizing::new([b; 32]))
}

struct Vol {
    name: String,
    key: Option<u8>,
    /// For a clone: the origin volume's name and snapshot.
    origin: Option<(String, String)>,
    /// Each cell's value now.
    cur: Vec<u64>,
    /// Each cell's values a crash may bring back: the last durable one and those since.
    dur: Vec<Vec<u64>>,
    /// Snapshots, oldest first: name and every cell's value.
    snaps: Vec<(String, Vec<u64>)>,
    handle: Option<Arc<Volume>>,
}

#[derive(Default, Debug)]
struct Stats {
    writes: u64,
    trims: u64,
    snap_creates: u64,
    snap_destroys: u64,
    snap_reads: u64,
    rollbacks: u64,
    space_checks: u64,
    holds: u64,
    clones: u64,
    clone_destroys: u64,
    refused_for_clones: u64,
    crashes: u64,
    restarts: u64,
    clean_written_mib: u64,
    grows: u64,
    shrinks: u64,
}

struct Run {
    seed: u64,
    dir: tempfile::TempDir,
    rng: Rng,
    pool: Option<Arc<Pool>>,
    vols: Vec<Vol>,
    next_tag: u64,
    next_snap: u64,
    op: u64,
    stats: Stats,
    open_opts: OpenOptions,
    /// Cells of a volume as created; writes land in the first this many cells, or in
    /// the last `TAIL_CELLS` of a volume grown past it (a thin, deeper map).
    base_cells: u64,
}

/// Cells at the end of a grown volume that writes reach (past `base_cells`).
const TAIL_CELLS: u64 = 64;

impl Run {
    fn ctx(&self) -> String {
        format!(
            "seed {:#x} (BULWARK_TEST_SEED={:#x}), op {}",
            self.seed, self.seed, self.op
        )
    }

    fn fail(&self, what: String) -> ! {
        let st = self.pool.as_ref().map(|p| p.status());
        panic!(
            "{}: {what}\nstats: {:?}\nspace: {:?}",
            self.ctx(),
            self.stats,
            st.as_ref().map(|s| &s.space)
        );
    }

    fn pool(&self) -> &Pool {
        self.pool.as_ref().expect("pool open")
    }

    fn open(&mut self) {
        let pool = Pool::open(self.dir.path(), self.open_opts.clone())
            .unwrap_or_else(|e| panic!("{}: the pool does not import: {e}", self.ctx()));
        for v in &mut self.vols {
            if let Some(k) = v.key {
                pool.load_key(&v.name, &secret(k)).unwrap();
            }
            v.handle = Some(pool.volume(&v.name).unwrap());
        }
        self.pool = Some(pool);
    }

    fn close_handles(&mut self) {
        for v in &mut self.vols {
            v.handle = None;
        }
    }

    fn count_clean(&mut self) {
        self.stats.clean_written_mib += self.pool().status().space.clean_written_bytes >> 20;
    }

    fn everything_durable(&mut self) {
        for v in &mut self.vols {
            v.dur = v.cur.iter().map(|&c| vec![c]).collect();
        }
    }

    /// Where a write or trim of up to `most` cells goes: `(first, n)`, in the first
    /// `base_cells` cells or, a quarter of the time on a grown volume, its last ones.
    fn region(&mut self, vi: usize, most: u64) -> (u64, u64) {
        let cells = self.vols[vi].cur.len() as u64;
        let (lo, hi) = if cells > self.base_cells && self.rng.below(4) == 0 {
            (cells - TAIL_CELLS.min(cells), cells)
        } else {
            (0, cells.min(self.base_cells))
        };
        let n = self.rng.range(1, most).min(hi - lo);
        (lo + self.rng.below(hi - lo - n + 1), n)
    }

    fn write(&mut self, vi: usize) {
        let (c0, n) = self.region(vi, 16);
        let mut buf = vec![0u8; (n * CELL) as usize];
        let mut tags = Vec::new();
        for i in 0..n {
            self.next_tag += 1;
            let tag = if self.rng.below(20) == 0 {
                0
            } else {
                self.next_tag
            };
            fill_cell(
                tag,
                c0 + i,
                &mut buf[(i * CELL) as usize..((i + 1) * CELL) as usize],
            );
            tags.push(tag);
        }
        if let Err(e) = self.vols[vi]
            .handle
            .as_ref()
            .unwrap()
            .write(c0 * CELL, &buf, false)
        {
            self.fail(format!(
                "write of {} cells {c0}+{n}: {e:?}",
                self.vols[vi].name
            ));
        }
        let v = &mut self.vols[vi];
        for (i, t) in tags.into_iter().enumerate() {
            let c = (c0 as usize) + i;
            v.cur[c] = t;
            if !v.dur[c].contains(&t) {
                v.dur[c].push(t);
            }
        }
        self.stats.writes += 1;
    }

    fn trim(&mut self, vi: usize) {
        let (c0, n) = self.region(vi, 32);
        if let Err(e) = self.vols[vi]
            .handle
            .as_ref()
            .unwrap()
            .trim(c0 * CELL, n * CELL)
        {
            self.fail(format!("trim: {e:?}"));
        }
        let v = &mut self.vols[vi];
        for c in c0 as usize..(c0 + n) as usize {
            v.cur[c] = 0;
            if !v.dur[c].contains(&0) {
                v.dur[c].push(0);
            }
        }
        self.stats.trims += 1;
    }

    /// Read cells `[c0, c0+n)` of `vol` (or of its snapshot `snap`) against `want`.
    fn check_range(&self, vi: usize, snap: Option<usize>, c0: u64, n: u64) {
        let v = &self.vols[vi];
        let (handle, want, what) = match snap {
            None => (v.handle.clone().unwrap(), &v.cur, v.name.to_string()),
            Some(k) => {
                let name = format!("{}@{}", v.name, v.snaps[k].0);
                let h = self
                    .pool()
                    .volume(&name)
                    .unwrap_or_else(|e| self.fail(format!("open {name}: {e:?}")));
                (h, &v.snaps[k].1, name)
            }
        };
        let mut buf = vec![0u8; (n * CELL) as usize];
        if let Err(e) = handle.read(c0 * CELL, &mut buf) {
            self.fail(format!("read of {what} cells {c0}+{n}: {e:?}"));
        }
        let mut cell = vec![0u8; CELL as usize];
        for i in 0..n {
            let c = c0 + i;
            let got = &buf[(i * CELL) as usize..((i + 1) * CELL) as usize];
            let tag = tag_of(got);
            fill_cell(tag, c, &mut cell);
            if got != cell.as_slice() || tag != want[c as usize] {
                self.fail(format!(
                    "{what} cell {c}: read value {tag} (whole: {}), the model says {}",
                    got == cell.as_slice(),
                    want[c as usize]
                ));
            }
        }
    }

    /// Cells of volume `vi` now, or of its snapshot `snap` (the size it was taken at).
    fn cells_of(&self, vi: usize, snap: Option<usize>) -> u64 {
        let v = &self.vols[vi];
        match snap {
            None => v.cur.len() as u64,
            Some(k) => v.snaps[k].1.len() as u64,
        }
    }

    fn check_all(&self, vi: usize, snap: Option<usize>) {
        let cells = self.cells_of(vi, snap);
        let name = match snap {
            None => self.vols[vi].name.clone(),
            Some(k) => format!("{}@{}", self.vols[vi].name, self.vols[vi].snaps[k].0),
        };
        let size = self.pool().volume(&name).unwrap().size();
        if size != cells * CELL {
            self.fail(format!(
                "{name} has {size} bytes, the model {}",
                cells * CELL
            ));
        }
        let mut c = 0;
        while c < cells {
            let n = (cells - c).min(256);
            self.check_range(vi, snap, c, n);
            c += n;
        }
    }

    fn snapshot_create(&mut self, vi: usize) {
        if self.vols[vi].snaps.len() >= SNAPS_MAX {
            return;
        }
        self.next_snap += 1;
        let name = format!("s{}", self.next_snap);
        let vol = self.vols[vi].name.clone();
        if let Err(e) = self.pool().snapshot_create(&vol, &name) {
            self.fail(format!("snapshot create {vol}@{name}: {e:?}"));
        }
        // Its commit makes every completed write of every volume durable.
        self.everything_durable();
        let cur = self.vols[vi].cur.clone();
        self.vols[vi].snaps.push((name, cur));
        self.stats.snap_creates += 1;
    }

    fn snapshot_destroy(&mut self, vi: usize) {
        let n = self.vols[vi].snaps.len();
        if n == 0 {
            return;
        }
        let k = self.rng.below(n as u64) as usize;
        let vol = self.vols[vi].name.clone();
        let name = self.vols[vi].snaps[k].0.clone();
        if self.has_clones(&vol, &name) {
            match self.pool().snapshot_destroy(&vol, &name) {
                Err(Error::Busy(_)) => {}
                other => self.fail(format!(
                    "destroy of {vol}@{name}, which has clones: {other:?}"
                )),
            }
            self.stats.refused_for_clones += 1;
            return;
        }
        let listed = self.pool().snapshot_list(Some(&vol)).unwrap();
        let used = listed
            .iter()
            .find(|s| s.snapshot == name)
            .unwrap_or_else(|| self.fail(format!("{vol}@{name} is not listed")))
            .used_bytes;
        match self.pool().snapshot_destroy(&vol, &name) {
            Ok(freed) if freed == used => {}
            Ok(freed) => self.fail(format!(
                "destroying {vol}@{name} freed {freed} bytes, its listed used was {used}"
            )),
            Err(e) => self.fail(format!("snapshot destroy {vol}@{name}: {e:?}")),
        }
        self.everything_durable();
        self.vols[vi].snaps.remove(k);
        self.stats.snap_destroys += 1;
    }

    fn hold_then_release(&mut self, vi: usize) {
        let Some((name, _)) = self.vols[vi].snaps.last().cloned() else {
            return;
        };
        let vol = self.vols[vi].name.clone();
        let vol = vol.as_str();
        self.pool().snapshot_hold(vol, &name, "keep", true).unwrap();
        match self.pool().snapshot_destroy(vol, &name) {
            Err(Error::Busy(_)) => {}
            other => self.fail(format!("destroy of a held snapshot: {other:?}")),
        }
        if self.pool().snapshot_hold(vol, &name, "keep", true).is_ok() {
            self.fail("the same hold twice was accepted".into());
        }
        self.pool()
            .snapshot_hold(vol, &name, "keep", false)
            .unwrap();
        self.everything_durable();
        self.stats.holds += 1;
    }

    fn rollback(&mut self, vi: usize) {
        let n = self.vols[vi].snaps.len();
        if n == 0 {
            return;
        }
        let k = self.rng.below(n as u64) as usize;
        let vol = self.vols[vi].name.clone();
        let vol = vol.as_str();
        let name = self.vols[vi].snaps[k].0.clone();
        let newer_cloned = self.vols[vi].snaps[k + 1..]
            .iter()
            .any(|(s, _)| self.has_clones(vol, s));
        if k + 1 < n {
            self.vols[vi].handle = None;
            match self.pool().volume_rollback(vol, &name, false) {
                Err(Error::Invalid(_)) => {}
                other => self.fail(format!("rollback past newer snapshots: {other:?}")),
            }
        }
        // With a handle open the volume is in use.
        self.vols[vi].handle = Some(self.pool().volume(vol).unwrap());
        if !matches!(
            self.pool().volume_rollback(vol, &name, true),
            Err(Error::Busy(_))
        ) {
            self.fail("rollback of an attached volume was not refused".into());
        }
        self.vols[vi].handle = None;
        if newer_cloned {
            match self.pool().volume_rollback(vol, &name, true) {
                Err(Error::Busy(_)) => {}
                other => self.fail(format!("rollback past a cloned snapshot: {other:?}")),
            }
            self.vols[vi].handle = Some(self.pool().volume(vol).unwrap());
            self.stats.refused_for_clones += 1;
            return;
        }
        match self.pool().volume_rollback(vol, &name, true) {
            Ok(destroyed) if destroyed.len() == n - k - 1 => {}
            other => self.fail(format!("rollback to {vol}@{name}: {other:?}")),
        }
        self.vols[vi].handle = Some(self.pool().volume(vol).unwrap());
        let v = &mut self.vols[vi];
        v.snaps.truncate(k + 1);
        v.cur = v.snaps[k].1.clone();
        self.everything_durable();
        self.stats.rollbacks += 1;
    }

    fn has_clones(&self, vol: &str, snap: &str) -> bool {
        self.vols.iter().any(|v| {
            v.origin
                .as_ref()
                .is_some_and(|(o, s)| o == vol && s == snap)
        })
    }

    /// Clone a random snapshot as a new volume (its own key when the origin has one).
    fn clone_snapshot(&mut self, vi: usize) {
        let n = self.vols[vi].snaps.len();
        if n == 0 || self.vols.len() >= VOLS_MAX {
            return;
        }
        let k = self.rng.below(n as u64) as usize;
        let vol = self.vols[vi].name.clone();
        let (snap, values) = self.vols[vi].snaps[k].clone();
        self.next_snap += 1;
        let name = format!("k{}", self.next_snap);
        let key = self.vols[vi]
            .key
            .map(|_| 100 + (self.next_snap % 100) as u8);
        if let Err(e) = self
            .pool()
            .volume_clone(&vol, &snap, &name, key.map(secret).as_ref())
        {
            self.fail(format!("clone of {vol}@{snap} as {name}: {e:?}"));
        }
        self.everything_durable();
        let handle = Some(self.pool().volume(&name).unwrap());
        self.vols.push(Vol {
            name,
            key,
            origin: Some((vol, snap)),
            dur: values.iter().map(|&t| vec![t]).collect(),
            cur: values,
            snaps: Vec::new(),
            handle,
        });
        self.stats.clones += 1;
    }

    /// Destroy a clone (with its snapshots) that no other clone depends on.
    fn destroy_clone(&mut self) {
        let Some(vi) = (0..self.vols.len()).find(|&i| {
            self.vols[i].origin.is_some()
                && !self.vols[i]
                    .snaps
                    .iter()
                    .any(|(s, _)| self.has_clones(&self.vols[i].name, s))
        }) else {
            return;
        };
        let name = self.vols[vi].name.clone();
        self.vols[vi].handle = None;
        match self.pool().destroy_volume_recursive(&name, true) {
            Ok(kept) if kept.is_empty() => {}
            other => self.fail(format!("destroy of clone {name}: {other:?}")),
        }
        self.everything_durable();
        self.vols.remove(vi);
        self.stats.clone_destroys += 1;
    }

    /// The space numbers against a recount from every tree's block pointers.
    fn check_space(&mut self, vi: usize) {
        let v = &self.vols[vi];
        // Trees of other sizes (snapshots before a resize, a clone's origin snapshot) are
        // compared over the largest: past a tree's end it holds nothing.
        let origin_cells = v.origin.as_ref().map_or(0, |(o, s)| {
            let ov = self.vols.iter().find(|x| &x.name == o).unwrap();
            ov.snaps.iter().find(|x| &x.0 == s).unwrap().1.len()
        });
        let cells = v
            .snaps
            .iter()
            .map(|s| s.1.len())
            .chain([v.cur.len(), origin_cells])
            .max()
            .unwrap() as u64;
        let mut trees: Vec<Arc<Volume>> = Vec::new();
        // A clone's first tree is compared with its origin snapshot (its base).
        let base = v
            .origin
            .as_ref()
            .map(|(o, s)| self.pool().volume(&format!("{o}@{s}")).unwrap());
        for (name, _) in &v.snaps {
            trees.push(self.pool().volume(&format!("{}@{name}", v.name)).unwrap());
        }
        trees.push(v.handle.clone().unwrap());
        // A record by what it holds, not where: the cleaner may move records between these
        // reads (it keeps their checksum, nonce and length), and every value written is
        // different, so equal identities are one shared record.
        let ptrs: Vec<Vec<_>> = trees
            .iter()
            .map(|t| {
                (0..cells)
                    .map(|l| {
                        let p = t.debug_block_ptr(l).unwrap();
                        let mut id = p;
                        id.addr = [0, 0];
                        id
                    })
                    .collect()
            })
            .collect();
        let base_ptrs: Option<Vec<_>> = base.as_ref().map(|t| {
            (0..cells)
                .map(|l| {
                    let mut id = t.debug_block_ptr(l).unwrap();
                    id.addr = [0, 0];
                    id
                })
                .collect()
        });
        let len = |p: &bulwark_engine::map::Blkptr| p.len as u64;
        let n = v.snaps.len();
        let mut used = vec![0u64; n];
        let mut referenced = vec![0u64; n + 1];
        let mut by_snaps = 0u64;
        let mut written = 0u64;
        // What destroying the volume frees of its head: for a clone, not what its base (the
        // origin's snapshot) holds, which stays (issue 42); for any other volume, all of it.
        let mut own = 0u64;
        for l in 0..cells as usize {
            for k in 0..=n {
                let p = &ptrs[k][l];
                if p.is_hole() {
                    continue;
                }
                referenced[k] += len(p);
                let base_same = base_ptrs.as_ref().is_some_and(|b| b[l] == *p);
                if k < n {
                    let prev_same = if k > 0 {
                        ptrs[k - 1][l] == *p
                    } else {
                        base_same
                    };
                    let next_same = ptrs[k + 1][l] == *p;
                    if !prev_same && !next_same {
                        used[k] += len(p);
                    }
                    if !next_same && !base_same {
                        by_snaps += len(p);
                    }
                } else {
                    if (n == 0 && !base_same) || (n > 0 && ptrs[n - 1][l] != *p) {
                        written += len(p);
                    }
                    if !base_same {
                        own += len(p);
                    }
                }
            }
        }
        let listed = self.pool().snapshot_list(Some(&v.name)).unwrap();
        let space = &self.pool().volume_space(Some(&v.name)).unwrap()[0];
        let names: Vec<&str> = listed.iter().map(|s| s.snapshot.as_str()).collect();
        let want: Vec<&str> = v.snaps.iter().map(|s| s.0.as_str()).collect();
        if names != want {
            self.fail(format!(
                "snapshots listed {names:?}, the model has {want:?}"
            ));
        }
        for (k, s) in listed.iter().enumerate() {
            if s.used_bytes != used[k] || s.referenced_bytes != referenced[k] {
                self.fail(format!(
                    "{}: used {} referenced {}, recounted {} and {}",
                    s.name, s.used_bytes, s.referenced_bytes, used[k], referenced[k]
                ));
            }
        }
        let recount = (referenced[n], by_snaps, written);
        let got = (
            space.referenced_bytes,
            space.used_by_snapshots_bytes,
            space.written_bytes,
        );
        if got != recount || space.used_bytes != own + by_snaps {
            self.fail(format!(
                "{}: (referenced, by snapshots, written) {got:?}, recounted {recount:?}; \
                 used {}, recounted {}",
                v.name,
                space.used_bytes,
                own + by_snaps
            ));
        }
        self.stats.space_checks += 1;
    }

    /// Resize a volume to a random size: a one-level map (16 cells), two levels (up to
    /// `base_cells`), or three (past 4096 cells). A shrink over data is refused; after a
    /// trim of what lies past the new end (and with the volume closed) it goes through.
    fn resize(&mut self, vi: usize) {
        let cells = match self.rng.below(3) {
            0 => 16,
            1 => self.rng.range(1, self.base_cells / 16) * 16,
            _ => 4096 + self.rng.range(1, 16) * 16,
        };
        let old = self.vols[vi].cur.len() as u64;
        let vol = self.vols[vi].name.clone();
        if cells < old {
            let data_past = self.vols[vi].cur[cells as usize..].iter().any(|&t| t != 0);
            self.vols[vi].handle = None;
            if data_past {
                match self.pool().volume_resize(&vol, cells * CELL, true) {
                    Err(Error::Invalid(_)) => {}
                    other => self.fail(format!("shrink of {vol} over data: {other:?}")),
                }
            }
            let h = self.pool().volume(&vol).unwrap();
            if let Err(e) = h.trim(cells * CELL, (old - cells) * CELL) {
                self.fail(format!("trim before the shrink of {vol}: {e:?}"));
            }
            drop(h);
            for c in cells..old {
                self.vols[vi].cur[c as usize] = 0;
            }
            self.stats.shrinks += 1;
        } else if cells > old {
            self.stats.grows += 1;
        }
        if let Err(e) = self.pool().volume_resize(&vol, cells * CELL, cells < old) {
            self.fail(format!(
                "resize of {vol} from {old} to {cells} cells: {e:?}"
            ));
        }
        self.vols[vi].cur.resize(cells as usize, 0);
        if cells != old {
            // Its commit makes every completed write durable (a resize to the same size
            // changes nothing and commits nothing).
            self.everything_durable();
        } else {
            let v = &mut self.vols[vi];
            v.dur.resize(cells as usize, vec![0]);
        }
        self.vols[vi].handle = Some(self.pool().volume(&vol).unwrap());
    }

    fn crash(&mut self) {
        self.count_clean();
        self.close_handles();
        drop(self.pool.take());
        self.open();
        // Pin every cell to the durable candidate it holds.
        for vi in 0..self.vols.len() {
            let cells = self.vols[vi].cur.len() as u64;
            let h = self.vols[vi].handle.clone().unwrap();
            let mut buf = vec![0u8; CELL as usize];
            for c in 0..cells {
                h.read(c * CELL, &mut buf).unwrap();
                let tag = tag_of(&buf);
                if !self.vols[vi].dur[c as usize].contains(&tag) {
                    let d = self.vols[vi].dur[c as usize].clone();
                    let name = self.vols[vi].name.clone();
                    self.fail(format!(
                        "after a crash, {name} cell {c} holds {tag}, not one of {d:?}"
                    ));
                }
                let v = &mut self.vols[vi];
                v.cur[c as usize] = tag;
                v.dur[c as usize] = vec![tag];
            }
            self.check_all(vi, None);
            for k in 0..self.vols[vi].snaps.len() {
                self.check_all(vi, Some(k));
            }
        }
        self.stats.crashes += 1;
    }

    fn restart(&mut self) {
        if let Err(e) = self.pool().flush() {
            self.fail(format!("flush: {e:?}"));
        }
        self.everything_durable();
        self.count_clean();
        self.close_handles();
        let pool = self.pool.take().unwrap();
        pool.close().unwrap();
        // Counted once the pool is closed: background work stopped and its last commit made.
        // Read before, while the cleaner or a commit ran, it was up to 170 KB lower than the
        // recount (a tolerance of 64 KB failed 1 run in 10 with the live-address check on);
        // read here it equals the recount to the byte.
        let before = pool.status().space.used_bytes;
        drop(pool);
        self.open();
        let after = self.pool().status().space.used_bytes;
        if after != before {
            self.fail(format!(
                "used bytes {before} when the pool closed, {after} after the import's recount"
            ));
        }
        for vi in 0..self.vols.len() {
            self.check_all(vi, None);
            for k in 0..self.vols[vi].snaps.len() {
                self.check_all(vi, Some(k));
            }
            self.check_space(vi);
        }
        self.stats.restarts += 1;
    }

    fn step(&mut self) {
        self.op += 1;
        let vi = self.rng.below(self.vols.len() as u64) as usize;
        match self.rng.below(1000) {
            0..=549 => self.write(vi),
            550..=559 => self.resize(vi),
            560..=629 => self.trim(vi),
            630..=729 => {
                let cells = self.vols[vi].cur.len() as u64;
                let n = self.rng.range(1, 64).min(cells);
                let c0 = self.rng.below(cells - n + 1);
                self.check_range(vi, None, c0, n);
            }
            730..=799 => {
                let n = self.vols[vi].snaps.len();
                if n > 0 {
                    let k = self.rng.below(n as u64) as usize;
                    let cells = self.cells_of(vi, Some(k));
                    let len = self.rng.range(1, 128).min(cells);
                    let c0 = self.rng.below(cells - len + 1);
                    self.check_range(vi, Some(k), c0, len);
                    self.stats.snap_reads += 1;
                }
            }
            800..=839 => {
                if let Err(e) = self.pool().flush() {
                    self.fail(format!("flush: {e:?}"));
                }
                self.everything_durable();
            }
            840..=884 => self.snapshot_create(vi),
            885..=919 => self.snapshot_destroy(vi),
            920..=934 => self.rollback(vi),
            935..=954 => self.check_space(vi),
            955..=957 => self.hold_then_release(vi),
            958..=963 => self.clone_snapshot(vi),
            964 => self.destroy_clone(),
            965..=979 => self.crash(),
            980..=989 => self.restart(),
            _ => {
                let n = self.vols[vi].snaps.len();
                if n > 0 {
                    let k = self.rng.below(n as u64) as usize;
                    self.check_all(vi, Some(k));
                }
            }
        }
        if self.op % 200 == 0 {
            let st = self.pool().status();
            if st.state != "ONLINE" || !st.errors.is_empty() || st.unrecoverable_blocks > 0 {
                self.fail(format!("pool {} with errors {:?}", st.state, st.errors));
            }
        }
    }
}

fn run_seed(seed: u64, ops: u64) {
    let mut rng = Rng(seed);
    let dir = if Path::new("/dev/shm").is_dir() {
        tempfile::tempdir_in("/dev/shm").unwrap()
    } else {
        tempfile::tempdir().unwrap()
    };
    let (layout, devices) = if rng.below(3) == 0 {
        (Layout::Mirror(2), 2)
    } else {
        (Layout::Single, 1)
    };
    let device_mib = rng.range(40, 64);
    Pool::create(
        dir.path(),
        layout,
        DeviceSpec::Files {
            count: devices,
            size_bytes: device_mib << 20,
        },
    )
    .unwrap();
    let open_opts = OpenOptions {
        commit_interval: std::time::Duration::from_millis(if rng.below(2) == 0 {
            30
        } else {
            2000
        }),
        // Every put and release checked against the others of the run (`store/live.rs`).
        check_addresses: true,
        ..OpenOptions::default()
    };
    let mut run = Run {
        seed,
        dir,
        rng,
        pool: None,
        vols: Vec::new(),
        next_tag: 0,
        next_snap: 0,
        op: 0,
        stats: Stats::default(),
        open_opts,
        base_cells: 0,
    };
    run.open();
    let usable = run.pool().status().space.usable_bytes;
    // Volumes of a sixteenth of the usable space each: four (two and their clones), with
    // two snapshots each holding a whole copy, stay under three quarters of it.
    let size = (usable / 16 / (64 << 10)).max(1) * (64 << 10);
    run.base_cells = size / CELL;
    for (i, (name, compression, encryption)) in [
        ("plain", Compression::Off, false),
        ("sealed", Compression::Lz4, true),
    ]
    .into_iter()
    .enumerate()
    {
        let key = encryption.then_some(i as u8 + 1);
        let opts = VolumeOptions {
            size_bytes: size,
            block_size: 4096,
            compression,
            encryption,
        };
        run.pool()
            .create_volume(name, opts, key.map(secret).as_ref())
            .unwrap();
        if let Some(k) = key {
            run.pool().load_key(name, &secret(k)).ok();
        }
        let cells = (size / CELL) as usize;
        let handle = Some(run.pool().volume(name).unwrap());
        run.vols.push(Vol {
            name: name.to_string(),
            key,
            origin: None,
            cur: vec![0; cells],
            dur: vec![vec![0]; cells],
            snaps: Vec::new(),
            handle,
        });
    }
    // Filled whole first, so overwrites free space and the cleaner has work.
    for vi in 0..run.vols.len() {
        let cells = run.vols[vi].cur.len() as u64;
        let mut c = 0;
        while c < cells {
            let n = (cells - c).min(256);
            let mut buf = vec![0u8; (n * CELL) as usize];
            for i in 0..n {
                run.next_tag += 1;
                let t = run.next_tag;
                fill_cell(
                    t,
                    c + i,
                    &mut buf[(i * CELL) as usize..((i + 1) * CELL) as usize],
                );
                run.vols[vi].cur[(c + i) as usize] = t;
                run.vols[vi].dur[(c + i) as usize].push(t);
            }
            run.vols[vi]
                .handle
                .as_ref()
                .unwrap()
                .write(c * CELL, &buf, false)
                .unwrap();
            c += n;
        }
    }
    eprintln!(
        "seed {seed:#x}: {layout}, {devices}x {device_mib} MiB, volumes of {} KiB, {ops} operations",
        size >> 10
    );
    while run.op < ops {
        run.step();
    }
    run.restart();
    run.count_clean();
    eprintln!("seed {seed:#x}: done: {:?}", run.stats);
    run.close_handles();
    run.pool.take().unwrap().close().unwrap();
}

#[test]
fn snapshots_match_the_model_through_cleaning_crashes_and_rollbacks() {
    run_seeds("BULWARK_SNAP_SEEDS", 3, "BULWARK_SNAP_OPS", 2500, run_seed);
}
