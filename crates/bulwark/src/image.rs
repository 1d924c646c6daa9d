//! `image import|export|list`: disk images into volumes and back out, through qemu-img.
//!
//! Only the CLI side: the tools run here, as the user, against the daemon's NBD
//! socket, and the daemon sees ordinary requests (`volume_create`,
//! `snapshot_create`, `volume_destroy` when an import fails) and NBD clients.
//!
//! An import: probe the file (`qemu-img info`, and `qemu-img check` for qcow2),
//! create the volume NAME as `volume create` does, sized to the image's virtual
//! size rounded up to the block size, copy with `qemu-img convert -n
//! --target-is-zero` (the volume is new, so zeros are skipped and stay holes),
//! take the snapshot NAME@image, read it back over NBD in process (`bulwark_nbd::reader`)
//! to hash its first virtual-size bytes (sha256), and record that in
//! `DIR/images/NAME.json` (tmp + rename, mode 0600). A failure after the volume
//! was created destroys it, snapshot and all, so a failed import leaves nothing.
//!
//! The sha256 is that of the image's virtual disk, as `qemu-img convert -O raw`
//! writes it: for a raw file whose size is a multiple of 512, `sha256sum FILE`.
//! Its cost is SHA-256's own over the whole virtual size (~2 GB/s with SHA-NI,
//! one core: SHA-256 is sequential and has no shortcut for zeros): runs that
//! block status reports as zeros are hashed from a static buffer of zeros, not
//! read; a thread reads the data runs ahead of the hash. `--no-digest` skips the
//! read-back and records `sha256: null`; nothing checks an image against its
//! record today, so a record without one only shows `-` in `image list`.

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::fs;
use std::io::{ErrorKind, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bulwark_engine::pool::SnapshotStatus;
use bulwark_engine::size::format_size;
use bulwark_nbd::reader::{NbdReader, READ_BYTES_MAX};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::cli::{ImageCommand, ImageExportArgs, ImageFormat, ImageImportArgs, ListArgs};
use crate::client::{self, print, print_json, Client};
use crate::control::{KeyStatus, Request, StatusReport, VolumeEntry};
use crate::display::{self, Align, Table};
use crate::error::{Error, Result};
use crate::snapshot;

/// The snapshot an import leaves: NAME@image.
pub const IMAGE_SNAPSHOT: &str = "image";
/// Folder of the import records inside the pool directory.
pub const IMAGES_DIR: &str = "images";
/// Hex digits of the sha256 shown in `image list`'s table.
const SHA_SHOWN: usize = 16;
/// Tries at destroying a failed import's volume, a second apart: a client
/// that has just exited may still be counted as attached for a moment.
const UNDO_TRIES: u32 = 5;

/// What `image import` records in `DIR/images/NAME.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRecord {
    /// The volume; the image is its snapshot NAME@image.
    pub name: String,
    /// The source's format: raw or qcow2.
    pub format: String,
    /// The file imported, as an absolute path.
    pub source: PathBuf,
    /// The image's virtual size in bytes (the volume may be larger, up to the next block).
    pub virtual_size: u64,
    /// sha256 of the first `virtual_size` bytes of NAME@image, hex; none (JSON null)
    /// when imported with `--no-digest`.
    pub sha256: Option<String>,
    pub imported_unix: u64,
}

/// One row of `image list --json`: the record, and whether NAME@image is still there.
#[derive(Debug, Serialize)]
struct ImageEntry {
    #[serde(flatten)]
    record: ImageRecord,
    present: bool,
}

pub fn command(dir: &Path, command: &ImageCommand) -> Result<()> {
    match command {
        ImageCommand::Import(a) => import(dir, a),
        ImageCommand::Export(a) => export(dir, a),
        ImageCommand::List(a) => list(dir, a),
        ImageCommand::Forget(a) => forget(dir, &a.name),
    }
}

// ---------------------------------------------------------------------------
// import

