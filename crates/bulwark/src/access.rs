//! Who may open which volume over the network, and the audit trail.
//!
//! Grants: `(client, volume) → read-only | read-write`, where a client is
//! `cn:COMMON_NAME`, `sha256:FINGERPRINT` (of the DER certificate,
//! lowercase hex), `psk:IDENTITY` or `anonymous` (plaintext TCP). Kept in
//! `DIR/grants.json` (mode 0600), replaced atomically on every change
//! (write a temporary file, fsync, rename, fsync the directory). The Unix
//! socket's client is the pool owner and needs no grant. A certificate
//! client matches grants on its `cn:` and its `sha256:` name; if both
//! match, the wider access wins.
//!
//! Audit: one JSON object per line appended to `DIR/audit.log` (mode 0600,
//! O_APPEND, fsync after each line): attach, detach, denied opens, failed
//! TLS handshakes, key operations (load, unload, add, remove, change, list,
//! rotate, erase), grant changes, volume create/destroy.
//! Lines name clients, peers and volumes, never a secret: no key bytes,
//! passphrase, PSK key or file contents ever reach this module.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tracing::error;

pub const GRANTS_FILE: &str = "grants.json";
pub const AUDIT_FILE: &str = "audit.log";

/// Longest client name a grant may hold (a CN is at most 64 characters; a
/// PSK identity here at most 1024 bytes).
const CLIENT_NAME_BYTES_MAX: usize = 1100;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Access {
    ReadOnly,
    ReadWrite,
}

impl Access {
    pub fn as_str(self) -> &'static str {
        match self {
            Access::ReadOnly => "read-only",
            Access::ReadWrite => "read-write",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub client: String,
    pub volume: String,
    pub access: Access,
}

#[derive(Serialize, Deserialize)]
struct GrantsFile {
    version: u32,
    grants: Vec<Grant>,
}

/// Checks and normalises a client name: `cn:` and `psk:` need a non-empty
/// name without control characters; `sha256:` takes 64 hex digits, with or
/// without colons (as `openssl x509 -fingerprint` prints them), stored
/// lowercase without colons.
pub fn normalize_client(client: &str) -> Result<String, String> {
    let bad = || {
        format!(
            "invalid client {client:?}: use cn:COMMON_NAME, sha256:FINGERPRINT, psk:IDENTITY \
             or anonymous"
        )
    };
    if client == "anonymous" {
        return Ok(client.to_owned());
    }
    if client.len() > CLIENT_NAME_BYTES_MAX {
        return Err(bad());
    }
    let (kind, name) = client.split_once(':').ok_or_else(bad)?;
    match kind {
        "cn" | "psk" => {
            if name.is_empty() || name.chars().any(char::is_control) {
                return Err(bad());
            }
            Ok(client.to_owned())
        }
        "sha256" => {
            let hex: String = name.chars().filter(|c| *c != ':').collect();
            if hex.len() != 64 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err(format!(
                    "invalid client {client:?}: a sha256 fingerprint is 64 hex digits"
                ));
            }
            Ok(format!("sha256:{}", hex.to_ascii_lowercase()))
        }
        _ => Err(bad()),
    }
}

/// The grants table, in memory and in `DIR/grants.json`.
pub struct Grants {
    path: PathBuf,
    /// (client, volume) → access.
    table: RwLock<BTreeMap<(String, String), Access>>,
    /// Serialises changes, so file and memory change in the same order.
    write: Mutex<()>,
}

