//! The CSI messages and services, generated at build time from `proto/csi.proto`
//! (CSI spec v1.13.0) by `build.rs`.

#![allow(clippy::all, missing_docs)]

tonic::include_proto!("csi.v1");
