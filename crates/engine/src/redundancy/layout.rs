//! The layout of a pool: how many copies or shards of each record, on which devices.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// How copies are laid out across devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Layout {
    /// One copy; several devices are concatenated.
    Single,
    /// N copies, one on each of N devices.
    Mirror(u8),
    /// Reed–Solomon: each record striped over K data and M parity shards on K+M devices.
    Parity { k: u8, m: u8 },
}

impl Layout {
    /// Members that must be readable for every record to be read: one copy of a mirror,
    /// K shards of a parity stripe, and (for `single`, where devices are concatenated)
    /// every one of the `members`.
    pub fn members_needed(self, members: usize) -> usize {
        match self {
            Layout::Single => members,
            Layout::Mirror(_) => 1,
            Layout::Parity { k, .. } => k as usize,
        }
    }
}

impl std::str::FromStr for Layout {
    type Err = Error;
    fn from_str(s: &str) -> Result<Layout> {
        if s == "single" {
            return Ok(Layout::Single);
        }
        if let Some(n) = s.strip_prefix("mirror:") {
            let n: u8 = n.parse().map_err(|_| {
                Error::Invalid(format!(
                    "invalid layout '{s}': mirror:N needs N between 2 and 8"
                ))
            })?;
            if !(2..=8).contains(&n) {
                return Err(Error::Invalid(format!(
                    "invalid layout '{s}': mirror:N needs N between 2 and 8"
                )));
            }
            return Ok(Layout::Mirror(n));
        }
        if let Some(spec) = s.strip_prefix("parity:") {
            let bad = || {
                Error::Invalid(format!("invalid layout '{s}': parity:K+M needs K >= 1 data and M = 1..3 parity shards, K+M <= 16 (e.g. parity:4+2)"))
            };
            let (k, m) = spec.split_once('+').ok_or_else(bad)?;
            let (k, m): (u8, u8) = (k.parse().map_err(|_| bad())?, m.parse().map_err(|_| bad())?);
            if k == 0
                || !(1..=3).contains(&m)
                || k as usize + m as usize > crate::constants::DEVICES_MAX
            {
                return Err(bad());
            }
            return Ok(Layout::Parity { k, m });
        }
        Err(Error::Invalid(format!(
            "invalid layout '{s}': expected single, mirror:N or parity:K+M"
        )))
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Layout::Single => f.write_str("single"),
            Layout::Mirror(n) => write!(f, "mirror:{n}"),
            Layout::Parity { k, m } => write!(f, "parity:{k}+{m}"),
        }
    }
}
