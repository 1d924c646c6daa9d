//! Superblock v2 (4096 bytes, the slots of v1) and the host anchor (two 512-byte slots
//! in `DIR/pool.anchor`). Layouts: decision 0008, "Superblock v2" and "Freshness".
//!
//! The superblock's *pool part* is bytes 0..4000, the same on every member; its blake3
//! is the superblock's digest ([`Superblock::digest`]), which the anchor records. Bytes
//! 4000..4032 name the device; 4032..4064 hold HMAC-SHA256(`K_sb`, bytes 0..4032)
//! ([`Superblock::hmac_input`]); 4064..4096 are zero (0008 draws 4032 + 32 = 4064;
//! the rest of the 4 KiB slot stays zero). The anchor's HMAC (`K_anchor`) covers its
//! bytes 0..480. Verifying either HMAC is step 4's; these decoders check the fields,
//! so a slot whose HMAC verified still cannot hold a value that breaks the pool's
//! arithmetic.

use crate::checksum::{checksum, Checksum};
use crate::constants::{
    DEVICES_MAX, DEVICE_RESERVED_BACK, DEVICE_RESERVED_FRONT, SUPERBLOCK_BYTES,
};
use crate::Result;

use super::address::{PoolAddr, SegmentShift, SEGMENT_ID_RESERVED};
use super::blkptr::{Blkptr, BLKPTR_BYTES};
use super::header::RecordType;
use super::{put, Fields};

