"""Helpers shared by the self-healing scenarios (scrub, repair, device loss,
fault injection): the layouts they run over, pools started with fault
injection, `scrub --wait`, damage applied to device files with the daemon
stopped, finding where a data block lives on the devices, and an NBD client
(tests/helpers/nbd_shell.py) a test can drive one request at a time.

What this module knows of the on-disk format is only what docs/format.md
promises users: labels live in the first and last MiB of every device, and a
record sits at the same device offset on every member (mirror: whole copies;
parity:K+M: K data shards of ceil(len/K) bytes, 16-aligned, and M parity
shards).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import HELPERS, KiB, MiB, Pool, nbd_python, run_helper

BLOCK = 4 * KiB
# Labels (superblock slots) live in the first MiB and the last MiB; stay
# clear of both, with room to spare at the back.
FRONT_RESERVED = 1 * MiB
BACK_RESERVED = 2 * MiB


@dataclass(frozen=True)
class Layout:
    name: str
    devices: int
    # Devices that may fail or lie at once without losing data.
    tolerance: int
    # Data shards per record (1 for mirrors).
    k: int

    def shard_bytes(self, record_len: int) -> int:
        """Bytes of the record on each device (a whole copy for a mirror)."""
        if self.k == 1:
            return record_len
        per = -(-record_len // self.k)
        return -(-per // 16) * 16


_LAYOUTS = {
    "mirror:2": Layout("mirror:2", 2, 1, 1),
    "mirror:3": Layout("mirror:3", 3, 2, 1),
    "parity:2+1": Layout("parity:2+1", 3, 1, 2),
    "parity:4+2": Layout("parity:4+2", 6, 2, 4),
}

# "For every layout": parametrize a test with `@pytest.mark.parametrize("layout", LAYOUTS)`.
LAYOUTS = [pytest.param(_LAYOUTS[n], id=n.replace(":", "").replace("+", "p")) for n in _LAYOUTS]


def heal_pool(make_pool, layout: Layout, device_size: str = "64M", *serve_args,
              faults: bool = True) -> Pool:
    """A created, started pool of `layout` (fault injection allowed unless faults=False)."""
    args = (["--allow-fault-injection"] if faults else []) + list(serve_args)
    p = make_pool(layout=layout.name, devices=layout.devices, device_size=device_size,
                  serve_args=args)
    return p.create().start()


# --------------------------------------------------------------------------
# scrub


def scrub_status(pool: Pool) -> dict:
    r = pool.cli("scrub", "status", "--json")
    return json.loads(r.stdout)


def scrub_wait(pool: Pool, *args, expect_rc: int | None = 0, timeout=300):
    """`bulwark scrub --wait` (or `scrub ARGS --wait`); returns (result, scrub status after).

    expect_rc None accepts any exit code."""
    cmd = [*args, "--wait"] if args else ["scrub", "--wait"]
    r = pool.cli(*cmd, check=False, timeout=timeout)
    if expect_rc is not None and r.returncode != expect_rc:
        pytest.fail(f"bulwark {' '.join(cmd)} exited {r.returncode}, expected {expect_rc}\n"
                    f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}\n{pool.log_tail()}")
    return r, scrub_status(pool)


def assert_clean_scrub(pool: Pool, what: str) -> dict:
    """A scrub that finds nothing to repair and nothing unrecoverable."""
    r, s = scrub_wait(pool)
    assert s["state"] == "finished", f"{what}: {s}"
    assert (s["repaired"], s["unrecoverable"]) == (0, 0), \
        f"{what}: the scrub should find nothing: {s}\n{r.stdout}"
    assert "repaired 0 in" in r.stdout and "with 0 errors" in r.stdout, r.stdout
    return s


def device_state(pool: Pool, path: str) -> str:
    for d in pool.status()["devices"]:
        if d["path"] == path:
            return d["state"]
    raise AssertionError(f"device {path} not in status")


# --------------------------------------------------------------------------
# device files (daemon stopped)


def data_bounds(path) -> tuple[int, int]:
    """The byte range of a device file where records may live, labels excluded."""
    return FRONT_RESERVED, os.path.getsize(path) - BACK_RESERVED


def data_extents(path):
    """(start, end) ranges of a sparse device file that hold data, inside data_bounds."""
    lo_lim, hi_lim = data_bounds(path)
    size = os.path.getsize(path)
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
    """Offsets of unit-aligned units inside data_bounds that are not all zero."""
    lo_lim, hi_lim = data_bounds(path)
    offs = []
    with open(path, "rb") as f:
        for s, e in data_extents(path):
            off = max(s - s % unit, -(-lo_lim // unit) * unit)
            while off < e and off + unit <= hi_lim:
                if not offs or off > offs[-1]:
                    f.seek(off)
                    if f.read(unit).count(0) != unit:
                        offs.append(off)
                off += unit
    return offs


def flip(path, offsets):
    """Invert one byte at each offset, durably."""
    lo, hi = data_bounds(path)
    with open(path, "r+b") as f:
        for off in offsets:
            assert lo <= off < hi, f"refusing to damage {path} at {off}: outside the data area"
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


def scatter_damage(path, rng: random.Random, unit=64 * KiB, fraction=1.0) -> list[int]:
    """Flip one random byte in `fraction` of the non-zero `unit`s of a device file."""
    units = nonzero_units(path, unit)
    assert units, f"no data on {path}"
    chosen = units if fraction >= 1.0 else rng.sample(units, max(1, int(len(units) * fraction)))
    offs = sorted(u + rng.randrange(unit) for u in chosen)
    flip(path, offs)
    return offs


def load_data(path):
    """[(start, bytes)] of the data extents inside data_bounds of a device file."""
    out = []
    with open(path, "rb") as f:
        for s, e in data_extents(path):
            f.seek(s)
            out.append((s, f.read(e - s)))
    return out


def find_all(data, needle):
    found = []
    for s, buf in data:
        i = buf.find(needle)
        while i != -1:
            found.append(s + i)
            i = buf.find(needle, i + 1)
    return found


def pattern_block(token: bytes, i: int) -> bytes:
    """4 KiB that name their token, block and position in every 32-byte unit:
    any piece of 32 bytes or more is found in one place only."""
    return b"".join(b"%s:%07d:%03d|" % (token, i, j) for j in range(BLOCK // 32))


def pattern_image(token: bytes, nblocks: int) -> bytes:
    return b"".join(pattern_block(token, i) for i in range(nblocks))


def new_token(rng: random.Random) -> bytes:
    token = b"T%018x" % rng.getrandbits(72)
    assert len(b"%s:%07d:%03d|" % (token, 0, 0)) == 32
    return token


def locate_blocks(layout: Layout, devices, token: bytes, blocks) -> dict[int, list[int]]:
    """Device offsets where each plain (uncompressed, unencrypted) pattern
    block's record starts: where its first 32 bytes are, on whichever device
    holds them. The record occupies [X, X + shard) on every device."""
    wanted = set(blocks)
    where = {i: set() for i in wanted}
    unit0 = re.compile(re.escape(token) + rb":(\d{7}):000\|")
    for d in devices:
        for start, buf in load_data(d):
            for m in unit0.finditer(buf):
                i = int(m.group(1))
                if i in wanted:
                    where[i].add(start + m.start())
    return {i: sorted(offs) for i, offs in where.items()}


# --------------------------------------------------------------------------
# NBD


def write_file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def check_export(pool: Pool, name: str, expected: Path, chunk: int = 64 * KiB) -> dict:
    r = run_helper("nbd_check.py", pool.uri(name), expected, str(chunk), timeout=300)
    return json.loads(r.stdout)


def assert_export_equals(pool: Pool, name: str, expected: Path, what: str, chunk=64 * KiB):
    res = check_export(pool, name, expected, chunk)
    assert res["ok"] == res["chunks"], \
        f"{what}: volume {name} differs from what was written: {res}\n{pool.log_tail()}"


class NbdError(Exception):
    def __init__(self, errno_: int, message: str):
        super().__init__(f"{errno.errorcode.get(errno_, errno_)}: {message}")
        self.errno = errno_


class NbdShell:
    """One NBD connection (libnbd, in a helper process), one request at a time."""

    def __init__(self, uri: str):
        self.proc = subprocess.Popen([nbd_python(), str(HELPERS / "nbd_shell.py"), uri],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._expect_ok()

    def _line(self) -> bytes:
        line = self.proc.stdout.readline()
        if not line:
            raise NbdError(errno.EPIPE, "the NBD helper exited")
        return line.rstrip(b"\n")

    def _expect_ok(self) -> bytes:
        line = self._line()
        if line.startswith(b"ERR"):
            _, code, *msg = line.split(b" ", 2) + [b""]
            raise NbdError(int(code), b" ".join(msg).decode(errors="replace"))
        assert line.startswith(b"OK"), line
        return line

    def _send(self, line: bytes, data: bytes = b""):
        try:
            self.proc.stdin.write(line + b"\n" + data)
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise NbdError(errno.EPIPE, "the NBD helper exited")

    def write(self, off: int, data: bytes, fua=False):
        self._send(b"W %d %d%s" % (off, len(data), b" fua" if fua else b""), data)
        self._expect_ok()

    def read(self, off: int, n: int) -> bytes:
        self._send(b"R %d %d" % (off, n))
        line = self._expect_ok()
        n = int(line.split()[1])
        return self.proc.stdout.read(n)

    def flush(self):
        self._send(b"F")
        self._expect_ok()

    def hashes(self, off: int, n: int, chunk: int) -> list:
        """Per chunk: sha256 hex, or ["ERR", errno]."""
        self._send(b"H %d %d %d" % (off, n, chunk))
        self._expect_ok()
        return json.loads(self._line())

    def size(self) -> int:
        self._send(b"Z")
        return int(self._expect_ok().split()[1])

    def close(self):
        if self.proc.poll() is None:
            try:
                self._send(b"Q")
            except NbdError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
