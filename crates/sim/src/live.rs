//! The live run (`bulwark-live`): the engine on its real threads, hunting what the
//! stepped simulator cannot reach.
//!
//! The simulator (`world.rs`) steps every background loop on one thread, so it sees every
//! interleaving a seed draws *between* operations but none *inside* one; shuttle
//! (`crates/modelcheck`) checks the meeting points one protocol at a time. The daemon runs
//! all of it at once: the maintenance thread (commits, the cleaner, the defragmenter), the
//! rotation workers, scrub, and several clients on one volume, each on its own thread. This
//! run does the same, with a model that needs no ordering between threads:
//!
//! - every 4 KiB cell of a volume belongs to one writer thread (in groups of
//!   `Shape::group` cells; groups of one cell in a volume of 8 KiB blocks, so two threads
//!   write halves of one block and the engine's read-modify-write must keep both);
//! - a cell's value is a tag unique to the run, rising over time (`model::fill_cell`), so
//!   a read that returns an *older* acknowledged value is told apart from any other wrong
//!   answer;
//! - there is no crash: a read must return exactly the last acknowledged write (a failed
//!   write leaves the cell at either value);
//! - a control thread does what an operator does meanwhile: `key unload` and `key load`
//!   (the writers of that volume let go of their handles first, as NBD clients
//!   disconnect), snapshots with their contents recorded while the volume's writers wait,
//!   and read back later from the snapshot view, snapshot destroy, `key rotate`, scrub and
//!   pool-wide flushes;
//! - at the end every cell of every volume and of every snapshot kept is read, and again
//!   after the pool is closed and imported.
//!
//! The interleavings are the machine's, not a seed's: a failure does not replay. It
//! prints what it read and what it expected, which cell, volume and snapshot, and the
//! operations the control thread had done just before.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use bulwark_engine::device::crash::{self, CrashJournal};
use bulwark_engine::{
    Compression, DeviceSpec, Error, Layout, OpenOptions, Pool, Secret, Volume, VolumeOptions,
};
use zeroize::Zeroizing;

use crate::model::{fill_cell, value_of, CELL};
use crate::rng::Rng;

/// What a live run does.
#[derive(Debug, Clone)]
pub struct LiveConfig {
    /// Seeds the threads' choices (not their interleaving).
    pub seed: u64,
    /// End with a power loss at the deadline instead of a clean stop: every device is
    /// frozen under the running threads (the engine's crash journal), each unsynced write
    /// kept, dropped or torn, and the pool imported again.
    pub crash: bool,
    pub duration: Duration,
    /// `single`, `mirror`, `parity` or `log` (a separate intent log device).
    pub layout: String,
    /// Writer threads per volume.
    pub writers: usize,
    /// Where the pool's directory goes (default `/dev/shm`).
    pub dir: Option<PathBuf>,
    /// The smallest node cache (`cache_bytes` 0: 64 nodes), which the threads' walks
    /// keep evicting: map walks read from the devices.
    pub tiny_cache: bool,
    pub holes_first: bool,
    /// Bytes between the starts of `lw-huge`'s 16 islands (`HUGE_SPREAD`, 1 TiB: a 16 TiB
    /// volume); `1 << 56` makes it 1 EiB, as the tester's volumes were.
    pub huge_spread: u64,
}

/// `LiveConfig::huge_spread` by default.
pub const HUGE_SPREAD: u64 = 1 << 40;

/// What a live run did.
#[derive(Debug, Default, Clone)]
pub struct LiveReport {
    pub writes: u64,
    pub reads: u64,
    pub flushes: u64,
    pub refused_writes: u64,
    pub cells_checked: u64,
    pub key_cycles: u64,
    pub snapshots: u64,
    pub snapshot_cells_checked: u64,
    pub rotations: u64,
    pub clones: u64,
    /// Of them, made independent (their key rotated at once).
    pub independent_clones: u64,
    pub scrubs: u64,
    pub stale_cached_nodes: u64,
    /// The crash at the end: unsynced writes kept, dropped and torn.
    pub crash: Option<(u64, u64, u64)>,
    /// Bytes the cleaner wrote, and the most of the usable space used at a control step.
    pub clean_written_bytes: u64,
    pub most_used: f64,
    /// The slowest operation: seconds, and what it was; how many took over a second.
    pub slowest: (f64, String),
    pub slow_ops: u64,
    /// Seconds of the fill, of the run with every thread, and of the final checks.
    pub seconds: (f64, f64, f64),
}

/// One volume's shape.
struct Shape {
    name: &'static str,
    encrypted: bool,
    block_size: u32,
    /// Cells per island, and islands.
    island_cells: u64,
    islands: u64,
    /// Bytes between two islands' starts (a huge thin volume spreads its islands over
    /// terabytes, so its map is deep and mostly holes).
    stride: u64,
    /// Cells a writer owns together (a write never crosses a group).
    group: u64,
}

impl Shape {
    fn cells(&self) -> u64 {
        self.island_cells * self.islands
    }
    fn offset(&self, cell: u64) -> u64 {
        (cell / self.island_cells) * self.stride + (cell % self.island_cells) * CELL
    }
    fn size(&self) -> u64 {
        (self.islands - 1) * self.stride + self.island_cells * CELL
    }
    /// The writer thread that owns `cell`.
    fn owner(&self, cell: u64, writers: usize) -> usize {
        ((cell / self.group) % writers as u64) as usize
    }
}

/// A cell's model: what a read may return now, and after a crash.
struct CellModel(Mutex<CellState>);

