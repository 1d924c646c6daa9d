//! log layer (in progress).
