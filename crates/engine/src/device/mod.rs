//! Device: a file or block device addressed by byte offset.
//!
//! This layer knows nothing of redundancy, checksums or keys. It reads and
//! writes whole ranges (`read_exact_at`/`write_all_at`) and makes them durable
//! with `flush` (`fdatasync`). A short read past the end is an error, never zeros.
//!
//! What lives here:
//! - [`Device`], the trait the layers above use, and [`FileDevice`]: files and block
//!   devices by `pread`/`preadv`/`pwrite` (`read_scattered_at` reads one range into many
//!   buffers); files it creates are mode 0600.
//! - [`DeviceClaim`]: an exclusive `flock` per member device, taken at create, import,
//!   online and replace, so a second process (a daemon on a copy of the pool directory)
//!   cannot write the same disks; `DIR/pool.lock` does the same for the directory.
//! - `holes`/`fill_holes` for `pool create --preallocate`: zeros written into the holes
//!   64 KiB at a time (larger writes leave large page-cache folios that ext4 walks buffer
//!   by buffer on every later write).
//! - `will_write`: a segment that opens for writing is read into the page cache in the
//!   background, because a run of records ending inside a 4 KiB block the cache lacks
//!   would otherwise wait for a synchronous read of it. `Store::placed_at` is the one
//!   trigger (from `put` and from intent-log slots), through
//!   `Redundancy::will_write_segment` (every member of a parity pool, whose shards lie at
//!   the segment's own place on each). `posix_fadvise(WILLNEED)` in 128 KiB pieces, over
//!   the `SEEK_DATA` extents on ext4, XFS and btrfs so holes are left alone; elsewhere
//!   (OpenZFS included, whose `SEEK_DATA` can sync a transaction group) over the whole
//!   segment. A segment the page cache already holds whole is left alone (`cachestat`,
//!   Linux 6.5+; older kernels advise every time). The `Arc<T>` forwarding impl must
//!   pass every method on: a default it missed once silently did nothing.
//! - [`sync`]: devices synced side by side on threads made once (a mirror's members,
//!   mirrored log devices), not a thread per flush; [`fault`]: fault injection as a
//!   device layer.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

pub mod crash;
pub mod fault;
pub mod sync;

use crate::{Error, Result};

