//! Attacks by someone who can write the devices (issue 20), as tests with access to the
//! engine's insides: each forges what such an attacker could forge offline (pointers and
//! unkeyed checksums) and checks the engine refuses it.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use zeroize::Zeroizing;

use crate::keys::Secret;
use crate::pool::{DeviceSpec, Layout, OpenOptions, Pool};
use crate::volume::{Compression, VolumeOptions};
use crate::Error;

fn pool(dir: &std::path::Path) -> Arc<Pool> {
    crate::pool::test_pool(dir, OpenOptions::default())
}

/// The pool's device files in `dir`, in order.
fn devices(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut d: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "img"))
        .collect();
    d.sort();
    d
}

fn opts(encryption: bool) -> VolumeOptions {
    VolumeOptions {
        size_bytes: 1 << 20,
        block_size: 4096,
        compression: Compression::Off,
        encryption,
    }
}

/// A record written unencrypted (by a plain volume, or forged with a recomputed checksum),
/// pointed at from an encrypted volume's map, is refused on read and listed by scrub: it is
/// never returned to the encrypted volume's client as data.
#[test]
fn plaintext_pointed_at_from_an_encrypted_volume_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let key = Secret::KeyFile(Zeroizing::new([7u8; 32]));
    {
        let pool = pool(dir.path());
        pool.create_volume("plain", opts(false), None).unwrap();
        pool.create_volume("enc", opts(true), Some(&key)).unwrap();
        let chosen = [0x41u8; 4096];
        pool.volume("plain")
            .unwrap()
            .write(0, &chosen, false)
            .unwrap();
        pool.volume("enc")
            .unwrap()
            .write(0, &[0x11; 4096], false)
            .unwrap();
        // The attacker's edit: block 0 of "enc" points at the plaintext record.
        let forged = pool.volume("plain").unwrap().debug_block_ptr(0).unwrap();
        let st = pool.core().find("enc").unwrap();
        let core = &pool.core();
        let old = st
            .map()
            .set(&*core.store, core.store.nodes(), 0, forged)
            .unwrap();
        assert!(!old.is_hole());
        core.store
            .note_dirty(st.head_dirty(), st.map().dirty_nodes());
        pool.flush().unwrap();
        pool.close().unwrap();
    }
    let pool = Pool::open(dir.path(), OpenOptions::default()).unwrap();
    pool.load_key("enc", &key).unwrap();
    let mut buf = [0u8; 4096];
    match pool.volume("enc").unwrap().read(0, &mut buf) {
        Err(Error::Corrupt(m)) => assert!(m.contains("stored unencrypted"), "{m}"),
        other => panic!(
            "a forged plaintext block was not refused: {other:?}, read {:?}",
            &buf[..4]
        ),
    }
    assert!(
        pool.status()
            .errors
            .iter()
            .any(|e| e.volume == "enc" && e.offset == 0),
        "the refused block is listed as an error"
    );
    // A scrub (no key needed) finds it too, after the list is cleared by a restart.
    pool.close().unwrap();
    drop(pool);
    let pool = Pool::open(dir.path(), OpenOptions::default()).unwrap();
    pool.core().errors.lock().clear();
    pool.core().errors_listed.store(false, Ordering::Release);
    pool.scrub_start().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while pool.scrub_status().state != "finished" {
        assert!(std::time::Instant::now() < deadline, "scrub did not finish");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let s = pool.scrub_status();
    assert!(s.unrecoverable >= 1, "scrub reported no error: {s:?}");
    assert!(pool
        .status()
        .errors
        .iter()
        .any(|e| e.volume == "enc" && e.offset == 0));
}

