//! Every bound the NBD server enforces, in one place.
//!
//! A client is untrusted input: each length it can send, each queue it can
//! fill and each wait it can cause has a named limit here, so that a reader
//! can check in one minute that no input can make the server allocate,
//! queue or wait without bound. Values that the protocol itself fixes live
//! in `proto`; the knobs a caller may turn live in `ServerConfig`.

use std::time::Duration;

/// Default for `ServerConfig::max_request_bytes` (the NBD spec's portable
/// maximum, 2^25).
pub const REQUEST_BYTES_DEFAULT: u32 = 32 << 20;
/// `max_request_bytes` is clamped to at least this.
pub const REQUEST_BYTES_MIN: u32 = 4096;
/// `max_request_bytes` is clamped to at most this, so that one read reply
/// always fits a single `NBD_REPLY_TYPE_OFFSET_DATA` chunk (2^32 - 8 bytes)
/// and one client cannot pin gigabytes per request.
pub const REQUEST_BYTES_LIMIT: u32 = 1 << 30;

/// Default for `ServerConfig::max_connections`: a host's worth of VMs, each
/// attached, with threads to spare under systemd's default task limit
/// (4915 on most hosts: 1024 busy connections × 4 threads).
pub const CONNECTIONS_DEFAULT: usize = 1024;
/// `max_connections` is clamped to at most this.
pub const CONNECTIONS_LIMIT: usize = 1 << 20;

/// Default for `ServerConfig::max_inflight_per_conn`.
pub const INFLIGHT_PER_CONN_DEFAULT: usize = 64;
/// `max_inflight_per_conn` is clamped to at most this.
pub const INFLIGHT_PER_CONN_LIMIT: usize = 4096;

/// Default for `ServerConfig::max_workers_per_conn`: enough to keep a few
/// backend calls blocked on storage while others run, few enough that a
/// busy connection does not multiply threads on a small machine.
pub const WORKERS_PER_CONN_DEFAULT: usize = 4;
/// `max_workers_per_conn` is clamped to at most this.
pub const WORKERS_PER_CONN_LIMIT: usize = 256;

/// Most requests one thread of the plain-socket path (`direct.rs`) reads and
/// runs as one batch, when they are already waiting whole on the socket.
pub const BATCH_REQUESTS_MAX: usize = 16;
/// A batch expected to run for less than this (nanoseconds, at what the
/// connection's requests have lately cost) is run by the thread that read
/// it, which keeps the read side; a longer one is handed off: another thread
/// reads on while it runs. 50 µs is several times what a wake-up and the
/// migration of the socket's state cost on a small VM, and far below a
/// request that waits for storage (an NVMe read is ~80 µs).
pub const HANDOFF_BATCH_NS: u64 = 50_000;
/// A batch kept by its reader (see `HANDOFF_BATCH_NS`) that has run this
/// long hands the read side to another thread after all: its requests
/// looked cheap but are waiting for storage. Checked every `WATCHDOG_TICK`.
pub const KEPT_BATCH_STALL: Duration = Duration::from_micros(500);
/// How often the watchdog looks at kept batches while any runs.
pub const WATCHDOG_TICK: Duration = Duration::from_millis(1);
/// Ticks without a kept batch after which the watchdog sleeps until one
/// starts.
pub const WATCHDOG_IDLE_TICKS: u32 = 100;
/// Data bytes (write payloads and read replies) a batch may hold in all; a
/// batch's first request may exceed it on its own (up to
/// `max_request_bytes`), and then has no company. So one connection's
/// threads hold at most `threads_max` × max(this, `max_request_bytes`) of
/// data, plus block-status replies (up to `BLOCK_STATUS_EXTENTS_MAX`
/// descriptors each, not counted here; counted, like every reply, in the
/// bound on replies waiting for the client).
pub const BATCH_PAYLOAD_BYTES: usize = 1 << 20;

/// A connection's worker thread (async path) with nothing to do for this
/// long exits.
pub const WORKER_IDLE: Duration = Duration::from_secs(2);

/// Payload bytes one connection may hold waiting for the client to read
/// them (replies queued for the socket), and on the async (TLS) path also
/// those of the requests it runs (write data received, read data not yet
/// sent), on top of the request-count bound. A single request larger than
/// this still proceeds, alone. Past it the connection is not read from
/// until the client reads. 4 MiB keeps four 1 MiB requests (one per
/// thread) or 64 requests of 64 KiB in flight, which is what keeps the
/// threads busy; more only queues replies the client is not reading. (It
/// was 128 MiB: 16 connections that never read their replies grew the
/// daemon by 2 GiB.)
pub const INFLIGHT_BYTES_PER_CONN_MAX: u32 = 4 << 20;

/// Option payloads above this close the connection (the largest legal
/// option, a meta-context query list, is far smaller in practice).
pub const OPTION_BYTES_MAX: u32 = 64 << 10;

/// Longest string the spec allows (export names, queries, messages).
pub const STRING_BYTES_MAX: usize = 4096;

/// Whole option-haggling phase must finish within this.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(60);

