//! What the bucket holds, as bytes: the superblock object (`Head`, MACed under a key from
//! the pool key), the segment table's pages and the deltas that precede them, the parts
//! of segments they name; and reading them back (`load`), every byte checked.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use crate::constants::{DEVICES_MAX, SEGMENT_BYTES, SUPERBLOCK_BYTES};
use crate::hex::{from_hex, to_hex};
use crate::pool::format::superblock::{Check, SbKey, Superblock};
use crate::tier::{Cond, ObjectStore, PutIf, Version};
use crate::{Error, Result};

/// The name of the superblock object.
pub const SUPERBLOCK_OBJECT: &str = "superblock";
/// Segments per page of the segment table (a commit rewrites the pages it touched).
pub const PAGE_SEGMENTS: u32 = 64;
/// The largest superblock object read (16 labels in hex and the page list of a pool of
/// the largest address space fit well below this).
pub(super) const SUPERBLOCK_OBJECT_BYTES_MAX: u64 = 16 << 20;
/// Parts per segment a page may list: past it, a commit uploads the segment's whole range
/// as one part instead (so a page stays small, `PAGE_BYTES_MAX`).
pub(super) const PARTS_PER_SEGMENT_MAX: u32 = 64;
/// The largest page: every segment of it with the most parts.
pub(super) const PAGE_BYTES_MAX: u64 =
    16 + PAGE_SEGMENTS as u64 * (12 + PARTS_PER_SEGMENT_MAX as u64 * 28);
pub(super) const MAGIC: &str = "bulwark object superblock 1";
pub(super) const PAGE_MAGIC: &[u8; 8] = b"BWTPAGE3";
/// Pages written before segments said whether they hold client data (read as metadata:
/// `restore` always downloads them).
pub(super) const PAGE_MAGIC_2: &[u8; 8] = b"BWTPAGE2";
/// A slot's flag in a page: the segment holds client data (a lazy `restore` leaves it in
/// the store; the local cache may give it back).
pub(super) const SLOT_DATA: u32 = 1;
/// A slot's flag in a delta: the segment left the table (freed).
pub(super) const SLOT_GONE: u32 = 2;
pub(super) const DELTA_MAGIC: &[u8; 8] = b"BWTDELT1";
/// The largest table delta a superblock object carries: past it, the commit writes the
/// pages of the segments the delta lists (in the round of its parts), and starts over.
pub(super) const DELTA_BYTES_MAX: usize = 8 << 10;
/// A commit's parts go up together in objects of about this size (one PUT for the
/// many small runs of a flush, several in parallel for a large commit).
pub(super) const BUNDLE_BYTES: usize = 8 << 20;

/// Uploads in flight at once during a commit.
pub(super) const UPLOADS_AT_ONCE: usize = 8;

/// One part: bytes `off..off + len` of a segment, at byte `at` of object `seg/EPOCH/SEQ`
/// (a commit's parts share objects: `BUNDLE_BYTES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub off: u32,
    pub len: u32,
    pub at: u32,
    pub epoch: u64,
    pub seq: u64,
}

impl Part {
    pub fn name(&self) -> String {
        format!("seg/{:08x}/{:012x}", self.epoch, self.seq)
    }
}

/// A segment's parts, later ones over earlier ones.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Slot {
    /// The segment's incarnation the parts are of (`Log::incarnation`; `u64::MAX`: of an
    /// earlier process).
    pub inc: u64,
    pub parts: Vec<Part>,
    /// The segment holds client data (`Log::is_evictable`), not map nodes or the table.
    pub data: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageRef {
    pub index: u32,
    pub name: String,
    pub blake3: String,
}

/// The superblock object's body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Head {
    pub magic: String,
    pub pool_id: String,
    pub epoch: u64,
    pub writer: String,
    pub generation: u64,
    /// The next object sequence number of this epoch.
    pub seq_next: u64,
    /// Drawn at random by each takeover: two hosts that take the pool at once write
    /// different bytes even under one writer name, so only one can read its own back.
    #[serde(default)]
    pub session: String,
    /// Every member's label (`Superblock::encode`), hex.
    pub labels: Vec<String>,
    pub pages: Vec<PageRef>,
    /// The table's changes since the pages were written (`encode_delta`), hex; applied
    /// over the pages when read.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub delta: String,
}

