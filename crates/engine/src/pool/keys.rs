//! Key lifecycle of encrypted volumes: slots, load and unload, change, erase.
//!
//! A slot wraps the volume master key (VMK) under a secret; the VMK wraps the
//! data keys (`keys::ring`). Adding, removing or changing a slot rewrites only
//! the slot list in the volume table, never data. Crypto-erase removes every
//! slot and data key and then replaces the superblock's table key and commits
//! twice: every superblock slot on every device is rewritten, so the older
//! volume tables still lying in free space (the only other places a wrapped
//! key ever lived) can no longer be decrypted by anyone.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use super::core::Core;
use crate::keys::ring::{self, DataKeyRecord, KeyRing};
use crate::keys::wrap::{self, KeySlot, SlotKind};
use crate::keys::Secret;
use crate::volume::VolumeState;
use crate::{Error, Result};

pub(crate) struct NewKeys {
    pub vmk: Zeroizing<[u8; 32]>,
    pub slots: Vec<KeySlot>,
    pub data_keys: Vec<DataKeyRecord>,
    pub ring: KeyRing,
}

/// Keys of a new encrypted volume: a VMK in one slot under `secret`, data key generation 0.
pub(crate) fn new_volume_keys(secret: &Secret, uuid: &[u8; 16]) -> Result<NewKeys> {
    let vmk = wrap::new_data_key();
    let slots = vec![wrap::wrap(&vmk, secret, uuid)?];
    let data_keys = vec![ring::new_data_key(&vmk, uuid, 0)];
    let ring = KeyRing::open(&vmk, uuid, &data_keys)?;
    Ok(NewKeys {
        vmk,
        slots,
        data_keys,
        ring,
    })
}

/// What `key list` shows of a slot: never anything secret.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SlotInfo {
    pub slot: usize,
    /// "passphrase" or "key_file"
    pub kind: String,
    /// Argon2id cost, for passphrase slots.
    pub argon2: Option<String>,
}

impl Core {
    fn encrypted(&self, name: &str) -> Result<Arc<VolumeState>> {
        let st = self.find(name)?;
        if !st.encryption {
            return Err(Error::Invalid(format!(
                "volume '{name}' is not encrypted; it has no keys"
            )));
        }
        Ok(st)
    }

    /// The slot `secret` opens and the VMK it yields.
    fn open_slot(&self, st: &VolumeState, secret: &Secret) -> Result<(usize, Zeroizing<[u8; 32]>)> {
        let slots = st.slots.lock().clone();
        if slots.is_empty() {
            return Err(Error::Invalid(format!(
                "the keys of volume '{}' were erased: its data is unrecoverable with any secret",
                st.name
            )));
        }
        for (i, slot) in slots.iter().enumerate() {
            if let Some(vmk) = wrap::unwrap(slot, secret, &st.uuid)? {
                return Ok((i, vmk));
            }
        }
        Err(Error::WrongKey(st.name.clone()))
    }

    pub fn load_key(self: &Arc<Self>, name: &str, secret: &Secret) -> Result<()> {
        let st = self.encrypted(name)?;
        if st.ring.read().is_some() {
            return Err(Error::Invalid(format!(
                "the key of volume '{name}' is already loaded"
            )));
        }
        let (_, vmk) = self
            .open_slot(&st, secret)
            .inspect_err(|_| tracing::warn!(volume = name, "key load refused: wrong key"))?;
        let ring = KeyRing::open(&vmk, &st.uuid, &st.data_keys.lock())?;
        *st.ring.write() = Some(Arc::new(ring));
        *st.vmk.lock() = Some(vmk);
        tracing::info!(volume = name, "key loaded");
        if st.rotation.lock().is_some() {
            self.spawn_rotation(st);
        }
        Ok(())
    }

    pub fn unload_key(&self, name: &str) -> Result<()> {
        let st = self.encrypted(name)?;
        if st.ring.read().is_none() {
            return Err(Error::Invalid(format!(
                "the key of volume '{name}' is not loaded"
            )));
        }
        if Arc::strong_count(&st) > 2 {
            return Err(Error::Busy(format!(
                "volume '{name}' is in use; detach its clients first"
            )));
        }
        // Its writes must reach the disk under the key before the key goes.
        self.flush()?;
        *st.ring.write() = None;
        *st.vmk.lock() = None;
        tracing::info!(volume = name, "key unloaded");
        Ok(())
    }

