//! bulwark engine: encrypted, checksummed, copy-on-write volumes on a pool of devices.
//!
//! Layers, bottom up (each module knows only the ones below it):
//! `device` (files and block devices by offset) → `redundancy` (single, mirror;
//! verified reads with repair) → `log` (segments, append, space accounting,
//! cleaning) → `codec` (lz4, AES-256-GCM, blake3) → `map` (copy-on-write radix
//! tree of block pointers) → `volume` (byte-addressed reads and writes) →
//! `pool` (labels, superblocks, commit, import, the volume table).
//!
//! The engine is synchronous and thread-safe: callers (the NBD export, the
//! control socket) run it on a bounded blocking pool. It knows nothing of NBD.

pub mod checksum;
pub mod codec;
pub mod constants;
pub mod device;
pub mod error;
#[cfg(test)]
pub(crate) mod fuzz;
pub mod hex;
pub mod keys;
pub mod log;
pub mod map;
pub mod pool;
pub mod redundancy;
pub mod size;
pub mod store;
pub mod volume;

pub use codec::Compression;
pub use error::{Error, Result};
pub use keys::Secret;
pub use pool::{
    DeviceSpec, DeviceStatus, Layout, OpenOptions, Pool, PoolStatus, SpaceStatus, VolumeStatus,
};
pub use volume::{Extent, Volume, VolumeOptions};
