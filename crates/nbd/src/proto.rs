//! NBD wire format: constants and a pure codec, with no I/O.
//!
//! Everything here follows the NetworkBlockDevice project's `doc/proto.md`
//! (fixed newstyle negotiation, structured replies, block status). All
//! integers on the wire are big-endian. Parsers take byte slices received
//! from an untrusted peer and return [`ProtoError`] on any malformed input;
//! they never panic and never allocate more than the input's length. The
//! client-side encoders and reply parsers exist for tests and tools, so that
//! every message has a round trip.

use thiserror::Error;

use crate::limits::STRING_BYTES_MAX;

// ---- Magic numbers -------------------------------------------------------

/// `NBDMAGIC`, first eight bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`, sent by the server after `NBDMAGIC` and by the client before
/// every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic opening every fixed-newstyle option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic opening every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic opening a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic opening a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// ---- Handshake flags (server, 16 bits) and client flags (32 bits) --------

pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// ---- Transmission flags (16 bits) ----------------------------------------

pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const FLAG_READ_ONLY: u16 = 1 << 1;
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const FLAG_SEND_FUA: u16 = 1 << 3;
pub const FLAG_ROTATIONAL: u16 = 1 << 4;
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const FLAG_SEND_DF: u16 = 1 << 7;
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const FLAG_SEND_RESIZE: u16 = 1 << 9;
pub const FLAG_SEND_CACHE: u16 = 1 << 10;
pub const FLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// ---- Options -------------------------------------------------------------

pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_PEEK_EXPORT: u32 = 4;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;
pub const OPT_EXTENDED_HEADERS: u32 = 11;

// ---- Option reply types --------------------------------------------------

pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
const REP_ERR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERR + 1;
pub const REP_ERR_POLICY: u32 = REP_ERR + 2;
pub const REP_ERR_INVALID: u32 = REP_ERR + 3;
pub const REP_ERR_PLATFORM: u32 = REP_ERR + 4;
pub const REP_ERR_TLS_REQD: u32 = REP_ERR + 5;
pub const REP_ERR_UNKNOWN: u32 = REP_ERR + 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_ERR + 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_ERR + 8;
pub const REP_ERR_TOO_BIG: u32 = REP_ERR + 9;

/// True for option reply types that denote an error (bit 31 set).
pub fn is_rep_error(reply: u32) -> bool {
    reply & REP_ERR != 0
}

// ---- NBD_INFO types (in NBD_REP_INFO replies) ----------------------------

pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// ---- Commands and command flags ------------------------------------------

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;
pub const CMD_RESIZE: u16 = 8;

pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

/// Human name of a command type, for logs.
pub fn cmd_name(kind: u16) -> &'static str {
    match kind {
        CMD_READ => "READ",
        CMD_WRITE => "WRITE",
        CMD_DISC => "DISC",
        CMD_FLUSH => "FLUSH",
        CMD_TRIM => "TRIM",
        CMD_CACHE => "CACHE",
        CMD_WRITE_ZEROES => "WRITE_ZEROES",
        CMD_BLOCK_STATUS => "BLOCK_STATUS",
        CMD_RESIZE => "RESIZE",
        _ => "UNKNOWN",
    }
}

/// Human name of an option, for logs.
pub fn opt_name(option: u32) -> &'static str {
    match option {
        OPT_EXPORT_NAME => "EXPORT_NAME",
        OPT_ABORT => "ABORT",
        OPT_LIST => "LIST",
        OPT_PEEK_EXPORT => "PEEK_EXPORT",
        OPT_STARTTLS => "STARTTLS",
        OPT_INFO => "INFO",
        OPT_GO => "GO",
        OPT_STRUCTURED_REPLY => "STRUCTURED_REPLY",
        OPT_LIST_META_CONTEXT => "LIST_META_CONTEXT",
        OPT_SET_META_CONTEXT => "SET_META_CONTEXT",
        OPT_EXTENDED_HEADERS => "EXTENDED_HEADERS",
        _ => "UNKNOWN",
    }
}

// ---- Structured replies --------------------------------------------------

