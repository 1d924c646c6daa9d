//! The Controller service: volumes and snapshots in the pool.
//!
//! Each call is validated here, at the edge, then becomes one or a few daemon requests.
//! Where the spec leaves the choice open this follows csi-driver-host-path and Ceph
//! CSI (docs/kubernetes.md lists each case):
//! - A volume is created encrypted unless the StorageClass says `encryption: off`; its
//!   key is unloaded again once it exists (keys follow `NodeStageVolume`).
//! - A volume from a snapshot is a bulwark clone under the new volume's own secret. The
//!   origin's key must be loaded to clone it: if it is not, the controller loads it
//!   with the secret's `originPassphrase`/`originKey`, or else its own
//!   `passphrase`/`key` (a StorageClass-wide Secret opens both), and unloads it after.
//! - A volume from a volume goes through an implicit snapshot of the source.
//! - A clone starts at its snapshot's size and is grown to a larger request; a limit
//!   below the snapshot's size is OUT_OF_RANGE. Any volume expands, with snapshots, as
//!   a clone or as an origin of clones (snapshots keep their size). Snapshots depend on
//!   their volume: `DeleteVolume` of a volume with snapshots is FAILED_PRECONDITION (the
//!   spec's "has snapshots and the plugin doesn't treat them as independent entities"),
//!   as is `DeleteSnapshot` of a snapshot with clones.
//! - Pagination tokens are offsets into the list sorted by id (as csi-driver-host-path).

use std::collections::HashMap;
use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::caps::{self, Access};
use crate::driver::{blocking, Driver, DEFAULT_VOLUME_BYTES};
use crate::ids;
use crate::params::Params;
use crate::pool::{ErrorKind, NewVolume, SnapshotInfo, VolumeInfo};
use crate::proto::controller_service_capability::{rpc, Rpc, Type as CapType};
use crate::proto::volume_content_source::{SnapshotSource, Type as SourceType, VolumeSource};
use crate::proto::{self, controller_server};
use crate::secret::{Secret, SecretFile, Secrets};
use crate::status::{invalid, required};

pub struct Controller(pub Arc<Driver>);

const CAPABILITIES: &[rpc::Type] = &[
    rpc::Type::CreateDeleteVolume,
    rpc::Type::CreateDeleteSnapshot,
    rpc::Type::ListSnapshots,
    rpc::Type::ListVolumes,
    rpc::Type::CloneVolume,
    rpc::Type::ExpandVolume,
    rpc::Type::GetCapacity,
];

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn round_up(n: u64, to: u64) -> u64 {
    n.div_ceil(to).saturating_mul(to)
}

/// The size to create from a capacity range, in whole blocks: the required bytes
/// rounded up, or the default (at most the limit) when none is required.
fn size_for(range: Option<&proto::CapacityRange>, block: u64) -> Result<u64, Status> {
    let (required, limit) = range.map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
    if required < 0 || limit < 0 {
        return Err(Status::out_of_range("capacity bytes cannot be negative"));
    }
    let (required, limit) = (required as u64, limit as u64);
    let size = if required == 0 {
        let d = DEFAULT_VOLUME_BYTES;
        if limit > 0 && limit < d {
            limit / block * block
        } else {
            d
        }
    } else {
        round_up(required, block)
    };
    if size == 0 || (limit > 0 && size > limit) {
        return Err(Status::out_of_range(format!(
            "no size in whole {block}-byte blocks fits required {required} and limit {limit} bytes"
        )));
    }
    Ok(size)
}

/// Whether an existing size meets a capacity range.
fn fits(size: u64, range: Option<&proto::CapacityRange>) -> bool {
    let Some(r) = range else { return true };
    size >= r.required_bytes.max(0) as u64 && (r.limit_bytes <= 0 || size <= r.limit_bytes as u64)
}

