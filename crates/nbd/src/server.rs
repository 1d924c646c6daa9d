//! The [`Server`]: accepts connections, runs each through the handshake and
//! the transmission phase, and tracks them for shutdown and for
//! "is this volume attached?" questions.
//!
//! Listeners and who their clients are: `serve_unix` (the owner: the
//! socket's mode is the access control), `serve_tcp` (plaintext,
//! `anonymous`), `serve_tcp_tls` (TLS required via `NBD_OPT_STARTTLS`; the
//! client is who its certificate or PSK says). TCP clients that fail (TLS,
//! plaintext on a TLS listener, refused opens) are slowed per address and
//! identity (`ratelimit.rs`); the delay is served before the greeting.
//!
//! Lifecycle: the `serve_*` methods accept until [`Server::shutdown`];
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

use crate::backend::{Client, Event, Exports, Identity};
use crate::handshake::{self, Context, HandshakeError, Negotiated, Outcome, Summary, Tls};
use crate::limits::{Limits, ServerConfig, ACCEPT_BACKOFF, HANDSHAKE_TIMEOUT};
use crate::ratelimit::{Key, Limiter};
use crate::request::End;
use crate::tls::TlsConfig;
use crate::{direct, transmission};

/// An NBD server over a set of exports.
pub struct Server {
    exports: Arc<dyn Exports>,
    limits: Limits,
    shutdown: watch::Sender<bool>,
    /// Open connections, in any phase.
    connections: watch::Sender<usize>,
    /// Connections in the transmission phase, by connection id.
    attached: Mutex<HashMap<u64, Attached>>,
    next_id: AtomicU64,
    limiter: Limiter,
    /// Refusals because the server was full, for the log.
    full: Mutex<Refused>,
    /// TCP connections not yet authenticated, in all and per address.
    startups: Mutex<Startups>,
    /// Refusals because too many were not yet authenticated, for the log.
    crowded: Mutex<Refused>,
}

/// TCP connections that have not authenticated yet (`max_startups`).
#[derive(Default)]
struct Startups {
    total: usize,
    /// Only addresses with at least one; so at most `startups_max` entries.
    by_address: HashMap<std::net::IpAddr, usize>,
}

/// Why a new TCP connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Crowded {
    Address,
    Total,
}

impl Startups {
    /// Counts one more connection from `ip`, unless that passes a bound.
    fn admit(&mut self, ip: std::net::IpAddr, limits: &Limits) -> Result<(), Crowded> {
        let mine = self.by_address.get(&ip).copied().unwrap_or(0);
        if mine >= limits.startups_per_address_max {
            return Err(Crowded::Address);
        }
        if self.total >= limits.startups_max {
            return Err(Crowded::Total);
        }
        self.total += 1;
        *self.by_address.entry(ip).or_insert(0) += 1;
        Ok(())
    }

    fn release(&mut self, ip: std::net::IpAddr) {
        self.total -= 1;
        match self.by_address.get_mut(&ip) {
            Some(n) if *n > 1 => *n -= 1,
            _ => {
                self.by_address.remove(&ip);
            }
        }
    }
}

/// Counts one TCP connection as not yet authenticated while alive.
struct StartupGuard {
    server: Arc<Server>,
    ip: std::net::IpAddr,
}

impl Drop for StartupGuard {
    fn drop(&mut self) {
        self.server.startups_lock().release(self.ip);
    }
}

#[derive(Default)]
struct Refused {
    /// Since the last warning.
    refused: u64,
    warned: Option<std::time::Instant>,
}

