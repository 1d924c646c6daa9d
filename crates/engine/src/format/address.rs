//! Pool address (8 bytes): `segment id (bits 63..24) ‖ offset / 16 (bits 23..0)`.
//!
//! A segment is `2^segment_shift` bytes, the shift fixed at `pool create` between
//! `SEGMENT_SHIFT_MIN` (1 MiB) and `SEGMENT_SHIFT_MAX` (256 MiB, what 24 bits of
//! offset / 16 reach). `u64::MAX` means no copy; segment id `2^40 − 1` is therefore
//! never allocated. Whether a segment id lies inside *this* pool is the pool's to
//! check; the codec bounds the offset by the segment size.

use crate::constants::{RECORD_ALIGN, SEGMENT_ID_BITS, SEGMENT_SHIFT_MAX, SEGMENT_SHIFT_MIN};
use crate::Result;

use super::corrupt;

/// Bits of an address that hold offset / 16.
const OFFSET_BITS: u32 = 64 - SEGMENT_ID_BITS;
/// The one segment id never allocated: its last address would read as `NONE`.
pub const SEGMENT_ID_RESERVED: u64 = (1 << SEGMENT_ID_BITS) - 1;

/// `log2` of the segment size, checked to be in range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentShift(u8);

impl SegmentShift {
    pub fn new(shift: u8) -> Result<SegmentShift> {
        if !(SEGMENT_SHIFT_MIN..=SEGMENT_SHIFT_MAX).contains(&shift) {
            return Err(corrupt(
                "segment shift",
                format!("{shift} is outside {SEGMENT_SHIFT_MIN}..={SEGMENT_SHIFT_MAX}"),
            ));
        }
        Ok(SegmentShift(shift))
    }
    pub fn get(self) -> u8 {
        self.0
    }
    pub fn segment_bytes(self) -> u64 {
        1 << self.0
    }
}

/// A pool address as stored: a segment and a 16-aligned offset inside it, or `NONE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolAddr(u64);

impl PoolAddr {
    /// No copy.
    pub const NONE: PoolAddr = PoolAddr(u64::MAX);
    /// The addresses of a hole pointer (64 zero bytes).
    pub const ZERO: PoolAddr = PoolAddr(0);

    /// The address of byte `offset` of `segment`. Panics on what no writer makes: a
    /// reserved or too large segment id, an offset off `RECORD_ALIGN` or past the
    /// largest segment.
    pub fn new(segment: u64, offset: u64) -> PoolAddr {
        assert!(
            segment < SEGMENT_ID_RESERVED,
            "segment id {segment} out of range"
        );
        assert!(offset % RECORD_ALIGN == 0 && offset < 1 << SEGMENT_SHIFT_MAX);
        PoolAddr((segment << OFFSET_BITS) | (offset / RECORD_ALIGN))
    }

    /// An address read from disk (`what` names the field): `NONE`, or a segment id
    /// other than the reserved one and an offset inside a segment of `shift`.
    pub fn decode(raw: u64, shift: SegmentShift, what: &'static str) -> Result<PoolAddr> {
        let a = PoolAddr(raw);
        if a == PoolAddr::NONE {
            return Ok(a);
        }
        if a.segment() == SEGMENT_ID_RESERVED {
            return Err(corrupt(
                what,
                format!("address {raw:#x} is in the reserved segment"),
            ));
        }
        if a.offset() >= shift.segment_bytes() {
            return Err(corrupt(
                what,
                format!(
                    "address {raw:#x} has offset {} beyond its segment of {} bytes",
                    a.offset(),
                    shift.segment_bytes()
                ),
            ));
        }
        Ok(a)
    }

    pub fn raw(self) -> u64 {
        self.0
    }
    pub fn is_none(self) -> bool {
        self == PoolAddr::NONE
    }
    pub fn segment(self) -> u64 {
        self.0 >> OFFSET_BITS
    }
    /// Bytes from the segment's start.
    pub fn offset(self) -> u64 {
        (self.0 & ((1 << OFFSET_BITS) - 1)) * RECORD_ALIGN
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::testing::refused;

    #[test]
    fn golden_and_round_trip() {
        // Segment 0x12_3456_789a, offset 0x40 → offset / 16 = 4 in the low 24 bits.
        let a = PoolAddr::new(0x12_3456_789a, 0x40);
        assert_eq!(a.raw(), 0x1234_5678_9a00_0004);
        assert_eq!((a.segment(), a.offset()), (0x12_3456_789a, 0x40));
        let shift = SegmentShift::new(20).unwrap();
        assert_eq!(PoolAddr::decode(a.raw(), shift, "a").unwrap(), a);
        assert!(PoolAddr::decode(u64::MAX, shift, "a").unwrap().is_none());
        // The last offset of the largest segment.
        let last = PoolAddr::new(SEGMENT_ID_RESERVED - 1, (1 << 28) - 16);
        assert_eq!(last.raw(), 0xffff_ffff_feff_ffff);
        let big = SegmentShift::new(SEGMENT_SHIFT_MAX).unwrap();
        assert_eq!(PoolAddr::decode(last.raw(), big, "a").unwrap(), last);
    }

    #[test]
    fn refuses_offsets_beyond_the_segment_and_the_reserved_segment() {
        let shift = SegmentShift::new(20).unwrap();
        refused(
            PoolAddr::decode(PoolAddr::new(3, 1 << 20).raw(), shift, "x"),
            "beyond its segment",
        );
        refused(
            PoolAddr::decode(0xffff_ffff_ff00_0000, shift, "x"),
            "reserved segment",
        );
        refused(SegmentShift::new(19), "outside");
        refused(SegmentShift::new(29), "outside");
        // Any raw value: decoded or refused, never a panic, and an accepted one is inside.
        let mut rng = crate::fuzz::Rng::new(7);
        for _ in 0..100_000 {
            let raw = rng.next();
            if let Ok(a) = PoolAddr::decode(raw, shift, "x") {
                assert!(a.is_none() || a.offset() < 1 << 20);
                assert_eq!(a.raw(), raw);
            }
        }
    }
}
