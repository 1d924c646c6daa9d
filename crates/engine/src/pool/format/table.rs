//! The volume table: the record the superblock points to.
//!
//! JSON, sealed with AES-256-GCM under the table key that only the superblock holds (so
//! replacing that key erases every older table: crypto-erase, `pool::keys`), inside a
//! checksummed, lz4-compressed record written with `METADATA_COPIES` copies at every
//! commit. It holds no secret unwrapped: key slots and data keys are wrapped. JSON keeps
//! the table readable once opened and lets fields be added without a format bump; it is
//! small (about 1 KiB per volume). Its format is 1, 2 once snapshots or clones exist, 3
//! once a snapshot's size differs from its volume's (`TABLE_FORMAT_MAX`).
//!
//! `TableRecord::check` refuses at open what no command writes, even sealed under the
//! pool key: encryption off beside key slots or data keys, a name, id or uuid given twice.

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use serde::{Deserialize, Serialize};

const TABLE_AAD: &[u8] = b"bulwark volume table v1";

use crate::codec::Compression;
use crate::hex::hex16;
use crate::keys::wrap::KeySlot;
use crate::map::{Blkptr, BLKPTR_BYTES};
use crate::{Error, Result};

/// The table's format: 1, or 2 once a volume has snapshots or is a clone (records an
/// older bulwark would not know it must keep), or 3 once a snapshot's size differs from
/// its volume's (`SnapshotRecord::size_bytes`: an older bulwark would read its tree at
/// the volume's depth). Import refuses a newer one.
pub const TABLE_FORMAT_MAX: u32 = 3;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TableRecord {
    pub format: u32,
    pub next_volume_id: u64,
    pub volumes: Vec<VolumeRecord>,
    #[serde(default)]
    pub scrub: super::health::ScrubState,
    /// Ranges no copy could supply, as `status` lists them.
    #[serde(default)]
    pub errors: Vec<super::health::DataError>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VolumeRecord {
    pub id: u64,
    #[serde(with = "hex16")]
    pub uuid: [u8; 16],
    pub name: String,
    pub size_bytes: u64,
    pub block_size: u32,
    pub compression: Compression,
    pub encryption: bool,
    /// Root of the block map (hex of the 64-byte block pointer).
    pub root: String,
    /// Wrappings of the volume master key.
    pub slots: Vec<KeySlot>,
    /// Data keys by generation, wrapped by the volume master key.
    #[serde(default)]
    pub data_keys: Vec<crate::keys::ring::DataKeyRecord>,
    /// A key rotation in progress.
    #[serde(default)]
    pub rotation: Option<crate::volume::rotation::Rotation>,
    /// Snapshots, oldest first (a clone's base first).
    #[serde(default)]
    pub snapshots: Vec<SnapshotRecord>,
    /// The snapshot this volume was cloned from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<crate::volume::snap::Origin>,
    /// Destroyed, kept for the clones of its snapshots (`VolumeState::deferred`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deferred: bool,
    /// Free text (`volume set NAME description=...`), at most 256 characters.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    /// Exported read-only, every write refused (`volume set NAME readonly=on`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub readonly: bool,
    /// When it was created (seconds since the epoch; 0 for volumes made before this field).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub created: u64,
    /// Its whole size is reserved in the pool (`volume create --thick`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub thick: bool,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One snapshot in the table: its map's root and what `snapshot list` shows.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub name: String,
    /// Its tree's id (namespace in the node cache, unique in the pool).
    pub id: u64,
    /// Root of its block map (hex of the 64-byte block pointer).
    pub root: String,
    pub created: u64,
    #[serde(default)]
    pub holds: Vec<String>,
    pub referenced: u64,
    /// A clone's base (`volume::snap::Snap::base`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub base: bool,
    /// The volume's size at the snapshot, when it differs from the volume's size now (the
    /// volume was resized since); absent (0) otherwise, and in every table written before
    /// volumes with snapshots could be resized. Written only when it differs, so a table
    /// without resized snapshots stays readable by an older bulwark (format 2).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub size_bytes: u64,
}

impl SnapshotRecord {
    /// The record of snapshot `s` of a volume of `volume_bytes`.
    pub fn of(s: &crate::volume::snap::Snap, volume_bytes: u64) -> SnapshotRecord {
        SnapshotRecord {
            size_bytes: if s.size_bytes == volume_bytes {
                0
            } else {
                s.size_bytes
            },
            name: s.name.clone(),
            id: s.tree.id,
            root: ptr_to_hex(&s.tree.root),
            created: s.created,
            holds: s.holds.iter().cloned().collect(),
            referenced: s.referenced,
            base: s.base,
        }
    }
}

/// Random nonce ‖ AES-256-GCM of `json` under `table_key` ‖ tag.
fn seal_json(mut json: Vec<u8>, table_key: &[u8; 32]) -> Vec<u8> {
    let key = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, table_key).expect("32-byte key"));
    let nonce = crate::keys::wrap::random_bytes::<12>();
    let mut out = nonce.to_vec();
    key.seal_in_place_append_tag(
        Nonce::assume_unique_for_key(nonce),
        Aad::from(TABLE_AAD),
        &mut json,
    )
    .expect("sealing the table");
    out.extend_from_slice(&json);
    out
}

