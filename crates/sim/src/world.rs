//! One simulated world: a pool in a fresh directory, its volumes, the model beside them,
//! and the driver that draws every operation from the seed.
//!
//! The pool is opened `stepped` (engine `pool/stepped.rs`): no maintenance or scrub thread
//! runs, and the driver interleaves their steps with client operations itself. Every
//! member device goes through the engine's crash journal (`device/crash.rs`), so a crash
//! can fall between two operations or inside one (at the n-th device write), and leaves
//! each unsynced write kept, dropped or torn, as the seed says. Faults (`Kind::Fault`,
//! `Kind::Device`) are armed through `Pool::set_faults`, only ever on what leaves every
//! block a good copy, or on the only copy for one read (docs/simulation.md).

use std::path::PathBuf;
use std::sync::Arc;

use bulwark_engine::device::crash::{self, CrashJournal};
use bulwark_engine::device::fault::{Fault, FaultMode};
use bulwark_engine::{
    Compression, DeviceSpec, Error, Layout, OpenOptions, Pool, Secret, Volume, VolumeOptions,
};
use zeroize::Zeroizing;

use crate::model::{fill_cell, value_of, Cell, Vol, CELL, ISLAND};
use crate::rng::{Rng, Trace};

mod tiered;

/// Pool layouts the simulator builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimLayout {
    Single,
    Mirror,
    Parity,
    /// `single` with a separate intent log device (`pool log add`): a FLUSH is a log
    /// block on it, and an import after a crash replays it.
    Log,
    /// `single` with the object tier on a simulated S3 (`objects.rs`, `world/tiered.rs`):
    /// every commit publishes to it, whose faults and second writer the seed arms.
    Tier,
}

impl Kind {
    pub fn parse(s: &str) -> Option<Kind> {
        KINDS
            .iter()
            .chain(LATER_KINDS.iter())
            .chain(tiered::TIER_KINDS.iter())
            .chain([(Kind::SmallCache, 0), (Kind::HolesFirst, 0)].iter())
            .map(|(k, _)| *k)
            .find(|k| format!("{k:?}").eq_ignore_ascii_case(s))
    }
}

impl SimLayout {
    pub fn parse(s: &str) -> Option<SimLayout> {
        match s {
            "single" => Some(SimLayout::Single),
            "mirror" => Some(SimLayout::Mirror),
            "parity" => Some(SimLayout::Parity),
            "log" => Some(SimLayout::Log),
            "tier" => Some(SimLayout::Tier),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            SimLayout::Single => "single",
            SimLayout::Mirror => "mirror",
            SimLayout::Parity => "parity",
            SimLayout::Log => "log",
            SimLayout::Tier => "tier",
        }
    }
    /// Every layout (`--layout all`).
    pub fn all() -> Vec<SimLayout> {
        vec![
            SimLayout::Single,
            SimLayout::Mirror,
            SimLayout::Parity,
            SimLayout::Log,
            SimLayout::Tier,
        ]
    }
    /// A separate intent log device, a file in the pool's directory (so the crash journal
    /// keeps its unsynced writes apart like the members').
    fn log_device(self) -> bool {
        self == SimLayout::Log
    }
    fn engine(self) -> (Layout, usize) {
        match self {
            SimLayout::Single | SimLayout::Log | SimLayout::Tier => (Layout::Single, 1),
            SimLayout::Mirror => (Layout::Mirror(2), 2),
            SimLayout::Parity => ("parity:2+1".parse().expect("a valid layout"), 3),
        }
    }
}

/// Operation kinds. Each seed turns on a random subset (swarm testing); `Write`, `Read`
/// and `Maintenance` are always on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Write,
    Read,
    Maintenance,
    Zero,
    Trim,
    Flush,
    SnapCreate,
    SnapDestroy,
    Clone,
    Rollback,
    Create,
    Destroy,
    Resize,
    KeyCycle,
    Scrub,
    Crash,
    Restart,
    KeyRotate,
    RotateStep,
    KeyErase,
    Fault,
    Device,
    LogChange,
    /// The object tier (`tier` layout only, `world/tiered.rs`): store faults around a
    /// commit, a second writer, a restore from the bucket alone, the tier's own step.
    TierFault,
    TierWriter,
    TierRestore,
    TierStep,
    /// A quiet spell: no client asks anything while the clock passes the defragmenter's
    /// quiet time (`DEFRAG_IDLE_SECS`) and maintenance rounds run (`pool/defrag.rs`).
    Idle,
    /// Create a huge thin volume: terabytes, its cells in islands far apart
    /// (`model::Vol::spread`), so its map is six levels deep and nearly empty (the lost
    /// write of issue 37 was seen with very large thin volumes).
    HugeCreate,
    /// Create a scattered thin volume: each block alone in an island far from the next
    /// (`model::Vol::island`), so each written block has a map leaf of its own and the maps
    /// outgrow the data they point to, as a guest's scattered file-system metadata makes them
    /// (issue 36 part 5: the room kept to rewrite every map outgrew the cleaner's).
    ScatterCreate,
    /// A guest writes its whole disk front to back, then flushes (`World::fill_volume`).
    Fill,
    /// A guest's burst of random one-block overwrites, a FLUSH every 16
    /// (`World::overwrite`).
    Overwrite,
    /// Not an operation: the seed's draw of a 64-node map cache (`World::tiny_node_cache`),
    /// named so that `--without SmallCache` turns it off like a kind.
    SmallCache,
    /// Not an operation: the seed's draw of holes first (`OpenOptions::holes_first`,
    /// `World::holes_first`), named so that `--without HolesFirst` turns it off.
    HolesFirst,
}

/// How a new volume lays its cells out (`model::Vol::spread`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CellLayout {
    /// Cell `c` at byte `c * CELL`.
    Plain,
    /// Terabytes, islands of `ISLAND` cells far apart (`Kind::HugeCreate`).
    Huge,
    /// One block per island (`Kind::ScatterCreate`).
    Scatter,
}

/// A member out of a redundant pool (`World::device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Out {
    /// `device offline`.
    Offline,
    /// Every I/O to it fails (`vanish` armed): unplugged.
    Vanished,
    /// Back (online, or replaced by a blank device) and resilvering: the scrub steps
    /// bring its copies up to date.
    Resilvering,
}

/// Each kind and its weight when on.
const KINDS: [(Kind, u64); 17] = [
    (Kind::Write, 400),
    (Kind::Read, 150),
    (Kind::Maintenance, 80),
    (Kind::Zero, 30),
    (Kind::Trim, 40),
    (Kind::Flush, 60),
    (Kind::SnapCreate, 25),
    (Kind::SnapDestroy, 15),
    (Kind::Clone, 10),
    (Kind::Rollback, 12),
    (Kind::Create, 6),
    (Kind::Destroy, 6),
    (Kind::Resize, 6),
    (Kind::KeyCycle, 8),
    (Kind::Scrub, 4),
    (Kind::Crash, 10),
    (Kind::Restart, 3),
];

/// Kinds added after the first long runs (F1's seeds), drawn from a generator of their
/// own so that a seed run `--without` each of them replays as it did before they came
/// (`tests/regressions.rs`). `RotateStep` (a batch of each rotation under way, what the
/// rotation worker does) is on whenever `KeyRotate` is.
pub const LATER_KINDS: [(Kind, u64); 11] = [
    (Kind::KeyRotate, 6),
    (Kind::RotateStep, 40),
    (Kind::KeyErase, 3),
    (Kind::Fault, 12),
    (Kind::Device, 8),
    (Kind::LogChange, 4),
    (Kind::Idle, 6),
    (Kind::HugeCreate, 4),
    (Kind::ScatterCreate, 4),
    (Kind::Fill, 3),
    (Kind::Overwrite, 10),
];

/// Faults a window arms on one member of a redundant pool (`World::fault`): every one
/// leaves the other members whole, so every read must still return the right bytes.
const WINDOW_FAULTS: [FaultMode; 5] = [
    FaultMode::ReadFlip,
    FaultMode::ReadError,
    FaultMode::WriteFlip,
    FaultMode::DropWrites,
    FaultMode::MisdirectWrites,
];

/// How often an armed fault hits an I/O, per mille (drawn per window).
const FAULT_ODDS: [u64; 4] = [10, 50, 200, 600];

/// The run's directory in `base`, named by the seed and layout, not at random: device
/// paths reach the pool's records (a resilver's health record names its device), so a
/// random name would lay different bytes, and so different I/O, on every run of a seed.
/// A name in use (a run of the same seed at the same time, or one killed before it
/// cleaned up) takes the next free suffix; that run then differs from the others.
fn run_dir(base: &std::path::Path, cfg: &Config) -> Result<tempfile::TempDir, String> {
    for n in 0..1000 {
        let mut name = format!("bulwark-sim-{}-{}", cfg.seed, cfg.layout.name());
        if n > 0 {
            name.push_str(&format!("-{n}"));
        }
        match tempfile::Builder::new()
            .prefix(&name)
            .rand_bytes(0)
            .tempdir_in(base)
        {
            Ok(d) => return Ok(d),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(format!("temp dir in {}: {e}", base.display())),
        }
    }
    Err(format!("no free run directory in {}", base.display()))
}

/// How far the used bytes an import recounts may lie from those counted while running, at
/// a clean restart (`World::restart`): the close's commit rewrites metadata whose size
/// varies by a few bytes (the volume table, compressed, with keys sealed in it). The
/// engine's own model test (`engine_model_snapshots.rs`) allows the same.
const USED_RECOUNT_SLACK: u64 = 64 << 10;

/// The log device's size (`log` layout): small, so its ring wraps within a run.
const LOG_DEVICE_BYTES: u64 = 8 << 20;

/// The cache device's size, when a seed draws one: small, so its ring wraps.
const CACHE_DEVICE_BYTES: u64 = 4 << 20;

/// Below this share of its usable space used, a pool must take writes
/// (`World::refusal_is_honest`).
const HONEST_ENOSPC_PERCENT: u64 = 80;
/// Volumes (clones included) at most, and snapshots per volume at most.
const VOLS_MAX: usize = 5;
/// Cells per write of `Kind::Fill` (1 MiB, as `qemu-img convert` and `dd bs=1M` write).
const FILL_CELLS: u64 = 256;
const SNAPS_MAX: usize = 3;

