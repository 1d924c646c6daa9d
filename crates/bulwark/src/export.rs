//! The glue between the engine and the NBD server: a volume as an NBD backend,
//! the pool as the set of exports.
//!
//! Only unlocked volumes are exported; a locked or unknown name opens nothing,
//! and both look the same to a client. Engine errors become errnos here
//! (`Error::errno`), and the ones that mean data or devices are in trouble are
//! logged with the volume and range, since the client only sees EIO.

use std::sync::Arc;

use bulwark_engine::{Pool, Volume};

use crate::nbd::{Backend, Errno, Exports, Extent};

pub struct VolumeBackend(pub Arc<Volume>);

impl VolumeBackend {
    fn fail(&self, what: &str, offset: u64, length: u64, e: bulwark_engine::Error) -> Errno {
        let errno = e.errno();
        if errno == libc::EIO || errno == libc::ENOSPC {
            tracing::warn!(volume = self.0.name(), offset, length, "{what} failed: {e}");
        } else {
            tracing::debug!(
                volume = self.0.name(),
                offset,
                length,
                "{what} refused: {e}"
            );
        }
        errno
    }
}

impl Backend for VolumeBackend {
    fn size(&self) -> u64 {
        self.0.size()
    }

    fn preferred_block_size(&self) -> u32 {
        self.0.block_size()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        let length = buf.len() as u64;
        self.0
            .read(offset, buf)
            .map_err(|e| self.fail("read", offset, length, e))
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), Errno> {
        self.0
            .write(offset, data, fua)
            .map_err(|e| self.fail("write", offset, data.len() as u64, e))
    }

    fn flush(&self) -> Result<(), Errno> {
        self.0.flush().map_err(|e| self.fail("flush", 0, 0, e))
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<(), Errno> {
        self.0
            .trim(offset, length)
            .map_err(|e| self.fail("trim", offset, length, e))?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        _may_trim: bool,
    ) -> Result<(), Errno> {
        // The engine frees whole zeroed blocks whether or not the client allows
        // it: a freed block reads as zeros, which is all NBD promises either way.
        self.0
            .write_zeroes(offset, length, fua)
            .map_err(|e| self.fail("write zeroes", offset, length, e))
    }

    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, Errno> {
        let extents = self
            .0
            .block_status(offset, length)
            .map_err(|e| self.fail("block status", offset, length, e))?;
        Ok(extents
            .into_iter()
            .map(|x| Extent {
                length: x.length,
                hole: x.hole,
                zero: x.hole,
            })
            .collect())
    }
}

/// Every unlocked volume of the pool, by name.
pub struct PoolExports(pub Arc<Pool>);

impl Exports for PoolExports {
    fn list(&self) -> Vec<String> {
        self.0.exportable()
    }

    fn open(&self, name: &str) -> Option<Arc<dyn Backend>> {
        let volume = self.0.volume(name).ok()?;
        Some(Arc::new(VolumeBackend(volume)))
    }
}
