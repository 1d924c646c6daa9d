//! Block codec: compress (lz4, skipped when it does not pay), encrypt with
//! AES-256-GCM, and checksum the stored bytes.
//!
//! The checksum covers the *stored* bytes so scrub and repair work without the
//! key. It is blake3-256 for metadata and for data blocks of unencrypted
//! volumes, and xxh3-128 (tagged, see [`checksum_sealed`]) for data blocks of
//! encrypted volumes, whose AEAD tag already authenticates them: there the
//! checksum only has to catch accidents, and blake3 on a 4 KiB block costs
//! four times as much as the encryption (docs/decisions/0006). The AEAD's associated data binds a block to its volume and logical
//! block number: a valid ciphertext moved to another address does not decrypt.
//! Nonces are never chosen here: the caller passes a pool-unique 64-bit counter
//! (see `pool` and ARCHITECTURE.md, "Nonces").

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use zeroize::Zeroizing;

use crate::volume::Compression;
use crate::{Error, Result};

/// Stored bytes are lz4-compressed.
pub const FLAG_LZ4: u16 = 1 << 0;
/// Stored bytes are AES-256-GCM ciphertext followed by the tag.
pub const FLAG_ENCRYPTED: u16 = 1 << 1;

pub type Checksum = [u8; 32];

/// blake3-256 of stored bytes.
pub fn checksum(stored: &[u8]) -> Checksum {
    *blake3::hash(stored).as_bytes()
}

/// Second half of a checksum field that holds an xxh3-128 (first half)
/// rather than a blake3-256. A blake3 output ends so only with probability
/// 2^-128.
const XXH3_TAG: [u8; 16] = *b"xxh3-128/bulwark";

/// Checksum of a data block of an encrypted volume (AEAD ciphertext and
/// tag): xxh3-128, little-endian, then [`XXH3_TAG`].
pub fn checksum_sealed(stored: &[u8]) -> Checksum {
    let mut sum = [0u8; 32];
    sum[..16].copy_from_slice(&xxhash_rust::xxh3::xxh3_128(stored).to_le_bytes());
    sum[16..].copy_from_slice(&XXH3_TAG);
    sum
}

/// Whether `stored` matches `sum`, of either kind.
pub fn verify(sum: &Checksum, stored: &[u8]) -> bool {
    if sum[16..] == XXH3_TAG {
        checksum_sealed(stored) == *sum
    } else {
        checksum(stored) == *sum
    }
}

/// A volume's block cipher, derived from its data key.
pub struct BlockCipher {
    key: LessSafeKey,
}

impl BlockCipher {
    pub fn new(data_key: &Zeroizing<[u8; 32]>) -> BlockCipher {
        let unbound =
            UnboundKey::new(&AES_256_GCM, &data_key[..]).expect("AES-256 key is 32 bytes");
        BlockCipher {
            key: LessSafeKey::new(unbound),
        }
    }
}

