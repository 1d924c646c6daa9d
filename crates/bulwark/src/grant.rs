//! `bulwark grant add|remove|list` on both sides of the control socket, and
//! the audit records of control requests.
//!
//! CLI side: build the request, print the answer. Daemon side
//! ([`handle`]): change the grants table (`access.rs`) and audit the
//! change. [`Audited`] describes a control request worth an audit line
//! (volume create/destroy, every key operation) without any secret: the
//! secret file's path is not even recorded, only its kind.

use std::path::Path;
use std::sync::Arc;

use bulwark_engine::Pool;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::access::{normalize_client, Access, AccessControl, Grant};
use crate::cli::{GrantAddArgs, GrantRemoveArgs, ListArgs};
use crate::client::{print, Client};
use crate::control::{ControlError, ErrorKind, Request, SecretRef};
use crate::error::Result;

// ---- CLI ---------------------------------------------------------------

pub fn add(dir: &Path, args: &GrantAddArgs) -> Result<()> {
    let access = if args.read_only {
        Access::ReadOnly
    } else {
        Access::ReadWrite
    };
    let request = Request::GrantAdd {
        client: args.client.clone(),
        volume: args.volume.clone(),
        access,
    };
    let changed: Changed<Grant> = Client::connect(dir)?.call_typed(&request)?;
    let grant = &changed.grant;
    print(&format!(
        "granted {} {} access to volume {}{}\n",
        grant.client,
        grant.access.as_str(),
        grant.volume,
        closed_note(&changed)
    ))
}

pub fn remove(dir: &Path, args: &GrantRemoveArgs) -> Result<()> {
    let request = Request::GrantRemove {
        client: args.client.clone(),
        volume: args.volume.clone(),
    };
    let changed: Changed = Client::connect(dir)?.call_typed(&request)?;
    print(&format!(
        "removed the grant of volume {} to {}{}\n",
        args.volume,
        args.client,
        closed_note(&changed)
    ))
}

/// The daemon's answer to a grant change.
#[derive(Deserialize)]
struct Changed<G = ()> {
    #[serde(flatten)]
    grant: G,
    /// Open NBD connections the change closed (absent from an older daemon).
    #[serde(default)]
    closed_connections: u64,
    /// Of those, the ones still open when the daemon answered.
    #[serde(default)]
    finishing_connections: u64,
}

/// Adds to a grant change's answer how many open NBD connections it closed,
/// and how many of those were still finishing their requests.
pub(crate) fn with_closed(answer: &mut Value, closed: usize, finishing: usize) {
    let (c, f) = ("closed_connections", "finishing_connections");
    match answer {
        Value::Object(map) => {
            map.insert(c.into(), closed.into());
            map.insert(f.into(), finishing.into());
        }
        other => *other = json!({ c: closed, f: finishing }),
    }
}

/// What to add to a grant change's message when it closed connections.
fn closed_note(changed: &Changed<impl Sized>) -> String {
    match (changed.closed_connections, changed.finishing_connections) {
        (0, _) => String::new(),
        (n, 0) => format!("; closed {n} open NBD connection(s) it no longer allows"),
        (n, f) => format!(
            "; closing {n} open NBD connection(s) it no longer allows \
             ({f} still finishing requests already sent)"
        ),
    }
}

pub fn list(dir: &Path, args: &ListArgs) -> Result<()> {
    let grants: Vec<Grant> = Client::connect(dir)?.call_typed(&Request::GrantList)?;
    if args.json {
        let mut text = serde_json::to_string_pretty(&grants).expect("grants serialize");
        text.push('\n');
        return print(&text);
    }
    if grants.is_empty() {
        return print("no grants\n");
    }
    let width = grants
        .iter()
        .map(|g| g.client.len())
        .max()
        .unwrap_or(0)
        .max("CLIENT".len());
    let vwidth = grants
        .iter()
        .map(|g| g.volume.len())
        .max()
        .unwrap_or(0)
        .max("VOLUME".len());
    let mut out = format!("{:width$}  {:vwidth$}  ACCESS\n", "CLIENT", "VOLUME");
    for g in &grants {
        out.push_str(&format!(
            "{:width$}  {:vwidth$}  {}\n",
            g.client,
            g.volume,
            g.access.as_str()
        ));
    }
    print(&out)
}

// ---- Daemon ------------------------------------------------------------

