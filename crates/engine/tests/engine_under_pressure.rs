//! Near full, the pool tells the truth (issue 36): a writer that cannot get room is
//! answered ENOSPC within a bound instead of waiting forever, and `status` says why.
//!
//! The endless wait: mirror:2 on two 128M files, a 90M encrypted volume full of random
//! data, snapshots v@base and v@k1, then random 4 KiB overwrites, 16 at a time and a
//! FLUSH. The snapshots pin every overwritten block, so the pool fills; before the fix the
//! cleaner ran pass after pass at 13 free segments, each pass's moves and rewritten map
//! nodes using exactly what it freed, and a writer counted every freed segment as progress
//! and waited forever (write amplification 173x). Now every overwrite ends, done or
//! refused for space, the refusals come once the cleaner can gain nothing, and the data
//! written before reads back.

use std::sync::mpsc;
use std::time::Duration;

use bulwark_engine::{
    Compression, DeviceSpec, Error, Layout, OpenOptions, Pool, Secret, VolumeOptions,
};
use zeroize::Zeroizing;

mod common;
use common::Rng;

const BLOCK: u64 = 4096;

fn key() -> Secret {
    Secret::KeyFile(Zeroizing::new([7; 32]))
}

fn block(seed: u64, lba: u64) -> Vec<u8> {
    let mut r = Rng(seed.wrapping_mul(0x9E37_79B9) ^ lba);
    (0..BLOCK / 8)
        .flat_map(|_| r.next().to_le_bytes())
        .collect()
}

/// The scenario; returns (overwrites done, whether one was refused for space).
fn overwrite_until_full(dir: &std::path::Path, rotate: bool) -> (u64, bool) {
    Pool::create(
        dir,
        Layout::Mirror(2),
        DeviceSpec::Files {
            count: 2,
            size_bytes: 128 << 20,
        },
    )
    .unwrap();
    let pool = Pool::open(dir, OpenOptions::default()).unwrap();
    let size = 90u64 << 20;
    let o = VolumeOptions {
        size_bytes: size,
        block_size: BLOCK as u32,
        compression: Compression::Off,
        encryption: true,
    };
    pool.create_volume("v", o, Some(&key())).unwrap();
    let blocks = size / BLOCK;
    {
        let v = pool.volume("v").unwrap();
        let chunk = 64u64;
        for first in (0..blocks).step_by(chunk as usize) {
            let data: Vec<u8> = (first..first + chunk).flat_map(|l| block(1, l)).collect();
            v.write(first * BLOCK, &data, false).unwrap();
        }
        v.flush().unwrap();
    }
    pool.snapshot_create("v", "base").unwrap();
    if rotate {
        // The reporter's pool: a key rotation rewrites every block under v@base until it
        // pauses for space (or ends), and v@k1 is taken then.
        pool.key_rotate("v").unwrap();
        loop {
            let r = pool
                .volumes()
                .into_iter()
                .find(|x| x.name == "v")
                .unwrap()
                .rotation;
            match r {
                Some(r) if r.error.is_none() => std::thread::sleep(Duration::from_millis(20)),
                _ => break,
            }
        }
    }
    pool.snapshot_create("v", "k1").unwrap();

    let v = pool.volume("v").unwrap();
    let mut rng = Rng(0x36);
    let mut latest: std::collections::HashMap<u64, u64> = Default::default();
    let mut done = 0u64;
    let mut refused = false;
    // More overwrites than the pool can hold beside what the snapshots pin.
    'outer: for round in 0..(blocks / 16 * 2) {
        for _ in 0..16 {
            let lba = rng.below(blocks);
            let tag = 2 + round;
            match v.write(lba * BLOCK, &block(tag, lba), false) {
                Ok(()) => {
                    latest.insert(lba, tag);
                    done += 1;
                }
                Err(Error::NoSpace) => {
                    refused = true;
                    break 'outer;
                }
                Err(e) => panic!("overwrite {done}: {e}"),
            }
        }
        match v.flush() {
            Ok(()) => {}
            Err(Error::NoSpace) => {
                refused = true;
                break;
            }
            Err(e) => panic!("flush after {done} overwrites: {e}"),
        }
    }
    let status = pool.status();
    assert_eq!(status.state, "ONLINE", "{status:?}");
    if refused {
        // Either the live data reached what writes can use, or status says cleaning is
        // stuck.
        let sp = &status.space;
        let why = sp.cleaning.clone().unwrap_or_default();
        assert!(
            why.contains("stuck") || sp.used_bytes + (4 << 20) >= sp.usable_bytes,
            "writes were refused for space, but status does not say why: {sp:?}"
        );
        eprintln!(
            "refused at {} of {} usable: {why}",
            sp.used_bytes, sp.usable_bytes
        );
    }
    // What was acknowledged reads back: the last write of each block, flushed or not.
    let mut buf = vec![0u8; BLOCK as usize];
    for (&lba, &tag) in latest.iter().take(2000) {
        v.read(lba * BLOCK, &mut buf).unwrap();
        assert!(buf == block(tag, lba), "block {lba} lost its last write");
    }
    let base = pool.volume("v@base").unwrap();
    for lba in (0..blocks).step_by(97) {
        base.read(lba * BLOCK, &mut buf).unwrap();
        assert!(buf == block(1, lba), "v@base block {lba} changed");
    }
    drop((v, base));
    // Destroying the snapshots frees their data: status stops saying cleaning is stuck
    // at once, not only when a writer next waits (it once kept saying so after every
    // trim and destroy, with most of the pool free).
    pool.snapshot_destroy("v", "k1").unwrap();
    pool.snapshot_destroy("v", "base").unwrap();
    pool.flush().unwrap();
    let sp = pool.status().space;
    assert_eq!(sp.cleaning, None, "space was freed: {sp:?}");
    pool.close().unwrap();
    (done, refused)
}

