"""Snapshot and clone of a 1 GiB and a 64 GiB volume cost the same: neither writes a data
record, and the metadata each writes (map nodes, the volume table) does not grow with
the volume's size. Checked from `status --json`'s written-bytes counters, which count
every byte the pool places, and from the volumes reading back as they should."""

import json

from conftest import MiB, assert_qemu_io_ok, make_key_file, qemu_io_ok, require_tools, run

GiB = 1024 * MiB


def space(pool) -> dict:
    return pool.status()["space"]


def test_snapshot_and_clone_write_no_data_whatever_the_size(pool):
    require_tools("qemu-io")
    for name, size in (("small", "1G"), ("large", "64G")):
        pool.create_volume(name, size=size)
        # The same 16 writes of 1 MiB, spread over the whole volume (a deep map for
        # the large one, every level touched).
        total = GiB if name == "small" else 64 * GiB
        cmds = [f"write -P {i + 1} {(total // 16) * i} 1M" for i in range(16)]
        qemu_io_ok(pool.uri(name), *cmds, "flush", what=f"fill {name}")
    pool.cli("snapshot", "create", "small@warm")  # the first commit of the kind
    costs = {}
    for name in ("small", "large"):
        before = space(pool)
        pool.cli("snapshot", "create", f"{name}@s1")
        key = make_key_file(pool.keys_dir / f"{name}-clone.key")
        pool.cli("volume", "clone", f"{name}@s1", f"{name}-clone", "--key-file", key)
        after = space(pool)
        data = after["data_written_bytes"] - before["data_written_bytes"]
        clean = after["clean_written_bytes"] - before["clean_written_bytes"]
        meta = after["meta_written_bytes"] - before["meta_written_bytes"]
        assert data == 0, f"snapshot + clone of {name} wrote {data} bytes of data records"
        costs[name] = meta + clean
    print(f"metadata written by snapshot + clone: {costs}")
    # Metadata of two commits each: a few map nodes and the volume table, however large
    # the volume. A copy of the 64 GiB volume's map would be far larger than the 1 GiB's.
    assert costs["large"] < 1 * MiB, costs
    assert costs["large"] <= 4 * max(costs["small"], 64 * 1024), costs
    # The clones read what their origins held.
    for name, total in (("small", GiB), ("large", 64 * GiB)):
        cmds = [f"read -P {i + 1} {(total // 16) * i} 1M" for i in range(16)]
        qemu_io_ok(pool.uri(f"{name}-clone"), *cmds, what=f"read {name}-clone")
        # A snapshot is a read-only export: qemu-io opens it with -r.
        args = ["qemu-io", "-f", "raw", "-r"]
        for c in cmds:
            args += ["-c", c]
        r = run(args + [pool.uri(f"{name}@s1")], check=False)
        assert_qemu_io_ok(r, f"read {name}@s1")
    listed = json.loads(pool.cli("snapshot", "list", "--json").stdout)
    assert {s["name"] for s in listed} == {"small@warm", "small@s1", "large@s1"}
