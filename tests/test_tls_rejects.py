"""Clients that cannot authenticate get nothing, not even the export list:
no certificate, a certificate from another CA, a wrong PSK, plaintext NBD on
the TLS listener. And the daemon refuses TCP without TLS unless asked for
plaintext on a loopback address."""

import os
import ssl

import pytest

from conftest import require_tools, run
from tlsutil import (REP_ERR_TLS_REQD, OPT_GO, OPT_INFO, OPT_STRUCTURED_REPLY, RawNbd,
                     make_pki, make_psk, nbdinfo_list, start_tls_pool, tcp_port)


def assert_got_nothing(r, *secrets_):
    assert r.returncode != 0, f"connection succeeded:\n{r.stdout}"
    for s in secrets_:
        assert s not in r.stdout, f"{s!r} leaked:\n{r.stdout}"


def test_x509_listener_refuses_unauthenticated_clients(make_pool, tmp_path):
    require_tools("nbdinfo", "qemu-io", "openssl")
    pki = make_pki(tmp_path / "pki")
    good = pki.client("alice")
    rogue = pki.client("alice", ca="rogue")  # same name, untrusted CA
    pool, port = start_tls_pool(make_pool, "--tls-certificates", pki.server_dir)
    pool.create_volume("secretvol", size="16M")
    pool.cli("grant", "add", "cn:alice", "secretvol", "--read-write")

    # Plaintext NBD on the TLS listener: every option but STARTTLS/ABORT is
    # refused with TLS_REQD, and nothing is listed.
    c = RawNbd(port)
    try:
        replies = c.list()
        assert [r for r, _ in replies] == [REP_ERR_TLS_REQD]
        assert b"secretvol" not in b"".join(p for _, p in replies)
        for opt in (OPT_INFO, OPT_GO):
            assert c.go("secretvol", opt)[0][0] == REP_ERR_TLS_REQD
        assert c.option(OPT_STRUCTURED_REPLY)[0][0] == REP_ERR_TLS_REQD
    finally:
        c.close()
    assert_got_nothing(nbdinfo_list(f"nbd://127.0.0.1:{port}"), "secretvol")

    # TLS without a client certificate.
    c = RawNbd(port)
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        c.starttls(None, pki.server_dir / "ca-cert.pem")
        c.list()
    c.close()
    noclient = tmp_path / "nocert"
    noclient.mkdir()
    (noclient / "ca-cert.pem").write_bytes((pki.server_dir / "ca-cert.pem").read_bytes())
    assert_got_nothing(nbdinfo_list(f"nbds://127.0.0.1:{port}/?tls-certificates={noclient}"),
                       "secretvol")

    # A certificate with the granted CN, from a CA the server does not trust.
    assert_got_nothing(nbdinfo_list(f"nbds://127.0.0.1:{port}/?tls-certificates={rogue}"),
                       "secretvol")
    r = run(["qemu-io", "-r", "--object", f"tls-creds-x509,id=tls0,endpoint=client,dir={rogue}",
             "--image-opts", f"driver=nbd,host=127.0.0.1,port={port},export=secretvol,"
             "tls-creds=tls0", "-c", "read 0 4k"], check=False)
    assert r.returncode != 0 and "read 4096/4096" not in r.stdout

    # The real alice still gets in.
    r = nbdinfo_list(f"nbds://127.0.0.1:{port}/?tls-certificates={good}")
    assert r.returncode == 0 and "secretvol" in r.stdout, r.stderr


def test_psk_listener_refuses_wrong_keys(make_pool, tmp_path):
    require_tools("nbdinfo")
    server_psk, keys = make_psk(tmp_path / "server", ["erin"])
    wrong, _ = make_psk(tmp_path / "wrong", ["erin"])  # same identity, other key
    unknown, _ = make_psk(tmp_path / "unknown", ["mallory"])
    pool, port = start_tls_pool(make_pool, "--tls-psk", server_psk)
    pool.create_volume("secretvol", size="16M")
    pool.cli("grant", "add", "psk:erin", "secretvol", "--read-write")
    for psk, user in ((wrong, "erin"), (unknown, "mallory")):
        assert_got_nothing(nbdinfo_list(f"nbds://{user}@127.0.0.1:{port}/?tls-psk-file={psk}"),
                           "secretvol")
    assert_got_nothing(nbdinfo_list(f"nbd://127.0.0.1:{port}"), "secretvol")
    r = nbdinfo_list(f"nbds://erin@127.0.0.1:{port}/?tls-psk-file={server_psk}")
    assert r.returncode == 0 and "secretvol" in r.stdout, r.stderr


def test_tcp_needs_tls_unless_plaintext_on_loopback(make_pool, tmp_path):
    pool = make_pool()
    pool.create()
    r = pool.bulwark("serve", pool.dir, "--nbd-listen", "127.0.0.1:0", check=False)
    assert r.returncode == 2 and "requires TLS" in r.stderr, r.stderr
    r = pool.bulwark("serve", pool.dir, "--nbd-listen", "0.0.0.0:0", "--nbd-plaintext",
                     check=False)
    assert r.returncode == 2 and "not a loopback address" in r.stderr, r.stderr
    r = pool.bulwark("serve", pool.dir, "--tls-psk", tmp_path / "nope", check=False)
    assert r.returncode != 0
    # A PSK file other users can read is refused.
    loose, _ = make_psk(tmp_path / "loose", ["x"])
    os.chmod(loose, 0o644)
    r = pool.bulwark("serve", pool.dir, "--nbd-listen", "127.0.0.1:0", "--tls-psk", loose,
                     check=False)
    assert r.returncode != 0 and "chmod 600" in r.stderr, r.stderr
    # Plaintext on loopback works; its clients are "anonymous" and need a grant.
    pool.serve_args = ["--nbd-listen", "127.0.0.1:0", "--nbd-plaintext"]
    pool.start()
    port = tcp_port(pool)
    pool.create_volume("v", size="16M")
    r = nbdinfo_list(f"nbd://127.0.0.1:{port}")
    assert r.returncode == 0 and '"v"' not in r.stdout
    pool.cli("grant", "add", "anonymous", "v", "--read-only")
    r = nbdinfo_list(f"nbd://127.0.0.1:{port}")
    assert r.returncode == 0 and '"v"' in r.stdout, r.stdout
