"""Snapshots as a storage admin checks them: through the `bulwark` CLI and real
NBD clients (qemu-io, qemu-img, nbdcopy, nbdinfo, fio, libnbd).

- A snapshot reads back, over NBD, exactly the data at its point; unwritten
  and trimmed ranges are holes in `nbdinfo --map`; VOL@SNAP is read-only (to
  qemu-io, and to a client that writes anyway) and listed as an export.
- Snapshots taken while a client writes hold every write acknowledged before
  `snapshot create` began and none issued after it returned; under fio every
  snapshot reads back whole, each block a complete fio block.
- Space: `snapshot list` and `volume list --space` agree with a model of which
  block versions each snapshot shares, to the byte; destroying a snapshot
  frees exactly its listed USED; a restart changes no number.
- A snapshot whose records the cleaner moves still reads back as taken.
- Rollback, holds, destroy -r, and what each refuses (and says when it does).
- A crash (BULWARK_CRASH_AT) at every step of snapshot create, snapshot
  destroy and volume rollback leaves the old state or the new one, never a mix;
  after `superblocks_written` of the operation's own commit, the new one.
Encrypted and unencrypted volumes, single and mirror:2 pools.
Replay a randomised failure with BULWARK_TEST_SEED=<seed printed>.
"""

import json
import random
import signal
import subprocess
import sys
import time

import pytest

import rawunix
from conftest import HELPERS, KiB, MiB, nbd_python, qemu_io, qemu_io_ok, require_tools, run, run_fio
from healing import NbdShell

sys.path.insert(0, str(HELPERS))
from crashblocks import content, parse  # noqa: E402

BS = 4 * KiB
ZERO_BLOCK = bytes(BS)


# --------------------------------------------------------------------------
# helpers


def started_pool(make_pool, layout="single"):
    devices = 2 if layout.startswith("mirror") else 1
    p = make_pool(layout=layout, devices=devices, device_size="256M")
    return p.create().start()


def format_size(n: int) -> str:
    """bulwark's human size (engine size::format_size), to check what the CLI prints."""
    units = ["", "K", "M", "G", "T", "P", "E"]
    v, i = float(n), 0
    while v >= 1024 and i < len(units) - 1:
        v /= 1024
        i += 1
    if i == 0:
        return str(n)
    if v >= 100 or v == int(v):
        return f"{v:.0f}{units[i]}"
    return f"{v:.2f}{units[i]}"


def copy_out(pool, name, path) -> bytes:
    """The whole export `name` as nbdcopy reads it."""
    run(["nbdcopy", pool.uri(name), path], timeout=120)
    return path.read_bytes()


def assert_image(got: bytes, want: bytes, what: str):
    assert len(got) == len(want), f"{what}: read {len(got)} bytes, expected {len(want)}"
    if got != want:
        bad = [o for o in range(0, len(want), BS) if got[o:o + BS] != want[o:o + BS]]
        first = bad[0]
        pytest.fail(f"{what}: {len(bad)} of {len(want) // BS} 4 KiB blocks differ from the expected "
                    f"data; first at offsets {bad[:8]}; got {got[first:first + 16].hex()}..., "
                    f"expected {want[first:first + 16].hex()}...")


