"""Pools in an object store (issue 22, docs/object-store.md), against real S3 servers on
loopback (moto and versitygw v1.8.0, tests/helpers/s3servers.py) and our own fault proxy
between the daemon and the server (tests/helpers/s3proxy.py). tests/test_s3_harness.py
checks first that both servers honour conditional writes, so a server that stopped would
not turn the fencing tests below into false passes.

What a user checks: every flushed byte comes back from a pool rebuilt from the bucket
alone; a second host that takes the pool stops the first one's writes; a lost reply, a
storm of 503s, a crash between the store and the local labels lose nothing acknowledged;
a store that ignores conditions is refused; the bucket holds no plaintext, and altered
objects are detected.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HELPERS, Pool, make_key_file, nbd_python, run, stderr_lines

sys.path.insert(0, str(HELPERS))
from s3proxy import FaultProxy  # noqa: E402
from s3servers import SERVER_KINDS, start_server  # noqa: E402

VOLUME_MIB = 24
MARKER = b"BULWARK-PLAINTEXT-MARKER-0123456789abcdef"


@pytest.fixture(scope="module", params=SERVER_KINDS)
def server(request, tmp_path_factory):
    with start_server(request.param, tmp_path_factory.mktemp(request.param)) as s:
        yield s


@pytest.fixture(scope="module")
def versitygw(tmp_path_factory):
    with start_server("versitygw", tmp_path_factory.mktemp("vgw")) as s:
        yield s


def store_url(server, prefix: str, endpoint: str | None = None) -> str:
    return f"s3://{server.bucket}/{prefix}?endpoint={endpoint or server.endpoint}"


class StorePool(Pool):
    """A pool whose durable copy is in an object store."""

    def __init__(self, tmp_path: Path, server, prefix: str, endpoint: str | None = None,
                 dir_name: str = "pool", **kw):
        super().__init__(tmp_path, dir_name=dir_name, device_size="256M", **kw)
        self.server = server
        self.prefix = prefix
        self.url = store_url(server, prefix, endpoint)
        self.creds = server.write_credentials(self.tmp / f"s3-{dir_name}.env")

    def import_from_store(self, pool_key: Path, *extra) -> subprocess.CompletedProcess:
        """`pool import --object-store` into this pool's (new) directory."""
        return self.bulwark("pool", "import", "--object-store", self.url,
                            "--object-store-credentials", self.creds, "--dir", self.dir,
                            "--pool-key", pool_key, *extra, check=False)

    def create(self, *extra) -> "StorePool":
        return super().create("--devices", "1", "--device-size", self.device_size,
                              "--object-store", self.url,
                              "--object-store-credentials", self.creds, *extra)


def nbd_script(pool: Pool, body: str, *, check: bool = True) -> subprocess.CompletedProcess:
    """Run `body` in the libnbd Python with `h` connected to volume v."""
    code = (
        "import nbd, sys\n"
        "h = nbd.NBD()\n"
        f"h.connect_uri({pool.uri('v')!r})\n" + body
    )
    return run([nbd_python(), "-c", code], check=check)


def try_flush(indent: str = "") -> str:
    """Python for `nbd_script`: a FLUSH that prints FLUSHED, or FLUSH-ERR and its errno."""
    lines = ["try:", "    h.flush(); print('FLUSHED')", "except nbd.Error as e:",
             "    print('FLUSH-ERR', e.errno)"]
    return "".join(f"{indent}{line}\n" for line in lines)


def rebuilt_elsewhere(p: "StorePool", pool_key: Path, volume_key: Path, out: Path, *,
                      dir_name: str = "q", endpoint: str | None = None) -> bytes:
    """Import p's pool from its bucket into a new directory, serve it, and read volume v
    back whole."""
    q = StorePool(p.tmp, p.server, p.prefix, endpoint=endpoint, dir_name=dir_name)
    r = q.import_from_store(pool_key)
    assert r.returncode == 0, f"import from the bucket failed:\n{r.stdout}\n{r.stderr}"
    assert "imported pool" in r.stdout
    q.start()
    try:
        q.load_key("v", volume_key)
        return read_back(q, out)
    finally:
        q.kill()


def write_and_flush(pool: Pool, data: Path) -> None:
    run(["nbdcopy", "--flush", str(data), pool.uri("v")])


def read_back(pool: Pool, out: Path) -> bytes:
    run(["nbdcopy", pool.uri("v"), str(out)])
    return out.read_bytes()


def volume_data(path: Path, seed: int) -> bytes:
    """Incompressible bytes with a recognisable marker every MiB (for the plaintext check)."""
    import random
    rng = random.Random(seed)
    mib = 1 << 20
    chunks = []
    for _ in range(VOLUME_MIB):
        c = bytearray(rng.randbytes(mib))
        c[4096:4096 + len(MARKER)] = MARKER
        chunks.append(bytes(c))
    data = b"".join(chunks)
    path.write_bytes(data)
    return data


def objects(server, prefix: str) -> dict[str, bytes]:
    c = server.client()
    out = {}
    for k in server.keys(prefix + "/"):
        out[k] = c.get_object(Bucket=server.bucket, Key=k)["Body"].read()
    return out