/// Least time between two warnings that clients were refused (server full).
const FULL_WARN_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// How a listener's clients are authenticated.
#[derive(Clone)]
enum Transport {
    /// The Unix socket: the owner, plaintext.
    Owner,
    /// Plaintext TCP: anonymous.
    Plain,
    /// TLS required.
    Tls(Arc<TlsConfig>),
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

/// A connection in the transmission phase.
struct Attached {
    export: String,
    client: Arc<Client>,
    read_only: bool,
    /// Set to stop this connection as a shutdown stops them all.
    stop: watch::Sender<bool>,
    /// Stopped by `revoke`.
    revoked: bool,
}

/// Counts one connection towards `attached(name)` while alive.
struct AttachGuard {
    server: Arc<Server>,
    id: u64,
}

impl Attached {
    fn stop(&mut self, revoked: bool) {
        self.revoked |= revoked;
        self.stop.send_replace(true);
    }
}

impl AttachGuard {
    /// Stops the connection: a shutdown of the server reaches it this way,
    /// and so does access taken away (`revoked`).
    fn stop(&self, revoked: bool) {
        if let Some(a) = self.server.attached_map().get_mut(&self.id) {
            a.stop(revoked);
        }
    }

    fn revoked(&self) -> bool {
        self.server
            .attached_map()
            .get(&self.id)
            .is_some_and(|a| a.revoked)
    }
}

impl Drop for AttachGuard {
    fn drop(&mut self) {
        self.server.attached_map().remove(&self.id);
    }
}

/// A listening socket the accept loop can take connections from.
trait Listen {
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// Accepts one connection; names its peer (for logs) and address.
    fn accept_one(
        &self,
    ) -> impl Future<Output = io::Result<(Self::Stream, String, Option<std::net::IpAddr>)>> + Send;
}

/// The owner's Unix socket: only this process's user and root may connect,
/// whatever the socket file's mode (as on the control socket). Others are
/// closed at once, before a byte is exchanged.
struct OwnerListener(UnixListener);

impl Listen for OwnerListener {
    type Stream = UnixStream;
    async fn accept_one(&self) -> io::Result<(UnixStream, String, Option<std::net::IpAddr>)> {
        // SAFETY: geteuid cannot fail and touches no memory.
        let euid = unsafe { libc::geteuid() };
        loop {
            let (stream, _) = self.0.accept().await?;
            let cred = match stream.peer_cred() {
                Ok(cred) => cred,
                Err(e) => {
                    warn!("refused an NBD connection on the unix socket: cannot read peer credentials: {e}");
                    continue;
                }
            };
            if cred.uid() != euid && cred.uid() != 0 {
                warn!(
                    uid = cred.uid(),
                    "refused an NBD connection on the unix socket from another user"
                );
                continue;
            }
            let peer = match cred.pid() {
                Some(pid) => format!("unix pid={pid} uid={}", cred.uid()),
                None => format!("unix uid={}", cred.uid()),
            };
            return Ok((stream, peer, None));
        }
    }
}

impl Listen for TcpListener {
    type Stream = TcpStream;
    async fn accept_one(&self) -> io::Result<(TcpStream, String, Option<std::net::IpAddr>)> {
        let (stream, addr) = self.accept().await?;
        // The spec asks both sides to disable Nagle.
        if let Err(e) = stream.set_nodelay(true) {
            warn!("TCP_NODELAY: {e}");
        }
        Ok((stream, addr.to_string(), Some(addr.ip())))
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
            limiter: Limiter::default(),
            full: Mutex::new(Refused::default()),
            startups: Mutex::new(Startups::default()),
            crowded: Mutex::new(Refused::default()),
        })
    }

    /// Serves connections from a Unix socket until [`shutdown`](Self::shutdown).
    /// Its clients are [`Identity::Owner`]: this process's user or root (the
    /// peer's uid is checked; others are closed at once).
    pub async fn serve_unix(self: Arc<Self>, listener: UnixListener) -> io::Result<()> {
        self.accept_loop(OwnerListener(listener), Transport::Owner)
            .await
    }

    /// Serves plaintext NBD on a TCP socket until [`shutdown`](Self::shutdown).
    /// Its clients are [`Identity::Anonymous`].
    pub async fn serve_tcp(self: Arc<Self>, listener: TcpListener) -> io::Result<()> {
        self.accept_loop(listener, Transport::Plain).await
    }

    /// Serves NBD on a TCP socket with TLS required until
    /// [`shutdown`](Self::shutdown). Clients are who TLS proved them to be.
    pub async fn serve_tcp_tls(
        self: Arc<Self>,
        listener: TcpListener,
        tls: Arc<TlsConfig>,
    ) -> io::Result<()> {
        self.accept_loop(listener, Transport::Tls(tls)).await
    }

    /// Serves one already-connected byte stream (plain socket, in-memory
    /// pipe) as the owner, through handshake and transmission; returns when
    /// the connection is finished. Returns at once after shutdown.
    pub async fn serve_stream<S>(self: Arc<Self>, stream: S)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        if let Some(guard) = self.track() {
            let peer = ("stream".to_owned(), None);
            self.connection(guard, stream, peer, Transport::Owner).await;
        }
    }

    /// Like [`serve_stream`](Self::serve_stream), with TLS required (as on a
    /// TLS listener) and `ip` as the peer's address for rate limiting.
    pub async fn serve_stream_tls<S>(
        self: Arc<Self>,
        stream: S,
        tls: Arc<TlsConfig>,
        ip: Option<std::net::IpAddr>,
    ) where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        if let Some(guard) = self.track() {
            let peer = ("stream".to_owned(), ip);
            self.connection(guard, stream, peer, Transport::Tls(tls))
                .await;
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
        self.attached_map()
            .values()
            .filter(|a| a.export == name)
            .count()
    }

    /// Closes the connections that `allowed` no longer allows, given the
    /// export each is on, its client, and whether it attached read-only
    /// (after a grant is removed or narrowed). Each stops as at shutdown: it
    /// reads no further request, answers those it has, and closes. Returns
    /// the ids of those stopped (see `wait_detached`).
    pub fn revoke(&self, allowed: impl Fn(&str, &Client, bool) -> bool) -> Vec<u64> {
        let mut attached = self.attached_map();
        let mut ids = Vec::new();
        for (id, a) in attached.iter_mut() {
            let stopping = *a.stop.borrow();
            if !stopping && !allowed(&a.export, &a.client, a.read_only) {
                a.stop(true);
                ids.push(*id);
            }
        }
        ids
    }

    /// Waits until the connections `ids` (from `revoke`) have closed, or
    /// `timeout` passes; returns how many are still open.
    pub async fn wait_detached(&self, ids: &[u64], timeout: std::time::Duration) -> usize {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let open = {
                let attached = self.attached_map();
                ids.iter().filter(|id| attached.contains_key(id)).count()
            };
            if open == 0 || tokio::time::Instant::now() >= deadline {
                return open;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    fn attached_map(&self) -> MutexGuard<'_, HashMap<u64, Attached>> {
        // Each entry is inserted and removed whole; a panic elsewhere cannot
        // leave one half-updated.
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

    fn startups_lock(&self) -> MutexGuard<'_, Startups> {
        // Each update is whole under the lock.
        self.startups.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a new TCP connection from `ip` as not yet authenticated, or
    /// refuses it: too many from its address or in all are. A refusal
    /// counts as a failure of the address, so one that floods waits longer
    /// at each later attempt, reconnecting or not.
    fn admit_startup(self: &Arc<Self>, ip: std::net::IpAddr) -> Option<StartupGuard> {
        let admitted = self.startups_lock().admit(ip, &self.limits);
        match admitted {
            Ok(()) => Some(StartupGuard {
                server: Arc::clone(self),
                ip,
            }),
            Err(why) => {
                self.limiter.fail(&[Key::Addr(ip)]);
                self.note_refused_crowded(why);
                None
            }
        }
    }

    /// Logs refusals of unauthenticated connections, at most once per
    /// `FULL_WARN_EVERY`, with how many there were.
    fn note_refused_crowded(&self, why: Crowded) {
        let mut c = self.crowded.lock().unwrap_or_else(PoisonError::into_inner);
        c.refused += 1;
        let now = std::time::Instant::now();
        if c.warned
            .is_none_or(|at| now.duration_since(at) >= FULL_WARN_EVERY)
        {
            let (what, max, flag) = match why {
                Crowded::Address => (
                    "from one address",
                    self.limits.startups_per_address_max,
                    "--max-startups-per-address",
                ),
                Crowded::Total => ("in all", self.limits.startups_max, "--max-startups"),
            };
            warn!(
                "too many unauthenticated NBD connections {what}: closed {} new connection(s) \
                 since the last warning (at most {max} at once: serve {flag})",
                c.refused
            );
            c.refused = 0;
            c.warned = Some(now);
        }
    }

    /// Logs refusals for a full server, at most once per `FULL_WARN_EVERY`
    /// with how many there were, so a flood of clients cannot flood the log.
    fn note_refused_full(&self, max: usize) {
        let mut full = self.full.lock().unwrap_or_else(PoisonError::into_inner);
        full.refused += 1;
        let now = std::time::Instant::now();
        if full
            .warned
            .is_none_or(|at| now.duration_since(at) >= FULL_WARN_EVERY)
        {
            warn!(
                "too many NBD connections: refused {} new client(s) since the last warning \
                 (at most {max} at once: serve --max-connections)",
                full.refused
            );
            full.refused = 0;
            full.warned = Some(now);
        }
    }

    /// Counts a connection as attached; returns its guard and the receiver
    /// that tells its transmission phase to stop.
    fn attach(
        self: &Arc<Self>,
        export: &str,
        client: &Arc<Client>,
        read_only: bool,
    ) -> (AttachGuard, watch::Receiver<bool>) {
        let (stop, stopped) = watch::channel(false);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let entry = Attached {
            export: export.to_owned(),
            client: Arc::clone(client),
            read_only,
            stop,
            revoked: false,
        };
        self.attached_map().insert(id, entry);
        let guard = AttachGuard {
            server: Arc::clone(self),
            id,
        };
        (guard, stopped)
    }

    async fn accept_loop<L: Listen>(
        self: Arc<Self>,
        listener: L,
        transport: Transport,
    ) -> io::Result<()> {
        let mut shutdown = self.shutdown.subscribe();
        loop {
            let accepted = tokio::select! {
                biased;
                _ = shutdown.wait_for(|s| *s) => return Ok(()),
                accepted = listener.accept_one() => accepted,
            };
            match accepted {
                Ok((stream, peer, ip)) => {
                    let Some(guard) = self.track() else {
                        return Ok(());
                    };
                    let server = Arc::clone(&self);
                    let transport = transport.clone();
                    tokio::spawn(server.connection(guard, stream, (peer, ip), transport));
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
        (peer, ip): (String, Option<std::net::IpAddr>),
        transport: Transport,
    ) -> impl Future<Output = ()> + Send
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let span = info_span!("nbd", conn = id);
        async move {
            info!(%peer, "client connected");
            let identity = match transport {
                Transport::Owner => Identity::Owner,
                // Until TLS says otherwise.
                Transport::Plain | Transport::Tls(_) => Identity::Anonymous,
            };
            let client = Client { identity, peer, ip };
            self.negotiate_and_serve(stream, client, transport).await;
            drop(guard);
        }
        .instrument(span)
    }

    /// Reports `event` to the exports on the blocking pool.
    async fn event(&self, client: &Arc<Client>, event: OwnedEvent) {
        let exports = Arc::clone(&self.exports);
        let client = Arc::clone(client);
        let _ = tokio::task::spawn_blocking(move || exports.event(&client, event.as_event())).await;
    }

    async fn negotiate_and_serve<S>(
        self: &Arc<Self>,
        mut stream: S,
        client: Client,
        transport: Transport,
    ) where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let shutdown = self.shutdown.subscribe();
        // A TCP connection is a stranger until it authenticates: counted
        // apart, within its own bounds.
        let mut startup = match client.ip {
            Some(ip) => match self.admit_startup(ip) {
                Some(guard) => Some(guard),
                None => return,
            },
            None => None,
        };
        // A TCP address that has been failing waits before it is answered.
        if let Some(ip) = client.ip {
            let Some(delay) = self.limiter.reserve(&[Key::Addr(ip)]) else {
                warn!("address is flooding after failures: connection refused");
                return;
            };
            if !delay.is_zero() {
                info!(?delay, "address has failed recently: delaying the greeting");
                let far = tokio::time::Instant::now() + delay + HANDSHAKE_TIMEOUT;
                if step(&shutdown, far, tokio::time::sleep(delay))
                    .await
                    .is_none()
                {
                    return;
                }
            }
        }
        let greeted = tokio::time::Instant::now();
        let deadline = greeted + HANDSHAKE_TIMEOUT;
        let tls = match transport {
            Transport::Owner | Transport::Plain => None,
            Transport::Tls(tls) => Some(tls),
        };
        // Where TLS is required, it must be done within `tls_timeout` of the
        // greeting: the client's flags, STARTTLS and the TLS handshake.
        let tls_deadline = match tls {
            Some(_) => deadline.min(greeted + self.limits.tls_timeout),
            None => deadline,
        };
        let mut client = Arc::new(client);
        let greet = step(&shutdown, tls_deadline, handshake::greet(&mut stream)).await;
        let no_zeroes = match greet {
            Some(Ok(no_zeroes)) => no_zeroes,
            Some(Err(e)) => return handshake_ended(Err(e)),
            None if tls.is_some() && !self.is_shutting_down() => {
                return self.tls_too_slow(&client).await
            }
            None => return,
        };
        let Some(tls) = tls else {
            let cx = self.context(&shutdown, &client, Tls::Unavailable, startup.is_some());
            let mut summary = Summary {
                refused_without_tls: 0,
            };
            let r = step(
                &shutdown,
                deadline,
                handshake::options(&mut stream, &cx, no_zeroes, &mut summary),
            )
            .await;
            if let Some(export) = handshake_result(r) {
                drop(startup.take());
                self.serve(stream, export, &client, shutdown).await;
            }
            return;
        };

        // TLS required: STARTTLS, the TLS handshake, then options again.
        let cx = self.context(&shutdown, &client, Tls::Required, startup.is_some());
        let mut summary = Summary {
            refused_without_tls: 0,
        };
        let r = step(
            &shutdown,
            tls_deadline,
            handshake::options(&mut stream, &cx, no_zeroes, &mut summary),
        )
        .await;
        let started = matches!(r, Some(Ok(Outcome::StartTls)));
        if r.is_none() && !self.is_shutting_down() {
            return self.tls_too_slow(&client).await;
        }
        if !started {
            let plaintext = summary.refused_without_tls > 0
                || matches!(r, Some(Err(HandshakeError::ExportNameBeforeTls)));
            if plaintext {
                self.fail_address(&client, "plaintext NBD options on a TLS listener")
                    .await;
            }
            handshake_result(r);
            return;
        }
        let accepted = step(&shutdown, tls_deadline, tls.accept(stream)).await;
        let (mut stream, identity) = match accepted {
            Some(Ok(done)) => done,
            Some(Err(reason)) => {
                info!("TLS handshake failed: {reason}");
                self.fail_address(&client, &format!("TLS handshake failed: {reason}"))
                    .await;
                return;
            }
            None if self.is_shutting_down() => return,
            None => return self.tls_too_slow(&client).await,
        };
        // Authenticated: no longer a stranger.
        drop(startup.take());
        Arc::make_mut(&mut client).identity = identity;
        info!(client = %client.identity.name(), "TLS established");
        let cx = self.context(&shutdown, &client, Tls::Active, false);
        let r = step(
            &shutdown,
            deadline,
            handshake::options(&mut stream, &cx, no_zeroes, &mut summary),
        )
        .await;
        if let Some(export) = handshake_result(r) {
            self.serve(stream, export, &client, shutdown).await;
        }
    }

    /// The handshake's context. `startup`: this connection is not yet
    /// authenticated (counted in `startups`, not against `max_connections`).
    fn context<'a>(
        &'a self,
        shutdown: &'a watch::Receiver<bool>,
        client: &'a Arc<Client>,
        tls: Tls,
        startup: bool,
    ) -> Context<'a> {
        // Strangers still in their handshake do not take the places of
        // those who have authenticated: only the others count.
        let strangers = self.startups_lock().total;
        let others = self.connections().saturating_sub(strangers);
        let counted = if startup { others + 1 } else { others };
        let full = (counted > self.limits.connections_max).then_some(self.limits.connections_max);
        if let Some(max) = full {
            self.note_refused_full(max);
        }
        Context {
            exports: &self.exports,
            limits: &self.limits,
            shutdown,
            client,
            limiter: &self.limiter,
            tls,
            full,
        }
    }

    /// A connection did not finish TLS within `tls_timeout`: dropped, and
    /// counted against its address like a failed handshake.
    async fn tls_too_slow(&self, client: &Arc<Client>) {
        let secs = self.limits.tls_timeout.as_secs_f64();
        info!("TLS not finished within {secs}s: connection dropped");
        self.fail_address(
            client,
            &format!("TLS not finished within {secs}s (serve --tls-timeout)"),
        )
        .await;
    }

    /// Counts a failure against the client's address and reports it.
    async fn fail_address(&self, client: &Arc<Client>, reason: &str) {
        if let Some(ip) = client.ip {
            self.limiter.fail(&[Key::Addr(ip)]);
        }
        self.event(
            client,
            OwnedEvent::HandshakeFailed {
                reason: reason.to_owned(),
            },
        )
        .await;
    }

    /// The transmission phase, counted as attached and reported.
    async fn serve<S>(
        self: &Arc<Self>,
        stream: S,
        export: Negotiated,
        client: &Arc<Client>,
        mut shutdown: watch::Receiver<bool>,
    ) where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let name = export.name.clone();
        let read_only = export.flags & crate::proto::FLAG_READ_ONLY != 0;
        let (attached, stopped) = self.attach(&name, client, read_only);
        // Access taken away after the handshake opened the export but before
        // `attach` is not seen by `revoke`: ask again, now that it would be.
        let (exports, who, what) = (Arc::clone(&self.exports), Arc::clone(client), name.clone());
        let allowed = tokio::task::spawn_blocking(move || {
            exports
                .open(&what, &who)
                .is_some_and(|b| read_only || !b.read_only())
        })
        .await
        .unwrap_or(false);
        if !allowed {
            // Nothing is served: the client is told no more than at the
            // handshake (the connection closes), and the denial is reported.
            info!(export = %name, "access taken away before serving: closing the connection");
            self.event(client, OwnedEvent::Denied { export: name })
                .await;
            return;
        }
        info!(
            export = %export.name,
            size = export.size,
            flags = format_args!("{:#x}", export.flags),
            structured = export.structured,
            block_status = export.meta_context.is_some(),
            client = %client.identity.name(),
            "serving export"
        );
        self.event(
            client,
            OwnedEvent::Attach {
                export: name.clone(),
                read_only,
            },
        )
        .await;
        let run = transmit(stream, export, &self.limits, stopped);
        tokio::pin!(run);
        let ended = tokio::select! {
            end = &mut run => Some(end),
            _ = shutdown.wait_for(|s| *s) => None,
        };
        let end = match ended {
            Some(end) => end,
            None => {
                attached.stop(false);
                run.await
            }
        };
        let end = match end {
            End::Shutdown if attached.revoked() => "access revoked".to_owned(),
            end => end.to_string(),
        };
        // Every request has finished: the export is no longer in use.
        drop(attached);
        // Its buffers are free: give the memory back (all of the kept
        // buffers too, once no connection is being served).
        let idle = self.attached_map().is_empty();
        tokio::task::spawn_blocking(move || crate::buffers::give_back(idle));
        info!("connection closed: {end}");
        self.event(
            client,
            OwnedEvent::Detach {
                export: name,
                reason: end,
            },
        )
        .await;
    }
}

