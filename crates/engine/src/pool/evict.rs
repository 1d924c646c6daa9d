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
//!    sealed segment with none, whose slot in the store's table is of its current opening,
//!    has every byte it holds in the store (`Tier::stored_segments`).
//! 2. `Log::mark_for_eviction`, under the log's lock, only if the segment is still as
//!    checked: free, or sealed client data of that opening with no put under way (a put
//!    placed in a segment counts until its bytes are written and noted for upload, even
//!    after another writer's allocation sealed it: `Log::put_done`). Reads from here on go
//!    to the store.
//! 3. The reuse gate, write-held once (`Store::drain_reads`): every read that looked at
//!    the mark before step 2 has finished. While a read from the store holds it past
//!    `GATE_WAIT`, the pass takes its marks back and stops, rather than stall every
//!    reader queued behind the gate.
//! 4. `Log::give_back`: under the log's lock, only if the segment was not opened again
//!    since (which clears the mark), the devices punch the hole.
//!
//! Free segments are given back first (their bytes are dead), then client data, oldest
//! opening first. Map nodes and the volume table are never given back (every map walk
//! needs them). At open, a segment that is a hole on every member holding it is marked
//! again (`mark_holes`). Devices that cannot punch holes stop the cache's passes.
//!
//! The other way, `bring_back` fetches whole the given-back segments read from the store
//! often (`Store::note_cold`) and writes them into their holes, under the log's lock while
//! the segment is still marked (`Log::bring_back`), so their reads are local again. It
//! runs on the maintenance thread, as `evict` does (never both at once); `bring_back_all`
//! brings back every one (`pool object-store remove`). It only uses room the cache has;
//! when a wanted segment finds less than a segment of room, the next `evict` gives back
//! down to its target (oldest first), so a cache sitting just under its limit with no
//! writes does not keep it wanted for ever. A segment must be read from the store
//! `REFILL_AFTER_READS` times to be wanted, which bounds the churn of a working set
//! larger than the cache.

use std::sync::atomic::Ordering;

use super::core::Core;
use crate::{Error, Result};

/// Segments given back per pass (each a few `fallocate` calls under the log's lock).
const EVICT_BATCH: usize = 64;

/// Segments of room a pass leaves below the limit at least, for segments to come back.
const REFILL_ROOM_SEGMENTS: u64 = 2;

