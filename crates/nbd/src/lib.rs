//! `bulwark-nbd`: an NBD server (fixed newstyle, structured replies, block
//! status) over a [`Backend`] trait, and a small blocking client that reads
//! one export. It knows nothing of volumes, encryption or the engine; it
//! turns NBD requests into calls on a `Backend` and back.
//!
//! Data path: socket → `handshake` (options, export choice) → on a plain
//! Unix or TCP socket, `direct`: each of the connection's threads in turn
//! reads a request, runs it (`Backend` call) and writes its reply; on a TLS
//! stream, the `transmission` reader (parse, validate, admit) → the
//! connection's worker threads (`Backend` call) → `transmission` writer
//! (reply) → socket.
//!
//! Codemap:
//! - `backend.rs`: the [`Backend`] and [`Exports`] traits, [`Client`],
//!   [`Identity`], [`Event`], [`Extent`], [`errno`] values.
//! - `proto.rs`: wire constants and a pure, panic-free codec ([`proto`]).
//! - `handshake.rs`: option haggling until `NBD_OPT_GO`/`EXPORT_NAME`; its
//!   outcome, `Negotiated`, is what the transmission phase serves.
//! - `request.rs`: request parsing, validation, execution and reply
//!   building, shared by both transmission paths.
//! - `transmission.rs`: the async reader/writer used for TLS streams.
//! - `direct.rs`: the threaded transmission phase on plain sockets.
//! - `server.rs`: [`Server`], accept loops, shutdown, attachment counts.
//! - `limits.rs`: every bound on what a client can make us hold or wait on
//!   (connections, request and reply bytes, batches): [`ServerConfig`] and
//!   its clamped form, `Limits`.
//! - `tls.rs`: [`TlsConfig`] (X.509 directory or PSK file), TLS accept and
//!   the client's identity.
//! - `ratelimit.rs`: exponential back-off per address and identity.
//! - `reader.rs`: [`reader::NbdReader`], a blocking client that reads one
//!   export (block status, reads); `bulwark image import` hashes with it.
//! - `buffers.rs`: one shelf of payload buffers, kept for reuse by all
//!   connections.
//! - `workers.rs`: per-connection blocking threads that run backend calls
//!   (async path). Connection threads, on both paths, are threads of their
//!   own, never tokio's blocking pool.
//!
//! Module order, bottom-up: `limits`, `backend` → `proto`, `buffers`,
//! `ratelimit`, `workers`, `tls` → `handshake` → `request` →
//! `transmission`, `direct` → `server`; `reader` (the client) uses only
//! `proto`. A module uses only modules before
//! it: the table in `crates/bulwark/tests/layers.rs` makes
//! `cargo test -p bulwark` fail on any other import.
//!
//! Invariants:
//! - Bytes from a client are input: any sequence of them yields a reply or
//!   a closed connection, never a panic, unbounded allocation or a stall of
//!   another connection.
//! - Requests are validated once, at the edge; backends only see in-range,
//!   permitted, nonzero-length calls.
//! - The handshake is generic over `AsyncRead + AsyncWrite`; TLS (`tls.rs`,
//!   OpenSSL) is another stream, entered with `NBD_OPT_STARTTLS`. On a TLS
//!   listener nothing but STARTTLS and ABORT is answered before TLS. The
//!   transmission phase runs on blocking threads for plain Unix and TCP
//!   sockets (`direct.rs`) and on the async path for every other stream;
//!   both parse, validate and execute with the same functions.
//! - Every client has an [`Identity`] (owner, anonymous, certificate, PSK);
//!   [`Exports`] decides per identity what it lists and opens, and sees
//!   every attach, detach and refusal ([`Event`]). Failing TCP clients are
//!   slowed per address and identity (`ratelimit.rs`).
//!
//! Not implemented: `NBD_OPT_EXTENDED_HEADERS` (answered
//! `NBD_REP_ERR_UNSUP`), `NBD_CMD_CACHE` and `NBD_CMD_RESIZE` (`EINVAL`),
//! `NBD_REPLY_TYPE_OFFSET_HOLE` (reads always send data), metadata
//! contexts other than `base:allocation`.

mod backend;
mod buffers;
mod direct;
mod handshake;
pub mod limits;
pub mod proto;
mod ratelimit;
pub mod reader;
mod request;
mod server;
pub mod tls;
mod transmission;
mod workers;

pub use backend::{errno, Backend, Client, Errno, Event, Exports, Extent, Identity};
pub use limits::ServerConfig;
pub use server::Server;
pub use tls::{TlsConfig, TlsError, TlsMode};
