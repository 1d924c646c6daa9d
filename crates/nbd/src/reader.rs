//! A blocking NBD client that reads one export: just enough of the protocol for
//! `bulwark image import` to hash a snapshot without a pipe and without reading
//! its holes. The server's side is the rest of this crate; this is its only client.
//!
//! Fixed newstyle handshake on a Unix socket, structured replies and the
//! `base:allocation` meta context when the server offers them, `NBD_OPT_GO`,
//! then one request at a time: `NBD_CMD_BLOCK_STATUS` and `NBD_CMD_READ`.
//! Without block status (a server that refuses the context) every range reads
//! as data, which is slower but gives the same bytes.
//!
//! Bytes from the server are input: every malformed or unexpected reply is an
//! `InvalidData` error naming what was wrong, never a panic. The codec is
//! `proto`'s, the one the server uses.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use crate::proto::{
    self, ChunkHeader, Descriptor, InfoRequest, MetaRequest, OptionHeader, OptionReplyHeader,
    Request, SimpleReply,
};

/// The most one option reply may carry (the protocol's strings are at most 4 KiB).
const OPTION_REPLY_BYTES_MAX: u32 = 64 << 10;
/// The most one read asks for: well under the 32 MiB every server accepts.
pub const READ_BYTES_MAX: usize = 4 << 20;
/// The most one block-status request covers (a request length is 32 bits).
const STATUS_BYTES_MAX: u64 = 1 << 30;

/// A run of an export's bytes as block status describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub length_bytes: u64,
    /// Reads of the run return zeros (`NBD_STATE_ZERO`): no need to read it.
    pub zero: bool,
}

/// An open connection to one export, in its transmission phase.
pub struct NbdReader {
    stream: UnixStream,
    size_bytes: u64,
    /// The id of `base:allocation` when the server agreed to it.
    allocation_id: Option<u32>,
    structured: bool,
    cookie: u64,
    /// The last chunk's payload, kept for the next (reads are up to 4 MiB each).
    payload: Vec<u8>,
}

