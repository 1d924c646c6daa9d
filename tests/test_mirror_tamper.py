"""Bytes flipped on one device of a mirror are detected by checksum and
repaired from the other copy without the client noticing; bytes flipped in
both copies make exactly the affected reads fail with EIO, and no read ever
returns bytes that were not written."""

import errno
import json
import os
import random

import pytest

from conftest import KiB, LONG_TEST_TIMEOUT_S, MiB, qemu_io, require_tools, run, run_helper

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)  # waits of up to 300 s each

EDGE = 1 * MiB        # labels and superblocks may live here: never touched
CHUNK = 64 * KiB
BLOCK = 4 * KiB
ENC_SIZE = 32 * MiB
PLAIN_SIZE = 8 * MiB


def data_extents(path):
    """(start, end) ranges of a sparse file that hold data, clipped to the middle."""
    size = os.path.getsize(path)
    lo_lim, hi_lim = EDGE, size - EDGE
    out = []
    with open(path, "rb") as f:
        fd = f.fileno()
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:
                    break
                raise
            end = os.lseek(fd, start, os.SEEK_HOLE)
            s, e2 = max(start, lo_lim), min(end, hi_lim)
            if s < e2:
                out.append((s, e2))
            pos = end
    return out


def nonzero_units(path, unit):
    """Offsets of unit-aligned units, wholly inside the middle of a device
    file, that are not all zero."""
    size = os.path.getsize(path)
    offs = []
    with open(path, "rb") as f:
        for s, e in data_extents(path):
            off = max(s - s % unit, (EDGE + unit - 1) // unit * unit)
            while off < e and off + unit <= size - EDGE:
                if not offs or off > offs[-1]:
                    f.seek(off)
                    if f.read(unit).count(0) != unit:
                        offs.append(off)
                off += unit
    return offs


def flip(path, offsets):
    with open(path, "r+b") as f:
        for off in offsets:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


def load_data(path):
    """[(start, bytes)] of the data extents in the middle of a device file."""
    out = []
    with open(path, "rb") as f:
        for s, e in data_extents(path):
            f.seek(s)
            out.append((s, f.read(e - s)))
    return out


def find_all(data, needle):
    """Offsets of needle in data loaded by load_data()."""
    found = []
    for s, buf in data:
        i = buf.find(needle)
        while i != -1:
            found.append(s + i)
            i = buf.find(needle, i + 1)
    return found


def check_volume(uri, expected, chunk):
    r = run_helper("nbd_check.py", uri, expected, str(chunk), timeout=300)
    return json.loads(r.stdout)


def plain_block(token, i):
    unit = b"BWTAMPER:%s:%06d|" % (token, i)
    return (unit * (BLOCK // len(unit) + 1))[:BLOCK]


def device_status(st, path):
    for d in st["devices"]:
        if d["path"] == path:
            return d
    raise AssertionError(f"device {path} not in status: {st['devices']}")


def test_mirror_tamper(mirror_pool, tmp_path, seed):
    require_tools("nbdcopy", "qemu-io")
    pool = mirror_pool
    rng = random.Random(seed)
    token = b"%016x" % rng.getrandbits(64)

    key = pool.create_volume("enc", size="32M")
    pool.create_volume("plain", size="8M", encryption=False, compression="off", block_size="4K")
    enc_img, plain_img = tmp_path / "enc.img", tmp_path / "plain.img"
    enc_img.write_bytes(rng.randbytes(ENC_SIZE))
    plain_img.write_bytes(b"".join(plain_block(token, i) for i in range(PLAIN_SIZE // BLOCK)))
    run(["nbdcopy", "--flush", enc_img, pool.uri("enc")])
    run(["nbdcopy", "--flush", plain_img, pool.uri("plain")])

    devices = pool.device_paths()
    assert len(devices) == 2, devices
    dev0, dev1 = devices
    pool.stop()

    # Phase 1: one flipped byte in every non-zero 64 KiB of device 0's middle.
    units = nonzero_units(dev0, CHUNK)
    assert len(units) * CHUNK >= ENC_SIZE, f"only {len(units)} non-zero 64 KiB units on {dev0}"
    flips = [u + rng.randrange(CHUNK) for u in units]
    flip(dev0, flips)
    print(f"phase 1: flipped {len(flips)} bytes on {dev0}")

    pool.start()
    pool.load_key("enc", key)
    res = check_volume(pool.uri("enc"), enc_img, CHUNK)
    assert res["ok"] == res["chunks"], f"encrypted volume after one-sided damage: {res}"
    res = check_volume(pool.uri("plain"), plain_img, BLOCK)
    assert res["ok"] == res["chunks"], f"plain volume after one-sided damage: {res}"
    st = pool.status()
    d0, d1 = device_status(st, dev0), device_status(st, dev1)
    assert d0["cksum_errors"] > 0, f"no checksum errors counted on the damaged device: {d0}"
    assert d1["cksum_errors"] == 0, f"checksum errors counted on the intact device: {d1}"
    assert st["repaired_blocks"] > 0, f"nothing reported repaired: {st}"
    assert st["unrecoverable_blocks"] == 0, f"unrecoverable blocks with one good copy: {st}"
    pool.stop()

    # Phase 2: the same damage on both copies of some blocks. Only blocks
    # whose copies are both intact qualify: a copy that phase 1 damaged and no
    # read has touched since (reads may be served by the other device) is
    # still damaged.
    data = {dev: load_data(dev) for dev in (dev0, dev1)}
    victims, places = [], {}
    for i in rng.sample(range(PLAIN_SIZE // BLOCK), PLAIN_SIZE // BLOCK):
        needle = plain_block(token, i)
        offs = {dev: find_all(data[dev], needle) for dev in (dev0, dev1)}
        if offs[dev1] and not offs[dev0]:
            continue  # damaged by phase 1 and not repaired
        assert offs[dev1], f"plain block {i} not found intact on {dev1}, which was never damaged"
        victims.append(i)
        places[i] = offs
        if len(victims) == 5:
            break
    assert len(victims) == 5, f"only {len(victims)} plain blocks are intact on both devices"
    victims.sort()
    del data
    for i in victims:
        for dev, offs in places[i].items():
            flip(dev, [o + 100 for o in offs])
    # Encrypted blocks: 4 KiB units stored identically at the same place on
    # both devices (the two copies of a mirrored block).
    same = []
    with open(dev0, "rb") as f0, open(dev1, "rb") as f1:
        for off in nonzero_units(dev0, BLOCK):
            f0.seek(off)
            f1.seek(off)
            a, b = f0.read(BLOCK), f1.read(BLOCK)
            if a == b and token not in a:
                same.append(off)
    assert same, "no 4 KiB block is stored identically at the same offset on both devices"
    enc_victims = sorted(rng.sample(same, min(8, len(same))))
    # The same byte on both devices: a 4 KiB unit straddles two stored
    # blocks (4 KiB + tag each), and a flip in each of the two would leave
    # each block one good copy.
    enc_flips = [o + rng.randrange(BLOCK) for o in enc_victims]
    for dev in (dev0, dev1):
        flip(dev, enc_flips)
    print(f"phase 2: plain blocks {victims}; encrypted-area offsets {enc_victims}")

    pool.start()
    pool.load_key("enc", key)

    res = check_volume(pool.uri("plain"), plain_img, BLOCK)
    assert not res["mismatch"], f"plain volume returned wrong bytes at {res['mismatch']}"
    failed = sorted(off // BLOCK for off, _, _ in res["error"])
    assert failed == victims, f"plain volume: reads failed at blocks {failed}, damaged {victims}: {res}"
    assert all(e in ("EIO", errno.EIO) for _, e, _ in res["error"]), f"errors other than EIO: {res['error']}"

    res = check_volume(pool.uri("enc"), enc_img, CHUNK)
    assert not res["mismatch"], f"encrypted volume returned wrong bytes at {res['mismatch']}"
    assert res["error"], "no read failed although both copies of some blocks were damaged"
    assert all(e in ("EIO", errno.EIO) for _, e, _ in res["error"]), f"errors other than EIO: {res['error']}"
    print(f"encrypted volume: {len(res['error'])} of {res['chunks']} chunks failed, the rest exact")

    # What a user sees: qemu-io and nbdcopy fail on the damaged range.
    r = qemu_io(pool.uri("plain"), f"read {victims[0] * BLOCK} 4k")
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Input/output error" in out, f"qemu-io read of damaged block:\n{out}"
    r = run(["nbdcopy", pool.uri("plain"), tmp_path / "plain.out"], check=False)
    assert r.returncode != 0, "nbdcopy copied a volume with unrecoverable blocks without an error"

    st = pool.status()
    assert st["unrecoverable_blocks"] > 0, f"unrecoverable blocks not reported: {st}"
