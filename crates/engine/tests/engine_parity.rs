//! Parity layouts: bad controller on one device, lost devices, degraded import, scrub.

use std::path::Path;
use std::time::Duration;

use bulwark_engine::device::fault::{Fault, FaultMode};
use bulwark_engine::{Compression, DeviceSpec, Layout, OpenOptions, Pool, VolumeOptions};

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

fn fault(mode: FaultMode) -> Vec<Fault> {
    vec![Fault {
        mode,
        probability: 1.0,
        seed: 3,
        include_labels: false,
    }]
}

fn data(i: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|j| ((i * 131 + j * 7 + j / 4096) % 253) as u8)
        .collect()
}

fn scrub(pool: &Pool) -> bulwark_engine::pool::format::health::ScrubStatus {
    pool.scrub_start().unwrap();
    for _ in 0..1000 {
        let s = pool.scrub_status();
        if s.state == "finished" {
            return s;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("scrub did not finish");
}

fn check_all(pool: &Pool, n: u64, len: usize) {
    let v = pool.volume("v").unwrap();
    for i in 0..n {
        let mut b = vec![0u8; len];
        v.read(i * len as u64, &mut b).unwrap();
        assert!(b == data(i, len), "chunk {i} differs");
    }
}

fn run(k: u8, m: u8) {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    let n = (k + m) as usize;
    Pool::create(
        dir,
        Layout::Parity { k, m },
        DeviceSpec::Files {
            count: n,
            size_bytes: 48 << 20,
        },
    )
    .unwrap();
    let devs: Vec<_> = (0..n).map(|i| dir.join(format!("dev{i}.img"))).collect();
    let (chunks, len) = (48u64, 64 << 10);
    {
        let pool = open(dir);
        let o = VolumeOptions {
            size_bytes: 8 << 20,
            block_size: 4096,
            compression: Compression::Lz4,
            encryption: false,
        };
        pool.create_volume("v", o, None).unwrap();
        // A bad controller on the first M devices corrupts every write they take.
        for d in &devs[..m as usize] {
            pool.set_faults(d, fault(FaultMode::WriteFlip)).unwrap();
        }
        let v = pool.volume("v").unwrap();
        for i in 0..chunks {
            v.write(i * len as u64, &data(i, len), false).unwrap();
        }
        v.flush().unwrap();
        for d in &devs[..m as usize] {
            pool.set_faults(d, vec![]).unwrap();
        }
        drop(v);
        check_all(&pool, chunks, len);
        let s = scrub(&pool);
        assert!(
            s.repaired > 0 && s.unrecoverable == 0,
            "parity:{k}+{m} {s:?}"
        );
        let s = scrub(&pool);
        assert_eq!(
            (s.repaired, s.unrecoverable),
            (0, 0),
            "second scrub parity:{k}+{m}"
        );
        // Lose M devices while writing: the client sees no error.
        for d in &devs[n - m as usize..] {
            pool.set_faults(d, fault(FaultMode::Vanish)).unwrap();
        }
        let v = pool.volume("v").unwrap();
        for i in 0..chunks / 2 {
            v.write(i * len as u64, &data(i, len), false).unwrap();
        }
        v.flush().unwrap();
        drop(v);
        check_all(&pool, chunks, len);
        assert_eq!(pool.status().state, "DEGRADED");
        pool.close().unwrap();
    }
    // Import with M devices gone: degraded, serving.
    for d in &devs[n - m as usize..] {
        std::fs::remove_file(d).unwrap();
    }
    let pool = open(dir);
    assert_eq!(pool.status().state, "DEGRADED");
    check_all(&pool, chunks, len);
    drop(pool);
    // One more missing is beyond what the layout tolerates: a clear refusal.
    std::fs::remove_file(&devs[0]).unwrap();
    let e = Pool::open(dir, OpenOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("missing"), "{e}");
}

#[test]
fn parity_2_1() {
    run(2, 1);
}

#[test]
fn parity_4_2() {
    run(4, 2);
}
