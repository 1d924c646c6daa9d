"""The local cache of a pool in an object store (issue 22 part 5, docs/object-store.md):
with `--object-store-cache-size`, the local devices keep about that much of the pool, and
records of the segments given back are read from the store, one ranged GET each.

What a user checks: the device files stay near the size asked for while the volume is
larger; every byte reads back exact, from the store where it must; a cold 4 KiB read costs
one small GET; a restart and an import on a new host with an empty cache (metadata only)
serve the same bytes; a store outage fails those reads with EIO and serves the rest; a
record no local copy verifies is read from the store instead (a one-device pool heals);
and a host that lost the pool reads EIO, never wrong bytes, once the new holder collected
the objects it read from.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from conftest import qemu_io, run
from test_object_store import (
    StorePool,
    FaultProxy,
    nbd_script,
    read_back,
    volume_data,
    write_and_flush,
)
import test_object_store
from test_object_store import versitygw  # noqa: F401  (the module's server fixture)

CACHE = "16M"
CACHE_BYTES = 16 << 20
VOLUME_MIB = test_object_store.VOLUME_MIB  # 24: larger than the cache


def allocated(pool: StorePool) -> int:
    """Bytes the pool's device files take on the local file system (what `du` shows)."""
    return sum(os.stat(p).st_blocks * 512 for p in Path(pool.dir).glob("dev*.img"))