pub const SUPERBLOCK_MAGIC: &[u8; 8] = b"BWSUPER2";
pub const SUPERBLOCK_VERSION: u32 = 2;
pub const SB_FLAG_OBJECT_STORE: u32 = 1;
pub const SB_FLAG_LOG_DEVICE: u32 = 2;
/// The pool part, the same on every member: its blake3 is the digest.
pub const SB_POOL_PART_BYTES: usize = 4000;
pub const SB_HMAC_AT: usize = 4032;
const MEMBER_IDS_AT: usize = 464;
const POINTERS: [(usize, &str); 4] = [
    (96, "superblock directory root"),
    (160, "superblock segment-table root"),
    (224, "superblock epoch table"),
    (400, "superblock pending replay"),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    Single,
    Mirror(u8),
    Parity { k: u8, m: u8 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub object_store: bool,
    pub pool_id: [u8; 16],
    pub generation: u64,
    pub layout: Layout,
    pub segment_shift: SegmentShift,
    pub segments_per_device: u64,
    pub device_bytes: u64,
    /// Local: the high-water slot; object store: the next segment id.
    pub high_water: u64,
    /// Object store; 0 local.
    pub writer_epoch: u32,
    pub writer_token: [u8; 16],
    /// Map node of the directory tree.
    pub directory_root: Blkptr,
    /// Map node of the segment table, or a hole.
    pub segment_table_root: Blkptr,
    /// The epoch-table object (one-time key), or a hole.
    pub epoch_table: Blkptr,
    pub epoch_salt: [u8; 32],
    pub erase_salt: [u8; 32],
    /// The intent log's first block, or `NONE`.
    pub log_start: PoolAddr,
    pub log_first_sequence: u64,
    pub log_salt: [u8; 16],
    pub log_seed: [u8; 16],
    /// The pending-replay object, or a hole.
    pub pending_replay: Blkptr,
    pub member_ids: Vec<[u8; 16]>,
    /// The log device's member id (flag bit 1), if there is one.
    pub log_device: Option<[u8; 16]>,
    pub device_id: [u8; 16],
    pub member_index: u32,
    pub hmac: [u8; 32],
}

impl Superblock {
    pub fn encode(&self) -> Vec<u8> {
        if let Err(why) = self.check() {
            panic!("encoding a superblock that {why}: {self:?}");
        }
        let mut b = vec![0u8; SUPERBLOCK_BYTES];
        put(&mut b, 0, SUPERBLOCK_MAGIC);
        put(&mut b, 8, &SUPERBLOCK_VERSION.to_le_bytes());
        let flags = self.object_store as u32 * SB_FLAG_OBJECT_STORE
            + self.log_device.is_some() as u32 * SB_FLAG_LOG_DEVICE;
        put(&mut b, 12, &flags.to_le_bytes());
        put(&mut b, 16, &self.pool_id);
        put(&mut b, 32, &self.generation.to_le_bytes());
        let (kind, n, m) = match self.layout {
            Layout::Single => (0, 1, 0),
            Layout::Mirror(n) => (1, n, 0),
            Layout::Parity { k, m } => (2, k, m),
        };
        b[40..44].copy_from_slice(&[kind, n, m, self.segment_shift.get()]);
        put(&mut b, 44, &(self.member_ids.len() as u32).to_le_bytes());
        put(&mut b, 48, &self.segments_per_device.to_le_bytes());
        put(&mut b, 56, &self.device_bytes.to_le_bytes());
        put(&mut b, 64, &self.high_water.to_le_bytes());
        put(&mut b, 72, &self.writer_epoch.to_le_bytes());
        put(&mut b, 80, &self.writer_token);
        let ptrs = [
            &self.directory_root,
            &self.segment_table_root,
            &self.epoch_table,
            &self.pending_replay,
        ];
        for ((at, _), p) in POINTERS.iter().zip(ptrs) {
            put(&mut b, *at, &p.encode());
        }
        put(&mut b, 288, &self.epoch_salt);
        put(&mut b, 320, &self.erase_salt);
        put(&mut b, 352, &self.log_start.raw().to_le_bytes());
        put(&mut b, 360, &self.log_first_sequence.to_le_bytes());
        put(&mut b, 368, &self.log_salt);
        put(&mut b, 384, &self.log_seed);
        for (i, id) in self.member_ids.iter().enumerate() {
            put(&mut b, MEMBER_IDS_AT + 16 * i, id);
        }
        put(&mut b, 720, &self.log_device.unwrap_or_default());
        put(&mut b, 4000, &self.device_id);
        put(&mut b, 4016, &self.member_index.to_le_bytes());
        put(&mut b, SB_HMAC_AT, &self.hmac);
        b
    }

    /// `Ok(None)` when the slot holds no format 2 superblock (never written, wiped, or
    /// format 1: `pool::superblock::MAGIC`); `Corrupt` when it holds a damaged one.
    pub fn decode(b: &[u8]) -> Result<Option<Superblock>> {
        if b.len() != SUPERBLOCK_BYTES || b[..8] != *SUPERBLOCK_MAGIC {
            return Ok(None);
        }
        let f = Fields::exact(b, SUPERBLOCK_BYTES, "superblock")?;
        let version = f.u32(8);
        f.check(version == SUPERBLOCK_VERSION, || {
            format!("format version {version}")
        })?;
        let flags = f.u32(12);
        f.check(
            flags & !(SB_FLAG_OBJECT_STORE | SB_FLAG_LOG_DEVICE) == 0,
            || format!("unknown flags {flags:#x}"),
        )?;
        f.zero(76, 4, "bytes 76..80")?;
        f.zero(736, SB_POOL_PART_BYTES - 736, "bytes 736..4000")?;
        f.zero(4020, 12, "bytes 4020..4032")?;
        f.zero(
            SB_HMAC_AT + 32,
            SUPERBLOCK_BYTES - SB_HMAC_AT - 32,
            "bytes 4064..4096",
        )?;
        let layout = match (f.u8(40), f.u8(41), f.u8(42)) {
            (0, 1, 0) => Layout::Single,
            (1, n, 0) if (2..=8).contains(&n) => Layout::Mirror(n),
            (2, k, m) if k >= 1 && (1..=3).contains(&m) => Layout::Parity { k, m },
            (k, n, m) => return Err(f.err(format!("unknown layout {k}/{n}/{m}"))),
        };
        let segment_shift = SegmentShift::new(f.u8(43)).map_err(|e| e.within("superblock"))?;
        let count = f.u32(44);
        f.check((1..=DEVICES_MAX as u32).contains(&count), || {
            format!("{count} members")
        })?;
        let ids_end = MEMBER_IDS_AT + 16 * count as usize;
        f.zero(
            ids_end,
            MEMBER_IDS_AT + 16 * DEVICES_MAX - ids_end,
            "member ids past the count",
        )?;
        let log_id: [u8; 16] = f.array(720);
        f.check(
            (flags & SB_FLAG_LOG_DEVICE != 0) == (log_id != [0; 16]),
            || "log device flag and member id disagree".into(),
        )?;
        let kinds = [
            RecordType::Node,
            RecordType::Node,
            RecordType::Object,
            RecordType::Object,
        ];
        let mut ptrs = [Blkptr::HOLE; 4];
        for (((at, what), kind), p) in POINTERS.iter().zip(kinds).zip(&mut ptrs) {
            *p = Blkptr::decode_as(&b[*at..*at + BLKPTR_BYTES], segment_shift, kind, true, what)?;
        }
        let [directory_root, segment_table_root, epoch_table, pending_replay] = ptrs;
        let sb = Superblock {
            object_store: flags & SB_FLAG_OBJECT_STORE != 0,
            pool_id: f.array(16),
            generation: f.u64(32),
            layout,
            segment_shift,
            segments_per_device: f.u64(48),
            device_bytes: f.u64(56),
            high_water: f.u64(64),
            writer_epoch: f.u32(72),
            writer_token: f.array(80),
            directory_root,
            segment_table_root,
            epoch_table,
            epoch_salt: f.array(288),
            erase_salt: f.array(320),
            log_start: PoolAddr::decode(f.u64(352), segment_shift, "superblock log start")?,
            log_first_sequence: f.u64(360),
            log_salt: f.array(368),
            log_seed: f.array(384),
            pending_replay,
            member_ids: (0..count as usize)
                .map(|i| f.array(MEMBER_IDS_AT + 16 * i))
                .collect(),
            log_device: (log_id != [0; 16]).then_some(log_id),
            device_id: f.array(4000),
            member_index: f.u32(4016),
            hmac: f.array(SB_HMAC_AT),
        };
        sb.check().map_err(|why| f.err(why))?;
        Ok(Some(sb))
    }

    fn check(&self) -> std::result::Result<(), String> {
        let count = self.member_ids.len() as u32;
        let wanted = match self.layout {
            Layout::Single => count,
            Layout::Mirror(n) => n as u32,
            Layout::Parity { k, m } => k as u32 + m as u32,
        };
        if count == 0 || count as usize > DEVICES_MAX || wanted != count {
            return Err(format!("has {count} members for {:?}", self.layout));
        }
        if self.member_index >= count {
            return Err(format!(
                "says it is member {} of {count}",
                self.member_index
            ));
        }
        if self.generation == 0 || self.directory_root.is_hole() {
            return Err("has generation 0 or no directory".into());
        }
        if !self.epoch_table.is_hole() && self.epoch_table.epoch != 0 {
            return Err("has an epoch table under a pool epoch, not its one-time key".into());
        }
        if self.object_store {
            if self.high_water >= SEGMENT_ID_RESERVED {
                return Err(format!("has next segment id {}", self.high_water));
            }
            return Ok(());
        }
        // Local: the segments fit the device bytes, and the high water the segments, so
        // every offset computed from them stays inside the device.
        let used = self
            .segments_per_device
            .checked_shl(self.segment_shift.get() as u32)
            .filter(|s| s >> self.segment_shift.get() == self.segments_per_device)
            .and_then(|s| s.checked_add(DEVICE_RESERVED_FRONT + DEVICE_RESERVED_BACK));
        if self.segments_per_device == 0 || used.is_none_or(|u| u > self.device_bytes) {
            return Err(format!(
                "has {} segments per device in {} bytes",
                self.segments_per_device, self.device_bytes
            ));
        }
        let segments = match self.layout {
            Layout::Single => self.segments_per_device.saturating_mul(count as u64),
            _ => self.segments_per_device,
        };
        if self.high_water > segments || self.writer_epoch != 0 {
            return Err(format!(
                "is local with high water {} of {segments} segments and writer epoch {}",
                self.high_water, self.writer_epoch
            ));
        }
        Ok(())
    }

    /// What the HMAC covers: bytes 0..4032 of an encoded superblock.
    pub fn hmac_input(b: &[u8]) -> &[u8] {
        &b[..SB_HMAC_AT]
    }

    /// The digest the anchor records: blake3 of the pool part (bytes 0..4000).
    pub fn digest(b: &[u8]) -> Checksum {
        checksum(&b[..SB_POOL_PART_BYTES])
    }
}

pub const ANCHOR_MAGIC: &[u8; 8] = b"BWANCHR2";
pub const ANCHOR_SLOT_BYTES: usize = 512;
pub const ANCHOR_HMAC_AT: usize = 480;

/// One slot of `DIR/pool.anchor`: the generations this host committed or is about to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Anchor {
    /// The newer valid slot wins.
    pub sequence: u64,
    pub pool_id: [u8; 16],
    pub committed: (u64, Checksum),
    /// Generation g+1 and its digest, while it is being written.
    pub next: Option<(u64, Checksum)>,
    pub log_floor: u64,
    pub writer_epoch: u32,
    pub hmac: [u8; 32],
}

