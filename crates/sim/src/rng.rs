//! The simulator's one source of choices: splitmix64, seeded from the run's seed. Every
//! decision of a run (which operations a seed turns on, each operation and its arguments,
//! where a crash falls and what it keeps) is drawn from it, in order, so a seed is a run.

pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x5EED_B01D_5EED_B01D)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }
    pub fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
    /// A number in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

/// The trace: every operation, its arguments and what the engine answered, folded into
/// one 64-bit FNV-1a hash. Two runs of one seed print the same hash, or they differed.
#[derive(Clone, Copy)]
pub struct Trace(pub u64, pub bool);

impl Default for Trace {
    fn default() -> Self {
        Trace(0xcbf2_9ce4_8422_2325, false)
    }
}

impl Trace {
    pub fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.0 ^= x as u64;
            self.0 = self.0.wrapping_mul(0x100_0000_01b3);
        }
    }
    pub fn num(&mut self, n: u64) {
        self.bytes(&n.to_le_bytes());
    }
    /// Text (an operation and its arguments, an answer); printed with `--log`.
    pub fn text(&mut self, s: &str) {
        if self.1 {
            eprintln!("  {s}");
        }
        self.bytes(s.as_bytes());
        self.bytes(&[0]);
    }
}
