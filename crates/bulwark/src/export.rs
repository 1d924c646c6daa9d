//! The glue between the engine and the NBD server: a volume as an NBD backend,
//! the pool as the set of exports, grants as who may open what.
//!
//! Only unlocked volumes are exported. The Unix socket's client (the owner)
//! opens any of them; a TLS or plaintext-TCP client opens and lists only
//! the volumes granted to one of its names, read-only grants as read-only
//! exports. A locked, unknown or forbidden name opens nothing, and all look
//! the same to a client: every open resolves the volume and looks up the
//! grant, whatever the outcome, and the server answers every failure alike
//! (same reply, same audit write, same back-off). Engine errors become errnos here
//! (`Error::errno`), and the ones that mean data or devices are in trouble are
//! logged with the volume and range, since the client only sees EIO. A grant
//! change closes the connections it no longer allows (`close_ungranted`,
//! through `nbd::Server::revoke`).
//!
//! With metrics on (`serve --metrics-listen`), requests are counted here, where
//! they enter the engine: each backend holds its export's `VolumeStats`, taken
//! at open, and a request adds to atomics only. Connection events are counted
//! in `PoolExports::event`, beside their audit record.

use std::sync::Arc;
use std::time::Instant;

use bulwark_engine::{Pool, Volume};

use serde_json::json;

use crate::access::{Access, AccessControl, Record};
use crate::metrics::{Metrics, Op, VolumeStats};
use bulwark_nbd::{Backend, Client, Errno, Event, Exports, Extent, Identity, Server};

pub struct VolumeBackend {
    volume: Arc<Volume>,
    read_only: bool,
    /// This export's counters, with metrics on.
    stats: Option<Arc<VolumeStats>>,
}

impl VolumeBackend {
    /// Runs one request on the volume, counted (and timed) when metrics are on.
    fn counted<T>(
        &self,
        op: Op,
        bytes: u64,
        run: impl FnOnce() -> Result<T, bulwark_engine::Error>,
    ) -> Result<T, bulwark_engine::Error> {
        let Some(stats) = &self.stats else {
            return run();
        };
        let started = Instant::now();
        let result = run();
        stats.record(op, bytes, started.elapsed(), result.is_ok());
        result
    }

    fn fail(&self, what: &str, offset: u64, length: u64, e: bulwark_engine::Error) -> Errno {
        let errno = e.errno();
        if errno == libc::EIO || errno == libc::ENOSPC {
            tracing::warn!(
                volume = self.volume.name(),
                offset,
                length,
                "{what} failed: {e}"
            );
        } else {
            tracing::debug!(
                volume = self.volume.name(),
                offset,
                length,
                "{what} refused: {e}"
            );
        }
        errno
    }
}

impl Backend for VolumeBackend {
    fn size(&self) -> u64 {
        self.volume.size()
    }

