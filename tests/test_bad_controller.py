"""A bad controller: every write to one device has a bit flipped on its way
(`fault set DEV write-flip`) while a client writes. Reads stay correct
throughout (the copies on the other devices verify); once the controller is
fixed (faults cleared), `scrub --wait` finds the bad copies, names the device
in the CKSUM column and repairs them; nothing is lost across a restart.
"""

import random

import pytest

from conftest import LONG_TEST_TIMEOUT_S, MiB, require_tools, run
from healing import (LAYOUTS, assert_clean_scrub, assert_export_equals, heal_pool, scrub_wait,
                     write_file)

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)  # waits of up to 300 s each

SIZE = 16 * MiB


def mixed_image(rng):
    """Random 64 KiB runs, compressible runs and zeros."""
    parts = []
    for _ in range(SIZE // (64 << 10)):
        kind = rng.random()
        if kind < 0.6:
            parts.append(rng.randbytes(64 << 10))
        elif kind < 0.9:
            parts.append((b"bulwark bad controller %08x " % rng.getrandbits(32)) * 2048)
        else:
            parts.append(bytes(64 << 10))
    return b"".join(p[:64 << 10] for p in parts)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_controller(make_pool, tmp_path, seed, layout):
    require_tools("nbdcopy")
    rng = random.Random(seed)
    pool = heal_pool(make_pool, layout)
    key = pool.create_volume("v", size="16M")
    devices = pool.device_paths()
    bad = rng.choice(devices)
    pool.cli("fault", "set", bad, "write-flip", "--seed", str(rng.randrange(1 << 32)))
    assert "write-flip" in pool.cli("status").stdout

    img = write_file(tmp_path / "v.img", mixed_image(rng))
    run(["nbdcopy", "--flush", img, pool.uri("v")])
    assert_export_equals(pool, "v", img, f"reads while every write to {bad} is corrupted")

    pool.cli("fault", "clear", bad)
    r, s = scrub_wait(pool)
    assert s["unrecoverable"] == 0, f"{s}\n{r.stdout}"
    assert s["repaired"] > 0, f"the scrub found nothing to repair after corrupted writes to {bad}: {s}"
    st = pool.status()
    counted = {d["path"]: d["cksum_errors"] for d in st["devices"]}
    assert counted[bad] > 0, f"no checksum errors counted on {bad}: {counted}"
    assert all(n == 0 for d, n in counted.items() if d != bad), \
        f"checksum errors counted on a device whose writes were not corrupted: {counted}"
    assert st["errors"] == [], st["errors"]
    assert_clean_scrub(pool, "second scrub")

    pool.restart()
    pool.load_key("v", key)
    assert_export_equals(pool, "v", img, "after the repair and a restart")
