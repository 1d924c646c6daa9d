//! The pool key (decision 0011): 32 random bytes in `DIR/pool.key`, made by `pool create`
//! (or `pool upgrade`), read at every import, never written to a member device. The keys
//! of the superblocks' and intent log blocks' MACs are derived from it, so someone who can
//! write the devices but not read this file can forge neither.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use zeroize::Zeroizing;

use super::hkdf::hkdf;
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

    /// MAC key of every superblock of pool `pool_id` (a log device's label is not MACed:
    /// the superblock names the log devices by id; their blocks carry the log key's MAC).
    pub fn superblock_key(&self, pool_id: &[u8; 16]) -> Zeroizing<[u8; 32]> {
        hkdf(&self.0[..], pool_id, &[b"bulwark2 superblock"])
    }

    /// MAC key of the intent-log blocks of pool `pool_id`.
    pub fn log_key(&self, pool_id: &[u8; 16]) -> Zeroizing<[u8; 32]> {
        hkdf(&self.0[..], pool_id, &[b"bulwark2 log"])
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
        assert_eq!(*made.0, *read.0);
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
            k.log_key(&[1; 16]),
            k.log_key(&[2; 16]),
        ];
        let distinct: std::collections::HashSet<[u8; 32]> = keys.iter().map(|k| **k).collect();
        assert_eq!(distinct.len(), keys.len());
        assert!(
            !keys.iter().any(|d| **d == *k.0),
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
