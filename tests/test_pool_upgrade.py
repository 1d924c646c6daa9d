"""Format 1 pools and `bulwark pool upgrade` (decision 0011).

`BULWARK_CREATE_FORMAT=1 bulwark pool create` (for tests only) makes a format 1 pool:
labels with an unkeyed blake3, no DIR/pool.key. This bulwark does not serve it
(its labels and metadata are not authenticated) and says to upgrade it; `pool upgrade`
(not while served) makes DIR/pool.key and writes format 2 labels on every device; the
pool is then served as any other. The labels are checked with tests/helpers/bwforge.py,
which reads them from docs/format.md.

A format 1 pool cannot be served by this binary, so nothing can be written into one
with it: the data-before-upgrade case uses the nearest thing, a format 2 pool holding
data whose labels are rewritten as format 1 (version 1, unkeyed blake3, no key check)
with its pool.key and anchor removed, as a format 1 pool's directory has neither key
nor (when made before anchors) anchor.
"""

from __future__ import annotations

import os
import stat
import sys

import pytest

from conftest import HELPERS, qemu_io_ok, require_tools

sys.path.insert(0, str(HELPERS))
import bwforge  # noqa: E402

LAYOUTS = [pytest.param("single", id="single"), pytest.param("mirror:2", id="mirror2")]


def error_lines(r) -> list[str]:
    return [l for l in r.stderr.splitlines() if l.startswith("error:")]


def all_slots(p):
    return [(d, s) for d in p.device_paths() for s in bwforge.read_slots(d)]


def assert_format_2(p, what):
    key = (p.dir / "pool.key").read_bytes()
    slots = all_slots(p)
    assert len(slots) == 4 * len(p.device_paths()), f"{what}: {len(slots)} slots"
    for d, s in slots:
        assert s.version == 2, f"{what}: {d}@{s.offset} is version {s.version}"
        assert s.key_check_ok(key), f"{what}: {d}@{s.offset}: key check fails under pool.key"
        assert s.mac_ok(key), f"{what}: {d}@{s.offset}: MAC fails under pool.key"
        assert not s.checksum_ok_v1(), f"{what}: {d}@{s.offset} still carries an unkeyed checksum"


def serve_refused_format_1(p):
    r = p.bulwark("serve", p.dir, check=False, timeout=60)
    assert r.returncode != 0, f"a format 1 pool was served:\n{r.stdout}{r.stderr}"
    errs = error_lines(r)
    assert len(errs) == 1, r.stderr
    assert "format 1" in errs[0] and "pool upgrade" in errs[0], errs[0]


def upgrade(p):
    r = p.bulwark("pool", "upgrade", p.dir, check=False, timeout=120)
    assert r.returncode == 0, f"pool upgrade failed:\n{r.stdout}{r.stderr}"
    assert "format 2" in r.stdout, r.stdout
    k = p.dir / "pool.key"
    assert k.exists(), "pool upgrade made no pool.key"
    assert len(k.read_bytes()) == 32, "pool.key is not 32 bytes"
    assert stat.S_IMODE(k.stat().st_mode) == 0o600, oct(k.stat().st_mode)
    return r


@pytest.mark.parametrize("layout", LAYOUTS)
def test_format_1_pool_is_refused_then_upgraded(make_pool, layout, monkeypatch):
    require_tools("qemu-io")
    p = make_pool(layout=layout, devices=2 if layout == "mirror:2" else 1, device_size="64M")
    monkeypatch.setenv("BULWARK_CREATE_FORMAT", "1")
    p.create()
    monkeypatch.delenv("BULWARK_CREATE_FORMAT")
    assert not (p.dir / "pool.key").exists(), "a format 1 pool has a pool.key"
    p._device_paths = bwforge.pool_devices(p.dir)
    slots = all_slots(p)
    assert slots and all(s.version == 1 and s.checksum_ok_v1() for _, s in slots), \
        [(d, s.offset, s.version) for d, s in slots]
    pool_id = slots[0][1].pool_id
    gen_before = max(s.generation for _, s in slots)

    serve_refused_format_1(p)
    upgrade(p)
    assert_format_2(p, "after the upgrade")
    slots = all_slots(p)
    assert {s.pool_id for _, s in slots} == {pool_id}, "the upgrade changed the pool id"
    assert max(s.generation for _, s in slots) > gen_before

    p.start()
    key = p.create_volume("enc", size="16M")
    p.create_volume("pl", size="16M", encryption=False)
    qemu_io_ok(p.uri("enc"), "write -P 0x1e 0 1M", "flush")
    qemu_io_ok(p.uri("pl"), "write -P 0x1f 64k 1M", "flush")
    # Refused while served.
    r = p.bulwark("pool", "upgrade", p.dir, check=False)
    assert r.returncode != 0, f"pool upgrade ran on a served pool:\n{r.stdout}{r.stderr}"
    p.restart()
    p.load_key("enc", key)
    qemu_io_ok(p.uri("enc"), "read -P 0x1e 0 1M")
    qemu_io_ok(p.uri("pl"), "read -P 0x1f 64k 1M", "read -P 0 0 64k")
    p.stop()

    r = p.bulwark("pool", "upgrade", p.dir, check=False)
    assert r.returncode != 0, f"a second upgrade succeeded:\n{r.stdout}{r.stderr}"
    errs = error_lines(r)
    assert len(errs) == 1 and "already format 2" in errs[0], r.stderr
    assert_format_2(p, "after a second upgrade")
    p.start()
    p.load_key("enc", key)
    qemu_io_ok(p.uri("enc"), "read -P 0x1e 0 1M")


def test_data_written_before_the_upgrade_reads_after_it(make_pool, tmp_path):
    """A pool holding an encrypted and a plain volume, its labels rewritten as format 1
    and its pool.key and anchor removed (what a format 1 pool directory looks like):
    refused as format 1; upgraded; served with the data intact, under a new pool.key."""
    require_tools("qemu-io")
    p = make_pool(layout="mirror:2", devices=2, device_size="64M").create().start()
    key = p.create_volume("enc", size="16M")
    p.create_volume("pl", size="16M", encryption=False)
    qemu_io_ok(p.uri("enc"), "write -P 0x2e 0 512k", "flush")
    qemu_io_ok(p.uri("pl"), "write -P 0x2f 0 512k", "flush")
    p.stop()
    old_key = (p.dir / "pool.key").read_bytes()

    def to_format_1(sb):
        sb.set("version", 1)
        sb.raw[bwforge.KEYCHECK_AT:bwforge.KEYCHECK_AT + 32] = bytes(32)

    bwforge.reseal_all_slots(p.device_paths(), to_format_1)  # unkeyed blake3 at 4064
    assert all(s.version == 1 and s.checksum_ok_v1() for _, s in all_slots(p))
    os.unlink(p.dir / "pool.key")
    os.unlink(p.dir / "pool.anchor")
    serve_refused_format_1(p)
    upgrade(p)
    assert (p.dir / "pool.key").read_bytes() != old_key, "the upgrade reused an old key"
    assert_format_2(p, "after the upgrade")
    p.start()
    p.load_key("enc", key)
    qemu_io_ok(p.uri("enc"), "read -P 0x2e 0 512k")
    qemu_io_ok(p.uri("pl"), "read -P 0x2f 0 512k")
