//! The Node service: a volume staged as a block device (and, for a file system,
//! formatted if blank and mounted at the staging path), published by bind mounts.
//!
//! Stage loads the volume's key with the node-stage secret (when it is encrypted and
//! locked) and attaches it (`attach`); unstage undoes both, in reverse. What stage did
//! is written to `STATE/volumes/ID.json` before it answers, so that:
//! - a plugin restart finds its volumes: nbdfuse runs in its own session and the mounts
//!   stay, so a repeated `NodeStageVolume` sees a healthy attachment and answers OK;
//! - a node reboot (or a daemon restart, which closes every NBD connection and locks
//!   every key) leaves a state file whose attachment no longer reads: the next
//!   `NodeStageVolume`, which kubelet sends for every volume in use, clears what is
//!   left of it and stages afresh, loading the key again from the secret.
//!
//! A volume whose key is already loaded (by an administrator, or a stage of it that is
//! still up) is staged without checking the secret again, and its key is then left
//! loaded at unstage: only a key this node loaded is unloaded.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tonic::{Request, Response, Status};

use crate::attach::{self, Attachment};
use crate::caps::{self, Access};
use crate::driver::{blocking, Driver};
use crate::mount;
use crate::pool::ErrorKind;
use crate::proto::node_service_capability::{rpc, Rpc, Type as CapType};
use crate::proto::{self, node_server};
use crate::secret::{SecretFile, Secrets};
use crate::status::{invalid, required};

pub struct Node(pub Arc<Driver>);

/// How long unstage retries a key unload that the daemon answers "in use" (its NBD
/// connection from nbdfuse is still closing).
const UNLOAD_WAIT: Duration = Duration::from_secs(10);

/// What stage did, kept until unstage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Staged {
    volume: String,
    staging_path: PathBuf,
    block: bool,
    attachment: Attachment,
    /// This node loaded the key, so unstage unloads it.
    key_loaded: bool,
    /// Publish targets bound now.
    targets: Vec<PathBuf>,
}

impl Driver {
    fn state_path(&self, volume: &str) -> PathBuf {
        self.config
            .state_dir
            .join("volumes")
            .join(format!("{volume}.json"))
    }

    fn fuse_root(&self) -> PathBuf {
        self.config.state_dir.join("fuse")
    }

