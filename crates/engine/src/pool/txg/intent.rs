//! The flush path of the intent log (decision 0010): a FLUSH appends the volume's
//! dirty block pointers as one log block and syncs it, instead of a commit; group
//! commit gathers concurrent flushes into one block. The block format and the chain
//! live in `intentlog::block`, the separate log devices in `intentlog::devices`; the
//! replay at import is `import::replay`.

use crate::constants::METADATA_COPIES;
use crate::log::Stream;
use crate::map::ADDR_NONE;
use crate::pool::core::Core;
use crate::pool::intentlog::block::*;
use crate::store::Dead;
use crate::volume::VolumeState;
use crate::Result;
use std::sync::Arc;

impl Core {
    /// A slot for a chain block: two places on a `single` pool (as for metadata), one
    /// where the layout keeps copies or parity of every record already (a block is needed
    /// only until the next commit, seconds away; a second copy there would double what
    /// every flush writes to every device).
    pub(crate) fn alloc_log_slot(&self) -> Result<[u64; 2]> {
        let a = self.store.place_log_block(Stream::Meta, LOG_BLOCK_BYTES)?;
        let redundant = !matches!(self.store.layout(), crate::redundancy::Layout::Single);
        if METADATA_COPIES < 2 || redundant {
            return Ok([a, ADDR_NONE]);
        }
        match self.store.place_log_block(Stream::Meta2, LOG_BLOCK_BYTES) {
            Ok(b) => Ok([a, b]),
            Err(e) => {
                self.store.release(Dead::unlinked(slot_ptr([a, ADDR_NONE])));
                Err(e)
            }
        }
    }

    /// The stored bytes of each entry's record (empty for a hole), verified; `None` when
    /// one cannot be read whole (the flush then names them and syncs the main devices).
    fn read_records(&self, entries: &[Entry]) -> Option<Vec<Vec<u8>>> {
        entries
            .iter()
            .map(|e| {
                let mut rec = Vec::new();
                if e.ptr.is_hole() {
                    return Some(rec);
                }
                let ok = self.store.read_quiet(
                    e.ptr.addrs(),
                    e.ptr.len as usize,
                    &e.ptr.checksum,
                    &mut rec,
                    &|_| true,
                );
                matches!(ok, Ok(true)).then_some(rec)
            })
            .collect()
    }