def test_pool_rebuilt_from_the_bucket_alone(server, tmp_path):
    """Write through NBD, FLUSH, export; delete the pool directory; import from the bucket
    into a fresh directory: every byte verifies, and the bucket holds no plaintext."""
    p = StorePool(tmp_path, server, f"rebuild-{server.kind}").create().start()
    try:
        key = p.create_volume("v", size=f"{VOLUME_MIB}M")
        data = volume_data(tmp_path / "data.img", 1)
        write_and_flush(p, tmp_path / "data.img")
        st = p.status()["object_store"]
        assert st["fenced"] is None and st["segments_stored"] > 0, st
        p.stop()
    finally:
        p.kill()
    stored = objects(server, p.prefix)
    assert sum(len(b) for b in stored.values()) >= len(data), \
        "the bucket holds less than the volume's data"
    leaked = [k for k, b in stored.items() if MARKER in b]
    assert not leaked, f"plaintext of the encrypted volume in the bucket: {leaked}"

    # The old host exports the pool (its last commit says so in the store) ...
    r = p.bulwark("pool", "export", p.dir)
    assert r.returncode == 0, r.stderr
    pool_key = tmp_path / "pool.key.backup"
    shutil.copy2(p.dir / "pool.key", pool_key)
    shutil.copy2(key, tmp_path / "v.key")
    shutil.rmtree(p.dir)

    # ... and a new host imports it from the bucket and the pool key alone.
    got = rebuilt_elsewhere(p, pool_key, tmp_path / "v.key", tmp_path / "out.img",
                            dir_name="newhost")
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(data).hexdigest(), \
        "a byte differs after the import from the bucket"


def test_second_host_fences_the_first(versitygw, tmp_path):
    """Split brain: a second importer takes the pool (--force, the first did not export);
    the first one's next FLUSH fails with EIO and it stops writing; restarted, it refuses
    to serve, naming the holder. What the first flushed before is all on the second.
    Nonces never overlap: listed offline (tests/helpers/bwforge.py, the format's own
    reader) from both hosts' devices, no (volume, key generation, salt, nonce) seals
    two different records."""
    srv = versitygw
    a = StorePool(tmp_path, srv, "fence").create().start()
    key = a.create_volume("v", size=f"{VOLUME_MIB}M")
    data = volume_data(tmp_path / "data.img", 2)
    write_and_flush(a, tmp_path / "data.img")
    a_devices = a.device_paths()

    b = StorePool(tmp_path, srv, "fence", dir_name="hostb")
    r = b.import_from_store(a.dir / "pool.key")
    assert r.returncode != 0 and "did not export" in r.stderr, \
        f"import of a pool another host holds must need --force:\n{r.stdout}\n{r.stderr}"
    r = b.import_from_store(a.dir / "pool.key", "--force")
    assert r.returncode == 0, f"forced import failed:\n{r.stdout}\n{r.stderr}"

    # The first host is fenced: its write may be taken, its flush is refused.
    out = nbd_script(a, (
        "h.pwrite(b'Z' * 4096, 0)\n" + try_flush()
    ), check=False)
    assert "FLUSH-ERR" in out.stdout and "FLUSHED" not in out.stdout, \
        f"a fenced host's flush must fail:\n{out.stdout}\n{out.stderr}\n{a.log_tail()}"
    st = a.status()
    assert st["state"] == "FAULTED", st["state"]
    assert st["object_store"]["fenced"] and "taken over" in st["object_store"]["fenced"]
    a.kill()
    r = run([str(a.bin), "serve", str(a.dir)], check=False, env=a._env(), timeout=60)
    assert r.returncode != 0 and "held by" in r.stderr and "hostb" in r.stderr, \
        f"a stale host must refuse to serve, naming the holder:\n{r.stderr}"

    b.start()
    try:
        b.load_key("v", key)
        got = read_back(b, tmp_path / "out.img")
        assert got == data, "the new holder lacks data the first host flushed"
        # The new holder writes under the same volume key as the fenced host did.
        run(["qemu-io", "-f", "raw", "-c", "write -P 0x5b 0 1M", "-c", "flush", b.uri("v")])
        b_devices = b.device_paths()
        b.stop()
    finally:
        b.kill()
    assert_no_nonce_sealed_twice(a, [a_devices, b_devices])


def assert_no_nonce_sealed_twice(pool: Pool, device_sets: list[list[str]]) -> None:
    """Over the encrypted records reachable on each set of devices (listed offline by
    bwforge), no (volume, key generation, salt, nonce) seals two different records; and
    each set wrote under a salt of its own."""
    pytest.importorskip("cryptography", reason="bwforge opens the volume table with AES-GCM")
    import bwforge
    import collections
    k = (pool.dir / "pool.key").read_bytes()
    seen = collections.defaultdict(set)
    salts = []
    for devs in device_sets:
        recs = bwforge.Image(devs, k).nonces()
        assert len(recs) >= 256, f"{devs}: only {len(recs)} encrypted records"
        salts.append({r["salt"] for r in recs})
        for r in recs:
            seen[(r["volume"], r["key_generation"], r["salt"], r["nonce"])].add((r["lba"], r["checksum"]))
    reused = {n: v for n, v in seen.items() if len(v) > 1}
    assert not reused, f"nonce reused across hosts: {list(reused.items())[:5]}"
    for i, own in enumerate(salts[1:], 1):
        assert own - set().union(*salts[:i]), f"host {i} wrote under no salt of its own: {salts}"


