//! A volume after its creation: its size (`volume resize`: grow online, shrink over
//! holes), the properties `volume get` shows and `volume set` changes, and the space
//! thick volumes reserve.
//!
//! A resize changes the volume's size and the depth of its block map in one commit,
//! under the commit lock: the map grows by levels above its root (`Tree::set_depth`),
//! so no node moves; it shrinks by dropping top levels that hold nothing past the new
//! end. Only the volume's own map changes: its snapshots (a clone's base among them)
//! keep the size and depth they were taken at (`Snap::size_bytes`), and since no node's
//! (level, index) moves when levels come or go above it, trees of different depths still
//! share by place (decision 0009; `Tree::walk_unique` aligns them). So a volume with
//! snapshots, a clone and the origin of clones resize like any other; a rollback brings
//! back the size the snapshot had, a clone starts at its snapshot's size, and a shrink
//! drops only holes of the volume itself (what its snapshots hold past the new end stays
//! theirs).
//!
//! Thick volumes (`volume create --thick`) reserve their whole size: what they have not
//! stored yet is kept from thin volumes' new data (`Store::thin_room`), counted at every
//! commit and at each change of a size or provisioning (`count_reservations`).

use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};

use super::core::Core;
use crate::codec::Compression;
use crate::map::{depth_for, Visit};
use crate::size::format_size;
use crate::volume::VolumeOptions;
use crate::{Error, Result};

/// Longest description, in characters.
pub const DESCRIPTION_CHARS_MAX: usize = 256;

/// Properties `volume set` changes.
pub const SETTABLE: &[&str] = &["compression", "description", "readonly"];

/// Properties `volume get` shows but `volume set` does not change.
pub const READ_ONLY: &[&str] = &[
    "size",
    "blocksize",
    "encryption",
    "keystatus",
    "used",
    "referenced",
    "origin",
    "originkeys",
    "snapshots",
    "created",
    "provisioning",
    "reservation",
];

/// Everything `volume get` shows of one volume.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct VolumeProps {
    pub name: String,
    pub size_bytes: u64,
    pub block_size: u32,
    pub compression: String,
    pub encryption: bool,
    pub locked: bool,
    pub key_slots: usize,
    /// The volume and its snapshots (`zfs get used`).
    pub used_bytes: u64,
    /// What its current data references.
    pub referenced_bytes: u64,
    /// `VOL@SNAP` for a clone.
    pub origin: Option<String>,
    /// Data keys this clone holds copies of, inherited from its origin (issue 41): with
    /// the clone's secret and the devices they open the origin's data up to the clone
    /// (all it held then, blocks overwritten after the snapshot and newer snapshots
    /// included). 0 once `--independent` or a key rotation dropped them, or for a volume
    /// that is no clone.
    #[serde(default)]
    pub inherited_keys: usize,
    /// Its snapshots, oldest first, as `VOL@SNAP`.
    pub snapshots: Vec<String>,
    /// Seconds since the epoch; 0 when not recorded (volumes made before it was).
    pub created: u64,
    pub description: String,
    pub readonly: bool,
    pub thick: bool,
}

/// What a resize did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Resized {
    pub name: String,
    pub old_bytes: u64,
    pub new_bytes: u64,
    /// The block map's depth before and after.
    pub old_depth: u8,
    pub new_depth: u8,
}

fn on_off(value: &str) -> Result<bool> {
    match value {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(Error::Invalid(format!(
            "invalid value '{value}': expected on or off"
        ))),
    }
}

impl Core {
    pub fn volume_props(&self, name: &str) -> Result<VolumeProps> {
        let st = self.find(name)?;
        let space = self.volume_space(Some(name))?.pop().unwrap_or_default();
        let status = st.status();
        let snapshots = st
            .snapshots()
            .iter()
            .filter(|s| !s.base)
            .map(|s| format!("{name}@{}", s.name))
            .collect();
        let description = st.description();
        let inherited_keys = st
            .data_keys()
            .iter()
            .filter(|r| r.lineage.is_some())
            .count();
        Ok(VolumeProps {
            name: status.name,
            size_bytes: status.size_bytes,
            block_size: status.block_size,
            compression: status.compression,
            encryption: status.encryption,
            locked: status.locked,
            key_slots: status.key_slots,
            used_bytes: space.used_bytes,
            referenced_bytes: space.referenced_bytes,
            origin: status.origin,
            inherited_keys,
            snapshots,
            created: st.created(),
            description,
            readonly: status.readonly,
            thick: status.thick,
        })
    }

