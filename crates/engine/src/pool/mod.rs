//! The pool, the engine's control plane: devices with labels, the volume table, commits,
//! import, snapshots, keys, scrub, cleaning and the object tier. ARCHITECTURE.md draws its
//! rooms; each file's own `//!` says what lives there.
//!
//! Bottom up (each room uses only rooms below it; `crates/bulwark/tests/layers.rs` holds
//! the order): `format` (the bytes and files the pool keeps), `tier` (the object tier's
//! pool side), `options` and `status` (what goes in and comes out), `intentlog` (the
//! intent log's blocks and devices), `core` (the state every volume handle shares), then
//! the rooms that act on it: `txg` (commit, the flush path, log devices), the dataset
//! operations (`snapshot`, `props`, `keys`, `rotate`), upkeep (`scrub`, `clean`, `evict`),
//! the pool's life (`create`, `import`), `facade` (`Pool`, what the daemon holds) and
//! `lifecycle` (a pool without a daemon). This file only declares and re-exports.

mod clean;
mod core;
pub mod create;
mod defrag;
pub mod evict;
mod facade;
pub mod format;
pub mod group;
#[cfg(test)]
mod hostile;
mod import;
pub mod intentlog;
pub mod keys;
pub mod lifecycle;
pub mod options;
pub mod props;
pub mod relocate;
pub mod rotate;
pub mod scrub;
pub mod snapshot;
pub mod status;
mod stepped;
pub mod tier;
pub mod txg;

pub use facade::Pool;
#[cfg(test)]
pub(crate) use facade::{test_pool, test_volume};

pub use crate::redundancy::Layout;
pub use core::KeptSnapshot;
pub use options::{DeviceSpec, OpenOptions};
pub use status::{
    DeviceStatus, LogStatus, PoolStatus, SnapshotStatus, SpaceStatus, VolumeSpace, VolumeStatus,
};
