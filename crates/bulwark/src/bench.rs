//! `bulwark bench`: the fio matrix users know, through fio's nbd engine.
//!
//! The target is a volume of the running daemon (its URI is built from the
//! daemon's NBD socket in `status`) or any NBD URI. The run is:
//!
//! 1. check fio exists and has the `nbd` engine;
//! 2. refuse a target that holds data unless `--force` (a volume: nonzero
//!    `used_bytes`, or attached clients; an `--uri`: `nbdinfo --map` shows an
//!    extent in the region not known to read as zeros, or nbdinfo is missing);
//! 3. fill the region once with sequential 1M writes, so read cells read
//!    data rather than holes and write cells overwrite, as on a disk in use,
//!    and flush it (`--end_fsync`), so the first cells do not measure the
//!    server's writeback of the fill;
//! 4. run every cell (block size × pattern × queue depth), write cells
//!    first, each one `fio --time_based --runtime`, `--jobs` connections
//!    each on its own slice of the region;
//! 5. print one table (or `--json`) in the order the lists were given.
//!
//! With `--fsync N` write cells flush after every N writes (fio `--fsync=N`).
//! When the target is a volume of the daemon, each write cell reads the pool's
//! space counters before and after and reports write amplification: bytes
//! written to the pool's devices (data, cleaner moves, metadata, every copy)
//! per byte fio wrote. An `--uri` target's pool is not visible: n/a.
//!
//! fio writes its JSON to a file (`--output`): on stdout it prints a line
//! before the JSON. Latency is fio's total latency (`lat_ns`: submission to
//! completion) with `--lat_percentiles`. MB is 10^6 bytes.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bulwark_engine::size::format_size;
use bulwark_engine::{Layout, SpaceStatus};
use indicatif::{ProgressBar, ProgressFinish, ProgressStyle};
use serde::Serialize;
use serde_json::Value;

use crate::cli::{BenchArgs, Pattern};
use crate::client::{self, Client};
use crate::control::{Request, StatusReport};
use crate::error::{Error, Result};

/// The default region is the whole export up to this (the fill pass writes all of it).
const DEFAULT_REGION_BYTES_MAX: u64 = 2 << 30;
/// Slices of the region are multiples of this (and of the largest block size).
const REGION_ALIGN_BYTES: u64 = 1 << 20;
/// Block size and queue depth of the fill pass.
const FILL_BLOCK_BYTES: u64 = 1 << 20;
const FILL_IODEPTH: u32 = 8;
/// A cell's fio is killed if it runs this much longer than `--runtime` (a stuck server).
const CELL_GRACE: Duration = Duration::from_secs(120);
const FIO_JOB_NAME: &str = "bulwark-bench";

/// What is measured.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    pub uri: String,
    /// The volume name when the target is a volume of the daemon.
    pub volume: Option<String>,
    /// Size of the export, when known.
    pub export_bytes: Option<u64>,
    /// Bytes the pool can still take for this volume (free space plus what it holds).
    #[serde(skip)]
    room_bytes: Option<u64>,
    /// The pool's directory when the target is a volume of the daemon: its space
    /// counters give each write cell's write amplification.
    #[serde(skip)]
    pool_dir: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cell {
    pub block_size: u64,
    pub pattern: Pattern,
    pub iodepth: u32,
    /// A flush after every this many writes (0: none); only write cells flush.
    pub fsync: u32,
}

impl Cell {
    pub fn label(&self) -> String {
        let mut label = format!(
            "{} {} QD{}",
            format_size(self.block_size),
            self.pattern.as_str(),
            self.iodepth
        );
        if self.flushes() {
            let _ = write!(label, " fsync={}", self.fsync);
        }
        label
    }

    fn flushes(&self) -> bool {
        self.fsync > 0 && !self.pattern.is_read()
    }
}

/// One measured cell, as `--json` gives it.
#[derive(Debug, Clone, Serialize)]
pub struct CellResult {
    pub block_size: u64,
    pub pattern: &'static str,
    pub iodepth: u32,
    pub jobs: u32,
    pub iops: f64,
    /// 10^6 bytes per second.
    pub mb_per_s: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    pub io_bytes: u64,
    pub runtime_ms: u64,
    /// fio's --fsync for this cell (0: no flushes).
    pub fsync: u32,
    /// Write cells of a volume target: bytes written to the pool's devices during the
    /// cell per byte fio wrote. None for read cells and `--uri` targets (n/a).
    pub write_amplification: Option<f64>,
    /// What the pool wrote during the cell (write cells of a volume target).
    pub pool_written: Option<PoolWritten>,
}

