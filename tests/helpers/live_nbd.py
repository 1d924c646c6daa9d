#!/usr/bin/python3
"""The live run through the daemon: `bulwark serve` and real NBD clients.

`bulwark-live` (crates/sim) checks the engine on its real threads; this
checks the whole daemon path the tester's lost write went through: libnbd
connections, several requests in flight on each (the NBD server runs them
on several threads), the control socket's commands between them, and
`kill -9`. Every read is compared with what the clients were told.

It makes its own pool in --dir, starts the daemon with --bin, and runs for
--seconds:
- volumes: `lf`, encrypted, filled at the start and overwritten; `lh`, an
  encrypted thin volume of --huge bytes (1E by default) written in islands
  spread over all of it; `lp`, encrypted, 8 KiB blocks written a 4 KiB half
  at a time, the halves of every other block by two connections;
- per volume --conns connections (writers), each with up to 8 requests in
  flight on cells it owns: writes of 1-4 cells (some FUA), trims, zeroes,
  reads, FLUSHes;
- one operator thread: `key unload` / `key load` (the volume's writers
  disconnect first; after the load the whole volume is read back at once,
  the tester's sequence), snapshots with known contents read back over NBD,
  clones of them read, written and destroyed, rollbacks to the newest
  snapshot, `key rotate`, `scrub`, `volume resize`, and with --kill a
  SIGKILL of the daemon under the writers, a restart, and a check of every
  cell against what FLUSH and FUA answers made durable.
At the end every cell of every volume and kept snapshot is read, then again
after a clean restart.

A cell's value is a tag unique to the run, rising over time, so a read of
an older acknowledged value is named as a lost write, apart from torn or
misplaced bytes. Exit 0: no violation; 1: violations (the pool directory is
kept); 2: the run could not be set up. A JSON summary goes to stdout.

    /usr/bin/python3 tests/helpers/live_nbd.py --bin target/release/bulwark \\
        --dir /tmp/lnbd --layout mirror --seconds 60 --seed 7 --kill
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbd

CELL = 4096
HDR = struct.Struct("<4sHHQQ")  # magic, volume id, 0, cell index, tag
MAGIC = b"LNBD"
ZERO = 0  # the value of a cell never written, trimmed or zeroed
MAX_VIOLATIONS = 20
IN_USE_RETRY_S = 10.0
HANG_S = 120
LAYOUTS = {
    "single": ("single", 1, "256M", False),
    "mirror": ("mirror:2", 2, "256M", False),
    "parity": ("parity:2+1", 3, "128M", False),
    "log": ("single", 1, "256M", True),
}
TAGS = itertools.count(1)


def cell_bytes(vid: int, index: int, tag: int) -> bytes:
    head = HDR.pack(MAGIC, vid, 0, index, tag)
    return head + hashlib.shake_128(head).digest(CELL - HDR.size)


def decode(buf, vid: int, index: int):
    """(tag, None) or (None, what is wrong with the bytes)."""
    b = bytes(buf)
    if b.count(0) == CELL:
        return ZERO, None
    try:
        magic, v, _, i, tag = HDR.unpack_from(b)
    except struct.error:
        return None, "short"
    if magic != MAGIC:
        return None, "garbage (no cell header)"
    if b[HDR.size:] != hashlib.shake_128(b[:HDR.size]).digest(CELL - HDR.size):
        return None, f"torn (header of volume {v} cell {i} tag {tag}, body not its own)"
    if (v, i) != (vid, index):
        return None, f"misplaced: holds volume {v} cell {i} tag {tag}"
    return tag, None


class Bufs:
    """`nbd.Buffer`s kept for reuse. libnbd 1.14's Python binding keeps alive every
    Buffer an aio command used (measured: 80 MiB more after 20,000 4 KiB writes with
    fresh Buffers, none with reused ones), so a minute's run grew to 2 GiB."""

    def __init__(self):
        self.free = {}

    def take(self, n: int, data=None):
        kept = self.free.get(n)
        b = kept.pop() if kept else nbd.Buffer(n)
        if data is not None:
            b.to_buffer()[:] = data
        return b

    def give(self, b):
        if b is not None:
            self.free.setdefault(b.size(), []).append(b)


class Skipped(Exception):
    """An operator's command refused in a way --in-use-ok lets pass."""


