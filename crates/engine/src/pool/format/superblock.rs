//! Superblock: the root of everything, in fixed slots on every device.
//!
//! Each device has four 4 KiB slots: two at the front, two behind the data
//! segments. Generation `g` is written to slot `g % 2` at the front and at the
//! back, on every device, after all the records it points to are durable. The
//! import takes the valid slot with the highest generation; a torn superblock
//! write fails its checksum and the other slot (one generation older, still
//! complete) is used. The layout is drawn in docs/format.md.
//!
//! Format 2 (decision 0011) carries a key check value (a wrong `pool.key` fails it on
//! every device, an altered label only on its own) and a MAC under the pool's superblock
//! key in place of format 1's blake3. `Check` says how a slot is read: keyed for import;
//! unkeyed only to list labels (`pool scan`), to recognise a device as some pool's, and
//! to read a format 1 pool, which only `pool upgrade` does.

use crate::checksum::checksum;
use crate::constants::{
    DEVICES_MAX, DEVICE_RESERVED_BACK, DEVICE_RESERVED_FRONT, SEGMENT_BYTES, SUPERBLOCK_BYTES,
    SUPERBLOCK_SLOT_OFFSETS,
};
use crate::map::{Blkptr, BLKPTR_BYTES};
use crate::redundancy::Layout;
use crate::{Error, Result};

pub const MAGIC: &[u8; 8] = b"BWSUPER1";
/// The format `pool create` writes: 2, the labels authenticated by the pool key (decision
/// 0011). Format 1 is read only to be upgraded (`bulwark pool upgrade`) or listed.
pub const VERSION: u32 = 2;
/// Format 1: the same bytes, with an unkeyed blake3 where format 2 has its MAC.
pub const VERSION_1: u32 = 1;
/// Format 1's blake3 of bytes 0..4064, or format 2's MAC of them (keyed blake3 under the
/// pool's superblock key, `keys::pool_key::PoolKey::superblock_key`).
const CHECKSUM_AT: usize = SUPERBLOCK_BYTES - 32;
/// Format 2: a key check value, the keyed blake3 of `KEY_CHECK_LABEL ‖ pool id` under the
/// superblock key. It tells a wrong `pool.key` (every device fails it) from an altered label.
const KEY_CHECK_AT: usize = 1024;
/// Format 2: the blake3 of bytes 0..1056 (every field and the key check), which a reader
/// without the key checks: labels read unkeyed (listing, `pool import`'s first look) are
/// still not trusted, but a damaged one is not taken for the newest.
const UNKEYED_SUM_AT: usize = 1056;
/// Format 2: a random id drawn by every commit, which the blocks of the intent log chain
/// it starts repeat under their MAC (`intentlog::block::Block::chain`).
const CHAIN_ID_AT: usize = 608;
const KEY_CHECK_LABEL: &[u8] = b"bulwark superblock key check v2";

/// The key that authenticates a format 2 pool's superblocks (and its intent log blocks'
/// MACs are keyed from the same pool key): derived from `DIR/pool.key` for one pool id.
pub type SbKey = zeroize::Zeroizing<[u8; 32]>;

/// How `decode` checks a slot.
#[derive(Clone, Copy)]
pub enum Check<'a> {
    /// A format 2 label must carry this key's MAC; format 1 labels are refused (`Corrupt`
    /// naming the version: a pool that has a key is never read unauthenticated).
    Key(&'a SbKey),
    /// No key: format 1 labels are verified by their checksum, format 2 labels are parsed
    /// but NOT authenticated. For listing (`pool scan`), for recognising a device that
    /// belongs to some pool, and for the upgrade of a format 1 pool: never for import.
    Unkeyed,
}

fn key_check(key: &SbKey, pool_id: &[u8; 16]) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(KEY_CHECK_LABEL);
    h.update(pool_id);
    *h.finalize().as_bytes()
}

