"""A dead disk swapped for a blank one in the same place is rebuilt with
`bulwark device replace DEV DEV` (as `zpool replace POOL DEV`): the resilver
fills it and the pool is ONLINE again. The same command on a device that still
carries its label is refused: on an online member there is nothing to replace,
an offline one is brought back by `device online`."""

import os

from conftest import qemu_io_ok
from healing import assert_clean_scrub, scrub_wait


def test_replace_a_device_in_place(make_pool):
    p = make_pool(layout="mirror:2", devices=2, device_size="128M")
    p.create().start()
    p.create_volume("v", size="16M", encryption=False, compression="off")
    qemu_io_ok(p.uri("v"), "write -P 0x41 0 8M", "flush")
    victim = p.device_paths()[1]

    r = p.cli("device", "replace", victim, victim, check=False)
    assert r.returncode != 0 and "online member of this pool" in r.stderr, r.stderr
    assert p.status()["state"] == "ONLINE"

    # Offline, it still carries its label: 'device online' brings it up to date.
    p.cli("device", "offline", victim)
    r = p.cli("device", "replace", victim, victim, check=False)
    assert r.returncode != 0 and f"bulwark device online {victim}" in r.stderr, r.stderr
    p.cli("device", "online", victim, "--wait")
    assert p.status()["state"] == "ONLINE"

    # The disk dies and a blank one of the same size takes its place.
    size = os.path.getsize(victim)
    p.stop()
    os.remove(victim)
    with open(victim, "wb") as f:
        f.truncate(size)
    p.start()
    assert p.status()["state"] == "DEGRADED"
    qemu_io_ok(p.uri("v"), "read -P 0x41 0 8M")

    r, s = scrub_wait(p, "device", "replace", victim, victim)
    assert s["kind"] == "resilver" and s["state"] == "finished" and s["unrecoverable"] == 0, s
    st = p.status()
    assert st["state"] == "ONLINE" and all(d["state"] == "ONLINE" for d in st["devices"]), st
    assert_clean_scrub(p, "scrub after the replace in place")
    p.restart()
    assert p.status()["state"] == "ONLINE"
    qemu_io_ok(p.uri("v"), "read -P 0x41 0 8M")
