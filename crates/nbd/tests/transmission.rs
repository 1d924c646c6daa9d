//! Transmission phase: data round trips with simple and structured replies,
//! every edge-validation error, block status, and many requests in flight at
//! once; each test runs on both transmission paths (`async_path`: an
//! in-memory pipe, as TLS streams are served; `direct_path`: a Unix socket
//! pair, as Unix and plain TCP clients are served).

mod common;

use std::sync::atomic::Ordering;

use bulwark_nbd::errno::*;
use bulwark_nbd::proto::*;
use bulwark_nbd::ServerConfig;
use common::*;
use tokio::io::DuplexStream;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

async fn simple_replies_round_trip<P: Pipe>() {
    let (server, disk, _) = server();
    let (s, _task) = P::pipe(&server);
    let mut c = Client::<P>::connect(s).await;
    c.go("disk").await.unwrap();
    let data = pattern(8192, 7);
    let r = c.call(CMD_WRITE, CMD_FLAG_FUA, 4096, 8192, &data).await;
    assert_eq!(Client::<P>::errno_of(&r), 0);
    let r = c.call(CMD_READ, 0, 4096, 8192, &[]).await;
    assert_eq!(
        r,
        Reply::Simple {
            handle: r.handle(),
            error: 0,
            data: data.clone()
        }
    );
    assert_eq!(&disk.data.lock().unwrap()[4096..12288], &data[..]);
    // Unaligned is fine: minimum block size is 1.
    let r = c.call(CMD_READ, 0, 4097, 3, &[]).await;
    let Reply::Simple { data: got, .. } = r else {
        panic!()
    };
    assert_eq!(got, data[1..4]);
    assert_eq!(
        Client::<P>::errno_of(&c.call(CMD_FLUSH, 0, 0, 0, &[]).await),
        0
    );
    assert_eq!(
        Client::<P>::errno_of(&c.call(CMD_TRIM, 0, 0, 4096, &[]).await),
        0
    );
    assert_eq!(
        Client::<P>::errno_of(
            &c.call(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 4096, 100, &[])
                .await
        ),
        0
    );
    assert!(disk.data.lock().unwrap()[4096..4196]
        .iter()
        .all(|b| *b == 0));
    // A read error: no payload follows the simple reply.
    disk.fail_reads.store(true, Ordering::SeqCst);
    assert_eq!(
        Client::<P>::errno_of(&c.call(CMD_READ, 0, 0, 512, &[]).await),
        EIO as u32
    );
    disk.fail_reads.store(false, Ordering::SeqCst);
    assert_eq!(
        Client::<P>::errno_of(&c.call(CMD_READ, 0, 0, 512, &[]).await),
        0
    );
}

async fn structured_read_is_one_data_chunk<P: Pipe>() {
    let (server, disk, _) = server();
    let (s, _task) = P::pipe(&server);
    let (mut c, _, flags) = Client::<P>::open(s, "disk").await;
    assert_ne!(flags & FLAG_SEND_DF, 0);
    let data = pattern(64 << 10, 3);
    c.call(CMD_WRITE, 0, 0, 64 << 10, &data).await;
    for flags in [0, CMD_FLAG_DF] {
        let r = c.call(CMD_READ, flags, 0, 64 << 10, &[]).await;
        let Reply::Chunk { header, payload } = r else {
            panic!("simple reply to a structured read")
        };
        assert_eq!(header.kind, REPLY_TYPE_OFFSET_DATA);
        assert_eq!(header.flags, REPLY_FLAG_DONE);
        assert_eq!(u64::from_be_bytes(payload[..8].try_into().unwrap()), 0);
        assert_eq!(payload[8..], data[..]);
    }
    // Zero-length read: a lone NONE chunk.
    let r = c.call(CMD_READ, 0, 100, 0, &[]).await;
    let Reply::Chunk { header, .. } = r else {
        panic!()
    };
    assert_eq!(
        (header.kind, header.flags),
        (REPLY_TYPE_NONE, REPLY_FLAG_DONE)
    );
    // Errors are structured error chunks with a message.
    disk.fail_reads.store(true, Ordering::SeqCst);
    let r = c.call(CMD_READ, 0, 0, 512, &[]).await;
    let Reply::Chunk { header, payload } = r else {
        panic!()
    };
    assert_eq!(
        (header.kind, header.flags),
        (REPLY_TYPE_ERROR, REPLY_FLAG_DONE)
    );
    let (err, msg) = parse_error_chunk(&payload).unwrap();
    assert_eq!(err, EIO as u32);
    assert!(!msg.is_empty());
}