/// Answers `grant_add`, `grant_remove` and `grant_list`. Blocks (file
/// writes, fsync): run on the blocking pool.
pub fn handle(
    pool: &Arc<Pool>,
    access: &AccessControl,
    request: Request,
) -> std::result::Result<Value, ControlError> {
    match request {
        Request::GrantAdd {
            client,
            volume,
            access: level,
        } => {
            let detail = json!({ "client": client, "access": level.as_str() });
            let result = (|| {
                let client = normalize_client(&client).map_err(ControlError::invalid)?;
                if !pool.volumes().iter().any(|v| v.name == volume) {
                    return Err(ControlError::new(
                        ErrorKind::NotFound,
                        format!("no volume named {volume}"),
                    ));
                }
                access
                    .grants
                    .add(&client, &volume, level)
                    .map_err(|e| ControlError::new(ErrorKind::Io, e))?;
                Ok(Grant {
                    client,
                    volume: volume.clone(),
                    access: level,
                })
            })();
            access.control(
                "grant_add",
                Some(&volume),
                result.as_ref().map(|_| ()).map_err(|e| e.message.as_str()),
                detail,
            );
            let grant = result?;
            Ok(serde_json::to_value(grant).expect("grants serialize"))
        }
        Request::GrantRemove { client, volume } => {
            let detail = json!({ "client": client });
            let result = normalize_client(&client)
                .map_err(ControlError::invalid)
                .and_then(|client| match access.grants.remove(&client, &volume) {
                    Ok(Some(_)) => Ok(()),
                    Ok(None) => Err(ControlError::new(
                        ErrorKind::NotFound,
                        format!("no grant for {client} on volume {volume}"),
                    )),
                    Err(e) => Err(ControlError::new(ErrorKind::Io, e)),
                });
            access.control(
                "grant_remove",
                Some(&volume),
                result.as_ref().map(|_| ()).map_err(|e| e.message.as_str()),
                detail,
            );
            result?;
            Ok(Value::Null)
        }
        Request::GrantList => {
            Ok(serde_json::to_value(access.grants.list()).expect("grants serialize"))
        }
        other => Err(ControlError::internal(format!(
            "not a grant request: {other:?}"
        ))),
    }
}

/// A control request that leaves an audit record.
pub struct Audited {
    event: &'static str,
    /// None for pool-wide requests (devices, faults, scrub).
    volume: Option<String>,
    detail: Value,
    /// On success, the result is recorded in `detail` under this name (a slot
    /// number, a key generation: nothing secret).
    result_as: Option<&'static str>,
}

fn secret_kind(s: &SecretRef) -> &'static str {
    match s {
        SecretRef::PassphraseFile(_) => "passphrase_file",
        SecretRef::KeyFile(_) => "key_file",
    }
}

impl Audited {
    /// What to record about `request`, if anything (grant requests record
    /// themselves in [`handle`]).
    pub fn of(request: &Request) -> Option<Audited> {
        let (event, volume, detail) = match request {
            Request::VolumeCreate {
                name,
                size_bytes,
                encryption,
                secret,
                ..
            } => (
                "volume_create",
                name,
                json!({
                    "size_bytes": size_bytes,
                    "encryption": encryption,
                    "secret": secret.as_ref().map(secret_kind),
                }),
            ),
            Request::VolumeResize {
                name,
                size_bytes,
                shrink,
            } => (
                "volume_resize",
                name,
                json!({ "size_bytes": size_bytes, "shrink": shrink }),
            ),
            Request::VolumeSet {
                name,
                property,
                value,
            } => ("volume_set", name, json!({ property.as_str(): value })),
            Request::VolumeDestroy { name, recursive } => (
                "volume_destroy",
                name,
                if *recursive {
                    json!({ "recursive": true })
                } else {
                    Value::Null
                },
            ),
            Request::VolumeRollback {
                volume,
                snapshot,
                destroy_newer,
            } => (
                "volume_rollback",
                volume,
                json!({ "snapshot": snapshot, "destroy_newer": destroy_newer }),
            ),
            Request::VolumeClone {
                volume,
                snapshot,
                name,
                secret,
                independent,
            } => (
                "volume_clone",
                name,
                json!({
                    "origin": format!("{volume}@{snapshot}"),
                    "secret": secret.as_ref().map(secret_kind),
                    "independent": independent,
                }),
            ),
            Request::SnapshotCreate { volume, snapshot } => {
                ("snapshot_create", volume, json!({ "snapshot": snapshot }))
            }
            Request::SnapshotDestroy { volume, snapshot } => {
                ("snapshot_destroy", volume, json!({ "snapshot": snapshot }))
            }
            Request::SnapshotHold {
                volume,
                snapshot,
                tag,
            } => (
                "snapshot_hold",
                volume,
                json!({ "snapshot": snapshot, "tag": tag }),
            ),
            Request::SnapshotRelease {
                volume,
                snapshot,
                tag,
            } => (
                "snapshot_release",
                volume,
                json!({ "snapshot": snapshot, "tag": tag }),
            ),
            Request::KeyLoad { name, secret } => {
                ("key_load", name, json!({ "secret": secret_kind(secret) }))
            }
            Request::KeyUnload { name } => ("key_unload", name, Value::Null),
            Request::KeyAdd { name, secret } => {
                ("key_add", name, json!({ "secret": secret_kind(secret) }))
            }
            Request::KeyRemove { name, secret } => {
                ("key_remove", name, json!({ "secret": secret_kind(secret) }))
            }
            Request::KeyChange { name, old, new } => (
                "key_change",
                name,
                json!({ "old": secret_kind(old), "new": secret_kind(new) }),
            ),
            Request::KeyList { name } => ("key_list", name, Value::Null),
            Request::KeyRotate { name } => ("key_rotate", name, Value::Null),
            Request::KeyErase { name } => ("key_erase", name, Value::Null),
            other => return Audited::of_pool(other),
        };
        let result_as = match request {
            Request::KeyAdd { .. } | Request::KeyChange { .. } => Some("slot"),
            // Every slot the secret opened (a list).
            Request::KeyRemove { .. } => Some("slots"),
            Request::KeyRotate { .. } => Some("generation"),
            _ => None,
        };
        Some(Audited {
            event,
            volume: Some(volume.clone()),
            detail,
            result_as,
        })
    }

