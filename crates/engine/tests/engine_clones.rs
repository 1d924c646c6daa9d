//! Clones with their own key (issue 21, part 3), on a pool small enough that the cleaner
//! moves the records clones share with their origin:
//! - three clones of one encrypted image, three keys: each opens with its own key only,
//!   reads the image, and its writes stay its own;
//! - the origin snapshot and volume cannot be destroyed while clones need them; a clone's
//!   destroy leaves the others whole;
//! - crypto-erasing the origin leaves every clone readable (clones hold their own copies
//!   of the data keys they inherited);
//! - a key rotation of a clone re-encrypts what it inherited, drops the inherited keys and
//!   detaches it: afterwards none of its blocks is under an inherited generation;
//! - the space counted by a running pool is what an import recounts, at every step.

use std::sync::Arc;

use bulwark_engine::{
    Compression, DeviceSpec, Error, Layout, OpenOptions, Pool, Secret, Volume, VolumeOptions,
};
use zeroize::Zeroizing;

const BLOCK: usize = 4096;

fn key(b: u8) -> Secret {
    Secret::KeyFile(Zeroizing::new([b; 32]))
}

/// Incompressible bytes for block `lba` of "version" `v`.
fn block(v: u64, lba: u64) -> Vec<u8> {
    let mut x = v.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ lba.wrapping_mul(0xD6E8_FEB8_6659_FD93) ^ 1;
    let mut out = vec![0u8; BLOCK];
    for c in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    out
}

struct Model {
    /// Version of each block (0: zeros).
    blocks: Vec<u64>,
}

fn write(v: &Volume, m: &mut Model, lba: u64, version: u64) {
    v.write(lba * BLOCK as u64, &block(version, lba), false)
        .unwrap();
    m.blocks[lba as usize] = version;
}

fn check(v: &Volume, m: &Model, what: &str) {
    let mut buf = vec![0u8; BLOCK * 64];
    for first in (0..m.blocks.len()).step_by(64) {
        let n = (m.blocks.len() - first).min(64);
        v.read((first * BLOCK) as u64, &mut buf[..n * BLOCK])
            .unwrap_or_else(|e| {
                panic!("{what}: read at block {first}: {e}");
            });
        for i in 0..n {
            let lba = (first + i) as u64;
            let want = match m.blocks[lba as usize] {
                0 => vec![0u8; BLOCK],
                ver => block(ver, lba),
            };
            assert!(
                buf[i * BLOCK..(i + 1) * BLOCK] == want[..],
                "{what}: block {lba} is not version {}",
                m.blocks[lba as usize]
            );
        }
    }
}

/// The cleaner alone makes room: writes do not fill holes (decision 0014), so the
/// rounds of scattered overwrites below make it move the records the clones share.
fn cleaner_only() -> OpenOptions {
    OpenOptions {
        fill_holes: false,
        ..OpenOptions::default()
    }
}

fn reopen(dir: &std::path::Path, pool: Arc<Pool>) -> Arc<Pool> {
    let before = pool.status().space.used_bytes;
    pool.close().unwrap();
    drop(pool);
    let pool = Pool::open(dir, cleaner_only()).unwrap();
    let after = pool.status().space.used_bytes;
    assert!(
        after.abs_diff(before) <= 64 << 10,
        "used bytes {before} before a restart, {after} recounted by the import"
    );
    pool
}