async fn edge_validation_errors<P: Pipe>() {
    let (server, disk, _) = server();
    let (s, _task) = P::pipe(&server);
    let (mut c, size, _) = Client::<P>::open(s, "disk").await;
    let cases: Vec<(u16, u16, u64, u32, u32)> = vec![
        // (command, flags, offset, length, expected errno)
        (CMD_READ, 0, size, 1, EINVAL as u32),
        (CMD_READ, 0, u64::MAX, 1, EINVAL as u32),
        (CMD_READ, 0, 0, (64 << 10) + 1, EINVAL as u32),
        (CMD_READ, CMD_FLAG_REQ_ONE, 0, 1, EINVAL as u32),
        (CMD_READ, 1 << 15, 0, 1, EINVAL as u32),
        (CMD_TRIM, 0, size - 1, 2, EINVAL as u32),
        (CMD_WRITE_ZEROES, 0, size, 1, ENOSPC as u32),
        (CMD_WRITE_ZEROES, 0, u64::MAX - 1, 4, ENOSPC as u32),
        (
            CMD_WRITE_ZEROES,
            CMD_FLAG_FAST_ZERO | CMD_FLAG_NO_HOLE,
            0,
            1,
            ENOTSUP as u32,
        ),
        (CMD_FLUSH, 0, 1, 0, EINVAL as u32),
        (CMD_FLUSH, CMD_FLAG_DF, 0, 0, EINVAL as u32),
        (CMD_BLOCK_STATUS, 0, 0, 0, EINVAL as u32),
        (CMD_BLOCK_STATUS, 0, size, 1, EINVAL as u32),
        (CMD_BLOCK_STATUS, CMD_FLAG_NO_HOLE, 0, 1, EINVAL as u32),
        (CMD_CACHE, 0, 0, 1, EINVAL as u32),
        (CMD_RESIZE, 0, 0, 0, EINVAL as u32),
        (0x7777, 0, 0, 0, EINVAL as u32),
    ];
    for (kind, flags, offset, length, want) in cases {
        let r = c.call(kind, flags, offset, length, &[]).await;
        assert_eq!(
            Client::<P>::errno_of(&r),
            want,
            "{} flags={flags:#x} offset={offset} length={length}",
            cmd_name(kind)
        );
    }
    // Writes beyond the end: the payload is consumed, ENOSPC returned, and
    // the stream stays in sync.
    let r = c.call(CMD_WRITE, 0, size - 100, 200, &[1; 200]).await;
    assert_eq!(Client::<P>::errno_of(&r), ENOSPC as u32);
    let r = c.call(CMD_WRITE, CMD_FLAG_NO_HOLE, 0, 10, &[1; 10]).await;
    assert_eq!(Client::<P>::errno_of(&r), EINVAL as u32);
    // Zero lengths succeed without touching the backend.
    let before = disk.calls.load(Ordering::SeqCst);
    for kind in [CMD_WRITE, CMD_TRIM, CMD_WRITE_ZEROES] {
        assert_eq!(
            Client::<P>::errno_of(&c.call(kind, 0, size, 0, &[]).await),
            0
        );
    }
    assert_eq!(disk.calls.load(Ordering::SeqCst), before);
    assert_eq!(
        Client::<P>::errno_of(&c.call(CMD_READ, 0, 0, 1, &[]).await),
        0
    );
}