/// Segments brought back per pass (each its parts' GETs, one segment's writes under the
/// log's lock and a flush).
const REFILL_BATCH: usize = 16;

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
    /// Does nothing without an object store, a cache size, or while under it (unless a
    /// segment wanted back finds less than a segment of room: then down to the target too).
    pub fn evict(&self) -> Result<Evicted> {
        let mut done = Evicted::default();
        let Some(tier) = &self.tier else {
            return Ok(done);
        };
        let Some(limit) = tier.cache_bytes else {
            return Ok(done);
        };
        let store = &self.store;
        // Past the limit; or under it with less than a segment of room while a segment
        // read often waits to come back (`bring_back` only uses room the cache has, and
        // with nothing written the cache would stay just under its limit for ever).
        let local = store.local_bytes();
        let room_wanted = store.wants_back() && local + store.bytes_per_segment() > limit;
        if tier.cache_unsupported.load(Ordering::Relaxed) || (local <= limit && !room_wanted) {
            return Ok(done);
        }
        // Room left below the limit: for a while of writes, and for segments read often
        // to come back (`bring_back` only uses room the cache has).
        let headroom = (limit / 100 * (100 - EVICT_TO_PERCENT))
            .max(REFILL_ROOM_SEGMENTS * store.bytes_per_segment());
        let target = limit.saturating_sub(headroom);
        let _c = self.commit_lock.lock();
        let _one = tier.cache_lock.lock();
        store.check_poisoned()?;
        // How many segments are still to give back to reach the target.
        let wanted = || {
            let now = store.local_bytes();
            now.saturating_sub(target)
                .div_ceil(store.bytes_per_segment()) as usize
        };
        // Free segments first: nothing reads them. Each is marked only if still free, and
        // punched only if not opened since (`Log::give_back`).
        let free: Vec<(u32, Option<u64>)> =
            store.free_held().into_iter().map(|s| (s, None)).collect();
        done.free = self.give_back(&free, &wanted, false)?;
        if tier.cache_unsupported.load(Ordering::Relaxed) {
            return Ok(done);
        }
        // Then client data, oldest opening first, each only as it was checked: sealed,
        // of the opening whose slot the store holds, with no put under way.
        let pending = store.pending_upload_segments();
        let candidates = store.eviction_candidates();
        let stored: Vec<(u32, Option<u64>)> = tier
            .stored_segments(store, &candidates, &pending)
            .into_iter()
            .map(|(s, inc)| (s, Some(inc)))
            .collect();
        done.data = self.give_back(&stored, &wanted, true)?;
        tier.evicted_total
            .fetch_add(done.data as u64, Ordering::Relaxed);
        if done.data > 0 || done.free > 0 {
            tracing::debug!(
                segments = done.data,
                free = done.free,
                local_bytes = store.local_bytes(),
                limit,
                "local cache: segments given back to the object store"
            );
        }
        Ok(done)
    }

    /// Bring back whole the given-back segments read from the store often enough
    /// (`Store::note_cold`): their parts fetched, written to the devices under the log's
    /// lock while the segment is still marked (`Log::bring_back`), made durable, then
    /// unmarked, so that their reads are local again. Runs on the maintenance thread, as
    /// `evict` does (never both at once). Returns how many came back.
    pub fn bring_back(&self) -> Result<usize> {
        let Some(tier) = &self.tier else {
            return Ok(0);
        };
        let _one = tier.cache_lock.lock();
        let store = &self.store;
        let wanted = store.take_wanted_back();
        let mut written = Vec::new();
        let mut done = 0;
        for &seg in &wanted {
            if written.len() >= REFILL_BATCH {
                break;
            }
            // Only into room the cache has: bringing back gives nothing back itself (the
            // next `evict` makes room to its target when a wanted segment finds none).
            if let Some(limit) = tier.cache_bytes {
                if store.local_bytes() + store.bytes_per_segment() > limit {
                    break;
                }
            }
            done += 1;
            if !store.is_evicted(seg) || store.is_free(seg) {
                continue;
            }
            match self.write_back(tier, seg) {
                Ok(Some(true)) => written.push(seg),
                Ok(_) => {}
                // The store does not answer: the rest waits for the next pass (each would
                // wait for its deadline, and this thread also commits and cleans).
                Err(e @ Error::StoreUnavailable(_)) | Err(e @ Error::Io(_)) => {
                    tracing::warn!("local cache: bringing back segments paused: {e}");
                    done -= 1;
                    break;
                }
                Err(e) => {
                    tracing::warn!(segment = seg, "local cache: bringing back failed: {e}");
                }
            }
        }
        store.return_wanted_back(&wanted[done..]);
        self.store.settle_written_back(&written)?;
        tier.refilled_total
            .fetch_add(written.len() as u64, Ordering::Relaxed);
        tracing::debug!(
            segments = written.len(),
            "local cache: segments brought back"
        );
        Ok(written.len())
    }

    /// Bring back every segment only the store holds (`pool object-store remove`: the
    /// pool is about to be local only), whatever the cache's size. Returns how many.
    pub fn bring_back_all(&self) -> Result<usize> {
        let Some(tier) = &self.tier else {
            return Ok(0);
        };
        let _one = tier.cache_lock.lock();
        let mut written = Vec::new();
        for seg in self.store.evicted_live() {
            match self.write_back(tier, seg)? {
                Some(true) => written.push(seg),
                Some(false) => {}
                None => {
                    return Err(Error::Unrecoverable(format!(
                        "segment {seg} was given back, and the object store's table has no \
                         bytes of it"
                    )))
                }
            }
        }
        self.store.settle_written_back(&written)?;
        Ok(written.len())
    }

    /// Fetch given-back segment `seg`'s bytes from the store and write them to the
    /// devices, under the log's lock, only while it is still the sealed, marked segment of
    /// the opening fetched (`Log::bring_back`). `None`: the store's table holds no bytes
    /// of this opening; `Some(false)`: the segment changed meanwhile, nothing written.
    fn write_back(&self, tier: &super::tier::Tier, seg: u32) -> Result<Option<bool>> {
        let store = &self.store;
        let opening = store.incarnation(seg);
        let Some(parts) = tier.segment_bytes(store, seg)? else {
            return Ok(None);
        };
        Ok(Some(store.write_back(seg, opening, &parts)?))
    }

    /// Give back `segs` (each with the opening checked, `None` for a free one), batch by
    /// batch while `wanted` says more are needed. With `readers`, each batch waits out the
    /// reads that could have missed its marks first (and is taken back when they take too
    /// long: a read waiting for the store). Returns how many were given back.
    fn give_back(
        &self,
        segs: &[(u32, Option<u64>)],
        wanted: &dyn Fn() -> usize,
        readers: bool,
    ) -> Result<usize> {
        let store = &self.store;
        let tier = self.tier.as_ref().expect("called with an object store");
        let mut given = 0;
        let mut rest = segs;
        while !rest.is_empty() {
            let n = wanted().min(EVICT_BATCH).min(rest.len());
            if n == 0 {
                break;
            }
            let (chunk, tail) = rest.split_at(n);
            rest = tail;
            let marked: Vec<u32> = chunk
                .iter()
                .filter(|(seg, opening)| store.mark_for_eviction(*seg, *opening))
                .map(|(seg, _)| *seg)
                .collect();
            if readers && !store.drain_reads(false) {
                for &seg in &marked {
                    store.unmark(seg);
                }
                break;
            }
            let mut none_could = !marked.is_empty();
            for seg in marked {
                match store.give_back_segment(seg) {
                    Ok(true) => {
                        given += 1;
                        none_could = false;
                    }
                    Ok(false) => {}
                    // The mark stays (a copy may be a hole): its reads go to the store.
                    Err(e) => {
                        none_could = false;
                        tracing::warn!(segment = seg, "local cache: giving back failed: {e}")
                    }
                }
            }
            if none_could {
                tier.cache_unsupported.store(true, Ordering::Relaxed);
                tracing::warn!(
                    "local cache: the pool's devices cannot give space back (block devices, \
                     or a file system without hole punching): they keep every byte"
                );
                break;
            }
        }
        Ok(given)
    }
}

/// At open: segments of client data (and free ones) that are holes on a member were given
/// back before (or never downloaded: a lazy `pool import --object-store`): their records
/// are read from the store.
pub(crate) fn mark_holes(store: &crate::store::Store, data_segments: &[bool]) -> usize {
    let mut n = 0;
    for (seg, _) in data_segments.iter().enumerate().filter(|(_, &d)| d) {
        let seg = seg as u32;
        if store.mark_if_hole(seg) {
            n += 1;
        }
    }
    for seg in store.free_held() {
        store.mark_if_hole(seg);
    }
    n
}