class Cell:
    __slots__ = ("cur", "maybe", "dur", "since")

    def __init__(self, value=ZERO):
        self.cur = value  # the last acknowledged value
        self.maybe = []  # values of writes that failed since: on the disk or not
        self.dur = value  # the last value a FLUSH or FUA answer made durable
        self.since = []  # values sent after `dur` (a crash may leave any of them)


class Volume:
    def __init__(self, run, vid, name, size, cells, block, owner):
        self.run, self.vid, self.name, self.size = run, vid, name, size
        self.block = block
        self.offsets = cells  # cell index -> byte offset
        self.cells = [Cell() for _ in cells]
        self.owner = owner  # cell index -> writer number
        self.key = run.dir / f"{name}.key"
        self.snaps = []  # (name, [value per cell]), oldest first
        # kept clones: (name, snapshot, [value per cell], key file, independent)
        self.clones = []
        self.lock = threading.Condition()
        self.pause = 0  # operator wants the writers stopped; 2: disconnected too
        self.paused = 0
        self.writers = []
        self.snap_seq = 0

    def uri(self, export=None):
        return f"nbd+unix:///{export or self.name}?socket={self.run.pool / 'nbd.sock'}"

    # --- the operator's side of the gate
    def hold(self, disconnect: bool):
        with self.lock:
            self.pause = 2 if disconnect else 1
            self.lock.notify_all()
            while self.paused < len(self.writers) and not self.run.stop.is_set():
                self.lock.wait(0.1)
            if self.paused < len(self.writers):
                # The run stopped (a hang) with writers still in their requests: no
                # command that needs them gone may run.
                self.pause = 0
                raise Skipped()

    def release(self):
        with self.lock:
            self.pause = 0
            self.lock.notify_all()


