//! Shared test fixtures: an in-memory [`Backend`] with fault and delay
//! knobs, a one-export [`Exports`], and a raw NBD client that speaks the
//! wire format byte by byte (through `bulwark_nbd::proto`), so tests can
//! send exactly the messages they mean, malformed ones included.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use bulwark_nbd::proto::*;
use bulwark_nbd::{Backend, Errno, Exports, Extent, Server, ServerConfig};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};

pub const BLOCK: u64 = 4096;

/// A disk in memory. Blocks written are "allocated"; trimmed whole blocks
/// become holes again. `gate` makes reads wait until opened; `fail_reads`
/// makes them return EIO.
pub struct MemBackend {
    pub data: Mutex<Vec<u8>>,
    pub allocated: Mutex<Vec<bool>>,
    pub read_only: bool,
    pub multi_conn: bool,
    pub fail_reads: AtomicBool,
    pub panic_on_flush: AtomicBool,
    pub calls: AtomicUsize,
    pub inflight: AtomicUsize,
    pub inflight_peak: AtomicUsize,
    gate: (Mutex<bool>, Condvar),
}

impl MemBackend {
    pub fn new(size: u64) -> Arc<Self> {
        Self::with(size, false)
    }

    pub fn with(size: u64, read_only: bool) -> Arc<Self> {
        Arc::new(Self {
            data: Mutex::new(vec![0; size as usize]),
            allocated: Mutex::new(vec![false; size.div_ceil(BLOCK) as usize]),
            read_only,
            multi_conn: true,
            fail_reads: AtomicBool::new(false),
            panic_on_flush: AtomicBool::new(false),
            calls: AtomicUsize::new(0),
            inflight: AtomicUsize::new(0),
            inflight_peak: AtomicUsize::new(0),
            gate: (Mutex::new(true), Condvar::new()),
        })
    }

    /// Makes reads block until `open_gate`.
    pub fn close_gate(&self) {
        *self.gate.0.lock().unwrap() = false;
    }