/// `(start, next_token)` of a page, from a request's token and `max_entries`.
fn page(len: usize, token: &str, max_entries: i32) -> Result<(usize, usize), Status> {
    if max_entries < 0 {
        return Err(invalid("max_entries cannot be negative"));
    }
    let start = if token.is_empty() {
        0
    } else {
        token
            .parse::<usize>()
            .ok()
            .filter(|&s| s <= len)
            .ok_or_else(|| Status::aborted(format!("starting_token '{token}' is not valid")))?
    };
    let end = if max_entries == 0 {
        len
    } else {
        (start + max_entries as usize).min(len)
    };
    Ok((start, end))
}

fn timestamp(secs: u64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: to_i64(secs),
        nanos: 0,
    }
}

impl Driver {
    fn volume_message(
        &self,
        v: &VolumeInfo,
        source: Option<proto::VolumeContentSource>,
    ) -> proto::Volume {
        proto::Volume {
            capacity_bytes: to_i64(v.size_bytes),
            volume_id: v.name.clone(),
            volume_context: HashMap::new(),
            content_source: source,
            accessible_topology: vec![self.topology()],
        }
    }

    fn snapshot_message(&self, s: &SnapshotInfo, volumes: &[VolumeInfo]) -> proto::Snapshot {
        let size = volumes
            .iter()
            .find(|v| v.name == s.volume)
            .map_or(0, |v| v.size_bytes);
        proto::Snapshot {
            size_bytes: to_i64(size),
            snapshot_id: ids::snapshot_id(&s.volume, &s.snapshot),
            source_volume_id: s.volume.clone(),
            creation_time: Some(timestamp(s.created_secs)),
            ready_to_use: true,
            group_snapshot_id: String::new(),
            accessible_topology: vec![self.topology()],
        }
    }

    /// Unloads a key we loaded; a failure is only logged (the key stays loaded, which
    /// `key unload` ends).
    fn unload_quietly(&self, name: &str) {
        if let Err(e) = self.pool.key_unload(name) {
            if e.kind != ErrorKind::Invalid {
                tracing::warn!(volume = name, "cannot unload the key: {e}");
            }
        }
    }

    fn secret_file(&self, s: &Secret) -> Result<SecretFile, Status> {
        SecretFile::write(&self.config.secrets_dir, s).map_err(|e| {
            Status::internal(format!(
                "cannot write a secret file under {}: {e}",
                self.config.secrets_dir.display()
            ))
        })
    }

