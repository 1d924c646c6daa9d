//! Format 2 byte layouts (decision 0008): pure encoders and decoders, no I/O, no keys.
//!
//! Step 1 of 0008's implementation: every structure of format 2 as a value type with
//! `encode` and a `decode` that takes any bytes. Pools stay format 1 (`map`,
//! `pool::superblock`) until step 7 switches `pool create`; nothing here is wired in
//! yet. One file a structure, bottom up:
//!
//! - [`address`]: the 8-byte pool address (40-bit segment id ‖ offset / 16) and the
//!   segment shift;
//! - [`blkptr`]: the 64-byte block pointer, its physical and logical parts;
//! - [`header`]: the 16-byte record header every record in a segment starts with;
//! - [`node`]: map nodes (volume maps, the directory, the segment table's inner
//!   nodes) and the bytes their GMAC covers;
//! - [`segment`]: segment-table entries and the segment table's leaves;
//! - [`epoch`]: epoch-table entries and the epoch-table object;
//! - [`dataset`]: dataset records (volume heads and snapshots);
//! - [`deadlist`]: dead lists and their chunks;
//! - [`superblock`]: superblock v2 and the host anchor;
//! - [`log`]: intent-log blocks and their entries.
//!
//! **Invariants.** Decoders take `&[u8]` and give the value or `Error::Corrupt`
//! naming the structure and field, for any bytes: they never panic, never size a
//! buffer by a number read before bounding it (counts must match the bytes present),
//! and recurse nowhere. Everything a decoder accepts encodes back to the same bytes
//! (reserved bytes must be zero), which the fuzz tests check. Encoders assert the cheap
//! invariants the decoders check, so a bug writes nothing a reader would refuse. The
//! bytes a MAC covers are given by accessors (`Blkptr::logical_bytes`,
//! `Node::mac_input`, `Superblock::hmac_input`, ...); computing MACs is step 3's.
//!
//! **Decisions where 0008 was silent** (written into the ADR in the same commit):
//! - Segment id `2^40 − 1` is never allocated, so `u64::MAX` (no copy) is no address.
//! - A pointer's type 0 goes with all 64 bytes zero (a hole); a record's length
//!   includes its 16-byte header, so a non-hole is at least 16 bytes. Copy 2, when
//!   present, lies in another segment than copy 1. Key epoch 0 (a one-time key or
//!   the log key) only on objects (nonce 0) and log blocks. Birth ≥ 1, and a child's
//!   birth is at most its node's.
//! - Lineage id 0 is pool metadata (the directory and the segment table); datasets'
//!   lineages are ≥ 1 and their object ids ≥ 2. The segment table's nodes are told
//!   apart from the directory's, which have the same lineage, key and uuid, by the
//!   GMAC label `"bulwark2 segs"` instead of `"bulwark2 node"` ([`node::Tree`]).
//! - Object kinds 6 (the pool record, object 1) and 7 (the pending-replay object),
//!   which 0008 names without a number. Their bodies, the keyring's and the log
//!   device label's are left to the steps that write them (5, 11).
//! - Key ids in a keyring start at 1; a dataset's rotation cursor is
//!   `key id from u32 ‖ key id to u32 ‖ next block u64 ‖ 48 zero`, all zero when no
//!   rotation runs; its `holds` field equals the count of its hold list.
//! - A free segment's slot in the segment table is 64 zero bytes; a dead-list
//!   bucket's chunk pointer is a hole exactly when the bucket is empty; the
//!   superblock's bytes 4064..4096 (after the HMAC) are zero.
//! - A log block is `128 + payload` bytes rounded up to 4 KiB (its length follows
//!   from the header); its GMAC covers bytes 0..88 with the xxh3 field (72..80) read as
//!   zero, so the xxh3, computed last over the whole block, can cover the tag. A log
//!   entry's header is 32 bytes (4 zero after 0008's 28) and each payload, and each
//!   record inside a WRITE_COPY, is padded to 16, so records in a block stay
//!   16-aligned. In a log-stream segment a log block is preceded by a record header
//!   (type 4); on the log device and as a log object it stands alone.

