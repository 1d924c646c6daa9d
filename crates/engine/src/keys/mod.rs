//! Secrets from files: passphrases and 32-byte key files. Never from argv, never logged.
//!
//! A `Secret` zeroizes itself on drop and has no `Debug` output beyond its kind; a secret
//! file over 64 KiB is refused.
//!
//! The modules: [`wrap`], key slots (a KEK from Argon2id or a key file wraps the volume
//! master key); [`ring`], data keys by generation and the block keys derived from them
//! (salted with the run's random salt, `Store::run_salt`, for new writes; for each older
//! run's salt a pointer names, from a small cache; unsalted for format 1 blocks);
//! [`pool_key`], the pool key file (`DIR/pool.key`) and the superblock and intent-log keys
//! derived from it; [`hkdf`], HKDF-SHA256.

use std::path::Path;
use zeroize::Zeroizing;

use crate::{Error, Result};

pub mod hkdf;
pub mod pool_key;
pub mod ring;
pub mod wrap;
pub use wrap::{KeySlot, SlotKind};

/// An unlock secret as the user gave it.
pub enum Secret {
    /// Bytes of a passphrase file, trailing newline removed; stretched with Argon2id.
    Passphrase(Zeroizing<Vec<u8>>),
    /// A 32-byte raw key file; used directly as the wrapping key.
    KeyFile(Zeroizing<[u8; 32]>),
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Secret::Passphrase(_) => f.write_str("Secret::Passphrase(<redacted>)"),
            Secret::KeyFile(_) => f.write_str("Secret::KeyFile(<redacted>)"),
        }
    }
}

/// The longest secret file read: a passphrase of 64 KiB is more than anyone types.
const SECRET_FILE_BYTES_MAX: u64 = 64 << 10;

/// Reads a secret file after checking, on the opened file itself (so the
/// checks and the read see the same file): it is a regular file (a symlink
/// is followed, and its target must pass), owned by the user this process
/// runs as or by root, and neither readable nor writable by anyone else.
/// Another user's file, even mode 0600, is refused: whoever owns it can
/// change it, or read it back.
pub fn read_secret_file(path: &Path) -> Result<Zeroizing<Vec<u8>>> {
    use std::io::Read;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
    let cannot = |e: std::io::Error| Error::Invalid(format!("cannot read {}: {e}", path.display()));
    // O_NONBLOCK: a FIFO put in the file's place does not hang the open; it
    // is then refused as not a regular file.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(cannot)?;
    let meta = file.metadata().map_err(cannot)?;
    if !meta.is_file() {
        return Err(Error::Invalid(format!(
            "{} is not a regular file; a secret must be read from a regular file",
            path.display()
        )));
    }
    // SAFETY: geteuid cannot fail and touches no memory.
    let euid = unsafe { libc::geteuid() };
    if meta.uid() != euid && meta.uid() != 0 {
        return Err(Error::Invalid(format!(
            "{} is owned by uid {}, not by this user (uid {euid}) or root; a secret file \
             must belong to the user that reads it: chown {euid} {}",
            path.display(),
            meta.uid(),
            path.display()
        )));
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(Error::Invalid(format!(
            "{} is accessible by other users (mode {mode:04o}); a secret file must be private: chmod 600 {}",
            path.display(),
            path.display()
        )));
    }
    // A secret is a passphrase or a key: its size is bounded, whatever the file claims.
    if meta.len() > SECRET_FILE_BYTES_MAX {
        return Err(Error::Invalid(format!(
            "{} holds {} bytes; a secret file holds at most {SECRET_FILE_BYTES_MAX}",
            path.display(),
            meta.len()
        )));
    }
    let mut bytes = Zeroizing::new(Vec::with_capacity(meta.len() as usize));
    file.take(SECRET_FILE_BYTES_MAX + 1)
        .read_to_end(&mut bytes)
        .map_err(cannot)?;
    if bytes.len() as u64 > SECRET_FILE_BYTES_MAX {
        return Err(Error::Invalid(format!(
            "{} grew past {SECRET_FILE_BYTES_MAX} bytes while it was read",
            path.display()
        )));
    }
    Ok(bytes)
}

/// A secret file that must hold exactly 32 bytes (a key file, the pool key); `what` names
/// it and `hint` says what it should hold, in the error.
pub(crate) fn read_key32(path: &Path, what: &str, hint: &str) -> Result<Zeroizing<[u8; 32]>> {
    let bytes = read_secret_file(path)?;
    if bytes.len() != 32 {
        return Err(Error::Invalid(format!(
            "{what} {} holds {} bytes; {hint}",
            path.display(),
            bytes.len()
        )));
    }
    let mut key = Zeroizing::new([0u8; 32]);
    key.copy_from_slice(&bytes);
    Ok(key)
}

impl Secret {
    pub fn from_passphrase_file(path: &Path) -> Result<Secret> {
        let mut bytes = read_secret_file(path)?;
        while matches!(bytes.last(), Some(b'\n') | Some(b'\r')) {
            bytes.pop();
        }
        if bytes.is_empty() {
            return Err(Error::Invalid(format!(
                "passphrase file {} is empty",
                path.display()
            )));
        }
        Ok(Secret::Passphrase(bytes))
    }

    pub fn from_key_file(path: &Path) -> Result<Secret> {
        read_key32(
            path,
            "key file",
            "a key file must hold exactly 32 random bytes (e.g. head -c 32 /dev/urandom > key)",
        )
        .map(Secret::KeyFile)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn loose_permissions_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("k");
        std::fs::write(&p, [7u8; 32]).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Secret::from_key_file(&p).unwrap_err().to_string();
        assert!(e.contains("mode 0644") && e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(Secret::from_key_file(&p).is_ok());
        std::fs::write(&p, b"pass phrase\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();
        assert!(Secret::from_passphrase_file(&p).is_err());
    }

    /// A huge file given as a passphrase is refused by its size, not read into memory.
    #[test]
    fn an_oversized_secret_file_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("big");
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(8 << 30).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let e = Secret::from_passphrase_file(&p).unwrap_err().to_string();
        assert!(e.contains("at most 65536"), "{e}");
    }

    #[test]
    fn another_users_file_is_refused() {
        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: only root can give a file to another user");
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("k");
        std::fs::write(&p, [7u8; 32]).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::chown(&p, Some(65534), None).unwrap();
        let e = Secret::from_key_file(&p).unwrap_err().to_string();
        assert!(
            e.contains("owned by uid 65534") && e.contains("chown 0"),
            "{e}"
        );
        std::os::unix::fs::chown(&p, Some(0), None).unwrap();
        assert!(Secret::from_key_file(&p).is_ok());
    }

    #[test]
    fn a_fifo_is_refused_without_hanging() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("k");
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string; mkfifo touches nothing else.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = Secret::from_key_file(&p).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }
}
