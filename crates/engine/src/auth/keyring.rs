//! Which key may authenticate a record of a lineage: the policy check of decision 0008
//! ("Policy at read"), and the writer's side that seals under the current epoch.
//!
//! Policy comes from authenticated state only: the pointer's key epoch → the epoch
//! table's entry (lineage, key id, kind, salt) → an entry of the reading lineage's
//! keyring with the same kind (and key id, for sealed epochs). The pointer's sealed
//! flag must equal "kind is sealed". Anything else is `Corrupt`, never data: a
//! plaintext record in an encrypted lineage names an auth-only epoch, which its
//! keyring does not hold, and a sealed flag cleared on a sealed epoch's pointer is
//! refused before any byte is looked at. A record's lineage (its header's id, the uuid
//! in its AAD or MAC) is its epoch's: a clone reads the records it shares with its
//! origin under the origin's epochs, with keys its own keyring inherited.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use zeroize::Zeroizing;

use crate::codec::CompressGuess;
use crate::format::address::SegmentShift;
use crate::format::blkptr::Blkptr;
use crate::format::header::RecordType;
use crate::format::node::{Node, Tree};
use crate::keys::epoch::{epoch_key, Epoch, EpochKind, EpochNumbers, EpochWriter};
use crate::{Error, Result};

use super::record::{self, DataPlace, EpochCipher, NodePlace, Sealed};

/// One key a lineage's keyring holds.
pub struct KeyEntry {
    /// The data key's id (sealed entries); auth-only epochs carry key id 0.
    pub key_id: u32,
    /// The lineage whose records the key authenticates (its own, or an origin's).
    pub source: [u8; 16],
    pub kind: EpochKind,
    /// The data key (sealed entries only; the others derive from the pool key).
    pub data_key: Option<Zeroizing<[u8; 32]>>,
}

impl std::fmt::Debug for KeyEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyEntry")
            .field("key_id", &self.key_id)
            .field("source", &crate::hex::to_hex(&self.source))
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

/// What a lineage may read: its policy and its keys, as its (authenticated) keyring
/// says, or pool metadata's one implicit entry.
#[derive(Debug)]
pub struct Keyring {
    /// The lineage's own uuid (the pool id for pool metadata).
    pub uuid: [u8; 16],
    pub encrypted: bool,
    entries: Vec<KeyEntry>,
}

impl Keyring {
    /// An encrypted lineage's keyring: its sealed data keys, and keys inherited from
    /// origins. Refuses one that would let the lineage read plaintext of its own or
    /// holds a sealed entry without its key.
    pub fn encrypted(uuid: [u8; 16], entries: Vec<KeyEntry>) -> Result<Keyring> {
        for e in &entries {
            let ok = match e.kind {
                EpochKind::Sealed => e.data_key.is_some() && e.key_id >= 1,
                EpochKind::LineageAuth => e.data_key.is_none() && e.source != uuid,
                EpochKind::PoolMeta => false,
            };
            if !ok {
                return Err(Error::Corrupt(format!(
                    "keyring of an encrypted lineage holds {e:?}"
                )));
            }
        }
        if !entries
            .iter()
            .any(|e| e.kind == EpochKind::Sealed && e.source == uuid)
        {
            return Err(Error::Corrupt(
                "keyring of an encrypted lineage holds no data key of its own".into(),
            ));
        }
        Ok(Keyring {
            uuid,
            encrypted: true,
            entries,
        })
    }

    /// An unencrypted lineage: "off, kind 2 of its own lineage", and of the lineages
    /// in `inherited` (the origins of a clone).
    pub fn unencrypted(uuid: [u8; 16], inherited: &[[u8; 16]]) -> Keyring {
        let auth = |source: [u8; 16]| KeyEntry {
            key_id: 0,
            source,
            kind: EpochKind::LineageAuth,
            data_key: None,
        };
        let mut entries = vec![auth(uuid)];
        entries.extend(inherited.iter().copied().map(auth));
        Keyring {
            uuid,
            encrypted: false,
            entries,
        }
    }

    /// Pool metadata (lineage 0: the directory, the segment table, objects), named by
    /// the pool id.
    pub fn pool_meta(pool_id: [u8; 16]) -> Keyring {
        Keyring {
            uuid: pool_id,
            encrypted: false,
            entries: vec![KeyEntry {
                key_id: 0,
                source: pool_id,
                kind: EpochKind::PoolMeta,
                data_key: None,
            }],
        }
    }