#[derive(Default)]
struct CellState {
    /// The last acknowledged value.
    now: u64,
    /// Values of writes that failed since: the cell may hold any of them.
    maybe: Vec<u64>,
    /// For a crash (`LiveConfig::crash`): the last value made durable by its writer's own
    /// FLUSH or FUA before the machine stopped, and every value written or tried since.
    /// After the crash the cell must read one of them: older is a flushed write lost.
    dur: u64,
    since: Vec<u64>,
}

impl CellModel {
    fn new() -> CellModel {
        CellModel(Mutex::new(CellState::default()))
    }
    fn state(&self) -> std::sync::MutexGuard<'_, CellState> {
        self.0.lock().expect("cell")
    }
    /// What a read may return now: the last acknowledged value first.
    fn now_allowed(&self) -> Vec<u64> {
        let c = self.state();
        let mut a = vec![c.now];
        a.extend(c.maybe.iter().copied());
        a
    }
    /// What a read may return after a crash: the last durable value first.
    fn crash_allowed(&self) -> Vec<u64> {
        let c = self.state();
        let mut a = vec![c.dur];
        a.extend(c.since.iter().copied());
        a
    }
    /// A write of `value` acknowledged (or, `durable`, made durable by FUA before the
    /// machine stopped).
    fn written(&self, value: u64, durable: bool) {
        let mut c = self.state();
        c.now = value;
        c.maybe.clear();
        if durable {
            c.dur = value;
            c.since.clear();
        } else {
            c.since.push(value);
        }
    }
    /// A write of `value` that failed: the cell may hold it.
    fn tried(&self, value: u64) {
        let mut c = self.state();
        c.maybe.push(value);
        c.since.push(value);
    }
    /// A read returned `value` (one of the allowed): from now on the cell reads it.
    fn pin(&self, value: u64) {
        let mut c = self.state();
        c.now = value;
        c.maybe.clear();
    }
    /// Its writer's FLUSH returned before the machine stopped: the cell holds `now` or
    /// one of `maybe`, durably.
    fn flushed(&self) {
        let mut c = self.state();
        c.dur = c.now;
        c.since = c.maybe.clone();
    }
    /// Everything it holds is durable (a clean close, or the check after a crash).
    fn settled(&self) {
        let mut c = self.state();
        c.dur = c.now;
        c.since = c.maybe.clone();
    }
}

/// A snapshot kept: its name, and each cell's possible values when it was taken.
type Kept = (String, Vec<Vec<u64>>);

struct Vol {
    shape: Shape,
    key: Option<u8>,
    cells: Vec<CellModel>,
    /// Writers hold it shared while they hold a handle; the control thread takes it
    /// whole to unload the key or to record a snapshot's contents.
    gate: RwLock<()>,
    /// Snapshots kept: name and each cell's values when it was taken (the second one
    /// `NONE`, or a failed write's value the cell may hold).
    snaps: Mutex<VecDeque<Kept>>,
}

/// A cell's name in its bytes: its volume and index, so a read that returns another
/// volume's or another cell's bytes never passes.
fn cell_id(vi: usize, cell: u64) -> u64 {
    ((vi as u64) << 48) | cell
}

/// The value a cell's bytes claim (0 for zeros); `Live::check` has checked them.
fn value_in(b: &[u8]) -> u64 {
    if b.iter().all(|&x| x == 0) {
        0
    } else {
        u64::from_le_bytes(b[..8].try_into().expect("a cell has 8 bytes"))
    }
}

fn secret(b: u8) -> Secret {
    Secret::KeyFile(Zeroizing::new([b; 32]))
}

/// The shapes of a run's volumes, sized for a pool of `usable` bytes about 75% full.
fn shapes(usable: u64, huge_spread: u64) -> Vec<Shape> {
    let island = 256u64; // 1 MiB of 4 KiB cells
    let big_islands = (usable * 25 / 100) / (island * CELL);
    vec![
        // Filled, overwritten all the time: the pool's fill, and the cleaner's work.
        Shape {
            name: "lw-fill",
            encrypted: true,
            block_size: 4096,
            island_cells: island,
            islands: big_islands.max(2),
            stride: island * CELL,
            group: 16,
        },
        // A huge thin volume (16 TiB by default; its islands 1 TiB apart): a deep, sparse map.
        Shape {
            name: "lw-huge",
            encrypted: true,
            block_size: 4096,
            island_cells: 64,
            islands: 16,
            stride: huge_spread,
            group: 16,
        },
        // 8 KiB blocks written a 4 KiB cell at a time by different threads.
        Shape {
            name: "lw-halves",
            encrypted: false,
            block_size: 8192,
            island_cells: island,
            islands: 4,
            stride: island * CELL,
            group: 1,
        },
    ]
}

/// A run's shared state.
struct Live {
    pool: RwLock<Option<Arc<Pool>>>,
    vols: Vec<Vol>,
    next_value: AtomicU64,
    stop: AtomicBool,
    /// The machine stopped (`LiveConfig::crash`): set before the devices freeze, so an
    /// answer read before it was seen came before the freeze.
    frozen: AtomicBool,
    failures: Mutex<Vec<String>>,
    /// The control thread's last operations (for a failure's report).
    recent: Mutex<VecDeque<String>>,
    writes: AtomicU64,
    reads: AtomicU64,
    flushes: AtomicU64,
    refused: AtomicU64,
    checked: AtomicU64,
    snap_checked: AtomicU64,
    writers: usize,
    /// The slowest operation: seconds, and what it was.
    slowest: Mutex<(f64, String)>,
    /// Operations that took more than a second.
    slow: AtomicU64,
}

