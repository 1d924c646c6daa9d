//! map layer (in progress).
