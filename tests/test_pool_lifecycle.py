"""A pool's life as a storage admin lives it, zpool-style (issue 23, part 3).

A pool is exported on one directory, its devices are moved, and it is imported
from the devices alone into a fresh directory: volumes, keys (after key load),
grants (carried by hand, or with --from-dir) and data (qemu-io pattern verify)
come along. A pool still in use (a daemon holds its devices, or it was imported
and not exported) is refused by a second import; a destroyed pool is refused by
every import. The host's registry (`pool list`) follows all of it.
"""

import json
import shutil

from conftest import Pool, qemu_io_ok, stderr_lines


def pool_list(p: Pool) -> dict:
    r = p.bulwark("pool", "list", "--json")
    return {row["name"]: row for row in json.loads(r.stdout)}


def refused(r, *words):
    """One `error:` line, exit 1, naming every word."""
    lines = stderr_lines(r)
    assert r.returncode == 1, f"exit {r.returncode}, expected a refusal:\n{r.stdout}{r.stderr}"
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0], f"{w!r} not in: {lines[0]}"
    return lines[0]


def test_export_move_import_destroy(tmp_path):
    reg = tmp_path / "registry.json"
    a = Pool(tmp_path / "host-a", layout="mirror:2", devices=2, device_size="128M",
             registry=reg, dir_name="tank")
    a.tmp.mkdir()
    a.create().start()
    try:
        key = a.create_volume("enc", size="32M")
        a.create_volume("plain", size="16M", encryption=False)
        qemu_io_ok(a.uri("enc"), "write -P 0x5a 0 1M", "write -P 0xa5 8M 512k", "flush")
        qemu_io_ok(a.uri("plain"), "write -P 0x33 1M 2M", "flush")
        a.cli("grant", "add", "cn:alice", "enc", "--read-only")
        listed = pool_list(a)
        assert listed["tank"]["state"] == "serving" and listed["tank"]["dir"] == str(a.dir), listed
        st = a.status()
        assert st["name"] == "tank", st
        assert "pool: tank" in a.cli("status").stdout

        # A served pool is not exported: the daemon must be stopped first.
        refused(a.bulwark("pool", "export", "tank", check=False), "stop it first")
        devices = a.device_paths()
        a.stop()
    finally:
        a.kill()

    r = a.bulwark("pool", "export", "tank")
    assert "exported pool tank" in r.stdout and "generation" in r.stdout, r.stdout
    assert pool_list(a)["tank"]["state"] == "exported"
    # An exported pool is not served by accident (a unit restarting on the old host).
    r = a.bulwark("serve", a.dir, check=False, timeout=60)
    refused(r, "was exported", "pool import")
    refused(a.bulwark("pool", "export", "tank", check=False), "already exported")
    off = json.loads(a.bulwark("pool", "status", "tank", "--json").stdout)
    assert off["state"] == "EXPORTED" and off["exported"], off

    # Move the devices (another host's disks), then import them alone into a fresh directory.
    disks = tmp_path / "disks"
    disks.mkdir()
    moved = [shutil.move(d, disks / d.split("/")[-1]) for d in devices]
    b = Pool(tmp_path / "host-b", layout="mirror:2", registry=reg, dir_name="tank")
    b.tmp.mkdir()
    # The pool key is not on the devices (a thief of the disks does not get it): the
    # import needs it, and a refused import leaves nothing behind.
    r = b.bulwark("pool", "import", "--dir", b.dir, *moved, check=False)
    refused(r, "--pool-key", "not on the devices")
    assert not b.dir.exists() or not (b.dir / "pool.json").exists()
    r = b.bulwark("pool", "import", "--dir", b.dir, "--pool-key", a.dir / "pool.key", *moved)
    out = r.stdout
    assert "pool: tank" in out and "EXPORTED" in out, out
    assert f"imported pool tank" in out and str(b.dir) in out, out
    assert "key load" in out and "enc" in out, out
    assert "grants: none" in out, out
    listed = pool_list(b)
    assert listed["tank"]["dir"] == str(b.dir) and listed["tank"]["state"] == "stopped", listed

    # Grants live in the pool directory, not on the devices: carried by hand.
    shutil.copy2(a.dir / "grants.json", b.dir / "grants.json")
    b.start()
    try:
        names = {v["name"]: v for v in b.status()["volumes"]}
        assert set(names) == {"enc", "plain"}, names
        assert names["enc"]["locked"] and not names["plain"]["locked"], names
        b.load_key("enc", key)
        qemu_io_ok(b.uri("enc"), "read -P 0x5a 0 1M", "read -P 0xa5 8M 512k", "read -P 0 1M 7M")
        qemu_io_ok(b.uri("plain"), "read -P 0x33 1M 2M", "read -P 0 0 1M")
        grants = json.loads(b.cli("grant", "list", "--json").stdout)
        assert [(g["client"], g["volume"], g["access"]) for g in grants] == \
            [("cn:alice", "enc", "read-only")], grants
        assert pool_list(b)["tank"]["state"] == "serving"

        # A second import of the pool while it is in use: refused, --force or not.
        c_dir = tmp_path / "host-c" / "tank"
        for extra in ((), ("--force",)):
            r = b.bulwark("pool", "import", "--dir", c_dir, *moved, *extra, check=False)
            refused(r, "in use", "running bulwark daemon")
            assert not c_dir.exists()
        # Destroying a served pool: refused.
        refused(b.bulwark("pool", "destroy", "tank", "--yes", check=False), "stop it first")
        b.stop()
    finally:
        b.kill()

    # Stopped but never exported: it may be in use on another host.
    r = b.bulwark("pool", "import", "--dir", c_dir, *moved, check=False)
    refused(r, "was not exported", "--force")
    assert not c_dir.exists(), "a refused import leaves nothing behind"

    # Destroy: asks first (no terminal here: refused, exit 2), then wipes every label.
    r = b.bulwark("pool", "destroy", "tank", check=False)
    assert r.returncode == 2 and "--yes" in r.stderr, r.stderr
    r = b.bulwark("pool", "destroy", "tank", "--yes")
    assert "labels wiped on 2 device(s)" in r.stdout, r.stdout
    assert not (b.dir / "pool.json").exists() and not (b.dir / "grants.json").exists()
    assert (b.dir / "audit.log").exists(), "the audit log is kept"
    events = [json.loads(l)["event"] for l in (b.dir / "audit.log").read_text().splitlines()]
    assert events[0] == "pool.import" and events[-1] == "pool.destroy", events
    assert "tank" not in pool_list(b)
    for extra in ((), ("--force",)):
        r = b.bulwark("pool", "import", "--dir", c_dir, *moved, *extra, check=False)
        refused(r, "no bulwark label")
    # The devices were given, not created by bulwark in the directory: they stay, unlabelled.
    assert all(__import__("os").path.exists(m) for m in moved)


