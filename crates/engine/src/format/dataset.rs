//! Dataset record (object kind 1): a volume head or a snapshot, which replaces the v1
//! JSON volume table's entry. Its raw bytes are authenticated whole (GMAC under a pool
//! epoch, the tag in the directory leaf's pointer), so the name ↔ uuid binding, size,
//! block size and encryption flag are covered by the pool-key MAC chain.
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 4 | `BWDS` |
//! | 4 | 1 | kind: 1 volume head, 2 snapshot |
//! | 5 | 1 | encryption: 0 off, 1 on |
//! | 6 | 1 | compression: 0 off, 1 lz4 |
//! | 7 | 1 | flags: bit 0 destroy deferred, bit 1 read-only |
//! | 8 | 8 | object id |
//! | 16 | 16 | dataset uuid |
//! | 32 | 4 | lineage id |
//! | 36 | 4 | block size |
//! | 40 | 8 | size in bytes |
//! | 48 | 8 | created at generation |
//! | 56 | 8 | snapshot generation (snapshots; 0 for heads) |
//! | 64 | 8 | previous snapshot object id, 0 none |
//! | 72 | 8 | previous snapshot generation, 0 none |
//! | 80 | 8 | next (newer) snapshot or the head, object id |
//! | 88 | 8 | clone origin snapshot object id, 0 none (heads) |
//! | 96 | 8 | clone origin generation |
//! | 104 | 4 | clones of this snapshot |
//! | 108 | 4 | holds (equal to the hold list's count) |
//! | 112 | 8 | referenced bytes |
//! | 120 | 8 | used (unique) bytes |
//! | 128 | 8 | written since the previous snapshot |
//! | 136 | 64 | map root pointer (a map node, or a hole) |
//! | 200 | 64 | dead list pointer (an unsealed object, or a hole) |
//! | 264 | 64 | keyring pointer (heads: a sealed one-time-key object; a hole in snapshots) |
//! | 328 | 64 | rotation cursor: key id from u32 ‖ key id to u32 ‖ next block u64 ‖ 48 zero |
//! | 392 | 2 | name length n (1..=255; snapshots `VOL@SNAP`) |
//! | 394 | n | name, UTF-8 |
//! | 394+n | … | holds: count (u16), then (tag length u8 ≥ 1, tag UTF-8) |
//!
//! The geometry is what `volume create` accepts (block size a power of two in
//! 4–128 KiB, size a whole number of blocks up to 1 EiB).

use crate::constants::{
    BLOCK_BYTES_MAX, BLOCK_BYTES_MIN, DATASET_NAME_BYTES_MAX, VOLUME_BYTES_MAX,
};
use crate::Result;

use super::address::SegmentShift;
use super::blkptr::{Blkptr, BLKPTR_BYTES};
use super::header::RecordType;
use super::{put, Fields};

pub const DATASET_MAGIC: &[u8; 4] = b"BWDS";
/// Bytes before the name.
pub const DATASET_FIXED_BYTES: usize = 394;
pub const DATASET_FLAG_DESTROY_DEFERRED: u8 = 1;
pub const DATASET_FLAG_READ_ONLY: u8 = 2;
const ROOT_AT: usize = 136;
const DEAD_LIST_AT: usize = 200;
const KEYRING_AT: usize = 264;
const ROTATION_AT: usize = 328;

coded_enum! {
    pub enum DatasetKind: u8 {
        Head = 1,
        Snapshot = 2,
    }
}

/// Key rotation in progress: blocks below `next_block` are under `key_to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RotationCursor {
    pub key_from: u32,
    pub key_to: u32,
    pub next_block: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dataset {
    pub kind: DatasetKind,
    pub encrypted: bool,
    pub lz4: bool,
    pub flags: u8,
    pub object_id: u64,
    pub uuid: [u8; 16],
    pub lineage: u32,
    pub block_bytes: u32,
    pub size_bytes: u64,
    pub created_generation: u64,
    pub snapshot_generation: u64,
    pub prev_snapshot_id: u64,
    pub prev_snapshot_generation: u64,
    pub next_id: u64,
    pub origin_id: u64,
    pub origin_generation: u64,
    pub clones: u32,
    pub referenced_bytes: u64,
    pub used_bytes: u64,
    pub written_bytes: u64,
    pub root: Blkptr,
    pub dead_list: Blkptr,
    pub keyring: Blkptr,
    pub rotation: Option<RotationCursor>,
    pub name: String,
    pub holds: Vec<String>,
}

