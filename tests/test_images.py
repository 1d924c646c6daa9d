"""`bulwark image import|export|list`: raw and qcow2 images go into a volume
(snapshotted as NAME@image, its sha256 recorded) and come back out byte for
byte, holes kept as holes on the way in (NBD block status of the volume) and
on the way out (allocated size of a sparse raw file, unallocated qcow2
clusters). Importing under a name in use is refused and leaves that volume
alone; an import that fails leaves no volume, snapshot or record behind."""

import hashlib
import json
import os
import random
import re
import struct

from conftest import MiB, make_key_file, require_tools, run, stderr_lines

SIZE = 64 * MiB

# (offset, length) of random data; everything else is a hole in the image.
DATA = [
    (0, 2 * MiB),
    (10 * MiB + 4096, 3 * MiB),
    (33 * MiB + 12345, 777_777),
    (SIZE - 1 * MiB, 1 * MiB),
]
DATA_BYTES = sum(length for _, length in DATA)
# Ranges no data region touches, even rounded out to 1 MiB (qcow2 clusters are 64 KiB).
NEVER_WRITTEN = [
    (3 * MiB, 7 * MiB),
    (15 * MiB, 18 * MiB),
    (35 * MiB, 27 * MiB),
]

NOISE = ("panicked", "Traceback", "stack backtrace", "RUST_BACKTRACE", "Usage:")
SHA_LINE = re.compile(r"^imported (\S+) as (\S+)@image: (\S+), sha256 ([0-9a-f]{64})$")


def make_raw(path, seed, size=SIZE, data=DATA):
    rng = random.Random(seed)
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: the gaps are holes
        for off, length in data:
            f.seek(off)
            f.write(rng.randbytes(length))
    assert os.stat(path).st_blocks * 512 < size, "test image is not sparse"
    return path


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def allocated(path):
    """Bytes the file takes on disk (du --block-size=1)."""
    return int(run(["du", "--block-size=1", path]).stdout.split()[0])


def overlaps(a_off, a_len, b_off, b_len):
    return max(a_off, b_off) < min(a_off + a_len, b_off + b_len)


def import_image(pool, src, name, *opts):
    """`image import`, checked: returns the sha256 it printed."""
    if not any(o in opts for o in ("--key-file", "--passphrase-file", "--encryption")):
        opts = (*opts, "--key-file", make_key_file(pool.keys_dir / f"{name}.key"))
    r = pool.cli("image", "import", src, name, *opts)
    lines = r.stdout.strip().splitlines()
    assert lines, f"image import printed nothing:\n{r.stderr}"
    m = SHA_LINE.match(lines[-1])
    assert m and m.group(2) == name, f"unexpected last line: {lines[-1]!r}"
    return m.group(4)


def assert_volume_holes(pool, export, what):
    """The volume holds the data regions only: NBD block status reports every
    never-written range as a hole."""
    ext = json.loads(run(["nbdinfo", "--map", "--json", pool.uri(export)]).stdout)
    assert sum(e["length"] for e in ext) >= SIZE, f"{what}: map does not cover the image: {ext}"
    for off, length in NEVER_WRITTEN:
        for e in ext:
            if overlaps(off, length, e["offset"], e["length"]):
                assert e["type"] & 1, f"{what}: never-written {off}+{length} is allocated: {e}\n{ext}"
    for off, length in DATA:
        for e in ext:
            if overlaps(off, length, e["offset"], e["length"]):
                assert not e["type"] & 2, f"{what}: data at {off}+{length} reads as zeros: {e}"


def assert_one_line_error(r, what, mentions):
    lines = stderr_lines(r)
    assert r.returncode != 0, f"{what}: exit 0\nstdout:{r.stdout}\nstderr:{r.stderr}"
    for n in NOISE:
        assert n not in r.stderr + r.stdout, f"{what}: {n!r} in output:\n{r.stderr}"
    assert len(lines) == 1, f"{what}: expected one line on stderr, got {len(lines)}:\n{r.stderr}"
    assert re.search(mentions, lines[0], re.I), f"{what}: {lines[0]!r} does not mention /{mentions}/"


def volume_names(pool):
    return {v["name"] for v in json.loads(pool.cli("volume", "list", "--json").stdout)}


def snapshot_names(pool):
    return {s["name"] for s in json.loads(pool.cli("snapshot", "list", "--json").stdout)}