/// The transmission phase: on a plain Unix or TCP socket, threads that each
/// read, run and answer whole requests (`direct.rs`); on any other stream
/// (TLS, in-memory pipes), the async reader and writer (`transmission.rs`).
async fn transmit<S>(
    stream: S,
    export: Negotiated,
    limits: &Limits,
    shutdown: watch::Receiver<bool>,
) -> End
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let stream: Box<dyn std::any::Any + Send> = Box::new(stream);
    let stream = match stream.downcast::<UnixStream>() {
        Ok(unix) => match unix.into_std() {
            Ok(s) => return direct::run(s, export, limits, shutdown).await,
            Err(e) => return End::Io(e),
        },
        Err(other) => other,
    };
    let stream = match stream.downcast::<TcpStream>() {
        Ok(tcp) => match tcp.into_std() {
            Ok(s) => return direct::run(s, export, limits, shutdown).await,
            Err(e) => return End::Io(e),
        },
        Err(other) => other,
    };
    match stream.downcast::<S>() {
        Ok(stream) => transmission::run(*stream, export, limits, shutdown).await,
        Err(_) => unreachable!("the stream is an S"),
    }
}

/// An [`Event`] that owns its strings, to cross to the blocking pool.
enum OwnedEvent {
    Attach { export: String, read_only: bool },
    Detach { export: String, reason: String },
    HandshakeFailed { reason: String },
    Denied { export: String },
}

