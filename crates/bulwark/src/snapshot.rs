//! The CLI side of snapshots, rollback and `volume list --space`.

use std::path::Path;

use bulwark_engine::pool::{SnapshotStatus, VolumeSpace};
use bulwark_engine::size::format_size;

use crate::cli::{
    SnapshotCommand, SnapshotListArgs, SnapshotNameArgs, SnapshotTagArgs, VolumeCloneArgs,
    VolumeListArgs, VolumeRollbackArgs,
};
use crate::client::{print, print_json, secret_ref, Client};
use crate::control::{Request, VolumeEntry};
use crate::display;
use crate::error::{Error, Result};

/// `VOL@SNAP` as (volume, snapshot), or a usage error naming what was given.
pub fn split(arg: &str) -> Result<(String, String)> {
    match arg.split_once('@') {
        Some((v, s)) if !v.is_empty() && !s.is_empty() && !s.contains('@') => {
            Ok((v.to_string(), s.to_string()))
        }
        _ => Err(Error::usage(format!(
            "'{arg}' is not a snapshot name: write VOL@SNAP (for example vm1@before-upgrade)"
        ))),
    }
}

pub fn command(dir: &Path, command: &SnapshotCommand) -> Result<()> {
    match command {
        SnapshotCommand::Create(a) => create(dir, a),
        SnapshotCommand::List(a) => list(dir, a),
        SnapshotCommand::Destroy(a) => destroy(dir, a),
        SnapshotCommand::Hold(a) => hold(dir, a, true),
        SnapshotCommand::Release(a) => hold(dir, a, false),
    }
}

fn create(dir: &Path, args: &SnapshotNameArgs) -> Result<()> {
    let (volume, snapshot) = split(&args.snapshot)?;
    Client::connect(dir)?.call(&Request::SnapshotCreate { volume, snapshot })?;
    print(&format!("created snapshot {}\n", args.snapshot))
}

fn list(dir: &Path, args: &SnapshotListArgs) -> Result<()> {
    let snaps: Vec<SnapshotStatus> = Client::connect(dir)?.call_typed(&Request::SnapshotList {
        volume: args.volume.clone(),
    })?;
    if args.json {
        print_json(&snaps)
    } else {
        print(&display::snapshot_table(&snaps))
    }
}

fn destroy(dir: &Path, args: &SnapshotNameArgs) -> Result<()> {
    let (volume, snapshot) = split(&args.snapshot)?;
    let answer = Client::connect(dir)?.call(&Request::SnapshotDestroy { volume, snapshot })?;
    let freed = answer
        .get("freed_bytes")
        .and_then(|v| v.as_u64())
        .unwrap_or(0);
    print(&format!(
        "destroyed snapshot {}: freed {} ({freed} bytes)\n",
        args.snapshot,
        format_size(freed)
    ))
}

fn hold(dir: &Path, args: &SnapshotTagArgs, hold: bool) -> Result<()> {
    // `zfs hold TAG SNAP` puts the tag first: taken too, as a tag never holds '@'.
    let (name, tag) = if !args.snapshot.contains('@') && args.tag.contains('@') {
        (&args.tag, &args.snapshot)
    } else {
        (&args.snapshot, &args.tag)
    };
    let (volume, snapshot) = split(name)?;
    let shown = format!("held {name} ({tag})\n");
    let tag = tag.clone();
    let request = if hold {
        Request::SnapshotHold {
            volume,
            snapshot,
            tag,
        }
    } else {
        Request::SnapshotRelease {
            volume,
            snapshot,
            tag,
        }
    };
    Client::connect(dir)?.call(&request)?;
    print(&if hold {
        shown
    } else {
        shown.replacen("held", "released", 1)
    })
}

/// `volume rollback VOL@SNAP [--destroy-newer]`.
pub fn rollback(dir: &Path, args: &VolumeRollbackArgs) -> Result<()> {
    let (volume, snapshot) = split(&args.snapshot)?;
    let destroyed: Vec<String> = Client::connect(dir)?.call_typed(&Request::VolumeRollback {
        volume: volume.clone(),
        snapshot,
        destroy_newer: args.destroy_newer,
    })?;
    let mut out = String::new();
    for d in &destroyed {
        out.push_str(&format!("destroyed newer snapshot {volume}@{d}\n"));
    }
    out.push_str(&format!(
        "rolled back volume {volume} to {}\n",
        args.snapshot
    ));
    print(&out)
}

/// `volume clone VOL@SNAP NEW (--key-file F | --passphrase-file F) [--independent]`.
pub fn clone(dir: &Path, args: &VolumeCloneArgs) -> Result<()> {
    let (volume, snapshot) = split(&args.snapshot)?;
    let secret = args.secret.file().map(|f| secret_ref(&f)).transpose()?;
    let entry: VolumeEntry = Client::connect(dir)?.call_typed(&Request::VolumeClone {
        volume,
        snapshot,
        name: args.name.clone(),
        secret,
        independent: args.independent,
    })?;
    let v = &entry.volume;
    let mut out = format!(
        "created volume {} as a clone of {}: {}, encryption {}{}\n",
        v.name,
        args.snapshot,
        format_size(v.size_bytes),
        if v.encryption { "on" } else { "off" },
        if v.encryption {
            ", its own key loaded"
        } else {
            ""
        }
    );
    if v.encryption {
        // Whether it inherited keys (an encrypted origin): what those keys open.
        let inherited = Client::connect(dir)
            .and_then(|mut c| {
                c.call_typed::<bulwark_engine::pool::props::VolumeProps>(&Request::VolumeGet {
                    name: args.name.clone(),
                })
            })
            .map(|p| p.inherited_keys)
            .unwrap_or(1);
        if inherited > 0 || args.independent {
            out.push_str(&display::clone_key_note(
                &args.name,
                &args.snapshot,
                args.independent,
            ));
        }
    }
    if args.independent {
        out.push_str(&format!(
            "re-encrypting its inherited blocks under its own key in the background \
             ('bulwark volume list' shows the progress); then it no longer depends on {}\n",
            args.snapshot
        ));
    }
    print(&out)
}

/// `volume list [--space] [--json]`.
pub fn volume_list(dir: &Path, args: &VolumeListArgs) -> Result<()> {
    if args.space {
        let space: Vec<VolumeSpace> =
            Client::connect(dir)?.call_typed(&Request::VolumeSpace { name: None })?;
        return if args.json {
            print_json(&space)
        } else {
            print(&display::space_table(&space))
        };
    }
    let volumes: Vec<VolumeEntry> = Client::connect(dir)?.call_typed(&Request::VolumeList)?;
    if args.json {
        print_json(&volumes)
    } else {
        print(&display::volume_table(&volumes))
    }
}
