//! The transmission phase on a plain socket (Unix or TCP), without hand-offs.
//!
//! `transmission.rs` moves every request across three parties: the async
//! reader parses it, a worker thread runs it, the async writer sends the
//! reply. Each crossing is a wake-up, and at 4 KiB (or 64 KiB with a fast
//! backend) those wake-ups, not the backend, bound the request rate. On a
//! plain socket we do what nbdkit does instead: a few threads per
//! connection, each of which in turn takes the read side, reads one request
//! (header and payload) and as many more as already wait whole on the
//! socket (`read_batch`), lets go, runs them, and writes their replies
//! under the write side's lock. A request is handled start to finish on one
//! thread; the only hand-off left is the read lock passing to the next
//! thread, and only for a batch worth it: one expected to run for at least
//! `HANDOFF_BATCH_NS`, or holding a FLUSH or FUA write (which wait for a
//! commit). A cheaper batch is run by the thread that read it, which keeps
//! the read side: waking another thread and moving the socket's state to
//! its CPU would cost more than the batch, and on a small machine serving
//! several connections those wake-ups, not the backend, set the rate
//! (`Conn::request_ns` learns what a request costs). Replies are written by
//! whichever thread holds the write side, several per system call (`send`). TLS streams keep the async path (OpenSSL sessions cannot be read
//! and written from two threads at once).
//!
//! Invariants (the same as `transmission.rs`, kept differently):
//! - Requests are parsed, validated and run with the same functions
//!   (`request.rs`: `parse_request`, `validate`, `execute`).
//! - At most `threads_max` batches run at once, each of at most
//!   `batch_max` requests (so at most `inflight_max` requests run at once)
//!   and of at most `max(request_bytes_max, BATCH_PAYLOAD_BYTES)` payload
//!   bytes (write data and read replies alike, `data_bytes`); their replies
//!   then wait within the bound below. A batch only takes requests that are
//!   already whole on the socket, so it never waits for a second request
//!   while holding the first. Threads start on demand (one more waits for the read side
//!   while `threads_max` allows) and stay until the connection ends; an idle
//!   connection holds two. They are threads of their own, not tokio's
//!   blocking pool, which idle connections would otherwise use up (`spawn`).
//! - A batch the reader kept does not hold the read side for long: the
//!   watchdog (one thread per process, awake only while kept batches run)
//!   hands the read side on after `KEPT_BATCH_STALL` plus up to one
//!   `WATCHDOG_TICK`, to a thread waiting for it (there is one unless all
//!   `threads_max` are busy), so requests that wait for storage still run
//!   up to `threads_max` at a time.
//! - A thread that kept the read side never blocks writing replies while
//!   holding it: it writes without waiting, and when the socket is full it
//!   hands the read side to another thread before it waits (`stall`), so a
//!   client that sends requests before it reads replies cannot deadlock us
//!   (given `threads_max` ≥ 2: with one thread, nobody reads while it
//!   waits), as long as its replies stay within the bound below; past it
//!   we stop reading until it reads, as the spec allows (libnbd and qemu
//!   read replies while they send).
//! - Replies waiting for the socket are bounded in bytes (`reply_bytes_max`,
//!   as the async path bounds its in-flight bytes): a thread that queues
//!   past it lets go of the read side and waits until the client has read
//!   enough, so a client that sends reads and never reads the replies stops
//!   being read from, instead of growing the queue. With the threads'
//!   own batches, a connection holds at most `reply_bytes_max` +
//!   `threads_max` × max(`BATCH_PAYLOAD_BYTES`, `request_bytes_max`) of
//!   payload.
//! - Every request read gets exactly one reply, unless writing to the client
//!   fails, after which the connection is closed.
//! - The connection ends only after every thread has returned from its last
//!   backend call (`run` awaits them all).
//! - Shutdown (of the server, or of this connection by `Server::revoke`)
//!   stops reading (`shutdown(SHUT_RD)` wakes the thread blocked in `read`,
//!   and no thread reads another header once `stopping` is set: a read after
//!   SHUT_RD still returns what the socket holds); requests already read
//!   still run and are answered. Once the
//!   reading has stopped, replies must be written within
//!   `DRAIN_WRITE_TIMEOUT` or the socket is shut down both ways.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch, Notify};
use tracing::{debug, warn};

use crate::buffers::BufPool;
use crate::handshake::Negotiated;
use crate::limits::{
    Limits, BATCH_PAYLOAD_BYTES, BATCH_REQUESTS_MAX, DRAIN_WRITE_TIMEOUT, HANDOFF_BATCH_NS,
    INFLIGHT_BYTES_PER_CONN_MAX, KEPT_BATCH_STALL, READ_BUFFER_BYTES, WATCHDOG_IDLE_TICKS,
    WATCHDOG_TICK,
};
use crate::proto::{Request, CMD_FLAG_FUA, CMD_FLUSH, CMD_READ, CMD_WRITE};
use crate::request::{execute, parse_request, rejected, validate, End, Outgoing, Shared};

/// A blocking socket the threads can share: one handle reads, one writes,
/// one is kept to shut the connection down from outside.
pub(crate) trait Socket: Read + Write + Pending + Send + Sync + Sized + 'static {
    fn try_clone(&self) -> io::Result<Self>;
    fn shutdown(&self, how: Shutdown) -> io::Result<()>;
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()>;
    /// Writes what the socket takes now, without waiting (`WouldBlock` when
    /// it takes nothing).
    fn write_now(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize>;
}

/// `sendmsg` with `MSG_DONTWAIT`: one call that never waits, whatever the
/// descriptor's blocking mode (shared by every clone of the socket).
fn send_now(fd: std::os::unix::io::RawFd, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is ABI-compatible with iovec; sendmsg only reads through it.
    msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = bufs.len() as _;
    // SAFETY: msg points at `bufs`, which outlives the call; `fd` is a socket we own.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

impl Socket for std::os::unix::net::UnixStream {
    fn try_clone(&self) -> io::Result<Self> {
        std::os::unix::net::UnixStream::try_clone(self)
    }
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        std::os::unix::net::UnixStream::shutdown(self, how)
    }
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        std::os::unix::net::UnixStream::set_nonblocking(self, nonblocking)
    }
    fn write_now(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        send_now(std::os::unix::io::AsRawFd::as_raw_fd(self), bufs)
    }
}

