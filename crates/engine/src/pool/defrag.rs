//! The defragmenter: the cleaner's idle work (decision 0014, step 3; issue 40).
//!
//! Random overwrites leave a volume's blocks scattered over the log, so a later sequential
//! read is a random read (a 1 MiB sequential read after 5x random 4 KiB overwrite at 80%
//! fill ran at a quarter of the same read before: BENCHMARKS.md). When no client has asked
//! anything for `DEFRAG_IDLE` by the pool's clock (`crate::env`), a maintenance round walks
//! the volumes in name order, a window of `DEFRAG_WINDOW_BYTES` of blocks at a time; a
//! window whose records lie in more than `DEFRAG_RUNS_MAX` runs on the devices is moved to
//! the cleaner's head in block order, by the cleaner's own move (`Core::move_records`:
//! checksum-verified bytes, swapped in only where the map still points at the old copy,
//! noted for the intent log; no key needed). The old copies become dead: the next commit
//! frees them, the cleaner reclaims the segments they leave part-empty.
//!
//! When it stops: at the first client operation (checked between windows; the next idle
//! spell goes on from the same place); when free segments fall to the level at which the
//! cleaner starts (it never takes what client writes and commits need: the cleaner's next
//! pass regains it); after a whole pass over every volume, until clients write again.
//! Left alone: volumes with snapshots or clones (their records are shared by several trees:
//! the cleaner's shared moves), pools with an object tier (every move would be uploaded
//! again), pools whose space accounting is incomplete (as the cleaner), and pools opened
//! with it off (`serve --no-defrag`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::core::{Core, DefragCursor};
use crate::constants::{DEFRAG_IDLE_SECS, RECORD_ALIGN};
use crate::map::{Blkptr, Visit};
use crate::volume::VolumeState;
use crate::{Error, Result};

/// Quiet time (no client read or write) before the defragmenter starts.
const DEFRAG_IDLE: Duration = Duration::from_secs(DEFRAG_IDLE_SECS);
/// Logical bytes judged and moved together.
const DEFRAG_WINDOW_BYTES: u64 = 1 << 20;
/// A window whose records lie in more runs than this is moved (a run: records end to end
/// on the devices; the defragmenter's own moves leave a window in about 4, one per batch).
const DEFRAG_RUNS_MAX: usize = 8;
/// Record bytes moved per round at most, and windows looked at: a round holds the commit
/// lock (flushes that wait are answered between windows).
const DEFRAG_ROUND_BYTES: u64 = 16 << 20;
const DEFRAG_ROUND_WINDOWS: usize = 1024;
/// Records and bytes per move (one read span, one write run), as the cleaner's batches.
const DEFRAG_BATCH_RECORDS: usize = 64;
const DEFRAG_BATCH_BYTES: usize = 256 << 10;

/// The runs a window's records lie in: a record that does not start where the one before
/// it ended starts a run. A record of `len` stored bytes takes `footprint(len)` bytes of
/// segment space (its length, or its shard on each member for parity), rounded up to
/// `RECORD_ALIGN`, as the log places records one after another.
fn runs(ptrs: &[(u64, Blkptr)], footprint: impl Fn(usize) -> usize) -> usize {
    let mut runs = 0;
    let mut end = None;
    for (_, p) in ptrs {
        if end != Some(p.addr[0]) {
            runs += 1;
        }
        let took = footprint(p.len as usize) as u64;
        end = Some(p.addr[0] + took.div_ceil(RECORD_ALIGN) * RECORD_ALIGN);
    }
    runs
}

/// How far a round went.
enum Round {
    /// The round's budget ran out, or a client came: go on later from the cursor.
    Paused,
    /// Free segments ran short: the cleaner's turn.
    NoRoom,
    /// Every volume looked at.
    Done,
}

