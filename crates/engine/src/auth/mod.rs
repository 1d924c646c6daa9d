//! Record authentication of format 2 (decision 0008, step 3): every record a v2 pool
//! stores is sealed (AES-256-GCM) or authenticated (GMAC) under an epoch key, with the
//! tag in the pointer that points at it. Not wired into pools yet (step 7).
//!
//! - [`record`]: the constructions. A data record is sealed (encrypted lineages) or
//!   authenticated only (unencrypted ones), bound to its lineage and logical block by
//!   `AAD_data`; a map node's tag is a GMAC over its place and its children's logical
//!   encodings, so the keyless cleaner may rewrite the children's physical fields.
//! - [`keyring`]: the policy check ([`Authenticator`]: a pointer's epoch must be one
//!   the reading lineage's keyring allows, its sealed flag what that epoch's kind
//!   says) and the writer's side ([`Sealer`], over `keys::epoch::EpochWriter`).
//!
//! **Invariants.** No byte of a record reaches a caller before its tag verified, and a
//! failed open leaves the output zeroed. The nonce is `n96(counter)`: the epoch's
//! in-memory counter, never a number read from a device. Every refusal is
//! `Error::Corrupt`, for any bytes and any pointer (fuzzed in the tests). Keys live in
//! `Zeroizing` buffers and in `codec::BlockCipher` (which wipes its schedule).

pub mod keyring;
pub mod record;

pub use keyring::{Authenticator, KeyEntry, Keyring, Sealer};
pub use record::{EpochCipher, Sealed};

/// Format 2's nonce of counter `c`: `c` as u32 little-endian, then 8 zero bytes.
pub fn n96(c: u32) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[..4].copy_from_slice(&c.to_le_bytes());
    n
}

#[cfg(test)]
mod tests;