impl VolumeRecord {
    /// The record's geometry as the options it was created with, refused as `Corrupt` when
    /// no `volume create` could have made it: block size a power of two from
    /// `BLOCK_BYTES_MIN` to `BLOCK_BYTES_MAX`, size from one block to `VOLUME_BYTES_MAX`
    /// and a whole number of blocks. Bytes from disk: a block size of 0 would divide by
    /// zero and a size of 0 would give no tree depth.
    pub fn options(&self) -> Result<crate::volume::VolumeOptions> {
        let opts = crate::volume::VolumeOptions {
            size_bytes: self.size_bytes,
            block_size: self.block_size,
            compression: self.compression,
            encryption: self.encryption,
        };
        opts.validate().map_err(|e| {
            Error::Corrupt(format!(
                "volume table: the record of volume '{}' (id {}) is damaged: {e}",
                self.name, self.id
            ))
        })?;
        Ok(opts)
    }

    /// The size of snapshot `s` of this volume, refused as `Corrupt` when no volume of this
    /// block size could have had it (as `options` does for the volume's own size).
    pub fn snapshot_bytes(&self, s: &SnapshotRecord) -> Result<u64> {
        let size_bytes = if s.size_bytes == 0 {
            self.size_bytes
        } else {
            s.size_bytes
        };
        crate::volume::VolumeOptions {
            size_bytes,
            block_size: self.block_size,
            compression: self.compression,
            encryption: self.encryption,
        }
        .validate()
        .map_err(|e| {
            Error::Corrupt(format!(
                "volume table: the record of snapshot '{}@{}' is damaged: {e}",
                self.name, s.name
            ))
        })?;
        Ok(size_bytes)
    }
}

pub fn ptr_to_hex(p: &Blkptr) -> String {
    let mut b = [0u8; BLKPTR_BYTES];
    p.encode(&mut b);
    crate::hex::to_hex(&b)
}

pub fn ptr_from_hex(s: &str) -> Result<Blkptr> {
    let b = crate::hex::from_hex(s).filter(|b| b.len() == BLKPTR_BYTES);
    let b =
        b.ok_or_else(|| Error::Corrupt("volume table holds a malformed root pointer".into()))?;
    Blkptr::decode(&b).map_err(|e| e.within("volume table root"))
}

