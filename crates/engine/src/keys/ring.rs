//! A volume's key ring: the volume master key (VMK) and its data keys by generation.
//!
//! Key slots wrap the VMK. The VMK wraps one data key per generation (stored in
//! the volume table as `DataKeyRecord`s, AES-256-GCM, associated data = volume
//! uuid ‖ generation). Every block pointer records the generation its block was
//! encrypted under, so a rotation can add a generation for new writes while old
//! blocks are re-encrypted in the background, and drop the old data key once no
//! block uses it. Changing a slot's secret touches only the slot.

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use super::wrap::random_bytes;
use crate::codec::BlockCipher;
use crate::hex::{from_hex, hex12, to_hex};
use crate::{Error, Result};

/// One data key, wrapped by the VMK. Holds nothing secret.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DataKeyRecord {
    pub generation: u16,
    #[serde(with = "hex12")]
    pub nonce: [u8; 12],
    pub wrapped: String,
}

fn aad(uuid: &[u8; 16], generation: u16) -> [u8; 18] {
    let mut a = [0u8; 18];
    a[..16].copy_from_slice(uuid);
    a[16..].copy_from_slice(&generation.to_le_bytes());
    a
}

fn vmk_key(vmk: &Zeroizing<[u8; 32]>) -> LessSafeKey {
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &vmk[..]).expect("32-byte key"))
}

/// A fresh data key for `generation`, wrapped by `vmk`.
pub fn new_data_key(vmk: &Zeroizing<[u8; 32]>, uuid: &[u8; 16], generation: u16) -> DataKeyRecord {
    let dek = Zeroizing::new(random_bytes::<32>());
    let nonce = random_bytes::<12>();
    let mut buf = Zeroizing::new(dek.to_vec());
    vmk_key(vmk)
        .seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(&aad(uuid, generation)[..]),
            &mut *buf,
        )
        .expect("sealing a data key");
    DataKeyRecord {
        generation,
        nonce,
        wrapped: to_hex(&buf),
    }
}

fn open_data_key(
    vmk: &Zeroizing<[u8; 32]>,
    uuid: &[u8; 16],
    rec: &DataKeyRecord,
) -> Result<Zeroizing<[u8; 32]>> {
    let mut buf = Zeroizing::new(
        from_hex(&rec.wrapped)
            .ok_or_else(|| Error::Corrupt("data key record is not hex".into()))?,
    );
    let plain = vmk_key(vmk)
        .open_in_place(
            Nonce::assume_unique_for_key(rec.nonce),
            Aad::from(&aad(uuid, rec.generation)[..]),
            &mut buf[..],
        )
        .map_err(|_| {
            Error::Corrupt(format!(
                "data key generation {} does not open under the volume master key",
                rec.generation
            ))
        })?;
    let mut k = Zeroizing::new([0u8; 32]);
    k.copy_from_slice(
        plain
            .get(..32)
            .ok_or_else(|| Error::Corrupt("short data key".into()))?,
    );
    Ok(k)
}

/// Block ciphers of every generation, and the one new writes use.
pub struct KeyRing {
    pub current: u16,
    ciphers: Vec<(u16, BlockCipher)>,
}

impl KeyRing {
    pub fn open(
        vmk: &Zeroizing<[u8; 32]>,
        uuid: &[u8; 16],
        records: &[DataKeyRecord],
    ) -> Result<KeyRing> {
        let mut ciphers = Vec::with_capacity(records.len());
        for r in records {
            let dek = open_data_key(vmk, uuid, r)?;
            ciphers.push((
                r.generation,
                BlockCipher::new(&super::wrap::block_key(&dek)),
            ));
        }
        let current = records
            .iter()
            .map(|r| r.generation)
            .max()
            .ok_or_else(|| Error::Corrupt("volume has no data key".into()))?;
        Ok(KeyRing { current, ciphers })
    }

    pub fn current(&self) -> &BlockCipher {
        self.get(self.current)
            .expect("the current generation is in the ring")
    }

    pub fn get(&self, generation: u16) -> Option<&BlockCipher> {
        self.ciphers
            .iter()
            .find(|(g, _)| *g == generation)
            .map(|(_, c)| c)
    }
}
