"""Helpers for the network-access scenarios (TLS, grants, rate limiting,
audit): certificates made with the `openssl` command, PSK files, a pool
served on TCP with TLS (on a loopback port the daemon picks itself), and a
raw NBD client (Python's ssl module) that shows exactly what the server sends
before and after STARTTLS.
"""

from __future__ import annotations

import os
import secrets
import socket
import ssl
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from conftest import Pool, run

NBD_MAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
OPT_REPLY_MAGIC = 0x0003E889045565A9
OPT_ABORT, OPT_LIST, OPT_STARTTLS, OPT_INFO, OPT_GO, OPT_STRUCTURED_REPLY = 2, 3, 5, 6, 7, 8
REP_ACK, REP_SERVER, REP_INFO = 1, 2, 3
REP_ERR_TLS_REQD = (1 << 31) + 5
REP_ERR_UNKNOWN = (1 << 31) + 6


def tcp_port(pool: Pool) -> int:
    """The port of the started daemon's NBD TCP listener, from `status --json`
    (`serve --nbd-listen 127.0.0.1:0` binds one the kernel picks: no other
    socket can take it between choosing it and listening on it)."""
    addr = pool.status()["daemon"]["nbd_tcp"]
    assert addr, f"the daemon reports no NBD TCP listener: {addr!r}"
    return int(addr.rsplit(":", 1)[1])


def _openssl(*args, cwd: Path) -> None:
    run(["openssl", *args], cwd=cwd)


def write_private(path: Path, data: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(data)
    return path


@dataclass
class Pki:
    """A CA, a server certificate for 127.0.0.1, and client credentials.

    `server_dir` is what `--tls-certificates` takes; each client directory
    holds ca-cert.pem, client-cert.pem and client-key.pem, the layout qemu's
    tls-creds-x509 and libnbd's tls-certificates read."""
    root: Path
    server_dir: Path

    def client(self, cn: str, ca: str = "ca") -> Path:
        """Client credentials with this CN, signed by CA `ca` ("ca", or
        another name for a CA the server does not trust)."""
        d = self.root / f"client-{cn}-{ca}"
        d.mkdir()
        ca_dir = self.ca(ca)
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", d / "client-key.pem",
                 "-out", d / "client.csr", "-subj", f"/CN={cn}", cwd=d)
        (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
        _openssl("x509", "-req", "-in", d / "client.csr", "-CA", ca_dir / "ca-cert.pem",
                 "-CAkey", ca_dir / "ca-key.pem", "-CAcreateserial", "-out", d / "client-cert.pem",
                 "-days", "2", "-extfile", d / "client.ext", cwd=d)
        # The client trusts the server's CA, whoever signed its own certificate.
        (d / "ca-cert.pem").write_bytes((self.server_dir / "ca-cert.pem").read_bytes())
        return d

    def ca(self, name: str) -> Path:
        d = self.root / f"ca-{name}"
        if not d.exists():
            d.mkdir()
            _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", d / "ca-key.pem",
                     "-out", d / "ca-cert.pem", "-days", "2", "-subj", f"/CN=bulwark test {name}",
                     cwd=d)
        return d

    @staticmethod
    def fingerprint(client_dir: Path) -> str:
        """sha256:HEX of the client certificate, as grants name it."""
        r = run(["openssl", "x509", "-noout", "-fingerprint", "-sha256",
                 "-in", client_dir / "client-cert.pem"])
        hexcolons = r.stdout.strip().split("=", 1)[1]
        return "sha256:" + hexcolons.replace(":", "").lower()


def make_pki(root: Path) -> Pki:
    root.mkdir(parents=True, exist_ok=True)
    server = root / "server"
    server.mkdir()
    pki = Pki(root, server)
    ca = pki.ca("ca")
    (server / "ca-cert.pem").write_bytes((ca / "ca-cert.pem").read_bytes())
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", server / "server-key.pem",
             "-out", server / "server.csr", "-subj", "/CN=localhost", cwd=server)
    (server / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", server / "server.csr", "-CA", ca / "ca-cert.pem",
             "-CAkey", ca / "ca-key.pem", "-CAcreateserial", "-out", server / "server-cert.pem",
             "-days", "2", "-extfile", server / "server.ext", cwd=server)
    os.chmod(server / "server-key.pem", 0o600)
    return pki


