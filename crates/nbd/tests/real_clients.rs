//! Real NBD clients against an in-process server on a Unix socket: what a
//! user of qemu, libnbd and fio would see. Each test skips (with a
//! message) if its tool is not installed. The fio test is slow and runs
//! only with `BULWARK_SLOW_TESTS=1`.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Arc;
use std::time::Duration;

use bulwark_nbd::{Server, ServerConfig};
use common::*;
use tokio::process::Command;

const DISK_BYTES: u64 = 64 << 20;

struct Fixture {
    server: Arc<Server>,
    disk: Arc<MemBackend>,
    dir: tempfile::TempDir,
    socket: PathBuf,
    serving: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Fixture {
    fn start() -> Self {
        let disk = MemBackend::new(DISK_BYTES);
        let ro = MemBackend::with(1 << 20, true);
        let mut map = HashMap::new();
        map.insert("disk".to_owned(), Arc::clone(&disk));
        map.insert("ro".to_owned(), ro);
        let server = Server::new(Arc::new(TestExports(map)), ServerConfig::default());
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("nbd.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let serving = tokio::spawn(Arc::clone(&server).serve_unix(listener));
        Self {
            server,
            disk,
            dir,
            socket,
            serving,
        }
    }

    fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket.display())
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Shuts down and checks every client connection was closed cleanly.
    async fn stop(self) {
        self.server.shutdown();
        within(self.serving).await.unwrap().unwrap();
        within(self.server.wait_idle()).await;
        assert_eq!(self.server.attached("disk"), 0);
    }
}

fn installed(tool: &str) -> bool {
    let found = std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|p| p.join(tool).is_file()));
    if !found {
        eprintln!("skipping: {tool} is not installed");
    }
    found
}

