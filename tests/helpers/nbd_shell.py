#!/usr/bin/python3
"""A libnbd client driven over stdin/stdout, so a test in another Python can
issue NBD requests one at a time and see each result.

Usage: nbd_shell.py URI

Requests (one ASCII line each; a write is followed by its raw bytes):
  W OFFSET LENGTH [fua]   + LENGTH bytes  ->  OK
  R OFFSET LENGTH                         ->  OK LENGTH + LENGTH bytes
  F                                       ->  OK            (flush)
  H OFFSET LENGTH CHUNK                   ->  OK + one JSON line: per chunk the
                                              sha256 hex of its bytes, or
                                              ["ERR", errno] if the read failed
  Z                                       ->  OK SIZE
  Q                                       ->  (exits)
Any request may instead answer `ERR ERRNO MESSAGE` (ERRNO 0 when unknown).
After the server drops the connection every request answers ERR.
Runs under the system Python (Debian's python3-libnbd).
"""
import hashlib
import json
import sys

import nbd


def main():
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    h = nbd.NBD()
    try:
        h.connect_uri(sys.argv[1])
    except nbd.Error as e:
        out.write(b"ERR %d %s\n" % (e.errno or 0, str(e.string).encode()))
        out.flush()
        return 1
    out.write(b"OK connected\n")
    out.flush()
    while True:
        line = inp.readline()
        if not line:
            return 0
        parts = line.split()
        cmd = parts[0]
        try:
            if cmd == b"W":
                off, n = int(parts[1]), int(parts[2])
                data = inp.read(n)
                flags = nbd.CMD_FLAG_FUA if b"fua" in parts[3:] else 0
                h.pwrite(data, off, flags=flags)
                out.write(b"OK\n")
            elif cmd == b"R":
                off, n = int(parts[1]), int(parts[2])
                data = h.pread(n, off)
                out.write(b"OK %d\n" % len(data) + data)
            elif cmd == b"F":
                h.flush()
                out.write(b"OK\n")
            elif cmd == b"H":
                off, n, chunk = (int(p) for p in parts[1:4])
                res = []
                end = off + n
                while off < end:
                    m = min(chunk, end - off)
                    try:
                        res.append(hashlib.sha256(h.pread(m, off)).hexdigest())
                    except nbd.Error as e:
                        res.append(["ERR", e.errno or 0])
                    off += m
                out.write(b"OK\n" + json.dumps(res).encode() + b"\n")
            elif cmd == b"Z":
                out.write(b"OK %d\n" % h.get_size())
            elif cmd == b"Q":
                return 0
            else:
                out.write(b"ERR 0 unknown request\n")
        except nbd.Error as e:
            msg = str(e.string).replace("\n", " ").encode()
            out.write(b"ERR %d %s\n" % (e.errno or 0, msg))
        out.flush()


if __name__ == "__main__":
    sys.exit(main())
