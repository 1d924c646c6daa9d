"""Grants decide what a TLS client sees: a client granted A lists only A
and cannot open B; asking for B and for a name that does not exist get the
same bytes back; a read-only grant exports the volume read-only and writes
fail with EPERM; removing a grant takes effect on the next connection (and
on open ones: test_grant_revocation.py), and
grants survive a restart in DIR/grants.json (mode 0600)."""

import json
import os
import stat

from conftest import nbd_python, require_tools, run
from tlsutil import (OPT_GO, OPT_INFO, REP_ACK, REP_ERR_UNKNOWN, RawNbd, make_pki,
                     nbdinfo_list, start_tls_pool)

WRITE_PROBE = r"""
import sys, nbd
h = nbd.NBD()
# Send the write even though the export says read-only: the server must refuse it.
h.set_strict_mode(h.get_strict_mode() & ~nbd.STRICT_COMMANDS)
h.set_uri_allow_local_file(True)
h.connect_uri(sys.argv[1])
print("read-only" if h.is_read_only() else "read-write")
try:
    h.pwrite(b"x" * 4096, 0)
    print("write ok")
except nbd.Error as e:
    print("write failed", e.errno)  # the errno name, e.g. EPERM
"""


def tls_session(port, pki, client):
    c = RawNbd(port)
    c.starttls(client, pki.server_dir / "ca-cert.pem")
    return c


def test_grants_limit_what_a_client_sees_and_does(make_pool, tmp_path):
    require_tools("nbdinfo", "openssl")
    pki = make_pki(tmp_path / "pki")
    alice = pki.client("alice")
    pool, port = start_tls_pool(make_pool, "--tls-certificates", pki.server_dir)
    for name in ("a", "b"):
        pool.create_volume(name, size="16M")
    pool.cli("grant", "add", "cn:alice", "a", "--read-only")

    # LIST shows only a.
    c = tls_session(port, pki, alice)
    try:
        assert RawNbd.names(c.list()) == ["a"]
        # b (exists, not granted) and nosuch (does not exist): identical replies.
        forbidden = c.go("b")
        unknown = c.go("nosuch")
        assert forbidden == unknown, (forbidden, unknown)
        assert forbidden[-1][0] == REP_ERR_UNKNOWN
        assert c.go("b", OPT_INFO) == c.go("nosuch", OPT_INFO)
        assert c.go("a", OPT_INFO)[-1][0] == REP_ACK
    finally:
        c.close()
    r = nbdinfo_list(f"nbds://127.0.0.1:{port}/?tls-certificates={alice}")
    assert [e["export-name"] for e in json.loads(r.stdout)["exports"]] == ["a"]
    r = run(["nbdinfo", f"nbds://127.0.0.1:{port}/b?tls-certificates={alice}"], check=False)
    assert r.returncode != 0

    # Read-only grant: advertised read-only, and a write sent anyway gets EPERM.
    probe = run([nbd_python(), "-c", WRITE_PROBE,
                 f"nbds://127.0.0.1:{port}/a?tls-certificates={alice}"])
    assert probe.stdout.split("\n")[:2] == ["read-only", "write failed EPERM"], probe.stdout

    # Read-write grant (replaces the read-only one).
    pool.cli("grant", "add", "cn:alice", "a", "--read-write")
    probe = run([nbd_python(), "-c", WRITE_PROBE,
                 f"nbds://127.0.0.1:{port}/a?tls-certificates={alice}"])
    assert probe.stdout.split("\n")[:2] == ["read-write", "write ok"], probe.stdout

    # grant list, persisted privately, kept across a restart.
    listed = json.loads(pool.cli("grant", "list", "--json").stdout)
    assert listed == [{"client": "cn:alice", "volume": "a", "access": "read-write"}]
    grants = pool.dir / "grants.json"
    assert stat.S_IMODE(os.stat(grants).st_mode) == 0o600
    pool.restart()
    pool.load_key("a", pool.keys_dir / "a.key")
    assert json.loads(pool.cli("grant", "list", "--json").stdout) == listed
    r = nbdinfo_list(f"nbds://127.0.0.1:{port}/?tls-certificates={alice}")
    assert [e["export-name"] for e in json.loads(r.stdout)["exports"]] == ["a"]

    # Removing the grant: the next connection sees nothing.
    pool.cli("grant", "remove", "cn:alice", "a")
    c = tls_session(port, pki, alice)
    try:
        assert RawNbd.names(c.list()) == []
        assert c.go("a")[-1][0] == REP_ERR_UNKNOWN
    finally:
        c.close()

    # Bad grant requests are refused.
    r = pool.cli("grant", "add", "alice", "a", "--read-write", check=False)
    assert r.returncode != 0 and "invalid client" in r.stderr
    r = pool.cli("grant", "add", "cn:alice", "nosuch", "--read-write", check=False)
    assert r.returncode != 0 and "no volume" in r.stderr
    r = pool.cli("grant", "add", "cn:alice", "a", check=False)
    assert r.returncode == 2

    # A destroyed volume takes its grants with it.
    pool.cli("grant", "add", "cn:alice", "b", "--read-only")
    pool.cli("volume", "destroy", "b")
    assert json.loads(pool.cli("grant", "list", "--json").stdout) == []
