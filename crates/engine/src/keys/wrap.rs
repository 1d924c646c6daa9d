//! Key slots: a volume's random data key, stored only wrapped.
//!
//! A slot wraps the 32-byte data key with AES-256-GCM under a key-encryption
//! key (KEK). The KEK comes from a passphrase through Argon2id (salted, with
//! its cost recorded in the slot) or from a 32-byte key file through HKDF.
//! The slot's associated data is the volume uuid, so a slot copied to another
//! volume does not open. A wrong secret fails the AEAD tag: `WrongKey`.
//! Every intermediate key lives in `Zeroizing` memory.

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use super::Secret;
use crate::hex::{from_hex, hex12, hex32, to_hex};
use crate::{Error, Result};

/// Argon2id cost for new passphrase slots: 64 MiB, 3 passes (OWASP's recommended floor is 19 MiB, 2 passes).
pub const ARGON2_M_KIB: u32 = 64 * 1024;
pub const ARGON2_T: u32 = 3;
pub const ARGON2_P: u32 = 1;

/// The most a slot read from disk may ask of Argon2id (cost is used as found, so
/// without a bound a damaged slot could make `key load` allocate terabytes, which
/// aborts the daemon, or run for days). Bulwark creates slots at `ARGON2_M_KIB`,
/// `ARGON2_T`, `ARGON2_P`; the bounds leave 16×, 5× and 16× headroom (LUKS2 caps
/// memory at 4 GiB, cryptsetup's default at 1 GiB). Worst case here: 1 GiB for
/// 16 passes, seconds, not hours.
pub const ARGON2_M_KIB_MAX: u32 = 1 << 20;
pub const ARGON2_T_MAX: u32 = 16;
pub const ARGON2_P_MAX: u32 = 16;

/// Refuses Argon2 costs above the bounds, before anything is allocated.
pub fn check_cost(kind: &SlotKind) -> Result<()> {
    let SlotKind::Passphrase { m_kib, t, p } = *kind else {
        return Ok(());
    };
    let over = |what: &str, got: u32, max: u32, unit: &str| {
        Err(Error::Corrupt(format!(
            "Argon2 {what} {got}{unit} is above the limit of {max}{unit}: the slot is damaged \
             (bulwark makes slots with memory {ARGON2_M_KIB} KiB, {ARGON2_T} passes, {ARGON2_P} lane)"
        )))
    };
    if m_kib > ARGON2_M_KIB_MAX {
        return over("memory cost", m_kib, ARGON2_M_KIB_MAX, " KiB");
    }
    if t > ARGON2_T_MAX {
        return over("time cost", t, ARGON2_T_MAX, " passes");
    }
    if p > ARGON2_P_MAX {
        return over("parallelism", p, ARGON2_P_MAX, " lanes");
    }
    Ok(())
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SlotKind {
    Passphrase { m_kib: u32, t: u32, p: u32 },
    KeyFile,
}

/// One wrapping of the data key. Holds nothing secret.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KeySlot {
    #[serde(flatten)]
    pub kind: SlotKind,
    #[serde(with = "hex32")]
    pub salt: [u8; 32],
    #[serde(with = "hex12")]
    pub nonce: [u8; 12],
    /// Data key ciphertext and tag (48 bytes), hex.
    pub wrapped: String,
}

pub fn random_bytes<const N: usize>() -> [u8; N] {
    crate::env::random()
}

pub fn new_data_key() -> Zeroizing<[u8; 32]> {
    Zeroizing::new(random_bytes::<32>())
}