impl OwnedEvent {
    fn as_event(&self) -> Event<'_> {
        match self {
            OwnedEvent::Attach { export, read_only } => Event::Attach {
                export,
                read_only: *read_only,
            },
            OwnedEvent::Detach { export, reason } => Event::Detach { export, reason },
            OwnedEvent::HandshakeFailed { reason } => Event::HandshakeFailed { reason },
            OwnedEvent::Denied { export } => Event::Denied { export },
        }
    }
}

/// Runs one handshake step unless the deadline passes or the server shuts
/// down first (both logged): connections still negotiating are closed.
async fn step<F: Future>(
    shutdown: &watch::Receiver<bool>,
    deadline: tokio::time::Instant,
    f: F,
) -> Option<F::Output> {
    let mut stop = shutdown.clone();
    tokio::select! {
        r = tokio::time::timeout_at(deadline, f) => match r {
            Ok(out) => Some(out),
            Err(_) => {
                warn!("handshake timed out");
                None
            }
        },
        _ = stop.wait_for(|s| *s) => {
            info!("closed during handshake: server shutting down");
            None
        }
    }
}

fn handshake_ended(r: Result<(), HandshakeError>) {
    match r {
        Ok(()) => {}
        Err(e) if e.is_disconnect() => info!("client disconnected during handshake"),
        Err(e) => info!("handshake failed: {e}"),
    }
}

