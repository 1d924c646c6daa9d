//! Exponential back-off for clients that keep failing.
//!
//! Failures (a failed TLS handshake, plaintext options on a TLS listener,
//! an export that was not opened) are counted per key: the client's IP
//! address and, once TLS has named it, its identity. The first
//! `RATE_FREE_FAILURES` cost nothing; each one after doubles the delay,
//! from `RATE_DELAY_BASE` up to `RATE_DELAY_MAX`. The delay is served
//! before the server answers: before the greeting of a new TCP connection
//! (per address), and before the reply to an open that failed (per address
//! and identity). A key with no failure for `RATE_FORGET` starts afresh.
//!
//! Waits are reserved, not just computed: concurrent attempts from one key
//! queue behind each other (each waits its back-off after the previous
//! one's), so opening many connections at once buys no more attempts per
//! second than one at a time. An attempt that would queue longer than
//! `RATE_QUEUE_MAX` is turned away at once, which bounds what a flood of
//! connections from one address can hold.
//!
//! A legitimate client behind the same address is slowed; it is refused
//! only while that address floods. The count forgets. The table is bounded
//! (`RATE_KEYS_MAX`); when full, forgotten and then oldest entries go.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::limits::{
    RATE_DELAY_BASE, RATE_DELAY_MAX, RATE_FORGET, RATE_FREE_FAILURES, RATE_KEYS_MAX, RATE_QUEUE_MAX,
};

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Key {
    Addr(IpAddr),
    Identity(String),
}

struct Entry {
    failures: u32,
    last: Instant,
    /// The last reserved attempt waits until here.
    next: Instant,
}

#[derive(Default)]
pub(crate) struct Limiter {
    entries: Mutex<HashMap<Key, Entry>>,
}

/// Delay owed after `failures` failures.
pub(crate) fn backoff(failures: u32) -> Duration {
    let Some(over) = failures.checked_sub(RATE_FREE_FAILURES) else {
        return Duration::ZERO;
    };
    if over == 0 {
        return Duration::ZERO;
    }
    let doublings = (over - 1).min(20);
    RATE_DELAY_BASE
        .saturating_mul(1u32 << doublings)
        .min(RATE_DELAY_MAX)
}

impl Limiter {
    fn lock(&self) -> MutexGuard<'_, HashMap<Key, Entry>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Delay owed by the worst of `keys` now, ignoring the queue.
    #[cfg(test)]
    pub(crate) fn delay(&self, keys: &[Key]) -> Duration {
        let now = Instant::now();
        let entries = self.lock();
        keys.iter()
            .filter_map(|k| entries.get(k))
            .filter(|e| now.duration_since(e.last) < RATE_FORGET)
            .map(|e| backoff(e.failures))
            .max()
            .unwrap_or(Duration::ZERO)
    }

    /// Reserves this attempt's turn: how long to wait before answering it
    /// (its back-off, after the attempts of the same keys already waiting),
    /// or `None` if that would exceed `RATE_QUEUE_MAX`.
    pub(crate) fn reserve(&self, keys: &[Key]) -> Option<Duration> {
        let now = Instant::now();
        let mut entries = self.lock();
        let mut wait = Duration::ZERO;
        for e in keys.iter().filter_map(|k| entries.get(k)) {
            if now.duration_since(e.last) >= RATE_FORGET {
                continue;
            }
            let b = backoff(e.failures);
            if !b.is_zero() {
                wait = wait.max(e.next.saturating_duration_since(now) + b);
            }
        }
        if wait > RATE_QUEUE_MAX {
            return None;
        }
        if !wait.is_zero() {
            for k in keys {
                if let Some(e) = entries.get_mut(k) {
                    e.next = e.next.max(now + wait);
                }
            }
        }
        Some(wait)
    }

    /// Counts one failure against each of `keys`.
    pub(crate) fn fail(&self, keys: &[Key]) {
        let now = Instant::now();
        let mut entries = self.lock();
        for key in keys {
            if !entries.contains_key(key) && entries.len() >= RATE_KEYS_MAX {
                entries.retain(|_, e| now.duration_since(e.last) < RATE_FORGET);
                if entries.len() >= RATE_KEYS_MAX {
                    if let Some(oldest) = entries
                        .iter()
                        .min_by_key(|(_, e)| e.last)
                        .map(|(k, _)| k.clone())
                    {
                        entries.remove(&oldest);
                    }
                }
            }
            let e = entries.entry(key.clone()).or_insert(Entry {
                failures: 0,
                last: now,
                next: now,
            });
            if now.duration_since(e.last) >= RATE_FORGET {
                e.failures = 0;
            }
            e.failures = e.failures.saturating_add(1);
            e.last = now;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_then_caps() {
        for f in 0..=RATE_FREE_FAILURES {
            assert_eq!(backoff(f), Duration::ZERO);
        }
        assert_eq!(backoff(RATE_FREE_FAILURES + 1), RATE_DELAY_BASE);
        assert_eq!(backoff(RATE_FREE_FAILURES + 2), RATE_DELAY_BASE * 2);
        assert_eq!(backoff(RATE_FREE_FAILURES + 3), RATE_DELAY_BASE * 4);
        assert_eq!(backoff(u32::MAX), RATE_DELAY_MAX);
    }

    #[test]
    fn per_key_counts() {
        let l = Limiter::default();
        let a = Key::Addr("127.0.0.1".parse().unwrap());
        let id = Key::Identity("cn:x".into());
        for _ in 0..RATE_FREE_FAILURES + 2 {
            l.fail(std::slice::from_ref(&a));
        }
        assert_eq!(l.delay(std::slice::from_ref(&a)), RATE_DELAY_BASE * 2);
        assert_eq!(l.delay(std::slice::from_ref(&id)), Duration::ZERO);
        assert_eq!(l.delay(&[id, a]), RATE_DELAY_BASE * 2);
    }

    #[test]
    fn concurrent_attempts_queue_and_overflow_is_refused() {
        let l = Limiter::default();
        let a = [Key::Addr("10.0.0.1".parse().unwrap())];
        assert_eq!(l.reserve(&a), Some(Duration::ZERO));
        for _ in 0..RATE_FREE_FAILURES + 1 {
            l.fail(&a);
        }
        // Attempts at once: each waits behind the previous one. (The second
        // waits for what is left of the first's turn: however long this
        // thread was descheduled between the two, they end together.)
        let first_at = std::time::Instant::now();
        assert_eq!(l.reserve(&a), Some(RATE_DELAY_BASE));
        let second = l.reserve(&a).unwrap();
        assert!(
            second + first_at.elapsed() >= RATE_DELAY_BASE * 2 && second <= RATE_DELAY_BASE * 2,
            "{second:?}"
        );
        // Past `RATE_QUEUE_MAX` of queue, an attempt is refused.
        assert!((0..1_000_000).any(|_| l.reserve(&a).is_none()));
        // Another key is not affected.
        assert_eq!(
            l.reserve(&[Key::Identity("x".into())]),
            Some(Duration::ZERO)
        );
    }

    #[test]
    fn table_is_bounded() {
        let l = Limiter::default();
        for i in 0..RATE_KEYS_MAX + 10 {
            l.fail(&[Key::Identity(i.to_string())]);
        }
        assert!(l.lock().len() <= RATE_KEYS_MAX);
    }
}