    fn entry(&self, epoch: &Epoch, uuid: &[u8; 16]) -> Option<&KeyEntry> {
        self.entries.iter().find(|e| {
            e.kind == epoch.kind
                && e.source == *uuid
                && (e.kind != EpochKind::Sealed || e.key_id == epoch.key_id)
        })
    }
}

/// An epoch as the epoch table gives it, with its lineage's uuid.
#[derive(Debug, Clone, Copy)]
struct KnownEpoch {
    epoch: Epoch,
    uuid: [u8; 16],
}

/// Verifies and opens the records of one lineage (or pool metadata): the policy check,
/// then the tag. Epoch key schedules are derived on first use and kept.
pub struct Authenticator {
    keyring: Keyring,
    /// The base of pool-metadata and auth-only epochs.
    pool_base: Zeroizing<[u8; 32]>,
    epochs: HashMap<u32, KnownEpoch>,
    ciphers: Mutex<HashMap<u32, Arc<EpochCipher>>>,
}

impl Authenticator {
    pub fn new(keyring: Keyring, pool_base: Zeroizing<[u8; 32]>) -> Authenticator {
        Authenticator {
            keyring,
            pool_base,
            epochs: HashMap::new(),
            ciphers: Mutex::new(HashMap::new()),
        }
    }

    pub fn keyring(&self) -> &Keyring {
        &self.keyring
    }

    /// An epoch of the (authenticated) epoch table, `uuid` being its lineage's. Refuses
    /// a number already known as another epoch.
    pub fn learn_epoch(&mut self, epoch: Epoch, uuid: [u8; 16]) -> Result<()> {
        match self.epochs.get(&epoch.no) {
            Some(k) if k.epoch != epoch || k.uuid != uuid => Err(Error::Corrupt(format!(
                "epoch {} is known twice, as {:?} and {epoch:?}",
                epoch.no, k.epoch
            ))),
            _ => {
                self.epochs.insert(epoch.no, KnownEpoch { epoch, uuid });
                Ok(())
            }
        }
    }

    /// The key `ptr` names and the lineage it is of, if this lineage's policy allows
    /// that key for a record of `ptr`'s type; else why not.
    fn key_for(&self, ptr: &Blkptr) -> Result<(Arc<EpochCipher>, KnownEpoch)> {
        let refused = |m: String| Err(Error::Corrupt(format!("{m}; refused, never read")));
        let Some(known) = self.epochs.get(&ptr.epoch).copied() else {
            return refused(format!(
                "a {:?} pointer names key epoch {}, which is not in the epoch table",
                ptr.kind, ptr.epoch
            ));
        };
        let epoch = &known.epoch;
        let Some(entry) = self.keyring.entry(epoch, &known.uuid) else {
            return refused(format!(
                "a {:?} pointer names epoch {} ({:?}, lineage {}, key id {}), which this \
                 lineage's keyring does not allow{}",
                ptr.kind,
                epoch.no,
                epoch.kind,
                epoch.lineage,
                epoch.key_id,
                if self.keyring.encrypted && epoch.kind != EpochKind::Sealed {
                    " (an unencrypted record in an encrypted lineage)"
                } else {
                    ""
                }
            ));
        };
        if ptr.kind == RecordType::Data && ptr.sealed() != (epoch.kind == EpochKind::Sealed) {
            return refused(format!(
                "a data pointer under {:?} epoch {} says sealed = {}",
                epoch.kind,
                epoch.no,
                ptr.sealed()
            ));
        }
        if let Some(c) = self.ciphers.lock().get(&epoch.no) {
            return Ok((c.clone(), known));
        }
        let base = match (&entry.data_key, epoch.kind) {
            (Some(dk), EpochKind::Sealed) => dk,
            (None, EpochKind::PoolMeta | EpochKind::LineageAuth) => &self.pool_base,
            _ => unreachable!("`Keyring` holds a data key exactly on sealed entries"),
        };
        let key = epoch_key(base, epoch, &known.uuid);
        let c = Arc::new(EpochCipher::new(epoch.no, &key));
        self.ciphers.lock().insert(epoch.no, c.clone());
        Ok((c, known))
    }

