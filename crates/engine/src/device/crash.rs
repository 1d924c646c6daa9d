//! Simulated power loss as a device layer: the writes a device has not yet made durable
//! are kept apart, and at a simulated crash each of them is kept, dropped or torn.
//!
//! For the deterministic simulator (`crates/sim`, docs/simulation.md) and tests only. A
//! test arms a `CrashJournal` for a directory (`arm`); every `FaultyDevice` opened on a
//! file under it afterwards (every member device and log device of a pool in that
//! directory) records each write since its last successful `flush` (fsync): where, the
//! bytes it replaced and the bytes it wrote. Writes still reach the file at once, so the
//! running pool reads what it wrote, as it would from the page cache.
//!
//! At the crash instant the test calls `freeze` (or `freeze_after` a number of writes, to
//! crash inside an operation): from then on writes and flushes fail with an I/O error and
//! reach nothing (the machine is off), so whatever the pool does while it is torn down is
//! not on the disks. They fail rather than pretend to succeed so that the pool
//! acknowledges nothing after the crash instant: a flush whose writes vanished must not
//! answer, nor tell the host's anchor (a file beside the devices, not journaled) that it
//! reached the log. After the pool is dropped, `crash` turns each device file into one state
//! a power loss could leave: every unsynced write undone, newest first, then each redone,
//! oldest first, whole, not at all, or torn (a random subset of its 4 KiB sectors: a
//! device writes a sector whole or not at all, and in any order), chosen by the caller's
//! seed. A write the pool made durable with `flush` is never undone. The journal is then
//! empty and thawed, and the next import's devices use it again.
//!
//! Unarmed, it costs one lock and a prefix comparison per `FaultyDevice` opened, and
//! nothing per I/O.

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

/// Sectors: a torn write keeps or loses each 4 KiB of the device separately.
pub const SECTOR_BYTES: u64 = 4096;

/// Journals armed in this process, by the directory they cover (weak: a dropped journal
/// disarms itself).
static ARMED: Mutex<Vec<(PathBuf, Weak<CrashJournal>)>> = Mutex::new(Vec::new());

/// One write since its device's last flush.
struct Pending {
    offset: u64,
    old: Vec<u8>,
    new: Vec<u8>,
}

#[derive(Default)]
struct State {
    frozen: bool,
    /// Freeze at the write after this many more (`freeze_after`): a crash inside an
    /// operation.
    freeze_in: Option<u64>,
    /// Unsynced writes per device file, oldest first.
    devices: BTreeMap<PathBuf, Vec<Pending>>,
}

/// What a crash did to the unsynced writes (for the simulator's trace).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CrashOutcome {
    pub kept: u64,
    pub dropped: u64,
    pub torn: u64,
}

/// The unsynced writes of every device under one directory (see the module doc).
pub struct CrashJournal {
    dir: PathBuf,
    state: Mutex<State>,
}

/// Record the writes of devices opened under `dir` from now on, until the journal is
/// dropped.
pub fn arm(dir: &Path) -> Arc<CrashJournal> {
    let j = Arc::new(CrashJournal {
        dir: dir.to_path_buf(),
        state: Mutex::new(State::default()),
    });
    let mut armed = ARMED.lock();
    armed.retain(|(_, w)| w.strong_count() > 0);
    armed.push((dir.to_path_buf(), Arc::downgrade(&j)));
    j
}

/// The journal armed for a device at `path`, if any (`FaultyDevice::new`).
pub(crate) fn journal_for(path: &Path) -> Option<Arc<CrashJournal>> {
    let armed = ARMED.lock();
    armed
        .iter()
        .filter(|(dir, _)| path.starts_with(dir))
        .find_map(|(_, w)| w.upgrade())
}

impl CrashJournal {
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The machine is off: later writes and flushes fail and reach nothing.
    pub fn freeze(&self) {
        self.state.lock().frozen = true;
    }

    /// Freeze at the `n`th write from now (0: the next write is the first swallowed): the
    /// machine dies in the middle of whatever the pool does next.
    pub fn freeze_after(&self, n: u64) {
        self.state.lock().freeze_in = Some(n);
    }

    /// Whether the machine is off (`freeze`, or `freeze_after` reached).
    pub fn frozen(&self) -> bool {
        self.state.lock().frozen
    }

    /// Writes not yet made durable, over all devices.
    pub fn unsynced(&self) -> usize {
        self.state.lock().devices.values().map(Vec::len).sum()
    }

