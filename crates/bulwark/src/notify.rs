//! Service readiness for systemd's `Type=notify` (the `sd_notify` protocol).
//!
//! When the service manager sets `NOTIFY_SOCKET`, the daemon sends one
//! datagram per state change to that Unix socket: `STATUS=...` while it
//! imports, `READY=1` once the NBD and control sockets listen, `STOPPING=1`
//! when a signal starts the shutdown. A name starting with `@` is an
//! abstract socket (a leading NUL byte in the address). Without
//! `NOTIFY_SOCKET` every call does nothing, so `bulwark serve` run by hand
//! or by another supervisor behaves as before.
//!
//! The protocol is a handful of `KEY=value` lines in one datagram; std's
//! `UnixDatagram` is all it takes (no libsystemd, no crate).
//!
//! Socket activation (`sd_listen_fds`): a manager that holds the NBD socket
//! (`packaging/systemd/bulwark@.socket`) passes it as fd 3 with `LISTEN_FDS`
//! and `LISTEN_PID`. The daemon serves on it instead of binding its own, and
//! never removes it: across a restart or an upgrade the socket stays open in
//! the manager, so clients that connect meanwhile wait in its backlog and are
//! answered by the next daemon instead of failing.

use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// The environment variable systemd sets for `Type=notify` services.
pub const NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";

/// Sends `state` (newline-separated `KEY=value` assignments) to
/// `$NOTIFY_SOCKET`. `Ok(false)` when the variable is unset or empty: not
/// run under a manager that listens.
pub fn notify(state: &str) -> io::Result<bool> {
    match std::env::var_os(NOTIFY_SOCKET) {
        Some(path) if !path.is_empty() => {
            send_to(&path.to_string_lossy(), state)?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// One datagram to the socket named as `NOTIFY_SOCKET` names it: a path, or
/// `@name` for the abstract namespace.
pub fn send_to(socket: &str, state: &str) -> io::Result<()> {
    let addr = address(socket)?;
    let sock = UnixDatagram::unbound()?;
    let sent = sock.send_to_addr(state.as_bytes(), &addr)?;
    if sent != state.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            format!(
                "short datagram to {socket}: {sent} of {} bytes",
                state.len()
            ),
        ));
    }
    Ok(())
}

/// The environment variables of socket activation (sd_listen_fds(3)).
pub const LISTEN_FDS: &str = "LISTEN_FDS";
pub const LISTEN_PID: &str = "LISTEN_PID";
pub const LISTEN_FDNAMES: &str = "LISTEN_FDNAMES";
/// The first descriptor passed (`SD_LISTEN_FDS_START`).
const LISTEN_FDS_START: i32 = 3;
/// The most descriptors taken from a manager.
const LISTEN_FDS_MAX: i32 = 16;

/// Listening unix sockets passed by a service manager to this process: (name, listener).
/// Reads and removes `LISTEN_FDS`, `LISTEN_PID`, `LISTEN_FDNAMES` (so no child inherits
/// them); nothing unless `LISTEN_PID` is this process. Call once, before threads start
/// (it changes the environment). A passed descriptor that is not a unix stream socket is
/// closed and warned about.
pub fn listen_fds() -> Vec<(String, std::os::unix::net::UnixListener)> {
    use std::os::fd::FromRawFd;
    let pid = std::env::var(LISTEN_PID).ok();
    let fds = std::env::var(LISTEN_FDS).ok();
    let names = std::env::var(LISTEN_FDNAMES).unwrap_or_default();
    for k in [LISTEN_PID, LISTEN_FDS, LISTEN_FDNAMES] {
        // Called before any other thread exists (the caller says so).
        std::env::remove_var(k);
    }
    if pid.and_then(|p| p.parse::<u32>().ok()) != Some(std::process::id()) {
        return Vec::new();
    }
    let n = fds
        .and_then(|n| n.parse::<i32>().ok())
        .unwrap_or(0)
        .clamp(0, LISTEN_FDS_MAX);
    let names: Vec<&str> = names.split(':').collect();
    let mut out = Vec::new();
    for i in 0..n {
        let fd = LISTEN_FDS_START + i;
        // SAFETY: the manager passed fds 3..3+n to this process (LISTEN_PID is ours);
        // each is owned here from now on.
        let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        // SAFETY: fcntl on a descriptor we own.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        let listener = std::os::unix::net::UnixListener::from(owned);
        if listener.local_addr().is_err() {
            tracing::warn!("socket activation: descriptor {fd} is not a unix socket; ignored");
            continue;
        }
        let name = names.get(i as usize).copied().unwrap_or("").to_string();
        out.push((name, listener));
    }
    out
}

fn address(socket: &str) -> io::Result<SocketAddr> {
    match socket.strip_prefix('@') {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            SocketAddr::from_abstract_name(name.as_bytes())
        }
        None if socket.starts_with('/') => SocketAddr::from_pathname(socket),
        None => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{NOTIFY_SOCKET}={socket} is neither an absolute path nor @abstract"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_socket_gets_the_datagram() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        send_to(path.to_str().unwrap(), "READY=1\nSTATUS=serving").unwrap();
        let mut buf = [0u8; 64];
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=serving");
    }

    #[test]
    fn at_sign_means_abstract_namespace() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("bulwark-notify-test-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixDatagram::bind_addr(&addr).unwrap();
        send_to(&format!("@{name}"), "STOPPING=1").unwrap();
        let mut buf = [0u8; 64];
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
    }

    #[test]
    fn relative_names_are_refused() {
        assert!(send_to("notify.sock", "READY=1").is_err());
    }
}
