//! The intent log (decision 0010): a client's flush makes its writes durable without a
//! commit; after a crash the import replays them, counts their space as a running pool
//! would, and never replays a flush that did not finish.

use std::sync::Arc;

use bulwark_engine::{Compression, DeviceSpec, Layout, OpenOptions, Pool, Secret, VolumeOptions};
use zeroize::Zeroizing;

fn key() -> Secret {
    Secret::KeyFile(Zeroizing::new([7; 32]))
}

fn block(tag: u64) -> Vec<u8> {
    let mut x = tag.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = vec![0u8; 4096];
    for c in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    out
}

fn open(dir: &std::path::Path) -> Arc<Pool> {
    let opts = OpenOptions {
        // Commits only when asked: every flush below goes through the log.
        commit_interval: std::time::Duration::from_secs(3600),
        ..OpenOptions::default()
    };
    let pool = Pool::open(dir, opts).unwrap();
    pool.load_key("v", &key()).unwrap();
    pool
}

#[test]
fn flushed_writes_survive_a_crash_and_space_is_recounted_the_same() {
    for layout in [Layout::Single, Layout::Mirror(2)] {
        let dir = tempfile::tempdir().unwrap();
        let devices = if layout == Layout::Single { 1 } else { 2 };
        Pool::create(
            dir.path(),
            layout,
            DeviceSpec::Files {
                count: devices,
                size_bytes: 64 << 20,
            },
        )
        .unwrap();
        let pool = Pool::open(dir.path(), OpenOptions::default()).unwrap();
        let opts = VolumeOptions {
            size_bytes: 8 << 20,
            block_size: 4096,
            compression: Compression::Off,
            encryption: true,
        };
        pool.create_volume("v", opts, Some(&key())).unwrap();
        pool.close().unwrap();
        drop(pool);
        let mut want = vec![0u64; 2048];
        let mut tag = 0;
        for round in 0..6u64 {
            let pool = open(dir.path());
            let v = pool.volume("v").unwrap();
            for step in 0..5u64 {
                for i in 0..40u64 {
                    let lba = (i * 37 + round * 11 + step * 5) % 2048;
                    tag += 1;
                    v.write(lba * 4096, &block(tag), false).unwrap();
                    want[lba as usize] = tag;
                }
                if step % 2 == 0 {
                    v.trim(((round * 97 + step) % 2000) * 4096, 4096 * 3)
                        .unwrap();
                    for l in (round * 97 + step) % 2000..(round * 97 + step) % 2000 + 3 {
                        want[l as usize] = 0;
                    }
                }
                v.flush().unwrap();
            }
            let before = pool.status().space.used_bytes;
            // A crash: nothing closed, no commit since the import's.
            drop(v);
            drop(pool);
            let pool = open(dir.path());
            let v = pool.volume("v").unwrap();
            let mut buf = vec![0u8; 4096];
            for (lba, &t) in want.iter().enumerate() {
                v.read(lba as u64 * 4096, &mut buf).unwrap();
                let expect = if t == 0 { vec![0u8; 4096] } else { block(t) };
                assert!(
                    buf == expect,
                    "{layout} round {round}: block {lba} is not write {t}"
                );
            }
            let after = pool.status().space.used_bytes;
            assert!(
                after.abs_diff(before) <= 64 << 10,
                "{layout} round {round}: used {before} before the crash, {after} recounted by the replay"
            );
            // And a clean restart agrees with the running count after the replay.
            pool.flush().unwrap();
            let running = pool.status().space.used_bytes;
            drop(v);
            pool.close().unwrap();
            drop(pool);
            let pool = open(dir.path());
            let recount = pool.status().space.used_bytes;
            assert!(
                recount.abs_diff(running) <= 64 << 10,
                "{layout} round {round}: used {running} running after a replay, {recount} recounted"
            );
            pool.close().unwrap();
        }
    }
}
