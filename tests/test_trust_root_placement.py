"""The trust root off the devices (issue 41 part 2): `pool create` warns whenever
pool.key or pool.anchor shares a file system with a device file of the pool, the
default file-backed layout (DIR/devN.img beside DIR/pool.key) included: a backup of DIR
or a snapshot of its disk holds the key with the devices, and restoring it rolls the
pool back with its anchor, unseen."""


def test_file_backed_pool_warns_that_key_and_anchor_lie_beside_the_devices(make_pool):
    p = make_pool(layout="single", devices=1, device_size="64M")
    r = p.bulwark("pool", "create", p.dir, "--layout", "single", "--devices", "1",
                  "--device-size", "64M", check=False)
    assert r.returncode == 0, r.stderr
    warnings = [l for l in r.stderr.splitlines() if l.startswith("warning:")]
    for name in ("pool.key", "pool.anchor"):
        assert any(name in l and "same file system" in l for l in warnings), r.stderr
    assert any("another disk" in l for l in warnings), r.stderr
