"""The block contents of the crash test, shared by the writer (system Python
with libnbd) and the test (pytest's Python).

Every 4 KiB block written names itself: a 64-byte header carries the seed,
round, generation and block number, and the rest is derived from them, so a
block read back after a crash is either exactly one version that was written
or something that was never written.
"""
import random

BLOCK = 4096
HEADER = 64


def header(seed: int, rnd: int, gen: int, blk: int) -> bytes:
    h = f"BWCRASH {seed:08x} r{rnd:03d} g{gen:06d} b{blk:07d} ".encode()
    return h.ljust(HEADER, b".")


def content(seed: int, rnd: int, gen: int, blk: int) -> bytes:
    h = header(seed, rnd, gen, blk)
    if (gen + blk) % 2:
        body = random.Random(f"{seed}/{rnd}/{gen}/{blk}").randbytes(BLOCK - HEADER)
    else:
        # Compressible half: the header repeated.
        body = (h * (BLOCK // HEADER))[: BLOCK - HEADER]
    return h + body


def parse(block: bytes):
    """(seed, round, gen, blk) named by a block's header, or None."""
    try:
        parts = block[:HEADER].decode("ascii").split()
        if parts[0] != "BWCRASH":
            return None
        return (int(parts[1], 16), int(parts[2][1:]), int(parts[3][1:]), int(parts[4][1:]))
    except (UnicodeDecodeError, IndexError, ValueError):
        return None
