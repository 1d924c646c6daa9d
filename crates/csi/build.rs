//! Generates the CSI messages and services from `proto/csi.proto` in pure Rust:
//! protox parses it (no `protoc` on the build machine), tonic-prost-build writes
//! the prost messages and the tonic servers (clients too, for the tests).

fn main() {
    println!("cargo:rerun-if-changed=proto/csi.proto");
    let descriptors = protox::compile(["csi.proto"], ["proto"]).expect("proto/csi.proto parses");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Services we do not implement (GroupController, SnapshotMetadata) and
        // the optional RPCs answer UNIMPLEMENTED, as the spec asks.
        .generate_default_stubs(true)
        .compile_fds(descriptors)
        .expect("generate the CSI gRPC code");
}