/// A fieldless enum stored as a number (`u8`, or `u32` for object kinds), with
/// `from_repr`, the decoder of that number: `None` for a value no writer stores.
macro_rules! coded_enum {
    ($(#[$m:meta])* pub enum $name:ident: $repr:ty {
        $($(#[$vm:meta])* $v:ident = $n:literal,)*
    }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr($repr)]
        pub enum $name {
            $($(#[$vm])* $v = $n,)*
        }

        impl $name {
            pub fn from_repr(v: $repr) -> Option<$name> {
                match v {
                    $($n => Some($name::$v),)*
                    _ => None,
                }
            }
        }
    };
}

pub mod address;
pub mod blkptr;
pub mod dataset;
pub mod deadlist;
pub mod epoch;
pub mod header;
pub mod log;
pub mod node;
pub mod segment;
pub mod superblock;

use crate::{Error, Result};

/// A structure's bytes after its length was checked: reads at offsets inside that
/// length cannot fail, and refusals name the structure.
#[derive(Clone, Copy)]
pub(crate) struct Fields<'a> {
    pub b: &'a [u8],
    pub what: &'static str,
}

impl<'a> Fields<'a> {
    /// `b` must be exactly `len` bytes.
    pub fn exact(b: &'a [u8], len: usize, what: &'static str) -> Result<Fields<'a>> {
        if b.len() != len {
            return Err(corrupt(what, format!("{} bytes, expected {len}", b.len())));
        }
        Ok(Fields { b, what })
    }

    /// `b` must be at least `len` bytes.
    pub fn at_least(b: &'a [u8], len: usize, what: &'static str) -> Result<Fields<'a>> {
        if b.len() < len {
            return Err(corrupt(
                what,
                format!("{} bytes, at least {len} expected", b.len()),
            ));
        }
        Ok(Fields { b, what })
    }

    pub fn u8(&self, at: usize) -> u8 {
        self.b[at]
    }
    pub fn u16(&self, at: usize) -> u16 {
        u16::from_le_bytes(self.array(at))
    }
    pub fn u32(&self, at: usize) -> u32 {
        u32::from_le_bytes(self.array(at))
    }
    pub fn u64(&self, at: usize) -> u64 {
        u64::from_le_bytes(self.array(at))
    }
    pub fn array<const N: usize>(&self, at: usize) -> [u8; N] {
        self.b[at..at + N]
            .try_into()
            .expect("inside the checked length")
    }

    /// The bytes `at..at + len` must be zero (reserved).
    pub fn zero(&self, at: usize, len: usize, field: &str) -> Result<()> {
        match self.b[at..at + len].iter().position(|&x| x != 0) {
            None => Ok(()),
            Some(i) => Err(self.err(format!("reserved {field} has byte {} set", at + i))),
        }
    }

    /// The u32 count at `at` of `size`-byte items behind a `header`-byte prefix: the
    /// bytes must hold exactly that many (so nothing is sized by an unchecked count).
    pub fn counted(&self, at: usize, header: usize, size: usize) -> Result<usize> {
        let n = self.u32(at) as usize;
        let want = n.checked_mul(size).and_then(|x| x.checked_add(header));
        self.check(want == Some(self.b.len()), || {
            format!("count {n} of {size}-byte entries in {} bytes", self.b.len())
        })?;
        Ok(n)
    }

    pub fn err(&self, msg: impl std::fmt::Display) -> Error {
        corrupt(self.what, msg)
    }

    /// Refuses unless `ok`, with `msg`.
    pub fn check(&self, ok: bool, msg: impl FnOnce() -> String) -> Result<()> {
        if ok {
            Ok(())
        } else {
            Err(self.err(msg()))
        }
    }
}

pub(crate) fn corrupt(what: &str, msg: impl std::fmt::Display) -> Error {
    Error::Corrupt(format!("{what}: {msg}"))
}

/// Little-endian writes at fixed offsets, for the encoders.
pub(crate) fn put(out: &mut [u8], at: usize, bytes: &[u8]) {
    out[at..at + bytes.len()].copy_from_slice(bytes);
}

#[cfg(test)]
pub(crate) mod testing {
    //! What every structure's tests share: the canonical-decoding fuzz loop and a
    //! refusal matcher.

    use crate::{Error, Result};

    /// Re-seals a mutant (a checksum recomputed) so mutations reach the fields behind it.
    pub type Fixup<'a> = Option<&'a dyn Fn(&mut Vec<u8>)>;

    /// `decode` never panics on mutants of `valid`, refuses only with `Corrupt`, and
    /// what it accepts encodes back to exactly the bytes it was given.
    pub fn fuzz_canonical<T: std::fmt::Debug>(
        name: &str,
        valid: &[Vec<u8>],
        cases: usize,
        fixup: Fixup,
        decode: &dyn Fn(&[u8]) -> Result<T>,
        encode: &dyn Fn(&T) -> Vec<u8>,
    ) {
        for v in valid {
            decode(v).unwrap_or_else(|e| panic!("{name}: a valid encoding is refused: {e}"));
        }
        crate::fuzz::never_panics(name, valid, cases, fixup, &|b| match decode(b) {
            Ok(v) => assert_eq!(encode(&v), b, "{name}: accepted {v:?} encodes otherwise"),
            Err(Error::Corrupt(_)) => {}
            Err(e) => panic!("{name}: not a Corrupt error: {e}"),
        });
    }

    /// `r` is a `Corrupt` error whose message holds `needle`.
    #[track_caller]
    pub fn refused<T: std::fmt::Debug>(r: Result<T>, needle: &str) {
        match r {
            Err(Error::Corrupt(m)) => assert!(m.contains(needle), "{m:?} lacks {needle:?}"),
            other => panic!("expected Corrupt({needle:?}), got {other:?}"),
        }
    }

    /// `b` with byte `at` replaced by `v`.
    pub fn with(b: &[u8], at: usize, v: &[u8]) -> Vec<u8> {
        let mut c = b.to_vec();
        c[at..at + v.len()].copy_from_slice(v);
        c
    }
}