def assert_nothing_left(pool, name, what):
    assert name not in volume_names(pool), f"{what}: volume {name} left behind"
    assert f"{name}@image" not in snapshot_names(pool), f"{what}: snapshot {name}@image left behind"
    assert not (pool.dir / "images" / f"{name}.json").exists(), f"{what}: record left behind"


def test_raw_round_trip(pool, tmp_path, seed):
    """(a) A sparse raw image in, out as sparse raw: same sha256, holes kept."""
    require_tools("qemu-img", "nbdcopy", "nbdinfo", "du")
    src = make_raw(tmp_path / "src.img", seed)
    want = sha256_file(src)

    sha = import_image(pool, src, "vm1")
    assert sha == want, "the recorded sha256 is not the image's"
    v = pool.volume_status("vm1")
    assert v["size_bytes"] == SIZE and v["encryption"] is True
    assert v["used_bytes"] <= DATA_BYTES + 1 * MiB, f"the holes took space: {v}"
    assert "vm1@image" in snapshot_names(pool)
    assert_volume_holes(pool, "vm1@image", "imported raw image")
    assert_volume_holes(pool, "vm1", "imported raw image (the volume)")

    out = tmp_path / "out.img"
    r = pool.cli("image", "export", "vm1@image", out)
    assert "exported vm1@image" in r.stdout
    assert os.path.getsize(out) == SIZE
    assert sha256_file(out) == want, "exported raw image differs from the source"
    used = allocated(out)
    assert DATA_BYTES <= used <= DATA_BYTES + 2 * MiB, \
        f"exported raw image allocates {used} bytes for {DATA_BYTES} bytes of data (size {SIZE})"
    assert os.stat(out).st_mode & 0o777 == 0o600, "the export holds data in the clear: mode 0600"

    # The live volume exports the same way; an existing file is not overwritten without --force.
    r = pool.cli("image", "export", "vm1", out, check=False)
    assert_one_line_error(r, "export over an existing file", r"exists.*--force")
    pool.cli("image", "export", "vm1", out, "--force")
    assert sha256_file(out) == want


def test_qcow2_round_trip(pool, tmp_path, seed):
    """(b) The same through qcow2: the format is detected, the round trip keeps
    the sha256, and the exported qcow2 leaves the holes unallocated."""
    require_tools("qemu-img", "nbdcopy", "nbdinfo")
    raw = make_raw(tmp_path / "src.img", seed)
    want = sha256_file(raw)
    src = tmp_path / "src.qcow2"
    run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, src])

    sha = import_image(pool, src, "vm2")  # format detected
    assert sha == want
    assert_volume_holes(pool, "vm2@image", "imported qcow2 image")
    record = json.loads((pool.dir / "images" / "vm2.json").read_text())
    assert record["format"] == "qcow2" and record["virtual_size"] == SIZE
    assert record["source"] == str(src.resolve())

    out = tmp_path / "out.qcow2"
    pool.cli("image", "export", "vm2@image", out, "--format", "qcow2")
    info = json.loads(run(["qemu-img", "info", "--output=json", out]).stdout)
    assert info["format"] == "qcow2" and info["virtual-size"] == SIZE
    back = tmp_path / "back.img"
    run(["qemu-img", "convert", "-f", "qcow2", "-O", "raw", out, back])
    assert sha256_file(back) == want, "qcow2 round trip changed the data"
    extents = json.loads(run(["qemu-img", "map", "--output=json", out]).stdout)
    for off, length in NEVER_WRITTEN:
        for e in extents:
            if overlaps(off, length, e["start"], e["length"]):
                assert not e["data"], f"exported qcow2 allocates never-written {off}+{length}: {e}"
    data = sum(e["length"] for e in extents if e["data"])
    assert data <= DATA_BYTES + 2 * MiB, f"exported qcow2 allocates {data} bytes: {extents}"

    # --format qcow2 given, a plain volume, another block size.
    sha = import_image(pool, src, "vm2b", "--format", "qcow2", "--encryption", "off",
                       "--block-size", "64K", "--compression", "off")
    assert sha == want
    v = pool.volume_status("vm2b")
    assert (v["encryption"], v["block_size"]) == (False, 65536)


