//! bulwark engine: encrypted, checksummed, copy-on-write volumes on a pool of devices.
//!
//! Layers, bottom up (each module knows only the ones below it; the table in
//! `crates/bulwark/tests/layers.rs` checks it): leaves (`error`, `constants`, `checksum`,
//! `hex`, `size`, `fuzz`; `crashpoint` and `pause`, named points for tests; `tier`, what
//! the pool needs from an object store) → `device` (files and block devices by offset) →
//! `redundancy` (one `Placement` per layout; verified reads with repair) → `cachedev`
//! (copies of hot records on a cache device, verified at every hit) → `log` (segments,
//! streams, space floors, cleaning victims) → `codec` (lz4, AES-256-GCM) → `keys` (key
//! slots, data key rings, the pool key) → `map` (copy-on-write radix tree of block
//! pointers) → `store` (the data plane: one put path, one release point, nonces,
//! back-pressure) → `volume` (byte-addressed reads and writes, through the store only) →
//! `pool` (the control plane: labels, superblocks, commit, import, the volume table, scrub,
//! rotation, devices).
//!
//! The engine is synchronous and thread-safe: callers run it on threads that may block
//! (the NBD server's connection threads, `spawn_blocking` for the control socket), never
//! on an async task's thread. It knows nothing of NBD.

pub mod cachedev;
pub mod checksum;
pub mod codec;
pub mod constants;
pub mod crashpoint;
pub mod device;
pub mod env;
pub mod error;
#[cfg(test)]
pub(crate) mod fuzz;
pub mod hex;
pub mod keys;
pub mod log;
pub mod map;
pub mod pause;
pub mod pool;
pub mod redundancy;
pub mod size;
pub mod store;
pub mod sync;
pub mod tier;
pub mod volume;

pub use codec::Compression;
pub use error::{Error, Result};
pub use keys::Secret;
pub use pool::{
    DeviceSpec, DeviceStatus, Layout, OpenOptions, Pool, PoolStatus, SpaceStatus, VolumeStatus,
};
pub use volume::{Extent, Volume, VolumeOptions};
