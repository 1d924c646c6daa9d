//! `bulwark csi`: the CSI driver (`bulwark-csi`) wired to this pool's daemon.
//!
//! The driver asks for what it needs through its `Pool` trait; this module answers
//! each call with one control request over `DIR/control.sock`, as the CLI's commands
//! do (a connection per call, so a daemon restart costs one failed call, not a stuck
//! driver), and keeps the daemon's error kind, which the driver turns into a gRPC
//! status. Secrets pass as paths of files the driver wrote, never as bytes.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bulwark_csi::pool::{
    self as csi_pool, NewVolume, PoolError, PoolResult, SecretKind, SecretPath, SnapshotInfo,
    VolumeInfo,
};
use serde::de::DeserializeOwned;

use crate::cli::CsiArgs;
use crate::client::Client;
use crate::control::{ErrorKind, Request, Response, SecretRef, StatusReport, VolumeEntry};
use crate::error::{Error, Result};

/// The pool's daemon, reached over its control socket.
struct ControlPool {
    dir: PathBuf,
}

fn kind_of(kind: Option<ErrorKind>) -> csi_pool::ErrorKind {
    use csi_pool::ErrorKind as K;
    match kind {
        Some(ErrorKind::Invalid) => K::Invalid,
        Some(ErrorKind::NotFound) => K::NotFound,
        Some(ErrorKind::Exists) => K::Exists,
        Some(ErrorKind::Locked) => K::Locked,
        Some(ErrorKind::WrongKey) => K::WrongKey,
        Some(ErrorKind::Busy | ErrorKind::ReadOnly) => K::Busy,
        Some(ErrorKind::NoSpace) => K::NoSpace,
        Some(ErrorKind::Unavailable | ErrorKind::StoreUnavailable) => K::Unavailable,
        _ => K::Other,
    }
}

fn secret_ref(s: SecretPath<'_>) -> SecretRef {
    match s.kind {
        SecretKind::Passphrase => SecretRef::PassphraseFile(s.path.to_path_buf()),
        SecretKind::Key => SecretRef::KeyFile(s.path.to_path_buf()),
    }
}

impl ControlPool {
    fn call(&self, request: &Request) -> PoolResult<serde_json::Value> {
        let unavailable =
            |e: Error| PoolError::new(csi_pool::ErrorKind::Unavailable, e.to_string());
        let mut client = Client::connect(&self.dir).map_err(unavailable)?;
        match client.call_response(request).map_err(unavailable)? {
            Response::Ok(v) => Ok(v),
            Response::Err { message, kind } => Err(PoolError::new(kind_of(kind), message)),
        }
    }

    fn call_typed<T: DeserializeOwned>(&self, request: &Request) -> PoolResult<T> {
        serde_json::from_value(self.call(request)?).map_err(|e| {
            PoolError::new(
                csi_pool::ErrorKind::Other,
                format!("unexpected answer from the daemon: {e}"),
            )
        })
    }

    fn status(&self) -> PoolResult<StatusReport> {
        self.call_typed(&Request::Status)
    }
}

impl csi_pool::Pool for ControlPool {
    fn volumes(&self) -> PoolResult<Vec<VolumeInfo>> {
        let entries: Vec<VolumeEntry> = self.call_typed(&Request::VolumeList)?;
        Ok(entries
            .into_iter()
            .map(|e| VolumeInfo {
                name: e.volume.name,
                size_bytes: e.volume.size_bytes,
                block_size: e.volume.block_size,
                encryption: e.volume.encryption,
                locked: e.volume.locked,
                origin: e.volume.origin,
            })
            .collect())
    }

    fn create_volume(&self, v: &NewVolume, secret: Option<SecretPath<'_>>) -> PoolResult<()> {
        self.call(&Request::VolumeCreate {
            name: v.name.clone(),
            size_bytes: v.size_bytes,
            block_size: v.block_size,
            compression: v.compression.clone(),
            encryption: v.encryption,
            secret: secret.map(secret_ref),
            thick: v.thick,
        })
        .map(drop)
    }

