//! The control protocol between the CLI and the daemon, shared by both sides.
//!
//! Transport: the unix socket `DIR/control.sock` (mode 0600, and the daemon
//! also checks the peer's uid). Framing: one JSON object per line each way;
//! a connection may carry several requests in turn. A request is tagged by
//! `op`:
//!
//! ```text
//! {"op":"status"}
//! {"op":"volume_list"}
//! {"op":"volume_create","name":"v","size_bytes":1073741824,"block_size":4096,
//!  "compression":"lz4","encryption":true,"secret":{"kind":"key_file","path":"/abs/key"}}
//!  (a thick volume: "thick":true)
//! {"op":"volume_resize","name":"v","size_bytes":2147483648,"shrink":false}
//!   (answered by {"name":"v","old_bytes":N,"new_bytes":N,"old_depth":3,"new_depth":4,"attached":N})
//! {"op":"volume_get","name":"v"}  {"op":"volume_set","name":"v","property":"readonly","value":"on"}
//! {"op":"volume_destroy","name":"v"}  {"op":"volume_destroy","name":"v","recursive":true}
//!   (answered by {"kept":[{"snapshot":"v@s","referenced_bytes":N,"clones":["c"]}]})
//! {"op":"volume_space","name":"v"}  {"op":"volume_space","name":null}
//! {"op":"volume_rollback","volume":"v","snapshot":"s","destroy_newer":false}
//! {"op":"snapshot_create","volume":"v","snapshot":"s"}
//! {"op":"volume_clone","volume":"v","snapshot":"s","name":"c",
//!  "secret":{"kind":"key_file","path":"/abs/key"},"independent":false}
//! {"op":"snapshot_list","volume":"v"}  {"op":"snapshot_list","volume":null}
//! {"op":"snapshot_destroy","volume":"v","snapshot":"s"}
//! {"op":"snapshot_hold","volume":"v","snapshot":"s","tag":"backup"}
//! {"op":"snapshot_release","volume":"v","snapshot":"s","tag":"backup"}
//! {"op":"key_load","name":"v","secret":{"kind":"passphrase_file","path":"/abs/pass"}}
//! {"op":"key_unload","name":"v"}
//! {"op":"key_add","name":"v","secret":{"kind":"passphrase_file","path":"/abs/pass"}}
//! {"op":"key_remove","name":"v","secret":{"kind":"key_file","path":"/abs/key"}}
//! {"op":"key_change","name":"v","old":{"kind":"passphrase_file","path":"/abs/old"},
//!  "new":{"kind":"passphrase_file","path":"/abs/new"}}
//! {"op":"key_list","name":"v"}  {"op":"key_rotate","name":"v"}  {"op":"key_erase","name":"v"}
//! {"op":"scrub_start"}  {"op":"scrub_resume"}  {"op":"scrub_pause"}  {"op":"scrub_cancel"}
//! {"op":"scrub_status"}
//! {"op":"device_offline","path":"/abs/dev1"}  {"op":"device_online","path":"/abs/dev1"}
//! {"op":"device_replace","old":"/abs/dev1","new":"/abs/dev9"}
//! {"op":"fault_set","device":"/abs/dev0",
//!  "fault":{"mode":"read-flip","probability":1.0,"seed":7,"include_labels":false}}
//! {"op":"fault_clear","device":"/abs/dev0"}  {"op":"fault_clear","device":null}
//! {"op":"fault_list"}
//! {"op":"grant_add","client":"cn:alice","volume":"v","access":"read-only"}
//! {"op":"grant_remove","client":"cn:alice","volume":"v"}  {"op":"grant_list"}
//! ```
//!
//! and answered by `{"ok":true,"result":...}` or
//! `{"ok":false,"error":"message","kind":"not_found"}`: the message is for
//! people, the [`ErrorKind`] for scripts (`not_found`, `exists`, `busy`,
//! `invalid`, `locked`, `wrong_key`, `no_space`, `io`, ...; each engine
//! error maps to one, see `From<bulwark_engine::Error>`).
//! Device paths are absolute (the CLI makes them so); `fault_set` adds to the
//! faults already armed on the device, replacing one of the same mode.
//!
//! Secrets never cross the socket: a request names an absolute path, the
//! daemon (running as the same user) reads the file, uses the secret and
//! drops it, zeroized, before it answers.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bulwark_engine::device::fault::{Fault, FaultMode};
use bulwark_engine::pool::format::health::{DataError, ScrubStatus};
use bulwark_engine::{PoolStatus, VolumeStatus};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Name of the control socket inside the pool directory.
pub const CONTROL_SOCKET_NAME: &str = "control.sock";
/// Name of the default NBD socket inside the pool directory.
pub const NBD_SOCKET_NAME: &str = "nbd.sock";
/// Longest request line the daemon accepts (the largest honest one is a few hundred bytes).
pub const REQUEST_BYTES_MAX: usize = 64 << 10;

