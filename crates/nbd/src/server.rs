//! The [`Server`]: accepts connections, runs each through the handshake and
//! the transmission phase, and tracks them for shutdown and for
//! "is this volume attached?" questions.
//!
//! Lifecycle: `serve_unix`/`serve_tcp` accept until [`Server::shutdown`];
//! shutdown also tells every connection to stop reading requests, finish
//! the ones in flight and close. [`Server::wait_idle`] resolves once the
//! last connection, and every backend call it started, has finished. Any
//! byte stream can be served with [`Server::serve_stream`] (tests use
//! in-memory pipes; TLS will use it too).
//!
//! Invariant: a connection is counted from before its first byte is read
//! until after its last backend call returns, and a connection accepted
//! after `shutdown()` is never served, so `wait_idle` after `shutdown`
//! cannot miss one.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::watch;
use tracing::{info, info_span, warn, Instrument};

use crate::backend::Exports;
use crate::handshake::{self, Outcome};
use crate::limits::{
    ACCEPT_BACKOFF, HANDSHAKE_TIMEOUT, INFLIGHT_PER_CONN_DEFAULT, INFLIGHT_PER_CONN_LIMIT,
    REQUEST_BYTES_DEFAULT, REQUEST_BYTES_LIMIT, REQUEST_BYTES_MIN, WORKERS_PER_CONN_DEFAULT,
    WORKERS_PER_CONN_LIMIT,
};
use crate::transmission;

/// Tunables for a [`Server`]. Out-of-range values are clamped (see
/// `limits.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Largest READ/WRITE payload, advertised as the maximum block size.
    /// Larger reads fail with `EINVAL`; larger writes close the connection.
    pub max_request_bytes: u32,
    /// Requests one connection may have in flight at once.
    pub max_inflight_per_conn: usize,
    /// Blocking threads per connection that run backend calls (started on
    /// demand; never more than `max_inflight_per_conn`).
    pub max_workers_per_conn: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            max_request_bytes: REQUEST_BYTES_DEFAULT,
            max_inflight_per_conn: INFLIGHT_PER_CONN_DEFAULT,
            max_workers_per_conn: WORKERS_PER_CONN_DEFAULT,
        }
    }
}

/// `ServerConfig` after clamping.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub request_bytes_max: u32,
    pub inflight_max: usize,
    pub workers_max: usize,
}

impl Limits {
    fn new(config: &ServerConfig) -> Self {
        Self {
            request_bytes_max: config
                .max_request_bytes
                .clamp(REQUEST_BYTES_MIN, REQUEST_BYTES_LIMIT),
            inflight_max: config
                .max_inflight_per_conn
                .clamp(1, INFLIGHT_PER_CONN_LIMIT),
            workers_max: config
                .max_workers_per_conn
                .clamp(1, WORKERS_PER_CONN_LIMIT),
        }
    }
}

/// An NBD server over a set of exports.
pub struct Server {
    exports: Arc<dyn Exports>,
    limits: Limits,
    shutdown: watch::Sender<bool>,
    /// Open connections, in any phase.
    connections: watch::Sender<usize>,
    /// Connections in the transmission phase, per export name.
    attached: Mutex<HashMap<String, usize>>,
    next_id: AtomicU64,
}

/// Counts one connection for `wait_idle` while alive.
struct ConnectionGuard {
    server: Arc<Server>,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.server.connections.send_modify(|n| *n -= 1);
    }
}

/// Counts one connection towards `attached(name)` while alive.
struct AttachGuard {
    server: Arc<Server>,
    name: String,
}

impl Drop for AttachGuard {
    fn drop(&mut self) {
        let mut attached = self.server.attached_map();
        if let Some(n) = attached.get_mut(&self.name) {
            *n -= 1;
            if *n == 0 {
                attached.remove(&self.name);
            }
        }
    }
}