def test_lost_reply_to_the_superblock_put(versitygw, tmp_path):
    """The superblock PUT lands but its reply is lost: the FLUSH is acknowledged, once, and
    the next commit goes on from it (no false fencing)."""
    srv = versitygw
    proxy = FaultProxy.for_server(srv)
    with proxy:
        p = StorePool(tmp_path, srv, "lostreply", endpoint=proxy.endpoint).create().start()
        try:
            key = p.create_volume("v", size=f"{VOLUME_MIB}M")
            rule = proxy.drop_reply(method="PUT", prefix="lostreply/superblock", times=1)
            data = volume_data(tmp_path / "data.img", 3)
            write_and_flush(p, tmp_path / "data.img")
            assert rule.fired, "the reply-dropping rule never fired"
            assert rule.statuses and rule.statuses[0] == 200, rule.statuses
            st = p.status()
            assert st["state"] == "ONLINE" and st["object_store"]["fenced"] is None, st
            nbd_script(p, "h.pwrite(b'Q' * 4096, 0)\nh.flush()\n")
            data = b"Q" * 4096 + data[4096:]
            p.stop()
            p.start()
            p.load_key("v", key)
            assert read_back(p, tmp_path / "out.img") == data
        finally:
            p.kill()


def test_store_outage_fails_flush_by_deadline_then_resumes(versitygw, tmp_path):
    """30 s of 503s from the store: reads are served all along, every FLUSH fails with EIO
    by the client's deadline instead of hanging, the pool is not faulted, and once the
    store answers again the next FLUSH makes everything durable."""
    srv = versitygw
    proxy = FaultProxy.for_server(srv)
    with proxy:
        p = StorePool(tmp_path, srv, "outage", endpoint=proxy.endpoint).create().start()
        try:
            key = p.create_volume("v", size="8M")
            nbd_script(p, "h.pwrite(b'A' * 65536, 0)\nh.flush()\n")
            rule = proxy.fail_503()
            # For 30 s of the storm: reads, writes and flushes, round after round; each
            # flush must come back (the run's own timeout bounds it) with EIO.
            out = nbd_script(p, (
                "import time\n"
                "t0 = time.monotonic(); rounds = 0\n"
                "while time.monotonic() - t0 < 30 or rounds == 0:\n"
                "    assert h.pread(65536, 0) == b'A' * 65536\n"
                "    h.pwrite(b'B' * 65536, 65536)\n" + try_flush("    ") +
                "    rounds += 1\n"
                "print('ROUNDS', rounds)\n"
            ), check=False)
            assert "FLUSH-ERR" in out.stdout and "FLUSHED" not in out.stdout, \
                f"{out.stdout}\n{out.stderr}\n{p.log_tail()}"
            assert rule.hits > 0
            # Not faulted; DEGRADED while commits fail (issue 42: the outage is visible).
            assert p.status()["state"] == "DEGRADED", "a store outage must degrade, not fault"
            rule.off()
            nbd_script(p, "h.pwrite(b'C' * 4096, 131072)\nh.flush()\n")
            p.kill()  # a crash: only what the store took counts
            p.start()
            p.load_key("v", key)
            got = read_back(p, tmp_path / "out.img")
            assert got[:65536] == b"A" * 65536
            assert got[65536:131072] == b"B" * 65536, "a write flushed after the outage was lost"
            assert got[131072:135168] == b"C" * 4096
        finally:
            p.kill()


def test_crash_after_the_store_took_the_commit(versitygw, tmp_path):
    """Killed after the store took a commit and before the local labels: the restart
    brings the labels to the store's generation, and the flushed data is there."""
    srv = versitygw
    p = StorePool(tmp_path, srv, "crashpub").create().start()
    key = p.create_volume("v", size="8M")
    p.stop()
    p.start(env={"BULWARK_CRASH_AT": "commit.published"})
    p.load_key("v", key)
    out = nbd_script(p, (
        "h.pwrite(b'P' * 65536, 0)\n"
        "try:\n"
        "    h.flush(); print('FLUSHED')\n"
        "except Exception as e:\n"
        "    print('FLUSH-ERR', e)\n"
    ), check=False)
    assert "FLUSHED" not in out.stdout, "the daemon should have stopped at the crash point"
    p.proc.wait(30)
    p.proc = None
    p.start()
    try:
        assert "brought to the object store's generation" in p.log_tail()
        p.load_key("v", key)
        got = read_back(p, tmp_path / "out.img")
        assert got[:65536] == b"P" * 65536, "the commit the store took is lost"
    finally:
        p.kill()


