//! Fixed-newstyle option haggling: from the greeting to the transmission
//! phase.
//!
//! [`greet`] sends the greeting and reads the client's flags; [`options`]
//! runs the option loop on any byte stream (`AsyncRead + AsyncWrite`). On a
//! listener that requires TLS the loop first runs in [`Tls::Required`]:
//! every option but `NBD_OPT_STARTTLS` and `NBD_OPT_ABORT` gets
//! `NBD_REP_ERR_TLS_REQD` (so the client learns nothing, not even the
//! export list), and STARTTLS is ACKed and returned to the caller, which
//! wraps the stream and calls the loop again in [`Tls::Active`] with fresh
//! state (the spec forbids keeping options negotiated before STARTTLS).
//! Without TLS ([`Tls::Unavailable`]) STARTTLS gets `NBD_REP_ERR_POLICY`.
//! The handshake never reads ahead of the option it is handling, so no byte
//! of the transmission phase (or of a TLS handshake) is consumed here.
//!
//! Opens go through [`Exports::open`] with the client's identity; a failed
//! open (unknown, unavailable or forbidden: one answer for all) is
//! reported as [`Event::Denied`], counted by the rate limiter, and answered
//! after the back-off it has earned.
//!
//! Invariants: every option gets exactly one final reply (ACK or error)
//! unless the connection is closed; the connection is closed only where
//! the spec allows or requires it (bad magic, unknown client flags,
//! oversized payloads, an `NBD_OPT_EXPORT_NAME` that cannot be honoured,
//! `NBD_OPT_ABORT`). Malformed payloads get `NBD_REP_ERR_INVALID`.
//! `Exports` and `Backend` methods may block, so they run on the blocking
//! pool.

use std::sync::Arc;

use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;
use tracing::debug;

use crate::backend::{Backend, Client, Event, Exports};
use crate::limits::{Limits, OPTION_BYTES_MAX, RATE_DELAY_MAX, STRING_BYTES_MAX};
use crate::proto::*;
use crate::ratelimit::{Key, Limiter};

/// Metadata context id handed out for `base:allocation`.
pub(crate) const BASE_ALLOCATION_ID: u32 = 1;

/// Why a handshake ended without reaching the transmission phase.
#[derive(Debug, Error)]
pub(crate) enum HandshakeError {
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    #[error("client sent unknown flags {0:#x}")]
    ClientFlags(u32),
    #[error("bad option header: {0}")]
    Header(ProtoError),
    #[error("option {option} carries {length} bytes (limit {OPTION_BYTES_MAX})")]
    OptionTooLarge { option: u32, length: u32 },
    #[error("NBD_OPT_EXPORT_NAME with an invalid name: {0}")]
    ExportName(ProtoError),
    #[error("NBD_OPT_EXPORT_NAME for unavailable export {0:?}")]
    ExportUnavailable(String),
    #[error("NBD_OPT_EXPORT_NAME before TLS on a listener that requires it")]
    ExportNameBeforeTls,
    #[error("server is shutting down")]
    Shutdown,
    #[error("refused: the server already serves its limit of {0} connections")]
    Full(usize),
}

impl HandshakeError {
    /// The client simply went away (EOF, reset, broken pipe), as clients
    /// that only list or probe exports often do.
    pub(crate) fn is_disconnect(&self) -> bool {
        use std::io::ErrorKind::*;
        matches!(self, HandshakeError::Io(e)
            if matches!(e.kind(), UnexpectedEof | BrokenPipe | ConnectionReset))
    }
}

/// Everything the transmission phase needs about the chosen export.
pub(crate) struct Negotiated {
    pub name: String,
    pub backend: Arc<dyn Backend>,
    pub size: u64,
    /// Transmission flags as advertised to the client.
    pub flags: u16,
    /// Advertised preferred block size.
    pub block_preferred: u32,
    /// Largest READ/WRITE payload accepted (the advertised maximum).
    pub request_bytes_max: u32,
    pub fast_zero: bool,
    pub structured: bool,
    /// Context id for `base:allocation`, if selected for this export.
    pub meta_context: Option<u32>,
}

pub(crate) enum Outcome {
    Transmission(Negotiated),
    /// The client sent `NBD_OPT_ABORT`.
    Aborted,
    /// `NBD_OPT_STARTTLS` was ACKed: the caller runs the TLS handshake.
    StartTls,
}