impl Socket for std::net::TcpStream {
    fn try_clone(&self) -> io::Result<Self> {
        std::net::TcpStream::try_clone(self)
    }
    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        std::net::TcpStream::shutdown(self, how)
    }
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        std::net::TcpStream::set_nonblocking(self, nonblocking)
    }
    fn write_now(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        send_now(std::os::unix::io::AsRawFd::as_raw_fd(self), bufs)
    }
}

/// What a read could return right now without blocking, and waiting for
/// it with a time limit.
pub(crate) trait Pending {
    /// Bytes queued on the socket (0 when the kernel will not say).
    fn pending(&self) -> usize;
    /// Reads what the socket holds now, without waiting (`WouldBlock` when
    /// it holds nothing).
    fn read_now(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize>;
    /// Waits until a read would not block, for at most `timeout`; false if
    /// the time passed first.
    fn wait_readable(&self, timeout: Duration) -> io::Result<bool>;
}

/// `recvmsg` with `MSG_DONTWAIT`: one call that never waits, whatever the
/// descriptor's blocking mode.
fn recv_now(fd: std::os::unix::io::RawFd, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSliceMut is ABI-compatible with iovec; recvmsg writes through it
    // within each slice's length.
    msg.msg_iov = bufs.as_mut_ptr() as *mut libc::iovec;
    msg.msg_iovlen = bufs.len() as _;
    // SAFETY: msg points at `bufs`, which outlives the call; `fd` is a socket we own.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// `poll` for input (or hang-up) on one descriptor, for at most `timeout`.
fn poll_readable(fd: std::os::unix::io::RawFd, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid pollfd; `fd` is a socket we own.
    match unsafe { libc::poll(&mut pfd, 1, ms) } {
        n if n > 0 => Ok(true),
        0 => Ok(false),
        _ => {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                // Looked at again by the caller's loop.
                Ok(true)
            } else {
                Err(e)
            }
        }
    }
}

/// `FIONREAD` on a socket descriptor.
fn queued_bytes(fd: std::os::unix::io::RawFd) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int to the pointer we pass; `fd` is a socket we own.
    let rc = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) };
    if rc == 0 {
        usize::try_from(n).unwrap_or(0)
    } else {
        0
    }
}

impl Pending for std::os::unix::net::UnixStream {
    fn pending(&self) -> usize {
        queued_bytes(std::os::unix::io::AsRawFd::as_raw_fd(self))
    }
    fn read_now(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        recv_now(std::os::unix::io::AsRawFd::as_raw_fd(self), bufs)
    }
    fn wait_readable(&self, timeout: Duration) -> io::Result<bool> {
        poll_readable(std::os::unix::io::AsRawFd::as_raw_fd(self), timeout)
    }
}

impl Pending for std::net::TcpStream {
    fn pending(&self) -> usize {
        queued_bytes(std::os::unix::io::AsRawFd::as_raw_fd(self))
    }
    fn read_now(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        recv_now(std::os::unix::io::AsRawFd::as_raw_fd(self), bufs)
    }
    fn wait_readable(&self, timeout: Duration) -> io::Result<bool> {
        poll_readable(std::os::unix::io::AsRawFd::as_raw_fd(self), timeout)
    }
}

/// The read side and why reading stopped, if it has.
struct Reading<S> {
    rd: RequestReader<S>,
    end: Option<End>,
}

/// Thread accounting and the read role: one thread at a time reads
/// requests (`reader`); the others run batches or wait for the role
/// (`idle`, on `Conn::turn`).
struct Threads {
    started: usize,
    idle: usize,
    reader: bool,
    /// Counts the times the read role was taken. The role changes hands
    /// only when its holder lets go, or when the watchdog takes it from a
    /// holder running a batch it kept (`Conn::nudge`): the holder tells the
    /// two apart by this count.
    epoch: u64,
}

struct Conn<S> {
    shared: Shared,
    reading: Mutex<Reading<S>>,
    /// Replies, written by one thread at a time.
    replies: Combiner<Outgoing, S>,
    /// Bytes of replies queued or being written (`reply_weight`), bounded
    /// by `reply_bytes_max`: a thread that queued replies past it waits,
    /// without the read side, until the client has taken enough of them.
    reply_bytes: AtomicUsize,
    reply_bytes_max: usize,
    /// Threads waiting for `reply_bytes` to fall (`room` guards the wait).
    reply_waiters: AtomicUsize,
    room: Mutex<()>,
    room_freed: Condvar,
    /// A write to the client failed: nothing more is written.
    write_failed: AtomicBool,
    /// Kept to shut the socket down from outside the threads.
    ctl: S,
    threads: Mutex<Threads>,
    /// Wakes a thread waiting for the read role.
    turn: Condvar,
    threads_max: usize,
    /// Most requests one thread reads at once.
    batch_max: usize,
    /// `Server::shutdown` was called: a read that returns EOF now means
    /// "shutting down", not "client closed".
    stopping: AtomicBool,
    /// Reading has stopped (`Reading::end` is set): no spare thread starts.
    read_over: AtomicBool,
    /// Starting a thread failed once: no more are tried.
    spawn_failed: AtomicBool,
    /// What one request of this connection has lately cost to run, in
    /// nanoseconds (a moving average over batches; 0 before the first).
    request_ns: AtomicU64,
    /// When the reader began running a batch it kept (`ns_at`), 0 when it
    /// is not running one: the watchdog hands the read role on when this
    /// gets old (`nudge`).
    kept_since: AtomicU64,
    /// Reading has stopped (for any reason): the drain timer starts.
    read_ended: Notify,
}

/// `at` in nanoseconds since the first call in this process, never 0.
fn ns_at(at: Instant) -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    u64::try_from(at.saturating_duration_since(epoch).as_nanos())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// A connection the watchdog looks at.
trait Watched: Send + Sync {
    /// Hands the read role on if a kept batch has run too long; whether one runs.
    fn nudge(&self, now: u64) -> bool;
}

impl<S: Socket> Watched for Conn<S> {
    fn nudge(&self, now: u64) -> bool {
        Conn::nudge(self, now)
    }
}