/// What the redundancy layer needs of a device. Fault-injecting devices implement it too.
pub trait Device: Send + Sync {
    fn path(&self) -> &Path;
    fn size(&self) -> u64;
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()>;
    /// Reads the bytes at `offset..` into `bufs`, one after another, as `read_at` would
    /// into their concatenation. This default reads into one buffer and copies out;
    /// files override it with `preadv`, which scatters without the copy.
    fn read_scattered_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> std::io::Result<()> {
        let mut all = vec![0; bufs.iter().map(|b| b.len()).sum()];
        self.read_at(&mut all, offset)?;
        scatter(&all, bufs);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()>;
    fn flush(&self) -> std::io::Result<()>;
    /// Give back the space of `len` bytes at `offset`: afterwards they read as zeros and
    /// take no room (a hole). `Ok(false)`: this device cannot (the bytes are unchanged).
    fn discard(&self, _offset: u64, _len: u64) -> std::io::Result<bool> {
        Ok(false)
    }
    /// Whether `len` bytes at `offset` are one hole (`discard`ed, or never written):
    /// nothing of them is stored. `false` when the device cannot tell.
    fn is_hole(&self, _offset: u64, _len: u64) -> bool {
        false
    }
    /// Bytes of storage the device takes (a sparse file's allocated blocks); its size when
    /// it cannot tell.
    fn allocated_bytes(&self) -> u64 {
        self.size()
    }
    /// A hint: `len` bytes at `offset` are about to be written in pieces that do not end on
    /// the host's 4 KiB blocks; read them into the page cache in the background now.
    fn will_write(&self, _offset: u64, _len: u64) {}
}

/// Copies `from` into `bufs`, one after another (`from` is as long as all of them).
fn scatter(from: &[u8], bufs: &mut [&mut [u8]]) {
    let mut at = 0;
    for b in bufs.iter_mut() {
        b.copy_from_slice(&from[at..at + b.len()]);
        at += b.len();
    }
}

impl<T: Device + ?Sized> Device for std::sync::Arc<T> {
    fn path(&self) -> &Path {
        (**self).path()
    }
    fn size(&self) -> u64 {
        (**self).size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        (**self).read_at(buf, offset)
    }
    fn read_scattered_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> std::io::Result<()> {
        (**self).read_scattered_at(bufs, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        (**self).write_at(buf, offset)
    }
    fn flush(&self) -> std::io::Result<()> {
        (**self).flush()
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<bool> {
        (**self).discard(offset, len)
    }
    fn is_hole(&self, offset: u64, len: u64) -> bool {
        (**self).is_hole(offset, len)
    }
    fn allocated_bytes(&self) -> u64 {
        (**self).allocated_bytes()
    }
    fn will_write(&self, offset: u64, len: u64) {
        (**self).will_write(offset, len)
    }
}

/// A regular file or a block device.
pub struct FileDevice {
    path: PathBuf,
    file: File,
    size: u64,
    /// Bytes written since writeback was last started (see `write_at`).
    unkicked: std::sync::atomic::AtomicU64,
    /// This process's exclusive claim, once the device is a member of an open pool.
    claim: Option<Arc<DeviceClaim>>,
    /// A regular file on a file system whose `SEEK_DATA` is cheap (`seek_holes_cheap`).
    seek_holes: bool,
}

/// Whether `file` is a regular file on ext4, XFS or btrfs, whose `SEEK_DATA`/`SEEK_HOLE`
/// read only the extent map. Elsewhere it may cost far more (OpenZFS syncs a whole
/// transaction group to answer it for a file with unwritten changes, which a device file
/// under writes always has), so `will_write` does not ask there.
fn seek_holes_cheap(file: &File) -> bool {
    use std::os::unix::io::AsRawFd;
    const EXT4: i64 = 0xEF53;
    const XFS: i64 = 0x5846_5342;
    const BTRFS: i64 = 0x9123_683E;
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return false;
    }
    // SAFETY: `statfs` is plain data, for which all zeros is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: plain syscall on a descriptor we own, into a struct of the right type.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } != 0 {
        return false;
    }
    matches!(st.f_type as i64, EXT4 | XFS | BTRFS)
}

/// `cachestat`'s number: the generic syscall table's, which these architectures share
/// (mips and alpha number it otherwise, and the `libc` crate names it for neither x86-64
/// nor aarch64 with glibc).
const SYS_CACHESTAT: Option<libc::c_long> = if cfg!(any(
    target_arch = "x86_64",
    target_arch = "x86",
    target_arch = "aarch64",
    target_arch = "arm",
    target_arch = "riscv64",
    target_arch = "loongarch64"
)) {
    Some(451)
} else {
    None
};

/// Pages of `offset..offset + len` (`len` > 0) of `fd` in the page cache, and how many
/// pages the range touches: `cachestat(2)`, Linux 6.5+ (`ENOSYS` before).
fn cachestat(fd: std::os::unix::io::RawFd, offset: u64, len: u64) -> std::io::Result<(u64, u64)> {
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    let Some(number) = SYS_CACHESTAT else {
        return Err(std::io::Error::from_raw_os_error(libc::ENOSYS));
    };
    let range = Range { off: offset, len };
    let mut stat = Stat::default();
    // SAFETY: the kernel reads `range` and writes `stat`, both live and of the layout
    // `cachestat(2)` documents; flags must be 0.
    let r = unsafe {
        libc::syscall(
            number,
            fd as libc::c_long,
            &range as *const Range,
            &mut stat as *mut Stat,
            0 as libc::c_long,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: no arguments; the page size is always known.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
    let pages = (offset + len - 1) / page - offset / page + 1;
    Ok((stat.nr_cache, pages))
}

/// Whether every page of `offset..offset + len` of `fd` is in the page cache; `None`
/// where the kernel cannot say (before Linux 6.5, or a filter refuses the call: not asked
/// again). OpenZFS keeps its own cache, which this does not see: it answers `false`.
fn fully_cached(fd: std::os::unix::io::RawFd, offset: u64, len: u64) -> Option<bool> {
    use std::sync::atomic::{AtomicBool, Ordering};
    static MISSING: AtomicBool = AtomicBool::new(false);
    if MISSING.load(Ordering::Relaxed) || len == 0 {
        return None;
    }
    match cachestat(fd, offset, len) {
        Ok((cached, pages)) => Some(cached >= pages),
        Err(e) => {
            if matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) {
                MISSING.store(true, Ordering::Relaxed);
            }
            None
        }
    }
}

/// A process's exclusive claim on a device: a `flock` on a descriptor of its
/// own, held while any device of the process uses the file. Another process
/// (a second daemon on a copy of the pool directory, or on another pool
/// directory naming the same disks) is refused, as `DIR/pool.lock` refuses a
/// second daemon on the same directory: two processes writing one device
/// would each overwrite what the other wrote. Within one process the claim is
/// shared (a device taken offline and brought back is opened again while its
/// old descriptor may still be open).
pub struct DeviceClaim {
    _file: File,
}

/// Claims held by this process, by file identity (device and inode).
static CLAIMS: Mutex<BTreeMap<(u64, u64), Weak<DeviceClaim>>> = Mutex::new(BTreeMap::new());

impl DeviceClaim {
    /// Whether the device is claimed now, by this process or another (a running daemon):
    /// what holds it. Takes no claim that outlives the call.
    pub fn in_use(path: &Path) -> Option<String> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).ok()?;
        let key = (meta.dev(), meta.ino());
        let held_here = CLAIMS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&key)
            .is_some_and(|w| w.strong_count() > 0);
        if held_here {
            return Some(format!(
                "device {} is in use by a pool open in this process",
                path.display()
            ));
        }
        match DeviceClaim::take(path) {
            Err(Error::Busy(m)) => Some(m),
            _ => None,
        }
    }

    pub fn take(path: &Path) -> Result<Arc<DeviceClaim>> {
        use std::os::unix::fs::MetadataExt;
        use std::os::unix::io::AsRawFd;
        let file = File::open(path).map_err(|e| Error::device(path, e))?;
        let meta = file.metadata().map_err(|e| Error::device(path, e))?;
        let key = (meta.dev(), meta.ino());
        let mut claims = CLAIMS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(held) = claims.get(&key).and_then(Weak::upgrade) {
            return Ok(held);
        }
        // SAFETY: flock on a descriptor we own; no memory is touched.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::WouldBlock {
                return Err(Error::Busy(format!(
                    "device {} is in use by another process (a bulwark daemon serving another \
                     copy of this pool, or another pool on the same disk?): two processes \
                     writing one device destroy each other's data",
                    path.display()
                )));
            }
            return Err(Error::device(path, e));
        }
        let claim = Arc::new(DeviceClaim { _file: file });
        claims.retain(|_, w| w.strong_count() > 0);
        claims.insert(key, Arc::downgrade(&claim));
        Ok(claim)
    }
}

