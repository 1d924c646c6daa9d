//! codec layer (in progress).