/// One thread per process that looks, every `WATCHDOG_TICK`, for a reader
/// stuck in a batch it kept, and hands its read role on. It sleeps while no
/// kept batch has run for `WATCHDOG_IDLE_TICKS` ticks; `running` wakes it.
struct Watchdog {
    conns: Mutex<Vec<Weak<dyn Watched>>>,
    parked: AtomicBool,
    /// Guards the sleep (`parked` is also read without it).
    sleep: Mutex<()>,
    wake: Condvar,
}

fn watchdog() -> &'static Watchdog {
    static DOG: OnceLock<&'static Watchdog> = OnceLock::new();
    DOG.get_or_init(|| {
        let dog: &'static Watchdog = Box::leak(Box::new(Watchdog {
            conns: Mutex::new(Vec::new()),
            parked: AtomicBool::new(false),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("nbd-watchdog".into())
            .spawn(move || dog.patrol())
            .expect("cannot start the NBD watchdog thread");
        dog
    })
}

impl Watchdog {
    fn watch(&self, conn: Weak<dyn Watched>) {
        let mut conns = lock(&self.conns);
        // Connections that ended while the watchdog slept go here.
        conns.retain(|weak| weak.strong_count() > 0);
        conns.push(conn);
    }

    /// A reader kept a batch: wake the watchdog if it sleeps.
    fn running(&self) {
        if self.parked.load(Ordering::SeqCst) {
            let _g = lock(&self.sleep);
            self.parked.store(false, Ordering::SeqCst);
            self.wake.notify_one();
        }
    }

    /// Looks at every live connection once; whether any runs a kept batch.
    fn scan(&self) -> bool {
        let now = ns_at(Instant::now());
        let mut any = false;
        lock(&self.conns).retain(|weak| match weak.upgrade() {
            Some(conn) => {
                any |= conn.nudge(now);
                true
            }
            None => false,
        });
        any
    }

    fn patrol(&self) {
        let mut quiet = 0;
        loop {
            std::thread::sleep(WATCHDOG_TICK);
            if self.scan() {
                quiet = 0;
                continue;
            }
            quiet += 1;
            if quiet < WATCHDOG_IDLE_TICKS {
                continue;
            }
            let mut g = lock(&self.sleep);
            self.parked.store(true, Ordering::SeqCst);
            // A batch kept before `parked` was set is seen here; one kept
            // after it finds `parked` set and wakes us.
            if self.scan() {
                self.parked.store(false, Ordering::SeqCst);
            }
            while self.parked.load(Ordering::SeqCst) {
                g = self.wake.wait(g).unwrap_or_else(PoisonError::into_inner);
            }
            quiet = 0;
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves its data consistent at each step.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<S: Socket> Conn<S> {
    /// Starts one more thread; `alive` is cloned into it (see `run`).
    ///
    /// A thread of its own, not one of tokio's blocking pool: a connection
    /// holds its threads while it is open (two while idle), and the pool is
    /// bounded and shared with the handshake's backend calls and the
    /// embedding program's own blocking work (the daemon's control requests).
    /// Drawing on it, a few hundred idle connections took every pool thread,
    /// and the next connection, or the next control request, waited forever.
    fn spawn(self: &Arc<Self>, alive: &mpsc::Sender<()>) -> io::Result<()> {
        let conn = Arc::clone(self);
        let alive = alive.clone();
        std::thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || {
                conn.serve_requests(&alive);
                // The connection's sockets and backend go before `run` is told.
                drop(conn);
                drop(alive);
            })
            .map(drop)
    }

    /// Records why reading stopped (the first reason wins) and wakes every
    /// thread waiting to read.
    fn end_reading(&self, reading: &mut Reading<S>, end: End) {
        if reading.end.is_none() {
            debug!("stopped reading requests: {end}");
            reading.end = Some(end);
            self.read_over.store(true, Ordering::Release);
            let _ = self.ctl.shutdown(Shutdown::Read);
            self.read_ended.notify_one();
        }
    }

    /// One thread: take the read role, read a batch of requests, run them,
    /// reply; until reading stops.
    fn serve_requests(self: &Arc<Self>, alive: &mpsc::Sender<()>) {
        let mut header = [0u8; Request::LEN];
        let mut batch = Vec::new();
        let mut replies = Vec::new();
        'role: loop {
            let epoch = self.take_role(alive);
            // While this thread holds the read role:
            loop {
                let ended = {
                    let mut reading = lock(&self.reading);
                    if reading.end.is_some() {
                        drop(reading);
                        self.give_role();
                        break 'role;
                    }
                    match self.read_batch(&mut reading.rd, &mut header, &mut batch) {
                        Some(end) => {
                            self.end_reading(&mut reading, end);
                            true
                        }
                        None => false,
                    }
                };
                if batch.is_empty() {
                    self.give_role();
                    break 'role;
                }
                let started = Instant::now();
                let mut reader = !ended && self.run_here(&batch);
                if reader {
                    self.kept_since.store(ns_at(started), Ordering::SeqCst);
                    watchdog().running();
                } else {
                    self.give_role();
                }
                let requests = batch.len() as u64;
                let ex = &self.shared.export;
                for (req, data) in batch.drain(..) {
                    replies.push(match validate(&req, ex) {
                        Err(rej) => {
                            self.shared.pool.give(data);
                            rejected(&req, &rej, ex.structured)
                        }
                        Ok(op) => execute(op, req.handle, data, &self.shared),
                    });
                }
                self.learn_cost(started, requests);
                if reader {
                    reader = self.end_kept(epoch);
                }
                let ok = if reader {
                    // Before this thread waits for a full socket, another takes the read side.
                    let mut stall = || {
                        reader = false;
                        self.give_role();
                    };
                    self.send(&mut replies, Some(&mut stall))
                } else {
                    self.send(&mut replies, None)
                };
                if !ok || ended {
                    if reader {
                        self.give_role();
                    }
                    break 'role;
                }
                if !reader {
                    continue 'role;
                }
            }
        }
    }

    /// Waits for the read role; keeps one more thread waiting for it while
    /// there is room, so the role can always be handed on at once. Returns
    /// the role's epoch.
    fn take_role(self: &Arc<Self>, alive: &mpsc::Sender<()>) -> u64 {
        let mut t = lock(&self.threads);
        while t.reader {
            t.idle += 1;
            t = self.turn.wait(t).unwrap_or_else(PoisonError::into_inner);
            t.idle -= 1;
        }
        t.reader = true;
        t.epoch += 1;
        let epoch = t.epoch;
        if t.idle == 0
            && t.started < self.threads_max
            && !self.read_over.load(Ordering::Acquire)
            && !self.spawn_failed.load(Ordering::Relaxed)
        {
            t.started += 1;
            drop(t);
            if let Err(e) = self.spawn(alive) {
                // The connection goes on with the threads it has, and tries
                // no more (nor floods the log while threads are short).
                warn!("cannot start another thread for this connection: {e}");
                self.spawn_failed.store(true, Ordering::Relaxed);
                lock(&self.threads).started -= 1;
            }
        }
        epoch
    }

    /// Hands the read role to a waiting thread (this one runs a batch, or
    /// is leaving).
    fn give_role(&self) {
        lock(&self.threads).reader = false;
        self.turn.notify_one();
    }

    /// The reader (of role `epoch`) finished a batch it kept: whether it
    /// still holds the role (the watchdog may have handed it on meanwhile).
    fn end_kept(&self, epoch: u64) -> bool {
        let t = lock(&self.threads);
        let holder = t.reader && t.epoch == epoch;
        if holder {
            self.kept_since.store(0, Ordering::SeqCst);
        }
        holder
    }

    /// From the watchdog: when the reader has been running a batch it kept
    /// for longer than `KEPT_BATCH_STALL`, another thread takes the read role
    /// (a request that looked cheap is waiting for storage). Returns whether
    /// a kept batch is running.
    fn nudge(&self, now: u64) -> bool {
        let since = self.kept_since.load(Ordering::SeqCst);
        if since == 0 {
            return false;
        }
        if now.saturating_sub(since) >= KEPT_BATCH_STALL.as_nanos() as u64 {
            let mut t = lock(&self.threads);
            if self.kept_since.load(Ordering::SeqCst) == since && t.reader && t.idle > 0 {
                self.kept_since.store(0, Ordering::SeqCst);
                t.reader = false;
                drop(t);
                self.turn.notify_one();
            }
        }
        true
    }

    /// Whether the thread that read `batch` should run it and keep the read
    /// side: when it holds no FLUSH or FUA write and should take less than
    /// `HANDOFF_BATCH_NS` at what requests have lately cost.
    fn run_here(&self, batch: &[(Request, Vec<u8>)]) -> bool {
        let waits = |r: &Request| r.kind == CMD_FLUSH || r.flags & CMD_FLAG_FUA != 0;
        if batch.iter().any(|(r, _)| waits(r)) {
            return false;
        }
        let per_request = self.request_ns.load(Ordering::Relaxed);
        per_request.saturating_mul(batch.len() as u64) < HANDOFF_BATCH_NS
    }

    /// Folds a batch's run time into `request_ns` (a moving average, 1/8
    /// weight to the newest batch; concurrent updates may lose one, which
    /// only delays the average).
    fn learn_cost(&self, started: Instant, requests: u64) {
        let per_request =
            u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX) / requests.max(1);
        let old = self.request_ns.load(Ordering::Relaxed);
        let new = old.saturating_mul(7).saturating_add(per_request) / 8;
        self.request_ns.store(new, Ordering::Relaxed);
    }

