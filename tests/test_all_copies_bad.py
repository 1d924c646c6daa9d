"""The same blocks damaged on every copy (every shard, for parity): reads of
exactly those blocks fail with EIO, never return wrong bytes; `status` names
the volume and byte range of each; `scrub --wait` exits 1 listing them; every
other block, in this volume and another, reads back exactly.

A map leaf damaged on every copy: the 64 blocks under it fail with EIO, and
`status` lists their range (kind map) as soon as the pool is imported (the
import's walk meets the leaf), not only after a scrub; before, it said "No
known data errors" while every read of the range failed.
"""

import errno
import random

import pytest

import sys

from conftest import HELPERS, LONG_TEST_TIMEOUT_S, MiB, qemu_io, qemu_io_ok, require_tools, run
from healing import (BLOCK, LAYOUTS, assert_export_equals, check_export, flip, heal_pool,
                     locate_blocks, new_token, pattern_image, scrub_wait, write_file)

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)  # waits of up to 300 s each

NBLOCKS = 1024
VICTIMS = 5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_copies_bad(make_pool, tmp_path, seed, layout):
    require_tools("nbdcopy", "qemu-io")
    rng = random.Random(seed)
    pool = heal_pool(make_pool, layout, faults=False)
    token = new_token(rng)
    key = pool.create_volume("enc", size="8M")
    pool.create_volume("plain", size="4M", encryption=False, compression="off")
    plain = write_file(tmp_path / "plain.img", pattern_image(token, NBLOCKS))
    enc = write_file(tmp_path / "enc.img", rng.randbytes(8 * MiB))
    run(["nbdcopy", "--flush", plain, pool.uri("plain")])
    run(["nbdcopy", "--flush", enc, pool.uri("enc")])
    devices = pool.device_paths()
    pool.stop()

    victims = sorted(rng.sample(range(NBLOCKS), VICTIMS))
    where = locate_blocks(layout, devices, token, victims)
    shard = layout.shard_bytes(BLOCK)
    for i in victims:
        assert len(where[i]) == 1, f"block {i} found at {where[i]}, expected one place"
        for d in devices:
            flip(d, [where[i][0] + rng.randrange(shard)])
    print(f"damaged every copy of plain blocks {victims}")

    pool.start()
    pool.load_key("enc", key)
    res = check_export(pool, "plain", plain, BLOCK)
    assert not res["mismatch"], f"wrong bytes returned at {res['mismatch']}"
    failed = sorted(off // BLOCK for off, _, _ in res["error"])
    assert failed == victims, f"reads failed at blocks {failed}, damaged {victims}: {res}"
    assert all(e in ("EIO", errno.EIO) for _, e, _ in res["error"]), res["error"]
    assert_export_equals(pool, "enc", enc, "the other volume")

    r = qemu_io(pool.uri("plain"), f"read {victims[0] * BLOCK} 4k")
    assert r.returncode != 0 and "Input/output error" in r.stdout + r.stderr, r.stdout + r.stderr

    expected = [{"volume": "plain", "offset": i * BLOCK, "length": BLOCK, "kind": "data"}
                for i in victims]
    errors = [{k: e[k] for k in ("volume", "offset", "length", "kind")} for e in pool.status()["errors"]]
    assert sorted(errors, key=lambda e: e["offset"]) == expected, errors
    # The text shows blocks next to each other as one range.
    runs = []
    for i in victims:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    text = pool.cli("status").stdout
    for first, end in runs:
        assert f"\tplain: bytes {first * BLOCK}-{end * BLOCK - 1} (data)\n" in text, text

    r, s = scrub_wait(pool, expect_rc=1)
    assert s["unrecoverable"] == VICTIMS and s["repaired"] == 0, s
    for first, end in runs:
        assert f"plain: bytes {first * BLOCK}-{end * BLOCK - 1} (data)" in r.stdout, r.stdout
    assert "no good copy" in r.stderr, r.stderr
    errors = [{k: e[k] for k in ("volume", "offset", "length", "kind")} for e in pool.status()["errors"]]
    assert sorted(errors, key=lambda e: e["offset"]) == expected, errors

    # A client that writes a lost block whole gives it good contents again: it
    # reads back, and it is no longer listed (before, it stayed until the next scrub).
    fixed = victims[0]
    r = qemu_io(pool.uri("plain"), f"write -P 0x6b {fixed * BLOCK} 4k", f"read -P 0x6b {fixed * BLOCK} 4k")
    assert r.returncode == 0 and "Input/output error" not in r.stdout + r.stderr, r.stdout + r.stderr
    errors = [{k: e[k] for k in ("volume", "offset", "length", "kind")} for e in pool.status()["errors"]]
    assert sorted(errors, key=lambda e: e["offset"]) == expected[1:], errors


@pytest.mark.parametrize("layout", ["single", "mirror:2"])
def test_map_leaf_lost_is_listed_at_import(make_pool, tmp_path, seed, layout):
    pytest.importorskip("cryptography", reason="bwforge opens the volume table with AES-GCM")
    sys.path.insert(0, str(HELPERS))
    import bwforge
    require_tools("nbdcopy", "qemu-io")
    rng = random.Random(seed)
    pool = make_pool(layout=layout, devices=2 if layout == "mirror:2" else 1,
                     device_size="64M").create().start()
    pool.create_volume("plain", size="16M", encryption=False, compression="off")
    img = write_file(tmp_path / "plain.img", rng.randbytes(16 * MiB))
    run(["nbdcopy", "--flush", img, pool.uri("plain")])
    pool.stop()

    # 4096 blocks: a root over 64 leaves of 64 blocks (256 KiB) each. Leaf 3 goes, on
    # every copy.
    f = bwforge.Image.of_pool_dir(pool.dir)
    root = bwforge.Pointer(bytes.fromhex(f.volume(f.read_table(), "plain")["root"]))
    level, _, leaves = f.read_node(root)
    assert level == 1, level
    leaf = leaves[3]
    for a in (leaf.addr1, leaf.addr2):
        if a != bwforge.NONE:
            f.write_at(a, rng.randbytes(leaf.length))

    pool.start()
    lost = (3 * 256 * 1024, 256 * 1024)
    errors = [{k: e[k] for k in ("volume", "offset", "length", "kind")} for e in pool.status()["errors"]]
    assert errors == [{"volume": "plain", "offset": lost[0], "length": lost[1], "kind": "map"}], errors
    text = pool.cli("status").stdout
    assert f"\tplain: bytes {lost[0]}-{sum(lost) - 1} (map)\n" in text, text
    r = qemu_io(pool.uri("plain"), f"read {lost[0] + 4096} 4k")
    assert r.returncode != 0 and "Input/output error" in r.stdout + r.stderr, r.stdout + r.stderr
    res = check_export(pool, "plain", img, 256 * 1024)
    assert not res["mismatch"], f"wrong bytes returned at {res['mismatch']}"
    assert [off for off, _, _ in res["error"]] == [lost[0]], res["error"]
    # A scrub goes past the lost leaf (it steps over holes, not over this), lists its
    # range, and finishes.
    r, st = scrub_wait(pool, expect_rc=1)
    assert st["state"] == "finished" and st["unrecoverable"] >= 1, st
    assert f"plain: bytes {lost[0]}-{sum(lost) - 1} (map)" in r.stdout, r.stdout


def test_scrub_goes_past_a_lost_node_at_a_batch_start(make_pool, tmp_path):
    """A level-1 map node (4096 blocks, one scrub batch) lost on every copy, at the start
    of a batch: the scrub, which steps over holes before each batch, lists its range and
    goes on to the next, instead of failing there."""
    pytest.importorskip("cryptography", reason="bwforge opens the volume table with AES-GCM")
    sys.path.insert(0, str(HELPERS))
    import bwforge
    require_tools("qemu-io")
    pool = make_pool(layout="mirror:2", devices=2, device_size="64M").create().start()
    pool.create_volume("p", size="64M", encryption=False)
    qemu_io_ok(pool.uri("p"), "write -P 0x1 0 1M", "write -P 0x2 16M 1M", "write -P 0x3 32M 1M",
               "flush")
    pool.stop()
    f = bwforge.Image.of_pool_dir(pool.dir)
    root = bwforge.Pointer(bytes.fromhex(f.volume(f.read_table(), "p")["root"]))
    level, _, nodes = f.read_node(root)
    assert level == 2, level
    lost = nodes[1]  # blocks 4096..8191: bytes 16M..32M
    for a in (lost.addr1, lost.addr2):
        if a != bwforge.NONE:
            f.write_at(a, bytes(lost.length))
    pool.start()
    r, st = scrub_wait(pool, expect_rc=1)
    assert st["state"] == "finished", st
    assert f"p: bytes {16 * MiB}-{32 * MiB - 1} (map)" in r.stdout, r.stdout
    qemu_io_ok(pool.uri("p"), "read -P 0x1 0 1M", "read -P 0x3 32M 1M")