    /// Change one property of volume `name` (`SETTABLE`), durably (one commit).
    pub fn volume_set(&self, name: &str, property: &str, value: &str) -> Result<()> {
        self.store.check_poisoned()?;
        let _c = self.commit_lock.lock();
        let st = self.find(name)?;
        match property {
            "compression" => st.set_compression(value.parse::<Compression>()?),
            "description" => {
                let chars = value.chars().count();
                if chars > DESCRIPTION_CHARS_MAX {
                    return Err(Error::Invalid(format!(
                        "description of {chars} characters: at most {DESCRIPTION_CHARS_MAX}"
                    )));
                }
                if value.chars().any(char::is_control) {
                    return Err(Error::Invalid(
                        "a description is one line of text: no control characters".into(),
                    ));
                }
                st.set_description(value.to_string());
            }
            "readonly" => st.set_readonly(on_off(value)?),
            "size" => {
                return Err(Error::Invalid(format!(
                    "size is changed with 'bulwark volume resize {name} SIZE'"
                )))
            }
            p if READ_ONLY.contains(&p) => {
                return Err(Error::Invalid(format!(
                    "property {p} is read-only (settable: {})",
                    SETTABLE.join(", ")
                )))
            }
            p => {
                return Err(Error::Invalid(format!(
                    "unknown property '{p}' (settable: {})",
                    SETTABLE.join(", ")
                )))
            }
        }
        self.table_dirty.store(true, Ordering::Release);
        self.commit_held()?;
        tracing::info!(volume = name, property, value, "volume property set");
        Ok(())
    }

    /// Grow volume `name` to `size` bytes, or with `shrink` make it smaller. A grow is
    /// online: handles see the new size at once (NBD clients at their next connection).
    /// A shrink needs the volume closed (no handle: NBD clients, scrub, key rotation) and
    /// every block past the new end a hole: refused otherwise, saying how many bytes are
    /// in use there. A thick volume's reservation follows its size.
    pub fn volume_resize(&self, name: &str, size: u64, shrink: bool) -> Result<Resized> {
        self.store.check_poisoned()?;
        let _c = self.commit_lock.lock();
        let st = self.find(name)?;
        let old = st.size();
        let bs = st.block_size() as u64;
        VolumeOptions {
            size_bytes: size,
            block_size: st.block_size(),
            compression: st.compression(),
            encryption: st.is_encrypted(),
        }
        .validate()?;
        let old_depth = st.map().depth;
        let new_depth = depth_for(size / bs);
        let done = || Resized {
            name: name.to_string(),
            old_bytes: old,
            new_bytes: size,
            old_depth,
            new_depth,
        };
        if size == old {
            return Ok(done());
        }
        if size > old {
            if st.is_thick() {
                self.check_reservation(size - old)?;
            }
            let mut tree = st.map();
            tree.set_depth(&*self.store, self.store.nodes(), new_depth, &mut |_, _| {})?;
            st.set_size(size);
            self.store.note_dirty(st.head_dirty(), tree.dirty_nodes());
        } else {
            if !shrink {
                return Err(Error::Invalid(format!(
                    "{} is smaller than volume '{name}' ({}): pass --shrink to shrink it \
                     (refused while anything is stored past the new end)",
                    format_size(size),
                    format_size(old)
                )));
            }
            let clients = st.clients();
            if clients > 0 {
                return Err(self.volume_in_use(name, clients));
            }
            if st.rotation().is_some() {
                return Err(Error::Busy(format!(
                    "volume '{name}' is being re-encrypted (key rotation): shrink it once \
                     the rotation has finished"
                )));
            }
            let (blocks, stored) = self.mapped_past(&st, size / bs, old / bs)?;
            if blocks > 0 {
                return Err(Error::Invalid(format!(
                    "{} of volume '{name}' past {} hold data ({blocks} block(s), {} stored): \
                     a shrink drops only holes; shrink the file system and trim (fstrim, \
                     blkdiscard -o {size}) first",
                    format_size(blocks * bs),
                    format_size(size),
                    format_size(stored)
                )));
            }
            // Map nodes left empty past the end (blocks written, then trimmed) are dropped
            // by a commit: it writes none for an empty node.
            self.commit_held()?;
            let mut gone = Vec::new();
            {
                let mut tree = st.map();
                let snaps = st.snapshots();
                tree.set_depth(&*self.store, self.store.nodes(), new_depth, &mut |l, p| {
                    // A top the newest snapshot still holds (taken at the larger size,
                    // with nothing changed past the new end since) stays its.
                    gone.extend(crate::volume::snap::head_drops(
                        &self.store,
                        &snaps,
                        crate::map::At::Node(l, 0),
                        p,
                    ));
                })?;
                st.set_size(size);
                self.store.note_dirty(st.head_dirty(), tree.dirty_nodes());
            }
            for dead in gone {
                self.store.release(dead);
            }
        }
        self.table_dirty.store(true, Ordering::Release);
        self.commit_held()?;
        self.count_reservations();
        tracing::info!(
            volume = name,
            old,
            new = size,
            old_depth,
            new_depth,
            "volume resized"
        );
        Ok(done())
    }

