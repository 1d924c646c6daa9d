//! Seeded mutation fuzzing for the decoders of on-disk structures (tests only).
//!
//! Bytes from disk are input: every decoder must give `Ok` or a typed error for any
//! bytes, never panic, hang or allocate without bound. Each decoder has a test beside it
//! that feeds it `CASES` inputs made here from valid encodings: bit flips, bytes set to
//! extreme values (0, 0xff, a large length) in place, truncations, extensions, splices of
//! two encodings, and wholly random bytes. `fixup` lets a test re-seal a mutant (a
//! checksum recomputed, a table re-encrypted) so mutations reach the fields behind it.
//! One seed, one world: a failure prints the seed and case; `BULWARK_FUZZ_SEED=N`
//! replays it, `BULWARK_FUZZ_CASES=N` runs longer.

use std::panic::{catch_unwind, AssertUnwindSafe};

/// xorshift64*: small, seeded, good enough to pick mutations.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn env(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.parse().ok()
}

/// One mutant of a random one of `valid`.
pub fn mutate(rng: &mut Rng, valid: &[Vec<u8>]) -> Vec<u8> {
    let mut b = valid[rng.below(valid.len())].clone();
    let rounds = 1 + rng.below(4);
    for _ in 0..rounds {
        match rng.below(7) {
            0 if !b.is_empty() => {
                for _ in 0..1 + rng.below(8) {
                    let i = rng.below(b.len());
                    b[i] ^= 1 << rng.below(8);
                }
            }
            1 if !b.is_empty() => {
                // A field set to an extreme value: 0, all ones, or a large length.
                let n = [1, 2, 4, 8][rng.below(4)].min(b.len());
                let i = rng.below(b.len() - n + 1);
                let v: u64 = [0, u64::MAX, 1 << 31, u32::MAX as u64, 1 << 20][rng.below(5)];
                b[i..i + n].copy_from_slice(&v.to_le_bytes()[..n]);
            }
            2 => b.truncate(rng.below(b.len() + 1)),
            3 => {
                let n = 1 + rng.below(64);
                b.extend(rng.bytes(n));
            }
            4 => {
                let other = &valid[rng.below(valid.len())];
                let at = rng.below(b.len().min(other.len()) + 1);
                b[..at].copy_from_slice(&other[..at]);
            }
            5 => {
                let n = rng.below(b.len().max(16) * 2);
                b = rng.bytes(n);
            }
            _ if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] = rng.next() as u8;
            }
            _ => {}
        }
    }
    b
}

/// A fixup applied to a mutant before it is decoded.
pub type Fixup<'a> = &'a dyn Fn(&mut Vec<u8>);

/// Feeds `decode` `cases` mutants of `valid` (half of them passed through `fixup` first,
/// when given); fails the test with the seed and case on the first panic. `decode` must
/// return normally for every input (its own asserts check what it returned).
pub fn never_panics(
    name: &str,
    valid: &[Vec<u8>],
    cases: usize,
    fixup: Option<Fixup<'_>>,
    decode: &dyn Fn(&[u8]),
) {
    let seed = env("BULWARK_FUZZ_SEED").unwrap_or(0x005e_ed18);
    let cases = env("BULWARK_FUZZ_CASES").map_or(cases, |c| c as usize);
    let mut rng = Rng::new(seed ^ name.len() as u64);
    for v in valid {
        decode(v);
    }
    for case in 0..cases {
        let mut b = mutate(&mut rng, valid);
        if let Some(f) = fixup {
            if rng.below(2) == 0 {
                f(&mut b);
            }
        }
        if catch_unwind(AssertUnwindSafe(|| decode(&b))).is_err() {
            let head: String = b.iter().take(96).map(|x| format!("{x:02x}")).collect();
            panic!(
                "{name}: decoder panicked on case {case} of seed {seed} \
                 (BULWARK_FUZZ_SEED={seed} replays it); {} bytes, first: {head}",
                b.len()
            );
        }
    }
}