/// What a run counted (printed at the end, and the numbers in BENCHMARKS.md).
#[derive(Debug, Default, Clone)]
pub struct Stats {
    pub ops: u64,
    pub writes: u64,
    pub reads: u64,
    pub cells_checked: u64,
    pub flushes: u64,
    pub snapshots: u64,
    pub clones: u64,
    pub rollbacks: u64,
    pub refusals: u64,
    pub crashes: u64,
    pub crashes_inside_op: u64,
    pub restarts: u64,
    pub key_cycles: u64,
    pub rotations: u64,
    pub rotation_batches: u64,
    pub erases: u64,
    pub fault_windows: u64,
    pub faulty_reads: u64,
    pub faulty_reads_refused: u64,
    /// Read, checksum and write errors a member counted when its window closed.
    pub device_errors_seen: u64,
    /// The most blocks one import's scrubs and reads repaired (`status`).
    pub repaired_blocks: u64,
    /// Members taken offline or vanished, replaced, and resilvers run to their end.
    pub devices_out: u64,
    pub devices_replaced: u64,
    pub resilvers: u64,
    /// Stretches of the cache device overwritten with garbage.
    pub cache_spoiled: u64,
    /// Fault windows on the log device.
    pub log_faults: u64,
    /// `pool log add` and `remove`.
    pub log_changes: u64,
    pub scrubs: u64,
    pub maintenance_steps: u64,
    pub no_space: u64,
    /// Writes, zeroes and trims that waited for space (ran maintenance rounds on the
    /// simulated clock inside the call: `Store::wait_until`), and the longest such wait.
    pub space_waits: u64,
    pub space_wait_max_ms: u64,
    pub unsynced_kept: u64,
    pub unsynced_dropped: u64,
    pub unsynced_torn: u64,
    /// The most bytes client writes had placed into holes (decision 0014) in one process
    /// of the pool, as a maintenance step saw it: whether the run filled holes at all.
    pub hole_filled_max: u64,
    /// The most bytes the idle defragmenter had moved in one process of the pool, as a
    /// quiet spell (`Kind::Idle`) saw it.
    pub defrag_moved_max: u64,
    /// Huge thin volumes created (`Kind::HugeCreate`), clones of them not counted.
    pub huge_volumes: u64,
    /// Scattered thin volumes created (`Kind::ScatterCreate`), clones not counted.
    pub scattered_volumes: u64,
    /// Runs whose map node cache held 64 nodes (`World::tiny_node_cache`).
    pub tiny_node_cache: u64,
    /// Runs with holes first (`World::holes_first`).
    pub holes_first: u64,
    /// Whole-volume fills (`Kind::Fill`) and random overwrite bursts (`Kind::Overwrite`).
    pub fills: u64,
    pub overwrites: u64,
    /// The object tier (`tier` layout): fault windows armed on the store, those in which
    /// it failed a request (how many it failed depends on the upload threads' order: not
    /// counted), flushes that failed under them, second writers and the fencings seen,
    /// restores from the bucket, tier steps.
    pub store_windows: u64,
    pub store_windows_hit: u64,
    pub store_commits_failed: u64,
    pub second_writers: u64,
    pub fenced: u64,
    pub restores: u64,
    pub tier_steps: u64,
}

pub struct Config {
    pub seed: u64,
    pub ops: u64,
    pub layout: SimLayout,
    /// Where the pool directories go (a tmpfs keeps fsync cheap).
    pub dir: Option<PathBuf>,
    /// Print every operation (`--log`) to stderr.
    pub log: bool,
    /// Kinds of operation turned off whatever the seed draws (`--without`): to tell which
    /// a failure needs. The seed's other draws stay as they were.
    pub without: Vec<Kind>,
}

pub struct World {
    rng: Rng,
    pub trace: Trace,
    pub stats: Stats,
    pub op: u64,
    on: Vec<(Kind, u64)>,
    /// Kept alive for its directory; the pool lives in it.
    dir: tempfile::TempDir,
    journal: Arc<CrashJournal>,
    pool: Option<Arc<Pool>>,
    vols: Vec<Vol>,
    handles: Vec<Option<Arc<Volume>>>,
    next_value: u64,
    next_name: u64,
    compression: bool,
    /// The first volume made takes 16 to 24 MiB of a 40 MiB pool (`World::new`).
    big_volumes: bool,
    /// The map's node cache holds 64 nodes, not 8 MiB (`World::new`).
    tiny_node_cache: bool,
    /// A third of the seeds run with holes first (`serve --holes-first`, experimental:
    /// holes of segments a quarter live, the cleaner only for the segments commits need).
    holes_first: bool,
    /// The pool has a separate log device (`SimLayout::Log`, or `Kind::LogChange`).
    log_device: bool,
    /// The pool keeps a second copy of everything (mirror, parity).
    redundant: bool,
    /// A fault window open: the member (index in `status().devices`) and the fault armed.
    window: Option<(usize, FaultMode)>,
    /// A member that may hold damage a write fault left (until a scrub repairs it): the
    /// only one a window may arm, so a block never lacks a good copy.
    damaged: Option<usize>,
    /// A member out (offline, vanished) or resilvering: no fault window meanwhile, and no
    /// other member may go.
    out: Option<(usize, Out)>,
    /// A cache device (`OpenOptions::cache_device`), drawn per seed: its writer runs on
    /// its own thread, but every copy it returns is verified, so what a read returns (and
    /// the trace) does not depend on when it ran.
    cache: Option<PathBuf>,
    /// A fault armed on the log device (`log` layout, `World::log_fault`).
    log_window: bool,
    /// The object tier (`tier` layout): the simulated store and who writes it.
    tier: Option<tiered::TierWorld>,
}

type R = Result<(), String>;

fn secret(b: u8) -> Secret {
    Secret::KeyFile(Zeroizing::new([b; 32]))
}

fn kind_of(e: &Error) -> &'static str {
    match e {
        Error::Invalid(_) => "invalid",
        Error::NotFound(_) => "not_found",
        Error::Exists(_) => "exists",
        Error::Locked(_) => "locked",
        Error::WrongKey(_) => "wrong_key",
        Error::Busy(_) => "busy",
        Error::NoSpace => "no_space",
        Error::ReadOnly(_) => "read_only",
        Error::Unrecoverable(_) => "unrecoverable",
        Error::Corrupt(_) => "corrupt",
        Error::Io(_) => "io",
        _ => "other",
    }
}

/// What the pool says of volumes and snapshots: a refusal must leave it as it was (and the
/// cells read as before: the model is unchanged, and every later read checks them). Used
/// bytes are not compared: a refusal may come after a commit, whose metadata moves them.
#[derive(Debug, PartialEq, Eq)]
struct Shape {
    volumes: Vec<String>,
    snapshots: Vec<String>,
}

impl World {
    /// Swarm: the seed's operations, whether its pool is small (near full), whether its
    /// volumes compress, and whether it has a cache device, in the order they were
    /// always drawn (`rng`, then a generator of their own for the later kinds).
    fn draw_kinds(cfg: &Config, rng: &mut Rng) -> (Vec<(Kind, u64)>, bool, bool, bool) {
        let mut on = Vec::new();
        for (k, w) in KINDS {
            let always = matches!(k, Kind::Write | Kind::Read | Kind::Maintenance);
            if (always || rng.chance(600)) && !cfg.without.contains(&k) {
                on.push((k, w));
            }
        }
        let near_full = rng.chance(300);
        let compression = rng.chance(300);
        // From a generator of their own: the main one's draws stay where they were.
        let mut later = Rng::new(cfg.seed ^ 0x5eed_1a7e_4b1d_0001);
        for (k, w) in LATER_KINDS {
            let drawn = match k {
                Kind::RotateStep => on.iter().any(|(k, _)| *k == Kind::KeyRotate),
                // Its own generator: `later`'s draws after it (the cache device) stay.
                Kind::HugeCreate => Rng::new(cfg.seed ^ 0x5eed_4a9e_0000_0003).chance(400),
                Kind::ScatterCreate => Rng::new(cfg.seed ^ 0x5eed_5ca7_0000_0004).chance(300),
                // Drawn together, from their own generator: a disk written whole, then
                // overwritten at random.
                Kind::Fill | Kind::Overwrite => {
                    Rng::new(cfg.seed ^ 0x5eed_f111_0000_0005).chance(400)
                }
                _ => later.chance(600),
            };
            if drawn && !cfg.without.contains(&k) {
                on.push((k, w));
            }
        }
        let cache_device = later.chance(300);
        (on, near_full, compression, cache_device)
    }