pub const REPLY_FLAG_DONE: u16 = 1 << 0;

pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;

// ---- base:allocation ----------------------------------------------------

pub const META_BASE_ALLOCATION: &str = "base:allocation";
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

// ---- Fixed sizes ---------------------------------------------------------

/// Zero padding after an `NBD_OPT_EXPORT_NAME` reply without `NO_ZEROES`.
pub const EXPORT_NAME_PADDING: usize = 124;
/// Server greeting: NBDMAGIC, IHAVEOPT, handshake flags.
pub const GREETING_LEN: usize = 18;

// ---- Errors --------------------------------------------------------------

/// A message from the peer that does not follow the wire format.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ProtoError {
    #[error("bad magic {0:#x}")]
    BadMagic(u64),
    #[error("message truncated: {needed} more bytes needed")]
    Truncated { needed: usize },
    #[error("{0} unexpected trailing bytes")]
    Trailing(usize),
    #[error("string of {0} bytes exceeds the 4096-byte limit")]
    StringTooLong(usize),
    #[error("string is not valid UTF-8")]
    NotUtf8,
    #[error("string contains NUL")]
    Nul,
    #[error("length field {0} does not match the message")]
    BadLength(u32),
}

/// Bounds-checked big-endian reader over an untrusted byte slice.
struct Cursor<'a> {
    buf: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ProtoError> {
        if n > self.buf.len() {
            return Err(ProtoError::Truncated {
                needed: n - self.buf.len(),
            });
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], ProtoError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u16(&mut self) -> Result<u16, ProtoError> {
        self.array().map(u16::from_be_bytes)
    }

    fn u32(&mut self) -> Result<u32, ProtoError> {
        self.array().map(u32::from_be_bytes)
    }

    fn u64(&mut self) -> Result<u64, ProtoError> {
        self.array().map(u64::from_be_bytes)
    }

    fn remaining(&self) -> usize {
        self.buf.len()
    }

    fn finish(self) -> Result<(), ProtoError> {
        match self.buf.len() {
            0 => Ok(()),
            n => Err(ProtoError::Trailing(n)),
        }
    }
}

/// Decodes an NBD string: UTF-8, no NUL, at most 4096 bytes.
pub fn parse_string(bytes: &[u8]) -> Result<String, ProtoError> {
    if bytes.len() > STRING_BYTES_MAX {
        return Err(ProtoError::StringTooLong(bytes.len()));
    }
    if bytes.contains(&0) {
        return Err(ProtoError::Nul);
    }
    std::str::from_utf8(bytes)
        .map(str::to_owned)
        .map_err(|_| ProtoError::NotUtf8)
}

fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_be_bytes());
}
fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_be_bytes());
}
fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_be_bytes());
}
/// Appends a length-prefixed (u32) string.
fn put_str32(out: &mut Vec<u8>, s: &str) {
    put_u32(out, len32(s.len()));
    out.extend_from_slice(s.as_bytes());
}

/// Length as a wire u32. Callers only pass lengths bounded far below 4 GiB
/// (strings, option payloads, capped descriptor lists).
fn len32(n: usize) -> u32 {
    u32::try_from(n).expect("wire length bounded by limits.rs")
}

// ---- Handshake messages --------------------------------------------------

/// Server greeting: `NBDMAGIC`, `IHAVEOPT`, handshake flags.
pub fn greeting(handshake_flags: u16) -> [u8; GREETING_LEN] {
    let mut out = [0u8; GREETING_LEN];
    out[0..8].copy_from_slice(&NBD_MAGIC.to_be_bytes());
    out[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    out[16..18].copy_from_slice(&handshake_flags.to_be_bytes());
    out
}

/// Parses a server greeting (client side); returns the handshake flags.
pub fn parse_greeting(b: &[u8; GREETING_LEN]) -> Result<u16, ProtoError> {
    let mut c = Cursor::new(b);
    let magic = c.u64()?;
    if magic != NBD_MAGIC {
        return Err(ProtoError::BadMagic(magic));
    }
    let magic = c.u64()?;
    if magic != IHAVEOPT {
        return Err(ProtoError::BadMagic(magic));
    }
    c.u16()
}

/// Header of a client option: `IHAVEOPT`, option, payload length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub length: u32,
}

