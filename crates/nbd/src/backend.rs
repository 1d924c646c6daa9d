//! What the server serves: the [`Backend`] a connection reads and writes,
//! and the [`Exports`] catalogue that names backends.
//!
//! These traits are the whole contract between the NBD layer and storage:
//! the server validates every request before calling a backend, so a
//! backend may assume `offset + length <= size()` and that it is never
//! asked to write when `read_only()` is true. Backends report failures as
//! NBD errno values ([`errno`]); anything outside the values the spec
//! allows is sent to the client as `EIO`.

use std::sync::Arc;

/// A Linux errno value as used on the NBD wire.
pub type Errno = i32;

/// The errno values the NBD protocol defines (its "Error values" section).
pub mod errno {
    use super::Errno;

    pub const EPERM: Errno = 1;
    pub const EIO: Errno = 5;
    pub const ENOMEM: Errno = 12;
    pub const EINVAL: Errno = 22;
    pub const ENOSPC: Errno = 28;
    pub const EOVERFLOW: Errno = 75;
    pub const ENOTSUP: Errno = 95;
    pub const ESHUTDOWN: Errno = 108;

    // Host errno values the spec asks servers to map onto the set above.
    const EFBIG: Errno = 27;
    const EROFS: Errno = 30;
    const EDQUOT: Errno = 122;

    /// Maps any backend errno onto a value the spec allows on the wire:
    /// `EDQUOT`/`EFBIG` become `ENOSPC` (as the spec asks), `EROFS` becomes
    /// `EPERM`, and anything unknown (including 0 or negative) becomes
    /// `EIO`.
    pub fn to_wire(e: Errno) -> u32 {
        let e = match e {
            EPERM | EIO | ENOMEM | EINVAL | ENOSPC | EOVERFLOW | ENOTSUP | ESHUTDOWN => e,
            EFBIG | EDQUOT => ENOSPC,
            EROFS => EPERM,
            _ => EIO,
        };
        e as u32
    }
}

/// Status of a run of bytes, as returned by [`Backend::block_status`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Bytes in this run.
    pub length: u64,
    /// Not allocated in the backing store (`NBD_STATE_HOLE`).
    pub hole: bool,
    /// Reads as zeroes (`NBD_STATE_ZERO`).
    pub zero: bool,
}

/// One exported disk.
///
/// Methods block; the server calls them on each connection's own threads
/// (and, to open an export, on tokio's blocking pool), several at once per
/// connection, from any number of connections. Every
/// call has already been validated: ranges lie within `size()`, lengths are
/// nonzero, and write methods are not called on a read-only backend.
pub trait Backend: Send + Sync + 'static {
    /// Size in bytes; fixed for the life of a connection.
    fn size(&self) -> u64;

    /// Block size below which I/O becomes read-modify-write (e.g. 4096).
    /// Sent to clients as the preferred block size, rounded up to a power
    /// of two of at least 512.
    fn preferred_block_size(&self) -> u32;

    /// Refuse writes, trims and zeroing (`EPERM`) and tell clients so.
    fn read_only(&self) -> bool {
        false
    }

    /// A flush on one connection covers writes acknowledged on every other
    /// connection to the same backend (advertised as `CAN_MULTI_CONN`).
    fn can_multi_conn(&self) -> bool {
        true
    }

    /// Whether [`write_zeroes`](Self::write_zeroes) with `may_trim` is
    /// faster than writing zeroes (e.g. it only updates metadata). When
    /// false, requests with `NBD_CMD_FLAG_FAST_ZERO` fail at once with
    /// `ENOTSUP`, which tells clients such as `qemu-img convert` to write
    /// the zeroes themselves.
    fn can_fast_zero(&self) -> bool {
        false
    }

    /// Fills `buf` with the bytes at `offset`.
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Errno>;

    /// Writes `data` at `offset`; durable before returning if `fua`.
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), Errno>;

    /// Makes every write acknowledged so far durable.
    fn flush(&self) -> Result<(), Errno>;

    /// Hints that the range is no longer needed; contents become undefined.
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<(), Errno>;

    /// Makes the range read as zeroes. With `may_trim` the range may be
    /// deallocated; without it, it must stay allocated (`NBD_CMD_FLAG_NO_HOLE`).
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        may_trim: bool,
    ) -> Result<(), Errno>;

    /// Describes `[offset, offset + length)` as consecutive extents starting
    /// at `offset`. May cover less than `length` (clients ask again for the
    /// rest) or more (the excess is cut off); must not be empty.
    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, Errno>;
}