    pub fn new(cfg: &Config) -> Result<World, String> {
        let mut rng = Rng::new(cfg.seed);
        let (mut on, near_full, compression, cache_device) = Self::draw_kinds(cfg, &mut rng);
        // Near full, half the seeds make their first volume about half the pool: filled
        // and pinned by snapshots, cleaning's moves and map nodes then cost about what it
        // frees (the regime of issue 36's endless wait). A generator of its own again.
        let big_volumes = near_full && Rng::new(cfg.seed ^ 0x5eed_b160_0000_0002).chance(500);
        // A third of the seeds give the map's node cache its least (64 nodes) instead of
        // 8 MiB, which no simulated volume fills: clean nodes are evicted and read again
        // from the devices all the time, as in a daemon serving TiB volumes (the lost write
        // of issue 37 was seen with very large thin volumes). Its own generator too.
        let tiny_node_cache = Rng::new(cfg.seed ^ 0x5eed_cac4_0000_0004).chance(333)
            && !cfg.without.contains(&Kind::SmallCache);
        // Two thirds of the seeds run holes first, the daemon's default since 2026-12-05
        // (decision 0014); the rest the engine's default rule (`serve --no-holes-first`).
        let holes_first = Rng::new(cfg.seed ^ 0x5eed_401e_0000_0006).chance(667)
            && !cfg.without.contains(&Kind::HolesFirst);
        let tier = tiered::draw(cfg, &mut on);
        let base = match &cfg.dir {
            Some(d) => d.clone(),
            None if std::path::Path::new("/dev/shm").is_dir() => PathBuf::from("/dev/shm"),
            None => std::env::temp_dir(),
        };
        let dir = run_dir(&base, cfg)?;
        let (layout, count) = cfg.layout.engine();
        // Small pools: the cleaner runs, and a near-full seed runs out of room.
        let pool_mib: u64 = if near_full { 40 } else { 64 };
        let size_bytes = match cfg.layout {
            SimLayout::Parity => (pool_mib / 2) << 20,
            _ => pool_mib << 20,
        };
        let spec = DeviceSpec::Files { count, size_bytes };
        let mut logs = Vec::new();
        if cfg.layout.log_device() {
            let log = dir.path().join("log-device.img");
            std::fs::File::create(&log)
                .and_then(|f| f.set_len(LOG_DEVICE_BYTES))
                .map_err(|e| format!("log device file: {e}"))?;
            logs.push(log);
        }
        Pool::create_with_log(dir.path(), layout, spec, "sim", &logs)
            .map_err(|e| format!("pool create: {e}"))?;
        tier.as_ref().map(|t| t.configure(dir.path())).transpose()?;
        let cache = cache_device.then(|| dir.path().join("cache-device.img"));
        if let Some(c) = &cache {
            std::fs::File::create(c)
                .and_then(|f| f.set_len(CACHE_DEVICE_BYTES))
                .map_err(|e| format!("cache device file: {e}"))?;
        }
        let journal = crash::arm(dir.path());
        let mut w = World {
            rng,
            trace: Trace::default(),
            stats: Stats {
                tiny_node_cache: u64::from(tiny_node_cache),
                holes_first: u64::from(holes_first),
                ..Stats::default()
            },
            op: 0,
            on,
            dir,
            journal,
            pool: None,
            vols: Vec::new(),
            handles: Vec::new(),
            next_value: 0,
            next_name: 0,
            compression,
            big_volumes,
            tiny_node_cache,
            holes_first,
            log_device: cfg.layout.log_device(),
            redundant: matches!(cfg.layout, SimLayout::Mirror | SimLayout::Parity),
            window: None,
            damaged: None,
            out: None,
            cache,
            log_window: false,
            tier,
        };
        w.trace.1 = cfg.log;
        w.trace.text(cfg.layout.name());
        for (k, _) in &w.on {
            w.trace.text(&format!("{k:?}"));
        }
        if let Some(t) = &w.tier {
            w.trace.text(&t.describe());
        }
        w.open()?;
        for _ in 0..2 {
            w.create_volume(CellLayout::Plain)?;
        }
        Ok(w)
    }

    /// The kinds of operation this seed turned on.
    pub fn kinds(&self) -> Vec<Kind> {
        self.on.iter().map(|(k, _)| *k).collect()
    }

    fn pool(&self) -> &Pool {
        self.pool.as_ref().expect("the pool is open")
    }

    /// How every import of this world's pool opens it.
    fn options(&mut self) -> OpenOptions {
        OpenOptions {
            stepped: true,
            allow_fault_injection: true,
            cache_device: self.cache.clone(),
            cache_bytes: if self.tiny_node_cache { 0 } else { 8 << 20 },
            // The daemon's default since 2026-12-05 (decision 0014); the simulator ran
            // with it on before that too.
            fill_holes: true,
            holes_first: self.holes_first,
            tier: self.tier.as_mut().map(|t| t.open()),
            // Every put and release checked against the others of the run (`store/live.rs`):
            // a double release or a put over a live record fails the seed.
            check_addresses: true,
            ..OpenOptions::default()
        }
    }

    fn open(&mut self) -> R {
        let opts = self.options();
        let pool = Pool::open(self.dir.path(), opts)
            .map_err(|e| format!("the pool does not import: {e}"))?;
        if self.cache.is_some() {
            match pool.status().cache_device {
                Some(c) if c.state == "ONLINE" || c.state == "SCANNING" => {}
                other => return Err(format!("the cache device is not in use: {other:?}")),
            }
        }
        if self.log_device {
            // FLUSH goes through the log device only while it is in use.
            match pool.status().log {
                Some(l) if l.state == "ONLINE" && l.devices.len() == 1 => {}
                other => return Err(format!("the log device is not in use at import: {other:?}")),
            }
        }
        self.handles.clear();
        // Fresh device layers: no fault armed (what a window damaged stays damaged).
        self.window = None;
        self.log_window = false;
        for v in &self.vols {
            if let Some(k) = v.key {
                pool.load_key(&v.name, &secret(k))
                    .map_err(|e| format!("key load of {} after import: {e}", v.name))?;
            }
            let h = pool
                .volume(&v.name)
                .map_err(|e| format!("open {} after import: {e}", v.name))?;
            self.handles.push(Some(h));
        }
        self.pool = Some(pool);
        Ok(())
    }

    fn shape(&self) -> Shape {
        let p = self.pool();
        let mut volumes: Vec<String> = p.volumes().into_iter().map(|v| v.name).collect();
        volumes.sort();
        let mut snapshots: Vec<String> = p
            .snapshot_list(None)
            .unwrap_or_default()
            .into_iter()
            .map(|s| format!("{}@{}", s.volume, s.snapshot))
            .collect();
        snapshots.sort();
        Shape { volumes, snapshots }
    }

    /// The pool's volumes and snapshots are the model's.
    fn check_names(&self) -> R {
        let s = self.shape();
        let mut volumes: Vec<String> = self.vols.iter().map(|v| v.name.clone()).collect();
        volumes.sort();
        let mut snapshots: Vec<String> = self
            .vols
            .iter()
            .flat_map(|v| v.snaps.iter().map(move |(n, _)| format!("{}@{n}", v.name)))
            .collect();
        snapshots.sort();
        if s.volumes != volumes {
            return Err(format!(
                "volumes {:?}, the model has {volumes:?}",
                s.volumes
            ));
        }
        if s.snapshots != snapshots {
            return Err(format!(
                "snapshots {:?}, the model has {snapshots:?}",
                s.snapshots
            ));
        }
        Ok(())
    }

    /// A refused operation: its error kind is `want`, and nothing changed.
    fn refused(&mut self, what: &str, got: Result<(), Error>, want: &str, before: Shape) -> R {
        match got {
            Err(e) if kind_of(&e) == want => {}
            Err(e) => {
                return Err(format!(
                    "{what}: refused as {} ({e}), want {want}",
                    kind_of(&e)
                ))
            }
            Ok(()) => return Err(format!("{what}: accepted, want a refusal ({want})")),
        }
        let after = self.shape();
        if after != before {
            return Err(format!(
                "{what} was refused but changed the pool: before {before:?}, after {after:?}"
            ));
        }
        self.stats.refusals += 1;
        self.trace.text(want);
        Ok(())
    }

    fn everything_durable(&mut self) {
        for v in &mut self.vols {
            v.durable();
        }
    }

    fn new_value(&mut self) -> u64 {
        self.next_value += 1;
        self.next_value
    }

    fn new_name(&mut self, prefix: &str) -> String {
        self.next_name += 1;
        format!("{prefix}{}", self.next_name)
    }

    fn handle(&self, vi: usize) -> Arc<Volume> {
        self.handles[vi].clone().expect("a handle is open")
    }

    /// `(first cell, count)` of a range of up to `most` cells in volume `vi`.
    fn range(&mut self, vi: usize, most: u64) -> (u64, u64) {
        let cells = self.vols[vi].cells.len() as u64;
        let n = match self.rng.below(10) {
            0 => self.rng.range(1, most.min(cells)),
            1..=3 => self.rng.range(1, 16.min(cells)),
            _ => self.rng.range(1, 4.min(cells)),
        };
        let c0 = self.rng.below(cells - n + 1);
        (c0, self.vols[vi].clip(c0, n))
    }

    /// A writer short of space waits at most `SPACE_WAIT_HARD` from its first try (docs/
    /// durability.md): in stepped mode its wait runs the rounds itself on the simulated
    /// clock (`Store::wait_until`), so a wait past the bound (the endless wait of issue
    /// 36) shows as simulated time. A round's own clock and the last tick are the slack.
    fn within_wait_bound(&mut self, what: &str, since: std::time::Instant) -> R {
        let waited = bulwark_engine::env::since(since);
        if waited >= bulwark_engine::constants::SPACE_WAIT_TICK {
            self.stats.space_waits += 1;
            let ms = waited.as_millis() as u64;
            self.stats.space_wait_max_ms = self.stats.space_wait_max_ms.max(ms);
        }
        let hard = bulwark_engine::constants::SPACE_WAIT_HARD;
        if waited > hard + std::time::Duration::from_secs(10) {
            return Err(format!(
                "{what} waited {:.1} s for space: past the {} s bound",
                waited.as_secs_f64(),
                hard.as_secs()
            ));
        }
        Ok(())
    }

    /// A client refused for space, after its retry, finds the pool's live data near its
    /// usable space: ENOSPC while much of it is free is a defect (issue 36 part 5: refusals
    /// at 63% of usable after a fill and release; durable random writes refused at 84%).
    /// Skipped while a device is out or a fault window is open (a redundant pool short of a
    /// member may refuse what it cannot place), and on pools with an object store, whose
    /// local cache bounds what may be local.
    fn refusal_is_honest(&mut self, what: &str) -> R {
        if self.journal.frozen()
            || self.window.is_some()
            || self.damaged.is_some()
            || self.out.is_some()
        {
            return Ok(());
        }
        if self.tier.is_some() {
            return Ok(());
        }
        let space = self.pool().status().space;
        let (used, usable) = (space.used_bytes, space.usable_bytes.max(1));
        if used * 100 < usable * HONEST_ENOSPC_PERCENT {
            return Err(format!(
                "{what} refused for space at {}% of usable ({used} of {usable} bytes used; \
                 refusals {}, the last: {:?})",
                used * 100 / usable,
                space.refused_writes,
                space.last_refusal.map(|r| r.reason)
            ));
        }
        Ok(())
    }

