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


def _other_fs_dir(near):
    """A fresh directory on another file system than `near` (/dev/shm, a tmpfs), or skip."""
    import os
    import tempfile

    import pytest
    base = "/dev/shm"
    if not os.path.isdir(base) or os.stat(base).st_dev == os.stat(near).st_dev:
        pytest.skip("no second file system (/dev/shm) to keep the trust root on")
    return tempfile.mkdtemp(prefix="bulwark-keys-", dir=base)


def test_key_dir_puts_key_and_anchor_off_the_devices_and_the_pool_serves(make_pool):
    import json
    import os
    import shutil
    from pathlib import Path

    p = make_pool(layout="single", devices=1, device_size="64M")
    keys = Path(_other_fs_dir(p.tmp)) / "tank-root"
    try:
        r = p.bulwark("pool", "create", p.dir, "--layout", "single", "--devices", "1",
                      "--device-size", "64M", "--key-dir", keys, check=False)
        assert r.returncode == 0, r.stderr
        assert not [l for l in r.stderr.splitlines() if l.startswith("warning:")], r.stderr
        assert str(keys / "pool.key") in r.stdout, r.stdout
        # The trust root is in the key directory, not beside the devices.
        assert (keys / "pool.key").exists() and (keys / "pool.anchor").exists()
        assert not (p.dir / "pool.key").exists() and not (p.dir / "pool.anchor").exists()
        assert oct(os.stat(keys).st_mode & 0o777) == "0o700"
        conf = json.loads((p.dir / "pool.json").read_text())
        assert conf["key_dir"] == str(keys.resolve())

        p.start()
        p.create_volume("v", size="16M")
        st = p.status()
        assert st["trust_root"]["key_dir"] is True, st["trust_root"]
        assert st["trust_root"]["key"] == str(keys.resolve() / "pool.key")
        assert st["trust_root"]["anchor"] == str(keys.resolve() / "pool.anchor")
        text = p.cli("status").stdout
        assert "trust root: " + str(keys.resolve()) in text, text
        assert "--key-dir" in text, text
        # A restart finds the key and the anchor there again (the anchor is written by
        # every commit: it moves forward in the key directory).
        before = (keys / "pool.anchor").read_bytes()
        p.stop()
        p.start()
        assert p.volume_status("v")["name"] == "v"
        p.stop()
        assert (keys / "pool.anchor").read_bytes() != before
        assert not (p.dir / "pool.anchor").exists()
    finally:
        if p.running:
            p.stop()
        shutil.rmtree(keys.parent, ignore_errors=True)


def test_without_key_dir_status_names_the_pool_directory(make_pool):
    p = make_pool(layout="single", devices=1, device_size="64M")
    p.create()
    p.start()
    st = p.status()
    assert st["trust_root"]["key_dir"] is False
    assert st["trust_root"]["key"].endswith("/pool.key")
    assert st["trust_root"]["key"].startswith(str(p.dir.resolve())) or \
        st["trust_root"]["key"].startswith(str(p.dir))


def test_the_warning_names_key_dir(make_pool):
    p = make_pool(layout="single", devices=1, device_size="64M")
    r = p.bulwark("pool", "create", p.dir, "--layout", "single", "--devices", "1",
                  "--device-size", "64M", check=False)
    assert r.returncode == 0, r.stderr
    assert "--key-dir" in r.stderr, r.stderr


def test_pool_import_key_dir_moves_the_trust_root_off_the_devices(make_pool):
    """`pool import --key-dir K` (issue 41 part 2, as `pool create --key-dir`): the
    imported pool's key and anchor are in K, not beside the devices; the pool serves from
    there with its data; an import without it warns as `pool create` does."""
    import json
    import shutil
    from pathlib import Path

    from conftest import qemu_io_ok

    p = make_pool(layout="single", devices=1, device_size="64M")
    p.create().start()
    key = p.create_volume("v", size="16M")
    qemu_io_ok(p.uri("v"), "write -P 0x5c 0 64k", "flush")
    p.stop()
    p.bulwark("pool", "export", p.dir)
    keys = Path(_other_fs_dir(p.tmp)) / "moved-root"
    new = p.tmp / "new"
    try:
        r = p.bulwark("pool", "import", "--dir", new, "--from-dir", p.dir,
                      "--key-dir", keys, check=False)
        assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
        assert f"trust root: {keys.resolve()}" in r.stdout, r.stdout
        assert not [l for l in r.stderr.splitlines() if l.startswith("warning:")], r.stderr
        assert (keys / "pool.key").exists() and (keys / "pool.anchor").exists()
        assert not (new / "pool.key").exists() and not (new / "pool.anchor").exists()
        assert json.loads((new / "pool.json").read_text())["key_dir"] == str(keys.resolve())
        q = make_pool(layout="single", devices=1, device_size="64M")
        q.dir = new
        q.start()
        try:
            st = q.status()
            assert st["trust_root"]["key_dir"] is True, st["trust_root"]
            assert st["trust_root"]["anchor"] == str(keys.resolve() / "pool.anchor")
            q.load_key("v", key)
            qemu_io_ok(q.uri("v"), "read -P 0x5c 0 64k")
            q.stop()
        finally:
            q.kill()
        # Back again without --key-dir: the trust root lands in the directory, beside the
        # devices, and the import says so.
        q.bulwark("pool", "export", new)
        again = p.tmp / "again"
        r = p.bulwark("pool", "import", "--dir", again, "--from-dir", new, check=False)
        assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
        warnings = [l for l in r.stderr.splitlines() if l.startswith("warning:")]
        assert any("pool.key" in l and "same file system" in l and "--key-dir" in l
                   for l in warnings), r.stderr
    finally:
        shutil.rmtree(keys.parent, ignore_errors=True)


def test_pool_import_key_dir_refuses_another_pools_trust_root(make_pool):
    """A key directory that already holds another pool's pool.key is refused before
    anything is imported: the other pool's trust root is never overwritten."""
    p = make_pool(layout="single", devices=1, device_size="64M")
    p.create()
    other = p.tmp / "other-root"
    other.mkdir(mode=0o700)
    (other / "pool.key").write_bytes(b"\x01" * 32)
    p.bulwark("pool", "export", p.dir)
    new = p.tmp / "new"
    r = p.bulwark("pool", "import", "--dir", new, "--from-dir", p.dir,
                  "--pool-key", p.dir / "pool.key", "--key-dir", other, check=False)
    assert r.returncode != 0, r.stdout
    assert "another pool's trust root" in r.stderr, r.stderr
    assert not (new / "pool.json").exists()
    assert (other / "pool.key").read_bytes() == b"\x01" * 32