def test_store_that_ignores_conditions_is_refused(versitygw, tmp_path):
    """A proxy that strips If-Match/If-None-Match (and signs the request again) stands for
    a store that ignores them: probe-store, pool create and serve all refuse it, naming
    the check that failed."""
    srv = versitygw
    proxy = FaultProxy.for_server(srv)
    with proxy:
        p = StorePool(tmp_path, srv, "nocond", endpoint=proxy.endpoint)
        r = p.bulwark("pool", "probe-store", p.url, "--object-store-credentials", p.creds)
        assert r.returncode == 0 and "honours conditional writes" in r.stdout
        rule = proxy.strip_conditions(resign=True)
        r = p.bulwark("pool", "probe-store", p.url, "--object-store-credentials", p.creds,
                      check=False)
        assert r.returncode == 1 and "If-None-Match" in r.stderr, r.stderr
        r = p.bulwark("pool", "create", p.dir, "--device-size", "256M", "--object-store",
                      p.url, "--object-store-credentials", p.creds, check=False)
        assert r.returncode != 0 and "does not honour conditional writes" in r.stderr, r.stderr
        assert not (p.dir / "pool.json").exists(), "a refused create left a pool behind"
        rule.off()
        p.create().start()
        p.stop()
        rule = proxy.strip_conditions(resign=True)
        r = run([str(p.bin), "serve", str(p.dir)], check=False, env=p._env(), timeout=60)
        assert r.returncode != 0 and "does not honour conditional writes" in r.stderr, r.stderr


def test_altered_objects_are_detected(versitygw, tmp_path):
    """The bucket's operator alters the superblock object: the import refuses it (MAC).
    Bytes flipped in a data part: reads of those blocks fail with EIO, never wrong data."""
    srv = versitygw
    p = StorePool(tmp_path, srv, "tamper").create().start()
    key = p.create_volume("v", size=f"{VOLUME_MIB}M")
    data = volume_data(tmp_path / "data.img", 4)
    write_and_flush(p, tmp_path / "data.img")
    p.stop()
    p.bulwark("pool", "export", p.dir)
    c = srv.client()
    sb_key = "tamper/superblock"
    original = c.get_object(Bucket=srv.bucket, Key=sb_key)["Body"].read()
    body = json.loads(original.rsplit(b"\n", 1)[0])
    body["generation"] += 1
    forged = json.dumps(body).encode() + b"\n" + original.rsplit(b"\n", 1)[1]
    c.put_object(Bucket=srv.bucket, Key=sb_key, Body=forged)
    q = StorePool(tmp_path, srv, "tamper", dir_name="q")
    r = q.import_from_store(p.dir / "pool.key")
    assert r.returncode != 0 and "MAC" in r.stderr, r.stderr
    assert not (q.dir / "pool.json").exists()

    c.put_object(Bucket=srv.bucket, Key=sb_key, Body=original)
    # The largest part is client data: flip one byte in each of its 64 KiB pieces.
    parts = {k: b for k, b in objects(srv, "tamper").items() if "/seg/" in "/" + k}
    victim = max(parts, key=lambda k: len(parts[k]))
    bad = bytearray(parts[victim])
    for i in range(1000, len(bad), 65536):
        bad[i] ^= 0x40
    c.put_object(Bucket=srv.bucket, Key=victim, Body=bytes(bad))
    r = q.import_from_store(p.dir / "pool.key")
    assert r.returncode == 0, r.stderr
    q.start()
    try:
        q.load_key("v", key)
        out = nbd_script(q, (
            "bad = good = 0\n"
            f"want = open({str(tmp_path / 'data.img')!r}, 'rb').read()\n"
            f"for off in range(0, {VOLUME_MIB << 20}, 4096):\n"
            "    try:\n"
            "        got = h.pread(4096, off)\n"
            "    except nbd.Error:\n"
            "        bad += 1; continue\n"
            "    assert got == want[off:off + 4096], f'wrong data at {off}'\n"
            "    good += 1\n"
            "print('BAD', bad, 'GOOD', good)\n"
        ), check=False)
        assert out.returncode == 0, f"wrong data returned:\n{out.stdout}\n{out.stderr}"
        bad_blocks = int(out.stdout.split()[1])
        assert bad_blocks > 0, "no read noticed the altered part"
    finally:
        q.kill()


def test_garbage_collection_keeps_what_commits_reference(versitygw, tmp_path):
    """Segments freed by overwrites leave the table, and the objects that held only them
    are garbage: with a grace of 0 s the daemon deletes them, and only unreferenced ones:
    the referenced table pages stay, and the pool still rebuilds from the bucket, byte for
    byte."""
    from conftest import wait_until
    srv = versitygw
    p = StorePool(tmp_path, srv, "gc", serve_args=("--object-store-gc-grace", "0"))
    p.create().start()
    key = p.create_volume("v", size="8M")
    want = b""
    for i in range(3):
        want = os.urandom(8 << 20)
        (tmp_path / "round.img").write_bytes(want)
        write_and_flush(p, tmp_path / "round.img")
    c = srv.client()

    def head():
        raw = c.get_object(Bucket=srv.bucket, Key="gc/superblock")["Body"].read()
        return json.loads(raw.rsplit(b"\n", 1)[0])

    segs_before = set(srv.keys("gc/seg/"))
    p.stop()
    p.start()  # the first round of the new run collects
    st = wait_until(lambda: p.status()["object_store"], lambda s: s["collected"] > 0)
    assert st["collected"] > 0, f"nothing collected: {st}\n{p.log_tail()}"
    segs_after = set(srv.keys("gc/seg/"))
    assert segs_before - segs_after, "no object of the overwritten data was deleted"
    referenced = {f"gc/{pg['name']}" for pg in head()["pages"]}
    assert referenced <= set(srv.keys("gc/table/")), "a referenced table page was deleted"
    p.stop()
    p.bulwark("pool", "export", p.dir)
    assert rebuilt_elsewhere(p, p.dir / "pool.key", key, tmp_path / "out.img") == want


