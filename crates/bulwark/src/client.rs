//! The CLI side of every command: build a request, send it over the control
//! socket, print the answer.
//!
//! The `pool` commands (`pools`) are the exception: they run the engine
//! directly, since there is no daemon before there is a pool (nor after export). The CLI never opens a secret file: it
//! checks the path exists, makes it absolute and sends the path.

use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bulwark_engine::size::format_size;
use bulwark_engine::VolumeStatus;
use serde::de::DeserializeOwned;

use crate::cli::{
    KeyLoadArgs, NameArgs, SecretFile, SecretKind, StatusArgs, VolumeCreateArgs, VolumeSettingsArgs,
};
use crate::control::{self, Request, Response, SecretRef, StatusReport};
use crate::display;
use crate::error::{Error, Result};

/// How long the CLI waits for one answer; Argon2id and a commit fit well inside.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(300);

/// Guard a destructive command: `name` typed back at a terminal after `prompt`, or the
/// command refused (`not_terminal` without one: say `--yes`; `refused` on a mismatch).
pub fn confirm_by_typing(
    name: &str,
    not_terminal: &str,
    prompt: &str,
    refused: &str,
) -> Result<()> {
    use std::io::IsTerminal;
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Err(Error::usage(not_terminal.to_string()));
    }
    let mut stderr = std::io::stderr();
    let _ = write!(stderr, "{prompt}");
    let _ = stderr.flush();
    let mut answer = String::new();
    stdin
        .lock()
        .read_line(&mut answer)
        .map_err(|e| Error::msg(format!("cannot read the confirmation: {e}")))?;
    if answer.trim_end_matches(['\n', '\r']) != name {
        return Err(Error::msg(refused.to_string()));
    }
    Ok(())
}

/// The pool directory from `--pool` or `BULWARK_POOL`.
pub fn pool_dir(pool: Option<&Path>) -> Result<&Path> {
    pool.ok_or_else(|| Error::usage("no pool given: use --pool DIR or set BULWARK_POOL"))
}

/// One connection to a running daemon.
pub struct Client {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Client {
    pub fn connect(dir: &Path) -> Result<Client> {
        let path = control::control_socket_path(dir);
        let stream = UnixStream::connect(&path).map_err(|e| match e.kind() {
            ErrorKind::NotFound | ErrorKind::NotADirectory if dir.exists() && !dir.is_dir() => {
                Error::msg(format!(
                    "{} is not a pool directory but a file (give the directory the pool was \
                     created in, with --pool DIR or BULWARK_POOL, not one of its devices)",
                    dir.display()
                ))
            }
            ErrorKind::NotFound if !dir.is_dir() => Error::msg(format!(
                "no pool directory {} (give the directory the pool was created in, with \
                 --pool DIR or BULWARK_POOL)",
                dir.display()
            )),
            // No daemon: is there a pool at all (nothing, or one that lost its pool.json)?
            ErrorKind::NotFound | ErrorKind::ConnectionRefused => {
                match bulwark_engine::pool::Pool::check_dir(dir) {
                    Err(why) => Error::msg(why.to_string()),
                    Ok(()) => Error::msg(format!(
                        "cannot reach the bulwark daemon for pool {} (is 'bulwark serve {}' running?)",
                        dir.display(),
                        dir.display()
                    )),
                }
            }
            ErrorKind::PermissionDenied => Error::msg(format!(
                "permission denied on {}: run as the user that runs the daemon",
                path.display()
            )),
            _ => Error::msg(format!("cannot connect to {}: {e}", path.display())),
        })?;
        stream
            .set_read_timeout(Some(RESPONSE_TIMEOUT))
            .map_err(|e| Error::msg(format!("control socket: {e}")))?;
        let writer = stream
            .try_clone()
            .map_err(|e| Error::msg(format!("control socket: {e}")))?;
        Ok(Client {
            reader: BufReader::new(stream),
            writer,
        })
    }

    /// Send one request and return its result, or the daemon's error as ours.
    pub fn call(&mut self, request: &Request) -> Result<serde_json::Value> {
        match self.call_response(request)? {
            Response::Ok(v) => Ok(v),
            // The kind is for scripts on the socket; a person reads the message.
            Response::Err { message, .. } => Err(Error::msg(message)),
        }
    }

    /// Send one request and return the daemon's answer as it came, its error kind kept
    /// (for callers that act on it: the CSI driver).
    pub fn call_response(&mut self, request: &Request) -> Result<Response> {
        let mut line = serde_json::to_string(request).expect("a request always serializes");
        line.push('\n');
        let lost =
            |e: std::io::Error| Error::msg(format!("lost the connection to the daemon: {e}"));
        self.writer.write_all(line.as_bytes()).map_err(lost)?;
        let mut answer = String::new();
        let n = self.reader.read_line(&mut answer).map_err(lost)?;
        if n == 0 {
            return Err(Error::msg(
                "the daemon closed the connection without answering (is it shutting down?)",
            ));
        }
        Response::from_line(answer.trim_end()).map_err(Error::msg)
    }