async fn read_only_export_refuses_writes<P: Pipe>() {
    let (server, _, ro) = server();
    let (s, _task) = P::pipe(&server);
    let (mut c, _, _) = Client::<P>::open(s, "ro").await;
    assert_eq!(
        Client::<P>::errno_of(&c.call(CMD_WRITE, 0, 0, 4, &[1, 2, 3, 4]).await),
        EPERM as u32
    );
    assert_eq!(
        Client::<P>::errno_of(&c.call(CMD_TRIM, 0, 0, 4096, &[]).await),
        EPERM as u32
    );
    assert_eq!(
        Client::<P>::errno_of(&c.call(CMD_WRITE_ZEROES, 0, 0, 4096, &[]).await),
        EPERM as u32
    );
    assert_eq!(
        Client::<P>::errno_of(&c.call(CMD_READ, 0, 0, 4096, &[]).await),
        0
    );
    assert_eq!(
        Client::<P>::errno_of(&c.call(CMD_FLUSH, 0, 0, 0, &[]).await),
        0
    );
    assert_eq!(ro.calls.load(Ordering::SeqCst), 2);
}

async fn block_status_reports_holes_and_respects_req_one<P: Pipe>() {
    let (server, _, _) = server();
    let (s, _task) = P::pipe(&server);
    let (mut c, _, _) = Client::<P>::open(s, "disk").await;
    // Blocks 2 and 3 allocated, the rest holes.
    c.call(
        CMD_WRITE,
        0,
        2 * BLOCK,
        2 * BLOCK as u32,
        &vec![9; 2 * BLOCK as usize],
    )
    .await;
    let status = |r: Reply| {
        let Reply::Chunk { header, payload } = r else {
            panic!("block status needs a structured reply")
        };
        assert_eq!(header.kind, REPLY_TYPE_BLOCK_STATUS);
        assert_eq!(header.flags, REPLY_FLAG_DONE);
        parse_block_status_chunk(&payload).unwrap().1
    };
    let hz = STATE_HOLE | STATE_ZERO;
    let d = |length: u64, flags: u32| Descriptor {
        length: length as u32,
        flags,
    };
    // Coalesced, and never past the requested length.
    assert_eq!(
        status(
            c.call(CMD_BLOCK_STATUS, 0, 0, 5 * BLOCK as u32 + 10, &[])
                .await
        ),
        vec![d(2 * BLOCK, hz), d(2 * BLOCK, 0), d(BLOCK + 10, hz)]
    );
    assert_eq!(
        status(c.call(CMD_BLOCK_STATUS, 0, 100, 50, &[]).await),
        vec![d(50, hz)]
    );
    assert_eq!(
        status(
            c.call(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 0, 5 * BLOCK as u32, &[])
                .await
        ),
        vec![d(2 * BLOCK, hz)]
    );
    assert_eq!(
        status(
            c.call(
                CMD_BLOCK_STATUS,
                CMD_FLAG_REQ_ONE | CMD_FLAG_FUA,
                3 * BLOCK - 1,
                3,
                &[]
            )
            .await
        ),
        vec![d(3, 0)]
    );
    // Trim punches the hole back.
    c.call(CMD_TRIM, 0, 2 * BLOCK, BLOCK as u32, &[]).await;
    assert_eq!(
        status(c.call(CMD_BLOCK_STATUS, 0, 0, 4 * BLOCK as u32, &[]).await),
        vec![d(3 * BLOCK, hz), d(BLOCK, 0)]
    );
}

async fn many_requests_in_flight<P: Pipe>() {
    let (server, disk, _) = server();
    let (s, _task) = P::pipe(&server);
    let (mut c, _, _) = Client::<P>::open(s, "disk").await;
    // Writes to distinct blocks, all sent before any reply is read.
    let mut handles = Vec::new();
    for i in 0..200u64 {
        let data = pattern(BLOCK as usize, i as u8);
        handles.push(c.send(CMD_WRITE, 0, i * BLOCK, BLOCK as u32, &data).await);
    }
    let mut seen = std::collections::HashSet::new();
    for _ in 0..200 {
        let r = within(c.reply()).await.unwrap();
        assert_eq!(Client::<P>::errno_of(&r), 0);
        assert!(seen.insert(r.handle()));
    }
    assert_eq!(seen.len(), handles.len());
    for i in 0..200u64 {
        let r = c.call(CMD_READ, 0, i * BLOCK, BLOCK as u32, &[]).await;
        let Reply::Chunk { payload, .. } = r else {
            panic!()
        };
        assert_eq!(payload[8..], pattern(BLOCK as usize, i as u8)[..]);
    }
    // Reads in flight together, bounded by max_inflight_per_conn (8).
    disk.close_gate();
    for i in 0..20u64 {
        c.send(CMD_READ, 0, i * BLOCK, BLOCK as u32, &[]).await;
    }
    disk.until_inflight(8).await;
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert_eq!(disk.inflight.load(Ordering::SeqCst), 8);
    disk.open_gate();
    for _ in 0..20 {
        assert_eq!(Client::<P>::errno_of(&within(c.reply()).await.unwrap()), 0);
    }
    assert!(disk.inflight_peak.load(Ordering::SeqCst) <= 8);
}

