//! Cleaner: reclaim segments whose records are mostly dead.
//!
//! A pass picks the emptiest sealed segments (victims), walks every volume's
//! map once, and moves the live records it finds in them:
//! - data blocks are copied verbatim (stored bytes, verified by checksum — no
//!   key needed, so locked volumes are cleaned too; the nonce and checksum
//!   stay, only the address changes) and swapped into the map only if the map
//!   still points at the old copy (a client write in between wins);
//! - map nodes in a victim are marked dirty, so the next commit rewrites them;
//! - the volume table is rewritten by every commit anyway.
//!
//! After the commit that follows, the victims hold nothing live and are freed.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use super::core::Core;
use crate::constants::{CLEAN_BATCH_SEGMENTS, SEGMENT_BYTES};
use crate::log::{segment_of, Stream};
use crate::map::{Blkptr, Visit};
use crate::{Error, Result};

impl Core {
    /// One cleaning pass; returns the number of victim segments processed.
    pub fn clean(&self) -> Result<usize> {
        let _c = self.commit_lock.lock();
        let victims = self
            .log
            .victims(CLEAN_BATCH_SEGMENTS, (SEGMENT_BYTES * 15 / 16) as u32);
        if victims.is_empty() {
            return Ok(0);
        }
        let set: HashSet<u32> = victims.iter().copied().collect();
        let in_victim = |p: &Blkptr| p.addrs().iter().any(|&a| set.contains(&segment_of(a)));
        let volumes: Vec<_> = self.volumes.read().values().cloned().collect();
        let mut stored = Vec::new();
        for v in volumes {
            let mut moves: Vec<(u64, Blkptr)> = Vec::new();
            {
                let mut tree = v.tree.lock();
                let mut touch: Vec<(u8, u64)> = Vec::new();
                tree.walk(self, &self.cache, 0, u64::MAX, &mut |visit| {
                    match visit {
                        Visit::Unreadable { error, .. } => {
                            return Err(Error::Corrupt(format!("cleaner: {error}")))
                        }
                        Visit::Data { lba, ptr } if in_victim(ptr) => moves.push((lba, *ptr)),
                        Visit::Node { level, index, ptr } if in_victim(ptr) => {
                            touch.push((level, index))
                        }
                        _ => {}
                    }
                    Ok(())
                })?;
                for (level, index) in touch {
                    tree.touch(self, &self.cache, level, index)?;
                }
                self.note_dirty(&v, tree.dirty_nodes());
            }
            for (lba, old) in moves {
                {
                    // Like a client read: a block replaced since the walk may lie in a
                    // segment a writer has recycled (`Core::recycle_if_due`) and rewritten.
                    let _gate = self.reuse_gate.read();
                    if v.tree.lock().lookup(self, &self.cache, lba)? != old {
                        continue;
                    }
                    match self.red.read_verified(
                        old.addrs(),
                        old.len as usize,
                        &old.checksum,
                        &mut stored,
                    ) {
                        Ok(()) => {}
                        Err(Error::Unrecoverable(e)) => {
                            tracing::error!(volume = %v.name, lba, "cannot move an unrecoverable block: {e}");
                            continue;
                        }
                        Err(e) => return Err(e),
                    }
                }
                let addr = self.alloc_record(Stream::Clean, stored.len())?;
                let new = Blkptr {
                    addr: [addr, old.addr[1]],
                    ..old
                };
                if let Err(e) = self.red.write(addr, &stored) {
                    self.release_record(addr, old.len as usize);
                    return Err(e);
                }
                let mut tree = v.tree.lock();
                if tree.lookup(self, &self.cache, lba)? == old {
                    tree.set(self, &self.cache, lba, new)?;
                    self.note_dirty(&v, tree.dirty_nodes());
                    self.free_ptr(&old);
                } else {
                    self.release_record(addr, old.len as usize);
                }
            }
        }
        self.table_dirty.store(true, Ordering::Release);
        Ok(victims.len())
    }
}