    /// Block `block` (of `block_bytes`) of this lineage from the data record `stored`
    /// that `ptr` points at, into `out`; `out` holds nothing of the record on failure.
    pub fn open_data(
        &self,
        ptr: &Blkptr,
        block: u64,
        block_bytes: u32,
        stored: &[u8],
        out: &mut [u8],
    ) -> Result<()> {
        let (key, known) = self.key_for(ptr).inspect_err(|_| out.fill(0))?;
        let place = DataPlace {
            lineage: known.epoch.lineage,
            uuid: known.uuid,
            block,
            block_bytes,
        };
        record::open_data(&key, ptr, &place, stored, out)
    }

    /// The map node of `tree` at `level`, `index` from the record `stored` that `ptr`
    /// points at.
    pub fn open_node(
        &self,
        ptr: &Blkptr,
        tree: Tree,
        level: u8,
        index: u64,
        stored: &[u8],
        shift: SegmentShift,
    ) -> Result<Node> {
        let (key, known) = self.key_for(ptr)?;
        let place = NodePlace {
            tree,
            level,
            index,
            lineage: known.epoch.lineage,
            uuid: known.uuid,
        };
        record::open_node(&key, ptr, &place, stored, shift)
    }
}

/// The writer's side of one lineage (or pool metadata): seals data and nodes under its
/// current epoch (`EpochWriter`: a fresh salt per run, a counter, rollover), with the
/// epoch's key schedule built once.
pub struct Sealer {
    writer: EpochWriter,
    current: Mutex<Option<Arc<EpochCipher>>>,
    /// Every epoch this sealer used, oldest first.
    opened: Mutex<Vec<Epoch>>,
}

impl Sealer {
    pub fn new(writer: EpochWriter) -> Sealer {
        Sealer {
            writer,
            current: Mutex::new(None),
            opened: Mutex::new(Vec::new()),
        }
    }

    /// The epochs this sealer has used, oldest first: each must be logged and enter
    /// the epoch table before a pointer that names it is committed.
    pub fn epochs(&self) -> Vec<Epoch> {
        self.opened.lock().clone()
    }

    /// The next (key, nonce) and the epoch it belongs to (new epochs go to the log and
    /// the epoch table before a record that uses them is referenced).
    fn next(&self, numbers: &EpochNumbers) -> Result<(Arc<EpochCipher>, u32, Epoch)> {
        let (open, nonce) = self.writer.next(numbers)?;
        let mut cur = self.current.lock();
        let cipher = match &*cur {
            Some(c) if c.no == open.epoch.no => c.clone(),
            _ => {
                let c = Arc::new(EpochCipher::new(open.epoch.no, &open.key));
                *cur = Some(c.clone());
                let mut opened = self.opened.lock();
                if !opened.iter().any(|e| e.no == open.epoch.no) {
                    opened.push(open.epoch);
                }
                c
            }
        };
        Ok((cipher, nonce, open.epoch))
    }

    /// Appends the data record of block `block` (`plain`, one whole block) to `out`:
    /// sealed for a sealed writer, authenticated only otherwise.
    pub fn seal_data(
        &self,
        numbers: &EpochNumbers,
        block: u64,
        compress: Option<&CompressGuess>,
        plain: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(Sealed, Epoch)> {
        let kind = self.writer.kind();
        assert!(kind != EpochKind::PoolMeta, "data of pool metadata");
        let (key, nonce, epoch) = self.next(numbers)?;
        let place = DataPlace {
            lineage: self.writer.lineage(),
            uuid: *self.writer.lineage_uuid(),
            block,
            block_bytes: plain.len() as u32,
        };
        let s = record::seal_data(
            &key,
            nonce,
            &place,
            kind == EpochKind::Sealed,
            compress,
            plain,
            out,
        )?;
        Ok((s, epoch))
    }

    /// Appends the record of map node `node` of `tree` to `out`.
    pub fn seal_node(
        &self,
        numbers: &EpochNumbers,
        tree: Tree,
        node: &Node,
        out: &mut Vec<u8>,
    ) -> Result<(Sealed, Epoch)> {
        assert_eq!(
            node.id.lineage,
            self.writer.lineage(),
            "a node of its lineage"
        );
        let (key, nonce, epoch) = self.next(numbers)?;
        let s = record::seal_node(&key, nonce, tree, self.writer.lineage_uuid(), node, out)?;
        Ok((s, epoch))
    }
}
