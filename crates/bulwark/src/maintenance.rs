//! Scrub, device and fault-injection commands: the CLI side (requests,
//! progress bars, exit codes) and the daemon side (the engine calls).
//!
//! The engine does the work in the background: a scrub or resilver runs on
//! its own thread and survives the CLI that started it (and a daemon restart,
//! from its saved cursor). `--wait` only watches: it polls `scrub_status` and
//! draws a progress bar until the scan stops, then exits 0 if every block had
//! a good copy and 1 otherwise, listing the ranges that had none.
//!
//! `fault set` is additive: the daemon reads the device's armed faults, drops
//! one of the same mode, appends the new one and arms the list, under one lock
//! so two concurrent `fault set` calls cannot lose each other's fault.

use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use bulwark_engine::device::fault::Fault;
use bulwark_engine::size::format_size;
use bulwark_engine::Pool;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;

use crate::cli::{DeviceCommand, FaultCommand, ScrubArgs, ScrubCommand};
use crate::client::{print, Client};
use crate::control::{to_value, ControlError, FaultEntry, FaultSpec, Request, ScrubReport};
use crate::display;
use crate::error::{Error, Result};

/// How often `--wait` asks the daemon for progress.
const POLL_INTERVAL: Duration = Duration::from_millis(250);

// ---------------------------------------------------------------------------
// daemon side

/// Serialises the read-modify-write of a device's fault list.
static FAULTS_LOCK: Mutex<()> = Mutex::new(());

/// Answer one scrub, device or fault request (blocking: run it off the async threads).
pub fn handle(pool: &Pool, request: Request) -> std::result::Result<Value, ControlError> {
    match request {
        Request::ScrubStart { verify_store } => {
            pool.scrub_start_with(verify_store)?;
            to_value(&report(pool))
        }
        Request::ScrubResume => {
            let s = pool.scrub_status();
            if s.state != "paused" {
                return Err(ControlError::invalid(format!(
                    "no paused scrub to resume (the last {} is {}); 'bulwark scrub start' starts one",
                    s.kind, s.state
                )));
            }
            pool.scrub_start()?;
            to_value(&report(pool))
        }
        Request::ScrubPause => {
            pool.scrub_pause()?;
            to_value(&report(pool))
        }
        Request::ScrubCancel => {
            pool.scrub_cancel()?;
            to_value(&report(pool))
        }
        Request::ScrubStatus => to_value(&report(pool)),
        Request::DeviceOffline { path } => {
            pool.device_offline(&path)?;
            Ok(Value::String(pool.status().state))
        }
        Request::DeviceOnline { path } => {
            pool.device_online(&path)?;
            to_value(&report(pool))
        }
        Request::DeviceReplace { old, new } => {
            pool.device_replace(&old, &new)?;
            to_value(&report(pool))
        }
        Request::FaultSet { device, fault } => {
            let _one_at_a_time = FAULTS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
            let mut faults = faults_of(pool, &device);
            faults.retain(|f| f.mode != fault.mode);
            faults.push(Fault::from(fault));
            pool.set_faults(&device, faults.clone())?;
            to_value(&faults)
        }
        Request::FaultClear { device } => {
            let _one_at_a_time = FAULTS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
            let mut cleared = 0;
            match device {
                Some(device) => {
                    cleared += faults_of(pool, &device).len();
                    pool.set_faults(&device, Vec::new())?;
                }
                None => {
                    for entry in armed_faults(pool) {
                        pool.set_faults(&entry.device, Vec::new())?;
                        cleared += entry.faults.len();
                    }
                }
            }
            Ok(Value::from(cleared))
        }
        Request::FaultList => to_value(&armed_faults(pool)),
        other => Err(ControlError::internal(format!(
            "internal error: {other:?} is not a maintenance request"
        ))),
    }
}

fn report(pool: &Pool) -> ScrubReport {
    // Errors first: a scrub that finishes in between can only have cleared some.
    let errors = pool.status().errors;
    ScrubReport {
        scrub: pool.scrub_status(),
        errors,
    }
}

/// Devices with faults armed, in member order.
pub fn armed_faults(pool: &Pool) -> Vec<FaultEntry> {
    pool.list_faults()
        .into_iter()
        .filter(|(_, faults)| !faults.is_empty())
        .map(|(device, faults)| FaultEntry { device, faults })
        .collect()
}

fn faults_of(pool: &Pool, device: &Path) -> Vec<Fault> {
    pool.list_faults()
        .into_iter()
        .find(|(path, _)| same_file(path, device))
        .map(|(_, faults)| faults)
        .unwrap_or_default()
}

