"""Bad RAM during a scrub: with every read flipping a bit (`fault set DEV
read-flip` on every device), no copy of anything verifies. The scrub must
report the blocks as unrecoverable and write nothing in their place: not one
byte of any data block changes on any device. Once the faults are cleared,
a scrub finds the data intact and clears the error records.

The data blocks are found on the devices by writing a plain volume (no
encryption, no compression) whose every 32 bytes name their block, and
locating each block's record before the scrub. Bytes elsewhere (the pool's
own bookkeeping: superblocks, volume table, scrub cursor) may change.
"""

import hashlib
import random

import pytest

from conftest import KiB, LONG_TEST_TIMEOUT_S, require_tools, run
from healing import (BLOCK, LAYOUTS, assert_clean_scrub, assert_export_equals, heal_pool,
                     locate_blocks, new_token, pattern_image, scrub_wait, write_file)

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)  # waits of up to 300 s each

NBLOCKS = 512
CHUNK = 64 * KiB


def read_ranges(path, ranges):
    with open(path, "rb") as f:
        out = []
        for a, b in ranges:
            f.seek(a)
            out.append(f.read(b - a))
        return out


def chunk_hashes(path):
    out = []
    with open(path, "rb") as f:
        while True:
            b = f.read(CHUNK)
            if not b:
                return out
            out.append(hashlib.sha1(b).digest())


def changed_ranges(before, after):
    """Byte ranges (CHUNK-granular) whose hashes differ, merged."""
    out = []
    for i, (x, y) in enumerate(zip(before, after)):
        if x != y:
            if out and out[-1][1] == i * CHUNK:
                out[-1][1] += CHUNK
            else:
                out.append([i * CHUNK, (i + 1) * CHUNK])
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scrub_bad_ram(make_pool, tmp_path, seed, layout):
    require_tools("nbdcopy")
    rng = random.Random(seed)
    pool = heal_pool(make_pool, layout)
    token = new_token(rng)
    pool.create_volume("plain", size="2M", encryption=False, compression="off")
    img = write_file(tmp_path / "plain.img", pattern_image(token, NBLOCKS))
    run(["nbdcopy", "--flush", img, pool.uri("plain")])
    devices = pool.device_paths()
    pool.stop()

    where = locate_blocks(layout, devices, token, range(NBLOCKS))
    lost = [i for i, offs in where.items() if not offs]
    assert not lost, f"blocks {lost[:10]}... not found on any device"
    shard = layout.shard_bytes(BLOCK)
    footprints = sorted({(x, x + shard) for offs in where.values() for x in offs})
    before = {d: read_ranges(d, footprints) for d in devices}
    hashes_before = {d: chunk_hashes(d) for d in devices}

    pool.start()
    for d in devices:
        pool.cli("fault", "set", d, "read-flip", "--probability", "1",
                 "--seed", str(rng.randrange(1 << 32)))
    r, s = scrub_wait(pool, expect_rc=1)
    assert s["state"] == "finished", s
    assert s["unrecoverable"] > 0 and s["repaired"] == 0, s
    assert "plain: bytes " in r.stdout and "no good copy" in r.stderr, f"{r.stdout}\n{r.stderr}"
    errors = pool.status()["errors"]
    assert errors and all(e["volume"] == "plain" for e in errors), errors
    uncovered = [i for i in range(NBLOCKS)
                 if not any(e["offset"] <= i * BLOCK < e["offset"] + e["length"] for e in errors)]
    assert not uncovered, f"blocks {uncovered[:10]}... were unreadable but are not in the error list: {errors}"
    pool.cli("fault", "clear")
    pool.stop()

    for d in devices:
        after = read_ranges(d, footprints)
        changed = changed_ranges(hashes_before[d], chunk_hashes(d))
        print(f"{d}: bytes changed in {changed} (the pool's own bookkeeping)")
        hit = [footprints[j] for j, (x, y) in enumerate(zip(before[d], after)) if x != y]
        assert not hit, (f"the bad-RAM scrub wrote over data blocks on {d} at {hit[:10]} "
                         f"(changed ranges: {changed})")

    pool.start()
    kept = pool.status()["errors"]
    assert kept, "the error records did not survive a restart"
    s = assert_clean_scrub(pool, "scrub with the faults cleared")
    assert pool.status()["errors"] == [], "a clean scrub did not clear the error records"
    assert_export_equals(pool, "plain", img, "after the bad-RAM scrub", chunk=BLOCK)