async fn disconnect_finishes_in_flight_requests_first<P: Pipe>() {
    let (server, disk, _) = server();
    let (s, task) = P::pipe(&server);
    let (mut c, _, _) = Client::<P>::open(s, "disk").await;
    disk.close_gate();
    let h1 = c.send(CMD_READ, 0, 0, 512, &[]).await;
    let h2 = c.send(CMD_READ, 0, 512, 512, &[]).await;
    c.send(CMD_DISC, 0, 0, 0, &[]).await;
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    disk.open_gate();
    let mut got = vec![
        within(c.reply()).await.unwrap().handle(),
        within(c.reply()).await.unwrap().handle(),
    ];
    got.sort();
    assert_eq!(got, vec![h1, h2]);
    c.expect_closed().await;
    within(task).await.unwrap();
    assert_eq!(server.attached("disk"), 0);
}

async fn oversized_write_closes_connection<P: Pipe>() {
    let (server, disk, _) = server();
    let (s, task) = P::pipe(&server);
    let (mut c, _, _) = Client::<P>::open(s, "disk").await;
    c.send(CMD_WRITE, 0, 0, (64 << 10) + 1, &[]).await;
    c.expect_closed().await;
    within(task).await.unwrap();
    assert_eq!(disk.calls.load(Ordering::SeqCst), 0);
}

async fn bad_request_magic_closes_connection<P: Pipe>() {
    use tokio::io::AsyncWriteExt;
    let (server, _, _) = server();
    let (s, task) = P::pipe(&server);
    let (mut c, _, _) = Client::<P>::open(s, "disk").await;
    let mut req = Request {
        flags: 0,
        kind: CMD_READ,
        handle: 1,
        offset: 0,
        length: 1,
    }
    .encode();
    req[0] = 0x12; // the historic, wrong-endian magic
    c.s.write_all(&req).await.unwrap();
    c.expect_closed().await;
    within(task).await.unwrap();
}

/// Requests that arrive together with a disconnect or a malformed request
/// (one write on the socket: the direct path reads them as one batch) are
/// run and answered before the connection closes.
async fn requests_ahead_of_the_end_are_answered<P: Pipe>() {
    use tokio::io::AsyncWriteExt;
    let req = |kind, handle, length| Request {
        flags: 0,
        kind,
        handle,
        offset: 0,
        length,
    };
    let mut malformed = req(CMD_READ, 3, BLOCK as u32).encode();
    malformed[0] ^= 0xff;
    for (seed, end) in [(9u8, req(CMD_DISC, 3, 0).encode()), (10, malformed)] {
        // Fewer threads than requests in flight: each thread reads batches.
        let (server, _, _) = server_with(ServerConfig {
            max_request_bytes: 64 << 10,
            max_inflight_per_conn: 16,
            max_workers_per_conn: 2,
            ..ServerConfig::default()
        });
        let (s, task) = P::pipe(&server);
        let (mut c, _, _) = Client::<P>::open(s, "disk").await;
        let data = pattern(BLOCK as usize, seed);
        let mut burst = req(CMD_WRITE, 1, BLOCK as u32).encode().to_vec();
        burst.extend_from_slice(&data);
        burst.extend_from_slice(&req(CMD_FLUSH, 2, 0).encode());
        burst.extend_from_slice(&end);
        c.s.write_all(&burst).await.unwrap();
        let mut got = Vec::new();
        for _ in 0..2 {
            let r = within(c.reply()).await.unwrap();
            assert_eq!(Client::<P>::errno_of(&r), 0);
            got.push(r.handle());
        }
        got.sort();
        assert_eq!(got, vec![1, 2], "replies before the end (seed {seed})");
        c.expect_closed().await;
        within(task).await.unwrap();
        let (s, _task) = P::pipe(&server);
        let (mut c, _, _) = Client::<P>::open(s, "disk").await;
        let Reply::Chunk { payload, .. } = c.call(CMD_READ, 0, 0, BLOCK as u32, &[]).await else {
            panic!("expected a data chunk")
        };
        assert_eq!(payload[8..], data[..], "seed {seed}");
    }
}

