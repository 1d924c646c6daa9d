//! File systems and mounts on the node: format a device when it holds none, mount,
//! bind-mount, unmount, find mount points, sizes and usage, grow a file system.
//!
//! Everything runs the system's own tools (`mkfs.ext4`, `mkfs.xfs`, `blkid`,
//! `mount`, `umount`, `resize2fs`, `xfs_growfs`), as kubelet's mount-utils do, so an
//! administrator can replay any step by hand. Mount points are read from
//! `/proc/self/mountinfo`.

use std::path::Path;
use std::process::Command;

/// File systems the node formats; the first is the default (an empty `fs_type`).
pub const FS_TYPES: &[&str] = &["ext4", "xfs"];

/// A failed step, with the tool's own words.
#[derive(Debug)]
pub struct SysError(pub String);

impl std::fmt::Display for SysError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

pub type SysResult<T> = std::result::Result<T, SysError>;

/// Runs `program args`; its stdout, or an error with its stderr.
pub fn run(program: &str, args: &[&str]) -> SysResult<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| SysError(format!("cannot run {program}: {e}")))?;
    if !out.status.success() {
        return Err(SysError(format!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The file system on `device`, or `None` when `blkid` finds none.
pub fn fs_type(device: &str) -> SysResult<Option<String>> {
    let out = Command::new("blkid")
        .args(["-p", "-s", "TYPE", "-o", "value", device])
        .output()
        .map_err(|e| SysError(format!("cannot run blkid: {e}")))?;
    match out.status.code() {
        Some(0) => {
            let t = String::from_utf8_lossy(&out.stdout).trim().to_string();
            Ok((!t.is_empty()).then_some(t))
        }
        // 2: nothing recognised on the device.
        Some(2) => Ok(None),
        _ => Err(SysError(format!(
            "blkid {device} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))),
    }
}

/// Formats `device` as `fs` (ext4 or xfs). Discards are skipped: a new volume is all
/// holes already.
pub fn format(device: &str, fs: &str) -> SysResult<()> {
    match fs {
        "ext4" => run(
            "mkfs.ext4",
            &["-F", "-q", "-E", "nodiscard,lazy_itable_init=1", device],
        )?,
        "xfs" => run("mkfs.xfs", &["-f", "-q", "-K", device])?,
        other => return Err(SysError(format!("cannot format {other}"))),
    };
    Ok(())
}

/// `mount -t fs [-o options] source target`.
pub fn mount(source: &str, target: &Path, fs: Option<&str>, options: &[String]) -> SysResult<()> {
    let target = target.to_string_lossy();
    let mut args: Vec<&str> = Vec::new();
    if let Some(fs) = fs {
        args.extend(["-t", fs]);
    }
    let joined = options.join(",");
    if !options.is_empty() {
        args.extend(["-o", &joined]);
    }
    args.extend([source, &target]);
    run("mount", &args).map(drop)
}

/// A bind mount of `source` at `target`, read-only when asked (a second, remounting step:
/// a bind mount ignores `ro` at first).
pub fn bind(source: &Path, target: &Path, readonly: bool) -> SysResult<()> {
    let source = source.to_string_lossy();
    mount(&source, target, None, &["bind".to_string()])?;
    if readonly {
        mount(
            &source,
            target,
            None,
            &["bind".to_string(), "remount".to_string(), "ro".to_string()],
        )?;
    }
    Ok(())
}

/// Unmounts `target` if something is mounted there (every layer).
pub fn unmount(target: &Path) -> SysResult<()> {
    while is_mount_point(target)? {
        run("umount", &[&target.to_string_lossy()])?;
    }
    Ok(())
}

/// Whether `path` is a mount point now.
pub fn is_mount_point(path: &Path) -> SysResult<bool> {
    Ok(mount_source(path)?.is_some())
}

/// What is mounted at `path` (the source field of mountinfo), if anything.
pub fn mount_source(path: &Path) -> SysResult<Option<String>> {
    let want = match std::fs::canonicalize(path) {
        Ok(p) => p,
        Err(_) => return Ok(None),
    };
    let text = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| SysError(format!("cannot read /proc/self/mountinfo: {e}")))?;
    let mut found = None;
    for line in text.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        if fields.len() < 10 {
            continue;
        }
        if Path::new(&unescape(fields[4])) != want {
            continue;
        }
        // After the optional fields and "-": fs type, source. The last one listed is on top.
        if let Some(dash) = fields.iter().position(|f| *f == "-") {
            found = fields.get(dash + 2).map(|s| unescape(s));
        }
    }
    Ok(found)
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Bytes and inodes of the file system mounted at `path`: (total, available, used)
/// for each.
pub fn usage(path: &Path) -> SysResult<([u64; 3], [u64; 3])> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| SysError(format!("{}: NUL in path", path.display())))?;
    // SAFETY: `c` is a valid C string and `st` a properly sized out-parameter.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(SysError(format!(
            "statvfs {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        )));
    }
    let f = st.f_frsize as u64;
    let bytes = [
        st.f_blocks as u64 * f,
        st.f_bavail as u64 * f,
        (st.f_blocks as u64 - st.f_bfree as u64) * f,
    ];
    let inodes = [
        st.f_files as u64,
        st.f_favail as u64,
        st.f_files as u64 - st.f_ffree as u64,
    ];
    Ok((bytes, inodes))
}

/// Size in bytes of a block device (`/sys/class/block/NAME/size`, 512-byte sectors).
pub fn device_bytes(device: &str) -> SysResult<u64> {
    let name = Path::new(device)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let text = std::fs::read_to_string(format!("/sys/class/block/{name}/size"))
        .map_err(|e| SysError(format!("size of {device}: {e}")))?;
    text.trim()
        .parse::<u64>()
        .map(|s| s * 512)
        .map_err(|e| SysError(format!("size of {device}: {e}")))
}

/// Grows the file system on `device`, mounted at `mount_point`, to the device's size.
pub fn grow(device: &str, mount_point: &Path) -> SysResult<()> {
    match fs_type(device)?.as_deref() {
        Some("ext4") | Some("ext3") | Some("ext2") => run("resize2fs", &[device]).map(drop),
        Some("xfs") => run("xfs_growfs", &[&mount_point.to_string_lossy()]).map(drop),
        other => Err(SysError(format!(
            "cannot grow a file system of type {}",
            other.unwrap_or("none")
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_names_are_unescaped() {
        assert_eq!(unescape(r"/a\040b"), "/a b");
        assert_eq!(unescape(r"/x\134y"), r"/x\y");
        assert_eq!(unescape(r"/plain"), "/plain");
        assert_eq!(unescape(r"/end\04"), r"/end\04");
    }

    #[test]
    fn the_root_is_a_mount_point() {
        assert!(is_mount_point(Path::new("/")).unwrap());
        assert!(!is_mount_point(Path::new("/no/such/path")).unwrap());
    }
}
