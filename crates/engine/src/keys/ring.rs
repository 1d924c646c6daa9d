//! A volume's key ring: the volume master key (VMK) and its data keys by generation.
//!
//! Key slots wrap the VMK. The VMK wraps one data key per generation (stored in
//! the volume table as `DataKeyRecord`s, AES-256-GCM, associated data = volume
//! uuid ‖ generation). Every block pointer records the generation its block was
//! encrypted under, so a rotation can add a generation for new writes while old
//! blocks are re-encrypted in the background, and drop the old data key once no
//! block uses it. Changing a slot's secret touches only the slot.

use std::collections::HashMap;
use std::sync::Arc;

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use super::wrap::{random_bytes, KeySlot};
use super::Secret;
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
    /// For a key a clone inherited: the uuid (hex) of the volume whose blocks it sealed
    /// (their associated data names that volume). Absent: this volume's own key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lineage: Option<String>,
}

impl DataKeyRecord {
    /// The uuid the blocks of this generation were sealed under: `own`, or the lineage.
    pub fn lineage_or(&self, own: &[u8; 16]) -> Result<[u8; 16]> {
        match &self.lineage {
            None => Ok(*own),
            Some(h) => from_hex(h)
                .and_then(|b| <[u8; 16]>::try_from(b.as_slice()).ok())
                .ok_or_else(|| Error::Corrupt("data key record has a malformed lineage".into())),
        }
    }
}

/// Associated data of a wrapped data key: the owning volume's uuid ‖ generation, and the
/// lineage of an inherited key (so it cannot be moved to another lineage unseen).
fn aad(uuid: &[u8; 16], generation: u16, lineage: Option<&[u8; 16]>) -> Vec<u8> {
    let mut a = Vec::with_capacity(34);
    a.extend_from_slice(uuid);
    a.extend_from_slice(&generation.to_le_bytes());
    if let Some(l) = lineage {
        a.extend_from_slice(l);
    }
    a
}

fn vmk_key(vmk: &Zeroizing<[u8; 32]>) -> LessSafeKey {
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &vmk[..]).expect("32-byte key"))
}

/// The generation after every one in `records` (own or inherited): a volume's next data
/// key. `Invalid` once all 65536 are used.
pub fn next_generation(records: &[DataKeyRecord], volume: &str) -> Result<u16> {
    records
        .iter()
        .map(|k| k.generation)
        .max()
        .unwrap_or(0)
        .checked_add(1)
        .ok_or_else(|| Error::Invalid(format!("volume '{volume}' has used every key generation")))
}

/// A fresh data key for `generation`, wrapped by `vmk`.
pub fn new_data_key(vmk: &Zeroizing<[u8; 32]>, uuid: &[u8; 16], generation: u16) -> DataKeyRecord {
    let dek = Zeroizing::new(random_bytes::<32>());
    wrap_data_key(vmk, uuid, generation, &dek, None)
}

fn wrap_data_key(
    vmk: &Zeroizing<[u8; 32]>,
    uuid: &[u8; 16],
    generation: u16,
    dek: &Zeroizing<[u8; 32]>,
    lineage: Option<&[u8; 16]>,
) -> DataKeyRecord {
    let nonce = random_bytes::<12>();
    let mut buf = Zeroizing::new(dek.to_vec());
    vmk_key(vmk)
        .seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(&aad(uuid, generation, lineage)[..]),
            &mut *buf,
        )
        .expect("sealing a data key");
    DataKeyRecord {
        generation,
        nonce,
        wrapped: to_hex(&buf),
        lineage: lineage.map(|l| to_hex(l)),
    }
}