impl TableRecord {
    pub fn empty() -> TableRecord {
        TableRecord {
            format: 1,
            next_volume_id: 1,
            volumes: Vec::new(),
            scrub: Default::default(),
            errors: Vec::new(),
        }
    }
    /// JSON sealed with AES-256-GCM under the superblock's table key: random nonce ‖ ciphertext ‖ tag.
    pub fn seal(&self, table_key: &[u8; 32]) -> Vec<u8> {
        seal_json(
            serde_json::to_vec(self).expect("table serialises"),
            table_key,
        )
    }
    pub fn open(b: &[u8], table_key: &[u8; 32]) -> Result<TableRecord> {
        if b.len() < 12 + 16 {
            return Err(Error::Corrupt("volume table record is too short".into()));
        }
        let key = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, table_key).expect("32-byte key"));
        let nonce = Nonce::try_assume_unique_for_key(&b[..12])
            .map_err(|_| Error::Corrupt("table nonce".into()))?;
        let mut body = b[12..].to_vec();
        let json = key
            .open_in_place(nonce, Aad::from(TABLE_AAD), &mut body)
            .map_err(|_| {
                Error::Corrupt(
                    "volume table failed authentication under the superblock's table key".into(),
                )
            })?;
        let t: TableRecord = serde_json::from_slice(json)
            .map_err(|e| Error::Corrupt(format!("volume table: {e}")))?;
        t.check()?;
        Ok(t)
    }

    /// What no sequence of commands could have written, refused as `Corrupt` (the table
    /// authenticates under the pool key, which a forger may hold: it must not turn an
    /// encrypted volume's later writes into plaintext or hide one volume behind another):
    /// - two volumes with one name, id or uuid (the volumes are kept by name, so one would
    ///   silently replace the other; a uuid is in the AAD of every block);
    /// - a volume with encryption off that holds key slots or data keys (every volume is
    ///   created encrypted or not for its whole life; a crypto-erase empties the slots of
    ///   an encrypted volume, it never turns encryption off).
    pub fn check(&self) -> Result<()> {
        let mut names = std::collections::HashSet::new();
        let mut ids = std::collections::HashSet::new();
        let mut uuids = std::collections::HashSet::new();
        for v in &self.volumes {
            let damaged = |what: &str| {
                Error::Corrupt(format!(
                    "volume table: the record of volume '{}' (id {}) {what}: no command writes \
                     that; the table was altered by someone holding the pool key, or damaged",
                    v.name, v.id
                ))
            };
            if !names.insert(v.name.as_str()) {
                return Err(damaged("repeats the name of another volume"));
            }
            if !ids.insert(v.id) {
                return Err(damaged("repeats the id of another volume"));
            }
            if !uuids.insert(v.uuid) {
                return Err(damaged("repeats the uuid of another volume"));
            }
            if !v.encryption && (!v.slots.is_empty() || !v.data_keys.is_empty()) {
                return Err(damaged(
                    "says encryption is off but holds key slots or data keys",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{wrap, Secret, SlotKind};
    use zeroize::Zeroizing;

    /// Volume `id` (uuid `[id; 16]`, 1 MiB of 4 KiB blocks, no data) as `volume create`
    /// records it: encrypted with one key-file slot for `kf` and one data key, or not.
    fn record(id: u64, encryption: bool, vmk: &Zeroizing<[u8; 32]>, kf: &Secret) -> VolumeRecord {
        let uuid = [id as u8; 16];
        VolumeRecord {
            id,
            uuid,
            name: format!("v{id}"),
            size_bytes: 1 << 20,
            block_size: 4096,
            compression: Compression::Lz4,
            encryption,
            root: ptr_to_hex(&Blkptr::HOLE),
            slots: if encryption {
                vec![wrap::wrap(vmk, kf, &uuid).unwrap()]
            } else {
                vec![]
            },
            data_keys: if encryption {
                vec![crate::keys::ring::new_data_key(vmk, &uuid, 1)]
            } else {
                vec![]
            },
            rotation: None,
            snapshots: vec![],
            origin: None,
            deferred: false,
            description: String::new(),
            readonly: false,
            created: 0,
            thick: false,
        }
    }

    /// A snapshot record of a pool written before snapshots had sizes of their own (no
    /// `size_bytes`) has its volume's size; one that names a size keeps it, and a size no
    /// volume could have is refused as `Corrupt`. The size is written only when it differs.
    #[test]
    fn snapshot_sizes_old_and_new() {
        let kf = Secret::KeyFile(Zeroizing::new([2; 32]));
        let v = record(1, false, &wrap::new_data_key(), &kf);
        let old: SnapshotRecord = serde_json::from_str(
            r#"{"name":"s","id":9,"root":"00","created":1,"holds":[],"referenced":0}"#,
        )
        .unwrap();
        assert_eq!(v.snapshot_bytes(&old).unwrap(), 1 << 20);
        let grown = SnapshotRecord {
            size_bytes: 64 << 10,
            ..old.clone()
        };
        assert_eq!(v.snapshot_bytes(&grown).unwrap(), 64 << 10);
        for bad in [4095, crate::constants::VOLUME_BYTES_MAX + 4096] {
            let e = v
                .snapshot_bytes(&SnapshotRecord {
                    size_bytes: bad,
                    ..old.clone()
                })
                .unwrap_err();
            assert!(matches!(e, Error::Corrupt(_)), "{e}");
        }
        assert!(!serde_json::to_string(&old).unwrap().contains("size_bytes"));
        assert!(serde_json::to_string(&grown)
            .unwrap()
            .contains("size_bytes"));
    }

    /// A table no command writes is refused at open, even sealed under the right key:
    /// encryption off beside key slots or data keys, a name, id or uuid given twice.
    #[test]
    fn open_refuses_what_no_command_writes() {
        let table_key = [7u8; 32];
        let kf = Secret::KeyFile(Zeroizing::new([2; 32]));
        let vol = |id: u64, name: &str, encryption: bool| VolumeRecord {
            name: name.into(),
            ..record(id, encryption, &wrap::new_data_key(), &kf)
        };
        let open = |vols: Vec<VolumeRecord>| {
            let mut t = TableRecord::empty();
            t.volumes = vols;
            TableRecord::open(&t.seal(&table_key), &table_key)
        };
        assert!(open(vec![vol(1, "enc", true), vol(2, "pl", false)]).is_ok());
        // A crypto-erased volume: encrypted, no slots left.
        let mut erased = vol(1, "enc", true);
        erased.slots.clear();
        assert!(open(vec![erased]).is_ok());

        let refused = |vols: Vec<VolumeRecord>, why: &str| match open(vols) {
            Err(Error::Corrupt(m)) => assert!(m.contains(why), "{m}"),
            other => panic!("{why}: {:?}", other.map(|_| ())),
        };
        let mut off = vol(1, "enc", true);
        off.encryption = false;
        refused(vec![off.clone()], "encryption is off but holds key slots");
        off.slots.clear();
        refused(
            vec![off],
            "encryption is off but holds key slots or data keys",
        );
        refused(
            vec![vol(1, "enc", true), vol(2, "enc", false)],
            "repeats the name",
        );
        refused(
            vec![vol(1, "a", true), vol(1, "b", false)],
            "repeats the id",
        );
        let mut twin = vol(2, "b", false);
        twin.uuid = [1; 16];
        refused(vec![vol(1, "a", true), twin], "repeats the uuid");
    }

    /// Every part of the table that import and key load decode from its JSON (the
    /// record, each volume's geometry and root pointer, key slots, data keys) gives `Ok`
    /// or `Corrupt` for mutated JSON sealed under the right key (half the cases) or
    /// mutated ciphertext (the rest). Passphrase slots are only cost-checked here: a
    /// mutant inside the bounds would run Argon2 for real.
    #[test]
    fn open_and_every_record_check_never_panic() {
        let table_key = [5u8; 32];
        let uuid = [3u8; 16];
        let kf = Secret::KeyFile(Zeroizing::new([1; 32]));
        let vmk = wrap::new_data_key();
        let mut slot_pp = wrap::wrap(&vmk, &kf, &uuid).unwrap();
        slot_pp.kind = SlotKind::Passphrase {
            m_kib: 65536,
            t: 3,
            p: 1,
        };
        // Every volume its own uuid, as `TableRecord::check` asks.
        let rec = |id: u64, size_bytes: u64, block_size: u32, encryption: bool| {
            let mut r = record(id, encryption, &vmk, &kf);
            r.size_bytes = size_bytes;
            r.block_size = block_size;
            r.root = ptr_to_hex(&Blkptr {
                addr: [1 << 20, 2 << 20],
                len: 900,
                flags: 1,
                ..Blkptr::HOLE
            });
            if encryption {
                r.slots.push(slot_pp.clone());
            }
            r
        };
        let mut t = TableRecord::empty();
        t.volumes = vec![rec(1, 1 << 30, 4096, true), rec(2, 8 << 20, 65536, false)];
        let json = serde_json::to_vec(&t).unwrap();
        let sealed = t.seal(&table_key);
        let fix = |b: &mut Vec<u8>| *b = seal_json(std::mem::take(b), &table_key);
        let json_or_sealed = vec![json, sealed];
        crate::fuzz::never_panics(
            "TableRecord::open",
            &json_or_sealed,
            4000,
            Some(&fix),
            &|b| {
                let Ok(t) = TableRecord::open(b, &table_key) else {
                    return;
                };
                for v in &t.volumes {
                    let ok = |r: Result<()>| match r {
                        Ok(()) | Err(Error::Corrupt(_)) => {}
                        Err(e) => panic!("not a Corrupt error: {e}"),
                    };
                    ok(v.options().map(|o| {
                        assert!(o.size_bytes > 0 && o.size_bytes % o.block_size as u64 == 0);
                        assert!(crate::map::depth_for(o.size_bytes / o.block_size as u64) <= 8);
                    }));
                    ok(ptr_from_hex(&v.root).map(|_| ()));
                    for s in &v.slots {
                        if let SlotKind::Passphrase { .. } = s.kind {
                            ok(wrap::check_cost(&s.kind));
                        } else {
                            ok(wrap::unwrap(s, &kf, &v.uuid).map(|_| ()));
                        }
                    }
                    ok(
                        crate::keys::ring::KeyRing::open(&vmk, &v.uuid, &v.data_keys, [0; 16])
                            .map(|_| ()),
                    );
                }
            },
        );
    }
}
