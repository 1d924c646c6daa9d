"""`bulwark device offline` lasts until `bulwark device online`, as `zpool
offline` does: a restart (clean or after kill -9) keeps the device OFFLINE
and the pool DEGRADED, instead of quietly using a device that missed writes;
`device online` then resilvers it and a scrub finds nothing to repair."""

import os
import subprocess

import pytest

from conftest import qemu_io_ok
from healing import assert_clean_scrub


@pytest.mark.parametrize("restart", ["stop", "kill"])
def test_offline_survives_a_restart(make_pool, restart):
    p = make_pool(layout="mirror:2", devices=2, device_size="128M")
    p.create().start()
    p.create_volume("v", size="16M", encryption=False)
    qemu_io_ok(p.uri("v"), "write -P 1 0 4M", "flush")
    victim = p.device_paths()[1]
    p.cli("device", "offline", victim)
    qemu_io_ok(p.uri("v"), "write -P 2 4M 4M", "flush")

    if restart == "stop":
        p.stop()
    else:
        p.kill()
    p.start()
    st = p.status()
    states = {d["path"]: d["state"] for d in st["devices"]}
    assert states[victim] == "OFFLINE", states
    assert st["state"] == "DEGRADED", st["state"]
    qemu_io_ok(p.uri("v"), "read -P 1 0 4M", "read -P 2 4M 4M", "write -P 3 8M 4M", "flush")

    # And again: still offline until told otherwise.
    p.restart()
    assert {d["path"]: d["state"] for d in p.status()["devices"]}[victim] == "OFFLINE"

    r = p.cli("device", "online", victim, "--wait")
    assert "resilver" in r.stdout, r.stdout
    st = p.status()
    assert st["state"] == "ONLINE" and all(d["state"] == "ONLINE" for d in st["devices"]), st
    assert_clean_scrub(p, "scrub after bringing the device back")
    qemu_io_ok(p.uri("v"), "read -P 1 0 4M", "read -P 2 4M 4M", "read -P 3 8M 4M")
    p.restart()
    assert p.status()["state"] == "ONLINE"


def test_an_offline_device_alone_is_not_used_silently(make_pool):
    """A mirror whose only reachable device is the one taken offline: that device
    missed every write since (an offline device gets no superblocks), so the daemon
    does not start on it quietly, rolled back; it says which device is offline, what
    is missing, and the two ways on. With the other device back, it starts as before."""
    p = make_pool(layout="mirror:2", devices=2, device_size="128M")
    p.create().start()
    p.create_volume("v", size="16M", encryption=False)
    qemu_io_ok(p.uri("v"), "write -P 1 0 4M", "flush")
    online, victim = p.device_paths()
    p.cli("device", "offline", victim)
    qemu_io_ok(p.uri("v"), "write -P 2 4M 4M", "flush")
    p.stop()

    # Out of the pool's directory: import finds a renamed device there by its label.
    gone = str(p.tmp / "dev0-away.img")
    os.rename(online, gone)
    try:
        r = subprocess.run([str(p.bin), "serve", str(p.dir)], capture_output=True, text=True,
                           env=p._env(), stdin=subprocess.DEVNULL, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("bulwark serve ran on the offline device alone (it should refuse to start)")
    assert r.returncode != 0, r.stdout + r.stderr
    msg = r.stdout + r.stderr
    assert "offline" in msg and victim in msg, msg
    assert "pool.json" in msg, msg
    assert "missing" in msg, msg

    os.rename(gone, online)
    p.start()
    st = p.status()
    assert {d["path"]: d["state"] for d in st["devices"]}[victim] == "OFFLINE", st
    qemu_io_ok(p.uri("v"), "read -P 1 0 4M", "read -P 2 4M 4M")


def test_the_last_whole_copy_stays_online_during_a_resilver(make_pool):
    """While the other device of a mirror is being resilvered it is not a whole copy:
    taking the one device that is whole offline is refused, as for the last copy."""
    p = make_pool(layout="mirror:2", devices=2, device_size="256M",
                  serve_args=["--scrub-rate", "1M"])
    p.create().start()
    p.create_volume("v", size="32M", encryption=False, compression="off")
    qemu_io_ok(p.uri("v"), "write -P 1 0 16M", "flush")
    whole, victim = p.device_paths()
    p.cli("device", "offline", victim)
    qemu_io_ok(p.uri("v"), "write -P 2 0 16M", "flush")
    p.cli("device", "online", victim)  # the resilver runs at 1 MB/s: for seconds
    st = {d["path"]: d["state"] for d in p.status()["devices"]}
    assert st[victim] != "ONLINE", st

    r = p.cli("device", "offline", whole, check=False)
    assert r.returncode != 0 and "last online copy" in r.stderr, r.stderr
    qemu_io_ok(p.uri("v"), "read -P 2 0 16M")
