//! Block codec: compress (lz4, skipped when it does not pay), encrypt with
//! AES-256-GCM, and checksum the stored bytes.
//!
//! The checksum covers the *stored* bytes so scrub and repair work without the
//! key. It is blake3-256 for metadata and for data blocks of unencrypted
//! volumes, and xxh3-128 (tagged, see [`crate::checksum::checksum_sealed`]) for data blocks of
//! encrypted volumes, whose AEAD tag already authenticates them: there the
//! checksum only has to catch accidents, and blake3 on a 4 KiB block costs
//! four times as much as the encryption (docs/decisions/0006). The AEAD's associated data binds a block to its volume and logical
//! block number: a valid ciphertext moved to another address does not decrypt.
//! Nonces are never chosen here: the caller passes a pool-unique 64-bit counter
//! (see `pool` and ARCHITECTURE.md, "Nonces").
//!
//! Compression is tried when a 512-byte sample of the block compresses; along a volume's
//! writes, after two incompressible samples in a row only one block in 16 is sampled
//! ([`CompressGuess`], kept per volume). A block is sealed straight from the request buffer
//! into the record buffer and opened straight into the reply buffer ([`encode_at`],
//! [`decode`]). `aead.rs` runs AES-256-GCM on aws-lc-rs or ring, whichever is faster on the
//! CPU: the same bytes either way.

use std::sync::atomic::{AtomicU32, Ordering};

mod aead;
pub use aead::{AeadBackend, BlockCipher};

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Stored bytes are lz4-compressed.
pub const FLAG_LZ4: u16 = 1 << 0;
/// Stored bytes are AES-256-GCM ciphertext followed by the tag.
pub const FLAG_ENCRYPTED: u16 = 1 << 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Compression {
    Off,
    Lz4,
}

impl std::str::FromStr for Compression {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "off" => Ok(Compression::Off),
            "lz4" => Ok(Compression::Lz4),
            _ => Err(Error::Invalid(format!(
                "invalid compression '{s}': expected off or lz4"
            ))),
        }
    }
}

impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Compression::Off => "off",
            Compression::Lz4 => "lz4",
        })
    }
}

/// Whether a record's flags fit its volume's policy: every data record of an encrypted
/// volume is sealed, and no record of a plain volume is. The flags come from a block
/// pointer on disk, which anyone who can write the devices can forge together with an
/// unkeyed checksum: a record that claims to be plaintext in an encrypted volume is refused,
/// never returned as data (it would be bytes an attacker chose).
pub fn check_policy(encrypted_volume: bool, flags: u16) -> Result<()> {
    match (encrypted_volume, flags & FLAG_ENCRYPTED != 0) {
        (true, false) => Err(Error::Corrupt(
            "a block of an encrypted volume is stored unencrypted; refused (it was not written by this volume)".into(),
        )),
        (false, true) => Err(Error::Corrupt(
            "a block of an unencrypted volume claims to be encrypted; refused".into(),
        )),
        _ => Ok(()),
    }
}

/// AES-256-GCM tag length.
pub const TAG_BYTES: usize = crate::constants::AEAD_TAG_BYTES;

/// Associated data of a data block: volume uuid and logical block number.
pub fn block_aad(volume_uuid: &[u8; 16], block: u64) -> [u8; 24] {
    let mut a = [0u8; 24];
    a[..16].copy_from_slice(volume_uuid);
    a[16..].copy_from_slice(&block.to_le_bytes());
    a
}

/// Encode `plain` into `out` (cleared first). Returns the flags to record in the block pointer.
pub fn encode(
    plain: &[u8],
    compression: Compression,
    cipher: Option<&BlockCipher>,
    aad: &[u8],
    nonce: u64,
    out: &mut Vec<u8>,
) -> Result<u16> {
    out.clear();
    encode_append(plain, compression, cipher, aad, nonce, out)
}

/// Bytes sampled to guess whether a block compresses.
const SAMPLE_BYTES: usize = 512;

/// Cheap guess: compress a sample from the middle of the block; incompressible data (most VM
/// disk contents: already compressed or encrypted) then costs a 512-byte attempt, not a
/// whole-block one. A block whose sample does not shrink by 1/16 is stored as it is.
fn worth_compressing(plain: &[u8]) -> bool {
    if plain.len() < 4 * SAMPLE_BYTES {
        return true;
    }
    let mid = plain.len() / 2 - SAMPLE_BYTES / 2;
    let sample = &plain[mid..mid + SAMPLE_BYTES];
    let mut buf = [0u8; SAMPLE_BYTES + SAMPLE_BYTES / 8 + 32];
    match lz4_flex::block::compress_into(sample, &mut buf) {
        Ok(n) => n <= SAMPLE_BYTES - SAMPLE_BYTES / 16,
        Err(_) => true,
    }
}