impl Live {
    /// Note how long an operation took, keeping the slowest.
    fn timed(&self, start: Instant, what: &dyn Fn() -> String) {
        let secs = start.elapsed().as_secs_f64();
        if secs > 1.0 {
            self.slow.fetch_add(1, Ordering::Relaxed);
        }
        let mut s = self.slowest.lock().expect("slowest");
        if secs > s.0 {
            *s = (secs, what());
        }
    }
    fn pool(&self) -> Arc<Pool> {
        self.pool
            .read()
            .expect("pool lock")
            .clone()
            .expect("the pool is open")
    }
    fn fail(&self, m: String) {
        let recent: Vec<String> = self
            .recent
            .lock()
            .expect("recent")
            .iter()
            .cloned()
            .collect();
        let line = format!(
            "{m}\n  control thread's last operations: {}",
            recent.join("; ")
        );
        eprintln!("VIOLATION: {line}");
        self.failures.lock().expect("failures").push(line);
        self.stop.store(true, Ordering::Release);
    }
    fn note(&self, s: String) {
        let mut r = self.recent.lock().expect("recent");
        if r.len() == 8 {
            r.pop_front();
        }
        r.push_back(s);
    }
    fn value(&self) -> u64 {
        self.next_value.fetch_add(1, Ordering::Relaxed)
    }
    /// The run's counts, into its report.
    fn counts(&self, report: &mut LiveReport) {
        report.slowest = self.slowest.lock().expect("slowest").clone();
        report.slow_ops = self.slow.load(Ordering::Relaxed);
        report.writes = self.writes.load(Ordering::Relaxed);
        report.reads = self.reads.load(Ordering::Relaxed);
        report.flushes = self.flushes.load(Ordering::Relaxed);
        report.refused_writes = self.refused.load(Ordering::Relaxed);
        report.cells_checked = self.checked.load(Ordering::Relaxed);
        report.snapshot_cells_checked = self.snap_checked.load(Ordering::Relaxed);
    }

    /// Check cells `c0..c0+n` of volume `vi` as read into `buf`; `expect` gives each
    /// cell's allowed values. `what` names the volume or snapshot.
    fn check(
        &self,
        what: &str,
        vi: usize,
        c0: u64,
        buf: &[u8],
        expect: &dyn Fn(u64) -> Vec<u64>,
        scratch: &mut [u8],
    ) -> Step {
        for (i, b) in buf.chunks(CELL as usize).enumerate() {
            let cell = c0 + i as u64;
            let allowed = expect(cell);
            let now = allowed[0];
            let (got, exact) = value_of(b, cell_id(vi, cell), scratch);
            if exact && allowed.contains(&got) {
                continue;
            }
            let how = if !exact {
                "bytes that are no value of this cell (torn, another cell's, or garbage)"
            } else if got < now {
                "an OLDER value: an acknowledged write lost"
            } else {
                "a value never acknowledged for this cell"
            };
            return Err(format!(
                "{what} cell {cell} (offset {}) read {got} ({how}); expected one of {allowed:?}",
                self.vols[vi].shape.offset(cell),
            ));
        }
        self.checked
            .fetch_add(buf.len() as u64 / CELL, Ordering::Relaxed);
        Ok(())
    }
}

/// The pool's devices for `layout` in `dir`; the usable bytes are about the given size.
fn create_pool(dir: &Path, layout: &str) -> Result<u64, String> {
    let mib = 96u64;
    let (l, count, size): (Layout, usize, u64) = match layout {
        "single" | "log" => (Layout::Single, 1, mib << 20),
        "mirror" => (Layout::Mirror(2), 2, mib << 20),
        "parity" => ("parity:2+1".parse().expect("a layout"), 3, (mib / 2) << 20),
        other => return Err(format!("layout {other}: single, mirror, parity or log")),
    };
    let mut logs = Vec::new();
    if layout == "log" {
        let log = dir.join("log-device.img");
        std::fs::File::create(&log)
            .and_then(|f| f.set_len(16 << 20))
            .map_err(|e| format!("log device file: {e}"))?;
        logs.push(log);
    }
    Pool::create_with_log(
        dir,
        l,
        DeviceSpec::Files {
            count,
            size_bytes: size,
        },
        "live",
        &logs,
    )
    .map_err(|e| format!("pool create: {e}"))?;
    Ok(mib << 20)
}

fn options(cfg: &LiveConfig) -> OpenOptions {
    OpenOptions {
        cache_bytes: if cfg.tiny_cache { 0 } else { 8 << 20 },
        // Many commits: each is a chance for a node's place to change under a reader.
        commit_interval: Duration::from_millis(100),
        fill_holes: true,
        holes_first: cfg.holes_first,
        check_addresses: true,
        // The crash journal is a device layer.
        allow_fault_injection: true,
        ..OpenOptions::default()
    }
}