def make_damaged_compressed_qcow2(tmp_path):
    """A qcow2 whose metadata is sound (qemu-img check passes) but whose first
    compressed cluster is garbage: qemu-img convert fails partway, after the
    volume was created."""
    raw = tmp_path / "text.img"
    with open(raw, "wb") as f:
        f.truncate(8 * MiB)
        f.write((b"bulwark image test " * 60000)[:1 * MiB])
    bad = tmp_path / "bad.qcow2"
    run(["qemu-img", "convert", "-c", "-f", "raw", "-O", "qcow2", raw, bad])
    with open(bad, "r+b") as f:
        header = f.read(72)
        cluster_bits = struct.unpack(">I", header[20:24])[0]
        l1 = struct.unpack(">Q", header[40:48])[0]
        f.seek(l1)
        l2 = struct.unpack(">Q", f.read(8))[0] & 0x00FF_FFFF_FFFF_FE00
        f.seek(l2)
        entry = struct.unpack(">Q", f.read(8))[0]
        assert entry >> 62 & 1, f"first cluster is not compressed: {entry:#x}"
        offset = entry & ((1 << (62 - (cluster_bits - 8))) - 1)
        f.seek(offset)
        f.write(b"\xff" * 64)
    run(["qemu-img", "check", bad])  # the damage is where check does not look
    return bad


def test_import_refusals_leave_nothing(pool, tmp_path, seed):
    """(c) A name in use is refused and its volume left as it was; an image
    that is damaged, of another format, or fails partway leaves nothing."""
    require_tools("qemu-img", "nbdcopy")
    src = make_raw(tmp_path / "src.img", seed)
    want = sha256_file(src)
    import_image(pool, src, "vm3")
    record = (pool.dir / "images" / "vm3.json").read_text()

    # An existing name: refused before anything is touched.
    other = make_raw(tmp_path / "other.img", seed + 1)
    r = pool.cli("image", "import", other, "vm3", "--encryption", "off", check=False)
    assert_one_line_error(r, "import under an existing name", r"vm3.*exists")
    assert "vm3" in volume_names(pool) and "vm3@image" in snapshot_names(pool)
    assert (pool.dir / "images" / "vm3.json").read_text() == record
    out = tmp_path / "vm3.img"
    pool.cli("image", "export", "vm3", out)
    assert sha256_file(out) == want, "the existing volume changed"

    # A truncated qcow2: qemu-img check finds it damaged, no volume is made.
    good = tmp_path / "good.qcow2"
    run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", src, good])
    truncated = tmp_path / "truncated.qcow2"
    truncated.write_bytes(good.read_bytes()[:300_000])
    r = pool.cli("image", "import", truncated, "bad1", "--encryption", "off", check=False)
    assert_one_line_error(r, "truncated qcow2", r"damaged qcow2")
    assert_nothing_left(pool, "bad1", "truncated qcow2")

    # Damage the copy finds partway: the volume made for it is destroyed again.
    bad = make_damaged_compressed_qcow2(tmp_path)
    r = pool.cli("image", "import", bad, "bad2", "--encryption", "off", check=False)
    assert_one_line_error(r, "qcow2 failing in the copy", r"failed.*volume bad2 destroyed")
    assert_nothing_left(pool, "bad2", "qcow2 failing in the copy")

    # Formats other than raw and qcow2, and files that are no image at all.
    vmdk = tmp_path / "disk.vmdk"
    run(["qemu-img", "create", "-f", "vmdk", vmdk, "16M"])
    r = pool.cli("image", "import", vmdk, "bad3", "--encryption", "off", check=False)
    assert_one_line_error(r, "vmdk image", r"vmdk.*raw and qcow2")
    assert_nothing_left(pool, "bad3", "vmdk image")
    r = pool.cli("image", "import", good, "bad4", "--format", "raw", "--encryption", "off",
                 "--block-size", "3K", check=False)
    assert_one_line_error(r, "bad block size", r"block")
    r = pool.cli("image", "import", tmp_path / "missing.img", "bad5", "--encryption", "off",
                 check=False)
    assert_one_line_error(r, "missing file", r"missing\.img")
    empty = tmp_path / "empty.img"
    empty.write_bytes(b"")
    r = pool.cli("image", "import", empty, "bad6", "--encryption", "off", check=False)
    assert_one_line_error(r, "empty file", r"empty")
    # An overlay needs its backing file: refused, whatever that file holds.
    overlay = tmp_path / "overlay.qcow2"
    run(["qemu-img", "create", "-f", "qcow2", "-b", good, "-F", "qcow2", overlay])
    r = pool.cli("image", "import", overlay, "bad7", "--encryption", "off", check=False)
    assert_one_line_error(r, "qcow2 with a backing file", r"backing file")
    r = pool.cli("image", "import", src, "bad8", check=False)
    assert_one_line_error(r, "no key", r"--key-file|--passphrase-file")
    # A text file named .qcow2 (qemu-img's probe says raw): refused, not imported as raw.
    text = tmp_path / "notes.qcow2"
    text.write_text("not a disk image\n" * 1000)
    r = pool.cli("image", "import", text, "bad9", "--encryption", "off", check=False)
    assert_one_line_error(r, "text named .qcow2", r"named as a qcow2 image.*--format raw")
    for n in ("bad4", "bad5", "bad6", "bad7", "bad8", "bad9"):
        assert_nothing_left(pool, n, n)
    assert volume_names(pool) == {"vm3"}