pub fn control_socket_path(dir: &Path) -> PathBuf {
    dir.join(CONTROL_SOCKET_NAME)
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Status,
    VolumeList,
    VolumeCreate {
        name: String,
        size_bytes: u64,
        block_size: u32,
        /// "off" or "lz4".
        compression: String,
        encryption: bool,
        secret: Option<SecretRef>,
        /// Reserve the whole size in the pool (refused when it cannot hold it).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        thick: bool,
    },
    /// Answered by `Resized` and the NBD connections attached (`"attached": N`), which keep
    /// the old size until they reconnect.
    VolumeResize {
        name: String,
        size_bytes: u64,
        /// Allow a smaller size (refused while attached or over data).
        #[serde(default)]
        shrink: bool,
    },
    /// Answered by the volume's `VolumeProps`.
    VolumeGet {
        name: String,
    },
    /// One property (compression, description, readonly).
    VolumeSet {
        name: String,
        property: String,
        value: String,
    },
    VolumeDestroy {
        name: String,
        /// Destroy its snapshots with it (refused without, when it has any).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        recursive: bool,
    },
    /// Answered by `Vec<VolumeSpace>`: one volume, or every volume when `name` is null.
    VolumeSpace {
        name: Option<String>,
    },
    /// Answered by the names of the newer snapshots destroyed (`destroy_newer`).
    VolumeRollback {
        volume: String,
        snapshot: String,
        #[serde(default)]
        destroy_newer: bool,
    },
    SnapshotCreate {
        volume: String,
        snapshot: String,
    },
    /// Answered by the new volume's `VolumeEntry`.
    VolumeClone {
        volume: String,
        snapshot: String,
        name: String,
        secret: Option<SecretRef>,
        #[serde(default)]
        independent: bool,
    },
    /// Answered by `Vec<SnapshotStatus>`, oldest first per volume.
    SnapshotList {
        volume: Option<String>,
    },
    /// Answered by `{"freed_bytes": N}`.
    SnapshotDestroy {
        volume: String,
        snapshot: String,
    },
    SnapshotHold {
        volume: String,
        snapshot: String,
        tag: String,
    },
    SnapshotRelease {
        volume: String,
        snapshot: String,
        tag: String,
    },
    KeyLoad {
        name: String,
        secret: SecretRef,
    },
    KeyUnload {
        name: String,
    },
    /// Answered by the new slot's number.
    KeyAdd {
        name: String,
        secret: SecretRef,
    },
    /// Removes every slot `secret` opens (it no longer opens the volume); answered by
    /// their numbers, ascending. Refused when no slot would be left.
    KeyRemove {
        name: String,
        secret: SecretRef,
    },
    /// Gives the slot `old` opens the secret `new`; answered by its number. Refused when
    /// `new` already opens another slot.
    KeyChange {
        name: String,
        old: SecretRef,
        new: SecretRef,
    },
    /// Answered by the slots (`Vec<SlotInfo>`, nothing secret).
    KeyList {
        name: String,
    },
    /// Answered by the new data key generation; re-encryption runs in the background.
    KeyRotate {
        name: String,
    },
    /// Crypto-erase: every slot and data key destroyed.
    KeyErase {
        name: String,
    },
    /// Start a scrub; resumes a paused one (`Busy` if one is running). `verify_store`:
    /// check the object store's copies of locally held records too.
    ScrubStart {
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        verify_store: bool,
    },
    /// Resume a paused scrub; refused when none is paused.
    ScrubResume,
    ScrubPause,
    ScrubCancel,
    /// Answered by a `ScrubReport`.
    ScrubStatus,
    DeviceOffline {
        path: PathBuf,
    },
    /// Starts a resilver of the device.
    DeviceOnline {
        path: PathBuf,
    },
    /// Starts a resilver onto `new`.
    DeviceReplace {
        old: PathBuf,
        new: PathBuf,
    },
    /// Answered by the device's faults after the change (`Vec<Fault>`).
    FaultSet {
        device: PathBuf,
        fault: FaultSpec,
    },
    /// One device, or every device when `device` is null. Answered by the number cleared.
    FaultClear {
        device: Option<PathBuf>,
    },
    /// Answered by `Vec<FaultEntry>`, one per device with faults armed.
    FaultList,
    /// Answered by the `Grant` stored (client name normalised).
    GrantAdd {
        client: String,
        volume: String,
        access: crate::access::Access,
    },
    GrantRemove {
        client: String,
        volume: String,
    },
    /// Answered by `Vec<Grant>`.
    GrantList,
}

