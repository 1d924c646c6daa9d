//! Human output: `volume list` as `zfs list` prints, `status` as `zpool status` does.
//!
//! Pure functions from protocol results to text, so they can be tested
//! without a daemon. Sizes use `bulwark_engine::size::format_size` (1.50G).
//! One volume table, with the same columns in `volume list` and `status`.

use std::fmt::Write as _;

use bulwark_engine::device::fault::Fault;
use bulwark_engine::pool::format::health::{DataError, ScrubStatus};
use bulwark_engine::pool::keys::SlotInfo;
use bulwark_engine::pool::{LogStatus, SnapshotStatus, VolumeSpace};
use bulwark_engine::size::format_size;
use bulwark_engine::{DeviceStatus, SpaceStatus, VolumeStatus};

use crate::control::{FaultEntry, KeyStatus, ScrubReport, StatusReport, VolumeEntry};

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// Columns padded to their widest cell, separated by two spaces, no trailing blanks.
pub struct Table {
    headers: Vec<&'static str>,
    align: Vec<Align>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(columns: &[(&'static str, Align)]) -> Table {
        Table {
            headers: columns.iter().map(|c| c.0).collect(),
            align: columns.iter().map(|c| c.1).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        assert_eq!(cells.len(), self.headers.len());
        self.rows.push(cells);
    }

    pub fn render(&self, indent: &str) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.len()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let header: Vec<String> = self.headers.iter().map(|h| h.to_string()).collect();
        for row in std::iter::once(&header).chain(&self.rows) {
            let mut line = String::from(indent);
            for (i, cell) in row.iter().enumerate() {
                if i > 0 {
                    line.push_str("  ");
                }
                let pad = widths[i] - cell.chars().count();
                match self.align[i] {
                    Align::Left => {
                        line.push_str(cell);
                        line.extend(std::iter::repeat_n(' ', pad));
                    }
                    Align::Right => {
                        line.extend(std::iter::repeat_n(' ', pad));
                        line.push_str(cell);
                    }
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// `volume list`: the volume table (see `volumes_table`).
pub fn volume_table(volumes: &[VolumeEntry]) -> String {
    if volumes.is_empty() {
        return "no volumes\n".to_string();
    }
    volumes_table(volumes.iter().map(|v| (&v.volume, v.attached)), "")
}

/// The one volume table, in `volume list` and under `volumes:` in `status`:
/// NAME SIZE USED BLOCKSIZE COMPRESS ENCRYPTION KEY KEYGEN SLOTS ATTACHED ORIGIN.
/// KEY says what `zfs get keystatus` says (`available`, `unavailable`), or
/// `erased` (no key slot left), or `-` for a plain volume; ATTACHED counts
/// NBD connections.
fn volumes_table<'a>(
    rows: impl Iterator<Item = (&'a VolumeStatus, usize)>,
    indent: &str,
) -> String {
    use Align::*;
    let mut t = Table::new(&[
        ("NAME", Left),
        ("SIZE", Right),
        ("USED", Right),
        ("BLOCKSIZE", Right),
        ("COMPRESS", Left),
        ("ENCRYPTION", Left),
        ("KEY", Left),
        ("KEYGEN", Left),
        ("SLOTS", Right),
        ("ATTACHED", Right),
        ("ORIGIN", Left),
    ]);
    for (v, attached) in rows {
        let key = match KeyStatus::of(v) {
            KeyStatus::Unavailable if v.key_slots == 0 => "erased",
            KeyStatus::None => "-",
            status => status.as_str(),
        };
        let (keygen, slots) = key_cells(v);
        t.row(vec![
            v.name.clone(),
            format_size(v.size_bytes),
            format_size(v.used_bytes),
            format_size(v.block_size as u64),
            v.compression.clone(),
            on_off(v.encryption).to_string(),
            key.to_string(),
            keygen,
            slots,
            attached.to_string(),
            v.origin.clone().unwrap_or_else(|| "-".to_string()),
        ]);
    }
    t.render(indent)
}

/// `volume create`: one line about the new volume.
pub fn volume_created(v: &VolumeStatus) -> String {
    let key = match KeyStatus::of(v) {
        KeyStatus::Available => ", key loaded",
        KeyStatus::Unavailable => ", locked",
        KeyStatus::None => "",
    };
    format!(
        "created volume {}: {}, block size {}, compression {}, encryption {}{}\n",
        v.name,
        format_size(v.size_bytes),
        format_size(v.block_size as u64),
        v.compression,
        on_off(v.encryption),
        key,
    )
}

/// The KEYGEN and SLOTS cells of a volume: the data key generation new writes
/// use ("2, rotating 40%" while older blocks are re-encrypted, "erased" after a
/// crypto-erase) and the number of key slots; "-" for a volume without encryption.
fn key_cells(v: &VolumeStatus) -> (String, String) {
    if !v.encryption {
        return ("-".into(), "-".into());
    }
    if v.key_slots == 0 {
        return ("erased".into(), "0".into());
    }
    let paused = v.rotation.as_ref().is_some_and(|r| r.error.is_some());
    let keygen = match rotation_progress(v) {
        Some(p) if paused && !v.locked => format!("{}, rotating {p} (paused)", v.key_generation),
        Some(p) => format!("{}, rotating {p}", v.key_generation),
        None => v.key_generation.to_string(),
    };
    (keygen, v.key_slots.to_string())
}

/// How far a key rotation has walked the volume ("40%"), if one is running.
/// Counted in logical blocks examined, which always ends at 100%.
pub fn rotation_progress(v: &VolumeStatus) -> Option<String> {
    let r = v.rotation.as_ref()?;
    let blocks = (v.size_bytes / u64::from(v.block_size.max(1))).max(1);
    Some(format!("{}%", r.lba.min(blocks) * 100 / blocks))
}

/// Why a key rotation of an unlocked volume is paused and what resumes it, if it is paused:
/// ("the pool is out of space", "it goes on by itself once space is free, ...").
pub fn rotation_pause(v: &VolumeStatus) -> Option<(String, String)> {
    let r = v.rotation.as_ref()?;
    let reason = r.error.clone()?;
    let hint = if r.retrying {
        format!(
            "it goes on by itself once space is free, or tries again at once with \
             'bulwark key rotate {}'",
            v.name
        )
    } else {
        format!("'bulwark key rotate {}' resumes it", v.name)
    };
    Some((reason, hint))
}

/// `status` lines about key rotations in progress (empty when there are none).
fn rotation_lines(volumes: &[VolumeStatus]) -> String {
    let mut out = String::new();
    for v in volumes {
        let (Some(r), Some(p)) = (&v.rotation, rotation_progress(v)) else {
            continue;
        };
        let head = format!(
            "rotation: volume {} to data key generation {}",
            v.name, r.to_generation
        );
        let progress = format!("{p} examined, {} block(s) re-encrypted", r.blocks_done);
        let _ = match (v.locked, rotation_pause(v)) {
            (true, _) => writeln!(out, "{head}, paused until its key is loaded: {progress}"),
            (false, Some((reason, hint))) => {
                writeln!(out, "{head}, paused: {reason} ({progress}); {hint}")
            }
            (false, None) => writeln!(out, "{head}, in progress: {progress}"),
        };
    }
    out
}

/// `key list`: SLOT KIND KDF, nothing secret.
pub fn key_slot_table(slots: &[SlotInfo]) -> String {
    if slots.is_empty() {
        return "no key slots (the keys were erased)\n".to_string();
    }
    use Align::*;
    let mut t = Table::new(&[("SLOT", Right), ("KIND", Left), ("KDF", Left)]);
    for s in slots {
        t.row(vec![
            s.slot.to_string(),
            s.kind.clone(),
            s.argon2.clone().unwrap_or_else(|| "hkdf-sha256".into()),
        ]);
    }
    t.render("")
}

/// `status`: pool header, device table, repair counters, space, volumes, errors.
/// `status`'s lines about space: used, free, reserved, overcommit, holes, the cleaner.
fn space_lines(out: &mut String, space: &SpaceStatus) {
    let thick = if space.thick_reserved_bytes > 0 {
        format!(
            ", {} reserved by thick volumes",
            format_size(space.thick_reserved_bytes)
        )
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "space: {} used, {} free, {} total ({} reserved for commits and cleaning{thick})",
        format_size(space.used_bytes),
        format_size(space.free_bytes),
        format_size(space.total_bytes),
        format_size(space.reserved_bytes),
    );
    if let Some(line) = overcommit_line(space) {
        let _ = writeln!(out, "{line}");
    }
    if space.hole_bytes > 0 {
        let _ = writeln!(
            out,
            "holes: {} free in {} extents of partly-used segments, {} in extents of 64K or \
             more (filled by writes when free segments run short)",
            format_size(space.hole_bytes),
            space.holes,
            format_size(space.hole_large_bytes)
        );
    }
    if space.defrag_moved_bytes > 0 {
        let _ = writeln!(
            out,
            "defragmented: {} rewritten in block order while idle, {} pass(es) over every \
             volume since the daemon started",
            format_size(space.defrag_moved_bytes),
            space.defrag_passes
        );
    }
    if space.clean_cost >= 0.05 {
        let _ = writeln!(
            out,
            "cleaner cost: {:.2} bytes of map nodes per byte moved (random small writes: \
             writes that need new space may be refused before {} is used, when no segment \
             is empty enough for cleaning it to gain)",
            space.clean_cost,
            format_size(space.usable_bytes)
        );
    }
    if let Some(why) = &space.cleaning {
        let _ = writeln!(out, "cleaning: {why}");
    }
    if let Some(r) = &space.last_refusal {
        let _ = writeln!(
            out,
            "refused: {} write(s) got ENOSPC after waiting for space since the daemon started; \
             the last at {}: {} ({} free segments)",
            space.refused_writes,
            date(r.unix_secs),
            r.reason,
            r.free_segments
        );
    }
}

pub fn status_text(report: &StatusReport) -> String {
    let p = &report.pool;
    let d = &report.daemon;
    let mut out = String::new();
    if p.name.is_empty() {
        let _ = writeln!(out, "  pool: {}", p.pool_id);
    } else {
        let _ = writeln!(out, "  pool: {}", p.name);
        let _ = writeln!(out, "    id: {}", p.pool_id);
    }
    let _ = writeln!(out, "   dir: {}", p.dir.display());
    let _ = writeln!(out, " state: {}", p.state);
    let _ = writeln!(out, "layout: {}", p.layout);
    let _ = writeln!(out, "   gen: {}", p.generation);
    let mut exports = format!("nbd+unix:///NAME?socket={}", d.nbd_socket.display());
    if let Some(tcp) = &d.nbd_tcp {
        let _ = write!(exports, ", nbd://{tcp}/NAME");
    }
    let _ = writeln!(out, "export: {exports}");
    out.push_str(&device_advice(report));
    let _ = writeln!(out, "  scan: {}", scan_line(&p.scrub));
    let _ = writeln!(out, "config:\n");

    out.push_str(&vdev_table(&p.layout, &p.state, &p.devices));
    out.push('\n');
    if let Some(c) = &p.cache_device {
        out.push_str(&cache_device_text(c));
    }
    if let Some(log) = &p.log {
        out.push_str(&log_text(log));
    }
    if let Some(t) = &report.trust_root {
        let _ = writeln!(
            out,
            "trust root: {} ({})\n\tkey: {}\n\tanchor: {}",
            t.dir.display(),
            if t.key_dir {
                "--key-dir, apart from the pool directory"
            } else {
                "the pool directory: keep a copy of the key off the devices' disk"
            },
            t.key.display(),
            t.anchor.display()
        );
    }
    if let Some(t) = &p.object_store {
        let _ = writeln!(
            out,
            "object store: {}\n\tstate: {}, epoch {}, generation {}, writer '{}', flush {}\n\t{} \
             segments in {} parts",
            t.url,
            match (t.state.as_str(), t.fenced.is_some()) {
                ("", true) => "FENCED",
                ("", false) => "HELD",
                (s, _) => s,
            },
            t.epoch,
            t.generation,
            t.writer,
            t.flush,
            t.segments_stored,
            t.parts
        );
        out.push_str(&store_health_text(t));
        let r = &t.requests;
        let _ = writeln!(
            out,
            "\trequests this run: {} PUT ({} up), {} GET ({} down), {} DELETE, {} LIST; {} \
             objects collected\n",
            r.puts,
            format_size(r.bytes_up),
            r.gets,
            format_size(r.bytes_down),
            r.deletes,
            r.lists,
            t.collected
        );
        if let Some(c) = &t.cache {
            let _ = writeln!(
                out,
                "\tlocal cache: {} of {} on the local devices; {} segments in the store only \
                 ({} given back, {} brought back this run)",
                format_size(c.local_bytes),
                format_size(c.limit_bytes),
                c.evicted_segments,
                c.evicted_total,
                c.refilled_total
            );
            if c.paced_writes > 0 {
                let _ = writeln!(
                    out,
                    "\tlocal cache: {} writes waited {:.1}s in all for the store to take room back",
                    c.paced_writes, c.paced_seconds
                );
            }
        }
        if t.remote_reads > 0 || t.healed_from_store > 0 {
            let _ = writeln!(
                out,
                "\treads from the store this run: {} ({} fetched, {} reads served by read-ahead); \
                 {} records no local copy verified\n",
                t.remote_reads,
                format_size(t.remote_read_bytes),
                t.read_ahead_hits,
                t.healed_from_store
            );
        }
        if let Some(f) = &t.fenced {
            let _ = writeln!(out, "\t{f}\n");
        }
    }

    if !report.faults.is_empty() {
        let _ = writeln!(
            out,
            "faults: injected on purpose; 'bulwark fault clear' disarms them\n"
        );
        for line in fault_table(&report.faults).lines() {
            let _ = writeln!(out, "\t{line}");
        }
        out.push('\n');
    }

    let _ = writeln!(out, "repaired blocks: {}", p.repaired_blocks);
    // Counted per read (a client's, a scrub's) that found no good copy: the same bad
    // block read four times counts four. The ranges themselves are under `errors:`.
    let _ = writeln!(
        out,
        "unrecoverable reads: {} (reads that found no good copy; the ranges are under errors:)",
        p.unrecoverable_blocks
    );
    space_lines(&mut out, &p.space);
    out.push('\n');

    if p.volumes.is_empty() {
        let _ = writeln!(out, "volumes: none");
    } else {
        let _ = writeln!(out, "volumes:\n");
        let rows = p
            .volumes
            .iter()
            .map(|v| (v, d.attached.get(&v.name).copied().unwrap_or(0)));
        out.push_str(&volumes_table(rows, "\t"));
        let rotations = rotation_lines(&p.volumes);
        if !rotations.is_empty() {
            out.push('\n');
            out.push_str(&rotations);
        }
    }
    out.push('\n');

    out.push_str(&errors_text(&p.errors));
    if let Some(lost) = &p.lost_flushes {
        let _ = writeln!(
            out,
            "\tintent log: {lost} (taken with serve --accept-log-loss)"
        );
    }
    out
}

/// A group of devices as zpool shows them: its name and state on the first row, then
/// each device with its error counters.
fn vdev_table(top: &str, state: &str, devices: &[DeviceStatus]) -> String {
    use Align::*;
    let mut t = Table::new(&[
        ("NAME", Left),
        ("STATE", Left),
        ("READ", Right),
        ("WRITE", Right),
        ("CKSUM", Right),
    ]);
    t.row(vec![
        top.to_string(),
        state.to_string(),
        String::new(),
        String::new(),
        String::new(),
    ]);
    for dev in devices {
        t.row(vec![
            format!("  {}", dev.path.display()),
            dev.state.clone(),
            dev.read_errors.to_string(),
            dev.write_errors.to_string(),
            dev.cksum_errors.to_string(),
        ]);
    }
    t.render("\t")
}

/// The separate intent log devices under `logs:`, as zpool shows them, with why the log
/// fell back, or what the import could not replay.
pub fn log_text(log: &LogStatus) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "logs:\n");
    let top = if log.devices.len() > 1 {
        "mirror"
    } else {
        "log"
    };
    out.push_str(&vdev_table(top, &log.state, &log.devices));
    if let Some(note) = &log.note {
        let _ = writeln!(out, "\tnote: {note}");
    }
    out.push('\n');
    out
}

/// "provisioned 12G on 4.00G usable: 3.0x overcommitted", when the volumes' sizes add
/// up to more than the pool's live data may fill; `None` otherwise.
pub fn overcommit_line(space: &SpaceStatus) -> Option<String> {
    if space.usable_bytes == 0 || space.provisioned_bytes <= space.usable_bytes {
        return None;
    }
    let ratio = space.provisioned_bytes as f64 / space.usable_bytes as f64;
    // Past 1000x the exact ratio says nothing more (a 10T thin volume on a small pool).
    let ratio = if ratio >= 1000.0 {
        "over 1000x".to_string()
    } else {
        format!("{ratio:.1}x")
    };
    Some(format!(
        "provisioned {} on {} usable: {ratio} overcommitted",
        format_size(space.provisioned_bytes),
        format_size(space.usable_bytes),
    ))
}

/// For each device not ONLINE, what it means and what to do (zpool's status/action).
fn device_advice(report: &StatusReport) -> String {
    let mut out = String::new();
    for dev in &report.pool.devices {
        let path = dev.path.display();
        let faulted = dev
            .fault
            .as_ref()
            .map(|why| format!("is no longer used: {why}"));
        let (status, action) = match dev.state.as_str() {
            "UNAVAIL" => (
                "is missing, cannot be opened or missed writes while it was away; \
                 the pool runs without it",
                format!(
                    "if it is back, 'bulwark device online {path}' resilvers it; \
                     'bulwark device replace {path} NEW' rebuilds its copies on a new device"
                ),
            ),
            "FAULTED" => (
                faulted
                    .as_deref()
                    .unwrap_or("failed I/O and is no longer used"),
                format!(
                    "'bulwark device online {path}' tries it again, \
                     'bulwark device replace {path} NEW' replaces it"
                ),
            ),
            "OFFLINE" => (
                "was taken offline",
                format!("'bulwark device online {path}' brings it back up to date"),
            ),
            "DEGRADED" => (
                "had read or checksum errors (bad copies are repaired from good ones)",
                "'bulwark scrub --wait' verifies and repairs every copy".to_string(),
            ),
            "RESILVERING" => ("is being resilvered", String::new()),
            _ => continue,
        };
        let _ = writeln!(out, "status: device {path} {status}");
        if !action.is_empty() {
            let _ = writeln!(out, "action: {action}");
        }
    }
    out
}

/// The `scan:` line of `status` (continuation lines start with a tab), as zpool words it.
pub fn scan_line(s: &ScrubStatus) -> String {
    let line = scan_line_local(s);
    match (&s.store, s.state.as_str()) {
        (Some(c), "scanning" | "paused" | "finished" | "canceled") => format!(
            "{line}\n\tobject store copies: {} verified, {} bad, {} written again from the \
             local copy",
            c.verified, c.bad, c.rewritten
        ),
        _ => line,
    }
}

fn scan_line_local(s: &ScrubStatus) -> String {
    let kind = s.kind.as_str();
    match s.state.as_str() {
        "none" | "" => "none requested".into(),
        "scanning" => {
            let onto = match (&s.device, kind) {
                (Some(d), "resilver") => format!(" onto {}", d.display()),
                _ => String::new(),
            };
            format!(
                "{kind} in progress since {}{onto}\n\t{} done, {}/s, {} to go, {} repaired, {} unrecoverable",
                date(s.started_unix),
                done_of_total(s),
                format_size(s.rate_bytes_per_sec),
                s.eta_seconds.map(duration).unwrap_or_else(|| "unknown".into()),
                s.repaired,
                s.unrecoverable,
            )
        }
        "paused" => format!(
            "{kind} paused at {}, {} repaired, {} unrecoverable; 'bulwark scrub resume' continues it",
            done_of_total(s),
            s.repaired,
            s.unrecoverable
        ),
        "finished" => format!(
            "{kind} repaired {} in {} with {} errors on {}",
            s.repaired,
            duration(s.finished_unix.saturating_sub(s.started_unix)),
            s.unrecoverable,
            date(s.finished_unix)
        ),
        "canceled" => format!(
            "{kind} canceled on {} at {}, {} repaired, {} unrecoverable",
            date(s.finished_unix),
            done_of_total(s),
            s.repaired,
            s.unrecoverable
        ),
        other => format!("{kind} {other}"),
    }
}

/// "1.20G of 4.00G (30.0%)".
pub fn done_of_total(s: &ScrubStatus) -> String {
    let total = s.bytes_total.max(s.bytes_done);
    let pct = if total == 0 {
        100.0
    } else {
        s.bytes_done as f64 * 100.0 / total as f64
    };
    format!(
        "{} of {} ({pct:.1}%)",
        format_size(s.bytes_done),
        format_size(total)
    )
}

/// The `cache:` section: the cache device, its fill and its counters.
pub fn cache_device_text(c: &bulwark_engine::cachedev::CacheDeviceStatus) -> String {
    let mut out = String::new();
    let _ = writeln!(out, " cache: {} {}", c.path.display(), c.state);
    if let Some(why) = &c.reason {
        let _ = writeln!(out, "\t{why} (the pool serves without it)");
    } else {
        let _ = writeln!(
            out,
            "\tsize {}, used {} ({} records); hits {}, misses {}, hit rate {:.1}%",
            format_size(c.size_bytes),
            format_size(c.used_bytes),
            c.entries,
            c.hits,
            c.misses,
            c.hit_rate * 100.0
        );
        let _ = writeln!(
            out,
            "\terrors detected {} (copies that failed their checksum, read from the pool \
             instead); read errors {}, write errors {}",
            c.errors, c.read_errors, c.write_errors
        );
    }
    out.push('\n');
    out
}

/// The `errors:` section: each unrecoverable range as `VOLUME: bytes FIRST-LAST (kind)`,
/// ranges of one volume and kind that touch or overlap shown as one (the pool keeps
/// one per block: a bad disk region would otherwise print thousands of lines).
pub fn errors_text(errors: &[DataError]) -> String {
    if errors.is_empty() {
        return "errors: No known data errors\n".into();
    }
    let merged = merge_ranges(errors);
    let mut out = format!(
        "errors: {} range(s) with no good copy: reads of them fail with EIO, never return wrong bytes\n\n",
        merged.len()
    );
    for e in &merged {
        let _ = writeln!(out, "\t{}", error_range(e));
    }
    out
}

/// `errors` sorted by volume, kind and offset, with touching or overlapping ranges of
/// the same volume and kind joined.
fn merge_ranges(errors: &[DataError]) -> Vec<DataError> {
    let mut sorted: Vec<&DataError> = errors.iter().collect();
    sorted.sort_by(|a, b| (&a.volume, &a.kind, a.offset).cmp(&(&b.volume, &b.kind, b.offset)));
    let mut out: Vec<DataError> = Vec::new();
    for e in sorted {
        match out.last_mut() {
            Some(last)
                if last.volume == e.volume
                    && last.kind == e.kind
                    && e.offset <= last.offset + last.length =>
            {
                let end = (last.offset + last.length).max(e.offset + e.length);
                last.length = end - last.offset;
            }
            _ => out.push(e.clone()),
        }
    }
    out
}

/// `vol: bytes 40960-45055 (data)`: the first and last byte, inclusive.
pub fn error_range(e: &DataError) -> String {
    format!(
        "{}: bytes {}-{} ({})",
        e.volume,
        e.offset,
        e.offset + e.length.max(1) - 1,
        e.kind
    )
}

/// `scrub status`: the scan line and the errors.
pub fn scrub_report_text(r: &ScrubReport) -> String {
    format!(
        "  scan: {}\n{}",
        scan_line(&r.scrub),
        errors_text(&r.errors)
    )
}

/// `fault list`: DEVICE MODE PROBABILITY SEED LABELS.
pub fn fault_table(entries: &[FaultEntry]) -> String {
    if entries.is_empty() {
        return "no faults armed\n".into();
    }
    use Align::*;
    let mut t = Table::new(&[
        ("DEVICE", Left),
        ("MODE", Left),
        ("PROBABILITY", Right),
        ("SEED", Right),
        ("LABELS", Left),
    ]);
    for e in entries {
        for f in &e.faults {
            t.row(vec![
                e.device.display().to_string(),
                fault_mode(f),
                f.probability.to_string(),
                f.seed.to_string(),
                if f.include_labels { "yes" } else { "no" }.to_string(),
            ]);
        }
    }
    t.render("")
}

/// A fault's mode as the CLI spells it (read-flip, vanish, ...).
pub fn fault_mode(f: &Fault) -> String {
    serde_json::to_value(f.mode)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{:?}", f.mode))
}

/// `snapshot list`: NAME USED REFER CREATED HOLDS (as `zfs list -t snapshot`; USED is
/// what destroying the snapshot frees).
pub fn snapshot_table(snaps: &[SnapshotStatus]) -> String {
    if snaps.is_empty() {
        return "no snapshots\n".to_string();
    }
    use Align::*;
    let mut t = Table::new(&[
        ("NAME", Left),
        ("USED", Right),
        ("REFER", Right),
        ("CREATED", Left),
        ("HOLDS", Left),
    ]);
    for s in snaps {
        t.row(vec![
            s.name.clone(),
            format_size(s.used_bytes),
            format_size(s.referenced_bytes),
            date(s.created),
            if s.holds.is_empty() {
                "-".to_string()
            } else {
                s.holds.join(",")
            },
        ]);
    }
    t.render("")
}

/// `volume list --space`: NAME USED REFER USEDSNAP WRITTEN SNAPSHOTS (as
/// `zfs list -o space`, stored data bytes, one copy).
pub fn space_table(vols: &[VolumeSpace]) -> String {
    if vols.is_empty() {
        return "no volumes\n".to_string();
    }
    use Align::*;
    let mut t = Table::new(&[
        ("NAME", Left),
        ("USED", Right),
        ("REFER", Right),
        ("USEDSNAP", Right),
        ("WRITTEN", Right),
        ("SNAPSHOTS", Right),
    ]);
    for v in vols {
        t.row(vec![
            v.name.clone(),
            format_size(v.used_bytes),
            format_size(v.referenced_bytes),
            format_size(v.used_by_snapshots_bytes),
            format_size(v.written_bytes),
            v.snapshots.to_string(),
        ]);
    }
    t.render("")
}

/// Seconds as H:MM:SS.
pub fn duration(secs: u64) -> String {
    format!("{}:{:02}:{:02}", secs / 3600, secs / 60 % 60, secs % 60)
}

/// The object store's health under its `state:` line: since when commits fail and why,
/// the last commit it took, how far it lags, the failed requests by cause.
fn store_health_text(t: &bulwark_engine::pool::tier::TierStatus) -> String {
    let mut out = String::new();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let ago = |at: u64| format!("{} ({}s ago)", date(at), now.saturating_sub(at));
    if let Some(since) = t.failing_since {
        let what = if t.state == "UNREACHABLE" {
            "not answering since the pool was imported; commits stay on the local devices until \
             it does"
        } else {
            "commits failing"
        };
        let _ = writeln!(out, "\t{what}: since {}", ago(since));
        if let Some(e) = &t.last_error {
            let _ = writeln!(out, "\tlast error: {e}");
        }
        let _ = writeln!(
            out,
            "\taction: the pool serves on and retries; check the store, its credentials and \
             the network (docs/runbook.md, \"object store\")"
        );
    }
    let last = t
        .last_commit
        .map(ago)
        .unwrap_or_else(|| "none yet in this run".into());
    let _ = write!(
        out,
        "\tlast commit in the store: {last}; {} commits reached it, {} failed",
        t.commits_ok, t.commits_failed
    );
    if t.lag_bytes > 0 {
        let _ = write!(
            out,
            "; it lacks {} written since {:.0}s",
            format_size(t.lag_bytes),
            t.lag_seconds
        );
    }
    out.push('\n');
    if !t.request_errors.is_empty() {
        let errs: Vec<String> = t
            .request_errors
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        let _ = writeln!(out, "\tfailed requests this run: {}", errs.join(", "));
    }
    out
}

/// A unix time in local time, as zpool prints it: "Sat Nov 22 02:24:56 2025".
pub fn date(unix: u64) -> String {
    let t = unix as libc::time_t;
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    let mut buf = [0u8; 64];
    // SAFETY: localtime_r and strftime write only into the buffers given, sized here.
    let n = unsafe {
        if libc::localtime_r(&t, &mut tm).is_null() {
            return format!("@{unix}");
        }
        libc::strftime(
            buf.as_mut_ptr().cast(),
            buf.len(),
            c"%a %b %e %H:%M:%S %Y".as_ptr(),
            &tm,
        )
    };
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// What `volume clone` prints about the new key (issue 41 part 4): the clone holds
/// copies of the origin's data keys up to the clone, which open more than the snapshot.
pub fn clone_key_note(name: &str, origin: &str, independent: bool) -> String {
    let vol = origin.split('@').next().unwrap_or(origin);
    let reach = format!(
        "copies of {vol}'s data keys up to the clone: with it and the device files one can \
         read everything {vol} held until the clone, not only {origin} (blocks of {vol} \
         overwritten after the snapshot, and its newer snapshots, included; \
         docs/security.md, \"Clones and their keys\")"
    );
    if independent {
        format!(
            "note: until its rewrite is done, {name}'s key holds {reach}\nnote: \
             --independent drops those keys once every inherited block is re-encrypted under \
             {name}'s own key; then it holds only what {origin} holds ('bulwark volume get \
             {name} originkeys' shows - then)\n"
        )
    } else {
        format!(
            "note: {name}'s key holds {reach}\nnote: to hold only what {origin} holds, clone \
             with --independent (or run 'bulwark key rotate {name}'): after the rewrite the \
             inherited keys are destroyed\n"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::DaemonInfo;
    use bulwark_engine::pool::format::health::DataErrorKind;
    use bulwark_engine::{DeviceStatus, PoolStatus, SpaceStatus};

    fn vol(name: &str, encryption: bool, locked: bool) -> VolumeStatus {
        VolumeStatus {
            name: name.into(),
            size_bytes: 1 << 30,
            block_size: 4096,
            compression: "lz4".into(),
            encryption,
            locked,
            used_bytes: 3 << 19,
            key_slots: usize::from(encryption),
            ..Default::default()
        }
    }

    #[test]
    fn key_generation_slots_and_rotation_read_plainly() {
        let mut v = vol("r", true, false);
        v.key_generation = 2;
        v.key_slots = 3;
        v.rotation = Some(bulwark_engine::pool::rotate::Rotation {
            to_generation: 2,
            lba: 1 << 17,
            blocks_done: 1000,
            blocks_total: 4000,
            ..Default::default()
        });
        assert_eq!(rotation_progress(&v).as_deref(), Some("50%"));
        assert_eq!(key_cells(&v), ("2, rotating 50%".into(), "3".into()));
        assert_eq!(
            rotation_lines(std::slice::from_ref(&v)),
            "rotation: volume r to data key generation 2, in progress: 50% examined, \
             1000 block(s) re-encrypted\n"
        );
        v.rotation.as_mut().unwrap().error = Some("the pool is out of space".into());
        v.rotation.as_mut().unwrap().retrying = true;
        assert_eq!(
            key_cells(&v),
            ("2, rotating 50% (paused)".into(), "3".into())
        );
        assert_eq!(
            rotation_lines(std::slice::from_ref(&v)),
            "rotation: volume r to data key generation 2, paused: the pool is out of space \
             (50% examined, 1000 block(s) re-encrypted); it goes on by itself once space is \
             free, or tries again at once with 'bulwark key rotate r'\n"
        );
        // A reason with "; " of its own is printed whole before the progress.
        v.rotation.as_mut().unwrap().error =
            Some("corrupt: key rotation: bad node; run a scrub".into());
        v.rotation.as_mut().unwrap().retrying = false;
        assert_eq!(
            rotation_lines(std::slice::from_ref(&v)),
            "rotation: volume r to data key generation 2, paused: corrupt: key rotation: bad \
             node; run a scrub (50% examined, 1000 block(s) re-encrypted); 'bulwark key rotate r' \
             resumes it\n"
        );
        v.locked = true;
        assert_eq!(key_cells(&v), ("2, rotating 50%".into(), "3".into()));
        assert_eq!(
            rotation_lines(std::slice::from_ref(&v)),
            "rotation: volume r to data key generation 2, paused until its key is loaded: \
             50% examined, 1000 block(s) re-encrypted\n"
        );
        let mut erased = vol("e", true, true);
        erased.key_slots = 0;
        assert_eq!(key_cells(&erased), ("erased".into(), "0".into()));

        let slots = vec![
            SlotInfo {
                slot: 0,
                kind: "key_file".into(),
                argon2: None,
            },
            SlotInfo {
                slot: 1,
                kind: "passphrase".into(),
                argon2: Some("argon2id m=65536KiB t=3 p=1".into()),
            },
        ];
        assert_eq!(
            key_slot_table(&slots),
            "SLOT  KIND        KDF\n   0  key_file    hkdf-sha256\n   1  passphrase  argon2id m=65536KiB t=3 p=1\n"
        );
    }

    #[test]
    fn volume_table_aligns_columns() {
        let rows: Vec<VolumeEntry> = [
            vol("alpha", true, false),
            vol("b", true, true),
            vol("plain", false, false),
        ]
        .into_iter()
        .map(|v| VolumeEntry {
            key_status: KeyStatus::of(&v),
            attached: if v.name == "alpha" { 2 } else { 0 },
            volume: v,
        })
        .collect();
        let text = volume_table(&rows);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "NAME   SIZE   USED  BLOCKSIZE  COMPRESS  ENCRYPTION  KEY          KEYGEN  SLOTS  ATTACHED  ORIGIN"
        );
        assert_eq!(
            lines[1],
            "alpha    1G  1.50M         4K  lz4       on          available    0           1         2  -"
        );
        assert_eq!(
            lines[2],
            "b        1G  1.50M         4K  lz4       on          unavailable  0           1         0  -"
        );
        assert_eq!(
            lines[3],
            "plain    1G  1.50M         4K  lz4       off         -            -           -         0  -"
        );
    }

    #[test]
    fn status_reads_like_zpool() {
        let report = StatusReport {
            pool: PoolStatus {
                pool_id: "abc".into(),
                name: "tank".into(),
                dir: "/p".into(),
                state: "ONLINE".into(),
                layout: "mirror:2".into(),
                generation: 7,
                devices: vec![
                    DeviceStatus {
                        path: "/p/dev0".into(),
                        state: "ONLINE".into(),
                        read_errors: 0,
                        write_errors: 0,
                        cksum_errors: 12,
                        size_bytes: 1 << 28,
                        fault: None,
                    },
                    DeviceStatus {
                        path: "/p/dev1".into(),
                        state: "ONLINE".into(),
                        read_errors: 0,
                        write_errors: 0,
                        cksum_errors: 0,
                        size_bytes: 1 << 28,
                        fault: None,
                    },
                ],
                repaired_blocks: 12,
                unrecoverable_blocks: 0,
                space: SpaceStatus {
                    total_bytes: 1 << 28,
                    used_bytes: 1 << 20,
                    free_bytes: 251 << 20,
                    reserved_bytes: 4 << 20,
                    usable_bytes: 200 << 20,
                    provisioned_bytes: 600 << 20,
                    ..Default::default()
                },
                volumes: vec![vol("v", true, true)],
                scrub: scrub(),
                errors: Vec::new(),
                cache_device: None,
                log: Some(LogStatus {
                    state: "FELL_BACK".into(),
                    devices: vec![DeviceStatus {
                        path: "/nvme/log".into(),
                        state: "FAULTED".into(),
                        write_errors: 1,
                        ..Default::default()
                    }],
                    note: Some("the intent log fell back".into()),
                }),
                object_store: None,
                lost_flushes: None,
            },
            daemon: DaemonInfo {
                version: "0".into(),
                pid: 1,
                nbd_socket: "/p/nbd.sock".into(),
                nbd_tcp: None,
                attached: Default::default(),
                fault_injection: false,
            },
            faults: Vec::new(),
            trust_root: None,
        };
        let text = status_text(&report);
        assert!(
            text.contains("\tNAME       STATE   READ  WRITE  CKSUM\n"),
            "{text}"
        );
        assert!(
            text.contains("\t  /p/dev0  ONLINE     0      0     12\n"),
            "{text}"
        );
        assert!(
            text.contains("logs:\n\n\tNAME         STATE      READ  WRITE  CKSUM\n\tlog          FELL_BACK\n\t  /nvme/log  FAULTED       0      1      0\n\tnote: the intent log fell back\n"),
            "{text}"
        );
        assert!(text.contains("repaired blocks: 12\n"));
        assert!(text.contains(
            "space: 1M used, 251M free, 256M total (4M reserved for commits and cleaning)\n"
        ));
        assert!(text.starts_with("  pool: tank\n    id: abc\n"), "{text}");
        assert!(
            text.contains("provisioned 600M on 200M usable: 3.0x overcommitted\n"),
            "{text}"
        );
        let huge = SpaceStatus {
            provisioned_bytes: 10 << 40,
            usable_bytes: 200 << 20,
            ..SpaceStatus::default()
        };
        assert_eq!(
            overcommit_line(&huge).unwrap(),
            "provisioned 10T on 200M usable: over 1000x overcommitted"
        );
        assert!(text.contains(" unavailable "), "{text}");
        assert!(text.ends_with("errors: No known data errors\n"));
        assert!(text.contains("  scan: none requested\n"), "{text}");
        assert!(!text.contains("status:"), "{text}");
    }

    fn scrub() -> ScrubStatus {
        ScrubStatus {
            state: "none".into(),
            kind: "scrub".into(),
            device: None,
            bytes_done: 0,
            bytes_total: 0,
            rate_bytes_per_sec: 0,
            eta_seconds: None,
            repaired: 0,
            unrecoverable: 0,
            started_unix: 0,
            finished_unix: 0,
            store: None,
        }
    }

    #[test]
    fn scan_line_reads_like_zpool() {
        let mut s = scrub();
        s.state = "scanning".into();
        s.bytes_done = 1 << 30;
        s.bytes_total = 4 << 30;
        s.rate_bytes_per_sec = 100 << 20;
        s.eta_seconds = Some(3725);
        s.repaired = 3;
        let line = scan_line(&s);
        assert!(line.starts_with("scrub in progress since "), "{line}");
        assert!(
            line.ends_with(
                "\n\t1G of 4G (25.0%) done, 100M/s, 1:02:05 to go, 3 repaired, 0 unrecoverable"
            ),
            "{line}"
        );
        s.state = "finished".into();
        s.started_unix = 1_000_000;
        s.finished_unix = 1_000_075;
        s.unrecoverable = 2;
        let line = scan_line(&s);
        assert!(
            line.starts_with("scrub repaired 3 in 0:01:15 with 2 errors on "),
            "{line}"
        );
        s.kind = "resilver".into();
        s.state = "scanning".into();
        s.device = Some("/p/dev2".into());
        assert!(scan_line(&s).starts_with("resilver in progress since "));
        assert!(scan_line(&s).contains(" onto /p/dev2\n"));
    }

    #[test]
    fn errors_list_volume_and_inclusive_byte_range() {
        let e = DataError {
            volume: "v".into(),
            offset: 40960,
            length: 4096,
            kind: DataErrorKind::Data,
            seen_epoch: 1,
        };
        let text = errors_text(&[e]);
        assert!(
            text.starts_with("errors: 1 range(s) with no good copy"),
            "{text}"
        );
        assert!(
            text.ends_with("\n\tv: bytes 40960-45055 (data)\n"),
            "{text}"
        );
    }

    /// A bad region is kept block by block; it is shown as one range per volume
    /// and kind (a scrub of two bad disk halves once printed 7,941 lines).
    #[test]
    fn touching_error_ranges_show_as_one() {
        let e = |volume: &str, offset: u64, length: u64, kind: DataErrorKind| DataError {
            volume: volume.into(),
            offset,
            length,
            kind,
            seen_epoch: 1,
        };
        let mut errors: Vec<DataError> = (0..1000)
            .rev()
            .map(|i| e("v", i * 4096, 4096, DataErrorKind::Data))
            .collect();
        errors.push(e("v", 0, 8 << 20, DataErrorKind::Map));
        errors.push(e("v", 0, 256 << 10, DataErrorKind::Map));
        errors.push(e("v", 10 << 20, 4096, DataErrorKind::Data));
        errors.push(e("w", 4096, 4096, DataErrorKind::Data));
        let text = errors_text(&errors);
        let lines: Vec<&str> = text.lines().filter(|l| l.starts_with('\t')).collect();
        assert_eq!(
            lines,
            [
                "\tv: bytes 0-4095999 (data)",
                "\tv: bytes 10485760-10489855 (data)",
                "\tv: bytes 0-8388607 (map)",
                "\tw: bytes 4096-8191 (data)",
            ],
            "{text}"
        );
        assert!(text.starts_with("errors: 4 range(s)"), "{text}");
    }
}
