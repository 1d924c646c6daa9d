//! The intent log below `Core`: the block format and the chain a FLUSH appends to
//! (`block`), and the separate log devices that may hold it (`devices`). What a FLUSH does
//! with them is `txg::intent`; adding and removing log devices is `txg::logdev`.

pub mod block;
pub mod devices;