    fn create_volume(
        &self,
        mut req: proto::CreateVolumeRequest,
    ) -> Result<proto::CreateVolumeResponse, Status> {
        if req.name.is_empty() {
            return Err(required("name"));
        }
        if req.volume_capabilities.is_empty() {
            return Err(required("volume_capabilities"));
        }
        for c in &req.volume_capabilities {
            caps::check(c).map_err(invalid)?;
        }
        let params = Params::parse(&req.parameters).map_err(invalid)?;
        let secrets = Secrets::take(&mut req.secrets).map_err(invalid)?;
        if let Some(t) = &req.accessibility_requirements {
            let ours = self.topology();
            if !t.requisite.is_empty() && !t.requisite.contains(&ours) {
                return Err(Status::resource_exhausted(format!(
                    "this pool is on node {} only, which the requisite topology leaves out",
                    self.config.node_id
                )));
            }
        }
        let name = ids::bulwark_name(&req.name);
        let _op = self.op(&name)?;
        let range = req.capacity_range.as_ref();
        let source = req.volume_content_source.clone();
        // The origin a clone is made from, as (volume, snapshot).
        let origin = match source.as_ref().and_then(|s| s.r#type.as_ref()) {
            None => None,
            Some(SourceType::Snapshot(SnapshotSource { snapshot_id })) => {
                let (v, s) = ids::parse_snapshot_id(snapshot_id).ok_or_else(|| {
                    Status::not_found(format!("snapshot {snapshot_id} does not exist"))
                })?;
                Some((v.to_string(), s.to_string()))
            }
            Some(SourceType::Volume(VolumeSource { volume_id })) => {
                Some((volume_id.clone(), ids::clone_snapshot(&name)))
            }
        };

        if let Some(v) = self.pool.volume(&name)? {
            let same_origin = v.origin == origin.as_ref().map(|(v, s)| ids::snapshot_id(v, s));
            if !fits(v.size_bytes, range) || !same_origin || v.encryption != params.encryption {
                return Err(Status::already_exists(format!(
                    "volume {} exists with another size, source or encryption",
                    req.name
                )));
            }
            return Ok(proto::CreateVolumeResponse {
                volume: Some(self.volume_message(&v, source)),
            });
        }

        let Some((from, snapshot)) = origin else {
            let size = size_for(range, params.block_size as u64)?;
            let spec = NewVolume {
                name: name.clone(),
                size_bytes: size,
                block_size: params.block_size,
                compression: params.compression.clone(),
                encryption: params.encryption,
                thick: params.thick,
            };
            let own = match (&secrets.own, params.encryption) {
                (Some(s), true) => Some(self.secret_file(s)?),
                (None, true) => {
                    return Err(invalid(
                        "encryption is on (the default) and the request has no secret: name a \
                         Secret with 'passphrase' or 'key' in the StorageClass \
                         (csi.storage.k8s.io/provisioner-secret-name), or set encryption: off",
                    ))
                }
                (_, false) => None,
            };
            self.pool
                .create_volume(&spec, own.as_ref().map(SecretFile::as_ref))?;
            if params.encryption {
                self.unload_quietly(&name);
            }
            let v = self
                .pool
                .volume(&name)?
                .ok_or_else(|| Status::internal(format!("volume {name} vanished after create")))?;
            tracing::info!(volume = %name, size, encryption = params.encryption, "volume created");
            return Ok(proto::CreateVolumeResponse {
                volume: Some(self.volume_message(&v, None)),
            });
        };

        // A clone.
        let from_volume = self.pool.volume(&from)?.ok_or_else(|| {
            Status::not_found(match &source.as_ref().and_then(|s| s.r#type.clone()) {
                Some(SourceType::Volume(_)) => format!("source volume {from} does not exist"),
                _ => format!("snapshot {from}@{snapshot} does not exist"),
            })
        })?;
        let is_implicit = ids::is_clone_snapshot(&snapshot);
        let exists = self
            .pool
            .snapshots()?
            .iter()
            .any(|s| s.volume == from && s.snapshot == snapshot);
        if !exists && !is_implicit {
            return Err(Status::not_found(format!(
                "snapshot {from}@{snapshot} does not exist"
            )));
        }
        if from_volume.encryption != params.encryption {
            return Err(invalid(format!(
                "a clone keeps the encryption of its origin {from} ({}), and the parameters ask \
                 for encryption {}",
                if from_volume.encryption { "on" } else { "off" },
                if params.encryption { "on" } else { "off" }
            )));
        }
        // A clone starts at its snapshot's size and is grown to the request (bulwark grows
        // any volume, a clone too); it never shrinks below what its snapshot holds.
        let wanted = size_for(range, from_volume.block_size as u64)?;
        let own = match (&secrets.own, from_volume.encryption) {
            (Some(s), true) => Some(self.secret_file(s)?),
            (None, true) => {
                return Err(invalid(format!(
                    "{from} is encrypted, so its clone needs a secret of its own ('passphrase' \
                     or 'key' in the provisioner secret)"
                )))
            }
            (_, false) => None,
        };
        // The origin's key, loaded here if it is not yet.
        let mut loaded_here = false;
        if from_volume.encryption && from_volume.locked {
            let origin_file = match &secrets.origin {
                Some(s) => Some(self.secret_file(s)?),
                None => None,
            };
            let try_with = origin_file
                .as_ref()
                .or(own.as_ref())
                .expect("checked above");
            match self.pool.key_load(&from, try_with.as_ref()) {
                Ok(()) => loaded_here = true,
                Err(e) if e.kind == ErrorKind::WrongKey => {
                    return Err(Status::failed_precondition(format!(
                        "the key of {from}, the origin of the clone, is not loaded, and {} does \
                         not open it: put its secret in the provisioner secret as \
                         'originPassphrase' or 'originKey', or load it ('bulwark key load {from}')",
                        if origin_file.is_some() {
                            "the secret's originPassphrase/originKey"
                        } else {
                            "the new volume's own secret"
                        }
                    )))
                }
                Err(e) => return Err(e.into()),
            }
        }
        let result = (|| -> Result<(), Status> {
            if is_implicit && !exists {
                self.pool.create_snapshot(&from, &snapshot)?;
            }
            self.pool.clone_snapshot(
                &from,
                &snapshot,
                &name,
                own.as_ref().map(SecretFile::as_ref),
            )?;
            self.size_clone(&name, &format!("{from}@{snapshot}"), wanted, range)
        })();
        if loaded_here {
            self.unload_quietly(&from);
        }
        if let Err(e) = result {
            if is_implicit && !exists {
                let _ = self.pool.destroy_snapshot(&from, &snapshot);
            }
            return Err(e);
        }
        if from_volume.encryption {
            self.unload_quietly(&name);
        }
        let v = self
            .pool
            .volume(&name)?
            .ok_or_else(|| Status::internal(format!("volume {name} vanished after clone")))?;
        tracing::info!(volume = %name, origin = %format!("{from}@{snapshot}"), "volume cloned");
        Ok(proto::CreateVolumeResponse {
            volume: Some(self.volume_message(&v, source)),
        })
    }

