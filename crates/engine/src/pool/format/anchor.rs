//! The freshness anchor (decision 0011, "Freshness"): `pool.anchor`, on the host in the
//! pool's trust root directory (`DIR`, or the `key_dir` `pool.json` names), names the
//! generation this host last committed and the one it is about to write, each with a
//! digest of its superblock. Import takes the devices only at one of
//! those two: devices restored from an older copy (a rollback of the whole pool, which
//! every superblock checksum accepts) are refused, naming both generations, unless the
//! administrator accepts the rollback (`serve --accept-rollback`).
//!
//! Two 512-byte slots, written alternately (the newer valid sequence wins), each synced
//! before the superblock it announces is written, so a crash between the two leaves the
//! devices at the anchor's committed generation or at its next one:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `BWANCHR1` |
//! | 8 | 8 | sequence |
//! | 16 | 16 | pool id |
//! | 32 | 8 | committed generation |
//! | 40 | 32 | its superblock digest (`digest`) |
//! | 72 | 8 | next generation, or 0 |
//! | 80 | 32 | its superblock digest |
//! | 112 | 8 | nonces reserved: the highest `nonce_reserved` of any superblock announced |
//! | 120 | 360 | zero |
//! | 480 | 32 | blake3 of bytes 0..480 |
//!
//! The anchor also keeps the highest nonce reservation the host ever announced: import
//! starts above it even when the devices' superblock says less (a rollback accepted with
//! `--accept-rollback`, an edited counter), so no nonce is handed out twice under a key.
//!
//! The slot checksum is unkeyed: the anchor detects what is done to the devices, not an
//! edit of the anchor itself, which lives on the host beside the pool key (trusted,
//! docs/security.md).

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::superblock::Superblock;
use crate::checksum::checksum;
use crate::{Error, Result};

const MAGIC: &[u8; 8] = b"BWANCHR1";
const SLOT_BYTES: usize = 512;
const SUM_AT: usize = 480;
pub const FILE_NAME: &str = "pool.anchor";

/// A generation and the digest of its superblock.
pub type Point = (u64, [u8; 32]);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Anchor {
    pub seq: u64,
    pub pool_id: [u8; 16],
    pub committed: Point,
    /// The generation being written, or `(0, _)` when none is.
    pub next: Point,
    /// The highest `nonce_reserved` of any superblock this host announced.
    pub nonce_reserved: u64,
}

/// The digest of a superblock's pool-wide content: the same on every member (each member's
/// own index and id are left out).
pub fn digest(sb: &Superblock) -> [u8; 32] {
    let common = Superblock {
        member_index: 0,
        device_id: [0; 16],
        ..sb.clone()
    };
    // Format 1 hashed the whole slot (its checksum included); format 2 the fields, since
    // its MAC needs the key and adds nothing the fields do not say.
    if sb.format == super::superblock::VERSION_1 {
        checksum(&common.encode(None))
    } else {
        checksum(&common.encode_body())
    }
}

/// The anchor file of the pool in `dir`: in its trust root's directory (`pool create
/// --key-dir`, recorded in pool.json), else in `dir`.
pub fn path(dir: &Path) -> PathBuf {
    super::config::trust_root_dir(dir).join(FILE_NAME)
}

impl Anchor {
    fn encode(&self) -> [u8; SLOT_BYTES] {
        let mut b = [0u8; SLOT_BYTES];
        b[0..8].copy_from_slice(MAGIC);
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..32].copy_from_slice(&self.pool_id);
        b[32..40].copy_from_slice(&self.committed.0.to_le_bytes());
        b[40..72].copy_from_slice(&self.committed.1);
        b[72..80].copy_from_slice(&self.next.0.to_le_bytes());
        b[80..112].copy_from_slice(&self.next.1);
        b[112..120].copy_from_slice(&self.nonce_reserved.to_le_bytes());
        let sum = checksum(&b[..SUM_AT]);
        b[SUM_AT..].copy_from_slice(&sum);
        b
    }

    /// One slot, or `None` when it is not a valid anchor slot (never written, torn).
    fn decode(b: &[u8]) -> Option<Anchor> {
        if b.len() != SLOT_BYTES || &b[0..8] != MAGIC || checksum(&b[..SUM_AT])[..] != b[SUM_AT..] {
            return None;
        }
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
        let arr32 = |at: usize| -> [u8; 32] { b[at..at + 32].try_into().unwrap() };
        Some(Anchor {
            seq: u64_at(8),
            pool_id: b[16..32].try_into().unwrap(),
            committed: (u64_at(32), arr32(40)),
            next: (u64_at(72), arr32(80)),
            nonce_reserved: u64_at(112),
        })
    }

    /// Whether the devices' newest superblock (generation and digest) is one this anchor
    /// allows: the committed one, or the one being written when the host stopped.
    pub fn allows(&self, at: &Point) -> bool {
        *at == self.committed || (self.next.0 != 0 && *at == self.next)
    }
}

