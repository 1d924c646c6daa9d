//! Graceful shutdown: accepting stops, in-flight requests still get their
//! replies, `wait_idle` resolves only after the last backend call, and a
//! client that stops reading cannot hold shutdown up forever; `revoke` stops
//! the connections it names the same way.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bulwark_nbd::proto::*;
use bulwark_nbd::{Server, ServerConfig};
use common::*;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

#[tokio::test]
async fn in_flight_requests_complete_after_shutdown() {
    let (server, disk, _) = server();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let serving = tokio::spawn(server.clone().serve_unix(listener));

    let (mut a, _, _) = Client::open(UnixStream::connect(&path).await.unwrap(), "disk").await;
    let (mut b, _, _) = Client::open(UnixStream::connect(&path).await.unwrap(), "disk").await;
    assert_eq!(server.attached("disk"), 2);
    assert_eq!(server.attached("ro"), 0);

    disk.close_gate();
    let handles = [
        a.send(CMD_READ, 0, 0, 4096, &[]).await,
        a.send(CMD_READ, 0, 4096, 4096, &[]).await,
    ];
    disk.until_inflight(2).await;

    server.shutdown();
    within(serving).await.unwrap().unwrap();
    // No new connections once shut down.
    assert!(UnixStream::connect(&path).await.is_err() || server.is_shutting_down());

    // Idle connection `b` is closed; `a` waits for its reads.
    b.expect_closed().await;
    let idle = tokio::spawn({
        let server = server.clone();
        async move { server.wait_idle().await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !idle.is_finished(),
        "wait_idle resolved with backend calls running"
    );
    disk.open_gate();
    let mut got = vec![
        within(a.reply()).await.unwrap().handle(),
        within(a.reply()).await.unwrap().handle(),
    ];
    got.sort();
    assert_eq!(got, handles);
    a.expect_closed().await;
    within(idle).await.unwrap();
    assert_eq!(server.connections(), 0);
    assert_eq!(server.attached("disk"), 0);
}

#[tokio::test]
async fn handshaking_clients_are_closed_and_late_ones_refused() {
    let (server, _, _) = server();
    let (s, task) = pipe(&server);
    let mut c = Client::connect(s).await;
    server.shutdown();
    c.expect_closed().await;
    within(task).await.unwrap();
    // A stream handed over after shutdown is dropped at once.
    let (s, task) = pipe(&server);
    within(task).await.unwrap();
    drop(s);
    within(server.wait_idle()).await;
}

/// A client that sends reads and never reads the replies: after shutdown
/// the server gives each write `DRAIN_WRITE_TIMEOUT`, then hangs up. In
/// real time (so it takes `DRAIN_WRITE_TIMEOUT`, beside the socket variant
/// below): the workers are threads of their own, which paused time cannot
/// see, so it would run the clock past their work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_that_stops_reading_cannot_block_shutdown() {
    let (server, disk) = drain_server();
    let (client, server_end) = tokio::io::duplex(4096);
    let task = tokio::spawn(server.clone().serve_stream(server_end));
    stalled_client_is_dropped_after_the_drain_timeout(&server, &disk, client, task, 4, 4).await;
}

/// The same on a Unix socket (the threaded path, `direct.rs`), in real
/// time: its threads block in system calls, which paused time cannot see
/// (so this test takes `DRAIN_WRITE_TIMEOUT`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_that_stops_reading_cannot_block_shutdown_on_a_socket() {
    let (server, disk) = drain_server();
    let (client, server_end) = tokio::net::UnixStream::pair().unwrap();
    let task = tokio::spawn(server.clone().serve_stream(server_end));
    // The socket buffers more than the pipe: more reads to fill it. Once 8
    // have run, their replies (512 KiB) are more than the socket holds.
    stalled_client_is_dropped_after_the_drain_timeout(&server, &disk, client, task, 64, 8).await;
}

fn drain_server() -> (Arc<Server>, Arc<MemBackend>) {
    let (server, disk, _) = server_with(ServerConfig {
        max_request_bytes: 64 << 10,
        max_inflight_per_conn: 4,
        ..ServerConfig::default()
    });
    (server, disk)
}

