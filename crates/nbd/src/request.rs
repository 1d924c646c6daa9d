//! One request apart from the socket it came on: parsing and validation at
//! the edge ([`parse_request`], [`validate`]), running it on the backend
//! ([`execute`], on the caller's thread), and its reply ([`Outgoing`]).
//! Both transmission paths use these same functions: `direct.rs` on plain
//! sockets and `transmission.rs` (async) on TLS streams, so a request is
//! judged and answered the same way on either.
//!
//! Invariants:
//! - Requests are validated here, once, at the edge; a backend never sees
//!   an out-of-range, zero-length or read-only-violating call.
//! - Every validated request produces exactly one reply (one simple reply,
//!   or structured chunks ending in `NBD_REPLY_FLAG_DONE`); a panicking
//!   backend yields `EIO`, not a dead server.

use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};

use tokio::sync::OwnedSemaphorePermit;
use tracing::{debug, error, warn};

use crate::backend::{errno, Errno, Extent};
use crate::buffers::BufPool;
use crate::handshake::Negotiated;
use crate::limits::BLOCK_STATUS_EXTENTS_MAX;
use crate::proto::*;

/// A request that passed validation. Ranges lie within the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Read {
        offset: u64,
        length: u32,
    },
    Write {
        offset: u64,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        length: u32,
        fua: bool,
    },
    WriteZeroes {
        offset: u64,
        length: u32,
        fua: bool,
        may_trim: bool,
    },
    BlockStatus {
        offset: u64,
        length: u32,
        req_one: bool,
    },
}

/// A request refused at the edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reject {
    pub errno: Errno,
    pub message: &'static str,
}

fn reject(errno: Errno, message: &'static str) -> Reject {
    Reject { errno, message }
}

