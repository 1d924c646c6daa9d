"""Raw images go into a volume and come back out byte for byte, with
qemu-img convert and with nbdcopy, and a sparse copy stays sparse: ranges
never written are reported as holes by NBD block status (nbdinfo --map)."""

import json
import os
import random

from conftest import MiB, require_tools, run

SIZE = 48 * MiB
TAIL = 100_001  # a data region of a non-block-multiple length, ending at the end

# (offset, length) of random data; everything else is a hole in the image.
DATA = [
    (0, 8 * MiB),
    (16 * MiB, 4097),
    (20 * MiB + 5, 777_777),
    (32 * MiB, 8 * MiB),
    (SIZE - TAIL, TAIL),
]
# Ranges that no data region touches, even rounded out to 1 MiB blocks.
NEVER_WRITTEN = [
    (8 * MiB, 8 * MiB),
    (22 * MiB, 10 * MiB),
    (40 * MiB, 7 * MiB),
]


def make_image(path, seed):
    rng = random.Random(seed)
    with open(path, "wb") as f:
        f.truncate(SIZE)  # sparse: the gaps are holes
        for off, length in DATA:
            f.seek(off)
            f.write(rng.randbytes(length))


def extents(uri):
    r = run(["nbdinfo", "--map", "--json", uri])
    return json.loads(r.stdout)


def check_map(uri, what):
    ext = extents(uri)
    assert ext, f"nbdinfo --map gave nothing for {what}"
    assert sum(e["length"] for e in ext) == SIZE, f"{what}: map does not cover the volume: {ext}"
    for off, length in NEVER_WRITTEN:
        for e in ext:
            lo, hi = max(off, e["offset"]), min(off + length, e["offset"] + e["length"])
            if lo < hi:
                assert e["type"] & 1, (f"{what}: never-written range {lo}..{hi} is not a hole "
                                       f"(extent {e}); full map: {ext}")
    for off, length in DATA:
        for e in ext:
            lo, hi = max(off, e["offset"]), min(off + length, e["offset"] + e["length"])
            if lo < hi:
                assert not e["type"] & 2, f"{what}: data at {lo}..{hi} reported as zero (extent {e})"


def test_image_convert(pool, tmp_path, seed):
    require_tools("qemu-img", "nbdcopy", "nbdinfo", "cmp")
    src = tmp_path / "src.img"
    make_image(src, seed)
    assert os.stat(src).st_blocks * 512 < SIZE, "test image is not sparse"

    # qemu-img convert in and out.
    pool.create_volume("img1", size="48M")
    uri1 = pool.uri("img1")
    run(["qemu-img", "convert", "-n", "--target-is-zero", "-f", "raw", "-O", "raw", src, uri1])
    out1 = tmp_path / "out1.img"
    run(["qemu-img", "convert", "-f", "raw", "-O", "raw", uri1, out1])
    run(["cmp", src, out1])
    check_map(uri1, "volume written by qemu-img convert")

    # nbdcopy in and out.
    pool.create_volume("img2", size="48M")
    uri2 = pool.uri("img2")
    run(["nbdcopy", "--destination-is-zero", "--flush", src, uri2])
    out2 = tmp_path / "out2.img"
    run(["nbdcopy", uri2, out2])
    run(["cmp", src, out2])
    check_map(uri2, "volume written by nbdcopy")