#[test]
fn overwrites_under_two_snapshots_end_in_enospc_not_an_endless_wait() {
    run_bounded(false);
}

#[test]
fn overwrites_under_a_snapshot_taken_mid_rotation_end_in_enospc_not_an_endless_wait() {
    run_bounded(true);
}

fn run_bounded(rotate: bool) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(|| overwrite_until_full(&path, rotate));
        let _ = tx.send(r);
    });
    // Not a timing assertion: a bound on a hang. Each refused write waits at most
    // SPACE_WAIT_MAX (30 s); the whole run takes well under a minute here, and forever
    // before the fix.
    match rx.recv_timeout(Duration::from_secs(900)) {
        Ok(Ok((done, refused))) => {
            assert!(
                refused,
                "{done} overwrites under two snapshots all fit a pool that cannot hold them"
            );
            eprintln!("{done} overwrites before the pool was full");
        }
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => panic!("the overwrites did not end: a writer waits for space forever"),
    }
}

/// Issue 36 part 5: after a fill and its release (exabyte thin volumes, a snapshot, two
/// clones, random 4 KiB writes, released by trim), writes were refused at 75–80% of
/// `usable_bytes`, in every round, and status went on saying cleaning was stuck after the
/// release. Later, with holes on, CI still saw 77% in 1 run of 3: once the reserve for
/// rewriting map nodes outgrew the cleaner's budget, records got no share of it and its
/// rounds moved nothing (`Log::clean_budget_for_records`; its unit test pins that cause,
/// which needs a timing this test only meets under load). Holes on (`--fill-holes`) and off (the default)
/// are both run: writes are refused only once the pool is full (103% of usable here).
#[test]
fn writes_fill_the_pool_after_a_release_not_three_quarters_of_it() {
    fill_release_fill(true);
}

/// The same with holes off (the default): the cleaner alone must get there.
#[test]
fn without_holes_writes_still_fill_the_pool_after_a_release() {
    fill_release_fill(false);
}

