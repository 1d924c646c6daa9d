"""A fault-injecting HTTP/1.1 reverse proxy for the object-store tests.

It runs in threads of the pytest process, between the daemon (or a boto3
client) and an S3 server on loopback, forwards every request unchanged, and
applies rules that the test switches on and off while requests flow:

    with FaultProxy.for_server(server) as proxy:     # an s3servers.S3Server
        ...point the daemon at proxy.endpoint...
        proxy.counts("PUT", prefix="pool/seg/")      # requests seen so far
        r = proxy.fail(status=503)                   # until r.off()
        r = proxy.strip_conditions()                 # a store that ignores If-Match
        r = proxy.slow_body(hold_after=1 << 20, prefix="pool/seg/")
        r.holding.wait(10)                           # mid-body: kill someone, then r.release()
        r = proxy.drop_reply(method="PUT", prefix="pool/sb")   # forward, then lose the reply
        r = proxy.pause(method="PUT");  r.waiting.wait(10); ...; r.release()

Every rule is a `Rule` with `threading.Event`s for the test to wait on (never
sleep), a `hits` count, `off()`, and optional `times` (it switches itself off
after that many requests). A request may match several rules; they apply in
this order: strip_conditions, pause(stage="request"), fail, slow_body (while
forwarding), pause(stage="reply"), drop_reply. Within a kind, the oldest active
matching rule applies.

Forwarding: the request line, headers (order and case kept, `Host` verbatim,
so SigV4 signatures made for the proxy's address still verify upstream) and
body go to a fresh upstream connection per request (no stale keep-alive
connection can make a retry ambiguous); the client side keeps its connection
alive. Hop-by-hop headers (Connection, Keep-Alive, Expect, TE, ...) are not
forwarded; `Expect: 100-continue` is answered by the proxy itself. Request
bodies are streamed as they arrive (chunked ones with their framing unchanged,
aws-chunked included); a client that goes mid-body (a killed daemon) gets its
upstream request aborted with a reset, so the server sees a cut body, never a
complete one. Responses: Content-Length bodies are streamed; a chunked or
close-delimited response is read whole and sent with a Content-Length; HEAD
replies keep upstream's Content-Length. If the upstream cannot be reached or
fails mid-request, the proxy closes the client's connection without a reply,
as a dead server's network path would look.

Killing the daemon mid-body: what the daemon has handed to its kernel still
arrives after it dies (socket buffers: up to a few MiB on loopback), so hold
the body (slow_body(hold_after=N)) and make it several MiB larger than N; the
proxy shrinks its receive buffer on a slowed connection to 64 KiB.

Every request has a `Seen` record (requests()): method, key, query, headers
as sent by the client, body_len, upstream status, outcome, the rules applied,
and a `finished` event.

Addressing: path-style only (`/bucket/key`), which is what object_store and the
harness's boto3 clients use against an endpoint URL. Keys in counters and
matching are the URL-decoded key after `/bucket/`.

Stripping If-Match/If-None-Match: object_store signs every header it sends
(all but authorization, content-length, user-agent: object_store 0.12
aws/credential.rs canonicalize_headers), so a stripped condition header would
break the signature (403 SignatureDoesNotMatch from versitygw and from moto
started with signature checks). With `resign=True` (the default) the proxy,
given the secret, signs the request again with AWS SigV4 over the same signed
headers less the stripped ones, the same x-amz-date and the same
x-amz-content-sha256 (the body is not rehashed). Requests signed with
STREAMING-AWS4-HMAC-SHA256-PAYLOAD (per-chunk signatures chained to the seed
signature) and presigned URLs cannot be re-signed this way; such a request is
forwarded stripped and recorded with outcome "resign-unsupported".
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import http.server
import re
import socket
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade",
    "expect", "proxy-authorization", "proxy-authenticate",
}
CONDITION_HEADERS = ("if-match", "if-none-match")
UPSTREAM_TIMEOUT_S = 120
HOLD_TIMEOUT_S = 600  # a paused request that nobody releases gives up after this
PIECE = 64 * 1024
SLOW_RCVBUF = 64 * 1024  # client socket buffer under slow_body

REASONS = {
    400: "Bad Request", 403: "Forbidden", 404: "Not Found", 409: "Conflict",
    412: "Precondition Failed", 429: "Too Many Requests", 500: "Internal Server Error",
    502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout",
}
DEFAULT_CODES = {
    429: "SlowDown", 500: "InternalError", 503: "SlowDown", 502: "ServiceUnavailable",
    504: "ServiceUnavailable", 403: "AccessDenied", 404: "NoSuchKey",
}


# --------------------------------------------------------------------------
# SigV4 re-signing


def _uri_encode(s: str, *, keep_slash: bool) -> str:
    return urllib.parse.quote(s, safe="-_.~/" if keep_slash else "-_.~")


def _canonical_query(raw_query: str) -> str:
    pairs = urllib.parse.parse_qsl(raw_query, keep_blank_values=True)
    enc = sorted((_uri_encode(k, keep_slash=False), _uri_encode(v, keep_slash=False)) for k, v in pairs)
    return "&".join(f"{k}={v}" for k, v in enc)


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


_AUTH_RE = re.compile(
    r"AWS4-HMAC-SHA256\s+Credential=(?P<cred>[^,\s]+)\s*,\s*SignedHeaders=(?P<signed>[^,\s]+)\s*,"
    r"\s*Signature=(?P<sig>[0-9a-f]+)")


class ResignError(Exception):
    pass


def _raw_query(raw_query: str) -> str:
    """The query's pairs as the client encoded them, sorted (a client that
    encodes differently from AWS's rule signs this form)."""
    pairs = [p if "=" in p else p + "=" for p in raw_query.split("&") if p]
    return "&".join(sorted(pairs))