fn import(dir: &Path, args: &ImageImportArgs) -> Result<()> {
    // Usage first: a missing key is a mistake of the command line, before any tool runs.
    args.settings.secret_for_encryption()?;
    require_tool("qemu-img", "qemu-utils")?;
    let source = image_path(&args.file)?;
    let shown = args.file.display().to_string();
    // The daemon and the name before the image: both are quick to ask, a check is not.
    let mut client = Client::connect(dir)?;
    let socket = nbd_socket(&mut client)?;
    let volumes: Vec<VolumeEntry> = client.call_typed(&Request::VolumeList)?;
    if volumes.iter().any(|v| v.volume.name == args.name) {
        return Err(Error::msg(format!(
            "cannot import {shown} as {}: volume '{}' already exists",
            args.name, args.name
        )));
    }
    let info = probe(&source, &shown, args.format)?;
    if args.format.is_none() {
        named_as_it_is(&source, &shown, &info.format)?;
    }
    if info.format == "qcow2" {
        check_qcow2(&source, &shown)?;
    }
    if info.virtual_size == 0 {
        return Err(Error::msg(format!(
            "{shown} is empty: there is nothing to import"
        )));
    }
    let block = u64::from(args.settings.block_size);
    let size_bytes = info
        .virtual_size
        .checked_next_multiple_of(block)
        .ok_or_else(|| Error::msg(format!("{shown} is too large to import")))?;
    let request = client::volume_create_request(&args.name, size_bytes, &args.settings)?;

    catch_interrupts();
    // A new connection: the first one sat idle while qemu-img looked at the image.
    drop(client);
    Client::connect(dir)?
        .call(&request)
        .map_err(|e| Error::msg(format!("cannot import {shown} as {}: {e}", args.name)))?;

    // The volume is ours from here: any failure destroys it again.
    let copied = copy_in(dir, &socket, &source, &info, args, size_bytes);
    let record = match copied {
        Ok(record) => record,
        Err(e) => {
            let undo = match destroy_volume(dir, &args.name) {
                Ok(()) => format!("volume {} destroyed, nothing was imported", args.name),
                Err(d) => format!(
                    "volume {} could not be destroyed ({d}): destroy it with \
                     'bulwark volume destroy -r {}'",
                    args.name, args.name
                ),
            };
            return Err(Error::msg(format!(
                "import of {shown} as {} failed: {e}; {undo}",
                args.name
            )));
        }
    };
    let digest = match &record.sha256 {
        Some(hex) => format!("sha256 {hex}"),
        None => "no sha256 recorded (--no-digest)".to_string(),
    };
    print(&format!(
        "imported {shown} as {}@{IMAGE_SNAPSHOT}: {}, {digest}\n",
        args.name,
        format_size(record.virtual_size),
    ))
}

/// The steps after the volume exists: copy, snapshot, hash, record.
fn copy_in(
    dir: &Path,
    socket: &Path,
    source: &Path,
    info: &ImageInfo,
    args: &ImageImportArgs,
    size_bytes: u64,
) -> Result<ImageRecord> {
    check_interrupted()?;
    let target = nbd_uri(socket, &args.name);
    let mut convert = Command::new("qemu-img");
    convert.arg("convert").arg("-n").arg("--target-is-zero");
    let progress = std::io::IsTerminal::is_terminal(&std::io::stdout());
    if progress {
        convert.arg("-p");
    }
    convert
        .args(["-f", &info.format, "-O", "raw"])
        .arg(source)
        .arg(&target);
    run_tool("qemu-img convert", &mut convert, progress)?;
    check_interrupted()?;

    let snap = format!("{}@{IMAGE_SNAPSHOT}", args.name);
    Client::connect(dir)?
        .call(&Request::SnapshotCreate {
            volume: args.name.clone(),
            snapshot: IMAGE_SNAPSHOT.to_string(),
        })
        .map_err(|e| Error::msg(format!("snapshot {snap}: {e}")))?;
    check_interrupted()?;

    let sha256 = if args.no_digest {
        None
    } else {
        Some(sha256_of_export(
            socket,
            &snap,
            info.virtual_size,
            size_bytes,
        )?)
    };
    check_interrupted()?;

    let record = ImageRecord {
        name: args.name.clone(),
        format: info.format.clone(),
        source: source.to_path_buf(),
        virtual_size: info.virtual_size,
        sha256,
        imported_unix: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    };
    write_record(dir, &record)?;
    Ok(record)
}