/// The key of the superblock object's MAC, derived from the pool's superblock key.
pub fn object_key(sb_key: &SbKey) -> Zeroizing<[u8; 32]> {
    Zeroizing::new(blake3::derive_key(
        "bulwark 2026-11-26 object store superblock",
        &sb_key[..],
    ))
}

impl Head {
    /// The object's bytes: the body (JSON), a newline, the MAC (hex).
    pub fn seal(&self, key: &[u8; 32]) -> Vec<u8> {
        let mut b = serde_json::to_vec(self).expect("a head serialises");
        let mac = blake3::keyed_hash(key, &b);
        b.push(b'\n');
        b.extend_from_slice(to_hex(mac.as_bytes()).as_bytes());
        b
    }

    /// Read a superblock object: its MAC under `key`, then its fields within bounds.
    pub fn open(bytes: &[u8], key: &[u8; 32]) -> Result<Head> {
        let bad = |why: String| Error::Corrupt(format!("the object store's superblock: {why}"));
        if bytes.len() as u64 > SUPERBLOCK_OBJECT_BYTES_MAX {
            return Err(bad(format!(
                "{} bytes, more than the {SUPERBLOCK_OBJECT_BYTES_MAX} it may hold",
                bytes.len()
            )));
        }
        let nl = bytes
            .iter()
            .rposition(|&b| b == b'\n')
            .ok_or_else(|| bad("no MAC".into()))?;
        let (body, mac) = (&bytes[..nl], &bytes[nl + 1..]);
        let mac = std::str::from_utf8(mac)
            .ok()
            .and_then(from_hex)
            .filter(|m| m.len() == 32)
            .ok_or_else(|| bad("its MAC is not 32 bytes of hex".into()))?;
        let want = blake3::keyed_hash(key, body);
        // blake3::Hash compares in constant time.
        if want != blake3::Hash::from_bytes(mac.try_into().expect("32 bytes")) {
            return Err(bad(
                "its MAC does not verify: the pool key is not this pool's, or the object was \
                 altered"
                    .into(),
            ));
        }
        let head: Head =
            serde_json::from_slice(body).map_err(|e| bad(format!("not readable: {e}")))?;
        if head.magic != MAGIC {
            return Err(bad(format!("unknown format '{}'", head.magic)));
        }
        if head.labels.is_empty() || head.labels.len() > DEVICES_MAX {
            return Err(bad(format!("{} labels", head.labels.len())));
        }
        if head.labels.iter().any(|l| l.len() != 2 * SUPERBLOCK_BYTES) {
            return Err(bad("a label is not one superblock".into()));
        }
        Ok(head)
    }

    /// The members' labels, decoded and verified under the pool key.
    pub fn superblocks(&self, sb_key: &SbKey) -> Result<Vec<Superblock>> {
        self.labels
            .iter()
            .map(|l| {
                let bytes = from_hex(l).ok_or_else(|| {
                    Error::Corrupt("the object store's superblock: a label is not hex".into())
                })?;
                Superblock::decode(&bytes, Check::Key(sb_key))?.ok_or_else(|| {
                    Error::Corrupt("the object store's superblock: an empty label".into())
                })
            })
            .collect()
    }

    pub fn label_bytes(&self) -> Result<Vec<Vec<u8>>> {
        self.labels
            .iter()
            .map(|l| {
                from_hex(l).ok_or_else(|| {
                    Error::Corrupt("the object store's superblock: a label is not hex".into())
                })
            })
            .collect()
    }
}