    /// Reads one request, waiting for it, then as many more as the socket already
    /// holds whole, up to the batch bounds: a burst of requests costs one hand-off
    /// of the read side and one reply write, not one each. Returns why reading
    /// stopped, if it did; the requests read before that are in `batch`.
    fn read_batch(
        &self,
        rd: &mut RequestReader<S>,
        header: &mut [u8; Request::LEN],
        batch: &mut Vec<(Request, Vec<u8>)>,
    ) -> Option<End> {
        let mut payload = 0;
        loop {
            match self.read_request(rd, header) {
                Ok((req, data)) => {
                    payload += data_bytes(&req);
                    batch.push((req, data));
                }
                Err(end) => return Some(end),
            }
            if batch.len() >= self.batch_max {
                return None;
            }
            match rd.ready(BATCH_PAYLOAD_BYTES.saturating_sub(payload)) {
                Ok(true) => {}
                // A failed look-ahead is found again, and reported, by the next read.
                Ok(false) | Err(_) => return None,
            }
        }
    }

    /// Reads one request header and its payload.
    fn read_request(
        &self,
        rd: &mut RequestReader<S>,
        header: &mut [u8; Request::LEN],
    ) -> Result<(Request, Vec<u8>), End> {
        // Stopped (shutdown, or access revoked): requests still queued on the
        // socket are not read, and so never run (a read after SHUT_RD still
        // returns what the socket holds).
        if self.stopping.load(Ordering::Acquire) {
            return Err(End::Shutdown);
        }
        rd.header(header).map_err(|e| self.read_error(e))?;
        let req = parse_request(header, &self.shared.export)?;
        let mut data = Vec::new();
        if req.kind == CMD_WRITE && req.length > 0 {
            data = self.shared.pool.take(req.length as usize);
            rd.payload(&mut data, req.length as usize)
                .map_err(|e| self.read_error(e))?;
        }
        Ok((req, data))
    }

    fn read_error(&self, e: io::Error) -> End {
        if self.stopping.load(Ordering::Acquire) {
            return End::Shutdown;
        }
        match e.kind() {
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => End::Eof,
            _ => End::Io(e),
        }
    }