    fn load_state(&self, volume: &str) -> Result<Option<Staged>, Status> {
        let path = self.state_path(volume);
        match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).map(Some).map_err(|e| {
                Status::internal(format!("state file {} is damaged: {e}", path.display()))
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Status::internal(format!(
                "cannot read {}: {e}",
                path.display()
            ))),
        }
    }

    /// Written whole (temporary file, fsync, rename) so a crash leaves the old or the new.
    fn save_state(&self, s: &Staged) -> Result<(), Status> {
        let path = self.state_path(&s.volume);
        let io =
            |e: std::io::Error| Status::internal(format!("cannot write {}: {e}", path.display()));
        std::fs::create_dir_all(path.parent().expect("state files have a parent")).map_err(io)?;
        let tmp = path.with_extension("json.tmp");
        let bytes = serde_json::to_vec_pretty(s).expect("state serializes");
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp).map_err(io)?;
            f.write_all(&bytes).map_err(io)?;
            f.sync_all().map_err(io)?;
        }
        std::fs::rename(&tmp, &path).map_err(io)
    }

    fn remove_state(&self, volume: &str) {
        let _ = std::fs::remove_file(self.state_path(volume));
    }

    /// Unloads a key this node loaded, waiting out "in use" while the NBD connection closes.
    fn unload_key(&self, volume: &str) -> Result<(), Status> {
        let started = Instant::now();
        loop {
            match self.pool.key_unload(volume) {
                Ok(()) => return Ok(()),
                // Not loaded (a daemon restart locked it) or no such volume: nothing to do.
                Err(e) if matches!(e.kind, ErrorKind::Invalid | ErrorKind::NotFound) => {
                    return Ok(())
                }
                Err(e) if e.kind == ErrorKind::Busy && started.elapsed() < UNLOAD_WAIT => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Undoes what a state file says, every step tried; errors are only logged when
    /// `quiet` (clearing what a reboot left), else the first is returned.
    fn tear_down(&self, s: &Staged, quiet: bool) -> Result<(), Status> {
        let mut first: Option<Status> = None;
        let mut note = |r: Result<(), Status>| {
            if let Err(e) = r {
                if quiet {
                    tracing::info!(volume = %s.volume, "clearing an old stage: {}", e.message());
                } else if first.is_none() {
                    first = Some(e);
                }
            }
        };
        for t in &s.targets {
            note(unmount_and_remove(t, quiet));
        }
        if !s.block {
            note(mount::unmount(&s.staging_path).map_err(Status::from));
        }
        note(attach::detach(&s.attachment).map_err(Status::from));
        if s.key_loaded && !quiet {
            note(self.unload_key(&s.volume));
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn stage(&self, mut req: proto::NodeStageVolumeRequest) -> Result<(), Status> {
        if req.volume_id.is_empty() {
            return Err(required("volume_id"));
        }
        if req.staging_target_path.is_empty() {
            return Err(required("staging_target_path"));
        }
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or_else(|| required("volume_capability"))?;
        let access = caps::check(cap).map_err(invalid)?;
        let secrets = Secrets::take(&mut req.secrets).map_err(invalid)?;
        let staging = PathBuf::from(&req.staging_target_path);
        let name = req.volume_id.clone();
        let _op = self.op(&name)?;
        let info = self
            .pool
            .volume(&name)?
            .ok_or_else(|| Status::not_found(format!("volume {name} does not exist")))?;

        if let Some(old) = self.load_state(&name)? {
            let up = old.attachment.healthy()
                && (old.block || mount::is_mount_point(&old.staging_path)?);
            if up {
                if old.staging_path != staging || old.block != (access == Access::Block) {
                    return Err(Status::already_exists(format!(
                        "volume {name} is staged at {} with another access type or path",
                        old.staging_path.display()
                    )));
                }
                return Ok(());
            }
            // A reboot, a daemon restart or a crash: clear what is left, stage again.
            tracing::info!(volume = %name, "the volume's earlier stage is gone: staging it again");
            let _ = self.tear_down(&old, true);
            self.remove_state(&name);
        }

        // The key, from the node-stage secret.
        let mut key_loaded = false;
        if info.encryption && info.locked {
            let s = secrets.own.as_ref().ok_or_else(|| {
                invalid(format!(
                    "volume {name} is encrypted and its key is not loaded: NodeStageVolume needs \
                     its secret ('passphrase' or 'key' in the Secret that the StorageClass names \
                     as csi.storage.k8s.io/node-stage-secret-name)"
                ))
            })?;
            let file = SecretFile::write(&self.config.secrets_dir, s).map_err(|e| {
                Status::internal(format!(
                    "cannot write a secret file under {}: {e}",
                    self.config.secrets_dir.display()
                ))
            })?;
            self.pool.key_load(&name, file.as_ref()).map_err(|e| {
                if e.kind == ErrorKind::WrongKey {
                    Status::unauthenticated(format!(
                        "the node-stage secret does not open volume {name}: {e}"
                    ))
                } else {
                    e.into()
                }
            })?;
            key_loaded = true;
        }
        let undo_key = |d: &Driver| {
            if key_loaded {
                let _ = d.unload_key(&name);
            }
        };

        let socket = match self.pool.nbd_socket() {
            Ok(s) => s,
            Err(e) => {
                undo_key(self);
                return Err(e.into());
            }
        };
        let attachment = match attach::attach(&name, &socket, &self.fuse_root()) {
            Ok(a) => a,
            Err(e) => {
                undo_key(self);
                return Err(e.into());
            }
        };
        let mut staged = Staged {
            volume: name.clone(),
            staging_path: staging.clone(),
            block: access == Access::Block,
            attachment,
            key_loaded,
            targets: Vec::new(),
        };
        let result = (|| -> Result<(), Status> {
            // The state first: a crash from here on leaves something unstage can undo.
            self.save_state(&staged)?;
            if let Access::Mount { fs, flags } = &access {
                let device = staged.attachment.device().to_string();
                let found = mount::fs_type(&device)?;
                let fs = match found {
                    Some(found) => found,
                    None => {
                        mount::format(&device, fs)?;
                        fs.clone()
                    }
                };
                std::fs::create_dir_all(&staging).map_err(|e| {
                    Status::internal(format!("cannot make {}: {e}", staging.display()))
                })?;
                mount::mount(&device, &staging, Some(&fs), flags)?;
            }
            Ok(())
        })();
        if let Err(e) = result {
            staged.targets.clear();
            let _ = self.tear_down(&staged, false);
            self.remove_state(&name);
            return Err(e);
        }
        tracing::info!(volume = %name, device = staged.attachment.device(), "volume staged");
        Ok(())
    }

    fn unstage(&self, req: proto::NodeUnstageVolumeRequest) -> Result<(), Status> {
        if req.volume_id.is_empty() {
            return Err(required("volume_id"));
        }
        if req.staging_target_path.is_empty() {
            return Err(required("staging_target_path"));
        }
        let name = req.volume_id;
        let _op = self.op(&name)?;
        let Some(s) = self.load_state(&name)? else {
            // Not staged by this node (or unstaged already): leave nothing mounted there.
            mount::unmount(Path::new(&req.staging_target_path))?;
            return Ok(());
        };
        self.tear_down(&s, false)?;
        self.remove_state(&name);
        tracing::info!(volume = %name, "volume unstaged");
        Ok(())
    }

    fn publish(&self, req: proto::NodePublishVolumeRequest) -> Result<(), Status> {
        if req.volume_id.is_empty() {
            return Err(required("volume_id"));
        }
        if req.target_path.is_empty() {
            return Err(required("target_path"));
        }
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or_else(|| required("volume_capability"))?;
        let access = caps::check(cap).map_err(invalid)?;
        if req.staging_target_path.is_empty() {
            return Err(required("staging_target_path"));
        }
        let name = req.volume_id.clone();
        let _op = self.op(&name)?;
        if self.pool.volume(&name)?.is_none() {
            return Err(Status::not_found(format!("volume {name} does not exist")));
        }
        let mut s = self.load_state(&name)?.ok_or_else(|| {
            Status::failed_precondition(format!("volume {name} is not staged on this node"))
        })?;
        if s.staging_path != Path::new(&req.staging_target_path) {
            return Err(Status::failed_precondition(format!(
                "volume {name} is staged at {}, not {}",
                s.staging_path.display(),
                req.staging_target_path
            )));
        }
        if s.block != (access == Access::Block) {
            return Err(invalid(format!(
                "volume {name} was staged for {} access",
                if s.block { "block" } else { "mount" }
            )));
        }
        let target = PathBuf::from(&req.target_path);
        let readonly = req.readonly || caps::read_only(cap);
        let make = |r: std::io::Result<()>| {
            r.map_err(|e| Status::internal(format!("cannot make {}: {e}", target.display())))
        };
        if !mount::is_mount_point(&target)? {
            if s.block {
                if let Some(parent) = target.parent() {
                    make(std::fs::create_dir_all(parent))?;
                }
                if !target.exists() {
                    make(std::fs::File::create(&target).map(drop))?;
                }
                mount::bind(Path::new(s.attachment.device()), &target, readonly)?;
            } else {
                make(std::fs::create_dir_all(&target))?;
                mount::bind(&s.staging_path, &target, readonly)?;
            }
        }
        if !s.targets.contains(&target) {
            s.targets.push(target);
            self.save_state(&s)?;
        }
        Ok(())
    }

    fn unpublish(&self, req: proto::NodeUnpublishVolumeRequest) -> Result<(), Status> {
        if req.volume_id.is_empty() {
            return Err(required("volume_id"));
        }
        if req.target_path.is_empty() {
            return Err(required("target_path"));
        }
        let name = req.volume_id;
        let _op = self.op(&name)?;
        let target = PathBuf::from(&req.target_path);
        unmount_and_remove(&target, false)?;
        if let Some(mut s) = self.load_state(&name)? {
            if s.targets.contains(&target) {
                s.targets.retain(|t| *t != target);
                self.save_state(&s)?;
            }
        }
        Ok(())
    }

    fn stats(
        &self,
        req: proto::NodeGetVolumeStatsRequest,
    ) -> Result<proto::NodeGetVolumeStatsResponse, Status> {
        use proto::volume_usage::Unit;
        if req.volume_id.is_empty() {
            return Err(required("volume_id"));
        }
        if req.volume_path.is_empty() {
            return Err(required("volume_path"));
        }
        let v = self
            .pool
            .volume(&req.volume_id)?
            .ok_or_else(|| Status::not_found(format!("volume {} does not exist", req.volume_id)))?;
        let path = Path::new(&req.volume_path);
        let meta = std::fs::metadata(path).map_err(|_| {
            Status::not_found(format!("{} does not exist on this node", req.volume_path))
        })?;
        let usage = if meta.is_dir() {
            if !mount::is_mount_point(path)? {
                return Err(Status::not_found(format!(
                    "volume {} is not mounted at {}",
                    req.volume_id, req.volume_path
                )));
            }
            let (bytes, inodes) = mount::usage(path)?;
            vec![
                proto::VolumeUsage {
                    available: to_i64(bytes[1]),
                    total: to_i64(bytes[0]),
                    used: to_i64(bytes[2]),
                    unit: Unit::Bytes as i32,
                },
                proto::VolumeUsage {
                    available: to_i64(inodes[1]),
                    total: to_i64(inodes[0]),
                    used: to_i64(inodes[2]),
                    unit: Unit::Inodes as i32,
                },
            ]
        } else {
            vec![proto::VolumeUsage {
                available: 0,
                total: to_i64(v.size_bytes),
                used: 0,
                unit: Unit::Bytes as i32,
            }]
        };
        Ok(proto::NodeGetVolumeStatsResponse { usage })
    }

    fn node_expand(
        &self,
        req: proto::NodeExpandVolumeRequest,
    ) -> Result<proto::NodeExpandVolumeResponse, Status> {
        if req.volume_id.is_empty() {
            return Err(required("volume_id"));
        }
        if req.volume_path.is_empty() {
            return Err(required("volume_path"));
        }
        let name = req.volume_id.clone();
        let _op = self.op(&name)?;
        if self.pool.volume(&name)?.is_none() {
            return Err(Status::not_found(format!("volume {name} does not exist")));
        }
        let s = self.load_state(&name)?.ok_or_else(|| {
            Status::failed_precondition(format!("volume {name} is not staged on this node"))
        })?;
        let device = s.attachment.device().to_string();
        let size = mount::device_bytes(&device)?;
        let required = req
            .capacity_range
            .as_ref()
            .map_or(0, |r| r.required_bytes.max(0) as u64);
        if required > size {
            return Err(Status::failed_precondition(format!(
                "volume {name} is attached at {size} bytes, its size when it was staged; a \
                 bulwark volume grows offline: unstage it and stage it again to see {required} bytes"
            )));
        }
        if !s.block {
            mount::grow(&device, &s.staging_path)?;
        }
        Ok(proto::NodeExpandVolumeResponse {
            capacity_bytes: to_i64(size),
        })
    }
}

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Unmounts `target` and removes the file or directory there (the SP made it).
fn unmount_and_remove(target: &Path, lazy: bool) -> Result<(), Status> {
    if lazy {
        let _ = mount::run("umount", &["-l", &target.to_string_lossy()]);
    } else {
        mount::unmount(target)?;
    }
    let r = match std::fs::symlink_metadata(target) {
        Ok(m) if m.is_dir() => std::fs::remove_dir(target),
        Ok(_) => std::fs::remove_file(target),
        Err(_) => Ok(()),
    };
    r.map_err(|e| Status::internal(format!("cannot remove {}: {e}", target.display())))
}

#[tonic::async_trait]
impl node_server::Node for Node {
    async fn node_stage_volume(
        &self,
        request: Request<proto::NodeStageVolumeRequest>,
    ) -> Result<Response<proto::NodeStageVolumeResponse>, Status> {
        let d = self.0.clone();
        let r = request.into_inner();
        blocking(move || d.stage(r)).await?;
        Ok(Response::new(proto::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<proto::NodeUnstageVolumeRequest>,
    ) -> Result<Response<proto::NodeUnstageVolumeResponse>, Status> {
        let d = self.0.clone();
        let r = request.into_inner();
        blocking(move || d.unstage(r)).await?;
        Ok(Response::new(proto::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<proto::NodePublishVolumeRequest>,
    ) -> Result<Response<proto::NodePublishVolumeResponse>, Status> {
        let d = self.0.clone();
        let r = request.into_inner();
        blocking(move || d.publish(r)).await?;
        Ok(Response::new(proto::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<proto::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<proto::NodeUnpublishVolumeResponse>, Status> {
        let d = self.0.clone();
        let r = request.into_inner();
        blocking(move || d.unpublish(r)).await?;
        Ok(Response::new(proto::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<proto::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<proto::NodeGetVolumeStatsResponse>, Status> {
        let d = self.0.clone();
        let r = request.into_inner();
        blocking(move || d.stats(r)).await.map(Response::new)
    }

    async fn node_expand_volume(
        &self,
        request: Request<proto::NodeExpandVolumeRequest>,
    ) -> Result<Response<proto::NodeExpandVolumeResponse>, Status> {
        let d = self.0.clone();
        let r = request.into_inner();
        blocking(move || d.node_expand(r)).await.map(Response::new)
    }

    async fn node_get_capabilities(
        &self,
        _: Request<proto::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<proto::NodeGetCapabilitiesResponse>, Status> {
        let caps = [
            rpc::Type::StageUnstageVolume,
            rpc::Type::GetVolumeStats,
            rpc::Type::ExpandVolume,
        ];
        Ok(Response::new(proto::NodeGetCapabilitiesResponse {
            capabilities: caps
                .iter()
                .map(|t| proto::NodeServiceCapability {
                    r#type: Some(CapType::Rpc(Rpc { r#type: *t as i32 })),
                })
                .collect(),
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<proto::NodeGetInfoRequest>,
    ) -> Result<Response<proto::NodeGetInfoResponse>, Status> {
        Ok(Response::new(proto::NodeGetInfoResponse {
            node_id: self.0.config.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: Some(self.0.topology()),
        }))
    }
}
