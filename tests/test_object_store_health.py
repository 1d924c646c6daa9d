"""The object store's health where an operator looks (issue 42): `status` and its
metrics say when commits fail and why, the pool is DEGRADED meanwhile; every store error
is one line naming the server's cause; `serve` starts while the store is unreachable
(every byte is local) and catches the store up when it answers; a fenced daemon names
what takes the pool back. Real servers (versitygw, tests/helpers/s3servers.py) and our
fault proxy in front of them (tests/helpers/s3proxy.py).
"""

from __future__ import annotations

import sys
import urllib.request

from conftest import HELPERS, make_key_file, run, wait_until
from test_object_store import (StorePool, nbd_script, read_back, rebuilt_elsewhere,
                               store_url, try_flush)

sys.path.insert(0, str(HELPERS))
from s3proxy import FaultProxy  # noqa: E402
from s3servers import free_port, start_server  # noqa: E402


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def metric(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no series {series} in the metrics:\n{text}")


def dashboard_store_metrics() -> set[str]:
    import json
    import re
    from conftest import REPO
    d = json.loads((REPO / "packaging" / "grafana" / "bulwark.json").read_text())
    exprs = [t["expr"] for p in d["panels"] for t in p["targets"]]
    return {n for e in exprs for n in re.findall(r"bulwark_object_store_\w+", e)}


def test_failing_commits_show_in_status_and_metrics(tmp_path):
    """The store answers 503 SlowDown: flushes fail, and `status` says the store is
    FAILING since when and why (one line, the server's code), the pool DEGRADED, and the
    metrics count the failed commits and the errors by kind. Once the store answers, the
    next flush reaches it and both are as before, the lag back to 0."""
    with start_server("versitygw", tmp_path / "vgw") as srv, FaultProxy.for_server(srv) as proxy:
        port = free_port()
        p = StorePool(tmp_path, srv, "health", endpoint=proxy.endpoint,
                      serve_args=["--metrics-listen", f"127.0.0.1:{port}"]).create().start()
        try:
            p.create_volume("v", size="8M")
            nbd_script(p, "h.pwrite(b'A' * 65536, 0)\nh.flush()\n")
            st = p.status()
            assert st["state"] == "ONLINE" and st["object_store"]["state"] == "HELD", st
            assert st["object_store"]["last_commit"] > 0
            rule = proxy.fail(status=503, code="SlowDown", message="Please reduce your request rate.")
            out = nbd_script(p, "h.pwrite(b'B' * 65536, 65536)\n" + try_flush(), check=False)
            assert "FLUSH-ERR" in out.stdout, f"{out.stdout}\n{out.stderr}\n{p.log_tail()}"
            st = p.status()
            t = st["object_store"]
            assert st["state"] == "DEGRADED", "failing commits must degrade the pool"
            assert t["state"] == "FAILING" and t["failing_since"] > 0, t
            # A retried 503 reaches the client without its body: the status names it.
            assert "HTTP 503" in t["last_error"] and "\n" not in t["last_error"], t["last_error"]
            assert "<?xml" not in t["last_error"] and len(t["last_error"]) < 400, t["last_error"]
            assert t["commits_failed"] >= 1 and t["request_errors"].get("server_error", 0) >= 1, t
            assert t["lag_bytes"] > 0, t  # compressed: less than written
            text = p.cli("status").stdout
            assert "FAILING" in text and "commits failing: since" in text and "HTTP 503" in text, text
            m = metrics(port)
            assert metric(m, 'bulwark_object_store_state{state="FAILING"}') == 1
            assert metric(m, 'bulwark_object_store_commits_total{result="failed"}') >= 1
            assert metric(m, 'bulwark_object_store_request_errors_total{kind="server_error"}') >= 1
            assert metric(m, "bulwark_object_store_lag_bytes") > 0
            assert metric(m, 'bulwark_pool_state{state="DEGRADED"}') == 1
            # The dashboard's object store panels read series the daemon exports.
            for name in dashboard_store_metrics():
                assert f"\n{name}" in m, f"the dashboard reads {name}, which is not exported"
            rule.off()
            nbd_script(p, "h.flush()\n")
            st = p.status()
            t = st["object_store"]
            assert st["state"] == "ONLINE" and t["state"] == "HELD", st
            assert "failing_since" not in t and t["lag_bytes"] == 0, t
            m = metrics(port)
            assert metric(m, 'bulwark_object_store_state{state="HELD"}') == 1
            assert metric(m, 'bulwark_object_store_commits_total{result="ok"}') >= 2
            assert metric(m, "bulwark_object_store_lag_seconds") == 0
        finally:
            p.kill()


def test_store_errors_are_one_line_naming_the_servers_cause(tmp_path):
    """A wrong secret: SignatureDoesNotMatch in one short line, not the server's XML. A
    bucket that does not exist: NoSuchBucket, not a complaint about conditional writes.
    Nothing listening: the connection failure, in one line."""
    with start_server("versitygw", tmp_path / "vgw") as srv:
        p = StorePool(tmp_path, srv, "errs")
        wrong = tmp_path / "wrong.env"
        wrong.write_text(f"AWS_ACCESS_KEY_ID={srv.access_key}\n"
                         "AWS_SECRET_ACCESS_KEY=not-the-secret\n"
                         f"AWS_REGION={srv.region}\n")
        wrong.chmod(0o600)
        cases = [
            (store_url(srv, "x"), wrong, "SignatureDoesNotMatch"),
            (f"s3://no-such-bucket-42/x?endpoint={srv.endpoint}", p.creds, "NoSuchBucket"),
            (f"s3://{srv.bucket}/x?endpoint=http://127.0.0.1:{free_port()}", p.creds,
             "cannot reach the server"),
        ]
        for url, creds, cause in cases:
            r = p.bulwark("pool", "probe-store", url, "--object-store-credentials", creds,
                          check=False)
            err = r.stderr.strip()
            assert r.returncode != 0, r.stdout
            assert cause in err, f"{url}: {err}"
            assert "\n" not in err and len(err) < 600 and "<?xml" not in err, err
            assert "conditional writes" not in err, err
            assert "not-the-secret" not in err + r.stdout


def test_serve_starts_with_the_store_down_and_catches_it_up(tmp_path):
    """The store is down when the daemon starts: it serves from the local devices
    (status: store UNREACHABLE, pool DEGRADED), flushes are durable locally, and once the
    store answers it is taken and caught up by itself: a pool rebuilt from the bucket
    alone holds what was written during the outage."""
    with start_server("versitygw", tmp_path / "vgw") as srv:
        p = StorePool(tmp_path, srv, "late").create().start()
        key = p.create_volume("v", size="8M")
        nbd_script(p, "h.pwrite(b'A' * 65536, 0)\nh.flush()\n")
        p.stop()
        srv.kill()
        try:
            p.start()
            st = p.status()
            assert st["object_store"]["state"] == "UNREACHABLE", st["object_store"]
            assert st["state"] == "DEGRADED", st["state"]
            assert "cannot reach the server" in st["object_store"]["last_error"]
            p.load_key("v", key)
            nbd_script(p, "h.pwrite(b'B' * 65536, 65536)\nh.flush()\n")
            assert p.status()["object_store"]["lag_bytes"] > 0
            srv.restart()
            t = wait_until(lambda: p.status()["object_store"],
                           lambda t: t["state"] == "HELD" and t["lag_bytes"] == 0, timeout=60)
            assert t["commits_ok"] >= 1, t
            assert p.status()["state"] == "ONLINE"
            p.stop()
        finally:
            p.kill()
        p.bulwark("pool", "export", p.dir)
        got = rebuilt_elsewhere(p, p.dir / "pool.key", key, tmp_path / "b.img")
        assert got[:65536] == b"A" * 65536
        assert got[65536:131072] == b"B" * 65536, "the write made during the outage is not in the store"


def test_a_fenced_daemon_names_what_takes_the_pool_back(tmp_path):
    """Another host took the pool: the fenced daemon's answers name `pool import
    --object-store` (a restart is refused), not "restart the daemon"."""
    with start_server("versitygw", tmp_path / "vgw") as srv:
        a = StorePool(tmp_path, srv, "fence42").create().start()
        try:
            a.create_volume("v", size="8M", encryption=False)
            b = StorePool(tmp_path, srv, "fence42", dir_name="hostb")
            r = b.import_from_store(a.dir / "pool.key", "--force")
            assert r.returncode == 0, r.stderr
            out = nbd_script(a, "h.pwrite(b'Z' * 4096, 0)\n" + try_flush(), check=False)
            assert "FLUSH-ERR" in out.stdout, out.stdout
            t = a.status()["object_store"]
            assert t["state"] == "FENCED" and "hostb" in t["fenced_by"], t
            assert "pool import --object-store" in t["take_back"], t
            r = a.cli("volume", "create", "w", "--size", "4M", "--encryption", "off", check=False)
            assert r.returncode != 0
            assert "restart the daemon" not in r.stderr, r.stderr
            assert "pool import --object-store" in r.stderr and "taken over" in r.stderr, r.stderr
            assert "pool import --object-store" in a.cli("status").stdout
        finally:
            a.kill()


def test_a_late_takeover_never_overwrites_a_newer_store(tmp_path):
    """Issue 41 part 3, the late path: this host's directory is put back from an older
    copy and `serve` starts while the store is down (it serves from the local devices).
    When the store answers, it holds commits newer than these devices: the daemon must
    not upload its older state over them (a silent rollback of the bucket). It refuses
    the takeover, `status` says why and names the import that keeps the store's state,
    and the bucket still holds the newer write."""
    import json
    import shutil
    with start_server("versitygw", tmp_path / "vgw") as srv:
        p = StorePool(tmp_path, srv, "latetake").create().start()
        key = p.create_volume("v", size="8M")
        nbd_script(p, "h.pwrite(b'A' * 65536, 0)\nh.flush()\n")
        p.stop()
        saved = tmp_path / "saved"
        run(["cp", "-a", "--sparse=always", str(p.dir), str(saved)])
        p.start()
        p.load_key("v", key)
        nbd_script(p, "h.pwrite(b'B' * 65536, 0)\nh.flush()\n")
        p.stop()
        store_gen = json.loads(p.bulwark("pool", "status", p.dir, "--json").stdout)["generation"]
        shutil.rmtree(p.dir)
        run(["cp", "-a", "--sparse=always", str(saved), str(p.dir)])
        srv.kill()
        try:
            p.start()
            assert p.status()["object_store"]["state"] == "UNREACHABLE"
            srv.restart()
            t = wait_until(lambda: p.status()["object_store"],
                           lambda t: t["state"] == "HELD" or "the store is newer" in (t.get("last_error") or ""),
                           timeout=60)
            assert t["state"] != "HELD", f"the older local copy took the newer store: {t}"
            assert "the store is newer" in t["last_error"], t
            assert f"--min-generation {store_gen}" in t["last_error"], t
            # The daemon stops writing its stale copy then (as a fenced one does), so a
            # clean stop has no final commit to make: killed, not stopped.
        finally:
            p.kill()
        q = StorePool(tmp_path, srv, "latetake", dir_name="q")
        r = q.import_from_store(p.dir / "pool.key", "--force")
        assert r.returncode == 0, r.stderr
        q.start()
        try:
            q.load_key("v", key)
            got = read_back(q, tmp_path / "q.img")
            assert got[:65536] == b"B" * 65536, "the bucket lost its newer write"
        finally:
            q.kill()