def test_image_list(pool, tmp_path, seed):
    """(d) `image list` shows each import with the file's sha256, and marks one
    whose NAME@image is gone as missing."""
    require_tools("qemu-img", "nbdcopy")
    assert pool.cli("image", "list").stdout.strip() == "no images"
    src = make_raw(tmp_path / "src.img", seed)
    want = sha256_file(src)
    import_image(pool, src, "vm4")
    # An image whose size is no multiple of the block size: the volume rounds up,
    # the record and the export of NAME@image keep the image's own size.
    odd = make_raw(tmp_path / "odd.img", seed + 2, size=SIZE + 512,
                   data=[(0, 4096), (SIZE - 100, 612)])
    odd_sha = import_image(pool, odd, "odd", "--block-size", "64K")
    assert odd_sha == sha256_file(odd)
    assert pool.volume_status("odd")["size_bytes"] == SIZE + 64 * 1024
    out = tmp_path / "odd-out.img"
    pool.cli("image", "export", "odd@image", out)
    assert os.path.getsize(out) == SIZE + 512 and sha256_file(out) == odd_sha

    listed = json.loads(pool.cli("image", "list", "--json").stdout)
    by_name = {e["name"]: e for e in listed}
    assert set(by_name) == {"vm4", "odd"}
    e = by_name["vm4"]
    assert e["sha256"] == want and e["present"] is True
    assert (e["format"], e["virtual_size"], e["source"]) == ("raw", SIZE, str(src.resolve()))
    assert by_name["odd"]["virtual_size"] == SIZE + 512

    table = pool.cli("image", "list").stdout
    row = next(l for l in table.splitlines() if l.startswith("vm4 "))
    assert want[:16] in row and "vm4@image" in row and "raw" in row and "64M" in row, table
    assert "SHA256" in table.splitlines()[0]

    pool.cli("volume", "destroy", "-r", "vm4")
    listed = {e["name"]: e for e in json.loads(pool.cli("image", "list", "--json").stdout)}
    assert listed["vm4"]["present"] is False and listed["odd"]["present"] is True
    row = next(l for l in pool.cli("image", "list").stdout.splitlines() if l.startswith("vm4 "))
    assert row.rstrip().endswith("missing"), row

    # (issue 42) a missing row does not stay forever: `image forget NAME` drops it, and
    # is refused while NAME@image still exists.
    r = pool.cli("image", "forget", "odd", check=False)
    assert r.returncode != 0 and "odd@image still exists" in r.stderr, r.stderr
    r = pool.cli("image", "forget", "vm4")
    assert "image vm4 forgotten" in r.stdout, r.stdout
    listed = [e["name"] for e in json.loads(pool.cli("image", "list", "--json").stdout)]
    assert listed == ["odd"], listed
    r = pool.cli("image", "forget", "vm4", check=False)
    assert r.returncode != 0 and "no image named vm4" in r.stderr, r.stderr


GiB = 1024 * MiB


def make_sparse_qcow2(tmp_path, seed):
    """(issue 42) A qcow2 of 1 GiB + 3 * 64 KiB + 1536 bytes: random data at odd offsets (one run across
    the 1 GiB line, one in the last, partial block), zeros written as data, zero clusters
    (qemu-io write -z), and holes everywhere else."""
    rng = random.Random(seed)
    size = GiB + 3 * 65536 + 1536
    raw = tmp_path / "sparse-src.img"
    with open(raw, "wb") as f:
        f.truncate(size)
        for off, length in [(12345, 70_001), (5 * MiB + 777, 3 * MiB + 5),
                            (GiB - 100_003, 200_000), (size - 1000, 1000)]:
            f.seek(off)
            f.write(rng.randbytes(length))
        f.seek(300 * MiB + 4096)
        f.write(bytes(2 * MiB + 512))  # zeros as data
    src = tmp_path / "sparse.qcow2"
    run(["qemu-img", "convert", "-S", "0", "-f", "raw", "-O", "qcow2", raw, src])
    for cmd in ("write -z 5M 64k", "write -z 512M 1M", f"write -P 0x5a {GiB - 65536} 512"):
        qemu_io_ok_file(src, cmd)
    info = json.loads(run(["qemu-img", "info", "--output=json", src]).stdout)
    assert info["virtual-size"] == size, info
    return src, size