/// Checks one request against what was negotiated. `NBD_CMD_DISC` and the
/// oversized-write case (which closes the connection) are handled by the
/// reader before this.
pub(crate) fn validate(req: &Request, ex: &Negotiated) -> Result<Op, Reject> {
    use errno::*;
    let flags = ex.flags;
    let advertised = |f: u16| flags & f != 0;
    let writes = matches!(req.kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    let allowed = match req.kind {
        CMD_READ if advertised(FLAG_SEND_DF) => CMD_FLAG_FUA | CMD_FLAG_DF,
        CMD_READ | CMD_WRITE | CMD_FLUSH | CMD_TRIM => CMD_FLAG_FUA,
        CMD_WRITE_ZEROES if advertised(FLAG_SEND_FAST_ZERO) => {
            CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO
        }
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
        CMD_BLOCK_STATUS => CMD_FLAG_FUA | CMD_FLAG_REQ_ONE,
        _ => return Err(reject(EINVAL, "unknown command")),
    };
    if writes && advertised(FLAG_READ_ONLY) {
        return Err(reject(EPERM, "export is read-only"));
    }
    if req.flags & !allowed != 0 {
        return Err(reject(EINVAL, "flag not valid for this command"));
    }
    let fua = req.flags & CMD_FLAG_FUA != 0;
    let (offset, length) = (req.offset, req.length);
    let in_bounds = offset
        .checked_add(u64::from(length))
        .is_some_and(|end| end <= ex.size);
    match req.kind {
        CMD_FLUSH => {
            if offset != 0 || length != 0 {
                return Err(reject(EINVAL, "flush offset and length must be zero"));
            }
            Ok(Op::Flush)
        }
        CMD_READ => {
            if !in_bounds {
                return Err(reject(EINVAL, "read beyond the end of the export"));
            }
            if length > ex.request_bytes_max {
                return Err(reject(EINVAL, "read larger than the maximum block size"));
            }
            Ok(Op::Read { offset, length })
        }
        CMD_WRITE => {
            if !in_bounds {
                return Err(reject(ENOSPC, "write beyond the end of the export"));
            }
            if length > ex.request_bytes_max {
                return Err(reject(EINVAL, "write larger than the maximum block size"));
            }
            Ok(Op::Write { offset, fua })
        }
        CMD_TRIM => {
            if !in_bounds {
                return Err(reject(EINVAL, "trim beyond the end of the export"));
            }
            Ok(Op::Trim {
                offset,
                length,
                fua,
            })
        }
        CMD_WRITE_ZEROES => {
            if !in_bounds {
                return Err(reject(ENOSPC, "write zeroes beyond the end of the export"));
            }
            let no_hole = req.flags & CMD_FLAG_NO_HOLE != 0;
            // A fast zero must fail fast when it cannot be fast: only a
            // backend that zeroes by deallocating qualifies, and NO_HOLE
            // forbids exactly that.
            if req.flags & CMD_FLAG_FAST_ZERO != 0 && (!ex.fast_zero || no_hole) {
                return Err(reject(ENOTSUP, "fast zero not supported"));
            }
            Ok(Op::WriteZeroes {
                offset,
                length,
                fua,
                may_trim: !no_hole,
            })
        }
        CMD_BLOCK_STATUS => {
            if ex.meta_context.is_none() {
                return Err(reject(EINVAL, "no metadata context negotiated"));
            }
            if length == 0 {
                return Err(reject(EINVAL, "block status of zero length"));
            }
            if !in_bounds {
                return Err(reject(EINVAL, "block status beyond the end of the export"));
            }
            Ok(Op::BlockStatus {
                offset,
                length,
                req_one: req.flags & CMD_FLAG_REQ_ONE != 0,
            })
        }
        // Unknown commands were rejected above.
        _ => Err(reject(EINVAL, "unknown command")),
    }
}

/// Turns backend extents into block-status descriptors for a request of
/// `length` bytes: zero-length extents dropped, neighbours with equal
/// status merged, the total cut to `length` (so every descriptor fits a
/// u32 and none reaches past the request), at most
/// `BLOCK_STATUS_EXTENTS_MAX` of them, exactly one with `req_one`. An empty
/// answer becomes one descriptor of status 0, which the spec says is
/// always safe.
pub(crate) fn descriptors(extents: &[Extent], length: u32, req_one: bool) -> Vec<Descriptor> {
    let mut out: Vec<Descriptor> = Vec::new();
    let mut remaining = u64::from(length);
    for e in extents {
        if remaining == 0 {
            break;
        }
        if e.length == 0 {
            continue;
        }
        let run = e.length.min(remaining);
        remaining -= run;
        // run <= remaining <= length, which is a u32.
        let run = run as u32;
        let flags = if e.hole { STATE_HOLE } else { 0 } | if e.zero { STATE_ZERO } else { 0 };
        let full = req_one || out.len() == BLOCK_STATUS_EXTENTS_MAX;
        match out.last_mut() {
            // The sum stays <= length, so no overflow.
            Some(last) if last.flags == flags => last.length += run,
            Some(_) if full => break,
            _ => out.push(Descriptor { length: run, flags }),
        }
    }
    if out.is_empty() {
        out.push(Descriptor { length, flags: 0 });
    }
    out
}

// ---- Replies -------------------------------------------------------------

/// Largest fixed part of a reply: chunk header plus read offset.
const HEAD_BYTES_MAX: usize = ChunkHeader::LEN + 8;

/// One finished reply, queued for the writer.
pub(crate) struct Outgoing {
    head: [u8; HEAD_BYTES_MAX],
    head_len: usize,
    body: Vec<u8>,
    /// The body came from the buffer pool and goes back to it.
    pooled: bool,
    /// Held until the reply is written (see module invariants).
    permits: Vec<OwnedSemaphorePermit>,
}

impl Outgoing {
    fn new(parts: &[&[u8]], body: Vec<u8>, pooled: bool) -> Self {
        let mut head = [0u8; HEAD_BYTES_MAX];
        let mut head_len = 0;
        for part in parts {
            head[head_len..head_len + part.len()].copy_from_slice(part);
            head_len += part.len();
        }
        Self {
            head,
            head_len,
            body,
            pooled,
            permits: Vec::new(),
        }
    }

    pub(crate) fn with_permits(mut self, permits: Vec<OwnedSemaphorePermit>) -> Self {
        self.permits = permits;
        self
    }

    pub(crate) fn head(&self) -> &[u8] {
        &self.head[..self.head_len]
    }

    pub(crate) fn body(&self) -> &[u8] {
        &self.body
    }

    /// The reply was sent (or dropped): its buffer goes back to the pool
    /// and its permits are released.
    pub(crate) fn done(self, pool: &BufPool) {
        if self.pooled {
            pool.give(self.body);
        }
    }
}

fn chunk(kind: u16, handle: u64, length: usize) -> [u8; ChunkHeader::LEN] {
    ChunkHeader {
        flags: REPLY_FLAG_DONE,
        kind,
        handle,
        // Payloads are bounded by REQUEST_BYTES_LIMIT + 8 or by the
        // descriptor cap, both far below 4 GiB.
        length: u32::try_from(length).unwrap_or(u32::MAX),
    }
    .encode()
}

pub(crate) fn reply_ok(handle: u64) -> Outgoing {
    // A simple reply is allowed for any payload-less success, even when
    // structured replies were negotiated (but never for READ).
    Outgoing::new(
        &[&SimpleReply { error: 0, handle }.encode()],
        Vec::new(),
        false,
    )
}

pub(crate) fn reply_error(handle: u64, structured: bool, error: Errno, message: &str) -> Outgoing {
    let error = errno::to_wire(error);
    if structured {
        let payload = error_chunk(error, message);
        let header = chunk(REPLY_TYPE_ERROR, handle, payload.len());
        let (fixed, text) = payload.split_at(6);
        Outgoing::new(&[&header, fixed], text.to_vec(), false)
    } else {
        Outgoing::new(
            &[&SimpleReply { error, handle }.encode()],
            Vec::new(),
            false,
        )
    }
}

/// A successful read. `data` is a pooled buffer holding exactly the bytes
/// read; it is sent as one `OFFSET_DATA` chunk (so `NBD_CMD_FLAG_DF` is
/// always honoured) or after a simple reply.
pub(crate) fn reply_read(handle: u64, structured: bool, offset: u64, data: Vec<u8>) -> Outgoing {
    match (structured, data.is_empty()) {
        (false, _) => Outgoing::new(&[&SimpleReply { error: 0, handle }.encode()], data, true),
        // OFFSET_DATA must carry at least one byte; a zero-length read
        // succeeds with a bare NONE chunk.
        (true, true) => Outgoing::new(&[&chunk(REPLY_TYPE_NONE, handle, 0)], data, true),
        (true, false) => {
            let header = chunk(REPLY_TYPE_OFFSET_DATA, handle, 8 + data.len());
            Outgoing::new(&[&header, &offset.to_be_bytes()], data, true)
        }
    }
}

pub(crate) fn reply_block_status(handle: u64, context_id: u32, d: &[Descriptor]) -> Outgoing {
    let payload = block_status_chunk(context_id, d);
    let header = chunk(REPLY_TYPE_BLOCK_STATUS, handle, payload.len());
    Outgoing::new(&[&header], payload, false)
}

// ---- Execution -----------------------------------------------------------

/// What every request task of one connection shares.
pub(crate) struct Shared {
    pub(crate) export: Negotiated,
    pub(crate) pool: BufPool,
}

/// Runs one validated request against the backend and builds its reply.
/// A panicking backend yields `EIO`, not a dead server.
pub(crate) fn execute(op: Op, handle: u64, data: Vec<u8>, shared: &Shared) -> Outgoing {
    let structured = shared.export.structured;
    match catch_unwind(AssertUnwindSafe(|| run_op(op, handle, data, shared))) {
        Ok(out) => out,
        Err(_) => {
            error!(?op, "backend panicked");
            reply_error(handle, structured, errno::EIO, "internal error")
        }
    }
}

fn run_op(op: Op, handle: u64, data: Vec<u8>, shared: &Shared) -> Outgoing {
    let ex = &shared.export;
    let backend = &*ex.backend;
    let structured = ex.structured;
    let done = |result: Result<(), Errno>| match result {
        Ok(()) => reply_ok(handle),
        Err(e) => {
            debug!(?op, errno = e, "backend error");
            reply_error(handle, structured, e, "backend error")
        }
    };
    match op {
        Op::Read { offset, length } => {
            let mut buf = shared.pool.take(length as usize);
            buf.resize(length as usize, 0);
            if length > 0 {
                if let Err(e) = backend.read(offset, &mut buf) {
                    debug!(?op, errno = e, "backend error");
                    shared.pool.give(buf);
                    return reply_error(handle, structured, e, "read failed");
                }
            }
            reply_read(handle, structured, offset, buf)
        }
        Op::Write { offset, fua } => {
            let result = if data.is_empty() {
                Ok(())
            } else {
                backend.write(offset, &data, fua)
            };
            shared.pool.give(data);
            done(result)
        }
        Op::Flush => done(backend.flush()),
        Op::Trim {
            offset,
            length,
            fua,
        } => done(match length {
            0 => Ok(()),
            _ => backend.trim(offset, u64::from(length), fua),
        }),
        Op::WriteZeroes {
            offset,
            length,
            fua,
            may_trim,
        } => done(match length {
            0 => Ok(()),
            _ => backend.write_zeroes(offset, u64::from(length), fua, may_trim),
        }),
        Op::BlockStatus {
            offset,
            length,
            req_one,
        } => {
            let Some(context_id) = ex.meta_context else {
                // `validate` requires a negotiated context.
                return reply_error(handle, structured, errno::EINVAL, "no metadata context");
            };
            match backend.block_status(offset, u64::from(length)) {
                Ok(extents) => {
                    if extents.iter().all(|e| e.length == 0) {
                        warn!(offset, length, "backend returned no extents");
                    }
                    let d = descriptors(&extents, length, req_one);
                    reply_block_status(handle, context_id, &d)
                }
                Err(e) => {
                    debug!(?op, errno = e, "backend error");
                    reply_error(handle, structured, e, "block status failed")
                }
            }
        }
    }
}

// ---- Request headers -----------------------------------------------------

/// Why a connection stopped reading requests.
#[derive(Debug)]
pub(crate) enum End {
    /// `NBD_CMD_DISC`.
    Disconnect,
    /// The client closed its side without `NBD_CMD_DISC`.
    Eof,
    /// `Server::shutdown` was called.
    Shutdown,
    /// The writer failed (the client went away).
    WriterGone,
    /// The client broke the protocol in a way that desynchronises the stream.
    Violation(String),
    Io(io::Error),
}

impl std::fmt::Display for End {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            End::Disconnect => write!(f, "client disconnected"),
            End::Eof => write!(f, "client closed the connection"),
            End::Shutdown => write!(f, "server shutting down"),
            End::WriterGone => write!(f, "could not send replies"),
            End::Violation(what) => write!(f, "protocol violation: {what}"),
            End::Io(e) => write!(f, "i/o error: {e}"),
        }
    }
}