    /// Run maintenance steps after a refusal for space (the writer's own wait ran rounds
    /// already: these are a client's retry).
    fn make_room(&mut self) -> R {
        for _ in 0..4 {
            self.maintenance()?;
        }
        Ok(())
    }

    /// A volume of 2-8 MiB (24 MiB for a near-full seed's first), or with `huge` the same
    /// cells spread over terabytes.
    fn create_volume(&mut self, shape: CellLayout) -> R {
        if self.vols.len() >= VOLS_MAX {
            return Ok(());
        }
        let name = self.new_name("v");
        let encrypted = self.rng.chance(500);
        let block_size = [4096u32, 4096, 8192, 16384][self.rng.below(4) as usize];
        let big = self.big_volumes && self.vols.is_empty();
        let (lo, hi) = match shape {
            _ if big => (4096, 6144),
            // Each block a leaf of its own (two 4 KiB copies, and their parents): its map
            // takes several times the data, so fewer cells.
            CellLayout::Scatter => (256, 1024),
            _ => (512, 2048),
        };
        let cells = self.rng.range(lo, hi) & !((block_size as u64 / CELL) - 1);
        let key = encrypted.then(|| 1 + self.rng.below(200) as u8);
        let (spread, island) = match shape {
            CellLayout::Plain => (0, ISLAND),
            // Islands 64 MiB to 256 GiB apart: 2 to 24 TiB in all.
            CellLayout::Huge => (ISLAND << self.rng.range(8, 21), ISLAND),
            // One block per island, 256 to 16384 blocks apart (1 to 64 MiB for 4 KiB
            // blocks, 4 to 256 MiB for 16 KiB): a leaf holds far fewer blocks.
            CellLayout::Scatter => {
                let island = block_size as u64 / CELL;
                (island << self.rng.range(8, 14), island)
            }
        };
        let model = Vol {
            name: name.clone(),
            key,
            origin: None,
            block_size,
            spread,
            island,
            cells: vec![Cell::zero(); cells as usize],
            snaps: Vec::new(),
        };
        let opts = VolumeOptions {
            size_bytes: model.bytes_for(cells),
            block_size,
            compression: if self.compression {
                Compression::Lz4
            } else {
                Compression::Off
            },
            encryption: encrypted,
        };
        let spread_text = if shape == CellLayout::Scatter {
            format!(" spread {spread} island {island}")
        } else if spread > 0 {
            format!(" spread {spread}")
        } else {
            String::new()
        };
        self.trace.text(&format!(
            "create {name} {cells} {block_size} {encrypted}{spread_text}"
        ));
        self.pool()
            .create_volume(&name, opts, key.map(secret).as_ref())
            .map_err(|e| format!("volume create {name}: {e}"))?;
        let h = self
            .pool()
            .volume(&name)
            .map_err(|e| format!("open {name}: {e}"))?;
        // Its commit made everything durable.
        self.everything_durable();
        self.stats.huge_volumes += u64::from(shape == CellLayout::Huge);
        self.stats.scattered_volumes += u64::from(shape == CellLayout::Scatter);
        self.vols.push(model);
        self.handles.push(Some(h));
        Ok(())
    }

    fn write(&mut self, vi: usize) -> R {
        let (c0, n) = self.range(vi, 256);
        let fua = self.rng.chance(100);
        self.write_at(vi, c0, n, fua).map(|_| ())
    }

    /// Write cells `[c0, c0 + n)` of volume `vi` (one I/O: the range lies in one island)
    /// with new values, and check the answer. `Ok(false)`: refused for space (after the
    /// client's retry) or the machine died inside it.
    fn write_at(&mut self, vi: usize, c0: u64, n: u64, fua: bool) -> Result<bool, String> {
        let mut buf = vec![0u8; (n * CELL) as usize];
        let mut values = Vec::with_capacity(n as usize);
        for i in 0..n {
            let v = self.new_value();
            fill_cell(
                v,
                c0 + i,
                &mut buf[(i * CELL) as usize..((i + 1) * CELL) as usize],
            );
            values.push(v);
        }
        self.trace
            .text(&format!("write {vi} {c0}+{n} {fua} values {}..", values[0]));
        let h = self.handle(vi);
        let at = self.vols[vi].offset(c0);
        let t = bulwark_engine::env::now();
        let mut got = h.write(at, &buf, fua);
        self.within_wait_bound("a write", t)?;
        if matches!(got, Err(Error::NoSpace)) {
            self.stats.no_space += 1;
            self.make_room()?;
            let t = bulwark_engine::env::now();
            got = h.write(at, &buf, fua);
            self.within_wait_bound("a write", t)?;
        }
        self.stats.writes += 1;
        let ok = got.is_ok();
        let cells = &mut self.vols[vi].cells[c0 as usize..(c0 + n) as usize];
        match got {
            _ if self.journal.frozen() => {
                // The machine died inside the write: never acknowledged.
                cells.iter_mut().zip(&values).for_each(|(c, &v)| c.maybe(v));
            }
            Ok(()) if fua => cells
                .iter_mut()
                .zip(&values)
                .for_each(|(c, &v)| c.set_durable(v)),
            Ok(()) => cells.iter_mut().zip(&values).for_each(|(c, &v)| c.set(v)),
            Err(Error::NoSpace) => {
                self.stats.no_space += 1;
                cells.iter_mut().zip(&values).for_each(|(c, &v)| c.maybe(v));
                self.refusal_is_honest("a write")?;
            }
            Err(e) => {
                return Err(format!(
                    "write of {} cells {c0}+{n}: {e}",
                    self.vols[vi].name
                ))
            }
        }
        let frozen = self.journal.frozen();
        self.trace.text(if frozen { "frozen" } else { "ok" });
        Ok(!frozen && ok)
    }

    /// A guest writing its whole disk front to back (an image copied in, `dd`): writes of
    /// `FILL_CELLS`, then a FLUSH. It stops at the first refusal for space, as a copy
    /// does. On a near-full seed's big first volume it fills the pool with live data:
    /// where cleaning's moves and rewritten map nodes cost about what it frees once
    /// snapshots pin that data (issue 36's endless wait needed a disk filled, then
    /// overwritten at random under two snapshots).
    fn fill_volume(&mut self, vi: usize) -> R {
        let cells = self.vols[vi].cells.len() as u64;
        self.trace.text(&format!("fill {vi}"));
        self.stats.fills += 1;
        let mut c0 = 0;
        while c0 < cells {
            let n = self.vols[vi].clip(c0, FILL_CELLS.min(cells - c0));
            if !self.write_at(vi, c0, n, false)? {
                return Ok(());
            }
            c0 += n;
        }
        self.flush(vi)
    }

    /// A guest's sustained random overwrite (a database, fio): 32 to 256 writes of one
    /// block each at random blocks of a hot region (the whole volume down to a sixteenth
    /// of it), a FLUSH after every 16, as a guest with 16 writes in flight flushes.
    /// Repeated uniform random overwrite leaves dead bytes spread thin over every segment
    /// written since the last snapshot (the cleaner's worst case), which single writes
    /// between other operations rarely do. It stops at the first refusal for space.
    fn overwrite(&mut self, vi: usize) -> R {
        let per = (self.vols[vi].block_size as u64 / CELL).max(1);
        let blocks = self.vols[vi].cells.len() as u64 / per;
        if blocks == 0 {
            return Ok(());
        }
        let span = (blocks >> self.rng.below(5)).max(1);
        let first = self.rng.below(blocks - span + 1);
        let count = self.rng.range(32, 256);
        self.trace
            .text(&format!("overwrite {vi} {first}+{span} {count}"));
        self.stats.overwrites += 1;
        for i in 1..=count {
            let c0 = (first + self.rng.below(span)) * per;
            if !self.write_at(vi, c0, per, false)? {
                return Ok(());
            }
            if i % 16 == 0 {
                self.flush(vi)?;
            }
        }
        Ok(())
    }

    /// Zeroes or a trim: either way the range reads as zeros.
    fn zero(&mut self, vi: usize, trim: bool) -> R {
        let (c0, n) = self.range(vi, 512);
        let fua = !trim && self.rng.chance(100);
        self.trace.text(&format!("zero {vi} {c0}+{n} {trim} {fua}"));
        let h = self.handle(vi);
        let at = self.vols[vi].offset(c0);
        let run = |h: &Volume| {
            if trim {
                h.trim(at, n * CELL)
            } else {
                h.write_zeroes(at, n * CELL, fua)
            }
        };
        let t = bulwark_engine::env::now();
        let mut got = run(&h);
        self.within_wait_bound("a zero or trim", t)?;
        if matches!(got, Err(Error::NoSpace)) {
            self.stats.no_space += 1;
            self.make_room()?;
            let t = bulwark_engine::env::now();
            got = run(&h);
            self.within_wait_bound("a zero or trim", t)?;
        }
        // A trim frees whole blocks and leaves partial ones as they are (`Volume::trim`).
        let per = self.vols[vi].block_size as u64 / CELL;
        let (lo, hi) = if trim {
            (c0.div_ceil(per) * per, (c0 + n) / per * per)
        } else {
            (c0, c0 + n)
        };
        if lo >= hi {
            return Ok(());
        }
        let cells = &mut self.vols[vi].cells[lo as usize..hi as usize];
        match got {
            Ok(()) if fua => cells.iter_mut().for_each(|c| c.set_durable(0)),
            Ok(()) => cells.iter_mut().for_each(|c| c.set(0)),
            Err(Error::NoSpace) => {
                self.stats.no_space += 1;
                cells.iter_mut().for_each(|c| c.maybe(0));
            }
            Err(e) => {
                return Err(format!(
                    "zero/trim of {} cells {c0}+{n}: {e}",
                    self.vols[vi].name
                ))
            }
        }
        Ok(())
    }