    /// Blocks `lo..hi` of `st` that hold data, and their stored bytes.
    fn mapped_past(&self, st: &crate::volume::VolumeState, lo: u64, hi: u64) -> Result<(u64, u64)> {
        let tree = st.map();
        let (mut blocks, mut bytes) = (0u64, 0u64);
        tree.walk(&*self.store, self.store.nodes(), lo, hi, &mut |v| {
            match v {
                Visit::Unreadable { error, .. } => {
                    return Err(Error::Corrupt(format!("volume '{}': {error}", st.name())))
                }
                Visit::Data { ptr, .. } => {
                    blocks += 1;
                    bytes += ptr.len as u64;
                }
                Visit::Node { .. } => {}
            }
            Ok(())
        })?;
        Ok((blocks, bytes))
    }

    /// Count what thick volumes have reserved and not stored (`Store::thick_unused`).
    pub(crate) fn count_reservations(&self) {
        let unused: u64 = self
            .volumes
            .read()
            .values()
            .filter(|v| !v.is_deferred())
            .map(|v| v.reservation_unused())
            .sum();
        self.store.set_thick_unused(unused);
    }

    /// Refuses a new reservation of `bytes` when the pool cannot hold it: live data, what
    /// thick volumes already keep and it must fit in what live data may fill.
    pub(crate) fn check_reservation(&self, bytes: u64) -> Result<()> {
        self.count_reservations();
        let unused = self.store.thick_unused();
        let (used, usable) = self.store.used_and_usable();
        let room = usable.saturating_sub(used).saturating_sub(unused);
        if bytes > room {
            return Err(Error::Invalid(format!(
                "the pool cannot reserve {}: {} can still be reserved ({} usable, {} used, {} \
                 already reserved by thick volumes)",
                format_size(bytes),
                format_size(room),
                format_size(usable),
                format_size(used),
                format_size(unused)
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::{DeviceSpec, Layout, OpenOptions, Pool};
    use rand::{Rng, SeedableRng};
    use std::sync::Arc;

    fn opts(size: u64, block_size: u32) -> VolumeOptions {
        VolumeOptions {
            size_bytes: size,
            block_size,
            compression: Compression::Off,
            encryption: false,
        }
    }

    fn pool(dir: &std::path::Path, device_mib: u64) -> Arc<Pool> {
        Pool::create(
            dir,
            Layout::Single,
            DeviceSpec::Files {
                count: 1,
                size_bytes: device_mib << 20,
            },
        )
        .unwrap();
        Pool::open(dir, OpenOptions::default()).unwrap()
    }

    fn reopen(dir: &std::path::Path, p: Arc<Pool>) -> Arc<Pool> {
        p.close().unwrap();
        drop(p);
        Pool::open(dir, OpenOptions::default()).unwrap()
    }

    fn noise(seed: u64, n: usize) -> Vec<u8> {
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| r.random()).collect()
    }

    /// A grow that needs a deeper map (64K blocks: depth 2 holds 256 MiB) keeps every
    /// block, takes writes past the old end at once, and survives a reopen; a shrink over
    /// data is refused with the bytes in use; after a trim it works, and back at the
    /// old depth the data below the end is intact.
    #[test]
    fn grow_deeper_and_shrink_back() {
        let t = tempfile::tempdir().unwrap();
        let mut p = pool(t.path(), 96);
        p.create_volume("v", opts(128 << 20, 65536), None).unwrap();
        let v = p.volume("v").unwrap();
        let a = noise(1, 256 << 10);
        v.write(0, &a, false).unwrap();
        v.write((128 << 20) - (64 << 10), &a[..64 << 10], true)
            .unwrap();
        let r = p.volume_resize("v", 1 << 30, false).unwrap();
        assert_eq!((r.old_depth, r.new_depth), (2, 3));
        assert_eq!(v.size(), 1 << 30, "an open handle sees the new size");
        let b = noise(2, 128 << 10);
        v.write((1 << 30) - (128 << 10), &b, true).unwrap();
        drop(v);
        p = reopen(t.path(), p);
        let v = p.volume("v").unwrap();
        assert_eq!(v.size(), 1 << 30);
        let mut buf = vec![0u8; a.len()];
        v.read(0, &mut buf).unwrap();
        assert_eq!(buf, a);
        let mut buf = vec![0u8; b.len()];
        v.read((1 << 30) - (128 << 10), &mut buf).unwrap();
        assert_eq!(buf, b);

        // Smaller without --shrink, and with handles open: refused.
        let e = p.volume_resize("v", 128 << 20, false).unwrap_err();
        assert!(e.to_string().contains("--shrink"), "{e}");
        let e = p.volume_resize("v", 128 << 20, true).unwrap_err();
        assert!(matches!(e, Error::Busy(_)), "{e}");
        drop(v);
        // Over data: refused with how much is in use past the end.
        let e = p.volume_resize("v", 128 << 20, true).unwrap_err();
        assert!(e.to_string().contains("128K of volume 'v'"), "{e}");
        let used = p.volumes()[0].used_bytes;
        let v = p.volume("v").unwrap();
        v.trim((1 << 30) - (128 << 10), 128 << 10).unwrap();
        drop(v);
        let r = p.volume_resize("v", 128 << 20, true).unwrap();
        assert_eq!((r.old_depth, r.new_depth), (3, 2));
        assert_eq!(p.volumes()[0].used_bytes, used - (128 << 10));
        p = reopen(t.path(), p);
        let v = p.volume("v").unwrap();
        assert_eq!(v.size(), 128 << 20);
        let mut buf = vec![0u8; a.len()];
        v.read(0, &mut buf).unwrap();
        assert_eq!(buf, a);
        let mut tail = vec![0u8; 64 << 10];
        v.read((128 << 20) - (64 << 10), &mut tail).unwrap();
        assert_eq!(tail, a[..64 << 10]);
        assert!(v.read(128 << 20, &mut tail).is_err(), "past the new end");
        // The shrunk pool's space accounting matches a fresh count at import.
        assert_eq!(p.volumes()[0].used_bytes, used - (128 << 10));
        drop(v);
        p.close().unwrap();
    }

    fn read_at(p: &Pool, name: &str, off: u64, len: usize) -> Vec<u8> {
        let v = p.volume(name).unwrap();
        let mut b = vec![0u8; len];
        v.read(off, &mut b).unwrap();
        b
    }

    /// Any volume grows: one with held snapshots, a clone, the origin of clones. Each
    /// snapshot keeps the size it had (`VOL@SNAP` exports it, across a reopen, which needs
    /// table format 3), a clone starts at its snapshot's size and grows on its own, a
    /// rollback brings the old size back, a shrink past what only a snapshot holds works
    /// and leaves the snapshot whole, and destroying everything frees all (the pool's
    /// count equals the import's recount throughout).
    #[test]
    fn any_volume_grows_and_snapshots_keep_their_size() {
        let t = tempfile::tempdir().unwrap();
        let mut p = pool(t.path(), 96);
        // 1 MiB of 4K blocks: 256 blocks, a two-level map (one level holds 64).
        let small = 1u64 << 20;
        p.create_volume("v", opts(small, 4096), None).unwrap();
        let a = noise(1, small as usize);
        p.volume("v").unwrap().write(0, &a, true).unwrap();
        p.snapshot_create("v", "s1").unwrap();
        p.snapshot_hold("v", "s1", "keep", true).unwrap();
        // Grown two levels (64 MiB: 16384 blocks, depth 3) with a held snapshot and clients.
        let v = p.volume("v").unwrap();
        let r = p.volume_resize("v", 64 << 20, false).unwrap();
        assert_eq!((r.old_depth, r.new_depth), (2, 3));
        assert_eq!(v.size(), 64 << 20, "an open handle sees the new size");
        let b = noise(2, 64 << 10);
        v.write((64 << 20) - (64 << 10), &b, false).unwrap();
        v.write(0, &b, true).unwrap();
        drop(v);
        p.snapshot_create("v", "s2").unwrap();
        assert_eq!(p.volume("v@s1").unwrap().size(), small);
        assert_eq!(read_at(&p, "v@s1", 0, small as usize), a);
        assert!(p
            .volume("v@s1")
            .unwrap()
            .read(small, &mut [0u8; 4096])
            .is_err());
        let sizes: Vec<u64> = p
            .snapshot_list(Some("v"))
            .unwrap()
            .iter()
            .map(|s| s.size_bytes)
            .collect();
        assert_eq!(sizes, vec![small, 64 << 20]);

        // A clone of the small snapshot starts small and grows on its own; the origin grows
        // again with clones.
        p.volume_clone("v", "s1", "c", None).unwrap();
        assert_eq!(p.volume("c").unwrap().size(), small);
        p.volume_resize("c", 32 << 20, false).unwrap();
        let cb = noise(3, 8192);
        p.volume("c")
            .unwrap()
            .write((32 << 20) - 8192, &cb, true)
            .unwrap();
        p.volume_resize("v", 1 << 30, false).unwrap();
        p.snapshot_create("c", "cs").unwrap();
        let used = p.status().space.used_bytes;
        p = reopen(t.path(), p);
        assert_eq!(
            p.status().space.used_bytes,
            used,
            "the import's recount agrees"
        );
        for (name, size) in [
            ("v", 1 << 30),
            ("v@s1", small),
            ("v@s2", 64 << 20),
            ("c", 32 << 20),
            ("c@cs", 32 << 20),
        ] {
            assert_eq!(p.volume(name).unwrap().size(), size, "{name}");
        }
        assert_eq!(read_at(&p, "v@s1", 0, small as usize), a);
        assert_eq!(read_at(&p, "c", 0, small as usize), a);
        assert_eq!(read_at(&p, "c", (32 << 20) - 8192, 8192), cb);
        assert_eq!(read_at(&p, "v@s2", (64 << 20) - (64 << 10), 64 << 10), b);
        assert_eq!(read_at(&p, "v", (64 << 20) - (64 << 10), 64 << 10), b);

        // Back to s2: its size comes back, the newer data goes.
        p.volume("v")
            .unwrap()
            .write((1 << 30) - 4096, &[7u8; 4096], true)
            .unwrap();
        p.volume_rollback("v", "s2", false).unwrap();
        assert_eq!(p.volume("v").unwrap().size(), 64 << 20);
        assert_eq!(read_at(&p, "v", 0, 64 << 10), b);
        // Shrink below s2's data: the head's blocks past the end must be holes (trimmed),
        // s2 keeps its own.
        let e = p.volume_resize("v", small, true).unwrap_err();
        assert!(e.to_string().contains("hold data"), "{e}");
        p.volume("v")
            .unwrap()
            .trim(small, (64 << 20) - small)
            .unwrap();
        let r = p.volume_resize("v", small, true).unwrap();
        assert_eq!((r.old_depth, r.new_depth), (3, 2));
        assert_eq!(read_at(&p, "v@s2", (64 << 20) - (64 << 10), 64 << 10), b);
        let used = p.status().space.used_bytes;
        p = reopen(t.path(), p);
        assert_eq!(
            p.status().space.used_bytes,
            used,
            "the import's recount agrees"
        );
        assert_eq!(read_at(&p, "v@s2", (64 << 20) - (64 << 10), 64 << 10), b);
        // Back to s2 again: the grown size and its data return.
        p.volume_rollback("v", "s2", false).unwrap();
        assert_eq!(p.volume("v").unwrap().size(), 64 << 20);
        assert_eq!(read_at(&p, "v", (64 << 20) - (64 << 10), 64 << 10), b);

        // Everything goes: nothing is left behind, nothing freed twice.
        p.destroy_volume_recursive("c", true).unwrap();
        p.snapshot_hold("v", "s1", "keep", false).unwrap();
        p.snapshot_destroy("v", "s2").unwrap();
        p.snapshot_destroy("v", "s1").unwrap();
        let used = p.status().space.used_bytes;
        p = reopen(t.path(), p);
        assert_eq!(
            p.status().space.used_bytes,
            used,
            "the import's recount agrees"
        );
        p.destroy_volume_recursive("v", true).unwrap();
        p = reopen(t.path(), p);
        assert!(
            p.status().space.used_bytes < 64 << 10,
            "{:?}",
            p.status().space
        );
        p.close().unwrap();
    }

    /// Properties set are durable; readonly refuses every kind of write with EPERM;
    /// compression applies to new writes.
    #[test]
    fn properties_round_trip() {
        let t = tempfile::tempdir().unwrap();
        let mut p = pool(t.path(), 64);
        p.create_volume("v", opts(8 << 20, 4096), None).unwrap();
        let before = p.volume_props("v").unwrap();
        assert!(before.created > 0 && !before.readonly && before.description.is_empty());
        p.volume_set("v", "description", "db server, ticket 12")
            .unwrap();
        p.volume_set("v", "compression", "lz4").unwrap();
        p.volume_set("v", "readonly", "on").unwrap();
        for (prop, value, want) in [
            ("compression", "zstd", "invalid compression"),
            ("readonly", "yes", "expected on or off"),
            ("size", "1G", "volume resize"),
            ("used", "1", "read-only"),
            ("colour", "red", "unknown property"),
            ("description", "a\nb", "control characters"),
        ] {
            let e = p.volume_set("v", prop, value).unwrap_err().to_string();
            assert!(e.contains(want), "{prop}={value}: {e}");
        }
        let long = "x".repeat(DESCRIPTION_CHARS_MAX + 1);
        assert!(p.volume_set("v", "description", &long).is_err());
        p = reopen(t.path(), p);
        let props = p.volume_props("v").unwrap();
        assert_eq!(props.description, "db server, ticket 12");
        assert_eq!(props.compression, "lz4");
        assert!(props.readonly);
        assert_eq!(props.created, before.created);
        let v = p.volume("v").unwrap();
        assert!(v.is_read_only());
        for e in [
            v.write(0, &[1u8; 4096], false).unwrap_err(),
            v.write_zeroes(0, 4096, false).unwrap_err(),
            v.trim(0, 4096).unwrap_err(),
        ] {
            assert_eq!(e.errno(), libc::EPERM, "{e}");
        }
        p.volume_set("v", "readonly", "off").unwrap();
        v.write(0, &vec![b'a'; 64 << 10], true).unwrap();
        assert!(
            p.volumes()[0].used_bytes < 16 << 10,
            "lz4 applies to new writes"
        );
        drop(v);
        p.close().unwrap();
    }

    /// A thick volume's size is reserved: a reservation the pool cannot hold is refused,
    /// thin volumes' new data stops short of it (ENOSPC), and the thick volume can still
    /// write all of it.
    #[test]
    fn thick_reservations_hold() {
        let t = tempfile::tempdir().unwrap();
        let p = pool(t.path(), 64);
        let usable = p.status().space.usable_bytes;
        let e = p
            .create_volume_provisioned("huge", opts(usable + (1 << 20), 4096), None, true)
            .unwrap_err();
        assert!(e.to_string().contains("cannot reserve"), "{e}");
        assert!(p.volumes().is_empty(), "nothing created");
        p.create_volume_provisioned("thick", opts(16 << 20, 4096), None, true)
            .unwrap();
        assert!(p.volumes()[0].thick);
        assert_eq!(p.status().space.thick_reserved_bytes, 16 << 20);
        p.create_volume("thin", opts(256 << 20, 4096), None)
            .unwrap();
        let thin = p.volume("thin").unwrap();
        let chunk = 1 << 20;
        let mut written = 0u64;
        let refused = loop {
            match thin.write(written, &noise(written, chunk), true) {
                Ok(()) => written += chunk as u64,
                Err(e) => break e,
            }
            assert!(written < 256 << 20, "the thin volume never stopped");
        };
        assert!(matches!(refused, Error::NoSpace), "{refused}");
        let st = p.status();
        assert!(
            st.space.used_bytes + (16 << 20) <= usable + 2 * chunk as u64,
            "thin data ran into the reservation: {:?}",
            st.space
        );
        let thick = p.volume("thick").unwrap();
        for i in 0..16u64 {
            thick
                .write(i * chunk as u64, &noise(1000 + i, chunk), true)
                .unwrap();
        }
        drop((thin, thick));
        p.close().unwrap();
    }
}
