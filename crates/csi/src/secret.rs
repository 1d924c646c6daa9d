//! CSI secrets → short-lived secret files for the daemon.
//!
//! A CSI request carries its Secret as a map of strings. The fields bulwark reads
//! are `passphrase` (Argon2id, as `--passphrase-file`) or `key` (the bytes of a key
//! file, as `--key-file`), and for a clone whose origin's key is not loaded,
//! `originPassphrase` or `originKey`. The daemon takes secrets only as paths of files
//! (they never cross the control socket, never reach argv or a log), so each secret is
//! written to a 0600 file in a fresh 0700 directory under the secrets directory, handed
//! over by path, and overwritten with zeros and removed when the [`SecretFile`] drops.
//! The bytes in this process live in `Zeroizing` buffers; the request's own map is
//! emptied into them, so no copy waits in it.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use zeroize::Zeroizing;

use crate::pool::{SecretKind, SecretPath};

/// Longest secret taken (the daemon's own bound on secret files).
pub const SECRET_BYTES_MAX: usize = 64 << 10;

/// The field names of a volume's own secret and of its origin's.
const OWN: (&str, &str) = ("passphrase", "key");
const ORIGIN: (&str, &str) = ("originPassphrase", "originKey");

/// A secret taken out of a request.
pub struct Secret {
    pub kind: SecretKind,
    bytes: Zeroizing<Vec<u8>>,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret({:?}, redacted)", self.kind)
    }
}

/// The secrets of one request: the volume's own and, maybe, its origin's.
#[derive(Debug, Default)]
pub struct Secrets {
    pub own: Option<Secret>,
    pub origin: Option<Secret>,
}

impl Secrets {
    /// Takes the fields bulwark knows out of `map` (the rest are left; every value is
    /// zeroized when `map` drops). Errors name fields, never values.
    pub fn take(map: &mut HashMap<String, String>) -> Result<Secrets, String> {
        let own = take_one(map, OWN)?;
        let origin = take_one(map, ORIGIN)?;
        for (_, v) in map.drain() {
            drop(Zeroizing::new(v.into_bytes()));
        }
        Ok(Secrets { own, origin })
    }
}

fn take_one(
    map: &mut HashMap<String, String>,
    (passphrase, key): (&str, &str),
) -> Result<Option<Secret>, String> {
    let p = map
        .remove(passphrase)
        .map(|v| Zeroizing::new(v.into_bytes()));
    let k = map.remove(key).map(|v| Zeroizing::new(v.into_bytes()));
    let (kind, bytes, field) = match (p, k) {
        (None, None) => return Ok(None),
        (Some(_), Some(_)) => {
            return Err(format!(
                "the secret has both '{passphrase}' and '{key}': give one of them"
            ))
        }
        (Some(b), None) => (SecretKind::Passphrase, b, passphrase),
        (None, Some(b)) => (SecretKind::Key, b, key),
    };
    if bytes.is_empty() {
        return Err(format!("the secret's '{field}' is empty"));
    }
    if bytes.len() > SECRET_BYTES_MAX {
        return Err(format!(
            "the secret's '{field}' is longer than {} KiB",
            SECRET_BYTES_MAX >> 10
        ));
    }
    let bytes = match kind {
        SecretKind::Passphrase => bytes,
        SecretKind::Key => key_bytes(&bytes).ok_or_else(|| {
            format!(
                "the secret's '{field}' must be a key of 32 bytes written as 64 hex digits \
                 (e.g. openssl rand -hex 32)"
            )
        })?,
    };
    Ok(Some(Secret { kind, bytes }))
}

/// A key given as 64 hex digits (a newline after them allowed), as its 32 bytes.
fn key_bytes(text: &[u8]) -> Option<Zeroizing<Vec<u8>>> {
    let t = text.strip_suffix(b"\n").unwrap_or(text);
    let t = t.strip_suffix(b"\r").unwrap_or(t);
    if t.len() != 64 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = Zeroizing::new(Vec::with_capacity(32));
    for pair in t.chunks(2) {
        out.push(digit(pair[0])? << 4 | digit(pair[1])?);
    }
    Some(out)
}

/// A secret written for the daemon; zeroed and removed on drop.
pub struct SecretFile {
    kind: SecretKind,
    path: PathBuf,
    len: usize,
    // Removed (with the file) after the file is zeroed in `drop`.
    _dir: tempfile::TempDir,
}

impl SecretFile {
    /// Writes `secret` to `DIR/bulwark-csi-XXXX/secret` (0700 directory, 0600 file).
    pub fn write(dir: &Path, secret: &Secret) -> std::io::Result<SecretFile> {
        std::fs::create_dir_all(dir)?;
        use std::os::unix::fs::PermissionsExt;
        let private = tempfile::Builder::new()
            .prefix("bulwark-csi-")
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir_in(dir)?;
        let path = private.path().join("secret");
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        f.write_all(&secret.bytes)?;
        Ok(SecretFile {
            kind: secret.kind,
            path,
            len: secret.bytes.len(),
            _dir: private,
        })
    }

    pub fn as_ref(&self) -> SecretPath<'_> {
        SecretPath {
            kind: self.kind,
            path: &self.path,
        }
    }
}

impl Drop for SecretFile {
    fn drop(&mut self) {
        // Zeros over the secret before the name goes (a tmpfs frees the pages; a disk
        // file system at least loses the bytes from the page cache and the file).
        if let Ok(mut f) = OpenOptions::new().write(true).open(&self.path) {
            let _ = f.write_all(&vec![0u8; self.len]);
            let _ = f.sync_data();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn fields_are_read_and_the_map_emptied() {
        let hex = "00ff".repeat(16);
        let mut m = map(&[("key", &hex), ("originPassphrase", "p0"), ("other", "x")]);
        let s = Secrets::take(&mut m).unwrap();
        assert_eq!(s.own.as_ref().unwrap().kind, SecretKind::Key);
        assert_eq!(*s.own.as_ref().unwrap().bytes, [0u8, 0xff].repeat(16));
        assert!(!format!("{s:?}").contains("00ff"));
        let newline = format!("{hex}\n");
        assert!(Secrets::take(&mut map(&[("key", &newline)])).is_ok());
        let e = Secrets::take(&mut map(&[("key", "k1")])).unwrap_err();
        assert!(e.contains("64 hex digits") && !e.contains("k1"), "{e}");
        assert_eq!(s.origin.as_ref().unwrap().kind, SecretKind::Passphrase);
        assert!(m.is_empty());
        let mut both = map(&[("key", &hex), ("passphrase", "p")]);
        let e = Secrets::take(&mut both).unwrap_err();
        assert!(e.contains("both") && !e.contains("'k'"), "{e}");
        assert!(Secrets::take(&mut map(&[("key", "")])).is_err());
        assert!(Secrets::take(&mut map(&[])).unwrap().own.is_none());
    }

    #[test]
    fn the_file_is_private_and_gone_after() {
        let base = tempfile::tempdir().unwrap();
        let s = Secrets::take(&mut map(&[("passphrase", "correct horse")]))
            .unwrap()
            .own
            .unwrap();
        let f = SecretFile::write(base.path(), &s).unwrap();
        let path = f.as_ref().path.to_path_buf();
        assert_eq!(std::fs::read(&path).unwrap(), b"correct horse");
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(path.parent().unwrap()), 0o700);
        drop(f);
        assert!(!path.exists() && !path.parent().unwrap().exists());
        assert_eq!(std::fs::read_dir(base.path()).unwrap().count(), 0);
    }
}