/// Where the connection stands with TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tls {
    /// Not offered on this listener: STARTTLS gets `NBD_REP_ERR_POLICY`.
    Unavailable,
    /// Required and not yet started: only STARTTLS and ABORT are served.
    Required,
    /// Established: STARTTLS again is invalid.
    Active,
}

/// What the option loop needs besides the stream.
pub(crate) struct Context<'a> {
    pub exports: &'a Arc<dyn Exports>,
    pub limits: &'a Limits,
    pub shutdown: &'a watch::Receiver<bool>,
    pub client: &'a Arc<Client>,
    pub limiter: &'a Limiter,
    pub tls: Tls,
    /// The server already serves its most connections (this number): every
    /// option but ABORT is refused, saying so.
    pub full: Option<usize>,
}

impl Context<'_> {
    /// Rate-limit keys of this client: its address and, if authenticated
    /// by TLS, its identity.
    pub(crate) fn keys(&self) -> Vec<Key> {
        let mut keys = Vec::with_capacity(2);
        if let Some(ip) = self.client.ip {
            keys.push(Key::Addr(ip));
        }
        if self.tls == Tls::Active {
            keys.push(Key::Identity(self.client.identity.name()));
        }
        keys
    }
}

/// An export opened and described on the blocking pool.
struct Opened {
    backend: Arc<dyn Backend>,
    size: u64,
    read_only: bool,
    multi_conn: bool,
    fast_zero: bool,
    block_preferred: u32,
    request_bytes_max: u32,
}

/// Block sizes advertised for a backend: (minimum, preferred, maximum).
/// Minimum is 1 (any alignment is served); preferred is the backend's,
/// made a power of two of at least 512 and no larger than the maximum.
pub(crate) fn block_sizes(backend_preferred: u32, request_bytes_max: u32) -> (u32, u32, u32) {
    let preferred = backend_preferred
        .max(512)
        .checked_next_power_of_two()
        .unwrap_or(1 << 31);
    // Largest power of two not above the maximum (which is at least 4096).
    let cap = 1u32 << (31 - request_bytes_max.leading_zeros());
    (1, preferred.min(cap), request_bytes_max)
}

/// Opens `name` for the client on the blocking pool. A failed open (for
/// whatever reason) takes the same path every time: reported to
/// `Exports::event`, counted against the client, and delayed by the
/// back-off it has earned before the caller replies.
async fn open_export(cx: &Context<'_>, name: &str) -> Option<Opened> {
    let exports = Arc::clone(cx.exports);
    let client = Arc::clone(cx.client);
    let name = name.to_owned();
    let request_bytes_max = cx.limits.request_bytes_max;
    let opened = tokio::task::spawn_blocking(move || {
        let Some(backend) = exports.open(&name, &client) else {
            exports.event(&client, Event::Denied { export: &name });
            return None;
        };
        let (_, block_preferred, request_bytes_max) =
            block_sizes(backend.preferred_block_size(), request_bytes_max);
        Some(Opened {
            size: backend.size(),
            read_only: backend.read_only(),
            multi_conn: backend.can_multi_conn(),
            fast_zero: backend.can_fast_zero(),
            block_preferred,
            request_bytes_max,
            backend,
        })
    })
    .await
    // A panicking `open` is treated as "not available".
    .ok()
    .flatten();
    if opened.is_none() {
        let keys = cx.keys();
        // Refusals queue behind each other too; past the queue bound they
        // wait the longest back-off (the reply must still go out).
        let delay = cx.limiter.reserve(&keys).unwrap_or(RATE_DELAY_MAX);
        cx.limiter.fail(&keys);
        if !delay.is_zero() {
            debug!(?delay, "delaying the reply to a failed open");
            tokio::time::sleep(delay).await;
        }
    }
    opened
}

async fn list_exports(exports: &Arc<dyn Exports>, client: &Arc<Client>) -> Vec<String> {
    let exports = Arc::clone(exports);
    let client = Arc::clone(client);
    tokio::task::spawn_blocking(move || exports.list(&client))
        .await
        .unwrap_or_default()
}

/// Meta-context names that a query selects. `base:` is a wildcard only
/// when listing; unknown namespaces and leaf names select nothing.
fn meta_matches(query: &str, listing: bool) -> bool {
    query == META_BASE_ALLOCATION || (listing && query == "base:")
}

/// What to do after replying to one option.
enum Step {
    Continue,
    Go(Negotiated),
    Abort,
    StartTls,
}

