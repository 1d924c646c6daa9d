"""Volumes after create (issue 23, part 4): resize, properties, thin and thick.

A volume under a mounted ext4 grows online and resize2fs takes the new room, files
intact; a shrink over data is refused with how much is in use, a shrink of an unused
tail works. Properties set are durable; readonly=on makes the export read-only and
qemu-io's writes fail. A thin volume that overcommits the pool is created with a
warning and status says by how much; a thick volume's reservation is refused when the
pool cannot hold it and, once made, thin volumes' data stops short of it.
"""

import hashlib
import json
import os
import re

from conftest import KiB, MiB, qemu_io, qemu_io_ok, require_tools, run, stderr_lines
from keyutil import audit_lines
from test_nbdfuse_ext4 import loop_mount, make_tree, nbdfuse, require_loop_mount


def get(pool, name, prop="all") -> dict:
    r = pool.cli("volume", "get", name, prop, "--json")
    return {row["property"]: row for row in json.loads(r.stdout)}


def tree_sums(root):
    got = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            with open(p, "rb") as f:
                got[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return got


def test_grow_under_a_mounted_ext4(pool, tmp_path, seed):
    require_tools("nbdfuse", "fusermount3", "mkfs.ext4", "e2fsck", "resize2fs", "mount",
                  "umount", "losetup")
    require_loop_mount()
    # 64K blocks: a block map of depth 2 holds 256 MiB, so the grow needs a deeper map.
    key = pool.create_volume("fs1", size="128M", block_size="64K")
    uri = pool.uri("fs1")
    mnt, fs = tmp_path / "mnt", tmp_path / "fs"
    src = tmp_path / "src"
    sums = make_tree(src, seed)

    with nbdfuse(uri, mnt) as disk:
        assert disk.stat().st_size == 128 * MiB
        run(["mkfs.ext4", "-q", "-F", disk])
        with loop_mount(disk, fs):
            run(["cp", "-a", f"{src}/.", f"{fs}/tree"])
            run(["sync", "-f", f"{fs}/tree"])
            # Grown while mounted: the daemon serves 512M to new connections at once, but
            # this NBD connection (nbdfuse's) keeps the size of its handshake, 128M.
            r = pool.cli("volume", "resize", "fs1", "512M")
            assert "from 128M to 512M" in r.stdout and "depth 2 -> 3" in r.stdout, r.stdout
            assert "keep the old size" in r.stdout, r.stdout
            assert disk.stat().st_size == 128 * MiB
            assert pool.volume_status("fs1")["size_bytes"] == 512 * MiB
            big = os.urandom(8 * MiB)
            (fs / "before.bin").write_bytes(big)
            sums["before.bin"] = hashlib.sha256(big).hexdigest()
            run(["sync", "-f", f"{fs}/before.bin"])

    # So the mount is redone: a new nbdfuse connection sees 512M, resize2fs grows ext4
    # into it (offline, after the e2fsck -f it asks for).
    with nbdfuse(uri, mnt) as disk:
        assert disk.stat().st_size == 512 * MiB
        run(["e2fsck", "-fy", disk])
        r = run(["resize2fs", disk])
        assert "is now" in r.stdout + r.stderr, r.stdout + r.stderr
        with loop_mount(disk, fs):
            st = os.statvfs(fs)
            assert st.f_blocks * st.f_frsize > 400 * MiB, "ext4 did not grow"
            assert {k: v for k, v in tree_sums(fs).items() if not k.startswith("lost+found")
                    } == {**{f"tree/{k}": v for k, v in sums.items() if k != "before.bin"},
                          "before.bin": sums["before.bin"]}
            # Fill past the old end: the new blocks hold data.
            after = os.urandom(200 * MiB)
            (fs / "after.bin").write_bytes(after)
            run(["sync", "-f", f"{fs}/after.bin"])
            want_after = hashlib.sha256(after).hexdigest()
        r = run(["e2fsck", "-fn", disk], check=False)
        assert r.returncode == 0, f"e2fsck -fn after the grow:\n{r.stdout}{r.stderr}"

    pool.restart()
    pool.load_key("fs1", key)
    with nbdfuse(uri, mnt) as disk:
        assert disk.stat().st_size == 512 * MiB
        with loop_mount(disk, fs):
            assert hashlib.sha256((fs / "after.bin").read_bytes()).hexdigest() == want_after
            assert hashlib.sha256((fs / "tree" / "big.bin").read_bytes()).hexdigest() == \
                sums["big.bin"]


def test_shrink_only_over_holes(pool):
    pool.create_volume("sh", size="64M", encryption=False)
    uri = pool.uri("sh")
    qemu_io_ok(uri, "write -P 0x21 0 1M", "write -P 0x22 60M 1M", "flush")
    pool.wait_detached("sh")
    r = pool.cli("volume", "resize", "sh", "32M", check=False)
    assert r.returncode == 1 and "--shrink" in r.stderr, r.stderr
    r = pool.cli("volume", "resize", "sh", "32M", "--shrink", check=False)
    lines = stderr_lines(r)
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "1M of volume 'sh' past 32M hold data" in lines[0], lines[0]
    assert pool.volume_status("sh")["size_bytes"] == 64 * MiB

    # Zero the tail (whole zeroed blocks are freed, as a trim frees them: what fstrim
    # does for a shrunk file system), then the shrink works.
    qemu_io_ok(uri, "write -z 60M 1M", "flush")
    pool.wait_detached("sh")
    used = pool.volume_status("sh")["used_bytes"]
    r = pool.cli("volume", "resize", "sh", "32M", "--shrink")
    assert "from 64M to 32M" in r.stdout, r.stdout
    v = pool.volume_status("sh")
    assert v["size_bytes"] == 32 * MiB and v["used_bytes"] == used, v
    info = json.loads(run(["nbdinfo", "--json", uri]).stdout)
    assert info["exports"][0]["export-size"] == 32 * MiB, info
    qemu_io_ok(uri, "read -P 0x21 0 1M", "read -P 0 1M 31M")
    r = qemu_io(uri, "read 32M 4k")
    assert "read 4096/4096 bytes" not in r.stdout, r.stdout
    pool.wait_detached("sh")

    # A volume with a held snapshot grows; the snapshot keeps its size (its export says
    # so), a clone of it starts there and grows on its own, and a rollback brings the
    # snapshot's size back.
    pool.cli("snapshot", "create", "sh@s1")
    pool.cli("snapshot", "hold", "sh@s1", "keep")
    r = pool.cli("volume", "resize", "sh", "128M")
    assert "from 32M to 128M" in r.stdout, r.stdout
    qemu_io_ok(uri, "write -P 0x23 100M 1M", "flush")
    pool.wait_detached("sh")
    pool.cli("snapshot", "create", "sh@s2")
    pool.cli("volume", "clone", "sh@s1", "shc")
    pool.cli("volume", "resize", "shc", "64M")
    pool.restart()

    def export_size(name):
        info = json.loads(run(["nbdinfo", "--json", pool.uri(name)]).stdout)
        return info["exports"][0]["export-size"]

    for name, size in (("sh", 128), ("sh@s1", 32), ("sh@s2", 128), ("shc", 64)):
        assert export_size(name) == size * MiB, name
    listed = json.loads(pool.cli("snapshot", "list", "sh", "--json").stdout)
    assert [s["size_bytes"] for s in listed] == [32 * MiB, 128 * MiB], listed
    qemu_io_ok(pool.uri("shc"), "read -P 0x21 0 1M", "read -P 0 32M 32M")
    pool.wait_detached("shc")
    pool.cli("volume", "rollback", "sh@s1", "--destroy-newer")
    assert pool.volume_status("sh")["size_bytes"] == 32 * MiB
    qemu_io_ok(uri, "read -P 0x21 0 1M")


def test_properties_round_trip_and_readonly(pool):
    key = pool.create_volume("p", size="16M")
    props = get(pool, "p")
    assert set(props) >= {"size", "blocksize", "compression", "encryption", "keystatus",
                          "used", "referenced", "origin", "snapshots", "created",
                          "description", "readonly"}, props
    assert props["size"]["value"] == 16 * MiB and props["keystatus"]["value"] == "available"
    assert props["readonly"]["value"] == "off" and props["readonly"]["source"] == "default"
    assert props["created"]["value"] > 0 and props["encryption"]["value"] is True

    qemu_io_ok(pool.uri("p"), "write -P 0x11 0 64k", "flush")
    pool.wait_detached("p")
    pool.cli("volume", "set", "p", "description=web server, ticket 1234", "compression=off")
    r = pool.cli("volume", "set", "p", "readonly=on")
    assert "read-only" in r.stdout, r.stdout
    for bad, why in (("compression=zstd", "invalid compression"), ("size=1G", "volume resize"),
                     ("used=0", "read-only"), ("colour=red", "unknown property"),
                     ("readonly=maybe", "on or off"), ("description=" + "x" * 257, "at most 256")):
        r = pool.cli("volume", "set", "p", bad, check=False)
        assert r.returncode == 1 and why in r.stderr, (bad, r.stderr)

    pool.restart()
    pool.load_key("p", key)
    props = get(pool, "p")
    assert props["description"]["value"] == "web server, ticket 1234"
    assert props["description"]["source"] == "local"
    assert (props["compression"]["value"], props["readonly"]["value"]) == ("off", "on"), props
    one = pool.cli("volume", "get", "p", "readonly").stdout.splitlines()
    assert re.match(r"p\s+readonly\s+on\s+local$", one[1]), one

    # Exported read-only: qemu-io cannot write (it refuses to open the export for
    # writing, or the write fails), and the data is unchanged.
    r = qemu_io(pool.uri("p"), "write -P 0x99 0 4k")
    out = (r.stdout + r.stderr).lower()
    assert r.returncode != 0 or "failed" in out or "error" in out, out
    assert "wrote" not in out, out
    r = run(["nbdinfo", "--json", pool.uri("p")])
    assert json.loads(r.stdout)["exports"][0]["is_read_only"] is True, r.stdout
    r = run(["qemu-io", "-r", "-f", "raw", "-c", "read -P 0x11 0 64k", pool.uri("p")], check=False)
    assert r.returncode == 0 and "Pattern verification failed" not in r.stdout, r.stdout
    pool.wait_detached("p")

    pool.cli("volume", "set", "p", "readonly=off")
    qemu_io_ok(pool.uri("p"), "write -P 0x12 0 4k", "read -P 0x12 0 4k", "read -P 0x11 4k 60k")
    events = audit_lines(pool)
    sets = [e["detail"] for e in events if e["event"] == "volume_set"]
    assert {"readonly": "on"} in sets and {"readonly": "off"} in sets, sets


def test_overcommit_warning_and_thick_reservations(make_pool):
    p = make_pool(device_size="256M").create().start()
    usable = p.status()["space"]["usable_bytes"]

    # Thin: more than the pool holds is allowed, with one warning line.
    r = p.cli("volume", "create", "big", "--size", "1G", "--encryption", "off",
              "--compression", "off")
    warn = stderr_lines(r)
    assert len(warn) == 1 and warn[0].startswith("warning: provisioned 1G on "), r.stderr
    assert "x overcommitted" in warn[0], warn
    assert re.search(r"provisioned 1G on \S+ usable: \d+\.\dx overcommitted", p.cli("status").stdout)

    # Thick: refused beyond what the pool can hold; within it, reserved at once.
    r = p.cli("volume", "create", "huge", "--size", "2G", "--thick", "--encryption", "off",
              check=False)
    assert r.returncode == 1 and "cannot reserve" in r.stderr, r.stderr
    r = p.cli("volume", "create", "t", "--size", "64M", "--thick", "--encryption", "off",
              "--compression", "off")
    assert "warning" not in r.stderr, r.stderr
    st = p.status()
    assert st["space"]["thick_reserved_bytes"] == 64 * MiB, st["space"]
    assert "64M reserved by thick volumes" in p.cli("status").stdout
    props = get(p, "t")
    assert props["provisioning"]["value"] == "thick" and props["reservation"]["value"] == 64 * MiB
    assert get(p, "big")["provisioning"]["value"] == "thin"

    # The thin volume's data stops short of the reservation (ENOSPC)...
    off, step, failed = 0, 8 * MiB, None
    while off < 1024 * MiB:
        r = qemu_io(p.uri("big"), f"write -P 0x5{off // step % 10} {off} {step}", "flush")
        out = r.stdout + r.stderr
        if r.returncode != 0 or "failed" in out.lower():
            failed = out
            break
        off += step
    assert failed is not None and "No space left on device" in failed, failed
    p.wait_detached("big")
    space = p.status()["space"]
    assert space["used_bytes"] + 64 * MiB <= usable + 2 * step, (space, usable)
    # ... and the thick volume still writes all of its size.
    qemu_io_ok(p.uri("t"), "write -P 0x44 0 64M", "flush", "read -P 0x44 0 64M")
    qemu_io_ok(p.uri("big"), "read -P 0x50 0 8M")
