"""A burst of failures is slowed down, and the legitimate client still gets
in. Failed TLS handshakes (a certificate from an untrusted CA) slow every
later connection from the address; denied opens by an authenticated client
slow its later refusals. Delays are compared with the first attempts of the
same run, never with wall-clock constants."""

import ssl

from conftest import require_tools
from tlsutil import REP_ERR_UNKNOWN, RawNbd, make_pki, nbdinfo_list, start_tls_pool, timed

BURST = 8


def bad_handshake(port, pki, rogue):
    c = RawNbd(port)
    try:
        c.starttls(rogue, pki.server_dir / "ca-cert.pem")
        c.list()
    finally:
        c.close()


def test_failures_are_slowed_and_legit_client_gets_in(make_pool, tmp_path):
    require_tools("nbdinfo", "openssl")
    pki = make_pki(tmp_path / "pki")
    alice = pki.client("alice")
    rogue = pki.client("alice", ca="rogue")
    pool, port = start_tls_pool(make_pool, "--tls-certificates", pki.server_dir)
    pool.create_volume("a", size="16M")
    pool.create_volume("b", size="16M")
    pool.cli("grant", "add", "cn:alice", "a", "--read-write")

    # Failed TLS handshakes from one address.
    times = []
    for _ in range(BURST):
        took, r = timed(bad_handshake, port, pki, rogue)
        assert isinstance(r, (ssl.SSLError, ConnectionError, OSError)), f"handshake passed: {r}"
        times.append(took)
    first = min(times[:3])
    print("bad handshakes:", [round(t, 3) for t in times])
    # Later attempts wait longer than the first ones, increasingly.
    assert times[-1] > 8 * first, times
    assert times[-1] > times[-3] > times[2], times

    # The legitimate client is slowed too (same address) but gets in.
    took, r = timed(nbdinfo_list, f"nbds://127.0.0.1:{port}/?tls-certificates={alice}")
    assert r.returncode == 0 and '"a"' in r.stdout, r.stderr
    print("legit client after the burst:", round(took, 3))

    # Failures are in the audit log, as denials.
    lines = (pool.dir / "audit.log").read_text().splitlines()
    assert sum('"event":"handshake"' in l and '"result":"denied"' in l for l in lines) >= BURST

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
    assert denied[-1] > 8 * min(denied[:3]) and denied[-1] > denied[-3], denied
    lines = (pool2.dir / "audit.log").read_text().splitlines()
    assert sum('"event":"attach"' in l and '"result":"denied"' in l for l in lines) == 6
