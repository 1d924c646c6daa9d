//! The pool key (decision 0008, "Keys"): 32 random bytes in `DIR/pool.key`, made by
//! `pool create`, read at `serve`, never written to a member device. Every pool-level key
//! of format 2 is derived from it (superblock and anchor HMACs, the epoch table, the erase
//! root, the intent log, pool-metadata and unencrypted-lineage epochs), so someone who can
//! write the devices but not read this file can forge none of them.
//!
//! Not wired into the v1 pool yet (step 4 of decision 0008 makes `pool create` write it).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use zeroize::Zeroizing;

use super::epoch::hkdf;
use crate::{Error, Result};

pub struct PoolKey(Zeroizing<[u8; 32]>);

impl std::fmt::Debug for PoolKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PoolKey(<redacted>)")
    }
}

impl PoolKey {
    /// Make a new pool key at `path`: created exclusively (an existing file is never
    /// overwritten: it may be the only copy of another pool's key), mode 0600, synced with
    /// its directory before it is used.
    pub fn create(path: &Path) -> Result<PoolKey> {
        let key = PoolKey(Zeroizing::new(super::wrap::random_bytes::<32>()));
        key.save(path)?;
        Ok(key)
    }

    /// Write this key to a new file at `path` (as `create` does): `bulwark pool import`
    /// puts the key it is given into the pool's new directory.
    pub fn save(&self, path: &Path) -> Result<()> {
        let key = &self.0;
        let cannot = |e: std::io::Error| {
            Error::Invalid(format!(
                "cannot create the pool key {}: {e}",
                path.display()
            ))
        };
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => Error::Exists(format!(
                    "{} already exists; a pool key is never overwritten (move it away if it is \
                     not needed)",
                    path.display()
                )),
                _ => cannot(e),
            })?;
        file.write_all(&key[..]).map_err(cannot)?;
        file.sync_all().map_err(cannot)?;
        if let Some(dir) = path.parent() {
            let dir = if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            };
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(cannot)?;
        }
        Ok(())
    }

    /// Read the pool key at `path`: a private regular file of this user or root (as every
    /// secret file), exactly 32 bytes.
    pub fn load(path: &Path) -> Result<PoolKey> {
        super::read_key32(path, "pool key", "it is not a pool key (32 random bytes)").map(PoolKey)
    }

    /// The base of pool-metadata and unencrypted-lineage epochs (`epoch::EpochWriter`).
    pub fn base(&self) -> Zeroizing<[u8; 32]> {
        self.0.clone()
    }

    /// HMAC key of every superblock (and log-device label) of pool `pool_id`.
    pub fn superblock_key(&self, pool_id: &[u8; 16]) -> Zeroizing<[u8; 32]> {
        hkdf(&self.0[..], pool_id, &[b"bulwark2 superblock"])
    }

    /// HMAC key of the anchor slots of pool `pool_id`.
    pub fn anchor_key(&self, pool_id: &[u8; 16]) -> Zeroizing<[u8; 32]> {
        hkdf(&self.0[..], pool_id, &[b"bulwark2 anchor"])
    }

    /// One-time GMAC key of the epoch table a superblock with `epoch_salt` points at.
    pub fn epoch_table_key(&self, epoch_salt: &[u8; 16]) -> Zeroizing<[u8; 32]> {
        hkdf(&self.0[..], epoch_salt, &[b"bulwark2 epochs"])
    }

    /// The erase root of a superblock with `erase_salt`: keyrings are sealed under keys
    /// derived from it, so a new erase salt makes a crypto-erased keyring unreadable.
    pub fn erase_root(&self, erase_salt: &[u8; 16]) -> Zeroizing<[u8; 32]> {
        hkdf(&self.0[..], erase_salt, &[b"bulwark2 erase"])
    }

    /// GMAC key of the intent-log blocks written after a superblock with `log_salt`.
    pub fn log_key(&self, log_salt: &[u8; 16]) -> Zeroizing<[u8; 32]> {
        hkdf(&self.0[..], log_salt, &[b"bulwark2 log"])
    }
}

/// The member devices among `devices` that lie on the same filesystem as the key file
/// `key` (same `st_dev`): a disk that holds both gives its thief the devices and the key,
/// and an unencrypted volume on it cannot resist them (`pool create` refuses it unless
/// told, `status` says it).
pub fn devices_beside(key: &Path, devices: &[PathBuf]) -> Result<Vec<PathBuf>> {
    use std::os::unix::fs::MetadataExt;
    let dev_of = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| m.dev())
            .map_err(|e| Error::Invalid(format!("cannot stat {}: {e}", p.display())))
    };
    let key_dev = dev_of(key)?;
    let mut beside = Vec::new();
    for d in devices {
        if dev_of(d)? == key_dev {
            beside.push(d.clone());
        }
    }
    Ok(beside)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_key_is_made_private_never_overwritten_and_read_back() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool.key");
        let made = PoolKey::create(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(matches!(PoolKey::create(&path), Err(Error::Exists(_))));
        let read = PoolKey::load(&path).unwrap();
        assert_eq!(*made.base(), *read.base());
        assert_eq!(format!("{read:?}"), "PoolKey(<redacted>)");
    }

    #[test]
    fn a_file_that_is_not_a_pool_key_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let short = dir.path().join("short");
        std::fs::write(&short, [1u8; 31]).unwrap();
        std::fs::set_permissions(&short, std::fs::Permissions::from_mode(0o600)).unwrap();
        let e = PoolKey::load(&short).unwrap_err().to_string();
        assert!(e.contains("31 bytes"), "{e}");
        let open = dir.path().join("open");
        std::fs::write(&open, [1u8; 32]).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = PoolKey::load(&open).unwrap_err().to_string();
        assert!(e.contains("accessible by other users"), "{e}");
    }

    #[test]
    fn each_pool_level_key_is_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let k = PoolKey::create(&dir.path().join("pool.key")).unwrap();
        let keys = [
            k.superblock_key(&[1; 16]),
            k.superblock_key(&[2; 16]),
            k.anchor_key(&[1; 16]),
            k.epoch_table_key(&[1; 16]),
            k.erase_root(&[1; 16]),
            k.log_key(&[1; 16]),
        ];
        let distinct: std::collections::HashSet<[u8; 32]> = keys.iter().map(|k| **k).collect();
        assert_eq!(distinct.len(), keys.len());
        assert!(
            !keys.iter().any(|d| **d == *k.base()),
            "no derived key is the pool key"
        );
    }

    #[test]
    fn devices_on_the_key_s_filesystem_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("pool.key");
        PoolKey::create(&key).unwrap();
        let dev = dir.path().join("dev0");
        std::fs::write(&dev, b"").unwrap();
        assert_eq!(
            devices_beside(&key, std::slice::from_ref(&dev)).unwrap(),
            [dev]
        );
    }
}