    /// Read cells `[c0, c0+n)` of volume `vi` (or its snapshot `snap`) against the model.
    fn check_range(&mut self, vi: usize, snap: Option<usize>, c0: u64, n: u64) -> R {
        let (h, what) = match snap {
            None => (self.handle(vi), self.vols[vi].name.clone()),
            Some(k) => {
                let name = format!("{}@{}", self.vols[vi].name, self.vols[vi].snaps[k].0);
                let h = self
                    .pool()
                    .volume(&name)
                    .map_err(|e| format!("open {name}: {e}"))?;
                (h, name)
            }
        };
        let mut buf = vec![0u8; (n * CELL) as usize];
        h.read(self.vols[vi].offset(c0), &mut buf)
            .map_err(|e| format!("read of {what} cells {c0}+{n}: {e}"))?;
        self.check_bytes(vi, snap, c0, n, &buf, &what)
    }

    /// What a read of cells `[c0, c0+n)` of volume `vi` (or its snapshot) returned, in
    /// `buf`, against the model.
    fn check_bytes(
        &mut self,
        vi: usize,
        snap: Option<usize>,
        c0: u64,
        n: u64,
        buf: &[u8],
        what: &str,
    ) -> R {
        let mut scratch = vec![0u8; CELL as usize];
        for i in 0..n {
            let c = c0 + i;
            let got = &buf[(i * CELL) as usize..((i + 1) * CELL) as usize];
            let (v, whole) = value_of(got, c, &mut scratch);
            let may: Vec<u64> = match snap {
                None => self.vols[vi].cells[c as usize].cur.clone(),
                Some(k) => vec![self.vols[vi].snaps[k].1[c as usize]],
            };
            if !whole || !may.contains(&v) {
                return Err(format!(
                    "{what} cell {c} read value {v} (its own bytes: {whole}); the model allows {may:?}"
                ));
            }
            if snap.is_none() {
                self.vols[vi].cells[c as usize].pin(v);
            }
            self.trace.num(v);
        }
        self.stats.cells_checked += n;
        Ok(())
    }

    fn read(&mut self, vi: usize) -> R {
        self.stats.reads += 1;
        let snaps = self.vols[vi].snaps.len() as u64;
        let snap = (snaps > 0 && self.rng.chance(250)).then(|| self.rng.below(snaps) as usize);
        let cells = match snap {
            None => self.vols[vi].cells.len() as u64,
            Some(k) => self.vols[vi].snaps[k].1.len() as u64,
        };
        let n = self.rng.range(1, 64.min(cells));
        let c0 = self.rng.below(cells - n + 1);
        let n = self.vols[vi].clip(c0, n);
        self.trace.text(&format!("read {vi} {snap:?} {c0}+{n}"));
        self.check_range(vi, snap, c0, n)
    }

    /// Every cell of every volume and snapshot against the model.
    fn check_everything(&mut self) -> R {
        for vi in 0..self.vols.len() {
            let size = self.handle(vi).size();
            let cells = self.vols[vi].cells.len() as u64;
            let bytes = self.vols[vi].bytes_for(cells);
            if size != bytes {
                return Err(format!(
                    "{} has {size} bytes, the model {bytes}",
                    self.vols[vi].name,
                ));
            }
            let mut c = 0;
            while c < cells {
                let n = self.vols[vi].clip(c, (cells - c).min(256));
                self.check_range(vi, None, c, n)?;
                c += n;
            }
            for k in 0..self.vols[vi].snaps.len() {
                let cells = self.vols[vi].snaps[k].1.len() as u64;
                let mut c = 0;
                while c < cells {
                    let n = self.vols[vi].clip(c, (cells - c).min(256));
                    self.check_range(vi, Some(k), c, n)?;
                    c += n;
                }
            }
        }
        self.check_names()
    }

    fn flush(&mut self, vi: usize) -> R {
        self.trace.text(&format!("flush {vi}"));
        let got = self.handle(vi).flush();
        if self.journal.frozen() && got.is_err() {
            // Died inside the flush: not acknowledged.
            return Ok(());
        }
        got.map_err(|e| format!("flush of {}: {e}", self.vols[vi].name))?;
        self.stats.flushes += 1;
        // A flush covers every volume's completed writes (group commit, intent log).
        self.everything_durable();
        Ok(())
    }

    fn maintenance(&mut self) -> R {
        self.stats.maintenance_steps += 1;
        self.trace.text("maintenance");
        self.pool()
            .maintenance_step()
            .map_err(|e| format!("maintenance step: {e}"))?;
        let st = self.pool().status();
        if !self.journal.frozen() && st.state == "FAULTED" {
            return Err("the pool is poisoned after a maintenance step".into());
        }
        self.stats.hole_filled_max = self.stats.hole_filled_max.max(st.space.hole_filled_bytes);
        Ok(())
    }

    /// A quiet spell: a round (which sees the clients' last operation), the clock past the
    /// defragmenter's quiet time, then rounds with no client operation between them (the
    /// defragmenter moves a bounded amount per round and goes on in the next).
    fn idle(&mut self) -> R {
        self.trace.text("idle");
        self.maintenance()?;
        bulwark_engine::env::advance(std::time::Duration::from_secs(
            bulwark_engine::constants::DEFRAG_IDLE_SECS,
        ));
        for _ in 0..1 + self.rng.below(4) {
            self.maintenance()?;
        }
        let st = self.pool().status();
        self.stats.defrag_moved_max = self.stats.defrag_moved_max.max(st.space.defrag_moved_bytes);
        Ok(())
    }

    /// Pin every cell a failed write left uncertain, by reading it.
    fn settle(&mut self, vi: usize) -> R {
        for c in 0..self.vols[vi].cells.len() as u64 {
            if self.vols[vi].cells[c as usize].cur.len() > 1 {
                self.check_range(vi, None, c, 1)?;
            }
        }
        Ok(())
    }

    fn snap_create(&mut self, vi: usize) -> R {
        if self.vols[vi].snaps.len() >= SNAPS_MAX {
            return Ok(());
        }
        self.settle(vi)?;
        let name = self.new_name("s");
        let vol = self.vols[vi].name.clone();
        self.trace.text(&format!("snapshot {vol}@{name}"));
        match self.pool().snapshot_create(&vol, &name) {
            Ok(()) => {}
            Err(Error::NoSpace) => {
                self.stats.no_space += 1;
                return Ok(());
            }
            Err(e) => return Err(format!("snapshot create {vol}@{name}: {e}")),
        }
        self.everything_durable();
        let values = self.vols[vi].cells.iter().map(|c| c.cur[0]).collect();
        self.vols[vi].snaps.push((name, values));
        self.stats.snapshots += 1;
        Ok(())
    }

    /// A key rotation of `vol` is under way (clone and rollback refuse it).
    fn rotating(&self, vol: &str) -> bool {
        self.pool()
            .volumes()
            .iter()
            .any(|v| v.name == vol && v.rotation.is_some())
    }

    fn has_clones(&self, vol: &str, snap: &str) -> bool {
        self.vols.iter().any(|v| {
            v.origin
                .as_ref()
                .is_some_and(|(o, s)| o == vol && s == snap)
        })
    }

    fn snap_destroy(&mut self, vi: usize) -> R {
        let n = self.vols[vi].snaps.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let k = self.rng.below(n) as usize;
        let vol = self.vols[vi].name.clone();
        let name = self.vols[vi].snaps[k].0.clone();
        self.trace.text(&format!("snapshot destroy {vol}@{name}"));
        if self.has_clones(&vol, &name) {
            let before = self.shape();
            let got = self.pool().snapshot_destroy(&vol, &name).map(|_| ());
            return self.refused(
                &format!("destroy of {vol}@{name}, which has clones"),
                got,
                "busy",
                before,
            );
        }
        let used = self
            .pool()
            .snapshot_list(Some(&vol))
            .map_err(|e| format!("snapshot list {vol}: {e}"))?
            .into_iter()
            .find(|s| s.snapshot == name)
            .ok_or_else(|| format!("{vol}@{name} is not listed"))?
            .used_bytes;
        match self.pool().snapshot_destroy(&vol, &name) {
            Ok(freed) if freed == used => {}
            Ok(freed) => {
                return Err(format!(
                    "destroying {vol}@{name} freed {freed} bytes, its listed used was {used}"
                ))
            }
            Err(e) => return Err(format!("snapshot destroy {vol}@{name}: {e}")),
        }
        self.everything_durable();
        self.vols[vi].snaps.remove(k);
        Ok(())
    }

    fn clone_snapshot(&mut self, vi: usize) -> R {
        let n = self.vols[vi].snaps.len() as u64;
        if n == 0 || self.vols.len() >= VOLS_MAX {
            return Ok(());
        }
        let k = self.rng.below(n) as usize;
        let vol = self.vols[vi].name.clone();
        let (snap, values) = self.vols[vi].snaps[k].clone();
        let name = self.new_name("c");
        let key = self.vols[vi].key.map(|_| 1 + self.rng.below(200) as u8);
        self.trace.text(&format!("clone {vol}@{snap} {name}"));
        if self.rotating(&vol) {
            let before = self.shape();
            let got = self
                .pool()
                .volume_clone(&vol, &snap, &name, key.map(secret).as_ref());
            return self.refused(
                &format!("clone of {vol}@{snap} during its key rotation"),
                got,
                "busy",
                before,
            );
        }
        match self
            .pool()
            .volume_clone(&vol, &snap, &name, key.map(secret).as_ref())
        {
            Ok(()) => {}
            Err(Error::NoSpace) => {
                self.stats.no_space += 1;
                return Ok(());
            }
            Err(e) => return Err(format!("clone of {vol}@{snap} as {name}: {e}")),
        }
        self.everything_durable();
        let h = self
            .pool()
            .volume(&name)
            .map_err(|e| format!("open clone {name}: {e}"))?;
        let block_size = self.vols[vi].block_size;
        let (spread, island) = (self.vols[vi].spread, self.vols[vi].island);
        self.vols.push(Vol {
            name,
            key,
            origin: Some((vol, snap)),
            block_size,
            spread,
            island,
            cells: values
                .iter()
                .map(|&v| Cell {
                    cur: vec![v],
                    dur: vec![v],
                })
                .collect(),
            snaps: Vec::new(),
        });
        self.handles.push(Some(h));
        self.stats.clones += 1;
        Ok(())
    }

