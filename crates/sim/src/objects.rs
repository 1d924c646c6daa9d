//! A simulated object store (S3) for the `tier` layout: in memory, with S3's conditional
//! writes and versions, and faults armed by the seed.
//!
//! What it keeps is what the engine's `tier::ObjectStore` contract asks of a real store:
//! `put_if` with `Cond::Absent` (`If-None-Match: *`) refuses a name that exists, with
//! `Cond::Matches` (`If-Match`) refuses unless the object is still that version (a missing
//! object included: never created by it); every write gives the object a new version (its
//! ETag: a count of the writes of that name, which never goes back, so a version once
//! replaced never matches again, even after a delete); a GET larger than the caller's
//! bound is `Corrupt`, a ranged GET past the end `Corrupt`, of a missing object `NotFound`.
//!
//! Faults (`arm`): while armed, each request may fail, as the real client
//! (`bulwark-objstore`) reports such a failure: a *timeout* (nothing done,
//! `Error::Io` of kind `TimedOut`), a *5xx* (nothing done, `Error::Io`, "503 Service
//! Unavailable"), or a *lost answer* (the write landed, and the caller gets a timeout; for
//! a conditional write, half the time the refusal the client's retry got instead, HTTP
//! 412, as the real client reports it: `PutIf::Refused`). Whether a request fails is a hash
//! of the armed seed, the kind of request and how many of that kind the window has seen:
//! the superblock's conditional writes, its reads and the reads of data come one at a
//! time. A commit's uploads (plain PUTs) run on several threads at once, and how many
//! there are depends on the sizes of records (random nonces, compression): within one
//! window they all fail, with one mode, or none does, so what a commit answers is the
//! seed's whatever the threads' order. No clock, no thread of its own.
//!
//! The second writer (`World::tier_writer`) reaches around the contract with `raw_get` and
//! `raw_put`: another host's superblock object lands in the bucket whatever the pool
//! wrote.

use std::collections::BTreeMap;
use std::sync::Mutex;

use bulwark_engine::tier::{Cond, Listed, ObjectStore, PutIf, Version};
use bulwark_engine::{Error, Result};

/// A failure the store may give a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreFault {
    /// The request timed out; nothing was done.
    Timeout,
    /// HTTP 503 (after the client's retries); nothing was done.
    ServerError,
    /// A write landed and its answer was lost (a read: a timeout).
    LostAnswer,
}

/// Every fault kind (a window arms one, or all).
pub const STORE_FAULTS: [StoreFault; 3] = [
    StoreFault::Timeout,
    StoreFault::ServerError,
    StoreFault::LostAnswer,
];

/// What an armed window does: each request fails with `odds` per mille, one of `modes`.
#[derive(Debug, Clone)]
pub struct Armed {
    pub seed: u64,
    pub odds: u64,
    pub modes: Vec<StoreFault>,
}

/// Requests, for the fault hash.
#[derive(Clone, Copy)]
enum Op {
    Put = 1,
    PutIf = 2,
    Get = 3,
    Range = 4,
    Delete = 5,
    List = 6,
}

#[derive(Default)]
struct Inner {
    /// Name → (body, version).
    objects: BTreeMap<String, (Vec<u8>, u64)>,
    /// Writes per name so far (never reset: the next version of the name).
    writes: BTreeMap<String, u64>,
    /// Requests of each kind in the armed window so far, for the fault hash.
    asked: BTreeMap<u8, u64>,
    armed: Option<Armed>,
    /// Faults given, by kind (`request_errors`, and the run's counts).
    given: BTreeMap<&'static str, u64>,
}

/// The simulated bucket.
#[derive(Default)]
pub struct SimStore {
    inner: Mutex<Inner>,
}

