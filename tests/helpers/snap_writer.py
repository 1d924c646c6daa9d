#!/usr/bin/python3
"""Write numbered, self-describing blocks to an NBD export until told to stop,
logging each write before it is issued and when it is acknowledged.

Usage: snap_writer.py URI SEED NBLOCKS STOP_FILE

Write number i (i = 1, 2, ...) goes to block i % NBLOCKS with the content
crashblocks.content(SEED, 1, i, block), so a block read back names exactly the
write that put it there. Up to 16 writes are in flight, never two to the same
block (write i is issued only once write i - NBLOCKS was acknowledged), so a
block's versions are ordered. Before issuing write i it prints "I i"; when
write i is acknowledged it prints "A i". Every line is flushed at once: a
line the parent has read happened before it read it, and a write whose "I"
line the parent has not yet seen was issued after it looked. Stops (after
the writes in flight are acknowledged) once STOP_FILE exists, prints "S LAST"
and exits 0; on an NBD error prints "E ..." and exits 2.
Runs under the system Python (Debian's python3-libnbd).
"""
import os
import sys

import nbd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from crashblocks import BLOCK, content  # noqa: E402

INFLIGHT = 16


def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main():
    uri, seed, nblocks, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    h = nbd.NBD()
    h.connect_uri(uri)
    inflight = {}  # cookie -> (seq, buffer)
    busy = set()  # blocks with a write in flight
    seq = 0
    stopping = False
    try:
        while True:
            if not stopping and seq % 32 == 0 and os.path.exists(stop):
                stopping = True
            while not stopping and len(inflight) < INFLIGHT and (seq + 1) % nblocks not in busy:
                seq += 1
                blk = seq % nblocks
                buf = nbd.Buffer.from_bytearray(bytearray(content(seed, 1, seq, blk)))
                say(f"I {seq}")
                cookie = h.aio_pwrite(buf, blk * BLOCK)
                inflight[cookie] = (seq, buf)
                busy.add(blk)
                if seq % 32 == 0:
                    break
            if not inflight:
                if stopping:
                    break
                continue
            h.poll(-1)
            for cookie in list(inflight):
                if h.aio_command_completed(cookie):
                    s, _ = inflight.pop(cookie)
                    busy.discard(s % nblocks)
                    say(f"A {s}")
    except nbd.Error as e:
        say(f"E {e.errno} {e.string}")
        return 2
    h.shutdown()
    say(f"S {seq}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
