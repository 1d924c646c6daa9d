//! bulwark-sim: a deterministic simulator of the engine (issue 37, docs/simulation.md).
//!
//! One seed is one run: a seeded generator (`rng.rs`) picks which kinds of operation the
//! run uses (swarm testing), then every operation, its arguments, every background step
//! and every crash, against a pool opened in the engine's stepped mode (no background
//! thread: `Pool::maintenance_step`, `Pool::scrub_step`, `Pool::rotation_step`) on
//! devices whose unsynced writes the engine's crash journal keeps apart, with faults
//! armed through the engine's fault layer (one copy's bit flips, read errors, lost and
//! misdirected writes, a member that goes and comes back, a failing log device),
//! garbage on a cache device, and an object store's faults and second writer
//! (`objects.rs`, the `tier` layout). Every read is checked against the reference model
//! (`model.rs`); refusals must change nothing; a clean restart must recount the
//! space it counted. A run folds every operation and answer into a trace hash: the same
//! seed prints the same hash.

pub mod live;
pub mod model;
pub mod objects;
pub mod rng;
pub mod world;

pub use world::{Config, Kind, SimLayout, Stats, LATER_KINDS};

/// A run that held.
#[derive(Debug, Clone)]
pub struct Report {
    pub seed: u64,
    pub ops: u64,
    pub trace_hash: u64,
    pub stats: Stats,
    pub kinds: Vec<Kind>,
}

/// A run that found a violation (or an engine panic): what, at which operation, and the
/// command line that replays it.
#[derive(Debug, Clone)]
pub struct Failure {
    pub seed: u64,
    pub op: u64,
    pub message: String,
    pub replay: String,
    pub trace_hash: u64,
}

/// The one line that replays a run.
pub fn replay_line(cfg: &Config) -> String {
    let mut line = format!(
        "cargo run --release -p bulwark-sim -- --seed {} --ops {} --layout {}",
        cfg.seed,
        cfg.ops,
        cfg.layout.name()
    );
    for k in &cfg.without {
        line.push_str(&format!(" --without {k:?}"));
    }
    line
}

/// How far the simulated clock moves per operation.
const OP_TIME: std::time::Duration = std::time::Duration::from_millis(1);

/// Run one seed for `cfg.ops` operations. An engine panic is a failure like any other.
pub fn run(cfg: &Config) -> Result<Report, Failure> {
    run_and_hash(cfg, false).map(|(report, _)| report)
}

/// `run`, and a hash of the bytes on the pool's devices at the end (`World::device_hash`):
/// the same seed must leave the same bytes, not only give the same answers.
pub fn run_with_device_hash(cfg: &Config) -> Result<(Report, u64), Failure> {
    run_and_hash(cfg, true)
}

fn run_and_hash(cfg: &Config, hash_devices: bool) -> Result<(Report, u64), Failure> {
    let replay = replay_line(cfg);
    let fail = |op: u64, message: String, trace_hash: u64| Failure {
        seed: cfg.seed,
        op,
        message,
        replay: replay.clone(),
        trace_hash,
    };
    // The engine's clock and randomness for this thread come from the seed (nonces,
    // salts, keys, ids, timestamps): the same seed lays the same bytes in the same places.
    let _env = bulwark_engine::env::simulate(cfg.seed);
    let mut world = match world::World::new(cfg) {
        Ok(w) => w,
        Err(m) => return Err(fail(0, m, 0)),
    };
    for _ in 0..cfg.ops {
        bulwark_engine::env::advance(OP_TIME);
        let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| world.step()));
        match step {
            Ok(Ok(())) => {}
            Ok(Err(m)) => return Err(fail(world.op, m, world.trace.0)),
            Err(p) => {
                let m = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "a panic".into());
                return Err(fail(world.op, format!("panic: {m}"), world.trace.0));
            }
        }
    }
    if let Err(m) = world.finish() {
        return Err(fail(world.op, m, world.trace.0));
    }
    let device_hash = if hash_devices {
        world
            .device_hash()
            .map_err(|m| fail(world.op, m, world.trace.0))?
    } else {
        0
    };
    let report = Report {
        seed: cfg.seed,
        ops: cfg.ops,
        trace_hash: world.trace.0,
        stats: world.stats.clone(),
        kinds: world.kinds(),
    };
    Ok((report, device_hash))
}