fn mac(key: &SbKey, body: &[u8]) -> [u8; 32] {
    *blake3::keyed_hash(key, body).as_bytes()
}
/// After the member ids (160 + 16 × 16).
const TABLE_KEY_AT: usize = 416;
/// The pool's state: 0 active (imported on some host), 1 exported (`bulwark pool export`).
const STATE_AT: usize = 15;
/// The pool's name: one length byte, then that many bytes of UTF-8 (after the table key).
const NAME_AT: usize = 448;
/// Longest pool name a label holds.
pub const NAME_BYTES_MAX: usize = 64;
/// Intent log version (u32; 0 = none), then its head's two addresses (after the pool
/// name, 448..513).
const LOG_AT: usize = 520;
/// The separate log devices (`pool::intentlog::devices`): version (u32; 0 = none), count
/// (u32, 1 or 2), their ids (16 bytes each, two places), then the head slot of this
/// generation's chain on them (u64; `u64::MAX` = none: the chain, if any, is on the main
/// devices).
/// Offsets 560..608 of the 560..1024 this feature may use.
const LOG_DEV_AT: usize = 560;
/// Most log devices a pool names (the log mirrored on both).
pub const LOG_DEVICES_MAX: usize = 2;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// 1 or 2 (`VERSION`): what `encode` writes and `decode` found.
    pub format: u32,
    pub layout: Layout,
    pub pool_id: [u8; 16],
    pub device_id: [u8; 16],
    pub member_index: u32,
    pub member_count: u32,
    pub generation: u64,
    /// Bytes of each device the pool uses.
    pub device_bytes: u64,
    pub segments_per_device: u64,
    /// Nonces below this may have been used; the next import starts here.
    pub nonce_reserved: u64,
    /// One past the highest segment ever allocated.
    pub high_water: u32,
    /// The volume table record.
    pub root: Blkptr,
    pub member_ids: Vec<[u8; 16]>,
    /// Encrypts the volume table. Kept only here (in place, every slot), and replaced by a
    /// crypto-erase or key rotation: once both slots are rewritten, older tables in free
    /// space — and the wrapped keys inside them — cannot be read by anyone.
    pub table_key: [u8; 32],
    /// The pool's name (`pool create --name`); empty on pools made before names.
    pub name: String,
    /// Set by `bulwark pool export`: no host has the pool imported, and the next
    /// `bulwark pool import` may take it without `--force`. Cleared by the import's commit.
    pub exported: bool,
    /// The first slot of this generation's intent log chain (two copies), if it has one
    /// (`pool::intentlog`); a pool written by a bulwark without the log has none.
    pub log_head: Option<[u64; 2]>,
    /// The ids of the pool's separate log devices (their labels,
    /// `pool::intentlog::devices`), if any.
    pub log_devices: Vec<[u8; 16]>,
    /// The slot of this generation's chain head on the log devices, when the chain is
    /// there (then `log_head` is `None`).
    pub log_dev_head: Option<u64>,
    /// Drawn at random by every commit (format 2; zeros in format 1): the intent log chain
    /// this superblock starts carries it, so blocks of a chain of another timeline that
    /// reused this generation number (devices restored, a log device not) are not replayed.
    pub chain_id: [u8; 16],
}

impl Superblock {
    /// The slot's bytes: format 2 sealed with `key`'s MAC (a format 2 superblock without a
    /// key is a bug), format 1 with its checksum.
    pub fn encode(&self, key: Option<&SbKey>) -> Vec<u8> {
        let mut b = self.encode_body();
        match (self.format, key) {
            (VERSION, Some(key)) => {
                let check = key_check(key, &self.pool_id);
                b[KEY_CHECK_AT..KEY_CHECK_AT + 32].copy_from_slice(&check);
                let sum = checksum(&b[..UNKEYED_SUM_AT]);
                b[UNKEYED_SUM_AT..UNKEYED_SUM_AT + 32].copy_from_slice(&sum);
                let sum = mac(key, &b[..CHECKSUM_AT]);
                b[CHECKSUM_AT..].copy_from_slice(&sum);
            }
            (VERSION_1, _) => {
                let sum = checksum(&b[..CHECKSUM_AT]);
                b[CHECKSUM_AT..].copy_from_slice(&sum);
            }
            (f, _) => panic!("a format {f} superblock encoded without its key"),
        }
        b
    }

