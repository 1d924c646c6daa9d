//! The volume table: the record the superblock points to.
//!
//! JSON inside a checksummed, lz4-compressed record, written with
//! `METADATA_COPIES` copies at every commit. It holds no secret: key slots hold
//! only wrapped keys. JSON keeps the table readable in a hex dump and lets
//! fields be added without a format bump; it is small (about 1 KiB per volume).

use serde::{Deserialize, Serialize};

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
    pub slots: Vec<KeySlot>,
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
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("table serialises")
    }
    pub fn decode(b: &[u8]) -> Result<TableRecord> {
        serde_json::from_slice(b).map_err(|e| Error::Corrupt(format!("volume table: {e}")))
    }
}
