//! Stepped mode: the pool's background work driven by its caller, one step at a time.
//!
//! For the deterministic simulator (`crates/sim`, docs/simulation.md) and tests only. A
//! pool opened with `OpenOptions::stepped` starts no maintenance thread and no scrub
//! thread; whoever holds it calls `Pool::maintenance_step` (one round of
//! `Core::maintenance_loop`: the commit it would make, the cleaning pass it would run)
//! and `Pool::scrub_step` (a started scrub, run to its end on the caller's thread) when
//! its schedule says so. With nothing running beside the caller, a writer short of space
//! runs the maintenance rounds it would wait for itself (`Store::set_stepped`), each after
//! the tick it would have slept on the simulated clock, under the rules and bounds of a
//! real wait (`Store::wait_until`): the simulator checks no write waits past them. A scrub does not sleep to hold
//! its rate (`Core::throttle`). A key rotation starts no worker (`spawn_rotation`):
//! `Pool::rotation_step` (`rotate.rs`) runs one batch of each rotation under way, as the worker would
//! (a batch that fails pauses it with its reason in `Rotation::error`; one paused for
//! space is tried again at the next step, any other waits for `key_rotate` or a key load,
//! which clear the reason). The object tier's fencing check and collection, which a
//! serving pool runs by the clock, are left out of a stepped round: `Pool::tier_step`
//! runs them.
//!
//! Nothing here changes what a round does: production runs the same `maintenance_round`
//! from its thread, so a seed that breaks a step breaks the daemon too.

use super::core::{Core, MaintenanceState};
use crate::{Error, Result};

impl Core {
    fn refuse_unless_stepped(&self, what: &str) -> Result<()> {
        if self.store.stepped() {
            return Ok(());
        }
        Err(Error::Invalid(format!(
            "{what} needs a pool opened with OpenOptions::stepped: a thread already does it"
        )))
    }

    /// `Pool::maintenance_step`.
    pub(super) fn maintenance_step(&self, st: &mut MaintenanceState) -> Result<()> {
        self.refuse_unless_stepped("maintenance_step")?;
        self.maintenance_round(st);
        Ok(())
    }

    /// `Pool::tier_step`: the object tier's clock-driven work, which a stepped round
    /// leaves out: the fencing check (a takeover found poisons the pool, as in the
    /// round) and a collection. Ok(false) when fenced; nothing without an object store.
    pub(super) fn tier_step(&self) -> Result<bool> {
        self.refuse_unless_stepped("tier_step")?;
        Ok(match &self.tier {
            Some(t) => self.tier_upkeep(t, true, true),
            None => true,
        })
    }

    /// `Pool::scrub_step`.
    pub(super) fn scrub_step(&self) -> Result<()> {
        self.refuse_unless_stepped("scrub_step")?;
        if self.scrub.lock().state != super::scrub::ScrubPhase::Scanning {
            return Ok(());
        }
        self.scrub_run()
    }
}
