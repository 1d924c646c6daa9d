//! `bulwark-live`: the engine on its real threads, several writers per volume and an
//! operator beside them, every read checked (`bulwark_sim::live`, docs/simulation.md).
//!
//! ```text
//! bulwark-live [--seconds N] [--layout single|mirror|parity|log|all] [--writers W]
//!              [--seed S] [--runs R] [--tiny-cache] [--huge-spread LOG2] [--holes-first] [--crash] [--dir D] [--log]
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use bulwark_sim::live::{live, LiveConfig, HUGE_SPREAD};

const USAGE: &str = "usage: bulwark-live [--seconds N] [--layout single|mirror|parity|log|all] [--writers W] [--seed S] [--runs R] [--tiny-cache] [--huge-spread LOG2] [--holes-first] [--crash] [--dir D] [--log]";

fn main() -> ExitCode {
    let mut it = std::env::args().skip(1);
    let (mut seconds, mut layouts, mut writers, mut seed, mut runs) =
        (30u64, vec!["single".to_string()], 3usize, 1u64, 1u64);
    let (mut tiny, mut holes, mut dir) = (false, false, None::<PathBuf>);
    let mut crash = false;
    let mut spread = HUGE_SPREAD;
    while let Some(flag) = it.next() {
        let mut value = || it.next();
        let ok = match flag.as_str() {
            "--seconds" => value().and_then(|v| v.parse().ok()).map(|v| seconds = v),
            "--writers" => value().and_then(|v| v.parse().ok()).map(|v| writers = v),
            "--seed" => value().and_then(|v| v.parse().ok()).map(|v| seed = v),
            "--runs" => value().and_then(|v| v.parse().ok()).map(|v| runs = v),
            "--dir" => value().map(|v| dir = Some(v.into())),
            "--layout" => value().map(|v| {
                layouts = if v == "all" {
                    ["single", "mirror", "parity", "log"]
                        .map(String::from)
                        .to_vec()
                } else {
                    vec![v]
                }
            }),
            "--huge-spread" => value()
                .and_then(|v| v.parse::<u32>().ok())
                .filter(|&b| (12..=56).contains(&b))
                .map(|b| spread = 1u64 << b),
            "--tiny-cache" => {
                tiny = true;
                Some(())
            }
            "--log" => {
                // The engine's warnings on stderr, with their times (`BULWARK_LOG` filters).
                let _ = tracing_subscriber::fmt()
                    .with_writer(std::io::stderr)
                    .with_ansi(false)
                    .with_env_filter(
                        tracing_subscriber::EnvFilter::try_from_env("BULWARK_LOG")
                            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
                    )
                    .try_init();
                Some(())
            }
            "--crash" => {
                crash = true;
                Some(())
            }
            "--holes-first" => {
                holes = true;
                Some(())
            }
            _ => None,
        };
        if ok.is_none() {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    }
    let mut failed = 0;
    for r in 0..runs {
        for layout in &layouts {
            let cfg = LiveConfig {
                seed: seed + r,
                duration: Duration::from_secs(seconds),
                layout: layout.clone(),
                writers,
                dir: dir.clone(),
                tiny_cache: tiny,
                crash,
                holes_first: holes,
                huge_spread: spread,
            };
            match live(&cfg) {
                Ok(rep) => println!(
                    "live seed {} layout {layout} {seconds} s: held; {rep:?}",
                    cfg.seed
                ),
                Err(fails) => {
                    failed += 1;
                    println!(
                        "FAIL live seed {} layout {layout}{}{}{}: {}",
                        cfg.seed,
                        if tiny { " tiny-cache" } else { "" },
                        if holes { " holes-first" } else { "" },
                        if crash { " crash" } else { "" },
                        fails.join("\n")
                    );
                }
            }
        }
    }
    if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
