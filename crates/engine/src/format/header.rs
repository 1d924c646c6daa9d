//! Record header (16 bytes): the first bytes of every record in a segment.
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 1 | type (as in the pointer) |
//! | 1 | 1 | level (map nodes), 0 otherwise |
//! | 2 | 2 | zero |
//! | 4 | 4 | lineage id (data and map nodes), object kind (objects), 0 (log) |
//! | 8 | 8 | logical block (data), node index (map nodes), object id (objects), sequence (log) |
//!
//! Covered by the pointer's checksum, by no MAC: a hint for the cleaner, which checks
//! it against the tree before trusting it.

use crate::constants::{NODE_LEVELS_MAX, RECORD_HEADER_BYTES};
use crate::Result;

use super::{put, Fields};

coded_enum! {
    /// What a pointer points at and a record header says a record is.
    pub enum RecordType: u8 {
        /// Only in pointers: nothing stored.
        Hole = 0,
        Data = 1,
        Node = 2,
        Object = 3,
        Log = 4,
    }
}

coded_enum! {
    /// The kind of an object (a record of type 3), in its header.
    pub enum ObjectKind: u32 {
        Dataset = 1,
        /// Sealed under a one-time key (key epoch 0).
        Keyring = 2,
        DeadList = 3,
        DeadListChunk = 4,
        /// Authenticated with the one-time key of the superblock that points at it.
        EpochTable = 5,
        /// Object 1: next object id, next lineage id, scrub state, errors, lineages.
        PoolRecord = 6,
        /// Intent-log entries waiting for an encrypted dataset's key.
        PendingReplay = 7,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordHeader {
    Data { lineage: u32, block: u64 },
    Node { level: u8, lineage: u32, index: u64 },
    Object { kind: ObjectKind, id: u64 },
    Log { sequence: u64 },
}

impl RecordHeader {
    pub fn record_type(&self) -> RecordType {
        match self {
            RecordHeader::Data { .. } => RecordType::Data,
            RecordHeader::Node { .. } => RecordType::Node,
            RecordHeader::Object { .. } => RecordType::Object,
            RecordHeader::Log { .. } => RecordType::Log,
        }
    }

    pub fn encode(&self) -> [u8; RECORD_HEADER_BYTES] {
        let (level, word, long) = match *self {
            RecordHeader::Data { lineage, block } => (0, lineage, block),
            RecordHeader::Node {
                level,
                lineage,
                index,
            } => {
                assert!(level < NODE_LEVELS_MAX, "node level {level}");
                (level, lineage, index)
            }
            RecordHeader::Object { kind, id } => (0, kind as u32, id),
            RecordHeader::Log { sequence } => (0, 0, sequence),
        };
        let mut b = [0u8; RECORD_HEADER_BYTES];
        b[0] = self.record_type() as u8;
        b[1] = level;
        put(&mut b, 4, &word.to_le_bytes());
        put(&mut b, 8, &long.to_le_bytes());
        b
    }

    /// The header at the start of `b` (a record's first 16 bytes, or more).
    pub fn decode(b: &[u8]) -> Result<RecordHeader> {
        let f = Fields::at_least(b, RECORD_HEADER_BYTES, "record header")?;
        f.zero(2, 2, "bytes 2..4")?;
        let (level, word, long) = (f.u8(1), f.u32(4), f.u64(8));
        let kind = RecordType::from_repr(f.u8(0));
        if kind != Some(RecordType::Node) {
            f.check(level == 0, || {
                format!("level {level} on a record that is no node")
            })?;
        }
        Ok(match kind {
            Some(RecordType::Data) => RecordHeader::Data {
                lineage: word,
                block: long,
            },
            Some(RecordType::Node) => {
                f.check(level < NODE_LEVELS_MAX, || format!("node level {level}"))?;
                RecordHeader::Node {
                    level,
                    lineage: word,
                    index: long,
                }
            }
            Some(RecordType::Object) => RecordHeader::Object {
                kind: ObjectKind::from_repr(word)
                    .ok_or_else(|| f.err(format!("unknown object kind {word}")))?,
                id: long,
            },
            Some(RecordType::Log) => {
                f.check(word == 0, || format!("log record with lineage {word}"))?;
                RecordHeader::Log { sequence: long }
            }
            Some(RecordType::Hole) | None => {
                return Err(f.err(format!("unknown record type {}", f.u8(0))))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::testing::{fuzz_canonical, refused, with};

    fn samples() -> Vec<RecordHeader> {
        vec![
            RecordHeader::Data {
                lineage: 7,
                block: 1 << 40,
            },
            RecordHeader::Node {
                level: 10,
                lineage: 0,
                index: 3,
            },
            RecordHeader::Object {
                kind: ObjectKind::PendingReplay,
                id: 1,
            },
            RecordHeader::Object {
                kind: ObjectKind::Dataset,
                id: u64::MAX,
            },
            RecordHeader::Log { sequence: 99 },
        ]
    }

    #[test]
    fn golden_bytes() {
        let h = RecordHeader::Node {
            level: 2,
            lineage: 0x0102_0304,
            index: 0x1122_3344_5566_7788,
        };
        let golden = [
            2, 2, 0, 0, 0x04, 0x03, 0x02, 0x01, 0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11,
        ];
        assert_eq!(h.encode(), golden);
        assert_eq!(RecordHeader::decode(&golden).unwrap(), h);
        let obj = RecordHeader::Object {
            kind: ObjectKind::EpochTable,
            id: 5,
        };
        assert_eq!(
            obj.encode(),
            [3, 0, 0, 0, 5, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0]
        );
    }

    #[test]
    fn round_trip_and_refusals() {
        for h in samples() {
            let b = h.encode();
            assert_eq!(RecordHeader::decode(&b).unwrap(), h);
            // The header of a longer record reads its first 16 bytes.
            let mut long = b.to_vec();
            long.extend([0xee; 100]);
            assert_eq!(RecordHeader::decode(&long).unwrap(), h);
        }
        let data = RecordHeader::Data {
            lineage: 1,
            block: 2,
        }
        .encode();
        refused(RecordHeader::decode(&data[..15]), "at least 16");
        refused(
            RecordHeader::decode(&with(&data, 0, &[0])),
            "unknown record type 0",
        );
        refused(
            RecordHeader::decode(&with(&data, 0, &[9])),
            "unknown record type 9",
        );
        refused(RecordHeader::decode(&with(&data, 1, &[1])), "level 1");
        refused(RecordHeader::decode(&with(&data, 3, &[1])), "reserved");
        let node = with(&data, 0, &[2]);
        refused(
            RecordHeader::decode(&with(&node, 1, &[11])),
            "node level 11",
        );
        let obj = with(&data, 0, &[3]);
        refused(
            RecordHeader::decode(&with(&obj, 4, &[8])),
            "unknown object kind 8",
        );
        refused(
            RecordHeader::decode(&with(&data, 0, &[4])),
            "log record with lineage 1",
        );
    }

    #[test]
    fn decode_is_canonical_for_any_bytes() {
        let valid: Vec<Vec<u8>> = samples().iter().map(|h| h.encode().to_vec()).collect();
        fuzz_canonical(
            "RecordHeader::decode",
            &valid,
            30_000,
            None,
            &|b| {
                // Only exact headers must re-encode to themselves.
                if b.len() == RECORD_HEADER_BYTES {
                    RecordHeader::decode(b)
                } else {
                    RecordHeader::decode(b).and(Err(crate::Error::Corrupt("longer".into())))
                }
            },
            &|h| h.encode().to_vec(),
        );
    }
}
