//! The daemon's life as a user and a supervisor see it: start, answer the CLI
//! and raw control-protocol lines (errors with a kind a script can match:
//! `not_found` apart from `busy`), refuse to destroy or lock an attached
//! volume, stop cleanly on SIGTERM (exit 0, sockets gone), and start again
//! over the stale sockets a `kill -9` leaves behind.
//!
//! Data through real NBD clients (qemu-io, nbdcopy, ...) is proven by the
//! integration suite in `tests/` at the repository root; here a volume is
//! attached with the smallest NBD handshake that holds a connection open.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const START_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

struct Daemon {
    child: Child,
    log: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn bulwark(pool: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_bulwark"))
        .arg("--pool")
        .arg(pool)
        .args(args)
        .env_remove("BULWARK_POOL")
        .output()
        .expect("run bulwark")
}

fn ok(pool: &Path, args: &[&str]) -> String {
    let o = bulwark(pool, args);
    assert!(
        o.status.success(),
        "bulwark {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

fn refused(pool: &Path, args: &[&str]) -> String {
    let o = bulwark(pool, args);
    assert_eq!(
        o.status.code(),
        Some(1),
        "bulwark {args:?} should fail: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    String::from_utf8(o.stderr).unwrap()
}

fn start(pool: &Path, n: usize) -> Daemon {
    let log = pool.parent().unwrap().join(format!("serve-{n}.log"));
    let child = Command::new(env!("CARGO_BIN_EXE_bulwark"))
        .arg("serve")
        .arg(pool)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("start bulwark serve");
    let mut daemon = Daemon { child, log };
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Some(status) = daemon.child.try_wait().unwrap() {
            panic!(
                "serve exited with {status} during start:\n{}",
                daemon.log_text()
            );
        }
        // The daemon answers on its control socket a moment before it
        // prints that it serves: wait for both.
        if bulwark(pool, &["status"]).status.success()
            && daemon.log_text().contains("bulwark: serving pool")
        {
            return daemon;
        }
        assert!(
            Instant::now() < deadline,
            "serve did not answer status:\n{}",
            daemon.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl Daemon {
    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn signal(&self, sig: i32) {
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, sig) }, 0);
    }

    fn wait(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "serve did not exit:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Attach to an export with NBD_OPT_EXPORT_NAME and hold the connection open.
fn attach(socket: &Path, name: &str) -> UnixStream {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).unwrap();
    assert_eq!(&hello[..8], b"NBDMAGIC");
    assert_eq!(&hello[8..16], b"IHAVEOPT");
    s.write_all(&3u32.to_be_bytes()).unwrap(); // FIXED_NEWSTYLE | NO_ZEROES
    let mut opt = b"IHAVEOPT".to_vec();
    opt.extend_from_slice(&1u32.to_be_bytes()); // NBD_OPT_EXPORT_NAME
    opt.extend_from_slice(&(name.len() as u32).to_be_bytes());
    opt.extend_from_slice(name.as_bytes());
    s.write_all(&opt).unwrap();
    let mut export = [0u8; 10]; // size, transmission flags
    s.read_exact(&mut export).unwrap();
    s
}

/// One raw request line on the control socket, one answer line back.
fn control_line(conn: &mut (BufReader<UnixStream>, UnixStream), line: &str) -> serde_json::Value {
    conn.1.write_all(line.as_bytes()).unwrap();
    conn.1.write_all(b"\n").unwrap();
    let mut answer = String::new();
    conn.0.read_line(&mut answer).unwrap();
    serde_json::from_str(&answer).unwrap()
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// A one-device pool of 64 MiB in `tmp/pool`.
fn create_pool(tmp: &Path) -> PathBuf {
    let pool = tmp.join("pool");
    let out = Command::new(env!("CARGO_BIN_EXE_bulwark"))
        .args(["pool", "create"])
        .arg(&pool)
        // The test's own registry of pools, not this host's.
        .env("BULWARK_REGISTRY", tmp.join("registry.json"))
        .args([
            "--layout",
            "single",
            "--devices",
            "1",
            "--device-size",
            "64M",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    pool
}

/// Waits until the daemon counts `n` NBD connections to `volume`.
fn wait_attached(pool: &Path, volume: &str, n: u64) -> serde_json::Value {
    // The server counts a connection once it has sent the handshake's reply.
    let deadline = Instant::now() + START_TIMEOUT;
    let status = loop {
        let status: serde_json::Value =
            serde_json::from_str(&ok(pool, &["status", "--json"])).unwrap();
        if status["daemon"]["attached"][volume] == n || Instant::now() > deadline {
            break status;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status["daemon"]["attached"][volume], n, "{status}");
    status
}

#[test]
fn serve_lifecycle() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = create_pool(tmp.path());
    let p = pool.as_path();

    let mut daemon = start(p, 1);
    let nbd_sock = pool.join("nbd.sock");
    let control_sock = pool.join("control.sock");
    assert!(daemon.log_text().contains(&format!(
        "bulwark: serving pool {} (nbd socket {})",
        p.display(),
        nbd_sock.display()
    )));
    assert_eq!(mode(&nbd_sock), 0o600);
    assert_eq!(mode(&control_sock), 0o600);

    let key = tmp.path().join("key");
    std::fs::write(&key, [7u8; 32]).unwrap();
    // Secret files must be private: the daemon refuses ones other users can read.
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let key = key.to_str().unwrap();
    let created = ok(
        p,
        &["volume", "create", "v", "--size", "16M", "--key-file", key],
    );
    assert!(
        created.starts_with("created volume v: 16M, block size 4K, compression lz4, encryption on"),
        "{created}"
    );
    ok(
        p,
        &[
            "volume",
            "create",
            "plain",
            "--size",
            "8M",
            "--encryption",
            "off",
            "--compression",
            "off",
        ],
    );

    // Attached volumes can be neither destroyed nor locked.
    let conn = attach(&nbd_sock, "v");
    let status = wait_attached(p, "v", 1);
    assert_eq!(status["state"], "ONLINE");
    let err = refused(p, &["volume", "destroy", "v"]);
    assert_eq!(err, "error: volume v is in use by 1 NBD connection(s)\n");
    let err = refused(p, &["key", "unload", "v"]);
    assert_eq!(err, "error: volume v is in use by 1 NBD connection(s)\n");
    drop(conn);
    let deadline = Instant::now() + START_TIMEOUT;
    while bulwark(p, &["key", "unload", "v"]).status.code() != Some(0) {
        assert!(Instant::now() < deadline, "the detach was never noticed");
        std::thread::sleep(Duration::from_millis(50));
    }
    let list: serde_json::Value =
        serde_json::from_str(&ok(p, &["volume", "list", "--json"])).unwrap();
    let v = list
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "v")
        .unwrap();
    assert_eq!(v["key_status"], "unavailable", "{list}");
    assert_eq!(v["locked"], true);
    let table = ok(p, &["volume", "list"]);
    assert!(
        table.starts_with(
            "NAME   SIZE  USED  BLOCKSIZE  COMPRESS  ENCRYPTION  KEY          KEYGEN  SLOTS  ATTACHED  ORIGIN\n"
        ),
        "{table}"
    );
    ok(p, &["key", "load", "v", "--key-file", key]);
    ok(p, &["volume", "destroy", "plain"]);
    let text = ok(p, &["status"]);
    assert!(text.contains("errors: No known data errors"), "{text}");

    // The raw protocol: several requests per connection, errors as answers.
    let stream = UnixStream::connect(&control_sock).unwrap();
    let mut conn = (BufReader::new(stream.try_clone().unwrap()), stream);
    let a = control_line(&mut conn, r#"{"op":"volume_list"}"#);
    assert_eq!(a["ok"], true);
    assert_eq!(a["result"].as_array().unwrap().len(), 1);
    let a = control_line(&mut conn, r#"{"op":"format_everything"}"#);
    assert_eq!(a["ok"], false);
    assert!(
        a["error"]
            .as_str()
            .unwrap()
            .starts_with("malformed request"),
        "{a}"
    );
    let a = control_line(
        &mut conn,
        r#"{"op":"key_load","name":"v","secret":{"kind":"key_file","path":"key"}}"#,
    );
    assert_eq!(a["ok"], false);
    assert!(a["error"].as_str().unwrap().contains("not absolute"), "{a}");
    let a = control_line(&mut conn, r#"{"op":"volume_destroy","name":"nosuch"}"#);
    assert_eq!(
        a,
        serde_json::json!({"ok": false, "error": "volume 'nosuch' does not exist", "kind": "not_found"})
    );
    drop(conn);

    // SIGTERM: final commit, sockets removed, exit 0.
    daemon.signal(libc::SIGTERM);
    let status = daemon.wait();
    assert!(
        status.success(),
        "exit {status} after SIGTERM:\n{}",
        daemon.log_text()
    );
    assert!(
        !nbd_sock.exists() && !control_sock.exists(),
        "sockets left behind"
    );
    assert!(refused(p, &["status"]).contains("cannot reach the bulwark daemon"));

    // kill -9 leaves stale sockets; the next start replaces them, the volume is back, locked.
    let mut daemon = start(p, 2);
    daemon.signal(libc::SIGKILL);
    daemon.wait();
    assert!(nbd_sock.exists() && control_sock.exists());
    let mut daemon = start(p, 3);
    let list: serde_json::Value =
        serde_json::from_str(&ok(p, &["volume", "list", "--json"])).unwrap();
    assert_eq!(list[0]["name"], "v");
    assert_eq!(list[0]["key_status"], "unavailable");
    daemon.signal(libc::SIGINT);
    assert!(
        daemon.wait().success(),
        "exit after SIGINT:\n{}",
        daemon.log_text()
    );
}

/// Scripts on the control socket tell failures apart by `kind`, not by
/// parsing messages: a volume that does not exist is `not_found`, one held
/// by an NBD client `busy`; the CLI still prints the same message line.
#[test]
fn control_errors_carry_a_kind() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = create_pool(tmp.path());
    let p = pool.as_path();
    let mut daemon = start(p, 1);
    ok(
        p,
        &[
            "volume",
            "create",
            "v",
            "--size",
            "8M",
            "--encryption",
            "off",
        ],
    );
    let conn_nbd = attach(&pool.join("nbd.sock"), "v");
    wait_attached(p, "v", 1);

    let stream = UnixStream::connect(pool.join("control.sock")).unwrap();
    let mut conn = (BufReader::new(stream.try_clone().unwrap()), stream);
    let mut answer = |line: &str| {
        let a = control_line(&mut conn, line);
        assert_eq!(a["ok"], false, "{line}: {a}");
        (
            a["kind"].as_str().unwrap().to_owned(),
            a["error"].as_str().unwrap().to_owned(),
        )
    };
    let (kind, missing) = answer(r#"{"op":"volume_destroy","name":"nosuch"}"#);
    assert_eq!(kind, "not_found");
    let (kind, in_use) = answer(r#"{"op":"volume_destroy","name":"v"}"#);
    assert_eq!(kind, "busy");
    assert_eq!(
        answer(r#"{"op":"key_unload","name":"v"}"#).0,
        "busy",
        "key unload of an attached volume"
    );
    assert_eq!(
        answer(r#"{"op":"volume_create","name":"v","size_bytes":8388608,"block_size":4096,"compression":"off","encryption":false,"secret":null}"#).0,
        "exists"
    );
    assert_eq!(answer(r#"{"op":"no_such_op"}"#).0, "invalid");
    assert_eq!(
        answer(r#"{"op":"grant_remove","client":"cn:nobody","volume":"v"}"#).0,
        "not_found"
    );

    // The CLI's line is the message, unchanged.
    assert_eq!(
        refused(p, &["volume", "destroy", "nosuch"]),
        format!("error: {missing}\n")
    );
    assert_eq!(
        refused(p, &["volume", "destroy", "v"]),
        format!("error: {in_use}\n")
    );
    drop(conn_nbd);
    daemon.signal(libc::SIGTERM);
    assert!(daemon.wait().success(), "{}", daemon.log_text());
}
