//! The cache device on every layout, encrypted and compressed volumes: reads come back
//! through it (hits counted), and a cache device damaged everywhere never returns wrong
//! bytes (the bad copies are counted, and the reads go to the pool).

use std::path::Path;
use std::time::{Duration, Instant};

use bulwark_engine::cachedev::CacheDeviceStatus;
use bulwark_engine::{Compression, DeviceSpec, Layout, OpenOptions, Pool, Secret, VolumeOptions};
use zeroize::Zeroizing;

const BLOCKS: u64 = 512;

fn data(seed: u64, len: usize, compressible: bool) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|i| {
            if compressible {
                return ((seed as usize + i / 64) % 7) as u8;
            }
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn cache(pool: &Pool) -> CacheDeviceStatus {
    pool.status()
        .cache_device
        .expect("status shows the cache device")
}

/// Wait (bounded) until the cache holds at least `entries` records.
fn wait_entries(pool: &Pool, entries: u64) -> CacheDeviceStatus {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let c = cache(pool);
        if c.entries >= entries || Instant::now() > deadline {
            return c;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn read_all(pool: &Pool, name: &str, piece: usize) -> Vec<u8> {
    let v = pool.volume(name).unwrap();
    let mut out = vec![0u8; (BLOCKS * 4096) as usize];
    let mut at = 0;
    while at < out.len() {
        let n = piece.min(out.len() - at);
        v.read(at as u64, &mut out[at..at + n]).unwrap();
        at += n;
    }
    out
}

fn run(layout: Layout, devices: usize) {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("pool");
    let cache_path = t.path().join("cache.img");
    std::fs::File::create(&cache_path)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    Pool::create(
        &dir,
        layout,
        DeviceSpec::Files {
            count: devices,
            size_bytes: 64 << 20,
        },
    )
    .unwrap();
    let pool = Pool::open(
        &dir,
        OpenOptions {
            cache_device: Some(cache_path.clone()),
            ..OpenOptions::default()
        },
    )
    .unwrap();
    assert_eq!(cache(&pool).state, "ONLINE");
    let key = Secret::KeyFile(Zeroizing::new([7; 32]));
    let vols = [
        ("enc", true, Compression::Off, false),
        ("lz", false, Compression::Lz4, true),
        ("encz", true, Compression::Lz4, true),
    ];
    let mut want = Vec::new();
    for (i, (name, encryption, compression, compressible)) in vols.iter().enumerate() {
        let o = VolumeOptions {
            size_bytes: BLOCKS * 4096,
            block_size: 4096,
            compression: *compression,
            encryption: *encryption,
        };
        pool.create_volume(name, o, encryption.then_some(&key))
            .unwrap();
        let d = data(i as u64 + 1, (BLOCKS * 4096) as usize, *compressible);
        pool.volume(name).unwrap().write(0, &d, false).unwrap();
        want.push(d);
    }
    pool.flush().unwrap();
    // Misses: read from the pool (in runs, and block by block), offered to the cache.
    for (i, (name, ..)) in vols.iter().enumerate() {
        assert!(
            read_all(&pool, name, 256 << 10) == want[i],
            "{name}: first read"
        );
    }
    let c = wait_entries(&pool, 3 * BLOCKS);
    assert!(
        c.entries >= 3 * BLOCKS,
        "{layout}: the cache did not fill: {c:?}"
    );
    let hits = c.hits;
    for (i, (name, ..)) in vols.iter().enumerate() {
        assert!(
            read_all(&pool, name, 64 << 10) == want[i],
            "{name}: read through the cache"
        );
    }
    let c = cache(&pool);
    assert!(
        c.hits >= hits + 3 * BLOCKS,
        "{layout}: reads not served by the cache: {c:?}"
    );
    assert_eq!(c.errors, 0);

    // Damage a byte in every 16 of the cache device (label and all): every record, even
    // a small compressed one, has bad bytes.
    damage(&cache_path);
    for (i, (name, ..)) in vols.iter().enumerate() {
        assert!(
            read_all(&pool, name, 64 << 10) == want[i],
            "{name}: read past a damaged cache"
        );
    }
    let c = cache(&pool);
    assert!(
        c.errors >= 3 * BLOCKS,
        "{layout}: damaged copies not counted: {c:?}"
    );
    for d in pool.status().devices {
        assert_eq!(
            d.cksum_errors, 0,
            "the pool's devices were not blamed: {d:?}"
        );
    }
    pool.close().unwrap();
}

fn damage(path: &Path) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut bytes = std::fs::read(path).unwrap();
    for i in (5..bytes.len()).step_by(16) {
        bytes[i] ^= 0xA5;
    }
    f.write_all_at(&bytes, 0).unwrap();
}

#[test]
fn cache_device_on_single() {
    run(Layout::Single, 1);
}

#[test]
fn cache_device_on_mirror() {
    run(Layout::Mirror(2), 2);
}

#[test]
fn cache_device_on_parity() {
    run(Layout::Parity { k: 2, m: 1 }, 3);
}