    /// Queues replies (taken from `outs`) for the write side (`Combiner`);
    /// returns false once writing to the client has failed. With a `stall`,
    /// this thread writes without waiting, and runs `stall` once before it
    /// first waits, for room on the socket or for queued replies to go out
    /// (`reply_bytes_max`).
    fn send(&self, outs: &mut Vec<Outgoing>, mut stall: Option<&mut dyn FnMut()>) -> bool {
        let weight: usize = outs.iter().map(reply_weight).sum();
        self.reply_bytes.fetch_add(weight, Ordering::SeqCst);
        self.replies.push(outs, |wr, batch| {
            let written: usize = batch.iter().map(reply_weight).sum();
            if !self.write_failed.load(Ordering::Acquire) {
                if let Err(e) = write_batch(wr, &batch, &mut stall) {
                    debug!("could not send a reply: {e}");
                    self.write_failed.store(true, Ordering::Release);
                    // First wake the thread that may wait in `read` holding
                    // the read side, then record why reading stopped.
                    let _ = self.ctl.shutdown(Shutdown::Both);
                    let mut reading = lock(&self.reading);
                    self.end_reading(&mut reading, End::WriterGone);
                }
            }
            for out in batch {
                out.done(&self.shared.pool);
            }
            self.reply_bytes.fetch_sub(written, Ordering::SeqCst);
            if self.reply_waiters.load(Ordering::SeqCst) > 0 {
                let _g = lock(&self.room);
                self.room_freed.notify_all();
            }
        });
        if self.reply_bytes.load(Ordering::SeqCst) > self.reply_bytes_max {
            if let Some(stall) = stall.take() {
                stall();
            }
            self.wait_for_room();
        }
        !self.write_failed.load(Ordering::Acquire)
    }

