""""In use" means a client (issue 36, part 4). A scrub reading a volume is
background work: `volume destroy` waits for the scrub's current batch (bounded)
and goes ahead, rather than refusing a volume nobody has open; the scrub then
passes over the destroyed volume and finishes without errors. A client that has
the volume open still makes it "in use", and the refusal names it."""

import time

from conftest import qemu_io_ok
from healing import NbdShell, scrub_status

DEADLINE_S = 120


def test_destroy_during_a_scrub_waits_for_its_batch(make_pool):
    p = make_pool(layout="mirror:2", devices=2, device_size="256M",
                  serve_args=["--scrub-rate", "1M"])
    p.create().start()
    p.create_volume("v", size="64M", encryption=False)
    p.create_volume("w", size="16M", encryption=False)
    qemu_io_ok(p.uri("v"), "write -P 7 0 24M", "flush")
    qemu_io_ok(p.uri("w"), "write -P 9 0 4M", "flush")
    p.cli("scrub")
    deadline = time.monotonic() + DEADLINE_S
    while True:
        s = scrub_status(p)
        if s["state"] == "scanning" and s["bytes_done"] > 0:
            break
        assert s["state"] == "scanning", f"the scrub ended before the test could use it: {s}"
        assert time.monotonic() < deadline, s
        time.sleep(0.05)

    # Nobody has v open: the scrub reading it does not make it "in use".
    r = p.cli("volume", "destroy", "v", check=False)
    assert r.returncode == 0, f"a volume no client has open was refused during a scrub:\n{r.stderr}"
    assert [v["name"] for v in p.status()["volumes"]] == ["w"]

    # The scrub goes on past the destroyed volume and finishes clean.
    deadline = time.monotonic() + DEADLINE_S
    while (s := scrub_status(p))["state"] == "scanning":
        assert time.monotonic() < deadline, s
        time.sleep(0.1)
    st = p.status()
    assert st["errors"] == [] and st["unrecoverable_blocks"] == 0, st

    # A client is a use: refused, naming it.
    with NbdShell(p.uri("w")):
        r = p.cli("volume", "destroy", "w", check=False)
        assert r.returncode != 0, "destroyed while a client had it open"
        assert "in use" in r.stderr, r.stderr