    /// Roll back to a random snapshot; the refusals first (newer snapshots without
    /// `--destroy-newer`, the volume in use, a newer snapshot with clones), each of which
    /// must change nothing.
    fn rollback(&mut self, vi: usize) -> R {
        let n = self.vols[vi].snaps.len();
        if n == 0 {
            return Ok(());
        }
        let k = self.rng.below(n as u64) as usize;
        let vol = self.vols[vi].name.clone();
        let name = self.vols[vi].snaps[k].0.clone();
        self.trace.text(&format!("rollback {vol}@{name}"));
        // Settled first: a refusal may not change what the cells read.
        self.settle(vi)?;
        let newer_cloned = self.vols[vi].snaps[k + 1..]
            .iter()
            .any(|(s, _)| self.has_clones(&vol, s));
        // In use: a handle is open.
        let before = self.shape();
        let got = self.pool().volume_rollback(&vol, &name, true).map(|_| ());
        self.refused(
            &format!("rollback of {vol} (in use) to {name}"),
            got,
            "busy",
            before,
        )?;
        self.handles[vi] = None;
        let result = (|| {
            if self.rotating(&vol) {
                let before = self.shape();
                let got = self.pool().volume_rollback(&vol, &name, true).map(|_| ());
                return self
                    .refused(
                        &format!("rollback of {vol} to {name} during its key rotation"),
                        got,
                        "busy",
                        before,
                    )
                    .map(|()| false);
            }
            if k + 1 < n {
                let before = self.shape();
                let got = self.pool().volume_rollback(&vol, &name, false).map(|_| ());
                self.refused(
                    &format!("rollback of {vol} past newer snapshots to {name}"),
                    got,
                    "invalid",
                    before,
                )?;
            }
            if newer_cloned {
                let before = self.shape();
                let got = self.pool().volume_rollback(&vol, &name, true).map(|_| ());
                return self
                    .refused(
                        &format!("rollback of {vol} to {name} --destroy-newer, a newer snapshot has clones"),
                        got,
                        "busy",
                        before,
                    )
                    .map(|()| false);
            }
            match self.pool().volume_rollback(&vol, &name, true) {
                Ok(gone) if gone.len() == n - k - 1 => Ok(true),
                other => Err(format!("rollback of {vol} to {name}: {other:?}")),
            }
        })();
        let h = self
            .pool()
            .volume(&vol)
            .map_err(|e| format!("open {vol} after rollback: {e}"))?;
        self.handles[vi] = Some(h);
        if result? {
            let v = &mut self.vols[vi];
            v.snaps.truncate(k + 1);
            v.cells = v.snaps[k]
                .1
                .iter()
                .map(|&x| Cell {
                    cur: vec![x],
                    dur: vec![x],
                })
                .collect();
            self.everything_durable();
            self.stats.rollbacks += 1;
        }
        // Whatever happened, the pool says what the model says.
        self.check_names()
    }

    /// Destroy a volume none of whose snapshots has clones (with its snapshots).
    fn destroy(&mut self) -> R {
        let candidates: Vec<usize> = (0..self.vols.len())
            .filter(|&i| {
                !self.vols[i]
                    .snaps
                    .iter()
                    .any(|(s, _)| self.has_clones(&self.vols[i].name, s))
            })
            .collect();
        if candidates.is_empty() || self.vols.len() <= 1 {
            return Ok(());
        }
        let vi = candidates[self.rng.below(candidates.len() as u64) as usize];
        let name = self.vols[vi].name.clone();
        self.trace.text(&format!("destroy {name}"));
        let before = self.shape();
        let got = self.pool().destroy_volume(&name);
        self.refused(&format!("destroy of {name} (in use)"), got, "busy", before)?;
        self.handles[vi] = None;
        match self.pool().destroy_volume_recursive(&name, true) {
            Ok(kept) if kept.is_empty() => {}
            other => return Err(format!("destroy of {name}: {other:?}")),
        }
        self.everything_durable();
        self.vols.remove(vi);
        self.handles.remove(vi);
        self.check_names()
    }

    fn resize(&mut self, vi: usize) -> R {
        let old = self.vols[vi].cells.len() as u64;
        let step = (self.vols[vi].block_size as u64 / CELL).max(1);
        let cells = old + self.rng.range(1, 512) * step;
        let vol = self.vols[vi].name.clone();
        self.trace.text(&format!("resize {vol} {cells}"));
        let bytes = self.vols[vi].bytes_for(cells);
        // A huge volume's last island may already hold the new cells: the size does not
        // change, and the engine commits nothing (as for any resize to the same size).
        let same = bytes == self.vols[vi].bytes_for(old);
        match self.pool().volume_resize(&vol, bytes, false) {
            Ok(_) => {}
            Err(Error::NoSpace) => {
                self.stats.no_space += 1;
                return Ok(());
            }
            Err(e) => return Err(format!("grow {vol} to {cells} cells: {e}")),
        }
        if !same {
            // The grow's commit made everything durable.
            self.everything_durable();
        }
        self.vols[vi].cells.resize(cells as usize, Cell::zero());
        Ok(())
    }

    /// Key unload (refused while in use) and load again.
    fn key_cycle(&mut self, vi: usize) -> R {
        let Some(key) = self.vols[vi].key else {
            return Ok(());
        };
        let vol = self.vols[vi].name.clone();
        self.trace.text(&format!("key cycle {vol}"));
        let before = self.shape();
        let got = self.pool().unload_key(&vol);
        self.refused(
            &format!("key unload of {vol} (in use)"),
            got,
            "busy",
            before,
        )?;
        self.handles[vi] = None;
        self.pool()
            .unload_key(&vol)
            .map_err(|e| format!("key unload {vol}: {e}"))?;
        // Its commit made everything durable.
        self.everything_durable();
        match self.pool().volume(&vol) {
            Err(Error::Locked(_)) => {}
            other => {
                return Err(format!(
                    "{vol} opened without its key: {:?}",
                    other.map(|_| ())
                ))
            }
        }
        if self.rng.chance(300) {
            let before = self.shape();
            let got = self
                .pool()
                .load_key(&vol, &secret(key.wrapping_add(1).max(1)));
            self.refused(
                &format!("key load of {vol} with a wrong key"),
                got,
                "wrong_key",
                before,
            )?;
        }
        if self.rng.chance(300) {
            self.maintenance()?;
        }
        self.pool()
            .load_key(&vol, &secret(key))
            .map_err(|e| format!("key load {vol}: {e}"))?;
        let h = self
            .pool()
            .volume(&vol)
            .map_err(|e| format!("open {vol} after key load: {e}"))?;
        self.handles[vi] = Some(h);
        self.stats.key_cycles += 1;
        // What it read before the unload, it reads after the load.
        let cells = self.vols[vi].cells.len() as u64;
        let n = 64.min(cells);
        let c0 = self.rng.below(cells - n + 1);
        let n = self.vols[vi].clip(c0, n);
        self.check_range(vi, None, c0, n)
    }

    /// Start a key rotation (a commit, so a durable point) or resume the one under way (no
    /// commit). Its batches are `rotate_step`s; what the cells read never changes.
    fn key_rotate(&mut self, vi: usize) -> R {
        if self.vols[vi].key.is_none() {
            return Ok(());
        }
        let vol = self.vols[vi].name.clone();
        self.trace.text(&format!("key rotate {vol}"));
        // A rotation under way is resumed, with no commit: no durable point then.
        let resumed = self.rotating(&vol);
        match self.pool().key_rotate(&vol) {
            Ok(_) => {}
            Err(Error::NoSpace) => {
                self.stats.no_space += 1;
                return Ok(());
            }
            Err(e) => return Err(format!("key rotate {vol}: {e}")),
        }
        if !resumed {
            self.everything_durable();
        }
        self.stats.rotations += 1;
        Ok(())
    }

    /// One batch of every rotation under way (what the rotation worker does between
    /// client writes). A batch may pause for space; any other reason is a failure.
    fn rotate_step(&mut self) -> R {
        self.trace.text("rotate step");
        let rotating: Vec<String> = self
            .pool()
            .volumes()
            .into_iter()
            .filter(|v| v.rotation.is_some())
            .map(|v| v.name)
            .collect();
        let ran = self
            .pool()
            .rotation_step()
            .map_err(|e| format!("rotation step: {e}"))?;
        self.stats.rotation_batches += ran as u64;
        for v in self.pool().volumes() {
            if let Some(r) = &v.rotation {
                if let Some(e) = r.error.as_ref().filter(|_| !r.retrying) {
                    return Err(format!("the key rotation of {} paused: {e}", v.name));
                }
            }
            // A clone whose rotation finished shares nothing with its origin any more.
            let Some(m) = self.vols.iter_mut().find(|m| m.name == v.name) else {
                continue;
            };
            if m.origin.is_some() && v.origin.is_none() {
                if !rotating.contains(&v.name) || v.rotation.is_some() {
                    return Err(format!("{} lost its origin {:?}", v.name, m.origin));
                }
                m.origin = None;
            }
        }
        Ok(())
    }

    /// Crypto-erase an encrypted volume none of whose snapshots has clones (refused while
    /// in use): it no longer opens, its key no longer loads; then it is destroyed, and the
    /// model drops it.
    fn key_erase(&mut self, vi: usize) -> R {
        let vol = self.vols[vi].name.clone();
        let cloned = self.vols[vi]
            .snaps
            .iter()
            .any(|(s, _)| self.has_clones(&vol, s));
        let Some(key) = self.vols[vi].key.filter(|_| !cloned && self.vols.len() > 1) else {
            return Ok(());
        };
        self.trace.text(&format!("key erase {vol}"));
        let before = self.shape();
        let got = self.pool().key_erase(&vol);
        self.refused(&format!("key erase of {vol} (in use)"), got, "busy", before)?;
        self.handles[vi] = None;
        self.pool()
            .key_erase(&vol)
            .map_err(|e| format!("key erase {vol}: {e}"))?;
        self.everything_durable();
        match self.pool().volume(&vol) {
            Err(Error::Invalid(_) | Error::Locked(_)) => {}
            other => {
                return Err(format!(
                    "{vol} opened after its keys were erased: {:?}",
                    other.map(|_| ())
                ))
            }
        }
        if self.pool().load_key(&vol, &secret(key)).is_ok() {
            return Err(format!("{vol}'s key loaded after its keys were erased"));
        }
        match self.pool().destroy_volume_recursive(&vol, true) {
            Ok(kept) if kept.is_empty() => {}
            other => return Err(format!("destroy of {vol} after erase: {other:?}")),
        }
        self.vols.remove(vi);
        self.handles.remove(vi);
        self.stats.erases += 1;
        self.check_names()
    }