fn invalid(what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

impl NbdReader {
    /// Connects to `socket` and opens `export`.
    pub fn open(socket: &Path, export: &str) -> io::Result<Self> {
        let mut stream = UnixStream::connect(socket)?;
        let mut greeting = [0u8; proto::GREETING_LEN];
        stream.read_exact(&mut greeting)?;
        let flags = proto::parse_greeting(&greeting).map_err(invalid)?;
        if flags & proto::FLAG_FIXED_NEWSTYLE == 0 {
            return Err(invalid("the server does not speak fixed newstyle NBD"));
        }
        let mut client_flags = proto::FLAG_C_FIXED_NEWSTYLE;
        if flags & proto::FLAG_NO_ZEROES != 0 {
            client_flags |= proto::FLAG_C_NO_ZEROES;
        }
        stream.write_all(&client_flags.to_be_bytes())?;
        let mut reader = NbdReader {
            stream,
            size_bytes: 0,
            allocation_id: None,
            structured: false,
            cookie: 0,
            payload: Vec::new(),
        };
        reader.structured = reader.simple_option(proto::OPT_STRUCTURED_REPLY)?;
        if reader.structured {
            reader.allocation_id = reader.set_meta_context(export)?;
        }
        reader.go(export)?;
        Ok(reader)
    }

    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn send_option(&mut self, option: u32, payload: &[u8]) -> io::Result<()> {
        let length = u32::try_from(payload.len()).map_err(|_| invalid("option too long"))?;
        self.stream
            .write_all(&OptionHeader { option, length }.encode())?;
        self.stream.write_all(payload)
    }

    /// The next reply to `option`: its type and payload.
    fn option_reply(&mut self, option: u32) -> io::Result<(u32, Vec<u8>)> {
        let mut head = [0u8; OptionReplyHeader::LEN];
        self.stream.read_exact(&mut head)?;
        let h = OptionReplyHeader::parse(&head).map_err(invalid)?;
        if h.option != option || h.length > OPTION_REPLY_BYTES_MAX {
            return Err(invalid(format!(
                "unexpected reply to {}: option {}, {} bytes",
                proto::opt_name(option),
                h.option,
                h.length
            )));
        }
        let mut payload = vec![0u8; h.length as usize];
        self.stream.read_exact(&mut payload)?;
        Ok((h.reply, payload))
    }

    /// An option without payload: true when acknowledged, false when refused.
    fn simple_option(&mut self, option: u32) -> io::Result<bool> {
        self.send_option(option, &[])?;
        let (reply, _) = self.option_reply(option)?;
        Ok(reply == proto::REP_ACK)
    }

    fn set_meta_context(&mut self, export: &str) -> io::Result<Option<u32>> {
        let request = MetaRequest {
            export: export.to_string(),
            queries: vec![proto::META_BASE_ALLOCATION.to_string()],
        };
        self.send_option(proto::OPT_SET_META_CONTEXT, &request.encode())?;
        let mut id = None;
        loop {
            let (reply, payload) = self.option_reply(proto::OPT_SET_META_CONTEXT)?;
            match reply {
                proto::REP_META_CONTEXT => {
                    let (n, name) = proto::parse_meta_context(&payload).map_err(invalid)?;
                    if name == proto::META_BASE_ALLOCATION {
                        id = Some(n);
                    }
                }
                proto::REP_ACK => return Ok(id),
                // Refused (unsupported, unknown export...): `go` says why if it matters.
                r if proto::is_rep_error(r) => return Ok(None),
                r => return Err(invalid(format!("unexpected meta context reply {r}"))),
            }
        }
    }

    fn go(&mut self, export: &str) -> io::Result<()> {
        let request = InfoRequest {
            name: export.to_string(),
            requests: vec![],
        };
        self.send_option(proto::OPT_GO, &request.encode())?;
        let mut size = None;
        loop {
            let (reply, payload) = self.option_reply(proto::OPT_GO)?;
            match reply {
                proto::REP_INFO => {
                    if let proto::Info::Export { size: s, .. } =
                        proto::parse_info(&payload).map_err(invalid)?
                    {
                        size = Some(s);
                    }
                }
                proto::REP_ACK => break,
                r if proto::is_rep_error(r) => {
                    let text = String::from_utf8_lossy(&payload);
                    return Err(io::Error::other(format!(
                        "the server refused export {export}: {}",
                        if text.is_empty() {
                            "no reason given"
                        } else {
                            &text
                        }
                    )));
                }
                r => return Err(invalid(format!("unexpected reply {r} to NBD_OPT_GO"))),
            }
        }
        self.size_bytes = size.ok_or_else(|| invalid("the server gave no export size"))?;
        Ok(())
    }

    fn request(&mut self, kind: u16, offset: u64, length: u32) -> io::Result<u64> {
        self.cookie += 1;
        let r = Request {
            flags: 0,
            kind,
            handle: self.cookie,
            offset,
            length,
        };
        self.stream.write_all(&r.encode())?;
        Ok(self.cookie)
    }

    /// How the export's bytes from `offset` on are held: at least one extent, none
    /// past the export's end; they cover at most `STATUS_BYTES_MAX` bytes. Without block
    /// status, one data extent.
    pub fn runs(&mut self, offset: u64) -> io::Result<Vec<Run>> {
        let wanted = self.size_bytes.saturating_sub(offset).min(STATUS_BYTES_MAX);
        if wanted == 0 {
            return Err(invalid("block status asked past the export's end"));
        }
        let Some(id) = self.allocation_id else {
            return Ok(vec![Run {
                length_bytes: wanted,
                zero: false,
            }]);
        };
        let cookie = self.request(proto::CMD_BLOCK_STATUS, offset, wanted as u32)?;
        let mut descriptors: Vec<Descriptor> = Vec::new();
        self.replies(cookie, "block status", |kind, payload| {
            if kind != proto::REPLY_TYPE_BLOCK_STATUS {
                return Err(invalid(format!(
                    "block status: unexpected chunk type {kind}"
                )));
            }
            let (context, found) = proto::parse_block_status_chunk(payload).map_err(invalid)?;
            if context == id {
                descriptors.extend(found);
            }
            Ok(())
        })?;
        clamp_runs(&descriptors, wanted)
    }

    /// Reads `buf.len()` (at most `READ_BYTES_MAX`) bytes at `offset`.
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        assert!(buf.len() <= READ_BYTES_MAX && !buf.is_empty());
        let end = offset.checked_add(buf.len() as u64);
        if end.is_none_or(|e| e > self.size_bytes) {
            return Err(invalid("read past the export's end"));
        }
        let cookie = self.request(proto::CMD_READ, offset, buf.len() as u32)?;
        if !self.structured {
            return self
                .simple_reply(cookie, "read")
                .and_then(|()| self.stream.read_exact(buf));
        }
        let mut filled = 0usize;
        self.replies(cookie, "read", |kind, payload| {
            let at = payload_offset(payload)?;
            let len = match kind {
                proto::REPLY_TYPE_OFFSET_DATA => payload.len() - 8,
                proto::REPLY_TYPE_OFFSET_HOLE if payload.len() == 12 => {
                    u32::from_be_bytes(payload[8..12].try_into().expect("4 bytes")) as usize
                }
                k => return Err(invalid(format!("read: unexpected chunk type {k}"))),
            };
            let start = at
                .checked_sub(offset)
                .filter(|s| *s + len as u64 <= buf.len() as u64)
                .ok_or_else(|| invalid("read: a chunk outside the range asked for"))?
                as usize;
            let target = &mut buf[start..start + len];
            match kind {
                proto::REPLY_TYPE_OFFSET_DATA => target.copy_from_slice(&payload[8..]),
                _ => target.fill(0),
            }
            filled += len;
            Ok(())
        })?;
        // Chunks never overlap (the server sends one per byte range), so the sum counts each byte once.
        if filled != buf.len() {
            return Err(invalid(format!(
                "read: the server sent {filled} of {} bytes",
                buf.len()
            )));
        }
        Ok(())
    }

    fn simple_reply(&mut self, cookie: u64, what: &str) -> io::Result<()> {
        let mut head = [0u8; SimpleReply::LEN];
        self.stream.read_exact(&mut head)?;
        let r = SimpleReply::parse(&head).map_err(invalid)?;
        if r.handle != cookie {
            return Err(invalid(format!("{what}: a reply to another request")));
        }
        if r.error != 0 {
            return Err(io::Error::other(format!("{what}: error {}", r.error)));
        }
        Ok(())
    }

    /// The structured reply chunks to request `cookie` until the last one, each handed
    /// to `chunk` (type, payload); an error chunk or a simple error reply
    /// ends it with an error.
    fn replies(
        &mut self,
        cookie: u64,
        what: &str,
        mut chunk: impl FnMut(u16, &[u8]) -> io::Result<()>,
    ) -> io::Result<()> {
        let mut payload = std::mem::take(&mut self.payload);
        let done = self.chunks(cookie, what, &mut payload, &mut chunk);
        self.payload = payload;
        done
    }

    fn chunks(
        &mut self,
        cookie: u64,
        what: &str,
        payload: &mut Vec<u8>,
        chunk: &mut impl FnMut(u16, &[u8]) -> io::Result<()>,
    ) -> io::Result<()> {
        loop {
            let mut head = [0u8; ChunkHeader::LEN];
            self.stream.read_exact(&mut head[..SimpleReply::LEN])?;
            let magic = u32::from_be_bytes(head[..4].try_into().expect("4 bytes"));
            if magic == proto::SIMPLE_REPLY_MAGIC {
                let simple: [u8; SimpleReply::LEN] =
                    head[..SimpleReply::LEN].try_into().expect("16 bytes");
                let r = SimpleReply::parse(&simple).map_err(invalid)?;
                return Err(if r.handle != cookie {
                    invalid(format!("{what}: a reply to another request"))
                } else {
                    io::Error::other(format!("{what}: error {}", r.error))
                });
            }
            self.stream.read_exact(&mut head[SimpleReply::LEN..])?;
            let h = ChunkHeader::parse(&head).map_err(invalid)?;
            if h.handle != cookie || h.length as usize > READ_BYTES_MAX + 64 {
                return Err(invalid(format!(
                    "{what}: unexpected chunk (cookie {}, {} bytes)",
                    h.handle, h.length
                )));
            }
            payload.resize(h.length as usize, 0);
            self.stream.read_exact(payload)?;
            match h.kind {
                proto::REPLY_TYPE_NONE => {}
                proto::REPLY_TYPE_ERROR | proto::REPLY_TYPE_ERROR_OFFSET => {
                    let (error, message) = proto::parse_error_chunk(
                        &payload[..payload.len().min(6 + read_u16(payload, 4) as usize)],
                    )
                    .map_err(invalid)?;
                    return Err(io::Error::other(format!(
                        "{what}: error {error}: {message}"
                    )));
                }
                kind => chunk(kind, payload)?,
            }
            if h.flags & proto::REPLY_FLAG_DONE != 0 {
                return Ok(());
            }
        }
    }
}

