"""Bytes flipped in the device files with the daemon stopped, on one device of
a mirror or on M devices of parity:K+M, never reach a client: every read
through NBD returns what was written. `scrub --wait` then repairs every bad
copy it finds, and a second scrub finds nothing left to repair.

Damage: one flipped byte in every non-zero 64 KiB of each damaged device's
data area (labels excluded), which hits data blocks, map nodes and the volume
table alike. Replay with BULWARK_TEST_SEED=<seed printed>.
"""

import random

import pytest

from conftest import LONG_TEST_TIMEOUT_S, MiB, require_tools, run
from healing import (BLOCK, LAYOUTS, assert_clean_scrub, assert_export_equals, heal_pool,
                     new_token, pattern_image, scatter_damage, scrub_wait, write_file)

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)  # waits of up to 300 s each

ENC_SIZE = 16 * MiB
PLAIN_SIZE = 8 * MiB


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scrub_repair(make_pool, tmp_path, seed, layout):
    require_tools("nbdcopy")
    rng = random.Random(seed)
    pool = heal_pool(make_pool, layout)
    key = pool.create_volume("enc", size="16M")
    pool.create_volume("plain", size="8M", encryption=False, compression="off")
    enc = write_file(tmp_path / "enc.img", rng.randbytes(ENC_SIZE))
    plain = write_file(tmp_path / "plain.img", pattern_image(new_token(rng), PLAIN_SIZE // BLOCK))
    run(["nbdcopy", "--flush", enc, pool.uri("enc")])
    run(["nbdcopy", "--flush", plain, pool.uri("plain")])

    devices = pool.device_paths()
    pool.stop()
    damaged = sorted(rng.sample(devices, layout.tolerance if layout.k > 1 else 1))
    for d in damaged:
        offs = scatter_damage(d, rng)
        print(f"flipped {len(offs)} bytes on {d}")

    pool.start()
    pool.load_key("enc", key)
    assert_export_equals(pool, "enc", enc, "reads after damage")
    assert_export_equals(pool, "plain", plain, "reads after damage", chunk=BLOCK)

    r, s = scrub_wait(pool)
    assert s["state"] == "finished" and s["kind"] == "scrub", s
    assert s["unrecoverable"] == 0, f"a block had no good copy, with damage within tolerance: {s}\n{r.stdout}"
    assert s["repaired"] > 0, (
        f"the scrub repaired nothing, but reads only check the copies they need, so damage "
        f"on {damaged} must have been left for it: {s}")
    st = pool.status()
    assert st["errors"] == [], st["errors"]
    counted = {d["path"]: d["cksum_errors"] for d in st["devices"]}
    assert all(counted[d] > 0 for d in damaged), f"checksum errors per device: {counted}, damaged {damaged}"
    assert all(n == 0 for d, n in counted.items() if d not in damaged), \
        f"checksum errors counted on an undamaged device: {counted}, damaged {damaged}"

    assert_clean_scrub(pool, "second scrub")
    assert_export_equals(pool, "enc", enc, "reads after the scrubs")
    assert_export_equals(pool, "plain", plain, "reads after the scrubs", chunk=BLOCK)
