//! The key lifecycle of encrypted volumes beyond load and unload: `key add`,
//! `remove`, `change`, `list`, `rotate` and `erase`, and `volume destroy
//! --crypto-erase`, on both sides of the control socket.
//!
//! CLI side: the secret files are named, never read: their absolute paths go
//! over the socket (as for `key load`). `key rotate` on a paused rotation
//! resumes it. `key rotate --wait` polls the volume and draws a progress bar
//! until the background re-encryption ends, or fails when it pauses (its key
//! unloaded, the pool full, another error), saying why and what resumes it. `key
//! erase` destroys data on purpose, so without `--yes` it asks for the
//! volume's name at a terminal (and refuses when there is none).
//!
//! Daemon side ([`handle`]): read each secret file with [`load_secret`]
//! (`Secret::from_*_file`, which refuses files other users can access; the
//! daemon reads the secrets of `volume create` and `key load` with it too),
//! make the engine call, and drop the secret, zeroized, before answering.
//! Each request is audited by `grant::Audited` (the secrets' kinds, never
//! their paths or bytes).

use std::path::Path;
use std::time::Duration;

use bulwark_engine::pool::keys::SlotInfo;
use bulwark_engine::{Pool, Secret, VolumeStatus};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;

use crate::cli::{
    KeyChangeArgs, KeyCommand, KeyEraseArgs, KeyListArgs, KeyLoadArgs, KeyRotateArgs,
    VolumeDestroyArgs,
};
use crate::client::{self, print, secret_ref, Client};
use crate::control::{to_value, ControlError, ErrorKind, Request, SecretRef, VolumeEntry};
use crate::display;
use crate::error::{Error, Result};

/// How often `key rotate --wait` asks the daemon for progress.
const POLL_INTERVAL: Duration = Duration::from_millis(250);

// ---------------------------------------------------------------------------
// daemon side

/// Answer one key request other than load and unload (blocking: run it off
/// the async threads). The caller refuses `key_erase` while the volume is attached.
pub fn handle(pool: &Pool, request: Request) -> std::result::Result<Value, ControlError> {
    match request {
        Request::KeyAdd { name, secret } => {
            let secret = load_secret(&secret)?;
            let slot = pool
                .key_add(&name, &secret)
                .map_err(|e| explain(pool, &name, e))?;
            drop(secret);
            Ok(Value::from(slot))
        }
        Request::KeyRemove { name, secret } => {
            let secret = load_secret(&secret)?;
            let slots = pool
                .key_remove(&name, &secret)
                .map_err(|e| explain(pool, &name, e))?;
            drop(secret);
            Ok(Value::from(slots))
        }
        Request::KeyChange { name, old, new } => {
            let old = load_secret(&old)?;
            let new = load_secret(&new)?;
            let slot = pool
                .key_change(&name, &old, &new)
                .map_err(|e| explain(pool, &name, e))?;
            drop((old, new));
            Ok(Value::from(slot))
        }
        Request::KeyList { name } => {
            let slots = pool.key_list(&name)?;
            to_value(&slots)
        }
        Request::KeyRotate { name } => {
            let generation = pool
                .key_rotate(&name)
                .map_err(|e| explain(pool, &name, e))?;
            Ok(Value::from(generation))
        }
        Request::KeyErase { name } => {
            pool.key_erase(&name)?;
            Ok(Value::Null)
        }
        other => Err(ControlError::internal(format!(
            "internal error: {other:?} is not a key request"
        ))),
    }
}

/// Read a secret the request names. The path must be absolute (the CLI
/// canonicalizes it); the file's contents are never logged.
pub fn load_secret(secret: &SecretRef) -> std::result::Result<Secret, ControlError> {
    let (path, from_file): (&Path, fn(&Path) -> bulwark_engine::Result<Secret>) = match secret {
        SecretRef::PassphraseFile(p) => (p, Secret::from_passphrase_file),
        SecretRef::KeyFile(p) => (p, Secret::from_key_file),
    };
    if !path.is_absolute() {
        return Err(ControlError::invalid(format!(
            "secret file path {} is not absolute",
            path.display()
        )));
    }
    Ok(from_file(path)?)
}

