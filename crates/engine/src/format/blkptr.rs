//! Block pointer v2 (64 bytes): a physical part the keyless cleaner, scrub and
//! resilver may rewrite, and a logical part every MAC covers.
//!
//! | offset | size | field | P/L |
//! | --- | --- | --- | --- |
//! | 0 | 8 | pool address of copy 1 | P |
//! | 8 | 8 | pool address of copy 2, or `u64::MAX` | P |
//! | 16 | 4 | stored length, record header included; 0 = hole | P |
//! | 20 | 1 | type: 0 hole, 1 data, 2 map node, 3 object, 4 log block | L |
//! | 21 | 1 | flags: bit 0 lz4, bit 1 sealed; other bits zero | L |
//! | 22 | 2 | zero | L |
//! | 24 | 8 | birth (commit generation the pointer was installed in) | L |
//! | 32 | 4 | key epoch (0 = one-time key or log key) | L |
//! | 36 | 4 | nonce counter under that epoch's key | L |
//! | 40 | 8 | xxh3-64 of the stored bytes | P |
//! | 48 | 16 | tag (AES-GCM tag of sealed data, else the GMAC) | L |
//!
//! The *logical encoding* is bytes 20..40 ‖ 48..64 ([`Blkptr::logical_bytes`]). A hole
//! is 64 zero bytes; a hole with any other byte set is `Corrupt` (the parent's MAC
//! covers the zeros, so punching a hole is a forgery like any other).

use crate::constants::{RECORD_BYTES_MAX, RECORD_HEADER_BYTES};
use crate::Result;

use super::address::{PoolAddr, SegmentShift};
use super::header::RecordType;
use super::{put, Fields};

pub const BLKPTR_BYTES: usize = 64;
/// Bytes of a pointer's logical encoding.
pub const BLKPTR_LOGICAL_BYTES: usize = 36;
pub const FLAG_LZ4: u8 = 1;
/// The record is AES-GCM ciphertext (data of an encrypted volume, keyrings).
pub const FLAG_SEALED: u8 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Blkptr {
    /// Copies (`addr[1] == NONE` for one copy).
    pub addr: [PoolAddr; 2],
    /// Stored bytes, the record header included; 0 for a hole.
    pub len: u32,
    pub kind: RecordType,
    pub flags: u8,
    /// The commit generation the pointer was installed in.
    pub birth: u64,
    pub epoch: u32,
    pub nonce: u32,
    /// xxh3-64 of the stored bytes.
    pub checksum: u64,
    pub tag: [u8; 16],
}

impl Blkptr {
    pub const HOLE: Blkptr = Blkptr {
        addr: [PoolAddr::ZERO; 2],
        len: 0,
        kind: RecordType::Hole,
        flags: 0,
        birth: 0,
        epoch: 0,
        nonce: 0,
        checksum: 0,
        tag: [0; 16],
    };

    pub fn is_hole(&self) -> bool {
        self.kind == RecordType::Hole
    }

    /// The copies' addresses.
    pub fn addrs(&self) -> &[PoolAddr] {
        if self.addr[1].is_none() {
            &self.addr[..1]
        } else {
            &self.addr[..]
        }
    }

    pub fn sealed(&self) -> bool {
        self.flags & FLAG_SEALED != 0
    }

    /// Panics on a pointer no reader would accept (the paired assertion of `decode`).
    pub fn encode(&self) -> [u8; BLKPTR_BYTES] {
        if let Err(why) = self.check() {
            panic!("encoding a block pointer that {why}: {self:?}");
        }
        let mut b = [0u8; BLKPTR_BYTES];
        put(&mut b, 0, &self.addr[0].raw().to_le_bytes());
        put(&mut b, 8, &self.addr[1].raw().to_le_bytes());
        put(&mut b, 16, &self.len.to_le_bytes());
        b[20] = self.kind as u8;
        b[21] = self.flags;
        put(&mut b, 24, &self.birth.to_le_bytes());
        put(&mut b, 32, &self.epoch.to_le_bytes());
        put(&mut b, 36, &self.nonce.to_le_bytes());
        put(&mut b, 40, &self.checksum.to_le_bytes());
        put(&mut b, 48, &self.tag);
        b
    }

    /// What every MAC covers: bytes 20..40 ‖ 48..64 of the encoding (type, flags,
    /// zero, birth, key epoch, nonce, tag).
    pub fn logical_bytes(&self) -> [u8; BLKPTR_LOGICAL_BYTES] {
        let b = self.encode();
        let mut l = [0u8; BLKPTR_LOGICAL_BYTES];
        l[..20].copy_from_slice(&b[20..40]);
        l[20..].copy_from_slice(&b[48..64]);
        l
    }

