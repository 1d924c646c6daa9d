//! Holes: free extents inside sealed client-data segments, which client writes fill when
//! free segments run short instead of waiting for the cleaner (decision 0014).
//!
//! A record's bytes become a hole in three steps, as a whole segment becomes free:
//! released by the in-memory state (`Log::release_bytes` notes it, with its segment's
//! incarnation), collected by the next commit when it begins (`zero_sealed_for_commit`),
//! and added here only once that commit is durable and every read that looked a pointer up
//! before it has finished (`Log::release`, after the reuse gate's drain). So no durable
//! commit, no intent-log chain and no read in flight names a hole's bytes.
//!
//! This table is memory only: it holds what was released since import. A pool just
//! imported has none, and its writes take free segments, and the cleaner, as before.
//! Holes of a segment that becomes free whole are forgotten with it. The table keeps at
//! most `HOLES_TRACKED_MAX` extents; past that a released record's bytes come back only
//! through the cleaner, as before.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Extents the table keeps at most (about 64 bytes of memory each).
pub(super) const HOLES_TRACKED_MAX: usize = 1 << 20;

/// Holes at least this large are counted apart (`large_bytes_usable`, `status`): a client
/// write of 64 KiB fits one whole.
pub(super) const HOLE_LARGE_BYTES: u32 = 64 << 10;

/// How many segments `take` looks at before it gives up on a best fit.
const CANDIDATES_MAX: usize = 64;

/// Free extents per segment (offsets inside the segment, end exclusive), merged when
/// they touch, and the segments ordered by their largest extent.
#[derive(Default)]
pub(super) struct Holes {
    by_seg: HashMap<u32, BTreeMap<u32, u32>>,
    by_size: BTreeSet<(u32, u32)>,
    bytes: u64,
    /// Bytes in holes of at least `HOLE_LARGE_BYTES`.
    large: u64,
    count: usize,
}

/// What `Holes::insert` did with an extent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Added {
    Yes,
    /// It overlaps a hole already known: the same bytes released twice. Nothing added.
    Overlaps,
    /// The table is full: the bytes come back through the cleaner.
    Full,
}

/// The bytes of an extent that count as large (`Holes::large_bytes`).
fn large(start: u32, end: u32) -> u64 {
    if end - start >= HOLE_LARGE_BYTES {
        (end - start) as u64
    } else {
        0
    }
}

fn largest(m: &BTreeMap<u32, u32>) -> u32 {
    m.iter().map(|(s, e)| e - s).max().unwrap_or(0)
}

impl Holes {
    /// Free bytes in holes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Free bytes in holes of at least `HOLE_LARGE_BYTES`.
    #[cfg(test)]
    pub fn large_bytes(&self) -> u64 {
        self.large
    }

    /// Bytes in holes of at least `HOLE_LARGE_BYTES` in segments `usable` accepts, counted
    /// up to `enough` (segments with a large hole only, largest first).
    pub fn large_bytes_usable(&self, usable: impl Fn(u32) -> bool, enough: u64) -> u64 {
        let mut sum = 0;
        for &(_, seg) in self.by_size.range((HOLE_LARGE_BYTES, 0)..).rev() {
            if sum >= enough {
                break;
            }
            if usable(seg) {
                sum += self.by_seg[&seg]
                    .iter()
                    .map(|(&s, &e)| large(s, e))
                    .sum::<u64>();
            }
        }
        sum
    }