/// Destroys a failed import's volume with its snapshots.
fn destroy_volume(dir: &Path, name: &str) -> Result<()> {
    let mut last = None;
    for attempt in 0..UNDO_TRIES {
        if attempt > 0 {
            std::thread::sleep(Duration::from_secs(1));
        }
        let done = Client::connect(dir).and_then(|mut c| {
            c.call(&Request::VolumeDestroy {
                name: name.to_string(),
                recursive: true,
            })
        });
        match done {
            Ok(_) => return Ok(()),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("at least one try"))
}

/// What `qemu-img info` says of an image bulwark can import.
#[derive(Debug)]
struct ImageInfo {
    /// raw or qcow2.
    format: String,
    virtual_size: u64,
}

/// `qemu-img info`, and the refusals: formats other than raw and qcow2, backing
/// files, external data files, encrypted images.
fn probe(file: &Path, shown: &str, format: Option<ImageFormat>) -> Result<ImageInfo> {
    let mut cmd = Command::new("qemu-img");
    cmd.args(["info", "--output=json"]);
    if let Some(f) = format {
        cmd.args(["-f", f.as_str()]);
    }
    cmd.arg(file);
    let out = run_tool("qemu-img info", &mut cmd, false)
        .map_err(|e| Error::msg(format!("cannot read {shown} as a disk image: {e}")))?;
    image_info(&out, shown)
}

/// The format comes from the content (qemu-img's probe); a file whose name says qcow2
/// but whose content is not (a text file, a truncated download, a raw disk renamed) is
/// refused rather than imported as raw. `--format raw` imports it as raw on purpose.
fn named_as_it_is(file: &Path, shown: &str, format: &str) -> Result<()> {
    let ext = file
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase());
    if matches!(ext.as_deref(), Some("qcow2" | "qcow")) && format != "qcow2" {
        return Err(Error::msg(format!(
            "{shown} is named as a qcow2 image but its content is not qcow2 (no qcow2 \
             header; qemu-img reads it as {format}): not imported; pass --format raw to \
             import it as a raw disk"
        )));
    }
    Ok(())
}

/// The checks on `qemu-img info --output=json`'s answer.
fn image_info(json: &str, shown: &str) -> Result<ImageInfo> {
    let v: Value = serde_json::from_str(json)
        .map_err(|e| Error::msg(format!("qemu-img info on {shown}: unexpected output: {e}")))?;
    let format = v["format"].as_str().unwrap_or("unknown").to_string();
    if format != "raw" && format != "qcow2" {
        return Err(Error::msg(format!(
            "{shown} is a {format} image: bulwark imports raw and qcow2 images; convert it \
             first (qemu-img convert -O qcow2 {shown} OUT.qcow2)"
        )));
    }
    if let Some(backing) = v["backing-filename"].as_str() {
        return Err(Error::msg(format!(
            "{shown} has a backing file ({backing}): import one self-contained image; \
             flatten it first (qemu-img convert -O qcow2 {shown} OUT.qcow2)"
        )));
    }
    if let Some(data) = v["format-specific"]["data"]["data-file"].as_str() {
        return Err(Error::msg(format!(
            "{shown} keeps its data in an external file ({data}): flatten it first \
             (qemu-img convert -O qcow2 {shown} OUT.qcow2)"
        )));
    }
    if v["encrypted"].as_bool() == Some(true) {
        return Err(Error::msg(format!(
            "{shown} is an encrypted {format} image: decrypt it first with qemu-img convert"
        )));
    }
    let virtual_size = v["virtual-size"].as_u64().ok_or_else(|| {
        Error::msg(format!(
            "qemu-img info on {shown}: no virtual size in its answer"
        ))
    })?;
    Ok(ImageInfo {
        format,
        virtual_size,
    })
}

/// `qemu-img check` of a qcow2 image: refuses one with corruptions or that
/// cannot be checked (a truncated file reads as zeros where its clusters are
/// missing, so the copy alone would not notice). Leaked clusters are harmless.
fn check_qcow2(file: &Path, shown: &str) -> Result<()> {
    let out = Command::new("qemu-img")
        .args(["check", "--output=json", "-f", "qcow2"])
        .arg(file)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| tool_error("qemu-img", e))?;
    // 0: clean, 3: only leaks; 2: corruptions; 1 and others: the check could not finish.
    match out.status.code() {
        Some(0) | Some(3) => Ok(()),
        Some(2) => {
            let found = serde_json::from_slice::<Value>(&out.stdout)
                .ok()
                .and_then(|v| v["corruptions"].as_u64())
                .map(|n| format!("{n} corruption(s)"))
                .unwrap_or_else(|| "corruptions".to_string());
            Err(Error::msg(format!(
                "{shown} is a damaged qcow2 image: qemu-img check found {found}; not imported"
            )))
        }
        _ => Err(Error::msg(format!(
            "{shown} is a damaged qcow2 image: qemu-img check: {}; not imported",
            last_line(&out.stderr, out.status)
        ))),
    }
}