    /// A pointer read from disk, in a pool of segments of `shift`. Refuses what no
    /// writer stores: a hole with a byte set, an unknown type or flag, a length under a
    /// record header or over `RECORD_BYTES_MAX`, no first copy, an address outside its
    /// segment, both copies in one segment, the sealed flag on a map node or log block,
    /// key epoch 0 on data or nodes, a birth of 0. Whether the segments lie inside
    /// this pool is the pool's to check.
    pub fn decode(b: &[u8], shift: SegmentShift) -> Result<Blkptr> {
        let f = Fields::exact(b, BLKPTR_BYTES, "block pointer")?;
        let kind = RecordType::from_repr(f.u8(20))
            .ok_or_else(|| f.err(format!("unknown type {}", f.u8(20))))?;
        if kind == RecordType::Hole {
            f.zero(0, BLKPTR_BYTES, "hole")?;
            return Ok(Blkptr::HOLE);
        }
        f.zero(22, 2, "bytes 22..24")?;
        let p = Blkptr {
            addr: [
                PoolAddr::decode(f.u64(0), shift, "block pointer copy 1")?,
                PoolAddr::decode(f.u64(8), shift, "block pointer copy 2")?,
            ],
            len: f.u32(16),
            kind,
            flags: f.u8(21),
            birth: f.u64(24),
            epoch: f.u32(32),
            nonce: f.u32(36),
            checksum: f.u64(40),
            tag: f.array(48),
        };
        p.check().map_err(|why| f.err(why))?;
        Ok(p)
    }

    /// `decode`, and then refuses (naming `what`) any type but `kind`, and a hole
    /// unless `hole_ok`.
    pub fn decode_as(
        b: &[u8],
        shift: SegmentShift,
        kind: RecordType,
        hole_ok: bool,
        what: &'static str,
    ) -> Result<Blkptr> {
        let p = Blkptr::decode(b, shift).map_err(|e| e.within(what))?;
        if !(p.kind == kind || hole_ok && p.is_hole()) {
            return Err(super::corrupt(
                what,
                format!("points at a {:?}, not a {kind:?}", p.kind),
            ));
        }
        Ok(p)
    }

