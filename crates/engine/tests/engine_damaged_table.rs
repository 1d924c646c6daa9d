//! A volume table that authenticates but holds records no bulwark writes: the pool
//! refuses them with a `Corrupt` error that names the volume or slot, and never panics,
//! spins or aborts (issue 18, "bytes from disk are input").
//!
//! The table is sealed under a key that lives in the superblock, so a test that holds
//! the device can rewrite it: read the newest superblock of a one-device `single` pool,
//! open its table, edit it, seal it again into an unused segment (above the high-water
//! mark) and write a superblock one generation newer that points at it.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use bulwark_engine::checksum::checksum;
use bulwark_engine::constants::{DEVICE_RESERVED_FRONT, SEGMENT_BYTES};
use bulwark_engine::keys::pool_key::PoolKey;
use bulwark_engine::keys::SlotKind;
use bulwark_engine::map::{Blkptr, ADDR_NONE};
use bulwark_engine::pool::format::superblock::{Check, Superblock};
use bulwark_engine::pool::format::table::TableRecord;
use bulwark_engine::{
    Compression, DeviceSpec, Error, Layout, OpenOptions, Pool, Secret, VolumeOptions,
};
use zeroize::Zeroizing;

fn kf(b: u8) -> Secret {
    Secret::KeyFile(Zeroizing::new([b; 32]))
}

fn pp(s: &str) -> Secret {
    Secret::Passphrase(Zeroizing::new(s.as_bytes().to_vec()))
}

/// A one-device `single` pool with an encrypted volume "v" (key `kf(1)`) and a plain
/// volume "p", each with a block of data; closed. Returns the device file.
fn new_pool(dir: &Path) -> PathBuf {
    Pool::create(
        dir,
        Layout::Single,
        DeviceSpec::Files {
            count: 1,
            size_bytes: 64 << 20,
        },
    )
    .unwrap();
    let pool = Pool::open(dir, OpenOptions::default()).unwrap();
    for (name, key) in [("v", Some(kf(1))), ("p", None)] {
        let o = VolumeOptions {
            size_bytes: 4 << 20,
            block_size: 4096,
            compression: Compression::Lz4,
            encryption: key.is_some(),
        };
        pool.create_volume(name, o, key.as_ref()).unwrap();
        pool.volume(name)
            .unwrap()
            .write(0, &[7u8; 4096], true)
            .unwrap();
    }
    pool.close().unwrap();
    let dev = dir.join("dev0.img");
    assert!(dev.exists(), "device file {}", dev.display());
    dev
}

fn read_at(dev: &Path, off: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut b = vec![0u8; len];
    std::fs::File::open(dev)
        .unwrap()
        .read_exact_at(&mut b, off)
        .unwrap();
    b
}

fn write_at(dev: &Path, off: u64, b: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(dev).unwrap();
    f.write_all_at(b, off).unwrap();
    f.sync_all().unwrap();
}

/// Rewrites the pool's volume table through `edit` (see the file's comment).
fn edit_table(dev: &Path, edit: impl FnOnce(&mut TableRecord)) {
    let front = [0u64, 256 << 10];
    let sb = front
        .iter()
        .filter_map(|&o| {
            Superblock::decode(&read_at(dev, o, 4096), Check::Unkeyed)
                .ok()
                .flatten()
        })
        .max_by_key(|sb| sb.generation)
        .expect("a superblock");
    let back_region = DEVICE_RESERVED_FRONT + sb.segments_per_device * SEGMENT_BYTES;
    let key = PoolKey::load(&dev.parent().unwrap().join("pool.key")).unwrap();
    let dev_off = |addr: u64| DEVICE_RESERVED_FRONT + addr;
    let root = sb.root;
    let stored = read_at(dev, dev_off(root.addr[0]), root.len as usize);
    assert_eq!(checksum(&stored), root.checksum);
    let sealed = if root.flags & bulwark_engine::codec::FLAG_LZ4 != 0 {
        lz4_flex::block::decompress(&stored, 16 << 20).unwrap()
    } else {
        stored
    };
    let mut table = TableRecord::open(&sealed, &sb.table_key).unwrap();
    edit(&mut table);
    // Stored uncompressed (flags 0), one copy, at the start of a segment never written.
    let stored = table.seal(&sb.table_key);
    let addr = sb.high_water as u64 * SEGMENT_BYTES;
    write_at(dev, dev_off(addr), &stored);
    let mut next = sb.clone();
    next.generation += 1;
    next.high_water += 1;
    next.root = Blkptr {
        addr: [addr, ADDR_NONE],
        nonce: 0,
        len: stored.len() as u32,
        flags: 0,
        key_gen: 0,
        checksum: checksum(&stored),
    };
    for off in Superblock::slot_offsets(next.generation, back_region) {
        write_at(
            dev,
            off,
            &next.encode(Some(&key.superblock_key(&sb.pool_id))),
        );
    }
    // The host's anchor would refuse this generation before the table is read (it never
    // wrote it: `engine_rollback.rs`); this file is about the table's decoders, so the
    // forger here holds the host directory too (the pool key that authenticates the
    // labels, decision 0011) and removes the anchor.
    std::fs::remove_file(dev.parent().unwrap().join("pool.anchor")).unwrap();
}