/// The engine's error as the user should read it: a volume whose keys were
/// erased is not a "wrong key" case; say what happened instead (the kind
/// stays `wrong_key`: no secret opens it).
pub fn explain(pool: &Pool, name: &str, e: bulwark_engine::Error) -> ControlError {
    match e {
        bulwark_engine::Error::WrongKey(_) if erased(pool, name) => ControlError::new(
            ErrorKind::WrongKey,
            format!(
                "the keys of volume '{name}' were erased (crypto-erase): no passphrase or key \
                 file opens it any more and its data is unrecoverable; \
                 'bulwark volume destroy {name}' frees its space"
            ),
        ),
        e => ControlError::from(e),
    }
}

fn erased(pool: &Pool, name: &str) -> bool {
    pool.volumes()
        .iter()
        .any(|v| v.name == name && v.encryption && v.key_slots == 0)
}

// ---------------------------------------------------------------------------
// CLI side

pub fn command(dir: &Path, command: &KeyCommand) -> Result<()> {
    match command {
        KeyCommand::Load(a) => client::key_load(dir, a),
        KeyCommand::Unload(a) => client::key_unload(dir, a),
        KeyCommand::Add(a) => add(dir, a),
        KeyCommand::Remove(a) => remove(dir, a),
        KeyCommand::Change(a) => change(dir, a),
        KeyCommand::List(a) => list(dir, a),
        KeyCommand::Rotate(a) => rotate(dir, a),
        KeyCommand::Erase(a) => erase(dir, a),
    }
}

fn secret_of(args: &KeyLoadArgs) -> Result<SecretRef> {
    secret_ref(&args.secret.file().expect("clap requires one secret source"))
}

fn add(dir: &Path, args: &KeyLoadArgs) -> Result<()> {
    let request = Request::KeyAdd {
        name: args.name.clone(),
        secret: secret_of(args)?,
    };
    let slot: usize = Client::connect(dir)?.call_typed(&request)?;
    print(&format!(
        "added key slot {slot} to volume {}: that {} now opens it too\n",
        args.name,
        secret_word(&request)
    ))
}

fn remove(dir: &Path, args: &KeyLoadArgs) -> Result<()> {
    let request = Request::KeyRemove {
        name: args.name.clone(),
        secret: secret_of(args)?,
    };
    let slots: Vec<usize> = Client::connect(dir)?.call_typed(&request)?;
    print(&removed_message(&args.name, secret_word(&request), &slots))
}

/// What `key remove` did: every slot the secret opened is gone (a volume made before
/// `key change` refused duplicates may have held one secret in several slots).
fn removed_message(name: &str, word: &str, slots: &[usize]) -> String {
    match slots {
        [slot] => {
            format!("removed key slot {slot} of volume {name}: that {word} no longer opens it\n")
        }
        _ => {
            let list: Vec<String> = slots.iter().map(|s| s.to_string()).collect();
            format!(
                "removed key slots {} of volume {name}: that {word} opened each of them; it no \
                 longer opens the volume\n",
                list.join(", ")
            )
        }
    }
}

fn secret_word(request: &Request) -> &'static str {
    match request {
        Request::KeyAdd { secret, .. } | Request::KeyRemove { secret, .. } => match secret {
            SecretRef::PassphraseFile(_) => "passphrase",
            SecretRef::KeyFile(_) => "key file",
        },
        _ => "secret",
    }
}

fn change(dir: &Path, args: &KeyChangeArgs) -> Result<()> {
    let old = args.old.file().expect("clap requires the old secret");
    let new = args.new_secret().expect("clap requires the new secret");
    let request = Request::KeyChange {
        name: args.name.clone(),
        old: secret_ref(&old)?,
        new: secret_ref(&new)?,
    };
    let slot: usize = Client::connect(dir)?.call_typed(&request)?;
    print(&format!(
        "changed key slot {slot} of volume {}: the old secret no longer opens it, the new one does\n",
        args.name
    ))
}

fn list(dir: &Path, args: &KeyListArgs) -> Result<()> {
    let slots: Vec<SlotInfo> = Client::connect(dir)?.call_typed(&Request::KeyList {
        name: args.name.clone(),
    })?;
    if args.json {
        let mut text = serde_json::to_string_pretty(&slots).expect("slots serialize");
        text.push('\n');
        print(&text)
    } else {
        print(&display::key_slot_table(&slots))
    }
}

