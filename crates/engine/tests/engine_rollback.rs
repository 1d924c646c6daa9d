//! Whole-pool rollback (issue 20): device images restored from an older copy carry valid
//! superblocks of an older generation, which every checksum accepts. The host's anchor
//! (`DIR/pool.anchor`) knows which generation it committed: the pool refuses the old
//! devices, naming both generations, until the administrator accepts the rollback; a
//! generation the host never wrote is refused too; a crash between the anchor and the
//! superblock write imports.

use std::path::{Path, PathBuf};

use bulwark_engine::keys::pool_key::PoolKey;
use bulwark_engine::pool::format::superblock::{Check, Superblock};
use bulwark_engine::{Compression, DeviceSpec, Error, Layout, OpenOptions, Pool, VolumeOptions};

fn opts() -> VolumeOptions {
    VolumeOptions {
        size_bytes: 1 << 20,
        block_size: 4096,
        compression: Compression::Off,
        encryption: false,
    }
}

fn devices(dir: &Path) -> Vec<PathBuf> {
    let mut d: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "img"))
        .collect();
    d.sort();
    d
}

fn save(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    devices(dir)
        .into_iter()
        .map(|p| {
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect()
}

fn restore(saved: &[(PathBuf, Vec<u8>)]) {
    for (p, b) in saved {
        std::fs::write(p, b).unwrap();
    }
}

/// A new pool of `count` device files with an unencrypted volume "v", open.
fn new_pool(dir: &Path, layout: Layout, count: usize) -> std::sync::Arc<Pool> {
    let spec = DeviceSpec::Files {
        count,
        size_bytes: 64 << 20,
    };
    Pool::create(dir, layout, spec).unwrap();
    let pool = Pool::open(dir, OpenOptions::default()).unwrap();
    pool.create_volume("v", opts(), None).unwrap();
    pool
}

fn read0(pool: &Pool, vol: &str) -> u8 {
    let mut b = [0u8; 4096];
    pool.volume(vol).unwrap().read(0, &mut b).unwrap();
    b[0]
}

fn write0(pool: &Pool, vol: &str, byte: u8) {
    pool.volume(vol)
        .unwrap()
        .write(0, &[byte; 4096], false)
        .unwrap();
    pool.flush().unwrap();
}

#[test]
fn devices_restored_from_an_older_copy_are_refused_until_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let pool = new_pool(dir.path(), Layout::Mirror(2), 2);
    write0(&pool, "v", 0xa);
    pool.close().unwrap();
    drop(pool);
    let old = save(dir.path());

    let pool = Pool::open(dir.path(), OpenOptions::default()).unwrap();
    write0(&pool, "v", 0xb);
    pool.create_volume("since", opts(), None).unwrap();
    pool.close().unwrap();
    drop(pool);

    restore(&old);
    let e = match Pool::open(dir.path(), OpenOptions::default()) {
        Err(Error::Corrupt(m)) => m,
        Err(e) => panic!("refused with the wrong error: {e}"),
        Ok(_) => panic!("a rolled-back pool was imported"),
    };
    assert!(
        e.contains("rolled back") && e.contains("--accept-rollback"),
        "{e}"
    );

    // The administrator restored them on purpose: taken as they are, and anchored anew.
    let accept = OpenOptions {
        accept_rollback: true,
        ..OpenOptions::default()
    };
    let pool = Pool::open(dir.path(), accept).unwrap();
    assert_eq!(read0(&pool, "v"), 0xa);
    assert!(pool.volume("since").is_err());
    pool.close().unwrap();
    drop(pool);
    let pool = Pool::open(dir.path(), OpenOptions::default()).unwrap();
    assert_eq!(read0(&pool, "v"), 0xa);
    pool.close().unwrap();
}

/// A crash after the anchor announced a generation and before any superblock of it was
/// written: the devices are at the committed generation, which imports; and devices that
/// hold the announced one import too (the normal restart).
#[test]
fn devices_at_the_committed_or_the_announced_generation_import() {
    let dir = tempfile::tempdir().unwrap();
    let pool = new_pool(dir.path(), Layout::Single, 1);
    write0(&pool, "v", 1);
    let before = save(dir.path());
    // One more commit. Its anchor slots: first the announce {committed: the saved
    // generation, next: this one}, then, once its superblocks are written, the settled one
    // {committed: this one}. A crash between the two leaves only the announce: the newer
    // slot (the higher sequence) is wiped to stand for it.
    write0(&pool, "v", 2);
    let mut anchor_after = std::fs::read(dir.path().join("pool.anchor")).unwrap();
    let seq = |slot: &[u8]| u64::from_le_bytes(slot[8..16].try_into().unwrap());
    let newer = if seq(&anchor_after[..512]) > seq(&anchor_after[512..1024]) {
        0
    } else {
        512
    };
    anchor_after[newer..newer + 512].fill(0);
    // Simulate a crash before the superblocks of that commit landed: drop without close,
    // then put the devices back as they were before it (its records are unreferenced).
    drop(pool);
    restore(&before);
    std::fs::write(dir.path().join("pool.anchor"), &anchor_after).unwrap();
    let pool = Pool::open(dir.path(), OpenOptions::default()).unwrap();
    assert_eq!(read0(&pool, "v"), 1, "the committed generation's data");
    pool.close().unwrap();
}

/// A superblock of a generation the host never wrote (forged one newer, with every
/// checksum right and even the pool key's MAC: a host that holds the key, or another copy
/// of the pool) is refused: the devices were changed by someone else.
#[test]
fn a_generation_the_host_never_wrote_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pool = new_pool(dir.path(), Layout::Single, 1);
    pool.close().unwrap();
    drop(pool);
    let dev = &devices(dir.path())[0];
    let bytes = std::fs::read(dev).unwrap();
    let key = PoolKey::load(&dir.path().join("pool.key")).unwrap();
    let sb = [0usize, 256 << 10]
        .iter()
        .filter_map(|&o| {
            Superblock::decode(&bytes[o..o + 4096], Check::Unkeyed)
                .ok()
                .flatten()
        })
        .max_by_key(|sb| sb.generation)
        .unwrap();
    let mut forged = sb.clone();
    forged.generation += 5;
    let back = bulwark_engine::constants::DEVICE_RESERVED_FRONT
        + sb.segments_per_device * bulwark_engine::constants::SEGMENT_BYTES;
    let mut b = bytes;
    for off in Superblock::slot_offsets(forged.generation, back) {
        b[off as usize..off as usize + 4096]
            .copy_from_slice(&forged.encode(Some(&key.superblock_key(&sb.pool_id))));
    }
    std::fs::write(dev, &b).unwrap();
    let e = match Pool::open(dir.path(), OpenOptions::default()) {
        Err(Error::Corrupt(m)) => m,
        Err(e) => panic!("refused with the wrong error: {e}"),
        Ok(_) => panic!("a forged generation was imported"),
    };
    assert!(e.contains("never wrote"), "{e}");
}