    fn member(&self, i: usize) -> PathBuf {
        self.pool().status().devices[i].path.clone()
    }

    /// A fault window on a mirror or parity pool: open one (a fault armed on one member,
    /// the damaged one if any) or close the open one. While it is open every operation
    /// goes on and every read must return the right bytes (repaired from the other
    /// members); a write fault leaves the member damaged until a scrub.
    fn fault(&mut self) -> R {
        if self.cache.is_some() && self.rng.chance(250) {
            return self.corrupt_cache();
        }
        if self.out.is_some() {
            return Ok(());
        }
        if let Some((d, mode)) = self.window.take() {
            self.trace
                .text(&format!("fault window closed {d} {mode:?}"));
            let dev = &self.pool().status().devices[d];
            self.stats.device_errors_seen += dev.read_errors + dev.cksum_errors + dev.write_errors;
            let path = self.member(d);
            self.pool()
                .set_faults(&path, Vec::new())
                .map_err(|e| format!("clearing faults: {e}"))?;
            return Ok(());
        }
        let members = self.pool().status().devices.len() as u64;
        let d = match self.damaged {
            Some(d) => d,
            None => self.rng.below(members) as usize,
        };
        let mode = WINDOW_FAULTS[self.rng.below(WINDOW_FAULTS.len() as u64) as usize];
        let odds = FAULT_ODDS[self.rng.below(FAULT_ODDS.len() as u64) as usize];
        let seed = self.rng.next_u64();
        self.trace
            .text(&format!("fault window {d} {mode:?} {odds}"));
        let path = self.member(d);
        let fault = Fault {
            mode,
            probability: odds as f64 / 1000.0,
            seed,
            include_labels: false,
        };
        self.pool()
            .set_faults(&path, vec![fault])
            .map_err(|e| format!("arming {mode:?} on {}: {e}", path.display()))?;
        if !matches!(mode, FaultMode::ReadFlip | FaultMode::ReadError) {
            self.damaged = Some(d);
        }
        self.window = Some((d, mode));
        self.stats.fault_windows += 1;
        Ok(())
    }

    /// `pool log add` / `pool log remove`: a pool without a separate log device gets one
    /// (a file in its directory), one with it goes back to the main devices' log. Durable
    /// when it returns (a commit), so a durable point.
    fn log_change(&mut self) -> R {
        let path = self.dir.path().join("log-device.img");
        let add = !self.log_device;
        self.trace.text(if add { "log add" } else { "log remove" });
        if add && !path.exists() {
            std::fs::File::create(&path)
                .and_then(|f| f.set_len(LOG_DEVICE_BYTES))
                .map_err(|e| format!("log device file: {e}"))?;
        }
        let paths = if add { vec![path] } else { Vec::new() };
        match self.pool().set_log_devices(&paths) {
            Ok(()) => {}
            Err(Error::NoSpace) => {
                self.stats.no_space += 1;
                return Ok(());
            }
            Err(e) => return Err(format!("log {}: {e}", if add { "add" } else { "remove" })),
        }
        self.everything_durable();
        self.log_device = add;
        self.log_window = false;
        self.stats.log_changes += 1;
        Ok(())
    }

    /// The log device fails (`log` layout): every write to it, or every I/O, fails, for
    /// a window of operations. The pool must notice and make FLUSH durable another way
    /// (a commit): a FLUSH that answers success is durable whatever the log device did,
    /// which the next crash checks. Closing the window leaves the log device as the pool
    /// left it (an import takes it again).
    fn log_fault(&mut self) -> R {
        let path = self.dir.path().join("log-device.img");
        if self.log_window {
            self.trace.text("log device fault cleared");
            self.log_window = false;
            return self
                .pool()
                .set_faults(&path, Vec::new())
                .map_err(|e| format!("clearing the log device's faults: {e}"));
        }
        let mode = [FaultMode::WriteError, FaultMode::Vanish][self.rng.below(2) as usize];
        let odds = [300u64, 1000][self.rng.below(2) as usize];
        let seed = self.rng.next_u64();
        self.trace
            .text(&format!("log device fault {mode:?} {odds}"));
        let fault = Fault {
            mode,
            probability: odds as f64 / 1000.0,
            seed,
            include_labels: false,
        };
        self.pool()
            .set_faults(&path, vec![fault])
            .map_err(|e| format!("arming {mode:?} on the log device: {e}"))?;
        self.log_window = true;
        self.stats.log_faults += 1;
        Ok(())
    }