/// A page of the segment table: the parts of segments `index * PAGE_SEGMENTS ..`.
pub fn encode_page(index: u32, slots: &BTreeMap<u32, Slot>) -> Vec<u8> {
    let lo = index * PAGE_SEGMENTS;
    let hi = lo.saturating_add(PAGE_SEGMENTS);
    let mine: Vec<_> = slots
        .range(lo..hi)
        .filter(|(_, s)| !s.parts.is_empty())
        .collect();
    let mut b = Vec::with_capacity(16 + mine.len() * 40);
    b.extend_from_slice(PAGE_MAGIC);
    b.extend_from_slice(&index.to_le_bytes());
    b.extend_from_slice(&(mine.len() as u32).to_le_bytes());
    for (seg, s) in mine {
        encode_slot(&mut b, *seg, Some(s));
    }
    b
}

/// One segment's entry in a page or a delta: its number, part count, flags, parts. `None`:
/// the segment left the table (deltas only: no parts, `SLOT_GONE`).
fn encode_slot(b: &mut Vec<u8>, seg: u32, slot: Option<&Slot>) {
    let (parts, flags) = match slot {
        Some(s) => (&s.parts[..], if s.data { SLOT_DATA } else { 0 }),
        None => (&[][..], SLOT_GONE),
    };
    b.extend_from_slice(&seg.to_le_bytes());
    b.extend_from_slice(&(parts.len() as u32).to_le_bytes());
    b.extend_from_slice(&flags.to_le_bytes());
    for p in parts {
        b.extend_from_slice(&p.off.to_le_bytes());
        b.extend_from_slice(&p.len.to_le_bytes());
        b.extend_from_slice(&p.at.to_le_bytes());
        b.extend_from_slice(&p.epoch.to_le_bytes());
        b.extend_from_slice(&p.seq.to_le_bytes());
    }
}

/// Read one entry (`encode_slot`; `flagged` false: a `BWTPAGE2` page, no flags). `gone`:
/// whether an entry may say the segment left the table. Bounds checked: bucket input.
fn decode_slot(
    r: &mut Reader<'_>,
    flagged: bool,
    gone: bool,
    bad: &dyn Fn(&str) -> Error,
) -> Result<(u32, Option<Slot>)> {
    let seg = r.u32().ok_or_else(|| bad("short"))?;
    let n = r.u32().ok_or_else(|| bad("short"))?;
    let flags = if flagged {
        r.u32().ok_or_else(|| bad("short"))?
    } else {
        0
    };
    if flags & !(SLOT_DATA | SLOT_GONE) != 0 || (flags & SLOT_GONE != 0 && !gone) {
        return Err(bad("unknown segment flags"));
    }
    if flags & SLOT_GONE != 0 {
        if n != 0 || flags & SLOT_DATA != 0 {
            return Err(bad("a segment that left the table with parts"));
        }
        return Ok((seg, None));
    }
    if n == 0 || n > PARTS_PER_SEGMENT_MAX {
        return Err(bad("a segment with no parts or too many"));
    }
    let mut parts = Vec::new();
    for _ in 0..n {
        let p = Part {
            off: r.u32().ok_or_else(|| bad("short"))?,
            len: r.u32().ok_or_else(|| bad("short"))?,
            at: r.u32().ok_or_else(|| bad("short"))?,
            epoch: r.u64().ok_or_else(|| bad("short"))?,
            seq: r.u64().ok_or_else(|| bad("short"))?,
        };
        if p.len == 0 || p.off as u64 + p.len as u64 > SEGMENT_BYTES {
            return Err(bad("a part outside its segment"));
        }
        if p.at as u64 + p.len as u64 > (BUNDLE_BYTES as u64 + SEGMENT_BYTES) {
            return Err(bad("a part past the end of any object the pool writes"));
        }
        parts.push(p);
    }
    Ok((
        seg,
        Some(Slot {
            inc: u64::MAX,
            parts,
            data: flags & SLOT_DATA != 0,
        }),
    ))
}

