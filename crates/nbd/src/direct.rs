//! The transmission phase on a plain socket (Unix or TCP), without hand-offs.
//!
//! `transmission.rs` moves every request across three parties: the async
//! reader parses it, a worker thread runs it, the async writer sends the
//! reply. Each crossing is a wake-up, and at 4 KiB (or 64 KiB with a fast
//! backend) those wake-ups, not the backend, bound the request rate. On a
//! plain socket we do what nbdkit does instead: a few threads per
//! connection, each of which in turn takes the read side, reads one request
//! (header and payload), lets go, runs the request, and writes its own reply
//! under the write side's lock. A request is handled start to finish on one
//! thread; the only hand-off left is the read lock passing to the next
//! thread. Replies are written by whichever thread holds the write side,
//! several per system call when they finish together (`send`). TLS streams keep the async path (OpenSSL sessions cannot be read
//! and written from two threads at once).
//!
//! Invariants (the same as `transmission.rs`, kept differently):
//! - Requests are parsed and validated with the same functions
//!   (`parse_request`, `validate`, `execute`).
//! - At most `threads_max` requests are in flight, each holding at most one
//!   payload of `request_bytes_max`: the connection's memory is bounded by
//!   its threads. Threads start on demand (when every started one is busy)
//!   and stay until the connection ends; an idle connection holds one.
//! - Every request read gets exactly one reply, unless writing to the client
//!   fails, after which the connection is closed.
//! - The connection ends only after every thread has returned from its last
//!   backend call (`run` awaits them all).
//! - Shutdown stops reading (`shutdown(SHUT_RD)` wakes the thread blocked in
//!   `read`); requests already read still run and are answered. Once the
//!   reading has stopped, replies must be written within
//!   `DRAIN_WRITE_TIMEOUT` or the socket is shut down both ways.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::{mpsc, watch, Notify};
use tracing::debug;

use crate::buffers::BufPool;
use crate::handshake::Negotiated;
use crate::limits::{DRAIN_WRITE_TIMEOUT, READ_BUFFER_BYTES};
use crate::proto::{Request, CMD_WRITE};
use crate::server::Limits;
use crate::transmission::{execute, parse_request, rejected, validate, End, Outgoing, Shared};

/// A blocking socket the threads can share: one handle reads, one writes,
/// one is kept to shut the connection down from outside.
pub(crate) trait Socket: Read + Write + Send + Sync + Sized + 'static {
    fn try_clone(&self) -> io::Result<Self>;
    fn shutdown(&self, how: Shutdown) -> io::Result<()>;
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()>;
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
}

/// The read side and why reading stopped, if it has.
struct Reading<S> {
    rd: RequestReader<S>,
    end: Option<End>,
}

/// Thread accounting.
struct Threads {
    started: usize,
    busy: usize,
}

