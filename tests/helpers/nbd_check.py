#!/usr/bin/python3
"""Read a whole NBD export in fixed chunks with libnbd and compare each chunk
with the same range of an expected file.

Usage: nbd_check.py URI EXPECTED_FILE CHUNK_BYTES

Prints one JSON object: {"size", "chunks", "ok", "mismatch": [offset...],
"error": [[offset, errno, message]...],
"reconnects": n}. A chunk that reads back without error
but differs from the file is a "mismatch": bytes that were never written.
Runs under the system Python (Debian's python3-libnbd).
"""
import json
import sys

import nbd


def connect(uri):
    h = nbd.NBD()
    h.connect_uri(uri)
    return h


def main():
    uri, expected_path, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
    h = connect(uri)
    size = h.get_size()
    res = {"size": size, "chunks": 0, "ok": 0, "mismatch": [], "error": [], "reconnects": 0}
    with open(expected_path, "rb") as f:
        off = 0
        while off < size:
            n = min(chunk, size - off)
            f.seek(off)
            want = f.read(n)
            want += b"\0" * (n - len(want))
            res["chunks"] += 1
            try:
                got = h.pread(n, off)
            except nbd.Error as e:
                res["error"].append([off, e.errno, e.string])
                if h.aio_is_closed() or h.aio_is_dead():
                    # The server dropped the connection after the error:
                    # note it and go on with a new one.
                    res["reconnects"] += 1
                    h = connect(uri)
            else:
                if got == want:
                    res["ok"] += 1
                else:
                    res["mismatch"].append(off)
            off += n
    try:
        h.shutdown()
    except nbd.Error:
        pass
    print(json.dumps(res))


if __name__ == "__main__":
    main()