    fn destroy_volume(&self, name: &str, recursive: bool) -> PoolResult<()> {
        self.call(&Request::VolumeDestroy {
            name: name.to_string(),
            recursive,
        })
        .map(drop)
    }

    fn resize_volume(&self, name: &str, size_bytes: u64) -> PoolResult<()> {
        self.call(&Request::VolumeResize {
            name: name.to_string(),
            size_bytes,
            shrink: false,
        })
        .map(drop)
    }

    fn snapshots(&self) -> PoolResult<Vec<SnapshotInfo>> {
        let list: Vec<bulwark_engine::volume::snap::SnapshotStatus> =
            self.call_typed(&Request::SnapshotList { volume: None })?;
        Ok(list
            .into_iter()
            .map(|s| SnapshotInfo {
                volume: s.volume,
                snapshot: s.snapshot,
                created_secs: s.created,
            })
            .collect())
    }

    fn create_snapshot(&self, volume: &str, snapshot: &str) -> PoolResult<()> {
        self.call(&Request::SnapshotCreate {
            volume: volume.to_string(),
            snapshot: snapshot.to_string(),
        })
        .map(drop)
    }

    fn destroy_snapshot(&self, volume: &str, snapshot: &str) -> PoolResult<()> {
        self.call(&Request::SnapshotDestroy {
            volume: volume.to_string(),
            snapshot: snapshot.to_string(),
        })
        .map(drop)
    }

    fn clone_snapshot(
        &self,
        volume: &str,
        snapshot: &str,
        new: &str,
        secret: Option<SecretPath<'_>>,
    ) -> PoolResult<()> {
        self.call(&Request::VolumeClone {
            volume: volume.to_string(),
            snapshot: snapshot.to_string(),
            name: new.to_string(),
            secret: secret.map(secret_ref),
            independent: false,
        })
        .map(drop)
    }

    fn key_load(&self, name: &str, secret: SecretPath<'_>) -> PoolResult<()> {
        self.call(&Request::KeyLoad {
            name: name.to_string(),
            secret: secret_ref(secret),
        })
        .map(drop)
    }

    fn key_unload(&self, name: &str) -> PoolResult<()> {
        self.call(&Request::KeyUnload {
            name: name.to_string(),
        })
        .map(drop)
    }

    fn free_bytes(&self) -> PoolResult<u64> {
        Ok(self.status()?.pool.space.free_bytes)
    }

    fn nbd_socket(&self) -> PoolResult<PathBuf> {
        Ok(self.status()?.daemon.nbd_socket)
    }
}

/// `bulwark csi`: serves until SIGTERM or SIGINT.
pub fn serve(dir: &Path, args: &CsiArgs) -> Result<()> {
    let endpoint = bulwark_csi::parse_endpoint(&args.endpoint).map_err(Error::usage)?;
    if args.node_id.trim().is_empty() {
        return Err(Error::usage("--node-id cannot be empty"));
    }
    let dir = std::path::absolute(dir)
        .map_err(|e| Error::msg(format!("pool directory {}: {e}", dir.display())))?;
    let (controller, node) = match (args.controller, args.node) {
        (false, false) => (true, true),
        other => other,
    };
    let config = bulwark_csi::Config {
        endpoint,
        node_id: args.node_id.clone(),
        controller,
        node,
        secrets_dir: args
            .secrets_dir
            .clone()
            .unwrap_or_else(|| args.state_dir.join("secrets")),
        state_dir: args.state_dir.clone(),
    };
    let driver = bulwark_csi::Driver::new(Arc::new(ControlPool { dir }), config);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::msg(format!("cannot start the runtime: {e}")))?;
    runtime
        .block_on(bulwark_csi::serve(driver))
        .map_err(|e| Error::msg(format!("csi: {e}")))
}