impl Dataset {
    pub fn encode(&self) -> Vec<u8> {
        if let Err(why) = self.check() {
            panic!("encoding a dataset record that {why}: {self:?}");
        }
        let mut b = vec![0u8; DATASET_FIXED_BYTES];
        put(&mut b, 0, DATASET_MAGIC);
        b[4] = self.kind as u8;
        b[5] = self.encrypted as u8;
        b[6] = self.lz4 as u8;
        b[7] = self.flags;
        let words: [(usize, u64); 13] = [
            (8, self.object_id),
            (40, self.size_bytes),
            (48, self.created_generation),
            (56, self.snapshot_generation),
            (64, self.prev_snapshot_id),
            (72, self.prev_snapshot_generation),
            (80, self.next_id),
            (88, self.origin_id),
            (96, self.origin_generation),
            (112, self.referenced_bytes),
            (120, self.used_bytes),
            (128, self.written_bytes),
            (ROTATION_AT + 8, self.rotation.map_or(0, |r| r.next_block)),
        ];
        for (at, v) in words {
            put(&mut b, at, &v.to_le_bytes());
        }
        put(&mut b, 16, &self.uuid);
        put(&mut b, 32, &self.lineage.to_le_bytes());
        put(&mut b, 36, &self.block_bytes.to_le_bytes());
        put(&mut b, 104, &self.clones.to_le_bytes());
        put(&mut b, 108, &(self.holds.len() as u32).to_le_bytes());
        put(&mut b, ROOT_AT, &self.root.encode());
        put(&mut b, DEAD_LIST_AT, &self.dead_list.encode());
        put(&mut b, KEYRING_AT, &self.keyring.encode());
        if let Some(r) = self.rotation {
            put(&mut b, ROTATION_AT, &r.key_from.to_le_bytes());
            put(&mut b, ROTATION_AT + 4, &r.key_to.to_le_bytes());
        }
        put(&mut b, 392, &(self.name.len() as u16).to_le_bytes());
        b.extend_from_slice(self.name.as_bytes());
        b.extend_from_slice(&(self.holds.len() as u16).to_le_bytes());
        for h in &self.holds {
            b.push(h.len() as u8);
            b.extend_from_slice(h.as_bytes());
        }
        b
    }

    /// The object's body (after its record header), in a pool of segments of `shift`.
    pub fn decode(b: &[u8], shift: SegmentShift) -> Result<Dataset> {
        let f = Fields::at_least(b, DATASET_FIXED_BYTES, "dataset record")?;
        f.check(f.array::<4>(0) == *DATASET_MAGIC, || "bad magic".into())?;
        let kind = DatasetKind::from_repr(f.u8(4))
            .ok_or_else(|| f.err(format!("unknown kind {}", f.u8(4))))?;
        let flag = |at: usize, field: &str| match f.u8(at) {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(f.err(format!("{field} byte is {v}"))),
        };
        let (encrypted, lz4) = (flag(5, "encryption")?, flag(6, "compression")?);
        let ptr = |at: usize, kind, what| {
            Blkptr::decode_as(&b[at..at + BLKPTR_BYTES], shift, kind, true, what)
        };
        let root = ptr(ROOT_AT, RecordType::Node, "dataset map root")?;
        let dead_list = ptr(DEAD_LIST_AT, RecordType::Object, "dataset dead list")?;
        let keyring = ptr(KEYRING_AT, RecordType::Object, "dataset keyring")?;
        f.zero(ROTATION_AT + 16, 48, "rotation bytes 16..64")?;
        let rotation =
            (f.u32(ROTATION_AT) != 0 || f.u32(ROTATION_AT + 4) != 0 || f.u64(ROTATION_AT + 8) != 0)
                .then(|| RotationCursor {
                    key_from: f.u32(ROTATION_AT),
                    key_to: f.u32(ROTATION_AT + 4),
                    next_block: f.u64(ROTATION_AT + 8),
                });
        let (name, rest) = text(&f, &b[392..], 2, "name")?;
        let holds_at = b.len() - rest.len();
        f.check(rest.len() >= 2, || "has no hold count".into())?;
        let count = f.u16(holds_at) as usize;
        let mut rest = &rest[2..];
        let mut holds = Vec::new();
        for _ in 0..count {
            // Each hold takes at least two bytes, so `count` cannot run past them.
            let (tag, after) = text(&f, rest, 1, "hold tag")?;
            holds.push(tag);
            rest = after;
        }
        f.check(rest.is_empty(), || {
            format!("{} bytes after the holds", rest.len())
        })?;
        f.check(f.u32(108) as usize == holds.len(), || {
            format!("says {} holds and lists {}", f.u32(108), holds.len())
        })?;
        let d = Dataset {
            kind,
            encrypted,
            lz4,
            flags: f.u8(7),
            object_id: f.u64(8),
            uuid: f.array(16),
            lineage: f.u32(32),
            block_bytes: f.u32(36),
            size_bytes: f.u64(40),
            created_generation: f.u64(48),
            snapshot_generation: f.u64(56),
            prev_snapshot_id: f.u64(64),
            prev_snapshot_generation: f.u64(72),
            next_id: f.u64(80),
            origin_id: f.u64(88),
            origin_generation: f.u64(96),
            clones: f.u32(104),
            referenced_bytes: f.u64(112),
            used_bytes: f.u64(120),
            written_bytes: f.u64(128),
            root,
            dead_list,
            keyring,
            rotation,
            name,
            holds,
        };
        d.check().map_err(|why| f.err(why))?;
        Ok(d)
    }

