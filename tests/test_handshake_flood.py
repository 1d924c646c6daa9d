"""A stranger without a credential cannot lock out those who have one.

One address (127.0.0.2) opens 1,030 connections to the TLS listener and
never starts TLS. Only `--max-startups-per-address` (16) of them are
greeted; the rest are closed at once, and each of those counts as a failure
of the address. Meanwhile a client with a certificate, from another
address, lists, opens and reads its volume, and the owner reads on the
unix socket. The stranger's greeted connections are dropped once
`--tls-timeout` has passed, and when it comes back its back-off has not
been reset: it is refused at once, or its greeting comes only after the
longest back-off (5 s), as the daemon's log says.

Before these bounds, all 1,030 were greeted and held for the 60 s
handshake timeout, and the certificate client was told "too many
connections"."""

import os
import re
import resource
import selectors
import socket
import time

import pytest

from conftest import WAIT_TIMEOUT_S, qemu_io_ok, require_tools, run, wait_until
from tlsutil import make_pki, nbdinfo_list, start_tls_pool

STRANGER = "127.0.0.2"
CONNECTIONS = 1030
PER_ADDRESS = 16  # serve --max-startups-per-address (the default)
TLS_TIMEOUT_S = 20  # long enough for the checks below while the stranger holds its slots
RATE_DELAY_MAX_S = 5  # the longest back-off per attempt (limits.rs)


class Flood:
    """The stranger's connections, and what each got: a greeting, or closed
    (EOF or reset)."""

    def __init__(self, port: int):
        self.port = port
        self.sel = selectors.DefaultSelector()
        self.socks: list[socket.socket] = []
        self.greeted: set[socket.socket] = set()
        self.closed: set[socket.socket] = set()

    def open(self, n: int) -> None:
        for _ in range(n):
            s = socket.socket()
            s.bind((STRANGER, 0))
            s.setblocking(False)
            err = s.connect_ex(("127.0.0.1", self.port))
            assert err in (0, 115), os.strerror(err)  # 115: EINPROGRESS
            self.socks.append(s)
            self.sel.register(s, selectors.EVENT_READ)

    def watch(self, done, timeout=WAIT_TIMEOUT_S) -> None:
        """Reads what the sockets get until done() or timeout."""
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            for key, _ in self.sel.select(timeout=0.5):
                s = key.fileobj
                try:
                    data = s.recv(4096)
                except BlockingIOError:
                    continue
                except ConnectionError:
                    data = b""
                if data:
                    self.greeted.add(s)
                else:
                    self.closed.add(s)
                    self.sel.unregister(s)

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.sel.close()


def test_a_handshake_flood_locks_nobody_out(make_pool, tmp_path):
    require_tools("nbdinfo", "nbdcopy", "openssl", "qemu-io")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < CONNECTIONS + 200:
        pytest.skip(f"the hard open-files limit ({hard}) is below {CONNECTIONS} connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        socket.create_connection(("127.0.0.1", 9), source_address=(STRANGER, 0), timeout=1)
    except ConnectionRefusedError:
        pass
    except OSError as e:
        pytest.skip(f"cannot connect from {STRANGER}: {e}")

    pki = make_pki(tmp_path / "pki")
    alice = pki.client("alice")
    pool, port = start_tls_pool(make_pool, "--tls-certificates", pki.server_dir,
                                "--tls-timeout", TLS_TIMEOUT_S)
    pool.create_volume("a", size="16M", encryption=False)
    pool.cli("grant", "add", "cn:alice", "a", "--read-write")
    qemu_io_ok(pool.uri("a"), "write -P 0x6b 0 1M", what="owner write")

    started = time.monotonic()
    flood = Flood(port)
    try:
        # In steps of 64, so that the listen backlog never overflows (the
        # kernel would drop connections, and the client retry them for
        # minutes); each step waits until all but the 16 allowed are closed.
        while len(flood.socks) < CONNECTIONS:
            flood.open(min(64, CONNECTIONS - len(flood.socks)))
            flood.watch(lambda: len(flood.closed) >= len(flood.socks) - PER_ADDRESS)
            assert len(flood.closed) >= len(flood.socks) - PER_ADDRESS, (
                f"only {len(flood.closed)} of the stranger's {len(flood.socks)} connections "
                f"were closed; {len(flood.greeted)} greeted\n{pool.log_tail()}")
        print(f"{len(flood.closed)} closed at once, {len(flood.greeted)} greeted, "
              f"in {time.monotonic() - started:.1f}s")
        assert len(flood.greeted) <= PER_ADDRESS

        # With the stranger's slots taken: the certificate client lists, opens, reads.
        uri = f"nbds://127.0.0.1:{port}/a?tls-certificates={alice}"
        r = nbdinfo_list(f"nbds://127.0.0.1:{port}/?tls-certificates={alice}")
        assert r.returncode == 0 and '"a"' in r.stdout, r.stderr + pool.log_tail()
        out = tmp_path / "a.img"
        run(["nbdcopy", uri, out], timeout=120)
        assert out.read_bytes()[:1 << 20] == b"\x6b" * (1 << 20)
        # The owner reads on the unix socket.
        qemu_io_ok(pool.uri("a"), "read -P 0x6b 0 1M", what="owner during the flood")

        # Those still open are dropped once the TLS timeout has passed.
        flood.watch(lambda: len(flood.closed) == CONNECTIONS,
                    timeout=TLS_TIMEOUT_S + WAIT_TIMEOUT_S)
        assert len(flood.closed) == CONNECTIONS, f"{CONNECTIONS - len(flood.closed)} still open"
        assert time.monotonic() - started >= TLS_TIMEOUT_S
        log = wait_until(lambda: pool.log_path.read_text(),
                         lambda t: f"TLS not finished within {TLS_TIMEOUT_S}s" in t)
        assert f"TLS not finished within {TLS_TIMEOUT_S}s" in log, pool.log_tail()
    finally:
        flood.close()

    # Coming back does not reset the back-off: refused at once, or greeted
    # only after the longest back-off.
    def reasons():
        text = pool.log_path.read_text()
        return (text.count("address is flooding after failures"),
                re.findall(r"delaying the greeting delay=([0-9.]+)s", text))
    before = reasons()
    s = socket.socket()
    s.bind((STRANGER, 0))
    s.settimeout(WAIT_TIMEOUT_S)
    t = time.monotonic()
    s.connect(("127.0.0.1", port))
    try:
        greeting = s.recv(18)
    except ConnectionError:
        greeting = b""
    took = time.monotonic() - t
    s.close()
    after = wait_until(reasons, lambda r: r != before)
    print(f"reconnect: {'greeted' if greeting else 'closed'} after {took:.1f}s; log {after}")
    if greeting:
        assert after[1][len(before[1]):] and float(after[1][-1]) >= RATE_DELAY_MAX_S, after
        assert took >= RATE_DELAY_MAX_S, took
    else:
        assert after[0] > before[0] or "too many unauthenticated" in pool.log_path.read_text(), \
            pool.log_tail()

    # The certificate client from its own address is not slowed by any of it.
    r = nbdinfo_list(f"nbds://127.0.0.1:{port}/?tls-certificates={alice}")
    assert r.returncode == 0 and '"a"' in r.stdout, r.stderr
