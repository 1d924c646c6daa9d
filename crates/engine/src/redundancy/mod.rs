//! redundancy layer (in progress).