/// Parses a request header and ends the connection on what cannot be
/// answered: `NBD_CMD_DISC`, a malformed header, or a write payload larger
/// than the advertised maximum (which we can neither trust nor skip).
pub(crate) fn parse_request(header: &[u8; Request::LEN], ex: &Negotiated) -> Result<Request, End> {
    let req = Request::parse(header).map_err(|e| End::Violation(e.to_string()))?;
    debug!(
        cmd = cmd_name(req.kind),
        handle = req.handle,
        flags = req.flags,
        offset = req.offset,
        length = req.length,
        "request"
    );
    if req.kind == CMD_DISC {
        return Err(End::Disconnect);
    }
    if req.kind == CMD_WRITE && req.length > ex.request_bytes_max {
        return Err(End::Violation(format!(
            "write of {} bytes exceeds the {}-byte maximum",
            req.length, ex.request_bytes_max
        )));
    }
    Ok(req)
}

/// The reply to a request that failed validation.
pub(crate) fn rejected(req: &Request, rej: &Reject, structured: bool) -> Outgoing {
    debug!(
        cmd = cmd_name(req.kind),
        handle = req.handle,
        errno = rej.errno,
        reason = rej.message,
        "request rejected"
    );
    reply_error(req.handle, structured, rej.errno, rej.message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Backend, Errno};
    use crate::handshake::transmission_flags;
    use errno::*;
    use std::sync::Arc;

    struct Null;
    impl Backend for Null {
        fn size(&self) -> u64 {
            1 << 20
        }
        fn preferred_block_size(&self) -> u32 {
            4096
        }
        fn read(&self, _: u64, _: &mut [u8]) -> Result<(), Errno> {
            Ok(())
        }
        fn write(&self, _: u64, _: &[u8], _: bool) -> Result<(), Errno> {
            Ok(())
        }
        fn flush(&self) -> Result<(), Errno> {
            Ok(())
        }
        fn trim(&self, _: u64, _: u64, _: bool) -> Result<(), Errno> {
            Ok(())
        }
        fn write_zeroes(&self, _: u64, _: u64, _: bool, _: bool) -> Result<(), Errno> {
            Ok(())
        }
        fn block_status(&self, _: u64, _: u64) -> Result<Vec<Extent>, Errno> {
            Ok(vec![])
        }
    }

    fn export(read_only: bool, structured: bool, meta: bool, fast_zero: bool) -> Negotiated {
        Negotiated {
            name: "t".into(),
            backend: Arc::new(Null),
            size: 1 << 20,
            flags: transmission_flags(read_only, true, structured),
            block_preferred: 4096,
            request_bytes_max: 64 << 10,
            fast_zero,
            structured,
            meta_context: meta.then_some(1),
        }
    }

    fn req(kind: u16, flags: u16, offset: u64, length: u32) -> Request {
        Request {
            flags,
            kind,
            handle: 1,
            offset,
            length,
        }
    }

    fn errno_of(r: Result<Op, Reject>) -> Errno {
        r.expect_err("should be rejected").errno
    }

    #[test]
    fn flags_advertised() {
        let f = transmission_flags(false, true, true);
        for bit in [
            FLAG_HAS_FLAGS,
            FLAG_SEND_FLUSH,
            FLAG_SEND_FUA,
            FLAG_SEND_TRIM,
            FLAG_SEND_WRITE_ZEROES,
            FLAG_SEND_FAST_ZERO,
            FLAG_SEND_DF,
            FLAG_CAN_MULTI_CONN,
        ] {
            assert_ne!(f & bit, 0, "{bit:#x}");
        }
        assert_eq!(f & FLAG_READ_ONLY, 0);
        let f = transmission_flags(true, false, false);
        assert_ne!(f & FLAG_READ_ONLY, 0);
        for bit in [
            FLAG_SEND_TRIM,
            FLAG_SEND_WRITE_ZEROES,
            FLAG_SEND_FAST_ZERO,
            FLAG_SEND_DF,
            FLAG_CAN_MULTI_CONN,
        ] {
            assert_eq!(f & bit, 0, "{bit:#x}");
        }
    }

    #[test]
    fn valid_requests() {
        let ex = export(false, true, true, true);
        assert_eq!(
            validate(&req(CMD_READ, CMD_FLAG_DF, 0, 4096), &ex),
            Ok(Op::Read {
                offset: 0,
                length: 4096
            })
        );
        assert_eq!(
            validate(&req(CMD_WRITE, CMD_FLAG_FUA, (1 << 20) - 512, 512), &ex),
            Ok(Op::Write {
                offset: (1 << 20) - 512,
                fua: true
            })
        );
        assert_eq!(validate(&req(CMD_FLUSH, 0, 0, 0), &ex), Ok(Op::Flush));
        assert_eq!(
            validate(&req(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 0, 1 << 20), &ex),
            Ok(Op::WriteZeroes {
                offset: 0,
                length: 1 << 20,
                fua: false,
                may_trim: false
            })
        );
        assert_eq!(
            validate(&req(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 0, 512), &ex),
            Ok(Op::WriteZeroes {
                offset: 0,
                length: 512,
                fua: false,
                may_trim: true
            })
        );
        assert_eq!(
            validate(&req(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 0, 1 << 20), &ex),
            Ok(Op::BlockStatus {
                offset: 0,
                length: 1 << 20,
                req_one: true
            })
        );
        // Zero lengths are accepted (and served without a backend call).
        assert!(validate(&req(CMD_READ, 0, 1 << 20, 0), &ex).is_ok());
        assert!(validate(&req(CMD_TRIM, 0, 0, 0), &ex).is_ok());
        // FUA is accepted on every command.
        assert!(validate(&req(CMD_READ, CMD_FLAG_FUA, 0, 1), &ex).is_ok());
        assert!(validate(&req(CMD_FLUSH, CMD_FLAG_FUA, 0, 0), &ex).is_ok());
    }

    #[test]
    fn rejected_requests() {
        let ex = export(false, false, false, false);
        assert_eq!(errno_of(validate(&req(CMD_CACHE, 0, 0, 1), &ex)), EINVAL);
        assert_eq!(errno_of(validate(&req(99, 0, 0, 1), &ex)), EINVAL);
        // Flags: unknown bits, DF without structured replies, REQ_ONE on read.
        assert_eq!(
            errno_of(validate(&req(CMD_READ, 1 << 9, 0, 1), &ex)),
            EINVAL
        );
        assert_eq!(
            errno_of(validate(&req(CMD_READ, CMD_FLAG_DF, 0, 1), &ex)),
            EINVAL
        );
        assert_eq!(
            errno_of(validate(&req(CMD_READ, CMD_FLAG_REQ_ONE, 0, 1), &ex)),
            EINVAL
        );
        assert_eq!(
            errno_of(validate(&req(CMD_WRITE, CMD_FLAG_NO_HOLE, 0, 1), &ex)),
            EINVAL
        );
        // Bounds: EINVAL for reads and trims, ENOSPC for writes.
        let size = 1u64 << 20;
        assert_eq!(errno_of(validate(&req(CMD_READ, 0, size, 1), &ex)), EINVAL);
        assert_eq!(
            errno_of(validate(&req(CMD_READ, 0, u64::MAX, 2), &ex)),
            EINVAL
        );
        assert_eq!(
            errno_of(validate(&req(CMD_TRIM, 0, size - 1, 2), &ex)),
            EINVAL
        );
        assert_eq!(errno_of(validate(&req(CMD_WRITE, 0, size, 1), &ex)), ENOSPC);
        assert_eq!(
            errno_of(validate(&req(CMD_WRITE, 0, u64::MAX, 1), &ex)),
            ENOSPC
        );
        assert_eq!(
            errno_of(validate(&req(CMD_WRITE_ZEROES, 0, size, 1), &ex)),
            ENOSPC
        );
        assert_eq!(
            errno_of(validate(&req(CMD_READ, 0, size + 1, 0), &ex)),
            EINVAL
        );
        // Length above the maximum block size.
        assert_eq!(
            errno_of(validate(&req(CMD_READ, 0, 0, (64 << 10) + 1), &ex)),
            EINVAL
        );
        // Flush with nonzero fields.
        assert_eq!(errno_of(validate(&req(CMD_FLUSH, 0, 1, 0), &ex)), EINVAL);
        // Block status without a context.
        assert_eq!(
            errno_of(validate(&req(CMD_BLOCK_STATUS, 0, 0, 1), &ex)),
            EINVAL
        );
        // Fast zero: unsupported backend, and NO_HOLE can never be fast.
        assert_eq!(
            errno_of(validate(
                &req(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 0, 1),
                &ex
            )),
            ENOTSUP
        );
        let fast = export(false, false, false, true);
        assert_eq!(
            errno_of(validate(
                &req(
                    CMD_WRITE_ZEROES,
                    CMD_FLAG_FAST_ZERO | CMD_FLAG_NO_HOLE,
                    0,
                    1
                ),
                &fast
            )),
            ENOTSUP
        );
        let meta = export(false, true, true, false);
        assert_eq!(
            errno_of(validate(&req(CMD_BLOCK_STATUS, 0, 0, 0), &meta)),
            EINVAL
        );
        assert_eq!(
            errno_of(validate(&req(CMD_BLOCK_STATUS, 0, size, 1), &meta)),
            EINVAL
        );
    }

    #[test]
    fn read_only_rejects_writes() {
        let ex = export(true, true, true, true);
        for kind in [CMD_WRITE, CMD_TRIM, CMD_WRITE_ZEROES] {
            assert_eq!(errno_of(validate(&req(kind, 0, 0, 1), &ex)), EPERM);
        }
        assert!(validate(&req(CMD_READ, 0, 0, 1), &ex).is_ok());
        assert!(validate(&req(CMD_FLUSH, 0, 0, 0), &ex).is_ok());
        // FAST_ZERO was not advertised on a read-only export.
        assert_eq!(
            errno_of(validate(
                &req(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 0, 1),
                &ex
            )),
            EPERM
        );
    }

    fn ext(length: u64, hole: bool, zero: bool) -> Extent {
        Extent { length, hole, zero }
    }

    fn d(length: u32, flags: u32) -> Descriptor {
        Descriptor { length, flags }
    }

    #[test]
    fn descriptors_coalesce_and_clip() {
        let hz = STATE_HOLE | STATE_ZERO;
        let e = [
            ext(4096, true, true),
            ext(0, false, false),
            ext(4096, true, true),
            ext(8192, false, false),
            ext(1 << 40, true, true),
        ];
        assert_eq!(
            descriptors(&e, 20000, false),
            vec![d(8192, hz), d(8192, 0), d(3616, hz)]
        );
        assert_eq!(descriptors(&e, 20000, true), vec![d(8192, hz)]);
        assert_eq!(descriptors(&e, 100, true), vec![d(100, hz)]);
        // A huge extent is clipped to the request, which fits a u32.
        assert_eq!(
            descriptors(&[ext(u64::MAX, false, true)], u32::MAX, false),
            vec![d(u32::MAX, STATE_ZERO)]
        );
        // Less than asked is fine.
        assert_eq!(descriptors(&e[..1], 20000, false), vec![d(4096, hz)]);
        // Nothing usable: one descriptor of status 0 for the whole range.
        assert_eq!(descriptors(&[], 512, false), vec![d(512, 0)]);
        assert_eq!(
            descriptors(&[ext(0, true, true)], 512, true),
            vec![d(512, 0)]
        );
    }

    #[test]
    fn descriptors_are_capped() {
        let many: Vec<Extent> = (0..BLOCK_STATUS_EXTENTS_MAX as u64 + 10)
            .map(|i| ext(1, i % 2 == 0, false))
            .collect();
        let out = descriptors(&many, u32::MAX, false);
        assert_eq!(out.len(), BLOCK_STATUS_EXTENTS_MAX);
    }

    #[test]
    fn reply_shapes() {
        let r = reply_ok(7);
        assert_eq!(
            SimpleReply::parse(r.head().try_into().unwrap()),
            Ok(SimpleReply {
                error: 0,
                handle: 7
            })
        );
        let r = reply_error(7, false, 1234, "x");
        assert_eq!(
            SimpleReply::parse(r.head().try_into().unwrap()),
            Ok(SimpleReply {
                error: EIO as u32,
                handle: 7
            })
        );
        assert!(r.body().is_empty());
        let r = reply_error(8, true, EINVAL, "bad");
        let h = ChunkHeader::parse(r.head()[..20].try_into().unwrap()).unwrap();
        assert_eq!(h.kind, REPLY_TYPE_ERROR);
        assert_eq!(h.flags, REPLY_FLAG_DONE);
        let mut payload = r.head()[20..].to_vec();
        payload.extend_from_slice(r.body());
        assert_eq!(h.length as usize, payload.len());
        assert_eq!(
            parse_error_chunk(&payload),
            Ok((EINVAL as u32, "bad".into()))
        );
        let r = reply_read(9, true, 4096, vec![1, 2, 3]);
        let h = ChunkHeader::parse(r.head()[..20].try_into().unwrap()).unwrap();
        assert_eq!((h.kind, h.length), (REPLY_TYPE_OFFSET_DATA, 11));
        assert_eq!(&r.head()[20..], &4096u64.to_be_bytes());
        assert_eq!(r.body(), &[1, 2, 3]);
        let r = reply_read(9, true, 0, vec![]);
        let h = ChunkHeader::parse(r.head().try_into().unwrap()).unwrap();
        assert_eq!(
            (h.kind, h.length, h.flags),
            (REPLY_TYPE_NONE, 0, REPLY_FLAG_DONE)
        );
        let r = reply_read(9, false, 0, vec![5; 10]);
        assert_eq!(r.head().len(), 16);
        assert_eq!(r.body().len(), 10);
        let r = reply_block_status(3, 1, &[d(512, STATE_HOLE)]);
        let h = ChunkHeader::parse(r.head().try_into().unwrap()).unwrap();
        assert_eq!((h.kind, h.length), (REPLY_TYPE_BLOCK_STATUS, 12));
        assert_eq!(
            parse_block_status_chunk(r.body()),
            Ok((1, vec![d(512, STATE_HOLE)]))
        );
    }
}