async fn backend_panic_is_eio_not_a_crash<P: Pipe>() {
    let (server, disk, _) = server();
    let (s, _task) = P::pipe(&server);
    let (mut c, _, _) = Client::<P>::open(s, "disk").await;
    disk.panic_on_flush.store(true, Ordering::SeqCst);
    assert_eq!(
        Client::<P>::errno_of(&c.call(CMD_FLUSH, 0, 0, 0, &[]).await),
        EIO as u32
    );
    disk.panic_on_flush.store(false, Ordering::SeqCst);
    assert_eq!(
        Client::<P>::errno_of(&c.call(CMD_FLUSH, 0, 0, 0, &[]).await),
        0
    );
}

async fn client_eof_without_disc_cleans_up<P: Pipe>() {
    let (server, _, _) = server();
    let (s, task) = P::pipe(&server);
    let (mut c, _, _) = Client::<P>::open(s, "disk").await;
    c.call(CMD_READ, 0, 0, 1, &[]).await;
    assert_eq!(server.attached("disk"), 1);
    drop(c);
    within(task).await.unwrap();
    assert_eq!(server.attached("disk"), 0);
    assert_eq!(server.connections(), 0);
}

/// 100,000 small reads with 32 always in flight: every one gets its reply,
/// once. (On the direct path replies are written by whichever thread holds
/// the write side; the race that once left a reply queued, and stalled
/// fio, is pinned down by `direct::tests::combiner_leaves_nothing_behind`.)
async fn every_reply_arrives_under_load<P: Pipe>() {
    let (server, _, _) = server();
    let (s, _task) = P::pipe(&server);
    let (mut c, _, _) = Client::<P>::open(s, "disk").await;
    const TOTAL: u64 = 100_000;
    const DEPTH: u64 = 32;
    let mut sent = 0u64;
    let mut seen = std::collections::HashSet::new();
    while sent < DEPTH {
        c.send(CMD_READ, 0, (sent % 64) * 512, 512, &[]).await;
        sent += 1;
    }
    while (seen.len() as u64) < TOTAL {
        let r = within(c.reply()).await.unwrap();
        assert_eq!(Client::<P>::errno_of(&r), 0);
        assert!(seen.insert(r.handle()), "handle answered twice");
        if sent < TOTAL {
            c.send(CMD_READ, 0, (sent % 64) * 512, 512, &[]).await;
            sent += 1;
        }
    }
}

/// A client that sends every request before it reads a reply (legal, if
/// rude): 64 KiB reads fill the socket towards it while its 64 KiB writes
/// fill the socket towards us. The server must go on reading requests while
/// replies wait for room; a thread that kept the read side across a cheap
/// batch hands it over before it waits (`direct.rs`, `stall`). The replies
/// stay within half the connection's reply bound (past the bound the server
/// stops reading until the client reads, as the spec allows), while the
/// writes are many times what the socket holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_replies_only_after_sending_everything_is_served() {
    use bulwark_nbd::limits::INFLIGHT_BYTES_PER_CONN_MAX;
    let (server, _, _) = server();
    let (s, _task) = tokio::net::UnixStream::pipe(&server);
    let (mut c, _, _) = Client::open(s, "disk").await;
    const PAIRS: u64 = INFLIGHT_BYTES_PER_CONN_MAX as u64 / 2 / 65536;
    let data = pattern(65536, 7);
    let mut handles = std::collections::HashSet::new();
    within(async {
        for i in 0..PAIRS {
            let offset = (i % 16) * 65536;
            handles.insert(c.send(CMD_READ, 0, offset, 65536, &[]).await);
            handles.insert(c.send(CMD_WRITE, 0, offset, 65536, &data).await);
        }
    })
    .await;
    for _ in 0..2 * PAIRS {
        let r = within(c.reply()).await.unwrap();
        assert_eq!(Client::<tokio::net::UnixStream>::errno_of(&r), 0);
        assert!(handles.remove(&r.handle()), "unknown or repeated handle");
    }
    assert!(handles.is_empty());
}