fn kek(secret: &Secret, kind: &SlotKind, salt: &[u8; 32]) -> Result<Zeroizing<[u8; 32]>> {
    let mut out = Zeroizing::new([0u8; 32]);
    match (secret, kind) {
        (Secret::Passphrase(p), SlotKind::Passphrase { m_kib, t, p: par }) => {
            check_cost(kind)?;
            let params = argon2::Params::new(*m_kib, *t, *par, Some(32)).map_err(|e| {
                Error::Corrupt(format!("key slot has invalid Argon2 parameters: {e}"))
            })?;
            argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params)
                .hash_password_into(p, salt, &mut out[..])
                .map_err(|e| Error::Invalid(format!("argon2: {e}")))?;
        }
        (Secret::KeyFile(k), SlotKind::KeyFile) => {
            let salt = aws_lc_rs::hkdf::Salt::new(aws_lc_rs::hkdf::HKDF_SHA256, salt);
            let prk = salt.extract(&k[..]);
            let okm = prk
                .expand(&[b"bulwark key-file kek v1"], aws_lc_rs::hkdf::HKDF_SHA256)
                .map_err(|_| Error::Invalid("hkdf".into()))?;
            okm.fill(&mut out[..])
                .map_err(|_| Error::Invalid("hkdf".into()))?;
        }
        _ => {
            return Err(Error::Invalid(
                "secret kind does not match slot kind".into(),
            ))
        }
    }
    Ok(out)
}

fn aead(kek: &Zeroizing<[u8; 32]>) -> LessSafeKey {
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &kek[..]).expect("32-byte key"))
}

/// Wrap `data_key` for `volume_uuid` under `secret`.
pub fn wrap(
    data_key: &Zeroizing<[u8; 32]>,
    secret: &Secret,
    volume_uuid: &[u8; 16],
) -> Result<KeySlot> {
    let kind = match secret {
        Secret::Passphrase(_) => SlotKind::Passphrase {
            m_kib: ARGON2_M_KIB,
            t: ARGON2_T,
            p: ARGON2_P,
        },
        Secret::KeyFile(_) => SlotKind::KeyFile,
    };
    let salt = random_bytes::<32>();
    let nonce = random_bytes::<12>();
    let key = aead(&kek(secret, &kind, &salt)?);
    let mut buf = Zeroizing::new(data_key.to_vec());
    key.seal_in_place_append_tag(
        Nonce::assume_unique_for_key(nonce),
        Aad::from(&volume_uuid[..]),
        &mut *buf,
    )
    .map_err(|_| Error::Invalid("key wrapping failed".into()))?;
    Ok(KeySlot {
        kind,
        salt,
        nonce,
        wrapped: to_hex(&buf),
    })
}

/// Try to open `slot` with `secret`; `None` when the secret is not this slot's.
pub fn unwrap(
    slot: &KeySlot,
    secret: &Secret,
    volume_uuid: &[u8; 16],
) -> Result<Option<Zeroizing<[u8; 32]>>> {
    let matches = matches!(
        (secret, &slot.kind),
        (Secret::Passphrase(_), SlotKind::Passphrase { .. })
            | (Secret::KeyFile(_), SlotKind::KeyFile)
    );
    if !matches {
        return Ok(None);
    }
    let key = aead(&kek(secret, &slot.kind, &slot.salt)?);
    let mut buf = Zeroizing::new(
        from_hex(&slot.wrapped).ok_or_else(|| Error::Corrupt("key slot is not hex".into()))?,
    );
    let Ok(plain) = key.open_in_place(
        Nonce::assume_unique_for_key(slot.nonce),
        Aad::from(&volume_uuid[..]),
        &mut buf[..],
    ) else {
        return Ok(None);
    };
    if plain.len() != 32 {
        return Err(Error::Corrupt(
            "key slot holds a key of the wrong length".into(),
        ));
    }
    let mut k = Zeroizing::new([0u8; 32]);
    k.copy_from_slice(plain);
    Ok(Some(k))
}