/// The pool's write counters over one cell, in bytes of usable space (one copy), as
/// `status` counts them; `device_factor` turns them into bytes on the devices.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PoolWritten {
    pub data_bytes: u64,
    pub clean_bytes: u64,
    pub meta_bytes: u64,
    /// Device bytes per byte of usable space: copies of a mirror, (K+M)/K of parity.
    pub device_factor: f64,
}

impl PoolWritten {
    /// The counters' growth from `before` to `after`.
    fn between(before: &SpaceStatus, after: &SpaceStatus, layout: Layout) -> PoolWritten {
        PoolWritten {
            data_bytes: after
                .data_written_bytes
                .saturating_sub(before.data_written_bytes),
            clean_bytes: after
                .clean_written_bytes
                .saturating_sub(before.clean_written_bytes),
            meta_bytes: after
                .meta_written_bytes
                .saturating_sub(before.meta_written_bytes),
            device_factor: device_factor(layout),
        }
    }

    fn device_bytes(&self) -> f64 {
        (self.data_bytes + self.clean_bytes + self.meta_bytes) as f64 * self.device_factor
    }

    /// Device bytes per client byte; None when the client wrote nothing.
    fn amplification(&self, client_bytes: u64) -> Option<f64> {
        (client_bytes > 0).then(|| self.device_bytes() / client_bytes as f64)
    }
}