    /// The fields, without key check or checksum (`anchor::digest` hashes this).
    pub fn encode_body(&self) -> Vec<u8> {
        assert!(self.member_ids.len() <= DEVICES_MAX);
        let mut b = vec![0u8; SUPERBLOCK_BYTES];
        b[0..8].copy_from_slice(MAGIC);
        if self.format == VERSION {
            b[CHAIN_ID_AT..CHAIN_ID_AT + 16].copy_from_slice(&self.chain_id);
        }
        b[8..12].copy_from_slice(&self.format.to_le_bytes());
        let (kind, n, m) = match self.layout {
            Layout::Single => (0u8, 1u8, 0u8),
            Layout::Mirror(n) => (1, n, 0),
            Layout::Parity { k, m } => (2, k, m),
        };
        b[12] = kind;
        b[13] = n;
        b[14] = m;
        b[16..32].copy_from_slice(&self.pool_id);
        b[32..48].copy_from_slice(&self.device_id);
        b[48..52].copy_from_slice(&self.member_index.to_le_bytes());
        b[52..56].copy_from_slice(&self.member_count.to_le_bytes());
        b[56..64].copy_from_slice(&self.generation.to_le_bytes());
        b[64..72].copy_from_slice(&self.device_bytes.to_le_bytes());
        b[72..80].copy_from_slice(&self.segments_per_device.to_le_bytes());
        b[80..88].copy_from_slice(&self.nonce_reserved.to_le_bytes());
        b[88..92].copy_from_slice(&self.high_water.to_le_bytes());
        self.root.encode(&mut b[96..96 + BLKPTR_BYTES]);
        for (i, id) in self.member_ids.iter().enumerate() {
            b[160 + 16 * i..176 + 16 * i].copy_from_slice(id);
        }
        b[TABLE_KEY_AT..TABLE_KEY_AT + 32].copy_from_slice(&self.table_key);
        b[STATE_AT] = u8::from(self.exported);
        let name = self.name.as_bytes();
        assert!(
            name.len() <= NAME_BYTES_MAX,
            "pool name of {} bytes",
            name.len()
        );
        b[NAME_AT] = name.len() as u8;
        b[NAME_AT + 1..NAME_AT + 1 + name.len()].copy_from_slice(name);
        if let Some([a, c]) = self.log_head {
            b[LOG_AT..LOG_AT + 4].copy_from_slice(&1u32.to_le_bytes());
            b[LOG_AT + 8..LOG_AT + 16].copy_from_slice(&a.to_le_bytes());
            b[LOG_AT + 16..LOG_AT + 24].copy_from_slice(&c.to_le_bytes());
        }
        assert!(self.log_devices.len() <= LOG_DEVICES_MAX);
        assert!(self.log_dev_head.is_none() || !self.log_devices.is_empty());
        if !self.log_devices.is_empty() {
            b[LOG_DEV_AT..LOG_DEV_AT + 4].copy_from_slice(&1u32.to_le_bytes());
            b[LOG_DEV_AT + 4..LOG_DEV_AT + 8]
                .copy_from_slice(&(self.log_devices.len() as u32).to_le_bytes());
            for (i, id) in self.log_devices.iter().enumerate() {
                let at = LOG_DEV_AT + 8 + 16 * i;
                b[at..at + 16].copy_from_slice(id);
            }
            let head = self.log_dev_head.unwrap_or(u64::MAX);
            b[LOG_DEV_AT + 40..LOG_DEV_AT + 48].copy_from_slice(&head.to_le_bytes());
        }
        b
    }