impl Core {
    /// The defragmenter's part of a maintenance round, after the cleaner's.
    pub(super) fn defrag_round(&self, st: &mut DefragCursor) {
        if !self.defrag_due(st) {
            return;
        }
        let _c = self.commit_lock.lock();
        match self.defrag_held(st) {
            Ok(Round::Paused) => self.store.wake_maintenance(),
            Ok(Round::NoRoom) => {}
            Ok(Round::Done) => {
                st.done_at = Some(self.store.written().data);
                st.at = None;
                self.defrag_stats.passes.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    moved_bytes = self.defrag_stats.moved.load(Ordering::Relaxed),
                    "defragmenting pass done"
                );
            }
            Err(e) => tracing::warn!("defragmenting stopped: {e}"),
        }
    }

    /// Whether the pool has been quiet long enough, has room, and has something new.
    fn defrag_due(&self, st: &mut DefragCursor) -> bool {
        if !self.defrag_stats.on
            || self.tier.is_some()
            || !self.accounting_complete
            || self.store.is_poisoned()
            || self.low_on_space()
        {
            return false;
        }
        let ops = self.store.client_ops();
        if ops != st.ops {
            st.ops = ops;
            st.quiet_since = crate::env::now();
            return false;
        }
        crate::env::since(st.quiet_since) >= DEFRAG_IDLE
            && st.done_at != Some(self.store.written().data)
    }

    /// Windows of the volumes from the cursor on, under the commit lock (no snapshot comes
    /// or goes, no other move runs).
    fn defrag_held(&self, st: &mut DefragCursor) -> Result<Round> {
        // What the cleaner's stream writes meanwhile is the defragmenter's (the cleaner
        // waits for the commit lock): every copy, as `clean_written_bytes` counts it.
        let clean_before = self.store.written().clean;
        let round = self.defrag_windows(st);
        let wrote = self.store.written().clean - clean_before;
        self.defrag_stats.moved.fetch_add(wrote, Ordering::Relaxed);
        round
    }

    fn defrag_windows(&self, st: &mut DefragCursor) -> Result<Round> {
        let volumes: Vec<Arc<VolumeState>> = self.volumes.read().values().cloned().collect();
        let (mut bytes, mut windows) = (0u64, 0usize);
        let mut stored = Vec::new();
        for v in volumes {
            let from = match &st.at {
                Some((name, lba)) if name == v.name() => *lba,
                Some((name, _)) if name.as_str() > v.name() => continue,
                _ => 0,
            };
            st.at = Some((v.name().to_string(), from));
            if !v.snapshots().is_empty() {
                continue;
            }
            let window = (DEFRAG_WINDOW_BYTES / v.block_size() as u64).max(1);
            let blocks = v.size() / v.block_size() as u64;
            let mut lo = from;
            loop {
                // Unmapped stretches are stepped over, not looked at window by window.
                lo = v
                    .map()
                    .next_mapped(&*self.store, self.store.nodes(), lo, blocks)?;
                if lo >= blocks {
                    break;
                }
                if bytes >= DEFRAG_ROUND_BYTES
                    || windows >= DEFRAG_ROUND_WINDOWS
                    || self.store.client_ops() != st.ops
                {
                    st.at = Some((v.name().to_string(), lo));
                    return Ok(Round::Paused);
                }
                self.answer_waiting_flushes()?;
                let hi = (lo / window + 1) * window;
                match self.defrag_window(&v, lo, hi.min(blocks), &mut stored) {
                    Ok(n) => bytes += n,
                    Err(Error::NoSpace) => {
                        st.at = Some((v.name().to_string(), lo));
                        return Ok(Round::NoRoom);
                    }
                    Err(e) => {
                        // Not again next round (an unreadable map node, a device error):
                        // the pass goes on after this window; a scrub reports what failed.
                        st.at = Some((v.name().to_string(), hi.min(blocks)));
                        return Err(e);
                    }
                }
                windows += 1;
                lo = hi;
                if self.low_on_space() {
                    st.at = Some((v.name().to_string(), lo));
                    return Ok(Round::NoRoom);
                }
            }
        }
        Ok(Round::Done)
    }

    /// Move blocks `lo..hi` of `v` in block order when their records lie in too many runs;
    /// returns the record bytes moved (about: a batch counts whole if any of it moved).
    /// `NoSpace`: the cleaner's room ran out.
    fn defrag_window(
        &self,
        v: &VolumeState,
        lo: u64,
        hi: u64,
        stored: &mut Vec<u8>,
    ) -> Result<u64> {
        let ptrs = self.window(v, lo, hi)?;
        if runs(&ptrs, |len| self.store.footprint(len)) <= DEFRAG_RUNS_MAX {
            return Ok(0);
        }
        let mut moved = 0;
        let mut i = 0;
        while i < ptrs.len() {
            let (mut n, mut len) = (0, 0);
            while i + n < ptrs.len() && n < DEFRAG_BATCH_RECORDS && len < DEFRAG_BATCH_BYTES {
                len += ptrs[i + n].1.len as usize;
                n += 1;
            }
            let batch = &ptrs[i..i + n];
            i += n;
            if self.move_records(v, batch, stored)? > 0 {
                moved += len as u64;
            }
        }
        Ok(moved)
    }

    /// The records of blocks `lo..hi` of `v`'s map, in block order.
    fn window(&self, v: &VolumeState, lo: u64, hi: u64) -> Result<Vec<(u64, Blkptr)>> {
        let mut ptrs = Vec::new();
        v.map()
            .walk(&*self.store, self.store.nodes(), lo, hi, &mut |visit| {
                match visit {
                    Visit::Data { lba, ptr } => ptrs.push((lba, *ptr)),
                    Visit::Unreadable { error, .. } => {
                        return Err(Error::Corrupt(format!("defragmenter: {error}")))
                    }
                    Visit::Node { .. } => {}
                }
                Ok(())
            })?;
        Ok(ptrs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::map::ADDR_NONE;

    fn at(addr: u64, len: u32) -> (u64, Blkptr) {
        let mut p = Blkptr::HOLE;
        p.addr = [addr, ADDR_NONE];
        p.len = len;
        (0, p)
    }

    #[test]
    fn records_end_to_end_are_one_run() {
        let same = |len: usize| len;
        assert_eq!(runs(&[], same), 0);
        assert_eq!(
            runs(&[at(0, 4096), at(4096, 4096), at(8192, 4096)], same),
            1
        );
        // A record of 4000 bytes ends at the next RECORD_ALIGN boundary.
        let next = 4000u64.div_ceil(RECORD_ALIGN) * RECORD_ALIGN;
        assert_eq!(runs(&[at(0, 4000), at(next, 4096)], same), 1);
        assert_eq!(
            runs(&[at(0, 4096), at(1 << 20, 4096), at(4096, 4096)], same),
            3
        );
        // Parity 2+1: a 4 KiB record takes a 2 KiB shard on each member; the next record
        // placed after it starts 2 KiB on (counted by its length, every record a run).
        let shard = |len: usize| len.div_ceil(2);
        assert_eq!(
            runs(&[at(0, 4096), at(2048, 4096), at(4096, 4096)], shard),
            1
        );
        assert_eq!(
            runs(&[at(0, 4096), at(2048, 4096), at(4096, 4096)], same),
            3
        );
    }

    /// The scrub's pacing takes the count of client operations since its last look; the
    /// count the defragmenter compares must still see them (it once read 0 after each
    /// take, and a client busy beside a scrub looked quiet).
    #[test]
    fn the_scrub_taking_its_count_leaves_the_client_count_growing() {
        let dir = tempfile::tempdir().unwrap();
        let pool = crate::pool::test_pool(dir.path(), crate::pool::OpenOptions::default());
        let store = &pool.core().store;
        let start = store.client_ops();
        store.note_client_ops(3);
        store.take_client_ops();
        store.note_client_ops(2);
        assert_eq!(store.take_client_ops(), 2);
        assert_eq!(store.client_ops(), start + 5);
        assert_eq!(store.take_client_ops(), 0);
        pool.close().unwrap();
    }

    const SIZE: u64 = 8 << 20;
    const BLOCK: u64 = 4096;

    /// Block `lba`'s bytes in round `round`: incompressible, different per block and round.
    fn pattern(lba: u64, round: u64) -> Vec<u8> {
        let mut x =
            lba.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ round.wrapping_mul(0xD1B5_4A32_D192_ED03);
        (0..BLOCK / 8)
            .flat_map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                x.to_le_bytes()
            })
            .collect()
    }

    /// The most runs any 1 MiB window of volume `v` lies in.
    fn worst_runs(pool: &crate::pool::Pool) -> usize {
        let core = pool.core();
        let v = core.volumes.read().get("v").cloned().unwrap();
        let w = DEFRAG_WINDOW_BYTES / BLOCK;
        (0..SIZE / BLOCK)
            .step_by(w as usize)
            .map(|lo| {
                let ptrs = core.window(&v, lo, lo + w).unwrap();
                runs(&ptrs, |len| core.store.footprint(len))
            })
            .max()
            .unwrap()
    }

    fn check_reads(pool: &crate::pool::Pool, round: u64) {
        let v = pool.volume("v").unwrap();
        let mut buf = vec![0u8; BLOCK as usize];
        for lba in 0..SIZE / BLOCK {
            v.read(lba * BLOCK, &mut buf).unwrap();
            assert!(buf == pattern(lba, round), "block {lba} reads other bytes");
        }
    }

    /// A volume overwritten block by block in random order, then left alone: the rounds
    /// that follow its quiet time rewrite it in block order, reads return the last writes
    /// (before and after the pool is opened again), and no round moves anything while
    /// clients are busy.
    #[test]
    fn an_idle_pool_rewrites_scattered_blocks_in_block_order() {
        idle_pool_defragments(crate::pool::Layout::Single, 1);
    }

    /// The same on parity 2+1, whose records take a shard on each member: runs are
    /// counted by that footprint (counted by length, every record was a run, and every
    /// window was moved again on every quiet spell).
    #[test]
    fn an_idle_parity_pool_rewrites_scattered_blocks_in_block_order() {
        idle_pool_defragments(crate::pool::Layout::Parity { k: 2, m: 1 }, 3);
    }

    fn idle_pool_defragments(layout: crate::pool::Layout, devices: usize) {
        use crate::pool::{DeviceSpec, OpenOptions, Pool};
        use crate::volume::{Compression, VolumeOptions};

        let _env = crate::env::simulate(40);
        let dir = tempfile::tempdir().unwrap();
        let opts = || OpenOptions {
            stepped: true,
            ..OpenOptions::default()
        };
        let files = DeviceSpec::Files {
            count: devices,
            size_bytes: 64 << 20,
        };
        Pool::create(dir.path(), layout, files).unwrap();
        let pool = Pool::open(dir.path(), opts()).unwrap();
        let o = VolumeOptions {
            size_bytes: SIZE,
            block_size: BLOCK as u32,
            compression: Compression::Off,
            encryption: false,
        };
        pool.create_volume("v", o, None).unwrap();
        let v = pool.volume("v").unwrap();
        for lba in 0..SIZE / BLOCK {
            v.write(lba * BLOCK, &pattern(lba, 0), false).unwrap();
        }
        pool.maintenance_step().unwrap();
        assert!(
            worst_runs(&pool) <= DEFRAG_RUNS_MAX,
            "written in order, laid out in order"
        );
        // Overwrite every block once, in a random order, a commit every 64 writes.
        let mut order: Vec<u64> = (0..SIZE / BLOCK).collect();
        let mut x = 7u64;
        for i in (1..order.len()).rev() {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            order.swap(i, (x >> 33) as usize % (i + 1));
        }
        for (i, &lba) in order.iter().enumerate() {
            v.write(lba * BLOCK, &pattern(lba, 1), false).unwrap();
            if i % 64 == 63 {
                pool.maintenance_step().unwrap();
            }
        }
        let scattered = worst_runs(&pool);
        assert!(
            scattered > DEFRAG_RUNS_MAX,
            "random overwrites left {scattered} runs"
        );
        // Busy: rounds come, the clock moves, but a client asks something before each.
        let moved = |p: &Pool| p.status().space.defrag_moved_bytes;
        for _ in 0..4 {
            crate::env::advance(DEFRAG_IDLE);
            let mut one = vec![0u8; BLOCK as usize];
            v.read(0, &mut one).unwrap();
            pool.maintenance_step().unwrap();
        }
        assert_eq!(
            moved(&pool),
            0,
            "the defragmenter ran while a client was busy"
        );
        // Quiet: the rounds after the quiet time do it, in passes that end.
        crate::env::advance(DEFRAG_IDLE);
        for _ in 0..100 {
            pool.maintenance_step().unwrap();
            if pool.status().space.defrag_passes > 0 {
                break;
            }
        }
        assert_eq!(
            pool.status().space.defrag_passes,
            1,
            "no pass ended in 100 rounds"
        );
        assert!(
            moved(&pool) >= SIZE / 2,
            "moved only {} bytes",
            moved(&pool)
        );
        let after = worst_runs(&pool);
        assert!(
            after <= DEFRAG_RUNS_MAX,
            "{scattered} runs before, {after} after"
        );
        check_reads(&pool, 1);
        // Nothing new written: more quiet rounds move nothing more.
        let done = moved(&pool);
        crate::env::advance(DEFRAG_IDLE * 2);
        pool.maintenance_step().unwrap();
        assert_eq!(moved(&pool), done);
        drop(v);
        pool.close().unwrap();
        drop(pool);
        let pool = Pool::open(dir.path(), opts()).unwrap();
        check_reads(&pool, 1);
        assert!(worst_runs(&pool) <= DEFRAG_RUNS_MAX);
        // Idle again after the reopen (the pass counts start over): the layout is already
        // in order, so nothing moves.
        crate::env::advance(DEFRAG_IDLE);
        pool.maintenance_step().unwrap();
        crate::env::advance(DEFRAG_IDLE);
        for _ in 0..10 {
            pool.maintenance_step().unwrap();
        }
        assert_eq!(pool.status().space.defrag_passes, 1);
        assert_eq!(
            moved(&pool),
            0,
            "a window already in block order moved again"
        );
        pool.close().unwrap();
    }
}
