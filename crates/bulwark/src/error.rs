//! The binary's one error type: a message for the user and whether it was a usage mistake.
//!
//! Every failure ends as one line on stderr, `error: <message>`, and an exit
//! code: 2 for usage mistakes (as clap uses for its own), 1 for everything
//! else. Messages say what went wrong and, where there is one, what to do.

use std::fmt;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug)]
pub struct Error {
    message: String,
    usage: bool,
}

impl Error {
    /// A failure of the operation itself (exit code 1).
    pub fn msg(message: impl Into<String>) -> Error {
        Error {
            message: message.into(),
            usage: false,
        }
    }

    /// The command line asks for something that cannot be (exit code 2).
    pub fn usage(message: impl Into<String>) -> Error {
        Error {
            message: message.into(),
            usage: true,
        }
    }

    pub fn exit_code(&self) -> u8 {
        if self.usage {
            2
        } else {
            1
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

impl From<bulwark_engine::Error> for Error {
    fn from(e: bulwark_engine::Error) -> Error {
        Error::msg(e.to_string())
    }
}