/// Bytes on the devices per byte of usable space.
fn device_factor(layout: Layout) -> f64 {
    match layout {
        Layout::Single => 1.0,
        Layout::Mirror(n) => n as f64,
        Layout::Parity { k, m } => (k as f64 + m as f64) / k as f64,
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub target: Target,
    pub fio_version: String,
    /// Bytes from offset 0 that the cells address (all jobs together).
    pub region_bytes: u64,
    pub jobs: u32,
    pub runtime_s: u64,
    /// fio's --fsync in write cells (0: no flushes).
    pub fsync: u32,
    /// The pool's layout (volume targets).
    pub layout: Option<String>,
    /// Whether the region was filled with sequential writes before the cells.
    pub filled: bool,
    /// How long the fill pass took, in seconds.
    pub fill_s: Option<f64>,
    pub cells: Vec<CellResult>,
}

pub fn bench(pool: Option<&Path>, args: &BenchArgs) -> Result<()> {
    let fio = Fio::find()?;
    let target = match (&args.volume, &args.uri) {
        (Some(name), _) => volume_target(client::pool_dir(pool)?, name, args.force)?,
        (None, Some(uri)) => uri_target(uri)?,
        (None, None) => unreachable!("clap requires a volume or --uri"),
    };
    let plan = Plan::new(args, &target)?;
    if args.uri.is_some() && !args.force {
        refuse_uri_with_data(&target.uri, plan.region_bytes)?;
    }
    let report = run_plan(&fio, &target, &plan, args)?;
    if args.json {
        let mut text = serde_json::to_string_pretty(&report).expect("a report always serializes");
        text.push('\n');
        client::print(&text)
    } else {
        client::print(&render_table(&report))
    }
}

// ---------------------------------------------------------------------------
// targets

/// A volume of the running daemon: unlocked, empty and unused unless `force`.
fn volume_target(dir: &Path, name: &str, force: bool) -> Result<Target> {
    let report: StatusReport = Client::connect(dir)?.call_typed(&Request::Status)?;
    let v = report
        .pool
        .volumes
        .iter()
        .find(|v| v.name == name)
        .ok_or_else(|| {
            Error::msg(format!(
                "no volume named '{name}' in pool {} (see 'bulwark volume list')",
                dir.display()
            ))
        })?;
    if v.locked {
        return Err(Error::msg(crate::control::locked_message(v)));
    }
    let mut reasons = Vec::new();
    if v.used_bytes > 0 {
        reasons.push(format!("it holds {} of data", format_size(v.used_bytes)));
    }
    let attached = report.daemon.attached.get(name).copied().unwrap_or(0);
    if attached > 0 {
        reasons.push(format!("{attached} NBD client(s) are attached to it"));
    }
    if !reasons.is_empty() && !force {
        return Err(Error::msg(format!(
            "refusing to benchmark volume '{name}': {}, and bench overwrites it. \
             Use a fresh volume, or pass --force to overwrite this one",
            reasons.join(" and ")
        )));
    }
    let socket = absolute_socket(&report.daemon.nbd_socket, report.daemon.pid)?;
    Ok(Target {
        uri: unix_uri(name, &socket),
        volume: Some(name.to_string()),
        export_bytes: Some(v.size_bytes),
        room_bytes: Some(report.pool.space.free_bytes.saturating_add(v.used_bytes)),
        pool_dir: Some(dir.to_path_buf()),
    })
}

/// The daemon reports its socket as it was given; a relative one is relative to its cwd.
fn absolute_socket(socket: &Path, pid: u32) -> Result<PathBuf> {
    if socket.is_absolute() {
        return Ok(socket.to_path_buf());
    }
    let in_daemon_cwd = PathBuf::from(format!("/proc/{pid}/cwd")).join(socket);
    std::fs::canonicalize(&in_daemon_cwd).map_err(|e| {
        Error::msg(format!(
            "the daemon's NBD socket is the relative path {} and its directory cannot be \
             found ({e}); use --uri 'nbd+unix:///VOLUME?socket=ABSOLUTE_PATH'",
            socket.display()
        ))
    })
}

/// `nbd+unix:///NAME?socket=PATH`, with anything unusual percent-encoded.
fn unix_uri(name: &str, socket: &Path) -> String {
    format!(
        "nbd+unix:///{}?socket={}",
        percent_encode(name, false),
        percent_encode(&socket.to_string_lossy(), true)
    )
}

fn percent_encode(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        let plain = b.is_ascii_alphanumeric()
            || matches!(b, b'-' | b'.' | b'_' | b'~')
            || (keep_slash && b == b'/');
        if plain {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// Any NBD URI: its size from `nbdinfo --size` when nbdinfo is installed.
fn uri_target(uri: &str) -> Result<Target> {
    let export_bytes =
        match tool_output(Command::new("nbdinfo").arg("--size").arg(uri)) {
            Ok(out) => Some(out.trim().parse::<u64>().map_err(|_| {
                Error::msg(format!("nbdinfo --size {uri} printed '{}'", out.trim()))
            })?),
            Err(ToolError::Missing) => None,
            Err(ToolError::Failed(msg)) => {
                return Err(Error::msg(format!("cannot open {uri}: {msg}")));
            }
        };
    Ok(Target {
        uri: uri.to_string(),
        volume: None,
        export_bytes,
        room_bytes: None,
        pool_dir: None,
    })
}

/// Refuse an export whose region may hold data: any extent that
/// `nbdinfo --map` does not report as reading zeros. A server without block
/// status reports everything as data, so this errs on the side of refusing.
fn refuse_uri_with_data(uri: &str, region_bytes: u64) -> Result<()> {
    let out = match tool_output(Command::new("nbdinfo").args(["--map", "--json"]).arg(uri)) {
        Ok(out) => out,
        Err(ToolError::Missing) => {
            return Err(Error::msg(format!(
                "refusing to benchmark {uri}: without nbdinfo (Debian: libnbd-bin) bench cannot \
                 tell whether it holds data, and bench overwrites it. Pass --force if it holds \
                 nothing you need"
            )))
        }
        Err(ToolError::Failed(msg)) => {
            return Err(Error::msg(format!(
                "cannot read the allocation map of {uri}: {msg} (pass --force to skip this check)"
            )))
        }
    };
    let extents: Vec<Value> = serde_json::from_str(&out).map_err(|e| {
        Error::msg(format!(
            "nbdinfo --map --json printed unexpected output: {e}"
        ))
    })?;
    let data = data_bytes_in(&extents, region_bytes);
    if data > 0 {
        return Err(Error::msg(format!(
            "refusing to benchmark {uri}: nbdinfo --map reports {} of data in the {} region \
             bench would overwrite. Pass --force to overwrite it",
            format_size(data),
            format_size(region_bytes)
        )));
    }
    Ok(())
}

/// Bytes below `limit` in extents without the NBD_STATE_ZERO bit (2).
fn data_bytes_in(extents: &[Value], limit: u64) -> u64 {
    let mut total = 0;
    for e in extents {
        let offset = e["offset"].as_u64().unwrap_or(0);
        let length = e["length"].as_u64().unwrap_or(0);
        let kind = e["type"].as_u64().unwrap_or(0);
        if kind & 2 == 0 && offset < limit {
            total += length.min(limit - offset);
        }
    }
    total
}

// ---------------------------------------------------------------------------
// the plan

struct Plan {
    /// In the order the user gave the lists (the table's order).
    cells: Vec<Cell>,
    region_bytes: u64,
    slice_bytes: u64,
}

impl Plan {
    fn new(args: &BenchArgs, target: &Target) -> Result<Plan> {
        let mut cells = Vec::new();
        for &block_size in &args.block_sizes {
            for &pattern in &args.patterns {
                for &iodepth in &args.iodepths {
                    let cell = Cell {
                        block_size,
                        pattern,
                        iodepth,
                        fsync: args.fsync,
                    };
                    if !cells.contains(&cell) {
                        cells.push(cell);
                    }
                }
            }
        }
        let wanted = match (args.size, target.export_bytes) {
            (Some(size), Some(export)) if size > export => {
                return Err(Error::usage(format!(
                    "--size {} is larger than the export ({})",
                    format_size(size),
                    format_size(export)
                )))
            }
            (Some(size), _) => size,
            (None, Some(export)) => export.min(DEFAULT_REGION_BYTES_MAX),
            (None, None) => {
                return Err(Error::usage(
                    "cannot learn the export's size (nbdinfo is not installed): pass --size",
                ))
            }
        };
        let largest = cells.iter().map(|c| c.block_size).max().unwrap_or(0);
        let align = largest.max(REGION_ALIGN_BYTES);
        let jobs = args.jobs as u64;
        let slice_bytes = wanted / jobs / align * align;
        if slice_bytes == 0 {
            return Err(Error::usage(format!(
                "a region of {} is too small for {jobs} job(s): each needs at least {}",
                format_size(wanted),
                format_size(align)
            )));
        }
        let region_bytes = slice_bytes * jobs;
        if let Some(room) = target.room_bytes {
            if region_bytes > room {
                return Err(Error::msg(format!(
                    "the pool has room for {} more in this volume but bench writes {}: \
                     pass a smaller --size",
                    format_size(room),
                    format_size(region_bytes)
                )));
            }
        }
        Ok(Plan {
            cells,
            region_bytes,
            slice_bytes,
        })
    }

    /// Write cells before read cells; otherwise the given order.
    fn execution_order(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.cells.len()).collect();
        order.sort_by_key(|&i| self.cells[i].pattern.is_read());
        order
    }
}

fn run_plan(fio: &Fio, target: &Target, plan: &Plan, args: &BenchArgs) -> Result<Report> {
    let progress = ProgressBar::new(plan.cells.len() as u64)
        .with_style(
            ProgressStyle::with_template("{spinner} bench [{pos}/{len}] {wide_msg} {elapsed}")
                .expect("a valid template"),
        )
        .with_finish(ProgressFinish::AndClear);
    progress.enable_steady_tick(Duration::from_millis(200));

    let common = common_fio_args(&target.uri, args.jobs, plan.slice_bytes);
    let mut fill_s = None;
    if !args.no_fill {
        progress.set_message(format!(
            "filling the {} region with sequential {} writes",
            format_size(plan.region_bytes),
            format_size(FILL_BLOCK_BYTES)
        ));
        let started = Instant::now();
        let mut fill = common.clone();
        fill.extend([
            "--rw=write".to_string(),
            format!("--bs={FILL_BLOCK_BYTES}"),
            format!("--iodepth={FILL_IODEPTH}"),
            "--end_fsync=1".to_string(),
        ]);
        let json = fio.run("the fill pass", &fill, None)?;
        check_job_error(&json, "the fill pass")?;
        fill_s = Some(started.elapsed().as_secs_f64());
    }

    let mut results: Vec<Option<CellResult>> = vec![None; plan.cells.len()];
    for i in plan.execution_order() {
        let cell = plan.cells[i];
        let label = cell.label();
        progress.set_message(format!("{label} ({} s)", args.runtime));
        let mut cmd = common.clone();
        cmd.extend(cell_fio_args(cell, args.runtime));
        // The pool's counters around a write cell (volume targets only).
        let before = match &target.pool_dir {
            Some(dir) if !cell.pattern.is_read() => pool_space(dir),
            _ => None,
        };
        let timeout = Duration::from_secs(args.runtime) + CELL_GRACE;
        let json = fio.run(&label, &cmd, Some(timeout))?;
        let mut result = parse_cell(&json, cell, args.jobs)?;
        if let (Some((before, _)), Some(dir)) = (&before, &target.pool_dir) {
            if let Some((after, layout)) = pool_space(dir) {
                let written = PoolWritten::between(before, &after, layout);
                result.write_amplification = written.amplification(result.io_bytes);
                result.pool_written = Some(written);
            }
        }
        results[i] = Some(result);
        progress.inc(1);
    }
    progress.finish_and_clear();

    Ok(Report {
        target: target.clone(),
        fio_version: fio.version.clone(),
        region_bytes: plan.region_bytes,
        jobs: args.jobs,
        runtime_s: args.runtime,
        fsync: args.fsync,
        layout: target
            .pool_dir
            .as_deref()
            .and_then(pool_space)
            .map(|(_, layout)| layout.to_string()),
        filled: !args.no_fill,
        fill_s,
        cells: results
            .into_iter()
            .map(|r| r.expect("every cell ran"))
            .collect(),
    })
}

/// One cell's fio arguments (after the common ones).
fn cell_fio_args(cell: Cell, runtime_s: u64) -> Vec<String> {
    let mut args = vec![
        format!("--rw={}", cell.pattern.as_str()),
        format!("--bs={}", cell.block_size),
        format!("--iodepth={}", cell.iodepth),
        "--time_based=1".to_string(),
        format!("--runtime={runtime_s}"),
    ];
    if cell.flushes() {
        args.push(format!("--fsync={}", cell.fsync));
    }
    args
}

/// The pool's space counters and layout from the daemon's status; None if it cannot be
/// read (the cell then shows no write amplification rather than failing the run).
fn pool_space(dir: &Path) -> Option<(SpaceStatus, Layout)> {
    let report: StatusReport = Client::connect(dir)
        .ok()?
        .call_typed(&Request::Status)
        .ok()?;
    let layout = report.pool.layout.parse().ok()?;
    Some((report.pool.space, layout))
}

/// fio arguments shared by the fill pass and every cell.
fn common_fio_args(uri: &str, jobs: u32, slice_bytes: u64) -> Vec<String> {
    vec![
        format!("--name={FIO_JOB_NAME}"),
        "--ioengine=nbd".to_string(),
        format!("--uri={uri}"),
        format!("--numjobs={jobs}"),
        format!("--size={slice_bytes}"),
        format!("--offset_increment={slice_bytes}"),
        "--group_reporting=1".to_string(),
        "--norandommap=1".to_string(),
        "--lat_percentiles=1".to_string(),
        "--percentile_list=50:99".to_string(),
        "--eta=never".to_string(),
    ]
}

fn check_job_error(json: &Value, what: &str) -> Result<()> {
    let job = &json["jobs"][0];
    if job.is_null() {
        return Err(Error::msg(format!("fio reported no job for {what}")));
    }
    match job["error"].as_i64() {
        Some(0) => Ok(()),
        Some(errno) => Err(Error::msg(format!(
            "fio failed in {what}: error {errno} ({})",
            std::io::Error::from_raw_os_error(errno as i32)
        ))),
        None => Err(Error::msg(format!(
            "fio reported no error status for {what}"
        ))),
    }
}

/// The cell's numbers from fio's JSON (one group: `--group_reporting`).
fn parse_cell(json: &Value, cell: Cell, jobs: u32) -> Result<CellResult> {
    let label = cell.label();
    check_job_error(json, &label)?;
    let job = &json["jobs"][0];
    let side = &job[if cell.pattern.is_read() {
        "read"
    } else {
        "write"
    }];
    let bad = |field: &str| Error::msg(format!("fio's report for {label} lacks {field}"));
    let iops = side["iops"].as_f64().ok_or_else(|| bad("iops"))?;
    let bw_bytes = side["bw_bytes"].as_f64().ok_or_else(|| bad("bw_bytes"))?;
    let io_bytes = side["io_bytes"].as_u64().ok_or_else(|| bad("io_bytes"))?;
    let runtime_ms = side["runtime"].as_u64().unwrap_or(0);
    if io_bytes == 0 {
        return Err(Error::msg(format!("fio completed no I/O in {label}")));
    }
    let percentiles = &side["lat_ns"]["percentile"];
    let p50 = percentile(percentiles, 50.0).ok_or_else(|| bad("the p50 latency"))?;
    let p99 = percentile(percentiles, 99.0).ok_or_else(|| bad("the p99 latency"))?;
    Ok(CellResult {
        block_size: cell.block_size,
        pattern: cell.pattern.as_str(),
        iodepth: cell.iodepth,
        jobs,
        iops,
        mb_per_s: bw_bytes / 1e6,
        lat_p50_us: p50 / 1e3,
        lat_p99_us: p99 / 1e3,
        io_bytes,
        runtime_ms,
        fsync: if cell.flushes() { cell.fsync } else { 0 },
        write_amplification: None,
        pool_written: None,
    })
}

/// fio names percentiles "50.000000"; match by value, not by spelling.
fn percentile(map: &Value, which: f64) -> Option<f64> {
    map.as_object()?.iter().find_map(|(k, v)| {
        let p: f64 = k.parse().ok()?;
        ((p - which).abs() < 1e-6).then(|| v.as_f64()).flatten()
    })
}

// ---------------------------------------------------------------------------
// fio

struct Fio {
    version: String,
    workdir: tempfile::TempDir,
}

impl Fio {
    /// fio on PATH with the nbd engine, or an error saying what to install.
    fn find() -> Result<Fio> {
        let version = match tool_output(Command::new("fio").arg("--version")) {
            Ok(v) => v.trim().to_string(),
            Err(ToolError::Missing) => {
                return Err(Error::msg(
                    "fio is not installed (bulwark bench drives fio's nbd engine): \
                     install fio (Debian: apt-get install fio)",
                ))
            }
            Err(ToolError::Failed(msg)) => {
                return Err(Error::msg(format!("fio --version failed: {msg}")))
            }
        };
        if let Err(e) = tool_output(Command::new("fio").arg("--enghelp=nbd")) {
            let why = match e {
                ToolError::Missing => "it disappeared".to_string(),
                ToolError::Failed(msg) => msg,
            };
            return Err(Error::msg(format!(
                "{version} has no nbd I/O engine ({why}); bulwark bench needs it: \
                 use a fio built with libnbd (Debian's fio package has it)"
            )));
        }
        let workdir = tempfile::Builder::new()
            .prefix("bulwark-bench-")
            .tempdir()
            .map_err(|e| Error::msg(format!("cannot create a temporary directory: {e}")))?;
        Ok(Fio { version, workdir })
    }

    /// Run fio with `args`, JSON to a file; its parsed report. `what` names the step in errors.
    fn run(&self, what: &str, args: &[String], timeout: Option<Duration>) -> Result<Value> {
        let dir = self.workdir.path();
        let out_path = dir.join("fio.json");
        let log_path = dir.join("fio.log");
        let _ = std::fs::remove_file(&out_path);
        let log = std::fs::File::create(&log_path)
            .map_err(|e| Error::msg(format!("cannot create {}: {e}", log_path.display())))?;
        let log2 = log
            .try_clone()
            .map_err(|e| Error::msg(format!("cannot create {}: {e}", log_path.display())))?;
        let mut child = Command::new("fio")
            .args(args)
            .arg("--output-format=json")
            .arg(format!("--output={}", out_path.display()))
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|e| Error::msg(format!("cannot run fio: {e}")))?;
        let started = Instant::now();
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) => {}
                Err(e) => return Err(Error::msg(format!("waiting for fio: {e}"))),
            }
            if timeout.is_some_and(|t| started.elapsed() > t) {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::msg(format!(
                    "fio did not finish {what} within {} s: is the NBD server stuck? \
                     fio said:\n{}",
                    timeout.unwrap().as_secs(),
                    tail(&log_path)
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if !status.success() {
            return Err(Error::msg(format!(
                "fio failed in {what} ({status}):\n{}\ncommand: fio {}",
                tail(&log_path),
                args.join(" ")
            )));
        }
        let text = std::fs::read_to_string(&out_path)
            .map_err(|e| Error::msg(format!("fio wrote no report for {what}: {e}")))?;
        serde_json::from_str(&text).map_err(|e| {
            Error::msg(format!(
                "fio's report for {what} is not JSON ({e}):\n{}",
                tail(&log_path)
            ))
        })
    }
}

/// The last lines of a log file, for error messages.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = lines.len().saturating_sub(10);
    if lines.is_empty() {
        "(no output)".to_string()
    } else {
        lines[start..].join("\n")
    }
}

enum ToolError {
    Missing,
    Failed(String),
}

/// Run a helper tool to completion; its stdout, or why not.
fn tool_output(cmd: &mut Command) -> Result<String, ToolError> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => ToolError::Missing,
            _ => ToolError::Failed(e.to_string()),
        })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        let mut msg = String::from_utf8_lossy(&out.stderr).trim().to_string();
        if msg.is_empty() {
            msg = String::from_utf8_lossy(&out.stdout).trim().to_string();
        }
        if msg.is_empty() {
            msg = out.status.to_string();
        }
        Err(ToolError::Failed(msg))
    }
}