    /// The rules `decode` enforces and `encode` asserts, beyond each pointer's type.
    fn check(&self) -> std::result::Result<(), String> {
        let (bs, size) = (self.block_bytes, self.size_bytes);
        if !bs.is_power_of_two() || !(BLOCK_BYTES_MIN..=BLOCK_BYTES_MAX).contains(&bs) {
            return Err(format!("has block size {bs}"));
        }
        if size == 0 || size > VOLUME_BYTES_MAX || size % bs as u64 != 0 {
            return Err(format!("has size {size} for blocks of {bs}"));
        }
        if self.flags & !(DATASET_FLAG_DESTROY_DEFERRED | DATASET_FLAG_READ_ONLY) != 0 {
            return Err(format!("has unknown flags {:#04x}", self.flags));
        }
        if self.object_id < 2 || self.lineage == 0 {
            return Err(format!(
                "is object {} of lineage {} (object 1 is the pool record, lineage 0 the pool's)",
                self.object_id, self.lineage
            ));
        }
        if (self.prev_snapshot_id == 0) != (self.prev_snapshot_generation == 0)
            || (self.origin_id == 0) != (self.origin_generation == 0)
        {
            return Err("names a snapshot without its generation, or the reverse".into());
        }
        let ats = self.name.bytes().filter(|&c| c == b'@').count();
        let snapshot = self.kind == DatasetKind::Snapshot;
        if snapshot {
            if self.snapshot_generation == 0 || !self.keyring.is_hole() || self.origin_id != 0 {
                return Err("is a snapshot with no generation, a keyring or an origin".into());
            }
        } else if self.snapshot_generation != 0 || self.clones != 0 || !self.holds.is_empty() {
            return Err("is a head with a snapshot generation, clones or holds".into());
        } else if self.encrypted && self.keyring.is_hole() {
            return Err("is an encrypted head without a keyring".into());
        }
        let parts_ok = !self.name.starts_with('@') && !self.name.ends_with('@');
        if ats != snapshot as usize || !parts_ok {
            return Err(format!("is a {:?} named {:?}", self.kind, self.name));
        }
        for (p, sealed) in [(&self.dead_list, false), (&self.keyring, true)] {
            if !p.is_hole() && (p.sealed() != sealed || sealed && p.epoch != 0) {
                return Err(format!(
                    "has a {}sealed {:?} pointer",
                    ["un", ""][p.sealed() as usize],
                    p.kind
                ));
            }
        }
        if let Some(r) = self.rotation {
            let blocks = size / bs as u64;
            if r.key_from == 0 || r.key_to == 0 || r.key_from == r.key_to || r.next_block > blocks {
                return Err(format!("has rotation {r:?} over {blocks} blocks"));
            }
        }
        for s in std::iter::once(&self.name).chain(&self.holds) {
            if s.is_empty() || s.len() > DATASET_NAME_BYTES_MAX {
                return Err(format!("has a name or hold of {} bytes", s.len()));
            }
        }
        if self.holds.len() > u16::MAX as usize {
            return Err(format!("has {} holds", self.holds.len()));
        }
        Ok(())
    }
}

