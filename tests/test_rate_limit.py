"""A burst of failures is slowed down, and the legitimate client still gets
in. Failed TLS handshakes (a certificate from an untrusted CA) slow every
later connection from the address; denied opens by an authenticated client
slow its later refusals. The first failures cost nothing; past them each
attempt waits twice as long as the one before, from 100 ms. The daemon's
log says which attempts it delayed and by how much, and each delayed attempt
takes at least its delay: a lower bound, which a slow machine cannot break
(the time of the attempts that were not delayed is never compared)."""

import re
import ssl

import pytest

from conftest import require_tools, wait_until
from tlsutil import REP_ERR_UNKNOWN, RawNbd, make_pki, nbdinfo_list, start_tls_pool, timed

BURST = 8
# Attempts answered without delay: each sees only the failures before it,
# and the first three failures cost nothing.
FREE = 4
# The delays of the attempts after those (s): 100 ms, doubling.
DELAYS = [0.1 * 2 ** i for i in range(BURST - FREE)]
# The failed-open delays are logged at debug level.
LOG_FILTER = "info,bulwark_nbd::handshake=debug"
_UNITS = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "ns": 1e-9}


def logged_delays(pool, message):
    """The delays (s) the daemon logged with `message`, in order."""
    out = []
    for line in pool.log_path.read_text().splitlines():
        if message in line:
            m = re.search(r"\bdelay=([0-9.]+)(s|ms|µs|ns)\b", line)
            assert m, f"no delay= in the log line: {line}"
            out.append(float(m.group(1)) * _UNITS[m.group(2)])
    return out


def bad_handshake(port, pki, rogue):
    c = RawNbd(port)
    try:
        c.starttls(rogue, pki.server_dir / "ca-cert.pem")
        c.list()
    finally:
        c.close()


def test_failures_are_slowed_and_legit_client_gets_in(make_pool, tmp_path, monkeypatch):
    require_tools("nbdinfo", "openssl")
    monkeypatch.setenv("BULWARK_LOG", LOG_FILTER)
    pki = make_pki(tmp_path / "pki")
    alice = pki.client("alice")
    rogue = pki.client("alice", ca="rogue")
    pool, port = start_tls_pool(make_pool, "--tls-certificates", pki.server_dir)
    pool.create_volume("a", size="16M")
    pool.create_volume("b", size="16M")
    pool.cli("grant", "add", "cn:alice", "a", "--read-write")

    def denied_handshakes(lines):
        return sum('"event":"handshake"' in l and '"result":"denied"' in l for l in lines)

    def audit_lines():
        return (pool.dir / "audit.log").read_text().splitlines()

    # Failed TLS handshakes from one address.
    times = []
    for i in range(BURST):
        took, r = timed(bad_handshake, port, pki, rogue)
        assert isinstance(r, (ssl.SSLError, ConnectionError, OSError)), f"handshake passed: {r}"
        times.append(took)
        # Failures are in the audit log, as denials. The daemon counts a failure
        # before it writes that record, which it may do after the client has seen
        # the failure: waiting for it makes the next attempt see every one before.
        lines = wait_until(audit_lines, lambda lines: denied_handshakes(lines) > i)
        assert denied_handshakes(lines) > i, lines
    print("bad handshakes:", [round(t, 3) for t in times])
    # The first ones were answered at once, every later one was delayed,
    # each twice as long as the one before; and the delay was served.
    greeting = "address has failed recently: delaying the greeting"
    assert logged_delays(pool, greeting) == pytest.approx(DELAYS), pool.log_tail()
    for took, delay in zip(times[FREE:], DELAYS):
        assert took >= delay, (times, DELAYS)

    # The legitimate client is slowed too (same address) but gets in.
    took, r = timed(nbdinfo_list, f"nbds://127.0.0.1:{port}/?tls-certificates={alice}")
    assert r.returncode == 0 and '"a"' in r.stdout, r.stderr
    print("legit client after the burst:", round(took, 3))

    # Denied opens by an authenticated client (on a fresh daemon, so the
    # address starts clean): its refusals get slower.
    pool.stop()
    pool2, port = start_tls_pool(make_pool, "--tls-certificates", pki.server_dir)
    pool2.create_volume("b", size="16M")
    c = RawNbd(port)
    c.starttls(alice, pki.server_dir / "ca-cert.pem")
    denied = []
    for i in range(6):
        took, replies = timed(c.go, "b" if i % 2 else "nosuch")
        assert replies[-1][0] == REP_ERR_UNKNOWN
        denied.append(took)
    c.close()
    print("denied opens:", [round(t, 3) for t in denied])
    # Refusals past the free ones are delayed, increasingly, and the delay is served.
    refusal = "delaying the reply to a failed open"
    assert logged_delays(pool2, refusal) == pytest.approx(DELAYS[:len(denied) - FREE]), \
        pool2.log_tail()
    for took, delay in zip(denied[FREE:], DELAYS):
        assert took >= delay, (denied, DELAYS)
    lines = (pool2.dir / "audit.log").read_text().splitlines()
    assert sum('"event":"attach"' in l and '"result":"denied"' in l for l in lines) == 6