impl OptionHeader {
    pub const LEN: usize = 16;

    pub fn parse(b: &[u8; Self::LEN]) -> Result<Self, ProtoError> {
        let mut c = Cursor::new(b);
        let magic = c.u64()?;
        if magic != IHAVEOPT {
            return Err(ProtoError::BadMagic(magic));
        }
        Ok(Self {
            option: c.u32()?,
            length: c.u32()?,
        })
    }

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
        out[8..12].copy_from_slice(&self.option.to_be_bytes());
        out[12..16].copy_from_slice(&self.length.to_be_bytes());
        out
    }
}

/// Header of a fixed-newstyle option reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    pub option: u32,
    pub reply: u32,
    pub length: u32,
}

impl OptionReplyHeader {
    pub const LEN: usize = 20;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[0..8].copy_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
        out[8..12].copy_from_slice(&self.option.to_be_bytes());
        out[12..16].copy_from_slice(&self.reply.to_be_bytes());
        out[16..20].copy_from_slice(&self.length.to_be_bytes());
        out
    }

    pub fn parse(b: &[u8; Self::LEN]) -> Result<Self, ProtoError> {
        let mut c = Cursor::new(b);
        let magic = c.u64()?;
        if magic != OPTION_REPLY_MAGIC {
            return Err(ProtoError::BadMagic(magic));
        }
        Ok(Self {
            option: c.u32()?,
            reply: c.u32()?,
            length: c.u32()?,
        })
    }
}

/// Appends one complete option reply (header and payload) to `out`.
pub fn put_option_reply(out: &mut Vec<u8>, option: u32, reply: u32, payload: &[u8]) {
    let header = OptionReplyHeader {
        option,
        reply,
        length: len32(payload.len()),
    };
    out.extend_from_slice(&header.encode());
    out.extend_from_slice(payload);
}

/// Reply to `NBD_OPT_EXPORT_NAME`: size, transmission flags, and 124 zero
/// bytes unless the client negotiated `NO_ZEROES`.
pub fn export_name_reply(size: u64, transmission_flags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(10 + EXPORT_NAME_PADDING);
    put_u64(&mut out, size);
    put_u16(&mut out, transmission_flags);
    if !no_zeroes {
        out.resize(out.len() + EXPORT_NAME_PADDING, 0);
    }
    out
}

/// `NBD_REP_SERVER` payload: length-prefixed export name.
pub fn rep_server(name: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + name.len());
    put_str32(&mut out, name);
    out
}

/// Parses an `NBD_REP_SERVER` payload; returns the name and any trailing
/// description.
pub fn parse_rep_server(payload: &[u8]) -> Result<(String, String), ProtoError> {
    let mut c = Cursor::new(payload);
    let len = c.u32()?;
    if len as usize > c.remaining() {
        return Err(ProtoError::BadLength(len));
    }
    let name = parse_string(c.take(len as usize)?)?;
    let rest = c.remaining();
    let description = parse_string(c.take(rest)?)?;
    Ok((name, description))
}

/// `NBD_REP_INFO` payload for `NBD_INFO_EXPORT`.
pub fn info_export(size: u64, transmission_flags: u16) -> [u8; 12] {
    let mut out = [0u8; 12];
    out[0..2].copy_from_slice(&INFO_EXPORT.to_be_bytes());
    out[2..10].copy_from_slice(&size.to_be_bytes());
    out[10..12].copy_from_slice(&transmission_flags.to_be_bytes());
    out
}

/// `NBD_REP_INFO` payload for `NBD_INFO_BLOCK_SIZE`.
pub fn info_block_size(minimum: u32, preferred: u32, maximum: u32) -> [u8; 14] {
    let mut out = [0u8; 14];
    out[0..2].copy_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    out[2..6].copy_from_slice(&minimum.to_be_bytes());
    out[6..10].copy_from_slice(&preferred.to_be_bytes());
    out[10..14].copy_from_slice(&maximum.to_be_bytes());
    out
}