fn same_file(a: &Path, b: &Path) -> bool {
    a == b
        || matches!(
            (std::fs::canonicalize(a), std::fs::canonicalize(b)),
            (Ok(x), Ok(y)) if x == y
        )
}

// ---------------------------------------------------------------------------
// CLI side

pub fn scrub(dir: &Path, args: &ScrubArgs) -> Result<()> {
    let mut client = Client::connect(dir)?;
    match &args.command {
        None => scrub_start(&mut client, args.wait, args.verify_store),
        Some(ScrubCommand::Start(w)) => scrub_start(&mut client, w.wait, w.verify_store),
        Some(ScrubCommand::Resume(w)) => {
            let r: ScrubReport = client.call_typed(&Request::ScrubResume)?;
            if w.wait {
                return wait_and_finish(&mut client);
            }
            print(&format!(
                "{} resumed at {}; 'bulwark scrub status' shows its progress\n",
                r.scrub.kind,
                display::done_of_total(&r.scrub)
            ))
        }
        Some(ScrubCommand::Pause) => {
            let r: ScrubReport = client.call_typed(&Request::ScrubPause)?;
            print(&format!(
                "{} paused at {}; 'bulwark scrub resume' continues it\n",
                r.scrub.kind,
                display::done_of_total(&r.scrub)
            ))
        }
        Some(ScrubCommand::Cancel) => {
            let r: ScrubReport = client.call_typed(&Request::ScrubCancel)?;
            print(&format!(
                "{} canceled at {}; the next scrub starts from the beginning\n",
                r.scrub.kind,
                display::done_of_total(&r.scrub)
            ))
        }
        Some(ScrubCommand::Status(a)) => {
            let r: ScrubReport = client.call_typed(&Request::ScrubStatus)?;
            if a.json {
                print_json(&r)
            } else {
                print(&display::scrub_report_text(&r))
            }
        }
    }
}

fn scrub_start(client: &mut Client, wait: bool, verify_store: bool) -> Result<()> {
    loop {
        match client.call_typed::<ScrubReport>(&Request::ScrubStart { verify_store }) {
            Ok(r) if !wait => {
                return print(&format!(
                    "scrub {} ({} to verify); 'bulwark scrub status' shows its progress, \
                     'bulwark scrub --wait' waits for it\n",
                    if r.scrub.bytes_done > 0 {
                        "resumed"
                    } else {
                        "started"
                    },
                    format_size(r.scrub.bytes_total),
                ))
            }
            Ok(_) => return wait_and_finish(client),
            Err(e) => {
                // Refused: join the scan that is running, if that is why.
                let r: ScrubReport = client.call_typed(&Request::ScrubStatus)?;
                if !wait || r.scrub.state != "scanning" {
                    return Err(e);
                }
                if r.scrub.kind == "scrub" {
                    eprintln!("a scrub is already running: waiting for it to finish");
                    return wait_and_finish(client);
                }
                eprintln!(
                    "a {} is in progress: waiting for it before the scrub starts",
                    r.scrub.kind
                );
                let done = watch(client)?;
                print(&format!("{}\n", display::scan_line(&done.scrub)))?;
            }
        }
    }
}

/// Watch the running scan until it stops, then report it: exit 1 if a block had no good copy.
fn wait_and_finish(client: &mut Client) -> Result<()> {
    let r = watch(client)?;
    let s = &r.scrub;
    match s.state.as_str() {
        "finished" => {}
        "paused" => {
            return Err(Error::msg(format!(
                "the {} was paused at {}; 'bulwark scrub resume --wait' continues it",
                s.kind,
                display::done_of_total(s)
            )))
        }
        "canceled" => {
            return Err(Error::msg(format!(
                "the {} was canceled at {}",
                s.kind,
                display::done_of_total(s)
            )))
        }
        other => {
            return Err(Error::msg(format!(
                "the {} stopped in state '{other}'",
                s.kind
            )))
        }
    }
    let mut text = format!("{}\n", display::scan_line(s));
    // Errors left when a scan finishes were all seen by it (older ones are dropped); a map
    // node that could not be read is listed there without being counted as a block.
    if s.unrecoverable == 0 && r.errors.is_empty() {
        return print(&text);
    }
    text.push_str(&display::errors_text(&r.errors));
    print(&text)?;
    Err(Error::msg(format!(
        "the {} found {} record(s) with no good copy ({} range(s) of volumes affected); nothing \
         was written in their place: reads there fail with EIO until a good copy is found \
         (listed above and in 'bulwark status')",
        s.kind,
        s.unrecoverable,
        r.errors.len()
    )))
}