def test_a_copied_directory_is_another_writer(versitygw, tmp_path):
    """A pool directory copied elsewhere (devices and pool.json, writer name included) does
    not silently take the pool from the host that holds it: it is refused, naming the
    holder, unless the holder exported the pool."""
    srv = versitygw
    p = StorePool(tmp_path, srv, "copied").create().start()
    p.create_volume("v", size="8M")
    p.stop()
    copy = tmp_path / "copy"
    shutil.copytree(p.dir, copy, symlinks=True)
    (copy / "pool.lock").unlink(missing_ok=True)
    r = run([str(p.bin), "serve", str(copy)], check=False, env=p._env(), timeout=60)
    assert r.returncode != 0 and "held by" in r.stderr, r.stderr
    # The original still serves.
    p.start()
    p.stop()


def test_an_oversized_superblock_object_is_refused_without_reading_it(versitygw, tmp_path):
    """The bucket's operator replaces the superblock object with a huge one: the import
    refuses it by its size, before reading it."""
    srv = versitygw
    p = StorePool(tmp_path, srv, "huge").create()
    srv.client().put_object(Bucket=srv.bucket, Key="huge/superblock", Body=b"x" * (17 << 20))
    q = StorePool(tmp_path, srv, "huge", dir_name="q")
    r = q.import_from_store(p.dir / "pool.key")
    # Refused by the size the store gives (HEAD), not after a download of the body.
    assert r.returncode != 0 and f"holds {17 << 20} bytes" in r.stderr, r.stderr


@pytest.mark.parametrize("what", ["seg/", "superblock"])
def test_store_killed_mid_upload(what, tmp_path):
    """The server is killed while a commit's upload is mid-body (held by the proxy), then
    restarted; afterwards the daemon is killed -9 and restarted too. Each FLUSH was either
    acknowledged, and its data is there (on the host, and in a pool rebuilt from the
    bucket), or it failed; the interrupted object is absent or whole."""
    import threading
    with start_server("versitygw", tmp_path / "vgw") as srv, FaultProxy.for_server(srv) as proxy:
        prefix = "killed-" + what.rstrip("/")
        p = StorePool(tmp_path, srv, prefix, endpoint=proxy.endpoint).create().start()
        try:
            key = p.create_volume("v", size="16M")
            nbd_script(p, "h.pwrite(b'1' * 1048576, 0)\nh.flush()\n")
            rule = proxy.slow_body(hold_after=2048, prefix=f"{prefix}/{what}", times=1)
            result = {}

            def flush():
                result["out"] = nbd_script(p, (
                    "h.pwrite(b'2' * 1048576, 1048576)\n" + try_flush()
                ), check=False).stdout

            t = threading.Thread(target=flush)
            t.start()
            assert rule.holding.wait(60), f"no upload reached the hold: {proxy.requests()[-3:]}"
            held = proxy.requests()[-1]
            srv.kill()
            rule.release()
            srv.restart()
            t.join(120)
            assert not t.is_alive(), "the FLUSH hung past the client's deadlines"
            assert "FLUSHED" in result["out"] or "FLUSH-ERR" in result["out"], result
            flushed_2 = "FLUSHED" in result["out"]
            # The store is back: the next FLUSH makes everything durable.
            nbd_script(p, "h.pwrite(b'3' * 1048576, 2097152)\nh.flush()\n")
            assert p.status()["state"] == "ONLINE"
            # The interrupted object: absent, or whole (never a prefix of its body).
            c = srv.client()
            want = dict(held.headers).get("Content-Length") or dict(held.headers).get("content-length")
            if held.key.endswith("/superblock"):
                # Rewritten by every commit since: whole means it still parses and carries
                # its MAC line (the pool above took it, which checked the MAC).
                raw = c.get_object(Bucket=srv.bucket, Key=held.key)["Body"].read()
                body, mac = raw.rsplit(b"\n", 1)
                json.loads(body)
                assert len(mac) == 64, f"a partial superblock object: {raw[-80:]!r}"
            elif held.key in srv.keys(held.key) and want:
                size = c.head_object(Bucket=srv.bucket, Key=held.key)["ContentLength"]
                assert size == int(want), f"a partial object: {held.key} {size} of {want}"
            p.kill()
            p.start()
            p.load_key("v", key)
            got = read_back(p, tmp_path / "out.img")
            assert got[:1048576] == b"1" * 1048576
            assert got[2097152:3145728] == b"3" * 1048576
            assert got[1048576:2097152] == b"2" * 1048576, \
                f"the second write (flush {'acknowledged' if flushed_2 else 'failed'}) is missing"
            p.stop()
        finally:
            p.kill()
        p.bulwark("pool", "export", p.dir)
        assert rebuilt_elsewhere(p, p.dir / "pool.key", key, tmp_path / "out2.img",
                                 endpoint=proxy.endpoint) == got


