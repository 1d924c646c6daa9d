//! A volume: a byte-addressed virtual disk over the block map.
//!
//! PUBLIC API SKELETON — bodies are being filled in.

use serde::{Deserialize, Serialize};

use crate::Result;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Compression {
    Off,
    Lz4,
}

impl std::str::FromStr for Compression {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "off" => Ok(Compression::Off),
            "lz4" => Ok(Compression::Lz4),
            _ => Err(crate::Error::Invalid(format!("invalid compression '{s}': expected off or lz4"))),
        }
    }
}

impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Compression::Off => "off",
            Compression::Lz4 => "lz4",
        })
    }
}

#[derive(Debug, Clone)]
pub struct VolumeOptions {
    pub size_bytes: u64,
    /// 4 KiB .. 128 KiB, a power of two.
    pub block_size: u32,
    pub compression: Compression,
    pub encryption: bool,
}

/// A run of bytes with one allocation state, for NBD block status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u64,
    /// Never written, trimmed or zeroed: reads as zeros and holds no space.
    pub hole: bool,
}

pub struct Volume {
    _p: (),
}

impl Volume {
    pub fn name(&self) -> &str {
        todo!()
    }
    pub fn size(&self) -> u64 {
        todo!()
    }
    pub fn block_size(&self) -> u32 {
        todo!()
    }
    /// Fill `buf` from `offset`. Every block read is verified; never returns wrong bytes.
    pub fn read(&self, _offset: u64, _buf: &mut [u8]) -> Result<()> {
        todo!()
    }
    /// Write `data` at `offset`; with `fua` it is durable when this returns.
    pub fn write(&self, _offset: u64, _data: &[u8], _fua: bool) -> Result<()> {
        todo!()
    }
    /// Make the range read as zeros (whole blocks are freed).
    pub fn write_zeroes(&self, _offset: u64, _length: u64, _fua: bool) -> Result<()> {
        todo!()
    }
    /// Discard the range: whole blocks are freed; partial blocks are left as they are.
    pub fn trim(&self, _offset: u64, _length: u64) -> Result<()> {
        todo!()
    }
    /// Everything written so far (by any connection) becomes durable.
    pub fn flush(&self) -> Result<()> {
        todo!()
    }
    /// Allocation map of `[offset, offset+length)` as consecutive extents.
    pub fn block_status(&self, _offset: u64, _length: u64) -> Result<Vec<Extent>> {
        todo!()
    }
}
