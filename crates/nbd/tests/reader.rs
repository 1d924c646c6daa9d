//! `reader::NbdReader` against this crate's own server: block status tells
//! holes from data, reads return what was written, and a failing server or a
//! missing export is an error with its reason, never a panic.

mod common;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bulwark_nbd::reader::{NbdReader, Run};
use bulwark_nbd::{Backend, Server, ServerConfig};
use common::*;

const DISK_BYTES: u64 = 8 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_what_was_written_and_skips_holes() {
    let disk = MemBackend::new(DISK_BYTES);
    // Data at odd offsets; the rest never written (holes that read as zeros).
    let writes: [(u64, usize); 3] = [
        (4096 * 3 + 17, 70_001),
        (5 << 20, 4096),
        (DISK_BYTES - 100, 100),
    ];
    for (i, (off, len)) in writes.iter().enumerate() {
        let bytes: Vec<u8> = (0..*len).map(|n| (n * 7 + i * 13 + 1) as u8).collect();
        disk.write(*off, &bytes, false).unwrap();
    }
    let want = disk.data.lock().unwrap().clone();
    let mut map = HashMap::new();
    map.insert("disk".to_owned(), Arc::clone(&disk));
    let server = Server::new(Arc::new(TestExports(map)), ServerConfig::default());
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nbd.sock");
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let serving = tokio::spawn(Arc::clone(&server).serve_unix(listener));

    let path = socket.clone();
    let (got, runs) = tokio::task::spawn_blocking(move || {
        let mut r = NbdReader::open(&path, "disk").unwrap();
        assert_eq!(r.size_bytes(), DISK_BYTES);
        let mut runs: Vec<Run> = Vec::new();
        let mut got = Vec::new();
        let mut offset = 0;
        while offset < DISK_BYTES {
            for run in r.runs(offset).unwrap() {
                let mut buf = vec![0u8; run.length_bytes as usize];
                if !run.zero {
                    for (i, part) in buf.chunks_mut(1 << 20).enumerate() {
                        r.read(offset + (i << 20) as u64, part).unwrap();
                    }
                }
                got.extend_from_slice(&buf);
                offset += run.length_bytes;
                runs.push(run);
            }
        }
        (got, runs)
    })
    .await
    .unwrap();
    assert!(got == want, "the bytes read are not the disk's");
    let data: u64 = runs
        .iter()
        .filter(|r| !r.zero)
        .map(|r| r.length_bytes)
        .sum();
    assert!(
        data < DISK_BYTES / 8,
        "holes reported as data: {data} bytes of data"
    );

    // A server error on read is an error with its errno, not a panic.
    disk.fail_reads.store(true, Ordering::SeqCst);
    let path = socket.clone();
    let e = tokio::task::spawn_blocking(move || {
        let mut r = NbdReader::open(&path, "disk").unwrap();
        r.read(0, &mut [0u8; 4096]).unwrap_err()
    })
    .await
    .unwrap();
    assert!(e.to_string().contains("read: error"), "{e}");
    disk.fail_reads.store(false, Ordering::SeqCst);

    // A missing export: refused at open, saying so.
    let path = socket.clone();
    let e = tokio::task::spawn_blocking(move || NbdReader::open(&path, "nope").err().unwrap())
        .await
        .unwrap();
    assert!(e.to_string().contains("refused export nope"), "{e}");

    server.shutdown();
    within(serving).await.unwrap().unwrap();
}