    /// `dev.write_at(buf, offset)`, recorded. Frozen: an error, nothing written.
    pub(crate) fn write(
        &self,
        dev: &dyn super::Device,
        buf: &[u8],
        offset: u64,
    ) -> std::io::Result<()> {
        let mut s = self.state.lock();
        match s.freeze_in {
            Some(0) => {
                s.frozen = true;
                s.freeze_in = None;
            }
            Some(n) => s.freeze_in = Some(n - 1),
            None => {}
        }
        if s.frozen {
            return Err(off());
        }
        let mut old = vec![0u8; buf.len()];
        dev.read_at(&mut old, offset)?;
        dev.write_at(buf, offset)?;
        s.devices
            .entry(dev.path().to_path_buf())
            .or_default()
            .push(Pending {
                offset,
                old,
                new: buf.to_vec(),
            });
        Ok(())
    }

    /// `dev.flush()`; on success the writes it covered are durable. Frozen: an error.
    pub(crate) fn flush(&self, dev: &dyn super::Device) -> std::io::Result<()> {
        let covered = {
            let s = self.state.lock();
            if s.frozen {
                return Err(off());
            }
            s.devices.get(dev.path()).map_or(0, Vec::len)
        };
        dev.flush()?;
        let mut s = self.state.lock();
        if let Some(p) = s.devices.get_mut(dev.path()) {
            p.drain(..covered.min(p.len()));
        }
        Ok(())
    }

    /// Leave each device file as a power loss might (see the module doc): `pick(n)` is the
    /// caller's seeded choice in `0..n`; per write, 0 keeps it, 1 drops it, 2 tears it
    /// (then one pick per sector, 0 keeps the sector). Call after the pool is dropped.
    /// The journal is empty and thawed afterwards.
    pub fn crash(&self, pick: &mut dyn FnMut(u64) -> u64) -> std::io::Result<CrashOutcome> {
        let mut s = self.state.lock();
        let mut out = CrashOutcome::default();
        let devices = std::mem::take(&mut s.devices);
        for (path, pending) in devices {
            if pending.is_empty() {
                continue;
            }
            let file = std::fs::OpenOptions::new().write(true).open(&path)?;
            for p in pending.iter().rev() {
                file.write_all_at(&p.old, p.offset)?;
            }
            for p in &pending {
                match pick(3) {
                    0 => {
                        file.write_all_at(&p.new, p.offset)?;
                        out.kept += 1;
                    }
                    1 => out.dropped += 1,
                    _ => {
                        out.torn += 1;
                        let end = p.offset + p.new.len() as u64;
                        let mut at = p.offset;
                        while at < end {
                            let next = ((at / SECTOR_BYTES + 1) * SECTOR_BYTES).min(end);
                            if pick(2) == 0 {
                                let (a, b) = ((at - p.offset) as usize, (next - p.offset) as usize);
                                file.write_all_at(&p.new[a..b], at)?;
                            }
                            at = next;
                        }
                    }
                }
            }
            file.sync_all()?;
        }
        s.frozen = false;
        s.freeze_in = None;
        Ok(out)
    }
}

fn off() -> std::io::Error {
    std::io::Error::other("simulated power loss: the machine is off")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{Device, FileDevice};

    #[test]
    fn a_crash_keeps_what_was_flushed_and_only_whole_sectors_of_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let j = arm(dir.path());
        let path = dir.path().join("d");
        let d = FileDevice::create_sparse(&path, 1 << 20).unwrap();
        assert!(
            journal_for(&path).is_some(),
            "armed for every file under the directory"
        );
        j.write(&d, &[1u8; 8192], 0).unwrap();
        j.flush(&d).unwrap();
        j.write(&d, &[2u8; 8192], 0).unwrap();
        j.write(&d, &[3u8; 4096], 8192).unwrap();
        assert_eq!(j.unsynced(), 2);
        j.freeze();
        assert!(j.write(&d, &[9u8; 4096], 0).is_err(), "the machine is off");
        assert!(j.flush(&d).is_err());
        drop(d);
        // Tear the first write (keep its first sector only), drop the second.
        let mut picks = vec![2, 0, 1, 1].into_iter();
        let out = j.crash(&mut |_| picks.next().unwrap()).unwrap();
        assert_eq!((out.kept, out.dropped, out.torn), (0, 1, 1));
        let f = FileDevice::open(&path).unwrap();
        let mut b = vec![0u8; 12288];
        f.read_at(&mut b, 0).unwrap();
        assert!(
            b[..4096].iter().all(|&x| x == 2),
            "a kept sector holds the new bytes"
        );
        assert!(
            b[4096..8192].iter().all(|&x| x == 1),
            "a lost sector holds the flushed ones"
        );
        assert!(
            b[8192..].iter().all(|&x| x == 0),
            "a dropped write left nothing"
        );
        assert_eq!(j.unsynced(), 0);
        assert!(!j.frozen(), "thawed for the next import");
    }
}
