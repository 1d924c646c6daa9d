//! Epoch-table entries (48 bytes) and the epoch-table object (object kind 5).
//!
//! An epoch is (epoch no, lineage, key id, kind, salt): the key of every record whose
//! pointer names the epoch is derived from the salt. The table is the body of an
//! object, authenticated as a whole (every byte of it) with the one-time key of the
//! superblock that points at it: `BWEP`, count (u32), next epoch no (u32), then the
//! entries, in ascending epoch no, each below the next one.
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 4 | epoch no (≥ 1) |
//! | 4 | 4 | lineage id (0 = pool metadata) |
//! | 8 | 4 | key id in the lineage's keyring (kind 1, ≥ 1); 0 otherwise |
//! | 12 | 1 | kind: 0 pool metadata, 1 sealed, 2 lineage auth-only |
//! | 13 | 3 | zero |
//! | 16 | 16 | salt |
//! | 32 | 8 | live records |
//! | 40 | 8 | generation created |

use crate::Result;

use super::{put, Fields};

pub const EPOCH_ENTRY_BYTES: usize = 48;
pub const EPOCH_TABLE_MAGIC: &[u8; 4] = b"BWEP";
pub const EPOCH_TABLE_HEADER_BYTES: usize = 12;

coded_enum! {
    pub enum EpochKind: u8 {
        /// Pool metadata (lineage 0): directory, segment table, datasets, dead lists.
        Pool = 0,
        /// Data and map nodes of an encrypted lineage, from a data key.
        Sealed = 1,
        /// Data and map nodes of an unencrypted lineage, from the pool key.
        LineageAuth = 2,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpochEntry {
    pub epoch: u32,
    pub lineage: u32,
    pub key_id: u32,
    pub kind: EpochKind,
    pub salt: [u8; 16],
    pub live_records: u64,
    pub generation_created: u64,
}

impl EpochEntry {
    pub fn encode(&self) -> [u8; EPOCH_ENTRY_BYTES] {
        if let Err(why) = self.check() {
            panic!("encoding an epoch entry that {why}: {self:?}");
        }
        let mut b = [0u8; EPOCH_ENTRY_BYTES];
        put(&mut b, 0, &self.epoch.to_le_bytes());
        put(&mut b, 4, &self.lineage.to_le_bytes());
        put(&mut b, 8, &self.key_id.to_le_bytes());
        b[12] = self.kind as u8;
        put(&mut b, 16, &self.salt);
        put(&mut b, 32, &self.live_records.to_le_bytes());
        put(&mut b, 40, &self.generation_created.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<EpochEntry> {
        let f = Fields::exact(b, EPOCH_ENTRY_BYTES, "epoch entry")?;
        f.zero(13, 3, "bytes 13..16")?;
        let kind = EpochKind::from_repr(f.u8(12))
            .ok_or_else(|| f.err(format!("unknown kind {}", f.u8(12))))?;
        let e = EpochEntry {
            epoch: f.u32(0),
            lineage: f.u32(4),
            key_id: f.u32(8),
            kind,
            salt: f.array(16),
            live_records: f.u64(32),
            generation_created: f.u64(40),
        };
        e.check().map_err(|why| f.err(why))?;
        Ok(e)
    }

    fn check(&self) -> std::result::Result<(), String> {
        if self.epoch == 0 {
            return Err("is epoch 0 (the one-time key's)".into());
        }
        if (self.kind == EpochKind::Pool) != (self.lineage == 0) {
            return Err(format!(
                "is of kind {:?} for lineage {}",
                self.kind, self.lineage
            ));
        }
        if (self.kind == EpochKind::Sealed) != (self.key_id != 0) {
            return Err(format!(
                "is of kind {:?} with key id {}",
                self.kind, self.key_id
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochTable {
    /// The epoch no the next new epoch gets.
    pub next_epoch: u32,
    pub entries: Vec<EpochEntry>,
}

impl EpochTable {
    pub fn encode(&self) -> Vec<u8> {
        self.check()
            .unwrap_or_else(|why| panic!("encoding an epoch table whose {why}"));
        let mut b = Vec::with_capacity(EPOCH_TABLE_HEADER_BYTES + self.entries.len() * 48);
        b.extend_from_slice(EPOCH_TABLE_MAGIC);
        b.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        b.extend_from_slice(&self.next_epoch.to_le_bytes());
        for e in &self.entries {
            b.extend_from_slice(&e.encode());
        }
        b
    }

    /// The object's body (after its record header), authenticated whole.
    pub fn decode(b: &[u8]) -> Result<EpochTable> {
        let f = Fields::at_least(b, EPOCH_TABLE_HEADER_BYTES, "epoch table")?;
        f.check(f.array::<4>(0) == *EPOCH_TABLE_MAGIC, || "bad magic".into())?;
        f.counted(4, EPOCH_TABLE_HEADER_BYTES, EPOCH_ENTRY_BYTES)?;
        let entries = b[EPOCH_TABLE_HEADER_BYTES..]
            .chunks_exact(EPOCH_ENTRY_BYTES)
            .enumerate()
            .map(|(i, e)| {
                EpochEntry::decode(e).map_err(|e| e.within(format!("epoch table entry {i}")))
            })
            .collect::<Result<_>>()?;
        let t = EpochTable {
            next_epoch: f.u32(8),
            entries,
        };
        t.check().map_err(|why| f.err(why))?;
        Ok(t)
    }

    fn check(&self) -> std::result::Result<(), String> {
        let mut below = 0;
        for e in &self.entries {
            if e.epoch <= below || e.epoch >= self.next_epoch {
                return Err(format!(
                    "entry of epoch {} is not above {below} and below the next epoch {}",
                    e.epoch, self.next_epoch
                ));
            }
            below = e.epoch;
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::format::testing::{fuzz_canonical, refused, with};

    pub fn entry(epoch: u32) -> EpochEntry {
        EpochEntry {
            epoch,
            lineage: epoch % 3,
            key_id: if epoch % 3 == 1 { 7 } else { 0 },
            kind: [EpochKind::Pool, EpochKind::Sealed, EpochKind::LineageAuth][epoch as usize % 3],
            salt: [epoch as u8; 16],
            live_records: 1 << 33,
            generation_created: 12,
        }
    }

    fn table() -> EpochTable {
        EpochTable {
            next_epoch: 10,
            entries: [1, 2, 4, 6, 9].map(entry).to_vec(),
        }
    }

    #[test]
    fn golden_bytes() {
        let e = EpochEntry {
            epoch: 0x0201,
            lineage: 0x0403,
            key_id: 0x0605,
            kind: EpochKind::Sealed,
            salt: *b"0123456789abcdef",
            live_records: 0x07,
            generation_created: 0x0908,
        };
        #[rustfmt::skip]
        let golden: [u8; 48] = [
            0x01, 0x02, 0, 0, 0x03, 0x04, 0, 0, 0x05, 0x06, 0, 0, 1, 0, 0, 0,
            b'0', b'1', b'2', b'3', b'4', b'5', b'6', b'7',
            b'8', b'9', b'a', b'b', b'c', b'd', b'e', b'f',
            0x07, 0, 0, 0, 0, 0, 0, 0, 0x08, 0x09, 0, 0, 0, 0, 0, 0,
        ];
        assert_eq!(e.encode(), golden);
        assert_eq!(EpochEntry::decode(&golden).unwrap(), e);
        let t = EpochTable {
            next_epoch: 0x0202,
            entries: vec![e],
        };
        let b = t.encode();
        assert_eq!(b[..12], [b'B', b'W', b'E', b'P', 1, 0, 0, 0, 2, 2, 0, 0]);
        assert_eq!(b[12..], golden);
        assert_eq!(EpochTable::decode(&b).unwrap(), t);
    }

    #[test]
    fn round_trip_and_refusals() {
        let t = table();
        let b = t.encode();
        assert_eq!(EpochTable::decode(&b).unwrap(), t);
        let empty = EpochTable {
            next_epoch: 1,
            entries: vec![],
        };
        assert_eq!(EpochTable::decode(&empty.encode()).unwrap(), empty);
        refused(EpochTable::decode(&b[..11]), "at least 12");
        refused(EpochTable::decode(&with(&b, 0, b"BWE1")), "bad magic");
        refused(EpochTable::decode(&b[..b.len() - 1]), "count 5 of 48-byte");
        refused(
            EpochTable::decode(&with(&b, 4, &[0xff; 4])),
            "count 4294967295",
        );
        refused(
            EpochTable::decode(&with(&b, 8, &[9])),
            "below the next epoch 9",
        );
        // Entry 1 (epoch 2) turned into epoch 1: not ascending.
        refused(EpochTable::decode(&with(&b, 12 + 48, &[1])), "not above 1");
        let e = entry(4).encode();
        refused(EpochEntry::decode(&with(&e, 0, &[0])), "epoch 0");
        refused(EpochEntry::decode(&with(&e, 12, &[3])), "unknown kind 3");
        refused(EpochEntry::decode(&with(&e, 14, &[1])), "bytes 13..16");
        refused(EpochEntry::decode(&with(&e, 4, &[0])), "for lineage 0");
        refused(EpochEntry::decode(&with(&e, 8, &[0])), "key id 0");
        refused(
            EpochEntry::decode(&with(&entry(3).encode(), 8, &[1])),
            "key id 1",
        );
    }

    #[test]
    fn decode_is_canonical_for_any_bytes() {
        let t = table();
        let valid = vec![
            t.encode(),
            EpochTable {
                next_epoch: 3,
                entries: vec![entry(2)],
            }
            .encode(),
        ];
        fuzz_canonical(
            "EpochTable::decode",
            &valid,
            20_000,
            None,
            &EpochTable::decode,
            &|t| t.encode(),
        );
    }
}
