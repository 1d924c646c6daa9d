"""A pool's devices are its own: created readable by their owner only, never
named twice in one pool, never written by two daemons at once, and never
used when they have shrunk under the pool."""

import os
import shutil
import stat
import subprocess

from conftest import Pool, qemu_io_ok, stderr_lines


def test_device_files_are_private(make_pool):
    """Device files hold the pool's data (plaintext for volumes without
    encryption) and metadata: other local users must not read them."""
    p = make_pool(layout="mirror:2", devices=2, device_size="64M").create()
    for d in ("dev0.img", "dev1.img"):
        mode = stat.S_IMODE(os.stat(p.dir / d).st_mode)
        assert mode == 0o600, f"{d} has mode {mode:o}"


def test_the_same_device_twice_is_refused(make_pool, tmp_path):
    """A mirror of one file named twice (by the same path, another spelling of
    it, a symlink or a hard link) would keep both copies on one device."""
    dev = tmp_path / "d1.img"
    other = tmp_path / "d2.img"
    for f in (dev, other):
        with open(f, "wb") as fh:
            fh.truncate(128 << 20)
    (tmp_path / "link.img").symlink_to(dev)
    os.link(dev, tmp_path / "hard.img")
    spellings = [dev, tmp_path / "sub" / ".." / "d1.img", tmp_path / "link.img", tmp_path / "hard.img"]
    (tmp_path / "sub").mkdir()
    p = make_pool(layout="mirror:2")
    for second in spellings:
        r = p.bulwark("pool", "create", p.dir, "--layout", "mirror:2",
                      "--device", dev, "--device", second, check=False)
        assert r.returncode != 0, f"created a mirror of {dev} and {second}:\n{r.stdout}"
        lines = stderr_lines(r)
        assert len(lines) == 1 and "given twice" in lines[0], r.stderr
        assert not (p.dir / "pool.json").exists()
    # Two different files make a pool.
    r = p.bulwark("pool", "create", p.dir, "--layout", "mirror:2",
                  "--device", dev, "--device", other, check=False)
    assert r.returncode == 0, r.stderr


def test_a_second_daemon_on_a_copy_of_the_pool_is_refused(make_pool, tmp_path):
    """A copy of the pool directory (a restored backup, a second host on the
    same disks) names the same devices: a second daemon serving it would
    overwrite what the first writes. It is refused, and the first one's data
    is intact."""
    d1, d2 = tmp_path / "e1.img", tmp_path / "e2.img"
    for f in (d1, d2):
        with open(f, "wb") as fh:
            fh.truncate(128 << 20)
    first = make_pool(layout="mirror:2")
    first.create("--device", d1, "--device", d2).start()
    first.create_volume("a", size="16M", encryption=False)
    qemu_io_ok(first.uri("a"), "write -P 0x5a 0 1M", "flush")

    copy = Pool(tmp_path / "copy", layout="mirror:2")
    copy.dir.parent.mkdir()
    shutil.copytree(first.dir, copy.dir, ignore=shutil.ignore_patterns("*.sock", "pool.lock"))
    r = subprocess.run([str(copy.bin), "serve", str(copy.dir)], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode != 0, f"a second daemon served the same devices:\n{r.stderr}"
    assert "in use by another process" in r.stderr and str(d1) in r.stderr, r.stderr

    # The first daemon goes on, its data intact, and still owns the devices
    # after a restart.
    qemu_io_ok(first.uri("a"), "read -P 0x5a 0 1M")
    first.restart()
    qemu_io_ok(first.uri("a"), "read -P 0x5a 0 1M")
    assert first.status()["state"] == "ONLINE"


def test_a_shrunk_device_is_not_used(make_pool):
    """A device truncated (or a volume shrunk) under a stopped pool has lost its
    end: it is not used, the pool runs DEGRADED on the other copy, and
    `device online` says why it refuses until the size is back."""
    p = make_pool(layout="mirror:2", devices=2, device_size="128M")
    p.create().start()
    p.create_volume("v", size="16M", encryption=False)
    qemu_io_ok(p.uri("v"), "write -P 0x33 0 4M", "flush")
    victim = p.device_paths()[1]
    size = os.path.getsize(victim)
    p.stop()
    os.truncate(victim, size // 2)

    p.start()
    st = p.status()
    assert st["state"] == "DEGRADED", st["state"]
    states = {d["path"]: d["state"] for d in st["devices"]}
    assert states[victim] != "ONLINE", states
    assert "smaller than this pool's devices" in p.log_path.read_text(), p.log_tail()
    qemu_io_ok(p.uri("v"), "read -P 0x33 0 4M")
    assert os.path.getsize(victim) == size // 2, "the daemon wrote past the shrunk end"

    r = p.cli("device", "online", victim, check=False)
    assert r.returncode != 0 and "smaller than this pool's devices" in r.stderr, r.stderr

    os.truncate(victim, size)
    r = p.cli("device", "online", victim, "--wait", check=False)
    assert r.returncode == 0, r.stderr
    st = p.status()
    assert st["state"] == "ONLINE", st
    qemu_io_ok(p.uri("v"), "read -P 0x33 0 4M")