def test_local_flush_mode(versitygw, tmp_path):
    """--object-store-flush local: a FLUSH is durable on the local devices (intent log)
    and survives kill -9 without the store having it; the store gets it with a commit,
    and a pool rebuilt from the bucket has it after a clean stop."""
    srv = versitygw
    p = StorePool(tmp_path, srv, "localflush").create("--object-store-flush", "local").start()
    try:
        assert p.status()["object_store"]["flush"] == "local"
        key = p.create_volume("v", size="8M")
        nbd_script(p, "h.pwrite(b'L' * 65536, 0)\nh.flush()\n")
        p.kill()  # before the 5 s commit: only the local intent log has the write
        p.start()
        assert "intent log replayed" in p.log_tail()
        p.load_key("v", key)
        assert read_back(p, tmp_path / "a.img")[:65536] == b"L" * 65536
        p.stop()
    finally:
        p.kill()
    p.bulwark("pool", "export", p.dir)
    got = rebuilt_elsewhere(p, p.dir / "pool.key", key, tmp_path / "b.img")
    assert got[:65536] == b"L" * 65536


def test_rolled_back_store_refused_with_min_generation(versitygw, tmp_path):
    """The bucket's operator restores an older (authentic) superblock object: an import
    told the generation the last host showed refuses it, naming both generations."""
    srv = versitygw
    p = StorePool(tmp_path, srv, "rollback").create().start()
    try:
        p.create_volume("v", size="8M")
        nbd_script(p, "h.pwrite(b'A' * 4096, 0)\nh.flush()\n")
        c = srv.client()
        old = c.get_object(Bucket=srv.bucket, Key="rollback/superblock")["Body"].read()
        nbd_script(p, "h.pwrite(b'B' * 4096, 0)\nh.flush()\n")
        last = p.status()["generation"]
        p.stop()
    finally:
        p.kill()
    c.put_object(Bucket=srv.bucket, Key="rollback/superblock", Body=old)
    q = StorePool(tmp_path, srv, "rollback", dir_name="q")
    r = q.import_from_store(p.dir / "pool.key", "--force", "--min-generation", str(last))
    assert r.returncode != 0 and "older than" in r.stderr and "rolled back" in r.stderr, r.stderr
    assert not (q.dir / "pool.json").exists()


def test_an_existing_pool_gets_an_object_store(versitygw, tmp_path):
    """`pool object-store add URL` on a pool that has data: everything it held is uploaded,
    later flushes go to the store, and a new host rebuilds every byte from the bucket. A
    second add is refused; `remove` makes the pool local again."""
    srv = versitygw
    p = StorePool(tmp_path, srv, "added")
    Pool.create(p, "--devices", "1", "--device-size", p.device_size)
    p.start()
    try:
        key = p.create_volume("v", size=f"{VOLUME_MIB}M")
        data = volume_data(tmp_path / "data.img", 21)
        write_and_flush(p, tmp_path / "data.img")
        assert p.status().get("object_store") is None
        r = p.cli("pool", "object-store", "add", p.url, check=False)
        assert r.returncode != 0 and "stop it first" in r.stderr, \
            f"changing a served pool's store must be refused:\n{r.stdout}\n{r.stderr}"
        p.stop()
    finally:
        p.kill()
    assert not server_keys(srv, p.prefix), "objects in the bucket before the store was added"
    r = p.cli("pool", "object-store", "add", p.url, "--object-store-credentials", p.creds)
    assert "segments uploaded" in r.stdout, r.stdout
    r = p.cli("pool", "object-store", "add", p.url, "--object-store-credentials", p.creds,
              check=False)
    assert r.returncode != 0 and "already keeps its durable copy" in r.stderr, r.stderr
    p.start()
    try:
        st = p.status()["object_store"]
        assert st["fenced"] is None and st["segments_stored"] > 0, st
        p.load_key("v", key)
        nbd_script(p, "h.pwrite(b'A' * 65536, 0)\nh.flush()\n")
        data = b"A" * 65536 + data[65536:]
        p.stop()
    finally:
        p.kill()
    r = p.bulwark("pool", "export", p.dir)
    assert r.returncode == 0, r.stderr
    pool_key = tmp_path / "pool.key.backup"
    shutil.copy2(p.dir / "pool.key", pool_key)
    got = rebuilt_elsewhere(p, pool_key, key, tmp_path / "out.img", dir_name="elsewhere")
    assert got == data, "bytes differ after an import of a pool whose store was added late"

    # The store is another host's now: forgetting it here needs --force.
    r = p.cli("pool", "object-store", "remove", check=False)
    assert r.returncode != 0 and "--force" in r.stderr, f"{r.stdout}\n{r.stderr}"
    r = p.cli("pool", "object-store", "remove", "--force", check=False)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    r = p.cli("pool", "object-store", "remove", check=False)
    assert r.returncode != 0 and "has no object store" in r.stderr, r.stderr


def server_keys(server, prefix: str) -> list[str]:
    return [k for k in server.keys(prefix + "/") if not k.startswith(prefix + "/probe/")]


