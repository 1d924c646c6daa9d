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


def test_device_import_of_an_older_copy_names_min_generation(make_pool, tmp_path):
    """Issue 41 part 3, device imports: an exported pool's devices put back from an older
    copy. `pool import --min-generation N` (the generation the last host showed) refuses
    them and imports nothing; an import into the pool's old directory (whose anchor knows
    the newer generation) refuses them naming both generations, the newer side, the
    import that keeps it (with --min-generation) and what --accept-rollback would drop;
    an import with neither anchor nor --min-generation takes them, and warns so, naming
    --min-generation."""
    import re

    p = make_pool(layout="single", devices=1, device_size="64M").create().start()
    key = p.create_volume("v", size="16M")
    qemu_io_ok(p.uri("v"), "write -P 0xa 0 64k", "flush")
    devices = p.device_paths()
    p.stop()
    p.bulwark("pool", "export", p.dir)
    saved = tmp_path / "saved"
    saved.mkdir()
    for d in devices:
        shutil.copy2(d, saved)
    # The pool goes on: imported again, one more write, exported at a newer generation.
    p.bulwark("pool", "import", "--dir", p.dir, *devices)
    p.start()
    p.load_key("v", key)
    qemu_io_ok(p.uri("v"), "write -P 0xb 0 64k", "flush")
    newer = p.status()["generation"]
    p.stop()
    p.bulwark("pool", "export", p.dir)
    last = json.loads(p.bulwark("pool", "status", p.dir, "--json").stdout)["generation"]
    for d in devices:
        shutil.copy2(saved / d.split("/")[-1], d)

    new = tmp_path / "new"
    r = p.bulwark("pool", "import", "--dir", new, "--pool-key", p.dir / "pool.key",
                  "--min-generation", str(newer), *devices, check=False)
    assert r.returncode != 0, r.stdout
    assert f"older than --min-generation {newer}" in r.stderr, r.stderr
    assert not (new / "pool.json").exists()

    r = p.bulwark("pool", "import", "--dir", p.dir, *devices, check=False)
    assert r.returncode != 0, r.stdout
    err = [l for l in stderr_lines(r) if l.startswith("error:")]
    assert len(err) == 1, r.stderr
    gens = {int(g) for g in re.findall(r"generation (\d+)", err[0])}
    assert last in gens and min(gens) < newer, err[0]
    assert "the anchor's side is newer" in err[0], err[0]
    assert f"--min-generation {last}" in err[0], err[0]
    assert "--accept-rollback would import this copy and drop every commit" in err[0], err[0]

    r = p.bulwark("pool", "import", "--dir", new, "--pool-key", p.dir / "pool.key",
                  *devices, check=False)
    assert r.returncode == 0, r.stderr
    assert "no --min-generation" in r.stderr, r.stderr


def test_damaged_newest_labels_are_not_called_a_plain_rollback(make_pool):
    """Issue 41 part 3: someone without the key damages the newest generation's label
    slots on every device (a MAC byte each). The pool falls back to the generation
    before, which the anchor refuses; the refusal says the newest labels fail
    authentication (not a rollback), names both generations, and says what
    --accept-rollback would drop before anyone runs it."""
    import re
    import sys

    from conftest import HELPERS
    sys.path.insert(0, str(HELPERS))
    import bwforge

    p = make_pool(layout="mirror:2", devices=2, device_size="128M").create().start()
    p.create_volume("v", size="16M")
    qemu_io_ok(p.uri("v"), "write -P 0xa 0 64k", "flush")
    devices = p.device_paths()
    p.stop()
    newest = max(s.generation for d in devices for s in bwforge.read_slots(d))
    damaged = 0
    for d in devices:
        for s in bwforge.read_slots(d):
            if s.generation == newest:
                with open(d, "r+b") as f:
                    f.seek(s.offset + bwforge.MAC_AT)
                    b = f.read(1)
                    f.seek(s.offset + bwforge.MAC_AT)
                    f.write(bytes([b[0] ^ 0xFF]))
                damaged += 1
    assert damaged >= 2, "no newest label slot found to damage"

    r = p.bulwark("serve", p.dir, check=False, timeout=60)
    assert r.returncode != 0, f"a pool whose newest labels were damaged was served:\n{r.stderr}"
    err = [l for l in stderr_lines(r) if l.startswith("error:")]
    assert len(err) == 1, r.stderr
    gens = {int(g) for g in re.findall(r"generation (\d+)", err[0])}
    assert newest in gens and newest - 1 in gens, err[0]
    assert f"{damaged} label slot(s) of this pool fail authentication" in err[0], err[0]
    assert "which is not a rollback" in err[0], err[0]
    assert "--accept-rollback" in err[0] and "drop every commit" in err[0], err[0]