/// Devices rolled back to before nonces were used, taken with `accept_rollback`: the pool
/// goes on above every nonce the host ever reserved (the anchor keeps the highest), not
/// from the devices' older reservation, so no nonce is handed out twice under a key.
#[test]
fn an_accepted_rollback_never_hands_out_a_used_nonce() {
    let dir = tempfile::tempdir().unwrap();
    let used;
    let saved: Vec<(std::path::PathBuf, Vec<u8>)>;
    {
        let pool = pool(dir.path());
        pool.flush().unwrap();
        saved = devices(dir.path())
            .into_iter()
            .map(|p| (p.clone(), std::fs::read(&p).unwrap()))
            .collect();
        let old_reservation = pool.core().sb.lock().sb.nonce_reserved;
        // Use more nonces than the saved devices reserved (each range runs out and commits).
        let core = pool.core().clone();
        let mut last = 0;
        while last <= old_reservation + 1000 {
            last = core.store.next_nonce(|| core.commit()).unwrap();
        }
        used = last;
        pool.close().unwrap();
    }
    for (p, b) in &saved {
        std::fs::write(p, b).unwrap();
    }
    assert!(Pool::open(dir.path(), OpenOptions::default()).is_err());
    let accept = OpenOptions {
        accept_rollback: true,
        ..OpenOptions::default()
    };
    let pool = Pool::open(dir.path(), accept).unwrap();
    let next = pool
        .core()
        .store
        .next_nonce(|| pool.core().commit())
        .unwrap();
    assert!(
        next > used,
        "nonce {next} handed out again (used up to {used})"
    );
}

/// Nonces never repeat under a key, whatever the devices say (decision 0011): devices
/// restored to an older copy and imported with the host's anchor gone (a lost pool
/// directory, or `pool import` on another host) start the nonce counter where the first
/// run did, and the second run's blocks take the same counter values; each run sealed
/// under its own random salt, so no (generation, salt, nonce) is used twice.
#[test]
fn a_rollback_with_the_anchor_lost_reuses_no_key_and_nonce() {
    let dir = tempfile::tempdir().unwrap();
    let key = Secret::KeyFile(Zeroizing::new([9u8; 32]));
    let used = |pool: &Pool| -> Vec<(u16, [u8; 16], u64)> {
        let v = pool.volume("enc").unwrap();
        (0..32u64)
            .map(|lba| {
                let p = v.debug_block_ptr(lba).unwrap();
                let salt = crate::checksum::salt_of(&p.checksum).expect("a salted block");
                (p.key_gen, salt, p.nonce)
            })
            .collect()
    };
    let first;
    {
        let pool = pool(dir.path());
        pool.create_volume("enc", opts(true), Some(&key)).unwrap();
        pool.close().unwrap();
    }
    // The copy the attacker (or a backup) keeps: before the next run's import reserved
    // its nonces.
    let saved: Vec<(std::path::PathBuf, Vec<u8>)> = devices(dir.path())
        .into_iter()
        .map(|p| (p.clone(), std::fs::read(&p).unwrap()))
        .collect();
    {
        let pool = Pool::open(dir.path(), OpenOptions::default()).unwrap();
        pool.load_key("enc", &key).unwrap();
        let v = pool.volume("enc").unwrap();
        for lba in 0..32u64 {
            v.write(lba * 4096, &[lba as u8 + 1; 4096], false).unwrap();
        }
        first = used(&pool);
        drop(v);
        pool.close().unwrap();
    }
    for (p, b) in &saved {
        std::fs::write(p, b).unwrap();
    }
    std::fs::remove_file(dir.path().join("pool.anchor")).unwrap();
    let pool = Pool::open(dir.path(), OpenOptions::default()).unwrap();
    pool.load_key("enc", &key).unwrap();
    let v = pool.volume("enc").unwrap();
    for lba in 0..32u64 {
        v.write(lba * 4096, &[0xF0 ^ lba as u8; 4096], false)
            .unwrap();
    }
    let second = used(&pool);
    let nonces = |u: &[(u16, [u8; 16], u64)]| -> std::collections::BTreeSet<u64> {
        u.iter().map(|t| t.2).collect()
    };
    assert!(
        nonces(&first).intersection(&nonces(&second)).count() > 0,
        "the counter did not start over: this test would not see a reuse"
    );
    let a: std::collections::BTreeSet<_> = first.iter().collect();
    assert!(
        second.iter().all(|t| !a.contains(t)),
        "a (generation, salt, nonce) was used twice"
    );
    let mut buf = [0u8; 4096];
    v.read(5 * 4096, &mut buf).unwrap();
    assert_eq!(buf, [0xF0 ^ 5; 4096]);
}

