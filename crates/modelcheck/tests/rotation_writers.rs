//! Key rotation against client writes: the engine's `volume::stripes` (compiled against
//! shuttle by `bulwark-modelcheck`: the stripe locks writes and rewrites take, and
//! `drain`) driven by shuttle threads playing client writes and a key rotation, under the
//! randomized and the PCT schedulers.
//!
//! Only the locks are the engine's code here; the steps around them are played as the
//! engine takes them, over a model of a volume's map (block → the generation of the data
//! key its record is sealed under, and the value), its key ring's current generation and
//! the data keys it keeps:
//! - a client write of whole blocks is `Volume::write_blocks`: `Stripes::run` held, the
//!   key ring read (`Volume::ring`, inside `write_blocks_encoded`), the records sealed
//!   under its current generation and written, the map pointed at them;
//! - `key rotate` is `Core::key_rotate`: a new data key made current, then
//!   `Stripes::drain`, then the worker started;
//! - the worker is `rotate_run`: one batch, which selects under the map lock the blocks
//!   whose record is under an older generation (holes are stepped over), rewrites each
//!   (`Volume::rewrite_block`: under `Stripes::one`, read and sealed again under the
//!   current generation), then drops the older data keys.
//!
//! Budget and seeds: `bulwark_modelcheck::check` (`BULWARK_SHUTTLE_ITERATIONS`, default
//! 1000 per scheduler; `BULWARK_SHUTTLE_SEED`; `BULWARK_SHUTTLE_SCHEDULERS`).

use bulwark_modelcheck::check;
use bulwark_modelcheck::stripes::Stripes;
use bulwark_modelcheck::sync::{Mutex, RwLock};
use shuttle::sync::Arc;
use shuttle::thread;

const BLOCKS: usize = 2;

struct Model {
    stripes: Stripes,
    /// The key ring's current generation (`VolumeState::ring`).
    ring: RwLock<u16>,
    /// The data keys the volume keeps (`VolumeState::data_keys`).
    keys: Mutex<Vec<u16>>,
    /// Block → (generation its record is sealed under, value); `None`: a hole.
    map: Mutex<Vec<Option<(u16, u64)>>>,
    /// The last value written to each block.
    given: Mutex<Vec<Option<u64>>>,
}

impl Model {
    fn new() -> Model {
        Model {
            stripes: Stripes::new(BLOCKS),
            ring: RwLock::new(1),
            keys: Mutex::new(vec![1]),
            map: Mutex::new(vec![None; BLOCKS]),
            given: Mutex::new(vec![None; BLOCKS]),
        }
    }

    /// A client write of `value` to blocks `first..first + n` (`Volume::write_blocks`).
    fn write(&self, first: usize, n: usize, value: u64) {
        let _stripes = self.stripes.run(first as u64, n as u64);
        let generation = *self.ring.read();
        // (Sealed under that generation's key and written to the devices.)
        let mut map = self.map.lock();
        for lba in first..first + n {
            map[lba] = Some((generation, value));
            self.given.lock()[lba] = Some(value);
        }
    }

    /// `key rotate`: a new current generation, the writes under the older one drained,
    /// then the worker's batch and the older keys dropped.
    fn rotate(&self) {
        {
            let mut keys = self.keys.lock();
            keys.push(2);
            *self.ring.write() = 2;
        }
        self.stripes.drain();
        // The worker: one batch over the whole volume.
        let to = 2;
        let old: Vec<usize> = {
            let map = self.map.lock();
            (0..BLOCKS)
                .filter(|&lba| map[lba].is_some_and(|(g, _)| g != to))
                .collect()
        };
        for lba in old {
            let _stripe = self.stripes.one(lba as u64);
            let now = self.map.lock()[lba];
            if let Some((_, value)) = now {
                let generation = *self.ring.read();
                self.map.lock()[lba] = Some((generation, value));
            }
        }
        // Every block is under the new generation: the others go.
        self.keys.lock().retain(|&g| g == to);
    }

    /// At the end: every block reads its last write, under a key the volume keeps.
    fn check_end(&self) {
        let map = self.map.lock();
        let keys = self.keys.lock();
        let given = self.given.lock();
        for lba in 0..BLOCKS {
            if let Some((g, value)) = map[lba] {
                assert!(
                    keys.contains(&g),
                    "block {lba} is sealed under generation {g}, whose key the rotation \
                     dropped (kept: {:?}): an acknowledged write is unreadable",
                    *keys
                );
                assert_eq!(
                    Some(value),
                    given[lba],
                    "block {lba} reads {value}, not its last write: a rewrite undid it"
                );
            }
        }
    }
}

/// A key rotation never leaves a block readable under no key: every block a client write
/// acknowledged, before, during or after the rotation, is under a data key the volume
/// keeps when the rotation has dropped the older ones, and reads its last write (a
/// rewrite never undoes a client write: both hold the block's stripe lock).
///
/// Block 0 holds a record under the first key; block 1 is a hole. A client writes blocks
/// 0 and 1 in one run and another writes block 0, while `key rotate` runs its worker.
///
/// Found by this test, and fixed with it: `key_rotate` made the new key current and
/// started the worker at once. A write that had read the key ring before (under its
/// stripe locks, sealing under the older key) could land in the map after the worker's
/// batch had walked its blocks: in a block that was a hole when walked (a thin volume's
/// first write there), it stayed under the older key, which the rotation then dropped (no
/// snapshot keeping it): the block was unreadable, an acknowledged write lost. Both
/// schedulers find it without `Stripes::drain` ("block 1 is sealed under generation 1,
/// whose key the rotation dropped (kept: [2])"); `key_rotate` now drains the stripe locks
/// after the new key is current.
///
/// Mutation run once (reverted): the rewrite reading the block outside its stripe lock
/// (`Stripes::one` taken after the read): both schedulers, "block 1 reads 20, not its
/// last write: a rewrite undid it".
#[test]
fn a_rotation_never_leaves_a_block_under_a_key_it_dropped() {
    check(|| {
        let m = Arc::new(Model::new());
        m.write(0, 1, 10);
        let rotation = {
            let m = m.clone();
            thread::spawn(move || m.rotate())
        };
        let other = {
            let m = m.clone();
            thread::spawn(move || m.write(0, 1, 30))
        };
        m.write(0, 2, 20);
        rotation.join().unwrap();
        other.join().unwrap();
        m.check_end();
    });
}
