//! Key lifecycle: slots, change, rotation across a crash, crypto-erase.

use std::path::Path;
use std::time::Duration;

use bulwark_engine::pool::format::superblock::Superblock;
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
fn data(i: u64) -> Vec<u8> {
    (0..65536u64)
        .map(|j| ((i * 17 + j * 3 + j / 999) % 256) as u8)
        .collect()
}
fn new_pool(dir: &Path) -> std::sync::Arc<Pool> {
    new_pool_sized(dir, 8 << 20, 64 << 20, Compression::Lz4)
}
/// A `mirror:2` pool with one encrypted volume "v" (key `kf(1)`).
fn new_pool_sized(
    dir: &Path,
    volume_bytes: u64,
    device_bytes: u64,
    compression: Compression,
) -> std::sync::Arc<Pool> {
    Pool::create(
        dir,
        Layout::Mirror(2),
        DeviceSpec::Files {
            count: 2,
            size_bytes: device_bytes,
        },
    )
    .unwrap();
    let pool = Pool::open(dir, OpenOptions::default()).unwrap();
    let o = VolumeOptions {
        size_bytes: volume_bytes,
        block_size: 4096,
        compression,
        encryption: true,
    };
    pool.create_volume("v", o, Some(&kf(1))).unwrap();
    pool
}
/// Waits (up to `seconds`) for the rotation of "v" to finish; fails the test if it does not.
fn rotation_done(pool: &Pool, seconds: u64) -> bulwark_engine::VolumeStatus {
    for _ in 0..seconds * 50 {
        if pool.volumes()[0].rotation.is_none() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let st = pool.volumes().remove(0);
    assert!(
        st.rotation.is_none(),
        "rotation did not finish: {:?}",
        st.rotation
    );
    st
}
fn check(pool: &Pool, chunks: impl Iterator<Item = u64>) {
    let v = pool.volume("v").unwrap();
    for i in chunks {
        let mut b = vec![0u8; 65536];
        v.read(i * 65536, &mut b).unwrap();
        assert!(b == data(i), "chunk {i}");
    }
}

#[test]
fn slots_add_remove_change() {
    let t = tempfile::tempdir().unwrap();
    let pool = new_pool(t.path());
    pool.volume("v").unwrap().write(0, &data(0), true).unwrap();
    assert_eq!(pool.key_add("v", &pp("second secret")).unwrap(), 1);
    assert_eq!(pool.key_list("v").unwrap().len(), 2);
    for s in [kf(1), pp("second secret")] {
        pool.unload_key("v").unwrap();
        pool.load_key("v", &s).unwrap();
        check(&pool, 0..1);
    }
    // Remove the key-file slot: it stops working; the passphrase still opens.
    pool.remove_slot_and_check();
    // Change the passphrase: data intact, old passphrase refused.
    pool.key_change("v", &pp("second secret"), &pp("third secret"))
        .unwrap();
    pool.unload_key("v").unwrap();
    assert!(matches!(
        pool.load_key("v", &pp("second secret")),
        Err(Error::WrongKey(_))
    ));
    pool.load_key("v", &pp("third secret")).unwrap();
    check(&pool, 0..1);
    let e = pool
        .key_remove("v", &pp("third secret"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("last key slot"), "{e}");
}

/// `key_change` refuses a new secret that already opens another slot, as `key_add` does:
/// it used to accept it, leaving one secret in two slots, and `key_remove` with that secret
/// then removed one of them and said the secret no longer opened the volume while the
/// other slot still did.
#[test]
fn change_refuses_a_secret_another_slot_has() {
    let t = tempfile::tempdir().unwrap();
    let pool = new_pool(t.path());
    pool.volume("v").unwrap().write(0, &data(0), true).unwrap();
    assert_eq!(pool.key_add("v", &kf(2)).unwrap(), 1);
    let added = pool.key_add("v", &kf(1)).unwrap_err();
    let changed = pool.key_change("v", &kf(2), &kf(1)).unwrap_err();
    assert!(matches!(changed, Error::Exists(_)), "{changed}");
    assert_eq!(changed.to_string(), added.to_string());
    assert!(
        changed.to_string().contains("already opens a key slot"),
        "{changed}"
    );
    // Nothing changed: both secrets still open the volume, each in its own slot.
    assert_eq!(pool.key_list("v").unwrap().len(), 2);
    for s in [kf(2), kf(1)] {
        pool.unload_key("v").unwrap();
        pool.load_key("v", &s).unwrap();
        check(&pool, 0..1);
    }
    // A change to the slot's own secret, or to a new one, is still allowed.
    pool.key_change("v", &kf(2), &kf(2)).unwrap();
    assert_eq!(pool.key_change("v", &kf(2), &kf(3)).unwrap(), 1);
    // Removing a secret leaves the other one as the only way in.
    assert_eq!(pool.key_remove("v", &kf(1)).unwrap(), vec![0]);
    pool.unload_key("v").unwrap();
    assert!(matches!(
        pool.load_key("v", &kf(1)),
        Err(Error::WrongKey(_))
    ));
    pool.load_key("v", &kf(3)).unwrap();
    check(&pool, 0..1);
}

trait RemoveSlot {
    fn remove_slot_and_check(&self);
}
impl RemoveSlot for Pool {
    fn remove_slot_and_check(&self) {
        self.key_remove("v", &kf(1)).unwrap();
        self.unload_key("v").unwrap();
        assert!(matches!(
            self.load_key("v", &kf(1)),
            Err(Error::WrongKey(_))
        ));
        self.load_key("v", &pp("second secret")).unwrap();
    }
}

#[test]
fn rotation_survives_a_crash_and_retires_the_old_key() {
    let t = tempfile::tempdir().unwrap();
    {
        let pool = new_pool(t.path());
        let v = pool.volume("v").unwrap();
        for i in 0..64 {
            v.write(i * 65536, &data(i), false).unwrap();
        }
        v.flush().unwrap();
        assert_eq!(pool.key_rotate("v").unwrap(), 1);
        for i in 64..96 {
            v.write(i * 65536, &data(i), false).unwrap();
        }
        v.flush().unwrap();
        // Crash: no close, the rotation worker may be anywhere.
    }
    let pool = Pool::open(t.path(), OpenOptions::default()).unwrap();
    pool.load_key("v", &kf(1)).unwrap();
    let st = rotation_done(&pool, 10);
    assert_eq!(st.key_generation, 1);
    check(&pool, 0..96);
    let v = pool.volume("v").unwrap();
    for lba in (0..96 * 16).step_by(7) {
        assert_eq!(
            v.debug_block_ptr(lba).unwrap().key_gen,
            1,
            "block {lba} still under the old key"
        );
    }
}

/// Stepped mode (the simulator's): a rotation starts no worker; each `rotation_step` runs
/// one batch (1024 blocks), client writes between batches win, and the step after the
/// last batch retires the old key.
#[test]
fn a_stepped_rotation_runs_one_batch_per_step() {
    let t = tempfile::tempdir().unwrap();
    drop(new_pool(t.path()));
    let opts = OpenOptions {
        stepped: true,
        ..OpenOptions::default()
    };
    let pool = Pool::open(t.path(), opts).unwrap();
    pool.load_key("v", &kf(1)).unwrap();
    let v = pool.volume("v").unwrap();
    // 8 MiB of 4 KiB blocks: two batches.
    for i in 0..128 {
        v.write(i * 65536, &data(i), false).unwrap();
    }
    assert_eq!(pool.key_rotate("v").unwrap(), 1);
    let progress = || pool.volumes()[0].rotation.clone();
    assert_eq!(progress().unwrap().blocks_done, 0, "no worker ran it");
    assert_eq!(pool.rotation_step().unwrap(), 1);
    assert_eq!(progress().unwrap().lba, 1024);
    // A client write between two batches: it stays, under the new key.
    v.write(100 * 65536, &data(1000), false).unwrap();
    assert_eq!(pool.rotation_step().unwrap(), 1);
    assert_eq!(progress().unwrap().lba, 2048);
    // The next finds the walk at the end and retires the old key.
    assert_eq!(pool.rotation_step().unwrap(), 1);
    assert!(progress().is_none(), "the rotation ended");
    assert_eq!(pool.rotation_step().unwrap(), 0);
    let mut b = vec![0u8; 65536];
    v.read(100 * 65536, &mut b).unwrap();
    assert!(b == data(1000));
    for lba in (0..2048).step_by(5) {
        assert_eq!(v.debug_block_ptr(lba).unwrap().key_gen, 1, "block {lba}");
    }
    drop(v);
    check(&pool, (0..100).chain(101..128));
}

#[test]
fn crypto_erase_leaves_no_table_key_that_could_open_old_tables() {
    let t = tempfile::tempdir().unwrap();
    let devs = [t.path().join("dev0.img"), t.path().join("dev1.img")];
    let pool = new_pool(t.path());
    pool.volume("v").unwrap().write(0, &data(0), true).unwrap();
    // Every table key in any superblock slot before the erase.
    let keys_before = table_keys(&devs);
    assert!(!keys_before.is_empty());
    pool.key_erase("v").unwrap();
    let e = pool.load_key("v", &kf(1)).unwrap_err().to_string();
    assert!(e.contains("erased"), "{e}");
    drop(pool);
    for d in &devs {
        let bytes = std::fs::read(d).unwrap();
        for k in &keys_before {
            assert!(
                !bytes.windows(32).any(|w| w == k),
                "an old table key survives in {}",
                d.display()
            );
        }
    }
    let pool = Pool::open(t.path(), OpenOptions::default()).unwrap();
    assert!(pool.load_key("v", &kf(1)).is_err());
}

fn table_keys(devs: &[std::path::PathBuf]) -> Vec<[u8; 32]> {
    let mut keys = Vec::new();
    for d in devs {
        let bytes = std::fs::read(d).unwrap();
        let back = bytes.len() as u64 - (1 << 20);
        for off in Superblock::all_slot_offsets(back) {
            let off = off as usize;
            if let Ok(Some(sb)) = Superblock::decode(
                &bytes[off..off + 4096],
                bulwark_engine::pool::format::superblock::Check::Unkeyed,
            ) {
                if !keys.contains(&sb.table_key) {
                    keys.push(sb.table_key);
                }
            }
        }
    }
    keys
}

/// A commit records the rotation cursor together with the map it commits: a crash while
/// the rotation runs and commits keep coming never leaves a durable cursor ahead of the
/// blocks it says were rewritten. (The cursor used to be read after the leaves had been
/// copied and written; a rotation resumed after a crash then skipped blocks still under
/// the old key, finished, and destroyed that key: EIO on read.) Timing-dependent: each
/// round crashes at another point of the rotation, with commits racing its batches.
#[test]
fn rotation_cursor_never_runs_ahead_of_the_committed_map() {
    const CHUNKS: u64 = 768; // 48 MiB: 12 rotation batches of 1024 blocks
    for round in 0..6u64 {
        let t = tempfile::tempdir().unwrap();
        {
            let pool = new_pool_sized(t.path(), CHUNKS * 65536, 256 << 20, Compression::Off);
            let v = pool.volume("v").unwrap();
            for i in 0..CHUNKS {
                v.write(i * 65536, &data(i), false).unwrap();
            }
            v.flush().unwrap();
            assert_eq!(pool.key_rotate("v").unwrap(), 1);
            // Commits back to back while the rotation works; crash part-way.
            let stop_at = (round + 1) * CHUNKS * 16 / 8;
            for _ in 0..20_000 {
                v.flush().unwrap();
                match &pool.volumes()[0].rotation {
                    Some(r) if r.lba < stop_at => {}
                    _ => break,
                }
            }
            // Crash: no close.
        }
        let pool = Pool::open(t.path(), OpenOptions::default()).unwrap();
        pool.load_key("v", &kf(1)).unwrap();
        rotation_done(&pool, 30);
        let v = pool.volume("v").unwrap();
        for i in 0..CHUNKS {
            let mut b = vec![0u8; 65536];
            v.read(i * 65536, &mut b).unwrap_or_else(|e| {
                panic!("round {round}: chunk {i} after the resumed rotation: {e}")
            });
            assert!(b == data(i), "round {round}: chunk {i}");
        }
    }
}

/// Waits (up to `seconds`) until `cond` holds for the status of "v"; fails the test if not.
fn wait_volume(
    pool: &Pool,
    seconds: u64,
    what: &str,
    cond: impl Fn(&bulwark_engine::VolumeStatus) -> bool,
) -> bulwark_engine::VolumeStatus {
    for _ in 0..seconds * 50 {
        let v = pool.volumes().into_iter().find(|v| v.name == "v").unwrap();
        if cond(&v) {
            return v;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!(
        "{what}: {:?}",
        pool.volumes().into_iter().find(|v| v.name == "v")
    );
}

fn paused_for_space(v: &bulwark_engine::VolumeStatus) -> bool {
    v.rotation
        .as_ref()
        .is_some_and(|r| r.retrying && r.error.as_deref() == Some("the pool is out of space"))
}

/// A pool with encrypted volume "v" (4 MiB written) and volume "f", which fills the rest.
fn full_pool_beside_v(dir: &std::path::Path) -> std::sync::Arc<Pool> {
    let pool = new_pool_sized(dir, 8 << 20, 32 << 20, Compression::Off);
    let v = pool.volume("v").unwrap();
    for i in 0..64 {
        v.write(i * 65536, &data(i), false).unwrap();
    }
    v.flush().unwrap();
    let o = VolumeOptions {
        size_bytes: 128 << 20,
        block_size: 4096,
        compression: Compression::Off,
        encryption: false,
    };
    pool.create_volume("f", o, None).unwrap();
    let f = pool.volume("f").unwrap();
    let fill = vec![0x22u8; 1 << 20];
    let mut at = 0;
    loop {
        match f.write(at, &fill, false) {
            Ok(()) => at += fill.len() as u64,
            Err(Error::NoSpace) => break,
            Err(e) => panic!("filling the pool: {e}"),
        }
        assert!(at < 128 << 20, "the pool never filled");
    }
    drop((f, v));
    pool.flush().unwrap();
    pool
}

/// A rotation that runs out of space pauses, with its reason, instead of stopping for good
/// while saying it runs: `key_rotate` resumes it (it used to answer "already running"),
/// closing the pool does not wait for space, loading the key after a reopen resumes it, and
/// it finishes by itself once space is freed, every block readable.
#[test]
fn rotation_paused_by_a_full_pool_goes_on_when_space_is_freed() {
    let t = tempfile::tempdir().unwrap();
    {
        let pool = full_pool_beside_v(t.path());
        assert_eq!(pool.key_rotate("v").unwrap(), 1);
        wait_volume(&pool, 60, "the rotation did not pause", paused_for_space);
        // Paused, not "already running": a request resumes it (and the pool is still full).
        assert_eq!(pool.key_rotate("v").unwrap(), 1);
        wait_volume(
            &pool,
            60,
            "the resumed rotation did not pause again",
            paused_for_space,
        );
        check(&pool, 0..64);
        // Closed while paused: the worker ends (close joins it).
    }
    let pool = Pool::open(t.path(), OpenOptions::default()).unwrap();
    let st = pool.volumes().into_iter().find(|v| v.name == "v").unwrap();
    assert_eq!(st.rotation.as_ref().map(|r| r.to_generation), Some(1));
    pool.load_key("v", &kf(1)).unwrap();
    wait_volume(
        &pool,
        60,
        "the reloaded rotation did not pause",
        paused_for_space,
    );
    pool.destroy_volume("f").unwrap();
    let st = rotation_done(&pool, 60);
    assert_eq!(st.key_generation, 1);
    check(&pool, 0..64);
    let v = pool.volume("v").unwrap();
    for lba in 0..64 * 16 {
        assert_eq!(v.debug_block_ptr(lba).unwrap().key_gen, 1, "block {lba}");
    }
}

/// Freeing space is what resumes a rotation paused for it, and an admin frees space by
/// destroying, locking or erasing volumes: the paused rotation must not hold its own
/// volume open against them (they were refused with "in use" while it waited).
#[test]
fn a_rotation_paused_for_space_does_not_hold_its_volume() {
    let t = tempfile::tempdir().unwrap();
    let pool = full_pool_beside_v(t.path());
    assert_eq!(pool.key_rotate("v").unwrap(), 1);
    wait_volume(&pool, 60, "the rotation did not pause", paused_for_space);
    pool.unload_key("v").unwrap();
    pool.load_key("v", &kf(1)).unwrap();
    wait_volume(
        &pool,
        60,
        "the rotation did not pause again after the key load",
        paused_for_space,
    );
    check(&pool, 0..64);
    pool.destroy_volume("v").unwrap();
    assert!(pool.volumes().iter().all(|v| v.name != "v"));
}