def wait_for(what: str, cond, timeout: float = 90.0, every: float = 0.5):
    """Poll `cond()` until it returns something true (the daemon's maintenance thread
    gives room back on its own schedule); fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)


def cache_of(pool: StorePool) -> dict:
    st = pool.status()["object_store"]
    assert st.get("cache"), f"status shows no local cache: {st}"
    return st


def ranged_gets(proxy: FaultProxy, prefix: str) -> list:
    return [s for s in proxy.requests() if s.method == "GET" and s.key
            and s.key.startswith(prefix + "/seg/")
            and any(k.lower() == "range" for k, _ in s.headers)]


@contextlib.contextmanager
def cache_pool(srv, tmp_path: Path, prefix: str):
    """A served pool with a `CACHE` local cache, its store behind a counting fault proxy:
    (proxy, pool); the daemon is killed at the end."""
    with FaultProxy.for_server(srv) as proxy:
        p = StorePool(tmp_path, srv, prefix, endpoint=proxy.endpoint).create(
            "--object-store-cache-size", CACHE).start()
        try:
            yield proxy, p
        finally:
            p.kill()


def fill_past_cache(p: StorePool, tmp_path: Path, seed: int) -> bytes:
    """Volume `v` written whole with incompressible data (larger than the cache) and
    flushed; returns once the device files fit the cache again (segments given back)."""
    p.create_volume("v", size=f"{VOLUME_MIB}M")
    data = volume_data(tmp_path / "data.img", seed)
    write_and_flush(p, tmp_path / "data.img")
    wait_for("the local cache to give back room",
             lambda: cache_of(p)["cache"]["local_bytes"] <= CACHE_BYTES)
    return data


def assert_one_record_fetched(proxy: FaultProxy, prefix: str, what: str) -> None:
    """Since the proxy's counts were reset: one ranged GET, of one 4 KiB record and its
    tag at most."""
    gets = ranged_gets(proxy, prefix)
    assert len(gets) == 1, f"{what} made {len(gets)} ranged GETs: {gets}"
    rng = dict((k.lower(), v) for k, v in gets[0].headers)["range"]
    lo, hi = (int(x) for x in rng.split("=")[1].split("-"))
    assert hi - lo + 1 <= 4096 + 16, f"{what} fetched {rng}"


def test_cache_keeps_its_size_and_reads_come_from_the_store(versitygw, tmp_path):
    """A 24 MiB volume in a pool whose cache is 16 MiB: the device files shrink to fit,
    every byte reads back exact (from the store where it must), a cold 4 KiB read is one
    GET of one record, and after a restart the given-back segments are still read from
    the store."""
    srv = versitygw
    with cache_pool(srv, tmp_path, "cache") as (proxy, p):
        key = p.create_volume("v", size=f"{VOLUME_MIB}M")
        data = volume_data(tmp_path / "data.img", 11)
        write_and_flush(p, tmp_path / "data.img")
        st = wait_for("the local cache to give back room",
                      lambda: (s := cache_of(p))["cache"]["local_bytes"] <= CACHE_BYTES and s)
        c = st["cache"]
        assert c["limit_bytes"] == CACHE_BYTES, c
        assert c["evicted_segments"] > 0 and c["evicted_total"] > 0, c
        assert allocated(p) <= CACHE_BYTES, \
            f"device files take {allocated(p)} bytes, more than the {CACHE} cache"
        assert allocated(p) < len(data), "the device files still hold the whole volume"

        proxy.reset_counts()
        assert read_back(p, tmp_path / "out.img") == data, \
            "bytes differ reading a volume partly given back to the store"
        st = p.status()["object_store"]
        assert st["remote_reads"] > 0, f"nothing was read from the store: {st}"
        assert ranged_gets(proxy, p.prefix), "no ranged GET reached the store"
        assert st["healed_from_store"] == 0, st

        # A cold 4 KiB read: one GET, of one record (4 KiB and its tag), no more.
        proxy.reset_counts()
        r = qemu_io(p.uri("v"), "read -v 0 4k")
        assert r.returncode == 0, r.stderr
        assert_one_record_fetched(proxy, p.prefix, "a cold 4 KiB read")

        # Read often, the segment is brought back whole: its reads stay local.
        nbd_script(p, "for _ in range(16):\n    h.pread(65536, 0)\n")
        wait_for("a segment read often to be brought back",
                 lambda: cache_of(p)["cache"]["refilled_total"] >= 1)
        proxy.reset_counts()
        r = qemu_io(p.uri("v"), "read -v 0 4k")
        assert r.returncode == 0, r.stderr
        gets = ranged_gets(proxy, p.prefix)
        assert not gets, f"a segment brought back is still read from the store: {gets}"

        # After a restart the holes are found again: still read from the store.
        p.stop()
        p.start()
        p.load_key("v", key)
        st = cache_of(p)
        assert st["cache"]["evicted_segments"] > 0, st
        assert read_back(p, tmp_path / "out2.img") == data
        assert p.status()["object_store"]["remote_reads"] > 0
        assert p.status()["state"] == "ONLINE"


def test_sequential_reads_from_the_store_are_read_ahead(versitygw, tmp_path):
    """Given-back data read in order, 64 KiB at a time with one request in flight: the
    reads after the first of a stream take the rest of their segment's part in one GET,
    so far fewer GETs than reads reach the store, and every byte is exact; a 4 KiB read
    that continues nothing fetches only its record."""
    srv = versitygw
    with cache_pool(srv, tmp_path, "ahead") as (proxy, p):
        data = fill_past_cache(p, tmp_path, 13)
        # A read nothing came before (no stream to continue): only its record.
        proxy.reset_counts()
        r = qemu_io(p.uri("v"), "read -v 0 4k")  # written first: given back
        assert r.returncode == 0, r.stderr
        assert_one_record_fetched(proxy, p.prefix, "a 4 KiB read continuing nothing")

        before = p.status()["object_store"]
        proxy.reset_counts()
        span = 6 << 20  # the oldest segments: given back first
        out = nbd_script(p, (
            "import hashlib\n"
            "d = hashlib.sha256()\n"
            f"for off in range(0, {span}, 65536):\n"
            "    d.update(h.pread(65536, off))\n"
            "print(d.hexdigest())\n"
        ))
        assert out.stdout.strip() == hashlib.sha256(data[:span]).hexdigest(), \
            "bytes differ in reads served by read-ahead"
        after = p.status()["object_store"]
        reads = after["remote_reads"] - before["remote_reads"]
        hits = after["read_ahead_hits"] - before["read_ahead_hits"]
        gets = ranged_gets(proxy, p.prefix)
        assert reads >= 32, f"only {reads} reads went to the store: was the data given back?"
        assert hits > 0, f"no read was served by read-ahead: {after}"
        assert len(gets) * 4 <= reads, \
            f"{len(gets)} GETs for {reads} sequential reads from the store: no read-ahead"
        got = read_back(p, tmp_path / "out.img")
        assert got == data, "bytes differ after reads served by read-ahead"



def test_writers_wait_for_the_store_past_the_cache_size(versitygw, tmp_path):
    """Uploads slowed to 8 MiB/s and a writer far faster, with no FLUSH: the device files
    never pass the cache's size and one wake interval (16 + 8 MiB) by more than the
    writes in flight, because writes past it wait for the store to take room back; the
    waits are counted, and every byte reads back exact."""
    srv = versitygw
    with cache_pool(srv, tmp_path, "pace") as (proxy, p):
        p.create_volume("v", size="64M")
        src = tmp_path / "data.img"
        src.write_bytes(os.urandom(64 << 20))
        slow = proxy.slow_body(rate=8 << 20, prefix=f"{p.prefix}/seg/")
        peak, done = [0], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], allocated(p))
                time.sleep(0.01)

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        try:
            # Four 256 KiB requests in flight at most: 1 MiB past a check at once.
            run(["nbdcopy", "--connections=1", "--requests=4", "--request-size=262144",
                 str(src), p.uri("v")])
        finally:
            done.set()
            t.join()
        assert slow.hits > 0, "no segment upload went through the slowed rule"
        cap = CACHE_BYTES + (8 << 20)
        slack = 4 << 20  # the requests in flight, map nodes, the open segments' rest
        assert peak[0] <= cap + slack, \
            f"the device files reached {peak[0] >> 20} MiB while the store took 8 MiB/s: " \
            f"writes were not paced at {cap >> 20} MiB"
        c = cache_of(p)["cache"]
        assert c["paced_writes"] > 0 and c["paced_seconds"] > 0, c
        slow.off()
        run(["qemu-io", "-f", "raw", "-c", "flush", p.uri("v")])
        out = tmp_path / "out.img"
        assert read_back(p, out) == src.read_bytes(), "a byte differs after paced writes"


def test_import_on_a_new_host_downloads_only_the_metadata(versitygw, tmp_path):
    """`pool import --object-store ... --object-store-cache-size`: the new host downloads
    the maps and the table, not the client data, and serves every byte from the store."""
    srv = versitygw
    p = StorePool(tmp_path, srv, "lazy").create().start()
    try:
        key = p.create_volume("v", size=f"{VOLUME_MIB}M")
        data = volume_data(tmp_path / "data.img", 12)
        write_and_flush(p, tmp_path / "data.img")
        p.stop()
    finally:
        p.kill()
    r = p.bulwark("pool", "export", p.dir)
    assert r.returncode == 0, r.stderr

    q = StorePool(tmp_path, srv, "lazy", dir_name="newhost")
    r = q.import_from_store(p.dir / "pool.key", "--object-store-cache-size", CACHE)
    assert r.returncode == 0, f"import failed:\n{r.stdout}\n{r.stderr}"
    assert "left in the store" in r.stdout, r.stdout
    assert allocated(q) < (4 << 20), \
        f"the import downloaded {allocated(q)} bytes: the client data came down too"
    q.start()
    try:
        q.load_key("v", key)
        got = read_back(q, tmp_path / "out.img")
        assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest(), \
            "bytes differ reading from the store on a host with an empty cache"
        st = cache_of(q)
        assert st["remote_reads"] > 0 and st["cache"]["evicted_segments"] > 0, st
        # New writes land locally and are flushed to the store as usual.
        nbd_script(q, "h.pwrite(b'N' * 65536, 0)\nh.flush()\n")
        data = b"N" * 65536 + data[65536:]
        assert read_back(q, tmp_path / "out2.img") == data
    finally:
        q.kill()


def test_store_outage_fails_cold_reads_and_serves_the_rest(versitygw, tmp_path):
    """503s from the store: reads of records only the store holds fail with EIO by the
    deadline, never hang or return zeros; records still local are served; once the store
    answers again every byte reads back."""
    srv = versitygw
    with cache_pool(srv, tmp_path, "cacheout") as (proxy, p):
        data = fill_past_cache(p, tmp_path, 13)
        rule = proxy.fail_503()
        # The oldest writes were given back first; the newest are still local.
        last = (VOLUME_MIB - 1) << 20
        out = nbd_script(p, (
            "import errno\n"
            "try:\n"
            "    b = h.pread(4096, 0); print('READ', b == " + repr(data[:4096]) + ")\n"
            "except nbd.Error as e:\n"
            "    print('READ-ERR', e.errno)\n"
            f"print('LOCAL', h.pread(65536, {last}) == open({str(tmp_path / 'data.img')!r}, 'rb').read()[{last}:{last + 65536}])\n"
        ), check=False)
        assert "READ-ERR EIO" in out.stdout, \
            f"a cold read during an outage must fail with EIO:\n{out.stdout}\n{out.stderr}"
        assert "LOCAL True" in out.stdout, out.stdout
        assert rule.fired
        rule.off()
        assert read_back(p, tmp_path / "out.img") == data
        st = p.status()
        assert st["state"] == "ONLINE", st["state"]


def test_a_record_no_local_copy_verifies_is_read_from_the_store(versitygw, tmp_path):
    """A one-device pool with an object store: bytes flipped on the device are caught by
    their checksum, and the record is read from the store instead (counted), so the client
    gets its data, not EIO."""
    srv = versitygw
    p = StorePool(tmp_path, srv, "heal").create().start()
    try:
        key = p.create_volume("v", size="8M", encryption=False, compression="off")
        payload = b"HEALME!!" * (8 << 17)
        (tmp_path / "d.img").write_bytes(payload)
        write_and_flush(p, tmp_path / "d.img")
        p.stop()
        dev = p.device_paths()[0]
        with open(dev, "r+b") as f:
            blob = f.read()
            at = blob.find(b"HEALME!!" * 512)
            assert at >= 0, "the plain volume's bytes are not on the device"
            for off in range(at, at + (1 << 20), 4096):
                f.seek(off + 7)
                f.write(b"\xff")
        p.start()
        assert read_back(p, tmp_path / "out.img") == payload
        st = p.status()
        assert st["object_store"]["healed_from_store"] > 0, st["object_store"]
        assert st["object_store"]["remote_reads"] > 0
    finally:
        p.kill()
    del key


def test_a_fenced_host_reads_eio_once_its_objects_are_collected(versitygw, tmp_path):
    """Host A's cache gave data back; host B takes the pool over, rewrites the volume and
    collects the objects no commit references. A's reads of what it gave back fail with
    EIO: never another writer's bytes, never zeros."""
    srv = versitygw
    a = StorePool(tmp_path, srv, "gc", ).create("--object-store-cache-size", CACHE).start()
    try:
        key = a.create_volume("v", size=f"{VOLUME_MIB}M")
        data = volume_data(tmp_path / "data.img", 14)
        write_and_flush(a, tmp_path / "data.img")
        wait_for("the local cache to give back room",
                 lambda: cache_of(a)["cache"]["local_bytes"] <= CACHE_BYTES)

        b = StorePool(tmp_path, srv, "gc", dir_name="hostb",
                      serve_args=("--object-store-gc-grace", "1"))
        r = b.import_from_store(a.dir / "pool.key", "--force",
                                "--object-store-cache-size", CACHE)
        assert r.returncode == 0, f"forced import failed:\n{r.stdout}\n{r.stderr}"
        b.start()
        try:
            b.load_key("v", key)
            other = volume_data(tmp_path / "other.img", 15)
            write_and_flush(b, tmp_path / "other.img")
            b.stop()   # the grace period passes; the next start collects
            time.sleep(1.5)
            b.start()
            wait_for("B to collect the objects no commit references",
                     lambda: b.status()["object_store"]["collected"] > 0)
        finally:
            b.kill()

        out = nbd_script(a, (
            "ok = err = 0\n"
            f"for off in range(0, {VOLUME_MIB} << 20, 1 << 20):\n"
            "    try:\n"
            f"        b = h.pread(4096, off)\n"
            "        assert b == open(" + repr(str(tmp_path / "data.img")) + ", 'rb').read()[off:off + 4096], off\n"
            "        ok += 1\n"
            "    except nbd.Error as e:\n"
            "        assert e.errno in (5, 'EIO'), e\n"
            "        err += 1\n"
            "print('OK', ok, 'EIO', err)\n"
        ), check=False)
        assert out.returncode == 0, f"a fenced host returned wrong bytes:\n{out.stdout}\n{out.stderr}"
        assert "EIO 0" not in out.stdout, \
            f"no read of a collected object failed:\n{out.stdout}\n{a.log_tail()}"
        del other
    finally:
        a.kill()