def qemu_io_ro(uri: str, *commands: str):
    """qemu-io opening the image read-only (-r), every command must succeed."""
    cmd = ["qemu-io", "-r", "-f", "raw"]
    for c in commands:
        cmd += ["-c", c]
    r = run(cmd + [uri], check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "Pattern verification failed" not in out \
        and "error" not in out.lower(), f"qemu-io -r {' '.join(commands)} on {uri} failed:\n{out}"


def snapshots(pool, vol=None) -> list[dict]:
    r = pool.cli("snapshot", "list", *([vol] if vol else []), "--json")
    return json.loads(r.stdout)


def snap_names(pool, vol=None) -> list[str]:
    return [s["name"] for s in snapshots(pool, vol)]


def space(pool, vol) -> dict:
    for v in json.loads(pool.cli("volume", "list", "--space", "--json").stdout):
        if v["name"] == vol:
            return v
    pytest.fail(f"volume {vol} missing from `volume list --space --json`")


def volume_used(pool, vol) -> int:
    for v in json.loads(pool.cli("volume", "list", "--json").stdout):
        if v["name"] == vol:
            return v["used_bytes"]
    pytest.fail(f"volume {vol} missing from `volume list --json`")


def assert_space_sane(pool, vol, what) -> tuple[dict, list[dict]]:
    """The relations between the numbers that hold whatever was written."""
    sp, snaps = space(pool, vol), snapshots(pool, vol)
    ctx = f"{what}: volume list --space: {sp}; snapshot list: {snaps}"
    assert sp["snapshots"] == len(snaps), f"SNAPSHOTS column is not the number of snapshots listed. {ctx}"
    assert sp["used_bytes"] == sp["referenced_bytes"] + sp["used_by_snapshots_bytes"], \
        f"volume USED is not REFER + USEDSNAP. {ctx}"
    assert sp["referenced_bytes"] == volume_used(pool, vol), \
        f"REFER of `volume list --space` is not USED of `volume list`. {ctx}"
    assert sp["written_bytes"] <= sp["referenced_bytes"], f"WRITTEN exceeds REFER. {ctx}"
    for s in snaps:
        assert s["used_bytes"] <= s["referenced_bytes"], f"{s['name']}: USED exceeds REFER. {ctx}"
    assert sum(s["used_bytes"] for s in snaps) <= sp["used_by_snapshots_bytes"], \
        f"the snapshots' USED add up to more than the volume's USEDSNAP. {ctx}"
    return sp, snaps


def cli_refused(pool, *args, mentions=()):
    """Run a command that must fail; its message must mention each of `mentions`."""
    r = pool.cli(*args, check=False)
    assert r.returncode != 0, f"`bulwark {' '.join(args)}` succeeded; it must be refused:\n{r.stdout}"
    msg = r.stderr + r.stdout
    for m in mentions:
        assert m in msg, f"`bulwark {' '.join(args)}` was refused, but its message does not " \
                         f"mention {m!r}:\n{msg}"
    return r


def allocated(pool, name) -> list[tuple[int, int]]:
    """Data extents (base:allocation, not a hole) of export `name`, merged."""
    r = run(["nbdinfo", "--map", "--json", pool.uri(name)])
    out: list[list[int]] = []
    for e in json.loads(r.stdout):
        if e["type"] & 1:  # hole
            continue
        if out and out[-1][0] + out[-1][1] == e["offset"]:
            out[-1][1] += e["length"]
        else:
            out.append([e["offset"], e["length"]])
    return [tuple(x) for x in out]


class Image:
    """The expected bytes of a volume, as qemu-io / libnbd write them."""

    def __init__(self, size):
        self.b = bytearray(size)

    def put(self, off, data):
        self.b[off:off + len(data)] = data

    def freeze(self) -> bytes:
        return bytes(self.b)


def write_random(sh: NbdShell, img: Image, rng, off, n):
    data = rng.randbytes(n)
    sh.write(off, data)
    img.put(off, data)


def discard(pool, vol, img: Image, off, n):
    qemu_io_ok(pool.uri(vol), f"discard {off} {n}")
    img.put(off, bytes(n))


# --------------------------------------------------------------------------
# 1. contents, holes, read-only, exports


@pytest.mark.parametrize("layout,encrypted", [("single", False), ("mirror:2", True)],
                         ids=["single-plain", "mirror-encrypted"])
def test_snapshot_contents_holes_read_only_and_exports(make_pool, tmp_path, layout, encrypted):
    require_tools("qemu-io", "qemu-img", "nbdcopy", "nbdinfo")
    pool = started_pool(make_pool, layout)
    size = 64 * MiB
    key = pool.create_volume("vm", size="64M", encryption=encrypted)
    uri = pool.uri("vm")
    img = Image(size)

    def write(pattern, off, n):
        qemu_io_ok(uri, f"write -P {pattern:#x} {off} {n}")
        img.put(off, bytes([pattern]) * n)

    write(0xa1, 0, 1 * MiB)
    write(0xa2, 8 * MiB, 512 * KiB)
    r = pool.cli("snapshot", "create", "vm@first")
    assert "vm@first" in r.stdout, f"snapshot create printed no name: {r.stdout!r}"
    at_first = img.freeze()

    write(0xb1, 512 * KiB, 1 * MiB)
    qemu_io_ok(uri, f"discard {8 * MiB} {512 * KiB}")
    img.put(8 * MiB, bytes(512 * KiB))
    write(0xb2, 32 * MiB, 64 * KiB)
    write(0xb3, 5000, 3000)  # inside one 4 KiB block: read-modify-write of a block vm@first holds
    qemu_io_ok(uri, f"write -z {128 * KiB} {64 * KiB}")  # zeroes: a hole from here on
    img.put(128 * KiB, bytes(64 * KiB))
    pool.cli("snapshot", "create", "vm@second")
    at_second = img.freeze()

    write(0xc1, 0, 4 * KiB)
    write(0xc2, 60 * MiB, 4 * MiB)

    assert {"vm", "vm@first", "vm@second"} <= set(pool.exports()), \
        f"nbdinfo --list does not show both snapshots as exports: {pool.exports()}"
    assert snap_names(pool, "vm") == ["vm@first", "vm@second"], snapshots(pool, "vm")

    # Each snapshot is the data at its point, read by two different clients.
    assert_image(copy_out(pool, "vm@first", tmp_path / "first.img"), at_first,
                 "vm@first read with nbdcopy")
    expected2 = tmp_path / "second-expected.img"
    expected2.write_bytes(at_second)
    r = run(["qemu-img", "compare", "-f", "raw", "-F", "raw", expected2, pool.uri("vm@second")], check=False)
    assert r.returncode == 0, f"qemu-img compare: vm@second is not the data at its point:\n{r.stdout}{r.stderr}"
    assert_image(copy_out(pool, "vm", tmp_path / "head.img"), img.freeze(), "the volume after both snapshots")

    # base:allocation: only what was written is data; the rest, and what was
    # trimmed before vm@second, are holes.
    assert allocated(pool, "vm@first") == [(0, 1 * MiB), (8 * MiB, 512 * KiB)], \
        "nbdinfo --map of vm@first: data only where written before it"
    assert allocated(pool, "vm@second") == [(0, 128 * KiB), (192 * KiB, 1344 * KiB), (32 * MiB, 64 * KiB)], \
        "nbdinfo --map of vm@second: the ranges trimmed or zeroed before it must be holes"

    # Read-only: advertised, refused to qemu-io, and refused by the server to a
    # client that writes anyway.
    info = json.loads(run(["nbdinfo", "--json", pool.uri("vm@first")]).stdout)["exports"][0]
    assert info["is_read_only"] is True, f"vm@first is not advertised read-only: {info}"
    r = qemu_io(pool.uri("vm@first"), "write -P 0xee 0 4k")
    assert r.returncode != 0, f"qemu-io opened vm@first read-write and wrote to it:\n{r.stdout}{r.stderr}"
    s, exp_size = rawunix.attach(pool.nbd_socket, "vm@first")
    assert exp_size == size, exp_size
    try:
        s.sendall(rawunix.header(rawunix.CMD_WRITE, 7, 0, BS) + b"\xee" * BS)
        err, handle, _ = rawunix.reply(s)
        assert err != 0, "the server acknowledged a write to snapshot vm@first"
    except ConnectionError:
        pass  # refused by dropping the connection: also a refusal
    finally:
        s.close()
    qemu_io_ro(pool.uri("vm@first"), "read -P 0xa1 0 1M")

    # The snapshots survive a restart; an encrypted one needs its volume's key.
    pool.restart()
    if encrypted:
        r = run(["nbdinfo", pool.uri("vm@first")], check=False)
        assert r.returncode != 0, "an encrypted volume's snapshot opened before its key was loaded"
        pool.load_key("vm", key)
    assert_image(copy_out(pool, "vm@first", tmp_path / "first2.img"), at_first, "vm@first after a restart")
    assert_image(copy_out(pool, "vm@second", tmp_path / "second2.img"), at_second, "vm@second after a restart")

    # Destroyed, a snapshot is no longer an export.
    pool.wait_detached("vm@second")
    pool.cli("snapshot", "destroy", "vm@second")
    exports = pool.exports()
    assert "vm@second" not in exports and "vm@first" in exports, exports
    r = run(["nbdinfo", pool.uri("vm@second")], check=False)
    assert r.returncode != 0, "a destroyed snapshot can still be opened"


# --------------------------------------------------------------------------
# 2. snapshots while a client writes


def read_writer_log(path):
    """(acknowledged writes, highest write issued, final, error) from complete lines."""
    text = path.read_text()
    text = text[:text.rfind("\n") + 1]
    acked, issued, final, err = set(), 0, None, None
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "A":
            acked.add(int(rest))
        elif kind == "I":
            issued = max(issued, int(rest))
        elif kind == "S":
            final = int(rest)
        elif kind == "E":
            err = rest
    return acked, issued, final, err


def test_snapshots_while_a_client_writes(make_pool, tmp_path, seed):
    require_tools("nbdcopy")
    pool = started_pool(make_pool, "single")
    pool.create_volume("live", size="32M")
    size, nblocks = 32 * MiB, 2048  # the writer cycles over the first 8 MiB
    rng = random.Random(seed)
    log, stop = tmp_path / "writer.log", tmp_path / "stop"
    with open(log, "w") as out:
        w = subprocess.Popen([nbd_python(), str(HELPERS / "snap_writer.py"), pool.uri("live"),
                              str(seed), str(nblocks), str(stop)], stdout=out, stderr=subprocess.STDOUT)
    taken = []
    try:
        deadline = time.monotonic() + 60
        while len(read_writer_log(log)[0]) < nblocks:
            assert w.poll() is None, f"writer exited early:\n{log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"writer too slow:\n{log.read_text()[-2000:]}"
            time.sleep(0.05)
        for k in range(6):
            time.sleep(rng.uniform(0.05, 0.3))
            acked_before = read_writer_log(log)[0]
            pool.cli("snapshot", "create", f"live@s{k}")
            acked_after, issued_by_return, _, err = read_writer_log(log)
            assert err is None, f"the writer got an error while snapshot s{k} was taken: {err}"
            taken.append((f"live@s{k}", acked_before, issued_by_return, len(acked_after) - len(acked_before)))
        stop.touch()
        assert w.wait(60) == 0, f"writer failed:\n{log.read_text()[-2000:]}"
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()
    acked, issued, final, err = read_writer_log(log)
    assert err is None and final == issued and len(acked) == issued, \
        f"writer: {issued} issued, {len(acked)} acknowledged, stopped at {final}, error {err}"
    assert sum(t[3] for t in taken) > 0, \
        "no write was acknowledged while any `snapshot create` ran: nothing was written concurrently"

    def check(name, data, floor, ceiling):
        """Block b holds the newest version acknowledged before the create began
        (floor[b], 0: never written) or one issued no later than `ceiling`."""
        bad, newer = [], 0
        for b in range(nblocks):
            blk = data[b * BS:(b + 1) * BS]
            if blk == ZERO_BLOCK:
                ver = 0
            else:
                who = parse(blk)
                if who is None or who[0] != seed or who[3] != b or blk != content(seed, 1, who[2], b):
                    bad.append((b, "not a complete block written here", blk[:48]))
                    continue
                ver = who[2]
            if ver == floor[b]:
                continue
            if ver > floor[b] and ver <= ceiling and ver % nblocks == b:
                newer += 1
                continue
            why = "older than a write acknowledged before create began" if ver < floor[b] \
                else "a write issued after create returned"
            bad.append((b, f"holds write {ver}: {why} (newest acknowledged before: {floor[b]}, "
                           f"highest issued by return: {ceiling})", b""))
        tail = data[nblocks * BS:]
        if tail.count(0) != len(tail):
            bad.append((nblocks, "data past the written range", b""))
        assert not bad, f"{name}: {len(bad)} bad blocks, first: {bad[:5]}"
        return newer

    for name, acked_before, ceiling, during in taken:
        floor = [0] * nblocks
        for s in acked_before:
            floor[s % nblocks] = max(floor[s % nblocks], s)
        data = copy_out(pool, name, tmp_path / "snap.img")
        assert len(data) == size
        newer = check(name, data, floor, ceiling)
        print(f"{name}: {len(acked_before)} writes acknowledged before create, {during} while it ran, "
              f"{newer} blocks hold a write in flight during the create")

    # And the volume holds every acknowledged write.
    latest = [0] * nblocks
    for s in acked:
        latest[s % nblocks] = max(latest[s % nblocks], s)
    check("the volume after the writer stopped", copy_out(pool, "live", tmp_path / "vol.img"), latest, 0)
    assert_space_sane(pool, "live", "after snapshots under a writer")


FIO_MAGIC = 0xACCA
_CRC32C = []


def crc32c_fio(data: bytes) -> int:
    """fio's crc32c (Castagnoli, initial ~0, no final inversion)."""
    if not _CRC32C:
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            _CRC32C.append(c)
    c = 0xFFFFFFFF
    for x in data:
        c = _CRC32C[(c ^ x) & 0xFF] ^ (c >> 8)
    return c


def fio_blocks(data: bytes, rng, what, data_crc_samples=48) -> dict[int, bytes]:
    """Every 4 KiB block of `data` is zero or a complete fio verify block
    written at its own offset (magic, length, offset, header crc; the data crc
    of a sample). Returns {offset: block} of the written ones."""
    written, bad = {}, []
    for off in range(0, len(data), BS):
        blk = data[off:off + BS]
        if blk == ZERO_BLOCK:
            continue
        magic, _vtype, length = int.from_bytes(blk[0:2], "little"), blk[2:4], int.from_bytes(blk[4:8], "little")
        at = int.from_bytes(blk[16:24], "little")
        if magic != FIO_MAGIC or length != BS or at != off:
            bad.append((off, f"not a fio block for this offset (magic {magic:#x}, len {length}, offset {at})"))
        elif crc32c_fio(blk[:36]) != int.from_bytes(blk[36:40], "little"):
            bad.append((off, "fio header crc32c mismatch"))
        else:
            written[off] = blk
    for off in rng.sample(sorted(written), min(data_crc_samples, len(written))):
        blk = written[off]
        if crc32c_fio(blk[44:]) != int.from_bytes(blk[40:44], "little"):
            bad.append((off, "fio data crc32c mismatch: torn or altered block"))
    assert not bad, f"{what}: {len(bad)} bad blocks, first: {bad[:5]}"
    return written


def test_snapshots_under_fio(make_pool, tmp_path, seed):
    require_tools("fio", "nbdcopy")
    pool = started_pool(make_pool, "mirror:2")
    # Uncompressed and unencrypted: a 4 KiB block stores exactly 4 KiB. fio is
    # rate-limited (about 3 s for its 32 MiB) so that snapshots land while it writes.
    pool.create_volume("db", size="64M", encryption=False, compression="off")
    job = 32 * MiB
    report = tmp_path / "fio.json"
    cmd = ["fio", "--name=snap", "--ioengine=nbd", f"--uri={pool.uri('db')}", "--rw=randwrite",
           "--bs=4k", "--iodepth=16", f"--size={job}", "--rate=12m", "--verify=crc32c", "--verify_fatal=1",
           "--do_verify=1", "--verify_state_save=0", "--output-format=json", f"--output={report}"]
    fio = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    taken = []  # (name, fio still running when create returned)
    try:
        while fio.poll() is None and len(taken) < 8:
            time.sleep(0.3)
            name = f"db@f{len(taken)}"
            pool.cli("snapshot", "create", name)
            taken.append((name, fio.poll() is None))
        out, _ = fio.communicate(timeout=300)
    finally:
        if fio.poll() is None:
            fio.kill()
            fio.wait()
    rep = json.loads(report.read_text())
    assert fio.returncode == 0, f"fio failed (exit {fio.returncode}): {out.decode(errors='replace')}"
    for j in rep["jobs"]:
        assert j["error"] == 0 and j["write"]["io_bytes"] == job and j["read"]["io_bytes"] >= job, \
            f"fio did not write and verify its {job} bytes: {j}"
    during = [n for n, running in taken if running]
    assert len(during) >= 2, f"fio finished before two snapshots were taken while it wrote: {taken}"
    pool.cli("snapshot", "create", "db@after")

    # fio writes each block once: every snapshot holds complete fio blocks, each
    # later snapshot holds the earlier one's blocks unchanged, and REFER is
    # exactly 4 KiB per block written.
    rng = random.Random(seed)
    prev, prev_name = {}, None
    listed = {s["name"]: s for s in snapshots(pool, "db")}
    for name in [n for n, _ in taken] + ["db@after"]:
        data = copy_out(pool, name, tmp_path / "snap.img")
        blocks = fio_blocks(data, rng, name)
        lost = [o for o, b in prev.items() if blocks.get(o) != b]
        assert not lost, f"{name} lacks or changed {len(lost)} blocks that the older {prev_name} holds " \
                         f"(fio writes each block once), first offsets {lost[:5]}"
        assert listed[name]["referenced_bytes"] == BS * len(blocks), \
            f"{name}: REFER {listed[name]['referenced_bytes']} but it holds {len(blocks)} written 4 KiB blocks"
        print(f"{name}: {len(blocks)} blocks written")
        prev, prev_name = blocks, name
    assert len(prev) == job // BS, f"db@after holds {len(prev)} fio blocks, fio wrote {job // BS}"
    assert_image(copy_out(pool, "db", tmp_path / "vol.img"), data, "the volume vs db@after (nothing written since)")

    sp, snaps = assert_space_sane(pool, "db", "after snapshots under fio")
    # No block was ever overwritten, so no snapshot holds anything alone.
    assert all(s["used_bytes"] == 0 for s in snaps) and sp["used_by_snapshots_bytes"] == 0, \
        f"snapshots of never-overwritten data claim USED space: {snaps} {sp}"
    assert sp["written_bytes"] == 0 and sp["referenced_bytes"] == job, \
        f"volume after fio and db@after: expected REFER {job} and WRITTEN 0: {sp}"


# --------------------------------------------------------------------------
# 3. space accounting


class SpaceModel:
    """Which write (an id) each block holds, for the volume and each snapshot,
    and the numbers `snapshot list` / `volume list --space` must show: a record
    is shared exactly when two neighbouring trees hold the same write."""

    def __init__(self):
        self.head: dict[int, int] = {}
        self.snaps: list[tuple[str, dict[int, int]]] = []
        self.data: dict[int, bytes] = {}
        self.next_id = 0

    def write(self, block, data):
        if data == ZERO_BLOCK:  # stored as a hole
            self.head.pop(block, None)
            return
        self.next_id += 1
        self.head[block] = self.next_id
        self.data[self.next_id] = data

    def trim(self, block):
        self.head.pop(block, None)

    def snapshot(self, name):
        self.snaps.append((name, dict(self.head)))

    def destroy(self, name):
        self.snaps = [(n, t) for n, t in self.snaps if n != name]

    def image(self, tree, size) -> bytes:
        img = bytearray(size)
        for b, wid in tree.items():
            img[b * BS:(b + 1) * BS] = self.data[wid]
        return bytes(img)

    def expected(self, rec) -> tuple[dict, dict]:
        """(volume space, {snapshot: (used, referenced)}) for `rec` bytes per record."""
        trees = [t for _, t in self.snaps] + [self.head]
        per = {}
        usedsnap = 0
        for k, (name, t) in enumerate(self.snaps):
            prev, nxt = (trees[k - 1] if k else {}), trees[k + 1]
            only = sum(1 for b, w in t.items() if prev.get(b) != w and nxt.get(b) != w)
            per[name] = (rec * only, rec * len(t))
            usedsnap += rec * sum(1 for b, w in t.items() if nxt.get(b) != w)
        last = self.snaps[-1][1] if self.snaps else {}
        written = sum(1 for b, w in self.head.items() if last.get(b) != w)
        ref = rec * len(self.head)
        return ({"used_bytes": ref + usedsnap, "referenced_bytes": ref, "used_by_snapshots_bytes": usedsnap,
                 "written_bytes": rec * written, "snapshots": len(self.snaps)}, per)


def assert_space_exact(pool, vol, model: SpaceModel, rec, what):
    sp, snaps = assert_space_sane(pool, vol, what)
    want_sp, want_snaps = model.expected(rec)
    got_sp = {k: sp[k] for k in want_sp}
    assert got_sp == want_sp, f"{what}: `volume list --space` {got_sp}, but the volume and its snapshots " \
                              f"hold {want_sp} ({rec} bytes per 4 KiB record)"
    got_snaps = {s["name"]: (s["used_bytes"], s["referenced_bytes"]) for s in snaps}
    assert got_snaps == want_snaps, f"{what}: `snapshot list` (USED, REFER) {got_snaps}, expected {want_snaps}"


@pytest.mark.parametrize("layout,encrypted", [("single", True), ("mirror:2", False)],
                         ids=["single-encrypted", "mirror-plain"])
def test_space_accounting_is_exact(make_pool, tmp_path, seed, layout, encrypted):
    require_tools("qemu-io", "nbdcopy")
    pool = started_pool(make_pool, layout)
    size, region = 32 * MiB, 1024  # writes land in the first 4 MiB, so they overlap
    key = pool.create_volume("sp", size="32M", encryption=encrypted, compression="off")
    uri = pool.uri("sp")
    rng = random.Random(seed)
    m = SpaceModel()

    def writes(sh, n, zero_every=0):
        for i in range(n):
            b = rng.randrange(region)
            k = min(rng.randint(1, 8), region - b)
            zero = zero_every and i % zero_every == zero_every - 1
            data = bytes(k * BS) if zero else rng.randbytes(k * BS)
            sh.write(b * BS, data)
            for j in range(k):
                m.write(b + j, data[j * BS:(j + 1) * BS])

    def trims(n):
        cmds = []
        for _ in range(n):
            b = rng.randrange(region)
            k = min(rng.randint(1, 16), region - b)
            cmds.append(f"discard {b * BS} {k * BS}")
            for j in range(k):
                m.trim(b + j)
        qemu_io_ok(uri, *cmds)

    with NbdShell(uri) as sh:
        writes(sh, 250)
    pool.cli("snapshot", "create", "sp@s0")
    m.snapshot("sp@s0")
    ref0 = snapshots(pool, "sp")[0]["referenced_bytes"]
    assert ref0 % len(m.head) == 0, f"REFER {ref0} of sp@s0 is not a whole number of its {len(m.head)} records"
    rec = ref0 // len(m.head)
    if not encrypted:
        assert rec == BS, f"an uncompressed, unencrypted 4 KiB block takes {rec} bytes, not 4096"
    assert_space_exact(pool, "sp", m, rec, "after the first snapshot")

    for k in range(1, 4):
        with NbdShell(uri) as sh:
            writes(sh, 60, zero_every=10)
        trims(12)
        pool.cli("snapshot", "create", f"sp@s{k}")
        m.snapshot(f"sp@s{k}")
        assert_space_exact(pool, "sp", m, rec, f"after snapshot s{k}")
    with NbdShell(uri) as sh:
        writes(sh, 40)
    trims(5)
    assert_space_exact(pool, "sp", m, rec, "after writes and trims past the last snapshot")

    # Destroying a snapshot frees exactly what it listed as USED: a middle one,
    # the oldest, the newest.
    for name in ("sp@s2", "sp@s0", "sp@s3"):
        used = {s["name"]: s["used_bytes"] for s in snapshots(pool, "sp")}[name]
        before = space(pool, "sp")
        r = pool.cli("snapshot", "destroy", name)
        assert f"freed {format_size(used)} ({used} bytes)" in r.stdout, \
            f"`snapshot destroy {name}` printed {r.stdout.strip()!r}; its USED was {used} ({format_size(used)})"
        after = space(pool, "sp")
        assert before["used_bytes"] - after["used_bytes"] == used, \
            f"destroying {name} (USED {used}) took the volume's USED from {before['used_bytes']} to " \
            f"{after['used_bytes']}"
        assert after["referenced_bytes"] == before["referenced_bytes"], (before, after)
        m.destroy(name)
        assert_space_exact(pool, "sp", m, rec, f"after destroying {name}")

    # A restart changes no number, and every snapshot still reads back as written.
    numbers = (snapshots(pool, "sp"), space(pool, "sp"), volume_used(pool, "sp"))
    pool.restart()
    if encrypted:
        pool.load_key("sp", key)
    assert (snapshots(pool, "sp"), space(pool, "sp"), volume_used(pool, "sp")) == numbers, \
        "space numbers changed across a clean restart"
    for name, tree in m.snaps:
        assert_image(copy_out(pool, name, tmp_path / "s.img"), m.image(tree, size), f"{name} after a restart")
    assert_image(copy_out(pool, "sp", tmp_path / "v.img"), m.image(m.head, size), "the volume after a restart")


def test_snapshot_survives_cleaning(make_pool, tmp_path, seed):
    """A full pool's cleaner compacts segments where a snapshot's records sit
    among garbage: the snapshot still reads back as taken, after a restart too,
    and a scrub finds every copy good."""
    require_tools("fio", "nbdcopy")
    pool = make_pool(layout="mirror:2", devices=2, device_size="128M")
    pool.create().start()
    size = 40 * MiB
    key = pool.create_volume("cl", size="40M", compression="off")
    rng = random.Random(seed)
    img = Image(size)
    (tmp_path / "a.img").write_bytes(rng.randbytes(size))
    run(["nbdcopy", tmp_path / "a.img", pool.uri("cl")])
    img.put(0, (tmp_path / "a.img").read_bytes())
    # Scattered overwrites leave the first pass's segments part garbage, part
    # records that the snapshot keeps.
    with NbdShell(pool.uri("cl")) as sh:
        for _ in range(400):
            write_random(sh, img, rng, rng.randrange(size // (16 * KiB)) * 16 * KiB, 16 * KiB)
    at_s1 = img.freeze()
    pool.cli("snapshot", "create", "cl@s1")
    cleaned_before = pool.status()["space"]["clean_written_bytes"]
    # Three overwrites of the whole volume: the pool (about 110 MiB usable per
    # copy, 80 MiB of it live) must clean to take them. fio verifies the last.
    out = tmp_path / "churn.json"
    _, rep = run_fio(["fio", "--name=churn", "--ioengine=nbd", f"--uri={pool.uri('cl')}", "--rw=randwrite",
                      "--bs=4k", "--iodepth=16", f"--size={size}", "--loops=3", "--verify=crc32c",
                      "--verify_fatal=1", "--do_verify=1", "--verify_state_save=0",
                      "--output-format=json", f"--output={out}"], out, timeout=300)
    assert all(j["error"] == 0 for j in rep["jobs"]), rep["jobs"]
    sp = pool.status()["space"]
    assert sp["clean_written_bytes"] > cleaned_before, f"the cleaner never ran; make the churn bigger: {sp}"
    assert_image(copy_out(pool, "cl@s1", tmp_path / "s.img"), at_s1, "cl@s1 after the cleaner ran")
    sp, snaps = assert_space_sane(pool, "cl", "after cleaning")
    assert snaps[0]["referenced_bytes"] == snaps[0]["used_bytes"] == sp["used_by_snapshots_bytes"], \
        f"cl@s1 shares nothing with the fully overwritten volume, so all it references is its own: {snaps} {sp}"

    pool.restart()
    pool.load_key("cl", key)
    assert_image(copy_out(pool, "cl@s1", tmp_path / "s.img"), at_s1, "cl@s1 after cleaning and a restart")
    pool.wait_detached("cl@s1")
    r = pool.cli("scrub", "--wait", check=False, timeout=300)
    assert r.returncode == 0, f"scrub found bad copies after cleaning moved snapshot records:\n{r.stdout}{r.stderr}"


# --------------------------------------------------------------------------
# 4. rollback


def test_rollback(make_pool, tmp_path, seed):
    require_tools("qemu-io", "nbdcopy")
    pool = started_pool(make_pool, "single")
    size = 32 * MiB
    key = pool.create_volume("rb", size="32M")
    rng = random.Random(seed)
    img = Image(size)
    with NbdShell(pool.uri("rb")) as sh:
        write_random(sh, img, rng, 0, 2 * MiB)
    at_r1 = img.freeze()
    pool.cli("snapshot", "create", "rb@r1")
    with NbdShell(pool.uri("rb")) as sh:
        write_random(sh, img, rng, 1 * MiB, 2 * MiB)
    discard(pool, "rb", img, 0, 256 * KiB)
    at_r2 = img.freeze()
    pool.cli("snapshot", "create", "rb@r2")
    with NbdShell(pool.uri("rb")) as sh:
        write_random(sh, img, rng, 2 * MiB, 1 * MiB)
    current = img.freeze()
    pool.wait_detached("rb")

    # Not the newest: refused, naming the newer snapshot and the way out.
    cli_refused(pool, "volume", "rollback", "rb@r1", mentions=("rb@r2", "--destroy-newer"))
    assert snap_names(pool, "rb") == ["rb@r1", "rb@r2"], "a refused rollback destroyed a snapshot"
    assert_image(copy_out(pool, "rb", tmp_path / "v.img"), current, "the volume after a refused rollback")
    pool.wait_detached("rb")

    # The newest: the volume is the snapshot again, nothing written since.
    r = pool.cli("volume", "rollback", "rb@r2")
    assert "rolled back" in r.stdout, r.stdout
    assert_image(copy_out(pool, "rb", tmp_path / "v.img"), at_r2, "the volume rolled back to rb@r2")
    assert_image(copy_out(pool, "rb@r2", tmp_path / "s.img"), at_r2, "rb@r2 after rolling back to it")
    sp, snaps = assert_space_sane(pool, "rb", "after rollback to rb@r2")
    assert sp["written_bytes"] == 0 and sp["referenced_bytes"] == snaps[-1]["referenced_bytes"], \
        f"right after a rollback to rb@r2 the volume must reference what rb@r2 does and WRITTEN be 0: {sp} {snaps}"

    # The volume takes writes again after it.
    with NbdShell(pool.uri("rb")) as sh:
        write_random(sh, img, rng, 0, 512 * KiB)

        # Refused while a client is attached (this connection), and nothing changes.
        cli_refused(pool, "volume", "rollback", "--destroy-newer", "rb@r1", mentions=("in use",))
        assert snap_names(pool, "rb") == ["rb@r1", "rb@r2"], "a refused rollback destroyed a snapshot"
        assert sh.read(0, 512 * KiB) == img.freeze()[:512 * KiB], "a refused rollback changed the volume"
        # A snapshot that does not exist is named as such, not as a volume in use.
        cli_refused(pool, "volume", "rollback", "rb@nosuch", mentions=("rb@nosuch", "does not exist"))
    pool.wait_detached("rb")

    # Clients reading snapshots are not clients of the volume: a rollback to the
    # newest goes ahead under them, and they go on reading their snapshot's data.
    with NbdShell(pool.uri("rb@r1")) as s1, NbdShell(pool.uri("rb@r2")) as s2:
        assert s1.read(0, 4 * MiB) == at_r1[:4 * MiB]
        assert s2.read(0, 4 * MiB) == at_r2[:4 * MiB]
        pool.cli("volume", "rollback", "rb@r2")
        assert s1.read(0, 4 * MiB) == at_r1[:4 * MiB], "rb@r1 read differently after a rollback to rb@r2"
        assert s2.read(0, 4 * MiB) == at_r2[:4 * MiB], "rb@r2 read differently after a rollback to it"
    assert_image(copy_out(pool, "rb", tmp_path / "v.img"), at_r2, "the volume rolled back to rb@r2 again")
    for name in ("rb", "rb@r1", "rb@r2"):
        pool.wait_detached(name)

    # Older, with --destroy-newer: the newer snapshot goes, the volume is rb@r1.
    r = pool.cli("volume", "rollback", "--destroy-newer", "rb@r1")
    assert "rb@r2" in r.stdout, f"rollback --destroy-newer did not say it destroyed rb@r2:\n{r.stdout}"
    assert snap_names(pool, "rb") == ["rb@r1"], f"rb@r2 still listed: {snapshots(pool, 'rb')}"
    assert "rb@r2" not in pool.exports()
    assert_image(copy_out(pool, "rb", tmp_path / "v.img"), at_r1, "the volume rolled back to rb@r1")
    assert_space_sane(pool, "rb", "after rollback --destroy-newer")

    pool.restart()
    pool.load_key("rb", key)
    assert snap_names(pool, "rb") == ["rb@r1"]
    assert_image(copy_out(pool, "rb", tmp_path / "v.img"), at_r1, "the rolled-back volume after a restart")
    assert_image(copy_out(pool, "rb@r1", tmp_path / "s.img"), at_r1, "rb@r1 after a restart")


def test_refused_rollback_destroys_nothing(make_pool, tmp_path, seed):
    """A rollback with --destroy-newer past a snapshot that has a clone is refused, and the
    refusal changes nothing: every snapshot stays, the volume reads as before (the tester's
    case: h@s1, h@s2 with clone c, h@s3; 'rollback h@s1 --destroy-newer' destroyed h@s3
    and then refused)."""
    require_tools("qemu-io", "nbdcopy")
    pool = started_pool(make_pool, "single")
    size = 8 * MiB
    key = pool.create_volume("h", size="8M")
    rng = random.Random(seed)
    img = Image(size)
    frozen = {}
    for i, snap in enumerate(("s1", "s2", "s3")):
        with NbdShell(pool.uri("h")) as sh:
            write_random(sh, img, rng, i * MiB, 2 * MiB)
        frozen[snap] = img.freeze()
        pool.wait_detached("h")
        pool.cli("snapshot", "create", f"h@{snap}")
    with NbdShell(pool.uri("h")) as sh:
        write_random(sh, img, rng, 5 * MiB, MiB)
    current = img.freeze()
    pool.wait_detached("h")
    pool.cli("volume", "clone", "h@s2", "c", "--key-file", key)

    cli_refused(pool, "volume", "rollback", "--destroy-newer", "h@s1", mentions=("h@s2", "clones", "c"))
    assert snap_names(pool, "h") == ["h@s1", "h@s2", "h@s3"], \
        f"a refused rollback changed the snapshots: {snap_names(pool, 'h')}"
    assert_image(copy_out(pool, "h", tmp_path / "v.img"), current, "h after a refused rollback")
    for snap in ("s1", "s2", "s3"):
        assert_image(copy_out(pool, f"h@{snap}", tmp_path / f"{snap}.img"), frozen[snap],
                     f"h@{snap} after a refused rollback")
    assert_image(copy_out(pool, "c", tmp_path / "c.img"), frozen["s2"], "the clone after a refused rollback")
    for name in ("h", "h@s1", "h@s2", "h@s3", "c"):
        pool.wait_detached(name)

    # Once the clone is gone the same command goes ahead and says what it destroyed.
    pool.cli("volume", "destroy", "c")
    r = pool.cli("volume", "rollback", "--destroy-newer", "h@s1")
    assert "h@s2" in r.stdout and "h@s3" in r.stdout, r.stdout
    assert snap_names(pool, "h") == ["h@s1"]
    assert_image(copy_out(pool, "h", tmp_path / "v.img"), frozen["s1"], "h rolled back to h@s1")
    assert_space_sane(pool, "h", "after rollback --destroy-newer past two snapshots")
    pool.restart()
    pool.load_key("h", key)
    assert_image(copy_out(pool, "h", tmp_path / "v.img"), frozen["s1"], "h rolled back, after a restart")


# --------------------------------------------------------------------------
# 5. holds, busy snapshots, destroy -r


def test_holds_and_recursive_destroy(make_pool, tmp_path):
    require_tools("qemu-io", "nbdinfo")
    pool = started_pool(make_pool, "mirror:2")
    empty_used = pool.status()["space"]["used_bytes"]
    pool.create_volume("h", size="64M", encryption=False)
    qemu_io_ok(pool.uri("h"), "write -P 0x31 0 8M")
    pool.cli("snapshot", "create", "h@a")
    qemu_io_ok(pool.uri("h"), "write -P 0x32 0 4M")
    pool.cli("snapshot", "create", "h@b")
    pool.create_volume("other", size="16M", encryption=False)
    pool.cli("snapshot", "create", "other@x")
    assert snap_names(pool) == ["h@a", "h@b", "other@x"] or snap_names(pool) == ["other@x", "h@a", "h@b"], \
        f"`snapshot list` must list every volume's snapshots, oldest first per volume: {snap_names(pool)}"
    assert snap_names(pool, "h") == ["h@a", "h@b"], snapshots(pool, "h")

    pool.cli("snapshot", "hold", "h@a", "backup")
    # zfs's order (`zfs hold TAG SNAP`) is taken too.
    r = pool.cli("snapshot", "hold", "legal", "h@a")
    assert r.stdout == "held h@a (legal)\n", r.stdout
    assert snapshots(pool, "h")[0]["holds"] == ["backup", "legal"], snapshots(pool, "h")
    cli_refused(pool, "snapshot", "hold", "h@a", "backup", mentions=("backup",))
    cli_refused(pool, "snapshot", "destroy", "h@a", mentions=("held", "backup"))
    pool.cli("snapshot", "release", "h@a", "backup")
    cli_refused(pool, "snapshot", "destroy", "h@a", mentions=("held", "legal"))
    cli_refused(pool, "snapshot", "release", "h@a", "backup", mentions=("backup",))
    assert snap_names(pool, "h") == ["h@a", "h@b"]
    qemu_io_ro(pool.uri("h@a"), "read -P 0x31 0 8M")

    # A volume with snapshots: with -r refused while one is held; without -r
    # refused, naming its snapshots and -r.
    cli_refused(pool, "volume", "destroy", "-r", "h", mentions=("h@a", "held"))
    pool.cli("snapshot", "release", "h@a", "legal")
    assert snapshots(pool, "h")[0]["holds"] == []
    cli_refused(pool, "volume", "destroy", "h", mentions=("h@a", "h@b", "-r"))
    assert snap_names(pool, "h") == ["h@a", "h@b"]

    # A snapshot with an NBD client is not destroyed under it.
    with NbdShell(pool.uri("h@b")) as sh:
        assert sh.read(0, BS) == b"\x32" * BS
        cli_refused(pool, "snapshot", "destroy", "h@b", mentions=("in use",))
        cli_refused(pool, "volume", "destroy", "-r", "h", mentions=("in use",))
        assert sh.read(4 * MiB, BS) == b"\x31" * BS, "h@b changed while a destroy was refused"
    pool.wait_detached("h@b")
    assert snap_names(pool, "h") == ["h@a", "h@b"]

    # Now -r takes the volume and its snapshots, and the pool gets the space back.
    r = pool.cli("volume", "destroy", "-r", "h")
    assert "destroyed" in r.stdout, r.stdout
    assert snap_names(pool) == ["other@x"], f"destroy -r h left: {snap_names(pool)}"
    assert not [e for e in pool.exports() if e.startswith("h")], pool.exports()
    assert [v for v in json.loads(pool.cli("volume", "list", "--json").stdout) if v["name"] == "h"] == []
    r = run(["nbdinfo", pool.uri("h@a")], check=False)
    assert r.returncode != 0, "a snapshot of a destroyed volume can still be opened"
    used = pool.status()["space"]["used_bytes"]
    assert used < empty_used + 1 * MiB, \
        f"the pool uses {used} bytes after destroying h and its snapshots (empty: {empty_used}; " \
        f"h held 8 MiB, other nothing)"


# --------------------------------------------------------------------------
# 6. a crash at every step

# (operation, crash point, what a restart must find: "old", "new" or "either").
# A point with ":N" crashes the Nth time it is reached: snapshot destroy and
# volume rollback commit once before they change anything and once after.
CRASHES = [
    ("create", "commit.nodes_written", "either"),
    ("create", "commit.flushed", "either"),
    ("create", "commit.superblocks_written", "new"),
    ("destroy", "commit.flushed", "either"),
    ("destroy", "commit.superblocks_written", "either"),
    ("destroy", "snapshot.destroy.released", "either"),
    ("destroy", "commit.flushed:2", "either"),
    ("destroy", "commit.superblocks_written:2", "new"),
    ("rollback", "commit.superblocks_written", "either"),
    ("rollback", "rollback.released", "either"),
    ("rollback", "commit.superblocks_written:2", "new"),
]


@pytest.mark.parametrize("op,point,outcome", CRASHES, ids=[f"{o}-{p}" for o, p, _ in CRASHES])
def test_crash_at_every_step(make_pool, tmp_path, seed, op, point, outcome):
    require_tools("qemu-io", "nbdcopy")
    layout = "mirror:2" if op == "destroy" else "single"
    encrypted = op != "rollback"
    pool = started_pool(make_pool, layout)
    size = 16 * MiB
    key = pool.create_volume("c", size="16M", encryption=encrypted, compression="off")
    rng = random.Random(seed)
    img = Image(size)
    with NbdShell(pool.uri("c")) as sh:
        write_random(sh, img, rng, 0, 4 * MiB)
    at_s1 = img.freeze()
    pool.cli("snapshot", "create", "c@s1")
    with NbdShell(pool.uri("c")) as sh:
        write_random(sh, img, rng, 1 * MiB, 2 * MiB)
    discard(pool, "c", img, 3 * MiB + 512 * KiB, 512 * KiB)
    at_s2 = img.freeze()
    pool.cli("snapshot", "create", "c@s2")
    with NbdShell(pool.uri("c")) as sh:
        write_random(sh, img, rng, 0, 512 * KiB)
        write_random(sh, img, rng, 5 * MiB, 1 * MiB)
    current = img.freeze()
    snaps_before = snapshots(pool, "c")
    space_before = space(pool, "c")

    # The daemon alone gets BULWARK_CRASH_AT; nothing is dirty when it starts,
    # so the operation's own commits are the first it makes.
    pool.stop()
    pool.start(env={"BULWARK_CRASH_AT": point})
    if encrypted:
        pool.load_key("c", key)
    args = {"create": ["snapshot", "create", "c@s3"],
            "destroy": ["snapshot", "destroy", "c@s1"],
            "rollback": ["volume", "rollback", "--destroy-newer", "c@s1"]}[op]
    r = pool.cli(*args, check=False)
    assert r.returncode != 0, f"`bulwark {' '.join(args)}` succeeded although the daemon was to crash at " \
                              f"{point}:\n{r.stdout}\n{pool.log_tail()}"
    try:
        rc = pool.proc.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the daemon did not crash at {point}:\n{pool.log_tail()}")
    pool.kill()
    assert rc == -signal.SIGABRT, f"the daemon exited {rc}, not by the crash point\n{pool.log_tail()}"
    name, _, nth = point.partition(":")
    assert f"BULWARK_CRASH_AT={name}:{nth or 1}: aborting here" in pool.log_tail(), \
        f"the daemon died, but not at {point}:\n{pool.log_tail()}"

    pool.start()
    if encrypted:
        pool.load_key("c", key)
    names = snap_names(pool, "c")
    vol = copy_out(pool, "c", tmp_path / "v.img")

    def read(name):
        return copy_out(pool, name, tmp_path / "s.img")

    if op == "create":
        assert_image(vol, current, "the volume after a crash during snapshot create")
        assert_image(read("c@s1"), at_s1, "c@s1 after a crash during snapshot create")
        assert_image(read("c@s2"), at_s2, "c@s2 after a crash during snapshot create")
        happened = names == ["c@s1", "c@s2", "c@s3"]
        assert happened or names == ["c@s1", "c@s2"], f"snapshots after the crash: {names}"
        if happened:
            assert_image(read("c@s3"), current, "c@s3, taken as the daemon crashed")
    elif op == "destroy":
        assert_image(vol, current, "the volume after a crash during snapshot destroy")
        assert_image(read("c@s2"), at_s2, "c@s2 after a crash while c@s1 was destroyed")
        happened = names == ["c@s2"]
        assert happened or names == ["c@s1", "c@s2"], f"snapshots after the crash: {names}"
        if not happened:
            assert_image(read("c@s1"), at_s1, "c@s1, whose destroy crashed")
    else:
        happened = names == ["c@s1"]
        assert happened or names == ["c@s1", "c@s2"], f"snapshots after the crash: {names}"
        assert_image(read("c@s1"), at_s1, "c@s1 after a crash during rollback")
        if happened:
            assert_image(vol, at_s1, "the volume after a crash during a rollback that took effect "
                                     "(c@s2 is gone): it must be c@s1, whole")
        else:
            assert_image(vol, current, "the volume after a crash during a rollback that did not take "
                                       "effect (c@s2 is still there): it must be as before, whole")
            assert_image(read("c@s2"), at_s2, "c@s2 after a crash during rollback")
    print(f"{op} crashed at {point}: after restart the {'new' if happened else 'old'} state")
    if outcome != "either":
        assert happened == (outcome == "new"), \
            f"a crash at {point} must leave the {outcome} state; snapshots: {names}"

    # The numbers are consistent, and exactly the old ones or the new ones.
    sp, snaps = assert_space_sane(pool, "c", f"after a crash at {point} and a restart")
    if not happened:
        assert snaps == snaps_before and sp == space_before, \
            f"the operation did not happen, but the numbers changed: {snaps_before} {space_before} -> {snaps} {sp}"
    elif op == "destroy":
        assert sp["used_bytes"] == space_before["used_bytes"] - snaps_before[0]["used_bytes"], \
            f"c@s1 (USED {snaps_before[0]['used_bytes']}) destroyed: volume USED {space_before} -> {sp}"
    elif op == "create":
        assert snaps[-1]["referenced_bytes"] == sp["referenced_bytes"] and sp["written_bytes"] == 0, (snaps, sp)

    # And the operation works now, without a crash.
    pool.wait_detached("c")
    for s in ("c@s1", "c@s2", "c@s3"):
        pool.wait_detached(s)
    if op == "create":
        pool.cli("snapshot", "create", "c@again")
        assert_image(read("c@again"), current, "a snapshot taken after the restart")
    elif op == "destroy":
        for name in snap_names(pool, "c"):
            used = {s["name"]: s["used_bytes"] for s in snapshots(pool, "c")}[name]
            before = space(pool, "c")["used_bytes"]
            r = pool.cli("snapshot", "destroy", name)
            assert f"freed {format_size(used)}" in r.stdout and space(pool, "c")["used_bytes"] == before - used, \
                f"destroying {name} (USED {used}) after the restart: {r.stdout.strip()}, volume USED " \
                f"{before} -> {space(pool, 'c')['used_bytes']}"
        sp = space(pool, "c")
        assert sp["used_bytes"] == sp["referenced_bytes"] and sp["used_by_snapshots_bytes"] == 0, sp
    else:
        pool.cli("volume", "rollback", "--destroy-newer", "c@s1")
        assert_image(copy_out(pool, "c", tmp_path / "v.img"), at_s1, "a second rollback after the restart")
        assert snap_names(pool, "c") == ["c@s1"]
    assert_space_sane(pool, "c", "after the operation was done again")