/// Zeros hashed in place of the runs block status says read as zeros.
static ZEROS: [u8; ZEROS_BYTES] = [0; ZEROS_BYTES];
const ZEROS_BYTES: usize = 256 << 10;
/// Without a terminal for the progress bar, a line says a hash of this size has begun
/// (about 2 s of SHA-256).
const SAY_HASHING_BYTES: u64 = 4 << 30;
/// Pieces read ahead of the hash: bounds the buffers in flight.
const PIECES_AHEAD: usize = 4;

/// The export's bytes in order: a buffer read, or a run of zeros not read.
enum Piece {
    Data(Vec<u8>),
    Zeros(u64),
}

/// Hashes the first `image_bytes` of export `export` (sha256); the rest, up to
/// `volume_bytes`, must be zeros (the block the volume rounded up to). A thread reads
/// the export (`NbdReader`) while this one hashes; the runs block status reports as
/// zeros are not read but hashed from a buffer of zeros, so the cost is the hash's own
/// (sha256 of the virtual size) plus reading the data.
fn sha256_of_export(
    socket: &Path,
    export: &str,
    image_bytes: u64,
    volume_bytes: u64,
) -> Result<String> {
    let failed = |e: std::io::Error| Error::msg(format!("reading the image back: {e}"));
    let reader = NbdReader::open(socket, export).map_err(failed)?;
    if reader.size_bytes() != volume_bytes {
        return Err(Error::msg(format!(
            "reading the image back: {export} has {} bytes, not {volume_bytes}",
            reader.size_bytes()
        )));
    }
    let (piece_tx, piece_rx) = mpsc::sync_channel(PIECES_AHEAD);
    let (spare_tx, spare_rx) = mpsc::channel();
    let thread = std::thread::spawn(move || read_pieces(reader, &piece_tx, &spare_rx));
    let hashed = hash_pieces(&piece_rx, &spare_tx, image_bytes, volume_bytes);
    // The reader stops at its next piece once nobody takes it; its connection closes
    // before the caller goes on (an import that failed destroys the volume next).
    drop(piece_rx);
    let _ = thread.join();
    hashed.map_err(|e| match e {
        HashError::Read(e) => failed(e),
        HashError::Other(e) => e,
    })
}

enum HashError {
    Read(std::io::Error),
    Other(Error),
}

/// The reader's side: runs in order, data read into recycled buffers.
fn read_pieces(
    mut reader: NbdReader,
    pieces: &mpsc::SyncSender<std::io::Result<Piece>>,
    spare: &mpsc::Receiver<Vec<u8>>,
) {
    let total = reader.size_bytes();
    let mut offset = 0u64;
    while offset < total {
        let runs = match reader.runs(offset) {
            Ok(e) => e,
            Err(e) => return drop(pieces.send(Err(e))),
        };
        for run in runs {
            let end = offset + run.length_bytes;
            if run.zero {
                if pieces.send(Ok(Piece::Zeros(run.length_bytes))).is_err() {
                    return;
                }
                offset = end;
                continue;
            }
            while offset < end {
                let n = (end - offset).min(READ_BYTES_MAX as u64) as usize;
                let mut buf = spare.try_recv().unwrap_or_default();
                buf.resize(n, 0);
                let piece = reader.read(offset, &mut buf).map(|()| Piece::Data(buf));
                let stop = piece.is_err();
                if pieces.send(piece).is_err() || stop {
                    return;
                }
                offset += n as u64;
            }
        }
    }
}