/// A Unix client that stops receiving (`shutdown(SHUT_RD)`) but keeps its
/// end open: the reply to its read fails with EPIPE while another thread
/// waits in `read` holding the read side (it took over while the read
/// waited at the gate). The connection must still end: the failed writer
/// once waited for that read side before shutting the socket down, and
/// hung with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_that_cannot_be_sent_ends_the_connection_while_a_read_waits() {
    use std::os::unix::io::AsRawFd;
    let (server, disk, _) = server();
    let (s, task) = tokio::net::UnixStream::pipe(&server);
    let (mut c, _, _) = Client::open(s, "disk").await;
    // SAFETY: shutdown on a socket this test owns.
    assert_eq!(unsafe { libc::shutdown(c.s.as_raw_fd(), libc::SHUT_RD) }, 0);
    disk.close_gate();
    c.send(CMD_READ, 0, 0, 4096, &[]).await;
    // Long enough for another thread to take the read side and wait in `read`.
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    disk.open_gate();
    within(task).await.unwrap();
    assert_eq!(server.connections(), 0);
}

/// A client that sends large reads and never reads the replies is no
/// longer read from once the replies waiting for it reach the connection's
/// byte bound (as on the async path), instead of making the server run
/// every read and hold every reply: before the bound, 300 reads of 1 MiB
/// made the server hold 300 MiB. Once the client reads, every reply comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_a_client_does_not_read_are_bounded() {
    use bulwark_nbd::limits::INFLIGHT_BYTES_PER_CONN_MAX;
    const MIB: u64 = 1 << 20;
    const READS: u64 = 300;
    let (server, disk, _) = server_with(ServerConfig {
        max_request_bytes: MIB as u32,
        max_inflight_per_conn: 8,
        max_workers_per_conn: 4,
        ..ServerConfig::default()
    });
    let (s, _task) = tokio::net::UnixStream::pipe(&server);
    let (mut c, _, _) = Client::open(s, "disk").await;
    let before = disk.calls.load(Ordering::SeqCst);
    let mut handles = std::collections::HashSet::new();
    within(async {
        for _ in 0..READS {
            handles.insert(c.send(CMD_READ, 0, 0, MIB as u32, &[]).await);
        }
    })
    .await;
    // Wait until the server has run what it will run: at least half the bound
    // (however slow the machine), then no new one for 300 ms. Looking too
    // early could only make the upper bound below easier to meet, never fail it.
    let half = INFLIGHT_BYTES_PER_CONN_MAX as u64 / MIB / 2;
    let ran = tokio::time::timeout(std::time::Duration::from_secs(120), async {
        let mut last = 0;
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            let now = (disk.calls.load(Ordering::SeqCst) - before) as u64;
            if now >= half && now == last {
                return now;
            }
            last = now;
        }
    })
    .await
    .unwrap_or_else(|_| {
        let ran = disk.calls.load(Ordering::SeqCst) - before;
        panic!("the server ran only {ran} reads in 120 s, or never stopped")
    });
    // The bound, plus one 1 MiB batch per thread, plus what the socket holds.
    let most = INFLIGHT_BYTES_PER_CONN_MAX as u64 / MIB + 4 + 4;
    assert!(
        ran <= most,
        "{ran} reads ran for a client that read no reply (at most {most})"
    );
    for _ in 0..READS {
        let r = within(c.reply()).await.unwrap();
        assert_eq!(Client::<tokio::net::UnixStream>::errno_of(&r), 0);
        assert!(handles.remove(&r.handle()), "unknown or repeated handle");
    }
}

