//! The Identity service: the driver's name and version, what it can do, and whether
//! the pool's daemon answers (`Probe`).

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::driver::{blocking, Driver, DRIVER_NAME};
use crate::proto::plugin_capability::{service, volume_expansion, Service, Type, VolumeExpansion};
use crate::proto::{self, identity_server};

pub struct Identity(pub Arc<Driver>);

fn service_cap(t: service::Type) -> proto::PluginCapability {
    proto::PluginCapability {
        r#type: Some(Type::Service(Service { r#type: t as i32 })),
    }
}

#[tonic::async_trait]
impl identity_server::Identity for Identity {
    async fn get_plugin_info(
        &self,
        _: Request<proto::GetPluginInfoRequest>,
    ) -> Result<Response<proto::GetPluginInfoResponse>, Status> {
        Ok(Response::new(proto::GetPluginInfoResponse {
            name: DRIVER_NAME.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<proto::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<proto::GetPluginCapabilitiesResponse>, Status> {
        let mut capabilities = vec![service_cap(service::Type::VolumeAccessibilityConstraints)];
        if self.0.config.controller {
            capabilities.push(service_cap(service::Type::ControllerService));
        }
        // Offline: an attached volume keeps the size of its NBD handshake (`attach`).
        capabilities.push(proto::PluginCapability {
            r#type: Some(Type::VolumeExpansion(VolumeExpansion {
                r#type: volume_expansion::Type::Offline as i32,
            })),
        });
        Ok(Response::new(proto::GetPluginCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn probe(
        &self,
        _: Request<proto::ProbeRequest>,
    ) -> Result<Response<proto::ProbeResponse>, Status> {
        let d = self.0.clone();
        blocking(move || {
            d.pool.nbd_socket().map_err(|e| {
                Status::failed_precondition(format!("the pool's daemon does not answer: {e}"))
            })
        })
        .await?;
        Ok(Response::new(proto::ProbeResponse { ready: Some(true) }))
    }
}