/// Run the engine on its real threads for `cfg.duration`; `Err` lists the violations.
pub fn live(cfg: &LiveConfig) -> Result<LiveReport, Vec<String>> {
    let base = cfg.dir.clone().unwrap_or_else(|| PathBuf::from("/dev/shm"));
    let dir = tempfile::Builder::new()
        .prefix("bulwark-live-")
        .tempdir_in(&base)
        .map_err(|e| vec![format!("a directory in {}: {e}", base.display())])?;
    let usable = create_pool(dir.path(), &cfg.layout).map_err(|e| vec![e])?;
    // Every device opened under the directory keeps its unsynced writes apart (for a
    // crash at the end; unused otherwise).
    let journal = crash::arm(dir.path());
    let live = start(dir.path(), cfg, usable).map_err(|e| vec![e])?;
    let t0 = Instant::now();
    fill_first(&live).map_err(|e| vec![e])?;
    let mut report = LiveReport::default();
    let t1 = Instant::now();
    let deadline = t1 + cfg.duration;
    std::thread::scope(|s| {
        for vi in 0..live.vols.len() {
            for t in 0..live.writers {
                let live = &live;
                let seed = cfg.seed ^ ((vi as u64) << 32) ^ t as u64;
                s.spawn(move || writer(live, vi, t, seed));
            }
        }
        control(
            &live,
            cfg.seed.wrapping_mul(31),
            deadline,
            cfg.crash.then_some(&*journal),
            &mut report,
        );
    });
    let t2 = Instant::now();
    if cfg.crash && live.failures.lock().expect("failures").is_empty() {
        if let Err(e) = power_off(&live, dir.path(), cfg, &journal, &mut report) {
            live.fail(e);
        }
    }
    if live.failures.lock().expect("failures").is_empty() {
        if let Err(e) = finish(&live, dir.path(), cfg, cfg.crash, &mut report) {
            live.fail(e);
        }
    }
    report.seconds = (
        (t1 - t0).as_secs_f64(),
        (t2 - t1).as_secs_f64(),
        t2.elapsed().as_secs_f64(),
    );
    live.counts(&mut report);
    let mut failures = std::mem::take(&mut *live.failures.lock().expect("failures"));
    if failures.is_empty() {
        return Ok(report);
    }
    // The pool's devices stay, for a look with the `bulwark` commands.
    drop(live);
    drop(journal);
    let kept = dir.keep();
    failures.push(format!("the pool's directory is kept: {}", kept.display()));
    Err(failures)
}

/// The pool opened in `dir` with the run's volumes, and the run's shared state.
fn start(dir: &Path, cfg: &LiveConfig, usable: u64) -> Result<Live, String> {
    let pool = Pool::open(dir, options(cfg)).map_err(|e| format!("open: {e}"))?;
    let mut rng = Rng::new(cfg.seed);
    let mut vols = Vec::new();
    for shape in shapes(usable, cfg.huge_spread) {
        let key = shape.encrypted.then(|| 1 + rng.below(200) as u8);
        pool.create_volume(
            shape.name,
            VolumeOptions {
                size_bytes: shape.size(),
                block_size: shape.block_size,
                compression: Compression::Lz4,
                encryption: shape.encrypted,
            },
            key.map(secret).as_ref(),
        )
        .map_err(|e| format!("volume create {}: {e}", shape.name))?;
        let cells = (0..shape.cells()).map(|_| CellModel::new()).collect();
        vols.push(Vol {
            shape,
            key,
            cells,
            gate: RwLock::new(()),
            snaps: Mutex::new(VecDeque::new()),
        });
    }
    Ok(Live {
        pool: RwLock::new(Some(pool)),
        vols,
        next_value: AtomicU64::new(1),
        stop: AtomicBool::new(false),
        frozen: AtomicBool::new(false),
        failures: Mutex::new(Vec::new()),
        recent: Mutex::new(VecDeque::new()),
        writes: AtomicU64::new(0),
        reads: AtomicU64::new(0),
        flushes: AtomicU64::new(0),
        refused: AtomicU64::new(0),
        checked: AtomicU64::new(0),
        snap_checked: AtomicU64::new(0),
        writers: cfg.writers.max(1),
        slowest: Mutex::new((0.0, String::new())),
        slow: AtomicU64::new(0),
    })
}

/// Power off: the pool is dropped on frozen devices, then each unsynced write is kept,
/// dropped or torn, and the pool imported.
fn power_off(
    live: &Live,
    dir: &Path,
    cfg: &LiveConfig,
    journal: &CrashJournal,
    report: &mut LiveReport,
) -> Result<(), String> {
    drop(live.pool.write().expect("pool lock").take());
    let mut rng = Rng::new(cfg.seed ^ 0xC8A5);
    let out = journal
        .crash(&mut |n| rng.below(n))
        .map_err(|e| format!("applying the crash: {e}"))?;
    report.crash = Some((out.kept, out.dropped, out.torn));
    let pool = Pool::open(dir, options(cfg))
        .map_err(|e| format!("the pool does not import after the crash: {e}"))?;
    *live.pool.write().expect("pool lock") = Some(pool);
    Ok(())
}

/// Write every cell of the first volume once (the pool's fill), then flush.
fn fill_first(live: &Live) -> Result<(), String> {
    let pool = live.pool();
    let v = &live.vols[0];
    let h = pool
        .volume(v.shape.name)
        .map_err(|e| format!("open: {e}"))?;
    let chunk = 64u64;
    let mut buf = vec![0u8; (chunk * CELL) as usize];
    let mut c = 0;
    while c < v.shape.cells() {
        let n = chunk.min(v.shape.island_cells - c % v.shape.island_cells);
        let mut values = Vec::with_capacity(n as usize);
        for i in 0..n {
            let value = live.value();
            fill_cell(
                value,
                cell_id(0, c + i),
                &mut buf[(i * CELL) as usize..((i + 1) * CELL) as usize],
            );
            values.push(value);
        }
        h.write(v.shape.offset(c), &buf[..(n * CELL) as usize], false)
            .map_err(|e| format!("fill of {} at cell {c}: {e}", v.shape.name))?;
        for (i, value) in values.into_iter().enumerate() {
            v.cells[(c + i as u64) as usize].written(value, false);
        }
        c += n;
    }
    h.flush()
        .map_err(|e| format!("flush after the fill: {e}"))?;
    v.cells.iter().for_each(CellModel::settled);
    Ok(())
}

/// After an operation of a writer: go on, end the burst (let go of the handle), or stop.
enum Next {
    Go,
    EndBurst,
    Stop,
}

/// A writer thread of one volume, and the cells it owns.
struct Writer<'a> {
    live: &'a Live,
    vi: usize,
    t: usize,
    /// The groups of cells this thread owns.
    groups: Vec<u64>,
    scratch: Vec<u8>,
}