impl Anchor {
    pub fn encode(&self) -> [u8; ANCHOR_SLOT_BYTES] {
        if let Some((g, _)) = self.next {
            assert_eq!(Some(g), self.committed.0.checked_add(1), "{self:?}");
        }
        let mut b = [0u8; ANCHOR_SLOT_BYTES];
        put(&mut b, 0, ANCHOR_MAGIC);
        put(&mut b, 8, &self.sequence.to_le_bytes());
        put(&mut b, 16, &self.pool_id);
        put(&mut b, 32, &self.committed.0.to_le_bytes());
        put(&mut b, 40, &self.committed.1);
        let (g, d) = self.next.unwrap_or_default();
        put(&mut b, 72, &g.to_le_bytes());
        put(&mut b, 80, &d);
        put(&mut b, 112, &self.log_floor.to_le_bytes());
        put(&mut b, 120, &self.writer_epoch.to_le_bytes());
        put(&mut b, ANCHOR_HMAC_AT, &self.hmac);
        b
    }

    /// `Ok(None)` for a slot never written (all zero).
    pub fn decode(b: &[u8]) -> Result<Option<Anchor>> {
        let f = Fields::exact(b, ANCHOR_SLOT_BYTES, "anchor slot")?;
        if b.iter().all(|&x| x == 0) {
            return Ok(None);
        }
        f.check(f.array::<8>(0) == *ANCHOR_MAGIC, || "bad magic".into())?;
        f.zero(124, ANCHOR_HMAC_AT - 124, "bytes 124..480")?;
        let (committed, next) = (f.u64(32), f.u64(72));
        let next_digest: Checksum = f.array(80);
        let next = match next {
            0 if next_digest == [0; 32] => None,
            g if g != 0 && Some(g) == committed.checked_add(1) => Some((g, next_digest)),
            g => return Err(f.err(format!("next generation {g} after committed {committed}"))),
        };
        Ok(Some(Anchor {
            sequence: f.u64(8),
            pool_id: f.array(16),
            committed: (committed, f.array(40)),
            next,
            log_floor: f.u64(112),
            writer_epoch: f.u32(120),
            hmac: f.array(ANCHOR_HMAC_AT),
        }))
    }

