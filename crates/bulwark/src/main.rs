//! `bulwark`: one binary for the daemon (`serve`) and the CLI that drives it.
//!
//! This file only parses arguments, sets up logging and dispatches; see
//! `cli` (arguments), `daemon` (serve), `client` (commands over the control
//! socket), `control` (the protocol), `export` (volumes as NBD backends),
//! `display` (tables) and `bench` (fio over NBD). Errors end as one
//! `error: <message>` line on stderr, exit code 1, or 2 for usage mistakes.
//!
//! Module order, bottom-up: `error`, `access`, `notify` → `cli`, `control`, `metrics` →
//! `display` → `client` → `export`, `grant`, `history`, `keys`, `maintenance`, `bench`,
//! `snapshot`, `volume`, `csi` → `image`, `objects` → `pools` → `daemon`. A module uses only
//! modules before it (`tests/layers.rs`). A command's two sides (the CLI's request and the
//! daemon's engine calls) live in one module below `daemon`, which only dispatches to them.

mod access;
mod bench;
mod cli;
mod client;
mod control;
mod csi;
mod daemon;
mod display;
mod error;
mod export;
mod grant;
mod history;
mod image;
mod keys;
mod maintenance;
mod metrics;
mod notify;
mod objects;
mod pools;
mod snapshot;
mod volume;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;

use crate::cli::{Cli, Command, GrantCommand, KeyCommand, PoolCommand, VolumeCommand};
use crate::error::Result;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    // The daemon logs what it does; a command that runs the engine itself (the pool
    // commands) says what it did on stdout, and logs only warnings.
    init_logging(
        if matches!(cli.command, Command::Serve(_) | Command::Csi(_)) {
            "info"
        } else {
            "warn"
        },
    );
    // Every engine path that opens a pool with an object store reaches it through this.
    bulwark_engine::pool::tier::set_opener(objects::opener);
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    let pool = cli.pool.as_deref();
    match &cli.command {
        Command::Pool(PoolCommand::Create(args)) => pools::create(args),
        Command::Pool(PoolCommand::List(args)) => pools::list(args),
        Command::Pool(PoolCommand::Status(args)) => pools::status(args, pool),
        Command::Pool(PoolCommand::Export(args)) => pools::export(args),
        Command::Pool(PoolCommand::Import(args)) => pools::import(args),
        Command::Pool(PoolCommand::ProbeStore(args)) => objects::probe_store(args),
        Command::Pool(PoolCommand::Destroy(args)) => pools::destroy(args),
        Command::Pool(PoolCommand::Upgrade(args)) => pools::upgrade(args),
        Command::Pool(PoolCommand::Cache(cmd)) => pools::cache(cmd),
        Command::Pool(PoolCommand::Log(command)) => pools::log(command, pool),
        Command::Pool(PoolCommand::ObjectStore(command)) => pools::object_store(command, pool),
        Command::Serve(args) => {
            let dir = match &args.dir {
                Some(dir) => dir.as_path(),
                None => client::pool_dir(pool)?,
            };
            daemon::serve(dir, args)
        }
        Command::Volume(VolumeCommand::Create(args)) => {
            client::volume_create(client::pool_dir(pool)?, args)
        }
        Command::Volume(VolumeCommand::List(args)) => {
            snapshot::volume_list(client::pool_dir(pool)?, args)
        }
        Command::Volume(VolumeCommand::Clone(args)) => {
            snapshot::clone(client::pool_dir(pool)?, args)
        }
        Command::Volume(VolumeCommand::Resize(args)) => {
            volume::resize(client::pool_dir(pool)?, args)
        }
        Command::Volume(VolumeCommand::Get(args)) => volume::get(client::pool_dir(pool)?, args),
        Command::Volume(VolumeCommand::Set(args)) => volume::set(client::pool_dir(pool)?, args),
        Command::Volume(VolumeCommand::Rollback(args)) => {
            snapshot::rollback(client::pool_dir(pool)?, args)
        }
        Command::Snapshot(command) => snapshot::command(client::pool_dir(pool)?, command),
        Command::Image(command) => image::command(client::pool_dir(pool)?, command),
        Command::Volume(VolumeCommand::Destroy(args)) => {
            keys::volume_destroy(client::pool_dir(pool)?, args)
        }
        Command::Key(KeyCommand::Load(args)) => client::key_load(client::pool_dir(pool)?, args),
        Command::Key(KeyCommand::Unload(args)) => client::key_unload(client::pool_dir(pool)?, args),
        Command::Key(command) => keys::command(client::pool_dir(pool)?, command),
        Command::Status(args) => client::status(client::pool_dir(pool)?, args),
        Command::Grant(GrantCommand::Add(args)) => grant::add(client::pool_dir(pool)?, args),
        Command::Grant(GrantCommand::Remove(args)) => grant::remove(client::pool_dir(pool)?, args),
        Command::Grant(GrantCommand::List(args)) => grant::list(client::pool_dir(pool)?, args),
        Command::Scrub(args) => maintenance::scrub(client::pool_dir(pool)?, args),
        Command::Device(command) => maintenance::device(client::pool_dir(pool)?, command),
        Command::Fault(command) => maintenance::fault(client::pool_dir(pool)?, command),
        Command::History(args) => history::history(client::pool_dir(pool)?, args),
        Command::Bench(args) => bench::bench(pool, args),
        Command::Csi(args) => csi::serve(client::pool_dir(pool)?, args),
        Command::Completions(args) => {
            use std::io::Write;
            // A closed pipe (`| head`) ends the output quietly, as for any filter.
            let _ = std::io::stdout().write_all(&cli::completions(args.shell));
            Ok(())
        }
        Command::Man(args) => {
            use std::io::Write;
            let pages = cli::man_pages(&args.dir)?;
            let list: String = pages.iter().map(|p| format!("{}\n", p.display())).collect();
            let _ = std::io::stdout().write_all(list.as_bytes());
            Ok(())
        }
    }
}

/// Help and version print as clap prints them; a usage mistake becomes one
/// `error:` line (the message and any tip, without the usage dump), exit 2.
fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp
        | ErrorKind::DisplayVersion
        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => e.exit(),
        _ => {
            eprintln!("error: {}", one_line(&e.render().to_string()));
            ExitCode::from(2)
        }
    }
}

/// clap's message as one line: its first paragraph and its tips, lines joined.
fn one_line(rendered: &str) -> String {
    let mut parts = Vec::new();
    for (i, paragraph) in rendered.split("\n\n").enumerate() {
        let text = paragraph
            .split('\n')
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(" ");
        if i == 0 {
            parts.push(text.strip_prefix("error: ").unwrap_or(&text).to_string());
        } else if text.starts_with("tip:") {
            parts.push(text);
        }
    }
    parts.join("; ")
}

/// Logs go to stderr; the filter comes from `BULWARK_LOG`, else `RUST_LOG`, else `default`.
fn init_logging(default: &str) {
    use tracing_subscriber::EnvFilter;
    let filter = ["BULWARK_LOG", "RUST_LOG"]
        .iter()
        .find_map(|var| std::env::var(var).ok().filter(|v| !v.is_empty()))
        .and_then(|spec| EnvFilter::try_new(spec).ok())
        .unwrap_or_else(|| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}
