//! The key rotation state a volume carries: its persisted progress (`Rotation`, in the
//! volume table) and whether a worker runs it (`RotationWorker`). The rotation itself is
//! control-plane work (`pool::rotate`).

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Rotation {
    /// The generation every block is being moved to.
    pub to_generation: u16,
    /// Next logical block to examine.
    pub lba: u64,
    pub blocks_done: u64,
    pub blocks_total: u64,
    /// Why the rotation is paused, if it is. It goes on by itself when `retrying`;
    /// otherwise `key_rotate` (or the next key load) resumes it.
    #[serde(default)]
    pub error: Option<String>,
    /// Paused for space: the worker tries again by itself once space is free.
    #[serde(default)]
    pub retrying: bool,
}

/// Whether a worker runs a volume's rotation, and a resume asked of it. Never persisted.
#[derive(Default)]
pub(crate) struct RotationWorker {
    pub(crate) state: Mutex<WorkerState>,
    pub(crate) wake: Condvar,
}

#[derive(Default)]
pub(crate) struct WorkerState {
    pub(crate) running: bool,
    /// `spawn_rotation` found the worker running: it must go on (or try again) instead of
    /// ending.
    pub(crate) resume: bool,
}

impl RotationWorker {
    pub(crate) fn running(&self) -> bool {
        self.state.lock().running
    }
}