    /// The rules `decode` enforces and `encode` asserts, beyond the address bounds.
    fn check(&self) -> std::result::Result<(), String> {
        use RecordType::*;
        if self.is_hole() {
            return if *self == Blkptr::HOLE {
                Ok(())
            } else {
                Err("is a hole with fields set".into())
            };
        }
        let len = self.len as u64;
        if len < RECORD_HEADER_BYTES as u64 || len > RECORD_BYTES_MAX {
            return Err(format!(
                "has length {len}, outside {RECORD_HEADER_BYTES}..={RECORD_BYTES_MAX}"
            ));
        }
        if self.addr[0].is_none() {
            return Err("has no first copy".into());
        }
        if !self.addr[1].is_none() && self.addr[1].segment() == self.addr[0].segment() {
            return Err(format!(
                "has both copies in segment {}",
                self.addr[0].segment()
            ));
        }
        if self.flags & !(FLAG_LZ4 | FLAG_SEALED) != 0 {
            return Err(format!("has unknown flags {:#04x}", self.flags));
        }
        if self.sealed() && !matches!(self.kind, Data | Object) {
            return Err(format!(
                "is a sealed {:?} (only data and objects are)",
                self.kind
            ));
        }
        if self.epoch == 0 && !matches!(self.kind, Object | Log) {
            return Err(format!("is a {:?} under key epoch 0", self.kind));
        }
        if self.epoch == 0 && self.kind == Object && self.nonce != 0 {
            return Err(format!(
                "is a one-time-key object with nonce {}",
                self.nonce
            ));
        }
        if self.birth == 0 {
            return Err("has birth 0".into());
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::format::testing::{fuzz_canonical, refused, with};

    pub fn shift() -> SegmentShift {
        SegmentShift::new(20).unwrap()
    }

    /// A representative pointer of each kind.
    pub fn samples() -> Vec<Blkptr> {
        let data = Blkptr {
            addr: [PoolAddr::new(5, 4096), PoolAddr::NONE],
            len: 4112,
            kind: RecordType::Data,
            flags: FLAG_SEALED,
            birth: 42,
            epoch: 3,
            nonce: 17,
            checksum: 0x0123_4567_89ab_cdef,
            tag: [0xa5; 16],
        };
        vec![
            data,
            Blkptr {
                flags: FLAG_LZ4,
                ..data
            },
            Blkptr {
                addr: [PoolAddr::new(9, 1 << 19), PoolAddr::new(10, 16)],
                len: 1500,
                kind: RecordType::Node,
                flags: FLAG_LZ4,
                nonce: u32::MAX,
                ..data
            },
            Blkptr {
                addr: [PoolAddr::new(1, 0), PoolAddr::new(2, 0)],
                kind: RecordType::Object,
                flags: FLAG_SEALED,
                epoch: 0,
                nonce: 0,
                ..data
            },
            Blkptr {
                kind: RecordType::Log,
                flags: 0,
                epoch: 0,
                ..data
            },
            Blkptr::HOLE,
        ]
    }

    #[test]
    fn golden_bytes_and_logical_encoding() {
        let p = Blkptr {
            addr: [PoolAddr::new(0x0102, 0x30), PoolAddr::NONE],
            len: 0x1010,
            kind: RecordType::Data,
            flags: FLAG_LZ4 | FLAG_SEALED,
            birth: 0x0807_0605_0403_0201,
            epoch: 0x0d0c_0b0a,
            nonce: 0x1110_0f0e,
            checksum: 0x1918_1716_1514_1312,
            tag: *b"TAGTAGTAGTAGTAG!",
        };
        #[rustfmt::skip]
        let golden: [u8; 64] = [
            // copy 1: segment 0x102 << 24 | 0x30 / 16
            0x03, 0x00, 0x00, 0x02, 0x01, 0x00, 0x00, 0x00,
            // copy 2: none
            0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
            // length, type 1, flags 3, zero
            0x10, 0x10, 0x00, 0x00, 0x01, 0x03, 0x00, 0x00,
            // birth
            0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08,
            // key epoch, nonce
            0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f, 0x10, 0x11,
            // xxh3-64
            0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, 0x19,
            // tag
            b'T', b'A', b'G', b'T', b'A', b'G', b'T', b'A',
            b'G', b'T', b'A', b'G', b'T', b'A', b'G', b'!',
        ];
        assert_eq!(p.encode(), golden);
        assert_eq!(Blkptr::decode(&golden, shift()).unwrap(), p);
        let logical = p.logical_bytes();
        assert_eq!(&logical[..20], &golden[20..40]);
        assert_eq!(&logical[20..], &golden[48..64]);
        // The physical part moves nothing in the logical encoding.
        let moved = Blkptr {
            addr: [PoolAddr::new(77, 0), PoolAddr::new(78, 16)],
            len: 99,
            checksum: 1,
            ..p
        };
        assert_eq!(moved.logical_bytes(), logical);
        assert_eq!(Blkptr::HOLE.encode(), [0; 64]);
        assert_eq!(Blkptr::HOLE.logical_bytes(), [0; 36]);
    }

    #[test]
    fn round_trip() {
        for p in samples() {
            assert_eq!(Blkptr::decode(&p.encode(), shift()).unwrap(), p);
        }
    }

    #[test]
    fn refuses_what_no_writer_stores() {
        let s = shift();
        let data = samples()[0].encode();
        let node = samples()[2].encode();
        refused(Blkptr::decode(&data[..63], s), "63 bytes");
        refused(
            Blkptr::decode(&with(&[0; 64], 40, &[1]), s),
            "reserved hole",
        );
        refused(Blkptr::decode(&with(&data, 20, &[5]), s), "unknown type 5");
        refused(Blkptr::decode(&with(&data, 21, &[4]), s), "unknown flags");
        refused(
            Blkptr::decode(&with(&data, 23, &[1]), s),
            "reserved bytes 22..24",
        );
        refused(
            Blkptr::decode(&with(&data, 16, &[0, 0, 0, 0]), s),
            "length 0",
        );
        refused(
            Blkptr::decode(&with(&data, 16, &[15, 0, 0, 0]), s),
            "length 15",
        );
        refused(
            Blkptr::decode(&with(&data, 16, &[1, 0, 0, 1]), s),
            "length 16777217",
        );
        refused(
            Blkptr::decode(&with(&data, 0, &[0xff; 8]), s),
            "no first copy",
        );
        // Offset 1 MiB inside a segment of 1 MiB.
        let far = PoolAddr::new(5, 1 << 20).raw().to_le_bytes();
        refused(
            Blkptr::decode(&with(&data, 0, &far), s),
            "beyond its segment",
        );
        assert!(Blkptr::decode(&with(&data, 0, &far), SegmentShift::new(21).unwrap()).is_ok());
        let same = PoolAddr::new(9, 4096).raw().to_le_bytes();
        refused(
            Blkptr::decode(&with(&node, 8, &same), s),
            "both copies in segment 9",
        );
        refused(
            Blkptr::decode(&with(&node, 21, &[FLAG_SEALED]), s),
            "sealed Node",
        );
        refused(
            Blkptr::decode(&with(&node, 32, &[0; 4]), s),
            "Node under key epoch 0",
        );
        let object = samples()[3].encode();
        refused(Blkptr::decode(&with(&object, 36, &[1]), s), "nonce 1");
        refused(Blkptr::decode(&with(&data, 24, &[0; 8]), s), "birth 0");
    }

    #[test]
    fn decode_is_canonical_for_any_bytes() {
        let valid: Vec<Vec<u8>> = samples().iter().map(|p| p.encode().to_vec()).collect();
        fuzz_canonical(
            "v2 Blkptr::decode",
            &valid,
            50_000,
            None,
            &|b| Blkptr::decode(b, shift()),
            &|p| p.encode().to_vec(),
        );
    }
}