/// The hasher's side: every piece in order, with a progress bar on a terminal.
fn hash_pieces(
    pieces: &mpsc::Receiver<std::io::Result<Piece>>,
    spare: &mpsc::Sender<Vec<u8>>,
    image_bytes: u64,
    volume_bytes: u64,
) -> std::result::Result<String, HashError> {
    use ring::digest::{Context, SHA256};
    let bar = ProgressBar::new(volume_bytes).with_style(
        ProgressStyle::with_template(
            "sha256 [{bar:30}] {percent:>3}% {binary_bytes}/{binary_total_bytes} ({eta}; \
             --no-digest skips this)",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    if bar.is_hidden() && image_bytes >= SAY_HASHING_BYTES {
        // No terminal for the bar: one line, so a long hash is not a silent one.
        eprintln!(
            "hashing the {} virtual disk (sha256, ~2 GB/s; --no-digest skips it)",
            format_size(image_bytes)
        );
    }
    let mut ctx = Context::new(&SHA256);
    let mut seen = 0u64;
    let interrupted = || check_interrupted().map_err(HashError::Other);
    while seen < volume_bytes {
        interrupted()?;
        let Ok(piece) = pieces.recv() else { break };
        match piece.map_err(HashError::Read)? {
            Piece::Data(buf) => {
                let image_part = image_bytes.saturating_sub(seen).min(buf.len() as u64) as usize;
                ctx.update(&buf[..image_part]);
                if buf[image_part..].iter().any(|b| *b != 0) {
                    return Err(HashError::Other(Error::msg(
                        "reading the image back: the bytes past the image's end are not zeros",
                    )));
                }
                seen += buf.len() as u64;
                let _ = spare.send(buf);
            }
            Piece::Zeros(run) => {
                let end = seen + run;
                while seen < end {
                    let n = (end - seen).min(ZEROS_BYTES as u64);
                    let image_part = image_bytes.saturating_sub(seen).min(n) as usize;
                    ctx.update(&ZEROS[..image_part]);
                    seen += n;
                    if seen % (64 << 20) == 0 {
                        bar.set_position(seen);
                        interrupted()?;
                    }
                }
            }
        }
        bar.set_position(seen);
    }
    bar.finish_and_clear();
    if seen != volume_bytes {
        return Err(HashError::Other(Error::msg(format!(
            "reading the image back: got {seen} bytes of {volume_bytes}"
        ))));
    }
    Ok(hex(ctx.finish().as_ref()))
}

/// Writes `DIR/images/NAME.json` whole or not at all: a temporary file, mode
/// 0600, synced, renamed over the old record, the folder synced.
fn write_record(dir: &Path, record: &ImageRecord) -> Result<()> {
    let folder = dir.join(IMAGES_DIR);
    let failed = |what: &Path, e: std::io::Error| {
        Error::msg(format!(
            "cannot record the image in {}: {e}",
            what.display()
        ))
    };
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&folder)
        .map_err(|e| failed(&folder, e))?;
    let path = record_path(dir, &record.name);
    let tmp = folder.join(format!(".{}.json.tmp", record.name));
    let mut text = serde_json::to_string_pretty(record).expect("a record always serializes");
    text.push('\n');
    let written = (|| -> std::io::Result<()> {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        // A stale temporary file keeps its old mode through open: set it.
        f.set_permissions(fs::Permissions::from_mode(0o600))?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        fs::rename(&tmp, &path)?;
        fs::File::open(&folder)?.sync_all()
    })();
    written.map_err(|e| {
        let _ = fs::remove_file(&tmp);
        failed(&path, e)
    })
}

fn record_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(IMAGES_DIR).join(format!("{name}.json"))
}

/// The records in `DIR/images`, by name; files that do not read as one are
/// skipped with a warning on stderr.
fn read_records(dir: &Path) -> Result<Vec<ImageRecord>> {
    let folder = dir.join(IMAGES_DIR);
    let entries = match fs::read_dir(&folder) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::msg(format!("cannot read {}: {e}", folder.display()))),
    };
    let mut records = Vec::new();
    for entry in entries {
        let path = entry
            .map_err(|e| Error::msg(format!("cannot read {}: {e}", folder.display())))?
            .path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if name.starts_with('.') || path.extension() != Some(OsStr::new("json")) {
            continue;
        }
        let read = fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<ImageRecord>(&b).map_err(|e| e.to_string()));
        match read {
            Ok(r) => records.push(r),
            Err(e) => eprintln!("warning: skipping {}: {e}", path.display()),
        }
    }
    records.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(records)
}

// ---------------------------------------------------------------------------
// export

