//! Key wrapping (in progress).