/// Read a page back (its bytes verified by the caller against the superblock object's
/// blake3; bounds checked here all the same: bytes from a bucket are input).
pub fn decode_page(b: &[u8], index: u32) -> Result<BTreeMap<u32, Slot>> {
    let bad = |why: &str| Error::Corrupt(format!("segment table page {index}: {why}"));
    let mut r = Reader(b);
    let flagged = match r.take(8).ok_or_else(|| bad("short"))? {
        m if m == PAGE_MAGIC => true,
        m if m == PAGE_MAGIC_2 => false,
        _ => return Err(bad("bad magic")),
    };
    if r.u32().ok_or_else(|| bad("short"))? != index {
        return Err(bad("it is another page"));
    }
    let count = r.u32().ok_or_else(|| bad("short"))?;
    if count > PAGE_SEGMENTS {
        return Err(bad("more segments than a page holds"));
    }
    let lo = index as u64 * PAGE_SEGMENTS as u64;
    let mut slots = BTreeMap::new();
    for _ in 0..count {
        let (seg, slot) = decode_slot(&mut r, flagged, false, &bad)?;
        if !(lo..lo + PAGE_SEGMENTS as u64).contains(&(seg as u64)) {
            return Err(bad("a segment outside the page"));
        }
        let slot = slot.expect("pages list no gone segments");
        if slots.insert(seg, slot).is_some() {
            return Err(bad("a segment listed twice"));
        }
    }
    if !r.0.is_empty() {
        return Err(bad("trailing bytes"));
    }
    Ok(slots)
}

/// The table's changes since its pages were last written, carried in the superblock object
/// itself (`Head::delta`, under its MAC): each listed segment's whole slot, or its leaving
/// the table. A commit then needs no page PUT until the delta passes `DELTA_BYTES_MAX`.
pub fn encode_delta(segs: &BTreeSet<u32>, slots: &BTreeMap<u32, Slot>) -> Vec<u8> {
    let mut b = Vec::with_capacity(12 + segs.len() * 40);
    b.extend_from_slice(DELTA_MAGIC);
    b.extend_from_slice(&(segs.len() as u32).to_le_bytes());
    for &seg in segs {
        encode_slot(&mut b, seg, slots.get(&seg).filter(|s| !s.parts.is_empty()));
    }
    b
}

/// Read a delta back (`encode_delta`): segment → its slot, or `None` (left the table).
pub fn decode_delta(b: &[u8]) -> Result<BTreeMap<u32, Option<Slot>>> {
    let bad = |why: &str| Error::Corrupt(format!("the superblock object's table delta: {why}"));
    let mut r = Reader(b);
    if r.take(8).ok_or_else(|| bad("short"))? != DELTA_MAGIC {
        return Err(bad("bad magic"));
    }
    let count = r.u32().ok_or_else(|| bad("short"))?;
    if count as u64 > DELTA_BYTES_MAX as u64 / 12 + 1 {
        return Err(bad("more segments than a delta holds"));
    }
    let mut out = BTreeMap::new();
    for _ in 0..count {
        let (seg, slot) = decode_slot(&mut r, true, true, &bad)?;
        if out.insert(seg, slot).is_some() {
            return Err(bad("a segment listed twice"));
        }
    }
    if !r.0.is_empty() {
        return Err(bad("trailing bytes"));
    }
    Ok(out)
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    }
}

/// Requests made to the store in this run, for `status`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Requests {
    pub puts: u64,
    pub gets: u64,
    pub deletes: u64,
    pub lists: u64,
    pub bytes_up: u64,
    pub bytes_down: u64,
}

/// The store, counting what is asked of it.
pub(super) struct Counted {
    pub(super) inner: Arc<dyn ObjectStore>,
    pub(super) n: [std::sync::atomic::AtomicU64; 6],
}

impl Counted {
    fn add(&self, i: usize, v: u64) {
        self.n[i].fetch_add(v, std::sync::atomic::Ordering::Relaxed);
    }
    pub(super) fn requests(&self) -> Requests {
        let g = |i: usize| self.n[i].load(std::sync::atomic::Ordering::Relaxed);
        Requests {
            puts: g(0),
            gets: g(1),
            deletes: g(2),
            lists: g(3),
            bytes_up: g(4),
            bytes_down: g(5),
        }
    }
}

