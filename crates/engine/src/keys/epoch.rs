//! Epoch keys (decision 0008, "Nonces"): how a record's (key, nonce) pair stays unique
//! when the devices lie.
//!
//! An epoch is (number, lineage, key id, kind, salt). Its key is derived from a base key
//! (the pool key for pool metadata and unencrypted lineages, a data key for sealed ones)
//! and a 128-bit salt the writer draws from the OS random source when it opens the epoch;
//! its nonces are an in-memory counter from 0, at most `EPOCH_NONCES` of them. Nothing
//! read from the devices feeds a nonce: a rolled-back pool, an edited counter, a restarted
//! daemon or a second writer on a copy of the devices all open new epochs with new salts,
//! so two records share a key only if one run of one writer sealed both, and that run's
//! counter never repeats.
//!
//! Not wired into the v1 pool: the epoch number and nonce go into the v2 block pointer
//! (step 3 of decision 0008), and epochs into the epoch table (step 5).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use zeroize::Zeroizing;

use crate::{Error, Result};

/// Nonces per epoch key: the 32-bit counter of the v2 nonce.
pub const EPOCH_NONCES: u64 = 1 << 32;

/// What an epoch's key authenticates (the epoch table's `kind` byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EpochKind {
    /// Pool metadata: directory, segment table, dataset records, dead lists.
    PoolMeta = 0,
    /// Data (sealed) and map nodes of an encrypted lineage, from one of its data keys.
    Sealed = 1,
    /// Data and map nodes of an unencrypted lineage (authenticated only).
    LineageAuth = 2,
}

impl EpochKind {
    pub fn from_byte(b: u8) -> Result<EpochKind> {
        match b {
            0 => Ok(EpochKind::PoolMeta),
            1 => Ok(EpochKind::Sealed),
            2 => Ok(EpochKind::LineageAuth),
            _ => Err(Error::Corrupt(format!("epoch kind {b} is not 0, 1 or 2"))),
        }
    }
}

/// One epoch: the identity of a key that seals or authenticates at most `EPOCH_NONCES`
/// records. Holds nothing secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Epoch {
    /// Pool-unique, from 1.
    pub no: u32,
    /// The lineage (0: pool metadata).
    pub lineage: u32,
    /// The data key's id in the lineage's keyring (`Sealed`), else 0.
    pub key_id: u32,
    pub kind: EpochKind,
    /// Drawn from the OS random source when the epoch opened.
    pub salt: [u8; 16],
}

/// HKDF-SHA256 (RFC 5869) of `ikm` with `salt`, expanded with the concatenation of `info`
/// to 32 bytes: every key of decision 0008's key table comes from here.
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

/// The key of `epoch`: `base` is the pool key for `PoolMeta` and `LineageAuth`, the data
/// key `key_id` of the lineage for `Sealed`; `lineage_uuid` names the lineage (the pool
/// id for pool metadata, where it is not part of the info).
pub fn epoch_key(
    base: &Zeroizing<[u8; 32]>,
    epoch: &Epoch,
    lineage_uuid: &[u8; 16],
) -> Zeroizing<[u8; 32]> {
    let no = epoch.no.to_le_bytes();
    match epoch.kind {
        EpochKind::PoolMeta => hkdf(&base[..], &epoch.salt, &[b"bulwark2 meta", &no]),
        EpochKind::Sealed => hkdf(
            &base[..],
            &epoch.salt,
            &[b"bulwark2 data", lineage_uuid, &no],
        ),
        EpochKind::LineageAuth => hkdf(
            &base[..],
            &epoch.salt,
            &[b"bulwark2 lineage", lineage_uuid, &no],
        ),
    }
}

/// Hands out epoch numbers: from the next one the last durable epoch table names. After
/// a rollback two runs may hand out the same number; their salts still differ, so their
/// keys do (the number names an epoch in the table, it is not what makes a key unique).
pub struct EpochNumbers(AtomicU32);

impl EpochNumbers {
    pub fn new(next: u32) -> EpochNumbers {
        EpochNumbers(AtomicU32::new(next.max(1)))
    }

    fn take(&self) -> Result<u32> {
        let no = self.0.fetch_add(1, Ordering::AcqRel);
        if no == u32::MAX {
            return Err(Error::Invalid(
                "the pool has used every epoch number (2^32 - 1)".into(),
            ));
        }
        Ok(no)
    }

    pub fn next(&self) -> u32 {
        self.0.load(Ordering::Acquire)
    }
}

/// An open epoch: its identity, its key, and the next nonce.
pub struct OpenEpoch {
    pub epoch: Epoch,
    pub key: Zeroizing<[u8; 32]>,
    next: AtomicU64,
    limit: u64,
}

impl OpenEpoch {
    /// Nonces handed out so far.
    pub fn used(&self) -> u64 {
        self.next.load(Ordering::Acquire).min(self.limit)
    }
}

/// The writer's side of one (lineage, kind, key id): its current epoch, opened on first
/// use and replaced by a new one (new number, new salt) once its nonces run out. Each
/// `next` returns the epoch and a nonce no other call of this run, nor of any other run,
/// pairs with that epoch's key.
pub struct EpochWriter {
    lineage: u32,
    lineage_uuid: [u8; 16],
    key_id: u32,
    kind: EpochKind,
    base: Zeroizing<[u8; 32]>,
    /// Nonces per epoch: `EPOCH_NONCES`, smaller in tests.
    limit: u64,
    current: Mutex<Option<Arc<OpenEpoch>>>,
}

impl EpochWriter {
    pub fn new(
        lineage: u32,
        lineage_uuid: [u8; 16],
        key_id: u32,
        kind: EpochKind,
        base: Zeroizing<[u8; 32]>,
    ) -> EpochWriter {
        EpochWriter::with_limit(lineage, lineage_uuid, key_id, kind, base, EPOCH_NONCES)
    }