    /// Extents kept.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Add `[start, end)` of segment `seg`, merged with the holes it touches.
    pub fn insert(&mut self, seg: u32, start: u32, end: u32) -> Added {
        assert!(start < end, "an empty hole {start}..{end} in segment {seg}");
        if self.count >= HOLES_TRACKED_MAX {
            return Added::Full;
        }
        let m = self.by_seg.entry(seg).or_default();
        let before = m.range(..end).next_back().map(|(&s, &e)| (s, e));
        let after = m.range(end..).next().map(|(&s, &e)| (s, e));
        if before.is_some_and(|(_, e)| e > start) {
            return Added::Overlaps;
        }
        let old = largest(m);
        let (mut s, mut e) = (start, end);
        if let Some((bs, be)) = before.filter(|&(_, be)| be == start) {
            m.remove(&bs);
            s = bs;
            debug_assert_eq!(be, start);
            self.count -= 1;
            self.large -= large(bs, be);
        }
        if let Some((as_, ae)) = after.filter(|&(as_, _)| as_ == end) {
            m.remove(&as_);
            e = ae;
            self.count -= 1;
            self.large -= large(as_, ae);
        }
        m.insert(s, e);
        self.large += large(s, e);
        self.count += 1;
        self.bytes += (end - start) as u64;
        let new = largest(m);
        self.by_size.remove(&(old, seg));
        self.by_size.insert((new, seg));
        Added::Yes
    }

    /// Take a hole for a run of `want` bytes whose first record needs `min`: the smallest
    /// hole of at least `want` in the segment whose largest hole is the smallest that
    /// holds `want`; failing that, likewise for `min` (`fits` answers whether this finds
    /// one). Segments
    /// `usable` refuses are passed over (and kept: a head may be open in one). Returns the
    /// segment and the extent, now out of the table.
    pub fn take(
        &mut self,
        want: u32,
        min: u32,
        usable: impl Fn(u32) -> bool,
    ) -> Option<(u32, u32, u32)> {
        let fit = self
            .by_size
            .range((want, 0)..)
            .map(|&(_, seg)| seg)
            .take(CANDIDATES_MAX)
            .find(|&seg| usable(seg));
        let seg = fit.or_else(|| self.fitting(min).find(|&seg| usable(seg)))?;
        let m = self
            .by_seg
            .get_mut(&seg)
            .expect("a segment ordered by size has holes");
        let need = if fit.is_some() { want } else { min };
        let (s, e) = m
            .iter()
            .filter(|(s, e)| *e - *s >= need)
            .min_by_key(|(s, e)| (*e - *s, **s))
            .map(|(&s, &e)| (s, e))
            .expect("the segment's largest hole holds the run");
        let old = largest(m);
        m.remove(&s);
        self.count -= 1;
        self.bytes -= (e - s) as u64;
        self.large -= large(s, e);
        self.by_size.remove(&(old, seg));
        if m.is_empty() {
            self.by_seg.remove(&seg);
        } else {
            self.by_size.insert((largest(m), seg));
        }
        Some((seg, s, e))
    }

    /// Whether `take` would find a hole for a record of `min` bytes (its fallback: the
    /// largest holes first, in segments `usable` accepts).
    pub fn fits(&self, min: u32, usable: impl Fn(u32) -> bool) -> bool {
        self.fitting(min).any(usable)
    }