/// A clone's copy of `rec` (a data key of volume `from_uuid`, under `from_vmk`): the same
/// data key, wrapped under the clone's master key, marked with the lineage its blocks
/// were sealed under.
pub fn inherit(
    from_vmk: &Zeroizing<[u8; 32]>,
    from_uuid: &[u8; 16],
    rec: &DataKeyRecord,
    to_vmk: &Zeroizing<[u8; 32]>,
    to_uuid: &[u8; 16],
) -> Result<DataKeyRecord> {
    let dek = open_data_key(from_vmk, from_uuid, rec)?;
    let lineage = rec.lineage_or(from_uuid)?;
    Ok(wrap_data_key(
        to_vmk,
        to_uuid,
        rec.generation,
        &dek,
        Some(&lineage),
    ))
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
    let lineage = match &rec.lineage {
        Some(_) => Some(rec.lineage_or(uuid)?),
        None => None,
    };
    let plain = vmk_key(vmk)
        .open_in_place(
            Nonce::assume_unique_for_key(rec.nonce),
            Aad::from(&aad(uuid, rec.generation, lineage.as_ref())[..]),
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

/// The block key of `data_key` under a run salt (format 2, decision 0011): every writer
/// run draws a fresh 128-bit salt, so no state read back from the devices (a counter, a
/// rolled-back superblock) can make two blocks share a key and a nonce.
pub fn salted_block_key(data_key: &Zeroizing<[u8; 32]>, salt: &[u8; 16]) -> Zeroizing<[u8; 32]> {
    super::hkdf::hkdf(&data_key[..], salt, &[b"bulwark block key v2"])
}

/// Most salted block ciphers a ring keeps for reading blocks of earlier runs (one per run
/// that wrote the volume and generation); past it the cache starts over.
const SALTED_CACHED_MAX: usize = 64;

/// Block ciphers of every generation, and the one new writes use.
pub struct KeyRing {
    pub current: u16,
    /// Generation, format 1 cipher (`wrap::block_key`), and the uuid its blocks were
    /// sealed under.
    ciphers: Vec<(u16, Arc<BlockCipher>, [u8; 16])>,
    /// Each generation's data key, to derive salted block keys for blocks of other runs.
    data_keys: Vec<(u16, Zeroizing<[u8; 32]>)>,
    /// This run's salt (`Store::run_salt`): new writes seal under the current generation's
    /// key salted with it.
    pub salt: [u8; 16],
    current_salted: Arc<BlockCipher>,
    salted: Mutex<SaltedCiphers>,
}

/// Block ciphers of earlier runs, by (generation, salt).
type SaltedCiphers = HashMap<(u16, [u8; 16]), Arc<BlockCipher>>;

impl KeyRing {
    pub fn open(
        vmk: &Zeroizing<[u8; 32]>,
        uuid: &[u8; 16],
        records: &[DataKeyRecord],
        salt: [u8; 16],
    ) -> Result<KeyRing> {
        let mut ciphers = Vec::with_capacity(records.len());
        let mut data_keys = Vec::with_capacity(records.len());
        for r in records {
            let dek = open_data_key(vmk, uuid, r)?;
            ciphers.push((
                r.generation,
                Arc::new(BlockCipher::new(&super::wrap::block_key(&dek))),
                r.lineage_or(uuid)?,
            ));
            data_keys.push((r.generation, dek));
        }
        // New writes use the newest of the volume's own generations (never an inherited one).
        let current = records
            .iter()
            .filter(|r| r.lineage.is_none())
            .map(|r| r.generation)
            .max()
            .ok_or_else(|| Error::Corrupt("volume has no data key of its own".into()))?;
        let dek = &data_keys
            .iter()
            .find(|(g, _)| *g == current)
            .expect("the current generation is in the ring")
            .1;
        let current_salted = Arc::new(BlockCipher::new(&salted_block_key(dek, &salt)));
        Ok(KeyRing {
            current,
            ciphers,
            data_keys,
            salt,
            current_salted,
            salted: Mutex::new(HashMap::new()),
        })
    }

    /// The cipher new writes seal with: the current generation's key under this run's salt.
    pub fn current(&self) -> &BlockCipher {
        &self.current_salted
    }

    /// The cipher that opens a block sealed under `generation` (and `salt`, from its
    /// pointer's checksum: `checksum::salt_of`; `None` for a format 1 block), and the uuid
    /// its associated data names.
    pub fn cipher_for(
        &self,
        generation: u16,
        salt: Option<[u8; 16]>,
    ) -> Option<(Arc<BlockCipher>, [u8; 16])> {
        let (_, v1, lineage) = self.ciphers.iter().find(|(g, _, _)| *g == generation)?;
        let Some(salt) = salt else {
            return Some((v1.clone(), *lineage));
        };
        if generation == self.current && salt == self.salt {
            return Some((self.current_salted.clone(), *lineage));
        }
        let mut cache = self.salted.lock();
        if let Some(c) = cache.get(&(generation, salt)) {
            return Some((c.clone(), *lineage));
        }
        let (_, dek) = self.data_keys.iter().find(|(g, _)| *g == generation)?;
        let c = Arc::new(BlockCipher::new(&salted_block_key(dek, &salt)));
        if cache.len() >= SALTED_CACHED_MAX {
            cache.clear();
        }
        cache.insert((generation, salt), c.clone());
        Some((c, *lineage))
    }
}

/// What a new encrypted volume starts with: its VMK, one slot, data key generation 0 and
/// the ring over it.
pub(crate) struct NewKeys {
    pub vmk: Zeroizing<[u8; 32]>,
    pub slots: Vec<KeySlot>,
    pub data_keys: Vec<DataKeyRecord>,
    pub ring: KeyRing,
}

/// Keys of a new encrypted volume: a VMK in one slot under `secret`, data key generation 0.
pub(crate) fn new_volume_keys(
    secret: &Secret,
    uuid: &[u8; 16],
    run_salt: [u8; 16],
) -> Result<NewKeys> {
    let vmk = super::wrap::new_data_key();
    let slots = vec![super::wrap::wrap(&vmk, secret, uuid)?];
    let data_keys = vec![new_data_key(&vmk, uuid, 0)];
    let ring = KeyRing::open(&vmk, uuid, &data_keys, run_salt)?;
    Ok(NewKeys {
        vmk,
        slots,
        data_keys,
        ring,
    })
}