/// The newest valid anchor in `dir`, or `None` when there is no anchor file. A file that
/// exists with no valid slot is an error: an anchor is never written torn in both slots.
pub fn read(dir: &Path) -> Result<Option<Anchor>> {
    let p = path(dir);
    // Two slots are all an anchor holds: whatever the file's size, no more is read.
    let bytes = match std::fs::File::open(&p) {
        Ok(f) => {
            use std::io::Read;
            let mut b = Vec::with_capacity(2 * SLOT_BYTES);
            f.take(2 * SLOT_BYTES as u64)
                .read_to_end(&mut b)
                .map_err(|e| Error::device(&p, e))?;
            b
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::device(&p, e)),
    };
    let best = bytes
        .chunks(SLOT_BYTES)
        .take(2)
        .filter_map(Anchor::decode)
        .max_by_key(|a| a.seq);
    match best {
        Some(a) => Ok(Some(a)),
        None => Err(Error::Corrupt(format!(
            "{} holds no valid anchor slot; it records which generation of the devices this \
             host last committed. Restore it from a backup, or move it away to trust the \
             devices as they are",
            p.display()
        ))),
    }
}

/// Write `a` to the slot its sequence picks and sync it (the file is made 0600).
pub fn write(dir: &Path, a: &Anchor) -> Result<()> {
    write_to(dir, a, false)
}

/// The first anchor of a new pool: whatever anchor file was left in `dir` (of a pool
/// whose devices and pool.json are gone) is replaced, not merged slot by slot.
pub fn write_first(dir: &Path, a: &Anchor) -> Result<()> {
    write_to(dir, a, true)
}

/// `write_first` into the trust root's directory `root` itself (`pool create`, before
/// pool.json names it).
pub fn write_first_in(root: &Path, a: &Anchor) -> Result<()> {
    write_file(&root.join(FILE_NAME), a, true)
}

fn write_to(dir: &Path, a: &Anchor, fresh: bool) -> Result<()> {
    write_file(&path(dir), a, fresh)
}

fn write_file(p: &Path, a: &Anchor, fresh: bool) -> Result<()> {
    let p = p.to_path_buf();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(fresh)
        .mode(0o600)
        .open(&p)
        .map_err(|e| Error::device(&p, e))?;
    let slot = (a.seq % 2) * SLOT_BYTES as u64;
    file.write_all_at(&a.encode(), slot)
        .and_then(|()| file.sync_data())
        .map_err(|e| Error::device(&p, e))
}

/// How far the intent log of one chain reached: `blocks` is what
/// `intentlog::block::Chain::seq` (or, on a log device, `intentlog::devices::DevChain::seq`)
/// was after the last flush the host recorded.
/// Written lazily (`ReachWriter`), after the flush returned and off its path, to a slot of
/// its own at `REACH_AT` in the anchor file (the commit's two slots are never touched by
/// it): a log found shorter at import lost acknowledged flushes. Flushes acknowledged
/// after the last record written are not covered (the window: one anchor write, about a
/// millisecond on an SSD, more while flushes come faster than it).
///
/// | offset | size | field |
/// | --- | --- | --- |
/// | 0 | 8 | magic `BWLOGRCH` |
/// | 8 | 16 | pool id |
/// | 24 | 8 | generation whose chain it is |
/// | 32 | 16 | the chain id (`Superblock::chain_id`) |
/// | 48 | 8 | blocks (sequence numbers) the chain reached |
/// | 56 | 424 | zero |
/// | 480 | 32 | blake3 of bytes 0..480 |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reach {
    pub pool_id: [u8; 16],
    pub generation: u64,
    pub chain: [u8; 16],
    pub blocks: u64,
}

const REACH_MAGIC: &[u8; 8] = b"BWLOGRCH";
/// Where the reach slot lies in the anchor file, after the commit's two slots.
const REACH_AT: u64 = 2 * SLOT_BYTES as u64;

impl Reach {
    fn encode(&self) -> [u8; SLOT_BYTES] {
        let mut b = [0u8; SLOT_BYTES];
        b[0..8].copy_from_slice(REACH_MAGIC);
        b[8..24].copy_from_slice(&self.pool_id);
        b[24..32].copy_from_slice(&self.generation.to_le_bytes());
        b[32..48].copy_from_slice(&self.chain);
        b[48..56].copy_from_slice(&self.blocks.to_le_bytes());
        let sum = checksum(&b[..SUM_AT]);
        b[SUM_AT..].copy_from_slice(&sum);
        b
    }

    fn decode(b: &[u8]) -> Option<Reach> {
        if b.len() != SLOT_BYTES
            || &b[0..8] != REACH_MAGIC
            || checksum(&b[..SUM_AT])[..] != b[SUM_AT..]
        {
            return None;
        }
        Some(Reach {
            pool_id: b[8..24].try_into().unwrap(),
            generation: u64::from_le_bytes(b[24..32].try_into().unwrap()),
            chain: b[32..48].try_into().unwrap(),
            blocks: u64::from_le_bytes(b[48..56].try_into().unwrap()),
        })
    }
}

/// The reach record in `dir`'s anchor file, if one is there and whole.
pub fn read_reach(dir: &Path) -> Option<Reach> {
    let f = std::fs::File::open(path(dir)).ok()?;
    let mut b = [0u8; SLOT_BYTES];
    f.read_exact_at(&mut b, REACH_AT).ok()?;
    Reach::decode(&b)
}

