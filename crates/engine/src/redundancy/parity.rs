//! Parity layouts (`parity:K+M`): each record is its own Reed–Solomon stripe.
//!
//! A record of `len` bytes is cut into K data shards of `shard_bytes(len)`
//! (the last one zero-padded), M parity shards are computed, and shard `i`
//! goes to member `(i + segment) % (K+M)` at the same device offset. Like
//! RAID-Z's variable stripe width, a small record uses a small stripe, so a
//! 4 KiB block costs (K+M)/K of its size, not a whole wide stripe; and a
//! stripe is always written whole: no read-modify-write, no write hole.
//!
//! Reads take the K data shards and check the record's checksum. If that
//! fails (or a shard is missing), every shard is read and erasure sets are
//! tried, smallest first, until a reconstruction matches the checksum; only
//! then are the shards that differ from the verified stripe rewritten. If no
//! reconstruction verifies, nothing is written.

use std::sync::atomic::Ordering;

use super::{Redundancy, ScrubOutcome};
use crate::checksum::{verify, Checksum};
use crate::constants::{DEVICE_RESERVED_FRONT, RECORD_ALIGN, SEGMENT_BYTES};
use crate::{Error, Result};

/// Bytes of each shard for a record of `len` bytes (even, as the codec requires; 16-aligned).
pub fn shard_bytes(len: usize, k: usize) -> usize {
    let a = RECORD_ALIGN as usize;
    len.div_ceil(k).div_ceil(a) * a
}

struct Stripe {
    k: usize,
    m: usize,
    sb: usize,
    /// Shard bytes as read; `None` where the device is missing or the read failed.
    shards: Vec<Option<Vec<u8>>>,
}

impl Redundancy {
    fn shard_place(&self, addr: u64, i: usize) -> (usize, u64) {
        let n = self.members.len();
        let seg = addr / SEGMENT_BYTES;
        let off = addr % SEGMENT_BYTES;
        (
            (i + seg as usize) % n,
            DEVICE_RESERVED_FRONT + seg * SEGMENT_BYTES + off,
        )
    }

    fn encode_stripe(k: usize, m: usize, sb: usize, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut shards: Vec<Vec<u8>> = (0..k)
            .map(|i| {
                let mut s = vec![0u8; sb];
                let from = (i * sb).min(data.len());
                let to = ((i + 1) * sb).min(data.len());
                s[..to - from].copy_from_slice(&data[from..to]);
                s
            })
            .collect();
        let parity = reed_solomon_simd::encode(k, m, &shards)
            .map_err(|e| Error::Invalid(format!("erasure coding: {e}")))?;
        shards.extend(parity);
        Ok(shards)
    }

    pub(super) fn parity_write(&self, k: usize, m: usize, addr: u64, data: &[u8]) -> Result<()> {
        let sb = shard_bytes(data.len(), k);
        let shards = Self::encode_stripe(k, m, sb, data)?;
        let mut written = 0;
        let mut last_err = None;
        for (i, shard) in shards.iter().enumerate() {
            let (mi, off) = self.shard_place(addr, i);
            let member = &self.members[mi];
            let Some(dev) = member.writable() else {
                continue;
            };
            match dev.write_at(shard, off) {
                Ok(()) => written += 1,
                Err(e) => {
                    member.fail_write("a write", &e);
                    tracing::error!(device = %member.path().display(), offset = off, "shard write failed: {e}");
                    last_err = Some(Error::device(&member.path(), e));
                }
            }
        }
        if written < k {
            return Err(last_err.unwrap_or_else(|| {
                Error::Io(std::io::Error::other(
                    "fewer devices than data shards are writable",
                ))
            }));
        }
        Ok(())
    }

    fn read_shard(&self, addr: u64, i: usize, sb: usize) -> Option<Vec<u8>> {
        let (mi, off) = self.shard_place(addr, i);
        let member = &self.members[mi];
        let dev = member.dev()?;
        let mut b = vec![0u8; sb];
        match dev.read_at(&mut b, off) {
            Ok(()) => Some(b),
            Err(e) => {
                member.read_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(device = %member.path().display(), offset = off, "shard read failed: {e}");
                None
            }
        }
    }