/// The main devices restored from a backup, the log device not: the run after the
/// restore reuses the generation numbers of the abandoned timeline, and its chain starts
/// where that timeline's did on the log device. Those old blocks carry a valid MAC; they
/// must not be replayed into the new timeline (they are another commit's chain: its chain
/// id, under the MAC, is not this superblock's).
#[test]
fn a_stale_log_chain_of_a_reused_generation_is_not_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let (pdir, _log) =
        crate::pool::txg::logdev::test_pool_with_log(dir.path(), Layout::Single, 1, 16 << 20);
    let opts = OpenOptions {
        commit_interval: std::time::Duration::from_secs(3600),
        ..OpenOptions::default()
    };
    {
        let pool = Pool::open(&pdir, opts.clone()).unwrap();
        pool.create_volume("v", self::opts(false), None).unwrap();
        pool.close().unwrap();
    }
    let dev = pdir.join("dev0.img");
    let saved = std::fs::read(&dev).unwrap();
    {
        let pool = Pool::open(&pdir, opts.clone()).unwrap();
        let v = pool.volume("v").unwrap();
        v.write(5 * 4096, &[0xAA; 4096], false).unwrap();
        v.flush().unwrap();
    } // a crash: timeline A's flush lives in the log device's chain
    std::fs::write(&dev, &saved).unwrap();
    {
        let accept = OpenOptions {
            accept_rollback: true,
            ..opts.clone()
        };
        let pool = Pool::open(&pdir, accept).unwrap();
        let mut buf = [0u8; 4096];
        pool.volume("v").unwrap().read(5 * 4096, &mut buf).unwrap();
        assert_eq!(buf[0], 0, "the restored devices are from before the write");
    } // a crash before any flush of timeline B
    let pool = Pool::open(&pdir, opts).unwrap();
    let mut buf = [0u8; 4096];
    pool.volume("v").unwrap().read(5 * 4096, &mut buf).unwrap();
    assert_eq!(buf[0], 0, "timeline A's flush was replayed into timeline B");
}