/// After a clean close the anchor names only the last generation: devices put back even
/// one commit earlier (the flush before the close) are refused. After a crash that one
/// commit is the window (decision 0011, "Freshness").
#[test]
fn a_clean_close_leaves_no_generation_to_roll_back_to() {
    let dir = tempfile::tempdir().unwrap();
    let pool = new_pool(dir.path(), Layout::Single, 1);
    write0(&pool, "v", 1);
    // The close commits once more: the devices saved here are one generation behind it.
    let before_close = save(dir.path());
    pool.close().unwrap();
    drop(pool);
    restore(&before_close);
    assert!(matches!(
        Pool::open(dir.path(), OpenOptions::default()),
        Err(Error::Corrupt(_))
    ));
}

/// Devices put back one generation after a crash lose nothing silently: the pool stopped
/// cleanly (devices at g, copied), started again (its import's commit writes g+1), a write
/// was flushed through the intent log of g+1, and the daemon died. Put back to the copy at
/// g, the devices are refused as rolled back: the anchor was settled on g+1 before the
/// flush was acknowledged. (It used to still announce g as committed until the next commit,
/// so the copy was taken and the flushed write was gone.)
#[test]
fn devices_put_back_one_generation_after_a_crash_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pool = new_pool(dir.path(), Layout::Single, 1);
    write0(&pool, "v", 0xa);
    pool.close().unwrap();
    drop(pool);
    let at_g = save(dir.path());
    let pool = Pool::open(dir.path(), OpenOptions::default()).unwrap();
    let v = pool.volume("v").unwrap();
    v.write(0, &[0xb; 4096], false).unwrap();
    v.flush().unwrap();
    drop(v);
    drop(pool); // a crash: no close
    restore(&at_g);
    match Pool::open(dir.path(), OpenOptions::default()) {
        Err(Error::Corrupt(m)) => assert!(m.contains("rolled back"), "{m}"),
        Err(e) => panic!("refused with the wrong error: {e}"),
        Ok(p) => panic!(
            "devices one generation old were taken: block 0 reads {:#x}, the flushed write was 0xb",
            read0(&p, "v")
        ),
    }
}
