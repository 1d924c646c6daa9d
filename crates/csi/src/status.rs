//! Failures as gRPC status codes, the way the CSI spec's error tables name them.
//!
//! A wrong secret is `UNAUTHENTICATED` (the request's credentials do not open the
//! volume); a locked volume, one in use, or one whose snapshots or clones keep it from
//! a change is `FAILED_PRECONDITION`; a full pool `RESOURCE_EXHAUSTED`; a daemon that
//! cannot be reached `UNAVAILABLE` (the CO retries). Messages say what to do and never
//! hold a secret: they come from the daemon, which never puts one in a message.

use tonic::{Code, Status};

use crate::mount::SysError;
use crate::pool::{ErrorKind, PoolError};

impl From<PoolError> for Status {
    fn from(e: PoolError) -> Status {
        let code = match e.kind {
            ErrorKind::Invalid => Code::InvalidArgument,
            ErrorKind::NotFound => Code::NotFound,
            ErrorKind::Exists => Code::AlreadyExists,
            ErrorKind::Locked => Code::FailedPrecondition,
            ErrorKind::WrongKey => Code::Unauthenticated,
            ErrorKind::Busy => Code::FailedPrecondition,
            ErrorKind::NoSpace => Code::ResourceExhausted,
            ErrorKind::Unavailable => Code::Unavailable,
            ErrorKind::Other => Code::Internal,
        };
        Status::new(code, e.message)
    }
}

impl From<SysError> for Status {
    fn from(e: SysError) -> Status {
        Status::internal(e.0)
    }
}

pub fn invalid(message: impl Into<String>) -> Status {
    Status::invalid_argument(message)
}

/// A required field left empty.
pub fn required(field: &str) -> Status {
    Status::invalid_argument(format!("{field} is required"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_secret_is_unauthenticated_and_keeps_the_message() {
        let s = Status::from(PoolError::new(
            ErrorKind::WrongKey,
            "the secret opens no key slot of volume 'v'",
        ));
        assert_eq!(s.code(), Code::Unauthenticated);
        assert!(s.message().contains("volume 'v'"));
        assert_eq!(
            Status::from(PoolError::new(ErrorKind::Busy, "in use")).code(),
            Code::FailedPrecondition
        );
    }
}