    pub fn call_typed<T: DeserializeOwned>(&mut self, request: &Request) -> Result<T> {
        let v = self.call(request)?;
        serde_json::from_value(v)
            .map_err(|e| Error::msg(format!("unexpected answer from the daemon: {e}")))
    }
}

/// Print to stdout; a closed pipe (`bulwark volume list | head -1`) is not an error.
pub fn print(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(Error::msg(format!("cannot write to stdout: {e}"))),
    }
}

pub fn print_json<T: serde::Serialize>(value: &T) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value).expect("results always serialize");
    text.push('\n');
    print(&text)
}

/// The absolute, resolved path of a secret file, checked to exist but not read.
pub(crate) fn secret_ref(file: &SecretFile) -> Result<SecretRef> {
    let what = match file.kind {
        SecretKind::Passphrase => "passphrase file",
        SecretKind::Key => "key file",
    };
    let given = file.path.to_string_lossy();
    if given == "-"
        || given == "/dev/stdin"
        || given.starts_with("/dev/fd/")
        || given.starts_with("/proc/self/fd/")
    {
        // The daemon opens the file itself (so the secret never passes through
        // this command or its arguments): a pipe of this process is out of its reach.
        return Err(Error::msg(format!(
            "{what} {given}: the daemon reads {what}s itself, so standard input and pipes \
             cannot be used; write the secret to a file only you can read (umask 077) and give its path"
        )));
    }
    let path: PathBuf = std::fs::canonicalize(&file.path)
        .map_err(|e| Error::msg(format!("cannot use {what} {}: {e}", file.path.display())))?;
    if !path.is_file() {
        return Err(Error::msg(format!(
            "{what} {} is not a regular file",
            file.path.display()
        )));
    }
    Ok(match file.kind {
        SecretKind::Passphrase => SecretRef::PassphraseFile(path),
        SecretKind::Key => SecretRef::KeyFile(path),
    })
}

pub fn volume_create(dir: &Path, args: &VolumeCreateArgs) -> Result<()> {
    let mut request = volume_create_request(&args.name, args.size, &args.settings)?;
    if let Request::VolumeCreate { thick, .. } = &mut request {
        *thick = args.thick;
    }
    let mut client = Client::connect(dir)?;
    let created: VolumeStatus = client.call_typed(&request)?;
    print(&display::volume_created(&created))?;
    // A thin volume may promise more than the pool holds: say so, as a warning.
    if args.thick {
        return Ok(());
    }
    if let Ok(report) = client.call_typed::<StatusReport>(&Request::Status) {
        if let Some(line) = display::overcommit_line(&report.pool.space) {
            eprintln!(
                "warning: {line}: writes to thin volumes fail (ENOSPC) once the pool is full"
            );
        }
    }
    Ok(())
}

/// The `volume_create` request for a volume of `size_bytes` with these settings
/// (`volume create`, `image import`): the secret checked against `--encryption`
/// and made an absolute path, never read.
pub fn volume_create_request(
    name: &str,
    size_bytes: u64,
    settings: &VolumeSettingsArgs,
) -> Result<Request> {
    let secret = settings
        .secret_for_encryption()?
        .as_ref()
        .map(secret_ref)
        .transpose()?;
    Ok(Request::VolumeCreate {
        name: name.to_string(),
        size_bytes,
        block_size: settings.block_size,
        compression: settings.compression.as_str().to_string(),
        encryption: secret.is_some(),
        secret,
        thick: false,
    })
}

pub fn volume_destroy(dir: &Path, args: &NameArgs, recursive: bool) -> Result<()> {
    let answer = Client::connect(dir)?.call(&Request::VolumeDestroy {
        name: args.name.clone(),
        recursive,
    })?;
    let kept: Vec<bulwark_engine::pool::KeptSnapshot> = answer
        .get("kept")
        .and_then(|k| serde_json::from_value(k.clone()).ok())
        .unwrap_or_default();
    let mut out = format!("destroyed volume {}\n", args.name);
    for k in &kept {
        out.push_str(&format!(
            "kept {} ({} referenced) for its clones {}: freed when the last of them is \
             destroyed or made independent\n",
            k.snapshot,
            format_size(k.referenced_bytes),
            k.clones.join(", ")
        ));
    }
    print(&out)
}

pub fn key_load(dir: &Path, args: &KeyLoadArgs) -> Result<()> {
    let file = args.secret.file().expect("clap requires one secret source");
    let request = Request::KeyLoad {
        name: args.name.clone(),
        secret: secret_ref(&file)?,
    };
    Client::connect(dir)?.call(&request)?;
    print(&format!("key loaded: volume {} is unlocked\n", args.name))
}

pub fn key_unload(dir: &Path, args: &NameArgs) -> Result<()> {
    Client::connect(dir)?.call(&Request::KeyUnload {
        name: args.name.clone(),
    })?;
    print(&format!("key unloaded: volume {} is locked\n", args.name))
}

pub fn status(dir: &Path, args: &StatusArgs) -> Result<()> {
    let report: StatusReport = Client::connect(dir)?.call_typed(&Request::Status)?;
    if args.json {
        print_json(&report)
    } else {
        print(&display::status_text(&report))
    }
}
