//! Scrub scenarios: repair from the good copy; the bad-RAM case writes nothing.

use std::fs::OpenOptions as FsOpen;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bulwark_engine::device::fault::{Fault, FaultMode};
use bulwark_engine::{Compression, DeviceSpec, Layout, OpenOptions, Pool, VolumeOptions};

const BLOCKS: u64 = 512;

fn open(dir: &Path) -> std::sync::Arc<Pool> {
    Pool::open(
        dir,
        OpenOptions {
            allow_fault_injection: true,
            ..OpenOptions::default()
        },
    )
    .unwrap()
}

/// As `open`, with writes that never fill holes (decision 0014): the cleaner alone makes
/// room, so overwrites make it move records.
fn open_cleaner_only(dir: &Path) -> std::sync::Arc<Pool> {
    Pool::open(
        dir,
        OpenOptions {
            allow_fault_injection: true,
            fill_holes: false,
            ..OpenOptions::default()
        },
    )
    .unwrap()
}

fn scrub(pool: &Pool) -> bulwark_engine::pool::format::health::ScrubStatus {
    pool.scrub_start().unwrap();
    for _ in 0..600 {
        let s = pool.scrub_status();
        if s.state == "finished" {
            return s;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("scrub did not finish: {:?}", pool.scrub_status());
}

fn block(i: u64) -> Vec<u8> {
    (0..4096u64)
        .map(|j| ((i * 31 + j * 7) % 251) as u8)
        .collect()
}

fn key() -> bulwark_engine::Secret {
    bulwark_engine::Secret::KeyFile(zeroize::Zeroizing::new([3u8; 32]))
}

fn setup(dir: &Path) -> Vec<(u64, u32)> {
    setup_with(dir, false)
}

/// 512 blocks on a mirror; `encrypted` volumes' data blocks carry the salted
/// xxh3-64 checksum (their AEAD tag authenticates them), others blake3.
fn setup_with(dir: &Path, encrypted: bool) -> Vec<(u64, u32)> {
    Pool::create(
        dir,
        Layout::Mirror(2),
        DeviceSpec::Files {
            count: 2,
            size_bytes: 64 << 20,
        },
    )
    .unwrap();
    let pool = open(dir);
    let o = VolumeOptions {
        size_bytes: BLOCKS * 4096,
        block_size: 4096,
        compression: Compression::Off,
        encryption: encrypted,
    };
    pool.create_volume("v", o, encrypted.then(key).as_ref())
        .unwrap();
    let v = pool.volume("v").unwrap();
    for i in 0..BLOCKS {
        v.write(i * 4096, &block(i), false).unwrap();
    }
    let places = (0..BLOCKS)
        .map(|i| {
            let p = v.debug_block_ptr(i).unwrap();
            assert_eq!(&p.checksum[24..] == b"xxh3+slt", encrypted);
            (p.addr[0], p.len)
        })
        .collect();
    drop(v);
    pool.close().unwrap();
    places
}

/// Device offset of pool address `a` in a mirror (same on every member).
fn dev_off(a: u64) -> u64 {
    (1 << 20) + a
}

fn devs(dir: &Path) -> Vec<PathBuf> {
    vec![dir.join("dev0.img"), dir.join("dev1.img")]
}

fn read_all(pool: &Pool) -> Vec<Result<Vec<u8>, String>> {
    let v = pool.volume("v").unwrap();
    (0..BLOCKS)
        .map(|i| {
            let mut b = vec![0u8; 4096];
            v.read(i * 4096, &mut b)
                .map(|_| b)
                .map_err(|e| e.to_string())
        })
        .collect()
}

#[test]
fn scrub_repairs_one_bad_copy_and_a_second_scrub_finds_nothing() {
    repairs_one_bad_copy(false);
}

#[test]
fn scrub_repairs_encrypted_blocks_by_their_checksum_without_the_key() {
    repairs_one_bad_copy(true);
}

fn repairs_one_bad_copy(encrypted: bool) {
    let t = tempfile::tempdir().unwrap();
    let places = setup_with(t.path(), encrypted);
    let f = FsOpen::new().write(true).open(&devs(t.path())[1]).unwrap();
    for (i, (a, _)) in places.iter().enumerate().step_by(7) {
        f.write_all_at(&[0xEE; 8], dev_off(*a) + (i as u64 % 100))
            .unwrap();
    }
    drop(f);
    let pool = open(t.path());
    let s = scrub(&pool);
    let expected = places.len().div_ceil(7) as u64;
    assert_eq!(s.repaired, expected, "{s:?}");
    assert_eq!(s.unrecoverable, 0);
    assert!(pool.status().devices[1].cksum_errors >= expected);
    let s2 = scrub(&pool);
    assert_eq!(
        (s2.repaired, s2.unrecoverable),
        (0, 0),
        "second scrub: {s2:?}"
    );
    if encrypted {
        pool.load_key("v", &key()).unwrap();
    }
    for (i, r) in read_all(&pool).into_iter().enumerate() {
        assert_eq!(r.unwrap(), block(i as u64));
    }
}

#[test]
fn bad_ram_scrub_writes_no_data_block_and_later_scrub_clears() {
    let t = tempfile::tempdir().unwrap();
    let places = setup(t.path());
    let snapshot = |dir: &Path| -> Vec<Vec<u8>> {
        devs(dir)
            .iter()
            .flat_map(|d| {
                let f = std::fs::File::open(d).unwrap();
                places
                    .iter()
                    .map(|(a, len)| {
                        let mut b = vec![0u8; *len as usize];
                        f.read_exact_at(&mut b, dev_off(*a)).unwrap();
                        b
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let before = snapshot(t.path());
    {
        let pool = open(t.path());
        for d in devs(t.path()) {
            pool.set_faults(
                &d,
                vec![Fault {
                    mode: FaultMode::ReadFlip,
                    probability: 1.0,
                    seed: 5,
                    include_labels: false,
                }],
            )
            .unwrap();
        }
        let s = scrub(&pool);
        assert!(s.unrecoverable >= BLOCKS, "every block should fail: {s:?}");
        assert_eq!(s.repaired, 0);
        let st = pool.status();
        assert!(!st.errors.is_empty() && st.errors.iter().all(|e| e.volume == "v"));
        pool.close().unwrap();
    }
    assert!(
        snapshot(t.path()) == before,
        "a data block was written during the bad-RAM scrub"
    );
    // Healthy again: the errors are cleared by the next scrub, and the data is intact.
    let pool = open(t.path());
    assert!(
        !pool.status().errors.is_empty(),
        "errors must survive a restart"
    );
    let s = scrub(&pool);
    assert_eq!((s.repaired, s.unrecoverable), (0, 0));
    assert!(
        pool.status().errors.is_empty(),
        "{:?}",
        pool.status().errors
    );
    for (i, r) in read_all(&pool).into_iter().enumerate() {
        assert_eq!(r.unwrap(), block(i as u64));
    }
}

/// The pool at `dir`, with the volume's key loaded when it is `encrypted`.
fn open_unlocked(dir: &Path, encrypted: bool) -> std::sync::Arc<Pool> {
    let pool = open(dir);
    if encrypted {
        pool.load_key("v", &key()).unwrap();
    }
    pool
}

#[test]
fn all_copies_bad_gives_an_error_never_wrong_bytes() {
    all_copies_bad(false);
}

/// Encrypted blocks are read apart (ciphertext into the block, tag aside) and
/// verified by their tag: a bad body or a bad tag on every copy is still an error.
#[test]
fn all_copies_bad_gives_an_error_never_wrong_bytes_encrypted() {
    all_copies_bad(true);
}

fn all_copies_bad(encrypted: bool) {
    let t = tempfile::tempdir().unwrap();
    let places = setup_with(t.path(), encrypted);
    for d in devs(t.path()) {
        let f = FsOpen::new().write(true).open(d).unwrap();
        f.write_all_at(&[0x55; 16], dev_off(places[10].0) + 40)
            .unwrap();
    }
    let pool = open_unlocked(t.path(), encrypted);
    let reads = read_all(&pool);
    for (i, r) in reads.into_iter().enumerate() {
        match (i, r) {
            (10, Err(e)) => assert!(e.contains("bytes 40960..45056"), "{e}"),
            (10, Ok(_)) => panic!("block 10 has no good copy but was returned"),
            (i, r) => assert_eq!(r.unwrap(), block(i as u64)),
        }
    }
    let st = pool.status();
    assert!(
        st.errors
            .iter()
            .any(|e| e.volume == "v" && e.offset == 40960 && e.length == 4096),
        "{:?}",
        st.errors
    );
}

#[test]
fn batched_reads_verify_every_record_inside_a_run() {
    batched_reads_verify(false);
}

/// The same through the path that reads encrypted runs apart and opens each block in
/// place: a bad body (block 100) and a bad tag (block 150) on the copy reads start with
/// are each found by the tag, read from the good copy and repaired.
#[test]
fn batched_reads_verify_every_record_inside_a_run_encrypted() {
    batched_reads_verify(true);
}

fn batched_reads_verify(encrypted: bool) {
    let t = tempfile::tempdir().unwrap();
    let places = setup_with(t.path(), encrypted);
    // Blocks were written one by one, so consecutive blocks lie end to end: a large read
    // takes one device read for the run. Corrupt blocks 100 and 150 on the copy reads
    // start with: 100 in its body, 150 in its last bytes (the tag, when encrypted).
    for (b, at) in [(100, 7), (150, places[150].1 as u64 - 5)] {
        let seg_first = ((places[b].0 >> 20) as usize) % 2;
        let f = FsOpen::new()
            .write(true)
            .open(&devs(t.path())[seg_first])
            .unwrap();
        f.write_all_at(&[0xA5; 3], dev_off(places[b].0) + at)
            .unwrap();
    }
    let pool = open_unlocked(t.path(), encrypted);
    let v = pool.volume("v").unwrap();
    let mut big = vec![0u8; (BLOCKS * 4096) as usize];
    v.read(0, &mut big).unwrap();
    for i in 0..BLOCKS as usize {
        assert!(
            big[i * 4096..(i + 1) * 4096] == block(i as u64)[..],
            "block {i}"
        );
    }
    let st = pool.status();
    assert_eq!(st.repaired_blocks, 2, "{st:?}");
    assert_eq!(st.devices.iter().map(|d| d.cksum_errors).sum::<u64>(), 2);
    // Repaired: read again, nothing more to repair.
    v.read(0, &mut big).unwrap();
    assert_eq!(pool.status().repaired_blocks, 2);
    // Both copies bad: the large read fails; it never returns the bad bytes.
    for d in devs(t.path()) {
        let f = FsOpen::new().write(true).open(d).unwrap();
        f.write_all_at(&[0x5A; 32], dev_off(places[200].0) + 9)
            .unwrap();
    }
    let err = v.read(0, &mut big).unwrap_err().to_string();
    assert!(err.contains("819200..823296"), "{err}");
}

/// A run whose read fails on every copy is read again block by block (each block tries
/// every copy, and the first block's failure ends the read), and each failed device
/// read is counted once: 2 for the run, 2 for the first block. Encrypted runs (read
/// apart) and plain ones count alike.
#[test]
fn failed_run_reads_are_counted_once_per_device_read() {
    for encrypted in [false, true] {
        let t = tempfile::tempdir().unwrap();
        setup_with(t.path(), encrypted);
        let pool = open_unlocked(t.path(), encrypted);
        for d in devs(t.path()) {
            let fault = Fault {
                mode: FaultMode::ReadError,
                probability: 1.0,
                seed: 1,
                include_labels: false,
            };
            pool.set_faults(&d, vec![fault]).unwrap();
        }
        let v = pool.volume("v").unwrap();
        let mut buf = vec![0u8; 16 * 4096];
        let err = v.read(0, &mut buf).unwrap_err().to_string();
        assert!(err.contains("bytes 0..4096: no copy verified"), "{err}");
        assert!(
            buf.iter().all(|&b| b == 0),
            "bytes returned from a failed read"
        );
        let errors: u64 = pool.status().devices.iter().map(|d| d.read_errors).sum();
        assert_eq!(errors, 2 + 2, "encrypted: {encrypted}");
    }
}

/// The cleaner reads records that lie close together in one device read and takes each
/// out of it only if it matches its checksum; one that does not is read alone (from the
/// good copy) before it moves. Cold blocks are written in 64 KiB runs among hot ones;
/// the copy reads start with is damaged in every third cold block; hot blocks are then
/// overwritten at random until the cleaner has moved damaged cold blocks. Moved blocks
/// were written to both copies from what was read: a damaged copy taken from the span
/// would leave both copies bad, and the block unreadable.
#[test]
fn the_cleaner_moves_a_bad_copy_never_and_reads_it_from_the_good_one() {
    const COLD: u64 = 256;
    const TOTAL: u64 = 1024;
    let t = tempfile::tempdir().unwrap();
    Pool::create(
        t.path(),
        Layout::Mirror(2),
        DeviceSpec::Files {
            count: 2,
            size_bytes: 24 << 20,
        },
    )
    .unwrap();
    let pool = open(t.path());
    let o = VolumeOptions {
        size_bytes: TOTAL * 4096,
        block_size: 4096,
        compression: Compression::Off,
        encryption: false,
    };
    pool.create_volume("v", o, None).unwrap();
    let v = pool.volume("v").unwrap();
    let blocks = |first: u64, n: u64, salt: u64| -> Vec<u8> {
        (first..first + n).flat_map(|i| block(i + salt)).collect()
    };
    // Cold chunk c (16 blocks), then three hot chunks, in turn: every segment holds both.
    for c in 0..COLD / 16 {
        v.write(c * 16 * 4096, &blocks(c * 16, 16, 0), false)
            .unwrap();
        let hot = COLD + c * 48;
        v.write(hot * 4096, &blocks(hot, 48, 0), false).unwrap();
    }
    v.flush().unwrap();
    let before: Vec<u64> = (0..COLD)
        .map(|i| v.debug_block_ptr(i).unwrap().addr[0])
        .collect();
    drop(v);
    pool.close().unwrap();
    drop(pool);
    // Damage the copy reads start with (member = segment % 2) of every third cold block.
    let damaged: Vec<u64> = (0..COLD).step_by(3).collect();
    for &b in &damaged {
        let a = before[b as usize];
        let f = FsOpen::new()
            .write(true)
            .open(&devs(t.path())[((a >> 20) % 2) as usize])
            .unwrap();
        f.write_all_at(&[0xA5; 5], dev_off(a) + 100).unwrap();
    }
    let pool = open_cleaner_only(t.path());
    let v = pool.volume("v").unwrap();
    let mut r = 0x9E37_79B9_7F4A_7C15u64;
    let moved = |v: &bulwark_engine::Volume| {
        damaged
            .iter()
            .filter(|&&b| v.debug_block_ptr(b).unwrap().addr[0] != before[b as usize])
            .count()
    };
    let mut round = 0;
    while moved(&v) < damaged.len() / 2 {
        round += 1;
        assert!(
            round <= 400,
            "the cleaner moved {} of {} damaged blocks",
            moved(&v),
            damaged.len()
        );
        for _ in 0..256 {
            r ^= r << 13;
            r ^= r >> 7;
            r ^= r << 17;
            let b = COLD + r % (TOTAL - COLD);
            v.write(b * 4096, &block(b + round), false).unwrap();
        }
        v.flush().unwrap();
    }
    assert!(pool.status().space.clean_written_bytes > 0);
    for i in 0..COLD {
        let mut b = vec![0u8; 4096];
        v.read(i * 4096, &mut b)
            .unwrap_or_else(|e| panic!("cold block {i}: {e}"));
        assert!(b == block(i), "cold block {i}");
    }
    // Every damaged copy was either moved past (read from the good one) or still lies
    // where it was: each counted as a checksum error, none unrecoverable.
    let st = pool.status();
    assert_eq!(st.unrecoverable_blocks, 0, "{st:?}");
    assert!(
        st.devices.iter().map(|d| d.cksum_errors).sum::<u64>() >= moved(&v) as u64,
        "{st:?}"
    );
}
