//! What every service shares: the configuration, the pool, the per-volume operation
//! locks, and the way blocking work leaves the async threads.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tonic::Status;

use crate::pool::Pool;
use crate::proto;

/// The driver's name, as the CSIDriver object and StorageClasses name it.
pub const DRIVER_NAME: &str = "csi.bulwark.io";
/// The topology key: a volume is accessible on the node whose pool holds it.
pub const TOPOLOGY_KEY: &str = "topology.csi.bulwark.io/node";
/// Size of a volume when `CreateVolume` gives no capacity (as csi-driver-host-path).
pub const DEFAULT_VOLUME_BYTES: u64 = 1 << 30;

/// What `bulwark csi` was started with.
#[derive(Debug, Clone)]
pub struct Config {
    /// The unix socket to serve on (`--endpoint unix:///PATH`).
    pub endpoint: PathBuf,
    /// This node's name (`--node-id`), the value of [`TOPOLOGY_KEY`].
    pub node_id: String,
    /// Serve the Controller service.
    pub controller: bool,
    /// Serve the Node service.
    pub node: bool,
    /// Where the node keeps its state files and nbdfuse mounts.
    pub state_dir: PathBuf,
    /// Where secret files are written for the daemon (a tmpfs is best).
    pub secrets_dir: PathBuf,
}

/// `unix:///PATH` (or `unix://PATH`, `unix:PATH`) as the socket's path.
pub fn parse_endpoint(endpoint: &str) -> Result<PathBuf, String> {
    let path = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .ok_or_else(|| {
            format!("endpoint '{endpoint}': bulwark csi serves on a unix socket, unix:///PATH")
        })?;
    if !path.starts_with('/') {
        return Err(format!(
            "endpoint '{endpoint}': the socket path must be absolute (unix:///PATH)"
        ));
    }
    Ok(PathBuf::from(path))
}

/// What every service shares: the pool, the configuration, and the volumes with an
/// operation under way.
pub struct Driver {
    pub pool: Arc<dyn Pool>,
    pub config: Config,
    busy: Mutex<HashSet<String>>,
}

/// A volume's operation; its drop lets the next one in.
pub struct OpGuard<'a> {
    driver: &'a Driver,
    key: String,
}

impl Drop for OpGuard<'_> {
    fn drop(&mut self) {
        self.driver
            .busy
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.key);
    }
}

impl Driver {
    pub fn new(pool: Arc<dyn Pool>, config: Config) -> Arc<Driver> {
        Arc::new(Driver {
            pool,
            config,
            busy: Mutex::new(HashSet::new()),
        })
    }

    /// One operation per volume (or snapshot name) at a time; a second gets ABORTED, as
    /// the spec asks, and the CO retries it.
    pub fn op(&self, key: &str) -> Result<OpGuard<'_>, Status> {
        let mut busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        if !busy.insert(key.to_string()) {
            return Err(Status::aborted(format!(
                "an operation on '{key}' is already in progress"
            )));
        }
        Ok(OpGuard {
            driver: self,
            key: key.to_string(),
        })
    }

    /// This node's topology segment.
    pub fn topology(&self) -> proto::Topology {
        proto::Topology {
            segments: [(TOPOLOGY_KEY.to_string(), self.config.node_id.clone())].into(),
        }
    }
}

/// Runs blocking work (daemon requests, mounts) off the async threads.
pub(crate) async fn blocking<T, F>(f: F) -> Result<T, Status>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, Status> + Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("the request's worker failed: {e}")))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            parse_endpoint("unix:///csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert_eq!(
            parse_endpoint("unix:/csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert!(parse_endpoint("tcp://127.0.0.1:10000").is_err());
        assert!(parse_endpoint("unix://relative.sock").is_err());
    }
}