fn export(dir: &Path, args: &ImageExportArgs) -> Result<()> {
    let (volume, snap) = if args.source.contains('@') {
        let (v, s) = snapshot::split(&args.source)?;
        (v, Some(s))
    } else {
        (args.source.clone(), None)
    };
    require_tool("qemu-img", "qemu-utils")?;
    let mut client = Client::connect(dir)?;
    let socket = nbd_socket(&mut client)?;
    let volumes: Vec<VolumeEntry> = client.call_typed(&Request::VolumeList)?;
    let entry = volumes
        .iter()
        .find(|v| v.volume.name == volume)
        .ok_or_else(|| Error::msg(format!("no volume named {volume}")))?;
    if entry.key_status == KeyStatus::Unavailable {
        return Err(Error::msg(crate::control::locked_message(&entry.volume)));
    }
    if let Some(s) = &snap {
        let snaps: Vec<SnapshotStatus> = client.call_typed(&Request::SnapshotList {
            volume: Some(volume.clone()),
        })?;
        if !snaps.iter().any(|x| &x.snapshot == s) {
            return Err(Error::msg(format!("no snapshot {}", args.source)));
        }
    }
    // NAME@image of an import whose image ends before the volume's last block: the
    // image as imported, cut at its virtual size (a multiple of 512, as qemu needs).
    let cut = match &snap {
        Some(s) if s == IMAGE_SNAPSHOT => fs::read(record_path(dir, &volume))
            .ok()
            .and_then(|b| serde_json::from_slice::<ImageRecord>(&b).ok())
            .map(|r| r.virtual_size)
            .filter(|n| *n < entry.volume.size_bytes && n % 512 == 0 && *n > 0),
        _ => None,
    };
    let size = cut.unwrap_or(entry.volume.size_bytes);
    let source = match cut {
        None => nbd_uri(&socket, &args.source),
        Some(n) => format!(
            "json:{}",
            serde_json::json!({
                "driver": "raw",
                "size": n,
                "file": {
                    "driver": "nbd",
                    "server": { "type": "unix", "path": socket },
                    "export": args.source,
                },
            })
        ),
    };

    let shown = args.file.display().to_string();
    let file = std::path::absolute(&args.file)
        .map_err(|e| Error::msg(format!("cannot write {shown}: {e}")))?;
    // Created here, mode 0600 (qemu-img keeps the mode of a file it overwrites):
    // the image holds the volume's data in the clear.
    let created = match fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&file)
    {
        Ok(_) => true,
        Err(e) if e.kind() == ErrorKind::AlreadyExists && args.force => false,
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {
            return Err(Error::msg(format!(
                "{shown} exists: give --force to overwrite it"
            )))
        }
        Err(e) => return Err(Error::msg(format!("cannot write {shown}: {e}"))),
    };
    catch_interrupts();
    let progress = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let mut convert = Command::new("qemu-img");
    convert.arg("convert");
    if progress {
        convert.arg("-p");
    }
    convert.args(["-f", "raw", "-O", args.format.as_str()]);
    if args.format == ImageFormat::Raw {
        // Runs of 4 KiB of zeros become holes, even where the volume holds them as data.
        convert.args(["-S", "4k"]);
    }
    convert.arg(&source).arg(&file);
    let done =
        run_tool("qemu-img convert", &mut convert, progress).and_then(|_| check_interrupted());
    if let Err(e) = done {
        if created {
            let _ = fs::remove_file(&file);
        }
        return Err(Error::msg(format!(
            "export of {} to {shown} failed: {e}",
            args.source
        )));
    }
    print(&format!(
        "exported {} to {shown}: {}, {}\n",
        args.source,
        args.format.as_str(),
        format_size(size)
    ))
}

// ---------------------------------------------------------------------------
// list

fn list(dir: &Path, args: &ListArgs) -> Result<()> {
    let records = read_records(dir)?;
    let snaps: Vec<SnapshotStatus> =
        Client::connect(dir)?.call_typed(&Request::SnapshotList { volume: None })?;
    let present: BTreeSet<String> = snaps.into_iter().map(|s| s.name).collect();
    let entries: Vec<ImageEntry> = records
        .into_iter()
        .map(|record| ImageEntry {
            present: present.contains(&format!("{}@{IMAGE_SNAPSHOT}", record.name)),
            record,
        })
        .collect();
    if args.json {
        print_json(&entries)
    } else {
        print(&image_table(&entries))
    }
}

/// `image forget NAME`: drop the record of an image whose NAME@image is gone.
fn forget(dir: &Path, name: &str) -> Result<()> {
    if !read_records(dir)?.iter().any(|r| r.name == name) {
        return Err(Error::msg(format!(
            "no image named {name} ('bulwark image list' shows the images)"
        )));
    }
    let snaps: Vec<SnapshotStatus> =
        Client::connect(dir)?.call_typed(&Request::SnapshotList { volume: None })?;
    let snap = format!("{name}@{IMAGE_SNAPSHOT}");
    if snaps.iter().any(|s| s.name == snap) {
        return Err(Error::msg(format!(
            "{snap} still exists: its record is what 'image list' checks it against; destroy \
             the snapshot first ('bulwark snapshot destroy {snap}') to forget the image"
        )));
    }
    let path = record_path(dir, name);
    fs::remove_file(&path)
        .map_err(|e| Error::msg(format!("cannot remove {}: {e}", path.display())))?;
    if let Ok(d) = fs::File::open(dir.join(IMAGES_DIR)) {
        let _ = d.sync_all();
    }
    print(&format!("image {name} forgotten ({snap} was gone)\n"))
}