fn nonce_bytes(counter: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

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
const SAMPLE_EVERY: u32 = 4;

/// Decides, block by block along one request, whether a block is worth an lz4
/// attempt. Blocks of one request usually come from the same file or image, so
/// after `MISSES_BEFORE_SKIPPING` incompressible samples in a row only one block in
/// `SAMPLE_EVERY` is sampled (the rest are stored as they are) until a sample
/// compresses again. On incompressible data (most VM disk contents) that cuts the
/// sampling cost by `SAMPLE_EVERY`; compressible data after an incompressible run
/// is found within `SAMPLE_EVERY` blocks.
#[derive(Default)]
pub struct CompressGuess {
    misses: u32,
    skipped: u32,
}

impl CompressGuess {
    fn try_block(&mut self, plain: &[u8]) -> bool {
        if self.misses >= MISSES_BEFORE_SKIPPING && self.skipped + 1 < SAMPLE_EVERY {
            self.skipped += 1;
            return false;
        }
        self.skipped = 0;
        let worth = worth_compressing(plain);
        self.misses = if worth { 0 } else { self.misses + 1 };
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
    let mut guess = CompressGuess::default();
    encode_append_guessed(plain, compression, &mut guess, cipher, aad, nonce, out)
}

/// `encode_append` for one of a run of blocks: `guess` carries what earlier blocks
/// of the run said about compressibility.
pub fn encode_append_guessed(
    plain: &[u8],
    compression: Compression,
    guess: &mut CompressGuess,
    cipher: Option<&BlockCipher>,
    aad: &[u8],
    nonce: u64,
    out: &mut Vec<u8>,
) -> Result<u16> {
    let start = out.len();
    let mut flags = 0;
    if compression == Compression::Lz4 && guess.try_block(plain) {
        let bound = lz4_flex::block::get_maximum_output_size(plain.len());
        out.resize(start + bound, 0);
        let n = lz4_flex::block::compress_into(plain, &mut out[start..])
            .map_err(|e| Error::Invalid(format!("lz4: {e}")))?;
        // Pays only when it saves at least an eighth: smaller stored blocks cost a decompress on every read.
        if n <= plain.len() - plain.len() / 8 {
            out.truncate(start + n);
            flags |= FLAG_LZ4;
        } else {
            out.truncate(start);
        }
    }
    if flags & FLAG_LZ4 == 0 {
        out.extend_from_slice(plain);
    }
    if let Some(c) = cipher {
        let tag = c
            .key
            .seal_in_place_separate_tag(nonce_bytes(nonce), Aad::from(aad), &mut out[start..])
            .map_err(|_| Error::Invalid("encryption failed".into()))?;
        out.extend_from_slice(tag.as_ref());
        flags |= FLAG_ENCRYPTED;
    }
    Ok(flags)
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
    let plain: &[u8] = if flags & FLAG_ENCRYPTED != 0 {
        let c = cipher
            .ok_or_else(|| Error::Corrupt("encrypted block in a volume without a key".into()))?;
        let p = c
            .key
            .open_in_place(nonce_bytes(nonce), Aad::from(aad), stored)
            .map_err(|_| {
                Error::Corrupt("block failed authentication (AEAD tag mismatch)".into())
            })?;
        p
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

    fn cipher() -> BlockCipher {
        BlockCipher::new(&Zeroizing::new([7u8; 32]))
    }

    #[test]
    fn round_trip_all_modes() {
        let c = cipher();
        let text: Vec<u8> = b"bulwark ".iter().cycle().take(4096).copied().collect();
        let random: Vec<u8> = (0..4096u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        for plain in [&text, &random] {
            for comp in [Compression::Off, Compression::Lz4] {
                for ci in [None, Some(&c)] {
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

    #[test]
    fn both_checksum_kinds_verify_and_catch_a_flipped_bit() {
        let mut block = vec![0u8; 4096];
        for (i, b) in block.iter_mut().enumerate() {
            *b = (i * 131 % 251) as u8;
        }
        for sum in [checksum(&block), checksum_sealed(&block)] {
            assert!(verify(&sum, &block));
            for bit in [0, 7, 4096 * 8 - 1, 12345] {
                let mut bad = block.clone();
                bad[bit / 8] ^= 1 << (bit % 8);
                assert!(!verify(&sum, &bad), "bit {bit} not caught");
            }
            // A block of another length, or an empty one.
            assert!(!verify(&sum, &block[..4095]));
            assert!(!verify(&sum, &[]));
        }
        // The kinds are told apart by the field, not guessed.
        assert_ne!(checksum(&block), checksum_sealed(&block));
        assert_eq!(checksum_sealed(&block)[16..], XXH3_TAG);
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
        let mut g = CompressGuess::default();
        // Two misses, then one sample in SAMPLE_EVERY.
        let tried: Vec<bool> = (0..10).map(|_| g.try_block(&random())).collect();
        assert_eq!(g.misses, 4);
        assert_eq!(tried, vec![false; 10]);
        // A compressible block right after a run is tried within SAMPLE_EVERY blocks,
        // and from then on every block is sampled again.
        let first = (0..SAMPLE_EVERY)
            .position(|_| g.try_block(&text))
            .expect("compressible block never tried");
        assert!(first < SAMPLE_EVERY as usize);
        assert_eq!(g.misses, 0);
        assert!(g.try_block(&text) && g.try_block(&text));
        // Through encode: all compressible blocks of a mixed run end up compressed
        // except at most SAMPLE_EVERY - 1 after an incompressible stretch.
        let mut g = CompressGuess::default();
        let mut uncompressed_text = 0;
        for i in 0..64 {
            let block = if (i / 16) % 2 == 0 {
                random()
            } else {
                text.clone()
            };
            let mut out = Vec::new();
            let f = encode_append_guessed(&block, Compression::Lz4, &mut g, None, &[], 0, &mut out)
                .unwrap();
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
        let c = cipher();
        let plain = vec![5u8; 4096];
        let mut stored = Vec::new();
        let flags = encode(
            &plain,
            Compression::Off,
            Some(&c),
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
            Some(&c),
            &block_aad(&[1; 16], 4),
            1,
            &mut out
        )
        .is_err());
        // Another volume.
        assert!(decode(
            &mut stored.clone(),
            flags,
            Some(&c),
            &block_aad(&[2; 16], 3),
            1,
            &mut out
        )
        .is_err());
        // One flipped bit.
        let mut t = stored.clone();
        t[100] ^= 1;
        assert!(decode(
            &mut t,
            flags,
            Some(&c),
            &block_aad(&[1; 16], 3),
            1,
            &mut out
        )
        .is_err());
        assert!(!stored.windows(16).any(|w| w == &plain[..16]));
    }
}