class Writer(threading.Thread):
    def __init__(self, vol: Volume, n: int, seed: int):
        super().__init__(daemon=True, name=f"{vol.name}-w{n}")
        self.vol, self.n = vol, n
        self.rng = random.Random(seed)
        self.mine = [i for i in range(len(vol.offsets)) if vol.owner(i) == n]
        self.dirty = set()
        self.pending = []
        self.bufs = Bufs()
        self.h = None

    def disconnect(self):
        if self.h is not None:
            try:
                self.h.shutdown()
            except nbd.Error:
                pass
            self.h = None

    def gate(self) -> bool:
        """Wait while the operator holds the volume; False when the run stops."""
        v = self.vol
        run = v.run
        with v.lock:
            if v.pause or not run.up.is_set():
                if v.pause == 2 or not run.up.is_set():
                    self.disconnect()
                v.paused += 1
                v.lock.notify_all()
                while (v.pause or not run.up.is_set()) and not run.stop.is_set():
                    v.lock.wait(0.1)
                    if v.pause == 2:
                        self.disconnect()
                v.paused -= 1
        return not run.stop.is_set()

    def connect(self) -> bool:
        h = nbd.NBD()
        try:
            h.connect_uri(self.vol.uri())
        except nbd.Error as e:
            self.vol.run.count("connect refused")
            self.vol.run.note_refusal(self.vol, "connect", str(e))
            time.sleep(0.01)
            return False
        self.h = h
        return True

    def run(self):
        try:
            while self.gate():
                if self.h is None and not self.connect():
                    continue
                try:
                    self.batch()
                except nbd.Error as e:
                    # The connection failed (the daemon was killed, or closed it): what was
                    # in flight may or may not have been done.
                    self.unknown()
                    self.vol.run.count("connection lost")
                    if self.vol.run.up.is_set() and not self.vol.pause:
                        self.vol.run.note_refusal(self.vol, "batch", str(e))
                    self.disconnect()
        except Exception as e:  # a harness bug must not pass for a quiet run
            self.vol.run.violation(f"{self.name}: harness error {e!r}")
            raise

    def unknown(self):
        for kind, cells, tags, _fua, _ck, _buf in self.pending:
            if kind != "read":
                for c, t in zip(cells, tags):
                    self.vol.cells[c].maybe.append(t)
                    self.dirty.add(c)
        self.pending = []

    def batch(self):
        v, rng, run = self.vol, self.rng, self.vol.run
        h = self.h
        used = set()
        ops = self.pending = []
        for _ in range(rng.randint(1, 8)):
            i = rng.choice(self.mine)
            if i in used:
                continue
            # a run of up to 4 cells of this writer, contiguous on the volume
            cells = [i]
            while (len(cells) < 4 and rng.random() < 0.4 and cells[-1] + 1 < len(v.offsets)
                   and v.owner(cells[-1] + 1) == self.n and cells[-1] + 1 not in used
                   and v.offsets[cells[-1] + 1] == v.offsets[cells[-1]] + CELL):
                cells.append(cells[-1] + 1)
            used.update(cells)
            off = v.offsets[cells[0]]
            r = rng.random()
            if r < 0.62:
                fua = rng.random() < 0.05
                tags = [next(TAGS) for _ in cells]
                data = b"".join(cell_bytes(v.vid, c, t) for c, t in zip(cells, tags))
                for c, t in zip(cells, tags):
                    v.cells[c].since.append(t)
                flags = nbd.CMD_FLAG_FUA if fua else 0
                buf = self.bufs.take(len(data), data)
                ck = h.aio_pwrite(buf, off, flags=flags)
                ops.append(("write", cells, tags, fua, ck, buf))
            elif r < 0.82:
                buf = self.bufs.take(CELL * len(cells))
                ck = h.aio_pread(buf, off)
                ops.append(("read", cells, None, False, ck, buf))
            elif r < 0.92:
                # A cell another connection owns: the server says CAN_MULTI_CONN, so what
                # that connection was told is done before this read is sent must show.
                f = rng.randrange(len(v.offsets))
                if v.owner(f) == self.n or f in used:
                    continue
                used.add(f)
                cell = v.cells[f]
                floor = (cell.cur, tuple(cell.maybe))
                buf = self.bufs.take(CELL)
                ck = h.aio_pread(buf, v.offsets[f])
                ops.append(("foreign", [f], floor, False, ck, buf))
            else:
                kind = "trim" if r < 0.96 else "zero"
                for c in cells:
                    v.cells[c].since.append(ZERO)
                if kind == "trim":
                    ck = h.aio_trim(CELL * len(cells), off)
                else:
                    ck = h.aio_zero(CELL * len(cells), off)
                ops.append((kind, cells, [ZERO] * len(cells), False, ck, None))
        sent = time.monotonic()
        while h.aio_in_flight() > 0:
            h.poll(1000)
            if time.monotonic() - sent > HANG_S and run.up.is_set():
                run.violation(f"{v.name}: requests unanswered after {HANG_S} s (a hang)")
                run.stop.set()
                return
        self.pending = []
        for kind, cells, tags, fua, ck, buf in ops:
            self.bufs.give(buf)  # its command is done: its bytes are read below, first
            try:
                h.aio_command_completed(ck)
                ok, err = True, None
            except nbd.Error as e:
                ok, err = False, e
            if kind == "read":
                if not ok:
                    if run.up.is_set():
                        run.violation(f"{v.name}: read of cells {cells} failed: {err}")
                    continue
                data = buf.to_bytearray()
                for k, c in enumerate(cells):
                    run.check_read(v, c, data[k * CELL:(k + 1) * CELL], "read")
                run.count("reads checked", len(cells))
                continue
            if kind == "foreign":
                if not ok:
                    if run.up.is_set():
                        run.violation(f"{v.name}: read of cell {cells[0]} failed: {err}")
                    continue
                run.check_foreign(v, cells[0], buf.to_bytearray(), *tags)
                run.count("reads of other connections' cells")
                continue
            for c, t in zip(cells, tags):
                cell = v.cells[c]
                if ok and kind == "trim":
                    # NBD leaves a trimmed range's contents to the server: bulwark
                    # reads zeroes after a whole block's trim and ignores part of one.
                    cell.maybe = [cell.cur, *cell.maybe]
                    cell.cur = ZERO
                    self.dirty.add(c)
                elif ok:
                    cell.cur = t
                    cell.maybe.clear()
                    if fua:
                        cell.dur, cell.since = t, []
                    else:
                        self.dirty.add(c)
                else:
                    cell.maybe.append(t)
                    self.dirty.add(c)
            if ok:
                run.count(kind + "s")
            else:
                run.count(kind + " refused")
                if "ENOSPC" not in str(err) and run.up.is_set():  # a full pool's answer
                    run.note_refusal(v, kind, str(err))
        if rng.random() < 0.12:
            h.flush()
            for c in self.dirty:
                cell = v.cells[c]
                cell.dur = cell.cur
                cell.since = list(cell.maybe)
            self.dirty.clear()
            run.count("flushes")