/// `NBD_REP_INFO` payload for `NBD_INFO_NAME`.
pub fn info_name(name: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + name.len());
    put_u16(&mut out, INFO_NAME);
    out.extend_from_slice(name.as_bytes());
    out
}

/// A decoded `NBD_REP_INFO` payload (client side).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Info {
    Export {
        size: u64,
        flags: u16,
    },
    Name(String),
    Description(String),
    BlockSize {
        minimum: u32,
        preferred: u32,
        maximum: u32,
    },
    Unknown(u16),
}

pub fn parse_info(payload: &[u8]) -> Result<Info, ProtoError> {
    let mut c = Cursor::new(payload);
    let info = match c.u16()? {
        INFO_EXPORT => Info::Export {
            size: c.u64()?,
            flags: c.u16()?,
        },
        INFO_NAME => {
            let rest = c.remaining();
            Info::Name(parse_string(c.take(rest)?)?)
        }
        INFO_DESCRIPTION => {
            let rest = c.remaining();
            Info::Description(parse_string(c.take(rest)?)?)
        }
        INFO_BLOCK_SIZE => Info::BlockSize {
            minimum: c.u32()?,
            preferred: c.u32()?,
            maximum: c.u32()?,
        },
        other => {
            let rest = c.remaining();
            c.take(rest)?;
            Info::Unknown(other)
        }
    };
    c.finish()?;
    Ok(info)
}

/// `NBD_REP_META_CONTEXT` payload: context id and name.
pub fn meta_context(id: u32, name: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + name.len());
    put_u32(&mut out, id);
    out.extend_from_slice(name.as_bytes());
    out
}

pub fn parse_meta_context(payload: &[u8]) -> Result<(u32, String), ProtoError> {
    let mut c = Cursor::new(payload);
    let id = c.u32()?;
    let rest = c.remaining();
    Ok((id, parse_string(c.take(rest)?)?))
}

/// Payload of `NBD_OPT_INFO` / `NBD_OPT_GO`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    pub requests: Vec<u16>,
}

impl InfoRequest {
    pub fn parse(payload: &[u8]) -> Result<Self, ProtoError> {
        let mut c = Cursor::new(payload);
        let name_len = c.u32()?;
        // The spec: the name length MUST be no larger than the data length - 6.
        if name_len as usize > payload.len().saturating_sub(6) {
            return Err(ProtoError::BadLength(name_len));
        }
        let name = parse_string(c.take(name_len as usize)?)?;
        let count = c.u16()?;
        let mut requests = Vec::with_capacity(usize::from(count).min(c.remaining() / 2));
        for _ in 0..count {
            requests.push(c.u16()?);
        }
        c.finish()?;
        Ok(Self { name, requests })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        put_str32(&mut out, &self.name);
        put_u16(
            &mut out,
            u16::try_from(self.requests.len()).expect("at most 65535 info requests"),
        );
        for r in &self.requests {
            put_u16(&mut out, *r);
        }
        out
    }
}

/// Payload of `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaRequest {
    pub export: String,
    pub queries: Vec<String>,
}

impl MetaRequest {
    pub fn parse(payload: &[u8]) -> Result<Self, ProtoError> {
        let mut c = Cursor::new(payload);
        let export_len = c.u32()?;
        if export_len as usize > c.remaining() {
            return Err(ProtoError::BadLength(export_len));
        }
        let export = parse_string(c.take(export_len as usize)?)?;
        let count = c.u32()?;
        // Each query takes at least four bytes, so `count` cannot make us
        // loop or allocate beyond the payload's size.
        let mut queries = Vec::new();
        for _ in 0..count {
            let len = c.u32()?;
            if len as usize > c.remaining() {
                return Err(ProtoError::BadLength(len));
            }
            queries.push(parse_string(c.take(len as usize)?)?);
        }
        c.finish()?;
        Ok(Self { export, queries })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        put_str32(&mut out, &self.export);
        put_u32(&mut out, len32(self.queries.len()));
        for q in &self.queries {
            put_str32(&mut out, q);
        }
        out
    }
}

// ---- Transmission messages -----------------------------------------------