def sigv4_resign(method: str, raw_path: str, headers: list[tuple[str, str]], secret_key: str,
                 drop: set[str]) -> list[tuple[str, str]]:
    """Return `headers` without the (lower-case) names in `drop`, with a new
    Authorization header: SigV4 over the original signed headers less `drop`,
    the original x-amz-date, scope and x-amz-content-sha256. `raw_path` is the
    request target as sent (path and query, percent-encoded). The canonical
    path and query are built the way the client built them: of AWS's rule
    (decode, encode all but unreserved characters) and the client's own
    encoding, the one that reproduces the client's signature; ResignError if
    neither does (wrong secret, or a request we cannot reproduce)."""
    lower = [(n.lower(), v) for n, v in headers]
    auth = next((v for n, v in lower if n == "authorization"), None)
    if auth is None:
        raise ResignError("no Authorization header (presigned or anonymous request)")
    m = _AUTH_RE.match(auth.strip())
    if not m:
        raise ResignError(f"not a SigV4 header authorization: {auth[:40]!r}")
    access_key, date, region, service, term = m["cred"].split("/")
    payload = next((v for n, v in lower if n == "x-amz-content-sha256"), None)
    if payload is None:
        raise ResignError("no x-amz-content-sha256 header")
    if payload.startswith("STREAMING-AWS4-HMAC-SHA256"):
        raise ResignError("chunk signatures chained to the seed signature cannot be re-signed")
    amz_date = next((v for n, v in lower if n == "x-amz-date"), None)
    if amz_date is None:
        raise ResignError("no x-amz-date header")
    scope = f"{date}/{region}/{service}/{term}"
    k = _hmac(("AWS4" + secret_key).encode(), date)
    k = _hmac(k, region)
    k = _hmac(k, service)
    k = _hmac(k, term)

    def sign(signed: list[str], hdrs: list[tuple[str, str]], uri: str, query: str) -> str:
        canon_headers = ""
        for name in signed:
            values = [" ".join(v.strip().split()) for n, v in hdrs if n.lower() == name]
            canon_headers += f"{name}:{','.join(values)}\n"
        canonical = "\n".join([method, uri, query, canon_headers, ";".join(signed), payload])
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                             hashlib.sha256(canonical.encode()).hexdigest()])
        return hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()

    path, _, query = raw_path.partition("?")
    old_signed = m["signed"].split(";")
    for uri in (_uri_encode(urllib.parse.unquote(path), keep_slash=True), path):
        for q in (_canonical_query(query), _raw_query(query)):
            if hmac.compare_digest(sign(old_signed, headers, uri, q), m["sig"]):
                break
        else:
            continue
        break
    else:
        raise ResignError("cannot reproduce the client's signature (wrong secret?)")
    signed = [h for h in old_signed if h not in drop]
    kept = [(n, v) for n, v in headers if n.lower() not in drop and n.lower() != "authorization"]
    sig = sign(signed, kept, uri, q)
    new_auth = (f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, "
                f"SignedHeaders={';'.join(signed)}, Signature={sig}")
    return kept + [("Authorization", new_auth)]


