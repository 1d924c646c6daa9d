"""The Proxmox VE storage plugin (packaging/proxmox/BulwarkPlugin.pm) against the real
daemon: images, snapshots, rollback, resize (with snapshots), templates and linked
clones, status, keys loaded from their file at activation after a daemon restart.

PVE itself is not here: `tests/helpers/pve_call.pl` loads the module with a stand-in for
`PVE::Storage::Plugin` (tests/helpers/pve/; its header says why and what it stands for)
and calls one method per process, as PVE's storage layer calls them (class methods with
PVE's arguments), printing the result as JSON. What PVE does around a method (locking,
the VM config) is not exercised; the data the methods produce is checked through the NBD
paths they return, with qemu-io and nbdinfo, as QEMU would use them.
"""

import json
import os
import stat
from pathlib import Path

import pytest

from conftest import MiB, qemu_io_ok, require_tools, run

HERE = Path(__file__).parent
CALL = HERE / "helpers" / "pve_call.pl"


def require_perl_json():
    require_tools("perl", "qemu-io", "nbdinfo")
    if run(["perl", "-MJSON", "-e", "1"], check=False).returncode != 0:
        pytest.skip("perl's JSON module is missing (apt-get install libjson-perl)")


class Plugin:
    def __init__(self, pool, keydir: Path):
        self.pool = pool
        self.scfg = {"bulwark-dir": str(pool.dir), "bulwark-binary": str(pool.bin),
                     "bulwark-keydir": str(keydir), "type": "bulwark"}

    def call(self, method, *args, env=None):
        e = dict(os.environ, **(env or {}))
        r = run(["perl", CALL, method, json.dumps(list(args))], env=e)
        out = json.loads(r.stdout)
        if "error" in out:
            raise PluginError(out["error"].strip())
        return out["ok"]

    def export_size(self, volname, snap=None):
        path = self.call("path", self.scfg, volname, "bw", snap)[0]
        info = json.loads(run(["nbdinfo", "--json", path]).stdout)
        return info["exports"][0]["export-size"]


class PluginError(Exception):
    pass