def make_psk(dir: Path, identities: dict[str, str] | list[str]) -> tuple[Path, dict[str, str]]:
    """A keys.psk file (identity:hexkey lines, psktool's format) in `dir`,
    mode 0600; returns its path and {identity: hexkey}."""
    dir.mkdir(parents=True, exist_ok=True)
    keys = identities if isinstance(identities, dict) else {
        i: secrets.token_hex(32) for i in identities}
    path = write_private(dir / "keys.psk", "".join(f"{i}:{k}\n" for i, k in keys.items()))
    return path, keys


def start_tls_pool(make_pool, *tls_args, device_size="512M") -> tuple[Pool, int]:
    """A started pool whose NBD TCP listener on 127.0.0.1 requires TLS."""
    p = make_pool(device_size=device_size,
                  serve_args=["--nbd-listen", "127.0.0.1:0", *tls_args])
    p.create().start()
    port = tcp_port(p)
    # A restart listens on the same port again, as a configured daemon would.
    p.serve_args[1] = f"127.0.0.1:{port}"
    return p, port


# --------------------------------------------------------------------------
# a raw NBD client


class RawNbd:
    """Fixed-newstyle option haggling by hand, over plain TCP or, after
    STARTTLS, over TLS (Python's ssl module with a client certificate)."""

    def __init__(self, port: int, timeout: float = 60):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.s = self.sock
        magic, opt, flags = struct.unpack(">QQH", self._recv(18))
        assert (magic, opt) == (NBD_MAGIC, IHAVEOPT), "not an NBD fixed-newstyle server"
        self.s.sendall(struct.pack(">I", 3))  # FIXED_NEWSTYLE | NO_ZEROES

    def _recv(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.s.recv(n - len(out))
            if not chunk:
                raise ConnectionError("server closed the connection")
            out += chunk
        return out

    def option(self, opt: int, data: bytes = b"") -> list[tuple[int, bytes]]:
        """Send one option, return its replies up to the final one."""
        self.s.sendall(struct.pack(">QII", IHAVEOPT, opt, len(data)) + data)
        replies = []
        while True:
            magic, ropt, rtype, length = struct.unpack(">QIII", self._recv(20))
            assert magic == OPT_REPLY_MAGIC and ropt == opt
            replies.append((rtype, self._recv(length)))
            if rtype == REP_ACK or rtype & (1 << 31):
                return replies

    def list(self) -> list[tuple[int, bytes]]:
        return self.option(OPT_LIST)

    @staticmethod
    def names(replies) -> list[str]:
        out = []
        for rtype, payload in replies:
            if rtype == REP_SERVER:
                (n,) = struct.unpack(">I", payload[:4])
                out.append(payload[4:4 + n].decode())
        return out

    def go(self, name: str, opt: int = OPT_GO) -> list[tuple[int, bytes]]:
        b = name.encode()
        return self.option(opt, struct.pack(">I", len(b)) + b + struct.pack(">H", 0))

    def starttls(self, client_dir: Path | None, ca: Path) -> None:
        replies = self.option(OPT_STARTTLS)
        assert replies == [(REP_ACK, b"")], f"STARTTLS refused: {replies}"
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(cafile=str(ca))
        ctx.check_hostname = False
        if client_dir is not None:
            ctx.load_cert_chain(str(client_dir / "client-cert.pem"),
                                str(client_dir / "client-key.pem"))
        self.s = ctx.wrap_socket(self.sock, server_hostname="localhost")
        # TLS 1.3 reports a refused client certificate only on the first read.

    def close(self) -> None:
        try:
            self.s.close()
        except OSError:
            pass


def timed(f, *args, **kw) -> tuple[float, object]:
    """(seconds taken, result or the exception raised) of f(*args)."""
    t = time.monotonic()
    try:
        r = f(*args, **kw)
    except Exception as e:  # noqa: BLE001 - the caller inspects it
        r = e
    return time.monotonic() - t, r


def nbdinfo_list(uri: str) -> subprocess.CompletedProcess:
    return run(["nbdinfo", "--list", "--json", uri], check=False, timeout=120)