    /// A clone just made from `origin` grown to `wanted` bytes (it starts at its
    /// snapshot's size), or destroyed again when its snapshot is larger than the request's
    /// limit (a clone is never smaller than its snapshot).
    fn size_clone(
        &self,
        name: &str,
        origin: &str,
        wanted: u64,
        range: Option<&proto::CapacityRange>,
    ) -> Result<(), Status> {
        let made = self.pool.volume(name)?.map(|v| v.size_bytes).unwrap_or(0);
        let sized = if !fits(made.max(wanted), range) {
            Err(Status::out_of_range(format!(
                "the snapshot {origin} is {made} bytes, more than the request's limit: a \
                 clone is never smaller than its snapshot"
            )))
        } else if wanted > made {
            self.pool.resize_volume(name, wanted).map_err(Status::from)
        } else {
            Ok(())
        };
        if sized.is_err() {
            let _ = self.pool.destroy_volume(name, false);
        }
        sized
    }

    fn delete_volume(&self, req: proto::DeleteVolumeRequest) -> Result<(), Status> {
        if req.volume_id.is_empty() {
            return Err(required("volume_id"));
        }
        let name = req.volume_id;
        let _op = self.op(&name)?;
        let Some(v) = self.pool.volume(&name)? else {
            return Ok(());
        };
        let snaps: Vec<SnapshotInfo> = self
            .pool
            .snapshots()?
            .into_iter()
            .filter(|s| s.volume == name)
            .collect();
        let user: Vec<String> = snaps
            .iter()
            .filter(|s| !ids::is_clone_snapshot(&s.snapshot))
            .map(|s| ids::snapshot_id(&s.volume, &s.snapshot))
            .collect();
        if !user.is_empty() {
            return Err(Status::failed_precondition(format!(
                "volume {name} has snapshots ({}): delete them first (bulwark snapshots \
                 belong to their volume)",
                user.join(", ")
            )));
        }
        // Implicit snapshots of clones are kept by the pool until their clones go.
        self.pool.destroy_volume(&name, !snaps.is_empty())?;
        if let Some((ov, os)) = v.origin.as_deref().and_then(ids::parse_snapshot_id) {
            if ids::is_clone_snapshot(os) {
                if let Err(e) = self.pool.destroy_snapshot(ov, os) {
                    if e.kind != ErrorKind::NotFound {
                        tracing::warn!(snapshot = %format!("{ov}@{os}"), "cannot destroy the clone's snapshot: {e}");
                    }
                }
            }
        }
        tracing::info!(volume = %name, "volume deleted");
        Ok(())
    }

