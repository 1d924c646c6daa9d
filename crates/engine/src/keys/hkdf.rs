//! HKDF-SHA256 (RFC 5869): the one key derivation of the pool key's keys
//! (`pool_key`) and of salted block keys (`ring::salted_block_key`).

use zeroize::Zeroizing;

/// HKDF-SHA256 of `ikm` with `salt`, expanded with the concatenation of `info` to 32 bytes.
pub fn hkdf(ikm: &[u8], salt: &[u8], info: &[&[u8]]) -> Zeroizing<[u8; 32]> {
    use aws_lc_rs::hkdf::{Salt, HKDF_SHA256};
    let prk = Salt::new(HKDF_SHA256, salt).extract(ikm);
    let okm = prk
        .expand(info, HKDF_SHA256)
        .expect("32 bytes is a valid HKDF length");
    let mut out = Zeroizing::new([0u8; 32]);
    okm.fill(&mut out[..])
        .expect("32 bytes is a valid HKDF length");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 5869's first SHA-256 test vector (case 1), first 32 bytes.
    #[test]
    fn hkdf_matches_rfc_5869() {
        let ikm = [0x0bu8; 22];
        let salt: Vec<u8> = (0x00..=0x0c).collect();
        let info: Vec<u8> = (0xf0..=0xf9).collect();
        let okm = hkdf(&ikm, &salt, &[&info[..5], &info[5..]]);
        let want = "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf";
        assert_eq!(crate::hex::to_hex(&okm[..]), want);
    }
}