/// Poll with a progress bar until the scan is no longer running.
fn watch(client: &mut Client) -> Result<ScrubReport> {
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template(
            "{prefix} [{bar:30}] {binary_bytes}/{binary_total_bytes} {wide_msg}",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    loop {
        let r: ScrubReport = client.call_typed(&Request::ScrubStatus)?;
        let s = &r.scrub;
        if s.state != "scanning" {
            bar.finish_and_clear();
            return Ok(r);
        }
        bar.set_prefix(s.kind.clone());
        bar.set_length(s.bytes_total.max(s.bytes_done));
        bar.set_position(s.bytes_done);
        bar.set_message(format!(
            "{}/s, {} to go, {} repaired, {} unrecoverable",
            format_size(s.rate_bytes_per_sec),
            s.eta_seconds
                .map(display::duration)
                .unwrap_or_else(|| "?".into()),
            s.repaired,
            s.unrecoverable
        ));
        std::thread::sleep(POLL_INTERVAL);
    }
}

pub fn device(dir: &Path, command: &DeviceCommand) -> Result<()> {
    let mut client = Client::connect(dir)?;
    match command {
        DeviceCommand::Offline(a) => {
            let path = absolute(&a.path)?;
            let state: String =
                client.call_typed(&Request::DeviceOffline { path: path.clone() })?;
            print(&format!(
                "device {} is offline; the pool is {state}\n",
                path.display()
            ))
        }
        DeviceCommand::Online(a) => {
            let path = absolute(&a.path)?;
            client.call(&Request::DeviceOnline { path: path.clone() })?;
            print(&format!(
                "device {} is online: resilver started ('bulwark scrub status' shows its progress)\n",
                path.display()
            ))?;
            if a.wait.wait {
                return wait_and_finish(&mut client);
            }
            Ok(())
        }
        DeviceCommand::Replace(a) => {
            let old = absolute(&a.old)?;
            let new = std::fs::canonicalize(&a.new).map_err(|e| {
                Error::msg(format!(
                    "cannot use {} as the new device: {e} (for a file: truncate -s SIZE {})",
                    a.new.display(),
                    a.new.display()
                ))
            })?;
            client.call(&Request::DeviceReplace {
                old: old.clone(),
                new: new.clone(),
            })?;
            print(&format!(
                "replacing {} with {}: resilver started ('bulwark scrub status' shows its progress)\n",
                old.display(),
                new.display()
            ))?;
            if a.wait.wait {
                return wait_and_finish(&mut client);
            }
            Ok(())
        }
    }
}

pub fn fault(dir: &Path, command: &FaultCommand) -> Result<()> {
    let mut client = Client::connect(dir)?;
    match command {
        FaultCommand::Set(a) => {
            let device = absolute(&a.device)?;
            let seed = a.seed.unwrap_or_else(random_seed);
            let fault = FaultSpec {
                mode: a.mode,
                probability: a.probability,
                seed,
                include_labels: a.include_labels,
            };
            let armed: Vec<Fault> = client.call_typed(&Request::FaultSet {
                device: device.clone(),
                fault,
            })?;
            let modes: Vec<String> = armed.iter().map(display::fault_mode).collect();
            print(&format!(
                "armed {} on {} (probability {}, seed {seed}{}); armed on this device: {}\n",
                display::fault_mode(armed.last().expect("the fault just set")),
                device.display(),
                a.probability,
                if a.include_labels { ", labels too" } else { "" },
                modes.join(", ")
            ))
        }
        FaultCommand::Clear(a) => {
            let device = a.device.as_deref().map(absolute).transpose()?;
            let cleared: usize = client.call_typed(&Request::FaultClear {
                device: device.clone(),
            })?;
            let whre = match &device {
                Some(d) => format!("on {}", d.display()),
                None => "on every device".into(),
            };
            print(&format!("cleared {cleared} fault(s) {whre}\n"))
        }
        FaultCommand::List(a) => {
            let entries: Vec<FaultEntry> = client.call_typed(&Request::FaultList)?;
            if a.json {
                print_json(&entries)
            } else {
                print(&display::fault_table(&entries))
            }
        }
    }
}

/// An absolute path for the daemon (whose working directory is not ours); need not exist.
fn absolute(path: &Path) -> Result<PathBuf> {
    std::path::absolute(path)
        .map_err(|e| Error::msg(format!("cannot resolve {}: {e}", path.display())))
}

fn random_seed() -> u64 {
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

fn print_json<T: serde::Serialize>(value: &T) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value).expect("results always serialize");
    text.push('\n');
    print(&text)
}
