//! Helpers the seeded model tests share: their knobs and their generator.
#![allow(dead_code)]

/// A number from the environment (decimal or 0x hex); a malformed one stops the test.
pub fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|s| {
        let s = s.trim();
        match s.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16),
            None => s.parse(),
        }
        .unwrap_or_else(|_| panic!("{name}={s} is not a number"))
    })
}

/// splitmix64: the tests' generator.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
    pub fn range(&mut self, lo: u64, hi_incl: u64) -> u64 {
        lo + self.below(hi_incl - lo + 1)
    }
}

/// Run `run_seed(seed, ops)` for `$seeds_var` seeds (default `seeds`) from
/// `BULWARK_TEST_SEED` (default: the clock), `$ops_var` operations each (default `ops`),
/// printing each seed so a failure can be replayed.
pub fn run_seeds(seeds_var: &str, seeds: u64, ops_var: &str, ops: u64, run_seed: fn(u64, u64)) {
    let first = env_u64("BULWARK_TEST_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    });
    let seeds = env_u64(seeds_var).unwrap_or(seeds);
    let ops = env_u64(ops_var).unwrap_or(ops);
    for i in 0..seeds {
        let seed = first.wrapping_add(i);
        eprintln!("seed {seed:#x} (BULWARK_TEST_SEED={seed:#x} replays it)");
        run_seed(seed, ops);
    }
}