    /// Data of the stripe treating `erased` shards as unknown; `None` if it cannot be rebuilt.
    fn rebuild(st: &Stripe, erased: &[usize], len: usize) -> Option<Vec<u8>> {
        let usable = |i: usize| !erased.contains(&i) && st.shards[i].is_some();
        let originals: Vec<(usize, &[u8])> = (0..st.k)
            .filter(|&i| usable(i))
            .map(|i| (i, st.shards[i].as_deref().unwrap()))
            .collect();
        let mut restored = std::collections::BTreeMap::new();
        if originals.len() < st.k {
            let recovery: Vec<(usize, &[u8])> = (st.k..st.k + st.m)
                .filter(|&i| usable(i))
                .map(|i| (i - st.k, st.shards[i].as_deref().unwrap()))
                .collect();
            if originals.len() + recovery.len() < st.k {
                return None;
            }
            restored = reed_solomon_simd::decode(
                st.k,
                st.m,
                originals.iter().copied(),
                recovery.iter().copied(),
            )
            .ok()?;
        }
        let mut data = Vec::with_capacity(st.k * st.sb);
        for i in 0..st.k {
            if usable(i) {
                data.extend_from_slice(st.shards[i].as_deref().unwrap());
            } else {
                data.extend_from_slice(restored.get(&i)?);
            }
        }
        data.truncate(len);
        Some(data)
    }

    /// Find data that verifies, trying erasure sets smallest first.
    fn solve(st: &Stripe, len: usize, sum: &Checksum) -> Option<Vec<u8>> {
        let n = st.k + st.m;
        let missing: Vec<usize> = (0..n).filter(|&i| st.shards[i].is_none()).collect();
        if missing.len() > st.m {
            return None;
        }
        let present: Vec<usize> = (0..n).filter(|&i| st.shards[i].is_some()).collect();
        for extra in 0..=(st.m - missing.len()) {
            let mut found = None;
            for_each_combination(&present, extra, &mut |combo| {
                let mut erased = missing.clone();
                erased.extend_from_slice(combo);
                match Self::rebuild(st, &erased, len) {
                    Some(d) if verify(sum, &d) => {
                        found = Some(d);
                        true
                    }
                    _ => false,
                }
            });
            if found.is_some() {
                return found;
            }
        }
        None
    }

    /// Read every shard of the stripe, find the verified data, rewrite what differs.
    fn full_stripe(
        &self,
        k: usize,
        m: usize,
        addr: u64,
        len: usize,
        sum: &Checksum,
    ) -> (Option<Vec<u8>>, ScrubOutcome) {
        let sb = shard_bytes(len, k);
        let st = Stripe {
            k,
            m,
            sb,
            shards: (0..k + m).map(|i| self.read_shard(addr, i, sb)).collect(),
        };
        let Some(good) = Self::solve(&st, len, sum) else {
            let bad = st.shards.iter().filter(|s| s.is_none()).count();
            return (
                None,
                ScrubOutcome {
                    bad_copies: bad,
                    repaired: 0,
                    unrecoverable: true,
                },
            );
        };
        let Ok(want) = Self::encode_stripe(k, m, sb, &good) else {
            return (
                None,
                ScrubOutcome {
                    bad_copies: 0,
                    repaired: 0,
                    unrecoverable: true,
                },
            );
        };
        let (mut bad, mut repaired) = (0, 0);
        for (i, shard) in want.iter().enumerate() {
            if st.shards[i].as_deref() == Some(shard.as_slice()) {
                continue;
            }
            let (mi, off) = self.shard_place(addr, i);
            let member = &self.members[mi];
            let Some(dev) = member.writable() else {
                continue;
            };
            bad += 1;
            if st.shards[i].is_some() {
                member.count_cksum();
            }
            match dev.write_at(shard, off) {
                Ok(()) => {
                    repaired += 1;
                    self.repaired_blocks.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    member.write_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(device = %member.path().display(), "shard repair failed: {e}");
                }
            }
        }
        (
            Some(good),
            ScrubOutcome {
                bad_copies: bad,
                repaired,
                unrecoverable: false,
            },
        )
    }