impl FileDevice {
    /// Create a sparse file of `size` bytes, readable by its owner only (it holds
    /// the pool's data and metadata); refuses to overwrite an existing file.
    pub fn create_sparse(path: &Path, size: u64) -> Result<FileDevice> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| Error::device(path, e))?;
        if let Err(e) = file.set_len(size) {
            // Too large for the file system: leave nothing behind.
            let _ = std::fs::remove_file(path);
            return Err(Error::device(path, e));
        }
        Ok(FileDevice {
            path: path.to_path_buf(),
            seek_holes: seek_holes_cheap(&file),
            file,
            size,
            unkicked: Default::default(),
            claim: None,
        })
    }

    /// Open an existing file or block device read-write.
    pub fn open(path: &Path) -> Result<FileDevice> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::device(path, e))?;
        let size = device_size(&file).map_err(|e| Error::device(path, e))?;
        Ok(FileDevice {
            path: path.to_path_buf(),
            seek_holes: seek_holes_cheap(&file),
            file,
            size,
            unkicked: Default::default(),
            claim: None,
        })
    }

    /// `lseek` to the first data (`SEEK_DATA`) or hole (`SEEK_HOLE`) at or after `at`;
    /// `None` when there is none (ENXIO). It moves no position anything relies on: every
    /// read and write here is positioned.
    fn seek(&self, at: u64, whence: libc::c_int) -> std::io::Result<Option<u64>> {
        use std::os::unix::io::AsRawFd;
        // SAFETY: plain syscall on a descriptor we own.
        let r = unsafe { libc::lseek(self.file.as_raw_fd(), at as libc::off_t, whence) };
        if r >= 0 {
            return Ok(Some(r as u64));
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENXIO) => Ok(None),
            _ => Err(e),
        }
    }

    /// The holes of a regular file (ranges no block backs, as `SEEK_HOLE` finds them),
    /// in order; none for a block device, or where the file system cannot tell (it then
    /// reports the whole file as data).
    pub fn holes(&self) -> Result<Vec<(u64, u64)>> {
        let meta = self
            .file
            .metadata()
            .map_err(|e| Error::device(&self.path, e))?;
        if !meta.is_file() {
            return Ok(Vec::new());
        }
        let seek = |at: u64, whence: libc::c_int| -> Result<Option<u64>> {
            self.seek(at, whence)
                .map_err(|e| Error::device(&self.path, e))
        };
        let mut holes = Vec::new();
        let mut at = 0;
        while at < self.size {
            let Some(start) = seek(at, libc::SEEK_HOLE)?.filter(|&h| h < self.size) else {
                break;
            };
            let end = seek(start, libc::SEEK_DATA)?
                .unwrap_or(self.size)
                .min(self.size);
            if end <= start {
                break;
            }
            holes.push((start, end));
            at = end;
        }
        Ok(holes)
    }

    /// Writes zeros into `holes` (as `holes` found them), so that every block of the file
    /// is allocated and written, then syncs the file: a later write is then an overwrite,
    /// whose sync costs no block allocation in the host's file system (its journal), and
    /// cannot fail for want of space there. `progress` gets the bytes written after each
    /// chunk. Only while nothing else writes the file: the zeros go where the holes were
    /// when they were listed.
    pub fn fill_holes(&self, holes: &[(u64, u64)], progress: &mut dyn FnMut(u64)) -> Result<()> {
        use std::os::unix::fs::FileExt;
        // Small writes on purpose: the host's page cache keeps these zeros in folios as
        // large as the writes that made them, and ext4 walks every 4 KiB buffer of a
        // folio on each later write into it. Zeros written 8 MiB at a time left 2 MiB
        // folios, and 64K random overwrites at 50% fill ran 15% slower than on a sparse
        // file (ext4_block_write_begin 15% of the daemon's CPU, 3.7% with 64 KiB).
        const CHUNK: u64 = 64 << 10;
        let zeros = vec![0u8; CHUNK as usize];
        for &(start, end) in holes {
            let mut at = start;
            while at < end {
                let n = (end - at).min(CHUNK);
                self.file
                    .write_all_at(&zeros[..n as usize], at)
                    .map_err(|e| Error::device(&self.path, e))?;
                at += n;
                progress(n);
            }
        }
        self.file
            .sync_all()
            .map_err(|e| Error::device(&self.path, e))
    }

    /// Takes this process's exclusive claim on the device (`DeviceClaim`):
    /// call before using it as a member of a pool.
    pub fn claim(&mut self) -> Result<()> {
        if self.claim.is_none() {
            self.claim = Some(DeviceClaim::take(&self.path)?);
        }
        Ok(())
    }
}