    fn validate(
        &self,
        req: proto::ValidateVolumeCapabilitiesRequest,
    ) -> Result<proto::ValidateVolumeCapabilitiesResponse, Status> {
        if req.volume_id.is_empty() {
            return Err(required("volume_id"));
        }
        if req.volume_capabilities.is_empty() {
            return Err(required("volume_capabilities"));
        }
        if self.pool.volume(&req.volume_id)?.is_none() {
            return Err(Status::not_found(format!(
                "volume {} does not exist",
                req.volume_id
            )));
        }
        if let Err(why) = Params::parse(&req.parameters) {
            return Ok(proto::ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: why,
            });
        }
        for c in &req.volume_capabilities {
            if let Err(why) = caps::check(c) {
                return Ok(proto::ValidateVolumeCapabilitiesResponse {
                    confirmed: None,
                    message: why,
                });
            }
        }
        Ok(proto::ValidateVolumeCapabilitiesResponse {
            confirmed: Some(proto::validate_volume_capabilities_response::Confirmed {
                volume_context: req.volume_context,
                volume_capabilities: req.volume_capabilities,
                parameters: req.parameters,
                mutable_parameters: HashMap::new(),
            }),
            message: String::new(),
        })
    }

    fn list_volumes(
        &self,
        req: proto::ListVolumesRequest,
    ) -> Result<proto::ListVolumesResponse, Status> {
        let mut volumes = self.pool.volumes()?;
        volumes.sort_by(|a, b| a.name.cmp(&b.name));
        let (start, end) = page(volumes.len(), &req.starting_token, req.max_entries)?;
        Ok(proto::ListVolumesResponse {
            entries: volumes[start..end]
                .iter()
                .map(|v| proto::list_volumes_response::Entry {
                    volume: Some(self.volume_message(v, None)),
                    status: None,
                })
                .collect(),
            next_token: if end < volumes.len() {
                end.to_string()
            } else {
                String::new()
            },
        })
    }

    fn controller_expand(
        &self,
        req: proto::ControllerExpandVolumeRequest,
    ) -> Result<proto::ControllerExpandVolumeResponse, Status> {
        if req.volume_id.is_empty() {
            return Err(required("volume_id"));
        }
        let range = req
            .capacity_range
            .as_ref()
            .ok_or_else(|| required("capacity_range"))?;
        let _op = self.op(&req.volume_id)?;
        let v = self
            .pool
            .volume(&req.volume_id)?
            .ok_or_else(|| Status::not_found(format!("volume {} does not exist", req.volume_id)))?;
        let want = size_for(Some(range), v.block_size as u64)?;
        let node_expansion_required = !matches!(
            req.volume_capability.as_ref().map(caps::check),
            Some(Ok(Access::Block))
        );
        if want > v.size_bytes {
            self.pool.resize_volume(&v.name, want)?;
            tracing::info!(volume = %v.name, from = v.size_bytes, to = want, "volume expanded");
        }
        Ok(proto::ControllerExpandVolumeResponse {
            capacity_bytes: to_i64(want.max(v.size_bytes)),
            node_expansion_required,
        })
    }

    fn create_snapshot(
        &self,
        req: proto::CreateSnapshotRequest,
    ) -> Result<proto::CreateSnapshotResponse, Status> {
        if req.name.is_empty() {
            return Err(required("name"));
        }
        if req.source_volume_id.is_empty() {
            return Err(required("source_volume_id"));
        }
        let name = ids::bulwark_name(&req.name);
        let _op = self.op(&format!("@{name}"))?;
        let volumes = self.pool.volumes()?;
        let Some(volume) = volumes.iter().find(|v| v.name == req.source_volume_id) else {
            return Err(Status::not_found(format!(
                "source volume {} does not exist",
                req.source_volume_id
            )));
        };
        let snaps = self.pool.snapshots()?;
        if let Some(s) = snaps.iter().find(|s| s.snapshot == name) {
            if s.volume != volume.name {
                return Err(Status::already_exists(format!(
                    "snapshot {} exists, of volume {}",
                    req.name, s.volume
                )));
            }
            return Ok(proto::CreateSnapshotResponse {
                snapshot: Some(self.snapshot_message(s, &volumes)),
            });
        }
        self.pool.create_snapshot(&volume.name, &name)?;
        let s = self
            .pool
            .snapshots()?
            .into_iter()
            .find(|s| s.volume == volume.name && s.snapshot == name)
            .ok_or_else(|| Status::internal(format!("snapshot {name} vanished after create")))?;
        tracing::info!(snapshot = %ids::snapshot_id(&s.volume, &s.snapshot), "snapshot created");
        Ok(proto::CreateSnapshotResponse {
            snapshot: Some(self.snapshot_message(&s, &volumes)),
        })
    }

    fn delete_snapshot(&self, req: proto::DeleteSnapshotRequest) -> Result<(), Status> {
        if req.snapshot_id.is_empty() {
            return Err(required("snapshot_id"));
        }
        let Some((v, s)) = ids::parse_snapshot_id(&req.snapshot_id) else {
            return Ok(());
        };
        let _op = self.op(&format!("@{s}"))?;
        match self.pool.destroy_snapshot(v, s) {
            Ok(()) => {
                tracing::info!(snapshot = %req.snapshot_id, "snapshot deleted");
                Ok(())
            }
            Err(e) if e.kind == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    fn list_snapshots(
        &self,
        req: proto::ListSnapshotsRequest,
    ) -> Result<proto::ListSnapshotsResponse, Status> {
        let volumes = self.pool.volumes()?;
        let mut snaps: Vec<SnapshotInfo> = self
            .pool
            .snapshots()?
            .into_iter()
            .filter(|s| !ids::is_clone_snapshot(&s.snapshot))
            .filter(|s| {
                req.snapshot_id.is_empty()
                    || ids::snapshot_id(&s.volume, &s.snapshot) == req.snapshot_id
            })
            .filter(|s| req.source_volume_id.is_empty() || s.volume == req.source_volume_id)
            .collect();
        snaps.sort_by(|a, b| (&a.volume, &a.snapshot).cmp(&(&b.volume, &b.snapshot)));
        let (start, end) = page(snaps.len(), &req.starting_token, req.max_entries)?;
        Ok(proto::ListSnapshotsResponse {
            entries: snaps[start..end]
                .iter()
                .map(|s| proto::list_snapshots_response::Entry {
                    snapshot: Some(self.snapshot_message(s, &volumes)),
                })
                .collect(),
            next_token: if end < snaps.len() {
                end.to_string()
            } else {
                String::new()
            },
        })
    }

    fn capacity(
        &self,
        req: proto::GetCapacityRequest,
    ) -> Result<proto::GetCapacityResponse, Status> {
        let none = proto::GetCapacityResponse {
            available_capacity: 0,
            maximum_volume_size: None,
            minimum_volume_size: None,
        };
        if req
            .volume_capabilities
            .iter()
            .any(|c| caps::check(c).is_err())
            || Params::parse(&req.parameters).is_err()
        {
            return Ok(none);
        }
        if let Some(t) = &req.accessible_topology {
            if *t != self.topology() {
                return Ok(none);
            }
        }
        Ok(proto::GetCapacityResponse {
            available_capacity: to_i64(self.pool.free_bytes()?),
            maximum_volume_size: None,
            minimum_volume_size: Some(4096),
        })
    }
}

#[tonic::async_trait]
impl controller_server::Controller for Controller {
    async fn create_volume(
        &self,
        request: Request<proto::CreateVolumeRequest>,
    ) -> Result<Response<proto::CreateVolumeResponse>, Status> {
        let d = self.0.clone();
        let r = request.into_inner();
        blocking(move || d.create_volume(r))
            .await
            .map(Response::new)
    }

    async fn delete_volume(
        &self,
        request: Request<proto::DeleteVolumeRequest>,
    ) -> Result<Response<proto::DeleteVolumeResponse>, Status> {
        let d = self.0.clone();
        let r = request.into_inner();
        blocking(move || d.delete_volume(r)).await?;
        Ok(Response::new(proto::DeleteVolumeResponse {}))
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<proto::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<proto::ValidateVolumeCapabilitiesResponse>, Status> {
        let d = self.0.clone();
        let r = request.into_inner();
        blocking(move || d.validate(r)).await.map(Response::new)
    }

    async fn list_volumes(
        &self,
        request: Request<proto::ListVolumesRequest>,
    ) -> Result<Response<proto::ListVolumesResponse>, Status> {
        let d = self.0.clone();
        let r = request.into_inner();
        blocking(move || d.list_volumes(r)).await.map(Response::new)
    }

    async fn get_capacity(
        &self,
        request: Request<proto::GetCapacityRequest>,
    ) -> Result<Response<proto::GetCapacityResponse>, Status> {
        let d = self.0.clone();
        let r = request.into_inner();
        blocking(move || d.capacity(r)).await.map(Response::new)
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<proto::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<proto::ControllerGetCapabilitiesResponse>, Status> {
        Ok(Response::new(proto::ControllerGetCapabilitiesResponse {
            capabilities: CAPABILITIES
                .iter()
                .map(|t| proto::ControllerServiceCapability {
                    r#type: Some(CapType::Rpc(Rpc { r#type: *t as i32 })),
                })
                .collect(),
        }))
    }

    async fn create_snapshot(
        &self,
        request: Request<proto::CreateSnapshotRequest>,
    ) -> Result<Response<proto::CreateSnapshotResponse>, Status> {
        let d = self.0.clone();
        let r = request.into_inner();
        blocking(move || d.create_snapshot(r))
            .await
            .map(Response::new)
    }

    async fn delete_snapshot(
        &self,
        request: Request<proto::DeleteSnapshotRequest>,
    ) -> Result<Response<proto::DeleteSnapshotResponse>, Status> {
        let d = self.0.clone();
        let r = request.into_inner();
        blocking(move || d.delete_snapshot(r)).await?;
        Ok(Response::new(proto::DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        request: Request<proto::ListSnapshotsRequest>,
    ) -> Result<Response<proto::ListSnapshotsResponse>, Status> {
        let d = self.0.clone();
        let r = request.into_inner();
        blocking(move || d.list_snapshots(r))
            .await
            .map(Response::new)
    }

    async fn controller_expand_volume(
        &self,
        request: Request<proto::ControllerExpandVolumeRequest>,
    ) -> Result<Response<proto::ControllerExpandVolumeResponse>, Status> {
        let d = self.0.clone();
        let r = request.into_inner();
        blocking(move || d.controller_expand(r))
            .await
            .map(Response::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(required: i64, limit: i64) -> proto::CapacityRange {
        proto::CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        }
    }

    #[test]
    fn sizes_round_up_to_blocks_within_limits() {
        assert_eq!(size_for(None, 4096).unwrap(), DEFAULT_VOLUME_BYTES);
        assert_eq!(size_for(Some(&range(1, 0)), 4096).unwrap(), 4096);
        assert_eq!(size_for(Some(&range(0, 8192)), 4096).unwrap(), 8192);
        assert!(size_for(Some(&range(5000, 6000)), 4096).is_err());
        assert!(size_for(Some(&range(-1, 0)), 4096).is_err());
        assert!(fits(8192, Some(&range(5000, 0))));
        assert!(!fits(8192, Some(&range(10000, 0))));
        assert!(!fits(8192, Some(&range(0, 4096))));
    }

    #[test]
    fn pages() {
        assert_eq!(page(5, "", 0).unwrap(), (0, 5));
        assert_eq!(page(5, "", 2).unwrap(), (0, 2));
        assert_eq!(page(5, "4", 2).unwrap(), (4, 5));
        assert_eq!(page(5, "5", 2).unwrap(), (5, 5));
        assert_eq!(page(5, "6", 2).unwrap_err().code(), tonic::Code::Aborted);
        assert_eq!(page(5, "x", 2).unwrap_err().code(), tonic::Code::Aborted);
        assert!(page(5, "", -1).is_err());
    }
}
