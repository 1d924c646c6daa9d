"""NBD over TLS with pre-shared keys (psktool's identity:hexkey file),
through qemu-io (tls-creds-psk, TLS 1.3 and 1.2), nbdinfo and nbdcopy
(tls-psk-file, the identity as the URI's user): the client is psk:IDENTITY and sees what
that identity was granted."""

import json
import os

from conftest import MiB, qemu_io_ok, require_tools, run
from tlsutil import make_psk, start_tls_pool


def test_psk_clients_read_and_write_over_tls(make_pool, tmp_path):
    require_tools("qemu-io", "nbdinfo", "nbdcopy")
    server_psk, keys = make_psk(tmp_path / "server", ["carol", "dave"])
    # Each client holds only its own key (qemu reads DIR/keys.psk).
    carol_psk, _ = make_psk(tmp_path / "carol", {"carol": keys["carol"]})
    pool, port = start_tls_pool(make_pool, "--tls-psk", server_psk)
    pool.create_volume("v", size="16M")
    pool.create_volume("w", size="16M")
    pool.cli("grant", "add", "psk:carol", "v", "--read-write")

    obj = f"tls-creds-psk,id=tls0,endpoint=client,dir={carol_psk.parent},username=carol"
    img = f"driver=nbd,host=127.0.0.1,port={port},export=v,tls-creds=tls0"
    r = run(["qemu-io", "--object", obj, "--image-opts", img,
             "-c", "write -P 0x33 0 1M", "-c", "read -P 0x33 0 1M"])
    assert "error" not in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
    r = run(["qemu-io", "--object", obj + ",priority=NORMAL:-VERS-TLS1.3", "--image-opts", img,
             "-c", "write -P 0x44 1M 1M", "-c", "read -P 0x44 1M 1M"])
    assert "error" not in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
    qemu_io_ok(pool.uri("v"), "read -P 0x33 0 1M", "read -P 0x44 1M 1M")

    # libnbd takes the PSK username from the URI's user part (the
    # tls-username query parameter needs a newer libnbd than Debian 12's).
    uri = f"nbds://carol@127.0.0.1:{port}/v?tls-psk-file={carol_psk}&tls-username=carol"
    info = json.loads(run(["nbdinfo", "--json", uri]).stdout)
    assert info["exports"][0]["export-size"] == 16 * MiB
    listed = json.loads(run(["nbdinfo", "--list", "--json",
                             f"nbds://carol@127.0.0.1:{port}/?tls-psk-file={carol_psk}"
                             f"&tls-username=carol"]).stdout)
    assert [e["export-name"] for e in listed["exports"]] == ["v"]

    data = os.urandom(8 * MiB)
    (tmp_path / "src.img").write_bytes(data)
    run(["nbdcopy", tmp_path / "src.img", uri])
    run(["nbdcopy", uri, tmp_path / "back.img"])
    assert (tmp_path / "back.img").read_bytes()[:8 * MiB] == data
