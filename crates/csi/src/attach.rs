//! A volume as a block device on this node.
//!
//! Where the kernel's NBD client is loaded (`/sys/module/nbd`) and `nbd-client` is
//! installed, the export is connected to a free `/dev/nbdN`. Elsewhere, which is what
//! CI machines and many containers have, `nbdfuse` shows the export as one file in a
//! FUSE mount and `losetup` makes a loop device of that file. Either way the device
//! keeps the size the NBD handshake gave it: a volume grown while attached is seen at
//! the next attach (the plugin announces offline expansion for that reason).
//!
//! nbdfuse runs in a session of its own, so it outlives a restart of the plugin: the
//! mounts on the device stay up, and the next `NodeStageVolume` finds them whole.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::mount::{run, SysError, SysResult};

/// How long nbdfuse may take to show the export.
const FUSE_READY_WAIT: Duration = Duration::from_secs(30);

/// How a volume is attached; kept in the node's state file to detach it later.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "via", rename_all = "snake_case")]
pub enum Attachment {
    /// nbdfuse at `fuse_dir` (its pid) and the loop device over `fuse_dir/disk`.
    Fuse {
        fuse_dir: PathBuf,
        pid: u32,
        device: String,
    },
    /// The kernel's NBD client on `device`.
    Kernel { device: String },
}

impl Attachment {
    pub fn device(&self) -> &str {
        match self {
            Attachment::Fuse { device, .. } | Attachment::Kernel { device } => device,
        }
    }

    /// Whether the device still reads: the NBD connection is alive, so a mount on it
    /// works. False after the daemon or nbdfuse went away (a reboot, a crash).
    pub fn healthy(&self) -> bool {
        if let Attachment::Fuse { fuse_dir, pid, .. } = self {
            // SAFETY: kill with signal 0 only checks that the process exists.
            if unsafe { libc::kill(*pid as libc::pid_t, 0) } != 0 {
                return false;
            }
            if backing_file(self.device()).as_deref() != Some(&fuse_dir.join("disk")) {
                return false;
            }
        }
        read_first_block(self.device())
    }
}

/// Connects export `volume` of the NBD server at `socket`.
pub fn attach(volume: &str, socket: &Path, fuse_root: &Path) -> SysResult<Attachment> {
    if Path::new("/sys/module/nbd").exists() && which("nbd-client") {
        return attach_kernel(volume, socket);
    }
    attach_fuse(volume, socket, fuse_root)
}

fn which(program: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
        .unwrap_or(false)
}

fn attach_kernel(volume: &str, socket: &Path) -> SysResult<Attachment> {
    // A free device: no size and no client pid.
    for n in 0..256 {
        let sys = PathBuf::from(format!("/sys/block/nbd{n}"));
        if !sys.exists() {
            break;
        }
        if sys.join("pid").exists()
            || std::fs::read_to_string(sys.join("size"))
                .map(|s| s.trim() != "0")
                .unwrap_or(true)
        {
            continue;
        }
        let device = format!("/dev/nbd{n}");
        let sock = socket.to_string_lossy();
        if run(
            "nbd-client",
            &["-unix", &sock, &device, "-N", volume, "-b", "4096"],
        )
        .is_ok()
        {
            return Ok(Attachment::Kernel { device });
        }
    }
    Err(SysError(
        "no free /dev/nbdN could be connected (nbd-client)".into(),
    ))
}

