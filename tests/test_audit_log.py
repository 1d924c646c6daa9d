"""DIR/audit.log records every attach, detach, denial, key load/unload,
grant change and volume create/destroy as one JSON line (mode 0600,
appended), and never a secret: not the key file's bytes, not the
passphrase, not the PSK key."""

import os
import stat

from conftest import make_passphrase_file, qemu_io_ok, require_tools, run, wait_until
from keyutil import audit_lines
from tlsutil import make_psk, nbdinfo_list, start_tls_pool


def test_audit_log_has_every_event_and_no_secret(make_pool, tmp_path):
    require_tools("nbdinfo", "qemu-io")
    server_psk, keys = make_psk(tmp_path / "server", ["frank"])
    wrong_psk, _ = make_psk(tmp_path / "wrong", ["frank"])
    pool, port = start_tls_pool(make_pool, "--tls-psk", server_psk)
    key = pool.create_volume("v", size="16M")
    passphrase = "correct horse battery staple 7781"
    pfile = make_passphrase_file(tmp_path / "pass", passphrase)
    pool.create_volume("p", size="16M", passphrase_file=pfile)

    pool.cli("key", "unload", "p")
    pool.cli("key", "load", "p", "--passphrase-file", pfile)
    pool.cli("grant", "add", "psk:frank", "v", "--read-write")
    uri = f"nbds://frank@127.0.0.1:{port}/v?tls-psk-file={server_psk}"
    run(["nbdinfo", uri])                                         # attach + detach (frank)
    r = run(["nbdinfo", f"nbds://frank@127.0.0.1:{port}/p?tls-psk-file={server_psk}"], check=False)
    assert r.returncode != 0                                      # denied: no grant on p
    r = nbdinfo_list(f"nbds://frank@127.0.0.1:{port}/?tls-psk-file={wrong_psk}")
    assert r.returncode != 0                                      # TLS handshake failed
    qemu_io_ok(pool.uri("v"), "write -P 1 0 4k")                  # owner attach + detach
    pool.cli("grant", "remove", "psk:frank", "v")
    pool.cli("volume", "destroy", "p")

    # (event, result, fields): every record this must have left.
    expected = [
        ("volume_create", "ok", dict(volume="v", client="owner")),
        ("volume_create", "ok", dict(volume="p")),
        ("key_unload", "ok", dict(volume="p")),
        ("key_load", "ok", dict(volume="p")),
        ("grant_add", "ok", dict(volume="v")),
        ("attach", "ok", dict(volume="v", client="psk:frank")),
        ("detach", "ok", dict(volume="v", client="psk:frank")),
        ("attach", "denied", dict(volume="p", client="psk:frank")),
        ("handshake", "denied", dict(client="unauthenticated")),
        ("attach", "ok", dict(volume="v", client="owner")),
        ("detach", "ok", dict(volume="v", client="owner")),
        ("grant_remove", "ok", dict(volume="v")),
        ("volume_destroy", "ok", dict(volume="p")),
    ]

    def has(lines, event, result, kw):
        return any(l["event"] == event and l["result"] == result
                   and all(l[k] == v for k, v in kw.items()) for l in lines)

    # Some records (a detach, a failed handshake) are written once the client
    # has gone: read the log again until all are there, then check it.
    lines = wait_until(lambda: audit_lines(pool),
                       lambda lines: all(has(lines, *e) for e in expected))
    log = pool.dir / "audit.log"
    assert stat.S_IMODE(os.stat(log).st_mode) == 0o600
    text = log.read_text()
    for l in lines:
        assert set(l) == {"time", "event", "client", "peer", "volume", "result", "detail"}, l
        assert l["time"].endswith("Z") and "T" in l["time"]
    missing = [e for e in expected if not has(lines, *e)]
    assert not missing, f"not in the audit log: {missing}\n{text}"
    attach = next(l for l in lines if l["event"] == "attach" and l["client"] == "psk:frank")
    assert attach["peer"].startswith("127.0.0.1:")

    # No secret, in any spelling.
    raw = log.read_bytes()
    key_bytes = key.read_bytes()
    assert key_bytes not in raw
    assert key_bytes.hex() not in text.lower()
    assert passphrase not in text
    for k in keys.values():
        assert k.lower() not in text.lower()


def test_audit_log_has_device_fault_and_scrub_actions(make_pool, tmp_path):
    """Actions that change what the whole pool does are audited too: a
    device taken offline, brought back or replaced, a fault armed or
    cleared (a drill someone should be able to account for), a scrub
    started, paused, resumed or cancelled. Refused ones are recorded as
    errors with the request."""
    pool = make_pool(layout="mirror:2", devices=2, device_size="256M",
                     serve_args=["--allow-fault-injection"])
    pool.create().start()
    pool.create_volume("v", size="8M")
    first, second = pool.device_paths()

    pool.cli("fault", "set", first, "read-error", "--probability", "0.5", "--seed", "7")
    pool.cli("fault", "clear", first)
    pool.cli("device", "offline", second)
    pool.cli("device", "online", second, "--wait")
    new = tmp_path / "new.img"
    with open(new, "wb") as f:
        f.truncate(256 << 20)
    pool.cli("device", "replace", second, new, "--wait")
    pool.cli("scrub")
    pool.cli("scrub", "pause", check=False)    # may find the scrub already done
    pool.cli("scrub", "cancel", check=False)
    r = pool.cli("device", "offline", tmp_path / "no-such.img", check=False)
    assert r.returncode != 0

    lines = audit_lines(pool)

    def find(event, result="ok"):
        return [l for l in lines if l["event"] == event and l["result"] == result]

    fault = find("fault_set")
    assert len(fault) == 1, lines
    assert fault[0]["volume"] is None and fault[0]["client"] == "owner"
    assert fault[0]["detail"]["device"] == first
    assert fault[0]["detail"]["fault"]["mode"] == "read-error"
    assert fault[0]["detail"]["fault"]["probability"] == 0.5
    assert find("fault_clear")[0]["detail"] == {"device": first}
    assert find("device_offline")[0]["detail"] == {"device": second}
    assert find("device_online")[0]["detail"] == {"device": second}
    replace = find("device_replace")
    assert replace and replace[0]["detail"] == {"device": second, "new": str(new)}, lines
    assert find("scrub_start")
    refused = find("device_offline", "error")
    assert refused and refused[0]["detail"]["request"] == {"device": str(tmp_path / "no-such.img")}
    assert refused[0]["detail"]["error"]
