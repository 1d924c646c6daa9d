//! What `status` shows of a pool: devices, space, the intent log's devices, the scrub,
//! data errors, the cache device and the object store (the types, filled in by `Core`).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::format::health::{DataError, ScrubStatus};
use super::tier;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DeviceStatus {
    pub path: PathBuf,
    /// ONLINE, DEGRADED, FAULTED or UNAVAIL.
    pub state: String,
    pub read_errors: u64,
    pub write_errors: u64,
    pub cksum_errors: u64,
    pub size_bytes: u64,
    /// Why a FAULTED device was faulted (its first failed write or sync).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SpaceStatus {
    /// Usable bytes (after redundancy).
    pub total_bytes: u64,
    pub used_bytes: u64,
    /// What client writes may still take: total less used and reserved.
    pub free_bytes: u64,
    /// Kept back from client writes for commits (map nodes) and the cleaner.
    #[serde(default)]
    pub reserved_bytes: u64,
    /// What thick volumes reserved and have not stored yet: kept from thin volumes' data
    /// (not counted in `free_bytes`).
    #[serde(default)]
    pub thick_reserved_bytes: u64,
    /// What live data may fill: total less the segments always kept for commits and the
    /// cleaner. Overwrites never fail for space while used stays within it.
    #[serde(default)]
    pub usable_bytes: u64,
    /// Sum of the volumes' sizes: above `usable_bytes` the pool is overcommitted (thin).
    #[serde(default)]
    pub provisioned_bytes: u64,
    /// Bytes written since the daemon started: client data, blocks the cleaner moved, and
    /// metadata (map nodes, volume table), each counted once per copy's worth of space.
    #[serde(default)]
    pub data_written_bytes: u64,
    #[serde(default)]
    pub clean_written_bytes: u64,
    #[serde(default)]
    pub meta_written_bytes: u64,
    /// (data + clean + meta) / data written since start; 1.0 before any client write.
    #[serde(default)]
    pub write_amplification: f64,
    /// Set when cleaning cannot gain space (the pool is full for writes that need new
    /// space, whatever `free_bytes` says): why, and what frees space.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cleaning: Option<String>,
    /// Map-node bytes the cleaner writes per byte it moves (every copy), as measured (0:
    /// not yet).
    #[serde(default)]
    pub clean_cost: f64,
    /// Free bytes inside partly-live segments that client writes fill when free segments
    /// run short (decision 0014), and how many free extents they are in: known since the
    /// pool was imported (memory only).
    #[serde(default)]
    pub hole_bytes: u64,
    /// Of `hole_bytes`, those in extents of at least 64 KiB: what the cleaner counts as
    /// room (a run goes into one hole whole, or into a free segment).
    #[serde(default)]
    pub hole_large_bytes: u64,
    #[serde(default)]
    pub holes: u64,
    /// Bytes client writes placed into holes since the daemon started (each copy's worth
    /// of space counted once, as the `*_written_bytes`).
    #[serde(default)]
    pub hole_filled_bytes: u64,
    /// Bytes the idle defragmenter rewrote in block order since the daemon started (counted
    /// as `clean_written_bytes` are, and in them), and the passes over every volume it ended.
    #[serde(default)]
    pub defrag_moved_bytes: u64,
    #[serde(default)]
    pub defrag_passes: u64,
    /// Writes a wait for space ended in ENOSPC since the daemon started, and the last
    /// one's time (seconds since the epoch) and reason (`Store::wait_until`): a refusal
    /// with `cleaning` unset is still explained here.
    #[serde(default)]
    pub refused_writes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_refusal: Option<Refusal>,
}

pub use crate::store::Refusal;

pub use crate::volume::snap::{SnapshotStatus, VolumeSpace};
pub use crate::volume::VolumeStatus;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PoolStatus {
    pub pool_id: String,
    /// The pool's name (`pool create --name`; the directory's name for older pools).
    #[serde(default)]
    pub name: String,
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
    pub scrub: ScrubStatus,
    /// Byte ranges no copy could supply (volume, offset, length).
    pub errors: Vec<DataError>,
    /// The cache device (`--cache-device`), if one is configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_device: Option<crate::cachedev::CacheDeviceStatus>,
    /// The separate intent log devices, when the pool has any (`intentlog::devices`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<LogStatus>,
    /// Acknowledged flushes the import found lost from the intent log and took anyway
    /// (`OpenOptions::accept_log_loss`): which volumes and how many flushes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost_flushes: Option<String>,
    /// The object store, when the pool has one (`tier`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object_store: Option<tier::TierStatus>,
}

/// The separate intent log devices in `status`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LogStatus {
    /// ONLINE (every log device works), DEGRADED (one of a mirrored pair is out), or
    /// FELL_BACK (none works: flushes commit or use the main devices' log).
    pub state: String,
    /// Each log device: ONLINE, FAULTED (failed while the pool ran) or UNAVAIL (missing
    /// or not this pool's at import).
    pub devices: Vec<DeviceStatus>,
    /// Why the log fell back, or what the import could not replay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}