    pub fn key_list(&self, name: &str) -> Result<Vec<SlotInfo>> {
        let st = self.encrypted(name)?;
        let slots = st.slots.lock();
        Ok(slots
            .iter()
            .enumerate()
            .map(|(i, s)| match &s.kind {
                SlotKind::Passphrase { m_kib, t, p } => SlotInfo {
                    slot: i,
                    kind: "passphrase".into(),
                    argon2: Some(format!("argon2id m={m_kib}KiB t={t} p={p}")),
                },
                SlotKind::KeyFile => SlotInfo {
                    slot: i,
                    kind: "key_file".into(),
                    argon2: None,
                },
            })
            .collect())
    }

    /// Add a slot for `secret`; the volume's key must be loaded.
    pub fn key_add(&self, name: &str, secret: &Secret) -> Result<usize> {
        let st = self.encrypted(name)?;
        let vmk = st
            .vmk
            .lock()
            .clone()
            .ok_or_else(|| Error::Locked(name.to_string()))?;
        if self.open_slot(&st, secret).is_ok() {
            return Err(Error::Exists(format!(
                "that secret already opens a key slot of volume '{name}'"
            )));
        }
        let slot = wrap::wrap(&vmk, secret, &st.uuid)?;
        let index = {
            let mut slots = st.slots.lock();
            slots.push(slot);
            slots.len() - 1
        };
        self.table_dirty.store(true, Ordering::Release);
        self.commit()?;
        tracing::info!(volume = name, slot = index, "key slot added");
        Ok(index)
    }

    /// Remove the slot `secret` opens. The last slot is refused: use `key_erase` to destroy
    /// the keys on purpose.
    pub fn key_remove(&self, name: &str, secret: &Secret) -> Result<usize> {
        let st = self.encrypted(name)?;
        let (index, _vmk) = self.open_slot(&st, secret)?;
        {
            let mut slots = st.slots.lock();
            if slots.len() == 1 {
                return Err(Error::Invalid(format!(
                    "that is the last key slot of volume '{name}': removing it would make the data unrecoverable; \
                     add another slot first, or use 'bulwark key erase {name}' to destroy the data on purpose"
                )));
            }
            slots.remove(index);
        }
        self.table_dirty.store(true, Ordering::Release);
        self.commit()?;
        tracing::info!(volume = name, slot = index, "key slot removed");
        Ok(index)
    }

    /// Replace the secret of the slot `old` opens by `new`; data is not touched.
    pub fn key_change(&self, name: &str, old: &Secret, new: &Secret) -> Result<usize> {
        let st = self.encrypted(name)?;
        let (index, vmk) = self.open_slot(&st, old)?;
        let slot = wrap::wrap(&vmk, new, &st.uuid)?;
        st.slots.lock()[index] = slot;
        self.table_dirty.store(true, Ordering::Release);
        self.commit()?;
        tracing::info!(volume = name, slot = index, "key slot changed");
        Ok(index)
    }

    /// Destroy every wrapped copy of the volume's keys: its data is unrecoverable at once.
    pub fn key_erase(&self, name: &str) -> Result<()> {
        let st = self.encrypted(name)?;
        if Arc::strong_count(&st) > 2 {
            return Err(Error::Busy(format!(
                "volume '{name}' is in use; detach its clients first"
            )));
        }
        st.slots.lock().clear();
        st.data_keys.lock().clear();
        *st.rotation.lock() = None;
        *st.ring.write() = None;
        *st.vmk.lock() = None;
        self.table_dirty.store(true, Ordering::Release);
        self.forget_old_tables()?;
        tracing::warn!(
            volume = name,
            "keys erased: the volume's data is unrecoverable"
        );
        Ok(())
    }

    /// Give the volume table a new key and rewrite every superblock slot (two commits), so
    /// no table written before can be decrypted again.
    pub(crate) fn forget_old_tables(&self) -> Result<()> {
        *self.table_key_next.lock() = Some(wrap::random_bytes::<32>());
        self.table_dirty.store(true, Ordering::Release);
        self.commit()?;
        self.table_dirty.store(true, Ordering::Release);
        self.commit()
    }
}