/// Who a connection's client is, as established by its transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// The Unix socket: only the server's owner can connect to it.
    Owner,
    /// Plaintext TCP: nobody in particular.
    Anonymous,
    /// TLS with a client certificate that verified against the CA.
    Certificate {
        /// The subject's common name, if it has one.
        cn: Option<String>,
        /// SHA-256 of the DER certificate, lowercase hex.
        sha256: String,
    },
    /// TLS with a pre-shared key; the identity the client sent.
    Psk(String),
}

impl Identity {
    /// Every name this client answers to, as grants spell them:
    /// `owner`, `anonymous`, `cn:NAME`, `sha256:HEX`, `psk:IDENTITY`.
    pub fn names(&self) -> Vec<String> {
        match self {
            Identity::Owner => vec!["owner".into()],
            Identity::Anonymous => vec!["anonymous".into()],
            Identity::Certificate { cn, sha256 } => {
                let mut names = Vec::with_capacity(2);
                if let Some(cn) = cn {
                    names.push(format!("cn:{cn}"));
                }
                names.push(format!("sha256:{sha256}"));
                names
            }
            Identity::Psk(id) => vec![format!("psk:{id}")],
        }
    }

    /// The one name used in logs: the first of [`names`](Self::names).
    pub fn name(&self) -> String {
        self.names().swap_remove(0)
    }
}

/// A connected client: who it is and where it connects from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Client {
    pub identity: Identity,
    /// `IP:PORT` for TCP, `unix pid=... uid=...` for the Unix socket.
    pub peer: String,
    /// The peer's address, for per-address rate limiting (TCP only).
    pub ip: Option<std::net::IpAddr>,
}

/// What happened to a client, reported to [`Exports::event`] (for an audit
/// trail). Called from the blocking pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event<'a> {
    /// Entered the transmission phase on `export`.
    Attach { export: &'a str, read_only: bool },
    /// Left it; `reason` says why.
    Detach { export: &'a str, reason: &'a str },
    /// Asked for an export that [`Exports::open`] did not give it (unknown
    /// and forbidden names are reported alike).
    Denied { export: &'a str },
    /// Failed before choosing an export: TLS handshake failure, plaintext
    /// options on a TLS listener.
    HandshakeFailed { reason: &'a str },
}

/// The set of disks a server offers, by name, and who may see which.
///
/// Methods may block; the server calls them on the blocking pool.
pub trait Exports: Send + Sync + 'static {
    /// Names `client` may list (NBD_OPT_LIST).
    fn list(&self, client: &Client) -> Vec<String>;

    /// Opens an export by name for `client`; `None` if unknown, not
    /// available (e.g. locked) or not permitted to this client: the server
    /// answers all of these alike, so an implementation should do the same
    /// work on each path. The empty name is the client's "default export".
    fn open(&self, name: &str, client: &Client) -> Option<Arc<dyn Backend>>;

    /// Something worth an audit record happened to `client`.
    fn event(&self, client: &Client, event: Event<'_>) {
        let _ = (client, event);
    }
}

#[cfg(test)]
mod tests {
    use super::errno::*;

    #[test]
    fn errno_to_wire() {
        for e in [
            EPERM, EIO, ENOMEM, EINVAL, ENOSPC, EOVERFLOW, ENOTSUP, ESHUTDOWN,
        ] {
            assert_eq!(to_wire(e), e as u32);
        }
        assert_eq!(to_wire(122), ENOSPC as u32);
        assert_eq!(to_wire(27), ENOSPC as u32);
        assert_eq!(to_wire(30), EPERM as u32);
        assert_eq!(to_wire(0), EIO as u32);
        assert_eq!(to_wire(-1), EIO as u32);
        assert_eq!(to_wire(4), EIO as u32);
    }

    #[test]
    fn identity_names() {
        use super::Identity;
        let c = Identity::Certificate {
            cn: Some("alice".into()),
            sha256: "ab".into(),
        };
        assert_eq!(c.names(), ["cn:alice", "sha256:ab"]);
        assert_eq!(c.name(), "cn:alice");
        let c = Identity::Certificate {
            cn: None,
            sha256: "ab".into(),
        };
        assert_eq!(c.name(), "sha256:ab");
        assert_eq!(Identity::Psk("bob".into()).name(), "psk:bob");
        assert_eq!(Identity::Owner.name(), "owner");
        assert_eq!(Identity::Anonymous.name(), "anonymous");
    }
}
