//! device layer (in progress).
