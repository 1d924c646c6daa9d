//! Named pause points: a test stops a background thread at exactly one step (the cleaner
//! between two batches of moves, say) and lets it go when it has done what it wanted to
//! do meanwhile, instead of sleeping and hoping the thread got there. A point costs one
//! load of a flag while no test has armed any.
//!
//! ```ignore
//! let p = pause::arm("clean.batch");   // the next thread to reach it stops there
//! p.wait_reached();                    // ... until it has
//! // act while it is stopped
//! p.release();                         // it goes on (and so does every later one)
//! ```
//!
//! Points: `clean.batch` (the cleaner holds the commit lock between two batches of moves),
//! `clean.end` (a pass has moved what it will, the commit lock still held),
//! `clean.install` (a record snapshots share is copied, not yet installed in their trees),
//! `rotate.finish` (a rotation's walk is done and its master key read, its older keys not
//! yet retired).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{Condvar, Mutex};

static ARMED: AtomicBool = AtomicBool::new(false);

#[derive(Default)]
struct State {
    reached: u32,
    released: bool,
}

#[derive(Default)]
struct Gate {
    state: Mutex<State>,
    changed: Condvar,
}

fn gates() -> &'static Mutex<HashMap<String, Arc<Gate>>> {
    static GATES: OnceLock<Mutex<HashMap<String, Arc<Gate>>>> = OnceLock::new();
    GATES.get_or_init(Default::default)
}

/// A point armed by a test; dropping it releases the point and disarms it.
pub struct Armed {
    name: String,
    gate: Arc<Gate>,
}

/// Arm point `name`: every thread that reaches it stops there until `release`.
pub fn arm(name: &str) -> Armed {
    let gate = Arc::new(Gate::default());
    gates().lock().insert(name.to_string(), gate.clone());
    ARMED.store(true, Ordering::SeqCst);
    Armed {
        name: name.to_string(),
        gate,
    }
}

impl Armed {
    /// Wait until a thread has reached the point (at most `max`); whether one did.
    pub fn wait_reached(&self, max: std::time::Duration) -> bool {
        let mut s = self.gate.state.lock();
        let deadline = crate::env::now() + max;
        while s.reached == 0 {
            if self.gate.changed.wait_until(&mut s, deadline).timed_out() {
                return s.reached > 0;
            }
        }
        true
    }

    /// Let every thread stopped at the point go, and those that reach it later pass.
    pub fn release(&self) {
        let mut s = self.gate.state.lock();
        s.released = true;
        self.gate.changed.notify_all();
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        self.release();
        let mut g = gates().lock();
        if g.get(&self.name)
            .is_some_and(|x| Arc::ptr_eq(x, &self.gate))
        {
            g.remove(&self.name);
        }
        if g.is_empty() {
            ARMED.store(false, Ordering::SeqCst);
        }
    }
}

/// Arm point `name` of the pool in `dir` only (tests in one process run several pools).
pub fn arm_at(dir: &std::path::Path, name: &str) -> Armed {
    arm(&format!("{}:{name}", dir.display()))
}

/// `point`, for the pool in `dir`: stops here if `name` is armed for every pool, or
/// for this one (`arm_at`).
pub fn point_at(dir: &std::path::Path, name: &str) {
    if !ARMED.load(Ordering::Relaxed) {
        return;
    }
    point(name);
    point(&format!("{}:{name}", dir.display()));
}

/// Stop here while a test holds point `name` armed and not released.
pub fn point(name: &str) {
    if !ARMED.load(Ordering::Relaxed) {
        return;
    }
    let Some(gate) = gates().lock().get(name).cloned() else {
        return;
    };
    let mut s = gate.state.lock();
    s.reached += 1;
    gate.changed.notify_all();
    while !s.released {
        gate.changed.wait(&mut s);
    }
}
