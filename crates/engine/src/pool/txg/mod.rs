//! Transaction groups: what makes the in-memory state durable. `commit` writes a new
//! generation (map nodes, the volume table, the superblock on every device); `intent` makes
//! a FLUSH durable between commits through the intent log; `logdev` adds and removes the
//! log devices a running pool uses.

pub mod commit;
pub mod intent;
pub mod logdev;