/// A writer thread of volume `vi`: bursts of writes, reads and flushes on its own cells,
/// each burst on a handle it opens and drops (as an NBD client connects and leaves).
fn writer(live: &Live, vi: usize, t: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let sh = &live.vols[vi].shape;
    let groups: Vec<u64> = (0..sh.cells().div_ceil(sh.group))
        .filter(|g| sh.owner(g * sh.group, live.writers) == t)
        .collect();
    if groups.is_empty() {
        return;
    }
    let mut w = Writer {
        live,
        vi,
        t,
        groups,
        scratch: vec![0u8; CELL as usize],
    };
    let mut buf = vec![0u8; (sh.group * CELL) as usize];
    // Until the control thread says stop (after the machine stopped, for a crash: the
    // writers are at work when it does).
    while !live.stop.load(Ordering::Acquire) {
        let _gate = live.vols[vi].gate.read().expect("gate");
        let h: Arc<Volume> = match live.pool().volume(sh.name) {
            Ok(h) => h,
            Err(e) => {
                w.failed(&format!("open with the key loaded: {e}"));
                return;
            }
        };
        for _ in 0..rng.range(10, 200) {
            if live.stop.load(Ordering::Acquire) {
                return;
            }
            let g = w.groups[rng.below(w.groups.len() as u64) as usize];
            let c0 = g * sh.group + rng.below(sh.group);
            let end = ((g + 1) * sh.group).min(sh.cells());
            let n = 1 + rng.below(end - c0);
            let bytes = &mut buf[..(n * CELL) as usize];
            let next = match rng.below(100) {
                0..=59 => w.write(&h, c0, bytes, rng.chance(50)),
                60..=64 => {
                    let zero = rng.chance(400);
                    w.clear(&h, c0, n, zero, zero && rng.chance(100))
                }
                65..=94 => w.read(&h, c0, bytes),
                _ => w.flush(&h),
            };
            match next {
                Next::Go => {}
                Next::EndBurst => break,
                Next::Stop => return,
            }
        }
    }
}

impl Writer<'_> {
    fn frozen(&self) -> bool {
        self.live.frozen.load(Ordering::Acquire)
    }
    fn cell(&self, c: u64) -> &CellModel {
        &self.live.vols[self.vi].cells[c as usize]
    }
    /// An error the run fails on, unless the machine has stopped (then every answer may be
    /// an error).
    fn failed(&self, what: &str) {
        if !self.frozen() {
            let name = self.live.vols[self.vi].shape.name;
            self.live.fail(format!("{name} writer {}: {what}", self.t));
        }
    }

    /// Cells `c0..` written with new values; `fua` asks for them durable at once.
    fn write(&mut self, h: &Volume, c0: u64, bytes: &mut [u8], fua: bool) -> Next {
        let sh = &self.live.vols[self.vi].shape;
        let n = bytes.len() as u64 / CELL;
        let values: Vec<u64> = (0..n).map(|_| self.live.value()).collect();
        for (i, &value) in values.iter().enumerate() {
            fill_cell(
                value,
                cell_id(self.vi, c0 + i as u64),
                &mut bytes[i * CELL as usize..(i + 1) * CELL as usize],
            );
        }
        let start = Instant::now();
        let got = h.write(sh.offset(c0), bytes, fua);
        self.live.timed(start, &|| {
            format!(
                "{} write of {n} cells at {c0} (fua {fua}): {:?}",
                sh.name,
                got.as_ref().map(|_| ())
            )
        });
        // Read after the answer: a FUA answered before the machine stopped.
        let durable = fua && !self.frozen();
        let cells = (c0..).zip(values);
        match got {
            Ok(()) => {
                cells.for_each(|(c, value)| self.cell(c).written(value, durable));
                self.live.writes.fetch_add(1, Ordering::Relaxed);
                Next::Go
            }
            Err(e) => {
                cells.for_each(|(c, value)| self.cell(c).tried(value));
                self.refused(e, c0)
            }
        }
    }

    /// A write refused: for space, the burst ends, as a client given ENOSPC lets go of the
    /// volume for now (so the operator, who may be waiting to free space, gets in).
    fn refused(&self, e: Error, c0: u64) -> Next {
        if self.frozen() {
            return Next::Stop;
        }
        if !matches!(e, Error::NoSpace) {
            self.failed(&format!("write at cell {c0}: {e}"));
            return Next::Stop;
        }
        self.live.refused.fetch_add(1, Ordering::Relaxed);
        Next::EndBurst
    }

    /// Trim (whole blocks read as zeros after it; a part of a block is left as it is) or,
    /// `zero`, zeroes (every cell reads as zeros).
    fn clear(&mut self, h: &Volume, c0: u64, n: u64, zero: bool, fua: bool) -> Next {
        let sh = &self.live.vols[self.vi].shape;
        let start = Instant::now();
        let got = if zero {
            h.write_zeroes(sh.offset(c0), n * CELL, fua)
        } else {
            h.trim(sh.offset(c0), n * CELL)
        };
        self.live.timed(start, &|| {
            let what = if zero { "zero" } else { "trim" };
            format!("{} {what} of {n} cells at {c0}", sh.name)
        });
        let per_block = sh.block_size as u64 / CELL;
        let cleared = (c0..c0 + n).filter(|&c| {
            let first = c - c % per_block;
            zero || (first >= c0 && first + per_block <= c0 + n)
        });
        let durable = fua && !self.frozen();
        match got {
            Ok(()) => {
                cleared.for_each(|c| self.cell(c).written(0, durable));
                self.live.writes.fetch_add(1, Ordering::Relaxed);
                Next::Go
            }
            Err(e) => {
                cleared.for_each(|c| self.cell(c).tried(0));
                self.refused(e, c0)
            }
        }
    }

    /// Read cells `c0..` and check them; what it read, it reads from now on.
    fn read(&mut self, h: &Volume, c0: u64, bytes: &mut [u8]) -> Next {
        let live = self.live;
        let v = &live.vols[self.vi];
        let n = bytes.len() as u64 / CELL;
        let start = Instant::now();
        let got = h.read(v.shape.offset(c0), bytes);
        live.timed(start, &|| {
            format!("{} read of {n} cells at {c0}", v.shape.name)
        });
        if let Err(e) = got {
            self.failed(&format!("read at cell {c0}: {e}"));
            return Next::Stop;
        }
        live.reads.fetch_add(1, Ordering::Relaxed);
        let expect = |cell: u64| v.cells[cell as usize].now_allowed();
        if let Err(m) = live.check(v.shape.name, self.vi, c0, bytes, &expect, &mut self.scratch) {
            live.fail(m);
            return Next::Stop;
        }
        for (i, b) in bytes.chunks(CELL as usize).enumerate() {
            self.cell(c0 + i as u64).pin(value_in(b));
        }
        Next::Go
    }

    /// FLUSH: answered before the machine stopped, every cell this thread owns is durable.
    fn flush(&mut self, h: &Volume) -> Next {
        let sh = &self.live.vols[self.vi].shape;
        let start = Instant::now();
        let got = h.flush();
        self.live.timed(start, &|| {
            format!("{} flush: {:?}", sh.name, got.as_ref().map(|_| ()))
        });
        if let Err(e) = got {
            self.failed(&format!("flush: {e}"));
            return Next::Stop;
        }
        // Read after the answer: it returned before the machine stopped.
        if !self.frozen() {
            for &g in &self.groups {
                for c in g * sh.group..((g + 1) * sh.group).min(sh.cells()) {
                    self.cell(c).flushed();
                }
            }
        }
        self.live.flushes.fetch_add(1, Ordering::Relaxed);
        Next::Go
    }
}

