//! Where a record dies (issue 38): the one place that decides a reference is gone for
//! good, and the only way to [`Store::release`].
//!
//! A [`Dead`] is made here and nowhere else, by one of the rules below; `release` takes
//! nothing else, so every release in the engine names the rule it follows, and a `Dead`
//! is spent by its release (it is neither `Clone` nor `Copy`).
//!
//! The rules:
//! - **Dropped by a tree** ([`Store::dropped`]): a tree let go of a pointer at one place
//!   (an overwrite, a trim, a shrink, a commit writing a new copy of a node). Sharing is
//!   decided by place (decision 0009, `volume::snap`): the trees of a volume that hold a
//!   record form one unbroken run, so when one drops it only its neighbours can still hold
//!   it, and it dies when none of them holds it at that place. A neighbour whose node
//!   cannot be read counts as holding it: a record kept too long leaks until the next
//!   import recounts; one released while a tree points at it would be overwritten.
//! - **Unique to a tree that goes** ([`Store::unique_to`], [`Store::walk_unique_dead`]):
//!   a snapshot destroyed, a volume rolled back or destroyed, a clone's base let go: the
//!   nodes and records that tree holds and none of its neighbours does.
//! - **Never linked** ([`Dead::unlinked`]): placed by an operation that failed before
//!   any tree, table or chain pointed at it.
//! - **Superseded** ([`Dead::superseded`]): the only pointer to it (the superblock's
//!   root, the volume table record, an intent-log chain's slots, the one copy a cleaner's
//!   move replaced in every tree that held it) now points elsewhere.
//!
//! Birth generations in block pointers (decision 0014's step 3, a format change) would let
//! `dropped` answer from the pointer alone; the by-place rule would stay as its check.

use crate::map::{At, Blkptr, Tree, Visit};
use crate::{Error, Result};

use super::Store;

/// A record no tree, table or chain refers to any more: its space may go back to the log
/// (`Store::release`). Made only by the rules of this module.
#[must_use = "a dead record's space is lost until it is released"]
#[derive(Debug, PartialEq, Eq)]
pub struct Dead(Blkptr);

impl Dead {
    /// Placed by an operation that failed before anything pointed at it.
    pub fn unlinked(p: Blkptr) -> Dead {
        Dead(p)
    }

    /// Its only referrer (a superblock's root, a table record, a chain's slot, every
    /// holder of a record the cleaner moved) points elsewhere now.
    pub fn superseded(p: Blkptr) -> Dead {
        Dead(p)
    }

    /// The pointer, for callers that count what they release.
    pub fn ptr(&self) -> &Blkptr {
        &self.0
    }

    pub(super) fn into_ptr(self) -> Blkptr {
        self.0
    }
}

impl Store {
    /// A tree dropped `p` at `at`: dead unless one of `neighbours` (the trees next to it in
    /// its volume's run: for the head, the newest snapshot) still holds it there.
    pub fn dropped(&self, neighbours: &[&Tree], at: At, p: &Blkptr) -> Option<Dead> {
        if p.is_hole() || self.held_by(neighbours, at, p) {
            return None;
        }
        Some(Dead(*p))
    }

    /// Whether any of `trees` holds `p` at `at` (an unreadable node counts as holding it).
    pub fn held_by(&self, trees: &[&Tree], at: At, p: &Blkptr) -> bool {
        trees.iter().any(|t| {
            t.holds(self, self.nodes(), at, p).unwrap_or_else(|e| {
                tracing::error!("keeping a record whose sharing cannot be checked: {e}");
                true
            })
        })
    }

    /// Tree `t` goes: the nodes and records it holds that none of `neighbours` does, and
    /// the stored data bytes among them. Refused (nothing released) when a node of `t`
    /// cannot be read: callers check everything before they change anything.
    pub fn unique_to(&self, t: &Tree, neighbours: &[&Tree]) -> Result<(Vec<Dead>, u64)> {
        let mut gone = Vec::new();
        let mut bytes = 0u64;
        t.walk_unique(self, self.nodes(), neighbours, &mut |v| {
            match v {
                Visit::Node { ptr, .. } => gone.push(Dead(*ptr)),
                Visit::Data { ptr, .. } => {
                    bytes += ptr.len as u64;
                    gone.push(Dead(*ptr));
                }
                Visit::Unreadable {
                    level,
                    index,
                    error,
                } => {
                    return Err(Error::Corrupt(format!(
                        "map node ({level}, {index}) cannot be read: {error}"
                    )))
                }
            }
            Ok(())
        })?;
        Ok((gone, bytes))
    }

    /// Tree `t` goes and nothing may stop it (a destroyed volume's family): release what
    /// it holds and none of `neighbours` does, as the walk finds it. The space under a node
    /// that cannot be read leaks until the next import recounts; the walk's error says so.
    pub fn walk_unique_dead(&self, t: &Tree, neighbours: &[&Tree]) -> Result<()> {
        t.walk_unique(self, self.nodes(), neighbours, &mut |v| {
            match v {
                Visit::Node { ptr, .. } | Visit::Data { ptr, .. } => self.release(Dead(*ptr)),
                Visit::Unreadable { .. } => {}
            }
            Ok(())
        })
    }
}