/// Where the daemon finds a secret: an absolute path, never the bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "path", rename_all = "snake_case")]
pub enum SecretRef {
    PassphraseFile(PathBuf),
    KeyFile(PathBuf),
}

/// What kind of failure an error answer reports, for scripts (the message
/// says the same for people). On the wire in snake case: `not_found`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request is malformed, or asks for what cannot be (a bad size,
    /// name or option; a state it does not apply to).
    Invalid,
    /// No such volume, device, grant.
    NotFound,
    /// A volume of that name exists already.
    Exists,
    /// The volume's key is not loaded.
    Locked,
    /// The secret opens no key slot of the volume.
    WrongKey,
    /// In use: NBD clients attached, a scrub reading it, another change
    /// under way. Trying again later may work.
    Busy,
    /// The pool is out of space.
    NoSpace,
    /// The volume is read-only (`volume set readonly=on`).
    ReadOnly,
    /// No copy of a block verified: its data is lost.
    Unrecoverable,
    /// Bytes on a device are not what bulwark wrote.
    Corrupt,
    /// A device or file failed (a secret file that cannot be read, too).
    Io,
    /// A write or flush failed earlier; restart the daemon.
    Poisoned,
    /// Another host took the pool in its object store: this daemon no longer writes it.
    Fenced,
    /// The pool's object store did not answer in time; trying again later may work.
    StoreUnavailable,
    /// The daemon is shutting down.
    Unavailable,
    /// A bug: an engine panic, a result that would not encode.
    Internal,
}

/// A request's failure, as the daemon answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlError {
    pub kind: ErrorKind,
    pub message: String,
}

impl ControlError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> ControlError {
        ControlError {
            kind,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> ControlError {
        ControlError::new(ErrorKind::Invalid, message)
    }

    pub fn internal(message: impl Into<String>) -> ControlError {
        ControlError::new(ErrorKind::Internal, message)
    }
}

impl std::fmt::Display for ControlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// The engine's error with its message unchanged and its variant as the kind.
impl From<bulwark_engine::Error> for ControlError {
    fn from(e: bulwark_engine::Error) -> ControlError {
        use bulwark_engine::Error as E;
        let kind = match &e {
            E::Invalid(_) | E::OutOfRange { .. } => ErrorKind::Invalid,
            E::NotFound(_) => ErrorKind::NotFound,
            E::Exists(_) => ErrorKind::Exists,
            E::Locked(_) => ErrorKind::Locked,
            E::WrongKey(_) => ErrorKind::WrongKey,
            E::Busy(_) => ErrorKind::Busy,
            E::NoSpace => ErrorKind::NoSpace,
            E::ReadOnly(_) => ErrorKind::ReadOnly,
            E::Unrecoverable(_) => ErrorKind::Unrecoverable,
            E::Corrupt(_) => ErrorKind::Corrupt,
            E::Device { .. } | E::Io(_) => ErrorKind::Io,
            E::Poisoned => ErrorKind::Poisoned,
            E::Fenced(_) => ErrorKind::Fenced,
            E::StoreUnavailable(_) => ErrorKind::StoreUnavailable,
        };
        ControlError::new(kind, e.to_string())
    }
}

/// A request's result, encoded for its answer.
pub fn to_value<T: Serialize>(v: &T) -> Result<Value, ControlError> {
    serde_json::to_value(v).map_err(|e| {
        ControlError::internal(format!("internal error: cannot encode the result: {e}"))
    })
}

/// One answer line. `Ok` carries the request's result (`null` when there is
/// none); `Err` the message and, from a daemon that sends one, the kind.
#[derive(Debug, Clone, PartialEq)]
pub enum Response {
    Ok(Value),
    Err {
        message: String,
        kind: Option<ErrorKind>,
    },
}

impl From<ControlError> for Response {
    fn from(e: ControlError) -> Response {
        Response::Err {
            message: e.message,
            kind: Some(e.kind),
        }
    }
}

#[derive(Serialize, Deserialize)]
struct ResponseWire {
    ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    /// An `ErrorKind`; read as a plain value, so that a kind this CLI does
    /// not know leaves the message readable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    kind: Option<Value>,
}

impl Response {
    /// The response as one line of JSON, without the newline.
    pub fn to_line(&self) -> String {
        let wire = match self {
            Response::Ok(v) => ResponseWire {
                ok: true,
                result: Some(v.clone()),
                error: None,
                kind: None,
            },
            Response::Err { message, kind } => ResponseWire {
                ok: false,
                result: None,
                error: Some(message.clone()),
                kind: kind.map(|k| serde_json::to_value(k).expect("kinds serialize")),
            },
        };
        serde_json::to_string(&wire).expect("a response always serializes")
    }