impl Grants {
    /// Loads `DIR/grants.json`; a missing file is an empty table.
    pub fn load(dir: &Path) -> Result<Grants, String> {
        let path = dir.join(GRANTS_FILE);
        let mut table = BTreeMap::new();
        match std::fs::read(&path) {
            Ok(bytes) => {
                let file: GrantsFile = serde_json::from_slice(&bytes)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                if file.version != 1 {
                    return Err(format!(
                        "{}: unknown version {}",
                        path.display(),
                        file.version
                    ));
                }
                for g in file.grants {
                    let client = normalize_client(&g.client)
                        .map_err(|e| format!("{}: {e}", path.display()))?;
                    table.insert((client, g.volume), g.access);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        }
        Ok(Grants {
            path,
            table: RwLock::new(table),
            write: Mutex::new(()),
        })
    }

    /// The widest access any of `names` has to `volume`.
    pub fn access(&self, names: &[String], volume: &str) -> Option<Access> {
        let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
        names
            .iter()
            .filter_map(|n| table.get(&(n.clone(), volume.to_owned())).copied())
            .max()
    }

    /// Volumes any of `names` may open.
    pub fn volumes(&self, names: &[String]) -> Vec<String> {
        let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
        let mut out: Vec<String> = table
            .keys()
            .filter(|(c, _)| names.contains(c))
            .map(|(_, v)| v.clone())
            .collect();
        out.sort();
        out.dedup();
        out
    }

    pub fn list(&self) -> Vec<Grant> {
        let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
        table
            .iter()
            .map(|((client, volume), access)| Grant {
                client: client.clone(),
                volume: volume.clone(),
                access: *access,
            })
            .collect()
    }

    /// Applies `change` to a copy of the table, persists it, then publishes it.
    fn change<T>(
        &self,
        change: impl FnOnce(&mut BTreeMap<(String, String), Access>) -> Result<T, String>,
    ) -> Result<T, String> {
        let _w = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        let mut next = self
            .table
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let out = change(&mut next)?;
        if next == *self.table.read().unwrap_or_else(PoisonError::into_inner) {
            // Nothing changed (a grant removed that was not there): nothing to write.
            return Ok(out);
        }
        let file = GrantsFile {
            version: 1,
            grants: next
                .iter()
                .map(|((client, volume), access)| Grant {
                    client: client.clone(),
                    volume: volume.clone(),
                    access: *access,
                })
                .collect(),
        };
        let mut bytes = serde_json::to_vec_pretty(&file).expect("grants serialize");
        bytes.push(b'\n');
        write_atomically(&self.path, &bytes)?;
        *self.table.write().unwrap_or_else(PoisonError::into_inner) = next;
        Ok(out)
    }

    /// Adds or replaces a grant; returns the access it replaced.
    pub fn add(
        &self,
        client: &str,
        volume: &str,
        access: Access,
    ) -> Result<Option<Access>, String> {
        self.change(|t| Ok(t.insert((client.to_owned(), volume.to_owned()), access)))
    }

    /// Removes a grant; returns the access it had, `None` when there was none.
    pub fn remove(&self, client: &str, volume: &str) -> Result<Option<Access>, String> {
        self.change(|t| Ok(t.remove(&(client.to_owned(), volume.to_owned()))))
    }

    /// Removes every grant on `volume` (it was destroyed); returns them.
    pub fn remove_volume(&self, volume: &str) -> Result<Vec<Grant>, String> {
        self.change(|t| {
            let gone: Vec<Grant> = t
                .iter()
                .filter(|((_, v), _)| v == volume)
                .map(|((c, v), a)| Grant {
                    client: c.clone(),
                    volume: v.clone(),
                    access: *a,
                })
                .collect();
            t.retain(|(_, v), _| v != volume);
            Ok(gone)
        })
    }
}

/// Replaces `path` with `bytes`: a mode-0600 temporary file in the same
/// directory, fsynced, renamed over `path`, then the directory fsynced.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = path.with_extension("json.tmp");
    let fail = |what: &str, e: std::io::Error| format!("cannot {what} {}: {e}", tmp.display());
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| fail("create", e))?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))
        .map_err(|e| fail("chmod", e))?;
    f.write_all(bytes).map_err(|e| fail("write", e))?;
    f.sync_all().map_err(|e| fail("fsync", e))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| format!("cannot replace {}: {e}", path.display()))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| format!("cannot fsync {}: {e}", dir.display()))
}

/// Grants and the audit log, shared by the NBD exports and the control socket.
pub struct AccessControl {
    pub grants: Grants,
    pub audit: Audit,
}

impl AccessControl {
    pub fn open(dir: &Path) -> Result<AccessControl, String> {
        Ok(AccessControl {
            grants: Grants::load(dir)?,
            audit: Audit::open(dir)?,
        })
    }

    /// An action taken through the control socket (by the pool owner).
    pub fn control(
        &self,
        event: &str,
        volume: Option<&str>,
        result: Result<(), &str>,
        detail: Value,
    ) {
        let (result, detail) = match result {
            Ok(()) => ("ok", detail),
            Err(e) => ("error", json!({ "error": e, "request": detail })),
        };
        self.audit.record(Record {
            event,
            client: "owner",
            peer: "control socket",
            volume,
            result,
            detail,
        });
    }
}

/// The append-only audit log.
pub struct Audit {
    file: Mutex<File>,
}

/// One audit record. `detail` is free text or structured, never a secret.
pub struct Record<'a> {
    pub event: &'a str,
    pub client: &'a str,
    pub peer: &'a str,
    pub volume: Option<&'a str>,
    pub result: &'a str,
    pub detail: Value,
}