def test_scrub_checks_the_stores_copy_of_what_was_given_back(versitygw, tmp_path):
    """A scrub verifies the store's copy of records given back (no key needed: checksums
    are of the stored bytes): clean at first; after the bucket's operator flips bytes in a
    data object, the scrub counts them unrecoverable and lists the volume's damaged range."""
    from healing import scrub_wait
    from test_object_store import objects

    srv = versitygw
    p = StorePool(tmp_path, srv, "cachescrub").create("--object-store-cache-size", CACHE).start()
    try:
        fill_past_cache(p, tmp_path, 16)
        p.bulwark("key", "unload", "v")  # the scrub needs no key
        before = p.status()["object_store"]["remote_reads"]
        r, s = scrub_wait(p)
        assert s["state"] == "finished" and s["unrecoverable"] == 0, f"{s}\n{r.stdout}"
        assert p.status()["object_store"]["remote_reads"] > before, \
            "the scrub did not read the given-back records from the store"

        # One byte in every 64 KiB of every data object: some of them are in records only
        # the store holds (which objects hold those is the pool's business).
        parts = {k: b for k, b in objects(srv, p.prefix).items() if "/seg/" in "/" + k}
        for victim, body in parts.items():
            bad = bytearray(body)
            for i in range(1000, len(bad), 65536):
                bad[i] ^= 0x40
            srv.client().put_object(Bucket=srv.bucket, Key=victim, Body=bytes(bad))
        r, s = scrub_wait(p, expect_rc=None)
        assert s["unrecoverable"] > 0, f"the scrub missed the altered object: {s}\n{r.stdout}"
        errs = p.status().get("errors") or []
        assert any(e.get("volume") == "v" for e in errs), f"no damaged range listed: {errs}"
    finally:
        p.kill()


