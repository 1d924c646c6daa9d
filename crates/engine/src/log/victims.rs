//! The cleaning policy: which sealed segments to clean next, apart from the worker that
//! moves their records (`pool::clean`).
//!
//! Cost-benefit, as in Sprite LFS (Rosenblum and Ousterhout) and its successors: cleaning a
//! segment whose live fraction is `u` reads the segment and writes `u` of it again, to gain
//! `1 - u`; the gain lasts longer the older (colder) the data, since cold data is unlikely to
//! die soon on its own. So segments are ranked by `(1 - u) * age / (1 + u)`. A young segment
//! that is mostly dead still wins (its `1 - u` is large); an old, nearly full one is cleaned
//! before a young one equally full, which a client is still overwriting and which would empty
//! itself if left alone. Age is counted in bytes the log has taken since the segment was
//! opened, so it needs no clock and does not move while the pool is idle.
//!
//! Invariant: a segment is picked only when cleaning it gains space (`live` at most
//! `LIVE_MAX`), and the picks' live bytes together fit the budget the caller has.

use crate::constants::SEGMENT_BYTES;

/// A segment holding more live bytes than this gains too little to be worth moving.
pub const LIVE_MAX: u32 = (SEGMENT_BYTES - SEGMENT_BYTES / 32) as u32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub seg: u32,
    /// Live bytes (footprint).
    pub live: u32,
    /// Bytes the log has taken since the segment was opened.
    pub age: u64,
}

impl Candidate {
    /// `(1 - u) * age / (1 + u)` with `u = live / SEGMENT_BYTES`, scaled by `SEGMENT_BYTES`.
    fn score(&self) -> f64 {
        let seg = SEGMENT_BYTES as f64;
        let dead = seg - self.live as f64;
        // Age + one segment: segments never written since this process began (age 0 only
        // for a brand-new one) still rank by how dead they are.
        dead * (self.age as f64 + seg) / (seg + self.live as f64)
    }
}

/// The best victims among `candidates`, best first: at most `max`, each worth cleaning,
/// whose live bytes together fit in `budget_bytes` (a candidate that does not fit is passed
/// over for a smaller one that does).
pub fn pick(mut candidates: Vec<Candidate>, max: usize, budget_bytes: u64) -> Vec<u32> {
    candidates.retain(|c| c.live <= LIVE_MAX);
    candidates.sort_by(|a, b| {
        b.score()
            .total_cmp(&a.score())
            .then(a.live.cmp(&b.live))
            .then(a.seg.cmp(&b.seg))
    });
    let mut left = budget_bytes;
    let mut out = Vec::new();
    for c in candidates {
        if out.len() == max {
            break;
        }
        if c.live as u64 <= left {
            left -= c.live as u64;
            out.push(c.seg);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEG: u32 = SEGMENT_BYTES as u32;

    fn c(seg: u32, live: u32, age: u64) -> Candidate {
        Candidate { seg, live, age }
    }

    #[test]
    fn an_emptier_segment_of_the_same_age_goes_first() {
        let v = pick(
            vec![
                c(1, SEG / 2, 100),
                c(2, SEG / 4, 100),
                c(3, SEG / 8 * 7, 100),
            ],
            3,
            u64::MAX,
        );
        assert_eq!(v, [2, 1, 3]);
    }

    #[test]
    fn an_old_segment_beats_a_young_one_a_little_emptier() {
        let young = c(1, SEG / 2, SEGMENT_BYTES);
        let old = c(2, SEG / 2 + SEG / 16, 4 * SEGMENT_BYTES);
        assert_eq!(pick(vec![young, old], 1, u64::MAX), [2]);
        // Greedy would have taken the young one; a much emptier young one still wins.
        let empty_young = c(3, SEG / 32, SEGMENT_BYTES);
        assert_eq!(pick(vec![young, old, empty_young], 1, u64::MAX), [3]);
    }

    #[test]
    fn nearly_full_segments_are_never_picked() {
        assert!(pick(vec![c(1, LIVE_MAX + 1, u64::MAX / 2)], 4, u64::MAX).is_empty());
        assert_eq!(pick(vec![c(1, LIVE_MAX, 1)], 4, u64::MAX), [1]);
    }

    #[test]
    fn picks_fit_the_budget_and_the_count() {
        let all: Vec<Candidate> = (0..10).map(|s| c(s, SEG / 2, 1000)).collect();
        assert_eq!(pick(all.clone(), 3, u64::MAX).len(), 3);
        // Room for two and a half: two.
        let v = pick(all, 10, SEGMENT_BYTES + SEGMENTS_HALF / 2);
        assert_eq!(v.len(), 2);
        // A candidate too big for what is left is passed over for one that fits.
        let v = pick(
            vec![
                c(1, SEG / 2, 100 * SEGMENT_BYTES),
                c(2, SEG / 2, 100 * SEGMENT_BYTES),
                c(3, SEG / 8, 0),
            ],
            10,
            SEGMENT_BYTES / 2 + SEGMENT_BYTES / 8,
        );
        assert_eq!(v, [1, 3]);
    }

    const SEGMENTS_HALF: u64 = SEGMENT_BYTES / 2;
}
