//! Every bound and fixed size in one place, with compile-time checks.

/// Default bound on the clean map-node cache.
pub const CACHE_BYTES_DEFAULT: u64 = 256 << 20;
