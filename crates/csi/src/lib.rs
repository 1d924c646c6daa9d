//! `bulwark-csi`: the Container Storage Interface driver (Identity, Controller and
//! Node services on one gRPC unix socket), so Kubernetes, KubeVirt and Harvester get
//! bulwark volumes: encrypted per StorageClass with keys from Secrets, snapshots, and
//! clones of a snapshot under their own Secret.
//!
//! The driver holds no data and no table of its own: every volume operation is one
//! or two requests to the pool's daemon ([`pool::Pool`], which the binary implements
//! over the control socket), and a volume's id is its bulwark name (`ids`). The node
//! attaches a volume through NBD (`attach`: the kernel client where loaded, else
//! nbdfuse and a loop device) and keeps what it attached in a state file per volume
//! (`node`), so a restart of the plugin, or of the whole node, finds and redoes it.
//!
//! Modules, bottom-up: `proto`, `pool`, `ids`, `params`, `mount` → `secret`, `attach`,
//! `caps`, `status` → `driver` → `identity`, `controller`, `node` (checked by `crates/bulwark/tests/layers.rs`).
//! Secrets are taken out of each request at the edge (`secret`), live in zeroized
//! buffers, reach the daemon only as 0600 files that are zeroed and removed after,
//! and are never logged: requests are logged by method and volume id, never whole.

pub mod attach;
pub mod caps;
pub mod controller;
pub mod driver;
pub mod identity;
pub mod ids;
pub mod mount;
pub mod node;
pub mod params;
pub mod pool;
pub mod proto;
pub mod secret;
pub mod status;

use std::sync::Arc;

pub use driver::{parse_endpoint, Config, Driver, DRIVER_NAME, TOPOLOGY_KEY};
pub use pool::Pool;

/// Serves the configured services on the endpoint until SIGTERM or SIGINT.
pub async fn serve(driver: Arc<Driver>) -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let path = driver.config.endpoint.clone();
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    // A socket left by an earlier run (kubelet restarts plugins often).
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let listener = tokio::net::UnixListener::bind(&path)?;
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let mut router = tonic::transport::Server::builder().add_service(
        proto::identity_server::IdentityServer::from_arc(Arc::new(identity::Identity(
            driver.clone(),
        ))),
    );
    if driver.config.controller {
        router = router.add_service(proto::controller_server::ControllerServer::from_arc(
            Arc::new(controller::Controller(driver.clone())),
        ));
    }
    if driver.config.node {
        router = router.add_service(proto::node_server::NodeServer::from_arc(Arc::new(
            node::Node(driver.clone()),
        )));
    }
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tracing::info!(
        endpoint = %path.display(),
        node = %driver.config.node_id,
        controller = driver.config.controller,
        node_service = driver.config.node,
        "CSI driver {DRIVER_NAME} serving"
    );
    let result = router
        .serve_with_incoming_shutdown(incoming, async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::info!("signal received: stopping");
        })
        .await;
    let _ = std::fs::remove_file(&path);
    result.map_err(std::io::Error::other)
}