    fn preferred_block_size(&self) -> u32 {
        self.volume.block_size()
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno> {
        let length = buf.len() as u64;
        self.counted(Op::Read, length, || self.volume.read(offset, buf))
            .map_err(|e| self.fail("read", offset, length, e))
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), Errno> {
        let length = data.len() as u64;
        self.counted(Op::Write, length, || self.volume.write(offset, data, fua))
            .map_err(|e| self.fail("write", offset, length, e))
    }

    fn flush(&self) -> Result<(), Errno> {
        self.counted(Op::Flush, 0, || self.volume.flush())
            .map_err(|e| self.fail("flush", 0, 0, e))
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<(), Errno> {
        // A FUA trim's flush is part of the trim, not a flush request of its own.
        self.counted(Op::Trim, length, || {
            self.volume.trim(offset, length)?;
            if fua {
                self.volume.flush()?;
            }
            Ok(())
        })
        .map_err(|e| self.fail("trim", offset, length, e))
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        _may_trim: bool,
    ) -> Result<(), Errno> {
        // The engine frees whole zeroed blocks whether or not the client allows
        // it: a freed block reads as zeros, which is all NBD promises either way.
        self.counted(Op::WriteZeroes, length, || {
            self.volume.write_zeroes(offset, length, fua)
        })
        .map_err(|e| self.fail("write zeroes", offset, length, e))
    }

    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, Errno> {
        let extents = self
            .counted(Op::BlockStatus, length, || {
                self.volume.block_status(offset, length)
            })
            .map_err(|e| self.fail("block status", offset, length, e))?;
        Ok(extents
            .into_iter()
            .map(|x| Extent {
                length: x.length,
                hole: x.hole,
                zero: x.hole,
            })
            .collect())
    }
}

/// Every unlocked volume of the pool, by name, as each client may see it.
pub struct PoolExports {
    pub pool: Arc<Pool>,
    pub access: Arc<AccessControl>,
    /// Counters, with `serve --metrics-listen`.
    pub metrics: Option<Arc<Metrics>>,
}

impl PoolExports {
    /// The access `client` has to `name`; `None` for none.
    fn access(&self, client: &Client, name: &str) -> Option<Access> {
        access_of(&self.access, client, name)
    }
}

/// The volume an export name belongs to: `VOL` for `VOL` and for its snapshot `VOL@SNAP`.
pub fn volume_of(export: &str) -> &str {
    export.split_once('@').map_or(export, |(v, _)| v)
}

/// The access the grants give `client` to volume `name` (the Unix socket's
/// owner may open anything); `None` for none.
pub fn access_of(access: &AccessControl, client: &Client, name: &str) -> Option<Access> {
    match client.identity {
        Identity::Owner => Some(Access::ReadWrite),
        _ => access.grants.access(&client.identity.names(), name),
    }
}

/// Closes the NBD connections the grants no longer allow: those whose
/// client has lost every grant to their volume, and read-write ones whose
/// client may now only read. Returns their ids (`Server::wait_detached`).
pub fn close_ungranted(server: &Server, access: &AccessControl) -> Vec<u64> {
    server.revoke(
        |volume, client, read_only| match access_of(access, client, volume_of(volume)) {
            None => false,
            Some(Access::ReadOnly) => read_only,
            Some(Access::ReadWrite) => true,
        },
    )
}

impl Exports for PoolExports {
    fn list(&self, client: &Client) -> Vec<String> {
        let exportable = self.pool.exportable();
        match client.identity {
            Identity::Owner => exportable,
            _ => {
                let granted = self.access.grants.volumes(&client.identity.names());
                exportable
                    .into_iter()
                    .filter(|v| granted.iter().any(|g| g == volume_of(v)))
                    .collect()
            }
        }
    }

    fn open(&self, name: &str, client: &Client) -> Option<Arc<dyn Backend>> {
        // Resolve first and decide after, so that unknown and forbidden
        // names cost the same. A snapshot (`VOL@SNAP`) is open to whoever may
        // open its volume, and always read-only.
        let volume = self.pool.volume(name).ok();
        let access = self.access(client, volume_of(name));
        match (volume, access) {
            (Some(volume), Some(access)) => Some(Arc::new(VolumeBackend {
                // A snapshot, or a volume set readonly=on, is read-only to everyone.
                read_only: access == Access::ReadOnly || volume.is_read_only(),
                volume,
                stats: self.metrics.as_ref().map(|m| m.volume(name)),
            })),
            _ => None,
        }
    }

    fn event(&self, client: &Client, event: Event<'_>) {
        if let Some(metrics) = &self.metrics {
            match event {
                Event::Attach { export, .. } => metrics.attached(export),
                Event::Detach { export, .. } => metrics.detached(export),
                Event::Denied { .. } => metrics.refused_open(),
                Event::HandshakeFailed { .. } => metrics.handshake_failed(),
            }
        }
        let name = client.identity.name();
        let (event, client_name, volume, result, detail) = match event {
            Event::Attach { export, read_only } => (
                "attach",
                name.as_str(),
                Some(export),
                "ok",
                json!({ "read_only": read_only }),
            ),
            Event::Detach { export, reason } => {
                ("detach", name.as_str(), Some(export), "ok", json!(reason))
            }
            Event::Denied { export } => {
                // For the administrator only: the client was told nothing.
                let why = match (
                    self.pool.volume(export).is_ok(),
                    self.access(client, volume_of(export)),
                ) {
                    (_, None) => "no grant for this client",
                    (false, Some(_)) => "no such unlocked volume",
                    (true, Some(_)) => "not available",
                };
                ("attach", name.as_str(), Some(export), "denied", json!(why))
            }
            Event::HandshakeFailed { reason } => (
                "handshake",
                "unauthenticated",
                None,
                "denied",
                json!(reason),
            ),
        };
        self.access.audit.record(Record {
            event,
            client: client_name,
            peer: &client.peer,
            volume,
            result,
            detail,
        });
    }
}
