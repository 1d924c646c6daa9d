//! Device: a file or block device addressed by byte offset.
//!
//! This layer knows nothing of redundancy, checksums or keys. It reads and
//! writes whole ranges (`read_exact_at`/`write_all_at`) and makes them durable
//! with `flush` (fsync). A short read past the end is an error, never zeros.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub mod fault;

use crate::{Error, Result};

/// What the redundancy layer needs of a device. Fault-injecting devices implement it too.
pub trait Device: Send + Sync {
    fn path(&self) -> &Path;
    fn size(&self) -> u64;
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()>;
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()>;
    fn flush(&self) -> std::io::Result<()>;
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
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        (**self).write_at(buf, offset)
    }
    fn flush(&self) -> std::io::Result<()> {
        (**self).flush()
    }
}

/// A regular file or a block device.
pub struct FileDevice {
    path: PathBuf,
    file: File,
    size: u64,
    /// Bytes written since writeback was last started (see `write_at`).
    unkicked: std::sync::atomic::AtomicU64,
}

impl FileDevice {
    /// Create a sparse file of `size` bytes; refuses to overwrite an existing file.
    pub fn create_sparse(path: &Path, size: u64) -> Result<FileDevice> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| Error::device(path, e))?;
        file.set_len(size).map_err(|e| Error::device(path, e))?;
        Ok(FileDevice {
            path: path.to_path_buf(),
            file,
            size,
            unkicked: Default::default(),
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
            file,
            size,
            unkicked: Default::default(),
        })
    }
}

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
}