impl Drop for NbdReader {
    /// `NBD_CMD_DISC`, so the server sees a clean goodbye; errors do not matter here.
    fn drop(&mut self) {
        let _ = self.request(proto::CMD_DISC, 0, 0);
    }
}

fn read_u16(b: &[u8], at: usize) -> u16 {
    b.get(at..at + 2)
        .map(|s| u16::from_be_bytes(s.try_into().expect("2 bytes")))
        .unwrap_or(0)
}

/// The offset an `OFFSET_DATA` or `OFFSET_HOLE` chunk starts with.
fn payload_offset(payload: &[u8]) -> io::Result<u64> {
    payload
        .get(..8)
        .map(|s| u64::from_be_bytes(s.try_into().expect("8 bytes")))
        .ok_or_else(|| invalid("read: a chunk without its offset"))
}

/// The descriptors of one block-status reply as extents covering at most `wanted`
/// bytes (a server may describe more than was asked); an empty reply is an error.
fn clamp_runs(descriptors: &[Descriptor], wanted: u64) -> io::Result<Vec<Run>> {
    let mut out = Vec::with_capacity(descriptors.len());
    let mut covered = 0u64;
    for d in descriptors {
        if covered == wanted {
            break;
        }
        let length_bytes = u64::from(d.length).min(wanted - covered);
        covered += length_bytes;
        out.push(Run {
            length_bytes,
            zero: d.flags & proto::STATE_ZERO != 0,
        });
    }
    if out.is_empty() {
        return Err(invalid("block status: no extent in the reply"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_cut_at_what_was_asked() {
        let d = |length, flags| Descriptor { length, flags };
        let got = clamp_runs(&[d(4096, 3), d(8192, 0), d(4096, 2)], 10_000).unwrap();
        assert_eq!(
            got,
            vec![
                Run {
                    length_bytes: 4096,
                    zero: true
                },
                Run {
                    length_bytes: 5904,
                    zero: false
                },
            ]
        );
        // HOLE without ZERO reads as data: only STATE_ZERO promises zeros.
        let got = clamp_runs(&[d(512, proto::STATE_HOLE)], 512).unwrap();
        assert!(!got[0].zero);
        assert!(clamp_runs(&[], 512).is_err());
    }
}
