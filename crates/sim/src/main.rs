//! `bulwark-sim`: run seeds of the deterministic simulator (docs/simulation.md).
//!
//! ```text
//! bulwark-sim [--seeds N] [--first S] [--ops M] [--layout single|mirror|parity|log|tier|all] [--dir D]
//! bulwark-sim --seed S --ops M --layout L        # replay one run
//! ```
//! A failure prints one line that replays it; every run ends with its trace hash.

use std::path::PathBuf;
use std::process::ExitCode;

use bulwark_sim::{run, Config, Kind, SimLayout};

const USAGE: &str = "usage: bulwark-sim [--seeds N] [--first S] [--ops M] [--layout single|mirror|parity|log|tier|all] [--dir D] [--verbose] [--log] [--keep-going] [--without KIND]...
       bulwark-sim --seed S [--ops M] [--layout L]   (replay one run)";

/// What the command line asked for.
struct Args {
    seeds: Vec<u64>,
    ops: u64,
    layouts: Vec<SimLayout>,
    dir: Option<PathBuf>,
    verbose: bool,
    log: bool,
    keep_going: bool,
    without: Vec<Kind>,
}

fn number(s: Option<String>) -> Option<u64> {
    let s = s?;
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
    }
}

/// The arguments, or `None` for a usage error.
fn parse() -> Option<Args> {
    let mut it = std::env::args().skip(1);
    let (mut count, mut first, mut one) = (10u64, 1u64, None);
    let mut a = Args {
        seeds: Vec::new(),
        ops: 1000,
        layouts: vec![SimLayout::Single],
        dir: None,
        verbose: false,
        log: false,
        keep_going: false,
        without: Vec::new(),
    };
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--seeds" => count = number(it.next())?,
            "--first" => first = number(it.next())?,
            "--seed" => one = Some(number(it.next())?),
            "--ops" => a.ops = number(it.next())?,
            "--layout" => {
                a.layouts = match it.next()?.as_str() {
                    "all" => SimLayout::all(),
                    l => vec![SimLayout::parse(l)?],
                }
            }
            "--dir" => a.dir = Some(it.next()?.into()),
            "--verbose" | "-v" => a.verbose = true,
            "--log" => a.log = true,
            "--keep-going" => a.keep_going = true,
            "--without" => a.without.push(Kind::parse(&it.next()?)?),
            _ => return None,
        }
    }
    a.seeds = match one {
        Some(s) => {
            a.verbose = true;
            vec![s]
        }
        None => (first..first + count).collect(),
    };
    Some(a)
}

/// The engine's own warnings and errors (a failed background commit, a pass of the
/// cleaner) beside the operations, on stderr (`--log`; `BULWARK_LOG` filters).
fn engine_log() {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BULWARK_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .without_time()
        .try_init();
}

fn main() -> ExitCode {
    let Some(args) = parse() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    if args.log {
        engine_log();
    }
    let start = std::time::Instant::now();
    let (mut ops, mut runs, mut crashes, mut failures) = (0u64, 0u64, 0u64, 0u64);
    let mut combined = 0xcbf2_9ce4_8422_2325u64;
    for &layout in &args.layouts {
        for &seed in &args.seeds {
            let cfg = Config {
                seed,
                ops: args.ops,
                layout,
                dir: args.dir.clone(),
                log: args.log,
                without: args.without.clone(),
            };
            match run(&cfg) {
                Ok(r) => {
                    (ops, runs, crashes) = (ops + r.ops, runs + 1, crashes + r.stats.crashes);
                    combined = (combined ^ r.trace_hash).wrapping_mul(0x100_0000_01b3);
                    if args.verbose {
                        println!(
                            "seed {seed} layout {} ops {}: ok, trace {:016x}\n  kinds {:?}\n  {:?}",
                            layout.name(),
                            r.ops,
                            r.trace_hash,
                            r.kinds,
                            r.stats
                        );
                    }
                }
                Err(f) => {
                    println!(
                        "FAIL seed {} layout {} at op {}: {}\nreplay: {}\ntrace {:016x}",
                        f.seed,
                        layout.name(),
                        f.op,
                        f.message,
                        f.replay,
                        f.trace_hash
                    );
                    if !args.keep_going {
                        return ExitCode::FAILURE;
                    }
                    failures += 1;
                }
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{runs} runs held, {ops} operations, {crashes} crashes, {failures} failed runs, in {secs:.1} s ({:.0} ops/s); trace {combined:016x}",
        ops as f64 / secs.max(1e-9)
    );
    if failures > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
