//! Key unload against I/O in flight: the engine's `volume::uses` (compiled against shuttle
//! by `bulwark-modelcheck`) driven by shuttle threads playing clients that open a handle
//! and write, a key rotation batch, and `key unload`, under the randomized and the PCT
//! schedulers.
//!
//! The parts the threads play are the engine's own steps in its own order, over a model
//! of the key (the volume's `ring` lock: `Some` while loaded) and of what was acknowledged:
//! - a client is `Core::volume_handle` (`Uses::open_while_loaded` on the key: refused when
//!   locked), then `Volume::write` (`Volume::ring`: the key taken under its read lock; none
//!   is an error, never plaintext; the write sealed under it and acknowledged), then the
//!   handle dropped (`Uses::close`);
//! - a rotation batch is `rotate_run`'s: `Uses::background_batch` held, stopped when the
//!   key is gone (`rotation_stopped`), else a block rewritten under the key;
//! - `key unload` is `Pool::unload_key`: the key must be loaded, `Core::quiesce_for_change`
//!   (`Uses::quiesce`: refused while in use, a batch waited for), the flush, then
//!   `Uses::take_key_unused` (the key taken, refused while in use).
//!
//! Budget and seeds: `bulwark_modelcheck::check` (`BULWARK_SHUTTLE_ITERATIONS`, default
//! 1000 per scheduler; `BULWARK_SHUTTLE_SEED`; `BULWARK_SHUTTLE_SCHEDULERS`).

use std::time::Duration;

use bulwark_modelcheck::check;
use bulwark_modelcheck::sync::RwLock as KeyLock;
use bulwark_modelcheck::uses::Uses;
use shuttle::sync::atomic::{AtomicBool, Ordering};
use shuttle::sync::Arc;
use shuttle::thread;

struct Model {
    uses: Uses,
    /// The volume's key ring: `Some` while the key is loaded.
    key: KeyLock<Option<Arc<u32>>>,
    /// `key unload` returned success.
    unloaded: AtomicBool,
}

impl Model {
    fn new() -> Model {
        Model {
            uses: Uses::new(),
            key: KeyLock::new(Some(Arc::new(1))),
            unloaded: AtomicBool::new(false),
        }
    }

    /// Something sealed under the key was acknowledged (a client write, a rotated block):
    /// key unload has not returned.
    fn sealed(&self, what: &str, _key: &Arc<u32>) {
        assert!(
            !self.unloaded.load(Ordering::SeqCst),
            "{what} was sealed under the volume's key and acknowledged after key unload \
             returned: the key was still in use when unload said it was gone"
        );
    }

    /// A client: open a handle, write once, close.
    fn client(&self) {
        if !self.uses.open_while_loaded(&self.key, true) {
            return; // locked: refused
        }
        let key = self.key.read().clone();
        if let Some(key) = key {
            self.sealed("a client write", &key);
        }
        self.uses.close();
    }

    /// A key rotation batch.
    fn rotation_batch(&self) {
        let _batch = self.uses.background_batch();
        let key = self.key.read().clone();
        let Some(key) = key else {
            return; // stopped: resumes at the next key load
        };
        self.sealed("a block a rotation batch rewrote", &key);
    }

    /// `Pool::unload_key`; true when it returned success.
    fn unload(&self) -> bool {
        if self.key.read().is_none() {
            return false;
        }
        let Ok(_w) = self.uses.quiesce(Duration::from_secs(30)) else {
            return false;
        };
        // (The flush: every write acknowledged so far made durable under the key.)
        if self.uses.take_key_unused(&self.key).is_err() {
            return false;
        }
        assert_eq!(
            self.uses.clients(),
            0,
            "key unload took the key while a handle was open"
        );
        self.unloaded.store(true, Ordering::SeqCst);
        true
    }
}

/// Key unload never returns while a handle could still write under the key: no client
/// write and no rotation batch is sealed under the key and acknowledged after unload
/// returned, and unload never takes the key while a handle is counted. A handle is counted
/// under the key's read lock only while the key is loaded, the key is taken under its
/// write lock only while none is counted (`Uses::open_while_loaded`,
/// `Uses::take_key_unused`), and a rotation batch holds the work lock unload's
/// `quiesce` waits for.
///
/// Two clients open, write and close, and a rotation batch runs, while key unload runs.
///
/// Found by this test, and fixed with it: `Core::volume_handle` checked that the key was
/// loaded and then counted the handle, and `unload_key` checked the count (in
/// `quiesce_for_change`), flushed, and took the key without looking again, so a handle
/// opened in between was counted after unload's check and found the key still there: its
/// write was sealed under the key and acknowledged, and unload returned success with the
/// handle open. On that code (`Uses` as first extracted, in the same order) both
/// schedulers fail at the default budget: "key unload took the key while a handle was
/// open" (and, with that assertion left out, "a client write was sealed under the
/// volume's key and acknowledged after key unload returned").
///
/// Mutations of `volume/uses.rs` run once (each reverted): `take_key_unused` without its
/// look at the count: both schedulers, "key unload took the key while a handle was open";
/// `open_while_loaded` letting the key's lock go before it counts: the randomized
/// scheduler, the same (PCT passed 1000); `quiesce` not keeping the work lock (taken, let
/// go): PCT, "a block a rotation batch rewrote was sealed under the volume's key and
/// acknowledged after key unload returned" (the randomized scheduler passed 1000).
#[test]
fn key_unload_never_returns_while_a_handle_or_a_batch_can_write_under_the_key() {
    check(|| {
        let m = Arc::new(Model::new());
        let clients: Vec<_> = (0..2)
            .map(|_| {
                let m = m.clone();
                thread::spawn(move || m.client())
            })
            .collect();
        let rotation = {
            let m = m.clone();
            thread::spawn(move || m.rotation_batch())
        };
        m.unload();
        for c in clients {
            c.join().unwrap();
        }
        rotation.join().unwrap();
        // After the unload, a handle is refused and a batch stops.
        if m.unloaded.load(Ordering::SeqCst) {
            m.client();
            m.rotation_batch();
        }
    });
}
