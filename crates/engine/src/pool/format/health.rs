//! What the pool knows of its data's health, kept in the volume table with every commit:
//! the scrub's progress and cursor, and the byte ranges no copy could supply.

use serde::{Deserialize, Serialize};

/// Where a scrub stands (persisted in the volume table by these lowercase names; tables
/// written before these were an enum may hold "" for `None`).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ScrubPhase {
    #[default]
    #[serde(alias = "")]
    None,
    Scanning,
    Paused,
    Finished,
    Canceled,
    /// A resilver asked a running pass to stop at its next batch and start again.
    Restarting,
}

impl ScrubPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            ScrubPhase::None => "none",
            ScrubPhase::Scanning => "scanning",
            ScrubPhase::Paused => "paused",
            ScrubPhase::Finished => "finished",
            ScrubPhase::Canceled => "canceled",
            ScrubPhase::Restarting => "restarting",
        }
    }
}

/// What a scan is for: a scrub, or a resilver (a scrub started to rebuild one device's
/// copies).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ScanKind {
    #[default]
    #[serde(alias = "")]
    Scrub,
    Resilver,
}

impl ScanKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ScanKind::Scrub => "scrub",
            ScanKind::Resilver => "resilver",
        }
    }
}

/// What an unreadable range held.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum DataErrorKind {
    /// Client data blocks.
    Data,
    /// A map node: every block it covers.
    Map,
}

impl std::fmt::Display for DataErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DataErrorKind::Data => "data",
            DataErrorKind::Map => "map",
        })
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ScrubState {
    pub state: ScrubPhase,
    pub started_unix: u64,
    pub finished_unix: u64,
    /// Cursor: next volume id and logical block to scrub.
    pub volume_id: u64,
    pub lba: u64,
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub repaired: u64,
    pub unrecoverable: u64,
    /// Scrub number; an error entry seen by an older scrub and not again is dropped at the end.
    pub epoch: u64,
    #[serde(default)]
    pub kind: ScanKind,
    /// The device being resilvered.
    #[serde(default)]
    pub device: Option<std::path::PathBuf>,
    /// `scrub start --verify-store`: the object store's copies of records still held
    /// locally are checked too (`StoreCheck`).
    #[serde(default)]
    pub verify_store: bool,
    #[serde(default)]
    pub store: StoreCheck,
}

/// What a scrub with `--verify-store` found of the object store's copies of records the
/// local devices hold (those only the store holds are checked by every scrub).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct StoreCheck {
    /// Records whose copy in the store verified.
    pub verified: u64,
    /// Records whose copy in the store did not verify, or whose object was gone.
    pub bad: u64,
    /// Of those, records written again from their verified local copy (moved to a new
    /// place, which the next commit uploads): the bad copy is referenced no more.
    pub rewritten: u64,
}

/// A byte range of a volume that no copy could supply.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DataError {
    pub volume: String,
    pub offset: u64,
    pub length: u64,
    pub kind: DataErrorKind,
    #[serde(default)]
    pub seen_epoch: u64,
}

/// What `status` shows of a scrub.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ScrubStatus {
    pub state: String,
    /// "scrub" or "resilver".
    pub kind: String,
    pub device: Option<std::path::PathBuf>,
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub rate_bytes_per_sec: u64,
    pub eta_seconds: Option<u64>,
    pub repaired: u64,
    pub unrecoverable: u64,
    pub started_unix: u64,
    pub finished_unix: u64,
    /// The object store's copies checked (`scrub start --verify-store`); `None`: not asked.
    #[serde(default)]
    pub store: Option<StoreCheck>,
}