async fn run(program: &str, args: &[&str]) -> Output {
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        Command::new(program).args(args).kill_on_drop(true).output(),
    )
    .await
    .unwrap_or_else(|_| panic!("{program} timed out"))
    .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn random_file(path: &Path, len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let data: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(path, &data).unwrap();
    data
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_io_write_read_zero_discard() {
    if !installed("qemu-io") {
        return;
    }
    let f = Fixture::start();
    let out = run(
        "qemu-io",
        &[
            "-f",
            "raw",
            &f.uri("disk"),
            "-c",
            "write -P 0xab 0 1M",
            "-c",
            "read -P 0xab 0 1M",
            "-c",
            "write -z 4k 4k",
            "-c",
            "read -P 0 4k 4k",
            "-c",
            "discard 1M 64k",
            "-c",
            "write -f -P 0xcd 2M 512",
            "-c",
            "flush",
            "-c",
            "read -P 0xcd 2M 512",
        ],
    )
    .await;
    let text = stdout(&out);
    assert!(!text.contains("Pattern verification failed"), "{text}");
    {
        let data = f.disk.data.lock().unwrap();
        assert!(data[..4096].iter().all(|b| *b == 0xab));
        assert!(data[4096..8192].iter().all(|b| *b == 0));
        assert!(data[2 << 20..(2 << 20) + 512].iter().all(|b| *b == 0xcd));
    }
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_lists_exports_and_maps_holes() {
    if !installed("nbdinfo") {
        return;
    }
    let f = Fixture::start();
    let socket = format!("nbd+unix://?socket={}", f.socket.display());
    let list = stdout(&run("nbdinfo", &["--list", &socket]).await);
    assert!(list.contains("export=\"disk\""), "{list}");
    assert!(list.contains("export=\"ro\""), "{list}");
    assert!(list.contains("base:allocation"), "{list}");
    assert!(list.contains("can_multi_conn: true"), "{list}");
    // Two data runs in a sparse disk.
    {
        let mut alloc = f.disk.allocated.lock().unwrap();
        for b in 16..32 {
            alloc[b] = true;
        }
        for b in 1000..1001 {
            alloc[b] = true;
        }
    }
    let map = stdout(&run("nbdinfo", &["--map", &f.uri("disk")]).await);
    let rows: Vec<(u64, u64, u32)> = map
        .lines()
        .map(|l| {
            let mut w = l.split_whitespace();
            let mut n = || w.next().unwrap().parse::<u64>().unwrap();
            (n(), n(), n() as u32)
        })
        .collect();
    assert_eq!(
        rows,
        vec![
            (0, 16 * BLOCK, 3),
            (16 * BLOCK, 16 * BLOCK, 0),
            (32 * BLOCK, 968 * BLOCK, 3),
            (1000 * BLOCK, BLOCK, 0),
            (1001 * BLOCK, DISK_BYTES - 1001 * BLOCK, 3),
        ],
        "{map}"
    );
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdcopy_round_trip_over_four_connections() {
    if !installed("nbdcopy") {
        return;
    }
    let f = Fixture::start();
    let src = f.path("src.img");
    let data = random_file(&src, DISK_BYTES as usize, 42);
    run(
        "nbdcopy",
        &[
            "--connections=4",
            "--requests=16",
            src.to_str().unwrap(),
            &f.uri("disk"),
        ],
    )
    .await;
    assert!(f.disk.data.lock().unwrap()[..] == data[..]);
    let back = f.path("back.img");
    run("nbdcopy", &[&f.uri("disk"), back.to_str().unwrap()]).await;
    assert!(std::fs::read(&back).unwrap() == data);
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_img_info_convert_compare() {
    if !installed("qemu-img") {
        return;
    }
    let f = Fixture::start();
    let info = stdout(&run("qemu-img", &["info", &f.uri("disk")]).await);
    assert!(info.contains("64 MiB"), "{info}");
    // A sparse source: data at the start and the end only.
    let src = f.path("src.img");
    let mut data = random_file(&src, 1 << 20, 7);
    data.resize(DISK_BYTES as usize - (1 << 20), 0);
    data.extend(std::iter::repeat_n(0x77u8, 1 << 20));
    std::fs::write(&src, &data).unwrap();
    run(
        "qemu-img",
        &[
            "convert",
            "-n",
            "-f",
            "raw",
            "-O",
            "raw",
            src.to_str().unwrap(),
            &f.uri("disk"),
        ],
    )
    .await;
    run(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            src.to_str().unwrap(),
            &f.uri("disk"),
        ],
    )
    .await;
    let out = f.path("out.qcow2");
    run(
        "qemu-img",
        &[
            "convert",
            "-O",
            "qcow2",
            &f.uri("disk"),
            out.to_str().unwrap(),
        ],
    )
    .await;
    run(
        "qemu-img",
        &["compare", src.to_str().unwrap(), out.to_str().unwrap()],
    )
    .await;
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libnbd_sees_negotiated_features() {
    let python = "/usr/bin/python3";
    if !Path::new(python).exists() {
        eprintln!("skipping: {python} missing");
        return;
    }
    let probe = Command::new(python)
        .args(["-c", "import nbd"])
        .output()
        .await;
    if !probe.is_ok_and(|o| o.status.success()) {
        eprintln!("skipping: python3 nbd module (libnbd) missing");
        return;
    }
    let f = Fixture::start();
    let script = r#"
import nbd, errno, sys
uri = sys.argv[1]
h = nbd.NBD()
h.add_meta_context("base:allocation")
h.connect_uri(uri)
assert h.get_structured_replies_negotiated()
assert h.can_meta_context("base:allocation")
assert h.can_df() and h.can_fast_zero() and h.can_multi_conn()
assert h.can_flush() and h.can_fua() and h.can_trim() and h.can_zero()
assert h.get_block_size(nbd.SIZE_PREFERRED) == 4096
h.pwrite(b"z" * 8192, 8192, nbd.CMD_FLAG_FUA)
seen = []
h.block_status(65536, 0, lambda ctx, off, e, err: seen.append(list(e)))
assert seen[-1] == [8192, 3, 8192, 0, 49152, 3], seen
h.block_status(65536, 0, lambda ctx, off, e, err: seen.append(list(e)), nbd.CMD_FLAG_REQ_ONE)
assert seen[-1] == [8192, 3], seen
h.zero(4096, 8192, nbd.CMD_FLAG_FAST_ZERO)
assert h.pread(4096, 8192) == bytearray(4096)
try:
    h.zero(4096, 8192, nbd.CMD_FLAG_FAST_ZERO | nbd.CMD_FLAG_NO_HOLE)
    raise SystemExit("fast zero with NO_HOLE should fail")
except nbd.Error as e:
    assert e.errnum == errno.ENOTSUP, e
h.set_strict_mode(0)
for call, want in [(lambda: h.pread(2, h.get_size() - 1), errno.EINVAL),
                   (lambda: h.pwrite(b"ab", h.get_size() - 1), errno.ENOSPC)]:
    try:
        call()
        raise SystemExit("out of range request succeeded")
    except nbd.Error as e:
        assert e.errnum == want, e
h.flush()
h.shutdown()
print("ok")
"#;
    let out = run(python, &["-c", script, &f.uri("disk")]).await;
    assert_eq!(stdout(&out).trim(), "ok");
    f.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fio_random_writes_verify() {
    if std::env::var_os("BULWARK_SLOW_TESTS").is_none() {
        eprintln!("skipping: set BULWARK_SLOW_TESTS=1 to run fio");
        return;
    }
    if !installed("fio") {
        return;
    }
    let f = Fixture::start();
    let report = f.path("fio.json");
    run(
        "fio",
        &[
            "--ioengine=nbd",
            &format!("--uri={}", f.uri("disk")),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=32",
            "--verify=crc32c",
            "--verify_state_save=0",
            "--size=64M",
            "--name=t",
            "--output-format=json",
            &format!("--output={}", report.display()),
        ],
    )
    .await;
    // fio exits nonzero on a verify mismatch; also check the job's error
    // and that the verify pass read back everything written.
    let json = std::fs::read_to_string(&report).unwrap();
    assert!(json.contains("\"error\" : 0"), "{json}");
    let read_bytes = format!("\"io_bytes\" : {DISK_BYTES}");
    assert_eq!(json.matches(&read_bytes).count(), 2, "{json}");
    f.stop().await;
}
