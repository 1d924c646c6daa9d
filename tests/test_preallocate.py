"""`pool create --preallocate` (as qemu-img's preallocation=full): the device files and
the log device file are written with zeros wherever they are sparse, so every block is
allocated on the host's file system (a FLUSH then syncs data only, and no write fails
there for want of space). The labels it wrote survive, the pool serves and keeps data
across a restart; a file system without room for it refuses the create, clearly, and
leaves nothing behind.
"""

import os
import shutil

import pytest

from conftest import Pool, qemu_io_ok, stderr_lines


def allocated(path) -> int:
    return os.stat(path).st_blocks * 512


def test_preallocated_pool_has_no_holes_and_serves(tmp_path):
    p = Pool(tmp_path, layout="mirror:2", devices=2, device_size="64M")
    p.tmp.mkdir(exist_ok=True)
    # The log device made with fallocate: its space is held already (the room check must
    # not count it again), but its blocks are unwritten extents that still take zeros.
    log = tmp_path / "log.img"
    with open(log, "wb") as f:
        f.truncate(8 << 20)
    try:
        os.posix_fallocate(os.open(log, os.O_RDWR), 0, 8 << 20)
    except OSError:
        pass  # a file system without fallocate: a sparse log file is tested then
    r = p.bulwark("pool", "create", p.dir, "--layout", "mirror:2", "--devices", "2",
                  "--device-size", "64M", "--log-device", log, "--preallocate")
    assert "preallocated" in r.stdout, r.stdout
    devices = [p.dir / "dev0.img", p.dir / "dev1.img"]
    for d in devices + [log]:
        size = os.path.getsize(d)
        assert allocated(d) >= size, f"{d}: {allocated(d)} of {size} bytes allocated"
    p.start()
    try:
        p.create_volume("v", size="32M", encryption=False)
        qemu_io_ok(p.uri("v"), "write -P 0x6c 0 4M", "flush")
        p.stop()
        p.start()
        qemu_io_ok(p.uri("v"), "read -P 0x6c 0 4M")
        st = p.status()
        assert st["state"] == "ONLINE", st
        # The log device's label survived the zeros: the log is still on it.
        assert st["log"]["state"] == "ONLINE", st["log"]
        assert [d["state"] for d in st["log"]["devices"]] == ["ONLINE"], st["log"]
    finally:
        p.kill()


def test_preallocate_without_room_is_refused_and_leaves_nothing(tmp_path):
    p = Pool(tmp_path, dir_name="big")
    free = shutil.disk_usage(tmp_path).free
    size = free + (1 << 30)
    if size > 15 << 40:
        # Past ext4's largest file: the sparse create itself would fail first.
        pytest.skip(f"{free} bytes free: too much room to ask for more in one file")
    r = p.bulwark("pool", "create", p.dir, "--devices", "1", "--device-size", str(size),
                  "--preallocate", check=False)
    lines = stderr_lines(r)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "preallocat" in lines[0] and "free" in lines[0], lines[0]
    # Nothing stays: no pool, no device file of that size.
    assert not (p.dir / "pool.json").exists()
    assert not (p.dir / "dev0.img").exists()
    # The directory is free for a pool made without it.
    p.bulwark("pool", "create", p.dir, "--devices", "1", "--device-size", "64M")
    assert (p.dir / "pool.json").exists()


def test_preallocate_is_refused_with_an_object_store(tmp_path):
    p = Pool(tmp_path)
    r = p.bulwark("pool", "create", p.dir, "--devices", "1", "--device-size", "64M",
                  "--object-store", "s3://bucket/prefix", "--preallocate", check=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "--preallocate" in r.stderr and "--object-store" in r.stderr, r.stderr
    assert not (p.dir / "pool.json").exists()