/// NAME SIZE FORMAT SHA256 IMPORTED SNAPSHOT; SNAPSHOT is NAME@image, or
/// `missing` when it is gone (destroyed, or the volume rolled back past it).
fn image_table(entries: &[ImageEntry]) -> String {
    if entries.is_empty() {
        return "no images\n".to_string();
    }
    use Align::*;
    let mut t = Table::new(&[
        ("NAME", Left),
        ("SIZE", Right),
        ("FORMAT", Left),
        ("SHA256", Left),
        ("IMPORTED", Left),
        ("SNAPSHOT", Left),
    ]);
    for e in entries {
        let r = &e.record;
        t.row(vec![
            r.name.clone(),
            format_size(r.virtual_size),
            r.format.clone(),
            match &r.sha256 {
                Some(hex) => hex.chars().take(SHA_SHOWN).collect(),
                None => "-".to_string(),
            },
            display::date(r.imported_unix),
            if e.present {
                format!("{}@{IMAGE_SNAPSHOT}", r.name)
            } else {
                "missing".to_string()
            },
        ]);
    }
    t.render("")
}

// ---------------------------------------------------------------------------
// tools, paths, signals

/// The daemon's NBD socket, from `status` (it may serve elsewhere than DIR/nbd.sock).
fn nbd_socket(client: &mut Client) -> Result<PathBuf> {
    let report: StatusReport = client.call_typed(&Request::Status)?;
    let socket = report.daemon.nbd_socket;
    if !socket.is_absolute() {
        return Err(Error::msg(format!(
            "the daemon serves NBD on the relative socket path {}: restart it with an \
             absolute --nbd-socket",
            socket.display()
        )));
    }
    Ok(socket)
}

/// `nbd+unix:///EXPORT?socket=PATH`, the path percent-encoded.
fn nbd_uri(socket: &Path, export: &str) -> String {
    format!(
        "nbd+unix:///{export}?socket={}",
        percent_encode(socket.as_os_str())
    )
}