fn rotate(dir: &Path, args: &KeyRotateArgs) -> Result<()> {
    let mut client = Client::connect(dir)?;
    // A rotation recorded already is resumed, not started, by the request.
    let paused = volume(&mut client, &args.name)?
        .filter(|v| v.rotation.is_some() && !v.locked)
        .map(|v| display::rotation_progress(&v).unwrap_or_default());
    let started = client.call_typed::<u16>(&Request::KeyRotate {
        name: args.name.clone(),
    });
    match (started, &paused) {
        (Ok(generation), None) if !args.wait => {
            let end = match snapshots_of(&mut client, &args.name) {
                0 => "the old data key is destroyed at the end".to_string(),
                n => kept_keys(n),
            };
            return print(&format!(
                "key rotation of volume {} started: new writes use data key generation \
                 {generation}; older blocks are re-encrypted in the background and {end} \
                 ('bulwark volume list' shows the progress)\n",
                args.name
            ));
        }
        (Ok(generation), Some(at)) if !args.wait => {
            return print(&format!(
                "key rotation of volume {} to data key generation {generation} resumed at \
                 {at}: older blocks are re-encrypted in the background ('bulwark status' shows \
                 the progress, or why it paused again)\n",
                args.name
            ))
        }
        (Ok(_), Some(at)) => eprintln!("resuming the key rotation of volume {} at {at}", args.name),
        (Ok(_), None) => {}
        (Err(e), _) => {
            // Refused: with --wait, join the rotation that is running, if that is why.
            let running = args.wait
                && volume(&mut client, &args.name)?
                    .is_some_and(|v| v.rotation.is_some() && !v.locked);
            if !running {
                return Err(e);
            }
            eprintln!(
                "a key rotation of volume {} is already running: waiting for it to finish",
                args.name
            );
        }
    }
    let v = watch_rotation(&mut client, &args.name)?;
    let keys = match snapshots_of(&mut client, &args.name) {
        0 => "the older data keys are destroyed".to_string(),
        n => kept_keys(n),
    };
    print(&format!(
        "key rotation of volume {} finished: every block of the volume is under data key \
         generation {}; {keys}\n",
        args.name, v.key_generation
    ))
}

/// Snapshots of volume `name`: they keep blocks under the old data keys, which then stay.
fn snapshots_of(client: &mut Client, name: &str) -> usize {
    client
        .call_typed::<Vec<bulwark_engine::pool::SnapshotStatus>>(&Request::SnapshotList {
            volume: Some(name.to_string()),
        })
        .map(|s| s.len())
        .unwrap_or(0)
}

fn kept_keys(snapshots: usize) -> String {
    format!(
        "the old data keys are KEPT: {snapshots} snapshot(s) still hold blocks encrypted \
         under them; destroy the snapshots and rotate again to destroy those keys"
    )
}

/// Poll the volume with a progress bar until its rotation ends; an error when it pauses
/// (key unloaded, pool full, another error): the rotation stays recorded.
fn watch_rotation(client: &mut Client, name: &str) -> Result<VolumeStatus> {
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("re-encrypting [{bar:30}] {percent:>3}% {wide_msg}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    loop {
        let Some(v) = volume(client, name)? else {
            bar.finish_and_clear();
            return Err(Error::msg(format!(
                "volume {name} disappeared during its key rotation"
            )));
        };
        let Some(r) = &v.rotation else {
            bar.finish_and_clear();
            return Ok(v);
        };
        if v.locked {
            bar.finish_and_clear();
            return Err(Error::msg(format!(
                "the key rotation of volume {name} is paused at {}: its key was unloaded; \
                 it resumes when the key is loaded again",
                display::rotation_progress(&v).unwrap_or_default()
            )));
        }
        if let Some((reason, hint)) = display::rotation_pause(&v) {
            bar.finish_and_clear();
            return Err(Error::msg(format!(
                "the key rotation of volume {name} is paused at {} and stays recorded: {reason}; {hint}",
                display::rotation_progress(&v).unwrap_or_default()
            )));
        }
        let blocks = v.size_bytes / u64::from(v.block_size.max(1));
        bar.set_length(blocks.max(1));
        bar.set_position(r.lba.min(blocks));
        bar.set_message(format!("{} blocks re-encrypted", r.blocks_done));
        std::thread::sleep(POLL_INTERVAL);
    }
}