    /// Reads an answer line. An error without a kind (a daemon from before
    /// kinds, or one this CLI does not know) is still an error with its message.
    pub fn from_line(line: &str) -> Result<Response, String> {
        let wire: ResponseWire = serde_json::from_str(line)
            .map_err(|e| format!("malformed response from the daemon: {e}"))?;
        Ok(if wire.ok {
            Response::Ok(wire.result.unwrap_or(Value::Null))
        } else {
            Response::Err {
                message: wire
                    .error
                    .unwrap_or_else(|| "the daemon reported an unnamed error".into()),
                kind: wire.kind.and_then(|k| serde_json::from_value(k).ok()),
            }
        })
    }
}

/// `status` result: the engine's `PoolStatus` fields at top level, plus what the daemon knows.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatusReport {
    #[serde(flatten)]
    pub pool: PoolStatus,
    pub daemon: DaemonInfo,
    /// Devices with injected faults armed (empty in normal operation).
    #[serde(default)]
    pub faults: Vec<FaultEntry>,
    /// Where the pool's trust root lives (issue 41): pool.key and pool.anchor, in the pool
    /// directory or in the directory `pool create --key-dir` named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trust_root: Option<TrustRoot>,
}

/// `status`'s trust root: the files and whether they sit apart from the pool directory.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrustRoot {
    /// The directory holding both (`--key-dir`, or the pool directory).
    pub dir: PathBuf,
    pub key: PathBuf,
    pub anchor: PathBuf,
    /// `pool create --key-dir` put them outside the pool directory.
    pub key_dir: bool,
}

impl TrustRoot {
    pub fn of(pool_dir: &std::path::Path) -> TrustRoot {
        let dir = bulwark_engine::pool::format::config::trust_root_dir(pool_dir);
        TrustRoot {
            key: dir.join("pool.key"),
            anchor: dir.join("pool.anchor"),
            key_dir: dir != pool_dir,
            dir,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DaemonInfo {
    pub version: String,
    pub pid: u32,
    pub nbd_socket: PathBuf,
    pub nbd_tcp: Option<String>,
    /// NBD connections per volume, only volumes with at least one.
    pub attached: BTreeMap<String, usize>,
    /// Started with `--allow-fault-injection`.
    #[serde(default)]
    pub fault_injection: bool,
}

/// `scrub_status` result: the scrub (or resilver) and the unrecoverable ranges known now.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScrubReport {
    #[serde(flatten)]
    pub scrub: ScrubStatus,
    pub errors: Vec<DataError>,
}

/// One fault as `fault_set` carries it: the engine's `Fault`, field for field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultSpec {
    pub mode: FaultMode,
    /// Chance that one I/O is hit, 0.0..=1.0.
    pub probability: f64,
    pub seed: u64,
    /// Also hit the superblock slots.
    #[serde(default)]
    pub include_labels: bool,
}

impl From<FaultSpec> for Fault {
    fn from(f: FaultSpec) -> Fault {
        Fault {
            mode: f.mode,
            probability: f.probability,
            seed: f.seed,
            include_labels: f.include_labels,
        }
    }
}

/// The faults armed on one device.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FaultEntry {
    pub device: PathBuf,
    pub faults: Vec<Fault>,
}

/// Whether an encrypted volume's key is loaded, as `zfs get keystatus` says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyStatus {
    Available,
    Unavailable,
    None,
}

impl KeyStatus {
    pub fn of(v: &VolumeStatus) -> KeyStatus {
        match (v.encryption, v.locked) {
            (false, _) => KeyStatus::None,
            (true, true) => KeyStatus::Unavailable,
            (true, false) => KeyStatus::Available,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            KeyStatus::Available => "available",
            KeyStatus::Unavailable => "unavailable",
            KeyStatus::None => "none",
        }
    }
}

/// What a command that needs an encrypted volume's key says when it is not loaded: load
/// it, or, once its keys were erased (no slot left), that nothing opens it.
pub fn locked_message(v: &VolumeStatus) -> String {
    let name = &v.name;
    if v.key_slots == 0 {
        format!(
            "the keys of volume '{name}' were erased: its data is unrecoverable with any \
             secret; destroy it ('bulwark volume destroy {name}')"
        )
    } else {
        format!(
            "volume '{name}' is locked: load its key first ('bulwark key load {name} \
             --key-file PATH' or '--passphrase-file PATH')"
        )
    }
}