/// Default for `ServerConfig::tls_timeout`: a connection on the TLS
/// listener that has not finished its TLS handshake this long after it was
/// greeted is dropped (and counted as a failure of its address). A real
/// client needs a few round trips; 10 s allows for a slow link.
pub const TLS_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);

/// Default for `ServerConfig::max_startups`: TCP connections not yet
/// authenticated (before TLS finished; on a plaintext listener, until the
/// handshake ends), from all addresses together. Past it, new TCP
/// connections are closed at once. Authenticated connections and the
/// owner's unix socket are counted apart (`max_connections`), so strangers
/// waiting never keep them out (as sshd's `MaxStartups`).
pub const STARTUPS_DEFAULT: usize = 128;
/// Default for `ServerConfig::max_startups_per_address`: the same, per
/// client address. Each connection refused for it counts as a failure of
/// the address (`ratelimit.rs`), so an address that floods is slowed, and
/// stays slowed when it reconnects.
pub const STARTUPS_PER_ADDRESS_DEFAULT: usize = 16;
/// `max_startups` (and per address) is clamped to at most this.
pub const STARTUPS_LIMIT: usize = 1 << 16;

/// Default for `ServerConfig::payload_timeout`: in the transmission phase,
/// once a request has begun to arrive, the rest of it (header and write
/// payload) must arrive within this, or the connection is closed. A client
/// may stay idle between requests as long as it likes. 60 s lets a 32 MiB
/// write through a link of 1 MB/s.
pub const PAYLOAD_TIMEOUT_DEFAULT: Duration = Duration::from_secs(60);

/// Once a connection stops reading requests (disconnect, EOF, shutdown),
/// each write of the remaining replies must complete within this, or the
/// connection is dropped: a client that stops reading cannot hold up
/// `Server::wait_idle`. Before that point a slow reader only slows itself.
pub const DRAIN_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// Most block-status descriptors in one reply (the spec lets the server
/// return fewer than the whole range; clients ask again for the rest).
pub const BLOCK_STATUS_EXTENTS_MAX: usize = 64 << 10;

/// Buffered reader in front of the socket (request headers are 28 bytes).
pub const READ_BUFFER_BYTES: usize = 64 << 10;
/// Buffered writer in front of the socket; larger payloads bypass it.
pub const WRITE_BUFFER_BYTES: usize = 64 << 10;

/// Payload buffers kept for reuse, for all connections together (one shelf
/// per process, `buffers.rs`): as many as a busy connection has requests in
/// flight (4 threads × 16 per batch by default) with room for a second, so
/// a steady stream of large requests never allocates (a fresh 1 MiB buffer
/// costs an mmap, page faults and a zero-fill).
pub const POOL_BUFFERS_MAX: usize = 128;
/// Buffers with more capacity than this are freed, not kept.
pub const POOL_BUFFER_BYTES_MAX: usize = 2 << 20;
/// Most bytes (capacity) the kept buffers hold together: what idle
/// connections can pin between them.
pub const POOL_BYTES_MAX: usize = 64 << 20;

/// Failures per address or identity that cost no delay (`ratelimit.rs`).
pub const RATE_FREE_FAILURES: u32 = 3;
/// Delay after the first failure past the free ones; doubles with each.
pub const RATE_DELAY_BASE: Duration = Duration::from_millis(100);
/// Longest delay a failing client is made to wait per attempt.
pub const RATE_DELAY_MAX: Duration = Duration::from_secs(5);
/// An attempt that would wait longer than this (behind others of the same
/// address or identity) is refused at once.
pub const RATE_QUEUE_MAX: Duration = Duration::from_secs(30);
/// A key with no failure for this long starts again from zero.
pub const RATE_FORGET: Duration = Duration::from_secs(600);
/// Addresses and identities remembered at once.
pub const RATE_KEYS_MAX: usize = 16 << 10;

/// Back-off after a transient `accept` error (e.g. out of descriptors).
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Tunables for a `Server`. Out-of-range values are clamped (see
/// `limits.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Largest READ/WRITE payload, advertised as the maximum block size.
    /// Larger reads fail with `EINVAL`; larger writes close the connection.
    pub max_request_bytes: u32,
    /// Requests one connection may have in flight at once.
    pub max_inflight_per_conn: usize,
    /// Blocking threads per connection that run backend calls (started on
    /// demand; never more than `max_inflight_per_conn`). On a plain socket
    /// these threads also read requests and write replies (`direct.rs`), so
    /// this also bounds the requests one connection has in service.
    pub max_workers_per_conn: usize,
    /// Connections served at once, in any phase. Each holds threads (two
    /// while idle on a plain socket, up to `max_workers_per_conn` while
    /// busy) and descriptors; past this, new clients are told the server
    /// is full (`NBD_REP_ERR_POLICY` with a message) and closed. TCP
    /// connections that have not authenticated yet are not counted here
    /// but in `max_startups`, so they never take an authenticated client's
    /// place.
    pub max_connections: usize,
    /// TCP connections not yet authenticated (TLS not finished; on a
    /// plaintext listener, handshake not finished), all addresses together;
    /// past it new TCP connections are closed at once.
    pub max_startups: usize,
    /// The same, per client address. A connection refused for either
    /// counts as a failure of its address (back-off, `ratelimit.rs`).
    pub max_startups_per_address: usize,
    /// A TLS-listener connection that has not finished TLS this long after
    /// its greeting is dropped, and counted as a failure of its address.
    pub tls_timeout: Duration,
    /// Once a request has begun to arrive, the rest (header and write
    /// payload) must arrive within this or the connection is closed. Idle
    /// connections may wait between requests without limit.
    pub payload_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            max_request_bytes: REQUEST_BYTES_DEFAULT,
            max_inflight_per_conn: INFLIGHT_PER_CONN_DEFAULT,
            max_workers_per_conn: WORKERS_PER_CONN_DEFAULT,
            max_connections: CONNECTIONS_DEFAULT,
            max_startups: STARTUPS_DEFAULT,
            max_startups_per_address: STARTUPS_PER_ADDRESS_DEFAULT,
            tls_timeout: TLS_TIMEOUT_DEFAULT,
            payload_timeout: PAYLOAD_TIMEOUT_DEFAULT,
        }
    }
}