/// Idle connections on sockets must not use up tokio's blocking pool,
/// which the handshake and the embedding program (the daemon's control
/// requests) draw on too: with the pool at 4 threads, 8 idle connections
/// (each holding its reading thread and a spare) once left a ninth waiting
/// forever in its handshake, and any `spawn_blocking` with it.
#[test]
fn idle_connections_leave_the_blocking_pool_free() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(4)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (server, _, _) = server();
        let mut idle = Vec::new();
        for i in 0..8u64 {
            let (s, task) = tokio::net::UnixStream::pipe(&server);
            let (mut c, _, _) = within(Client::open(s, "disk")).await;
            let data = pattern(4096, i as u8);
            let r = within(c.call(CMD_WRITE, 0, i * 4096, 4096, &data)).await;
            assert_eq!(Client::<tokio::net::UnixStream>::errno_of(&r), 0);
            idle.push((c, task));
        }
        // Each idle connection holds its threads now; a ninth is served...
        let (s, _task) = tokio::net::UnixStream::pipe(&server);
        let (mut c, _, _) = within(Client::open(s, "disk")).await;
        let r = within(c.call(CMD_READ, 0, 7 * 4096, 4096, &[])).await;
        let Reply::Chunk { payload, .. } = r else {
            panic!("expected one data chunk");
        };
        assert!(
            payload[8..] == pattern(4096, 7)[..],
            "read back other bytes"
        );
        // ...and the blocking pool still runs other work.
        assert_eq!(
            within(tokio::task::spawn_blocking(|| 42)).await.unwrap(),
            42
        );
        for (mut c, task) in idle {
            c.send(CMD_DISC, 0, 0, 0, &[]).await;
            within(task).await.unwrap();
        }
        assert_eq!(server.connections(), 1);
    });
}

/// The async path (TLS streams) the same way: requests waiting on storage
/// hold worker threads, which must not be the blocking pool's. With the
/// pool at 2 threads and a connection's 4 reads stuck at the gate, a
/// second client once waited in its handshake until the gate opened.
#[test]
fn busy_workers_leave_the_blocking_pool_free() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (server, disk, _) = server();
        let (s, task) = DuplexStream::pipe(&server);
        let (mut c, _, _) = within(Client::open(s, "disk")).await;
        disk.close_gate();
        // A failed assertion must not leave workers at the gate: the
        // runtime waits for its blocking threads when it is dropped.
        struct Reopen(std::sync::Arc<MemBackend>);
        impl Drop for Reopen {
            fn drop(&mut self) {
                self.0.open_gate();
            }
        }
        let _reopen = Reopen(std::sync::Arc::clone(&disk));
        for i in 0..4u64 {
            c.send(CMD_READ, 0, i * 4096, 4096, &[]).await;
        }
        // Until the four reads are at the gate, each on a worker thread.
        disk.until_inflight(4).await;
        let (s2, _task2) = DuplexStream::pipe(&server);
        let mut c2 = within(Client::connect(s2)).await;
        assert!(within(c2.go("disk")).await.is_ok());
        assert_eq!(
            within(tokio::task::spawn_blocking(|| 42)).await.unwrap(),
            42
        );
        disk.open_gate();
        for _ in 0..4 {
            let r = within(c.reply()).await.unwrap();
            assert_eq!(Client::<DuplexStream>::errno_of(&r), 0);
        }
        c.send(CMD_DISC, 0, 0, 0, &[]).await;
        within(task).await.unwrap();
    });
}

/// Each test above, once per transmission path.
macro_rules! on_both_paths {
    ($($name:ident),* $(,)?) => {
        mod async_path {
            $(#[tokio::test]
            async fn $name() {
                super::$name::<tokio::io::DuplexStream>().await
            })*
        }
        mod direct_path {
            $(#[tokio::test]
            async fn $name() {
                super::$name::<tokio::net::UnixStream>().await
            })*
        }
    };
}

on_both_paths!(
    simple_replies_round_trip,
    structured_read_is_one_data_chunk,
    edge_validation_errors,
    read_only_export_refuses_writes,
    block_status_reports_holes_and_respects_req_one,
    many_requests_in_flight,
    disconnect_finishes_in_flight_requests_first,
    oversized_write_closes_connection,
    bad_request_magic_closes_connection,
    requests_ahead_of_the_end_are_answered,
    backend_panic_is_eio_not_a_crash,
    client_eof_without_disc_cleans_up,
    every_reply_arrives_under_load,
);
