//! The reference model: what every 4 KiB cell of every volume and snapshot may read as.
//!
//! A cell holds a *value*: 0 is zeros, any other is a write's tag, whose bytes
//! (`fill_cell`) are the tag followed by bytes drawn from the tag and the cell's index, so
//! a read of the right value from the wrong cell, a torn cell, or stale bytes never pass
//! as the right one. Per cell the model keeps
//! - `cur`: what a read may return now (one value, or several after a write that failed:
//!   its blocks may or may not have been written); a read pins the cell to what it read;
//! - `dur`: what a crash may leave: the value at the last durable point and every value
//!   acknowledged since, never older, never another cell's.

pub const CELL: u64 = 4096;

/// The bytes of cell `cell` holding `value`.
pub fn fill_cell(value: u64, cell: u64, out: &mut [u8]) {
    if value == 0 {
        out.fill(0);
        return;
    }
    let mut x = value.wrapping_mul(0x1000_0000_01b3) ^ cell.rotate_left(32) ^ 0xC0FF_EE00;
    for chunk in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let v = x.to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    out[..8].copy_from_slice(&value.to_le_bytes());
}

/// The value a cell's bytes claim (0 for zeros), and whether the bytes are exactly that
/// value's bytes for this cell.
pub fn value_of(b: &[u8], cell: u64, scratch: &mut [u8]) -> (u64, bool) {
    let v = if b.iter().all(|&x| x == 0) {
        0
    } else {
        u64::from_le_bytes(b[..8].try_into().expect("a cell has 8 bytes"))
    };
    fill_cell(v, cell, scratch);
    (v, b == scratch)
}

/// One cell: what it may read as now, and after a crash.
#[derive(Clone, Debug)]
pub struct Cell {
    pub cur: Vec<u64>,
    pub dur: Vec<u64>,
}

impl Cell {
    pub fn zero() -> Cell {
        Cell {
            cur: vec![0],
            dur: vec![0],
        }
    }
    /// An acknowledged write of `v`.
    pub fn set(&mut self, v: u64) {
        self.cur = vec![v];
        if !self.dur.contains(&v) {
            self.dur.push(v);
        }
    }
    /// An acknowledged write made durable by itself (FUA).
    pub fn set_durable(&mut self, v: u64) {
        self.cur = vec![v];
        self.dur = vec![v];
    }
    /// A write that failed: it may or may not have reached the cell.
    pub fn maybe(&mut self, v: u64) {
        if !self.cur.contains(&v) {
            self.cur.push(v);
        }
        if !self.dur.contains(&v) {
            self.dur.push(v);
        }
    }
    /// Everything acknowledged so far is durable.
    pub fn durable(&mut self) {
        self.dur = self.cur.clone();
    }
    /// A read found `v` (one of `cur`).
    pub fn pin(&mut self, v: u64) {
        self.cur = vec![v];
    }
}

/// A volume (or clone) in the model.
pub struct Vol {
    pub name: String,
    /// The key byte of its key file (encrypted volumes), `None` when not encrypted.
    pub key: Option<u8>,
    /// For a clone: its origin volume and snapshot.
    pub origin: Option<(String, String)>,
    pub block_size: u32,
    /// 0: cell `c` is the volume's bytes `c * CELL`. Otherwise a huge thin volume
    /// (`Kind::HugeCreate`): its cells lie in islands of `ISLAND` cells, island `i` at cell
    /// `i * spread` of the volume, so its map is deep and sparse (terabytes, a few MiB
    /// written), as a guest's 1 TiB disk is. The model stays one cell per cell written.
    pub spread: u64,
    /// Cells per island when `spread` is set: `ISLAND` for a huge volume, one block's cells
    /// for a scattered one (`Kind::ScatterCreate`: every block under a map leaf of its own).
    pub island: u64,
    pub cells: Vec<Cell>,
    /// Snapshots, oldest first: name and each cell's value (snapshots are pinned whole
    /// when taken, and never change).
    pub snaps: Vec<(String, Vec<u64>)>,
}

/// Cells that lie together on a huge volume (`Vol::spread`): a multiple of every block
/// size's cells, so blocks never straddle islands.
pub const ISLAND: u64 = 64;

impl Vol {
    /// Where cell `c` lies on the volume, in bytes.
    pub fn offset(&self, c: u64) -> u64 {
        if self.spread == 0 {
            return c * CELL;
        }
        ((c / self.island) * self.spread + c % self.island) * CELL
    }

    /// The volume's size in bytes for `cells` cells.
    pub fn bytes_for(&self, cells: u64) -> u64 {
        if self.spread == 0 {
            return cells * CELL;
        }
        cells.div_ceil(self.island) * self.spread * CELL
    }

    /// `n` cut so that cells `[c0, c0 + n)` lie together on the volume (one island), so a
    /// range is still one I/O.
    pub fn clip(&self, c0: u64, n: u64) -> u64 {
        if self.spread == 0 {
            return n;
        }
        n.min(self.island - c0 % self.island)
    }

    pub fn durable(&mut self) {
        for c in &mut self.cells {
            c.durable();
        }
    }
}
