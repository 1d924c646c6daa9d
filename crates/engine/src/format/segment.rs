//! Segment-table entries (64 bytes) and the segment table's leaves.
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 8 | segment id |
//! | 8 | 1 | state: 0 free, 1 open, 2 sealed, 3 sealed and uploaded, 4 uploaded and evicted |
//! | 9 | 1 | stream: 0 data, 1 clean, 2 meta, 3 meta2, 4 log |
//! | 10 | 2 | zero |
//! | 12 | 4 | writer epoch in its object name (object store) |
//! | 16 | 4 | live bytes (footprint; a shared record counts once) |
//! | 20 | 4 | end offset written |
//! | 24 | 8 | generation opened |
//! | 32 | 8 | generation sealed |
//! | 40 | 4 | local slot, or `u32::MAX` |
//! | 44 | 4 | zero |
//! | 48 | 16 | xxh3-128 of the sealed object |
//!
//! All of an entry is logical (the leaf's GMAC covers its 64 bytes). The segment
//! table is a radix tree over segment id whose leaves are map nodes (`node`'s header,
//! lineage 0, level 0) holding 64 entries: slot `i` of leaf `j` is segment `64 j + i`.
//! A free segment's slot is 64 zero bytes (`None`); a stored entry names its own
//! segment id, so a misplaced entry is refused.

use crate::constants::{MAP_FANOUT, RECORD_ALIGN};
use crate::Result;

use super::address::SegmentShift;
use super::node::{mac_input, NodeId, Tree, NODE_HEADER_BYTES, NODE_RAW_BYTES};
use super::{put, Fields};

pub const SEGMENT_ENTRY_BYTES: usize = 64;

coded_enum! {
    /// A stored entry's state (a free segment has no entry).
    pub enum SegmentState: u8 {
        Open = 1,
        Sealed = 2,
        Uploaded = 3,
        Evicted = 4,
    }
}