def test_proxmox_plugin_drives_the_daemon(pool, tmp_path):
    require_perl_json()
    keydir = tmp_path / "keys"
    p = Plugin(pool, keydir)
    scfg = p.scfg

    assert p.call("api") == [12]
    assert p.call("api", env={"PVE_STANDIN_APIVER": "11"}) == [11]
    assert p.call("activate_storage", "bw", scfg, {}) == [1]
    total, avail, used, active = p.call("status", "bw", scfg, {})
    assert active == 1 and total > 0 and 0 < avail <= total and used >= 0

    # Images: PVE asks in KiB; names are PVE's; each volume its own key file.
    assert p.call("alloc_image", "bw", scfg, 100, "raw", None, 64 * 1024) == ["vm-100-disk-0"]
    assert p.call("alloc_image", "bw", scfg, 100, "raw", None, 1001) == ["vm-100-disk-1"]
    with pytest.raises(PluginError, match="already exists"):
        p.call("alloc_image", "bw", scfg, 100, "raw", "vm-100-disk-0", 1024)
    with pytest.raises(PluginError, match="raw only"):
        p.call("alloc_image", "bw", scfg, 100, "qcow2", None, 1024)
    key0 = keydir / "vm-100-disk-0.key"
    assert stat.S_IMODE(keydir.stat().st_mode) == 0o700
    assert stat.S_IMODE(key0.stat().st_mode) == 0o600 and key0.stat().st_size == 32
    assert pool.volume_status("vm-100-disk-0")["encryption"] is True
    size, fmt, _, parent = p.call("volume_size_info", scfg, "bw", "vm-100-disk-1", 5)
    assert (size, fmt, parent) == (251 * 4096, "raw", None), "1001K rounded up to 4K blocks"

    path = p.call("path", scfg, "vm-100-disk-0", "bw", None)[0]
    assert path == f"nbd+unix:///vm-100-disk-0?socket={pool.dir}/nbd.sock"
    qemu_io_ok(path, "write -P 0x11 0 1M", "flush")
    pool.wait_detached("vm-100-disk-0")
    blockdev = p.call("qemu_blockdev_options", scfg, "bw", "vm-100-disk-0", "10.0",
                      {"snapshot-name": "s1"})[0]
    assert blockdev["driver"] == "nbd" and blockdev["export"] == "vm-100-disk-0@s1"
    assert blockdev["server"] == {"type": "unix", "path": f"{pool.dir}/nbd.sock"}

    # Snapshots, resize with a snapshot (it keeps its size), rollback to the newest only.
    assert p.call("volume_qemu_snapshot_method", "bw", scfg, "vm-100-disk-0") == ["storage"]
    p.call("volume_snapshot", scfg, "bw", "vm-100-disk-0", "s1")
    qemu_io_ok(path, "write -P 0x22 0 1M", "flush")
    pool.wait_detached("vm-100-disk-0")
    assert p.call("volume_resize", scfg, "bw", "vm-100-disk-0", 128 * MiB, 0) == [128 * MiB]
    assert p.export_size("vm-100-disk-0") == 128 * MiB
    assert p.export_size("vm-100-disk-0", "s1") == 64 * MiB
    p.call("volume_snapshot", scfg, "bw", "vm-100-disk-0", "s2")
    info = p.call("volume_snapshot_info", scfg, "bw", "vm-100-disk-0")[0]
    assert set(info) == {"s1", "s2"} and info["s1"]["id"] < info["s2"]["id"]
    assert all(v["timestamp"] > 0 for v in info.values())
    blockers = []
    with pytest.raises(PluginError, match="not the most recent snapshot"):
        p.call("volume_rollback_is_possible", scfg, "bw", "vm-100-disk-0", "s1", blockers)
    assert p.call("volume_rollback_is_possible", scfg, "bw", "vm-100-disk-0", "s2", []) == [1]
    qemu_io_ok(path, "write -P 0x33 0 1M", "flush")
    pool.wait_detached("vm-100-disk-0")
    p.call("volume_snapshot_rollback", scfg, "bw", "vm-100-disk-0", "s2")
    qemu_io_ok(path, "read -P 0x22 0 1M")
    pool.wait_detached("vm-100-disk-0")
    p.call("volume_snapshot_delete", scfg, "bw", "vm-100-disk-0", "s2")
    p.call("volume_snapshot_delete", scfg, "bw", "vm-100-disk-0", "s1")
    assert p.call("volume_snapshot_info", scfg, "bw", "vm-100-disk-0") == [{}]

    # After a daemon restart the volumes are locked; activation loads each one's key.
    pool.restart()
    assert pool.volume_status("vm-100-disk-0")["locked"] is True
    p.call("activate_volume", "bw", scfg, "vm-100-disk-0", None, {})
    assert pool.volume_status("vm-100-disk-0")["locked"] is False
    qemu_io_ok(path, "read -P 0x22 0 1M")
    pool.wait_detached("vm-100-disk-0")
    p.call("deactivate_volume", "bw", scfg, "vm-100-disk-0", None, {})

    # A template and a linked clone under its own key; the clone grows.
    assert p.call("create_base", "bw", scfg, "vm-100-disk-0") == ["base-100-disk-0"]
    assert pool.volume_status("vm-100-disk-0")["readonly"] is True
    assert p.call("volume_has_feature", scfg, "clone", "bw", "base-100-disk-0", None, 0, {}) == [1]
    assert p.call("volume_has_feature", scfg, "clone", "bw", "vm-100-disk-1", None, 0, {}) == [None]
    assert p.call("volume_has_feature", scfg, "snapshot", "bw", "vm-100-disk-1", None, 0, {}) == [1]
    assert p.call("volume_has_feature", scfg, "rename", "bw", "vm-100-disk-1", None, 0, {}) == [None]
    assert p.export_size("base-100-disk-0") == 128 * MiB
    clone = p.call("clone_image", scfg, "bw", "base-100-disk-0", 101, None)[0]
    assert clone == "base-100-disk-0/vm-101-disk-0"
    assert (keydir / "vm-101-disk-0.key").exists()
    cpath = p.call("path", scfg, clone, "bw", None)[0]
    assert cpath == f"nbd+unix:///vm-101-disk-0?socket={pool.dir}/nbd.sock"
    qemu_io_ok(cpath, "read -P 0x22 0 1M", "write -P 0x44 1M 1M", "flush")
    pool.wait_detached("vm-101-disk-0")
    p.call("volume_resize", scfg, "bw", clone, 256 * MiB, 0)
    assert p.export_size(clone) == 256 * MiB
    size, _, _, parent = p.call("volume_size_info", scfg, "bw", clone, 5)
    assert (size, parent) == (256 * MiB, "base-100-disk-0")
    listed = {i["volid"]: i for i in p.call("list_images", "bw", scfg, None, None, {})[0]}
    assert set(listed) == {"bw:base-100-disk-0", "bw:vm-100-disk-1",
                           "bw:base-100-disk-0/vm-101-disk-0"}, listed
    assert listed["bw:base-100-disk-0/vm-101-disk-0"]["parent"] == "base-100-disk-0"
    assert listed["bw:base-100-disk-0/vm-101-disk-0"]["vmid"] == "101"
    only = p.call("list_images", "bw", scfg, 101, None, {})[0]
    assert [i["volid"] for i in only] == ["bw:base-100-disk-0/vm-101-disk-0"]

    # The clone opens with its own key alone after a restart.
    pool.restart()
    p.call("activate_volume", "bw", scfg, clone, None, {})
    qemu_io_ok(cpath, "read -P 0x44 1M 1M")
    pool.wait_detached("vm-101-disk-0")

    # Freed: the clone, then the template; their key files go with them.
    p.call("free_image", "bw", scfg, clone, 0, "raw")
    p.call("free_image", "bw", scfg, "base-100-disk-0", 1, "raw")
    p.call("free_image", "bw", scfg, "vm-100-disk-1", 0, "raw")
    assert p.call("list_images", "bw", scfg, None, None, {}) == [[]]
    assert sorted(os.listdir(keydir)) == []