/// Most buffers one `preadv` takes (Linux's `IOV_MAX`).
const IOV_MAX: usize = 1024;

fn device_size(file: &File) -> std::io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    let meta = file.metadata()?;
    if meta.is_file() {
        return Ok(meta.len());
    }
    // Block devices report 0 in metadata; their size is where the end seeks to.
    let mut f = file;
    f.seek(SeekFrom::End(0))
}

impl Device for FileDevice {
    fn path(&self) -> &Path {
        &self.path
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }
    fn read_scattered_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> std::io::Result<()> {
        use std::os::unix::io::AsRawFd;
        // Progress: whole buffers done, and bytes of the next one.
        let (mut first, mut within, mut offset) = (0, 0, offset);
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(bufs.len().min(IOV_MAX));
        loop {
            // Skip filled (and empty) buffers: a read of nothing would look like end of file.
            while first < bufs.len() && bufs[first].len() == within {
                first += 1;
                within = 0;
            }
            if first == bufs.len() {
                break;
            }
            iov.clear();
            for (i, b) in bufs[first..].iter_mut().take(IOV_MAX).enumerate() {
                let skip = if i == 0 { within } else { 0 };
                iov.push(libc::iovec {
                    iov_base: b[skip..].as_mut_ptr().cast(),
                    iov_len: b.len() - skip,
                });
            }
            // SAFETY: every iovec points into a distinct `&mut [u8]` we hold for the call,
            // within its bounds; the descriptor is ours.
            let n = unsafe {
                libc::preadv(
                    self.file.as_raw_fd(),
                    iov.as_ptr(),
                    iov.len() as libc::c_int,
                    offset as libc::off_t,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            let mut n = n as usize;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            offset += n as u64;
            while n > 0 {
                let left = bufs[first].len() - within;
                if n < left {
                    within += n;
                    break;
                }
                n -= left;
                first += 1;
                within = 0;
            }
        }
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        use std::os::unix::io::AsRawFd;
        use std::sync::atomic::Ordering;
        self.file.write_all_at(buf, offset)?;
        // Start writeback early and often, without waiting for it: the commit's fsync then
        // finds little left to write, instead of stalling every writer for the whole backlog.
        let n = self.unkicked.fetch_add(buf.len() as u64, Ordering::Relaxed) + buf.len() as u64;
        if n >= crate::constants::WRITEBACK_KICK_BYTES {
            self.unkicked.store(0, Ordering::Relaxed);
            // SAFETY: plain syscall on a descriptor we own; failure only loses the hint.
            unsafe {
                libc::sync_file_range(self.file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE)
            };
        }
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        self.file.sync_data()
    }
    fn will_write(&self, offset: u64, len: u64) {
        use std::os::unix::io::AsRawFd;
        // A buffered write that covers part of a 4 KiB block the page cache does not hold
        // reads that block first, synchronously (ext4's write_begin), unless the block was
        // never written (a hole). Records lie end to end at 16-byte alignment, so on a
        // written file (preallocated, or a segment used before) every run would wait for
        // one such read: 4K writes with a FLUSH after each ran 20% slower with the device
        // file out of the page cache, reading 4 KiB per write. One read of the segment in
        // the background when it opens takes their place.
        //
        // Only where blocks are stored: a hole needs no read, and read ahead it would fill
        // the cache with 4 KiB pages of zeros that every later write into them pays for
        // (64K random writes on a sparse pool: 21k -> 17k IOPS). Pages already cached are
        // left as they are.
        let fd = self.file.as_raw_fd();
        let end = offset.saturating_add(len).min(self.size);
        // Cached already (a pool smaller than the host's memory, nearly always): nothing to
        // read. Asking costs one walk of the cache's index; advising walks it page by page
        // (7% of the daemon's CPU under 64K random writes, for nothing).
        if end <= offset || fully_cached(fd, offset, end - offset) == Some(true) {
            return;
        }
        // In pieces: the kernel reads at most the device's read-ahead window (or its
        // largest request) per call, often 128 KiB, and drops the rest of a larger one.
        const PIECE: u64 = 128 << 10;
        let advise = |from: u64, to: u64| {
            let mut at = from;
            while at < to {
                let n = (to - at).min(PIECE);
                // SAFETY: plain syscall on a descriptor we own; failure only loses the hint.
                unsafe {
                    libc::posix_fadvise(
                        fd,
                        at as libc::off_t,
                        n as libc::off_t,
                        libc::POSIX_FADV_WILLNEED,
                    )
                };
                at += n;
            }
        };
        if !self.seek_holes {
            // A block device, or a file system where asking for holes is not cheap.
            advise(offset, end);
            return;
        }
        let mut at = offset;
        while at < end {
            let from = match self.seek(at, libc::SEEK_DATA) {
                Ok(Some(from)) if from < end => from,
                // No data past `at` in the range.
                Ok(_) => return,
                // No map of holes after all: all of it.
                Err(_) => return advise(at, end),
            };
            let to = match self.seek(from, libc::SEEK_HOLE) {
                Ok(Some(hole)) => hole.min(end),
                _ => end,
            };
            if to <= from {
                return;
            }
            advise(from, to);
            at = to;
        }
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<bool> {
        use std::os::unix::io::AsRawFd;
        // Regular files only: a block device's discard may not read back as zeros.
        if !self.file.metadata()?.is_file() {
            return Ok(false);
        }
        // SAFETY: plain syscall on a descriptor we own.
        let r = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if r == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EOPNOTSUPP) => Ok(false),
            _ => Err(e),
        }
    }
    fn is_hole(&self, offset: u64, len: u64) -> bool {
        if len == 0 || offset.saturating_add(len) > self.size {
            return false;
        }
        match self.seek(offset, libc::SEEK_DATA) {
            // No data at or after `offset`: a hole to the end.
            Ok(None) => true,
            Ok(Some(next)) => next >= offset + len,
            Err(_) => false,
        }
    }
    fn allocated_bytes(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        match self.file.metadata() {
            Ok(m) if m.is_file() => m.blocks() * 512,
            _ => self.size,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads `sizes` scattered at `offset` and returns the buffers' bytes end to end.
    fn scattered(dev: &dyn Device, sizes: &[usize], offset: u64) -> std::io::Result<Vec<u8>> {
        let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0xCC; n]).collect();
        let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        dev.read_scattered_at(&mut refs, offset)?;
        Ok(bufs.concat())
    }

    #[test]
    fn scattered_reads_match_plain_reads() {
        let t = tempfile::tempdir().unwrap();
        let dev = FileDevice::create_sparse(&t.path().join("d"), 64 << 10).unwrap();
        let data: Vec<u8> = (0..64u32 << 10).map(|i| (i * 7 % 251) as u8).collect();
        dev.write_at(&data, 0).unwrap();
        let cases: &[(&[usize], u64)] = &[
            (&[4096, 16, 4096, 16], 0),
            (&[0, 1, 0, 4095, 17, 3000, 0], 5),
            (&[65536], 0),
            (&[7; 1500], 100), // more buffers than one preadv takes
            (&[0, 0], 10),
        ];
        for &(sizes, off) in cases {
            let total: usize = sizes.iter().sum();
            let mut plain = vec![0; total];
            dev.read_at(&mut plain, off).unwrap();
            assert_eq!(plain, data[off as usize..off as usize + total]);
            assert_eq!(
                scattered(&dev, sizes, off).unwrap(),
                plain,
                "{sizes:?} at {off}"
            );
        }
        // Past the end is an error, as for `read_at`, never zeros.
        let e = scattered(&dev, &[4096, 16], (64 << 10) - 100).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    }

    /// Pages of `len` bytes at `offset` of `file` that the page cache holds (`mincore`).
    fn resident(file: &File, offset: u64, len: usize) -> usize {
        use std::os::unix::io::AsRawFd;
        // SAFETY: a read-only shared mapping of a range inside the file, unmapped before
        // returning; `mincore` writes one byte per page into a vector of that many.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                offset as libc::off_t,
            );
            assert_ne!(p, libc::MAP_FAILED);
            let mut v = vec![0u8; len.div_ceil(4096)];
            assert_eq!(libc::mincore(p, len, v.as_mut_ptr()), 0);
            libc::munmap(p, len);
            v.iter().filter(|&&b| b & 1 == 1).count()
        }
    }

    /// A device file of two halves of `len` bytes, written and synced half by half: the
    /// page cache's folios then lie within a half (a folio is never larger than the write
    /// that made it), and one half can be evicted alone.
    fn written_halves(len: usize) -> (tempfile::TempDir, PathBuf, FileDevice) {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("d");
        let dev = FileDevice::create_sparse(&path, 2 * len as u64).unwrap();
        dev.write_at(&vec![0x5A; len], 0).unwrap();
        dev.write_at(&vec![0x5A; len], len as u64).unwrap();
        dev.flush().unwrap();
        (t, path, dev)
    }

    /// `will_write` reaches the file through the `Arc` the pool holds its devices in (a
    /// default method the `Arc` forwarding missed once did nothing), and reads the range
    /// into the page cache, so that runs written into it later need no read each.
    #[test]
    fn will_write_reads_the_range_into_the_page_cache() {
        use std::os::unix::io::AsRawFd;
        const LEN: usize = 1 << 20;
        let (t, path, dev) = written_halves(LEN);
        // Written and synced, the pages are clean: DONTNEED takes them out of the cache.
        // SAFETY: plain syscall on a descriptor we own.
        unsafe { libc::posix_fadvise(dev.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let probe = File::open(&path).unwrap();
        if resident(&probe, 0, LEN) > 0 {
            eprintln!("skipped: this file system keeps the pages in memory (tmpfs?)");
            return;
        }
        let dev: Arc<dyn Device> = Arc::new(dev);
        dev.will_write(0, LEN as u64);
        // The read runs in the background: wait for it (bounded), never sleep and assert.
        for _ in 0..1000 {
            if resident(&probe, 0, LEN) == LEN / 4096 {
                // Only the range asked for.
                assert_eq!(resident(&probe, LEN as u64, LEN), 0);
                // A hole is not read in (a write into it reads nothing): a file whose
                // second half was never written keeps that half out of the cache.
                let holed = t.path().join("h");
                let h = FileDevice::create_sparse(&holed, 2 * LEN as u64).unwrap();
                h.write_at(&vec![0x5A; LEN], 0).unwrap();
                h.flush().unwrap();
                // SAFETY: plain syscall on a descriptor we own.
                unsafe { libc::posix_fadvise(h.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
                if !h.seek_holes {
                    eprintln!("holes not checked: this file system's SEEK_DATA is not used");
                    return;
                }
                let h: Arc<dyn Device> = Arc::new(h);
                h.will_write(0, 2 * LEN as u64);
                let hp = File::open(&holed).unwrap();
                for _ in 0..1000 {
                    if resident(&hp, 0, LEN) == LEN / 4096 {
                        break;
                    }
                    crate::env::sleep(std::time::Duration::from_millis(10));
                }
                assert_eq!(resident(&hp, 0, LEN), LEN / 4096, "the data half");
                assert_eq!(resident(&hp, LEN as u64, LEN), 0, "the hole was read in");
                return;
            }
            crate::env::sleep(std::time::Duration::from_millis(10));
        }
        panic!(
            "will_write left {} of {} pages out of the page cache",
            LEN / 4096 - resident(&probe, 0, LEN),
            LEN / 4096
        );
    }

    /// `fully_cached` tells a range the page cache holds whole from one it holds in part
    /// (what lets `will_write` skip the read-ahead of a cached segment, and only that).
    #[test]
    fn fully_cached_tells_a_cached_range_from_one_partly_evicted() {
        use std::os::unix::io::AsRawFd;
        const LEN: usize = 1 << 20;
        let (_t, path, dev) = written_halves(LEN);
        let fd = dev.file.as_raw_fd();
        match cachestat(fd, 0, 4096) {
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                eprintln!("skipped: this kernel has no cachestat (before Linux 6.5)");
                return;
            }
            other => assert!(other.is_ok(), "cachestat: {other:?}"),
        }
        // Only where the page cache is the file system's cache (OpenZFS keeps its own,
        // overlayfs its lower file's): ext4, XFS, btrfs, as for SEEK_DATA.
        if !dev.seek_holes {
            eprintln!("skipped: this file system's pages may live outside the page cache");
            return;
        }
        assert_eq!(
            fully_cached(fd, 0, 2 * LEN as u64),
            Some(true),
            "just written, every page is cached"
        );
        // The second half out of the cache: the whole is no longer cached, the first half
        // still is.
        // SAFETY: plain syscall on a descriptor we own.
        unsafe { libc::posix_fadvise(fd, LEN as i64, LEN as i64, libc::POSIX_FADV_DONTNEED) };
        let probe = File::open(&path).unwrap();
        if resident(&probe, LEN as u64, LEN) > 0 {
            eprintln!("skipped: this file system keeps the pages in memory (tmpfs?)");
            return;
        }
        assert_eq!(fully_cached(fd, 0, 2 * LEN as u64), Some(false));
        assert_eq!(
            fully_cached(fd, LEN as u64 + 1, LEN as u64 - 1),
            Some(false)
        );
        assert_eq!(fully_cached(fd, 0, LEN as u64), Some(true));
        // A range ending one byte into the evicted half reaches its first page.
        assert_eq!(fully_cached(fd, 0, LEN as u64 + 1), Some(false));
        assert_eq!(fully_cached(fd, LEN as u64 - 1, 1), Some(true));
    }

    /// Blocks the file system has allocated for a file, in bytes.
    fn allocated(path: &Path) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(path).unwrap().blocks() * 512
    }

    #[test]
    fn filling_the_holes_allocates_every_block_and_keeps_the_data() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("d");
        let size = 16u64 << 20;
        let dev = FileDevice::create_sparse(&path, size).unwrap();
        let holes = dev.holes().unwrap();
        if holes != vec![(0, size)] {
            // A file system without SEEK_HOLE reports no holes: nothing to test here.
            assert!(holes.is_empty(), "{holes:?}");
            return;
        }
        // Data in the middle and at the very end, as labels lie.
        let label = vec![0x5Au8; 64 << 10];
        dev.write_at(&label, 4 << 20).unwrap();
        dev.write_at(&label, size - (64 << 10)).unwrap();
        let holes = dev.holes().unwrap();
        assert_eq!(holes.first().map(|h| h.0), Some(0));
        let hole_bytes: u64 = holes.iter().map(|(a, b)| b - a).sum();
        assert!(hole_bytes >= size - (4 << 20), "{holes:?}");
        assert!(holes
            .iter()
            .all(|&(a, b)| b <= 4 << 20 || a >= (4 << 20) + (64 << 10)));
        let mut written = 0;
        dev.fill_holes(&holes, &mut |n| written += n).unwrap();
        assert_eq!(written, hole_bytes);
        assert!(dev.holes().unwrap().is_empty());
        assert!(allocated(&path) >= size, "{} of {size}", allocated(&path));
        let mut back = vec![0u8; 64 << 10];
        dev.read_at(&mut back, 4 << 20).unwrap();
        assert_eq!(back, label);
        dev.read_at(&mut back, size - (64 << 10)).unwrap();
        assert_eq!(back, label);
        dev.read_at(&mut back, 8 << 20).unwrap();
        assert!(back.iter().all(|&b| b == 0));
    }
}