/// `pool upgrade` stopped in its first commit after one member's format 2 labels landed
/// and before the other's: the pool is served (the member still at format 1 is one
/// generation behind, as after any commit cut short, and gets format 2 labels at the next
/// commit). It used to be refused as missing a member, and `pool upgrade` refused it as
/// already format 2. An upgrade with a member missing is refused, and leaves no key.
#[test]
fn an_upgrade_stopped_between_members_is_served() {
    use crate::constants::{DEVICE_RESERVED_FRONT, SEGMENT_BYTES, SUPERBLOCK_BYTES};
    use crate::pool::format::superblock::{Check, Superblock};
    let spec = || DeviceSpec::Files {
        count: 2,
        size_bytes: 64 << 20,
    };
    let upgrade = OpenOptions {
        upgrade: true,
        ..OpenOptions::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("p");
    crate::pool::create::create_format_1(&p, Layout::Single, spec(), "p").unwrap();
    let d1 = p.join("dev1.img");
    let before = std::fs::read(&d1).unwrap();
    let sb = crate::pool::format::labels::best_superblock(
        &crate::device::FileDevice::open(&d1).unwrap(),
        None,
        Check::Unkeyed,
    )
    .unwrap();
    let back = DEVICE_RESERVED_FRONT + sb.segments_per_device * SEGMENT_BYTES;
    drop(Pool::open(&p, upgrade.clone()).unwrap()); // a crash after the import's commit
                                                    // dev1 as if that commit had not reached it: its format 1 labels.
    let mut after = std::fs::read(&d1).unwrap();
    for o in Superblock::all_slot_offsets(back) {
        let o = o as usize;
        after[o..o + SUPERBLOCK_BYTES].copy_from_slice(&before[o..o + SUPERBLOCK_BYTES]);
    }
    std::fs::write(&d1, &after).unwrap();
    let pool = Pool::open(&p, OpenOptions::default()).unwrap();
    assert_eq!(pool.status().state, "ONLINE");
    pool.close().unwrap();
    drop(pool);
    // Both commits since (the import's and the close's) wrote dev1's format 2 labels.
    let bytes = std::fs::read(&d1).unwrap();
    for o in Superblock::all_slot_offsets(back) {
        let o = o as usize;
        let sb = Superblock::decode(&bytes[o..o + SUPERBLOCK_BYTES], Check::Unkeyed)
            .unwrap()
            .unwrap();
        assert_eq!(sb.format, crate::pool::format::superblock::VERSION);
    }
    // An upgrade with a member gone is refused.
    let dir3 = tempfile::tempdir().unwrap();
    let p3 = dir3.path().join("p");
    crate::pool::create::create_format_1(&p3, Layout::Mirror(2), spec(), "p").unwrap();
    std::fs::remove_file(p3.join("dev1.img")).unwrap();
    let e = crate::pool::lifecycle::upgrade(&p3).err().unwrap();
    assert!(e.to_string().contains("every member"), "{e}");
    assert!(
        !p3.join("pool.key").exists(),
        "a refused upgrade leaves no key"
    );
}

/// A label forged without the key with the exported mark set (and the unkeyed checksum
/// right) must not let `bulwark pool import` take a pool that was never exported: once it
/// has the key, the import decides again on the labels that verify. (It used to decide on
/// the unkeyed scan, and took the pool without --force.)
#[test]
fn a_forged_exported_mark_does_not_let_an_import_take_a_pool() {
    use crate::constants::{SUPERBLOCK_BYTES, SUPERBLOCK_SLOT_OFFSETS};
    use crate::pool::format::superblock::Check;
    use crate::pool::lifecycle::{import_into, ImportOptions};
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    {
        let pool = pool(&a);
        pool.create_volume("v", opts(false), None).unwrap();
        pool.close().unwrap();
    }
    let devp = a.join("dev0.img");
    let b = dir.path().join("b");
    let with_key = || ImportOptions {
        pool_key: Some(a.join("pool.key")),
        ..Default::default()
    };
    let e = import_into(&b, std::slice::from_ref(&devp), &with_key()).unwrap_err();
    assert!(e.to_string().contains("not exported"), "{e}");
    // The forger's slot: the newest label, exported, one generation on, sealed under a
    // key of its own (its unkeyed checksum is right; its MAC is not the pool's).
    let mut sb = crate::pool::format::labels::best_superblock(
        &crate::device::FileDevice::open(&devp).unwrap(),
        None,
        Check::Unkeyed,
    )
    .unwrap();
    sb.generation += 1;
    sb.exported = true;
    let bytes = sb.encode(Some(&zeroize::Zeroizing::new([0x77u8; 32])));
    let mut dev = std::fs::read(&devp).unwrap();
    let o = SUPERBLOCK_SLOT_OFFSETS[(sb.generation % 2) as usize] as usize;
    dev[o..o + SUPERBLOCK_BYTES].copy_from_slice(&bytes);
    std::fs::write(&devp, &dev).unwrap();
    match import_into(&b, std::slice::from_ref(&devp), &with_key()) {
        Ok(r) => panic!(
            "a pool never exported was imported without --force: {}",
            r.name
        ),
        Err(e) => assert!(e.to_string().contains("not exported"), "{e}"),
    }
    assert!(
        !b.join("pool.json").exists(),
        "a refused import leaves nothing"
    );
}