    /// `Ok(None)` when the slot holds no bulwark superblock at all (never written, or wiped).
    pub fn decode(b: &[u8], check: Check) -> Result<Option<Superblock>> {
        if b.len() != SUPERBLOCK_BYTES || &b[0..8] != MAGIC {
            return Ok(None);
        }
        let version = u32::from_le_bytes(b[8..12].try_into().unwrap());
        match (version, check) {
            (VERSION_1, Check::Unkeyed) => {
                if checksum(&b[..CHECKSUM_AT]) != b[CHECKSUM_AT..] {
                    return Err(Error::Corrupt("superblock checksum mismatch".into()));
                }
            }
            (VERSION_1, Check::Key(_)) => {
                return Err(Error::Corrupt(
                    "superblock of format 1 (unauthenticated) in a pool that has a pool key: \
                     ignored"
                        .into(),
                ))
            }
            (VERSION, Check::Unkeyed) => {
                if checksum(&b[..UNKEYED_SUM_AT])[..] != b[UNKEYED_SUM_AT..UNKEYED_SUM_AT + 32] {
                    return Err(Error::Corrupt("superblock checksum mismatch".into()));
                }
            }
            (VERSION, Check::Key(key)) => {
                let pool_id: [u8; 16] = b[16..32].try_into().unwrap();
                if key_check(key, &pool_id)[..] != b[KEY_CHECK_AT..KEY_CHECK_AT + 32] {
                    return Err(Error::Invalid(
                        "the pool key does not match this superblock (the pool key is not \
                         this pool's, or the label was altered)"
                            .into(),
                    ));
                }
                if mac(key, &b[..CHECKSUM_AT])[..] != b[CHECKSUM_AT..] {
                    return Err(Error::Corrupt(
                        "superblock fails authentication under the pool key (altered or damaged)"
                            .into(),
                    ));
                }
            }
            (v, _) => {
                return Err(Error::Corrupt(format!(
                    "superblock format version {v} is not supported (this bulwark reads \
                     {VERSION_1} and {VERSION})"
                )))
            }
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        let layout = match (b[12], b[13]) {
            (0, _) => Layout::Single,
            (1, n) if (2..=8).contains(&n) => Layout::Mirror(n),
            (2, k) if k >= 1 && (1..=3).contains(&b[14]) => Layout::Parity { k, m: b[14] },
            (k, n) => {
                return Err(Error::Corrupt(format!(
                    "superblock has unknown layout {k}/{n}"
                )))
            }
        };
        let member_count = u32_at(52);
        if member_count == 0 || member_count as usize > DEVICES_MAX {
            return Err(Error::Corrupt(format!(
                "superblock has {member_count} members"
            )));
        }
        let member_index = u32_at(48);
        if member_index >= member_count {
            return Err(Error::Corrupt(format!(
                "superblock says it is member {member_index} of {member_count}"
            )));
        }
        let members_wanted = match layout {
            Layout::Single => member_count,
            Layout::Mirror(n) => n as u32,
            Layout::Parity { k, m } => k as u32 + m as u32,
        };
        if members_wanted != member_count {
            return Err(Error::Corrupt(format!(
                "superblock has {member_count} members for a layout of {members_wanted}"
            )));
        }
        // The segments fit the device bytes the pool uses, and the high-water mark the
        // segments: every offset computed from them stays inside the device.
        let device_bytes = u64_at(64);
        let segments_per_device = u64_at(72);
        let high_water = u32_at(88);
        let used = segments_per_device
            .checked_mul(SEGMENT_BYTES)
            .and_then(|s| s.checked_add(DEVICE_RESERVED_FRONT + DEVICE_RESERVED_BACK));
        if segments_per_device == 0 || used.is_none_or(|u| u > device_bytes) {
            return Err(Error::Corrupt(format!(
                "superblock has {segments_per_device} segments per device in {device_bytes} bytes"
            )));
        }
        let segments = match layout {
            Layout::Single => segments_per_device.saturating_mul(member_count as u64),
            _ => segments_per_device,
        };
        if high_water as u64 > segments {
            return Err(Error::Corrupt(format!(
                "superblock high-water segment {high_water} is past the pool's {segments} segments"
            )));
        }
        let root =
            Blkptr::decode(&b[96..96 + BLKPTR_BYTES]).map_err(|e| e.within("superblock root"))?;
        let exported = match b[STATE_AT] {
            0 => false,
            1 => true,
            s => {
                return Err(Error::Corrupt(format!(
                    "superblock has unknown pool state {s}"
                )))
            }
        };
        let name_len = b[NAME_AT] as usize;
        if name_len > NAME_BYTES_MAX {
            return Err(Error::Corrupt(format!(
                "superblock has a pool name of {name_len} bytes (at most {NAME_BYTES_MAX})"
            )));
        }
        let name = std::str::from_utf8(&b[NAME_AT + 1..NAME_AT + 1 + name_len])
            .map_err(|_| Error::Corrupt("superblock has a pool name that is not UTF-8".into()))?
            .to_string();
        let member_ids = (0..member_count as usize)
            .map(|i| b[160 + 16 * i..176 + 16 * i].try_into().unwrap())
            .collect();
        let log_head = match u32_at(LOG_AT) {
            0 => None,
            1 => {
                let head = [u64_at(LOG_AT + 8), u64_at(LOG_AT + 16)];
                // The second copy may be absent (a redundant layout keeps one).
                for (i, a) in head.into_iter().enumerate() {
                    if i == 1 && a == crate::map::ADDR_NONE {
                        continue;
                    }
                    if a >= crate::constants::POOL_ADDRESS_END
                        || a % crate::constants::RECORD_ALIGN != 0
                    {
                        return Err(Error::Corrupt(format!(
                            "superblock's intent log head {a} is not a record address"
                        )));
                    }
                }
                Some(head)
            }
            v => {
                return Err(Error::Corrupt(format!(
                    "superblock has intent log version {v}, unknown to this bulwark"
                )))
            }
        };
        let (log_devices, log_dev_head) = match u32_at(LOG_DEV_AT) {
            0 if b[LOG_DEV_AT..LOG_DEV_AT + 48].iter().all(|&x| x == 0) => (Vec::new(), None),
            1 => {
                let count = u32_at(LOG_DEV_AT + 4) as usize;
                if count == 0 || count > LOG_DEVICES_MAX {
                    return Err(Error::Corrupt(format!(
                        "superblock names {count} log devices (1 to {LOG_DEVICES_MAX})"
                    )));
                }
                let ids: Vec<[u8; 16]> = (0..count)
                    .map(|i| {
                        let at = LOG_DEV_AT + 8 + 16 * i;
                        b[at..at + 16].try_into().unwrap()
                    })
                    .collect();
                let head = match u64_at(LOG_DEV_AT + 40) {
                    u64::MAX => None,
                    h => Some(h),
                };
                if head.is_some() && log_head.is_some() {
                    return Err(Error::Corrupt(
                        "superblock names an intent log chain on both the main and the log devices"
                            .into(),
                    ));
                }
                (ids, head)
            }
            v => {
                return Err(Error::Corrupt(format!(
                    "superblock has log device version {v}, unknown to this bulwark"
                )))
            }
        };
        Ok(Some(Superblock {
            chain_id: if version == VERSION {
                b[CHAIN_ID_AT..CHAIN_ID_AT + 16].try_into().unwrap()
            } else {
                [0; 16]
            },
            format: version,
            log_devices,
            log_dev_head,
            layout,
            pool_id: b[16..32].try_into().unwrap(),
            device_id: b[32..48].try_into().unwrap(),
            member_index,
            member_count,
            generation: u64_at(56),
            device_bytes,
            segments_per_device,
            nonce_reserved: u64_at(80),
            high_water,
            root,
            member_ids,
            table_key: b[TABLE_KEY_AT..TABLE_KEY_AT + 32].try_into().unwrap(),
            name,
            exported,
            log_head,
        }))
    }

    /// Whether a format 2 slot's key check value is `key`'s (the key is this pool's);
    /// says nothing of the rest of the slot.
    pub fn key_matches(b: &[u8], key: &SbKey) -> bool {
        b.len() == SUPERBLOCK_BYTES
            && key_check(key, b[16..32].try_into().unwrap())[..]
                == b[KEY_CHECK_AT..KEY_CHECK_AT + 32]
    }

    /// Device offsets of the slot that generation `generation` goes to (front and back copies).
    pub fn slot_offsets(generation: u64, back_region: u64) -> [u64; 2] {
        let s = SUPERBLOCK_SLOT_OFFSETS[(generation % 2) as usize];
        [s, back_region + s]
    }

    /// Every slot offset on a device.
    pub fn all_slot_offsets(back_region: u64) -> [u64; 4] {
        let [a, b] = SUPERBLOCK_SLOT_OFFSETS;
        [a, b, back_region + a, back_region + b]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A format 2 label of member 0 of a two-device mirror named `name`.
    fn mirror_label(name: &str) -> Superblock {
        Superblock {
            format: VERSION,
            chain_id: [6; 16],
            layout: Layout::Mirror(2),
            pool_id: [1; 16],
            device_id: [2; 16],
            member_index: 0,
            member_count: 2,
            generation: 9,
            device_bytes: 1 << 30,
            segments_per_device: 1000,
            nonce_reserved: 1 << 24,
            high_water: 10,
            root: Blkptr::HOLE,
            member_ids: vec![[2; 16], [3; 16]],
            table_key: [4; 32],
            name: name.into(),
            exported: false,
            log_head: None,
            log_devices: Vec::new(),
            log_dev_head: None,
        }
    }

    fn test_key() -> SbKey {
        zeroize::Zeroizing::new([0x5a; 32])
    }

    #[test]
    fn round_trip_and_corruption() {
        let sb = Superblock {
            format: VERSION,
            chain_id: [6; 16],
            layout: Layout::Mirror(2),
            pool_id: [1; 16],
            device_id: [2; 16],
            member_index: 1,
            member_count: 2,
            generation: 77,
            device_bytes: 1 << 30,
            segments_per_device: 1000,
            nonce_reserved: 1 << 24,
            high_water: 12,
            root: Blkptr {
                addr: [5 << 4, 6 << 4],
                nonce: 0,
                len: 99,
                flags: 1,
                key_gen: 2,
                checksum: [9; 32],
            },
            member_ids: vec![[3; 16], [2; 16]],
            table_key: [7; 32],
            name: "tank".into(),
            exported: true,
            log_head: None,
            log_devices: Vec::new(),
            log_dev_head: None,
        };
        let mut b = sb.encode(Some(&test_key()));
        assert_eq!(
            Superblock::decode(&b, Check::Key(&test_key()))
                .unwrap()
                .unwrap(),
            sb
        );
        b[100] ^= 0x40;
        assert!(Superblock::decode(&b, Check::Key(&test_key())).is_err());
        assert!(
            Superblock::decode(&[0u8; SUPERBLOCK_BYTES], Check::Key(&test_key()))
                .unwrap()
                .is_none()
        );
    }

    /// Any bytes give `Ok(None)`, `Ok(Some)` or `Corrupt`, also with the checksum made
    /// right after the mutation (half the cases), which takes mutants past it to the
    /// fields. What decodes is consistent (member index, layout against member count,
    /// segments inside the device bytes, high water inside the segments, a bounded root)
    /// and encodes back to the same bytes.
    #[test]
    fn decode_never_panics_and_accepts_only_consistent_superblocks() {
        let base = |layout, count: u32, spd: u64| Superblock {
            format: VERSION,
            chain_id: [6; 16],
            layout,
            pool_id: [1; 16],
            device_id: [2; 16],
            member_index: count - 1,
            member_count: count,
            generation: 9,
            device_bytes: (spd + 2) << 20,
            segments_per_device: spd,
            nonce_reserved: 1 << 24,
            high_water: 3,
            root: Blkptr {
                addr: [3 << 20, 4 << 20],
                nonce: 0,
                len: 1000,
                flags: 1,
                key_gen: 0,
                checksum: [9; 32],
            },
            member_ids: (0..count).map(|i| [i as u8; 16]).collect(),
            table_key: [7; 32],
            name: if count > 1 {
                format!("pool{count}")
            } else {
                String::new()
            },
            exported: count == 2,
            log_head: None,
            log_devices: Vec::new(),
            log_dev_head: None,
        };
        let valid = vec![
            base(Layout::Single, 1, 60).encode(Some(&test_key())),
            base(Layout::Single, 3, 12).encode(Some(&test_key())),
            base(Layout::Mirror(2), 2, 1000).encode(Some(&test_key())),
            base(Layout::Parity { k: 4, m: 2 }, 6, 40).encode(Some(&test_key())),
            Superblock {
                log_devices: vec![[8; 16], [9; 16]],
                log_dev_head: Some(77),
                ..base(Layout::Mirror(2), 2, 100)
            }
            .encode(Some(&test_key())),
        ];
        let fix = |b: &mut Vec<u8>| {
            if b.len() == SUPERBLOCK_BYTES {
                let sum = mac(&test_key(), &b[..CHECKSUM_AT]);
                b[CHECKSUM_AT..].copy_from_slice(&sum);
            }
        };
        crate::fuzz::never_panics("Superblock::decode", &valid, 20_000, Some(&fix), &|b| {
            match Superblock::decode(b, Check::Key(&test_key())) {
                Ok(Some(sb)) => {
                    assert!(sb.member_index < sb.member_count);
                    assert_eq!(sb.member_ids.len(), sb.member_count as usize);
                    let used = DEVICE_RESERVED_FRONT
                        + sb.segments_per_device * SEGMENT_BYTES
                        + DEVICE_RESERVED_BACK;
                    assert!(used <= sb.device_bytes);
                    assert!(sb.root.len as u64 <= crate::constants::RECORD_BYTES_MAX);
                    // Bytes the encoder does not write (padding) may differ.
                    assert_eq!(
                        Superblock::decode(&sb.encode(Some(&test_key())), Check::Key(&test_key()))
                            .unwrap()
                            .unwrap(),
                        sb
                    );
                }
                // A mutated key check value reads as another pool's key.
                Ok(None) | Err(Error::Corrupt(_)) | Err(Error::Invalid(_)) => {}
                Err(e) => panic!("not a Corrupt error: {e}"),
            }
        });
    }

    /// The intent log head round-trips with one copy or two; an address off the record
    /// grid is refused.
    #[test]
    fn log_head_round_trips() {
        let base = mirror_label("logpool");
        let rec = crate::constants::RECORD_ALIGN;
        for head in [
            None,
            Some([rec * 8, crate::map::ADDR_NONE]),
            Some([rec * 8, rec * 99]),
        ] {
            let sb = Superblock {
                log_head: head,
                ..base.clone()
            };
            assert_eq!(
                Superblock::decode(&sb.encode(Some(&test_key())), Check::Key(&test_key())).unwrap(),
                Some(sb)
            );
        }
        let bad = Superblock {
            log_head: Some([rec * 8 + 1, crate::map::ADDR_NONE]),
            ..base.clone()
        };
        assert!(matches!(
            Superblock::decode(&bad.encode(Some(&test_key())), Check::Key(&test_key())),
            Err(Error::Corrupt(_))
        ));
        // Log devices, one or two, with the chain on them or not; their bytes stay in
        // 560..1024.
        for (ids, head) in [
            (vec![[5u8; 16]], None),
            (vec![[5u8; 16]], Some(0)),
            (vec![[5u8; 16], [6u8; 16]], Some(1234)),
        ] {
            let sb = Superblock {
                log_devices: ids,
                log_dev_head: head,
                ..base.clone()
            };
            let bytes = sb.encode(Some(&test_key()));
            let plain = Superblock {
                log_devices: Vec::new(),
                log_dev_head: None,
                ..sb.clone()
            }
            .encode(Some(&test_key()));
            // (The unkeyed checksum of bytes 0..1056 changes with them, of course.)
            let differ: Vec<usize> = (0..CHECKSUM_AT)
                .filter(|i| !(UNKEYED_SUM_AT..UNKEYED_SUM_AT + 32).contains(i))
                .filter(|&i| bytes[i] != plain[i])
                .collect();
            assert!(
                differ.iter().all(|&i| (560..1024).contains(&i)),
                "{differ:?}"
            );
            assert_eq!(
                Superblock::decode(&bytes, Check::Key(&test_key())).unwrap(),
                Some(sb)
            );
        }
        // Both chains named at once is refused.
        let mut both = Superblock {
            log_devices: vec![[5u8; 16]],
            log_dev_head: Some(3),
            ..base
        }
        .encode(Some(&test_key()));
        both[LOG_AT..LOG_AT + 4].copy_from_slice(&1u32.to_le_bytes());
        both[LOG_AT + 8..LOG_AT + 16].copy_from_slice(&(rec * 8).to_le_bytes());
        both[LOG_AT + 16..LOG_AT + 24].copy_from_slice(&crate::map::ADDR_NONE.to_le_bytes());
        let sum = mac(&test_key(), &both[..CHECKSUM_AT]);
        both[CHECKSUM_AT..].copy_from_slice(&sum);
        assert!(matches!(
            Superblock::decode(&both, Check::Key(&test_key())),
            Err(Error::Corrupt(_))
        ));
    }

    /// What an attacker who writes the devices can do to a format 2 label without the pool
    /// key: change any field and recompute every unkeyed checksum. Each is refused; a wrong
    /// key is told apart from an altered label; a format 1 label is read only unkeyed.
    #[test]
    fn a_label_altered_without_the_key_is_refused() {
        let sb = mirror_label("authpool");
        let key = test_key();
        let good = sb.encode(Some(&key));
        assert_eq!(
            Superblock::decode(&good, Check::Key(&key)).unwrap(),
            Some(sb.clone())
        );
        // Layout mirror:2 → single, copies, member count, generation, nonce counter: each
        // with format 1's checksum recomputed over the edit (all an attacker can compute).
        for (at, value) in [(12usize, 0u8), (13, 3), (52, 1), (56, 10), (80, 0)] {
            let mut b = good.clone();
            b[at] = value;
            let sum = checksum(&b[..CHECKSUM_AT]);
            b[CHECKSUM_AT..].copy_from_slice(&sum);
            assert!(
                matches!(
                    Superblock::decode(&b, Check::Key(&key)),
                    Err(Error::Corrupt(_))
                ),
                "byte {at} edited"
            );
        }
        let other = zeroize::Zeroizing::new([0x11; 32]);
        assert!(matches!(
            Superblock::decode(&good, Check::Key(&other)),
            Err(Error::Invalid(_))
        ));
        // Unkeyed, the same label parses (for listing) but is not authenticated.
        assert_eq!(
            Superblock::decode(&good, Check::Unkeyed).unwrap(),
            Some(sb.clone())
        );
        // Format 1: verified by its checksum unkeyed, never accepted where a key is.
        let v1 = Superblock {
            format: VERSION_1,
            chain_id: [0; 16],
            ..sb
        };
        let b1 = v1.encode(None);
        assert_eq!(Superblock::decode(&b1, Check::Unkeyed).unwrap(), Some(v1));
        assert!(matches!(
            Superblock::decode(&b1, Check::Key(&key)),
            Err(Error::Corrupt(_))
        ));
    }
}