fn fnv(s: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in s.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn version(n: u64) -> Version {
    Version {
        etag: Some(format!("\"{n}\"")),
        version: None,
    }
}

impl SimStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Arm faults (`None`: disarm).
    pub fn arm(&self, armed: Option<Armed>) {
        let mut g = self.lock();
        g.armed = armed;
        g.asked.clear();
    }

    /// Faults given so far, by kind.
    pub fn faults_given(&self) -> u64 {
        self.lock().given.values().sum()
    }

    /// The object as it is, around the faults (the second writer, the checks).
    pub fn raw_get(&self, name: &str) -> Option<Vec<u8>> {
        self.lock().objects.get(name).map(|(b, _)| b.clone())
    }

    /// Write an object whatever is there (another host's write): a new version.
    pub fn raw_put(&self, name: &str, body: Vec<u8>) {
        let mut g = self.lock();
        let n = next_version(&mut g, name);
        g.objects.insert(name.to_string(), (body, n));
    }

    /// Objects held (for the trace: what collection left).
    pub fn object_count(&self) -> usize {
        self.lock().objects.len()
    }

    /// The fault this request gets, if any (and counts it).
    fn fault(g: &mut Inner, op: Op) -> Option<StoreFault> {
        let armed = g.armed.clone()?;
        let n = match op {
            // Uploads: one draw for the whole window (see the module's doc).
            Op::Put => 0,
            _ => {
                let asked = g.asked.entry(op as u8).or_default();
                *asked += 1;
                *asked
            }
        };
        let h = mix(armed.seed ^ mix(((op as u64) << 56) ^ n));
        if h % 1000 >= armed.odds || armed.modes.is_empty() {
            return None;
        }
        let f = armed.modes[((h >> 20) % armed.modes.len() as u64) as usize];
        let kind = match f {
            StoreFault::ServerError => "server_error",
            _ => "timeout",
        };
        *g.given.entry(kind).or_default() += 1;
        Some(f)
    }
}

fn next_version(g: &mut Inner, name: &str) -> u64 {
    let w = g.writes.entry(name.to_string()).or_default();
    *w += 1;
    *w
}

/// The error the real client gives for `f` on `what name`.
fn failure(f: StoreFault, what: &str, name: &str) -> Error {
    let msg = format!("object store sim://bucket: {what} {name}");
    match f {
        StoreFault::ServerError => Error::Io(std::io::Error::other(format!(
            "{msg}: HTTP 503 Service Unavailable: SlowDown (simulated)"
        ))),
        StoreFault::Timeout | StoreFault::LostAnswer => Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("{msg}: the request timed out (simulated)"),
        )),
    }
}

impl ObjectStore for SimStore {
    fn put(&self, name: &str, body: Vec<u8>) -> Result<()> {
        let mut g = self.lock();
        let f = Self::fault(&mut g, Op::Put);
        if matches!(f, Some(StoreFault::Timeout | StoreFault::ServerError)) {
            return Err(failure(f.expect("a fault"), "PUT", name));
        }
        let n = next_version(&mut g, name);
        g.objects.insert(name.to_string(), (body, n));
        match f {
            Some(f) => Err(failure(f, "PUT", name)),
            None => Ok(()),
        }
    }

    fn put_if(&self, name: &str, body: Vec<u8>, cond: &Cond) -> Result<PutIf> {
        let mut g = self.lock();
        let f = Self::fault(&mut g, Op::PutIf);
        if matches!(f, Some(StoreFault::Timeout | StoreFault::ServerError)) {
            return Err(failure(f.expect("a fault"), "conditional PUT", name));
        }
        let current = g.objects.get(name).map(|(_, v)| *v);
        let holds = match cond {
            Cond::Absent => current.is_none(),
            Cond::Matches(want) => current.is_some_and(|v| version(v).etag == want.etag),
        };
        if !holds {
            return match f {
                Some(f) => Err(failure(f, "conditional PUT", name)),
                None => Ok(PutIf::Refused),
            };
        }
        let n = next_version(&mut g, name);
        g.objects.insert(name.to_string(), (body, n));
        match f {
            // The answer lost: the client's retry found its own write there (412), or it
            // gave up by its deadline. Which one is the seed's too.
            Some(f) if mix(n ^ fnv(name)) % 2 == 0 => {
                let _ = f;
                Ok(PutIf::Refused)
            }
            Some(f) => Err(failure(f, "conditional PUT", name)),
            None => Ok(PutIf::Done(version(n))),
        }
    }