def test_scrub_verify_store_finds_and_replaces_bad_copies(versitygw, tmp_path):
    """`scrub start --verify-store` checks the store's copies of records the local devices
    hold (without it, only the local copies are read): records altered in the bucket are
    counted bad and written again from their verified local copies, a second scrub finds
    none, and a new host importing from the bucket reads every byte."""
    srv = versitygw
    p = StorePool(tmp_path, srv, "verify").create().start()
    try:
        # Stored as written (no encryption, no compression): the marker every MiB shows
        # where client data lies in the objects.
        p.create_volume("v", size=f"{VOLUME_MIB}M", encryption=False, compression="off")
        data = volume_data(tmp_path / "data.img", 7)
        write_and_flush(p, tmp_path / "data.img")
        c = srv.client()
        altered = 0
        for k, body in objects(srv, p.prefix).items():
            if not k.startswith(p.prefix + "/seg/") or MARKER not in body:
                continue
            b = bytearray(body)
            at = b.find(MARKER)
            while at >= 0 and altered < 4:
                b[at + len(MARKER)] ^= 0xFF
                altered += 1
                at = b.find(MARKER, at + 1)
            c.put_object(Bucket=srv.bucket, Key=k, Body=bytes(b))
        assert altered >= 3, "no marker found in the bucket's objects"

        r = p.cli("scrub", "start", "--wait")
        assert r.returncode == 0, r.stderr
        st = p.status()["scrub"]
        assert st.get("store") is None, f"a plain scrub asked the store: {st}"

        r = p.cli("scrub", "start", "--verify-store", "--wait")
        assert r.returncode == 0, r.stdout + r.stderr
        st = p.status()["scrub"]
        store = st["store"]
        # Each altered record once (an object no commit references any more may hold an
        # older copy of one: altering that changes nothing a reader sees).
        assert 1 <= store["bad"] <= altered and store["rewritten"] == store["bad"], st
        assert store["verified"] > 0, st
        assert "object store copies" in p.cli("scrub", "status").stdout

        r = p.cli("scrub", "start", "--verify-store", "--wait")
        assert r.returncode == 0, r.stderr
        store = p.status()["scrub"]["store"]
        assert store["bad"] == 0 and store["verified"] > 0, store
        assert read_back(p, tmp_path / "out0.img") == data
        p.stop()
    finally:
        p.kill()
    r = p.bulwark("pool", "export", p.dir)
    assert r.returncode == 0, r.stderr
    shutil.copy2(p.dir / "pool.key", tmp_path / "pool.key.backup")
    q = StorePool(p.tmp, srv, p.prefix, dir_name="verified")
    r = q.import_from_store(tmp_path / "pool.key.backup")
    assert r.returncode == 0, r.stdout + r.stderr
    q.start()
    try:
        got = read_back(q, tmp_path / "out.img")
        assert got == data, "a new host reads altered bytes after the store was scrubbed"
    finally:
        q.kill()


def test_scrub_verify_store_needs_a_store(make_pool):
    p = make_pool().create().start()
    r = p.cli("scrub", "start", "--verify-store", check=False)
    assert r.returncode != 0 and "no object store" in r.stderr, r.stderr


def test_a_pool_with_a_store_takes_no_log_device(versitygw, tmp_path):
    """`pool log add` on a pool with an object store is refused, naming why, and the
    pool still opens (the import refuses log devices beside a store: before, the add
    went through and the pool could not be opened again)."""
    p = StorePool(tmp_path, versitygw, "nolog").create().start()
    p.stop()
    log = tmp_path / "log.img"
    with open(log, "wb") as f:
        f.truncate(64 << 20)
    r = p.cli("pool", "log", "add", log, check=False)
    assert r.returncode != 0 and "takes no separate log device" in r.stderr, r.stderr
    p.start()
    assert p.status()["state"] == "ONLINE"
    p.kill()


def test_bucket_rolled_back_under_a_newer_host(versitygw, tmp_path):
    """Issue 41 part 3: the bucket's operator puts back an older (authentic) superblock
    object while this host's devices hold a newer commit. `serve` refuses, in one line
    naming both generations and which side is newer; it never advises a plain import from
    the store (that takes the older state and fences this host): the import it names
    carries --min-generation. The command it gives to keep the newer devices works: the
    pool serves again, with the newer write, from a store that holds it."""
    srv = versitygw
    p = StorePool(tmp_path, srv, "bucketrb").create().start()
    try:
        key = p.create_volume("v", size="8M")
        nbd_script(p, "h.pwrite(b'A' * 4096, 0)\nh.flush()\n")
        c = srv.client()
        old = c.get_object(Bucket=srv.bucket, Key="bucketrb/superblock")["Body"].read()
        nbd_script(p, "h.pwrite(b'B' * 4096, 0)\nh.flush()\n")
        p.stop()
    finally:
        p.kill()
    local = json.loads(p.bulwark("pool", "status", p.dir, "--json").stdout)["generation"]
    c.put_object(Bucket=srv.bucket, Key="bucketrb/superblock", Body=old)

    r = run([str(p.bin), "serve", str(p.dir)], check=False, env=p._env(), timeout=60)
    assert r.returncode != 0, f"a pool whose bucket was rolled back was served:\n{r.stderr}"
    lines = [l for l in stderr_lines(r) if l.startswith("error:")]
    assert len(lines) == 1, r.stderr
    msg = lines[0]
    import re
    gens = {int(g) for g in re.findall(r"generation (\d+)", msg)}
    assert local in gens and len(gens) == 2 and min(gens) < local, msg
    assert "this host's devices are newer" in msg, msg
    # Every import from the store it names refuses the older copy.
    for cmd in re.findall(r"'(bulwark [^']*)'", msg):
        if "import" in cmd:
            assert f"--min-generation {local}" in cmd, msg
    # The command that keeps the newer devices, run as given (DIR and a new prefix filled
    # in), brings the pool back with the second write.
    keep = [cmd for cmd in re.findall(r"'(bulwark [^']*)'", msg) if "object-store" in cmd
            and "import" not in cmd]
    assert len(keep) == 2 and "remove" in keep[0] and "add" in keep[1], msg
    assert f"--pool {p.dir}" in keep[0], msg
    p.cli("pool", "object-store", "remove", "--force")
    newer = StorePool(tmp_path, srv, "bucketrb2")
    p.cli("pool", "object-store", "add", newer.url, "--object-store-credentials", p.creds)
    p.start()
    try:
        p.load_key("v", key)
        assert read_back(p, tmp_path / "v.img")[:4096] == b"B" * 4096
        assert p.status()["object_store"]["state"] == "HELD"
        p.stop()
    finally:
        p.kill()
    p.bulwark("pool", "export", p.dir)
    p.url = newer.url
    p.prefix = newer.prefix
    got = rebuilt_elsewhere(p, p.dir / "pool.key", key, tmp_path / "b.img")
    assert got[:4096] == b"B" * 4096, "the new prefix lacks the newer write"