    /// Append `entries` (pointers only) to the log devices while the main devices, which
    /// hold the records they name, are synced: at once, on a thread each (one after the
    /// other under the simulator, `env::run_jobs`).
    fn append_beside_main_sync(
        &self,
        logdev: &crate::pool::intentlog::devices::LogDevices,
        pool_id: [u8; 16],
        chain_id: [u8; 16],
        entries: &[Entry],
    ) -> Result<crate::pool::intentlog::devices::Appended> {
        enum Done {
            Main(Result<()>),
            Log(crate::pool::intentlog::devices::Appended),
        }
        let written = || crate::crashpoint::hit("intent.written");
        let jobs: Vec<crate::env::Job<'_, Done>> = vec![
            Box::new(|| Done::Main(self.store.flush_devices())),
            Box::new(|| {
                Done::Log(logdev.append(pool_id, chain_id, entries, None, &written, &self.log_key))
            }),
        ];
        let mut appended = None;
        for done in crate::env::run_jobs(jobs) {
            match done {
                Done::Main(main) => main?,
                Done::Log(a) => appended = Some(a),
            }
        }
        Ok(appended.expect("the log job ran"))
    }

    /// Make every write completed before the call durable through the intent log (the
    /// caller holds the commit lock). `Ok(false)`: no chain (a commit is needed instead);
    /// `NoSpace`: no room for a chain block (likewise). Any other error is the devices'.
    pub(crate) fn log_flush_held(&self, volumes: &[Arc<VolumeState>]) -> Result<bool> {
        let mut chain = self.intent.lock();
        // The chain is on the log devices when they hold one, else on the main devices.
        let logdev = self.logdev.read().clone().filter(|l| l.has_chain());
        if chain.is_none() && logdev.is_none() {
            return Ok(false);
        }
        // The recycle epoch stays odd while the notes are taken (as during a commit's
        // snapshot): nothing is recyclable meanwhile, and every record a note names lies in
        // a segment opened before the epoch ends, which from then on only a commit frees.
        // (Ended before the take, a segment opened in between could hold a noted record
        // and be recycled before the next commit.)
        let snapshot = self.store.snapshot_map();
        let notes: Vec<_> = volumes.iter().map(|v| (v.id(), v.take_intents())).collect();
        drop(snapshot);
        let mut entries = Vec::new();
        for (id, n) in notes {
            entries.extend(dedup_notes(id, n));
        }
        if entries.is_empty() {
            // Every completed write is in the last commit or an earlier flush's blocks.
            return Ok(true);
        }
        let (pool_id, chain_id) = {
            let sb = self.sb.lock();
            (sb.sb.pool_id, sb.sb.chain_id)
        };
        if let Some(logdev) = logdev {
            let written = || crate::crashpoint::hit("intent.written");
            // A small flush puts its records' stored bytes into the log too (read back
            // from the main devices' page cache, verified): the log device alone makes it
            // durable, and the main devices are not synced.
            let inline: usize = entries
                .iter()
                .map(|e| (e.ptr.len as usize).next_multiple_of(16))
                .sum();
            let data = (inline <= logdev.inline_bytes_max())
                .then(|| self.read_records(&entries))
                .flatten();
            let appended = match &data {
                Some(data) => logdev.append(
                    pool_id,
                    chain_id,
                    &entries,
                    Some(data),
                    &written,
                    &self.log_key,
                ),
                // The log holds pointers only: the records they name are on the main
                // devices, synced once meanwhile.
                None => self.append_beside_main_sync(&logdev, pool_id, chain_id, &entries)?,
            };
            return Ok(match appended {
                crate::pool::intentlog::devices::Appended::Done => {
                    crate::crashpoint::hit("intent.synced");
                    if let Some(c) = logdev.state.lock().chain {
                        self.reach.note(crate::pool::format::anchor::Reach {
                            pool_id,
                            generation: c.generation,
                            chain: chain_id,
                            blocks: c.seq,
                        });
                    }
                    true
                }
                // A commit makes it all durable (the map holds every entry).
                _ => false,
            });
        }
        let Some(chain) = chain.as_mut() else {
            return Ok(false);
        };
        let flush_first = chain.seq;
        for chunk in entries.chunks(ENTRIES_PER_BLOCK) {
            // On `NoSpace` here the caller commits: the map holds every entry anyway.
            let next = match chain.after {
                Some(a) => a,
                None => {
                    let a = self.alloc_log_slot()?;
                    chain.slots.push(slot_ptr(a));
                    chain.after = Some(a);
                    a
                }
            };
            let after = self.alloc_log_slot()?;
            chain.slots.push(slot_ptr(after));
            let block = Block {
                pool_id,
                generation: chain.generation,
                seq: chain.seq,
                next,
                data_slots: 0,
                chain: chain_id,
                after,
                flush_first,
                entries: chunk.to_vec(),
            }
            .encode(&self.log_key);
            for &a in chain.next.iter().filter(|&&a| a != ADDR_NONE) {
                self.store.write_at(a, &block)?;
            }
            chain.next = next;
            chain.after = Some(after);
            chain.seq += 1;
        }
        crate::crashpoint::hit("intent.written");
        self.store.flush_devices()?;
        crate::crashpoint::hit("intent.synced");
        self.reach.note(crate::pool::format::anchor::Reach {
            pool_id,
            generation: chain.generation,
            chain: chain_id,
            blocks: chain.seq,
        });
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checksum::{seal_self_checked, SELF_CHECKED};
    use crate::map::Blkptr;
    use crate::Error;

    fn key() -> LogKey {
        zeroize::Zeroizing::new([0x3c; 32])
    }

    fn entry(i: u64) -> Entry {
        Entry {
            volume: 7,
            lba: i * 3,
            ptr: Blkptr {
                addr: [i * 4096, ADDR_NONE],
                nonce: i,
                len: 4112,
                flags: crate::codec::FLAG_ENCRYPTED,
                key_gen: 1,
                checksum: [i as u8; 32],
            },
        }
    }

    #[test]
    fn blocks_round_trip_and_refuse_other_chains() {
        let b = Block {
            pool_id: [9; 16],
            generation: 12,
            seq: 3,
            next: [1 << 20, 2 << 20],
            data_slots: 3,
            chain: [7; 16],
            after: [3 << 20, 4 << 20],
            flush_first: 2,
            entries: (1..=ENTRIES_PER_BLOCK as u64).map(entry).collect(),
        };
        let bytes = b.encode(&key());
        assert!(crate::checksum::verify(&SELF_CHECKED, &bytes));
        assert_eq!(
            Block::decode(&bytes, Some(&key()), &[9; 16], &[7; 16], 12, 3).unwrap(),
            Some(b.clone())
        );
        assert_eq!(
            Block::decode(&bytes, Some(&key()), &[8; 16], &[7; 16], 12, 3).unwrap(),
            None
        );
        assert_eq!(
            Block::decode(&bytes, Some(&key()), &[9; 16], &[7; 16], 13, 3).unwrap(),
            None
        );
        assert_eq!(
            Block::decode(&bytes, Some(&key()), &[9; 16], &[7; 16], 12, 4).unwrap(),
            None
        );
        let mut torn = bytes.clone();
        torn[100] ^= 1;
        assert!(!crate::checksum::verify(&SELF_CHECKED, &torn));
        // Forged without the pool key: an entry changed and the unkeyed blake3 made
        // right, as anyone can; or the whole block made under another key.
        let mut forged = bytes.clone();
        forged[HEADER_BYTES + 8] ^= 1;
        seal_self_checked(&mut forged);
        assert!(crate::checksum::verify(&SELF_CHECKED, &forged));
        assert!(matches!(
            Block::decode(&forged, Some(&key()), &[9; 16], &[7; 16], 12, 3),
            Err(Error::Corrupt(_))
        ));
        let other = b.encode(&zeroize::Zeroizing::new([1; 32]));
        assert!(matches!(
            Block::decode(&other, Some(&key()), &[9; 16], &[7; 16], 12, 3),
            Err(Error::Corrupt(_))
        ));
    }

    #[test]
    fn decode_never_panics() {
        let b = Block {
            pool_id: [9; 16],
            generation: 12,
            seq: 3,
            next: [1 << 20, 2 << 20],
            data_slots: 3,
            chain: [7; 16],
            after: [3 << 20, 4 << 20],
            flush_first: 2,
            entries: (1..=5).map(entry).collect(),
        }
        .encode(&key());
        crate::fuzz::never_panics(
            "intent::Block::decode",
            &[b],
            3000,
            Some(&|b: &mut Vec<u8>| {
                if b.len() == LOG_BLOCK_BYTES {
                    seal_self_checked(b)
                }
            }),
            &|b| {
                let _ = Block::decode(b, Some(&key()), &[9; 16], &[7; 16], 12, 3);
            },
        );
    }

    /// The last chain block damaged, and the host's record of the log's reach not yet
    /// written (a crash inside the window): the replay ends there, the flush before it is
    /// replayed, and the pool imports (a flush that may never have returned).
    #[test]
    fn a_damaged_block_ends_the_replay_there() {
        use crate::pool::{OpenOptions, Pool};
        let dir = tempfile::tempdir().unwrap();
        let opts = OpenOptions {
            commit_interval: std::time::Duration::from_secs(3600),
            ..OpenOptions::default()
        };
        let pool = crate::pool::test_pool(dir.path(), opts.clone());
        let vopts = crate::volume::VolumeOptions {
            size_bytes: 4 << 20,
            block_size: 4096,
            compression: crate::codec::Compression::Off,
            encryption: false,
        };
        pool.create_volume("v", vopts, None).unwrap();
        let v = pool.volume("v").unwrap();
        let block = |b: u8| vec![b; 4096];
        for lba in 0..10u64 {
            v.write(lba * 4096, &block(0xA1), false).unwrap();
        }
        v.flush().unwrap();
        for lba in 10..20u64 {
            v.write(lba * 4096, &block(0xB2), false).unwrap();
        }
        v.flush().unwrap();
        let slots = pool.core().intent.lock().as_ref().unwrap().slots.clone();
        assert_eq!(
            slots.len(),
            4,
            "head, the second block, the next two slots: {slots:?}"
        );
        // The second flush's block, both copies, damaged.
        for &a in slots[1].addrs() {
            pool.core()
                .store
                .write_at(a, &vec![0x5a; LOG_BLOCK_BYTES])
                .unwrap();
        }
        drop(v);
        drop(pool); // a crash: no close, no commit
                    // ... before the host recorded how far the log reached (the window a lazy record
                    // leaves: docs/durability.md): the anchor file's reach slot is not there.
        std::fs::OpenOptions::new()
            .write(true)
            .open(crate::pool::format::anchor::path(dir.path()))
            .unwrap()
            .set_len(1024)
            .unwrap();
        let pool = Pool::open(dir.path(), opts).unwrap();
        let v = pool.volume("v").unwrap();
        let mut buf = vec![0u8; 4096];
        for lba in 0..20u64 {
            v.read(lba * 4096, &mut buf).unwrap();
            let want = if lba < 10 { 0xA1 } else { 0 };
            assert!(buf.iter().all(|&b| b == want), "block {lba}");
        }
        let st = pool.status();
        assert_eq!(st.state, "ONLINE");
        pool.close().unwrap();
    }

    /// A pool with volume `v` (not encrypted) and three flushes that only the intent log
    /// holds (blocks 0..10 = 0xA1, 10..20 = 0xB2, 20..30 = 0xC3), "crashed": the chain's
    /// slots, block by block (a single pool: two copies each), and the records block 1
    /// names. Waits until the host has recorded how far the log reached.
    fn three_flushes_crashed(
        dir: &std::path::Path,
    ) -> (crate::pool::OpenOptions, Vec<Blkptr>, Vec<Blkptr>) {
        use crate::pool::OpenOptions;
        let opts = OpenOptions {
            commit_interval: std::time::Duration::from_secs(3600),
            ..OpenOptions::default()
        };
        let pool = crate::pool::test_pool(dir, opts.clone());
        let vopts = crate::volume::VolumeOptions {
            size_bytes: 4 << 20,
            block_size: 4096,
            compression: crate::codec::Compression::Off,
            encryption: false,
        };
        pool.create_volume("v", vopts, None).unwrap();
        let v = pool.volume("v").unwrap();
        for (f, b) in [0xA1u8, 0xB2, 0xC3].into_iter().enumerate() {
            for lba in f as u64 * 10..f as u64 * 10 + 10 {
                v.write(lba * 4096, &vec![b; 4096], false).unwrap();
            }
            v.flush().unwrap();
        }
        let chain = pool.core().intent.lock().as_ref().unwrap().slots.clone();
        // Block k lies at the slot the block before named: the head, then each block's
        // `next` (slots are pushed as [head, next0, after0, after1, after2]).
        let blocks = vec![chain[0], chain[1], chain[2]];
        let sb = pool.core().sb.lock().sb.clone();
        let mut b1 = Vec::new();
        assert!(pool
            .core()
            .store
            .read_quiet(
                blocks[1].addrs(),
                LOG_BLOCK_BYTES,
                &SELF_CHECKED,
                &mut b1,
                &|_| true
            )
            .unwrap());
        let block1 = Block::decode(
            &b1,
            Some(&pool.core().log_key),
            &sb.pool_id,
            &sb.chain_id,
            sb.generation,
            1,
        )
        .unwrap()
        .expect("block 1 is where the chain says");
        let records = block1.entries.iter().map(|e| e.ptr).collect();
        // The host records the log's reach off the flush path: wait until it has.
        while crate::pool::format::anchor::read_reach(dir).map(|r| r.blocks) != Some(3) {
            std::thread::yield_now();
        }
        drop(v);
        drop(pool); // a crash: no close, no commit
        (opts, blocks, records)
    }

    fn damage(dir: &std::path::Path, at: &[u64]) {
        // Through a pool opened on a copy would commit; write the device file directly.
        let conf = crate::pool::format::config::PoolConfig::read(dir).unwrap();
        let dev = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join(&conf.devices[0]))
            .unwrap();
        for &a in at {
            use std::os::unix::fs::FileExt;
            // `single` on one device: pool address a lies at 1 MiB + a.
            dev.write_all_at(&vec![0u8; LOG_BLOCK_BYTES], (1 << 20) + a)
                .unwrap();
        }
    }

    /// The host's record of the log's reach removed: only the later blocks can tell.
    fn forget_reach(dir: &std::path::Path) {
        std::fs::OpenOptions::new()
            .write(true)
            .open(crate::pool::format::anchor::path(dir))
            .unwrap()
            .set_len(1024)
            .unwrap();
    }

    fn refused_and_taken(dir: &std::path::Path, opts: crate::pool::OpenOptions, good: u64) {
        use crate::pool::{OpenOptions, Pool};
        forget_reach(dir);
        let e = Pool::open(dir, opts.clone())
            .err()
            .expect("the loss was refused");
        let e = e.to_string();
        assert!(e.contains("later block(s) of the same chain verify"), "{e}");
        assert!(
            e.contains("--accept-log-loss") && e.contains("volume(s) v"),
            "{e}"
        );
        let pool = Pool::open(
            dir,
            OpenOptions {
                accept_log_loss: true,
                ..opts
            },
        )
        .unwrap();
        let st = pool.status();
        assert!(
            st.lost_flushes.as_deref().is_some_and(|l| l.contains('v')),
            "{:?}",
            st.lost_flushes
        );
        let v = pool.volume("v").unwrap();
        let mut buf = vec![0u8; 4096];
        for lba in 0..good {
            v.read(lba * 4096, &mut buf).unwrap();
            assert!(buf.iter().all(|&b| b == 0xA1), "block {lba}");
        }
        pool.close().unwrap();
    }

    /// A chain block zeroed (both copies) while a later flush's block verifies: the
    /// flushes are lost, not unfinished; refused, then taken with the flag.
    #[test]
    fn a_zeroed_block_in_a_chain_that_goes_on_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (opts, blocks, _) = three_flushes_crashed(dir.path());
        damage(dir.path(), blocks[1].addrs());
        refused_and_taken(dir.path(), opts, 10);
    }

    /// The record a log entry names zeroed, while a later flush's block verifies.
    #[test]
    fn a_damaged_record_in_a_chain_that_goes_on_is_reported_lost() {
        let dir = tempfile::tempdir().unwrap();
        let (opts, _, records) = three_flushes_crashed(dir.path());
        damage(dir.path(), &[records[0].addrs()[0]]);
        refused_and_taken(dir.path(), opts, 10);
    }

    /// The last block zeroed: no later block is there, but the host recorded that the log
    /// reached further.
    #[test]
    fn a_log_cut_short_is_seen_by_the_hosts_reach_record() {
        let dir = tempfile::tempdir().unwrap();
        let (opts, blocks, _) = three_flushes_crashed(dir.path());
        damage(dir.path(), blocks[2].addrs());
        let e = crate::pool::Pool::open(dir.path(), opts)
            .err()
            .expect("refused");
        assert!(e.to_string().contains("reached 3"), "{e}");
    }
}