# --------------------------------------------------------------------------
# requests seen and rules


@dataclass
class Seen:
    """One request as the proxy saw it. `status` is what upstream answered
    (None if it never did); `outcome` is what the client got: "forwarded",
    "failed" (a fail rule answered), "dropped" (reply withheld),
    "upstream-error: ..." (connection closed), "resign-unsupported", ...."""
    method: str
    path: str
    key: str | None
    query: str
    headers: list[tuple[str, str]]
    body_len: int = 0
    status: int | None = None
    outcome: str = "pending"
    rules: list[str] = field(default_factory=list)
    # set when the proxy is done with the request, whatever the outcome
    finished: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)


class Rule:
    """A rule switched on by one of FaultProxy's methods. It matches requests
    by method (e.g. "PUT", or a tuple), key prefix, and an optional predicate
    on the `Seen` record; it stays on until off() or until it has applied
    `times` times."""

    kind = "rule"

    def __init__(self, proxy: "FaultProxy", *, method=None, prefix=None, where=None, times=None):
        self.proxy = proxy
        self.methods = None if method is None else ({method} if isinstance(method, str) else set(method))
        self.prefix = prefix
        self.where = where
        self.times = times
        self.hits = 0
        self.active = True
        self.fired = threading.Event()  # set when it first applies to a request

    def matches(self, seen: Seen) -> bool:
        if not self.active:
            return False
        if self.methods is not None and seen.method not in self.methods:
            return False
        if self.prefix is not None and (seen.key is None or not seen.key.startswith(self.prefix)):
            return False
        if self.where is not None and not self.where(seen):
            return False
        return True

    def _take(self, seen: Seen) -> bool:
        """Under the proxy lock: count a hit if the rule matches."""
        if not self.matches(seen):
            return False
        self.hits += 1
        if self.times is not None and self.hits >= self.times:
            self.active = False
        seen.rules.append(self.kind)
        self.fired.set()
        return True

    def off(self) -> None:
        self.active = False

    def __repr__(self):
        return (f"<{self.kind} methods={self.methods} prefix={self.prefix!r} "
                f"hits={self.hits} active={self.active}>")


class StripConditions(Rule):
    kind = "strip_conditions"

    def __init__(self, proxy, *, resign=True, **kw):
        super().__init__(proxy, **kw)
        self.resign = resign


class Fail(Rule):
    kind = "fail"

    def __init__(self, proxy, *, status=503, code=None, message=None, **kw):
        super().__init__(proxy, **kw)
        self.status = status
        self.code = code or DEFAULT_CODES.get(status, "ServiceUnavailable")
        self.message = message or "Injected by the bulwark test fault proxy."


class SlowBody(Rule):
    """Forward the request body at `rate` bytes/s (None: full speed); with
    `hold_after`, forward that many bytes, set `holding`, and wait for
    release(). `started` is set once the request headers and the first body
    bytes have reached the upstream server; `done` once the body is all sent."""

    kind = "slow_body"

    def __init__(self, proxy, *, rate=None, hold_after=None, **kw):
        super().__init__(proxy, **kw)
        self.rate = rate
        self.hold_after = hold_after
        self.started = threading.Event()
        self.holding = threading.Event()
        self.done = threading.Event()
        self._release = threading.Event()

    def release(self) -> None:
        self._release.set()