coded_enum! {
    pub enum Stream: u8 {
        Data = 0,
        Clean = 1,
        Meta = 2,
        Meta2 = 3,
        Log = 4,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentEntry {
    pub segment: u64,
    pub state: SegmentState,
    pub stream: Stream,
    pub writer_epoch: u32,
    pub live_bytes: u32,
    pub end_offset: u32,
    pub generation_opened: u64,
    /// 0 while open.
    pub generation_sealed: u64,
    /// `u32::MAX` when the segment has no local slot.
    pub local_slot: u32,
    pub object_xxh3_128: [u8; 16],
}

impl SegmentEntry {
    pub const NO_SLOT: u32 = u32::MAX;

    /// `None` (a free segment) encodes as 64 zero bytes.
    pub fn encode(entry: &Option<SegmentEntry>, shift: SegmentShift) -> [u8; SEGMENT_ENTRY_BYTES] {
        let mut b = [0u8; SEGMENT_ENTRY_BYTES];
        let Some(e) = entry else { return b };
        if let Err(why) = e.check(shift) {
            panic!("encoding a segment entry that {why}: {e:?}");
        }
        put(&mut b, 0, &e.segment.to_le_bytes());
        b[8] = e.state as u8;
        b[9] = e.stream as u8;
        put(&mut b, 12, &e.writer_epoch.to_le_bytes());
        put(&mut b, 16, &e.live_bytes.to_le_bytes());
        put(&mut b, 20, &e.end_offset.to_le_bytes());
        put(&mut b, 24, &e.generation_opened.to_le_bytes());
        put(&mut b, 32, &e.generation_sealed.to_le_bytes());
        put(&mut b, 40, &e.local_slot.to_le_bytes());
        put(&mut b, 48, &e.object_xxh3_128);
        b
    }

    /// The entry of segment `segment` (where the tree says it is), in a pool of
    /// segments of `shift`.
    pub fn decode(b: &[u8], segment: u64, shift: SegmentShift) -> Result<Option<SegmentEntry>> {
        let f = Fields::exact(b, SEGMENT_ENTRY_BYTES, "segment entry")?;
        if b.iter().all(|&x| x == 0) {
            return Ok(None);
        }
        f.zero(10, 2, "bytes 10..12")?;
        f.zero(44, 4, "bytes 44..48")?;
        let state = SegmentState::from_repr(f.u8(8)).ok_or_else(|| {
            f.err(format!(
                "state {} (a free segment's entry is all zero)",
                f.u8(8)
            ))
        })?;
        let stream = Stream::from_repr(f.u8(9))
            .ok_or_else(|| f.err(format!("unknown stream {}", f.u8(9))))?;
        let e = SegmentEntry {
            segment: f.u64(0),
            state,
            stream,
            writer_epoch: f.u32(12),
            live_bytes: f.u32(16),
            end_offset: f.u32(20),
            generation_opened: f.u64(24),
            generation_sealed: f.u64(32),
            local_slot: f.u32(40),
            object_xxh3_128: f.array(48),
        };
        f.check(e.segment == segment, || {
            format!(
                "entry of segment {} in the slot of segment {segment}",
                e.segment
            )
        })?;
        e.check(shift).map_err(|why| f.err(why))?;
        Ok(Some(e))
    }

    fn check(&self, shift: SegmentShift) -> std::result::Result<(), String> {
        let (live, end) = (self.live_bytes as u64, self.end_offset as u64);
        if live > end || end > shift.segment_bytes() || end % RECORD_ALIGN != 0 {
            return Err(format!(
                "has {live} live bytes and end offset {end} in a segment of {}",
                shift.segment_bytes()
            ));
        }
        let (opened, sealed) = (self.generation_opened, self.generation_sealed);
        let open = self.state == SegmentState::Open;
        if opened == 0 || (open && sealed != 0) || (!open && sealed < opened) {
            return Err(format!(
                "is {:?}, opened at generation {opened} and sealed at {sealed}",
                self.state
            ));
        }
        if self.state == SegmentState::Evicted && self.local_slot != Self::NO_SLOT {
            return Err(format!("is evicted but has local slot {}", self.local_slot));
        }
        Ok(())
    }
}

/// A leaf of the segment table: 64 entries behind a node header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentLeaf {
    pub id: NodeId,
    pub entries: [Option<SegmentEntry>; MAP_FANOUT],
}

impl SegmentLeaf {
    pub fn encode(&self, shift: SegmentShift) -> Vec<u8> {
        assert!(self.id.level == 0 && self.id.lineage == 0, "{:?}", self.id);
        let mut out = vec![0u8; NODE_RAW_BYTES];
        self.id.encode_header(&mut out);
        for (i, e) in self.entries.iter().enumerate() {
            if let Some(e) = e {
                assert_eq!(e.segment, self.first_segment() + i as u64);
            }
            let at = NODE_HEADER_BYTES + i * SEGMENT_ENTRY_BYTES;
            put(&mut out, at, &SegmentEntry::encode(e, shift));
        }
        out
    }

    /// A raw leaf read from disk; `id` is what the parent pointer says.
    pub fn decode(b: &[u8], id: &NodeId, shift: SegmentShift) -> Result<SegmentLeaf> {
        let f = Fields::exact(b, NODE_RAW_BYTES, "segment-table leaf")?;
        f.check(id.level == 0 && id.lineage == 0, || {
            format!("{id:?} is no segment-table leaf")
        })?;
        id.check_header(&f)?;
        let mut leaf = SegmentLeaf {
            id: *id,
            entries: [None; MAP_FANOUT],
        };
        let first = leaf.first_segment();
        for (i, e) in leaf.entries.iter_mut().enumerate() {
            let at = NODE_HEADER_BYTES + i * SEGMENT_ENTRY_BYTES;
            *e = SegmentEntry::decode(&b[at..at + SEGMENT_ENTRY_BYTES], first + i as u64, shift)?;
        }
        Ok(leaf)
    }

    fn first_segment(&self) -> u64 {
        self.id.index.wrapping_mul(MAP_FANOUT as u64)
    }

    /// What the parent pointer's GMAC covers (`pool_id` as the uuid).
    pub fn mac_input(&self, pool_id: &[u8; 16], shift: SegmentShift) -> Vec<u8> {
        let raw: Vec<_> = self
            .entries
            .iter()
            .map(|e| SegmentEntry::encode(e, shift))
            .collect();
        mac_input(
            Tree::SegmentTable,
            pool_id,
            &self.id,
            raw.iter().map(|e| &e[..]),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::blkptr::tests::shift;
    use crate::format::testing::{fuzz_canonical, refused, with};

    fn entry(segment: u64) -> SegmentEntry {
        SegmentEntry {
            segment,
            state: SegmentState::Sealed,
            stream: Stream::Meta2,
            writer_epoch: 0,
            live_bytes: 700_000,
            end_offset: 1 << 20,
            generation_opened: 4,
            generation_sealed: 9,
            local_slot: segment as u32,
            object_xxh3_128: [0; 16],
        }
    }

    fn leaf() -> SegmentLeaf {
        let id = NodeId {
            level: 0,
            index: 2,
            lineage: 0,
            birth: 12,
        };
        let mut l = SegmentLeaf {
            id,
            entries: [None; MAP_FANOUT],
        };
        for i in (0..MAP_FANOUT).step_by(3) {
            let mut e = entry(128 + i as u64);
            if i % 2 == 0 {
                e.state = SegmentState::Open;
                e.generation_sealed = 0;
                e.stream = Stream::Data;
            }
            if i % 5 == 0 {
                e.state = SegmentState::Evicted;
                e.generation_sealed = 9;
                e.local_slot = SegmentEntry::NO_SLOT;
                e.writer_epoch = 3;
                e.object_xxh3_128 = [i as u8; 16];
            }
            l.entries[i] = Some(e);
        }
        l
    }

    #[test]
    fn golden_bytes() {
        let e = SegmentEntry {
            segment: 0x0102,
            state: SegmentState::Uploaded,
            stream: Stream::Log,
            writer_epoch: 0x0304,
            live_bytes: 0x10,
            end_offset: 0x20,
            generation_opened: 0x05,
            generation_sealed: 0x06,
            local_slot: u32::MAX,
            object_xxh3_128: [0xcc; 16],
        };
        #[rustfmt::skip]
        let golden: [u8; 64] = [
            0x02, 0x01, 0, 0, 0, 0, 0, 0,
            3, 4, 0, 0, 0x04, 0x03, 0, 0,
            0x10, 0, 0, 0, 0x20, 0, 0, 0,
            5, 0, 0, 0, 0, 0, 0, 0,
            6, 0, 0, 0, 0, 0, 0, 0,
            0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0,
            0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc,
            0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc,
        ];
        assert_eq!(SegmentEntry::encode(&Some(e), shift()), golden);
        assert_eq!(
            SegmentEntry::decode(&golden, 0x0102, shift()).unwrap(),
            Some(e)
        );
        assert_eq!(SegmentEntry::decode(&[0; 64], 7, shift()).unwrap(), None);
    }

    #[test]
    fn round_trip_refusals_and_mac_input() {
        let s = shift();
        let l = leaf();
        let b = l.encode(s);
        assert_eq!(&b[..4], b"BWN2");
        assert_eq!(SegmentLeaf::decode(&b, &l.id, s).unwrap(), l);
        let m = l.mac_input(&[1; 16], s);
        assert_eq!(&m[..13], b"bulwark2 segs");
        assert_eq!(&m[46..], &b[32..]);
        let e = SegmentEntry::encode(&Some(entry(5)), s);
        let dec = |b: &[u8]| SegmentEntry::decode(b, 5, s);
        refused(dec(&e[..63]), "63 bytes");
        refused(SegmentEntry::decode(&e, 6, s), "slot of segment 6");
        refused(dec(&with(&e, 8, &[0])), "state 0");
        refused(dec(&with(&e, 8, &[5])), "state 5");
        refused(dec(&with(&e, 9, &[5])), "unknown stream 5");
        refused(dec(&with(&e, 11, &[1])), "bytes 10..12");
        refused(dec(&with(&e, 47, &[1])), "bytes 44..48");
        refused(dec(&with(&e, 20, &[0, 0, 0x20, 0])), "end offset 2097152");
        refused(dec(&with(&e, 20, &[8, 0, 0x0f, 0])), "end offset 983048");
        refused(dec(&with(&e, 20, &[0, 0, 0x0a, 0])), "700000 live bytes");
        refused(dec(&with(&e, 32, &[3])), "sealed at 3");
        refused(dec(&with(&e, 24, &[0])), "opened at generation 0");
        refused(dec(&with(&e, 8, &[4])), "evicted but has local slot 5");
        // The slot where a leaf puts an entry is its segment.
        let mut moved = b.clone();
        moved.copy_within(32..96, 96);
        refused(SegmentLeaf::decode(&moved, &l.id, s), "slot of segment 129");
        refused(
            SegmentLeaf::decode(&b, &NodeId { lineage: 1, ..l.id }, s),
            "no segment-table",
        );
    }

    #[test]
    fn decode_is_canonical_for_any_bytes() {
        let s = shift();
        let l = leaf();
        fuzz_canonical(
            "SegmentLeaf::decode",
            &[l.encode(s)],
            3000,
            None,
            &|b| SegmentLeaf::decode(b, &l.id, s),
            &|l| l.encode(s),
        );
        let entries: Vec<Vec<u8>> = l.entries[..8]
            .iter()
            .map(|e| SegmentEntry::encode(e, s).to_vec())
            .collect();
        fuzz_canonical(
            "SegmentEntry::decode",
            &entries,
            30_000,
            None,
            &|b| SegmentEntry::decode(b, b.first().map_or(0, |&x| x as u64), s),
            &|e| SegmentEntry::encode(e, s).to_vec(),
        );
    }
}