fn volume(client: &mut Client, name: &str) -> Result<Option<VolumeStatus>> {
    let volumes: Vec<VolumeEntry> = client.call_typed(&Request::VolumeList)?;
    Ok(volumes
        .into_iter()
        .map(|e| e.volume)
        .find(|v| v.name == name))
}

fn erase(dir: &Path, args: &KeyEraseArgs) -> Result<()> {
    if !args.yes {
        confirm_erase(&args.name)?;
    }
    erase_keys(dir, &args.name)?;
    print(&format!(
        "erased the keys of volume {0}: its data is unrecoverable; \
         'bulwark volume destroy {0}' frees its space\n",
        args.name
    ))
}

fn erase_keys(dir: &Path, name: &str) -> Result<()> {
    Client::connect(dir)?.call(&Request::KeyErase {
        name: name.to_string(),
    })?;
    Ok(())
}

/// Ask for the volume's name at a terminal, as a guard against erasing the wrong volume.
fn confirm_erase(name: &str) -> Result<()> {
    crate::client::confirm_by_typing(
        name,
        &format!(
            "'key erase' destroys the data of volume {name} for good: confirm by typing its \
             name at a terminal, or pass --yes"
        ),
        &format!(
            "This destroys every key of volume {name}: its data becomes unrecoverable, even \
             with the passphrase or key file.\nType the volume's name to confirm: "
        ),
        &format!("not confirmed: the keys of volume {name} are unchanged"),
    )
}

/// `volume destroy NAME [--crypto-erase]`: with it, the keys are erased first,
/// so the data is unrecoverable even if destroying fails afterwards.
pub fn volume_destroy(dir: &Path, args: &VolumeDestroyArgs) -> Result<()> {
    let name = &args.volume.name;
    if args.crypto_erase && !args.recursive {
        // The destroy would be refused after the erase: refuse before it.
        let snaps: Vec<bulwark_engine::pool::SnapshotStatus> =
            Client::connect(dir)?.call_typed(&Request::SnapshotList {
                volume: Some(name.clone()),
            })?;
        if !snaps.is_empty() {
            return Err(Error::msg(format!(
                "volume {name} has {} snapshot(s); pass -r to destroy them with it \
                 (nothing was erased)",
                snaps.len()
            )));
        }
    }
    if args.crypto_erase {
        erase_keys(dir, name).map_err(|e| {
            Error::msg(format!(
                "crypto-erase of volume {name} failed, nothing was destroyed: {e}"
            ))
        })?;
        print(&format!("erased the keys of volume {name}\n"))?;
    }
    client::volume_destroy(dir, &args.volume, args.recursive)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remove_names_every_slot_it_removed() {
        assert_eq!(
            removed_message("kc", "passphrase", &[0]),
            "removed key slot 0 of volume kc: that passphrase no longer opens it\n"
        );
        assert_eq!(
            removed_message("kc", "passphrase", &[0, 2]),
            "removed key slots 0, 2 of volume kc: that passphrase opened each of them; it no \
             longer opens the volume\n"
        );
    }

    #[test]
    fn key_requests_round_trip_as_documented() {
        for line in [
            r#"{"op":"key_add","name":"v","secret":{"kind":"passphrase_file","path":"/abs/pass"}}"#,
            r#"{"op":"key_remove","name":"v","secret":{"kind":"key_file","path":"/abs/key"}}"#,
            r#"{"op":"key_change","name":"v","old":{"kind":"passphrase_file","path":"/abs/old"},"new":{"kind":"passphrase_file","path":"/abs/new"}}"#,
            r#"{"op":"key_list","name":"v"}"#,
            r#"{"op":"key_rotate","name":"v"}"#,
            r#"{"op":"key_erase","name":"v"}"#,
        ] {
            let r: Request = serde_json::from_str(line).unwrap();
            assert_eq!(serde_json::to_string(&r).unwrap(), line);
        }
    }
}