class Pause(Rule):
    """Block matching requests until release(): before forwarding
    (stage="request") or after upstream answered, before the reply goes to the
    client (stage="reply"). `waiting` is set while at least one is held;
    `waiting_count()` says how many. release() lets every held request go and
    switches the rule off."""

    kind = "pause"

    def __init__(self, proxy, *, stage="request", **kw):
        super().__init__(proxy, **kw)
        if stage not in ("request", "reply"):
            raise ValueError(f"stage must be 'request' or 'reply', not {stage!r}")
        self.stage = stage
        self.kind = f"pause_{stage}"
        self.waiting = threading.Event()
        self._release = threading.Event()
        self._held = 0
        self._arrived = 0
        self._cond = threading.Condition()

    def waiting_count(self) -> int:
        """How many requests are held now."""
        with self._cond:
            return self._held

    def wait_for(self, n: int, timeout: float | None = None) -> bool:
        """Wait until `n` requests in all have arrived at this pause point
        (held now or released since); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._arrived >= n, timeout)

    def release(self) -> None:
        self.active = False
        self._release.set()

    def off(self) -> None:
        self.release()

    def _hold(self) -> None:
        with self._cond:
            self._held += 1
            self._arrived += 1
            self.waiting.set()
            self._cond.notify_all()
        try:
            self._release.wait(HOLD_TIMEOUT_S)
        finally:
            with self._cond:
                self._held -= 1
                if self._held == 0:
                    self.waiting.clear()


class DropReply(Rule):
    """Forward the request, read upstream's whole reply, then close the
    client's connection without sending it. `fired` is set once upstream has
    answered (the request landed); `statuses` lists what upstream answered."""

    kind = "drop_reply"

    def __init__(self, proxy, **kw):
        super().__init__(proxy, **kw)
        self.statuses: list[int] = []


# --------------------------------------------------------------------------
# the proxy


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256  # listen backlog: a client opening many connections at once


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "bulwark-fault-proxy"
    proxy: "FaultProxy"

    def log_message(self, fmt, *args):  # quiet
        pass

    def setup(self):
        super().setup()
        self.proxy._conn_opened(self.connection)

    def finish(self):
        try:
            super().finish()
        finally:
            self.proxy._conn_closed(self.connection)

    # every method goes through one path
    def do_GET(self):
        self._proxy()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_OPTIONS = do_PATCH = do_GET

    # -- client side helpers

    def _body_pieces(self):
        """Yield the request body as it arrives from the client, in pieces of
        at most PIECE bytes (a chunked body with its framing, to be relayed
        unchanged). Raises _ClientGone if the client goes mid-body."""
        rf = self.rfile
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            while True:
                line = rf.readline(65537)
                if not line:
                    raise _ClientGone("client closed mid-chunk")
                yield line
                try:
                    size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                except ValueError:
                    raise _ClientGone(f"bad chunk size line {line[:40]!r}")
                if size == 0:
                    while True:  # trailers, then the empty line
                        t = rf.readline(65537)
                        if not t:
                            raise _ClientGone("client closed in trailers")
                        yield t
                        if t in (b"\r\n", b"\n"):
                            return
                left = size + 2
                while left:
                    piece = rf.read1(min(PIECE, left))
                    if not piece:
                        raise _ClientGone("client closed mid-chunk")
                    left -= len(piece)
                    yield piece
        left = int(self.headers.get("Content-Length") or 0)
        while left:
            piece = rf.read1(min(PIECE, left))
            if not piece:
                raise _ClientGone("client closed mid-body")
            left -= len(piece)
            yield piece

    def _send_raw(self, status: int, reason: str, headers: list[tuple[str, str]], body: bytes | None):
        out = [f"HTTP/1.1 {status} {reason}\r\n"]
        for n, v in headers:
            out.append(f"{n}: {v}\r\n")
        out.append("\r\n")
        self.wfile.write("".join(out).encode("latin-1"))
        if body:
            self.wfile.write(body)
        self.wfile.flush()

    def _send_error_xml(self, rule: Fail, seen: Seen):
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{rule.code}</Code><Message>{rule.message}</Message>"
            f"<Resource>{seen.path}</Resource><RequestId>bulwark-fault-proxy</RequestId></Error>"
        ).encode()
        headers = [("Content-Type", "application/xml"), ("Content-Length", str(len(body))),
                   ("x-amz-request-id", "bulwark-fault-proxy")]
        if rule.status == 503 or rule.status == 429:
            headers.append(("Retry-After", "1"))
        self._send_raw(rule.status, REASONS.get(rule.status, "Error"), headers,
                       None if self.command == "HEAD" else body)

    # -- the request

    def _proxy(self):
        px = self.proxy
        path, _, query = self.path.partition("?")
        seen = Seen(method=self.command, path=path, key=px._key_of(path), query=query,
                    headers=list(self.headers.items()))
        px._record(seen)
        try:
            self._proxy_one(px, seen)
        finally:
            seen.finished.set()

    def _proxy_one(self, px: "FaultProxy", seen: Seen):
        headers = seen.headers
        chunked = "chunked" in (self.headers.get("Transfer-Encoding") or "").lower()
        body = self._counted(self._body_pieces(), seen)

        strip = px._take(StripConditions, seen)
        if strip is not None:
            drop = {n.lower() for n, _ in headers if n.lower() in CONDITION_HEADERS}
            if drop:
                signed = _signed_headers(headers)
                if strip.resign and signed & drop:
                    try:
                        headers = sigv4_resign(self.command, self.path, headers, px.secret_key, drop)
                    except ResignError as e:
                        seen.outcome = "resign-unsupported"
                        seen.rules.append(f"resign-unsupported: {e}")
                        headers = [(n, v) for n, v in headers if n.lower() not in drop]
                else:
                    headers = [(n, v) for n, v in headers if n.lower() not in drop]

        pause = px._take(Pause, seen, stage="request")
        if pause is not None:
            pause._hold()

        fail = px._take(Fail, seen)
        if fail is not None:
            try:
                for _ in body:  # read what the client sends, then answer
                    pass
            except (_ClientGone, OSError) as e:
                seen.outcome = f"client-error: {e}"
                self.close_connection = True
                return
            seen.outcome = "failed"
            seen.status = None
            self._send_error_xml(fail, seen)
            return

        slow = px._take(SlowBody, seen)
        if slow is not None:
            # keep little of the body in our socket buffer, so that a held or
            # slowed body holds the client back soon
            try:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_RCVBUF)
            except OSError:
                pass
        up = http.client.HTTPConnection(px.upstream_host, px.upstream_port, timeout=UPSTREAM_TIMEOUT_S)
        try:
            up.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for n, v in headers:
                ln = n.lower()
                if ln in HOP_BY_HOP:
                    continue
                if ln == "content-length" and chunked:
                    continue
                up.putheader(n, v)
            up.endheaders()
            body_error: list = []
            self._send_body(up, body, slow, body_error)
            if body_error:
                # upstream stopped reading: it may have answered early (an error)
                try:
                    resp = up.getresponse()
                except (OSError, http.client.HTTPException):
                    raise body_error[0]
                self.close_connection = True  # the rest of the body was not read
            else:
                resp = up.getresponse()
            seen.status = resp.status
            resp_headers = resp.getheaders()
            resp_chunked = resp.chunked
            length = resp.length
            if self.command == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200:
                payload, stream = b"", False
            elif resp_chunked or length is None:
                payload, stream = resp.read(), False
            else:
                payload, stream = None, True
            if not stream:
                resp.close()
        except _ClientGone as e:
            # the client went mid-body: abort upstream, which drops the partial body
            seen.outcome = f"client-error: {e} (upstream request aborted)"
            _abort(up)
            self.close_connection = True
            return
        except (OSError, http.client.HTTPException) as e:
            seen.outcome = f"upstream-error: {type(e).__name__}: {e}"
            _abort(up)
            self.close_connection = True
            return

        pause = px._take(Pause, seen, stage="reply")
        if pause is not None:
            pause._hold()

        drop = px._take(DropReply, seen)
        if drop is not None:
            drop.statuses.append(resp.status)
            if stream:
                try:
                    while resp.read(PIECE):
                        pass
                except (OSError, http.client.HTTPException):
                    pass
            up.close()
            seen.outcome = "dropped"
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return

        out_headers = []
        for n, v in resp_headers:
            ln = n.lower()
            if ln in HOP_BY_HOP or ln == "transfer-encoding":
                continue
            if ln == "content-length" and not stream and self.command != "HEAD":
                continue
            out_headers.append((n, v))
        if not stream and self.command != "HEAD" and resp.status not in (204, 304):
            out_headers.append(("Content-Length", str(len(payload))))
        if seen.outcome == "pending":
            seen.outcome = "forwarded"
        try:
            self._send_raw(resp.status, resp.reason or REASONS.get(resp.status, ""), out_headers,
                           payload if not stream else None)
            if stream:
                left = length
                while left > 0:
                    piece = resp.read(min(PIECE, left))
                    if not piece:
                        raise ConnectionError("upstream closed mid-body")
                    self.wfile.write(piece)
                    left -= len(piece)
                self.wfile.flush()
        except (OSError, http.client.HTTPException) as e:
            seen.outcome = f"upstream-error: {type(e).__name__}: {e}"
            self.close_connection = True
            up.close()
            return
        up.close()

    @staticmethod
    def _counted(pieces, seen: Seen):
        for p in pieces:
            seen.body_len += len(p)
            yield p

    def _send_body(self, up: http.client.HTTPConnection, body, slow: SlowBody | None,
                   body_error: list) -> None:
        """Send the client's body upstream as it arrives (paced and held
        under `slow`). A client gone mid-body raises _ClientGone; an upstream
        that fails is noted in body_error (its reply, if any, may still say why)."""
        try:
            if slow is None:
                for piece in body:
                    up.send(piece)
                return
            sent = 0
            step = PIECE if not slow.rate else max(1, min(PIECE, slow.rate // 20))
            t0 = time.monotonic()
            buf = b""
            pieces = iter(body)
            exhausted = False
            while True:
                if slow.hold_after is not None and sent == slow.hold_after and not slow._release.is_set():
                    slow.started.set()
                    slow.holding.set()
                    slow._release.wait(HOLD_TIMEOUT_S)
                    t0 = time.monotonic() - (sent / slow.rate if slow.rate else 0)
                want = step
                if slow.hold_after is not None and sent < slow.hold_after:
                    want = min(want, slow.hold_after - sent)
                while len(buf) < want and not exhausted:
                    try:
                        buf += next(pieces)
                    except StopIteration:
                        exhausted = True
                if not buf:
                    break
                out, buf = buf[:want], buf[want:]
                up.send(out)
                sent += len(out)
                slow.started.set()
                if slow.rate:
                    ahead = sent / slow.rate - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)  # pacing, not synchronisation
            slow.started.set()
        except _ClientGone:
            raise
        except OSError as e:
            body_error.append(e)
        finally:
            if slow is not None:
                slow.done.set()


class _ClientGone(Exception):
    pass


def _abort(up: http.client.HTTPConnection) -> None:
    """Close the upstream connection at once (RST, not FIN), so that the server
    sees a request cut short, not a complete one."""
    sock = up.sock
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    up.close()


def _signed_headers(headers: list[tuple[str, str]]) -> set[str]:
    auth = next((v for n, v in headers if n.lower() == "authorization"), "")
    m = _AUTH_RE.match(auth.strip())
    return set(m["signed"].split(";")) if m else set()


class FaultProxy:
    """A fault proxy in front of `upstream` (an http:// endpoint URL).

    FaultProxy(upstream, *, bucket=None, access_key=None, secret_key=None,
               region="us-east-1", host="127.0.0.1", port=0)

    `bucket` tells keys from bucket names in path-style URLs (without it, the
    first path segment is taken as the bucket). `secret_key` is needed only to
    re-sign requests under strip_conditions(resign=True). start()/stop(), or
    use it as a context manager; `endpoint` is "http://127.0.0.1:PORT"."""

    def __init__(self, upstream: str, *, bucket: str | None = None, access_key: str | None = None,
                 secret_key: str | None = None, region: str = "us-east-1",
                 host: str = "127.0.0.1", port: int = 0):
        u = urllib.parse.urlsplit(upstream)
        if u.scheme != "http":
            raise ValueError(f"upstream must be http://host:port, not {upstream!r}")
        self.upstream = upstream
        self.upstream_host = u.hostname
        self.upstream_port = u.port or 80
        self.bucket = bucket
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self._bind = (host, port)
        self._lock = threading.Lock()
        self._seen: list[Seen] = []
        self._rules: list[Rule] = []
        self._conns: set[socket.socket] = set()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def for_server(cls, server, **kw) -> "FaultProxy":
        """A proxy (not started) in front of an s3servers.S3Server, with its
        bucket and credentials."""
        return cls(server.endpoint, bucket=server.bucket, access_key=server.access_key,
                   secret_key=server.secret_key, region=server.region, **kw)

    # -- lifecycle

    def start(self) -> "FaultProxy":
        handler = type("Handler", (_Handler,), {"proxy": self})
        self._server = _Server(self._bind, handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3proxy",
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self.clear_rules()  # releases held requests
        self._server.shutdown()
        self._server.server_close()
        self.drop_connections()
        self._thread.join(10)
        self._server = None

    def __enter__(self):
        return self.start() if self._server is None else self

    def __exit__(self, *exc):
        self.stop()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def endpoint(self) -> str:
        return f"http://{self._server.server_address[0]}:{self.port}"

    def drop_connections(self) -> None:
        """Close every client connection now (as a network reset would)."""
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _conn_opened(self, c):
        with self._lock:
            self._conns.add(c)

    def _conn_closed(self, c):
        with self._lock:
            self._conns.discard(c)

    # -- counters

    def _key_of(self, path: str) -> str | None:
        p = urllib.parse.unquote(path)
        if self.bucket is not None:
            pre = f"/{self.bucket}/"
            if p.startswith(pre):
                return p[len(pre):]
            return None
        parts = p.lstrip("/").split("/", 1)
        return parts[1] if len(parts) == 2 else None

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self._seen.append(seen)

    def requests(self) -> list[Seen]:
        """A copy of the list of requests seen since the last reset_counts()."""
        with self._lock:
            return list(self._seen)

    def counts(self, method: str | None = None, prefix: str | None = None, *,
               status: int | None = None, outcome: str | None = None) -> int:
        """How many requests arrived (since reset_counts()) with this method,
        key prefix, upstream status and/or outcome. Requests a fail rule
        answered count too (the client made them)."""
        with self._lock:
            return sum(
                1 for s in self._seen
                if (method is None or s.method == method)
                and (prefix is None or (s.key is not None and s.key.startswith(prefix)))
                and (status is None or s.status == status)
                and (outcome is None or s.outcome == outcome))

    def total(self) -> int:
        with self._lock:
            return len(self._seen)

    def reset_counts(self) -> None:
        with self._lock:
            self._seen.clear()

    # -- rules

    def _add(self, rule: Rule) -> Rule:
        with self._lock:
            self._rules.append(rule)
        return rule

    def _take(self, cls, seen: Seen, stage: str | None = None):
        with self._lock:
            for r in self._rules:
                if type(r) is cls and (stage is None or r.stage == stage) and r._take(seen):
                    return r
        return None

    def rules(self) -> list[Rule]:
        with self._lock:
            return [r for r in self._rules if r.active]

    def clear_rules(self) -> None:
        """Switch every rule off and release every held request."""
        with self._lock:
            rules, self._rules = self._rules, []
        for r in rules:
            r.off()
            if isinstance(r, (SlowBody, Pause)):
                r._release.set()

    def strip_conditions(self, *, resign: bool = True, method=None, prefix=None, where=None,
                         times=None) -> StripConditions:
        """Remove If-Match and If-None-Match from matching requests (a store
        that ignores conditions). With resign=True, requests whose signature
        covers them are signed again (needs secret_key); with resign=False
        they go out with a signature that no longer verifies."""
        if resign and not self.secret_key:
            raise ValueError("strip_conditions(resign=True) needs FaultProxy(secret_key=...)")
        return self._add(StripConditions(self, resign=resign, method=method, prefix=prefix,
                                         where=where, times=times))

    def fail(self, *, status: int = 503, code: str | None = None, message: str | None = None,
             method=None, prefix=None, where=None, times=None) -> Fail:
        """Answer matching requests with `status` and an S3 XML error body
        (code SlowDown for 503 and 429 unless `code`), without forwarding."""
        return self._add(Fail(self, status=status, code=code, message=message, method=method,
                              prefix=prefix, where=where, times=times))

    def fail_503(self, **kw) -> Fail:
        return self.fail(status=503, **kw)

    def slow_body(self, *, rate: int | None = None, hold_after: int | None = None,
                  method="PUT", prefix=None, where=None, times=None) -> SlowBody:
        """Forward matching request bodies at `rate` bytes/s and/or hold them
        after `hold_after` bytes until release(); events started, holding, done."""
        return self._add(SlowBody(self, rate=rate, hold_after=hold_after, method=method,
                                  prefix=prefix, where=where, times=times))

    def drop_reply(self, *, method=None, prefix=None, where=None, times=1) -> DropReply:
        """Forward matching requests, then close the client's connection
        instead of sending upstream's reply ("the PUT landed, its reply was
        lost"). Applies once unless `times` says otherwise (None: until off())."""
        return self._add(DropReply(self, method=method, prefix=prefix, where=where, times=times))

    def pause(self, *, stage: str = "request", method=None, prefix=None, where=None,
              times=None) -> Pause:
        """Hold matching requests (before forwarding, or with stage="reply"
        after upstream answered) until release(); `waiting` is set while one is held."""
        return self._add(Pause(self, stage=stage, method=method, prefix=prefix, where=where,
                               times=times))