/// A listening socket the accept loop can take connections from.
trait Listen {
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// Accepts one connection and names its peer for logs.
    fn accept_one(&self) -> impl Future<Output = io::Result<(Self::Stream, String)>> + Send;
}

impl Listen for UnixListener {
    type Stream = UnixStream;
    async fn accept_one(&self) -> io::Result<(UnixStream, String)> {
        let (stream, _) = self.accept().await?;
        let peer = match stream.peer_cred() {
            Ok(cred) => format!("unix pid={:?} uid={}", cred.pid(), cred.uid()),
            Err(_) => "unix".to_owned(),
        };
        Ok((stream, peer))
    }
}

impl Listen for TcpListener {
    type Stream = TcpStream;
    async fn accept_one(&self) -> io::Result<(TcpStream, String)> {
        let (stream, addr) = self.accept().await?;
        // The spec asks both sides to disable Nagle.
        if let Err(e) = stream.set_nodelay(true) {
            warn!("TCP_NODELAY: {e}");
        }
        Ok((stream, addr.to_string()))
    }
}

/// Accept errors that say the listener itself is unusable.
fn accept_error_is_fatal(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EBADF | libc::EINVAL | libc::ENOTSOCK | libc::EFAULT)
    )
}

impl Server {
    pub fn new(exports: Arc<dyn Exports>, config: ServerConfig) -> Arc<Server> {
        Arc::new(Server {
            exports,
            limits: Limits::new(&config),
            shutdown: watch::channel(false).0,
            connections: watch::channel(0).0,
            attached: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
        })
    }

    /// Serves connections from a Unix socket until [`shutdown`](Self::shutdown).
    pub async fn serve_unix(self: Arc<Self>, listener: UnixListener) -> io::Result<()> {
        self.accept_loop(listener).await
    }

    /// Serves connections from a TCP socket until [`shutdown`](Self::shutdown).
    pub async fn serve_tcp(self: Arc<Self>, listener: TcpListener) -> io::Result<()> {
        self.accept_loop(listener).await
    }

