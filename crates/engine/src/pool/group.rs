//! Group commit: which commit covers a FLUSH.
//!
//! A FLUSH must return only once everything acknowledged before it is durable. Commits
//! (and intent-log flushes, which count as commits here) run one at a time under the
//! commit lock, and each is counted when it begins (before it takes its snapshot of the
//! map) and when it is done. A flush notes how many had begun when it arrived
//! (`arrive`): one that began after that and is done took its snapshot after every write
//! the flush covers, so it covers the flush too (`covered`), unless a commit begun after
//! the arrival failed without poisoning the pool (the object store did not take it:
//! `failed`), or an intent-log flush that made nothing durable (`log_flush`), when it may
//! not have, and the flush commits itself. A flush waits for the
//! commit lock (`lock_or_covered`), looking for such a commit as it waits; while it
//! waits it is counted (`waiting`), so a cleaning pass that holds the lock commits for it
//! between two batches.
//!
//! This file takes its atomics and the commit lock's type from `crate::sync`, so
//! `crates/modelcheck` checks it under shuttle with threads playing flushes, the
//! background commit and the cleaner.

use std::time::Duration;

use crate::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use crate::sync::{Mutex, MutexGuard};
use crate::Result;

/// How often a flush waiting for the commit lock looks whether a commit (one a cleaning
/// pass made for it, say) has answered it.
const FLUSH_LOOK_EVERY: Duration = Duration::from_millis(2);

#[derive(Default)]
pub struct GroupCommit {
    /// Commits begun and finished: a flush that arrives while a commit runs waits for the
    /// next one; one that finds a newer commit finished returns.
    begun: AtomicU64,
    done: AtomicU64,
    /// `begun` of the last commit that failed without poisoning the pool: a flush that
    /// arrived before it must commit itself.
    failed_at: AtomicU64,
    /// Flushes waiting for the commit lock (`lock_or_covered`).
    waiters: AtomicUsize,
}

impl GroupCommit {
    pub fn new() -> GroupCommit {
        GroupCommit::default()
    }

    /// A flush arrives: what it passes to `covered` and `lock_or_covered`.
    pub fn arrive(&self) -> u64 {
        self.begun.load(Ordering::Acquire)
    }

    /// A commit begun after a flush arrived at `arrived` is done, and none begun after it
    /// failed.
    pub fn covered(&self, arrived: u64) -> bool {
        self.done.load(Ordering::Acquire) > arrived
            && self.failed_at.load(Ordering::Acquire) <= arrived
    }

    /// Wait for `lock` (the commit lock) for a flush that arrived at `arrived`: `None` once
    /// a commit covers it (looked for every `FLUSH_LOOK_EVERY` while waiting, and again
    /// once the lock is taken), else the lock, held, for the flush's own commit.
    pub fn lock_or_covered<'a>(
        &self,
        lock: &'a Mutex<()>,
        arrived: u64,
    ) -> Option<MutexGuard<'a, ()>> {
        self.waiters.fetch_add(1, Ordering::AcqRel);
        let got = loop {
            if let Some(g) = lock.try_lock_for(FLUSH_LOOK_EVERY) {
                break Some(g);
            }
            if self.covered(arrived) {
                break None;
            }
        };
        self.waiters.fetch_sub(1, Ordering::AcqRel);
        got.filter(|_| !self.covered(arrived))
    }

    /// Whether a flush waits for the commit lock (a holder that can commit should).
    pub fn waiting(&self) -> bool {
        self.waiters.load(Ordering::Acquire) > 0
    }

    /// A commit (or intent-log flush) begins, under the commit lock, before it looks at
    /// anything it makes durable: its number.
    pub fn begin(&self) -> u64 {
        self.begun.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// Commit `begun` failed and the pool serves on: it covers no flush.
    pub fn failed(&self, begun: u64) {
        self.failed_at.fetch_max(begun, Ordering::AcqRel);
    }

    /// The commit begun last is done (after `failed`, if it failed).
    pub fn finish(&self) {
        self.done.fetch_add(1, Ordering::AcqRel);
    }

    /// An intent-log flush by a holder of the commit lock (`Core::log_flush_held`), counted
    /// as a commit. It covers the flushes that arrived before it only when it made
    /// everything durable (`Ok(true)`); one that did not (no chain, no room for a block,
    /// the log devices failed: the caller commits next) or failed counts as failed, so a
    /// flush waiting for the lock does not take it for its durable point (it took the
    /// notes and wrote them nowhere) and waits for the commit that follows, or makes its
    /// own.
    pub fn log_flush(&self, flush: impl FnOnce() -> Result<bool>) -> Result<bool> {
        let begun = self.begin();
        let logged = flush();
        if !matches!(logged, Ok(true)) {
            self.failed(begun);
        }
        self.finish();
        logged
    }
}