#[test]
fn clones_under_their_own_keys_through_cleaning_erase_and_rotation() {
    let dir = tempfile::tempdir().unwrap();
    Pool::create(
        dir.path(),
        Layout::Single,
        DeviceSpec::Files {
            count: 1,
            size_bytes: 44 << 20,
        },
    )
    .unwrap();
    let mut pool = Pool::open(dir.path(), cleaner_only()).unwrap();
    let size = 4 << 20;
    let blocks = size / BLOCK as u64;
    let opts = VolumeOptions {
        size_bytes: size,
        block_size: BLOCK as u32,
        compression: Compression::Lz4,
        encryption: true,
    };
    pool.create_volume("base", opts, Some(&key(1))).unwrap();
    let base = pool.volume("base").unwrap();
    let mut image = Model {
        blocks: vec![0; blocks as usize],
    };
    for lba in 0..blocks {
        if lba % 7 != 3 {
            write(&base, &mut image, lba, 1);
        }
    }
    drop(base);
    pool.snapshot_create("base", "img").unwrap();

    // A clone needs a key of its own, and the origin's key loaded.
    assert!(matches!(
        pool.volume_clone("base", "img", "nokey", None),
        Err(Error::Invalid(_))
    ));
    let names = ["c1", "c2", "c3"];
    for (i, n) in names.iter().enumerate() {
        pool.volume_clone("base", "img", n, Some(&key(10 + i as u8)))
            .unwrap();
    }
    let mut models: Vec<Model> = names
        .iter()
        .map(|_| Model {
            blocks: image.blocks.clone(),
        })
        .collect();
    let mut base_model = Model {
        blocks: image.blocks.clone(),
    };
    // Each clone reads the image and takes its own writes; the base goes on too.
    let mut version = 100;
    for round in 0..24 {
        for (i, n) in names.iter().enumerate() {
            let v = pool.volume(n).unwrap();
            check(&v, &models[i], &format!("{n} round {round}"));
            for lba in (0..blocks).filter(|l| (l + round + i as u64) % 3 == 0) {
                version += 1;
                write(&v, &mut models[i], lba, version);
            }
        }
        let b = pool.volume("base").unwrap();
        for lba in (0..blocks).filter(|l| (l + round) % 4 == 0) {
            version += 1;
            write(&b, &mut base_model, lba, version);
        }
        check(&pool.volume("base@img").unwrap(), &image, "base@img");
        pool.flush().unwrap();
    }
    let clean = pool.status().space.clean_written_bytes;
    assert!(
        clean > 0,
        "the cleaner never ran: the test would prove nothing about moves"
    );

    // Only its own key opens a clone: restart with no key loaded.
    pool = reopen(dir.path(), pool);
    assert!(matches!(
        pool.load_key("c1", &key(1)),
        Err(Error::WrongKey(_))
    ));
    pool.load_key("c1", &key(10)).unwrap();
    check(&pool.volume("c1").unwrap(), &models[0], "c1 alone");
    assert!(matches!(pool.volume("base"), Err(Error::Locked(_))));
    for (i, n) in names.iter().enumerate().skip(1) {
        pool.load_key(n, &key(10 + i as u8)).unwrap();
    }
    pool.load_key("base", &key(1)).unwrap();

    // The origin snapshot stays while clones need it.
    let r = pool.snapshot_destroy("base", "img");
    assert!(matches!(r, Err(Error::Busy(_))), "{r:?}");

    // Crypto-erase, then destroy, the origin: the clones read on; its snapshot stays,
    // hidden, for them, and its name stays taken.
    pool.key_erase("base").unwrap();
    for (i, n) in names.iter().enumerate() {
        check(
            &pool.volume(n).unwrap(),
            &models[i],
            &format!("{n} after the base's erase"),
        );
    }
    assert!(matches!(pool.destroy_volume("base"), Err(Error::Busy(_))));
    let kept = pool.destroy_volume_recursive("base", true).unwrap();
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(kept[0].snapshot, "base@img");
    assert_eq!(kept[0].clones, ["c1", "c2", "c3"]);
    assert!(pool.volumes().iter().all(|v| v.name != "base"));
    assert!(matches!(pool.volume("base@img"), Err(Error::NotFound(_))));
    assert!(matches!(
        pool.create_volume(
            "base",
            VolumeOptions {
                encryption: false,
                ..opts_of(size)
            },
            None
        ),
        Err(Error::Exists(_))
    ));
    // More writes to the clones, so the cleaner moves what they share with the kept
    // snapshot; then a scrub.
    let clean = pool.status().space.clean_written_bytes;
    for round in 0..20u64 {
        for (i, n) in names.iter().enumerate() {
            let v = pool.volume(n).unwrap();
            // Scattered, so old segments die partly and the cleaner has to move records.
            let pick = |l: u64| (l.wrapping_mul(0x9E37_79B9) ^ (round * 31 + i as u64)) % 7 < 2;
            for lba in (0..blocks).filter(|&l| pick(l)) {
                version += 1;
                write(&v, &mut models[i], lba, version);
            }
        }
        pool.flush().unwrap();
    }
    assert!(
        pool.status().space.clean_written_bytes > clean,
        "no cleaning after the destroy"
    );
    pool.scrub_start().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while pool.scrub_status().state != "finished" {
        assert!(std::time::Instant::now() < deadline, "scrub did not finish");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let st = pool.status();
    assert!(
        st.errors.is_empty() && st.unrecoverable_blocks == 0,
        "{:?}",
        st.errors
    );
    for (i, n) in names.iter().enumerate() {
        check(
            &pool.volume(n).unwrap(),
            &models[i],
            &format!("{n} after cleaning and scrub"),
        );
    }

    // Destroying one clone leaves the others whole.
    pool.destroy_volume("c2").unwrap();
    pool = reopen(dir.path(), pool);
    for (i, n) in names.iter().enumerate() {
        if *n != "c2" {
            pool.load_key(n, &key(10 + i as u8)).unwrap();
            check(
                &pool.volume(n).unwrap(),
                &models[i],
                &format!("{n} after c2 went"),
            );
        }
    }

    // A rotation of c3 re-encrypts what it inherited and detaches it.
    let generation = pool.key_rotate("c3").unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let st = pool.volumes().into_iter().find(|v| v.name == "c3").unwrap();
        if st.rotation.is_none() && st.origin.is_none() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "rotation of c3 did not finish: {st:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let c3 = pool.volume("c3").unwrap();
    for lba in 0..blocks {
        let p = c3.debug_block_ptr(lba).unwrap();
        assert!(
            p.is_hole() || p.key_gen == generation,
            "c3 block {lba} is still under generation {}",
            p.key_gen
        );
    }
    check(&c3, &models[2], "c3 after its rotation");
    drop(c3);

    // With c1 gone too, nothing needs the destroyed origin: it goes; c3 does not notice.
    pool.destroy_volume("c1").unwrap();
    pool = reopen(dir.path(), pool);
    pool.load_key("c3", &key(12)).unwrap();
    check(
        &pool.volume("c3").unwrap(),
        &models[2],
        "c3 after its origin went",
    );
    let listed: Vec<String> = pool.volumes().into_iter().map(|v| v.name).collect();
    assert_eq!(listed, ["c3"]);
    pool.create_volume("base", opts_of(size), Some(&key(1)))
        .unwrap();
    pool.close().unwrap();
}

fn opts_of(size: u64) -> VolumeOptions {
    VolumeOptions {
        size_bytes: size,
        block_size: BLOCK as u32,
        compression: Compression::Lz4,
        encryption: true,
    }
}
