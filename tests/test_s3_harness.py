"""The object-store test harness itself, with boto3 and no bulwark: the S3
servers (tests/helpers/s3servers.py) honour the conditional writes that
fencing depends on, and the fault proxy (tests/helpers/s3proxy.py) does what
each rule says. The object-store tests of bulwark rely on both: a server that
stopped honouring If-Match/If-None-Match would turn fencing tests into false
passes, so these run first and name the server and the condition that failed.

Stores tried (and what they honour) are listed in docs; as of this harness:
moto 5.2 and versitygw v1.8.0 (posix) refuse a second If-None-Match: * PUT
with 412, a stale If-Match PUT with 412, an If-Match PUT on a missing key with
404, and let exactly one of several concurrent If-None-Match: * PUTs win.
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import sys
import threading

import pytest

from conftest import HELPERS

sys.path.insert(0, str(HELPERS))
import s3proxy  # noqa: E402
from s3proxy import FaultProxy  # noqa: E402
from s3servers import SERVER_KINDS, start_moto, start_server, versitygw_server  # noqa: E402,F401

EVENT_TIMEOUT_S = 20


@pytest.fixture(scope="module", params=SERVER_KINDS)
def server(request, tmp_path_factory):
    """One server of each kind for the whole module (tests use their own keys)."""
    with start_server(request.param, tmp_path_factory.mktemp(request.param)) as s:
        yield s


@pytest.fixture
def proxy(server):
    with FaultProxy.for_server(server) as p:
        yield p


@pytest.fixture
def key(request):
    """A key of the test's own, so that tests sharing a server do not meet
    (letters, digits and -_./ only: moto's signature check fails on keys with
    other characters that SigV4 percent-encodes, e.g. [ ] = : + , @)."""
    name = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in request.node.name)
    return f"t/{name}/obj"


def status_of(exc) -> tuple[int, str]:
    r = exc.response
    return r["ResponseMetadata"]["HTTPStatusCode"], r["Error"]["Code"]


def put(client, bucket, key, body, **kw):
    return client.put_object(Bucket=bucket, Key=key, Body=body, **kw)["ETag"]


def get(client, bucket, key):
    return client.get_object(Bucket=bucket, Key=key)["Body"].read()


def refused(server, fn) -> tuple[int, str]:
    from botocore.exceptions import ClientError
    try:
        fn()
    except ClientError as e:
        return status_of(e)
    pytest.fail(f"{server!r}: the request was accepted; it must be refused")


# --------------------------------------------------------------------------
# conditions the fencing depends on, straight to the server


def test_if_none_match_star_refuses_second_put(server, key):
    c = server.client()
    put(c, server.bucket, key, b"first", IfNoneMatch="*")
    st = refused(server, lambda: put(c, server.bucket, key, b"second", IfNoneMatch="*"))
    assert st == (412, "PreconditionFailed"), f"{server!r}: second create-if-absent: {st}"
    assert get(c, server.bucket, key) == b"first"


def test_if_match_stale_etag_refused(server, key):
    c = server.client()
    e1 = put(c, server.bucket, key, b"v1")
    e2 = put(c, server.bucket, key, b"v2")
    assert e1 != e2
    st = refused(server, lambda: put(c, server.bucket, key, b"v3", IfMatch=e1))
    assert st == (412, "PreconditionFailed"), f"{server!r}: stale If-Match: {st}"
    assert get(c, server.bucket, key) == b"v2"
    e3 = put(c, server.bucket, key, b"v3", IfMatch=e2)  # the current ETag is accepted
    assert get(c, server.bucket, key) == b"v3" and e3 not in (e1, e2)


def test_if_match_on_missing_key_refused(server, key):
    """(MinIO once let If-Match succeed on a missing key.)"""
    c = server.client()
    st = refused(server, lambda: put(c, server.bucket, key, b"x", IfMatch='"0123456789abcdef0123456789abcdef"'))
    assert st[0] in (404, 412), f"{server!r}: If-Match on a missing key: {st}"
    assert server.keys(key) == []


def test_concurrent_creates_one_wins(server, proxy, key):
    """Several If-None-Match: * PUTs of one key released at once (held at the
    proxy until all have arrived): exactly one wins, the others get 412."""
    n = 8
    hold = proxy.pause(method="PUT", prefix=key)
    c = server.client(proxy.endpoint)
    results: list = [None] * n

    def one(i):
        from botocore.exceptions import ClientError
        try:
            put(c, server.bucket, key, f"writer {i}".encode(), IfNoneMatch="*")
            results[i] = "won"
        except ClientError as e:
            results[i] = status_of(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    assert hold.wait_for(n, EVENT_TIMEOUT_S), f"only {hold.waiting_count()} PUTs reached the proxy"
    hold.release()
    for t in threads:
        t.join(EVENT_TIMEOUT_S)
    winners = [i for i, r in enumerate(results) if r == "won"]
    assert len(winners) == 1, f"{server!r}: concurrent create-if-absent: {results}"
    assert all(r == (412, "PreconditionFailed") for i, r in enumerate(results) if i not in winners), results
    assert get(server.client(), server.bucket, key) == f"writer {winners[0]}".encode()


# --------------------------------------------------------------------------
# the proxy: forwarding


def test_proxy_forwards_signed_requests(server, proxy, key):
    """Host goes through verbatim, so signatures made for the proxy's address
    verify upstream (both servers check them); ranged GET, HEAD, list, delete."""
    c = server.client(proxy.endpoint)
    body = bytes(range(256)) * 1024
    etag = put(c, server.bucket, key, body)
    assert etag.strip('"') == hashlib.md5(body).hexdigest()
    r = c.get_object(Bucket=server.bucket, Key=key, Range="bytes=1000-1999")
    assert r["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert r["Body"].read() == body[1000:2000]
    assert c.head_object(Bucket=server.bucket, Key=key)["ContentLength"] == len(body)
    assert get(c, server.bucket, key) == body
    assert [o["Key"] for o in c.list_objects_v2(Bucket=server.bucket, Prefix=key)["Contents"]] == [key]
    c.delete_object(Bucket=server.bucket, Key=key)
    assert server.keys(key) == []
    assert [s.outcome for s in proxy.requests()] == ["forwarded"] * 6
    if server.verifies_signatures:  # a wrong secret is refused upstream
        bad = server.client(proxy.endpoint, secret_key="not-the-secret")
        assert refused(server, lambda: bad.list_objects_v2(Bucket=server.bucket))[0] == 403


def test_counters(server, proxy, key):
    c = server.client(proxy.endpoint)
    for i in range(3):
        put(c, server.bucket, f"{key}/seg/{i}", b"s")
    put(c, server.bucket, f"{key}/sb", b"sb")
    get(c, server.bucket, f"{key}/seg/0")
    c.head_object(Bucket=server.bucket, Key=f"{key}/sb")
    assert proxy.counts("PUT") == 4
    assert proxy.counts("PUT", prefix=f"{key}/seg/") == 3
    assert proxy.counts(prefix=f"{key}/seg/") == 4
    assert proxy.counts("HEAD") == 1
    assert proxy.counts("PUT", status=200) == 4
    assert proxy.total() == 6
    proxy.reset_counts()
    assert proxy.total() == 0 and proxy.counts("PUT") == 0
    get(c, server.bucket, f"{key}/sb")
    assert proxy.counts("GET", prefix=f"{key}/sb") == 1 and proxy.total() == 1


# --------------------------------------------------------------------------
# the proxy: a store that ignores conditions


def test_strip_rule_makes_conditions_ignored(server, proxy, key):
    """Through the proxy with strip_conditions on (re-signing: botocore and
    object_store both sign If-Match/If-None-Match), the refused PUTs succeed."""
    c = server.client(proxy.endpoint)
    e1 = put(c, server.bucket, key, b"first", IfNoneMatch="*")
    put(c, server.bucket, key, b"newer")
    rule = proxy.strip_conditions()
    put(c, server.bucket, key, b"second", IfNoneMatch="*")  # 412 without the rule
    put(c, server.bucket, key, b"third", IfMatch=e1)        # stale: 412 without the rule
    assert get(server.client(), server.bucket, key) == b"third"
    assert rule.hits >= 2 and rule.fired.is_set()
    sent = [s for s in proxy.requests() if s.method == "PUT"]
    assert all("strip_conditions" in s.rules for s in sent[2:]), sent
    # keys with characters SigV4 percent-encodes (moto's own check cannot take them)
    odd = f"{key}-odd/a=b:c+d@e,f;g h"  # (versitygw posix: no key under a key)
    put(c, server.bucket, odd, b"1", IfNoneMatch="*")
    put(c, server.bucket, odd, b"2", IfNoneMatch="*")
    assert get(c, server.bucket, odd) == b"2"
    assert all(s.outcome == "forwarded" for s in proxy.requests()), proxy.requests()
    rule.off()
    assert refused(server, lambda: put(c, server.bucket, key, b"x", IfNoneMatch="*")) == \
        (412, "PreconditionFailed")


def test_strip_rule_without_resigning_breaks_the_signature(server, proxy, key):
    """The condition headers are signed: stripped without re-signing, the
    request is refused as forged (403), not silently unconditional."""
    if not server.verifies_signatures:
        pytest.skip(f"{server.kind} started without signature checks "
                    f"(test_moto_checking_signatures covers moto)")
    c = server.client(proxy.endpoint)
    put(c, server.bucket, key, b"first")
    rule = proxy.strip_conditions(resign=False)
    st = refused(server, lambda: put(c, server.bucket, key, b"second", IfNoneMatch="*"))
    assert st[0] == 403, st
    assert get(server.client(), server.bucket, key) == b"first"
    # a proxy with the wrong secret cannot re-sign: it says so, the server refuses
    rule.off()
    with FaultProxy(server.endpoint, bucket=server.bucket, secret_key="wrong") as px:
        px.strip_conditions()
        st = refused(server, lambda: put(server.client(px.endpoint), server.bucket, key, b"third",
                                         IfNoneMatch="*"))
        assert st[0] == 403, st
        assert px.requests()[-1].outcome == "resign-unsupported"
    assert get(server.client(), server.bucket, key) == b"first"


def test_moto_checking_signatures(tmp_path):
    """moto with its signature checks on: the proxy forwards signed requests,
    re-signs stripped ones, and a stripped request left unsigned is refused."""
    with start_moto(tmp_path, verify_signatures=True) as s:
        assert s.verifies_signatures
        with FaultProxy(s.endpoint, bucket=s.bucket, secret_key=s.secret_key) as px:
            c = s.client(px.endpoint)
            key = "sig/obj"
            put(c, s.bucket, key, b"first", IfNoneMatch="*")
            assert refused(s, lambda: put(c, s.bucket, key, b"x", IfNoneMatch="*")) == \
                (412, "PreconditionFailed")
            bad = s.client(px.endpoint, secret_key="not-the-secret")
            assert refused(s, lambda: put(bad, s.bucket, key, b"x"))[0] == 403
            rule = px.strip_conditions(resign=False)
            assert refused(s, lambda: put(c, s.bucket, key, b"x", IfNoneMatch="*"))[0] == 403
            rule.off()
            px.strip_conditions()
            put(c, s.bucket, key, b"second", IfNoneMatch="*")
            assert get(c, s.bucket, key) == b"second"
        with pytest.raises(RuntimeError, match="in memory"):
            s.restart()  # moto's objects are in memory: no restart


def test_resign_matches_botocore():
    """The proxy's SigV4 re-signing gives what botocore's SigV4Auth signs for
    the request without the dropped headers."""
    pytest.importorskip("botocore")
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    import datetime
    from unittest import mock
    now = datetime.datetime(2026, 1, 2, 3, 4, 5)
    clock = mock.patch("botocore.auth.get_current_datetime", return_value=now)
    clock.start()
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    url = "http://127.0.0.1:9000/bkt/pool%20a/seg/0001~x?uploads=&x-id=PutObject"

    def signed(extra):
        req = AWSRequest(method="PUT", url=url, data=b"body",
                         headers={"If-None-Match": "*", "x-amz-meta-writer": " a  b ", **extra})
        S3SigV4Auth(creds, "s3", "us-east-1").add_auth(req)
        return req

    full = signed({})
    headers = [("Host", "127.0.0.1:9000")] + list(full.headers.items())
    path = url.split("9000", 1)[1]
    again = dict(s3proxy.sigv4_resign("PUT", path, headers, creds.secret_key, drop=set()))
    assert again["Authorization"] == full.headers["Authorization"]

    stripped = dict(s3proxy.sigv4_resign("PUT", path, headers, creds.secret_key, drop={"if-none-match"}))
    assert "If-None-Match" not in stripped
    ref = AWSRequest(method="PUT", url=url, data=b"body", headers={"x-amz-meta-writer": " a  b "})
    S3SigV4Auth(creds, "s3", "us-east-1").add_auth(ref)
    clock.stop()
    assert stripped["Authorization"] == ref.headers["Authorization"]


# --------------------------------------------------------------------------
# the proxy: failures


def test_fail_rule_503(server, proxy, key):
    c = server.client(proxy.endpoint)
    rule = proxy.fail_503()
    st = refused(server, lambda: put(c, server.bucket, key, b"x"))
    assert st == (503, "SlowDown")
    assert refused(server, lambda: c.list_objects_v2(Bucket=server.bucket))[0] == 503
    assert server.keys(key) == []
    assert proxy.counts("PUT", outcome="failed") == 1
    rule.off()
    put(c, server.bucket, key, b"x")
    assert get(c, server.bucket, key) == b"x"
    # matching ones only, a given number of times: boto3's retries get through
    proxy.reset_counts()
    rule = proxy.fail(status=503, method="GET", prefix=key, times=2)
    retrying = server.client(proxy.endpoint, attempts=3)
    assert get(retrying, server.bucket, key) == b"x"
    assert rule.hits == 2 and not rule.active
    assert proxy.counts("GET", prefix=key) == 3 and proxy.counts("GET", outcome="failed") == 2


def test_drop_reply_rule(server, proxy, key):
    """The PUT lands but its reply is lost: the client sees the connection
    close; the object is there; a blind retry of the create gets 412 for its
    own write."""
    from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError
    c = server.client(proxy.endpoint)
    rule = proxy.drop_reply(method="PUT", prefix=key)
    with pytest.raises((ConnectionClosedError, EndpointConnectionError)):
        put(c, server.bucket, key, b"landed", IfNoneMatch="*")
    assert rule.fired.is_set() and rule.statuses == [200] and not rule.active
    assert get(server.client(), server.bucket, key) == b"landed"
    with pytest.raises(ClientError) as e:
        put(c, server.bucket, key, b"landed", IfNoneMatch="*")
    assert status_of(e.value) == (412, "PreconditionFailed")
    assert proxy.counts("PUT", outcome="dropped") == 1


def test_slow_body_rule(server, proxy, key):
    """A held body: the test sees the upload start, the object is absent
    until released, then the PUT completes whole."""
    c = server.client(proxy.endpoint)
    body = b"z" * (256 * 1024)
    rule = proxy.slow_body(hold_after=4096, rate=4 * 1024 * 1024, prefix=key)
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("etag", put(c, server.bucket, key, body)))
    t.start()
    assert rule.started.wait(EVENT_TIMEOUT_S) and rule.holding.wait(EVENT_TIMEOUT_S)
    assert server.keys(key) == []
    assert not rule.done.is_set()
    rule.release()
    t.join(EVENT_TIMEOUT_S)
    assert rule.done.is_set()
    assert done["etag"].strip('"') == hashlib.md5(body).hexdigest()
    assert get(server.client(), server.bucket, key) == body


def test_client_gone_mid_body_leaves_no_object(server, proxy, key):
    """The client (the daemon, killed) goes mid-body while the proxy holds the
    body: the proxy aborts the upstream request, and no object appears."""
    import socket
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    # Far more than the socket buffers between the two can hold (a few MiB on loopback):
    # what the sender had queued when it was shut down still arrives, and must not be
    # all of it.
    body = b"d" * (32 * 1024 * 1024)
    url = f"{proxy.endpoint}/{server.bucket}/{key}"
    req = AWSRequest(method="PUT", url=url, data=body, headers={"Content-Length": str(len(body))})
    S3SigV4Auth(Credentials(server.access_key, server.secret_key), "s3", server.region).add_auth(req)
    rule = proxy.slow_body(hold_after=256 * 1024, prefix=key)
    sock = socket.create_connection(("127.0.0.1", proxy.port))
    head = f"PUT /{server.bucket}/{key} HTTP/1.1\r\nHost: 127.0.0.1:{proxy.port}\r\n" + "".join(
        f"{n}: {v}\r\n" for n, v in req.headers.items()) + "\r\n"
    sender = threading.Thread(target=lambda: _send_until_closed(sock, head.encode() + body))
    sender.start()
    assert rule.holding.wait(EVENT_TIMEOUT_S), proxy.requests()
    sock.shutdown(socket.SHUT_RDWR)  # as the kernel does for a killed process
    sock.close()
    sender.join(EVENT_TIMEOUT_S)
    rule.release()
    seen = proxy.requests()[-1]
    assert seen.finished.wait(EVENT_TIMEOUT_S)
    assert seen.outcome.startswith("client-error"), seen.outcome
    assert 256 * 1024 <= seen.body_len < len(body)
    assert server.keys(key) == []


def _send_until_closed(sock, data):
    try:
        sock.sendall(data)
    except OSError:
        pass


def test_pause_rule(server, proxy, key):
    c = server.client(proxy.endpoint)
    put(c, server.bucket, key, b"v")
    rule = proxy.pause(method="GET", prefix=key)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("v", get(c, server.bucket, key)))
    t.start()
    assert rule.waiting.wait(EVENT_TIMEOUT_S) and rule.waiting_count() == 1
    assert "v" not in got
    rule.release()
    t.join(EVENT_TIMEOUT_S)
    assert got["v"] == b"v" and not rule.waiting.is_set()
    # stage="reply": the write has landed while its reply is held
    rule = proxy.pause(stage="reply", method="PUT", prefix=key)
    t = threading.Thread(target=lambda: put(c, server.bucket, key, b"w"))
    t.start()
    assert rule.waiting.wait(EVENT_TIMEOUT_S)
    assert get(server.client(), server.bucket, key) == b"w"
    rule.release()
    t.join(EVENT_TIMEOUT_S)
    assert not t.is_alive()


# --------------------------------------------------------------------------
# killing the server mid-upload (versitygw: its objects survive a restart)


def test_versitygw_kill_mid_body_and_restart(versitygw_server, key):
    s = versitygw_server
    c = s.client()
    put(c, s.bucket, f"{key}/kept", b"kept")
    with FaultProxy(s.endpoint, bucket=s.bucket) as px:
        rule = px.slow_body(hold_after=64 * 1024, prefix=f"{key}/seg")
        pc = s.client(px.endpoint)
        err = {}

        def upload():
            try:
                put(pc, s.bucket, f"{key}/seg", b"q" * (1024 * 1024))
            except Exception as e:  # noqa: BLE001 - the client's view, checked below
                err["e"] = e

        t = threading.Thread(target=upload)
        t.start()
        assert rule.holding.wait(EVENT_TIMEOUT_S)
        s.kill()
        rule.release()
        t.join(EVENT_TIMEOUT_S)
        assert "e" in err, "the PUT succeeded although the server was killed mid-body"
        assert px.counts("PUT", prefix=f"{key}/seg") == 1
        assert px.requests()[-1].outcome.startswith("upstream-error")
    s.restart()
    assert s.keys(key) == [f"{key}/kept"], "a partial object after the kill"
    assert get(c, s.bucket, f"{key}/kept") == b"kept"


def test_credentials_file(server, tmp_path):
    p = server.write_credentials(tmp_path / "creds")
    assert (p.stat().st_mode & 0o777) == 0o600
    assert p.read_text().splitlines() == [
        f"AWS_ACCESS_KEY_ID={server.access_key}",
        f"AWS_SECRET_ACCESS_KEY={server.secret_key}",
        "AWS_REGION=us-east-1",
    ]


# --------------------------------------------------------------------------
# the proxy against an upstream that answers chunked, close-delimited, keep-alive


class _Odd(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):
        if self.path == "/b/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"hello ", b"chunked ", b"world"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
        elif self.path == "/b/close":
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"until close")
            self.close_connection = True
        else:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

    def do_PUT(self):
        te = self.headers.get("Transfer-Encoding", "")
        if "chunked" in te:
            data = b""
            while True:
                n = int(self.rfile.readline().split(b";")[0], 16)
                if n == 0:
                    self.rfile.readline()
                    break
                data += self.rfile.read(n)
                self.rfile.readline()
        else:
            data = self.rfile.read(int(self.headers["Content-Length"]))
        out = b"got " + data
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_HEAD(self):
        self.send_response(200)
        self.send_header("Content-Length", "12345")
        self.end_headers()


def test_proxy_http_framing():
    up = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Odd)
    threading.Thread(target=up.serve_forever, daemon=True).start()
    try:
        with FaultProxy(f"http://127.0.0.1:{up.server_address[1]}", bucket="b") as px:
            conn = http.client.HTTPConnection("127.0.0.1", px.port, timeout=10)
            for path, want in (("/b/chunked", b"hello chunked world"), ("/b/close", b"until close")):
                conn.request("GET", path)
                r = conn.getresponse()
                assert (r.status, r.read()) == (200, want)
                assert r.getheader("Content-Length") == str(len(want))
            conn.request("HEAD", "/b/x")
            r = conn.getresponse()
            assert r.status == 200 and r.getheader("Content-Length") == "12345" and r.read() == b""
            conn.request("PUT", "/b/y", body=b"abc")
            r = conn.getresponse()
            assert r.read() == b"got abc"
            conn.request("PUT", "/b/z", body=iter([b"chunk", b"ed"]), encode_chunked=True)
            r = conn.getresponse()
            assert r.read() == b"got chunked"
            conn.close()
            # all on one client connection
            assert px.total() == 5 and {s.outcome for s in px.requests()} == {"forwarded"}
            assert [s.key for s in px.requests()] == ["chunked", "close", "x", "y", "z"]
    finally:
        up.shutdown()
        up.server_close()