/// A transmission-phase request header (the write payload follows it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub kind: u16,
    pub handle: u64,
    pub offset: u64,
    pub length: u32,
}

impl Request {
    pub const LEN: usize = 28;

    pub fn parse(b: &[u8; Self::LEN]) -> Result<Self, ProtoError> {
        let mut c = Cursor::new(b);
        let magic = c.u32()?;
        if magic != REQUEST_MAGIC {
            return Err(ProtoError::BadMagic(u64::from(magic)));
        }
        Ok(Self {
            flags: c.u16()?,
            kind: c.u16()?,
            handle: c.u64()?,
            offset: c.u64()?,
            length: c.u32()?,
        })
    }

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        out[4..6].copy_from_slice(&self.flags.to_be_bytes());
        out[6..8].copy_from_slice(&self.kind.to_be_bytes());
        out[8..16].copy_from_slice(&self.handle.to_be_bytes());
        out[16..24].copy_from_slice(&self.offset.to_be_bytes());
        out[24..28].copy_from_slice(&self.length.to_be_bytes());
        out
    }
}

/// A simple reply header (read data, if any, follows it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReply {
    pub error: u32,
    pub handle: u64,
}

impl SimpleReply {
    pub const LEN: usize = 16;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        out[4..8].copy_from_slice(&self.error.to_be_bytes());
        out[8..16].copy_from_slice(&self.handle.to_be_bytes());
        out
    }

    pub fn parse(b: &[u8; Self::LEN]) -> Result<Self, ProtoError> {
        let mut c = Cursor::new(b);
        let magic = c.u32()?;
        if magic != SIMPLE_REPLY_MAGIC {
            return Err(ProtoError::BadMagic(u64::from(magic)));
        }
        Ok(Self {
            error: c.u32()?,
            handle: c.u64()?,
        })
    }
}

/// A structured reply chunk header (`length` payload bytes follow it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    pub flags: u16,
    pub kind: u16,
    pub handle: u64,
    pub length: u32,
}

impl ChunkHeader {
    pub const LEN: usize = 20;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
        out[4..6].copy_from_slice(&self.flags.to_be_bytes());
        out[6..8].copy_from_slice(&self.kind.to_be_bytes());
        out[8..16].copy_from_slice(&self.handle.to_be_bytes());
        out[16..20].copy_from_slice(&self.length.to_be_bytes());
        out
    }

    pub fn parse(b: &[u8; Self::LEN]) -> Result<Self, ProtoError> {
        let mut c = Cursor::new(b);
        let magic = c.u32()?;
        if magic != STRUCTURED_REPLY_MAGIC {
            return Err(ProtoError::BadMagic(u64::from(magic)));
        }
        Ok(Self {
            flags: c.u16()?,
            kind: c.u16()?,
            handle: c.u64()?,
            length: c.u32()?,
        })
    }
}

/// Payload of an `NBD_REPLY_TYPE_ERROR` chunk. The message is cut to the
/// 4096-byte string limit at a character boundary.
pub fn error_chunk(error: u32, message: &str) -> Vec<u8> {
    let mut end = message.len().min(STRING_BYTES_MAX);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    let message = &message[..end];
    let mut out = Vec::with_capacity(6 + message.len());
    put_u32(&mut out, error);
    put_u16(
        &mut out,
        u16::try_from(message.len()).expect("cut to 4096 above"),
    );
    out.extend_from_slice(message.as_bytes());
    out
}

/// Parses an `NBD_REPLY_TYPE_ERROR` payload into error and message.
pub fn parse_error_chunk(payload: &[u8]) -> Result<(u32, String), ProtoError> {
    let mut c = Cursor::new(payload);
    let error = c.u32()?;
    let len = c.u16()?;
    if usize::from(len) > c.remaining() {
        return Err(ProtoError::BadLength(u32::from(len)));
    }
    let message = parse_string(c.take(usize::from(len))?)?;
    c.finish()?;
    Ok((error, message))
}

/// One block-status descriptor: a run of `length` bytes sharing `flags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    pub length: u32,
    pub flags: u32,
}