/// Write the reach record and sync it.
pub fn write_reach(dir: &Path, r: &Reach) -> Result<()> {
    let p = path(dir);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&p)
        .map_err(|e| Error::device(&p, e))?;
    file.write_all_at(&r.encode(), REACH_AT)
        .and_then(|()| file.sync_data())
        .map_err(|e| Error::device(&p, e))
}

#[derive(Default)]
struct ReachState {
    want: Option<Reach>,
    stop: bool,
}

/// The thread that writes the reach record after flushes, the newest one each time it
/// gets to it (many flushes, one write). Stopped and joined when dropped.
pub(crate) struct ReachWriter {
    shared: std::sync::Arc<(parking_lot::Mutex<ReachState>, parking_lot::Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ReachWriter {
    pub(crate) fn start(dir: PathBuf) -> ReachWriter {
        let shared: std::sync::Arc<(parking_lot::Mutex<ReachState>, parking_lot::Condvar)> =
            Default::default();
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("bulwark-log-reach".into())
            .spawn(move || {
                let mut warned = false;
                loop {
                    let r = {
                        let mut st = s.0.lock();
                        while st.want.is_none() && !st.stop {
                            s.1.wait(&mut st);
                        }
                        if st.stop {
                            return;
                        }
                        st.want.take().expect("woken with a record to write")
                    };
                    if let Err(e) = write_reach(&dir, &r) {
                        if !std::mem::replace(&mut warned, true) {
                            tracing::warn!(
                                "cannot record how far the intent log reached ({e}): a log \
                                 cut short on the devices is then seen only by its later blocks"
                            );
                        }
                    }
                }
            })
            .ok();
        ReachWriter { shared, thread }
    }

    /// Record `r` soon (never waits for the write).
    pub(crate) fn note(&self, r: Reach) {
        self.shared.0.lock().want = Some(r);
        self.shared.1.notify_one();
    }
}

impl Drop for ReachWriter {
    fn drop(&mut self) {
        self.shared.0.lock().stop = true;
        self.shared.1.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn anchor(seq: u64) -> Anchor {
        Anchor {
            seq,
            pool_id: [1; 16],
            committed: (seq, [2; 32]),
            next: (seq + 1, [3; 32]),
            nonce_reserved: seq * 1000,
        }
    }

    #[test]
    fn the_newer_slot_wins_and_a_torn_one_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read(dir.path()).unwrap(), None);
        write(dir.path(), &anchor(1)).unwrap();
        write(dir.path(), &anchor(2)).unwrap();
        assert_eq!(read(dir.path()).unwrap(), Some(anchor(2)));
        // Tear slot 0 (sequence 2): slot 1 still holds sequence 1.
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(path(dir.path()))
            .unwrap();
        f.write_all_at(&[0xff; 16], 40).unwrap();
        assert_eq!(read(dir.path()).unwrap(), Some(anchor(1)));
        // Both torn: an error that says what the file is for.
        f.write_all_at(&[0xff; 16], SLOT_BYTES as u64 + 40).unwrap();
        let e = read(dir.path()).unwrap_err().to_string();
        assert!(e.contains("no valid anchor slot"), "{e}");
    }

    #[test]
    fn arbitrary_bytes_never_decode_as_an_anchor_by_accident() {
        let valid = anchor(7).encode().to_vec();
        crate::fuzz::never_panics("anchor", &[valid], 2000, None, &|b| {
            if let Some(a) = Anchor::decode(b) {
                assert_eq!(a, anchor(7), "a mutated slot decoded to something else");
            }
        });
    }

    /// A huge file in the anchor's place is read only as far as its two slots.
    #[test]
    fn a_huge_anchor_file_is_read_no_further_than_two_slots() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &anchor(3)).unwrap();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(path(dir.path()))
            .unwrap();
        f.set_len(64 << 30).unwrap();
        assert_eq!(read(dir.path()).unwrap(), Some(anchor(3)));
    }

    #[test]
    fn a_new_pool_replaces_a_stale_anchor() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &anchor(8)).unwrap();
        write(dir.path(), &anchor(9)).unwrap();
        let first = Anchor {
            pool_id: [5; 16],
            ..anchor(1)
        };
        write_first(dir.path(), &first).unwrap();
        assert_eq!(read(dir.path()).unwrap(), Some(first));
    }

    #[test]
    fn only_the_committed_or_the_next_generation_is_allowed() {
        let a = anchor(5);
        assert!(a.allows(&(5, [2; 32])));
        assert!(a.allows(&(6, [3; 32])));
        assert!(!a.allows(&(4, [2; 32])), "older");
        assert!(
            !a.allows(&(6, [2; 32])),
            "the right generation with another digest"
        );
        assert!(
            !a.allows(&(7, [3; 32])),
            "a generation this host never wrote"
        );
        let none_next = Anchor {
            next: (0, [0; 32]),
            ..a
        };
        assert!(!none_next.allows(&(0, [0; 32])));
    }
}
