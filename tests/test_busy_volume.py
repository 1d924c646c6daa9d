"""A volume that cannot be destroyed right now says what holds it: a scrub
reading it is named, with what to do, rather than clients that do not exist."""

import time

from conftest import qemu_io_ok
from healing import scrub_status

DEADLINE_S = 120


def test_destroy_during_a_scrub_names_the_scrub(make_pool):
    p = make_pool(layout="mirror:2", devices=2, device_size="256M",
                  serve_args=["--scrub-rate", "1M"])
    p.create().start()
    p.create_volume("v", size="64M", encryption=False)
    qemu_io_ok(p.uri("v"), "write -P 7 0 24M", "flush")
    p.cli("scrub")
    deadline = time.monotonic() + DEADLINE_S
    while True:
        s = scrub_status(p)
        if s["state"] == "scanning" and s["bytes_done"] > 0:
            break
        assert s["state"] == "scanning", f"the scrub ended before the test could use it: {s}"
        assert time.monotonic() < deadline, s
        time.sleep(0.05)

    r = p.cli("volume", "destroy", "v", check=False)
    assert r.returncode != 0, "destroyed while a scrub was reading it"
    assert "scrub" in r.stderr and "scrub cancel" in r.stderr, r.stderr
    assert "detach its clients" not in r.stderr, r.stderr

    # Once the scrub is cancelled, the destroy goes through.
    p.cli("scrub", "cancel")
    deadline = time.monotonic() + DEADLINE_S
    while p.cli("volume", "destroy", "v", check=False).returncode != 0:
        assert time.monotonic() < deadline, "the volume stayed busy after the scrub was cancelled"
        time.sleep(0.2)
    assert [v["name"] for v in p.status()["volumes"]] == []
