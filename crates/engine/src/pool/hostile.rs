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
    Pool::create(
        dir,
        Layout::Single,
        DeviceSpec::Files {
            count: 1,
            size_bytes: 64 << 20,
        },
    )
    .unwrap();
    Pool::open(dir, OpenOptions::default()).unwrap()
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
        let st = pool.core.find("enc").unwrap();
        let core = &pool.core;
        let old = st
            .tree
            .lock()
            .set(&*core.store, &core.store.cache, 0, forged)
            .unwrap();
        assert!(!old.is_hole());
        core.store
            .note_dirty(&st.dirty_nodes, st.tree.lock().dirty_nodes());
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
    pool.core.errors.lock().clear();
    pool.core.errors_listed.store(false, Ordering::Release);
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
        let old_reservation = pool.core.sb.lock().sb.nonce_reserved;
        // Use more nonces than the saved devices reserved (each range runs out and commits).
        let core = pool.core.clone();
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
    let next = pool.core.store.next_nonce(|| pool.core.commit()).unwrap();
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
    let saved: Vec<(std::path::PathBuf, Vec<u8>)>;
    let first;
    {
        let pool = pool(dir.path());
        pool.create_volume("enc", opts(true), Some(&key)).unwrap();
        pool.close().unwrap();
    }
    // The copy the attacker (or a backup) keeps: before the next run's import reserved
    // its nonces.
    saved = devices(dir.path())
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