    /// Serves one already-connected byte stream (plain socket, TLS stream,
    /// in-memory pipe) through handshake and transmission; returns when the
    /// connection is finished. Returns at once after shutdown.
    pub async fn serve_stream<S>(self: Arc<Self>, stream: S)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        if let Some(guard) = self.track() {
            self.connection(guard, stream, "stream".to_owned()).await;
        }
    }

    /// Stops accepting and stops reading new requests; in-flight requests
    /// complete and their replies are sent. Connections still negotiating
    /// are closed.
    pub fn shutdown(&self) {
        self.shutdown.send_replace(true);
    }

    /// Whether [`shutdown`](Self::shutdown) has been called.
    pub fn is_shutting_down(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// Resolves when no connection is open (every connection has finished,
    /// including its backend calls). Meant to be awaited after `shutdown()`.
    pub async fn wait_idle(&self) {
        let mut connections = self.connections.subscribe();
        // Cannot fail: `self` owns the sender.
        let _ = connections.wait_for(|n| *n == 0).await;
    }

    /// Number of open connections, in any phase.
    pub fn connections(&self) -> usize {
        *self.connections.borrow()
    }

    /// Number of open connections per export name (for "volume is
    /// attached" checks). Counts connections in the transmission phase.
    pub fn attached(&self, name: &str) -> usize {
        self.attached_map().get(name).copied().unwrap_or(0)
    }

    fn attached_map(&self) -> MutexGuard<'_, HashMap<String, usize>> {
        // Counters only; a panic elsewhere cannot leave them half-updated.
        self.attached.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a new connection, unless shutting down. The count goes up
    /// before the shutdown flag is read, and `shutdown()` sets the flag
    /// before `wait_idle` reads the count, so one of them sees the other.
    fn track(self: &Arc<Self>) -> Option<ConnectionGuard> {
        self.connections.send_modify(|n| *n += 1);
        let guard = ConnectionGuard {
            server: Arc::clone(self),
        };
        (!self.is_shutting_down()).then_some(guard)
    }

    fn attach(self: &Arc<Self>, name: &str) -> AttachGuard {
        *self.attached_map().entry(name.to_owned()).or_insert(0) += 1;
        AttachGuard {
            server: Arc::clone(self),
            name: name.to_owned(),
        }
    }

    async fn accept_loop<L: Listen>(self: Arc<Self>, listener: L) -> io::Result<()> {
        let mut shutdown = self.shutdown.subscribe();
        loop {
            let accepted = tokio::select! {
                biased;
                _ = shutdown.wait_for(|s| *s) => return Ok(()),
                accepted = listener.accept_one() => accepted,
            };
            match accepted {
                Ok((stream, peer)) => {
                    let Some(guard) = self.track() else {
                        return Ok(());
                    };
                    let server = Arc::clone(&self);
                    tokio::spawn(server.connection(guard, stream, peer));
                }
                Err(e) if accept_error_is_fatal(&e) => return Err(e),
                Err(e) => {
                    // Typically out of descriptors: back off, keep serving.
                    warn!("accept failed: {e}");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            }
        }
    }

    /// Runs one connection to completion. `guard` keeps it counted.
    fn connection<S>(
        self: Arc<Self>,
        guard: ConnectionGuard,
        stream: S,
        peer: String,
    ) -> impl Future<Output = ()> + Send
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let span = info_span!("nbd", conn = id);
        async move {
            info!(%peer, "client connected");
            self.negotiate_and_serve(stream).await;
            drop(guard);
        }
        .instrument(span)
    }

    async fn negotiate_and_serve<S>(self: &Arc<Self>, mut stream: S)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let shutdown = self.shutdown.subscribe();
        let mut stop = shutdown.clone();
        let negotiated = tokio::select! {
            r = tokio::time::timeout(
                HANDSHAKE_TIMEOUT,
                handshake::negotiate(&mut stream, &self.exports, &self.limits, &shutdown),
            ) => r,
            _ = stop.wait_for(|s| *s) => {
                info!("closed during handshake: server shutting down");
                return;
            }
        };
        let export = match negotiated {
            Err(_) => {
                warn!("handshake timed out");
                return;
            }
            Ok(Err(e)) if e.is_disconnect() => {
                info!("client disconnected during handshake");
                return;
            }
            Ok(Err(e)) => {
                info!("handshake failed: {e}");
                return;
            }
            Ok(Ok(Outcome::Aborted)) => {
                info!("client aborted negotiation");
                return;
            }
            Ok(Ok(Outcome::Transmission(export))) => export,
        };
        let _attached = self.attach(&export.name);
        info!(
            export = %export.name,
            size = export.size,
            flags = format_args!("{:#x}", export.flags),
            structured = export.structured,
            block_status = export.meta_context.is_some(),
            "serving export"
        );
        let end = transmission::run(stream, export, &self.limits, shutdown).await;
        info!("connection closed: {end}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_is_clamped() {
        let l = Limits::new(&ServerConfig {
            max_request_bytes: 0,
            max_inflight_per_conn: 0,
            max_workers_per_conn: 0,
        });
        assert_eq!(
            (l.request_bytes_max, l.inflight_max),
            (REQUEST_BYTES_MIN, 1)
        );
        let l = Limits::new(&ServerConfig {
            max_request_bytes: u32::MAX,
            max_inflight_per_conn: usize::MAX,
            max_workers_per_conn: usize::MAX,
        });
        assert_eq!(
            (l.request_bytes_max, l.inflight_max),
            (REQUEST_BYTES_LIMIT, INFLIGHT_PER_CONN_LIMIT)
        );
        let d = ServerConfig::default();
        assert_eq!(
            (d.max_request_bytes, d.max_inflight_per_conn),
            (32 << 20, 64)
        );
    }
}