/// Sends `reads` 64 KiB reads and never reads a reply; after shutdown the
/// server gives the pending writes `DRAIN_WRITE_TIMEOUT`, then hangs up.
/// The shutdown comes once `stuck` reads have run: enough that a reply
/// is waiting for a client that does not read.
async fn stalled_client_is_dropped_after_the_drain_timeout<S>(
    server: &Arc<Server>,
    disk: &MemBackend,
    client: S,
    task: tokio::task::JoinHandle<()>,
    reads: u64,
    stuck: usize,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut c, _, _) = Client::open(client, "disk").await;
    for i in 0..reads {
        c.send(CMD_READ, 0, i * 65536, 65536, &[]).await;
    }
    // A server that had run none by the shutdown would hang up at once,
    // with nothing stuck to drain (a fixed sleep here did not promise it).
    disk.until_calls(stuck).await;
    assert_eq!(server.connections(), 1);
    // Taken before the shutdown: the server's drain timer starts when its
    // connection task sees the shutdown, which on another runtime thread
    // may be before `shutdown` returns here (taken after it, `started`
    // once fell a hair inside the timeout, and the check below failed).
    let started = tokio::time::Instant::now();
    server.shutdown();
    tokio::time::timeout(Duration::from_secs(120), server.wait_idle())
        .await
        .expect("shutdown stalled on a client that does not read");
    // It was the drain timeout that ended the connection.
    assert!(started.elapsed() >= bulwark_nbd::limits::DRAIN_WRITE_TIMEOUT);
    task.await.unwrap();
    // The client end still exists; the server dropped its side.
    let _ = c.s.write_all(&[0]).await;
}

#[tokio::test]
async fn attached_counts_per_export() {
    let (server, _, _) = server();
    let mut clients = Vec::new();
    for name in ["disk", "disk", "ro", ""] {
        let (s, task) = pipe(&server);
        let (c, _, _) = Client::open(s, name).await;
        clients.push((c, task));
    }
    // The default export is attached under the name the client used.
    assert_eq!(server.attached("disk"), 2);
    assert_eq!(server.attached("ro"), 1);
    assert_eq!(server.attached(""), 1);
    assert_eq!(server.connections(), 4);
    let (mut c, task) = clients.remove(0);
    c.send(CMD_DISC, 0, 0, 0, &[]).await;
    within(task).await.unwrap();
    assert_eq!(server.attached("disk"), 1);
    server.shutdown();
    within(server.wait_idle()).await;
    assert_eq!(server.attached("disk") + server.attached("ro"), 0);
}

