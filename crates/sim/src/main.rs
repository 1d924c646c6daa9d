//! `bulwark-sim`: run seeds of the deterministic simulator (docs/simulation.md).
//!
//! ```text
//! bulwark-sim [--seeds N] [--first S] [--ops M] [--layout single|mirror|parity|all] [--dir D]
//! bulwark-sim --seed S --ops M --layout L        # replay one run
//! ```
//! A failure prints one line that replays it; every run ends with its trace hash.

use std::process::ExitCode;

use bulwark_sim::{run, Config, Kind, SimLayout};

fn usage() -> ExitCode {
    eprintln!(
        "usage: bulwark-sim [--seeds N] [--first S] [--ops M] [--layout single|mirror|parity|all] [--dir D] [--verbose] [--log] [--keep-going] [--without KIND]...\n       bulwark-sim --seed S [--ops M] [--layout L]   (replay one run)"
    );
    ExitCode::from(2)
}

fn number(s: &str) -> Option<u64> {
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
    }
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (mut seeds, mut first, mut ops) = (10u64, 1u64, 1000u64);
    let mut one: Option<u64> = None;
    let mut layouts = vec![SimLayout::Single];
    let mut dir = None;
    let mut verbose = false;
    let mut log = false;
    let mut keep_going = false;
    let mut failures = 0u64;
    let mut without = Vec::new();
    while let Some(a) = args.next() {
        let mut val = || args.next();
        match a.as_str() {
            "--seeds" => match val().as_deref().and_then(number) {
                Some(n) => seeds = n,
                None => return usage(),
            },
            "--first" => match val().as_deref().and_then(number) {
                Some(n) => first = n,
                None => return usage(),
            },
            "--seed" => match val().as_deref().and_then(number) {
                Some(n) => one = Some(n),
                None => return usage(),
            },
            "--ops" => match val().as_deref().and_then(number) {
                Some(n) => ops = n,
                None => return usage(),
            },
            "--layout" => match val().as_deref() {
                Some("all") => {
                    layouts = vec![SimLayout::Single, SimLayout::Mirror, SimLayout::Parity]
                }
                Some(l) => match SimLayout::parse(l) {
                    Some(l) => layouts = vec![l],
                    None => return usage(),
                },
                None => return usage(),
            },
            "--dir" => match val() {
                Some(d) => dir = Some(d.into()),
                None => return usage(),
            },
            "--verbose" | "-v" => verbose = true,
            "--log" => log = true,
            "--keep-going" => keep_going = true,
            "--without" => match val().as_deref().and_then(Kind::parse) {
                Some(k) => without.push(k),
                None => return usage(),
            },
            _ => return usage(),
        }
    }
    if log {
        // The engine's own warnings and errors (a failed background commit, a pass of the
        // cleaner) beside the operations, on stderr.
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_env("BULWARK_LOG")
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            )
            .without_time()
            .try_init();
    }
    let seeds: Vec<u64> = match one {
        Some(s) => {
            verbose = true;
            vec![s]
        }
        None => (first..first + seeds).collect(),
    };
    let start = std::time::Instant::now();
    let (mut total_ops, mut runs, mut combined) = (0u64, 0u64, 0xcbf2_9ce4_8422_2325u64);
    let mut crashes = 0;
    for layout in &layouts {
        for &seed in &seeds {
            let cfg = Config {
                seed,
                ops,
                layout: *layout,
                dir: dir.clone(),
                log,
                without: without.clone(),
            };
            match run(&cfg) {
                Ok(r) => {
                    total_ops += r.ops;
                    runs += 1;
                    crashes += r.stats.crashes;
                    combined = (combined ^ r.trace_hash).wrapping_mul(0x100_0000_01b3);
                    if verbose {
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
                        "FAIL seed {} layout {} at op {}: {}",
                        f.seed,
                        layout.name(),
                        f.op,
                        f.message
                    );
                    println!("replay: {}", f.replay);
                    println!("trace {:016x}", f.trace_hash);
                    if !keep_going {
                        return ExitCode::FAILURE;
                    }
                    failures += 1;
                }
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{runs} runs held, {total_ops} operations, {crashes} crashes, {failures} failed runs, in {secs:.1} s ({:.0} ops/s); trace {combined:016x}",
        total_ops as f64 / secs.max(1e-9)
    );
    if failures > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
