//! The volume table: the record the superblock points to.
//!
//! JSON inside a checksummed, lz4-compressed record, written with
//! `METADATA_COPIES` copies at every commit. It holds no secret: key slots hold
//! only wrapped keys. JSON keeps the table readable in a hex dump and lets
//! fields be added without a format bump; it is small (about 1 KiB per volume).

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use serde::{Deserialize, Serialize};

const TABLE_AAD: &[u8] = b"bulwark volume table v1";

use crate::keys::wrap::{hex16, KeySlot};
use crate::map::{Blkptr, BLKPTR_BYTES};
use crate::volume::Compression;
use crate::{Error, Result};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TableRecord {
    pub format: u32,
    pub next_volume_id: u64,
    pub volumes: Vec<VolumeRecord>,
    #[serde(default)]
    pub scrub: super::scrub::ScrubState,
    /// Ranges no copy could supply, as `status` lists them.
    #[serde(default)]
    pub errors: Vec<super::scrub::DataError>,
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
    pub rotation: Option<super::rotate::Rotation>,
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
}

pub fn ptr_to_hex(p: &Blkptr) -> String {
    let mut b = [0u8; BLKPTR_BYTES];
    p.encode(&mut b);
    crate::keys::wrap::to_hex(&b)
}

pub fn ptr_from_hex(s: &str) -> Result<Blkptr> {
    let b = crate::keys::wrap::from_hex(s).filter(|b| b.len() == BLKPTR_BYTES);
    let b =
        b.ok_or_else(|| Error::Corrupt("volume table holds a malformed root pointer".into()))?;
    Ok(Blkptr::decode(&b))
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
        let json = serde_json::to_vec(self).expect("table serialises");
        let key = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, table_key).expect("32-byte key"));
        let nonce = crate::keys::wrap::random_bytes::<12>();
        let mut out = nonce.to_vec();
        let mut body = json;
        key.seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(TABLE_AAD),
            &mut body,
        )
        .expect("sealing the table");
        out.extend_from_slice(&body);
        out
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
        serde_json::from_slice(json).map_err(|e| Error::Corrupt(format!("volume table: {e}")))
    }
}
