"""Losing devices while a client writes, and importing with a device missing.

1. `fault set DEV vanish` (every I/O fails, as if unplugged) on as many
   devices as the layout tolerates (one of mirror:2 and parity:2+1, two of
   mirror:3 and parity:4+2) while a client writes and flushes: no error
   reaches the client and every byte it wrote reads back; the pool is
   DEGRADED. `device replace` onto fresh files resilvers; the pool is ONLINE
   again, a scrub repairs nothing, and all of it survives a restart.
2. A device file missing at import (moved away with the daemon stopped): the
   daemon starts DEGRADED and names the missing device; data reads back. When
   the file returns it has missed writes: `device online` resilvers it and
   the pool is ONLINE again.
"""

import os
import random
import shutil
import threading
import time

import pytest

from conftest import LONG_TEST_TIMEOUT_S, MiB, require_tools, run
from healing import (BLOCK, LAYOUTS, NbdShell, assert_clean_scrub, assert_export_equals,
                     heal_pool, scrub_wait, write_file)

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)  # waits of up to 300 s each

VOL = 8 * MiB
NBLOCKS = VOL // BLOCK
GEN_BLOCKS = 64
WAIT_S = 120


class Writer(threading.Thread):
    """Writes generations of random blocks, each ended by a flush; keeps what it wrote."""

    def __init__(self, uri, image: bytearray, rng: random.Random):
        super().__init__(daemon=True)
        self.uri, self.image, self.rng = uri, image, rng
        self.flushed = 0
        self.stop = threading.Event()
        self.error = None

    def run(self):
        try:
            with NbdShell(self.uri) as nbd:
                while not self.stop.is_set():
                    for b in self.rng.sample(range(NBLOCKS), GEN_BLOCKS):
                        data = self.rng.randbytes(BLOCK)
                        nbd.write(b * BLOCK, data)
                        self.image[b * BLOCK:(b + 1) * BLOCK] = data
                    nbd.flush()
                    self.flushed += 1
        except Exception as e:  # reported by the test
            self.error = e

    def wait_for(self, n, pool):
        deadline = time.monotonic() + WAIT_S
        while self.flushed < n:
            assert self.error is None, f"the client saw an error: {self.error}\n{pool.log_tail()}"
            assert time.monotonic() < deadline, f"the writer made no progress past {self.flushed}"
            time.sleep(0.05)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_vanishes_while_writing(make_pool, tmp_path, seed, layout):
    require_tools("nbdcopy")
    rng = random.Random(seed)
    pool = heal_pool(make_pool, layout)
    key = pool.create_volume("v", size="8M")
    image = bytearray(rng.randbytes(VOL))
    run(["nbdcopy", "--flush", write_file(tmp_path / "init.img", bytes(image)), pool.uri("v")])
    devices = pool.device_paths()
    size = os.path.getsize(devices[0])

    writer = Writer(pool.uri("v"), image, random.Random(rng.getrandbits(64)))
    writer.start()
    try:
        writer.wait_for(3, pool)
        victims = sorted(rng.sample(devices, layout.tolerance))
        for d in victims:
            pool.cli("fault", "set", d, "vanish")
        writer.wait_for(writer.flushed + 5, pool)
    finally:
        writer.stop.set()
        writer.join(WAIT_S)
    assert writer.error is None, f"the client saw an error: {writer.error}\n{pool.log_tail()}"
    print(f"vanished {victims}; {writer.flushed} generations written and flushed")

    st = pool.status()
    assert st["state"] == "DEGRADED", st["state"]
    states = {d["path"]: d["state"] for d in st["devices"]}
    assert all(states[d] in ("FAULTED", "UNAVAIL") for d in victims), states
    assert all(s == "ONLINE" for d, s in states.items() if d not in victims), states
    expected = write_file(tmp_path / "expected.img", bytes(image))
    assert_export_equals(pool, "v", expected, "with devices vanished")

    for n, old in enumerate(victims):
        new = tmp_path / f"new{n}.img"
        with open(new, "wb") as f:
            f.truncate(size)
        r, s = scrub_wait(pool, "device", "replace", old, new)
        assert "resilver started" in r.stdout and "resilver repaired" in r.stdout, r.stdout
        assert s["kind"] == "resilver" and s["state"] == "finished" and s["unrecoverable"] == 0, s
    st = pool.status()
    assert st["state"] == "ONLINE", st
    paths = [d["path"] for d in st["devices"]]
    assert all(str(tmp_path / f"new{n}.img") in paths for n in range(len(victims))), paths
    assert all(d["state"] == "ONLINE" for d in st["devices"]), st["devices"]
    assert_clean_scrub(pool, "scrub after the resilver")
    assert_export_equals(pool, "v", expected, "after replacing the lost devices")

    pool.restart()
    assert pool.status()["state"] == "ONLINE"
    pool.load_key("v", key)
    assert_export_equals(pool, "v", expected, "after a restart")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_import_with_a_device_missing(make_pool, tmp_path, seed, layout):
    require_tools("nbdcopy")
    rng = random.Random(seed)
    pool = heal_pool(make_pool, layout, faults=False)
    key = pool.create_volume("v", size="8M")
    img = write_file(tmp_path / "v.img", rng.randbytes(VOL))
    run(["nbdcopy", "--flush", img, pool.uri("v")])
    devices = pool.device_paths()
    pool.stop()

    gone = rng.choice(devices)
    away = tmp_path / "away.img"
    shutil.move(gone, away)
    pool.start()
    log = pool.log_path.read_text()
    assert gone in log and "missing" in log, log
    st = pool.status()
    assert st["state"] == "DEGRADED", st["state"]
    states = {d["path"]: d["state"] for d in st["devices"]}
    assert states.get(gone) == "UNAVAIL", states
    text = pool.cli("status").stdout
    assert f"status: device {gone} is missing" in text, text
    pool.load_key("v", key)
    assert_export_equals(pool, "v", img, "with a device missing")
    update = rng.randbytes(1 * MiB)
    run(["nbdcopy", "--flush", write_file(tmp_path / "update.img", update),
         pool.uri("v")])
    img.write_bytes(update + img.read_bytes()[len(update):])
    pool.stop()

    # The device comes back, having missed writes.
    shutil.move(away, gone)
    pool.start()
    if pool.status()["state"] != "ONLINE":
        r, s = scrub_wait(pool, "device", "online", gone)
        assert s["kind"] == "resilver" and s["unrecoverable"] == 0, s
    st = pool.status()
    assert st["state"] == "ONLINE" and all(d["state"] == "ONLINE" for d in st["devices"]), st["devices"]
    pool.load_key("v", key)
    assert_clean_scrub(pool, "scrub after the device came back")
    assert_export_equals(pool, "v", img, "after the device came back")


def test_every_device_missing_is_named_so(pool):
    """Every device file gone: `serve` says the devices are missing (the runbook's words
    and its row), not that every label slot is damaged."""
    devices = pool.device_paths()
    pool.stop()
    for d in devices:
        os.unlink(d)
    r = run([pool.bin, "serve", pool.dir], check=False, timeout=60)
    assert r.returncode != 0
    assert "every device of the pool is missing" in r.stderr, r.stderr
    assert "damaged" not in r.stderr, r.stderr
