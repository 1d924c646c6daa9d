"""Overwriting a volume again and again does not fill the pool: a 32 MiB
volume on a 96 MiB device takes eight full overwrites of random data, each
flushed, without an error; the last data reads back, also after a restart,
and the pool reports its used space well below its total."""

import random

import pytest

from conftest import LONG_TEST_TIMEOUT_S, MiB, require_tools, run

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)  # waits of up to 300 s each

VOL = 32 * MiB
PASSES = 8


def test_space_reclaim(make_pool, tmp_path, seed):
    require_tools("nbdcopy", "cmp")
    pool = make_pool(layout="single", devices=1, device_size="96M")
    pool.create().start()
    key = pool.create_volume("churn", size="32M")
    uri = pool.uri("churn")
    rng = random.Random(seed)
    img = tmp_path / "pass.img"

    for n in range(PASSES):
        img.write_bytes(rng.randbytes(VOL))
        r = run(["nbdcopy", "--flush", img, uri], check=False, timeout=300)
        st = pool.status()
        assert r.returncode == 0, (f"overwrite pass {n + 1} of {PASSES} failed: {r.stderr.strip()}\n"
                                   f"space: {st['space']}")

    out = tmp_path / "out.img"
    run(["nbdcopy", uri, out])
    run(["cmp", img, out])

    st = pool.status()
    space = st["space"]
    print(f"space after {PASSES} overwrites: {space}")
    assert space["total_bytes"] > 0
    assert space["used_bytes"] <= 0.8 * space["total_bytes"], f"space not reclaimed: {space}"
    assert space["free_bytes"] >= 0.2 * space["total_bytes"], f"space not reclaimed: {space}"
    vol = pool.volume_status("churn")
    assert vol["used_bytes"] <= 1.25 * VOL, f"volume uses far more than its size: {vol}"

    pool.restart()
    pool.load_key("churn", key)
    run(["nbdcopy", uri, out])
    run(["cmp", img, out])