def test_removing_the_store_brings_back_what_only_it_held(versitygw, tmp_path):
    """`pool object-store remove` on a pool whose cache gave data back: every segment
    comes back first, then the pool serves every byte without the store."""
    srv = versitygw
    p = StorePool(tmp_path, srv, "cacheremove").create("--object-store-cache-size", CACHE).start()
    try:
        key = p.create_volume("v", size=f"{VOLUME_MIB}M")
        data = volume_data(tmp_path / "data.img", 17)
        write_and_flush(p, tmp_path / "data.img")
        wait_for("the local cache to give back room",
                 lambda: cache_of(p)["cache"]["evicted_segments"] > 0
                 and cache_of(p)["cache"]["local_bytes"] <= CACHE_BYTES)
        p.stop()
    finally:
        p.kill()
    r = p.cli("pool", "object-store", "remove")
    assert "bringing back" in r.stderr, r.stderr
    assert "pool.json" not in r.stderr
    assert "object_store" not in (p.dir / "pool.json").read_text()
    assert allocated(p) >= len(data), "the device files do not hold the volume again"
    p.start()
    try:
        assert p.status().get("object_store") is None
        p.load_key("v", key)
        assert read_back(p, tmp_path / "out.img") == data, \
            "bytes differ after the store was removed"
        st = p.status()
        assert st["state"] == "ONLINE" and not st.get("errors"), st
    finally:
        p.kill()


def test_cache_size_without_a_store_is_refused(tmp_path):
    """`--object-store-cache-size` (or another store option) without `--object-store` is
    an error naming what is missing, not silently ignored; nothing is created."""
    from conftest import Pool
    p = Pool(tmp_path)
    r = p.bulwark("pool", "create", p.dir, "--devices", "1", "--device-size", "64M",
                  "--object-store-cache-size", "1G", check=False)
    assert r.returncode != 0 and "needs --object-store" in r.stderr, r.stderr
    assert not (p.dir / "pool.json").exists()
