//! Fault injection as a device layer: the "evil disk controller" for drills and tests.
//!
//! Every member device of a pool is wrapped in a `FaultyDevice`. With no fault
//! set it costs one atomic load per I/O. Faults are switched on at run time
//! (`bulwark fault set`, only when the daemon was started with
//! `--allow-fault-injection`) and can be cleared again:
//!
//! | mode | effect |
//! | --- | --- |
//! | `read-flip` | flip a bit in data returned by reads (transient, like bad RAM) |
//! | `write-flip` | flip a bit in data as it is written (persistent, like a bad controller) |
//! | `read-error` | reads fail with EIO |
//! | `write-error` | writes fail with EIO |
//! | `drop-writes` | writes report success but nothing reaches the device |
//! | `tear-writes` | only the first half of each write reaches the device |
//! | `misdirect-writes` | writes land 1 MiB further on than asked (wrapping inside the device) |
//! | `vanish` | every I/O fails, as if the device were unplugged |
//! | `slow-reads` | a read waits `SLOW_READ_MS` before it reaches the device (a stalled queue) |
//!
//! Each fault fires with a probability (default 1.0), drawn from a seeded
//! generator so that a drill can be replayed. Superblock slots are exempt
//! unless `include_labels` is set, so a drill aimed at data does not make the
//! pool unimportable by accident.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::Device;
use crate::constants::DEVICE_RESERVED_FRONT;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultMode {
    ReadFlip,
    WriteFlip,
    ReadError,
    WriteError,
    DropWrites,
    TearWrites,
    MisdirectWrites,
    Vanish,
    SlowReads,
}

/// How long a read hit by `slow-reads` waits before it reaches the device.
pub const SLOW_READ_MS: u64 = 100;

