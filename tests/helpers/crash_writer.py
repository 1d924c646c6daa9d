#!/usr/bin/python3
"""Write self-describing blocks to an NBD export until the server dies.

Usage: crash_writer.py URI SEED ROUND NBLOCKS GEN_BLOCKS [--init]

With --init, first writes every block (generation 0) and flushes. Then, for
generation 1, 2, ...: picks 1..GEN_BLOCKS random blocks, prints
"W gen b1,b2,..." before issuing any of them, writes them with up to 32
requests in flight (about one in eight with FUA, printing "U gen blk" when a
FUA write is acknowledged), waits for all, flushes and prints "F gen" when
the flush is acknowledged. It first flushes and prints "F 0" once connected
(after the --init pass, if any). Every line is flushed at once, so the
parent can tell exactly what was acknowledged when the server was killed.
Exits 0 when the connection dies (that is the point); 2 on a data error.
Runs under the system Python (Debian's python3-libnbd).
"""
import os
import random
import sys

import nbd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from crashblocks import BLOCK, content  # noqa: E402

INFLIGHT = 32


def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def write_all(h, items, seed, rnd, gen, fua_pick):
    """items: list of block numbers. Returns when every write is acknowledged."""
    pending = list(items)
    inflight = {}
    while pending or inflight:
        while pending and len(inflight) < INFLIGHT:
            blk = pending.pop()
            buf = nbd.Buffer.from_bytearray(bytearray(content(seed, rnd, gen, blk)))
            fua = fua_pick(blk)
            flags = nbd.CMD_FLAG_FUA if fua else 0
            cookie = h.aio_pwrite(buf, blk * BLOCK, flags=flags)
            inflight[cookie] = (blk, fua, buf)
        h.poll(-1)
        for cookie in list(inflight):
            if h.aio_command_completed(cookie):
                blk, fua, _ = inflight.pop(cookie)
                if fua:
                    say(f"U {gen} {blk}")


def main():
    uri = sys.argv[1]
    seed, rnd, nblocks, gen_blocks = (int(a) for a in sys.argv[2:6])
    init = "--init" in sys.argv[6:]
    rng = random.Random(f"writer/{seed}/{rnd}")
    h = nbd.NBD()
    h.connect_uri(uri)
    can_fua = h.can_fua()
    say(f"C fua={int(can_fua)} size={h.get_size()}")
    try:
        if init:
            write_all(h, list(range(nblocks)), seed, rnd, 0, lambda b: False)
        h.flush()
        say("F 0")
        gen = 0
        while True:
            gen += 1
            blocks = rng.sample(range(nblocks), rng.randint(1, gen_blocks))
            fua_set = {b for b in blocks if rng.random() < 0.125} if can_fua else set()
            say(f"W {gen} " + ",".join(map(str, blocks)))
            write_all(h, blocks, seed, rnd, gen, lambda b: b in fua_set)
            h.flush()
            say(f"F {gen}")
    except nbd.Error as e:
        say(f"E {e.errno} {e.string}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