impl ObjectStore for Counted {
    fn put(&self, name: &str, body: Vec<u8>) -> Result<()> {
        self.add(0, 1);
        self.add(4, body.len() as u64);
        self.inner.put(name, body)
    }
    fn put_if(&self, name: &str, body: Vec<u8>, cond: &Cond) -> Result<PutIf> {
        self.add(0, 1);
        self.add(4, body.len() as u64);
        self.inner.put_if(name, body, cond)
    }
    fn get(&self, name: &str, max_bytes: u64) -> Result<Option<(Vec<u8>, Version)>> {
        self.add(1, 1);
        let r = self.inner.get(name, max_bytes)?;
        if let Some((b, _)) = &r {
            self.add(5, b.len() as u64);
        }
        Ok(r)
    }
    fn get_range(&self, name: &str, start: u64, len: u64) -> Result<Vec<u8>> {
        self.add(1, 1);
        let b = self.inner.get_range(name, start, len)?;
        self.add(5, b.len() as u64);
        Ok(b)
    }
    fn delete(&self, name: &str) -> Result<()> {
        self.add(2, 1);
        self.inner.delete(name)
    }
    fn list(&self, prefix: &str) -> Result<Vec<crate::tier::Listed>> {
        self.add(3, 1);
        self.inner.list(prefix)
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn request_errors(&self) -> Vec<(&'static str, u64)> {
        self.inner.request_errors()
    }
}

/// What the store holds of a pool: its head, the head's version, and the segment table.
pub struct Found {
    pub head: Head,
    pub version: Version,
    pub slots: BTreeMap<u32, Slot>,
    /// The segments the head's delta lists (their pages are older than their slots).
    pub delta_segs: BTreeSet<u32>,
}

/// Read the pool's superblock object and segment table (`None`: no pool there).
pub fn load(store: &dyn ObjectStore, key: &[u8; 32]) -> Result<Option<Found>> {
    let Some((bytes, version)) = store.get(SUPERBLOCK_OBJECT, SUPERBLOCK_OBJECT_BYTES_MAX)? else {
        return Ok(None);
    };
    let head = Head::open(&bytes, key)?;
    let mut slots = BTreeMap::new();
    for (p, got) in head.pages.iter().zip(get_pages(store, &head.pages)) {
        let Some(b) = got? else {
            return Err(Error::Corrupt(format!(
                "the object store {} lacks segment table page {} ({})",
                store.describe(),
                p.index,
                p.name
            )));
        };
        if to_hex(blake3::hash(&b).as_bytes()) != p.blake3 {
            return Err(Error::Corrupt(format!(
                "segment table page {} ({}) does not match the superblock object's checksum",
                p.index, p.name
            )));
        }
        slots.extend(decode_page(&b, p.index)?);
    }
    let mut delta_segs = BTreeSet::new();
    if !head.delta.is_empty() {
        let raw = from_hex(&head.delta).ok_or_else(|| {
            Error::Corrupt("the superblock object's table delta is not hex".into())
        })?;
        for (seg, slot) in decode_delta(&raw)? {
            delta_segs.insert(seg);
            match slot {
                Some(s) => slots.insert(seg, s),
                None => slots.remove(&seg),
            };
        }
    }
    Ok(Some(Found {
        head,
        version,
        slots,
        delta_segs,
    }))
}

/// The table pages `pages`, in their order (`None`: not in the store), fetched
/// `UPLOADS_AT_ONCE` at a time: a table of many pages is a round trip each, and one
/// after another they made most of an import's time (65 pages of a 4 GiB pool: 2.9 s
/// of a 6.4 s import on loopback, twice).
fn get_pages(store: &dyn ObjectStore, pages: &[PageRef]) -> Vec<Result<Option<Vec<u8>>>> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let workers = pages.len().min(UPLOADS_AT_ONCE);
    type Got = Vec<(usize, Result<Option<Vec<u8>>>)>;
    let next = &next;
    let jobs: Vec<crate::env::Job<'_, Got>> = (0..workers)
        .map(|_| {
            Box::new(move || {
                let mut mine = Vec::new();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(p) = pages.get(i) else {
                        return mine;
                    };
                    let r = store
                        .get(&p.name, PAGE_BYTES_MAX)
                        .map(|o| o.map(|(b, _)| b));
                    let failed = r.is_err();
                    mine.push((i, r));
                    if failed {
                        // The caller stops at the first error; the others need not wait.
                        next.store(pages.len(), std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }) as crate::env::Job<'_, Got>
        })
        .collect();
    let mut got: Got = crate::env::run_jobs(jobs).into_iter().flatten().collect();
    got.sort_by_key(|(i, _)| *i);
    // Pages after a failure may be missing: they end the list (the caller stops at the
    // failure first, since every page before it is there).
    got.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Objects by name; GETs of names in `fail` are I/O errors; GETs counted.
    struct Pages {
        objects: BTreeMap<String, Vec<u8>>,
        fail: Vec<String>,
        gets: std::sync::atomic::AtomicUsize,
    }

    impl ObjectStore for Pages {
        fn put(&self, _: &str, _: Vec<u8>) -> Result<()> {
            unreachable!()
        }
        fn put_if(&self, _: &str, _: Vec<u8>, _: &crate::tier::Cond) -> Result<PutIf> {
            unreachable!()
        }
        fn get(&self, name: &str, _: u64) -> Result<Option<(Vec<u8>, Version)>> {
            self.gets.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if self.fail.iter().any(|f| f == name) {
                return Err(Error::Io(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    format!("GET {name}"),
                )));
            }
            Ok(self
                .objects
                .get(name)
                .map(|b| (b.clone(), Version::default())))
        }
        fn get_range(&self, _: &str, _: u64, _: u64) -> Result<Vec<u8>> {
            unreachable!()
        }
        fn delete(&self, _: &str) -> Result<()> {
            unreachable!()
        }
        fn list(&self, _: &str) -> Result<Vec<crate::tier::Listed>> {
            unreachable!()
        }
        fn describe(&self) -> String {
            "pages".into()
        }
    }

    #[test]
    fn table_pages_come_back_in_order_and_a_failure_is_the_first_error() {
        let refs: Vec<PageRef> = (0..100)
            .map(|i| PageRef {
                index: i,
                name: format!("table/00000001/{i:012x}"),
                blake3: String::new(),
            })
            .collect();
        let mut store = Pages {
            objects: refs
                .iter()
                .filter(|p| p.index != 41)
                .map(|p| (p.name.clone(), p.index.to_le_bytes().to_vec()))
                .collect(),
            fail: Vec::new(),
            gets: Default::default(),
        };
        let got = get_pages(&store, &refs);
        assert_eq!(got.len(), 100);
        for (i, g) in got.iter().enumerate() {
            match g {
                Ok(Some(b)) => assert_eq!(b, &(i as u32).to_le_bytes()),
                Ok(None) => assert_eq!(i, 41, "only page 41 is missing"),
                Err(e) => panic!("page {i}: {e}"),
            }
        }
        // A failed GET: every page before it is there, in order, and it comes next.
        store.fail = vec![refs[57].name.clone(), refs[90].name.clone()];
        let got = get_pages(&store, &refs);
        assert!(got.len() >= 58);
        for (i, g) in got.iter().enumerate().take(57) {
            assert!(g.is_ok(), "page {i} before the failure");
        }
        assert!(matches!(got[57], Err(Error::Io(_))), "{:?}", got[57]);
        assert!(get_pages(&store, &[]).is_empty());
    }

    fn slots() -> BTreeMap<u32, Slot> {
        let mut m = BTreeMap::new();
        m.insert(
            3,
            Slot {
                inc: u64::MAX,
                parts: vec![
                    Part {
                        off: 0,
                        len: 4096,
                        at: 0,
                        epoch: 1,
                        seq: 7,
                    },
                    Part {
                        off: 4096,
                        len: 512,
                        at: 0,
                        epoch: 2,
                        seq: 0,
                    },
                ],
                data: true,
            },
        );
        m.insert(
            PAGE_SEGMENTS - 1,
            Slot {
                inc: u64::MAX,
                parts: vec![Part {
                    off: 16,
                    len: 32,
                    at: 0,
                    epoch: 1,
                    seq: 9,
                }],
                data: false,
            },
        );
        m.insert(
            PAGE_SEGMENTS,
            Slot {
                inc: u64::MAX,
                parts: vec![Part {
                    off: 0,
                    len: 16,
                    at: 0,
                    epoch: 1,
                    seq: 1,
                }],
                data: true,
            },
        );
        m
    }

    #[test]
    fn pages_round_trip_and_hold_only_their_segments() {
        let s = slots();
        let p0 = decode_page(&encode_page(0, &s), 0).unwrap();
        assert_eq!(p0.len(), 2);
        assert_eq!(p0[&3], s[&3]);
        let p1 = decode_page(&encode_page(1, &s), 1).unwrap();
        assert_eq!(p1.keys().copied().collect::<Vec<_>>(), vec![PAGE_SEGMENTS]);
        assert!(
            decode_page(&encode_page(0, &s), 1).is_err(),
            "page index is checked"
        );
    }

    #[test]
    fn deltas_round_trip_with_segments_that_left() {
        let s = slots();
        let segs: BTreeSet<u32> = [3, 7, PAGE_SEGMENTS].into_iter().collect();
        let d = decode_delta(&encode_delta(&segs, &s)).unwrap();
        assert_eq!(d.len(), 3);
        assert_eq!(d[&3].as_ref(), Some(&s[&3]));
        assert_eq!(d[&7], None, "a segment not in the table left it");
        assert_eq!(d[&PAGE_SEGMENTS].as_ref(), Some(&s[&PAGE_SEGMENTS]));
        // A page never says a segment left; a delta of any bytes is an error or bounded.
        let mut page = encode_page(0, &s);
        page[8 + 4 + 4 + 8] = SLOT_GONE as u8;
        assert!(decode_page(&page, 0).is_err());
        let good = encode_delta(&segs, &s);
        for i in 0..good.len() {
            for flip in [1u8, 0x80] {
                let mut b = good.clone();
                b[i] ^= flip;
                if let Ok(d) = decode_delta(&b) {
                    assert!(d.len() <= 3);
                }
            }
            assert!(decode_delta(&good[..i]).is_err(), "a delta cut at {i}");
        }
    }

    #[test]
    fn any_page_bytes_give_an_error_or_a_bounded_table() {
        let good = vec![encode_page(0, &slots())];
        crate::fuzz::never_panics("decode_page", &good, 5000, None, &|b| {
            if let Ok(m) = decode_page(b, 0) {
                assert!(m.len() <= PAGE_SEGMENTS as usize);
                for s in m.values() {
                    for p in &s.parts {
                        assert!(p.off as u64 + p.len as u64 <= SEGMENT_BYTES);
                    }
                }
            }
        });
    }

    #[test]
    fn the_superblock_object_is_refused_when_altered_or_under_another_key() {
        let key = [7u8; 32];
        let head = Head {
            magic: MAGIC.into(),
            pool_id: "00".repeat(16),
            epoch: 3,
            writer: "host-a".into(),
            session: "01".into(),
            generation: 9,
            seq_next: 12,
            labels: vec!["00".repeat(SUPERBLOCK_BYTES)],
            pages: vec![],
            delta: String::new(),
        };
        let b = head.seal(&key);
        assert_eq!(Head::open(&b, &key).unwrap(), head);
        assert!(Head::open(&b, &[8u8; 32])
            .unwrap_err()
            .to_string()
            .contains("MAC"));
        let mut t = b.clone();
        let at = t.iter().position(|&c| c == b'3').unwrap();
        t[at] = b'4';
        assert!(Head::open(&t, &key)
            .unwrap_err()
            .to_string()
            .contains("MAC"));
        let fix = |m: &mut Vec<u8>| {
            // Re-sealed, so that mutations reach the parser behind the MAC.
            if let Some(nl) = m.iter().rposition(|&c| c == b'\n') {
                let mac = to_hex(blake3::keyed_hash(&key, &m[..nl]).as_bytes());
                m.truncate(nl + 1);
                m.extend_from_slice(mac.as_bytes());
            }
        };
        crate::fuzz::never_panics("Head::open", &[b], 5000, Some(&fix), &|m| {
            if let Ok(h) = Head::open(m, &key) {
                assert!(!h.labels.is_empty() && h.labels.len() <= DEVICES_MAX);
            }
        });
    }
}