def test_import_in_place_and_from_an_old_directory(tmp_path):
    reg = tmp_path / "registry.json"
    a = Pool(tmp_path / "a", layout="single", devices=1, device_size="128M",
             registry=reg, dir_name="alpha")
    a.tmp.mkdir()
    a.create().start()
    try:
        a.create_volume("v", size="16M", encryption=False)
        qemu_io_ok(a.uri("v"), "write -P 0x77 0 2M", "flush")
        a.cli("grant", "add", "anonymous", "v", "--read-write")
        a.stop()
    finally:
        a.kill()

    # A second pool may not take the name; another name is fine.
    other = Pool(tmp_path / "o", registry=reg, dir_name="alpha", device_size="64M")
    other.tmp.mkdir()
    r = other.bulwark("pool", "create", other.dir, "--devices", "1", "--device-size", "64M",
                      check=False)
    refused(r, "already registered", "--name")
    other.bulwark("pool", "create", other.dir, "--devices", "1", "--device-size", "64M",
                  "--name", "beta")
    assert set(pool_list(a)) == {"alpha", "beta"}

    # pool status of a stopped pool: its labels.
    r = a.bulwark("pool", "status", "alpha")
    assert "state: STOPPED" in r.stdout and "ONLINE" in r.stdout and "gen:" in r.stdout, r.stdout

    # Exported and taken back in place (no devices given: the directory's own).
    a.bulwark("pool", "export", a.dir)
    r = a.bulwark("pool", "import", "--dir", a.dir)
    assert "imported pool alpha" in r.stdout, r.stdout
    a.start()
    try:
        qemu_io_ok(a.uri("v"), "read -P 0x77 0 2M")
        a.stop()
    finally:
        a.kill()

    # Exported again and imported from the old directory: devices and grants come along.
    a.bulwark("pool", "export", "alpha")
    b = Pool(tmp_path / "b", registry=reg, dir_name="alpha2")
    b.tmp.mkdir()
    r = b.bulwark("pool", "import", "--dir", b.dir, "--from-dir", a.dir, "--name", "gamma")
    assert "imported pool gamma" in r.stdout and "copied grants.json" in r.stdout, r.stdout
    b.start()
    try:
        qemu_io_ok(b.uri("v"), "read -P 0x77 0 2M")
        grants = json.loads(b.cli("grant", "list", "--json").stdout)
        assert [g["client"] for g in grants] == ["anonymous"], grants
        r = b.bulwark("pool", "status", "gamma")
        assert "  pool: gamma" in r.stdout and "state: ONLINE" in r.stdout, r.stdout
        listed = pool_list(b)
        assert "alpha" not in listed and listed["gamma"]["state"] == "serving", listed
        assert listed["gamma"]["size_bytes"] > 0 and listed["gamma"]["used_bytes"] > 0, listed
        b.stop()
    finally:
        b.kill()
    # The devices bulwark made live in the old directory: destroying the pool from its
    # new directory wipes their labels and leaves the files there.
    r = b.bulwark("pool", "destroy", "gamma", "--yes")
    assert "labels wiped on 1 device(s)" in r.stdout, r.stdout
    r = other.bulwark("pool", "destroy", "beta", "--yes")
    assert "removed" in r.stdout and not (other.dir / "dev0.img").exists(), r.stdout
    assert pool_list(a) == {}