impl Audit {
    pub fn open(dir: &Path) -> Result<Audit, String> {
        let path = dir.join(AUDIT_FILE);
        let file = OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        // An existing file keeps whatever mode it had: tighten it.
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(|e| format!("cannot chmod {}: {e}", path.display()))?;
        Ok(Audit {
            file: Mutex::new(file),
        })
    }

    /// Appends one line and fsyncs it. Blocks: call from blocking contexts.
    /// A failure is logged, not returned: the audited action already
    /// happened (or was already refused).
    pub fn record(&self, r: Record<'_>) {
        // Fields in this order (a struct keeps it; a JSON map sorts).
        #[derive(Serialize)]
        struct Line<'a> {
            time: String,
            event: &'a str,
            client: &'a str,
            peer: &'a str,
            volume: Option<&'a str>,
            result: &'a str,
            detail: Value,
        }
        let line = Line {
            time: rfc3339(SystemTime::now()),
            event: r.event,
            client: r.client,
            peer: r.peer,
            volume: r.volume,
            result: r.result,
            detail: r.detail,
        };
        let mut bytes = serde_json::to_vec(&line).expect("audit records serialize");
        bytes.push(b'\n');
        let file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
        let written = (&*file).write_all(&bytes).and_then(|_| file.sync_data());
        if let Err(e) = written {
            error!("cannot write the audit log: {e}");
        }
    }
}

/// `2024-05-01T12:34:56.789Z` (UTC, milliseconds).
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86400, secs % 86400);
    let (y, m, day) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian
/// (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn times() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_709_251_199_123);
        assert_eq!(rfc3339(t), "2024-02-29T23:59:59.123Z");
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(t), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn client_names() {
        assert_eq!(normalize_client("cn:alice").unwrap(), "cn:alice");
        assert_eq!(normalize_client("psk:bob").unwrap(), "psk:bob");
        assert_eq!(normalize_client("anonymous").unwrap(), "anonymous");
        let colons = (0..32).map(|_| "AB").collect::<Vec<_>>().join(":");
        assert_eq!(
            normalize_client(&format!("sha256:{colons}")).unwrap(),
            format!("sha256:{}", "ab".repeat(32))
        );
        for bad in [
            "alice",
            "cn:",
            "psk:",
            "sha256:abc",
            "x509:a",
            "cn:a\nb",
            "owner",
        ] {
            assert!(normalize_client(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn grants_persist_atomically_and_privately() {
        let dir = tempfile::tempdir().unwrap();
        let g = Grants::load(dir.path()).unwrap();
        assert!(g.list().is_empty());
        g.add("cn:a", "v", Access::ReadOnly).unwrap();
        let fp = format!("sha256:{}", "0".repeat(64));
        g.add(&fp, "v", Access::ReadWrite).unwrap();
        g.add("cn:a", "w", Access::ReadWrite).unwrap();
        let names = ["cn:a".to_owned(), fp];
        assert_eq!(g.access(&names, "v"), Some(Access::ReadWrite));
        assert_eq!(g.access(&names[..1], "v"), Some(Access::ReadOnly));
        assert_eq!(g.access(&names[..1], "x"), None);
        assert_eq!(g.volumes(&names[..1]), ["v", "w"]);
        let path = dir.path().join(GRANTS_FILE);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let again = Grants::load(dir.path()).unwrap();
        assert_eq!(again.list(), g.list());
        assert_eq!(g.remove("cn:a", "x").unwrap(), None);
        assert_eq!(g.remove("cn:a", "v").unwrap(), Some(Access::ReadOnly));
        assert_eq!(g.remove_volume("w").unwrap().len(), 1);
        let again = Grants::load(dir.path()).unwrap();
        assert_eq!(again.list().len(), 1);
        assert!(!dir.path().join("grants.json.tmp").exists());
    }

    #[test]
    fn audit_lines_append() {
        let dir = tempfile::tempdir().unwrap();
        let a = Audit::open(dir.path()).unwrap();
        for event in ["attach", "detach"] {
            a.record(Record {
                event,
                client: "cn:a",
                peer: "127.0.0.1:1",
                volume: Some("v"),
                result: "ok",
                detail: Value::Null,
            });
        }
        let text = std::fs::read_to_string(dir.path().join(AUDIT_FILE)).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1]["event"], "detach");
        assert_eq!(lines[0]["volume"], "v");
        let mode = std::fs::metadata(dir.path().join(AUDIT_FILE))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600);
    }
}