// ---------------------------------------------------------------------------
// output

fn render_table(report: &Report) -> String {
    let mut out = String::new();
    let what = match &report.target.volume {
        Some(v) => format!("volume {v} ({})", report.target.uri),
        None => report.target.uri.clone(),
    };
    let _ = writeln!(out, "target:  {what}");
    let _ = writeln!(
        out,
        "region:  {} from offset 0, {} connection(s), {} s per cell, {}{}",
        format_size(report.region_bytes),
        report.jobs,
        report.runtime_s,
        if report.filled {
            "filled first"
        } else {
            "not filled (--no-fill)"
        },
        match report.fill_s {
            Some(s) => format!(" in {s:.1} s"),
            None => String::new(),
        }
    );
    let _ = writeln!(out, "fio:     {}, ioengine=nbd", report.fio_version);
    if report.fsync > 0 {
        let _ = writeln!(
            out,
            "flush:   after every {} write(s) in write cells (fio --fsync={})",
            report.fsync, report.fsync
        );
    }
    let _ = writeln!(
        out,
        "WA:      {}",
        match &report.layout {
            Some(layout) => format!(
                "bytes written to the pool's devices ({layout}: data, cleaner, metadata, \
                 every copy) / bytes fio wrote, per write cell"
            ),
            None => "n/a (an --uri target: bench cannot see that server's pool)".to_string(),
        }
    );
    out.push('\n');

    let headers = ["BS", "PATTERN", "QD", "IOPS", "MB/S", "P50", "P99", "WA"];
    let right = [false, false, true, true, true, true, true, true];
    let rows: Vec<[String; 8]> = report
        .cells
        .iter()
        .map(|c| {
            [
                format_size(c.block_size),
                c.pattern.to_string(),
                c.iodepth.to_string(),
                format!("{:.0}", c.iops),
                format!("{:.1}", c.mb_per_s),
                format_latency(c.lat_p50_us),
                format_latency(c.lat_p99_us),
                match c.write_amplification {
                    Some(wa) => format!("{wa:.2}"),
                    // randread, read: nothing written
                    None if c.pattern.ends_with("read") => "-".to_string(),
                    None => "n/a".to_string(),
                },
            ]
        })
        .collect();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let header_row: [String; 8] = headers.map(String::from);
    for row in std::iter::once(&header_row).chain(&rows) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            if right[i] {
                let _ = write!(line, "{cell:>w$}", w = widths[i]);
            } else {
                let _ = write!(line, "{cell:<w$}", w = widths[i]);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// 7.5us, 85us, 1.25ms, 12.3ms, 1.20s.
fn format_latency(us: f64) -> String {
    if us < 10.0 {
        format!("{us:.1}us")
    } else if us < 1000.0 {
        format!("{us:.0}us")
    } else if us < 10_000.0 {
        format!("{:.2}ms", us / 1e3)
    } else if us < 1_000_000.0 {
        format!("{:.1}ms", us / 1e3)
    } else {
        format!("{:.2}s", us / 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn uri_from_socket_is_encoded() {
        assert_eq!(
            unix_uri("vol1", Path::new("/tmp/p/nbd.sock")),
            "nbd+unix:///vol1?socket=/tmp/p/nbd.sock"
        );
        assert_eq!(
            unix_uri("a b", Path::new("/tmp/my pool/nbd.sock")),
            "nbd+unix:///a%20b?socket=/tmp/my%20pool/nbd.sock"
        );
    }

    #[test]
    fn only_extents_not_known_zero_in_the_region_count_as_data() {
        let map = vec![
            json!({"offset": 0, "length": 4096, "type": 3}),
            json!({"offset": 4096, "length": 8192, "type": 0}),
            json!({"offset": 12288, "length": 4096, "type": 2}),
            json!({"offset": 16384, "length": 1 << 20, "type": 1}),
        ];
        assert_eq!(data_bytes_in(&map, 1 << 30), 8192 + (1 << 20));
        assert_eq!(data_bytes_in(&map, 8192), 4096);
        assert_eq!(data_bytes_in(&map, 4096), 0);
    }

    #[test]
    fn cell_numbers_come_from_the_right_side() {
        let fio = json!({"jobs": [{
            "error": 0,
            "read": {"iops": 0.0, "bw_bytes": 0, "io_bytes": 0, "runtime": 0,
                     "lat_ns": {"percentile": {}}},
            "write": {"iops": 25000.5, "bw_bytes": 102_400_000u64, "io_bytes": 1_024_000_000u64,
                      "runtime": 10000,
                      "lat_ns": {"percentile": {"50.000000": 40960, "99.000000": 1_236_992}}}
        }]});
        let cell = Cell {
            block_size: 4096,
            pattern: Pattern::Randwrite,
            iodepth: 32,
            fsync: 0,
        };
        let r = parse_cell(&fio, cell, 2).unwrap();
        assert_eq!(r.iops, 25000.5);
        assert_eq!(r.mb_per_s, 102.4);
        assert_eq!(r.lat_p50_us, 40.96);
        assert_eq!(r.lat_p99_us, 1236.992);
        assert_eq!((r.jobs, r.runtime_ms, r.pattern), (2, 10000, "randwrite"));

        let read = Cell {
            pattern: Pattern::Randread,
            ..cell
        };
        assert!(
            parse_cell(&fio, read, 1).is_err(),
            "no read I/O is an error"
        );

        let failed = json!({"jobs": [{"error": 5}]});
        let e = parse_cell(&failed, cell, 1).unwrap_err().to_string();
        assert!(e.contains("error 5"), "{e}");
    }

    #[test]
    fn latencies_read_well() {
        assert_eq!(format_latency(7.54), "7.5us");
        assert_eq!(format_latency(85.2), "85us");
        assert_eq!(format_latency(1250.0), "1.25ms");
        assert_eq!(format_latency(12_345.0), "12.3ms");
        assert_eq!(format_latency(1_200_000.0), "1.20s");
    }

    fn args(extra: &[&str]) -> BenchArgs {
        use clap::Parser;
        let cli = crate::cli::Cli::try_parse_from(
            ["bulwark", "bench", "v"]
                .iter()
                .chain(extra.iter())
                .copied(),
        )
        .unwrap();
        match cli.command {
            crate::cli::Command::Bench(a) => a,
            _ => unreachable!(),
        }
    }

    fn target(export: u64, room: Option<u64>) -> Target {
        Target {
            uri: "nbd+unix:///v?socket=/s".into(),
            volume: Some("v".into()),
            export_bytes: Some(export),
            room_bytes: room,
            pool_dir: None,
        }
    }

    #[test]
    fn fsync_flushes_write_cells_only() {
        let plan = Plan::new(
            &args(&["--block-sizes", "4k", "--iodepths", "1", "--fsync", "32"]),
            &target(1 << 30, None),
        )
        .unwrap();
        let cells: Vec<Cell> = plan.cells.clone();
        let write = cells
            .iter()
            .find(|c| c.pattern == Pattern::Randwrite)
            .copied()
            .unwrap();
        let read = cells
            .iter()
            .find(|c| c.pattern == Pattern::Randread)
            .copied()
            .unwrap();
        assert!(cell_fio_args(write, 10).contains(&"--fsync=32".to_string()));
        assert_eq!(write.label(), "4K randwrite QD1 fsync=32");
        assert!(!cell_fio_args(read, 10)
            .iter()
            .any(|a| a.starts_with("--fsync")));
        assert_eq!(read.label(), "4K randread QD1");

        let plain = Plan::new(&args(&["--block-sizes", "4k"]), &target(1 << 30, None)).unwrap();
        assert!(plain.cells.iter().all(|&c| !cell_fio_args(c, 10)
            .iter()
            .any(|a| a.starts_with("--fsync"))));
    }

    #[test]
    fn write_amplification_counts_every_stream_and_copy() {
        let before = SpaceStatus {
            data_written_bytes: 1000,
            clean_written_bytes: 50,
            meta_written_bytes: 10,
            ..SpaceStatus::default()
        };
        let after = SpaceStatus {
            data_written_bytes: 1000 + 4096,
            clean_written_bytes: 50 + 2048,
            meta_written_bytes: 10 + 1024,
            ..SpaceStatus::default()
        };
        let single = PoolWritten::between(&before, &after, Layout::Single);
        assert_eq!(
            (single.data_bytes, single.clean_bytes, single.meta_bytes),
            (4096, 2048, 1024)
        );
        assert_eq!(single.amplification(4096), Some(1.75));
        let mirror = PoolWritten::between(&before, &after, Layout::Mirror(2));
        assert_eq!(mirror.amplification(4096), Some(3.5));
        let parity = PoolWritten::between(&before, &after, Layout::Parity { k: 2, m: 1 });
        assert_eq!(parity.amplification(4096), Some(1.75 * 1.5));
        assert_eq!(
            single.amplification(0),
            None,
            "nothing written by the client"
        );
    }

    #[test]
    fn plan_orders_writes_first_and_slices_the_region() {
        let plan = Plan::new(&args(&["--jobs", "3"]), &target(10 << 30, None)).unwrap();
        assert_eq!(plan.cells.len(), 24);
        // 2G / 3 rounded down to whole MiB, per job.
        assert_eq!(plan.slice_bytes, 682 << 20);
        assert_eq!(plan.region_bytes, 3 * (682 << 20));
        let order = plan.execution_order();
        let first_read = order
            .iter()
            .position(|&i| plan.cells[i].pattern.is_read())
            .unwrap();
        assert!(order[first_read..]
            .iter()
            .all(|&i| plan.cells[i].pattern.is_read()));
        assert_eq!(first_read, 12);
        assert_eq!(plan.cells[0].label(), "4K randread QD1");
    }

    #[test]
    fn plan_checks_the_region() {
        assert!(Plan::new(&args(&["--size", "2G"]), &target(1 << 30, None)).is_err());
        assert!(Plan::new(&args(&["--size", "512K"]), &target(1 << 30, None)).is_err());
        assert!(Plan::new(&args(&[]), &target(64 << 20, Some(32 << 20))).is_err());
        let plan = Plan::new(&args(&[]), &target(64 << 20, Some(1 << 30))).unwrap();
        assert_eq!(plan.region_bytes, 64 << 20);
    }
}