/// Payload of an `NBD_REPLY_TYPE_BLOCK_STATUS` chunk.
pub fn block_status_chunk(context_id: u32, descriptors: &[Descriptor]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + 8 * descriptors.len());
    put_u32(&mut out, context_id);
    for d in descriptors {
        put_u32(&mut out, d.length);
        put_u32(&mut out, d.flags);
    }
    out
}

/// Parses an `NBD_REPLY_TYPE_BLOCK_STATUS` payload: context id and at
/// least one descriptor, none of zero length.
pub fn parse_block_status_chunk(payload: &[u8]) -> Result<(u32, Vec<Descriptor>), ProtoError> {
    if payload.len() < 12 || (payload.len() - 4) & 7 != 0 {
        return Err(ProtoError::BadLength(len32(
            payload.len().min(u32::MAX as usize),
        )));
    }
    let mut c = Cursor::new(payload);
    let id = c.u32()?;
    let mut out = Vec::with_capacity(c.remaining() / 8);
    while c.remaining() > 0 {
        let length = c.u32()?;
        if length == 0 {
            return Err(ProtoError::BadLength(0));
        }
        out.push(Descriptor {
            length,
            flags: c.u32()?,
        });
    }
    Ok((id, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greeting_round_trip() {
        let g = greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        assert_eq!(&g[0..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(parse_greeting(&g), Ok(3));
        let mut bad = g;
        bad[0] ^= 1;
        assert!(matches!(parse_greeting(&bad), Err(ProtoError::BadMagic(_))));
        let mut bad = g;
        bad[15] ^= 1;
        assert!(matches!(parse_greeting(&bad), Err(ProtoError::BadMagic(_))));
    }

    #[test]
    fn option_header_round_trip_and_bad_magic() {
        let h = OptionHeader {
            option: OPT_GO,
            length: 77,
        };
        assert_eq!(OptionHeader::parse(&h.encode()), Ok(h));
        let mut b = h.encode();
        b[3] = 0;
        assert!(matches!(
            OptionHeader::parse(&b),
            Err(ProtoError::BadMagic(_))
        ));
    }

    #[test]
    fn option_reply_round_trip() {
        let mut out = Vec::new();
        put_option_reply(&mut out, OPT_LIST, REP_SERVER, &rep_server("disk"));
        let header = OptionReplyHeader::parse(out[..20].try_into().unwrap()).unwrap();
        assert_eq!(
            header,
            OptionReplyHeader {
                option: OPT_LIST,
                reply: REP_SERVER,
                length: 8
            }
        );
        assert_eq!(
            parse_rep_server(&out[20..]),
            Ok(("disk".into(), String::new()))
        );
        let mut bad = out.clone();
        bad[0] = 0xff;
        assert!(OptionReplyHeader::parse(bad[..20].try_into().unwrap()).is_err());
        assert!(is_rep_error(REP_ERR_UNSUP) && !is_rep_error(REP_ACK));
    }

    #[test]
    fn rep_server_malformed() {
        assert!(matches!(
            parse_rep_server(&[0, 0]),
            Err(ProtoError::Truncated { .. })
        ));
        assert_eq!(
            parse_rep_server(&[0, 0, 0, 9, b'a']),
            Err(ProtoError::BadLength(9))
        );
    }

    #[test]
    fn export_name_reply_padding() {
        assert_eq!(export_name_reply(1, 2, false).len(), 134);
        let r = export_name_reply(0x0102, 0x0304, true);
        assert_eq!(r, vec![0, 0, 0, 0, 0, 0, 1, 2, 3, 4]);
    }

    #[test]
    fn info_round_trips() {
        assert_eq!(
            parse_info(&info_export(1 << 40, 0x1234)),
            Ok(Info::Export {
                size: 1 << 40,
                flags: 0x1234
            })
        );
        assert_eq!(
            parse_info(&info_block_size(1, 4096, 1 << 25)),
            Ok(Info::BlockSize {
                minimum: 1,
                preferred: 4096,
                maximum: 1 << 25
            })
        );
        assert_eq!(parse_info(&info_name("x")), Ok(Info::Name("x".into())));
        assert_eq!(parse_info(&[0, 9, 1, 2]), Ok(Info::Unknown(9)));
        // Malformed: short, trailing, empty.
        assert!(parse_info(&info_export(1, 1)[..11]).is_err());
        let mut long = info_block_size(1, 2, 3).to_vec();
        long.push(0);
        assert_eq!(parse_info(&long), Err(ProtoError::Trailing(1)));
        assert!(parse_info(&[]).is_err());
    }

    #[test]
    fn meta_context_round_trip() {
        let p = meta_context(7, META_BASE_ALLOCATION);
        assert_eq!(parse_meta_context(&p), Ok((7, META_BASE_ALLOCATION.into())));
        assert!(parse_meta_context(&p[..3]).is_err());
    }

    #[test]
    fn strings() {
        assert_eq!(parse_string(b"abc"), Ok("abc".into()));
        assert_eq!(parse_string(b""), Ok(String::new()));
        assert_eq!(parse_string(b"a\0b"), Err(ProtoError::Nul));
        assert_eq!(parse_string(&[0xff, 0xfe]), Err(ProtoError::NotUtf8));
        assert_eq!(
            parse_string(&[b'a'; 4097]),
            Err(ProtoError::StringTooLong(4097))
        );
        assert!(parse_string(&[b'a'; 4096]).is_ok());
    }

    #[test]
    fn info_request_round_trip() {
        let r = InfoRequest {
            name: "vol".into(),
            requests: vec![INFO_BLOCK_SIZE, INFO_NAME],
        };
        assert_eq!(InfoRequest::parse(&r.encode()), Ok(r.clone()));
        let empty = InfoRequest {
            name: String::new(),
            requests: vec![],
        };
        assert_eq!(InfoRequest::parse(&empty.encode()), Ok(empty));
    }

    #[test]
    fn info_request_malformed() {
        let good = InfoRequest {
            name: "vol".into(),
            requests: vec![3],
        }
        .encode();
        // Every strict prefix is an error, never a panic.
        for n in 0..good.len() {
            assert!(InfoRequest::parse(&good[..n]).is_err(), "prefix {n}");
        }
        // Trailing garbage.
        let mut long = good.clone();
        long.push(1);
        assert!(InfoRequest::parse(&long).is_err());
        // Name length larger than the payload allows.
        let mut bad = good.clone();
        bad[0..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            InfoRequest::parse(&bad),
            Err(ProtoError::BadLength(_))
        ));
        // Request count larger than present.
        let mut bad = good.clone();
        let at = 4 + 3;
        bad[at..at + 2].copy_from_slice(&50u16.to_be_bytes());
        assert!(InfoRequest::parse(&bad).is_err());
        // Invalid UTF-8 name.
        let mut bad = good;
        bad[4] = 0xff;
        assert_eq!(InfoRequest::parse(&bad), Err(ProtoError::NotUtf8));
    }

    #[test]
    fn meta_request_round_trip_and_malformed() {
        let r = MetaRequest {
            export: "e".into(),
            queries: vec!["base:allocation".into(), "qemu:dirty-bitmap:x".into()],
        };
        let enc = r.encode();
        assert_eq!(MetaRequest::parse(&enc), Ok(r));
        for n in 0..enc.len() {
            assert!(MetaRequest::parse(&enc[..n]).is_err(), "prefix {n}");
        }
        let mut long = enc.clone();
        long.extend_from_slice(&[0, 0]);
        assert!(MetaRequest::parse(&long).is_err());
        // A huge query count with no queries must fail fast, not loop.
        let mut bad = Vec::new();
        put_str32(&mut bad, "e");
        put_u32(&mut bad, u32::MAX);
        assert!(matches!(
            MetaRequest::parse(&bad),
            Err(ProtoError::Truncated { .. })
        ));
        // Query length past the end.
        let mut bad = Vec::new();
        put_str32(&mut bad, "");
        put_u32(&mut bad, 1);
        put_u32(&mut bad, 100);
        bad.extend_from_slice(b"base:");
        assert_eq!(MetaRequest::parse(&bad), Err(ProtoError::BadLength(100)));
        // Export length past the end.
        assert_eq!(
            MetaRequest::parse(&[0, 0, 1, 0, 0]),
            Err(ProtoError::BadLength(256))
        );
    }

    #[test]
    fn request_round_trip_and_bad_magic() {
        let r = Request {
            flags: CMD_FLAG_FUA,
            kind: CMD_WRITE,
            handle: 0xdead_beef_0000_0001,
            offset: 1 << 33,
            length: 4096,
        };
        assert_eq!(Request::parse(&r.encode()), Ok(r));
        let mut b = r.encode();
        b[0] = 0x12; // historic magic is still wrong
        assert!(matches!(Request::parse(&b), Err(ProtoError::BadMagic(_))));
    }

    #[test]
    fn replies_round_trip() {
        let s = SimpleReply {
            error: 22,
            handle: 9,
        };
        assert_eq!(SimpleReply::parse(&s.encode()), Ok(s));
        let c = ChunkHeader {
            flags: REPLY_FLAG_DONE,
            kind: REPLY_TYPE_BLOCK_STATUS,
            handle: 5,
            length: 12,
        };
        assert_eq!(ChunkHeader::parse(&c.encode()), Ok(c));
        let mut b = c.encode();
        b[1] = 0;
        assert!(ChunkHeader::parse(&b).is_err());
        let mut b = s.encode();
        b[1] = 0;
        assert!(SimpleReply::parse(&b).is_err());
    }

    #[test]
    fn error_chunk_round_trip_and_truncation() {
        let p = error_chunk(5, "disk on fire");
        assert_eq!(parse_error_chunk(&p), Ok((5, "disk on fire".into())));
        let long = "é".repeat(3000); // 6000 bytes, 2-byte chars
        let p = error_chunk(5, &long);
        let (_, msg) = parse_error_chunk(&p).unwrap();
        assert!(msg.len() <= STRING_BYTES_MAX && msg.len() >= STRING_BYTES_MAX - 1);
        assert!(parse_error_chunk(&[0, 0, 0, 5, 0, 9, b'x']).is_err());
        assert!(parse_error_chunk(&[0, 0]).is_err());
    }

    #[test]
    fn block_status_round_trip_and_malformed() {
        let d = [
            Descriptor {
                length: 4096,
                flags: STATE_HOLE | STATE_ZERO,
            },
            Descriptor {
                length: 512,
                flags: 0,
            },
        ];
        let p = block_status_chunk(3, &d);
        assert_eq!(parse_block_status_chunk(&p), Ok((3, d.to_vec())));
        assert!(parse_block_status_chunk(&p[..4]).is_err());
        assert!(parse_block_status_chunk(&p[..13]).is_err());
        let zero = block_status_chunk(
            1,
            &[Descriptor {
                length: 0,
                flags: 0,
            }],
        );
        assert!(parse_block_status_chunk(&zero).is_err());
    }

    /// Seeded garbage through every parser: errors are fine, panics are not.
    #[test]
    fn parsers_never_panic_on_garbage() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..20_000 {
            let len = (next() % 64) as usize;
            let bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            let _ = InfoRequest::parse(&bytes);
            let _ = MetaRequest::parse(&bytes);
            let _ = parse_string(&bytes);
            let _ = parse_info(&bytes);
            let _ = parse_rep_server(&bytes);
            let _ = parse_meta_context(&bytes);
            let _ = parse_error_chunk(&bytes);
            let _ = parse_block_status_chunk(&bytes);
            let mut fixed = [0u8; 28];
            for (i, b) in bytes.iter().take(28).enumerate() {
                fixed[i] = *b;
            }
            let _ = Request::parse(&fixed);
            let _ = OptionHeader::parse(fixed[..16].try_into().unwrap());
            let _ = OptionReplyHeader::parse(fixed[..20].try_into().unwrap());
            let _ = ChunkHeader::parse(fixed[..20].try_into().unwrap());
            let _ = SimpleReply::parse(fixed[..16].try_into().unwrap());
            let _ = parse_greeting(fixed[..18].try_into().unwrap());
        }
    }
}