def qemu_io_ok_file(path, command):
    r = run(["qemu-io", "-f", "qcow2", "-c", command, path])
    assert "error" not in (r.stdout + r.stderr).lower(), f"qemu-io {command}: {r.stdout}{r.stderr}"


def raw_sha256(tmp_path, image):
    """sha256sum of the image's virtual disk, as `qemu-img convert -O raw` writes it."""
    out = tmp_path / "as-raw.img"
    run(["qemu-img", "convert", "-O", "raw", image, out])
    sha = run(["sha256sum", out]).stdout.split()[0]
    out.unlink()
    return sha


def test_digest_of_a_sparse_qcow2(pool, tmp_path, seed):
    """(issue 42) The digest is hashed in process from block status and reads, zeros
    never read: it still equals sha256sum of the raw virtual disk, across the 1 GiB
    block-status window, through zero clusters, zeros held as data, and the partial
    last block (the volume rounds up to 64K)."""
    require_tools("qemu-img", "qemu-io", "sha256sum")
    src, size = make_sparse_qcow2(tmp_path, seed)
    want = raw_sha256(tmp_path, src)
    sha = import_image(pool, src, "sparse", "--block-size", "64K")
    assert sha == want, "the recorded sha256 is not sha256sum of the raw virtual disk"
    assert pool.volume_status("sparse")["size_bytes"] > size  # a tail past the image
    listed = {e["name"]: e for e in json.loads(pool.cli("image", "list", "--json").stdout)}
    assert listed["sparse"]["sha256"] == want and listed["sparse"]["virtual_size"] == size


def test_import_without_digest(pool, tmp_path, seed):
    """(issue 42) `--no-digest` records no sha256 (`-` in the table, null in JSON) and
    the volume still holds the image."""
    require_tools("qemu-img", "qemu-io", "sha256sum")
    src, size = make_sparse_qcow2(tmp_path, seed)
    want = raw_sha256(tmp_path, src)
    r = pool.cli("image", "import", src, "nod", "--no-digest", "--encryption", "off")
    assert r.stdout.strip().splitlines()[-1].endswith(
        "no sha256 recorded (--no-digest)"), r.stdout
    assert not any(n in r.stdout + r.stderr for n in NOISE), r.stderr
    record = json.loads((pool.dir / "images" / "nod.json").read_text())
    assert "sha256" in record and record["sha256"] is None, record
    listed = {e["name"]: e for e in json.loads(pool.cli("image", "list", "--json").stdout)}
    assert listed["nod"]["sha256"] is None and listed["nod"]["present"] is True
    row = next(l for l in pool.cli("image", "list").stdout.splitlines() if l.startswith("nod "))
    assert row.split()[3] == "-", row
    out = tmp_path / "nod.qcow2"
    pool.cli("image", "export", "nod@image", out, "--format", "qcow2")
    assert raw_sha256(tmp_path, out) == want, "the volume does not hold the image"


def test_long_hash_is_not_silent(pool, tmp_path):
    """(issue 42) Without a terminal for the progress bar, an import whose hash runs over
    4 GiB or more says so on stderr, naming --no-digest; with --no-digest it does not
    hash and says nothing of it. An empty 4 GiB qcow2: its digest is that of 4 GiB of zeros."""
    require_tools("qemu-img")
    src = tmp_path / "empty.qcow2"
    run(["qemu-img", "create", "-f", "qcow2", src, "4G"])
    r = pool.cli("image", "import", src, "big", "--encryption", "off")
    said = [l for l in stderr_lines(r) if l.startswith("hashing the 4G virtual disk")]
    assert len(said) == 1 and "--no-digest" in said[0], r.stderr
    zeros = hashlib.sha256()
    block = bytes(1 << 20)
    for _ in range(4096):
        zeros.update(block)
    assert r.stdout.strip().endswith(f"sha256 {zeros.hexdigest()}"), r.stdout
    r = pool.cli("image", "import", src, "big2", "--encryption", "off", "--no-digest")
    assert "hashing" not in r.stderr, r.stderr