class Run:
    def __init__(self, a):
        self.a = a
        self.dir = Path(a.dir)
        self.pool = self.dir / "pool"
        self.bin = str(Path(a.bin).resolve())
        self.rng = random.Random(a.seed)
        self.stop = threading.Event()
        self.up = threading.Event()
        self.mu = threading.Lock()
        self.counts = {}
        self.violations = []
        self.refusals = []
        self.proc = None
        self.starts = 0
        self.env = dict(os.environ, BULWARK_REGISTRY=str(self.dir / "registry.json"),
                        BULWARK_POOL=str(self.pool))
        self.vols = []
        self.independent = False  # whether `volume clone` takes --independent (setup)

    # --- bookkeeping
    def count(self, what, n=1):
        with self.mu:
            self.counts[what] = self.counts.get(what, 0) + n

    def violation(self, what):
        with self.mu:
            self.violations.append(what)
            print(f"VIOLATION: {what}", file=sys.stderr, flush=True)
            if len(self.violations) >= MAX_VIOLATIONS:
                self.stop.set()

    def note_refusal(self, vol, what, msg):
        with self.mu:
            if len(self.refusals) < 50:
                self.refusals.append(f"{vol.name} {what}: {msg}")

    def check_read(self, v: Volume, c: int, buf, where: str, expect=None):
        tag, bad = decode(buf, v.vid, c)
        cell = v.cells[c]
        if bad:
            self.violation(f"{v.name} cell {c} ({where}): {bad}; expected {cell.cur}")
            return
        if expect is not None:
            if tag not in expect:
                self.violation(f"{v.name} cell {c} ({where}): read {tag}, expected one of "
                               f"{sorted(expect)[:6]}{older(tag, expect)}")
            return
        if tag == cell.cur:
            return
        if tag in cell.maybe:
            cell.cur = tag
            cell.maybe.clear()
            return
        self.violation(f"{v.name} cell {c} ({where}): read {tag}, expected {cell.cur} "
                       f"(or a failed write's {cell.maybe}){older(tag, [cell.cur])}")

    def check_foreign(self, v: Volume, c: int, buf, cur, maybe):
        """A read of a cell another connection writes: the value it was told of before
        this read was sent, or a later one (tags rise; zeroes may be a later trim)."""
        tag, bad = decode(buf, v.vid, c)
        if bad:
            self.violation(f"{v.name} cell {c} (read by another connection): {bad}")
        # (After a trim or zero, `cur` is ZERO and what came before is not known.)
        elif cur != ZERO and tag != ZERO and tag < cur and tag not in maybe:
            self.violation(f"{v.name} cell {c} (read by another connection): read {tag}, "
                           f"older than {cur}, acknowledged before the read was sent (an "
                           f"OLDER value: an acknowledged write lost)")

    # --- the daemon
    def cli(self, *args, check=True, timeout=300):
        r = subprocess.run([self.bin, "--pool", str(self.pool), *map(str, args)],
                           capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"bulwark {' '.join(map(str, args))}: exit {r.returncode}: "
                               f"{r.stderr.strip()}")
        return r

    def start(self):
        self.starts += 1
        log = open(self.dir / f"serve-{self.starts}.log", "wb")
        self.proc = subprocess.Popen([self.bin, "serve", str(self.pool)], stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env)
        log.close()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"bulwark serve exited {self.proc.returncode} at start "
                                   f"(serve-{self.starts}.log)")
            r = self.cli("status", "--json", check=False, timeout=30)
            if r.returncode == 0 and (self.pool / "nbd.sock").exists():
                return
            time.sleep(0.1)
        raise RuntimeError("bulwark serve did not answer status within 120 s")

    def stop_daemon(self):
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(120)
        if rc != 0:
            self.violation(f"bulwark serve exited {rc} after SIGTERM")

    def load_keys(self):
        for v in self.vols:
            self.cli("key", "load", v.name, "--key-file", v.key)
            for cname, _snap, _cm, key, _ind in v.clones:
                self.cli("key", "load", cname, "--key-file", key)

    def with_retry(self, vol, what, *args):
        """A command that refuses a volume in use: the writers have disconnected, so
        'in use' is false; count it and try again for a while."""
        deadline = time.monotonic() + IN_USE_RETRY_S
        while True:
            r = self.cli(*args, check=False)
            if r.returncode == 0:
                return r
            if "in use" in r.stderr and time.monotonic() < deadline:
                self.count(f"{what}: 'in use' with no client")
                time.sleep(0.02)
                continue
            if "in use" in r.stderr and self.a.in_use_ok:
                self.count(f"{what}: 'in use' with no client for {IN_USE_RETRY_S:.0f} s")
                raise Skipped()
            return r

    # --- setup
    def setup(self):
        layout, n, size, log = LAYOUTS[self.a.layout]
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        args = ["pool", "create", str(self.pool), "--layout", layout, "--devices", str(n),
                "--device-size", size]
        if log:
            lp = self.dir / "log.dev"
            with open(lp, "wb") as f:
                f.truncate(64 << 20)
            args += ["--log-device", str(lp)]
        r = subprocess.run([self.bin, *args], capture_output=True, text=True, env=self.env)
        if r.returncode != 0:
            raise RuntimeError(f"pool create: {r.stderr.strip()}")
        r = subprocess.run([self.bin, "volume", "clone", "--help"], capture_output=True,
                           text=True, env=self.env)
        self.independent = "--independent" in r.stdout
        self.start()
        usable = int(self.cli_json("status")["space"]["usable_bytes"])
        fill = (int(usable * self.a.fill) // (1 << 20)) << 20
        w = self.a.conns
        huge = parse_size(self.a.huge)
        island = 32
        stride = (huge // 64) // CELL * CELL
        spec = [
            ("lf", fill, [i * CELL for i in range(fill // CELL)], "4K",
             lambda i: (i // 16) % w),
            ("lh", huge, [k * stride + j * CELL for k in range(64) for j in range(island)], "4K",
             lambda i: (i // 16) % w),
            # the halves of an odd block belong to two connections, of an even one to one
            # (which may send both at once)
            ("lp", 1 << 20, [i * CELL for i in range(256)], "8K",
             lambda i: (i // 2 + (i % 2) * (i // 2 % 2)) % w),
        ]
        for vid, (name, size, offs, block, owner) in enumerate(spec, 1):
            v = Volume(self, vid, name, size, offs, block, owner)
            v.key.write_bytes(os.urandom(32))
            os.chmod(v.key, 0o600)
            self.cli("volume", "create", name, "--size", size, "--encryption", "on",
                     "--key-file", v.key, "--block-size", block)
            self.vols.append(v)
        # lf filled first, with incompressible cells
        lf = self.vols[0]
        h = nbd.NBD()
        h.connect_uri(lf.uri())
        chunk = 256
        for start in range(0, len(lf.offsets), chunk):
            idx = range(start, min(start + chunk, len(lf.offsets)))
            tags = [next(TAGS) for _ in idx]
            h.pwrite(b"".join(cell_bytes(lf.vid, i, t) for i, t in zip(idx, tags)),
                     lf.offsets[start])
            for i, t in zip(idx, tags):
                lf.cells[i].cur = t
                lf.cells[i].since.append(t)
        h.flush()
        for c in lf.cells:
            c.dur, c.since = c.cur, []
        bye(h)
        self.up.set()

    def cli_json(self, *args):
        return json.loads(self.cli(*args, "--json").stdout)

    # --- whole-volume checks
    def verify(self, v: Volume, where: str, export=None, model=None, crash=False):
        """Read every cell of `v` (or of its snapshot `export` against `model`)."""
        h = nbd.NBD()
        try:
            h.connect_uri(v.uri(export))
        except nbd.Error as e:
            self.violation(f"{export or v.name} ({where}): cannot be opened: {e}")
            # said once: a snapshot gone is not looked for again
            v.snaps = [x for x in v.snaps if f"{v.name}@{x[0]}" != export]
            return
        try:
            i = 0
            n = len(v.offsets)
            while i < n:
                j = i + 1
                while j < n and j - i < 256 and v.offsets[j] == v.offsets[j - 1] + CELL:
                    j += 1
                data = h.pread(CELL * (j - i), v.offsets[i])
                for c in range(i, j):
                    piece = data[(c - i) * CELL:(c - i + 1) * CELL]
                    if model is not None:
                        self.check_read(v, c, piece, where, expect=values(model[c]))
                    elif crash:
                        cell = v.cells[c]
                        allowed = {cell.dur, *cell.since, *cell.maybe}
                        tag, bad = decode(piece, v.vid, c)
                        if bad or tag not in allowed:
                            self.check_read(v, c, piece, where, expect=allowed)
                        else:
                            cell.cur = cell.dur = tag
                            cell.since, cell.maybe = [], []
                    else:
                        self.check_read(v, c, piece, where)
                i = j
            self.count("cells verified", n)
        finally:
            bye(h)

    def verify_family(self, v: Volume, where: str):
        """`verify` of `v`, each snapshot kept and each clone kept."""
        self.verify(v, where)
        for name, model in list(v.snaps):
            self.verify(v, f"snapshot {name} {where}", export=f"{v.name}@{name}", model=model)
        for cname, _snap, cm, _key, _ind in v.clones:
            self.verify(v, f"clone {cname} {where}", export=cname, model=cm)

    # --- the operator
    def operator(self):
        rng = random.Random(self.rng.random())
        ops = ["key_cycle", "snapshot", "read_snapshot", "clone", "drop_clone", "rollback",
               "rotate", "scrub", "resize"]
        if self.a.kill:
            ops.append("kill")
        first = ["key_cycle", "snapshot"] + (["kill"] if self.a.kill else [])
        clones = 0
        while not self.stop.wait(rng.uniform(0.05, 0.4)):
            # the first ones on the filled volume, whatever the seed
            vol = self.vols[0] if first else rng.choice(self.vols)
            op = first.pop(0) if first else rng.choice(ops)
            try:
                getattr(self, "op_" + op)(vol, rng, clones)
                if op == "clone":
                    clones += 1
            except Skipped:
                pass
            except Exception as e:
                self.violation(f"operator {op} on {vol.name}: {e}")

    def op_key_cycle(self, v, rng, _):
        v.hold(disconnect=True)
        try:
            r = self.with_retry(v, "key unload", "key", "unload", v.name)
            if r.returncode != 0:
                raise RuntimeError(f"key unload: {r.stderr.strip()}")
            h = nbd.NBD()
            try:
                h.connect_uri(v.uri())
                self.violation(f"{v.name}: opened over NBD after key unload")
                h.shutdown()
            except nbd.Error:
                pass
            self.cli("key", "load", v.name, "--key-file", v.key)
            self.count("key cycles")
            # The tester's sequence: the volume read right after the load.
            self.verify(v, "after key unload and load")
        finally:
            v.release()

    def op_snapshot(self, v, rng, _):
        v.hold(disconnect=False)
        try:
            v.snap_seq += 1
            name = f"s{v.snap_seq}"
            self.cli("snapshot", "create", f"{v.name}@{name}")
            v.snaps.append((name, [c.cur if not c.maybe else frozenset([c.cur, *c.maybe])
                                   for c in v.cells]))
            self.count("snapshots")
        finally:
            v.release()
        if len(v.snaps) > 3:
            old, _m = v.snaps[0]
            r = self.with_retry(v, "snapshot destroy", "snapshot", "destroy",
                                f"{v.name}@{old}")
            if r.returncode == 0:
                v.snaps.pop(0)
                self.count("snapshots destroyed")
            elif "clone" in r.stderr:
                self.count("snapshot destroys refused (a clone)")
            else:
                raise RuntimeError(f"snapshot destroy {v.name}@{old}: {r.stderr.strip()}")

    def op_read_snapshot(self, v, rng, _):
        if not v.snaps:
            return
        name, model = rng.choice(v.snaps)
        self.verify(v, f"snapshot {name}", export=f"{v.name}@{name}", model=model)
        self.count("snapshots read")

    def op_clone(self, v, rng, n):
        """A clone of the newest snapshot, under its own key (half of them --independent,
        whose re-encryption runs in the background): read as the snapshot, written in
        bursts while that runs, read whole, destroyed."""
        if not v.snaps:
            return
        name, model = v.snaps[-1]
        cname = f"{v.name}c{n}"
        key = self.dir / f"{cname}.key"
        key.write_bytes(os.urandom(32))
        os.chmod(key, 0o600)
        extra = ["--independent"] if self.independent and rng.random() < 0.5 else []
        r = self.cli("volume", "clone", f"{v.name}@{name}", cname, "--key-file", key, *extra,
                     check=False)
        if r.returncode != 0:
            if "rotating its key" not in r.stderr and "out of space" not in r.stderr:
                raise RuntimeError(f"volume clone: {r.stderr.strip()}")
            self.count("clones refused")
            return
        cm = list(model)
        h = nbd.NBD()
        h.connect_uri(v.uri(cname))
        try:
            picks = rng.sample(range(len(v.offsets)), min(64, len(v.offsets)))
            for c in picks:
                self.check_read(v, c, h.pread(CELL, v.offsets[c]), f"clone {cname}",
                                expect=values(cm[c]))
            bufs = [nbd.Buffer(CELL) for _ in range(8)]
            for _ in range(rng.randint(1, 40)):
                batch = []
                for c, buf in zip(set(rng.choices(range(len(v.offsets)), k=8)), bufs):
                    t = next(TAGS)
                    buf.to_buffer()[:] = cell_bytes(v.vid, c, t)
                    ck = h.aio_pwrite(buf, v.offsets[c])
                    batch.append((c, t, ck))
                while h.aio_in_flight() > 0:
                    h.poll(1000)
                for c, t, ck in batch:
                    try:
                        h.aio_command_completed(ck)
                        cm[c] = t
                    except nbd.Error as e:
                        if "ENOSPC" not in str(e):
                            raise
                        self.count("clone writes refused")
                        cm[c] = frozenset(values(cm[c]) | {t})
                self.count("clone writes", len(batch))
                c = rng.choice([c for c, _, _ in batch])
                self.check_read(v, c, h.pread(CELL, v.offsets[c]), f"clone {cname} written",
                                expect=values(cm[c]))
            h.flush()  # a kill later must find them
        finally:
            bye(h)
        self.verify(v, f"clone {cname}{' (independent)' if extra else ''} read whole",
                    export=cname, model=cm)
        self.count("independent clones" if extra else "clones")
        if len(v.clones) < 2 and rng.random() < 0.3:
            # kept a while: its snapshot cannot go, nor a rollback past it
            v.clones.append((cname, name, cm, key, bool(extra)))
            return
        self.destroy_clone(v, cname)

    def destroy_clone(self, v, cname):
        r = self.with_retry(v, "clone destroy", "volume", "destroy", cname)
        if r.returncode != 0:
            raise RuntimeError(f"volume destroy {cname}: {r.stderr.strip()}")

    def op_drop_clone(self, v, rng, _):
        if not v.clones:
            return
        cname, snap, cm, _key, _ind = v.clones.pop(0)
        self.verify(v, f"kept clone {cname} of @{snap}", export=cname, model=cm)
        self.destroy_clone(v, cname)
        self.count("kept clones destroyed")

    def op_rollback(self, v, rng, _):
        """To the newest snapshot, or with --destroy-newer to an older one (refused, with
        nothing changed, when a newer one has a clone: issue 36)."""
        if not v.snaps:
            return
        k = rng.randrange(len(v.snaps))
        name, model = v.snaps[k]
        newer = [n for n, _ in v.snaps[k + 1:]]
        args = ["--destroy-newer"] if newer else []
        # An independent clone may have let go of its snapshot (its re-encryption done).
        cloned = [c for c in v.clones if c[1] in newer and not c[4]]
        v.hold(disconnect=True)
        try:
            r = self.with_retry(v, "rollback", "volume", "rollback", f"{v.name}@{name}", *args)
            if r.returncode != 0:
                self.count("rollbacks refused")
                if not cloned:
                    self.note_refusal(v, "rollback", r.stderr.strip())
                # A refusal changes nothing: the volume, every snapshot, every clone.
                self.verify_family(v, f"after a refused rollback to {name}")
                return
            if cloned:
                self.violation(f"rollback of {v.name} to {name} --destroy-newer went past "
                               f"{[c[1] for c in cloned]}, which have clones")
            del v.snaps[k + 1:]
            for cname, snap, cm, _key, _ind in v.clones:
                self.verify(v, f"clone {cname} of @{snap} after a rollback to {name}",
                            export=cname, model=cm)
            for c, m in zip(v.cells, model):
                *c.maybe, c.cur = sorted(values(m))
                c.dur, c.since = c.cur, list(c.maybe)
            for w in v.writers:
                w.dirty.clear()
            self.count("rollbacks" + (" past newer snapshots" if newer else ""))
            self.verify(v, f"after rollback to {name}")
        finally:
            v.release()

    def op_rotate(self, v, rng, _):
        r = self.cli("key", "rotate", v.name, check=False)
        self.count("rotations" if r.returncode == 0 else "rotations refused")

    def op_scrub(self, v, rng, _):
        r = self.cli("scrub", check=False)
        self.count("scrubs" if r.returncode == 0 else "scrubs refused")

    def op_resize(self, v, rng, _):
        if v.name == "lh":
            return
        new = v.size + (1 << 20)
        r = self.cli("volume", "resize", v.name, new, check=False)
        if r.returncode == 0:
            v.size = new
            self.count("resizes")
        else:
            self.count("resizes refused")

    def op_kill(self, v, rng, _):
        if self.starts > 1 + self.a.seconds // 20:
            return
        self.up.clear()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        for vol in self.vols:
            vol.hold(disconnect=True)
        try:
            self.start()
            self.load_keys()
            for vol in self.vols:
                self.verify(vol, "after kill -9 and restart", crash=True)
                for w in vol.writers:
                    w.dirty.clear()
            self.count("kills")
        finally:
            self.up.set()
            for vol in self.vols:
                vol.release()

    def plant_older(self):
        """The checker's own test: one cell of `lf` set back to an older value behind
        the model's back, as a lost write would leave it. The run must fail."""
        v = self.vols[0]
        c = next(i for i, cell in enumerate(v.cells) if cell.cur > 1 and not cell.maybe)
        h = nbd.NBD()
        h.connect_uri(v.uri())
        h.pwrite(cell_bytes(v.vid, c, v.cells[c].cur - 1), v.offsets[c])
        h.flush()
        bye(h)
        print(f"planted an older value in lf cell {c}", file=sys.stderr)

    # --- the whole run
    def main(self):
        self.setup()
        seeds = random.Random(self.a.seed ^ 0x5EED)
        for v in self.vols:
            v.writers = [Writer(v, n, seeds.getrandbits(64)) for n in range(self.a.conns)]
            for w in v.writers:
                w.start()
        op = threading.Thread(target=self.operator, daemon=True, name="operator")
        op.start()
        self.stop.wait(self.a.seconds)
        self.stop.set()
        op.join()
        for v in self.vols:
            v.release()
            for w in v.writers:
                w.join()
                w.disconnect()
        if any("(a hang)" in x for x in self.violations):
            # Nothing more can be read; the daemon is left to its log (and killed).
            return
        if self.proc.poll() is None and self.up.is_set():
            if self.a.plant_older:
                self.plant_older()
            for v in self.vols:
                self.verify_family(v, "at the end")
            self.stop_daemon()
            self.start()
            self.load_keys()
            for v in self.vols:
                self.verify_family(v, "after a clean restart")
        self.stop_daemon()


def bye(h):
    """Disconnect (NBD_CMD_DISC); a connection already gone is fine."""
    try:
        h.shutdown()
    except nbd.Error:
        pass


def values(m) -> set:
    """A snapshot model's entry: a value, or the values a failed write leaves possible."""
    return set(m) if isinstance(m, frozenset) else {m}


def older(tag, expected) -> str:
    exp = [e for e in expected if e != ZERO]
    if tag != ZERO and exp and tag < min(exp):
        return " (an OLDER value: an acknowledged write lost)"
    return ""


def parse_size(s: str) -> int:
    units = {"K": 10, "M": 20, "G": 30, "T": 40, "P": 50, "E": 60}
    if s[-1].upper() in units:
        return int(s[:-1]) << units[s[-1].upper()]
    return int(s)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", required=True, help="the bulwark binary")
    p.add_argument("--dir", required=True, help="a directory for the pool (emptied first)")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="single")
    p.add_argument("--seconds", type=int, default=30)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--conns", type=int, default=2, help="writer connections per volume")
    p.add_argument("--huge", default="1E", help="size of the thin volume lh")
    p.add_argument("--fill", type=float, default=0.3,
                   help="the filled volume's share of the pool's usable bytes")
    p.add_argument("--kill", action="store_true", help="SIGKILL the daemon now and then")
    p.add_argument("--in-use-ok", action="store_true",
                   help="count a command refused as 'in use' with no client for 10 s instead "
                        "of failing the run (for binaries before issue 36's fix)")
    p.add_argument("--plant-older", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    run = Run(a)
    started = time.monotonic()
    # A `timeout` or Ctrl-C ends the run through `finally`: no daemon is left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
    try:
        run.main()
    except Exception as e:
        print(json.dumps({"error": str(e), "counts": run.counts}), flush=True)
        print(f"live_nbd: {e}", file=sys.stderr)
        return 2
    finally:
        if run.proc is not None and run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
    out = {"layout": a.layout, "seed": a.seed, "seconds": round(time.monotonic() - started, 1),
           "counts": run.counts, "violations": run.violations, "refusals": run.refusals[:10]}
    print(json.dumps(out, indent=1), flush=True)
    if run.violations:
        print(f"live_nbd: {len(run.violations)} violation(s); pool kept in {a.dir}; replay: "
              f"{' '.join(sys.argv)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
