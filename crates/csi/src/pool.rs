//! What the driver needs from the pool's daemon, as a trait.
//!
//! The driver never speaks the control protocol itself: the `bulwark` binary
//! implements [`Pool`] over its control socket (`crates/bulwark/src/csi.rs`), as
//! every CLI command does, so the protocol stays in one place and the driver's
//! logic can be tested against a model. Calls block (one request and its answer
//! on a unix socket); the gRPC handlers run them on tokio's blocking pool.
//!
//! Secrets cross this boundary only as paths of 0600 files ([`SecretPath`]): the
//! daemon reads them itself, as it does for `key load --key-file`.

use std::path::{Path, PathBuf};

/// A volume as the controller and node see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeInfo {
    pub name: String,
    pub size_bytes: u64,
    pub block_size: u32,
    pub encryption: bool,
    /// Encrypted and its key not loaded.
    pub locked: bool,
    /// `VOL@SNAP` it was cloned from.
    pub origin: Option<String>,
}

/// One snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub volume: String,
    pub snapshot: String,
    /// Seconds since the epoch.
    pub created_secs: u64,
}

/// A volume to create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewVolume {
    pub name: String,
    pub size_bytes: u64,
    pub block_size: u32,
    /// "off" or "lz4".
    pub compression: String,
    pub encryption: bool,
    pub thick: bool,
}

/// What a secret file holds: a passphrase (Argon2id) or the bytes of a key file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretKind {
    Passphrase,
    Key,
}

/// A secret as the daemon takes it: the path of a file only its owner reads.
#[derive(Debug, Clone, Copy)]
pub struct SecretPath<'a> {
    pub kind: SecretKind,
    pub path: &'a Path,
}

/// Why a pool call failed, as far as the driver must tell failures apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    Invalid,
    NotFound,
    Exists,
    /// The volume's key is not loaded.
    Locked,
    /// The secret opens no key slot.
    WrongKey,
    /// In use (attached, has snapshots or clones, a change under way).
    Busy,
    NoSpace,
    /// The daemon cannot be reached, or is shutting down.
    Unavailable,
    Other,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolError {
    pub kind: ErrorKind,
    pub message: String,
}

impl PoolError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> PoolError {
        PoolError {
            kind,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for PoolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

pub type PoolResult<T> = std::result::Result<T, PoolError>;

/// The pool's daemon, one request at a time.
pub trait Pool: Send + Sync + 'static {
    fn volumes(&self) -> PoolResult<Vec<VolumeInfo>>;
    /// The volume is left with its key loaded when it is encrypted.
    fn create_volume(&self, volume: &NewVolume, secret: Option<SecretPath<'_>>) -> PoolResult<()>;
    fn destroy_volume(&self, name: &str, recursive: bool) -> PoolResult<()>;
    fn resize_volume(&self, name: &str, size_bytes: u64) -> PoolResult<()>;
    fn snapshots(&self) -> PoolResult<Vec<SnapshotInfo>>;
    fn create_snapshot(&self, volume: &str, snapshot: &str) -> PoolResult<()>;
    fn destroy_snapshot(&self, volume: &str, snapshot: &str) -> PoolResult<()>;
    /// `volume@snapshot` as `new`, under `secret` alone when encrypted (the origin's
    /// key must be loaded).
    fn clone_snapshot(
        &self,
        volume: &str,
        snapshot: &str,
        new: &str,
        secret: Option<SecretPath<'_>>,
    ) -> PoolResult<()>;
    fn key_load(&self, name: &str, secret: SecretPath<'_>) -> PoolResult<()>;
    fn key_unload(&self, name: &str) -> PoolResult<()>;
    /// What client writes may still take.
    fn free_bytes(&self) -> PoolResult<u64>;
    /// The daemon's NBD unix socket, where volumes are exported by name.
    fn nbd_socket(&self) -> PoolResult<PathBuf>;

    /// One volume, or `None`.
    fn volume(&self, name: &str) -> PoolResult<Option<VolumeInfo>> {
        Ok(self.volumes()?.into_iter().find(|v| v.name == name))
    }
}