    /// What the HMAC covers: bytes 0..480 of an encoded slot.
    pub fn hmac_input(b: &[u8; ANCHOR_SLOT_BYTES]) -> &[u8] {
        &b[..ANCHOR_HMAC_AT]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::blkptr::tests::samples;
    use crate::format::testing::{fuzz_canonical, refused, with};

    fn sb(layout: Layout, count: u32) -> Superblock {
        let node = samples()[2];
        let object = samples()[3];
        Superblock {
            object_store: false,
            pool_id: [1; 16],
            generation: 77,
            layout,
            segment_shift: SegmentShift::new(20).unwrap(),
            segments_per_device: 1000,
            device_bytes: (1000 << 20) + (2 << 20),
            high_water: 12,
            writer_epoch: 0,
            writer_token: [4; 16],
            directory_root: node,
            segment_table_root: node,
            epoch_table: object,
            epoch_salt: [5; 32],
            erase_salt: [6; 32],
            log_start: PoolAddr::new(7, 4096),
            log_first_sequence: 1000,
            log_salt: [8; 16],
            log_seed: [9; 16],
            pending_replay: Blkptr::HOLE,
            member_ids: (0..count).map(|i| [0x10 + i as u8; 16]).collect(),
            log_device: Some([0xdd; 16]),
            device_id: [0x11; 16],
            member_index: count - 1,
            hmac: [0xee; 32],
        }
    }

    fn samples_sb() -> Vec<Superblock> {
        vec![
            sb(Layout::Single, 1),
            Superblock {
                log_device: None,
                log_start: PoolAddr::NONE,
                ..sb(Layout::Mirror(2), 2)
            },
            Superblock {
                object_store: true,
                writer_epoch: 3,
                high_water: 1 << 39,
                segment_shift: SegmentShift::new(23).unwrap(),
                segments_per_device: 0,
                device_bytes: 0,
                pending_replay: samples()[3],
                ..sb(Layout::Parity { k: 4, m: 2 }, 6)
            },
        ]
    }

    #[test]
    fn golden_bytes_digest_and_hmac_input() {
        let s = sb(Layout::Mirror(2), 2);
        let b = s.encode();
        let mut g = vec![0u8; 4096];
        g[..16].copy_from_slice(b"BWSUPER2\x02\0\0\0\x02\0\0\0");
        g[16..32].fill(1);
        g[32] = 77;
        g[40..48].copy_from_slice(&[1, 2, 0, 20, 2, 0, 0, 0]);
        g[48..50].copy_from_slice(&[0xe8, 0x03]);
        g[56..64].copy_from_slice(&[0, 0, 0xa0, 0x3e, 0, 0, 0, 0]);
        g[64] = 12;
        g[80..96].fill(4);
        g[96..160].copy_from_slice(&samples()[2].encode());
        g[160..224].copy_from_slice(&samples()[2].encode());
        g[224..288].copy_from_slice(&samples()[3].encode());
        g[288..320].fill(5);
        g[320..352].fill(6);
        g[352..360].copy_from_slice(&[0, 1, 0, 0x07, 0, 0, 0, 0]);
        g[360..362].copy_from_slice(&[0xe8, 0x03]);
        g[368..384].fill(8);
        g[384..400].fill(9);
        g[464..480].fill(0x10);
        g[480..496].fill(0x11);
        g[720..736].fill(0xdd);
        g[4000..4016].fill(0x11);
        g[4016] = 1;
        g[4032..4064].fill(0xee);
        assert_eq!(b, g);
        assert_eq!(Superblock::decode(&g).unwrap().unwrap(), s);
        assert_eq!(Superblock::hmac_input(&b), &g[..4032]);
        // The digest covers the pool part only: members differ in 4000..4096.
        let other = Superblock {
            device_id: [0x10; 16],
            member_index: 0,
            hmac: [1; 32],
            ..s.clone()
        };
        assert_eq!(Superblock::digest(&b), Superblock::digest(&other.encode()));
        assert_eq!(Superblock::digest(&b), checksum(&g[..4000]));
        let mut edited = s.clone();
        edited.generation += 1;
        assert_ne!(Superblock::digest(&b), Superblock::digest(&edited.encode()));
    }

    #[test]
    fn round_trip_and_refusals() {
        for s in samples_sb() {
            assert_eq!(Superblock::decode(&s.encode()).unwrap().unwrap(), s);
        }
        let b = sb(Layout::Single, 1).encode();
        assert!(Superblock::decode(&[0; 4096]).unwrap().is_none());
        assert!(Superblock::decode(&with(&b, 0, b"BWSUPER1"))
            .unwrap()
            .is_none());
        assert!(Superblock::decode(&b[..4095]).unwrap().is_none());
        let dec = |b: &[u8]| Superblock::decode(b).map(|s| s.unwrap());
        refused(dec(&with(&b, 8, &[1])), "format version 1");
        refused(dec(&with(&b, 12, &[6])), "unknown flags");
        refused(dec(&with(&b, 12, &[0])), "log device flag");
        refused(dec(&with(&b, 77, &[1])), "bytes 76..80");
        refused(dec(&with(&b, 3999, &[1])), "bytes 736..4000");
        refused(dec(&with(&b, 4031, &[1])), "bytes 4020..4032");
        refused(dec(&with(&b, 4095, &[1])), "bytes 4064..4096");
        refused(dec(&with(&b, 40, &[3])), "unknown layout 3");
        refused(dec(&with(&b, 40, &[1, 9])), "unknown layout 1/9");
        refused(dec(&with(&b, 43, &[29])), "segment shift");
        refused(dec(&with(&b, 44, &[17])), "17 members");
        refused(dec(&with(&b, 480, &[0x11])), "member ids past the count");
        refused(dec(&with(&b, 4016, &[1])), "member 1 of 1");
        refused(dec(&with(&b, 32, &[0])), "generation 0");
        refused(dec(&with(&b, 96, &[0; 64])), "no directory");
        refused(dec(&with(&b, 96 + 20, &[3])), "directory root");
        refused(dec(&with(&b, 224 + 20, &[2])), "epoch table");
        refused(dec(&with(&b, 224 + 32, &[1])), "one-time key");
        refused(
            dec(&with(&b, 48, &[0xe9, 0x03])),
            "1001 segments per device",
        );
        refused(dec(&with(&b, 48, &[0; 8])), "0 segments per device");
        refused(
            dec(&with(&b, 48, &[0, 0, 0, 0, 0, 0x10])),
            "segments per device",
        );
        refused(dec(&with(&b, 64, &[0xe9, 0x03])), "high water 1001");
        refused(dec(&with(&b, 72, &[1])), "writer epoch 1");
        refused(dec(&with(&b, 352 + 2, &[0x10])), "beyond its segment");
        let obj = samples_sb()[2].encode();
        refused(
            dec(&with(&obj, 64, &[0xff, 0xff, 0xff, 0xff, 0xff])),
            "next segment id",
        );
    }

    #[test]
    fn anchor_golden_round_trip_and_refusals() {
        let a = Anchor {
            sequence: 3,
            pool_id: [1; 16],
            committed: (9, [2; 32]),
            next: Some((10, [3; 32])),
            log_floor: 0x0102,
            writer_epoch: 4,
            hmac: [5; 32],
        };
        let b = a.encode();
        let mut g = [0u8; 512];
        g[..9].copy_from_slice(b"BWANCHR2\x03");
        g[16..32].fill(1);
        g[32] = 9;
        g[40..72].fill(2);
        g[72] = 10;
        g[80..112].fill(3);
        g[112..114].copy_from_slice(&[2, 1]);
        g[120] = 4;
        g[480..].fill(5);
        assert_eq!(b, g);
        assert_eq!(Anchor::decode(&g).unwrap().unwrap(), a);
        assert_eq!(Anchor::hmac_input(&b), &g[..480]);
        let settled = Anchor {
            next: None,
            ..a.clone()
        };
        assert_eq!(Anchor::decode(&settled.encode()).unwrap().unwrap(), settled);
        assert!(Anchor::decode(&[0; 512]).unwrap().is_none());
        refused(Anchor::decode(&g[..511]), "511 bytes");
        refused(Anchor::decode(&with(&g, 0, b"BWANCHR1")), "bad magic");
        refused(
            Anchor::decode(&with(&g, 72, &[11])),
            "next generation 11 after committed 9",
        );
        refused(Anchor::decode(&with(&g, 72, &[0])), "next generation 0");
        refused(Anchor::decode(&with(&g, 200, &[1])), "bytes 124..480");
    }

    #[test]
    fn decoders_are_canonical_for_any_bytes() {
        let valid: Vec<Vec<u8>> = samples_sb().iter().map(Superblock::encode).collect();
        fuzz_canonical(
            "v2 Superblock::decode",
            &valid,
            20_000,
            None,
            &|b| match Superblock::decode(b)? {
                Some(s) => Ok(s),
                // Not a v2 superblock at all: nothing to re-encode.
                None => Err(crate::Error::Corrupt("none".into())),
            },
            &Superblock::encode,
        );
        let anchor = |next| Anchor {
            sequence: 3,
            pool_id: [1; 16],
            committed: (u64::MAX - 1, [2; 32]),
            next,
            log_floor: 7,
            writer_epoch: 0,
            hmac: [5; 32],
        };
        let valid = vec![
            anchor(None).encode().to_vec(),
            anchor(Some((u64::MAX, [3; 32]))).encode().to_vec(),
        ];
        fuzz_canonical(
            "Anchor::decode",
            &valid,
            20_000,
            None,
            &|b| match Anchor::decode(b)? {
                Some(a) => Ok(a),
                None => Err(crate::Error::Corrupt("empty".into())),
            },
            &|a| a.encode().to_vec(),
        );
    }
}