    /// Garbage written over a stretch of the cache device's ring (behind the engine's
    /// back): a copy it spoils must fail verification and be read from the pool; every
    /// read must stay right.
    fn corrupt_cache(&mut self) -> R {
        use std::os::unix::fs::FileExt;
        let path = self.cache.clone().expect("a cache device");
        let len = self.rng.range(4096, 256 << 10) as usize;
        // Somewhere in what the ring holds: how much that is depends on when the cache's
        // writer ran, so only the fraction is the seed's (and the trace's).
        let per_mille = self.rng.below(1000);
        let used = self
            .pool()
            .status()
            .cache_device
            .map_or(0, |c| c.used_bytes)
            .clamp(len as u64, CACHE_DEVICE_BYTES - 4096);
        let at = 4096 + (used - len as u64) * per_mille / 1000;
        self.trace
            .text(&format!("cache device garbage {per_mille} {len}"));
        let mut junk = vec![0u8; len];
        for b in junk.iter_mut() {
            *b = self.rng.below(256) as u8;
        }
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|f| f.write_at(&junk, at))
            .map_err(|e| format!("spoiling the cache device: {e}"))?;
        self.stats.cache_spoiled += 1;
        Ok(())
    }

    /// A read with bit flips or read errors armed on the only copy (single, log): it may
    /// fail (EIO, a checksum error), never return wrong bytes. Disarmed after it.
    fn faulty_read(&mut self, vi: usize) -> R {
        let mode = [FaultMode::ReadFlip, FaultMode::ReadError][self.rng.below(2) as usize];
        let odds = FAULT_ODDS[self.rng.below(FAULT_ODDS.len() as u64) as usize];
        let seed = self.rng.next_u64();
        let cells = self.vols[vi].cells.len() as u64;
        let n = self.rng.range(1, 64.min(cells));
        let c0 = self.rng.below(cells - n + 1);
        let n = self.vols[vi].clip(c0, n);
        self.trace
            .text(&format!("faulty read {vi} {mode:?} {odds} {c0}+{n}"));
        let path = self.member(0);
        let fault = Fault {
            mode,
            probability: odds as f64 / 1000.0,
            seed,
            include_labels: false,
        };
        self.pool()
            .set_faults(&path, vec![fault])
            .map_err(|e| format!("arming {mode:?}: {e}"))?;
        let h = self.handle(vi);
        let mut buf = vec![0u8; (n * CELL) as usize];
        let got = h.read(self.vols[vi].offset(c0), &mut buf);
        self.pool()
            .set_faults(&path, Vec::new())
            .map_err(|e| format!("clearing faults: {e}"))?;
        self.stats.faulty_reads += 1;
        match got {
            Ok(()) => {}
            Err(e) if matches!(kind_of(&e), "io" | "corrupt" | "unrecoverable") => {
                self.stats.faulty_reads_refused += 1;
                self.trace.text(kind_of(&e));
                return Ok(());
            }
            Err(e) => {
                return Err(format!(
                    "a read under {mode:?} failed as {}: {e}",
                    kind_of(&e)
                ))
            }
        }
        self.check_bytes(vi, None, c0, n, &buf, "a read under injected faults")
    }

    /// A member goes (offline, or vanishes: every I/O fails), comes back (online, or
    /// replaced by a blank device) and is resilvered, one step per operation, on a mirror
    /// or parity pool with no fault window and no damage; every read must stay right
    /// throughout, and no second member may go. On one device: `offline` refused.
    fn device(&mut self) -> R {
        if !self.redundant {
            self.trace.text("offline of the only device");
            let before = self.shape();
            let got = self.pool().device_offline(&self.member(0));
            return self.refused("offline of the only device", got, "invalid", before);
        }
        if self.window.is_some() || self.damaged.is_some() {
            return Ok(());
        }
        let members = self.pool().status().devices.len();
        match self.out {
            None => {
                let d = self.rng.below(members as u64) as usize;
                let path = self.member(d);
                if self.rng.chance(400) {
                    self.trace.text(&format!("device {d} vanishes"));
                    let fault = Fault {
                        mode: FaultMode::Vanish,
                        probability: 1.0,
                        seed: 1,
                        include_labels: true,
                    };
                    self.pool()
                        .set_faults(&path, vec![fault])
                        .map_err(|e| format!("vanish {}: {e}", path.display()))?;
                    self.out = Some((d, Out::Vanished));
                    self.stats.devices_out += 1;
                    return Ok(());
                }
                self.trace.text(&format!("device {d} offline"));
                self.pool()
                    .device_offline(&path)
                    .map_err(|e| format!("offline {}: {e}", path.display()))?;
                self.out = Some((d, Out::Offline));
                self.stats.devices_out += 1;
                let other = self.member((d + 1) % members);
                let before = self.shape();
                let got = self.pool().device_offline(&other);
                self.refused("offline of a second member", got, "invalid", before)
            }
            Some((d, how @ (Out::Offline | Out::Vanished))) => {
                let path = self.member(d);
                if how == Out::Vanished {
                    // Plugged in again, with whatever it missed. After an import it has
                    // no fault armed, and may have been left out as stale (`NotFound`).
                    match self.pool().set_faults(&path, Vec::new()) {
                        Ok(()) | Err(Error::NotFound(_)) => {}
                        Err(e) => return Err(format!("clearing faults: {e}")),
                    }
                }
                if self.rng.chance(400) {
                    let size = self.pool().status().devices[d].size_bytes;
                    let name = format!("{}.img", self.new_name("new"));
                    let new = self.dir.path().join(name);
                    self.trace.text(&format!("device {d} replaced"));
                    self.stats.devices_replaced += 1;
                    std::fs::File::create(&new)
                        .and_then(|f| f.set_len(size))
                        .map_err(|e| format!("new device file: {e}"))?;
                    self.pool().device_replace(&path, &new).map_err(|e| {
                        format!("replace {} by {}: {e}", path.display(), new.display())
                    })?;
                } else {
                    self.trace.text(&format!("device {d} online"));
                    match self.pool().device_online(&path) {
                        Ok(()) => {}
                        // Vanished and back before any I/O found it gone: a scrub
                        // repairs whatever it missed.
                        Err(Error::Invalid(_)) if how == Out::Vanished => {
                            self.out = None;
                            self.pool()
                                .scrub_start()
                                .map_err(|e| format!("scrub start: {e}"))?;
                            return self.scrub();
                        }
                        Err(e) => return Err(format!("online {}: {e}", path.display())),
                    }
                }
                self.out = Some((d, Out::Resilvering));
                Ok(())
            }
            Some((_, Out::Resilvering)) => self.scrub(),
        }
    }

    fn scrub(&mut self) -> R {
        self.trace.text("scrub");
        // The count of unrecoverable blocks includes reads that failed under injected
        // faults on a single device: the scrub must add none.
        let before = self.pool().status().unrecoverable_blocks;
        self.pool()
            .scrub_start()
            .map_err(|e| format!("scrub start: {e}"))?;
        self.pool()
            .scrub_step()
            .map_err(|e| format!("scrub: {e}"))?;
        let st = self.pool().status();
        if st.unrecoverable_blocks > before || !st.errors.is_empty() {
            return Err(format!(
                "scrub found {} unrecoverable blocks, errors {:?}",
                st.unrecoverable_blocks - before,
                st.errors
            ));
        }
        self.stats.repaired_blocks = self.stats.repaired_blocks.max(st.repaired_blocks);
        self.stats.scrubs += 1;
        if let Some((d, Out::Resilvering)) = self.out {
            // The scrub step ran the resilver to its end.
            let dev = &self.pool().status().devices[d];
            if !dev.state.eq_ignore_ascii_case("online") {
                return Err(format!(
                    "{} is {} after its resilver",
                    dev.path.display(),
                    dev.state
                ));
            }
            self.out = None;
            self.stats.resilvers += 1;
        }
        if self.window.is_none() {
            // Repaired: every live block has its copies again.
            self.damaged = None;
        }
        Ok(())
    }

    fn close_handles(&mut self) {
        for h in &mut self.handles {
            *h = None;
        }
    }

    /// A crash: between two operations, or inside the next write, flush or maintenance
    /// step (at its n-th device write). Then the unsynced writes are kept, dropped or torn
    /// by the seed, the pool is imported again, and every cell must read a value it may.
    fn crash(&mut self) -> R {
        let inside = self.rng.chance(500);
        if inside {
            let n = self.rng.below(40);
            self.trace.text(&format!("crash inside, write {n}"));
            self.journal.freeze_after(n);
            let vi = self.rng.below(self.vols.len() as u64) as usize;
            match self.rng.below(3) {
                0 => self.write(vi)?,
                1 => self.flush(vi)?,
                _ => {
                    self.stats.maintenance_steps += 1;
                    // Its answer does not count: the machine may have died inside it.
                    let _ = self.pool().maintenance_step();
                }
            }
            if self.journal.frozen() {
                self.stats.crashes_inside_op += 1;
            }
        } else {
            self.trace.text("crash");
        }
        self.power_off()?;
        self.stats.crashes += 1;
        self.open()?;
        self.after_crash()
    }

    /// The machine stops: the pool is dropped with the journal frozen, and each unsynced
    /// write kept, dropped or torn by the seed.
    fn power_off(&mut self) -> R {
        self.journal.freeze();
        self.close_handles();
        drop(self.pool.take());
        let rng = &mut self.rng;
        let out = self
            .journal
            .crash(&mut |n| rng.below(n))
            .map_err(|e| format!("applying the crash: {e}"))?;
        self.stats.unsynced_kept += out.kept;
        self.stats.unsynced_dropped += out.dropped;
        self.stats.unsynced_torn += out.torn;
        self.trace.text(&format!(
            "unsynced writes: {} kept, {} dropped, {} torn",
            out.kept, out.dropped, out.torn
        ));
        Ok(())
    }

    /// After a crash's import: every cell holds its last durable value or one
    /// acknowledged (or in flight) since: check, and pin it.
    fn after_crash(&mut self) -> R {
        for vi in 0..self.vols.len() {
            for c in &mut self.vols[vi].cells {
                c.cur = c.dur.clone();
            }
        }
        self.check_everything()?;
        self.everything_durable();
        Ok(())
    }

    /// A clean close and import: the import's recount of used space equals the count kept
    /// while running, and everything reads as before.
    fn restart(&mut self) -> R {
        self.trace.text("restart");
        self.pool().flush().map_err(|e| format!("flush: {e}"))?;
        self.everything_durable();
        let before = self.pool().status().space.used_bytes;
        self.close_handles();
        let pool = self.pool.take().expect("open");
        pool.close().map_err(|e| format!("close: {e}"))?;
        drop(pool);
        self.open()?;
        let after = self.pool().status().space.used_bytes;
        if after.abs_diff(before) > USED_RECOUNT_SLACK {
            return Err(format!(
                "used bytes {before} while running, {after} recounted by the import"
            ));
        }
        self.stats.restarts += 1;
        self.check_everything()
    }

    /// One operation drawn from the seed.
    pub fn step(&mut self) -> R {
        self.op += 1;
        self.stats.ops += 1;
        let total: u64 = self.on.iter().map(|(_, w)| w).sum();
        let mut x = self.rng.below(total);
        let mut kind = Kind::Write;
        for (k, w) in &self.on {
            if x < *w {
                kind = *k;
                break;
            }
            x -= w;
        }
        let vi = self.rng.below(self.vols.len() as u64) as usize;
        if self.trace.1 {
            eprintln!("op {} {kind:?} {}", self.op, self.vols[vi].name);
        }
        self.run_op(kind, vi)?;
        self.check_node_cache()
    }

    /// No map read took a cached node from another place than its parent named (the
    /// engine reads the node again then, so no read shows it: a cache entry the engine
    /// forgot to replace would otherwise be a way to older data).
    fn check_node_cache(&self) -> R {
        match self.pool.as_ref().map(|p| p.stale_cached_nodes()) {
            Some(n) if n > 0 => Err(format!(
                "the map node cache held {n} node(s) for another place than the parent's \
                 pointer (a stale entry)"
            )),
            _ => Ok(()),
        }
    }

    fn run_op(&mut self, kind: Kind, vi: usize) -> R {
        match kind {
            Kind::Write => self.write(vi),
            Kind::Read => self.read(vi),
            Kind::Maintenance => self.maintenance(),
            Kind::Zero => self.zero(vi, false),
            Kind::Trim => self.zero(vi, true),
            Kind::Flush => self.flush(vi),
            Kind::SnapCreate => self.snap_create(vi),
            Kind::SnapDestroy => self.snap_destroy(vi),
            Kind::Clone => self.clone_snapshot(vi),
            Kind::Rollback => self.rollback(vi),
            Kind::Create => self.create_volume(CellLayout::Plain),
            Kind::HugeCreate => self.create_volume(CellLayout::Huge),
            Kind::ScatterCreate => self.create_volume(CellLayout::Scatter),
            Kind::Destroy => self.destroy(),
            Kind::Resize => self.resize(vi),
            Kind::KeyCycle => self.key_cycle(vi),
            Kind::Scrub => self.scrub(),
            Kind::Crash => self.crash(),
            Kind::Restart => self.restart(),
            Kind::KeyRotate => self.key_rotate(vi),
            Kind::RotateStep => self.rotate_step(),
            Kind::KeyErase => self.key_erase(vi),
            Kind::Fault if self.redundant => self.fault(),
            Kind::Fault if self.cache.is_some() && self.rng.chance(250) => self.corrupt_cache(),
            Kind::Fault if self.log_device && (self.log_window || self.rng.chance(400)) => {
                self.log_fault()
            }
            Kind::Fault => self.faulty_read(vi),
            Kind::Device => self.device(),
            Kind::LogChange => self.log_change(),
            Kind::TierFault => self.tier_fault(vi),
            Kind::TierWriter => self.tier_writer(),
            Kind::TierRestore => self.tier_restore(),
            Kind::TierStep => self.tier_step(),
            Kind::Idle => self.idle(),
            Kind::Fill => self.fill_volume(vi),
            Kind::Overwrite => self.overwrite(vi),
            Kind::SmallCache | Kind::HolesFirst => unreachable!("never on: not an operation"),
        }
    }

    /// The end of a run: one last full check.
    /// A hash of every device image's bytes (members and log device; not the cache
    /// device, whose writer is a thread), in name order. Read while the pool is open: what
    /// the engine wrote through to the files.
    pub fn device_hash(&self) -> Result<u64, String> {
        use std::hash::Hasher;
        let mut names: Vec<PathBuf> = std::fs::read_dir(self.dir.path())
            .map_err(|e| format!("listing {}: {e}", self.dir.path().display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.extension().is_some_and(|x| x == "img")
                    && p.file_name().is_some_and(|n| n != "cache-device.img")
            })
            .collect();
        names.sort();
        let mut h = std::hash::DefaultHasher::new();
        for p in names {
            let bytes = std::fs::read(&p).map_err(|e| format!("reading {}: {e}", p.display()))?;
            h.write(p.file_name().unwrap_or_default().as_encoded_bytes());
            h.write(&bytes);
        }
        Ok(h.finish())
    }

    pub fn finish(&mut self) -> R {
        if self.trace.1 {
            // Not in the trace or the stats: when the cache's writer ran is not the seed's.
            eprintln!("cache device: {:?}", self.pool().status().cache_device);
        }
        self.check_everything()
    }
}