    pub(super) fn parity_read(
        &self,
        k: usize,
        m: usize,
        addrs: &[u64],
        len: usize,
        sum: &Checksum,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        for &addr in addrs {
            // Fast path: the K data shards.
            let sb = shard_bytes(len, k);
            out.clear();
            let mut ok = true;
            for i in 0..k {
                match self.read_shard(addr, i, sb) {
                    Some(s) => out.extend_from_slice(&s),
                    None => {
                        ok = false;
                        break;
                    }
                }
            }
            if ok {
                out.truncate(len);
                if verify(sum, out) {
                    return Ok(());
                }
            }
            if let (Some(good), _) = self.full_stripe(k, m, addr, len, sum) {
                *out = good;
                return Ok(());
            }
        }
        self.unrecoverable_blocks.fetch_add(1, Ordering::Relaxed);
        Err(Error::Unrecoverable(format!(
            "no reconstruction of the {len}-byte record at pool address {} verified",
            addrs[0]
        )))
    }

    pub(super) fn parity_scrub(
        &self,
        k: usize,
        m: usize,
        addrs: &[u64],
        len: usize,
        sum: &Checksum,
    ) -> ScrubOutcome {
        let mut total = ScrubOutcome {
            bad_copies: 0,
            repaired: 0,
            unrecoverable: true,
        };
        for &addr in addrs {
            let (good, o) = self.full_stripe(k, m, addr, len, sum);
            total.bad_copies += o.bad_copies;
            total.repaired += o.repaired;
            total.unrecoverable &= good.is_none();
        }
        if total.unrecoverable {
            self.unrecoverable_blocks.fetch_add(1, Ordering::Relaxed);
        }
        total
    }
}

/// Call `f` with every `r`-subset of `items` until it returns true.
fn for_each_combination(items: &[usize], r: usize, f: &mut dyn FnMut(&[usize]) -> bool) {
    fn go(
        items: &[usize],
        r: usize,
        start: usize,
        cur: &mut Vec<usize>,
        f: &mut dyn FnMut(&[usize]) -> bool,
    ) -> bool {
        if cur.len() == r {
            return f(cur);
        }
        for i in start..items.len() {
            cur.push(items[i]);
            if go(items, r, i + 1, cur, f) {
                return true;
            }
            cur.pop();
        }
        false
    }
    go(items, r, 0, &mut Vec::with_capacity(r), f);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn combinations() {
        let mut seen = Vec::new();
        for_each_combination(&[1, 2, 3, 4], 2, &mut |c| {
            seen.push(c.to_vec());
            false
        });
        assert_eq!(seen.len(), 6);
        let mut none = 0;
        for_each_combination(&[1, 2], 0, &mut |c| {
            assert!(c.is_empty());
            none += 1;
            false
        });
        assert_eq!(none, 1);
    }

    #[test]
    fn stripe_rebuilds_from_any_k_and_finds_a_corrupt_shard() {
        let (k, m) = (4, 2);
        let data: Vec<u8> = (0..4112u32).map(|i| (i * 7 % 256) as u8).collect();
        let sum = crate::checksum::checksum(&data);
        let sb = shard_bytes(data.len(), k);
        let shards = Redundancy::encode_stripe(k, m, sb, &data).unwrap();
        let mut st = Stripe {
            k,
            m,
            sb,
            shards: shards.into_iter().map(Some).collect(),
        };
        st.shards[1] = None;
        st.shards[4] = None;
        assert_eq!(Redundancy::solve(&st, data.len(), &sum).unwrap(), data);
        st.shards[1] = Some(vec![0xAA; sb]); // silently corrupt, one shard still missing
        assert_eq!(Redundancy::solve(&st, data.len(), &sum).unwrap(), data);
        st.shards[0] = Some(vec![0xBB; sb]); // beyond tolerance: never wrong bytes
        st.shards[4] = Some(vec![0xCC; sb]);
        assert!(Redundancy::solve(&st, data.len(), &sum).is_none());
    }
}