/// Runs `f` on another thread; fails the test if it panics or takes over a minute (a
/// hang before the fix).
fn within_a_minute<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{what}: still running after 60 s"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{what}: panicked"),
    }
}

fn open_err(dir: &Path, what: &str) -> String {
    let dir = dir.to_path_buf();
    let r = within_a_minute(what, move || {
        Pool::open(&dir, OpenOptions::default()).map(|_| ())
    });
    match r {
        Err(e @ Error::Corrupt(_)) => e.to_string(),
        Err(e) => panic!("{what}: expected a Corrupt error, got {e:?}"),
        Ok(()) => panic!("{what}: the pool imported"),
    }
}

/// Block size 0 (divided by at import: a panic), size 0 (a tree depth never found: import
/// spun forever), and every other geometry no `volume create` accepts are refused at
/// import with the volume's name and the bad value.
#[test]
fn a_volume_record_with_an_impossible_geometry_is_refused_at_import() {
    let cases: [(&str, u64, u32, &str); 6] = [
        ("block size 0", 4 << 20, 0, "block size 0"),
        ("size 0", 0, 4096, "size 0"),
        (
            "block size not a power of two",
            4 << 20,
            12288,
            "block size 12288",
        ),
        (
            "block size too large",
            4 << 20,
            1 << 20,
            "block size 1048576",
        ),
        (
            "size not a multiple",
            (4 << 20) + 512,
            4096,
            "not a multiple",
        ),
        ("size too large", 1 << 62, 4096, "volume size"),
    ];
    for (what, size, bs, says) in cases {
        let t = tempfile::tempdir().unwrap();
        let dev = new_pool(t.path());
        edit_table(&dev, |table| {
            let v = table.volumes.iter_mut().find(|v| v.name == "p").unwrap();
            v.size_bytes = size;
            v.block_size = bs;
        });
        let e = open_err(t.path(), what);
        assert!(
            e.contains("volume 'p'") && e.contains(says),
            "{what}: the error should name the volume and say {says:?}: {e}"
        );
    }
}

/// The crafting itself is sound: an edit that changes nothing imports and reads back.
#[test]
fn an_unchanged_rewritten_table_imports() {
    let t = tempfile::tempdir().unwrap();
    let dev = new_pool(t.path());
    edit_table(&dev, |_| {});
    let pool = Pool::open(t.path(), OpenOptions::default()).unwrap();
    let mut b = vec![0u8; 4096];
    pool.volume("p").unwrap().read(0, &mut b).unwrap();
    assert_eq!(b, [7u8; 4096]);
}

/// Argon2 costs read from a key slot are bounded before use: a memory cost of 4 TiB used
/// to abort the process (allocation failure) on `key load`, a time cost of 2^32 passes to
/// hang it. Such a slot is refused with a message naming it and the limit, the other
/// slots still open, and the pool goes on serving.
#[test]
fn a_key_slot_with_absurd_argon2_costs_is_refused_and_the_pool_stays_up() {
    let t = tempfile::tempdir().unwrap();
    let dev = new_pool(t.path());
    let bad = [
        (u32::MAX, 3, 1, "memory cost 4294967295 KiB"),
        (65536, u32::MAX, 1, "time cost 4294967295 passes"),
        (65536, 3, 1 << 20, "parallelism 1048576 lanes"),
    ];
    edit_table(&dev, |table| {
        let v = table.volumes.iter_mut().find(|v| v.name == "v").unwrap();
        let good = v.slots[0].clone();
        for (m_kib, t, p, _) in bad {
            let mut s = good.clone();
            s.kind = SlotKind::Passphrase { m_kib, t, p };
            v.slots.push(s);
        }
    });
    let dir = t.path().to_path_buf();
    let pool = within_a_minute("open", move || {
        Pool::open(&dir, OpenOptions::default()).unwrap()
    });
    let p2 = pool.clone();
    let e = within_a_minute("key load", move || p2.load_key("v", &pp("anything")));
    let e = match e {
        Err(e @ Error::Corrupt(_)) => e.to_string(),
        other => panic!("key load with damaged slots: expected Corrupt, got {other:?}"),
    };
    assert!(
        e.contains("key slot 1 of volume 'v'") && e.contains(bad[0].3) && e.contains("limit"),
        "{e}"
    );
    // Key remove skips the damaged slots too: the passphrase opens none of them.
    let p2 = pool.clone();
    let removed = within_a_minute("key remove", move || p2.key_remove("v", &pp("anything")));
    assert!(
        matches!(removed, Err(Error::WrongKey(_))),
        "key remove: {removed:?}"
    );
    // The pool stays up: the good slot opens, data reads back, the other volume too.
    pool.load_key("v", &kf(1)).unwrap();
    let mut b = vec![0u8; 4096];
    pool.volume("v").unwrap().read(0, &mut b).unwrap();
    assert_eq!(b, [7u8; 4096]);
    pool.volume("p").unwrap().read(0, &mut b).unwrap();
    assert_eq!(b, [7u8; 4096]);
}