    /// Waits (at most 10 s, else the test fails) until `n` backend calls
    /// are running at once: requests held at a closed gate.
    #[allow(dead_code)]
    pub async fn until_inflight(&self, n: usize) {
        within(async {
            while self.inflight.load(Ordering::SeqCst) < n {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
    }

    /// Waits (at most 60 s, else the test fails) until the backend has
    /// been called `n` times in all.
    #[allow(dead_code)]
    pub async fn until_calls(&self, n: usize) {
        let waited = tokio::time::timeout(Duration::from_secs(60), async {
            while self.calls.load(Ordering::SeqCst) < n {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await;
        let calls = self.calls.load(Ordering::SeqCst);
        assert!(
            waited.is_ok(),
            "{calls} backend calls in 60 s, {n} expected"
        );
    }

    pub fn open_gate(&self) {
        *self.gate.0.lock().unwrap() = true;
        self.gate.1.notify_all();
    }

    fn enter(&self) -> impl Drop + '_ {
        struct Exit<'a>(&'a AtomicUsize);
        impl Drop for Exit<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.calls.fetch_add(1, Ordering::SeqCst);
        let now = self.inflight.fetch_add(1, Ordering::SeqCst) + 1;
        self.inflight_peak.fetch_max(now, Ordering::SeqCst);
        Exit(&self.inflight)
    }

    fn mark(&self, offset: u64, length: u64, allocated: bool) {
        let mut map = self.allocated.lock().unwrap();
        if allocated {
            for b in offset / BLOCK..(offset + length).div_ceil(BLOCK) {
                map[b as usize] = true;
            }
        } else {
            for b in offset.div_ceil(BLOCK)..(offset + length) / BLOCK {
                map[b as usize] = false;
            }
        }
    }
}

impl Backend for MemBackend {
    fn size(&self) -> u64 {
        self.data.lock().unwrap().len() as u64
    }
    fn preferred_block_size(&self) -> u32 {
        BLOCK as u32
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn can_multi_conn(&self) -> bool {
        self.multi_conn
    }
    fn can_fast_zero(&self) -> bool {
        true
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        let _in = self.enter();
        let mut open = self.gate.0.lock().unwrap();
        while !*open {
            open = self.gate.1.wait(open).unwrap();
        }
        drop(open);
        if self.fail_reads.load(Ordering::SeqCst) {
            return Err(bulwark_nbd::errno::EIO);
        }
        let data = self.data.lock().unwrap();
        buf.copy_from_slice(&data[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn write(&self, offset: u64, src: &[u8], _fua: bool) -> Result<(), Errno> {
        let _in = self.enter();
        assert!(
            !self.read_only,
            "server let a write through to a read-only backend"
        );
        self.data.lock().unwrap()[offset as usize..offset as usize + src.len()]
            .copy_from_slice(src);
        self.mark(offset, src.len() as u64, true);
        Ok(())
    }
    fn flush(&self) -> Result<(), Errno> {
        let _in = self.enter();
        if self.panic_on_flush.load(Ordering::SeqCst) {
            panic!("flush exploded");
        }
        Ok(())
    }
    fn trim(&self, offset: u64, length: u64, _fua: bool) -> Result<(), Errno> {
        let _in = self.enter();
        self.write_zeroes(offset, length, false, true)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        _fua: bool,
        may_trim: bool,
    ) -> Result<(), Errno> {
        let _in = self.enter();
        assert!(length > 0, "zero-length call reached the backend");
        self.data.lock().unwrap()[offset as usize..(offset + length) as usize].fill(0);
        self.mark(offset, length, !may_trim);
        Ok(())
    }
    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, Errno> {
        let _in = self.enter();
        let map = self.allocated.lock().unwrap();
        let mut out = Vec::new();
        let mut pos = offset;
        while pos < offset + length {
            let end = ((pos / BLOCK) + 1) * BLOCK;
            let hole = !map[(pos / BLOCK) as usize];
            out.push(Extent {
                length: end.min(offset + length) - pos,
                hole,
                zero: hole,
            });
            pos = end;
        }
        Ok(out)
    }
}

/// Named backends; "" opens "disk".
pub struct TestExports(pub HashMap<String, Arc<MemBackend>>);

impl Exports for TestExports {
    fn list(&self, _: &bulwark_nbd::Client) -> Vec<String> {
        let mut v: Vec<String> = self.0.keys().cloned().collect();
        v.sort();
        v
    }
    fn open(&self, name: &str, _: &bulwark_nbd::Client) -> Option<Arc<dyn Backend>> {
        let name = if name.is_empty() { "disk" } else { name };
        self.0.get(name).map(|b| Arc::clone(b) as Arc<dyn Backend>)
    }
}

/// A server with a 1 MiB writable "disk" and a 64 KiB read-only "ro".
pub fn server_with(config: ServerConfig) -> (Arc<Server>, Arc<MemBackend>, Arc<MemBackend>) {
    let disk = MemBackend::new(1 << 20);
    let ro = MemBackend::with(64 << 10, true);
    let mut map = HashMap::new();
    map.insert("disk".to_owned(), Arc::clone(&disk));
    map.insert("ro".to_owned(), Arc::clone(&ro));
    (Server::new(Arc::new(TestExports(map)), config), disk, ro)
}

pub fn server() -> (Arc<Server>, Arc<MemBackend>, Arc<MemBackend>) {
    server_with(ServerConfig {
        max_request_bytes: 64 << 10,
        max_inflight_per_conn: 8,
        max_workers_per_conn: 8,
        ..ServerConfig::default()
    })
}

/// Connects an in-memory pipe to `server`; returns the client end and the
/// task serving the other end.
pub fn pipe(server: &Arc<Server>) -> (DuplexStream, tokio::task::JoinHandle<()>) {
    DuplexStream::pipe(server)
}

/// A client end connected to a fresh server connection. The server runs
/// its transmission phase on the async reader/writer for an in-memory pipe
/// (as for TLS streams) and on its threads for a socket (`direct.rs`, as
/// for every Unix and plain TCP client): tests generic over `Pipe` check
/// both paths.
pub trait Pipe: AsyncRead + AsyncWrite + Unpin + Send + Sized + 'static {
    fn pipe(server: &Arc<Server>) -> (Self, tokio::task::JoinHandle<()>);
}

impl Pipe for DuplexStream {
    fn pipe(server: &Arc<Server>) -> (Self, tokio::task::JoinHandle<()>) {
        let (client, server_end) = tokio::io::duplex(256 << 10);
        let task = tokio::spawn(Arc::clone(server).serve_stream(server_end));
        (client, task)
    }
}

impl Pipe for tokio::net::UnixStream {
    fn pipe(server: &Arc<Server>) -> (Self, tokio::task::JoinHandle<()>) {
        let (client, server_end) = tokio::net::UnixStream::pair().expect("socketpair");
        let task = tokio::spawn(Arc::clone(server).serve_stream(server_end));
        (client, task)
    }
}

/// One reply, simple or structured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Simple {
        handle: u64,
        error: u32,
        data: Vec<u8>,
    },
    Chunk {
        header: ChunkHeader,
        payload: Vec<u8>,
    },
}

impl Reply {
    pub fn handle(&self) -> u64 {
        match self {
            Reply::Simple { handle, .. } => *handle,
            Reply::Chunk { header, .. } => header.handle,
        }
    }
}

/// A raw NBD client.
pub struct Client<S> {
    pub s: S,
    /// Outstanding READ lengths by handle (simple replies need them).
    reads: HashMap<u64, u32>,
    next_handle: u64,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Client<S> {
    /// A client continuing on a new stream (e.g. after STARTTLS).
    #[allow(dead_code)]
    pub fn over(s: S) -> Self {
        Self {
            s,
            reads: HashMap::new(),
            next_handle: 1,
        }
    }

    /// Reads the greeting and sends `client_flags`.
    pub async fn greet(mut s: S, client_flags: u32) -> io::Result<Self> {
        let mut g = [0u8; GREETING_LEN];
        s.read_exact(&mut g).await?;
        let flags = parse_greeting(&g).map_err(|e| io::Error::other(e.to_string()))?;
        assert_eq!(flags, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        s.write_all(&client_flags.to_be_bytes()).await?;
        Ok(Self {
            s,
            reads: HashMap::new(),
            next_handle: 1,
        })
    }

    pub async fn connect(s: S) -> Self {
        Self::greet(s, FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
            .await
            .unwrap()
    }

    pub async fn send_option(&mut self, option: u32, payload: &[u8]) -> io::Result<()> {
        let h = OptionHeader {
            option,
            length: payload.len() as u32,
        };
        self.s.write_all(&h.encode()).await?;
        self.s.write_all(payload).await?;
        self.s.flush().await
    }

    pub async fn option_reply(&mut self) -> io::Result<(OptionReplyHeader, Vec<u8>)> {
        let mut h = [0u8; OptionReplyHeader::LEN];
        self.s.read_exact(&mut h).await?;
        let h = OptionReplyHeader::parse(&h).map_err(|e| io::Error::other(e.to_string()))?;
        let mut payload = vec![0; h.length as usize];
        self.s.read_exact(&mut payload).await?;
        Ok((h, payload))
    }

    /// Sends an option and collects replies up to the final one.
    pub async fn option(&mut self, option: u32, payload: &[u8]) -> Vec<(u32, Vec<u8>)> {
        self.send_option(option, payload).await.unwrap();
        let mut out = Vec::new();
        loop {
            let (h, p) = self.option_reply().await.unwrap();
            assert_eq!(h.option, option);
            let last = h.reply == REP_ACK || is_rep_error(h.reply);
            out.push((h.reply, p));
            if last {
                return out;
            }
        }
    }

    pub async fn structured(&mut self) {
        let r = self.option(OPT_STRUCTURED_REPLY, &[]).await;
        assert_eq!(r, vec![(REP_ACK, vec![])]);
    }

    pub async fn set_meta(&mut self, export: &str, queries: &[&str]) -> Vec<(u32, Vec<u8>)> {
        let req = MetaRequest {
            export: export.into(),
            queries: queries.iter().map(|q| q.to_string()).collect(),
        };
        self.option(OPT_SET_META_CONTEXT, &req.encode()).await
    }

    /// NBD_OPT_GO; returns (size, transmission flags) on success.
    pub async fn go(&mut self, name: &str) -> Result<(u64, u16), u32> {
        let req = InfoRequest {
            name: name.into(),
            requests: vec![INFO_BLOCK_SIZE],
        };
        let replies = self.option(OPT_GO, &req.encode()).await;
        let (last, _) = replies.last().unwrap();
        if *last != REP_ACK {
            return Err(*last);
        }
        for (reply, payload) in &replies {
            if *reply == REP_INFO {
                if let Ok(Info::Export { size, flags }) = parse_info(payload) {
                    return Ok((size, flags));
                }
            }
        }
        panic!("GO succeeded without NBD_INFO_EXPORT");
    }

    /// Handshake with structured replies and base:allocation, then GO.
    pub async fn open(s: S, name: &str) -> (Self, u64, u16) {
        let mut c = Self::connect(s).await;
        c.structured().await;
        let meta = c.set_meta(name, &[META_BASE_ALLOCATION]).await;
        assert_eq!(meta.len(), 2, "{meta:?}");
        let (size, flags) = c.go(name).await.unwrap();
        (c, size, flags)
    }

    /// Sends a request; returns its handle.
    pub async fn send(
        &mut self,
        kind: u16,
        flags: u16,
        offset: u64,
        length: u32,
        data: &[u8],
    ) -> u64 {
        let handle = self.next_handle;
        self.next_handle += 1;
        self.send_raw(
            Request {
                flags,
                kind,
                handle,
                offset,
                length,
            },
            data,
        )
        .await
        .unwrap();
        handle
    }

    pub async fn send_raw(&mut self, req: Request, data: &[u8]) -> io::Result<()> {
        if req.kind == CMD_READ {
            self.reads.insert(req.handle, req.length);
        }
        self.s.write_all(&req.encode()).await?;
        self.s.write_all(data).await?;
        self.s.flush().await
    }

    /// Reads one reply message (one chunk, for structured replies).
    pub async fn reply(&mut self) -> io::Result<Reply> {
        let magic = self.s.read_u32().await?;
        match magic {
            SIMPLE_REPLY_MAGIC => {
                let error = self.s.read_u32().await?;
                let handle = self.s.read_u64().await?;
                let mut data = Vec::new();
                if let Some(len) = self.reads.remove(&handle) {
                    if error == 0 {
                        data.resize(len as usize, 0);
                        self.s.read_exact(&mut data).await?;
                    }
                }
                Ok(Reply::Simple {
                    handle,
                    error,
                    data,
                })
            }
            STRUCTURED_REPLY_MAGIC => {
                let mut rest = [0u8; ChunkHeader::LEN];
                rest[..4].copy_from_slice(&magic.to_be_bytes());
                self.s.read_exact(&mut rest[4..]).await?;
                let header = ChunkHeader::parse(&rest).unwrap();
                let mut payload = vec![0; header.length as usize];
                self.s.read_exact(&mut payload).await?;
                if header.flags & REPLY_FLAG_DONE != 0 {
                    self.reads.remove(&header.handle);
                }
                Ok(Reply::Chunk { header, payload })
            }
            other => Err(io::Error::other(format!("bad reply magic {other:#x}"))),
        }
    }

    /// Sends one request and waits for its (single-message) reply.
    pub async fn call(
        &mut self,
        kind: u16,
        flags: u16,
        offset: u64,
        length: u32,
        data: &[u8],
    ) -> Reply {
        let handle = self.send(kind, flags, offset, length, data).await;
        let r = self.reply().await.unwrap();
        assert_eq!(r.handle(), handle);
        r
    }

    /// The errno of a reply (0 on success), simple or structured.
    pub fn errno_of(r: &Reply) -> u32 {
        match r {
            Reply::Simple { error, .. } => *error,
            Reply::Chunk { header, payload } if header.kind == REPLY_TYPE_ERROR => {
                parse_error_chunk(payload).unwrap().0
            }
            Reply::Chunk { .. } => 0,
        }
    }

    /// Asserts the server closed the connection (EOF, no more bytes).
    pub async fn expect_closed(&mut self) {
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(Duration::from_secs(10), self.s.read(&mut b))
            .await
            .expect("server did not close the connection");
        match r {
            Ok(0) | Err(_) => {}
            Ok(_) => panic!("unexpected byte {:#x} instead of EOF", b[0]),
        }
    }
}

/// Fails the test if `f` takes longer than 10 s.
pub async fn within<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .expect("timed out")
}