/// Derive the per-volume block key from the data key (domain separation: the data
/// key itself never touches a block).
pub fn block_key(data_key: &Zeroizing<[u8; 32]>) -> Zeroizing<[u8; 32]> {
    let salt = aws_lc_rs::hkdf::Salt::new(aws_lc_rs::hkdf::HKDF_SHA256, b"bulwark");
    let prk = salt.extract(&data_key[..]);
    let okm = prk
        .expand(&[b"bulwark block key v1"], aws_lc_rs::hkdf::HKDF_SHA256)
        .expect("hkdf length");
    let mut out = Zeroizing::new([0u8; 32]);
    okm.fill(&mut out[..]).expect("hkdf fill");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrap_unwrap_key_file_and_passphrase() {
        let dk = new_data_key();
        let uuid = [3u8; 16];
        let kf = Secret::KeyFile(Zeroizing::new([9u8; 32]));
        let slot = wrap(&dk, &kf, &uuid).unwrap();
        assert_eq!(*unwrap(&slot, &kf, &uuid).unwrap().unwrap(), *dk);
        assert!(
            unwrap(&slot, &Secret::KeyFile(Zeroizing::new([8u8; 32])), &uuid)
                .unwrap()
                .is_none()
        );
        assert!(unwrap(&slot, &kf, &[4u8; 16]).unwrap().is_none());
        assert!(!slot.wrapped.contains(&to_hex(&dk[..8])));

        let pp = Secret::Passphrase(Zeroizing::new(b"correct horse".to_vec()));
        let mut slot = wrap(&dk, &pp, &uuid).unwrap();
        // Keep the unit test fast: re-wrap with a cheap cost for the negative case only.
        assert_eq!(*unwrap(&slot, &pp, &uuid).unwrap().unwrap(), *dk);
        slot.kind = SlotKind::Passphrase {
            m_kib: ARGON2_M_KIB,
            t: ARGON2_T,
            p: ARGON2_P,
        };
        assert!(unwrap(
            &slot,
            &Secret::Passphrase(Zeroizing::new(b"wrong".to_vec())),
            &uuid
        )
        .unwrap()
        .is_none());
    }

    /// Costs above the bounds are refused before Argon2 runs (a memory cost of 4 TiB
    /// aborted the process, 2^32 passes hung it), each with its own message; costs at
    /// the bounds are accepted (checked without hashing: 1 GiB × 16 passes is slow).
    #[test]
    fn argon2_costs_out_of_bounds_are_refused() {
        let dk = new_data_key();
        let uuid = [3u8; 16];
        let pp = Secret::Passphrase(Zeroizing::new(b"x".to_vec()));
        let mut slot = wrap(&dk, &Secret::KeyFile(Zeroizing::new([1; 32])), &uuid).unwrap();
        for (m_kib, t, p, says) in [
            (
                u32::MAX,
                3,
                1,
                "memory cost 4294967295 KiB is above the limit of 1048576 KiB",
            ),
            (ARGON2_M_KIB_MAX + 1, 3, 1, "memory cost"),
            (
                65536,
                u32::MAX,
                1,
                "time cost 4294967295 passes is above the limit of 16",
            ),
            (65536, ARGON2_T_MAX + 1, 1, "time cost"),
            (65536, 3, u32::MAX, "parallelism 4294967295 lanes"),
            (65536, 3, ARGON2_P_MAX + 1, "parallelism"),
        ] {
            slot.kind = SlotKind::Passphrase { m_kib, t, p };
            match unwrap(&slot, &pp, &uuid) {
                Err(Error::Corrupt(m)) => assert!(m.contains(says), "{m}"),
                other => panic!("({m_kib}, {t}, {p}): {:?}", other.map(|k| k.is_some())),
            }
        }
        let at_bounds = SlotKind::Passphrase {
            m_kib: ARGON2_M_KIB_MAX,
            t: ARGON2_T_MAX,
            p: ARGON2_P_MAX,
        };
        check_cost(&at_bounds).unwrap();
        // Too small for Argon2 (memory below 8 KiB per lane): a typed error too.
        slot.kind = SlotKind::Passphrase {
            m_kib: 0,
            t: 0,
            p: 0,
        };
        assert!(matches!(unwrap(&slot, &pp, &uuid), Err(Error::Corrupt(_))));
    }
}