/// Consecutive incompressible samples after which blocks are sampled only one in
/// `SAMPLE_EVERY`.
const MISSES_BEFORE_SKIPPING: u32 = 2;
/// While skipping, one block in this many is sampled.
const SAMPLE_EVERY: u32 = 16;

/// Decides, block by block along a volume's writes, whether a block is worth an lz4
/// attempt. A volume's writes usually come in long runs of one kind of data (an
/// image, a database file, already compressed media), so after
/// `MISSES_BEFORE_SKIPPING` incompressible samples in a row only one block in
/// `SAMPLE_EVERY` is sampled (the rest are stored as they are) until a sample
/// compresses again. On incompressible data (most VM disk contents) that cuts the
/// sampling cost by `SAMPLE_EVERY`; compressible data after an incompressible run
/// is found within `SAMPLE_EVERY` blocks of the volume's writes.
///
/// One guess serves every writer of a volume (it lives in the volume's state): the
/// counters are relaxed atomics, and a race between writers only moves which block
/// is sampled, never what is stored for a block that was.
#[derive(Default)]
pub struct CompressGuess {
    misses: AtomicU32,
    skipped: AtomicU32,
}

impl CompressGuess {
    /// Whether to try lz4 on `plain` (and learn from the sample taken).
    pub fn try_block(&self, plain: &[u8]) -> bool {
        if self.misses.load(Ordering::Relaxed) >= MISSES_BEFORE_SKIPPING
            && self.skipped.fetch_add(1, Ordering::Relaxed) + 1 < SAMPLE_EVERY
        {
            return false;
        }
        self.skipped.store(0, Ordering::Relaxed);
        let worth = worth_compressing(plain);
        if worth {
            self.misses.store(0, Ordering::Relaxed);
        } else {
            self.misses.fetch_add(1, Ordering::Relaxed);
        }
        worth
    }
}

/// Like `encode`, appending the stored bytes to `out` (records of a batch end to end).
pub fn encode_append(
    plain: &[u8],
    compression: Compression,
    cipher: Option<&BlockCipher>,
    aad: &[u8],
    nonce: u64,
    out: &mut Vec<u8>,
) -> Result<u16> {
    let at = out.len();
    let (flags, len) = encode_at(
        plain,
        compression,
        &CompressGuess::default(),
        cipher,
        aad,
        nonce,
        out,
        at,
    )?;
    out.truncate(at + len);
    Ok(flags)
}

/// Most bytes `encode_at` may need for a block of `len` bytes.
pub fn encoded_len_max(len: usize) -> usize {
    lz4_flex::block::get_maximum_output_size(len).max(len) + TAG_BYTES
}

/// Encodes `plain` into `out[at..]` and returns the flags to record in the block
/// pointer and the stored length. `out` grows (zero-filled) only when it is shorter
/// than `at + encoded_len_max`; bytes past the stored length are left as they were.
/// A caller that reuses `out` across writes therefore touches only the bytes it
/// stores: the plaintext is encrypted straight from `plain` into `out`, with no copy
/// in between and no zero-filling.
#[allow(clippy::too_many_arguments)]
pub fn encode_at(
    plain: &[u8],
    compression: Compression,
    guess: &CompressGuess,
    cipher: Option<&BlockCipher>,
    aad: &[u8],
    nonce: u64,
    out: &mut Vec<u8>,
    at: usize,
) -> Result<(u16, usize)> {
    let max = at + encoded_len_max(plain.len());
    if out.len() < max {
        out.resize(max, 0);
    }
    let mut flags = 0;
    let mut len = plain.len();
    if compression == Compression::Lz4 && guess.try_block(plain) {
        let n = lz4_flex::block::compress_into(plain, &mut out[at..])
            .map_err(|e| Error::Invalid(format!("lz4: {e}")))?;
        // Pays only when it saves at least an eighth: smaller stored blocks cost a decompress on every read.
        if n <= plain.len() - plain.len() / 8 {
            len = n;
            flags |= FLAG_LZ4;
        }
    }
    match (cipher, flags & FLAG_LZ4 != 0) {
        (None, true) => {}
        (None, false) => out[at..at + len].copy_from_slice(plain),
        (Some(c), compressed) => {
            let (body, tag) = out[at..at + len + TAG_BYTES].split_at_mut(len);
            let from = if compressed { None } else { Some(plain) };
            c.seal(nonce, aad, from, body, tag)?;
        }
    }
    if cipher.is_some() {
        len += TAG_BYTES;
        flags |= FLAG_ENCRYPTED;
    }
    Ok((flags, len))
}