fn percent_encode(s: &OsStr) -> String {
    let mut out = String::new();
    for &b in s.as_bytes() {
        if b.is_ascii_alphanumeric() || b"/-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The image to import as an absolute path (so qemu-img never reads a
/// `proto:` prefix into it), checked to be a file or a block device.
fn image_path(file: &Path) -> Result<PathBuf> {
    let shown = file.display();
    let path =
        fs::canonicalize(file).map_err(|e| Error::msg(format!("cannot read {shown}: {e}")))?;
    let meta = fs::metadata(&path).map_err(|e| Error::msg(format!("cannot read {shown}: {e}")))?;
    if !meta.is_file() && !meta.file_type().is_block_device() {
        return Err(Error::msg(format!(
            "{shown} is not a file or a block device"
        )));
    }
    Ok(path)
}

/// Fails, naming the package, when `tool` is not on PATH.
fn require_tool(tool: &str, package: &str) -> Result<()> {
    let found = std::env::var_os("PATH").is_some_and(|paths| {
        std::env::split_paths(&paths).any(|d| {
            fs::metadata(d.join(tool))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    });
    if found {
        Ok(())
    } else {
        Err(Error::msg(format!(
            "{tool} is not installed (on Debian and Ubuntu it is in the package {package})"
        )))
    }
}

fn tool_error(tool: &str, e: std::io::Error) -> Error {
    Error::msg(format!("cannot run {tool}: {e}"))
}

/// Runs a tool to its end, stdin closed, stderr captured for the error; stdout
/// is captured and returned, or left on the terminal (`show_stdout`: qemu-img's -p).
fn run_tool(what: &str, cmd: &mut Command, show_stdout: bool) -> Result<String> {
    cmd.stdin(Stdio::null()).stderr(Stdio::piped());
    cmd.stdout(if show_stdout {
        Stdio::inherit()
    } else {
        Stdio::piped()
    });
    let tool = cmd.get_program().to_string_lossy().into_owned();
    let out = cmd.output().map_err(|e| tool_error(&tool, e))?;
    if !out.status.success() && INTERRUPTED.load(Ordering::SeqCst) {
        return Err(Error::msg(format!("{what}: interrupted")));
    }
    if !out.status.success() {
        return Err(Error::msg(format!(
            "{what}: {}",
            last_line(&out.stderr, out.status)
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A tool's last line of complaint, without its `tool: ` prefix; or how it ended.
fn last_line(stderr: &[u8], status: ExitStatus) -> String {
    let text = String::from_utf8_lossy(stderr);
    let line = text.lines().map(str::trim).rfind(|l| !l.is_empty());
    match line {
        Some(l) => l
            .strip_prefix("qemu-img: ")
            .or_else(|| l.strip_prefix("nbdcopy: "))
            .unwrap_or(l)
            .to_string(),
        None => match (
            status.code(),
            std::os::unix::process::ExitStatusExt::signal(&status),
        ) {
            (Some(c), _) => format!("exit status {c}"),
            (None, Some(s)) => format!("killed by signal {s}"),
            _ => status.to_string(),
        },
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// From here on, Ctrl-C (and SIGTERM, SIGHUP) no longer ends this process at
/// once: the tool it runs (which gets the default action back at exec) dies of
/// it, and the command undoes what it did and says so.
fn catch_interrupts() {
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: a zeroed sigaction is valid; the handler only stores to an
        // atomic, which is async-signal-safe.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}

fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        Err(Error::msg("interrupted"))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_refusals() {
        let ok = image_info(r#"{"format":"qcow2","virtual-size":1048576}"#, "f").unwrap();
        assert_eq!((ok.format.as_str(), ok.virtual_size), ("qcow2", 1 << 20));
        for (json, says) in [
            (r#"{"format":"vmdk","virtual-size":1}"#, "is a vmdk image"),
            (
                r#"{"format":"qcow2","virtual-size":1,"backing-filename":"b.img"}"#,
                "backing file (b.img)",
            ),
            (
                r#"{"format":"qcow2","virtual-size":1,"format-specific":{"data":{"data-file":"d"}}}"#,
                "external file (d)",
            ),
            (
                r#"{"format":"qcow2","virtual-size":1,"encrypted":true}"#,
                "encrypted qcow2",
            ),
            (r#"{"format":"raw"}"#, "no virtual size"),
            ("not json", "unexpected output"),
        ] {
            let e = image_info(json, "f").unwrap_err().to_string();
            assert!(e.contains(says), "{json}: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn uris() {
        assert_eq!(
            nbd_uri(Path::new("/srv/pool/nbd.sock"), "vm1@image"),
            "nbd+unix:///vm1@image?socket=/srv/pool/nbd.sock"
        );
        assert_eq!(
            nbd_uri(Path::new("/a b/n&d.sock"), "v"),
            "nbd+unix:///v?socket=/a%20b/n%26d.sock"
        );
    }

    #[test]
    fn records_round_trip_and_list() {
        let dir = tempfile::tempdir().unwrap();
        let r = ImageRecord {
            name: "vm1".into(),
            format: "qcow2".into(),
            source: "/img/vm1.qcow2".into(),
            virtual_size: 2 << 30,
            sha256: Some("ab".repeat(32)),
            imported_unix: 1_700_000_000,
        };
        write_record(dir.path(), &r).unwrap();
        write_record(dir.path(), &r).unwrap();
        let path = record_path(dir.path(), "vm1");
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        fs::write(dir.path().join(IMAGES_DIR).join("junk.json"), "{").unwrap();
        assert_eq!(read_records(dir.path()).unwrap(), vec![r.clone()]);
        let table = image_table(&[ImageEntry {
            record: r,
            present: false,
        }]);
        assert!(table.contains("abababababababab  "), "{table}");
        assert!(table.contains("2G") && table.contains("missing"), "{table}");
        assert_eq!(read_records(&dir.path().join("none")).unwrap(), vec![]);
    }

    #[test]
    fn a_record_without_digest_reads_back_and_shows_a_dash() {
        let dir = tempfile::tempdir().unwrap();
        let r = ImageRecord {
            name: "nod".into(),
            format: "raw".into(),
            source: "/img/nod.img".into(),
            virtual_size: 1 << 20,
            sha256: None,
            imported_unix: 1_700_000_000,
        };
        write_record(dir.path(), &r).unwrap();
        let text = fs::read_to_string(record_path(dir.path(), "nod")).unwrap();
        assert!(text.contains("\"sha256\": null"), "{text}");
        assert_eq!(read_records(dir.path()).unwrap(), vec![r.clone()]);
        let table = image_table(&[ImageEntry {
            record: r,
            present: true,
        }]);
        let row = table.lines().nth(1).unwrap();
        assert_eq!(row.split_whitespace().nth(3), Some("-"), "{table}");
    }
}
