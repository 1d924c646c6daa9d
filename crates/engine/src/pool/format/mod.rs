//! What the pool keeps on its devices and in its directory, as bytes and files: the
//! superblock (labels), the volume table, the host's anchor, `pool.json`, and the health
//! records the table carries. Nothing here holds a running pool's state.

pub mod anchor;
pub mod config;
pub mod health;
pub mod labels;
pub mod superblock;
pub mod table;
