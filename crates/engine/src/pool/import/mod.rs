//! Import: find the members, pick the newest superblock, rebuild the in-memory state.
//!
//! Import is also crash recovery: whatever the last complete superblock points
//! to is the pool; records written after it are unreferenced and their
//! segments are free. Space accounting is rebuilt by walking every volume's
//! map (bounded by the metadata size). If a map cannot be walked, segments
//! below the high-water mark are never reused in this session, so nothing
//! possibly referenced is overwritten.
//!
//! The phases, each in its own file, in order: `devices` (open what pool.json lists, read
//! the labels, pick the newest, take the members, check the anchor), `recount` (the table
//! and the walk of every map), `replay` (the intent log), `build` (`Core`, and the import's
//! commit).

mod build;
mod devices;
mod recount;
mod replay;

use std::fs::{self, File};
use std::os::unix::io::AsRawFd;
use std::path::Path;

use crate::pool::core::Core;
use crate::pool::format::config::PoolConfig;
use crate::pool::options::OpenOptions;
use crate::{Error, Result};

/// Take the pool's exclusive lock (`DIR/pool.lock`, flock); refused while another process holds it.
pub fn lock_pool(dir: &Path) -> Result<File> {
    PoolConfig::read(dir)?;
    let path = dir.join("pool.lock");
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| Error::device(&path, e))?;
    // SAFETY: flock on a descriptor we own; no memory is touched.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let holder = fs::read_to_string(&path).unwrap_or_default();
        return Err(Error::Busy(format!(
            "pool {} is in use by another bulwark process{}",
            dir.display(),
            if holder.trim().is_empty() {
                String::new()
            } else {
                format!(" (pid {})", holder.trim())
            }
        )));
    }
    f.set_len(0).ok();
    use std::io::Write;
    (&f).write_all(std::process::id().to_string().as_bytes())
        .ok();
    Ok(f)
}

/// Import the pool in `dir`: the phases in order (see the module's doc).
pub fn import(dir: &Path, opts: &OpenOptions) -> Result<Core> {
    let opened = devices::open_devices(dir, opts)?;
    let (opened, mut labels) = devices::read_labels(dir, opts, opened)?;
    let mut members = devices::take_members(dir, opts, &opened, &mut labels)?;
    let (mut store, table, segments) = recount::open_table(
        opts,
        &labels.newest,
        std::mem::take(&mut members.members),
        &members.anchor,
    )?;
    let mut counted = recount::recount(&store, &table, &labels.newest, segments)?;
    let replayed = replay::replay(
        dir,
        opts,
        &opened.conf,
        &labels.newest,
        &labels.log_key,
        &mut store,
        &mut counted,
    )?;
    build::build(
        dir, opts, opened, labels, members, store, &table, counted, replayed,
    )
}
