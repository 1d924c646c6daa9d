//! Key rotation: a new data key for every new write at once, old blocks
//! re-encrypted in the background, the old key dropped when no block uses it.
//!
//! `key_rotate` adds a data key generation and makes it current before it
//! returns. A worker then walks the map; each block of an older generation is
//! read and rewritten under its stripe lock (the same lock client writes take,
//! so a client write in between wins). The cursor is saved with every commit:
//! after a crash, loading the key resumes the rotation. When the walk ends,
//! older data keys are removed and the table key is replaced (see
//! `forget_old_tables`), so the old data key is gone from the devices.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::core::Core;
use crate::codec::FLAG_ENCRYPTED;
use crate::keys::ring::{self, KeyRing};
use crate::map::Visit;
use crate::volume::{Volume, VolumeState};
use crate::{Error, Result};

/// Blocks examined per batch.
const ROTATE_BATCH_BLOCKS: u64 = 1024;

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Rotation {
    /// The generation every block is being moved to.
    pub to_generation: u16,
    /// Next logical block to examine.
    pub lba: u64,
    pub blocks_done: u64,
    pub blocks_total: u64,
    /// Why the rotation stopped, if it did (it resumes at the next key load).
    #[serde(default)]
    pub error: Option<String>,
}

impl Core {
    /// Start a key rotation of an unlocked volume.
    pub fn key_rotate(self: &Arc<Self>, name: &str) -> Result<u16> {
        let st = self.find(name)?;
        if !st.encryption {
            return Err(Error::Invalid(format!(
                "volume '{name}' is not encrypted; it has no keys"
            )));
        }
        let vmk = st
            .vmk
            .lock()
            .clone()
            .ok_or_else(|| Error::Locked(name.to_string()))?;
        if st.rotation.lock().is_some() {
            return Err(Error::Busy(format!(
                "a key rotation of volume '{name}' is already running"
            )));
        }
        let generation = {
            let mut keys = st.data_keys.lock();
            let g = keys
                .iter()
                .map(|k| k.generation)
                .max()
                .unwrap_or(0)
                .checked_add(1)
                .ok_or_else(|| {
                    Error::Invalid("this volume has used every key generation".into())
                })?;
            keys.push(ring::new_data_key(&vmk, &st.uuid, g));
            *st.ring.write() = Some(Arc::new(KeyRing::open(&vmk, &st.uuid, &keys)?));
            g
        };
        let total = st.used_bytes.load(Ordering::Relaxed) / st.block_size.max(1) as u64;
        *st.rotation.lock() = Some(Rotation {
            to_generation: generation,
            blocks_total: total,
            ..Default::default()
        });
        self.table_dirty.store(true, Ordering::Release);
        self.commit()?;
        tracing::info!(
            volume = name,
            generation,
            "key rotation started: new writes use the new data key"
        );
        self.spawn_rotation(st);
        Ok(generation)
    }

    pub(crate) fn spawn_rotation(self: &Arc<Self>, st: Arc<VolumeState>) {
        let core = self.clone();
        let spawned = std::thread::Builder::new()
            .name("bulwark-rotate".into())
            .spawn(move || {
                if let Err(e) = core.rotate_run(&st) {
                    tracing::error!(volume = %st.name, "key rotation paused: {e}");
                    if let Some(r) = st.rotation.lock().as_mut() {
                        r.error = Some(e.to_string());
                    }
                }
            });
        if let Ok(h) = spawned {
            self.track_worker(h);
        }
    }

    fn rotate_run(self: &Arc<Self>, st: &Arc<VolumeState>) -> Result<()> {
        let vol = Volume::new(self.clone(), st.clone());
        let blocks = st.size / st.block_size as u64;
        let mut buf = vec![0u8; st.block_size as usize];
        loop {
            let Some(rot) = st.rotation.lock().as_mut().map(|r| {
                r.error = None;
                r.clone()
            }) else {
                return Ok(());
            };
            if self.closing.load(Ordering::Acquire)
                || st.ring.read().is_none()
                || st.destroyed.load(Ordering::Acquire)
            {
                return Ok(()); // resumes on the next key load
            }
            if rot.lba >= blocks {
                break;
            }
            let hi = (rot.lba + ROTATE_BATCH_BLOCKS).min(blocks);
            let mut old: Vec<u64> = Vec::new();
            st.tree
                .lock()
                .walk(&**self, &self.cache, rot.lba, hi, &mut |v| {
                    match v {
                        Visit::Data { lba, ptr }
                            if ptr.flags & FLAG_ENCRYPTED != 0
                                && ptr.key_gen != rot.to_generation =>
                        {
                            old.push(lba)
                        }
                        Visit::Unreadable { error, .. } => {
                            return Err(Error::Corrupt(format!("key rotation: {error}")))
                        }
                        _ => {}
                    }
                    Ok(())
                })?;
            for &lba in &old {
                vol.rewrite_block(lba, &mut buf)?;
            }
            let mut r = st.rotation.lock();
            if let Some(r) = r.as_mut() {
                r.lba = hi;
                r.blocks_done += old.len() as u64;
            }
            drop(r);
            self.table_dirty.store(true, Ordering::Release);
        }
        // Every block is under the new generation: drop the others.
        let to = st
            .rotation
            .lock()
            .as_ref()
            .map(|r| r.to_generation)
            .unwrap_or(0);
        {
            let vmk = st
                .vmk
                .lock()
                .clone()
                .ok_or_else(|| Error::Locked(st.name.clone()))?;
            let mut keys = st.data_keys.lock();
            keys.retain(|k| k.generation == to);
            *st.ring.write() = Some(Arc::new(KeyRing::open(&vmk, &st.uuid, &keys)?));
        }
        *st.rotation.lock() = None;
        self.forget_old_tables()?;
        tracing::info!(volume = %st.name, generation = to, "key rotation finished: the old data key is destroyed");
        Ok(())
    }
}