    /// `new` with `limit` nonces per epoch (tests exercise rollover with a small one).
    pub fn with_limit(
        lineage: u32,
        lineage_uuid: [u8; 16],
        key_id: u32,
        kind: EpochKind,
        base: Zeroizing<[u8; 32]>,
        limit: u64,
    ) -> EpochWriter {
        assert!((1..=EPOCH_NONCES).contains(&limit));
        EpochWriter {
            lineage,
            lineage_uuid,
            key_id,
            kind,
            base,
            limit,
            current: Mutex::new(None),
        }
    }

    pub fn lineage(&self) -> u32 {
        self.lineage
    }

    pub fn lineage_uuid(&self) -> &[u8; 16] {
        &self.lineage_uuid
    }

    pub fn kind(&self) -> EpochKind {
        self.kind
    }

    /// The epoch and nonce for the next record. Opens a new epoch (numbered by `numbers`,
    /// with a fresh salt) on first use and when the current one has no nonce left.
    pub fn next(&self, numbers: &EpochNumbers) -> Result<(Arc<OpenEpoch>, u32)> {
        loop {
            let open = {
                let mut cur = self.current.lock();
                match &*cur {
                    Some(e) if e.next.load(Ordering::Acquire) < e.limit => e.clone(),
                    _ => {
                        let e = Arc::new(self.open(numbers.take()?));
                        *cur = Some(e.clone());
                        e
                    }
                }
            };
            let n = open.next.fetch_add(1, Ordering::AcqRel);
            if n < open.limit {
                return Ok((open, n as u32));
            }
            // Another thread took the last nonce: the loop opens the next epoch.
        }
    }

    fn open(&self, no: u32) -> OpenEpoch {
        let epoch = Epoch {
            no,
            lineage: self.lineage,
            key_id: self.key_id,
            kind: self.kind,
            salt: super::wrap::random_bytes(),
        };
        OpenEpoch {
            key: epoch_key(&self.base, &epoch, &self.lineage_uuid),
            epoch,
            next: AtomicU64::new(0),
            limit: self.limit,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn writer(limit: u64) -> EpochWriter {
        EpochWriter::with_limit(
            7,
            [7; 16],
            1,
            EpochKind::Sealed,
            Zeroizing::new([9; 32]),
            limit,
        )
    }

    /// The HKDF is RFC 5869's: its first SHA-256 test vector (case 1), first 32 bytes.
    #[test]
    fn hkdf_matches_rfc_5869() {
        let ikm = [0x0bu8; 22];
        let salt: Vec<u8> = (0x00..=0x0c).collect();
        let info: Vec<u8> = (0xf0..=0xf9).collect();
        let okm = hkdf(&ikm, &salt, &[&info[..5], &info[5..]]);
        let want = "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf";
        assert_eq!(crate::hex::to_hex(&okm[..]), want);
    }

    #[test]
    fn kinds_lineages_numbers_and_salts_give_different_keys() {
        let base = Zeroizing::new([1u8; 32]);
        let e = Epoch {
            no: 1,
            lineage: 1,
            key_id: 0,
            kind: EpochKind::Sealed,
            salt: [2; 16],
        };
        let k = |e: &Epoch, uuid: &[u8; 16]| epoch_key(&base, e, uuid);
        let mut seen = HashSet::new();
        for e in [
            e,
            Epoch {
                kind: EpochKind::LineageAuth,
                ..e
            },
            Epoch {
                kind: EpochKind::PoolMeta,
                ..e
            },
            Epoch { no: 2, ..e },
            Epoch { salt: [3; 16], ..e },
        ] {
            assert!(seen.insert(*k(&e, &[5; 16])), "{e:?}");
        }
        assert!(seen.insert(*k(&e, &[6; 16])), "another lineage");
    }

    #[test]
    fn an_epoch_rolls_over_when_its_nonces_run_out() {
        let numbers = EpochNumbers::new(1);
        let w = writer(3);
        let got: Vec<(u32, u32)> = (0..7)
            .map(|_| {
                let (e, n) = w.next(&numbers).unwrap();
                (e.epoch.no, n)
            })
            .collect();
        assert_eq!(
            got,
            [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2), (3, 0)]
        );
        assert_eq!(numbers.next(), 4);
    }

    /// The rollback case of issue 20: a second run starts from the same durable state (the
    /// same next epoch number, as after restoring old device images) and writes again.
    /// Its epochs get the same numbers, but no (key, nonce) pair of the first run comes
    /// back; and threads of one run never share a pair either.
    #[test]
    fn a_run_from_rolled_back_state_repeats_no_key_nonce_pair() {
        let mut pairs: HashSet<([u8; 32], u32)> = HashSet::new();
        for _run in 0..2 {
            let numbers = Arc::new(EpochNumbers::new(5));
            let w = Arc::new(writer(1000));
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    let (w, numbers) = (w.clone(), numbers.clone());
                    std::thread::spawn(move || {
                        (0..1500)
                            .map(|_| {
                                let (e, n) = w.next(&numbers).unwrap();
                                (*e.key, n)
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            for h in handles {
                for p in h.join().unwrap() {
                    assert!(pairs.insert(p), "a (key, nonce) pair came twice");
                }
            }
        }
        assert_eq!(pairs.len(), 2 * 4 * 1500);
    }

    #[test]
    fn unknown_kind_byte_is_refused() {
        assert!(EpochKind::from_byte(3).is_err());
        assert_eq!(EpochKind::from_byte(1).unwrap(), EpochKind::Sealed);
    }
}
