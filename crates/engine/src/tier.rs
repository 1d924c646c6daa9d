//! The object tier's interface (issue 22): what the pool needs from an object store
//! (S3 and those that speak its dialect), and nothing of how it is reached. The client
//! itself lives outside the engine (`bulwark-objstore`, which runs its own async
//! runtime): the engine stays synchronous.
//!
//! Names are relative to the pool's root in the store (the URL's bucket and prefix). The
//! pool writes three kinds of object (`pool::tier`): `superblock`, the one object it
//! updates, always by compare-and-swap; sealed parts of segments, `seg/EPOCH/SEQ`, and
//! pages of the segment table, `table/EPOCH/SEQ`, each written once under a name never
//! used before (the writer's epoch is in every name, and the sequence only grows).

use crate::Result;

/// Which version of an object a conditional write expects (HTTP `ETag`, and the store's
/// version id where it has one).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Version {
    pub etag: Option<String>,
    pub version: Option<String>,
}

/// One object of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub name: String,
    pub size: u64,
    /// When it was last written, as the store says (seconds since the Unix epoch).
    pub modified: u64,
}

/// The condition of a compare-and-swap write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cond {
    /// Only if no object has the name (`If-None-Match: *`).
    Absent,
    /// Only if the object is still this version (`If-Match`).
    Matches(Version),
}

/// What a conditional write did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PutIf {
    /// Written; the new version.
    Done(Version),
    /// Refused: the condition did not hold (HTTP 412, or 409 from some stores). When the
    /// reply to an earlier try was lost, the refusal may be of the caller's own write:
    /// read the object back to tell (`pool::tier`).
    Refused,
}

/// An object store, as the pool uses it. Every call is synchronous and bounded in time by
/// the implementation (its retries end by a deadline): a store that does not answer gives
/// an error, never a hang.
pub trait ObjectStore: Send + Sync {
    /// Write `body` under `name`, whatever is there (names the pool writes this way are
    /// never reused).
    fn put(&self, name: &str, body: Vec<u8>) -> Result<()>;
    /// Write `body` under `name` only if `cond` holds.
    fn put_if(&self, name: &str, body: Vec<u8>, cond: &Cond) -> Result<PutIf>;
    /// The whole object and its version, or `None` if there is none; an object larger than
    /// `max_bytes` is `Corrupt`, and no more than that is ever read (a bucket is input).
    fn get(&self, name: &str, max_bytes: u64) -> Result<Option<(Vec<u8>, Version)>>;
    /// `len` bytes from `start`; an object shorter than that is `Corrupt`.
    fn get_range(&self, name: &str, start: u64, len: u64) -> Result<Vec<u8>>;
    /// Remove `name` (absent already: fine).
    fn delete(&self, name: &str) -> Result<()>;
    /// Every object under `prefix`.
    fn list(&self, prefix: &str) -> Result<Vec<Listed>>;
    /// The store and root, for messages (never credentials).
    fn describe(&self) -> String;
    /// Requests that failed in this run, by kind of cause (`timeout`, `connect`,
    /// `no_such_bucket`, `signature_does_not_match`, ...: a bounded set the client
    /// chooses), for `status` and the metrics. A store that does not count: none.
    fn request_errors(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
}

/// The startup probe (issue 22): a store that does not refuse a second create of the same
/// name, or a write against a stale version, would let two hosts write one pool at once
/// (split brain; under one data key that means nonce reuse). `name` must be fresh. The
/// probe's object is removed afterwards. Ok(list of checks passed), or `Invalid` naming
/// the check that failed.
pub fn probe(store: &dyn ObjectStore, name: &str) -> Result<Vec<&'static str>> {
    use crate::Error;
    let mut passed = Vec::new();
    let refused = |what: &str| {
        Error::Invalid(format!(
            "the object store {} does not honour conditional writes: {what}. Two hosts could \
             then write the pool at once; use a store that honours If-None-Match and If-Match \
             (see docs/object-store.md), or accept single-host use explicitly",
            store.describe()
        ))
    };
    let first = match store.put_if(name, b"bulwark probe 1".to_vec(), &Cond::Absent)? {
        PutIf::Done(v) => v,
        PutIf::Refused => {
            return Err(Error::Invalid(format!(
                "the object store {} refused to create the fresh object {name} (If-None-Match: *)",
                store.describe()
            )))
        }
    };
    passed.push("create if absent");
    let result = (|| {
        match store.put_if(name, b"bulwark probe 2".to_vec(), &Cond::Absent)? {
            PutIf::Refused => passed.push("second create refused (If-None-Match: *)"),
            PutIf::Done(_) => {
                return Err(refused(
                    "a second create of the same name (If-None-Match: *) was accepted",
                ))
            }
        }
        let second = match store.put_if(
            name,
            b"bulwark probe 3".to_vec(),
            &Cond::Matches(first.clone()),
        )? {
            PutIf::Done(v) => v,
            PutIf::Refused => {
                return Err(refused(
                    "a write with the current version (If-Match) was refused",
                ))
            }
        };
        passed.push("update with the current version (If-Match)");
        if second == first {
            return Err(refused(
                "a write did not change the object's version (ETag)",
            ));
        }
        match store.put_if(
            name,
            b"bulwark probe 4".to_vec(),
            &Cond::Matches(first.clone()),
        )? {
            PutIf::Refused => passed.push("update with a stale version refused (If-Match)"),
            PutIf::Done(_) => {
                return Err(refused(
                    "a write against a stale version (If-Match) was accepted",
                ))
            }
        }
        // If-Match on a name that does not exist must not create it (MinIO once did).
        let missing = format!("{name}-missing");
        match store.put_if(
            &missing,
            b"bulwark probe 5".to_vec(),
            &Cond::Matches(first.clone()),
        ) {
            Ok(PutIf::Refused) | Err(crate::Error::NotFound(_)) => {
                passed.push("update of a missing object refused (If-Match)")
            }
            Ok(PutIf::Done(_)) => {
                let _ = store.delete(&missing);
                return Err(refused("a write with If-Match created a missing object"));
            }
            Err(e) => return Err(e),
        }
        match store.get(name, 64)? {
            Some((body, _)) if body == b"bulwark probe 3" => passed.push("read back"),
            Some(_) => return Err(refused("a refused write changed the object")),
            None => {
                return Err(Error::Invalid(format!(
                    "the object store {} lost the probe object {name}",
                    store.describe()
                )))
            }
        }
        Ok(())
    })();
    let _ = store.delete(name);
    result.map(|_| passed)
}