/// Logs how option haggling ended; the export if it reached transmission.
fn handshake_result(r: Option<Result<Outcome, HandshakeError>>) -> Option<Negotiated> {
    match r {
        None => {}
        Some(Err(e)) => handshake_ended(Err(e)),
        Some(Ok(Outcome::Aborted)) => info!("client aborted negotiation"),
        // Only sent where TLS is required, and handled there.
        Some(Ok(Outcome::StartTls)) => info!("unexpected STARTTLS outcome"),
        Some(Ok(Outcome::Transmission(export))) => return Some(export),
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unauthenticated connections are bounded per address and in all; a
    /// released one makes room again, and an address's entry goes when its
    /// last one does.
    #[test]
    fn startups_are_bounded_per_address_and_in_all() {
        let limits = Limits::new(&ServerConfig {
            max_startups: 3,
            max_startups_per_address: 2,
            ..ServerConfig::default()
        });
        let a: std::net::IpAddr = "10.0.0.1".parse().unwrap();
        let b: std::net::IpAddr = "10.0.0.2".parse().unwrap();
        let c: std::net::IpAddr = "10.0.0.3".parse().unwrap();
        let mut s = Startups::default();
        assert_eq!(s.admit(a, &limits), Ok(()));
        assert_eq!(s.admit(a, &limits), Ok(()));
        assert_eq!(s.admit(a, &limits), Err(Crowded::Address));
        assert_eq!(s.admit(b, &limits), Ok(()));
        assert_eq!(s.admit(c, &limits), Err(Crowded::Total));
        s.release(a);
        assert_eq!(s.admit(c, &limits), Ok(()));
        s.release(a);
        s.release(b);
        s.release(c);
        assert_eq!(s.total, 0);
        assert!(s.by_address.is_empty());
    }
}
