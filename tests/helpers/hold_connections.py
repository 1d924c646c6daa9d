#!/usr/bin/python3
"""Open N NBD connections with libnbd, read one block on each, and keep
them open, idle, until standard input closes; then close them all.

Usage: hold_connections.py URI N

Prints "held N" once every connection has read its block, then, after
standard input closes, "closed N". Any failure is printed and exits 1.
Runs under the system Python (Debian's python3-libnbd).
"""
import resource
import sys

import nbd


def main():
    uri, n = sys.argv[1], int(sys.argv[2])
    # A descriptor per connection: the soft limit may be as low as 1024.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    handles = []
    for i in range(n):
        h = nbd.NBD()
        try:
            h.connect_uri(uri)
            h.pread(4096, 0)
        except nbd.Error as e:
            print(f"connection {i + 1} of {n} failed: {e}", flush=True)
            sys.exit(1)
        handles.append(h)
    print(f"held {len(handles)}", flush=True)
    sys.stdin.read()
    for h in handles:
        h.shutdown()
    print(f"closed {len(handles)}", flush=True)


if __name__ == "__main__":
    main()