    /// The segments `take` looks at for a record of `min` bytes, smallest largest-hole
    /// first (`CANDIDATES_MAX` of them).
    fn fitting(&self, min: u32) -> impl Iterator<Item = u32> + '_ {
        self.by_size
            .range((min, 0)..)
            .map(|&(_, seg)| seg)
            .take(CANDIDATES_MAX)
    }

    /// Segment `seg` became free whole (or its bytes cannot be trusted as holes any more):
    /// forget its holes.
    pub fn forget(&mut self, seg: u32) {
        if let Some(m) = self.by_seg.remove(&seg) {
            self.by_size.remove(&(largest(&m), seg));
            self.count -= m.len();
            self.bytes -= m.iter().map(|(s, e)| (e - s) as u64).sum::<u64>();
            self.large -= m.iter().map(|(&s, &e)| large(s, e)).sum::<u64>();
        }
    }

    /// Whether `[start, end)` of `seg` overlaps a hole (a debug check of the callers).
    pub fn overlaps(&self, seg: u32, start: u32, end: u32) -> bool {
        self.by_seg
            .get(&seg)
            .is_some_and(|m| m.range(..end).next_back().is_some_and(|(_, &e)| e > start))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_neighbours_merge_into_one_hole_a_larger_write_fits() {
        let mut h = Holes::default();
        // Sixteen 4112-byte records a 64 KiB write once laid end to end, released in any
        // order, are one hole a 64 KiB write fits.
        let rec = 4112;
        for i in [3u32, 0, 15, 7, 1, 2, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14] {
            assert_eq!(
                h.insert(9, 4096 + i * rec, 4096 + (i + 1) * rec),
                Added::Yes
            );
        }
        assert_eq!(h.count(), 1);
        assert_eq!(h.bytes(), 16 * rec as u64);
        // Fifteen of them were small holes; merged, they are room the cleaner counts.
        assert_eq!(h.large_bytes(), 16 * rec as u64);
        assert_eq!(
            h.take(16 * rec, rec, |_| true),
            Some((9, 4096, 4096 + 16 * rec))
        );
        assert_eq!((h.bytes(), h.large_bytes()), (0, 0));
        assert_eq!(h.take(rec, rec, |_| true), None);
    }

    #[test]
    fn the_same_bytes_released_twice_are_refused() {
        let mut h = Holes::default();
        assert_eq!(h.insert(1, 100, 200), Added::Yes);
        assert_eq!(h.insert(1, 150, 250), Added::Overlaps);
        assert_eq!(h.insert(1, 50, 101), Added::Overlaps);
        assert_eq!(h.insert(1, 100, 200), Added::Overlaps);
        assert_eq!(h.insert(2, 100, 200), Added::Yes);
        assert_eq!(h.bytes(), 200);
        assert!(h.overlaps(1, 199, 300) && !h.overlaps(1, 200, 300));
    }

    #[test]
    fn a_run_takes_the_best_fit_and_a_record_the_largest_when_none_holds_the_run() {
        let mut h = Holes::default();
        h.insert(1, 0, 10_000);
        h.insert(2, 0, 70_000);
        h.insert(2, 100_000, 300_000);
        h.insert(3, 0, 66_000);
        assert_eq!(h.large_bytes(), 70_000 + 200_000 + 66_000);
        // A 64 KiB run: segment 3's 66,000 is the smallest largest-hole that holds it.
        assert_eq!(h.take(65_792, 4112, |_| true), Some((3, 0, 66_000)));
        // Segment 2's best fit for it is its 70,000, not its 200,000.
        assert_eq!(h.take(65_792, 4112, |_| true), Some((2, 0, 70_000)));
        // A run of 1 MiB fits nowhere: its first record takes the best fit for itself
        // (segment 1's 10,000), and the next the one after.
        assert_eq!(h.take(1 << 20, 4112, |_| true), Some((1, 0, 10_000)));
        assert_eq!(h.take(1 << 20, 4112, |_| true), Some((2, 100_000, 300_000)));
        // Segments the caller cannot use are passed over and kept.
        h.insert(5, 0, 8224);
        assert!(!h.fits(4112, |s| s != 5));
        assert_eq!(h.take(4112, 4112, |s| s != 5), None);
        assert!(h.fits(4112, |_| true));
        assert_eq!(h.take(4112, 4112, |_| true), Some((5, 0, 8224)));
        assert_eq!((h.count(), h.bytes(), h.large_bytes()), (0, 0, 0));
    }

    #[test]
    fn a_segment_freed_whole_forgets_its_holes() {
        let mut h = Holes::default();
        h.insert(4, 0, 4112);
        h.insert(4, 8224, 12336);
        h.insert(5, 0, 4112);
        h.forget(4);
        assert_eq!((h.count(), h.bytes()), (1, 4112));
        assert_eq!(h.take(4112, 4112, |_| true), Some((5, 0, 4112)));
        assert_eq!(h.take(16, 16, |_| true), None);
    }
}