def test_devices_older_than_the_bucket_name_the_import_that_keeps_it(versitygw, tmp_path):
    """Issue 41 part 3, the other side: this host's whole directory (devices and anchor)
    is put back from an older copy while the bucket holds a newer commit. `serve` refuses,
    names both generations and the store as the newer side, and the import it gives
    (with --min-generation at the store's generation), run as given, serves the newer
    write."""
    srv = versitygw
    p = StorePool(tmp_path, srv, "devsold").create().start()
    try:
        key = p.create_volume("v", size="8M")
        nbd_script(p, "h.pwrite(b'A' * 4096, 0)\nh.flush()\n")
        p.stop()
        saved = tmp_path / "saved"
        run(["cp", "-a", "--sparse=always", str(p.dir), str(saved)])
        p.start()
        p.load_key("v", key)
        nbd_script(p, "h.pwrite(b'B' * 4096, 0)\nh.flush()\n")
        p.stop()
    finally:
        p.kill()
    store_gen = json.loads(p.bulwark("pool", "status", p.dir, "--json").stdout)["generation"]
    shutil.rmtree(p.dir)
    run(["cp", "-a", "--sparse=always", str(saved), str(p.dir)])

    r = run([str(p.bin), "serve", str(p.dir)], check=False, env=p._env(), timeout=60)
    assert r.returncode != 0, f"devices older than the bucket were served:\n{r.stderr}"
    lines = [l for l in stderr_lines(r) if l.startswith("error:")]
    assert len(lines) == 1, r.stderr
    msg = lines[0]
    import re
    gens = {int(g) for g in re.findall(r"generation (\d+)", msg)}
    assert store_gen in gens and len(gens) == 2 and max(gens) == store_gen, msg
    assert "the store is newer" in msg, msg
    cmds = [c for c in re.findall(r"'(bulwark [^']*)'", msg) if "pool import" in c]
    assert len(cmds) == 1 and f"--min-generation {store_gen}" in cmds[0], msg
    q = tmp_path / "q"
    argv = cmds[0].replace("FILE", str(p.creds)).replace("NEWDIR", str(q)).split()
    r = p.bulwark(*argv[1:], check=False)
    assert r.returncode == 0, f"the import the refusal gave failed:\n{r.stdout}\n{r.stderr}"
    qp = StorePool(tmp_path, srv, "devsold", dir_name="q")
    qp.start()
    try:
        qp.load_key("v", key)
        assert read_back(qp, tmp_path / "v.img")[:4096] == b"B" * 4096
    finally:
        qp.kill()


def test_import_from_the_store_with_key_dir(versitygw, tmp_path):
    """`pool import --object-store ... --key-dir K` (issue 41 part 2): the imported pool's
    key and anchor are in K, not in the new directory beside its device files; the pool
    serves from there with the data."""
    srv = versitygw
    p = StorePool(tmp_path, srv, "keydir").create().start()
    try:
        key = p.create_volume("v", size="8M")
        nbd_script(p, "h.pwrite(b'K' * 4096, 0)\nh.flush()\n")
        p.stop()
    finally:
        p.kill()
    p.bulwark("pool", "export", p.dir)
    q = StorePool(tmp_path, srv, "keydir", dir_name="q")
    keys = tmp_path / "trust" / "q"
    r = q.import_from_store(p.dir / "pool.key", "--key-dir", keys)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert f"trust root: {keys.resolve()}" in r.stdout, r.stdout
    assert (keys / "pool.key").exists() and (keys / "pool.anchor").exists()
    assert not (q.dir / "pool.key").exists() and not (q.dir / "pool.anchor").exists()
    q.start()
    try:
        assert q.status()["trust_root"]["key_dir"] is True
        q.load_key("v", key)
        assert read_back(q, tmp_path / "k.img")[:4096] == b"K" * 4096
        q.stop()
    finally:
        q.kill()