    fn get(&self, name: &str, max_bytes: u64) -> Result<Option<(Vec<u8>, Version)>> {
        let mut g = self.lock();
        if let Some(f) = Self::fault(&mut g, Op::Get) {
            return Err(failure(f, "GET", name));
        }
        match g.objects.get(name) {
            Some((b, _)) if b.len() as u64 > max_bytes => Err(Error::Corrupt(format!(
                "object store sim://bucket: {name} is {} bytes, more than the {max_bytes} \
                 expected",
                b.len()
            ))),
            Some((b, v)) => Ok(Some((b.clone(), version(*v)))),
            None => Ok(None),
        }
    }

    fn get_range(&self, name: &str, start: u64, len: u64) -> Result<Vec<u8>> {
        let mut g = self.lock();
        if let Some(f) = Self::fault(&mut g, Op::Range) {
            return Err(failure(f, "ranged GET", name));
        }
        let (b, _) = g.objects.get(name).ok_or_else(|| {
            Error::NotFound(format!("object store sim://bucket: {name}: no such key"))
        })?;
        let end = start.saturating_add(len);
        b.get(start as usize..end.min(usize::MAX as u64) as usize)
            .map(|s| s.to_vec())
            .ok_or_else(|| {
                Error::Corrupt(format!(
                    "object store sim://bucket: {name} is {} bytes, {len} asked from {start}",
                    b.len()
                ))
            })
    }

    fn delete(&self, name: &str) -> Result<()> {
        let mut g = self.lock();
        let f = Self::fault(&mut g, Op::Delete);
        if matches!(f, Some(StoreFault::Timeout | StoreFault::ServerError)) {
            return Err(failure(f.expect("a fault"), "DELETE", name));
        }
        g.objects.remove(name);
        match f {
            Some(f) => Err(failure(f, "DELETE", name)),
            None => Ok(()),
        }
    }

    fn list(&self, prefix: &str) -> Result<Vec<Listed>> {
        let mut g = self.lock();
        if let Some(f) = Self::fault(&mut g, Op::List) {
            return Err(failure(f, "LIST", prefix));
        }
        Ok(g.objects
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, (b, _))| Listed {
                name: k.clone(),
                size: b.len() as u64,
                // No clock: every object is older than any grace period.
                modified: 0,
            })
            .collect())
    }

    fn describe(&self) -> String {
        "sim://bucket".into()
    }

    fn request_errors(&self) -> Vec<(&'static str, u64)> {
        self.lock().given.iter().map(|(k, v)| (*k, *v)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine's own startup probe passes: the contract of conditional writes holds.
    #[test]
    fn the_engine_probe_passes() {
        let s = SimStore::default();
        bulwark_engine::tier::probe(&s, "probe/x").unwrap();
        assert!(s.raw_get("probe/x").is_none());
    }

    /// A lost answer: the write landed, the caller was told otherwise.
    #[test]
    fn a_lost_answer_lands() {
        let s = SimStore::default();
        s.arm(Some(Armed {
            seed: 1,
            odds: 1000,
            modes: vec![StoreFault::LostAnswer],
        }));
        let got = s.put_if("a", b"x".to_vec(), &Cond::Absent);
        assert!(
            matches!(got, Err(Error::Io(_)) | Ok(PutIf::Refused)),
            "{got:?}"
        );
        assert_eq!(s.raw_get("a").as_deref(), Some(&b"x"[..]));
        s.arm(Some(Armed {
            seed: 1,
            odds: 1000,
            modes: vec![StoreFault::Timeout],
        }));
        assert!(s.put("b", b"y".to_vec()).is_err());
        assert!(s.raw_get("b").is_none());
    }
}