impl std::str::FromStr for FaultMode {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<FaultMode> {
        serde_json::from_value(serde_json::Value::String(s.to_string())).map_err(|_| {
            crate::Error::Invalid(format!(
                "unknown fault '{s}': use read-flip, write-flip, read-error, write-error, drop-writes, tear-writes, misdirect-writes, vanish or slow-reads"
            ))
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Fault {
    pub mode: FaultMode,
    /// Chance that one I/O is hit, 0.0..=1.0.
    pub probability: f64,
    pub seed: u64,
    /// Also hit the superblock slots.
    #[serde(default)]
    pub include_labels: bool,
}

struct State {
    faults: Vec<Fault>,
    rng: u64,
}

pub struct FaultyDevice {
    inner: Box<dyn Device>,
    /// Simulated power loss (`crash.rs`): armed only by the simulator and tests.
    journal: Option<std::sync::Arc<super::crash::CrashJournal>>,
    armed: AtomicBool,
    state: Mutex<State>,
    back_region: u64,
}

impl FaultyDevice {
    pub fn new(inner: Box<dyn Device>, back_region: u64) -> FaultyDevice {
        FaultyDevice {
            journal: super::crash::journal_for(inner.path()),
            inner,
            armed: AtomicBool::new(false),
            state: Mutex::new(State {
                faults: Vec::new(),
                rng: 1,
            }),
            back_region,
        }
    }

    pub fn set(&self, faults: Vec<Fault>) {
        let mut s = self.state.lock();
        s.rng = faults.first().map(|f| f.seed | 1).unwrap_or(1);
        self.armed.store(!faults.is_empty(), Ordering::Release);
        s.faults = faults;
    }

    pub fn faults(&self) -> Vec<Fault> {
        self.state.lock().faults.clone()
    }

    /// A write that reaches the device (through the crash journal when one is armed).
    fn put(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        match &self.journal {
            Some(j) => j.write(&*self.inner, buf, offset),
            None => self.inner.write_at(buf, offset),
        }
    }

    fn is_label(&self, offset: u64) -> bool {
        offset < DEVICE_RESERVED_FRONT || offset >= self.back_region
    }

    /// A read of `bufs` (one after another) at `offset` by `read`, with the read faults
    /// applied: an error instead, or one bit flipped somewhere in what was read.
    fn read_with(
        &self,
        bufs: &mut [&mut [u8]],
        offset: u64,
        read: impl FnOnce(&mut [&mut [u8]]) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        match self.fire(
            offset,
            &[
                FaultMode::Vanish,
                FaultMode::ReadError,
                FaultMode::ReadFlip,
                FaultMode::SlowReads,
            ],
        ) {
            Some((FaultMode::Vanish, _)) => Err(eio("device vanished")),
            Some((FaultMode::ReadError, _)) => Err(eio("read error")),
            Some((FaultMode::SlowReads, _)) => {
                crate::env::sleep(std::time::Duration::from_millis(SLOW_READ_MS));
                read(bufs)
            }
            Some((_, r)) => {
                read(bufs)?;
                let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
                if total > 0 {
                    let mut bit = (r % (total * 8)) as usize;
                    for b in bufs.iter_mut() {
                        if bit < b.len() * 8 {
                            b[bit / 8] ^= 1 << (bit % 8);
                            break;
                        }
                        bit -= b.len() * 8;
                    }
                }
                Ok(())
            }
            None => read(bufs),
        }
    }

    /// The first armed fault of `modes` that fires for this I/O, with a random number for it.
    fn fire(&self, offset: u64, modes: &[FaultMode]) -> Option<(FaultMode, u64)> {
        if !self.armed.load(Ordering::Acquire) {
            return None;
        }
        let mut s = self.state.lock();
        let label = self.is_label(offset);
        for i in 0..s.faults.len() {
            let f = s.faults[i].clone();
            if !modes.contains(&f.mode) || (label && !f.include_labels) {
                continue;
            }
            let r = next(&mut s.rng);
            let p = (r >> 11) as f64 / (1u64 << 53) as f64;
            if p < f.probability {
                return Some((f.mode, next(&mut s.rng)));
            }
        }
        None
    }
}

fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn eio(what: &str) -> std::io::Error {
    std::io::Error::other(format!("injected fault: {what}"))
}

impl Device for FaultyDevice {
    fn path(&self) -> &Path {
        self.inner.path()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.read_with(&mut [buf], offset, |b| {
            self.inner.read_at(&mut *b[0], offset)
        })
    }
    fn read_scattered_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> std::io::Result<()> {
        self.read_with(bufs, offset, |b| self.inner.read_scattered_at(b, offset))
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        let modes = [
            FaultMode::Vanish,
            FaultMode::WriteError,
            FaultMode::WriteFlip,
            FaultMode::DropWrites,
            FaultMode::TearWrites,
            FaultMode::MisdirectWrites,
        ];
        match self.fire(offset, &modes) {
            None => self.put(buf, offset),
            Some((FaultMode::Vanish, _)) => Err(eio("device vanished")),
            Some((FaultMode::WriteError, _)) => Err(eio("write error")),
            Some((FaultMode::DropWrites, _)) => Ok(()),
            Some((FaultMode::TearWrites, _)) => self.put(&buf[..buf.len() / 2], offset),
            Some((FaultMode::MisdirectWrites, _)) => {
                let span = self
                    .back_region
                    .saturating_sub(DEVICE_RESERVED_FRONT)
                    .max(1);
                let to = DEVICE_RESERVED_FRONT
                    + (offset - DEVICE_RESERVED_FRONT.min(offset) + (1 << 20)) % span;
                self.put(
                    buf,
                    to.min(self.back_region.saturating_sub(buf.len() as u64)),
                )
            }
            Some((_, r)) => {
                let mut copy = buf.to_vec();
                if !copy.is_empty() {
                    let bit = (r % (copy.len() as u64 * 8)) as usize;
                    copy[bit / 8] ^= 1 << (bit % 8);
                }
                self.put(&copy, offset)
            }
        }
    }
    fn flush(&self) -> std::io::Result<()> {
        if self.fire(0, &[FaultMode::Vanish]).is_some() {
            return Err(eio("device vanished"));
        }
        match &self.journal {
            Some(j) => j.flush(&*self.inner),
            None => self.inner.flush(),
        }
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<bool> {
        if self.fire(offset, &[FaultMode::Vanish]).is_some() {
            return Err(eio("device vanished"));
        }
        self.inner.discard(offset, len)
    }
    fn is_hole(&self, offset: u64, len: u64) -> bool {
        self.inner.is_hole(offset, len)
    }
    fn allocated_bytes(&self) -> u64 {
        self.inner.allocated_bytes()
    }
    fn will_write(&self, offset: u64, len: u64) {
        self.inner.will_write(offset, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Mem(Mutex<Vec<u8>>);
    impl Device for Mem {
        fn path(&self) -> &Path {
            Path::new("mem")
        }
        fn size(&self) -> u64 {
            self.0.lock().len() as u64
        }
        fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<()> {
            buf.copy_from_slice(&self.0.lock()[off as usize..off as usize + buf.len()]);
            Ok(())
        }
        fn write_at(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
            self.0.lock()[off as usize..off as usize + buf.len()].copy_from_slice(buf);
            Ok(())
        }
        fn flush(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn read_flip_is_transient_write_flip_persists() {
        let d = FaultyDevice::new(Box::new(Mem(Mutex::new(vec![0; 4 << 20]))), 3 << 20);
        let off = 2 << 20;
        d.write_at(&[7u8; 64], off).unwrap();
        d.set(vec![Fault {
            mode: FaultMode::ReadFlip,
            probability: 1.0,
            seed: 9,
            include_labels: false,
        }]);
        let mut b = [0u8; 64];
        d.read_at(&mut b, off).unwrap();
        assert_ne!(b, [7u8; 64]);
        assert_eq!(b.iter().map(|x| (x ^ 7).count_ones()).sum::<u32>(), 1);
        // A scattered read gets exactly one bit flipped too, in whichever buffer it falls.
        for _ in 0..20 {
            let (mut x, mut y) = ([0u8; 3], [0u8; 61]);
            d.read_scattered_at(&mut [&mut x, &mut [], &mut y], off)
                .unwrap();
            let flipped = |p: &[u8]| p.iter().map(|v| (v ^ 7).count_ones()).sum::<u32>();
            assert_eq!(flipped(&x) + flipped(&y), 1, "{x:?} {y:?}");
        }
        // Labels are exempt by default.
        d.read_at(&mut b, 0).unwrap();
        assert_eq!(b, [0u8; 64]);
        d.set(vec![]);
        d.read_at(&mut b, off).unwrap();
        assert_eq!(b, [7u8; 64]);
        d.set(vec![Fault {
            mode: FaultMode::WriteFlip,
            probability: 1.0,
            seed: 9,
            include_labels: false,
        }]);
        d.write_at(&[1u8; 64], off).unwrap();
        d.set(vec![]);
        d.read_at(&mut b, off).unwrap();
        assert_ne!(b, [1u8; 64]);
        assert_eq!(b.iter().map(|x| (x ^ 1).count_ones()).sum::<u32>(), 1);
    }
}