struct Haggle<'a> {
    cx: &'a Context<'a>,
    no_zeroes: bool,
    /// Options refused with `NBD_REP_ERR_TLS_REQD` so far.
    refused_without_tls: u32,
    structured: bool,
    /// Export name and context id chosen by the last NBD_OPT_SET_META_CONTEXT.
    meta: Option<(String, u32)>,
    /// Replies to the current option, written in one go.
    out: Vec<u8>,
}

impl Haggle<'_> {
    fn reply(&mut self, option: u32, reply: u32, payload: &[u8]) {
        put_option_reply(&mut self.out, option, reply, payload);
    }

    async fn handle(&mut self, option: u32, payload: &[u8]) -> Result<Step, HandshakeError> {
        if self.cx.tls == Tls::Required {
            return self.before_tls(option, payload);
        }
        match option {
            OPT_EXPORT_NAME => self.export_name(payload).await,
            OPT_ABORT => {
                // The spec asks servers to ignore any data sent with ABORT.
                self.reply(option, REP_ACK, &[]);
                Ok(Step::Abort)
            }
            OPT_LIST => {
                if !payload.is_empty() {
                    self.reply(option, REP_ERR_INVALID, b"NBD_OPT_LIST takes no data");
                    return Ok(Step::Continue);
                }
                for name in list_exports(self.cx.exports, self.cx.client).await {
                    // Names that are not valid NBD strings cannot be used anyway.
                    if name.len() <= STRING_BYTES_MAX && !name.contains('\0') {
                        self.reply(option, REP_SERVER, &rep_server(&name));
                    }
                }
                self.reply(option, REP_ACK, &[]);
                Ok(Step::Continue)
            }
            OPT_STARTTLS => {
                if !payload.is_empty() {
                    self.reply(option, REP_ERR_INVALID, b"NBD_OPT_STARTTLS takes no data");
                } else if self.cx.tls == Tls::Active {
                    self.reply(option, REP_ERR_INVALID, b"TLS is already active");
                } else {
                    self.reply(
                        option,
                        REP_ERR_POLICY,
                        b"TLS is not enabled on this listener",
                    );
                }
                Ok(Step::Continue)
            }
            OPT_INFO | OPT_GO => self.info_or_go(option, payload).await,
            OPT_STRUCTURED_REPLY => {
                if payload.is_empty() {
                    self.structured = true;
                    self.reply(option, REP_ACK, &[]);
                } else {
                    self.reply(
                        option,
                        REP_ERR_INVALID,
                        b"NBD_OPT_STRUCTURED_REPLY takes no data",
                    );
                }
                Ok(Step::Continue)
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                self.meta_context(option, payload);
                Ok(Step::Continue)
            }
            // EXTENDED_HEADERS, PEEK_EXPORT and anything unknown.
            _ => {
                self.reply(option, REP_ERR_UNSUP, b"option not supported");
                Ok(Step::Continue)
            }
        }
    }

    /// A listener that requires TLS, before STARTTLS: nothing but STARTTLS
    /// and ABORT is served, and nothing about exports is said.
    fn before_tls(&mut self, option: u32, payload: &[u8]) -> Result<Step, HandshakeError> {
        match option {
            OPT_STARTTLS if payload.is_empty() => {
                self.reply(option, REP_ACK, &[]);
                Ok(Step::StartTls)
            }
            OPT_STARTTLS => {
                self.reply(option, REP_ERR_INVALID, b"NBD_OPT_STARTTLS takes no data");
                Ok(Step::Continue)
            }
            OPT_ABORT => {
                self.reply(option, REP_ACK, &[]);
                Ok(Step::Abort)
            }
            // It cannot be refused with an error reply: hang up.
            OPT_EXPORT_NAME => Err(HandshakeError::ExportNameBeforeTls),
            _ => {
                self.refused_without_tls += 1;
                self.reply(
                    option,
                    REP_ERR_TLS_REQD,
                    b"TLS is required: use NBD_OPT_STARTTLS",
                );
                Ok(Step::Continue)
            }
        }
    }

    async fn export_name(&mut self, payload: &[u8]) -> Result<Step, HandshakeError> {
        // NBD_OPT_EXPORT_NAME cannot return an error: hang up instead.
        let name = parse_string(payload).map_err(HandshakeError::ExportName)?;
        let Some(opened) = open_export(self.cx, &name).await else {
            return Err(HandshakeError::ExportUnavailable(name));
        };
        let negotiated = self.negotiated(name, opened);
        self.out.extend_from_slice(&export_name_reply(
            negotiated.size,
            negotiated.flags,
            self.no_zeroes,
        ));
        Ok(Step::Go(negotiated))
    }

    async fn info_or_go(&mut self, option: u32, payload: &[u8]) -> Result<Step, HandshakeError> {
        let request = match InfoRequest::parse(payload) {
            Ok(r) => r,
            Err(e) => {
                self.reply(option, REP_ERR_INVALID, e.to_string().as_bytes());
                return Ok(Step::Continue);
            }
        };
        let Some(opened) = open_export(self.cx, &request.name).await else {
            self.reply(option, REP_ERR_UNKNOWN, b"export not available");
            return Ok(Step::Continue);
        };
        let negotiated = self.negotiated(request.name, opened);
        self.reply(
            option,
            REP_INFO,
            &info_export(negotiated.size, negotiated.flags),
        );
        // Block sizes are sent whether or not they were asked for: our
        // minimum is 1, so they constrain nothing a client must honour.
        self.reply(
            option,
            REP_INFO,
            &info_block_size(1, negotiated.block_preferred, negotiated.request_bytes_max),
        );
        if request.requests.contains(&INFO_NAME) {
            self.reply(option, REP_INFO, &info_name(&negotiated.name));
        }
        self.reply(option, REP_ACK, &[]);
        Ok(if option == OPT_GO {
            Step::Go(negotiated)
        } else {
            Step::Continue
        })
    }

    fn meta_context(&mut self, option: u32, payload: &[u8]) {
        let setting = option == OPT_SET_META_CONTEXT;
        if setting {
            // SET replaces the selection even when it fails.
            self.meta = None;
            if !self.structured {
                self.reply(
                    option,
                    REP_ERR_INVALID,
                    b"negotiate NBD_OPT_STRUCTURED_REPLY first",
                );
                return;
            }
        }
        let request = match MetaRequest::parse(payload) {
            Ok(r) => r,
            Err(e) => {
                self.reply(option, REP_ERR_INVALID, e.to_string().as_bytes());
                return;
            }
        };
        let selected = if setting {
            request.queries.iter().any(|q| meta_matches(q, false))
        } else {
            // Listing with no queries lists everything.
            request.queries.is_empty() || request.queries.iter().any(|q| meta_matches(q, true))
        };
        if selected {
            // Ids in LIST replies are reserved and should be zero.
            let id = if setting { BASE_ALLOCATION_ID } else { 0 };
            self.reply(
                option,
                REP_META_CONTEXT,
                &meta_context(id, META_BASE_ALLOCATION),
            );
            if setting {
                self.meta = Some((request.export, BASE_ALLOCATION_ID));
            }
        }
        self.reply(option, REP_ACK, &[]);
    }

    fn negotiated(&self, name: String, o: Opened) -> Negotiated {
        let meta_context = match &self.meta {
            Some((export, id)) if *export == name && self.structured => Some(*id),
            _ => None,
        };
        Negotiated {
            flags: transmission_flags(o.read_only, o.multi_conn, self.structured),
            name,
            backend: o.backend,
            size: o.size,
            request_bytes_max: o.request_bytes_max,
            fast_zero: o.fast_zero,
            structured: self.structured,
            meta_context,
            block_preferred: o.block_preferred,
        }
    }
}