/// `ServerConfig` after clamping.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub request_bytes_max: u32,
    pub inflight_max: usize,
    pub workers_max: usize,
    pub connections_max: usize,
    pub startups_max: usize,
    pub startups_per_address_max: usize,
    pub tls_timeout: Duration,
    pub payload_timeout: Duration,
}

impl Limits {
    pub(crate) fn new(config: &ServerConfig) -> Self {
        Self {
            request_bytes_max: config
                .max_request_bytes
                .clamp(REQUEST_BYTES_MIN, REQUEST_BYTES_LIMIT),
            inflight_max: config
                .max_inflight_per_conn
                .clamp(1, INFLIGHT_PER_CONN_LIMIT),
            workers_max: config.max_workers_per_conn.clamp(1, WORKERS_PER_CONN_LIMIT),
            connections_max: config.max_connections.clamp(1, CONNECTIONS_LIMIT),
            startups_max: config.max_startups.clamp(1, STARTUPS_LIMIT),
            startups_per_address_max: config
                .max_startups_per_address
                .clamp(1, STARTUPS_LIMIT)
                .min(config.max_startups.clamp(1, STARTUPS_LIMIT)),
            tls_timeout: config
                .tls_timeout
                .clamp(Duration::from_millis(100), HANDSHAKE_TIMEOUT),
            payload_timeout: config.payload_timeout.max(Duration::from_millis(100)),
        }
    }
}

const _: () = assert!(REQUEST_BYTES_MIN <= REQUEST_BYTES_DEFAULT);
const _: () = assert!(REQUEST_BYTES_DEFAULT <= REQUEST_BYTES_LIMIT);
const _: () = assert!((REQUEST_BYTES_LIMIT as u64) < (1u64 << 32) - 8);
const _: () = assert!(REQUEST_BYTES_MIN.is_power_of_two());
const _: () = assert!(INFLIGHT_PER_CONN_DEFAULT <= INFLIGHT_PER_CONN_LIMIT);
// Permits are acquired with `acquire_many(n: u32)`.
const _: () = assert!(INFLIGHT_PER_CONN_LIMIT <= u32::MAX as usize);
const _: () = assert!(STARTUPS_PER_ADDRESS_DEFAULT <= STARTUPS_DEFAULT);
const _: () = assert!(STARTUPS_DEFAULT <= STARTUPS_LIMIT);
const _: () = assert!(STRING_BYTES_MAX <= OPTION_BYTES_MAX as usize);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_is_clamped() {
        let l = Limits::new(&ServerConfig {
            max_request_bytes: 0,
            max_inflight_per_conn: 0,
            max_workers_per_conn: 0,
            max_connections: 0,
            max_startups: 0,
            max_startups_per_address: 0,
            tls_timeout: Duration::ZERO,
            payload_timeout: Duration::ZERO,
        });
        assert_eq!(
            (l.request_bytes_max, l.inflight_max, l.connections_max),
            (REQUEST_BYTES_MIN, 1, 1)
        );
        let l = Limits::new(&ServerConfig {
            max_request_bytes: u32::MAX,
            max_inflight_per_conn: usize::MAX,
            max_workers_per_conn: usize::MAX,
            max_connections: usize::MAX,
            max_startups: usize::MAX,
            max_startups_per_address: usize::MAX,
            tls_timeout: Duration::MAX,
            payload_timeout: Duration::MAX,
        });
        assert_eq!(
            (l.request_bytes_max, l.inflight_max, l.connections_max),
            (
                REQUEST_BYTES_LIMIT,
                INFLIGHT_PER_CONN_LIMIT,
                CONNECTIONS_LIMIT
            )
        );
        assert_eq!(
            (l.startups_max, l.startups_per_address_max, l.tls_timeout),
            (STARTUPS_LIMIT, STARTUPS_LIMIT, HANDSHAKE_TIMEOUT)
        );
        let d = ServerConfig::default();
        assert_eq!(
            (d.max_request_bytes, d.max_inflight_per_conn),
            (32 << 20, 64)
        );
    }
}