fn fill_release_fill(fill_holes: bool) {
    let dir = tempfile::tempdir().unwrap();
    Pool::create(
        dir.path(),
        Layout::Single,
        DeviceSpec::Files {
            count: 1,
            size_bytes: 300 << 20,
        },
    )
    .unwrap();
    let pool = Pool::open(
        dir.path(),
        OpenOptions {
            fill_holes,
            ..OpenOptions::default()
        },
    )
    .unwrap();
    let o = VolumeOptions {
        size_bytes: 1 << 60,
        block_size: BLOCK as u32,
        compression: Compression::Off,
        encryption: true,
    };
    for n in ["a", "b"] {
        pool.create_volume(n, o.clone(), Some(&key())).unwrap();
    }
    // A base with a snapshot and two clones.
    {
        let v = pool.volume("a").unwrap();
        for i in 0..(16u64 << 20) / BLOCK {
            v.write(i * BLOCK, &block(3, i), false).unwrap();
        }
        v.flush().unwrap();
    }
    pool.snapshot_create("a", "s").unwrap();
    pool.volume_clone("a", "s", "c1", Some(&key())).unwrap();
    pool.volume_clone("a", "s", "c2", Some(&key())).unwrap();
    let report = |what: &str| {
        let s = pool.status().space;
        eprintln!(
            "{what}: used {} usable {} free {} reserved {} ({:.0}% of usable) cost {:.2} cleaning {:?}",
            s.used_bytes >> 20,
            s.usable_bytes >> 20,
            s.free_bytes >> 20,
            s.reserved_bytes >> 20,
            s.used_bytes as f64 * 100.0 / s.usable_bytes as f64,
            s.clean_cost,
            s.cleaning
        );
    };
    report("start");
    let fill = |name: &str, seed: u64, base: u64| -> u64 {
        let v = pool.volume(name).unwrap();
        let mut n = 0;
        let mut rng = Rng(seed);
        loop {
            let lba = base + rng.below(1 << 16);
            match v.write(lba * BLOCK, &block(seed, lba), false) {
                Ok(()) => n += 1,
                Err(Error::NoSpace) => return n,
                Err(e) => panic!("{e}"),
            }
            if n % 64 == 0 {
                if let Err(Error::NoSpace) = v.flush() {
                    return n;
                }
            }
        }
    };
    for round in 0..2 {
        let n = fill("b", 10 + round, 1 << 30) + fill("c1", 20 + round, 0);
        report(&format!("round {round} full after {n} writes"));
        let s = pool.status().space;
        assert!(
            s.used_bytes * 10 >= s.usable_bytes * 9,
            "round {round}: writes refused at {} of {} usable",
            s.used_bytes,
            s.usable_bytes
        );
        for name in ["b", "c1"] {
            let v = pool.volume(name).unwrap();
            v.trim(0, (1 << 16) * BLOCK).unwrap();
            v.trim((1 << 30) * BLOCK, (1 << 16) * BLOCK).unwrap();
            v.flush().unwrap();
        }
        report(&format!("round {round} released"));
        let s = pool.status().space;
        assert_eq!(s.cleaning, None, "round {round}: released, still 'stuck'");
    }
    pool.close().unwrap();
}

/// Stepped mode (the simulator's): no maintenance thread, so a writer short of space runs
/// the rounds it would wait for itself, on its own thread. Random overwrites of a volume of
/// a third of the pool, each batch made durable by a commit (no intent log), leave dead
/// bytes in every segment: only the cleaner gets them back, and no step is run between
/// the writes, so the writers' own waits must clean. (Before, a stepped writer got
/// `NoSpace` at once whenever free segments ran out, and the simulator never ran the wait
/// loop or its bounds.)
#[test]
fn a_stepped_writer_short_of_space_runs_the_rounds_it_waits_for() {
    let dir = tempfile::tempdir().unwrap();
    Pool::create(
        dir.path(),
        Layout::Single,
        DeviceSpec::Files {
            count: 1,
            size_bytes: 96 << 20,
        },
    )
    .unwrap();
    let pool = Pool::open(
        dir.path(),
        OpenOptions {
            stepped: true,
            intent_log: false,
            ..OpenOptions::default()
        },
    )
    .unwrap();
    let o = VolumeOptions {
        size_bytes: 32 << 20,
        block_size: BLOCK as u32,
        compression: Compression::Off,
        encryption: false,
    };
    pool.create_volume("v", o, None).unwrap();
    let v = pool.volume("v").unwrap();
    let blocks = (32u64 << 20) / BLOCK;
    let mut last = vec![0u64; blocks as usize];
    for lba in 0..blocks {
        v.write(lba * BLOCK, &block(0, lba), false).unwrap();
    }
    v.flush().unwrap();
    let mut rng = Rng(36);
    for batch in 1..=24u64 {
        for _ in 0..blocks / 2 {
            let lba = rng.below(blocks);
            v.write(lba * BLOCK, &block(batch, lba), false)
                .unwrap_or_else(|e| panic!("batch {batch}, block {lba}: {e}"));
            last[lba as usize] = batch;
        }
        v.flush().unwrap();
    }
    let mut buf = vec![0; BLOCK as usize];
    for lba in (0..blocks).step_by(7) {
        v.read(lba * BLOCK, &mut buf).unwrap();
        assert_eq!(buf, block(last[lba as usize], lba), "block {lba}");
    }
    let space = pool.status().space;
    assert!(
        space.clean_written_bytes > 0,
        "the writers' waits never cleaned: {space:?}"
    );
    drop(v);
    pool.close().unwrap();
}