/// Transmission flags advertised for an export. Read-only exports do not
/// advertise trim, write-zeroes or fast-zero (writes there get `EPERM`);
/// `SEND_DF` needs structured replies, and we never fragment reads anyway.
pub(crate) fn transmission_flags(read_only: bool, multi_conn: bool, structured: bool) -> u16 {
    let mut flags = FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_FUA;
    if read_only {
        flags |= FLAG_READ_ONLY;
    } else {
        flags |= FLAG_SEND_TRIM | FLAG_SEND_WRITE_ZEROES | FLAG_SEND_FAST_ZERO;
    }
    if structured {
        flags |= FLAG_SEND_DF;
    }
    if multi_conn {
        flags |= FLAG_CAN_MULTI_CONN;
    }
    flags
}

/// Sends the greeting and reads the client's flags; returns whether the
/// client asked for `NO_ZEROES`.
pub(crate) async fn greet<S>(stream: &mut S) -> Result<bool, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    stream
        .write_all(&greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES))
        .await?;
    stream.flush().await?;
    let client_flags = stream.read_u32().await?;
    let known = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;
    if client_flags & !known != 0 {
        return Err(HandshakeError::ClientFlags(client_flags));
    }
    // Clients without FIXED_NEWSTYLE are served as fixed-newstyle anyway
    // (the spec allows it); such clients only send NBD_OPT_EXPORT_NAME.
    Ok(client_flags & FLAG_C_NO_ZEROES != 0)
}