struct Conn<S> {
    shared: Shared,
    reading: Mutex<Reading<S>>,
    /// Replies, written by one thread at a time.
    replies: Combiner<Outgoing, S>,
    /// A write to the client failed: nothing more is written.
    write_failed: AtomicBool,
    /// Kept to shut the socket down from outside the threads.
    ctl: S,
    threads: Mutex<Threads>,
    threads_max: usize,
    /// `Server::shutdown` was called: a read that returns EOF now means
    /// "shutting down", not "client closed".
    stopping: AtomicBool,
    /// Reading has stopped (for any reason): the drain timer starts.
    read_ended: Notify,
    runtime: tokio::runtime::Handle,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves its data consistent at each step.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<S: Socket> Conn<S> {
    /// Starts one more thread. `alive` is cloned into it (see `run`).
    fn spawn(self: &Arc<Self>, alive: &mpsc::Sender<()>) {
        let conn = Arc::clone(self);
        let alive = alive.clone();
        // A thread from tokio's blocking pool: reused across connections.
        self.runtime.spawn_blocking(move || {
            conn.serve_requests(&alive);
            drop(alive);
        });
    }

    /// Records why reading stopped (the first reason wins) and wakes every
    /// thread waiting to read.
    fn end_reading(&self, reading: &mut Reading<S>, end: End) {
        if reading.end.is_none() {
            debug!("stopped reading requests: {end}");
            reading.end = Some(end);
            let _ = self.ctl.shutdown(Shutdown::Read);
            self.read_ended.notify_one();
        }
    }

    /// One thread: read a request, run it, reply; until reading stops.
    fn serve_requests(self: &Arc<Self>, alive: &mpsc::Sender<()>) {
        let mut header = [0u8; Request::LEN];
        loop {
            let (req, data) = {
                let mut reading = lock(&self.reading);
                if reading.end.is_some() {
                    break;
                }
                match self.read_request(&mut reading.rd, &mut header) {
                    Ok(x) => x,
                    Err(end) => {
                        self.end_reading(&mut reading, end);
                        break;
                    }
                }
            };
            self.start_busy(alive);
            let ex = &self.shared.export;
            let out = match validate(&req, ex) {
                Err(rej) => {
                    self.shared.pool.give(data);
                    rejected(&req, &rej, ex.structured)
                }
                Ok(op) => execute(op, req.handle, data, &self.shared),
            };
            let ok = self.send(out);
            lock(&self.threads).busy -= 1;
            if !ok {
                break;
            }
        }
    }

    /// Marks this thread busy; starts another when none is left to read.
    fn start_busy(self: &Arc<Self>, alive: &mpsc::Sender<()>) {
        let mut t = lock(&self.threads);
        t.busy += 1;
        if t.busy == t.started && t.started < self.threads_max {
            t.started += 1;
            drop(t);
            self.spawn(alive);
        }
    }

    /// Reads one request header and its payload.
    fn read_request(
        &self,
        rd: &mut RequestReader<S>,
        header: &mut [u8; Request::LEN],
    ) -> Result<(Request, Vec<u8>), End> {
        rd.header(header).map_err(|e| self.read_error(e))?;
        let req = parse_request(header, &self.shared.export)?;
        let mut data = Vec::new();
        if req.kind == CMD_WRITE && req.length > 0 {
            data = self.shared.pool.take();
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

    /// Queues a reply for the write side (`Combiner`); returns false once
    /// writing to the client has failed.
    fn send(&self, out: Outgoing) -> bool {
        self.replies.push(out, |wr, batch| {
            if !self.write_failed.load(Ordering::Acquire) {
                if let Err(e) = write_batch(wr, &batch) {
                    debug!("could not send a reply: {e}");
                    self.write_failed.store(true, Ordering::Release);
                    let mut reading = lock(&self.reading);
                    self.end_reading(&mut reading, End::WriterGone);
                    let _ = self.ctl.shutdown(Shutdown::Both);
                }
            }
            for out in batch {
                out.done(&self.shared.pool);
            }
        });
        !self.write_failed.load(Ordering::Acquire)
    }
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

    /// Queues `item`; unless another thread is writing, hands everything
    /// queued to `write`, batch by batch, until the queue stays empty.
    fn push(&self, item: T, mut write: impl FnMut(&mut W, Vec<T>)) {
        lock(&self.queue).push(item);
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
fn write_batch<W: Write>(wr: &mut W, batch: &[Outgoing]) -> io::Result<()> {
    let mut parts: Vec<IoSlice<'_>> = Vec::with_capacity(batch.len() * 2);
    for out in batch {
        parts.push(IoSlice::new(out.head()));
        if !out.body().is_empty() {
            parts.push(IoSlice::new(out.body()));
        }
    }
    let mut bufs: &mut [IoSlice<'_>] = &mut parts;
    while !bufs.is_empty() {
        // At most IOV_MAX slices per call.
        let n = bufs.len().min(1024);
        match wr.write_vectored(&bufs[..n]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(written) => IoSlice::advance_slices(&mut bufs, written),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Payloads at least this long are read straight into their own buffer, with only
/// the next request's header read ahead; shorter ones come through the read-ahead
/// buffer, several requests per system call.
const PAYLOAD_DIRECT_BYTES: usize = 16 << 10;

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
}

impl<S: Read> RequestReader<S> {
    fn new(sock: S, capacity: usize) -> Self {
        debug_assert!(capacity >= Request::LEN);
        Self {
            sock,
            buf: vec![0; capacity].into_boxed_slice(),
            pos: 0,
            end: 0,
            long: false,
        }
    }

    /// Reads the next request header.
    fn header(&mut self, out: &mut [u8; Request::LEN]) -> io::Result<()> {
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
            match self.sock.read(&mut self.buf[self.end..limit]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.end += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        out.copy_from_slice(&self.buf[self.pos..self.pos + Request::LEN]);
        self.pos += Request::LEN;
        Ok(())
    }

    /// Reads a payload of exactly `len` bytes into `data` (resized to `len`; a pooled
    /// buffer of that size is not zero-filled again).
    fn payload(&mut self, data: &mut Vec<u8>, len: usize) -> io::Result<()> {
        data.resize(len, 0);
        let buffered = len.min(self.end - self.pos);
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
        while at < len {
            let mut parts = [
                IoSliceMut::new(&mut data[at..]),
                IoSliceMut::new(&mut self.buf[..ahead]),
            ];
            match self.sock.read_vectored(&mut parts) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    let into_data = n.min(len - at);
                    at += into_data;
                    self.end = n - into_data;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
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
    let conn = Arc::new(Conn {
        shared: Shared {
            export,
            pool: BufPool::default(),
        },
        reading: Mutex::new(Reading {
            rd: RequestReader::new(rd, READ_BUFFER_BYTES),
            end: None,
        }),
        replies: Combiner::new(wr),
        write_failed: AtomicBool::new(false),
        ctl,
        threads: Mutex::new(Threads {
            started: 1,
            busy: 0,
        }),
        threads_max: limits.workers_max.min(limits.inflight_max).max(1),
        stopping: AtomicBool::new(false),
        read_ended: Notify::new(),
        runtime: tokio::runtime::Handle::current(),
    });
    conn.spawn(&alive);
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
        );
        let mut h = [0u8; Request::LEN];
        rd.header(&mut h).unwrap();
        let mut data = Vec::new();
        let e = rd.payload(&mut data, 65536).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
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
                        c.push(round * THREADS + t, |out, batch| {
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