/// A length-prefixed UTF-8 string at the start of `b` (a `len_bytes` length, 1 or 2),
/// and the bytes after it.
fn text<'a>(f: &Fields, b: &'a [u8], len_bytes: usize, field: &str) -> Result<(String, &'a [u8])> {
    let n = match b {
        [n, ..] if len_bytes == 1 => *n as usize,
        [lo, hi, ..] if len_bytes == 2 => u16::from_le_bytes([*lo, *hi]) as usize,
        _ => return Err(f.err(format!("ends inside the length of a {field}"))),
    };
    let rest = &b[len_bytes..];
    f.check(n <= rest.len() && n <= DATASET_NAME_BYTES_MAX, || {
        format!(
            "{field} of {n} bytes, {} left (at most {DATASET_NAME_BYTES_MAX})",
            rest.len()
        )
    })?;
    let s = std::str::from_utf8(&rest[..n]).map_err(|_| f.err(format!("{field} is not UTF-8")))?;
    Ok((s.to_owned(), &rest[n..]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::address::PoolAddr;
    use crate::format::blkptr::tests::{samples, shift};
    use crate::format::blkptr::FLAG_SEALED;
    use crate::format::testing::{fuzz_canonical, refused, with};

    fn head() -> Dataset {
        let [_, _, node, keyring, ..] = samples()[..] else {
            unreachable!()
        };
        let dead = Blkptr {
            flags: 0,
            epoch: 4,
            nonce: 9,
            ..keyring
        };
        Dataset {
            kind: DatasetKind::Head,
            encrypted: true,
            lz4: true,
            flags: DATASET_FLAG_READ_ONLY,
            object_id: 12,
            uuid: [0x11; 16],
            lineage: 3,
            block_bytes: 4096,
            size_bytes: 1 << 30,
            created_generation: 5,
            snapshot_generation: 0,
            prev_snapshot_id: 14,
            prev_snapshot_generation: 30,
            next_id: 0,
            origin_id: 0,
            origin_generation: 0,
            clones: 0,
            referenced_bytes: 1 << 29,
            used_bytes: 1 << 20,
            written_bytes: 4096,
            root: node,
            dead_list: dead,
            keyring,
            rotation: Some(RotationCursor {
                key_from: 1,
                key_to: 2,
                next_block: 77,
            }),
            name: "vol-é".into(),
            holds: vec![],
        }
    }

    fn snapshot() -> Dataset {
        Dataset {
            kind: DatasetKind::Snapshot,
            encrypted: false,
            flags: DATASET_FLAG_DESTROY_DEFERRED,
            object_id: 14,
            snapshot_generation: 30,
            prev_snapshot_id: 0,
            prev_snapshot_generation: 0,
            next_id: 12,
            clones: 2,
            keyring: Blkptr::HOLE,
            rotation: None,
            root: Blkptr::HOLE,
            name: "vol@monday".into(),
            holds: vec!["backup".into(), "x".into()],
            ..head()
        }
    }

    #[test]
    fn golden_bytes() {
        let d = Dataset {
            flags: 0,
            encrypted: false,
            keyring: Blkptr::HOLE,
            dead_list: Blkptr::HOLE,
            root: Blkptr::HOLE,
            rotation: Some(RotationCursor {
                key_from: 1,
                key_to: 2,
                next_block: 3,
            }),
            name: "ab".into(),
            ..head()
        };
        let b = d.encode();
        let mut golden = vec![0u8; 394];
        golden[..8].copy_from_slice(&[b'B', b'W', b'D', b'S', 1, 0, 1, 0]);
        golden[8] = 12;
        golden[16..32].copy_from_slice(&[0x11; 16]);
        golden[32] = 3;
        golden[36..40].copy_from_slice(&[0, 0x10, 0, 0]);
        golden[40..48].copy_from_slice(&[0, 0, 0, 0x40, 0, 0, 0, 0]);
        golden[48] = 5;
        golden[64] = 14;
        golden[72] = 30;
        golden[112..120].copy_from_slice(&[0, 0, 0, 0x20, 0, 0, 0, 0]);
        golden[120..128].copy_from_slice(&[0, 0, 0x10, 0, 0, 0, 0, 0]);
        golden[128..130].copy_from_slice(&[0, 0x10]);
        golden[328..344].copy_from_slice(&[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]);
        golden[392] = 2;
        golden.extend([b'a', b'b', 0, 0]);
        assert_eq!(b, golden);
        assert_eq!(Dataset::decode(&golden, shift()).unwrap(), d);
    }

    #[test]
    fn round_trip_and_refusals() {
        let s = shift();
        for d in [head(), snapshot()] {
            assert_eq!(Dataset::decode(&d.encode(), s).unwrap(), d);
        }
        let h = head().encode();
        let n = snapshot().encode();
        let dec = |b: &[u8]| Dataset::decode(b, s);
        refused(dec(&h[..393]), "at least 394");
        refused(dec(&with(&h, 0, b"BWDT")), "bad magic");
        refused(dec(&with(&h, 4, &[3])), "unknown kind 3");
        refused(dec(&with(&h, 5, &[2])), "encryption byte is 2");
        refused(dec(&with(&h, 6, &[2])), "compression byte is 2");
        refused(dec(&with(&h, 7, &[4])), "unknown flags");
        refused(dec(&with(&h, 36, &[0, 0x30])), "block size 12288");
        refused(dec(&with(&h, 36, &[0, 0, 4])), "block size 262144");
        refused(dec(&with(&h, 40, &[1])), "size 1073741825");
        refused(dec(&with(&h, 40, &[0; 8])), "size 0");
        refused(dec(&with(&h, 8, &[1])), "object 1");
        refused(dec(&with(&h, 32, &[0])), "lineage 0");
        refused(dec(&with(&h, 72, &[0])), "without its generation");
        refused(dec(&with(&h, 56, &[1])), "head with a snapshot generation");
        refused(dec(&with(&h, KEYRING_AT, &[0; 64])), "without a keyring");
        refused(dec(&with(&h, KEYRING_AT + 21, &[0])), "unsealed Object");
        refused(
            dec(&with(&h, DEAD_LIST_AT + 21, &[FLAG_SEALED])),
            "sealed Object",
        );
        refused(dec(&with(&h, ROOT_AT + 20, &[1])), "not a Node");
        refused(dec(&with(&h, ROTATION_AT + 4, &[1])), "rotation");
        refused(
            dec(&with(&h, ROTATION_AT + 20, &[1])),
            "rotation bytes 16..64",
        );
        refused(dec(&with(&h, ROTATION_AT + 8, &[0, 0, 0, 1])), "rotation");
        refused(dec(&with(&h, 394, b"v@")), "named");
        refused(dec(&with(&h, 394, &[0xff])), "name is not UTF-8");
        refused(dec(&with(&h, 392, &[0, 1])), "name of 256 bytes");
        let mut unnamed = h[..392].to_vec();
        unnamed.extend([0, 0, 0, 0]);
        refused(dec(&unnamed), "name or hold of 0 bytes");
        refused(dec(&h[..h.len() - 1]), "no hold count");
        let mut long = h.clone();
        long.push(0);
        refused(dec(&long), "1 bytes after the holds");
        refused(dec(&with(&n, 108, &[3])), "says 3 holds and lists 2");
        refused(dec(&with(&n, 56, &[0])), "snapshot with no generation");
        refused(dec(&with(&n, 394, b"volXmonday")), "named");
        refused(dec(&with(&n, n.len() - 2, &[0])), "1 bytes after the holds");
        refused(
            dec(&with(&n, n.len() - 2, &[2])),
            "hold tag of 2 bytes, 1 left",
        );
        let fake = Blkptr {
            addr: [PoolAddr::new(1, 0), PoolAddr::NONE],
            ..samples()[3]
        };
        refused(dec(&with(&n, KEYRING_AT, &fake.encode())), "a keyring");
    }

    #[test]
    fn decode_is_canonical_for_any_bytes() {
        let s = shift();
        fuzz_canonical(
            "Dataset::decode",
            &[head().encode(), snapshot().encode()],
            20_000,
            None,
            &|b| Dataset::decode(b, s),
            &Dataset::encode,
        );
    }
}