fn attach_fuse(volume: &str, socket: &Path, fuse_root: &Path) -> SysResult<Attachment> {
    let fuse_dir = fuse_root.join(volume);
    // A mount left by a crash would make the directory unusable.
    let _ = run("fusermount3", &["-u", "-z", &fuse_dir.to_string_lossy()]);
    std::fs::create_dir_all(&fuse_dir)
        .map_err(|e| SysError(format!("cannot make {}: {e}", fuse_dir.display())))?;
    let disk = fuse_dir.join("disk");
    let uri = format!("nbd+unix:///{volume}?socket={}", socket.display());
    let log_path = log_path_of(&fuse_dir);
    let log = std::fs::File::create(&log_path)
        .map_err(|e| SysError(format!("cannot make {}: {e}", log_path.display())))?;
    let mut cmd = Command::new("nbdfuse");
    cmd.arg(&disk)
        .arg(&uri)
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(|e| SysError(e.to_string()))?)
        .stderr(log);
    // SAFETY: setsid is async-signal-safe; it only detaches the child from our session,
    // so a restart of the plugin (or its process group's signal) leaves nbdfuse running.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| SysError(format!("cannot run nbdfuse: {e}")))?;
    let pid = child.id();
    let started = Instant::now();
    loop {
        if std::fs::metadata(&disk)
            .map(|m| m.len() > 0)
            .unwrap_or(false)
        {
            break;
        }
        if let Ok(Some(status)) = child.try_wait() {
            let said = std::fs::read_to_string(&log_path).unwrap_or_default();
            return Err(SysError(format!(
                "nbdfuse for volume {volume} exited ({status}): {}",
                said.trim()
            )));
        }
        if started.elapsed() > FUSE_READY_WAIT {
            stop_fuse(&fuse_dir, pid);
            return Err(SysError(format!(
                "nbdfuse did not show volume {volume} within {}s",
                FUSE_READY_WAIT.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // The child is not waited for: it lives on in its own session (a plugin restart
    // leaves it to init, which reaps it).
    std::mem::forget(child);
    let device = match run("losetup", &["--find", "--show", &disk.to_string_lossy()]) {
        Ok(out) => out.trim().to_string(),
        Err(e) => {
            stop_fuse(&fuse_dir, pid);
            return Err(e);
        }
    };
    Ok(Attachment::Fuse {
        fuse_dir,
        pid,
        device,
    })
}

/// Detaches; every step is tried, and what is already gone is not an error.
pub fn detach(a: &Attachment) -> SysResult<()> {
    match a {
        Attachment::Kernel { device } => run("nbd-client", &["-d", device]).map(drop),
        Attachment::Fuse {
            fuse_dir,
            pid,
            device,
        } => {
            let disk = fuse_dir.join("disk");
            if backing_file(device).as_deref() == Some(disk.as_path()) {
                run("losetup", &["-d", device])?;
            }
            stop_fuse(fuse_dir, *pid);
            Ok(())
        }
    }
}

/// Unmounts the FUSE directory (nbdfuse then exits) and waits for the process to go,
/// killing it after 10 s.
fn stop_fuse(fuse_dir: &Path, pid: u32) {
    let dir = fuse_dir.to_string_lossy();
    if run("fusermount3", &["-u", &dir]).is_err() {
        let _ = run("fusermount3", &["-u", "-z", &dir]);
    }
    let started = Instant::now();
    // SAFETY: signal 0 and SIGKILL to a pid we started; at worst it is gone already.
    loop {
        // Our own child (started by this run of the plugin) is reaped here, else it would
        // stay a zombie; one a restarted plugin left to init is reaped by init.
        // SAFETY: waitpid on one pid with WNOHANG; ECHILD when it is not our child.
        unsafe { libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), libc::WNOHANG) };
        if unsafe { libc::kill(pid as libc::pid_t, 0) } != 0 || !is_nbdfuse(pid) {
            break;
        }
        if started.elapsed() > Duration::from_secs(10) {
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = std::fs::remove_dir(fuse_dir);
    let _ = std::fs::remove_file(log_path_of(fuse_dir));
}

/// nbdfuse's output, beside its directory (`fuse/VOLUME.log`).
fn log_path_of(fuse_dir: &Path) -> PathBuf {
    PathBuf::from(format!("{}.log", fuse_dir.display()))
}

/// Whether `pid` is still an nbdfuse (a pid from a state file may have been reused).
fn is_nbdfuse(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| c.trim() == "nbdfuse")
        .unwrap_or(false)
}

/// The file behind loop device `device`, if it is one.
fn backing_file(device: &str) -> Option<PathBuf> {
    let name = Path::new(device)
        .file_name()?
        .to_string_lossy()
        .into_owned();
    let text = std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")).ok()?;
    Some(PathBuf::from(text.trim_end_matches('\n')))
}

/// Reads the first 4 KiB of `device` with O_DIRECT (the page cache would answer for a
/// dead connection).
fn read_first_block(device: &str) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(f) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(device)
    else {
        return false;
    };
    let layout = std::alloc::Layout::from_size_align(4096, 4096).expect("valid layout");
    // SAFETY: a 4096-aligned buffer of 4096 bytes, freed below; pread writes into it.
    unsafe {
        let buf = std::alloc::alloc(layout);
        if buf.is_null() {
            return false;
        }
        use std::os::fd::AsRawFd;
        let n = libc::pread(f.as_raw_fd(), buf.cast(), 4096, 0);
        std::alloc::dealloc(buf, layout);
        n == 4096
    }
}
