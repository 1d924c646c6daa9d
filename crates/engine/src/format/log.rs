//! Intent-log blocks (4 KiB–128 KiB) and their entries: the chain that issue 24's log
//! writes between commits, anchored in the superblock (decision 0008, "Intent log").
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `BWLOGBK2` |
//! | 8 | 8 | sequence |
//! | 16 | 8 | generation it follows (g) |
//! | 24 | 16 | chain seed (from superblock g) |
//! | 40 | 16 | tag of the previous block (the seed for the first) |
//! | 56 | 8 | address of the next block (allocated in advance) |
//! | 64 | 4 | payload bytes |
//! | 68 | 4 | entries |
//! | 72 | 8 | xxh3-64 of the whole block with this field zeroed |
//! | 80 | 8 | zero |
//! | 88 | 16 | tag = GMAC(log key, n96(sequence − first), [`LogBlock::mac_input`]) |
//! | 104 | 24 | zero |
//! | 128 | … | entries, then zeros to the block's end |
//!
//! A block is `128 + payload` rounded up to 4 KiB ([`LogBlock::length`]), so a reader
//! learns the length from the first 4 KiB. The GMAC covers bytes 0..88 with the xxh3
//! field read as zero, then the payload; the xxh3 is computed last, over the whole
//! block (tag included) with its own field zeroed: it catches torn blocks without a key.
//! The next block's address is a pool address in a log segment, a byte offset in a
//! log device's area, `u64::MAX` for log objects (named by sequence): the reader knows
//! which, so it is stored as a plain u64.
//!
//! **Entry:** a 32-byte header — `op u8` (1 WRITE_PTR, 2 WRITE_COPY, 3 TRIM, 4 ZERO,
//! 5 EPOCH, 6 VOLUME_OP), 3 zero, dataset object id u64, first block u64, count u32,
//! payload bytes u32, 4 zero — then the payload, then zeros to a multiple of 16, so
//! every entry and every record inside a block starts 16-aligned. Payloads:
//! WRITE_PTR `count` data pointers; WRITE_COPY `count` data pointers, then the records
//! they point at, in order, each padded to 16; TRIM and ZERO none; EPOCH one 48-byte
//! epoch entry (count 1, dataset and first block 0); VOLUME_OP a control request whose
//! form is issue 24's (opaque here, bounded by the block).

use crate::checksum::xxh3_64;
use crate::constants::{LOG_BLOCK_ALIGN, LOG_BLOCK_BYTES_MAX, RECORD_ALIGN};
use crate::Result;

use super::address::SegmentShift;
use super::blkptr::{Blkptr, BLKPTR_BYTES};
use super::epoch::{EpochEntry, EPOCH_ENTRY_BYTES};
use super::header::RecordType;
use super::{put, Fields};

pub const LOG_BLOCK_MAGIC: &[u8; 8] = b"BWLOGBK2";
pub const LOG_BLOCK_HEADER_BYTES: usize = 128;
pub const LOG_ENTRY_HEADER_BYTES: usize = 32;
/// Bytes of the header the GMAC covers (the tag follows).
const MAC_HEADER_BYTES: usize = 88;
const XXH3_AT: usize = 72;
const PAYLOAD_MAX: usize = LOG_BLOCK_BYTES_MAX - LOG_BLOCK_HEADER_BYTES;

coded_enum! {
    pub enum LogOp: u8 {
        WritePtr = 1,
        WriteCopy = 2,
        Trim = 3,
        Zero = 4,
        Epoch = 5,
        VolumeOp = 6,
    }
}

fn round16(n: usize) -> usize {
    n.next_multiple_of(RECORD_ALIGN as usize)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    pub op: LogOp,
    pub dataset: u64,
    pub first_block: u64,
    pub count: u32,
    /// Without the padding.
    pub payload: Vec<u8>,
}

impl LogEntry {
    /// Bytes the entry takes in a block, padding included.
    pub fn stored_bytes(&self) -> usize {
        LOG_ENTRY_HEADER_BYTES + round16(self.payload.len())
    }