    /// Pool-wide requests that change what the pool does: device state,
    /// injected faults, scrubs. Reads of state (status, lists) are not audited.
    fn of_pool(request: &Request) -> Option<Audited> {
        let (event, detail) = match request {
            Request::DeviceOffline { path } => ("device_offline", json!({ "device": path })),
            Request::DeviceOnline { path } => ("device_online", json!({ "device": path })),
            Request::DeviceReplace { old, new } => {
                ("device_replace", json!({ "device": old, "new": new }))
            }
            Request::FaultSet { device, fault } => {
                ("fault_set", json!({ "device": device, "fault": fault }))
            }
            Request::FaultClear { device } => ("fault_clear", json!({ "device": device })),
            Request::ScrubStart { verify_store } => (
                "scrub_start",
                if *verify_store {
                    json!({ "verify_store": true })
                } else {
                    Value::Null
                },
            ),
            Request::ScrubResume => ("scrub_resume", Value::Null),
            Request::ScrubPause => ("scrub_pause", Value::Null),
            Request::ScrubCancel => ("scrub_cancel", Value::Null),
            _ => return None,
        };
        Some(Audited {
            event,
            volume: None,
            detail,
            result_as: None,
        })
    }

    /// Records the outcome; after a destroyed volume, drops its grants
    /// (a later volume of the same name starts with none).
    pub async fn record(
        self,
        access: &Arc<AccessControl>,
        result: &std::result::Result<Value, ControlError>,
    ) {
        let access = Arc::clone(access);
        let ok = result.is_ok();
        let error = result.as_ref().err().map(|e| e.message.clone());
        let mut detail = self.detail;
        if let (Some(field), Ok(value)) = (self.result_as, result) {
            let mut map = match detail {
                Value::Object(map) => map,
                _ => serde_json::Map::new(),
            };
            map.insert(field.to_string(), value.clone());
            detail = Value::Object(map);
        }
        let _ = tokio::task::spawn_blocking(move || {
            access.control(
                self.event,
                self.volume.as_deref(),
                error.as_deref().map_or(Ok(()), Err),
                detail,
            );
            if let (true, "volume_destroy", Some(volume)) = (ok, self.event, &self.volume) {
                match access.grants.remove_volume(volume) {
                    Ok(gone) => {
                        for g in gone {
                            access.control(
                                "grant_remove",
                                Some(&g.volume),
                                Ok(()),
                                json!({ "client": g.client, "reason": "volume destroyed" }),
                            );
                        }
                    }
                    Err(e) => {
                        tracing::error!("cannot drop the grants of destroyed volume {volume}: {e}")
                    }
                }
            }
        })
        .await;
    }
}