/// The operator: key cycles, snapshots (recorded and read back), rotation, scrub, flushes.
fn control(
    live: &Live,
    seed: u64,
    deadline: Instant,
    journal: Option<&CrashJournal>,
    report: &mut LiveReport,
) {
    control_until(live, seed, deadline, report);
    // The machine stops under the running threads, or the writers end their bursts.
    if let Some(j) = journal {
        live.frozen.store(true, Ordering::Release);
        // While writes are unsynced (at most two seconds of waiting for some): a crash
        // of a machine whose writers all waited for space, or just after a commit synced
        // everything, would test nothing.
        let want = 1 + (seed % 64) as usize;
        for _ in 0..2000 {
            if j.unsynced() >= want {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        j.freeze();
    }
    live.stop.store(true, Ordering::Release);
}

/// The control thread's state: its choices, and the names it gave.
struct Operator<'a> {
    live: &'a Live,
    rng: Rng,
    scratch: Vec<u8>,
    next_name: u64,
}

/// What an operator's step found wrong (the run fails with it).
type Step = Result<(), String>;

fn control_until(live: &Live, seed: u64, deadline: Instant, report: &mut LiveReport) {
    let mut op = Operator {
        live,
        rng: Rng::new(seed),
        scratch: vec![0u8; CELL as usize],
        next_name: 0,
    };
    // Every run cycles the filled volume's key and snapshots it at least once, however few
    // steps a slow machine gives it.
    let first = op
        .key_cycle(&live.pool(), 0, report)
        .and_then(|()| op.snapshot(&live.pool(), 0, report));
    if let Err(m) = first {
        live.fail(m);
        return;
    }
    while !live.stop.load(Ordering::Acquire) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(op.rng.range(5, 150)));
        let vi = op.rng.below(live.vols.len() as u64) as usize;
        let name = live.vols[vi].shape.name;
        let pool = live.pool();
        let start = Instant::now();
        let kind = op.rng.below(100);
        let step = match kind {
            0..=29 => op.key_cycle(&pool, vi, report),
            30..=49 => op.snapshot(&pool, vi, report),
            50..=61 => op.read_snapshot(vi),
            62..=69 => op.clone(&pool, vi, report),
            70..=79 => op.rotate(&pool, vi, report),
            80..=84 => op.scrub(&pool, report),
            _ => {
                live.note("pool flush".into());
                pool.flush().map_err(|e| format!("pool flush: {e}"))
            }
        };
        if let Err(m) = step {
            live.fail(m);
            return;
        }
        live.timed(start, &|| {
            let last = live.recent.lock().expect("recent").back().cloned();
            format!("control op {kind} on {name} ({last:?}, the gate's wait included)")
        });
        let space = pool.status().space;
        report.clean_written_bytes = space.clean_written_bytes;
        report.most_used = report
            .most_used
            .max(space.used_bytes as f64 / space.usable_bytes.max(1) as f64);
        let stale = pool.stale_cached_nodes();
        if stale > 0 {
            live.fail(format!(
                "{stale} stale map nodes were found in the node cache"
            ));
            return;
        }
    }
}

