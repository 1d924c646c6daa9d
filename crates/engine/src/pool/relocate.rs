//! The cleaner's move, where it meets client writes: a record the cleaner copied elsewhere
//! goes into the map only where the map still points at the old copy.
//!
//! The cleaner reads a batch of records with the map lock released and writes their
//! copies (`clean`'s `move_records`); meanwhile a client write may point any of those
//! blocks at a newer record and release the old one. So the swap is a compare-and-set,
//! each block looked up and set under one hold of the map lock the writers take
//! (`swap_where_held`): a block still pointing at the old copy takes the new one and the
//! old copy is released; a block a writer changed keeps the writer's pointer and the new
//! copy is released. Either way every copy is released once and no newer write is undone.
//!
//! The map and what a swap does around it (the notes for the intent log, the releases)
//! come in through [`Relocation`]; the lock is `crate::sync`'s, so `crates/modelcheck`
//! checks this file under shuttle against threads playing writers and the cleaner.

use crate::sync::{Mutex, MutexGuard};
use crate::Result;

/// What a batch of moves is installed into: a map of blocks to pointers, behind a lock.
pub trait Relocation {
    /// The map (the volume's tree).
    type Map;
    /// A block pointer: equal only to a pointer at the same copy of the same record.
    type Ptr: Copy + PartialEq;
    /// Where block `lba` points now.
    fn lookup(&self, map: &Self::Map, lba: u64) -> Result<Self::Ptr>;
    /// Point block `lba` at `ptr`.
    fn set(&self, map: &mut Self::Map, lba: u64, ptr: Self::Ptr) -> Result<()>;
    /// Block `lba` moved from `old` to `new` (still under the map lock): `old` is released.
    fn swapped(&self, map: &Self::Map, lba: u64, old: &Self::Ptr, new: &Self::Ptr);
    /// The copy `new` did not go in (the block changed, or an error stopped the batch): it
    /// is released.
    fn not_swapped(&self, new: &Self::Ptr);
}

/// Install `moves` (block, old copy, new copy) into `map` under one hold of its lock:
/// each block still pointing at its old copy takes the new one. Returns the lock, still
/// held (the caller counts the nodes the swaps dirtied), and how many moved; on an error
/// the swaps made stay and the copies not yet swapped are given back.
pub fn swap_where_held<'m, R: Relocation>(
    r: &R,
    map: &'m Mutex<R::Map>,
    moves: &[(u64, R::Ptr, R::Ptr)],
) -> (MutexGuard<'m, R::Map>, Result<usize>) {
    let mut m = map.lock();
    let mut moved = 0;
    for (k, &(lba, old, new)) in moves.iter().enumerate() {
        let swapped = r.lookup(&m, lba).and_then(|now| {
            if now != old {
                return Ok(false);
            }
            r.set(&mut m, lba, new)?;
            Ok(true)
        });
        match swapped {
            Ok(true) => {
                r.swapped(&m, lba, &old, &new);
                moved += 1;
            }
            Ok(false) => r.not_swapped(&new),
            Err(e) => {
                for (_, _, new) in &moves[k..] {
                    r.not_swapped(new);
                }
                return (m, Err(e));
            }
        }
    }
    (m, Ok(moved))
}
