//! The local cache of a pool whose object store holds everything (issue 22 part 5,
//! `pool create --object-store-cache-size`): when the device files take more than the
//! cache's size, segments of client data whose bytes the store has are given back locally
//! (their range becomes a hole in every file that holds it), and their records are read
//! from the store from then on (`Store::read_record`, one ranged GET per record or run).
//!
//! Order, so that no read ever sees a hole where it expected bytes, and no byte the store
//! lacks is ever given back:
//! 1. Under the commit lock: no upload is under way, so every run written since the last
//!    commit is still listed for the next one (`Store::pending_upload_segments`), and a
//!    segment with none, whose slot in the store's table is of its current opening, is
//!    wholly in the store (`Tier::stored_segments`).
//! 2. `Log::set_evicted`: reads from here on go to the store.
//! 3. The reuse gate, write-held once: every read that looked at the mark before step 2
//!    has finished.
//! 4. `Log::give_back`: under the log's lock, only if the segment was not opened again
//!    since (a reopened segment's new bytes stay), the devices punch the hole.
//!
//! Free segments are given back first (their bytes are dead), then client data, oldest
//! first. Map nodes and the volume table are never given back (every map walk needs them).
//! At open, a segment found a hole on a member is marked again (`mark_holes`).

use std::sync::atomic::Ordering;

use super::core::Core;
use crate::Result;

/// Segments given back per pass (each a few `fallocate` calls under the log's lock).
const EVICT_BATCH: usize = 64;

/// Given back until the devices take at most this share of the cache's size, so that a
/// pass frees room for a while rather than one segment at a time.
const EVICT_TO_PERCENT: u64 = 90;

/// What one pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Evicted {
    pub free: usize,
    pub data: usize,
}

impl Core {
    /// Give back local room until the devices fit the cache's size (see the module docs).
    /// Does nothing without an object store, a cache size, or while under it.
    pub fn evict(&self) -> Result<Evicted> {
        let mut done = Evicted::default();
        let Some(tier) = &self.tier else {
            return Ok(done);
        };
        let Some(limit) = tier.cache_bytes else {
            return Ok(done);
        };
        let store = &self.store;
        if store.red.allocated_bytes() <= limit {
            return Ok(done);
        }
        let target = limit / 100 * EVICT_TO_PERCENT;
        let _c = self.commit_lock.lock();
        store.check_poisoned()?;
        // How many segments are still to give back to reach the target.
        let wanted = || {
            let now = store.red.allocated_bytes();
            now.saturating_sub(target)
                .div_ceil(store.red.bytes_per_segment()) as usize
        };
        // Free segments: nothing reads them, and they are given back under the log's lock.
        let free = store.log.free_held();
        let mut free = free.as_slice();
        while !free.is_empty() {
            let n = wanted().min(EVICT_BATCH).min(free.len());
            if n == 0 {
                return Ok(done);
            }
            let (chunk, rest) = free.split_at(n);
            free = rest;
            for &seg in chunk {
                store.log.set_evicted(seg);
                if store
                    .log
                    .give_back(seg, || store.red.discard_segment(seg))?
                {
                    done.free += 1;
                }
            }
        }
        let pending = store.pending_upload_segments();
        let candidates = store.log.eviction_candidates();
        let stored = tier.stored_segments(store, &candidates, &pending);
        let mut stored = stored.as_slice();
        while !stored.is_empty() {
            let n = wanted().min(EVICT_BATCH).min(stored.len());
            if n == 0 {
                break;
            }
            let (chunk, rest) = stored.split_at(n);
            stored = rest;
            let marked: Vec<u32> = chunk
                .iter()
                .copied()
                .filter(|&seg| store.log.set_evicted(seg))
                .collect();
            // Every read that could have missed the mark finishes first.
            drop(store.reuse_gate.write());
            for seg in marked {
                crate::crashpoint::hit("cache.evict");
                if store
                    .log
                    .give_back(seg, || store.red.discard_segment(seg))?
                {
                    done.data += 1;
                    tier.evicted_total.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if done.data > 0 {
            tracing::debug!(
                segments = done.data,
                free = done.free,
                local_bytes = store.red.allocated_bytes(),
                limit,
                "local cache: segments given back to the object store"
            );
        }
        Ok(done)
    }
}

/// At open: segments of client data (and free ones) that are holes on a member were given
/// back before (or never downloaded: a lazy `pool import --object-store`): their records
/// are read from the store.
pub(crate) fn mark_holes(store: &crate::store::Store, data_segments: &[bool]) -> usize {
    let mut n = 0;
    for (seg, _) in data_segments.iter().enumerate().filter(|(_, &d)| d) {
        let seg = seg as u32;
        if store.red.segment_is_hole(seg) && store.log.set_evicted(seg) {
            n += 1;
        }
    }
    for seg in store.log.free_held() {
        if store.red.segment_is_hole(seg) {
            store.log.set_evicted(seg);
        }
    }
    n
}