impl Operator<'_> {
    /// Key unload and load, the volume's handles let go of first (its writers wait).
    fn key_cycle(&mut self, pool: &Pool, vi: usize, report: &mut LiveReport) -> Step {
        let live = self.live;
        let v = &live.vols[vi];
        let name = v.shape.name;
        let Some(key) = v.key else { return Ok(()) };
        let _all = v.gate.write().expect("gate");
        live.note(format!("key unload {name}"));
        let t = Instant::now();
        let got = pool.unload_key(name);
        live.timed(t, &|| {
            format!("key unload {name}: {:?}", got.as_ref().map(|_| ()))
        });
        got.map_err(|e| format!("key unload of {name} with no handle open: {e}"))?;
        match pool.volume(name) {
            Err(Error::Locked(_)) => {}
            other => {
                return Err(format!(
                    "{name} opened after key unload: {:?}",
                    other.map(|_| ())
                ))
            }
        }
        if self.rng.chance(300) {
            std::thread::sleep(Duration::from_millis(self.rng.range(1, 50)));
        }
        live.note(format!("key load {name}"));
        let t = Instant::now();
        let got = pool.load_key(name, &secret(key));
        live.timed(t, &|| {
            format!("key load {name}: {:?}", got.as_ref().map(|_| ()))
        });
        got.map_err(|e| format!("key load of {name}: {e}"))?;
        report.key_cycles += 1;
        Ok(())
    }

    /// A snapshot whose contents are known (the volume's writers wait for it); the oldest
    /// destroyed past two (one of the filled volume, whose overwrites each snapshot pins).
    fn snapshot(&mut self, pool: &Pool, vi: usize, report: &mut LiveReport) -> Step {
        let live = self.live;
        let v = &live.vols[vi];
        let name = v.shape.name;
        let snap = format!("s{}", self.next_name);
        self.next_name += 1;
        let contents = {
            let _all = v.gate.write().expect("gate");
            live.note(format!("snapshot create {name}@{snap}"));
            match pool.snapshot_create(name, &snap) {
                Ok(()) => {}
                Err(Error::NoSpace) => return Ok(()),
                Err(e) => return Err(format!("snapshot create {name}@{snap}: {e}")),
            }
            v.cells
                .iter()
                .map(CellModel::now_allowed)
                .collect::<Vec<Vec<u64>>>()
        };
        report.snapshots += 1;
        let mut snaps = v.snaps.lock().expect("snaps");
        snaps.push_back((snap, contents));
        if snaps.len() > if vi == 0 { 1 } else { 2 } {
            let (old, _) = snaps.pop_front().expect("more than one");
            live.note(format!("snapshot destroy {name}@{old}"));
            pool.snapshot_destroy(name, &old)
                .map_err(|e| format!("snapshot destroy {name}@{old}: {e}"))?;
        }
        Ok(())
    }

    /// Read part of a snapshot kept.
    fn read_snapshot(&mut self, vi: usize) -> Step {
        let live = self.live;
        let v = &live.vols[vi];
        let snaps = v.snaps.lock().expect("snaps");
        let Some((snap, contents)) = snaps.get(self.rng.below(snaps.len().max(1) as u64) as usize)
        else {
            return Ok(());
        };
        let view = format!("{}@{snap}", v.shape.name);
        let pick = self.rng.next_u64();
        check_snapshot(live, vi, &view, contents, pick, 64, &mut self.scratch)
    }

    /// A clone of a kept snapshot, under a key of its own: it reads as the snapshot, then
    /// as its own writes; destroyed after (a snapshot with clones cannot be).
    fn clone(&mut self, pool: &Pool, vi: usize, report: &mut LiveReport) -> Step {
        let live = self.live;
        let v = &live.vols[vi];
        let name = v.shape.name;
        let snaps = v.snaps.lock().expect("snaps");
        let Some((snap, contents)) = snaps.get(self.rng.below(snaps.len().max(1) as u64) as usize)
        else {
            return Ok(());
        };
        let clone = format!("{name}-c{}", self.next_name);
        self.next_name += 1;
        let key = v.key.map(|_| 1 + self.rng.below(200) as u8);
        live.note(format!("clone {name}@{snap} {clone}"));
        match pool.volume_clone(name, snap, &clone, key.map(secret).as_ref()) {
            Ok(()) => {}
            // The origin's key rotation under way, or no room.
            Err(Error::Busy(_)) | Err(Error::NoSpace) => return Ok(()),
            Err(e) => return Err(format!("clone of {name}@{snap} as {clone}: {e}")),
        }
        // Half of the encrypted ones made independent (`--independent`: the clone's key
        // rotation re-encrypts what it inherited, then detaches it), and destroyed while
        // that may still run.
        let independent = key.is_some() && self.rng.below(2) == 0;
        if independent {
            live.note(format!("key rotate {clone} (independent)"));
            match pool.key_rotate(&clone) {
                Ok(_) => report.independent_clones += 1,
                Err(Error::Busy(_)) | Err(Error::NoSpace) => {}
                Err(e) => return Err(format!("key rotate {clone}: {e}")),
            }
        }
        let pick = self.rng.next_u64();
        check_snapshot(live, vi, &clone, contents, pick, 256, &mut self.scratch)?;
        write_clone(live, vi, pool, &clone, &mut self.rng, &mut self.scratch)?;
        if independent {
            // The destroy lands anywhere in the re-encryption, its end included (where
            // the daemon's run found a destroy freeing the origin's data, 6432e02).
            std::thread::sleep(Duration::from_millis(self.rng.below(200)));
        }
        live.note(format!("volume destroy {clone}"));
        pool.destroy_volume(&clone)
            .map_err(|e| format!("volume destroy {clone}: {e}"))?;
        report.clones += 1;
        Ok(())
    }

    fn rotate(&mut self, pool: &Pool, vi: usize, report: &mut LiveReport) -> Step {
        let v = &self.live.vols[vi];
        let name = v.shape.name;
        if v.key.is_none() {
            return Ok(());
        }
        self.live.note(format!("key rotate {name}"));
        match pool.key_rotate(name) {
            Ok(_) => report.rotations += 1,
            // A rotation under way, or no room for it now.
            Err(Error::Busy(_)) | Err(Error::NoSpace) | Err(Error::Invalid(_)) => {}
            Err(e) => return Err(format!("key rotate {name}: {e}")),
        }
        Ok(())
    }

    fn scrub(&mut self, pool: &Pool, report: &mut LiveReport) -> Step {
        self.live.note("scrub".into());
        match pool.scrub_start() {
            Ok(()) => report.scrubs += 1,
            Err(Error::Busy(_)) => {}
            Err(e) => return Err(format!("scrub start: {e}")),
        }
        Ok(())
    }
}

