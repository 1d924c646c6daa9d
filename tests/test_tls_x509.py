"""NBD over TLS with X.509 client certificates, through qemu-io, qemu-img,
nbdinfo and nbdcopy: a client whose certificate the pool's CA signed, and
that holds a grant, reads and writes its volume; the same volume seen
through the owner's unix socket holds the same bytes."""

import json
import os

from conftest import MiB, qemu_io_ok, require_tools, run
from tlsutil import Pki, make_pki, start_tls_pool


def x509_opts(client_dir, port, export="v"):
    obj = f"tls-creds-x509,id=tls0,endpoint=client,dir={client_dir}"
    img = f"driver=nbd,host=127.0.0.1,port={port},export={export},tls-creds=tls0"
    return obj, img


def test_x509_clients_read_and_write_over_tls(make_pool, tmp_path):
    require_tools("qemu-io", "qemu-img", "nbdinfo", "nbdcopy", "openssl")
    pki = make_pki(tmp_path / "pki")
    alice = pki.client("alice")
    pool, port = start_tls_pool(make_pool, "--tls-certificates", pki.server_dir)
    pool.create_volume("v", size="16M")
    # Granted by common name.
    pool.cli("grant", "add", "cn:alice", "v", "--read-write")

    # qemu-io: write a pattern over TLS (TLS 1.3, then 1.2), read it back.
    obj, img = x509_opts(alice, port)
    r = run(["qemu-io", "--object", obj, "--image-opts", img,
             "-c", "write -P 0x5a 0 1M", "-c", "read -P 0x5a 0 1M"])
    assert "error" not in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
    r = run(["qemu-io", "--object", obj + ",priority=NORMAL:-VERS-TLS1.3", "--image-opts", img,
             "-c", "write -P 0x6b 1M 1M", "-c", "read -P 0x6b 1M 1M"])
    assert "error" not in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
    # The owner sees the same bytes through the unix socket.
    qemu_io_ok(pool.uri("v"), "read -P 0x5a 0 1M", "read -P 0x6b 1M 1M")

    # qemu-img over TLS.
    r = run(["qemu-img", "info", "--output=json", "--object", obj, "--image-opts", img])
    assert json.loads(r.stdout)["virtual-size"] == 16 * MiB

    # nbdinfo and nbdcopy with an nbds:// URI.
    uri = f"nbds://127.0.0.1:{port}/v?tls-certificates={alice}"
    r = run(["nbdinfo", "--json", uri])
    info = json.loads(r.stdout)
    assert info["protocol"].endswith("with TLS") or "TLS" in r.stdout
    assert info["exports"][0]["export-size"] == 16 * MiB
    src = tmp_path / "src.img"
    data = os.urandom(16 * MiB)
    src.write_bytes(data)
    run(["nbdcopy", src, uri])
    back = tmp_path / "back.img"
    run(["nbdcopy", uri, back])
    assert back.read_bytes() == data

    # Granted by fingerprint instead: another client of the same CA.
    bob = pki.client("bob")
    pool.cli("grant", "add", Pki.fingerprint(bob), "v", "--read-only")
    r = run(["nbdcopy", f"nbds://127.0.0.1:{port}/v?tls-certificates={bob}", tmp_path / "bob.img"])
    assert (tmp_path / "bob.img").read_bytes() == data
