//! `memserve`: serves sparse in-memory disks over a Unix socket, to try the
//! server with real NBD clients (qemu-io, qemu-img, nbdinfo, nbdcopy, fio).
//!
//! Usage: `memserve SOCKET [NAME=SIZE[:ro]]...`
//!
//! Without export arguments it serves `disk` (256 MiB, writable; also the
//! default export, name "") and `ro` (16 MiB, read-only, first half filled
//! with a pattern, second half a hole). Storage is allocated in 64 KiB
//! chunks on first write, so block status reports real holes. Logs go to
//! stderr (`RUST_LOG=debug` shows every request). Ctrl-C shuts down
//! gracefully. `MEMSERVE_WORKERS=N` sets the worker threads per connection.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use bulwark_nbd::{errno, Backend, Client, Errno, Exports, Extent, Server, ServerConfig};

const CHUNK_BYTES: u64 = 64 << 10;

/// A sparse disk: `None` chunks are unallocated and read as zeroes.
struct MemDisk {
    size: u64,
    read_only: bool,
    chunks: Vec<RwLock<Option<Box<[u8]>>>>,
}

impl MemDisk {
    fn new(size: u64, read_only: bool) -> Self {
        let count = size.div_ceil(CHUNK_BYTES) as usize;
        Self {
            size,
            read_only,
            chunks: (0..count).map(|_| RwLock::new(None)).collect(),
        }
    }

    /// Calls `f(chunk index, offset within chunk, range within the request)`
    /// for each chunk that `[offset, offset + length)` touches.
    fn each(
        &self,
        offset: u64,
        length: u64,
        mut f: impl FnMut(usize, usize, std::ops::Range<usize>),
    ) {
        let mut done = 0u64;
        while done < length {
            let pos = offset + done;
            let within = pos % CHUNK_BYTES;
            let n = (CHUNK_BYTES - within).min(length - done);
            f(
                (pos / CHUNK_BYTES) as usize,
                within as usize,
                done as usize..(done + n) as usize,
            );
            done += n;
        }
    }

    fn zero_range(&self, offset: u64, length: u64, deallocate: bool) -> Result<(), Errno> {
        self.each(offset, length, |i, within, range| {
            let mut chunk = self.chunks[i].write().unwrap();
            let whole = within == 0 && range.len() as u64 == CHUNK_BYTES;
            if deallocate && whole {
                *chunk = None;
            } else if let Some(data) = chunk.as_mut() {
                data[within..within + range.len()].fill(0);
            } else if !deallocate {
                *chunk = Some(vec![0u8; CHUNK_BYTES as usize].into_boxed_slice());
            }
        });
        Ok(())
    }
}

impl Backend for MemDisk {
    fn size(&self) -> u64 {
        self.size
    }

    fn preferred_block_size(&self) -> u32 {
        4096
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn can_fast_zero(&self) -> bool {
        true
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        self.each(offset, buf.len() as u64, |i, within, range| {
            let chunk = self.chunks[i].read().unwrap();
            let n = range.len();
            match chunk.as_ref() {
                Some(data) => buf[range].copy_from_slice(&data[within..within + n]),
                None => buf[range].fill(0),
            }
        });
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> Result<(), Errno> {
        if self.read_only {
            return Err(errno::EPERM);
        }
        self.each(offset, data.len() as u64, |i, within, range| {
            let mut chunk = self.chunks[i].write().unwrap();
            let n = range.len();
            let bytes =
                chunk.get_or_insert_with(|| vec![0u8; CHUNK_BYTES as usize].into_boxed_slice());
            bytes[within..within + n].copy_from_slice(&data[range]);
        });
        Ok(())
    }

    fn flush(&self) -> Result<(), Errno> {
        Ok(())
    }

    fn trim(&self, offset: u64, length: u64, _fua: bool) -> Result<(), Errno> {
        self.zero_range(offset, length, true)
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        _fua: bool,
        may_trim: bool,
    ) -> Result<(), Errno> {
        self.zero_range(offset, length, may_trim)
    }

    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, Errno> {
        let mut out = Vec::new();
        self.each(offset, length, |i, _, range| {
            let hole = self.chunks[i].read().unwrap().is_none();
            out.push(Extent {
                length: range.len() as u64,
                hole,
                zero: hole,
            });
        });
        Ok(out)
    }
}

struct MemExports {
    disks: BTreeMap<String, Arc<MemDisk>>,
    default: String,
}

impl Exports for MemExports {
    fn list(&self, _: &Client) -> Vec<String> {
        self.disks.keys().cloned().collect()
    }

    fn open(&self, name: &str, _: &Client) -> Option<Arc<dyn Backend>> {
        let name = if name.is_empty() { &self.default } else { name };
        self.disks
            .get(name)
            .map(|d| Arc::clone(d) as Arc<dyn Backend>)
    }
}

fn parse_size(s: &str) -> Option<u64> {
    let (digits, shift) = match s.chars().last()? {
        'K' | 'k' => (&s[..s.len() - 1], 10),
        'M' | 'm' => (&s[..s.len() - 1], 20),
        'G' | 'g' => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

fn usage() -> ! {
    eprintln!("usage: memserve SOCKET [NAME=SIZE[:ro]]...   (SIZE like 4096, 64K, 256M, 1G)");
    std::process::exit(2);
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();

    let mut args = std::env::args().skip(1);
    let Some(socket) = args.next() else { usage() };
    let mut disks = BTreeMap::new();
    for arg in args {
        let Some((name, spec)) = arg.split_once('=') else {
            usage()
        };
        let (size, read_only) = match spec.strip_suffix(":ro") {
            Some(size) => (size, true),
            None => (spec, false),
        };
        let Some(size) = parse_size(size) else {
            usage()
        };
        disks.insert(name.to_owned(), Arc::new(MemDisk::new(size, read_only)));
    }
    if disks.is_empty() {
        disks.insert("disk".to_owned(), Arc::new(MemDisk::new(256 << 20, false)));
        let ro = MemDisk::new(16 << 20, true);
        for (i, chunk) in ro.chunks.iter().take(ro.chunks.len() / 2).enumerate() {
            *chunk.write().unwrap() =
                Some(vec![i as u8 | 1; CHUNK_BYTES as usize].into_boxed_slice());
        }
        disks.insert("ro".to_owned(), Arc::new(ro));
    }
    let default = disks.keys().next().cloned().unwrap_or_default();
    let default = if disks.contains_key("disk") {
        "disk".to_owned()
    } else {
        default
    };
    let exports = Arc::new(MemExports { disks, default });

    let _ = std::fs::remove_file(&socket);
    let listener = tokio::net::UnixListener::bind(&socket)?;
    let mut config = ServerConfig::default();
    if let Some(n) = std::env::var("MEMSERVE_WORKERS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        config.max_workers_per_conn = n;
    }
    let server = Server::new(exports, config);
    eprintln!("memserve: listening on {socket}");
    let serving = tokio::spawn(Arc::clone(&server).serve_unix(listener));
    tokio::signal::ctrl_c().await?;
    eprintln!("memserve: shutting down");
    server.shutdown();
    serving.await.expect("accept loop panicked")?;
    server.wait_idle().await;
    let _ = std::fs::remove_file(&socket);
    Ok(())
}
