//! Reading a device's labels (superblock slots, front and back) without a pool.
//!
//! The newest label of a device is the newest slot `Check` accepts, front or back. When
//! no front slot is readable (both damaged, or the device's first MiB zeroed), the back
//! copies are found where the device's size puts them, then a segment lower at a time
//! (`find_back_region`), and the next two commits write the front slots again.

use crate::constants::*;
use crate::device::Device;

use super::superblock::{Check, Superblock};

/// Read whatever superblock is in the front slots (used to refuse devices already in a pool).
pub fn front_label(dev: &dyn Device) -> Option<Superblock> {
    let mut buf = vec![0u8; SUPERBLOCK_BYTES];
    let mut best: Option<Superblock> = None;
    for off in SUPERBLOCK_SLOT_OFFSETS {
        if dev.read_at(&mut buf, off).is_ok() {
            if let Ok(Some(sb)) = Superblock::decode(&buf, Check::Unkeyed) {
                if best.as_ref().is_none_or(|b| sb.generation > b.generation) {
                    best = Some(sb);
                }
            }
        }
    }
    best
}

pub(crate) fn best_superblock(
    dev: &dyn Device,
    back_region: Option<u64>,
    check: Check,
) -> Option<Superblock> {
    let mut buf = vec![0u8; SUPERBLOCK_BYTES];
    let mut best: Option<Superblock> = None;
    let mut offsets = SUPERBLOCK_SLOT_OFFSETS.to_vec();
    if let Some(b) = back_region {
        offsets.extend(SUPERBLOCK_SLOT_OFFSETS.iter().map(|o| b + o));
    }
    for off in offsets {
        if dev.read_at(&mut buf, off).is_err() {
            continue;
        }
        match Superblock::decode(&buf, check) {
            Ok(Some(sb)) if best.as_ref().is_none_or(|b| sb.generation > b.generation) => {
                best = Some(sb)
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(device = %dev.path().display(), offset = off, "ignoring superblock slot: {e}")
            }
        }
    }
    best
}

/// Where the back copies of `dev`'s labels lie when no front slot says (both damaged, or
/// the device's first MiB zeroed by accident): the back region ends the last whole
/// segment of the device as `pool create` laid it out (a device grown since lays it
/// lower), so it is looked for there and then a segment lower at a time, at most
/// `BACK_SEARCH_SEGMENTS` times. A place counts only where a label that `check` accepts
/// lies and itself puts its back region there. `deep`: look lower than the device's end
/// (import of a pool's own device); else only there (`pool scan` of any disk, where each
/// place looked at is two reads).
pub(crate) fn find_back_region(dev: &dyn Device, check: Check, deep: bool) -> Option<u64> {
    let top = (dev.size() / SEGMENT_BYTES * SEGMENT_BYTES).checked_sub(DEVICE_RESERVED_BACK)?;
    let mut buf = vec![0u8; SUPERBLOCK_BYTES];
    (0..if deep { BACK_SEARCH_SEGMENTS } else { 1 })
        .map_while(|i| {
            top.checked_sub(i * SEGMENT_BYTES)
                .filter(|&b| b > DEVICE_RESERVED_FRONT)
        })
        .find(|&b| {
            SUPERBLOCK_SLOT_OFFSETS.iter().any(|o| {
                dev.read_at(&mut buf, b + o).is_ok()
                    && matches!(Superblock::decode(&buf, check), Ok(Some(sb)) if back_region_of(&sb) == b)
            })
        })
}

/// The newest label of `dev`, where the back region is known (`back`, from the front
/// slots of the pool's devices) or, when it is not, looked for (`find_back_region`).
pub(crate) fn label_front_or_back(
    dev: &dyn Device,
    back: Option<u64>,
    check: Check,
    deep: bool,
) -> Option<Superblock> {
    let back = back.or_else(|| find_back_region(dev, check, deep));
    let sb = best_superblock(dev, back, check)?;
    if best_superblock(dev, None, check).is_none() {
        tracing::warn!(
            device = %dev.path().display(),
            generation = sb.generation,
            "no front label slot of this device is readable: its label was read from the \
             back copies (the next two commits write the front slots again)"
        );
    }
    Some(sb)
}

/// The newest superblock on `dev` (front and back slots).
pub(crate) fn label_of(dev: &dyn Device, back_region: u64, check: Check) -> Option<Superblock> {
    best_superblock(dev, Some(back_region), check)
}

pub(crate) fn back_region_of(sb: &Superblock) -> u64 {
    DEVICE_RESERVED_FRONT + sb.segments_per_device * SEGMENT_BYTES
}