    fn encode_into(&self, out: &mut Vec<u8>) {
        let mut h = [0u8; LOG_ENTRY_HEADER_BYTES];
        h[0] = self.op as u8;
        put(&mut h, 4, &self.dataset.to_le_bytes());
        put(&mut h, 12, &self.first_block.to_le_bytes());
        put(&mut h, 20, &self.count.to_le_bytes());
        put(&mut h, 24, &(self.payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&h);
        out.extend_from_slice(&self.payload);
        out.resize(
            out.len() + round16(self.payload.len()) - self.payload.len(),
            0,
        );
    }

    /// The data pointers of a WRITE_PTR or WRITE_COPY entry.
    pub fn pointers(&self, shift: SegmentShift) -> Result<Vec<Blkptr>> {
        let n = match self.op {
            LogOp::WritePtr | LogOp::WriteCopy => self.count as usize,
            op => {
                return Err(super::corrupt(
                    "log entry",
                    format!("{op:?} holds no pointers"),
                ))
            }
        };
        let ptrs = self
            .payload
            .get(..n.saturating_mul(BLKPTR_BYTES))
            .ok_or_else(|| {
                super::corrupt(
                    "log entry",
                    format!("{n} pointers in {} bytes", self.payload.len()),
                )
            })?;
        ptrs.chunks_exact(BLKPTR_BYTES)
            .map(|p| Blkptr::decode_as(p, shift, RecordType::Data, false, "log entry pointer"))
            .collect()
    }

    /// The records a WRITE_COPY entry carries, one per pointer, each `len` bytes.
    pub fn copied_records(&self, shift: SegmentShift) -> Result<Vec<&[u8]>> {
        let ptrs = self.pointers(shift)?;
        let mut at = ptrs.len() * BLKPTR_BYTES;
        let mut records = Vec::with_capacity(ptrs.len());
        for p in &ptrs {
            let (len, end) = (p.len as usize, at + round16(p.len as usize));
            let r = self.payload.get(at..end).ok_or_else(|| {
                super::corrupt(
                    "log entry",
                    format!("record of {len} bytes past the payload"),
                )
            })?;
            if r[len..].iter().any(|&x| x != 0) {
                return Err(super::corrupt(
                    "log entry",
                    "padding after a record is not zero",
                ));
            }
            records.push(&r[..len]);
            at = end;
        }
        if self.op != LogOp::WriteCopy || at != self.payload.len() {
            return Err(super::corrupt(
                "log entry",
                format!(
                    "{:?} of {} bytes carries {at} bytes of records",
                    self.op,
                    self.payload.len()
                ),
            ));
        }
        Ok(records)
    }

    /// The epoch an EPOCH entry logs.
    pub fn epoch(&self) -> Result<EpochEntry> {
        if self.op != LogOp::Epoch {
            return Err(super::corrupt(
                "log entry",
                format!("{:?} is no EPOCH", self.op),
            ));
        }
        EpochEntry::decode(&self.payload).map_err(|e| e.within("log entry"))
    }

    /// The rules each op's entry keeps (decode refuses, encode asserts).
    fn check(&self, shift: SegmentShift) -> Result<()> {
        let bad = |why: String| Err(super::corrupt("log entry", format!("{:?} {why}", self.op)));
        let (n, len) = (self.count as usize, self.payload.len());
        match self.op {
            LogOp::WritePtr if n == 0 || len != n.saturating_mul(BLKPTR_BYTES) => {
                bad(format!("of {n} pointers with {len} payload bytes"))
            }
            LogOp::WritePtr => self.pointers(shift).map(drop),
            LogOp::WriteCopy if n == 0 => bad("of no records".into()),
            LogOp::WriteCopy => self.copied_records(shift).map(drop),
            LogOp::Trim | LogOp::Zero if n == 0 || len != 0 => {
                bad(format!("of {n} blocks with {len} payload bytes"))
            }
            LogOp::Epoch if n != 1 || self.dataset != 0 || self.first_block != 0 => bad(format!(
                "with count {n}, dataset {}, block {}",
                self.dataset, self.first_block
            )),
            LogOp::Epoch if len != EPOCH_ENTRY_BYTES => bad(format!("of {len} bytes")),
            LogOp::Epoch => self.epoch().map(drop),
            _ => Ok(()),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogBlock {
    pub sequence: u64,
    pub follows_generation: u64,
    pub chain_seed: [u8; 16],
    pub previous_tag: [u8; 16],
    pub next: u64,
    pub tag: [u8; 16],
    pub entries: Vec<LogEntry>,
}

impl LogBlock {
    /// The block's bytes, xxh3 included. Panics on entries `decode` would refuse, or
    /// too many for one block.
    pub fn encode(&self, shift: SegmentShift) -> Vec<u8> {
        let mut b = self.encode_unsummed(shift);
        let sum = xxh3_64(&b);
        put(&mut b, XXH3_AT, &sum.to_le_bytes());
        b
    }

    /// The block with its xxh3 field zero.
    fn encode_unsummed(&self, shift: SegmentShift) -> Vec<u8> {
        let mut b = vec![0u8; LOG_BLOCK_HEADER_BYTES];
        for e in &self.entries {
            e.check(shift)
                .unwrap_or_else(|err| panic!("encoding a log entry: {err}"));
            e.encode_into(&mut b);
        }
        let payload = b.len() - LOG_BLOCK_HEADER_BYTES;
        assert!(
            payload <= PAYLOAD_MAX,
            "log block payload of {payload} bytes"
        );
        b.resize(Self::length(payload), 0);
        put(&mut b, 0, LOG_BLOCK_MAGIC);
        put(&mut b, 8, &self.sequence.to_le_bytes());
        put(&mut b, 16, &self.follows_generation.to_le_bytes());
        put(&mut b, 24, &self.chain_seed);
        put(&mut b, 40, &self.previous_tag);
        put(&mut b, 56, &self.next.to_le_bytes());
        put(&mut b, 64, &(payload as u32).to_le_bytes());
        put(&mut b, 68, &(self.entries.len() as u32).to_le_bytes());
        put(&mut b, MAC_HEADER_BYTES, &self.tag);
        b
    }

    /// A block's length from its payload bytes: `128 + payload` rounded up to 4 KiB.
    pub fn length(payload: usize) -> usize {
        (LOG_BLOCK_HEADER_BYTES + payload).next_multiple_of(LOG_BLOCK_ALIGN)
    }

    /// The length of the block whose first bytes (at least the header) are `head`.
    pub fn length_from_header(head: &[u8]) -> Result<usize> {
        let f = Fields::at_least(head, LOG_BLOCK_HEADER_BYTES, "log block")?;
        f.check(f.array::<8>(0) == *LOG_BLOCK_MAGIC, || "bad magic".into())?;
        let payload = f.u32(64) as usize;
        f.check(payload <= PAYLOAD_MAX, || {
            format!("payload of {payload} bytes")
        })?;
        Ok(Self::length(payload))
    }

    /// What the tag's GMAC covers: bytes 0..88 with the xxh3 field zero, then the payload.
    pub fn mac_input(&self, shift: SegmentShift) -> Vec<u8> {
        let b = self.encode_unsummed(shift);
        let payload = u32::from_le_bytes(b[64..68].try_into().unwrap()) as usize;
        let mut m = b[..MAC_HEADER_BYTES].to_vec();
        m.extend_from_slice(&b[LOG_BLOCK_HEADER_BYTES..LOG_BLOCK_HEADER_BYTES + payload]);
        m
    }

    /// A whole block read from the log (its length from `length_from_header`). Checks
    /// the xxh3, the sizes, zeros and every entry; the tag and the chain are replay's.
    pub fn decode(b: &[u8], shift: SegmentShift) -> Result<LogBlock> {
        let len = Self::length_from_header(b)?;
        let f = Fields::exact(b, len, "log block")?;
        let mut zeroed = b.to_vec();
        zeroed[XXH3_AT..XXH3_AT + 8].fill(0);
        let sum = f.u64(XXH3_AT);
        f.check(xxh3_64(&zeroed) == sum, || {
            format!("xxh3 {sum:#x} does not match (torn?)")
        })?;
        f.zero(80, 8, "bytes 80..88")?;
        f.zero(104, 24, "bytes 104..128")?;
        let end = LOG_BLOCK_HEADER_BYTES + f.u32(64) as usize;
        f.zero(end, len - end, "bytes after the payload")?;
        let count = f.u32(68);
        let mut rest = &b[LOG_BLOCK_HEADER_BYTES..end];
        let mut entries = Vec::new();
        for i in 0..count {
            // Each entry takes at least 32 bytes, so `count` cannot run past the payload.
            let e =
                Self::entry(rest, shift).map_err(|e| e.within(format!("log block entry {i}")))?;
            rest = &rest[e.stored_bytes()..];
            entries.push(e);
        }
        f.check(rest.is_empty(), || {
            format!("{} payload bytes after {count} entries", rest.len())
        })?;
        Ok(LogBlock {
            sequence: f.u64(8),
            follows_generation: f.u64(16),
            chain_seed: f.array(24),
            previous_tag: f.array(40),
            next: f.u64(56),
            tag: f.array(MAC_HEADER_BYTES),
            entries,
        })
    }

    fn entry(b: &[u8], shift: SegmentShift) -> Result<LogEntry> {
        let f = Fields::at_least(b, LOG_ENTRY_HEADER_BYTES, "log entry")?;
        let op =
            LogOp::from_repr(f.u8(0)).ok_or_else(|| f.err(format!("unknown op {}", f.u8(0))))?;
        f.zero(1, 3, "bytes 1..4")?;
        f.zero(28, 4, "bytes 28..32")?;
        let len = f.u32(24) as usize;
        let stored = &b[LOG_ENTRY_HEADER_BYTES..];
        f.check(round16(len) <= stored.len(), || {
            format!("payload of {len} bytes, {} left", stored.len())
        })?;
        Fields {
            b: stored,
            what: "log entry",
        }
        .zero(len, round16(len) - len, "padding")?;
        let e = LogEntry {
            op,
            dataset: f.u64(4),
            first_block: f.u64(12),
            count: f.u32(20),
            payload: stored[..len].to_vec(),
        };
        e.check(shift)?;
        Ok(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::address::PoolAddr;
    use crate::format::blkptr::tests::{samples, shift};
    use crate::format::epoch::tests::entry as epoch_entry;
    use crate::format::testing::{fuzz_canonical, refused, with};

    fn data_ptr(i: u32, len: u32) -> Blkptr {
        Blkptr {
            len,
            nonce: i,
            addr: [PoolAddr::new(40, 128 + 16 * i as u64), PoolAddr::NONE],
            ..samples()[0]
        }
    }

    fn block() -> LogBlock {
        let ptrs = [data_ptr(0, 4112), data_ptr(1, 700)];
        let mut copy = ptrs.iter().flat_map(|p| p.encode()).collect::<Vec<_>>();
        copy.extend(vec![0xab; 4112]);
        copy.extend(vec![0xcd; 700]);
        copy.extend([0; 4]);
        LogBlock {
            sequence: 1001,
            follows_generation: 77,
            chain_seed: [1; 16],
            previous_tag: [2; 16],
            next: PoolAddr::new(41, 0).raw(),
            tag: [3; 16],
            entries: vec![
                LogEntry {
                    op: LogOp::WritePtr,
                    dataset: 12,
                    first_block: 5,
                    count: 1,
                    payload: data_ptr(9, 16).encode().to_vec(),
                },
                LogEntry {
                    op: LogOp::WriteCopy,
                    dataset: 12,
                    first_block: 6,
                    count: 2,
                    payload: copy,
                },
                LogEntry {
                    op: LogOp::Trim,
                    dataset: 13,
                    first_block: 0,
                    count: 1 << 20,
                    payload: vec![],
                },
                LogEntry {
                    op: LogOp::Zero,
                    dataset: 13,
                    first_block: 9,
                    count: 1,
                    payload: vec![],
                },
                LogEntry {
                    op: LogOp::Epoch,
                    dataset: 0,
                    first_block: 0,
                    count: 1,
                    payload: epoch_entry(4).encode().to_vec(),
                },
                LogEntry {
                    op: LogOp::VolumeOp,
                    dataset: 12,
                    first_block: 0,
                    count: 0,
                    payload: b"resize 1G".to_vec(),
                },
            ],
        }
    }

    fn resum(b: &mut [u8]) {
        if b.len() >= LOG_BLOCK_HEADER_BYTES {
            b[XXH3_AT..XXH3_AT + 8].fill(0);
            let sum = xxh3_64(b);
            b[XXH3_AT..XXH3_AT + 8].copy_from_slice(&sum.to_le_bytes());
        }
    }

    #[test]
    fn golden_bytes_and_mac_input() {
        let l = LogBlock {
            sequence: 0x0102,
            follows_generation: 0x0304,
            chain_seed: [5; 16],
            previous_tag: [6; 16],
            next: 0x0708,
            tag: [9; 16],
            entries: vec![LogEntry {
                op: LogOp::Zero,
                dataset: 0x0a,
                first_block: 0x0b,
                count: 0x0c,
                payload: vec![],
            }],
        };
        let b = l.encode(shift());
        let mut g = vec![0u8; 4096];
        g[..10].copy_from_slice(b"BWLOGBK2\x02\x01");
        g[16..18].copy_from_slice(&[4, 3]);
        g[24..40].fill(5);
        g[40..56].fill(6);
        g[56..58].copy_from_slice(&[8, 7]);
        g[64] = 32;
        g[68] = 1;
        g[88..104].fill(9);
        g[128..160].copy_from_slice(&[
            4, 0, 0, 0, 0x0a, 0, 0, 0, 0, 0, 0, 0, 0x0b, 0, 0, 0, 0, 0, 0, 0, 0x0c, 0, 0, 0, 0, 0,
            0, 0, 0, 0, 0, 0,
        ]);
        let sum = xxh3_64(&g);
        g[72..80].copy_from_slice(&sum.to_le_bytes());
        assert_eq!(b, g);
        assert_eq!(LogBlock::decode(&g, shift()).unwrap(), l);
        let m = l.mac_input(shift());
        assert_eq!(m.len(), 88 + 32);
        assert_eq!(&m[..72], &g[..72]);
        assert_eq!(m[72..80], [0; 8]);
        assert_eq!(&m[80..88], &g[80..88]);
        assert_eq!(&m[88..], &g[128..160]);
        assert_eq!(LogBlock::length_from_header(&g[..128]).unwrap(), 4096);
    }

    #[test]
    fn round_trip_accessors_and_refusals() {
        let s = shift();
        let l = block();
        let b = l.encode(s);
        assert_eq!(b.len(), 8192);
        assert_eq!(LogBlock::decode(&b, s).unwrap(), l);
        let copy = &l.entries[1];
        assert_eq!(
            copy.pointers(s).unwrap(),
            [data_ptr(0, 4112), data_ptr(1, 700)]
        );
        let recs = copy.copied_records(s).unwrap();
        assert_eq!((recs[0].len(), recs[1].len()), (4112, 700));
        assert!(recs[1].iter().all(|&x| x == 0xcd));
        assert_eq!(l.entries[4].epoch().unwrap(), epoch_entry(4));
        refused(l.entries[2].pointers(s), "Trim holds no pointers");
        refused(l.entries[0].epoch(), "no EPOCH");
        let dec = |b: &[u8]| LogBlock::decode(b, s);
        let resummed = |at: usize, v: &[u8]| {
            let mut c = with(&b, at, v);
            resum(&mut c);
            c
        };
        refused(dec(&b[..127]), "at least 128");
        refused(dec(&b[..4096]), "4096 bytes, expected 8192");
        refused(dec(&with(&b, 0, b"BWLOGBK1")), "bad magic");
        refused(dec(&with(&b, 200, &[1])), "does not match");
        refused(dec(&resummed(66, &[2])), "payload of 136336 bytes");
        refused(dec(&resummed(81, &[1])), "bytes 80..88");
        refused(dec(&resummed(127, &[1])), "bytes 104..128");
        refused(dec(&resummed(8191, &[1])), "after the payload");
        refused(dec(&resummed(68, &[7])), "entry 6");
        refused(dec(&resummed(68, &[5])), "after 5 entries");
        // The first entry: WRITE_PTR of one pointer.
        let e0 = LOG_BLOCK_HEADER_BYTES;
        refused(dec(&resummed(e0, &[7])), "unknown op 7");
        refused(dec(&resummed(e0 + 2, &[1])), "bytes 1..4");
        refused(dec(&resummed(e0 + 29, &[1])), "bytes 28..32");
        refused(dec(&resummed(e0 + 20, &[2])), "of 2 pointers with 64");
        refused(dec(&resummed(e0 + 32 + 20, &[3])), "not a Data");
        // WRITE_COPY with a record longer than its payload, or padding set.
        let e1 = e0 + 32 + 64;
        refused(dec(&resummed(e1 + 32 + 17, &[0x20])), "past the payload");
        let pad = e1 + 32 + 2 * 64 + 4112 + 700;
        refused(dec(&resummed(pad, &[1])), "padding");
        let e2 = e1 + 32 + 2 * 64 + 4112 + 704;
        refused(dec(&resummed(e2 + 20, &[0; 4])), "Trim of 0 blocks");
        let e4 = e2 + 2 * 32;
        refused(
            dec(&resummed(e4 + 4, &[1])),
            "Epoch with count 1, dataset 1",
        );
        refused(dec(&resummed(e4 + 32 + 12, &[9])), "unknown kind 9");
    }

    #[test]
    fn decode_is_canonical_for_any_bytes() {
        let s = shift();
        let small = LogBlock {
            entries: block().entries[2..].to_vec(),
            ..block()
        };
        let valid = vec![block().encode(s), small.encode(s)];
        fuzz_canonical(
            "LogBlock::decode",
            &valid,
            5000,
            Some(&|b: &mut Vec<u8>| resum(b)),
            &|b| LogBlock::decode(b, s),
            &|l| l.encode(s),
        );
    }
}
