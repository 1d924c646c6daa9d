//! Checksums of stored bytes: the lowest layer, below redundancy (which verifies
//! copies with them) and the map (whose pointers carry them). Unkeyed: they catch
//! media errors, not an attacker who can write the devices.

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
/// tag): xxh3-128, little-endian, then `XXH3_TAG`.
pub fn checksum_sealed(stored: &[u8]) -> Checksum {
    let mut sum = [0u8; 32];
    sum[..16].copy_from_slice(&xxhash_rust::xxh3::xxh3_128(stored).to_le_bytes());
    sum[16..].copy_from_slice(&XXH3_TAG);
    sum
}

/// Last 8 bytes of a checksum field that holds xxh3-64 (bytes 0..8) and the 16-byte run
/// salt its block's key was derived with (bytes 8..24): data blocks of encrypted volumes
/// written by format 2 (decision 0011, "Nonces"). A blake3 output ends so with
/// probability 2^-64, and `/bulwark`, the end of [`XXH3_TAG`], is not it.
const SALTED_TAG: [u8; 8] = *b"xxh3+slt";

/// Checksum of a data block sealed under a salted block key: xxh3-64, little-endian, the
/// salt, then `SALTED_TAG`. The pointer is authenticated (its leaf's blake3, up to a
/// superblock under the pool key), so the salt it names is the one the block was sealed
/// with; the AEAD tag authenticates the block itself.
pub fn checksum_salted(stored: &[u8], salt: &[u8; 16]) -> Checksum {
    let mut sum = [0u8; 32];
    sum[..8].copy_from_slice(&xxhash_rust::xxh3::xxh3_64(stored).to_le_bytes());
    sum[8..24].copy_from_slice(salt);
    sum[24..].copy_from_slice(&SALTED_TAG);
    sum
}

/// The run salt a `checksum_salted` field names; `None` for the other kinds.
pub fn salt_of(sum: &Checksum) -> Option<[u8; 16]> {
    (sum[24..] == SALTED_TAG).then(|| sum[8..24].try_into().expect("16 bytes"))
}

/// xxh3-64 of bytes: the unkeyed check of small headers that carry their own (the cache
/// device's entry headers), and the first half of `checksum_salted`.
pub fn xxh3_64(stored: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(stored)
}

/// The "checksum" of a record that carries its own: its last 32 bytes are the blake3 of
/// the rest. For records whose checksum cannot be known where they are pointed to from
/// (an intent log block's slot is chosen before the block is written); never in a map.
pub const SELF_CHECKED: Checksum = *b"bulwark: self-checked record \0\0\0";

/// `stored`, ended by the blake3 of what precedes it (`SELF_CHECKED`).
pub fn seal_self_checked(stored: &mut [u8]) {
    let n = stored.len() - 32;
    let sum = checksum(&stored[..n]);
    stored[n..].copy_from_slice(&sum);
}

/// Whether `stored` matches `sum`, of either kind (or carries its own, `SELF_CHECKED`).
pub fn verify(sum: &Checksum, stored: &[u8]) -> bool {
    if *sum == SELF_CHECKED {
        return stored.len() >= 32
            && checksum(&stored[..stored.len() - 32])[..] == stored[stored.len() - 32..];
    }
    if sum[24..] == SALTED_TAG {
        return xxhash_rust::xxh3::xxh3_64(stored).to_le_bytes()[..] == sum[..8];
    }
    if sum[16..] == XXH3_TAG {
        checksum_sealed(stored) == *sum
    } else {
        checksum(stored) == *sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_checksum_kinds_verify_and_catch_a_flipped_bit() {
        let mut block = vec![0u8; 4096];
        for (i, b) in block.iter_mut().enumerate() {
            *b = (i * 131 % 251) as u8;
        }
        for sum in [
            checksum(&block),
            checksum_sealed(&block),
            checksum_salted(&block, &[7; 16]),
        ] {
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
        assert_eq!(salt_of(&checksum_salted(&block, &[7; 16])), Some([7; 16]));
        assert_eq!(salt_of(&checksum_sealed(&block)), None);
        assert_eq!(salt_of(&checksum(&block)), None);
        assert_eq!(checksum_sealed(&block)[16..], XXH3_TAG);
    }
}