/// Whether a record of `stored_len` bytes with `flags` holds a whole block of
/// `block_len` bytes encrypted and uncompressed: its ciphertext, as long as the block,
/// then the tag. Such a record can be read apart (`open_sealed`).
pub fn sealed_whole(flags: u16, stored_len: usize, block_len: usize) -> bool {
    flags & (FLAG_ENCRYPTED | FLAG_LZ4) == FLAG_ENCRYPTED && stored_len == block_len + TAG_BYTES
}

/// Opens a record that `sealed_whole` describes, read apart: the ciphertext in `body`,
/// decrypted in place, and the tag in `tag`. The tag authenticates the block (decision
/// 0006), so a record that opens needs no checksum. On failure `body` holds no plaintext.
pub fn open_sealed(
    cipher: &BlockCipher,
    aad: &[u8],
    nonce: u64,
    body: &mut [u8],
    tag: &[u8],
) -> Result<()> {
    cipher
        .open_in_place(nonce, aad, body, tag)
        .map_err(|_| tag_failed())
}

/// The error of a block whose AEAD tag does not match.
fn tag_failed() -> Error {
    Error::Corrupt("block failed authentication (AEAD tag mismatch)".into())
}

/// Decode stored bytes (already checksum-verified) into `out`, which has the logical length.
/// `stored` is used as scratch and is clobbered.
pub fn decode(
    stored: &mut [u8],
    flags: u16,
    cipher: Option<&BlockCipher>,
    aad: &[u8],
    nonce: u64,
    out: &mut [u8],
) -> Result<()> {
    if flags & FLAG_ENCRYPTED != 0 && flags & FLAG_LZ4 == 0 {
        // Decrypted straight into `out`: no copy through `stored`.
        let c = cipher
            .ok_or_else(|| Error::Corrupt("encrypted block in a volume without a key".into()))?;
        if stored.len() != out.len() + TAG_BYTES {
            return Err(Error::Corrupt(format!(
                "block holds {} bytes, expected {}",
                stored.len().saturating_sub(TAG_BYTES),
                out.len()
            )));
        }
        let (body, tag) = stored.split_at(out.len());
        return c
            .open_into(nonce, aad, body, tag, out)
            .map_err(|_| tag_failed());
    }
    let plain: &[u8] = if flags & FLAG_ENCRYPTED != 0 {
        let c = cipher
            .ok_or_else(|| Error::Corrupt("encrypted block in a volume without a key".into()))?;
        if stored.len() < TAG_BYTES {
            return Err(tag_failed());
        }
        let (body, tag) = stored.split_at_mut(stored.len() - TAG_BYTES);
        c.open_in_place(nonce, aad, body, tag)
            .map_err(|_| tag_failed())?;
        body
    } else {
        stored
    };
    if flags & FLAG_LZ4 != 0 {
        let n = lz4_flex::block::decompress_into(plain, out)
            .map_err(|e| Error::Corrupt(format!("lz4: {e}")))?;
        if n != out.len() {
            return Err(Error::Corrupt(format!(
                "lz4 block decompressed to {n} bytes, expected {}",
                out.len()
            )));
        }
    } else {
        if plain.len() != out.len() {
            return Err(Error::Corrupt(format!(
                "block holds {} bytes, expected {}",
                plain.len(),
                out.len()
            )));
        }
        out.copy_from_slice(plain);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use zeroize::Zeroizing;

    /// The same key in both AES-256-GCM backends.
    fn ciphers() -> [BlockCipher; 2] {
        let key = Zeroizing::new([7u8; 32]);
        [
            BlockCipher::with_backend(&key, AeadBackend::AwsLc),
            BlockCipher::with_backend(&key, AeadBackend::Ring),
        ]
    }

    /// A compressible block (repeated text) and an incompressible-looking one.
    fn sample_blocks() -> [Vec<u8>; 2] {
        let text: Vec<u8> = b"bulwark ".iter().cycle().take(4096).copied().collect();
        let random: Vec<u8> = (0..4096u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        [text, random]
    }

    #[test]
    fn round_trip_all_modes() {
        let [a, r] = ciphers();
        for plain in &sample_blocks() {
            for comp in [Compression::Off, Compression::Lz4] {
                for ci in [None, Some(&a), Some(&r)] {
                    let aad = block_aad(&[1; 16], 9);
                    let mut stored = Vec::new();
                    let flags = encode(plain, comp, ci, &aad, 42, &mut stored).unwrap();
                    let mut out = vec![0u8; 4096];
                    decode(&mut stored.clone(), flags, ci, &aad, 42, &mut out).unwrap();
                    assert_eq!(&out, plain);
                }
            }
        }
    }

    /// Records of a batch are encoded into a buffer reused across writes: what lies
    /// past the record (or in it, before encoding) must not change the result.
    #[test]
    fn encoding_into_a_reused_buffer_matches_a_fresh_one() {
        let [a, r] = ciphers();
        for plain in &sample_blocks() {
            for comp in [Compression::Off, Compression::Lz4] {
                for ci in [None, Some(&a), Some(&r)] {
                    let mut fresh = Vec::new();
                    let flags = encode(plain, comp, ci, &[3; 24], 7, &mut fresh).unwrap();
                    let mut reused = vec![0xA5u8; 3 * 4096];
                    let (f, len) = encode_at(
                        plain,
                        comp,
                        &CompressGuess::default(),
                        ci,
                        &[3; 24],
                        7,
                        &mut reused,
                        32,
                    )
                    .unwrap();
                    assert_eq!((f, &reused[32..32 + len]), (flags, &fresh[..]));
                    assert!(reused[..32].iter().all(|&b| b == 0xA5), "bytes before `at`");
                    assert_eq!(reused.len(), 3 * 4096, "a long enough buffer is not grown");
                }
            }
        }
    }

    #[test]
    fn incompressible_runs_are_sampled_sparsely_and_compressible_blocks_still_found() {
        let mut x = 0x9E3779B97F4A7C15u64;
        let mut random = || -> Vec<u8> {
            (0..4096)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x >> 32) as u8
                })
                .collect()
        };
        let text: Vec<u8> = b"bulwark ".iter().cycle().take(4096).copied().collect();
        let g = CompressGuess::default();
        let misses = |g: &CompressGuess| g.misses.load(Ordering::Relaxed);
        // Two misses, then one sample in SAMPLE_EVERY.
        let n = (MISSES_BEFORE_SKIPPING + 2 * SAMPLE_EVERY) as usize;
        let tried: Vec<bool> = (0..n).map(|_| g.try_block(&random())).collect();
        assert_eq!(misses(&g), MISSES_BEFORE_SKIPPING + 2);
        assert_eq!(tried, vec![false; n]);
        // A compressible block right after a run is tried within SAMPLE_EVERY blocks,
        // and from then on every block is sampled again.
        let first = (0..SAMPLE_EVERY)
            .position(|_| g.try_block(&text))
            .expect("compressible block never tried");
        assert!(first < SAMPLE_EVERY as usize);
        assert_eq!(misses(&g), 0);
        assert!(g.try_block(&text) && g.try_block(&text));
        // Through encode: all compressible blocks of a mixed run end up compressed
        // except at most SAMPLE_EVERY - 1 after an incompressible stretch.
        let g = CompressGuess::default();
        let mut uncompressed_text = 0;
        let run = 2 * SAMPLE_EVERY;
        let mut out = Vec::new();
        for i in 0..4 * run {
            let block = if (i / run) % 2 == 0 {
                random()
            } else {
                text.clone()
            };
            let (f, len) =
                encode_at(&block, Compression::Lz4, &g, None, &[], 0, &mut out, 0).unwrap();
            assert!(len < block.len() || out[..len] == block[..]);
            if block == text && f & FLAG_LZ4 == 0 {
                uncompressed_text += 1;
            }
        }
        assert!(
            uncompressed_text <= 2 * (SAMPLE_EVERY - 1),
            "{uncompressed_text}"
        );
    }

    #[test]
    fn compression_skipped_when_it_does_not_pay() {
        let mut x = 0x2545F4914F6CDD1Du64;
        let random: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 32) as u8
            })
            .collect();
        let mut out = Vec::new();
        let flags = encode(&random, Compression::Lz4, None, &[], 0, &mut out).unwrap();
        assert_eq!(flags & FLAG_LZ4, 0);
        assert_eq!(out, random);
    }

    #[test]
    fn relocated_or_tampered_ciphertext_fails() {
        for c in &ciphers() {
            relocated_or_tampered_ciphertext_fails_with(c);
        }
    }

    fn relocated_or_tampered_ciphertext_fails_with(c: &BlockCipher) {
        let plain = vec![5u8; 4096];
        let mut stored = Vec::new();
        let flags = encode(
            &plain,
            Compression::Off,
            Some(c),
            &block_aad(&[1; 16], 3),
            1,
            &mut stored,
        )
        .unwrap();
        let mut out = vec![0u8; 4096];
        // Same bytes presented at another logical block.
        assert!(decode(
            &mut stored.clone(),
            flags,
            Some(c),
            &block_aad(&[1; 16], 4),
            1,
            &mut out
        )
        .is_err());
        // Another volume.
        assert!(decode(
            &mut stored.clone(),
            flags,
            Some(c),
            &block_aad(&[2; 16], 3),
            1,
            &mut out
        )
        .is_err());
        // One flipped bit. What was decrypted is not left for a caller to send.
        let mut t = stored.clone();
        t[100] ^= 1;
        out.fill(0xEE);
        assert!(decode(&mut t, flags, Some(c), &block_aad(&[1; 16], 3), 1, &mut out).is_err());
        assert!(
            out.iter().all(|&b| b == 0),
            "unauthenticated plaintext left in out"
        );
        assert!(!stored.windows(16).any(|w| w == &plain[..16]));
        // The tag itself changed: the same, and with lz4 on the in-place path too.
        let mut t = stored.clone();
        let last = t.len() - 1;
        t[last] ^= 0x80;
        out.fill(0xEE);
        assert!(decode(&mut t, flags, Some(c), &block_aad(&[1; 16], 3), 1, &mut out).is_err());
        assert!(
            out.iter().all(|&b| b == 0),
            "unauthenticated plaintext left in out"
        );
        let text: Vec<u8> = b"tampered ".iter().cycle().take(4096).copied().collect();
        let mut z = Vec::new();
        let zflags = encode(&text, Compression::Lz4, Some(c), &[9; 24], 2, &mut z).unwrap();
        assert_ne!(zflags & FLAG_LZ4, 0);
        z[3] ^= 4;
        assert!(decode(&mut z, zflags, Some(c), &[9; 24], 2, &mut out).is_err());
    }

    /// Both backends are the same AES-256-GCM: a pool written on a CPU that picks one
    /// opens on a CPU that picks the other, bit for bit.
    #[test]
    fn backends_seal_the_same_bytes_and_open_each_other() {
        let [a, r] = ciphers();
        assert_eq!(
            (a.backend(), r.backend()),
            (AeadBackend::AwsLc, AeadBackend::Ring)
        );
        for plain in &sample_blocks() {
            for comp in [Compression::Off, Compression::Lz4] {
                let aad = block_aad(&[4; 16], 77);
                let mut by_a = Vec::new();
                let mut by_r = Vec::new();
                let fa = encode(plain, comp, Some(&a), &aad, 1 << 40, &mut by_a).unwrap();
                let fr = encode(plain, comp, Some(&r), &aad, 1 << 40, &mut by_r).unwrap();
                assert_eq!((fa, &by_a), (fr, &by_r), "{comp:?}");
                for (sealed, opener) in [(&by_a, &r), (&by_r, &a)] {
                    let mut out = vec![0u8; plain.len()];
                    decode(
                        &mut sealed.clone(),
                        fa,
                        Some(opener),
                        &aad,
                        1 << 40,
                        &mut out,
                    )
                    .unwrap();
                    assert_eq!(&out, plain);
                }
            }
        }
    }

    /// `decode` of a data block gives `Ok` or `Corrupt` for any stored bytes and any
    /// flags (the first two bytes of a case), into a block-sized buffer it never grows.
    #[test]
    fn decode_never_panics() {
        let [c, _] = ciphers();
        let plain: Vec<u8> = (0..4096u32).map(|i| (i / 7) as u8).collect();
        let aad = block_aad(&[1; 16], 9);
        let mut valid = Vec::new();
        for (comp, cipher) in [
            (Compression::Lz4, Some(&c)),
            (Compression::Off, Some(&c)),
            (Compression::Lz4, None),
            (Compression::Off, None),
        ] {
            let mut out = Vec::new();
            let flags = encode(&plain, comp, cipher, &aad, 5, &mut out).unwrap();
            let mut v = flags.to_le_bytes().to_vec();
            v.extend_from_slice(&out);
            valid.push(v);
        }
        crate::fuzz::never_panics("codec::decode", &valid, 5000, None, &|b| {
            if b.len() < 2 {
                return;
            }
            let flags = u16::from_le_bytes([b[0], b[1]]);
            let mut out = vec![0u8; 4096];
            for cipher in [Some(&c), None] {
                let mut stored = b[2..].to_vec();
                match decode(&mut stored, flags, cipher, &aad, 5, &mut out) {
                    Ok(()) | Err(Error::Corrupt(_)) => {}
                    Err(e) => panic!("not a Corrupt error: {e}"),
                }
                assert_eq!(out.len(), 4096);
            }
        });
    }
}
