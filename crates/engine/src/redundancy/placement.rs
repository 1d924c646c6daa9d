//! One placement per layout: where a record's copies or shards lie on the members, how
//! much segment space it takes, and how it is written, read back verified and scrubbed.
//! `Redundancy` holds one and knows no layout by name; a new layout (or an object-store
//! tier under one) is a new implementation here.

use super::parity::shard_bytes;
use super::{Layout, Places, Redundancy, ScrubOutcome};
use crate::checksum::Checksum;
use crate::constants::{DEVICE_RESERVED_FRONT, SEGMENT_BYTES};
use crate::Result;

pub(crate) trait Placement: Send + Sync {
    /// Segments of the pool's log address space.
    fn segments(&self, segments_per_device: u64, members: usize) -> u64;
    /// Bytes of each device's segment space a record of `len` bytes takes.
    fn footprint(&self, len: usize) -> usize {
        len
    }
    /// Whether records can be written end to end, one device write per copy and run.
    fn runs_end_to_end(&self) -> bool {
        true
    }
    /// Usable bytes per byte of segment space.
    fn data_per_segment_byte(&self) -> u64 {
        1
    }
    /// The places of the whole copies of the record at `addr`; `None` for a layout that
    /// stripes records (it overrides the three operations below).
    fn copies(&self, red: &Redundancy, addr: u64) -> Option<Places>;

    /// Write a whole record (`Redundancy::write`).
    fn write(&self, red: &Redundancy, addr: u64, data: &[u8]) -> Result<()> {
        red.write_copies(red.copies(addr)?, data)
    }
    /// Read a record back verified, repairing bad copies (`Redundancy::read_verified`).
    fn read_verified(
        &self,
        red: &Redundancy,
        addrs: &[u64],
        len: usize,
        sum: &Checksum,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        red.read_copies(addrs, len, sum, out)
    }
    /// Verify every copy or shard of a record and repair the bad ones (`Redundancy::scrub`).
    fn scrub(
        &self,
        red: &Redundancy,
        addrs: &[u64],
        len: usize,
        sum: &Checksum,
        buf: &mut Vec<u8>,
    ) -> ScrubOutcome {
        red.scrub_copies(addrs, len, sum, buf)
    }
}

pub(super) fn for_layout(layout: Layout) -> Box<dyn Placement> {
    match layout {
        Layout::Single => Box::new(Concat),
        Layout::Mirror(_) => Box::new(Mirror),
        Layout::Parity { k, m } => Box::new(Parity {
            k: k as usize,
            m: m as usize,
        }),
    }
}

fn one_place(member: usize, offset: u64) -> Places {
    let mut p = Places {
        len: 1,
        items: [(0, 0); 8],
    };
    p.items[0] = (member, offset);
    p
}

/// `single`: one copy; the members' segment spaces are concatenated.
struct Concat;

impl Placement for Concat {
    fn segments(&self, segments_per_device: u64, members: usize) -> u64 {
        segments_per_device * members as u64
    }
    fn copies(&self, red: &Redundancy, addr: u64) -> Option<Places> {
        let seg = addr / SEGMENT_BYTES;
        let off = addr % SEGMENT_BYTES;
        let spd = red.segments_per_device;
        Some(one_place(
            (seg / spd) as usize,
            DEVICE_RESERVED_FRONT + (seg % spd) * SEGMENT_BYTES + off,
        ))
    }
}

/// `mirror:N`: a whole copy at the same offset on every member.
struct Mirror;

impl Placement for Mirror {
    fn segments(&self, segments_per_device: u64, _members: usize) -> u64 {
        segments_per_device
    }
    fn copies(&self, red: &Redundancy, addr: u64) -> Option<Places> {
        let seg = addr / SEGMENT_BYTES;
        let off = addr % SEGMENT_BYTES;
        let n = red.members.len();
        let mut p = Places {
            len: n,
            items: [(0, 0); 8],
        };
        // Start reads on a different member per segment to spread load.
        let first = (seg as usize) % n;
        for (i, item) in p.items[..n].iter_mut().enumerate() {
            *item = (
                (first + i) % n,
                DEVICE_RESERVED_FRONT + seg * SEGMENT_BYTES + off,
            );
        }
        Some(p)
    }
}

/// `parity:K+M`: each record striped over K data and M Reed–Solomon parity shards, one
/// per member, at the same offset (`parity` module).
struct Parity {
    k: usize,
    m: usize,
}

impl Placement for Parity {
    fn segments(&self, segments_per_device: u64, _members: usize) -> u64 {
        segments_per_device
    }
    fn footprint(&self, len: usize) -> usize {
        shard_bytes(len, self.k)
    }
    fn runs_end_to_end(&self) -> bool {
        false
    }
    fn data_per_segment_byte(&self) -> u64 {
        self.k as u64
    }
    fn copies(&self, _red: &Redundancy, _addr: u64) -> Option<Places> {
        None
    }
    fn write(&self, red: &Redundancy, addr: u64, data: &[u8]) -> Result<()> {
        red.parity_write(self.k, self.m, addr, data)
    }
    fn read_verified(
        &self,
        red: &Redundancy,
        addrs: &[u64],
        len: usize,
        sum: &Checksum,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        red.parity_read(self.k, self.m, addrs, len, sum, out)
    }
    fn scrub(
        &self,
        red: &Redundancy,
        addrs: &[u64],
        len: usize,
        sum: &Checksum,
        _buf: &mut Vec<u8>,
    ) -> ScrubOutcome {
        red.parity_scrub(self.k, self.m, addrs, len, sum)
    }
}