/// What [`options`] leaves behind besides its outcome.
pub(crate) struct Summary {
    /// Options refused with `NBD_REP_ERR_TLS_REQD`.
    pub refused_without_tls: u32,
}

/// Runs option haggling on `stream` until the client enters transmission,
/// aborts, starts TLS, or breaks the protocol. The caller bounds it with a
/// timeout.
pub(crate) async fn options<S>(
    stream: &mut S,
    cx: &Context<'_>,
    no_zeroes: bool,
    summary: &mut Summary,
) -> Result<Outcome, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut haggle = Haggle {
        cx,
        no_zeroes,
        refused_without_tls: 0,
        structured: false,
        meta: None,
        out: Vec::new(),
    };
    let result = option_loop(stream, &mut haggle).await;
    summary.refused_without_tls += haggle.refused_without_tls;
    result
}

async fn option_loop<S>(stream: &mut S, haggle: &mut Haggle<'_>) -> Result<Outcome, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    loop {
        let mut header = [0u8; OptionHeader::LEN];
        stream.read_exact(&mut header).await?;
        let header = OptionHeader::parse(&header).map_err(HandshakeError::Header)?;
        if header.length > OPTION_BYTES_MAX {
            return Err(HandshakeError::OptionTooLarge {
                option: header.option,
                length: header.length,
            });
        }
        let mut payload = vec![0u8; header.length as usize];
        stream.read_exact(&mut payload).await?;
        debug!(
            option = opt_name(header.option),
            code = header.option,
            length = header.length,
            "option"
        );
        haggle.out.clear();
        if *haggle.cx.shutdown.borrow() && header.option != OPT_ABORT {
            haggle.reply(header.option, REP_ERR_SHUTDOWN, b"server is shutting down");
            stream.write_all(&haggle.out).await?;
            stream.flush().await?;
            return Err(HandshakeError::Shutdown);
        }
        if let (Some(max), false) = (haggle.cx.full, header.option == OPT_ABORT) {
            // NBD_OPT_EXPORT_NAME cannot be answered with an error: hang up.
            if header.option == OPT_EXPORT_NAME {
                return Err(HandshakeError::Full(max));
            }
            // Refuse each option, so that a client that goes on past a
            // refused one (structured replies) hears why at NBD_OPT_GO.
            let msg = format!(
                "too many connections: this server serves at most {max} at once \
                 (bulwark serve --max-connections); try again later"
            );
            haggle.reply(header.option, REP_ERR_POLICY, msg.as_bytes());
            stream.write_all(&haggle.out).await?;
            stream.flush().await?;
            continue;
        }
        let step = haggle.handle(header.option, &payload).await;
        stream.write_all(&haggle.out).await?;
        stream.flush().await?;
        match step? {
            Step::Continue => {}
            Step::Go(negotiated) => return Ok(Outcome::Transmission(negotiated)),
            Step::Abort => return Ok(Outcome::Aborted),
            Step::StartTls => return Ok(Outcome::StartTls),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_are_sane() {
        assert_eq!(block_sizes(4096, 32 << 20), (1, 4096, 32 << 20));
        assert_eq!(block_sizes(0, 32 << 20), (1, 512, 32 << 20));
        assert_eq!(block_sizes(3000, 32 << 20), (1, 4096, 32 << 20));
        assert_eq!(block_sizes(u32::MAX, 32 << 20), (1, 32 << 20, 32 << 20));
        assert_eq!(block_sizes(1 << 20, 4096), (1, 4096, 4096));
        assert_eq!(block_sizes(1 << 20, 5000), (1, 4096, 5000));
    }

    #[test]
    fn meta_queries() {
        assert!(meta_matches("base:allocation", false));
        assert!(meta_matches("base:allocation", true));
        assert!(meta_matches("base:", true));
        assert!(!meta_matches("base:", false));
        assert!(!meta_matches("base:other", true));
        assert!(!meta_matches("qemu:dirty-bitmap:a", true));
        assert!(!meta_matches("", true));
    }
}
