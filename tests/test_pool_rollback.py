"""Whole-pool rollback is refused (issue 20).

An attacker (or a careless restore) puts back device images from an older copy: every
superblock and checksum on them is valid, so before the anchor the pool imported ONLINE
at the older generation, a volume created since was gone and flushed writes were lost,
silently. Now `serve` refuses the devices with one line naming both generations and the
flag that accepts them; with `--accept-rollback` it takes them as they are, and later
starts need no flag.
"""

import json
import shutil

from conftest import qemu_io_ok, stderr_lines


def test_devices_restored_from_an_older_copy_are_refused(make_pool, tmp_path):
    p = make_pool(layout="mirror:2", devices=2, device_size="128M").create().start()
    key = p.create_volume("v", size="16M")
    qemu_io_ok(p.uri("v"), "write -P 0xa 0 64k", "flush")
    devices = p.device_paths()
    p.stop()
    saved = tmp_path / "saved"
    saved.mkdir()
    for d in devices:
        shutil.copy2(d, saved)

    p.start()
    p.load_key("v", key)
    qemu_io_ok(p.uri("v"), "write -P 0xb 0 64k", "flush")
    p.create_volume("since", size="16M", encryption=False)
    p.stop()

    for d in devices:
        shutil.copy2(saved / d.split("/")[-1], d)
    r = p.bulwark("serve", p.dir, check=False, timeout=60)
    assert r.returncode != 0, f"a rolled-back pool was served:\n{r.stdout}{r.stderr}"
    lines = stderr_lines(r)
    assert len(lines) == 1, r.stderr
    assert "rolled back" in lines[0] and "--accept-rollback" in lines[0], lines[0]
    # Issue 41: the refusal names both generations, which side is newer, the command that
    # keeps the newer state, and what --accept-rollback would drop.
    import re
    gens = [int(g) for g in re.findall(r"generation (\d+)", lines[0])]
    assert len(set(gens)) >= 2, lines[0]
    assert "host's side is newer" in lines[0], lines[0]
    assert f"bulwark serve {p.dir}' again" in lines[0], lines[0]
    assert "drop every commit" in lines[0], lines[0]

    p.serve_args = ["--accept-rollback"]
    p.start()
    p.load_key("v", key)
    qemu_io_ok(p.uri("v"), "read -P 0xa 0 64k")
    assert "since" not in [v["name"] for v in p.status()["volumes"]]
    # The override is in the audit log, with both generations.
    lines = [json.loads(l) for l in (p.dir / "audit.log").read_text().splitlines()]
    accepted = [l for l in lines if l["event"] == "pool.accept_rollback"]
    assert len(accepted) == 1, lines
    d = accepted[0]["detail"]
    assert d["devices_generation"] < d["host_generation"], d
    p.stop()
    p.serve_args = []
    p.start()
    p.load_key("v", key)
    qemu_io_ok(p.uri("v"), "read -P 0xa 0 64k")