/// Write a few cells of clone `clone` (of volume `vi`) and read each back.
fn write_clone(
    live: &Live,
    vi: usize,
    pool: &Pool,
    clone: &str,
    rng: &mut Rng,
    scratch: &mut [u8],
) -> Step {
    let sh = &live.vols[vi].shape;
    let h = pool
        .volume(clone)
        .map_err(|e| format!("open {clone}: {e}"))?;
    let mut buf = vec![0u8; CELL as usize];
    for _ in 0..16 {
        let c = rng.below(sh.cells());
        let value = live.value();
        fill_cell(value, cell_id(vi, c), &mut buf);
        match h.write(sh.offset(c), &buf, false) {
            Ok(()) => {}
            Err(Error::NoSpace) => return Ok(()),
            Err(e) => return Err(format!("write of {clone} at cell {c}: {e}")),
        }
        h.read(sh.offset(c), &mut buf)
            .map_err(|e| format!("read of {clone} at cell {c}: {e}"))?;
        live.check(clone, vi, c, &buf, &|_| vec![value], scratch)?;
    }
    Ok(())
}

/// Read `n` cells of snapshot view `view` from a place `pick` chooses (all of them when
/// `n` is 0) and check them against `contents`.
fn check_snapshot(
    live: &Live,
    vi: usize,
    view: &str,
    contents: &[Vec<u64>],
    pick: u64,
    n: u64,
    scratch: &mut [u8],
) -> Step {
    let sh = &live.vols[vi].shape;
    let h = live
        .pool()
        .volume(view)
        .map_err(|e| format!("open {view}: {e}"))?;
    let (first, count) = if n == 0 {
        (0, sh.cells())
    } else {
        (
            pick % sh.cells().saturating_sub(n).max(1),
            n.min(sh.cells()),
        )
    };
    let mut buf = vec![0u8; CELL as usize * 64];
    let mut c = first;
    while c < first + count {
        let k = 64
            .min(first + count - c)
            .min(sh.island_cells - c % sh.island_cells);
        let bytes = &mut buf[..(k * CELL) as usize];
        h.read(sh.offset(c), bytes)
            .map_err(|e| format!("read of {view} at cell {c}: {e}"))?;
        let expect = |cell: u64| contents[cell as usize].clone();
        live.check(view, vi, c, bytes, &expect, scratch)?;
        live.snap_checked.fetch_add(k, Ordering::Relaxed);
        c += k;
    }
    Ok(())
}

/// Every cell of every volume and kept snapshot (after a crash: each its last durable
/// value or one written since, pinned to what it read), then again after a clean close and
/// an import (exactly what it read before).
fn finish(
    live: &Live,
    dir: &Path,
    cfg: &LiveConfig,
    crashed: bool,
    report: &mut LiveReport,
) -> Result<(), String> {
    let mut scratch = vec![0u8; CELL as usize];
    for round in 0..2 {
        let pool = live.pool();
        for (vi, v) in live.vols.iter().enumerate() {
            let sh = &v.shape;
            if round == 1 || crashed {
                if let Some(k) = v.key {
                    pool.load_key(sh.name, &secret(k))
                        .map_err(|e| format!("key load of {} after import: {e}", sh.name))?;
                }
            }
            let after_crash = crashed && round == 0;
            let what = if after_crash {
                format!("{} after the crash", sh.name)
            } else {
                sh.name.to_string()
            };
            let h = pool
                .volume(sh.name)
                .map_err(|e| format!("open {what}: {e}"))?;
            let mut buf = vec![0u8; CELL as usize * 64];
            let mut c = 0;
            while c < sh.cells() {
                let k = 64.min(sh.island_cells - c % sh.island_cells);
                let bytes = &mut buf[..(k * CELL) as usize];
                h.read(sh.offset(c), bytes)
                    .map_err(|e| format!("final read of {what} at cell {c}: {e}"))?;
                let expect = |cell: u64| {
                    let m = &v.cells[cell as usize];
                    if after_crash {
                        m.crash_allowed()
                    } else {
                        m.now_allowed()
                    }
                };
                live.check(&what, vi, c, bytes, &expect, &mut scratch)?;
                for (i, b) in bytes.chunks(CELL as usize).enumerate() {
                    let m = &v.cells[(c + i as u64) as usize];
                    m.pin(value_in(b));
                    m.settled();
                }
                c += k;
            }
            drop(h);
            for (snap, contents) in v.snaps.lock().expect("snaps").iter() {
                let view = format!("{}@{snap}", sh.name);
                check_snapshot(live, vi, &view, contents, 0, 0, &mut scratch)?;
            }
        }
        report.stale_cached_nodes += pool.stale_cached_nodes();
        if report.stale_cached_nodes > 0 {
            return Err(format!(
                "{} stale map nodes were found in the node cache",
                report.stale_cached_nodes
            ));
        }
        if round == 0 {
            pool.close().map_err(|e| format!("close: {e}"))?;
            drop(pool);
            *live.pool.write().expect("pool lock") = None;
            let pool =
                Pool::open(dir, options(cfg)).map_err(|e| format!("import after close: {e}"))?;
            *live.pool.write().expect("pool lock") = Some(pool);
        }
    }
    if let Some(p) = live.pool.write().expect("pool lock").take() {
        p.close().map_err(|e| format!("close: {e}"))?;
    }
    Ok(())
}
