//! The transmission phase: requests in, replies out, many in flight.
//!
//! Data path: one reader (the connection's task) parses a request header,
//! takes an in-flight permit (and a payload-bytes permit for READ/WRITE),
//! reads any write payload, validates the request with [`validate`], and
//! queues it for the connection's worker threads (`workers.rs`), where
//! [`execute`] calls the backend and sends the finished reply to the one
//! writer task over a channel. The writer serialises replies in completion
//! order, batching small ones before a flush.
//!
//! Invariants:
//! - Requests are validated once, at the edge (`request.rs`), before they
//!   are queued; a backend never sees an invalid call.
//! - Every admitted request produces exactly one reply (one simple reply,
//!   or structured chunks ending in `NBD_REPLY_FLAG_DONE`), except after
//!   the connection has failed.
//! - A reply carries its request's permits until it is written, so the
//!   reply channel never holds more than `max_inflight_per_conn` replies
//!   and `blocking_send` never waits.
//! - The connection ends only after every admitted request's backend call
//!   has returned: callers may close a backend once `Server::wait_idle`
//!   resolves.
//! - A client that stops reading replies stalls only its own connection;
//!   once the reader has stopped, each remaining write is bounded by
//!   `DRAIN_WRITE_TIMEOUT`.

use std::future::Future;
use std::io;
use std::sync::Arc;

use tokio::io::{
    AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter,
};
use tokio::sync::{mpsc, watch, Semaphore};
use tracing::{debug, error};

use crate::buffers::BufPool;
use crate::handshake::Negotiated;
use crate::limits::{
    Limits, DRAIN_WRITE_TIMEOUT, INFLIGHT_BYTES_PER_CONN_MAX, READ_BUFFER_BYTES, WRITE_BUFFER_BYTES,
};
use crate::proto::{Request, CMD_READ, CMD_WRITE};
use crate::request::{execute, parse_request, rejected, validate, End, Outgoing, Shared};
use crate::workers::Workers;

// ---- Reader --------------------------------------------------------------

fn io_end(e: io::Error) -> End {
    match e.kind() {
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => End::Eof,
        _ => End::Io(e),
    }
}

/// Races `f` against shutdown and writer failure.
async fn interruptible<F: Future>(
    f: F,
    shutdown: &mut watch::Receiver<bool>,
    tx: &mpsc::Sender<Outgoing>,
) -> Result<F::Output, End> {
    tokio::select! {
        biased;
        _ = shutdown.wait_for(|s| *s) => Err(End::Shutdown),
        _ = tx.closed() => Err(End::WriterGone),
        out = f => Ok(out),
    }
}

/// Reads exactly `len` bytes into `buf` (which is cleared), without
/// zero-filling it first.
async fn read_payload<R: AsyncRead + Unpin>(
    rd: &mut R,
    buf: &mut Vec<u8>,
    len: usize,
) -> io::Result<()> {
    buf.clear();
    buf.reserve(len);
    let mut limited = rd.take(len as u64);
    while buf.len() < len {
        if limited.read_buf(buf).await? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(())
}

/// Runs `f` (a read of part of a request) unless `deadline` passes first:
/// then `TimedOut` (`ServerConfig::payload_timeout`).
async fn within<F: Future<Output = io::Result<T>>, T>(
    deadline: tokio::time::Instant,
    timeout: std::time::Duration,
    f: F,
) -> io::Result<T> {
    match tokio::time::timeout_at(deadline, f).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "the rest of a request did not arrive within {}s (serve --payload-timeout)",
                timeout.as_secs_f64()
            ),
        )),
    }
}

struct Reader<'a, R> {
    rd: &'a mut BufReader<R>,
    /// How long the rest of a request may take once it has begun.
    timeout: std::time::Duration,
    shared: &'a Arc<Shared>,
    tx: &'a mpsc::Sender<Outgoing>,
    inflight: &'a Arc<Semaphore>,
    budget: &'a Arc<Semaphore>,
    workers: &'a Workers,
    shutdown: &'a mut watch::Receiver<bool>,
}

