"""Helpers for the key lifecycle scenarios (slots, rotation, crypto-erase):
the audit log's lines and a check that no secret is in it, the "wrong key"
wording, and a reader of the superblock slots of device files (docs/format.md)
to find the table keys and look for them anywhere on the devices.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from conftest import MiB, KiB, stderr_lines

WRONG = re.compile(r"(wrong|incorrect|invalid|bad).{0,20}(key|passphrase)|"
                   r"(key|passphrase).{0,30}(wrong|incorrect|does not match|invalid)", re.I)
NOISE = ("panicked", "Traceback", "RUST_BACKTRACE", "stack backtrace")


def assert_one_line_error(r, pattern, what):
    """The command failed with exactly one stderr line matching `pattern` and no panic."""
    lines = stderr_lines(r)
    assert r.returncode != 0, f"{what}: exit 0\nstdout:{r.stdout}\nstderr:{r.stderr}"
    assert len(lines) == 1, f"{what}: expected one line on stderr, got {len(lines)}:\n{r.stderr}"
    assert re.search(pattern, lines[0]), f"{what}: {lines[0]!r} does not match {pattern!r}"
    for n in NOISE:
        assert n not in r.stderr + r.stdout, f"{what}: {n!r} in output:\n{r.stderr}"


def assert_wrong_key(r, what):
    assert_one_line_error(r, WRONG, what)


# --------------------------------------------------------------------------
# audit log


def audit_lines(pool) -> list[dict]:
    """audit.log's whole records. The daemon appends while a test reads (a detach
    is recorded as the client goes), so a last line without its newline is left
    for the next read."""
    text = (pool.dir / "audit.log").read_text()
    return [json.loads(l) for l in text[:text.rfind("\n") + 1].splitlines()]


def audited(pool, event, result="ok", volume=None, **detail) -> list[dict]:
    """Audit lines of `event` with `result` (and volume, and these detail fields)."""
    out = []
    for l in audit_lines(pool):
        if l["event"] != event or l["result"] != result:
            continue
        if volume is not None and l["volume"] != volume:
            continue
        d = l["detail"] if isinstance(l["detail"], dict) else {}
        if result != "ok":
            d = d.get("request") or {}
        if all(d.get(k) == v for k, v in detail.items()):
            out.append(l)
    return out


def assert_no_secret_in_audit(pool, key_files=(), passphrases=()):
    raw = (pool.dir / "audit.log").read_bytes()
    text = raw.decode()
    for k in key_files:
        b = Path(k).read_bytes()
        assert b not in raw, f"key file {k} bytes in the audit log"
        assert b.hex() not in text.lower(), f"key file {k} (hex) in the audit log"
    for p in passphrases:
        assert p not in text, f"passphrase {p!r} in the audit log"


# --------------------------------------------------------------------------
# superblocks (docs/format.md)

SB_MAGIC = b"BWSUPER1"
SB_SLOT_BYTES = 4 * KiB
SB_SEGMENTS_AT = 72      # u64: segments per device S
SB_TABLE_KEY_AT = 416    # 32 bytes
FRONT_SLOTS = (0, 256 * KiB)


def superblock_slots(path) -> list[tuple[int, bytes]]:
    """(offset, 4 KiB) of every slot of a device file that starts with the magic."""
    out = []
    with open(path, "rb") as f:
        front = []
        for off in FRONT_SLOTS:
            f.seek(off)
            front.append((off, f.read(SB_SLOT_BYTES)))
        segments = {struct.unpack_from("<Q", b, SB_SEGMENTS_AT)[0]
                    for _, b in front if b.startswith(SB_MAGIC)}
        assert len(segments) == 1, f"{path}: front slots disagree on segments per device: {segments}"
        back = MiB + segments.pop() * MiB
        slots = list(front)
        for off in FRONT_SLOTS:
            f.seek(back + off)
            slots.append((back + off, f.read(SB_SLOT_BYTES)))
    for off, b in slots:
        if b.startswith(SB_MAGIC):
            out.append((off, b))
    return out


def table_keys(device_paths) -> set[bytes]:
    """The table keys in every superblock slot of every device."""
    keys = set()
    for p in device_paths:
        slots = superblock_slots(p)
        assert len(slots) == 4, f"{p}: {len(slots)} superblock slots carry the magic, expected 4"
        for _, b in slots:
            keys.add(b[SB_TABLE_KEY_AT:SB_TABLE_KEY_AT + 32])
    assert all(len(k) == 32 and any(k) for k in keys), "a table key is short or all zero"
    return keys


def find_anywhere(device_paths, needles) -> dict[bytes, list[tuple[str, int]]]:
    """Every (device, offset) where one of the 32-byte needles occurs, whole files scanned."""
    chunk = 64 * MiB
    overlap = max(len(n) for n in needles) - 1
    found = {n: [] for n in needles}
    for p in device_paths:
        with open(p, "rb") as f:
            base, tail = 0, b""
            while True:
                data = f.read(chunk)
                if not data:
                    break
                buf = tail + data
                start = base - len(tail)
                for n in needles:
                    i = buf.find(n)
                    while i != -1:
                        hit = (str(p), start + i)
                        if hit not in found[n]:
                            found[n].append(hit)
                        i = buf.find(n, i + 1)
                tail = buf[-overlap:]
                base += len(data)
    return found
