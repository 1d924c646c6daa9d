//! The engine's public errors: few, and each says what the caller should do.
//!
//! `errno()` maps each to the POSIX error an NBD client should see, so the
//! export layer needs no knowledge of engine internals.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The caller asked for something malformed (bad size, name, option).
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Exists(String),
    /// The volume's key is not loaded.
    #[error("volume '{0}' is locked: load its key with 'bulwark key load {0}'")]
    Locked(String),
    #[error("wrong key for volume '{0}': the passphrase or key file does not open any key slot")]
    WrongKey(String),
    /// The operation conflicts with current use (for example unloading a key while attached).
    #[error("{0}")]
    Busy(String),
    #[error(
        "access beyond the end of the volume: offset {offset} length {length}, volume size {size}"
    )]
    OutOfRange { offset: u64, length: u64, size: u64 },
    #[error("the pool is out of space")]
    NoSpace,
    /// A write to a volume set read-only (`volume set readonly=on`).
    #[error("{0}")]
    ReadOnly(String),
    /// No copy of a block verified: the data is lost (never returned wrong).
    #[error("unrecoverable block: {0}")]
    Unrecoverable(String),
    /// Bytes read from a device are not what bulwark wrote.
    #[error("corrupt: {0}")]
    Corrupt(String),
    #[error("{path}: {source}")]
    Device {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// A write or flush to every copy failed earlier: consistency cannot be promised
    /// until the pool is reopened.
    #[error("pool is poisoned after a failed write or flush; restart the daemon to re-import it")]
    Poisoned,
    /// Another host took the pool in its object store (`pool::tier`): this daemon must not
    /// write it again.
    #[error("{0}")]
    Fenced(String),
    /// The object store did not answer in time, or answered with errors: what needed it
    /// failed, and may be tried again.
    #[error("{0}")]
    StoreUnavailable(String),
}

impl Error {
    /// The errno an NBD client should see for this error.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Invalid(_) | Error::OutOfRange { .. } => libc::EINVAL,
            Error::NoSpace => libc::ENOSPC,
            Error::Locked(_) | Error::WrongKey(_) | Error::ReadOnly(_) => libc::EPERM,
            Error::NotFound(_) => libc::ENOENT,
            Error::Exists(_) => libc::EEXIST,
            Error::Busy(_) => libc::EBUSY,
            _ => libc::EIO,
        }
    }

    /// A `Corrupt` error with where it was found put in front (`what: message`); any
    /// other error as it is.
    pub(crate) fn within(self, what: impl std::fmt::Display) -> Self {
        match self {
            Error::Corrupt(m) => Error::Corrupt(format!("{what}: {m}")),
            e => e,
        }
    }

    pub(crate) fn device(path: &std::path::Path, source: std::io::Error) -> Self {
        Error::Device {
            path: path.to_path_buf(),
            source,
        }
    }
}