impl<R: AsyncRead + Unpin> Reader<'_, R> {
    /// Shutdown requested or writer gone: stop reading requests.
    fn stopping(&self) -> bool {
        *self.shutdown.borrow() || self.tx.is_closed()
    }

    async fn run(&mut self) -> End {
        loop {
            if let Err(end) = self.one().await {
                return end;
            }
        }
    }

    /// Reads, admits and dispatches one request.
    async fn one(&mut self) -> Result<(), End> {
        let mut header = [0u8; Request::LEN];
        if self.rd.buffer().len() >= Request::LEN && !self.stopping() {
            // Fast path for pipelined requests: the header is already
            // buffered, so this cannot wait.
            self.rd.read_exact(&mut header).await.map_err(io_end)?;
        } else {
            // An idle client may wait as long as it likes for its next
            // request; once a byte of it has come, the rest must follow
            // within the timeout.
            let first = async { self.rd.fill_buf().await.map(|b| b.len()) };
            if interruptible(first, self.shutdown, self.tx)
                .await?
                .map_err(io_end)?
                == 0
            {
                return Err(End::Eof);
            }
            let deadline = tokio::time::Instant::now() + self.timeout;
            let rest = within(deadline, self.timeout, self.rd.read_exact(&mut header));
            interruptible(rest, self.shutdown, self.tx)
                .await?
                .map_err(io_end)?;
        }
        let ex = &self.shared.export;
        let req = parse_request(&header, ex)?;
        let payload = req.kind == CMD_WRITE;
        let mut permits = Vec::with_capacity(2);
        let permit = match Arc::clone(self.inflight).try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => interruptible(
                Arc::clone(self.inflight).acquire_owned(),
                self.shutdown,
                self.tx,
            )
            .await?
            .map_err(|_| End::Shutdown)?,
        };
        permits.push(permit);
        // A request larger than the whole budget takes all of it, and so
        // runs alone.
        let bytes = match req.kind {
            CMD_READ | CMD_WRITE if req.length <= ex.request_bytes_max => {
                req.length.min(INFLIGHT_BYTES_PER_CONN_MAX)
            }
            _ => 0,
        };
        if bytes > 0 {
            let permit = match Arc::clone(self.budget).try_acquire_many_owned(bytes) {
                Ok(permit) => permit,
                Err(_) => interruptible(
                    Arc::clone(self.budget).acquire_many_owned(bytes),
                    self.shutdown,
                    self.tx,
                )
                .await?
                .map_err(|_| End::Shutdown)?,
            };
            permits.push(permit);
        }
        let mut data = Vec::new();
        if payload && req.length > 0 {
            data = self.shared.pool.take(req.length as usize);
            // Timed from here, not from the header: waiting above for the
            // client to read its replies is not the client crawling.
            let deadline = tokio::time::Instant::now() + self.timeout;
            let payload = read_payload(self.rd, &mut data, req.length as usize);
            interruptible(
                within(deadline, self.timeout, payload),
                self.shutdown,
                self.tx,
            )
            .await?
            .map_err(io_end)?;
        }
        match validate(&req, ex) {
            Err(rej) => {
                self.shared.pool.give(data);
                let out = rejected(&req, &rej, ex.structured).with_permits(permits);
                self.tx.send(out).await.map_err(|_| End::WriterGone)?;
            }
            Ok(op) => {
                let shared = Arc::clone(self.shared);
                let tx = self.tx.clone();
                self.workers.submit(Box::new(move || {
                    let out = execute(op, req.handle, data, &shared).with_permits(permits);
                    // Never waits (see module invariants); fails only if the
                    // writer is gone, and then the reply is dropped.
                    let _ = tx.blocking_send(out);
                }));
            }
        }
        Ok(())
    }
}

// ---- Writer --------------------------------------------------------------

/// Runs `f` to completion, unless the connection is draining and `f`
/// makes no progress within `DRAIN_WRITE_TIMEOUT`.
async fn guarded<F>(f: F, draining: &mut watch::Receiver<bool>) -> io::Result<()>
where
    F: Future<Output = io::Result<()>>,
{
    tokio::pin!(f);
    if !*draining.borrow() {
        tokio::select! {
            // Writes usually complete at once (into the buffer): try them
            // first so the common case never registers for the signal.
            biased;
            r = &mut f => return r,
            _ = draining.wait_for(|d| *d) => {}
        }
    }
    match tokio::time::timeout(DRAIN_WRITE_TIMEOUT, f).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "client stopped reading replies",
        )),
    }
}

async fn write_replies<W: AsyncWrite + Unpin>(
    wr: W,
    mut rx: mpsc::Receiver<Outgoing>,
    shared: Arc<Shared>,
    mut draining: watch::Receiver<bool>,
) -> io::Result<()> {
    let mut w = BufWriter::with_capacity(WRITE_BUFFER_BYTES, wr);
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        // Write everything already queued, then flush once.
        while let Some(out) = next {
            guarded(w.write_all(out.head()), &mut draining).await?;
            if !out.body().is_empty() {
                guarded(w.write_all(out.body()), &mut draining).await?;
            }
            // The request is complete: its permits are released here.
            out.done(&shared.pool);
            next = rx.try_recv().ok();
        }
        guarded(w.flush(), &mut draining).await?;
    }
    guarded(w.shutdown(), &mut draining).await
}

/// Serves requests on `stream` until the client disconnects, breaks the
/// protocol, or the server shuts down; returns once every admitted request
/// has finished.
pub(crate) async fn run<S>(
    stream: S,
    export: Negotiated,
    limits: &Limits,
    mut shutdown: watch::Receiver<bool>,
) -> End
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (rd, wr) = tokio::io::split(stream);
    let mut rd = BufReader::with_capacity(READ_BUFFER_BYTES, rd);
    let inflight_max = limits.inflight_max;
    let budget_bytes = INFLIGHT_BYTES_PER_CONN_MAX;
    let shared = Arc::new(Shared {
        export,
        pool: BufPool::default(),
    });
    let (tx, rx) = mpsc::channel(inflight_max);
    let inflight = Arc::new(Semaphore::new(inflight_max));
    let budget = Arc::new(Semaphore::new(budget_bytes as usize));
    let (draining_tx, draining_rx) = watch::channel(false);
    let writer = tokio::spawn(write_replies(wr, rx, Arc::clone(&shared), draining_rx));
    let workers = Workers::new(limits.workers_max.min(inflight_max));

    let end = Reader {
        rd: &mut rd,
        timeout: limits.payload_timeout,
        shared: &shared,
        tx: &tx,
        inflight: &inflight,
        budget: &budget,
        workers: &workers,
        shutdown: &mut shutdown,
    }
    .run()
    .await;

    // Stop reading; let in-flight requests finish and their replies go out.
    drop(tx);
    draining_tx.send_replace(true);
    match writer.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => debug!("reply writer stopped: {e}"),
        Err(e) => error!("reply writer failed: {e}"),
    }
    // Queued requests still run; then every worker thread exits.
    workers.join().await;
    // Every admitted request holds a permit until its reply is written or
    // dropped; once all are back, no backend call is running.
    let all = u32::try_from(inflight_max).unwrap_or(u32::MAX);
    let _ = inflight.acquire_many(all).await;
    end
}
