//! Who uses a volume, and the changes that wait until nobody does.
//!
//! A client's or a command's handle on the volume is counted (`open_while_loaded`,
//! `close`): what "in use" means to `volume destroy`, `rollback`, `key unload`, `key
//! erase` and a shrink. A background batch over the volume (a scrub batch, a key rotation
//! batch) holds the work lock for read (`background_batch`); a change takes it for write,
//! waiting at most a bound, and refuses while a handle is counted (`quiesce`).
//!
//! Key unload and erase meet the handles at the key: a handle of an encrypted volume is
//! counted under the key's read lock, and only while the key is loaded
//! (`open_while_loaded`); the key is taken away under its write lock, and only while no
//! handle is counted (`take_key_unused`). So a handle either was counted before the key
//! was taken (and the unload refuses: in use), or finds the key gone (and is refused:
//! locked): no handle opened while an unload was under way writes under a key the unload
//! said it took, and no unload returns while a handle could still write. (Before, the key
//! was checked and the handle counted apart, and unload took the key without looking at
//! the count again: a handle opened while unload flushed wrote under the key after unload
//! returned; `crates/modelcheck/tests/key_unload.rs` found it.)
//!
//! The maintenance thread's references (commits, cleaning, intent-log flushes) are not
//! handles: they used to make a volume nobody had opened "in use" whenever the pool was
//! busy. This file takes its locks and atomics from `crate::sync`, so `crates/modelcheck`
//! checks it under shuttle with threads playing clients, a rotation batch and key unload.

use std::time::Duration;

use crate::sync::atomic::{AtomicUsize, Ordering};
use crate::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Why a change to the volume cannot go on now.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// This many handles hold the volume open.
    InUse(usize),
    /// A background batch over it did not end within the bound.
    Busy,
}

#[derive(Default)]
pub struct Uses {
    /// Open handles on the volume that a client or a command took.
    clients: AtomicUsize,
    /// Held for read by a background batch over the volume, for write by a change.
    work: RwLock<()>,
}

impl Uses {
    pub fn new() -> Uses {
        Uses::default()
    }

    /// How many client or command handles hold the volume open.
    pub fn clients(&self) -> usize {
        self.clients.load(Ordering::Acquire)
    }

    /// Count a handle, if the volume needs no key or its `key` is loaded (checked and
    /// counted under the key's read lock). False: the volume is locked, nothing counted.
    pub fn open_while_loaded<K>(&self, key: &RwLock<Option<K>>, needs_key: bool) -> bool {
        let k = key.read();
        if needs_key && k.is_none() {
            return false;
        }
        self.clients.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// A counted handle closes.
    pub fn close(&self) {
        self.clients.fetch_sub(1, Ordering::AcqRel);
    }

    /// A background batch over the volume (scrub, key rotation): held while it reads or
    /// rewrites the volume's records, so that no change is made under it.
    pub fn background_batch(&self) -> RwLockReadGuard<'_, ()> {
        self.work.read()
    }

    /// Before a change to what the volume is: refused while a handle is counted; a
    /// background batch is waited for, at most `max`, and kept out while the guard lives.
    pub fn quiesce(&self, max: Duration) -> Result<RwLockWriteGuard<'_, ()>, Refused> {
        self.unused()?;
        let g = self.work.try_write_for(max).ok_or(Refused::Busy)?;
        self.unused()?;
        Ok(g)
    }

    /// Take the volume's `key` away (key unload, erase), under its write lock, refused if a
    /// handle is counted: a handle opening now waits, and then finds no key. The caller
    /// holds `quiesce`'s guard.
    pub fn take_key_unused<K>(&self, key: &RwLock<Option<K>>) -> Result<Option<K>, Refused> {
        let mut k = key.write();
        self.unused()?;
        Ok(k.take())
    }

    fn unused(&self) -> Result<(), Refused> {
        match self.clients() {
            0 => Ok(()),
            n => Err(Refused::InUse(n)),
        }
    }
}
