//! The pool: devices with labels, superblocks, the volume table, commit and import.
//!
//! PUBLIC API SKELETON — bodies are being filled in.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::keys::Secret;
use crate::volume::{Volume, VolumeOptions};
use crate::{Error, Result};

/// How copies are laid out across devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Layout {
    /// One copy; several devices are concatenated.
    Single,
    /// N copies, one on each of N devices.
    Mirror(u8),
}

impl std::str::FromStr for Layout {
    type Err = Error;
    fn from_str(s: &str) -> Result<Layout> {
        if s == "single" {
            return Ok(Layout::Single);
        }
        if let Some(n) = s.strip_prefix("mirror:") {
            let n: u8 = n.parse().map_err(|_| Error::Invalid(format!("invalid layout '{s}': mirror:N needs N between 2 and 8")))?;
            if !(2..=8).contains(&n) {
                return Err(Error::Invalid(format!("invalid layout '{s}': mirror:N needs N between 2 and 8")));
            }
            return Ok(Layout::Mirror(n));
        }
        if s.starts_with("parity:") {
            return Err(Error::Invalid(format!("layout '{s}': parity layouts are not supported yet; use single or mirror:N")));
        }
        Err(Error::Invalid(format!("invalid layout '{s}': expected single or mirror:N")))
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Layout::Single => f.write_str("single"),
            Layout::Mirror(n) => write!(f, "mirror:{n}"),
        }
    }
}

/// Where a new pool's devices come from.
#[derive(Debug, Clone)]
pub enum DeviceSpec {
    /// Create `count` sparse files of `size_bytes` each inside the pool directory.
    Files { count: usize, size_bytes: u64 },
    /// Use existing files or block devices (files that do not exist are refused).
    Paths(Vec<PathBuf>),
}

#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// Bound on the clean block-map node cache, in bytes.
    pub cache_bytes: u64,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions { cache_bytes: crate::constants::CACHE_BYTES_DEFAULT }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceStatus {
    pub path: PathBuf,
    /// ONLINE, DEGRADED, FAULTED or UNAVAIL.
    pub state: String,
    pub read_errors: u64,
    pub write_errors: u64,
    pub cksum_errors: u64,
    pub size_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SpaceStatus {
    /// Usable bytes (after redundancy).
    pub total_bytes: u64,
    pub used_bytes: u64,
    pub free_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VolumeStatus {
    pub name: String,
    pub size_bytes: u64,
    pub block_size: u32,
    pub compression: String,
    pub encryption: bool,
    pub locked: bool,
    /// Stored bytes referenced by this volume (after compression, one copy).
    pub used_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PoolStatus {
    pub pool_id: String,
    pub dir: PathBuf,
    /// ONLINE, DEGRADED or FAULTED.
    pub state: String,
    pub layout: String,
    pub generation: u64,
    pub devices: Vec<DeviceStatus>,
    pub repaired_blocks: u64,
    pub unrecoverable_blocks: u64,
    pub space: SpaceStatus,
    pub volumes: Vec<VolumeStatus>,
}

pub struct Pool {
    _p: (),
}

impl Pool {
    /// Create a new pool in `dir` (created if missing; must not already hold a pool).
    pub fn create(_dir: &Path, _layout: Layout, _devices: DeviceSpec) -> Result<()> {
        todo!()
    }

    /// Import the pool in `dir`, taking its exclusive lock for the life of the `Pool`.
    pub fn open(_dir: &Path, _opts: OpenOptions) -> Result<Arc<Pool>> {
        todo!()
    }

    pub fn create_volume(&self, _name: &str, _opts: VolumeOptions, _secret: Option<&Secret>) -> Result<()> {
        todo!()
    }

    /// Destroy a volume and free its space. Refused while it is attached.
    pub fn destroy_volume(&self, _name: &str) -> Result<()> {
        todo!()
    }

    pub fn volumes(&self) -> Vec<VolumeStatus> {
        todo!()
    }

    /// Unlock an encrypted volume. A wrong secret gives `Error::WrongKey`.
    pub fn load_key(&self, _name: &str, _secret: &Secret) -> Result<()> {
        todo!()
    }

    /// Lock an encrypted volume again; refused (`Error::Busy`) while attached.
    pub fn unload_key(&self, _name: &str) -> Result<()> {
        todo!()
    }

    /// An unlocked volume for I/O. `Error::NotFound` or `Error::Locked` otherwise.
    pub fn volume(&self, _name: &str) -> Result<Arc<Volume>> {
        todo!()
    }

    /// Names of volumes that may be exported now (unlocked).
    pub fn exportable(&self) -> Vec<String> {
        todo!()
    }

    pub fn status(&self) -> PoolStatus {
        todo!()
    }

    /// Make every write completed so far durable (one atomic commit).
    pub fn flush(&self) -> Result<()> {
        todo!()
    }

    /// Final commit; stops background work. The pool is unusable afterwards.
    pub fn close(&self) -> Result<()> {
        todo!()
    }
}
