//! A volume's stripe locks: a client write holds the locks of its blocks' stripes from
//! before it reads the key ring until its blocks are in the map (whole blocks in index
//! order, `run`; a partial block's read-modify-write, a trim or a zeroing one, `one`), and
//! a key rotation's rewrite of a block holds that block's (read, sealed again under the
//! newest key, pointed to), so a client write in between wins.
//!
//! `drain` takes every lock once, in index order, and lets it go: when it returns, every
//! write that held one before it began has ended. `key_rotate` drains after it makes the
//! new data key current, so no write sealed under the older key is still to land in the
//! map when the rotation's worker walks it (it would land behind the walk, in a block
//! the walk found a hole, and be left under a key the rotation then drops).
//!
//! This file takes its locks from `crate::sync`, so `crates/modelcheck` checks it under
//! shuttle with threads playing client writes and a key rotation.

use crate::sync::{Mutex, MutexGuard};

pub struct Stripes(Box<[Mutex<()>]>);

impl Stripes {
    /// `n` locks; block `lba` is under lock `lba % n`.
    pub fn new(n: usize) -> Stripes {
        Stripes((0..n).map(|_| Mutex::new(())).collect())
    }

    /// The lock of block `lba`'s stripe.
    pub fn one(&self, lba: u64) -> MutexGuard<'_, ()> {
        self.0[self.index(lba)].lock()
    }

    /// The locks of blocks `first..first + n`, taken in index order (so writes of
    /// overlapping runs cannot deadlock).
    pub fn run(&self, first: u64, n: u64) -> Vec<MutexGuard<'_, ()>> {
        let mut ix: Vec<usize> = (0..n).map(|i| self.index(first + i)).collect();
        ix.sort_unstable();
        ix.dedup();
        ix.into_iter().map(|i| self.0[i].lock()).collect()
    }

    /// Wait for every write that held a stripe lock when this began: each lock taken and
    /// let go, in index order (one held at a time: no write waits on this for long).
    pub fn drain(&self) {
        for l in self.0.iter() {
            drop(l.lock());
        }
    }

    fn index(&self, lba: u64) -> usize {
        (lba % self.0.len() as u64) as usize
    }
}
