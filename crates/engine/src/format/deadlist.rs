//! Dead lists (object kind 3) and their chunks (object kind 4): what a dataset dropped
//! that an older snapshot still holds, bucketed by the snapshot interval it was born
//! in (as OpenZFS's deadlists).
//!
//! Dead list: `BWDL`, bucket count (u32), then 88-byte buckets in ascending min birth:
//! `min birth u64` (the previous snapshot generation the bucket starts after),
//! `bytes u64`, `entries u64`, the pointer to its newest chunk (a hole when empty).
//!
//! Chunk: the previous chunk's pointer (64; a hole for the oldest), count (u32), then
//! 24-byte entries `{birth u64, logical index u64, level u8, zero 3, footprint u32}`,
//! naming a record by its logical identity so the cleaner may move it.

use crate::constants::NODE_LEVELS_MAX;
use crate::Result;

use super::address::SegmentShift;
use super::blkptr::{Blkptr, BLKPTR_BYTES};
use super::header::RecordType;
use super::{put, Fields};

pub const DEAD_LIST_MAGIC: &[u8; 4] = b"BWDL";
pub const DEAD_LIST_HEADER_BYTES: usize = 8;
pub const DEAD_BUCKET_BYTES: usize = 24 + BLKPTR_BYTES;
pub const DEAD_CHUNK_HEADER_BYTES: usize = BLKPTR_BYTES + 4;
pub const DEAD_ENTRY_BYTES: usize = 24;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeadBucket {
    pub min_birth: u64,
    pub bytes: u64,
    pub entries: u64,
    /// A dead-list chunk object, or a hole when the bucket is empty.
    pub newest_chunk: Blkptr,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadList {
    pub buckets: Vec<DeadBucket>,
}

/// Refuses a chunk pointer that is neither a hole nor an unsealed object.
fn chunk_ptr(b: &[u8], shift: SegmentShift, what: &'static str) -> Result<Blkptr> {
    let p = Blkptr::decode_as(b, shift, RecordType::Object, true, what)?;
    if p.sealed() {
        return Err(super::corrupt(
            what,
            "is sealed (dead lists are authenticated only)",
        ));
    }
    Ok(p)
}

impl DeadList {
    pub fn encode(&self) -> Vec<u8> {
        self.check()
            .unwrap_or_else(|why| panic!("encoding a dead list whose {why}"));
        let mut b = vec![0u8; DEAD_LIST_HEADER_BYTES + self.buckets.len() * DEAD_BUCKET_BYTES];
        put(&mut b, 0, DEAD_LIST_MAGIC);
        put(&mut b, 4, &(self.buckets.len() as u32).to_le_bytes());
        for (i, k) in self.buckets.iter().enumerate() {
            let at = DEAD_LIST_HEADER_BYTES + i * DEAD_BUCKET_BYTES;
            put(&mut b, at, &k.min_birth.to_le_bytes());
            put(&mut b, at + 8, &k.bytes.to_le_bytes());
            put(&mut b, at + 16, &k.entries.to_le_bytes());
            put(&mut b, at + 24, &k.newest_chunk.encode());
        }
        b
    }

    pub fn decode(b: &[u8], shift: SegmentShift) -> Result<DeadList> {
        let f = Fields::at_least(b, DEAD_LIST_HEADER_BYTES, "dead list")?;
        f.check(f.array::<4>(0) == *DEAD_LIST_MAGIC, || "bad magic".into())?;
        f.counted(4, DEAD_LIST_HEADER_BYTES, DEAD_BUCKET_BYTES)?;
        let buckets = b[DEAD_LIST_HEADER_BYTES..]
            .chunks_exact(DEAD_BUCKET_BYTES)
            .map(|k| {
                let g = Fields {
                    b: k,
                    what: "dead list bucket",
                };
                Ok(DeadBucket {
                    min_birth: g.u64(0),
                    bytes: g.u64(8),
                    entries: g.u64(16),
                    newest_chunk: chunk_ptr(&k[24..], shift, "dead list bucket chunk")?,
                })
            })
            .collect::<Result<_>>()?;
        let d = DeadList { buckets };
        d.check().map_err(|why| f.err(why))?;
        Ok(d)
    }

    fn check(&self) -> std::result::Result<(), String> {
        for (i, k) in self.buckets.iter().enumerate() {
            if i > 0 && k.min_birth <= self.buckets[i - 1].min_birth {
                return Err(format!(
                    "bucket {i} starts at birth {}, not ascending",
                    k.min_birth
                ));
            }
            if k.newest_chunk.is_hole() != (k.entries == 0) || (k.entries == 0) != (k.bytes == 0) {
                return Err(format!(
                    "bucket {i} has {} entries, {} bytes and chunk {:?}",
                    k.entries, k.bytes, k.newest_chunk.kind
                ));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeadEntry {
    pub birth: u64,
    /// The logical block (level 0) or node index (map nodes).
    pub index: u64,
    pub level: u8,
    pub footprint: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadListChunk {
    /// The older chunk of the bucket, or a hole.
    pub previous: Blkptr,
    pub entries: Vec<DeadEntry>,
}

impl DeadListChunk {
    pub fn encode(&self) -> Vec<u8> {
        assert!(self.previous.is_hole() || self.previous.kind == RecordType::Object);
        assert!(!self.previous.sealed());
        let mut b = vec![0u8; DEAD_CHUNK_HEADER_BYTES + self.entries.len() * DEAD_ENTRY_BYTES];
        put(&mut b, 0, &self.previous.encode());
        put(
            &mut b,
            BLKPTR_BYTES,
            &(self.entries.len() as u32).to_le_bytes(),
        );
        for (i, e) in self.entries.iter().enumerate() {
            assert!(e.level < NODE_LEVELS_MAX && e.birth > 0, "{e:?}");
            let at = DEAD_CHUNK_HEADER_BYTES + i * DEAD_ENTRY_BYTES;
            put(&mut b, at, &e.birth.to_le_bytes());
            put(&mut b, at + 8, &e.index.to_le_bytes());
            b[at + 16] = e.level;
            put(&mut b, at + 20, &e.footprint.to_le_bytes());
        }
        b
    }

    pub fn decode(b: &[u8], shift: SegmentShift) -> Result<DeadListChunk> {
        let f = Fields::at_least(b, DEAD_CHUNK_HEADER_BYTES, "dead list chunk")?;
        let previous = chunk_ptr(&b[..BLKPTR_BYTES], shift, "dead list chunk previous")?;
        f.counted(BLKPTR_BYTES, DEAD_CHUNK_HEADER_BYTES, DEAD_ENTRY_BYTES)?;
        let entries = b[DEAD_CHUNK_HEADER_BYTES..]
            .chunks_exact(DEAD_ENTRY_BYTES)
            .enumerate()
            .map(|(i, e)| {
                let g = Fields {
                    b: e,
                    what: "dead list entry",
                };
                g.zero(17, 3, "bytes 17..20")?;
                let d = DeadEntry {
                    birth: g.u64(0),
                    index: g.u64(8),
                    level: g.u8(16),
                    footprint: g.u32(20),
                };
                g.check(d.level < NODE_LEVELS_MAX && d.birth > 0, || {
                    format!("entry {i} has level {} and birth {}", d.level, d.birth)
                })?;
                Ok(d)
            })
            .collect::<Result<_>>()?;
        Ok(DeadListChunk { previous, entries })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::address::PoolAddr;
    use crate::format::blkptr::tests::{samples, shift};
    use crate::format::testing::{fuzz_canonical, refused, with};

    fn object() -> Blkptr {
        Blkptr {
            addr: [PoolAddr::new(3, 64), PoolAddr::new(4, 64)],
            len: 400,
            kind: RecordType::Object,
            flags: 0,
            birth: 8,
            epoch: 2,
            nonce: 5,
            checksum: 77,
            tag: [3; 16],
        }
    }

    fn list() -> DeadList {
        DeadList {
            buckets: vec![
                DeadBucket {
                    min_birth: 0,
                    bytes: 8192,
                    entries: 2,
                    newest_chunk: object(),
                },
                DeadBucket {
                    min_birth: 5,
                    bytes: 0,
                    entries: 0,
                    newest_chunk: Blkptr::HOLE,
                },
                DeadBucket {
                    min_birth: 9,
                    bytes: 1 << 40,
                    entries: 3,
                    newest_chunk: object(),
                },
            ],
        }
    }

    fn chunk() -> DeadListChunk {
        DeadListChunk {
            previous: object(),
            entries: (0..5)
                .map(|i| DeadEntry {
                    birth: 3 + i,
                    index: i << 20,
                    level: (i % 3) as u8,
                    footprint: 4112,
                })
                .collect(),
        }
    }

    #[test]
    fn golden_bytes() {
        let d = DeadList {
            buckets: vec![DeadBucket {
                min_birth: 1,
                bytes: 2,
                entries: 3,
                newest_chunk: object(),
            }],
        };
        let b = d.encode();
        let mut golden = vec![b'B', b'W', b'D', b'L', 1, 0, 0, 0];
        golden.extend([
            1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0,
        ]);
        golden.extend(object().encode());
        assert_eq!(b, golden);
        let c = DeadListChunk {
            previous: Blkptr::HOLE,
            entries: vec![DeadEntry {
                birth: 0x0102,
                index: 0x0304,
                level: 2,
                footprint: 0x0506,
            }],
        };
        let mut golden = vec![0u8; 64];
        golden.extend([1, 0, 0, 0]);
        golden.extend([0x02, 0x01, 0, 0, 0, 0, 0, 0, 0x04, 0x03, 0, 0, 0, 0, 0, 0]);
        golden.extend([2, 0, 0, 0, 0x06, 0x05, 0, 0]);
        assert_eq!(c.encode(), golden);
        assert_eq!(DeadListChunk::decode(&golden, shift()).unwrap(), c);
    }

    #[test]
    fn round_trip_and_refusals() {
        let s = shift();
        let b = list().encode();
        assert_eq!(DeadList::decode(&b, s).unwrap(), list());
        refused(DeadList::decode(&with(&b, 0, b"BWDM"), s), "bad magic");
        refused(DeadList::decode(&b[..b.len() - 8], s), "count 3 of 88-byte");
        // Bucket 1 starting at birth 0 again.
        refused(
            DeadList::decode(&with(&b, 8 + 88, &[0]), s),
            "not ascending",
        );
        // An empty bucket with bytes, a full one without a chunk.
        refused(
            DeadList::decode(&with(&b, 8 + 88 + 8, &[1]), s),
            "bucket 1 has 0 entries",
        );
        let no_chunk = with(&b, 8 + 24, &[0; 64]);
        refused(DeadList::decode(&no_chunk, s), "bucket 0 has 2 entries");
        // The chunk pointer must be an unsealed object.
        refused(
            DeadList::decode(&with(&b, 8 + 24 + 20, &[2]), s),
            "not a Object",
        );
        refused(DeadList::decode(&with(&b, 8 + 24 + 21, &[2]), s), "sealed");
        let c = chunk().encode();
        assert_eq!(DeadListChunk::decode(&c, s).unwrap(), chunk());
        refused(DeadListChunk::decode(&c[..67], s), "at least 68");
        refused(
            DeadListChunk::decode(&c[..c.len() - 1], s),
            "count 5 of 24-byte",
        );
        refused(
            DeadListChunk::decode(&with(&c, 68 + 16, &[11]), s),
            "level 11",
        );
        refused(
            DeadListChunk::decode(&with(&c, 68 + 18, &[1]), s),
            "bytes 17..20",
        );
        refused(DeadListChunk::decode(&with(&c, 68, &[0]), s), "birth 0");
        refused(
            DeadListChunk::decode(&with(&c, 0, &samples()[2].encode()), s),
            "Node",
        );
    }

    #[test]
    fn decode_is_canonical_for_any_bytes() {
        let s = shift();
        fuzz_canonical(
            "DeadList::decode",
            &[list().encode(), DeadList { buckets: vec![] }.encode()],
            20_000,
            None,
            &|b| DeadList::decode(b, s),
            &DeadList::encode,
        );
        fuzz_canonical(
            "DeadListChunk::decode",
            &[chunk().encode()],
            20_000,
            None,
            &|b| DeadListChunk::decode(b, s),
            &DeadListChunk::encode,
        );
    }
}