/// `revoke` stops only the connections its predicate no longer allows, as a
/// shutdown would: a request in flight still gets its reply, then the
/// connection closes; the others go on, and `wait_detached` sees it go.
/// On a socket (the threaded path) and on a pipe (the async path).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoke_stops_only_the_connections_no_longer_allowed() {
    let (server, disk, _) = server();
    let (a_sock, a_end) = UnixStream::pair().unwrap();
    let a_task = tokio::spawn(server.clone().serve_stream(a_end));
    let (mut a, _, _) = Client::open(a_sock, "disk").await;
    let (b_pipe, b_task) = pipe(&server);
    let (mut b, _, _) = Client::open(b_pipe, "disk").await;
    let (ro_sock, ro_end) = UnixStream::pair().unwrap();
    tokio::spawn(server.clone().serve_stream(ro_end));
    let (mut ro, _, _) = Client::open(ro_sock, "ro").await;
    // The server counts a connection as attached after it has sent the
    // handshake's last reply: on this runtime's other thread, maybe not yet.
    within(async {
        while server.attached("disk") < 2 || server.attached("ro") < 1 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    assert_eq!(server.attached("disk"), 2);

    // A read in flight on `a` when its access goes.
    disk.close_gate();
    let h = a.send(CMD_READ, 0, 0, 4096, &[]).await;
    disk.until_inflight(1).await;
    let ids = server.revoke(|export, _, _| export != "disk");
    assert_eq!(ids.len(), 2);
    // Nothing is stopped twice.
    assert!(server.revoke(|export, _, _| export != "disk").is_empty());
    b.expect_closed().await;
    within(b_task).await.unwrap();
    assert_eq!(
        server.wait_detached(&ids, Duration::from_millis(50)).await,
        1
    );
    disk.open_gate();
    let r = within(a.reply()).await.unwrap();
    assert_eq!((r.handle(), Client::<UnixStream>::errno_of(&r)), (h, 0));
    a.expect_closed().await;
    within(a_task).await.unwrap();
    assert_eq!(server.wait_detached(&ids, Duration::from_secs(10)).await, 0);
    assert_eq!(server.attached("disk"), 0);

    // The connection still allowed goes on.
    assert_eq!(server.attached("ro"), 1);
    let h = ro.send(CMD_READ, 0, 0, 4096, &[]).await;
    let r = within(ro.reply()).await.unwrap();
    assert_eq!((r.handle(), Client::<UnixStream>::errno_of(&r)), (h, 0));
}

/// Exports that allow each name `opens` times: the first `open` (the
/// handshake's) succeeds, a later one finds the access gone.
struct OpensOnce {
    disk: Arc<MemBackend>,
    opens: std::sync::atomic::AtomicUsize,
}

impl bulwark_nbd::Exports for OpensOnce {
    fn list(&self, _: &bulwark_nbd::Client) -> Vec<String> {
        vec!["disk".into()]
    }
    fn open(&self, _: &str, _: &bulwark_nbd::Client) -> Option<Arc<dyn bulwark_nbd::Backend>> {
        (self.opens.fetch_add(1, Ordering::SeqCst) == 0)
            .then(|| Arc::clone(&self.disk) as Arc<dyn bulwark_nbd::Backend>)
    }
}

/// Access taken away between the handshake's open and the connection being
/// counted as attached (where `revoke` cannot see it yet) still ends the
/// connection: the server asks again once it is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_gone_before_attach_ends_the_connection() {
    let exports = Arc::new(OpensOnce {
        disk: MemBackend::new(1 << 20),
        opens: Default::default(),
    });
    let server = Server::new(exports.clone(), ServerConfig::default());
    let (sock, end) = UnixStream::pair().unwrap();
    let task = tokio::spawn(server.clone().serve_stream(end));
    let (mut c, _, _) = Client::open(sock, "disk").await;
    c.expect_closed().await;
    within(task).await.unwrap();
    assert_eq!(exports.opens.load(Ordering::SeqCst), 2);
    assert_eq!(server.attached("disk"), 0);
}

/// A revoked connection runs no request still queued on its socket: those
/// already running are answered, the rest are dropped with the connection.
/// (A read after SHUT_RD still returns what the socket holds: before the
/// threads checked for a stop, all 40 ran.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_connection_runs_nothing_still_queued() {
    let (server, disk, _) = server();
    let (sock, end) = UnixStream::pair().unwrap();
    let task = tokio::spawn(server.clone().serve_stream(end));
    let (mut c, _, _) = Client::open(sock, "disk").await;
    disk.close_gate();
    for i in 0..40u64 {
        c.send(CMD_READ, 0, i * 4096, 4096, &[]).await;
    }
    // The server takes up to its bound of requests (8 in flight, 8 workers),
    // all held at the gate; the rest wait unread.
    disk.until_inflight(8).await;
    let running = disk.calls.load(Ordering::SeqCst);
    assert_eq!(running, 8, "the server ran more than its bound");
    assert_eq!(server.revoke(|_, _, _| false).len(), 1);
    tokio::time::sleep(Duration::from_millis(100)).await;
    disk.open_gate();
    let mut replies = 0;
    while let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(10), c.reply()).await {
        assert_eq!(Client::<UnixStream>::errno_of(&r), 0);
        replies += 1;
    }
    within(task).await.unwrap();
    let ran = disk.calls.load(Ordering::SeqCst);
    assert_eq!(replies, ran, "every request that ran was answered");
    assert!(
        ran <= running + 1,
        "{ran} requests ran, {running} were running at the revoke"
    );
}