    /// Waits until the replies queued or being written are within
    /// `reply_bytes_max`, or writing has failed. Whoever writes wakes us
    /// after each batch it wrote (or dropped, once writing failed).
    fn wait_for_room(&self) {
        self.reply_waiters.fetch_add(1, Ordering::SeqCst);
        let mut g = lock(&self.room);
        while self.reply_bytes.load(Ordering::SeqCst) > self.reply_bytes_max
            && !self.write_failed.load(Ordering::Acquire)
        {
            g = self
                .room_freed
                .wait(g)
                .unwrap_or_else(PoisonError::into_inner);
        }
        drop(g);
        self.reply_waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What a queued reply costs in memory: its payload and the reply itself.
fn reply_weight(out: &Outgoing) -> usize {
    out.body().len() + std::mem::size_of::<Outgoing>()
}

/// Items from many threads, handed to one writer at a time (flat
/// combining). A thread that finds the writer busy does not wait for it:
/// the writer takes the queue again after each batch and stops only when it
/// finds it empty after letting go of the lock, and every item is queued
/// before its thread tries the lock, so none is left behind.
struct Combiner<T, W> {
    queue: Mutex<Vec<T>>,
    out: Mutex<W>,
}

impl<T, W> Combiner<T, W> {
    fn new(out: W) -> Self {
        Self {
            queue: Mutex::new(Vec::new()),
            out: Mutex::new(out),
        }
    }

    /// Queues `items` (leaving the vector empty); unless another thread is
    /// writing, hands everything queued to `write`, batch by batch, until the
    /// queue stays empty.
    fn push(&self, items: &mut Vec<T>, mut write: impl FnMut(&mut W, Vec<T>)) {
        lock(&self.queue).append(items);
        loop {
            let mut out = match self.out.try_lock() {
                Ok(out) => out,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return,
            };
            let batch = std::mem::take(&mut *lock(&self.queue));
            if batch.is_empty() {
                // Tests widen the window in which another thread can queue
                // an item and find the lock held.
                #[cfg(test)]
                std::thread::yield_now();
                // An item queued after the take, by a thread that found the
                // lock held, is ours to write: look again once it is free.
                drop(out);
                if lock(&self.queue).is_empty() {
                    return;
                }
                continue;
            }
            write(&mut out, batch);
        }
    }
}

/// Writes replies end to end, in as few system calls as the kernel allows.
/// With a `stall`, without waiting while the socket takes them; once it is
/// full, `stall` runs (and is taken) and the rest is written waiting.
fn write_batch<S: Socket>(
    wr: &mut S,
    batch: &[Outgoing],
    stall: &mut Option<&mut dyn FnMut()>,
) -> io::Result<()> {
    let mut parts: Vec<IoSlice<'_>> = Vec::with_capacity(batch.len() * 2);
    for out in batch {
        parts.push(IoSlice::new(out.head()));
        if !out.body().is_empty() {
            parts.push(IoSlice::new(out.body()));
        }
    }
    let mut bufs: &mut [IoSlice<'_>] = &mut parts;
    while !bufs.is_empty() {
        let waiting = stall.is_none();
        // At most IOV_MAX slices per call.
        let n = bufs.len().min(1024);
        let result = if waiting {
            wr.write_vectored(&bufs[..n])
        } else {
            wr.write_now(&bufs[..n])
        };
        match result {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(written) => IoSlice::advance_slices(&mut bufs, written),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && !waiting => {
                if let Some(stall) = stall.take() {
                    stall();
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Bytes of data a request carries either way, each needing a buffer while it
/// runs: a write's payload, a read's reply. A batch's are bounded together
/// (`BATCH_PAYLOAD_BYTES`): 16 reads of 32 MiB once made one thread hold
/// 512 MiB, and a client with 64 such reads in flight 2 GiB of the daemon.
fn data_bytes(req: &Request) -> usize {
    if req.kind == CMD_WRITE || req.kind == CMD_READ {
        req.length as usize
    } else {
        0
    }
}

/// Payloads at least this long are read straight into their own buffer, with only
/// the next request's header read ahead; shorter ones come through the read-ahead
/// buffer, several requests per system call.
const PAYLOAD_DIRECT_BYTES: usize = 16 << 10;
/// How far a fresh payload buffer grows ahead of the bytes that arrived (`payload`).
const PAYLOAD_GROW_BYTES: usize = 1 << 20;

/// The read side of a connection. Request headers (and short payloads) come through
/// a read-ahead buffer, so a burst of small requests costs one system call. A long
/// payload is read with one `readv` straight into its own buffer plus the next
/// header into the read-ahead buffer: no copy through the buffer, which for 64 KiB
/// writes cost as much CPU as the kernel's own copy out of the socket.
struct RequestReader<S> {
    sock: S,
    buf: Box<[u8]>,
    /// `buf[pos..end]` is read and not yet consumed.
    pos: usize,
    end: usize,
    /// The last payload was long: read ahead one header only, so the next long
    /// payload is not pulled into `buf` (and copied out of it).
    long: bool,
    /// How long the rest of a request may take to arrive once it has begun
    /// (`ServerConfig::payload_timeout`).
    timeout: Duration,
    /// When the request being read must be whole: set when it first has to
    /// be waited for, cleared before the next header.
    deadline: Option<Instant>,
}

/// Reads into `bufs`: as long as it takes without a `deadline` (between
/// requests, where an idle client may stay), else until `deadline`, then
/// fails with `TimedOut`.
fn read_by<S: Read + Pending>(
    sock: &mut S,
    bufs: &mut [IoSliceMut<'_>],
    deadline: Option<Instant>,
    timeout: Duration,
) -> io::Result<usize> {
    let Some(deadline) = deadline else {
        return sock.read_vectored(bufs);
    };
    loop {
        match sock.read_now(bufs) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            r => return r,
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || !sock.wait_readable(left)? {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the rest of a request did not arrive within {}s (serve --payload-timeout)",
                    timeout.as_secs_f64()
                ),
            ));
        }
    }
}

impl<S: Read + Pending> RequestReader<S> {
    fn new(sock: S, capacity: usize, timeout: Duration) -> Self {
        debug_assert!(capacity >= Request::LEN);
        Self {
            sock,
            buf: vec![0; capacity].into_boxed_slice(),
            pos: 0,
            end: 0,
            long: false,
            timeout,
            deadline: None,
        }
    }

    /// The deadline of the request being read, starting it now if unset.
    fn deadline(&mut self) -> Instant {
        let timeout = self.timeout;
        *self
            .deadline
            .get_or_insert_with(|| Instant::now() + timeout)
    }

    /// Reads the next request header. Waits as long as it takes for its
    /// first byte; the rest of the request, payload included, must follow
    /// within `timeout`.
    fn header(&mut self, out: &mut [u8; Request::LEN]) -> io::Result<()> {
        self.deadline = None;
        self.fill_header()?;
        out.copy_from_slice(&self.buf[self.pos..self.pos + Request::LEN]);
        self.pos += Request::LEN;
        Ok(())
    }

    /// Reads until `buf[pos..]` holds a whole header.
    fn fill_header(&mut self) -> io::Result<()> {
        while self.end - self.pos < Request::LEN {
            if self.pos > 0 {
                self.buf.copy_within(self.pos..self.end, 0);
                self.end -= self.pos;
                self.pos = 0;
            }
            let limit = if self.long {
                Request::LEN
            } else {
                self.buf.len()
            };
            // Nothing of the next request yet: an idle client may wait.
            let deadline = (self.end > 0).then(|| self.deadline());
            let timeout = self.timeout;
            let into = &mut [IoSliceMut::new(&mut self.buf[self.end..limit])];
            match read_by(&mut self.sock, into, deadline, timeout) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.end += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads a payload of exactly `len` bytes into `data` (resized to `len`; a pooled
    /// buffer of that size is not zero-filled again). A fresh buffer grows as the bytes
    /// arrive, `PAYLOAD_GROW_BYTES` ahead of them at most: a client that sends a large
    /// WRITE's header and then little of its payload makes the daemon hold (touch) only
    /// what it sent, not the whole length it announced, on each of its connections.
    fn payload(&mut self, data: &mut Vec<u8>, len: usize) -> io::Result<()> {
        let buffered = len.min(self.end - self.pos);
        data.truncate(len);
        let first = buffered.max(len.min(PAYLOAD_GROW_BYTES));
        if data.len() < first {
            data.resize(first, 0);
        }
        data[..buffered].copy_from_slice(&self.buf[self.pos..self.pos + buffered]);
        self.pos += buffered;
        self.long = len >= PAYLOAD_DIRECT_BYTES;
        let mut at = buffered;
        if at == len {
            return Ok(());
        }
        // The buffer is drained: the rest of the payload goes straight to `data`, and
        // whatever follows it (the next header, or more for short requests) to `buf`.
        self.pos = 0;
        self.end = 0;
        let ahead = if self.long {
            Request::LEN
        } else {
            self.buf.len()
        };
        let deadline = Some(self.deadline());
        while at < len {
            if data.len() < len && data.len() < at + PAYLOAD_GROW_BYTES {
                data.resize(len.min(at + PAYLOAD_GROW_BYTES), 0);
            }
            // What follows the payload goes to `buf`, once `data` reaches its end.
            let last = data.len() == len;
            let room = data.len() - at;
            let (head, tail) = (
                &mut data[at..],
                &mut self.buf[..if last { ahead } else { 0 }],
            );
            let mut parts = [IoSliceMut::new(head), IoSliceMut::new(tail)];
            match read_by(&mut self.sock, &mut parts, deadline, self.timeout) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    let into_data = n.min(room);
                    at += into_data;
                    self.end = n - into_data;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Whether the next request, header and payload, can be read whole without
    /// waiting, and its data (`data_bytes`) is at most `payload_room` bytes. May read the next
    /// header into the buffer (only when the socket already holds it).
    fn ready(&mut self, payload_room: usize) -> io::Result<bool> {
        let buffered = self.end - self.pos;
        if buffered < Request::LEN {
            if buffered + self.sock.pending() < Request::LEN {
                return Ok(false);
            }
            self.fill_header()?;
        }
        let mut head = [0u8; Request::LEN];
        head.copy_from_slice(&self.buf[self.pos..self.pos + Request::LEN]);
        // A malformed header is left for the next blocking read to report.
        let Ok(req) = Request::parse(&head) else {
            return Ok(false);
        };
        if data_bytes(&req) > payload_room {
            return Ok(false);
        }
        let payload = if req.kind == CMD_WRITE {
            req.length as usize
        } else {
            0
        };
        let buffered = self.end - self.pos - Request::LEN;
        Ok(payload <= buffered || payload <= buffered + self.sock.pending())
    }
}

/// Serves requests on a blocking `socket` until the client disconnects,
/// breaks the protocol, or the server shuts down; returns once every
/// request read has finished.
pub(crate) async fn run<S: Socket>(
    socket: S,
    export: Negotiated,
    limits: &Limits,
    mut shutdown: watch::Receiver<bool>,
) -> End {
    let setup = || -> io::Result<(S, S, S)> {
        socket.set_nonblocking(false)?;
        Ok((socket.try_clone()?, socket.try_clone()?, socket))
    };
    let (rd, wr, ctl) = match setup() {
        Ok(x) => x,
        Err(e) => return End::Io(e),
    };
    let (alive, mut exited) = mpsc::channel::<()>(1);
    let threads_max = limits.workers_max.min(limits.inflight_max).max(1);
    let conn = Arc::new(Conn {
        shared: Shared {
            export,
            pool: BufPool::default(),
        },
        reading: Mutex::new(Reading {
            rd: RequestReader::new(rd, READ_BUFFER_BYTES, limits.payload_timeout),
            end: None,
        }),
        replies: Combiner::new(wr),
        reply_bytes: AtomicUsize::new(0),
        // Not raised to `request_bytes_max`: a thread queues its replies
        // before it looks at the bound, so a larger request still goes out.
        reply_bytes_max: INFLIGHT_BYTES_PER_CONN_MAX as usize,
        reply_waiters: AtomicUsize::new(0),
        room: Mutex::new(()),
        room_freed: Condvar::new(),
        write_failed: AtomicBool::new(false),
        ctl,
        threads: Mutex::new(Threads {
            started: 1,
            idle: 0,
            reader: false,
            epoch: 0,
        }),
        turn: Condvar::new(),
        threads_max,
        batch_max: (limits.inflight_max / threads_max).clamp(1, BATCH_REQUESTS_MAX),
        stopping: AtomicBool::new(false),
        read_over: AtomicBool::new(false),
        spawn_failed: AtomicBool::new(false),
        request_ns: AtomicU64::new(0),
        kept_since: AtomicU64::new(0),
        read_ended: Notify::new(),
    });
    watchdog().watch(Arc::downgrade(&conn) as Weak<dyn Watched>);
    if let Err(e) = conn.spawn(&alive) {
        warn!("cannot start a thread for this connection: {e}");
        conn.end_reading(&mut lock(&conn.reading), End::Io(e));
    }
    drop(alive);

    // Until reading stops: watch for shutdown.
    tokio::select! {
        _ = shutdown.wait_for(|s| *s) => {
            conn.stopping.store(true, Ordering::Release);
            let _ = conn.ctl.shutdown(Shutdown::Read);
        }
        _ = conn.read_ended.notified() => {}
    }
    // Draining: replies must go out within the bound.
    if tokio::time::timeout(DRAIN_WRITE_TIMEOUT, exited.recv())
        .await
        .is_err()
    {
        debug!("client stopped reading replies: closing the connection");
        let _ = conn.ctl.shutdown(Shutdown::Both);
        let _ = exited.recv().await;
    }
    let mut reading = lock(&conn.reading);
    reading.end.take().unwrap_or(End::Shutdown)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that hands out at most `chunk` bytes per call, vectored or not, and
    /// is interrupted now and then: every boundary case of `RequestReader`'s loops.
    struct Trickle {
        data: Vec<u8>,
        at: usize,
        chunk: usize,
        calls: usize,
    }

    /// A client that sent `data` and then nothing more, without closing.
    struct Stalled(Trickle);

    impl Read for Stalled {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.read_vectored(&mut [IoSliceMut::new(buf)])
        }
        fn read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
            if self.0.at == self.0.data.len() {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            self.0.read_vectored(bufs)
        }
    }

    impl Pending for Stalled {
        fn pending(&self) -> usize {
            self.0.pending()
        }
        fn read_now(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
            self.read_vectored(bufs)
        }
        fn wait_readable(&self, timeout: Duration) -> io::Result<bool> {
            std::thread::sleep(timeout);
            Ok(self.0.pending() > 0)
        }
    }

    impl Read for Trickle {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.read_vectored(&mut [IoSliceMut::new(buf)])
        }
        fn read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
            self.calls += 1;
            if self.calls % 7 == 0 {
                return Err(io::ErrorKind::Interrupted.into());
            }
            let mut n = 0;
            for b in bufs {
                let take = b.len().min(self.chunk - n).min(self.data.len() - self.at);
                b[..take].copy_from_slice(&self.data[self.at..self.at + take]);
                self.at += take;
                n += take;
            }
            Ok(n)
        }
    }

    impl Pending for Trickle {
        fn pending(&self) -> usize {
            self.data.len() - self.at
        }
        fn read_now(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
            self.read_vectored(bufs)
        }
        fn wait_readable(&self, _: Duration) -> io::Result<bool> {
            Ok(true)
        }
    }

    fn request(kind: u16, length: u32) -> Vec<u8> {
        Request {
            flags: 0,
            kind,
            handle: 7,
            offset: 0,
            length,
        }
        .encode()
        .to_vec()
    }

    /// `ready` says yes exactly when the next request is there whole (header and
    /// payload) and fits the room left, never consumes a request, and leaves a
    /// malformed header for the blocking read to report.
    #[test]
    fn request_reader_knows_when_a_whole_request_waits() {
        use crate::proto::{CMD_FLUSH, CMD_READ};
        let mut stream = request(CMD_WRITE, 70000);
        stream.extend(vec![1u8; 70000]);
        stream.extend(request(CMD_READ, 1 << 20));
        stream.extend(request(CMD_WRITE, 4096));
        stream.extend(vec![2u8; 4096]);
        stream.extend(request(CMD_FLUSH, 0));
        let whole = stream.len();
        for cut in [whole, whole - 1, whole - Request::LEN, whole - 30] {
            for chunk in [1, 29, 4096, 1 << 20] {
                let mut rd = RequestReader::new(
                    Trickle {
                        data: stream[..cut].to_vec(),
                        at: 0,
                        chunk,
                        calls: 0,
                    },
                    4096,
                    Duration::from_secs(60),
                );
                let mut h = [0u8; Request::LEN];
                let mut data = Vec::new();
                let ctx = format!("cut {cut} chunk {chunk}");
                assert!(rd.ready(1 << 20).unwrap(), "{ctx}");
                assert!(
                    !rd.ready(69999).unwrap(),
                    "payload larger than the room: {ctx}"
                );
                rd.header(&mut h).unwrap();
                rd.payload(&mut data, 70000).unwrap();
                // A read's reply counts against the room like a write's payload.
                assert!(!rd.ready((1 << 20) - 1).unwrap(), "{ctx}");
                assert!(rd.ready(1 << 20).unwrap(), "{ctx}");
                rd.header(&mut h).unwrap();
                assert_eq!(Request::parse(&h).unwrap().kind, CMD_READ, "{ctx}");
                let last_write_whole = cut >= whole - Request::LEN;
                assert_eq!(rd.ready(1 << 20).unwrap(), last_write_whole, "{ctx}");
                if !last_write_whole {
                    continue;
                }
                rd.header(&mut h).unwrap();
                rd.payload(&mut data, 4096).unwrap();
                assert_eq!(data, vec![2u8; 4096], "{ctx}");
                assert_eq!(rd.ready(1 << 20).unwrap(), cut == whole, "{ctx}");
            }
        }
        let mut bad = request(CMD_WRITE, 0);
        bad[0] ^= 0xff;
        let mut rd = RequestReader::new(
            Trickle {
                data: bad,
                at: 0,
                chunk: 64,
                calls: 0,
            },
            4096,
            Duration::from_secs(60),
        );
        assert!(!rd.ready(1 << 20).unwrap());
        let mut h = [0u8; Request::LEN];
        rd.header(&mut h).unwrap();
        assert!(Request::parse(&h).is_err());
    }

    /// Headers and payloads of every size come out whole and in order, however the
    /// stream is cut, and a pooled buffer's stale bytes never show through.
    #[test]
    fn request_reader_returns_each_header_and_payload_whole() {
        let sizes = [
            0usize, 1, 4096, 65536, 100, 70000, 16384, 16383, 4096, 0, 200000,
        ];
        let mut stream = Vec::new();
        let mut expected = Vec::new();
        for (i, &len) in sizes.iter().enumerate() {
            let header = [i as u8; Request::LEN];
            let payload: Vec<u8> = (0..len).map(|j| (j * 31 + i) as u8).collect();
            stream.extend_from_slice(&header);
            stream.extend_from_slice(&payload);
            expected.push((header, payload));
        }
        for chunk in [1, 27, 28, 29, 4095, 65536 + 28, 1 << 20] {
            for capacity in [Request::LEN, 4096, 64 << 10] {
                let mut rd = RequestReader::new(
                    Trickle {
                        data: stream.clone(),
                        at: 0,
                        chunk,
                        calls: 0,
                    },
                    capacity,
                    Duration::from_secs(60),
                );
                let mut data = vec![0xEE; 300000];
                for (header, payload) in &expected {
                    let mut h = [0u8; Request::LEN];
                    rd.header(&mut h).unwrap();
                    assert_eq!(&h, header, "chunk {chunk} capacity {capacity}");
                    rd.payload(&mut data, payload.len()).unwrap();
                    assert!(data == *payload, "chunk {chunk} capacity {capacity}");
                }
                let mut h = [0u8; Request::LEN];
                let eof = rd.header(&mut h).unwrap_err();
                assert_eq!(eof.kind(), io::ErrorKind::UnexpectedEof);
            }
        }
    }

    /// A stream that ends inside a payload is an error, not a short payload.
    #[test]
    fn request_reader_reports_a_truncated_payload() {
        let mut stream = vec![9u8; Request::LEN];
        stream.extend_from_slice(&[1u8; 5000]);
        let mut rd = RequestReader::new(
            Trickle {
                data: stream,
                at: 0,
                chunk: 3000,
                calls: 0,
            },
            4096,
            Duration::from_secs(60),
        );
        let mut h = [0u8; Request::LEN];
        rd.header(&mut h).unwrap();
        let mut data = Vec::new();
        let e = rd.payload(&mut data, 65536).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }

    /// A request whose payload (or the rest of whose header) stops coming
    /// fails with `TimedOut` once the timeout has passed, not before; an
    /// idle client between requests is waited for.
    #[test]
    fn request_reader_times_out_a_stalled_request() {
        let timeout = Duration::from_millis(50);
        let stalled = |data: Vec<u8>| {
            RequestReader::new(
                Stalled(Trickle {
                    data,
                    at: 0,
                    chunk: 1000,
                    calls: 1,
                }),
                4096,
                timeout,
            )
        };
        let mut stream = vec![9u8; Request::LEN];
        stream.extend_from_slice(&[1u8; 5000]);
        let mut rd = stalled(stream);
        let mut h = [0u8; Request::LEN];
        rd.header(&mut h).unwrap();
        let mut data = Vec::new();
        let started = Instant::now();
        let e = rd.payload(&mut data, 65536).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(started.elapsed() >= timeout);
        assert!(e.to_string().contains("--payload-timeout"), "{e}");

        // Half a header, then nothing.
        let mut rd = stalled(vec![9u8; Request::LEN / 2]);
        let e = rd.header(&mut h).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");

        // Nothing at all: the blocking read is asked (no deadline), and the
        // stand-in socket says it would block.
        let mut rd = stalled(Vec::new());
        let e = rd.header(&mut h).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "{e}");
    }

    /// Threads pushing at once, in rounds: after every round (once all
    /// pushes have returned) the queue is empty, every item was written
    /// exactly once, and by one writer at a time.
    #[test]
    fn combiner_leaves_nothing_behind() {
        const THREADS: usize = 4;
        const ROUNDS: usize = 20_000;
        let c = Arc::new(Combiner::new(Vec::<usize>::new()));
        let writers = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let barrier = Arc::new(std::sync::Barrier::new(THREADS));
        let stranded = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (c, writers, barrier, stranded) = (
                    Arc::clone(&c),
                    Arc::clone(&writers),
                    Arc::clone(&barrier),
                    Arc::clone(&stranded),
                );
                std::thread::spawn(move || {
                    for round in 0..ROUNDS {
                        c.push(&mut vec![round * THREADS + t], |out, batch| {
                            assert_eq!(writers.fetch_add(1, Ordering::SeqCst), 0);
                            out.extend(batch);
                            writers.fetch_sub(1, Ordering::SeqCst);
                        });
                        // Checked by one thread while all wait; recorded,
                        // not asserted, so a failure cannot strand the
                        // others at the barrier.
                        if barrier.wait().is_leader()
                            && (!lock(&c.queue).is_empty()
                                || lock(&c.out).len() != (round + 1) * THREADS)
                        {
                            stranded.fetch_add(1, Ordering::SeqCst);
                        }
                        barrier.wait();
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(
            stranded.load(Ordering::SeqCst),
            0,
            "rounds that ended with a reply left queued"
        );
        let mut got = std::mem::take(&mut *lock(&c.out));
        got.sort_unstable();
        assert_eq!(got, (0..THREADS * ROUNDS).collect::<Vec<_>>());
    }
}
