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