/// One row of `volume_list` (and `volume_create`'s result): the engine's fields plus key status.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VolumeEntry {
    #[serde(flatten)]
    pub volume: VolumeStatus,
    pub key_status: KeyStatus,
    /// NBD connections to this volume now.
    pub attached: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_as_documented() {
        let r = Request::VolumeCreate {
            name: "v".into(),
            size_bytes: 1 << 30,
            block_size: 4096,
            compression: "lz4".into(),
            encryption: true,
            secret: Some(SecretRef::KeyFile("/abs/key".into())),
            thick: false,
        };
        let line = serde_json::to_string(&r).unwrap();
        assert_eq!(
            line,
            r#"{"op":"volume_create","name":"v","size_bytes":1073741824,"block_size":4096,"compression":"lz4","encryption":true,"secret":{"kind":"key_file","path":"/abs/key"}}"#
        );
        assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), r);
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"status"}"#).unwrap(),
            Request::Status
        );
        assert!(serde_json::from_str::<Request>(r#"{"op":"format_disk"}"#).is_err());
    }

    #[test]
    fn maintenance_requests_round_trip_as_documented() {
        let r: Request = serde_json::from_str(
            r#"{"op":"fault_set","device":"/abs/dev0","fault":{"mode":"read-flip","probability":1.0,"seed":7,"include_labels":false}}"#,
        )
        .unwrap();
        let Request::FaultSet { device, fault } = &r else {
            panic!("{r:?}")
        };
        assert_eq!(device, Path::new("/abs/dev0"));
        assert_eq!((fault.mode, fault.probability), (FaultMode::ReadFlip, 1.0));
        for line in [
            r#"{"op":"scrub_start"}"#,
            r#"{"op":"scrub_start","verify_store":true}"#,
            r#"{"op":"scrub_resume"}"#,
            r#"{"op":"scrub_status"}"#,
            r#"{"op":"device_replace","old":"/abs/dev1","new":"/abs/dev9"}"#,
            r#"{"op":"fault_clear","device":null}"#,
            r#"{"op":"fault_list"}"#,
            r#"{"op":"volume_resize","name":"v","size_bytes":2147483648,"shrink":false}"#,
            r#"{"op":"volume_get","name":"v"}"#,
            r#"{"op":"volume_set","name":"v","property":"readonly","value":"on"}"#,
        ] {
            let r: Request = serde_json::from_str(line).unwrap();
            assert_eq!(serde_json::to_string(&r).unwrap(), line);
        }
    }

    #[test]
    fn responses_round_trip() {
        let ok = Response::Ok(Value::Null);
        assert_eq!(ok.to_line(), r#"{"ok":true,"result":null}"#);
        assert_eq!(Response::from_line(&ok.to_line()).unwrap(), ok);
        let err = Response::from(ControlError::new(ErrorKind::NotFound, "no such volume"));
        assert_eq!(
            err.to_line(),
            r#"{"ok":false,"error":"no such volume","kind":"not_found"}"#
        );
        assert_eq!(Response::from_line(&err.to_line()).unwrap(), err);
        assert!(Response::from_line("garbage").is_err());
        // A daemon that sends no kind, or one unknown here: the message still comes through.
        for line in [
            r#"{"ok":false,"error":"no such volume"}"#,
            r#"{"ok":false,"error":"no such volume","kind":"from_the_future"}"#,
        ] {
            assert_eq!(
                Response::from_line(line).unwrap(),
                Response::Err {
                    message: "no such volume".into(),
                    kind: None
                }
            );
        }
    }

    /// Each engine error keeps its message and gets the kind scripts match on.
    #[test]
    fn engine_errors_carry_their_kind() {
        use bulwark_engine::Error as E;
        let cases = [
            (E::NotFound("no volume named v".into()), "not_found"),
            (E::Busy("volume v is being scrubbed".into()), "busy"),
            (E::Exists("volume v exists".into()), "exists"),
            (E::Invalid("bad size".into()), "invalid"),
            (E::Locked("v".into()), "locked"),
            (E::WrongKey("v".into()), "wrong_key"),
            (E::NoSpace, "no_space"),
            (E::Io(std::io::Error::other("disk")), "io"),
            (E::Poisoned, "poisoned"),
            (E::Fenced("taken over".into()), "fenced"),
            (E::StoreUnavailable("503".into()), "store_unavailable"),
        ];
        for (e, kind) in cases {
            let message = e.to_string();
            let c = ControlError::from(e);
            assert_eq!(c.message, message);
            assert_eq!(serde_json::to_value(c.kind).unwrap(), kind);
        }
    }
}
