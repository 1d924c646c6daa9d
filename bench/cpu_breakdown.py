#!/usr/bin/env python3
"""Break a daemon CPU profile down by layer: NBD, codec (and within it the
crypto and checksum share), map, device I/O, scheduling, other.

Input: `perf script` output of a profile recorded with DWARF call graphs on
the running daemon, for example:

    perf record -F 999 --call-graph dwarf,32768 -p $(pgrep -f 'bulwark serve') -o w.data -- sleep 5
    perf script -i w.data > w.txt
    bench/cpu_breakdown.py w.txt [--bytes N]

Each sample is charged to one category: the first frame, walking from the
leaf towards the root, that names one (see CATEGORIES). With --bytes (bytes
moved by the client during the recording) it also prints CPU nanoseconds per
byte, from the sample count and frequency.
"""

import argparse
import collections
import re
import sys

# (category, pattern) tried in order on each frame, leaf first. Leaf-level
# kernel and library frames are named by what they do; the rest by the
# first bulwark module above them.
CATEGORIES = [
    ("crypto (AES-256-GCM)", r"aes_gcm|aesni|gcm_|aws_lc.*aes|ghash"),
    ("checksum (xxh3, blake3)", r"xxh3|xxhash|blake3"),
    ("compression (lz4)", r"lz4"),
    ("scheduling (context switches, futex)", r"finish_task_switch|__schedule|futex|_raw_spin_unlock_irqrestore|try_to_wake_up|schedule\b"),
    ("device I/O (pread/pwrite, page cache, fs)", r"pwrite|pread|ext4|filemap|copy_folio|generic_perform_write|sync_file_range|fdatasync|block_write|folio|xfs_"),
    # A kernel copy (`_copy_to_iter`, `copy_page_to_iter`, ...) is named by its caller:
    # page cache (`filemap_read`: device I/O) or socket (`skb_copy_datagram_*`).
    ("NBD socket I/O (kernel)", r"unix_stream|sock_|tcp_|skb|writev|recvmsg|sendmsg"),
    ("map (block pointers, radix tree)", r"bulwark_engine::map::"),
    ("codec (copies, framing)", r"bulwark_engine::codec::"),
    ("device I/O (pread/pwrite, page cache, fs)", r"bulwark_engine::(device|redundancy)::"),
    ("engine (log, pool, volume)", r"bulwark_engine::"),
    ("NBD (parse, validate, reply)", r"bulwark_nbd::"),
    ("export adapter", r"bulwark::export"),
]


def frames(path):
    """Yields the frame list (leaf first) of each sample."""
    cur = []
    with open(path, errors="replace") as f:
        for line in f:
            if not line.strip():
                if cur:
                    yield cur
                cur = []
                continue
            if line[0] in " \t":
                parts = line.strip().split(None, 1)
                if len(parts) == 2:
                    cur.append(parts[1])
    if cur:
        yield cur


def classify(stack):
    for frame in stack:
        for name, pat in CATEGORIES:
            if re.search(pat, frame):
                return name
    return "other (allocator, runtime, libc)"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("script", help="perf script output")
    ap.add_argument("--bytes", type=float, help="bytes the client moved during the recording")
    ap.add_argument("--freq", type=float, default=999.0, help="perf record -F (default 999)")
    a = ap.parse_args()
    counts = collections.Counter()
    total = 0
    for stack in frames(a.script):
        counts[classify(stack)] += 1
        total += 1
    if not total:
        sys.exit("no samples")
    cpu_s = total / a.freq
    print(f"{total} samples, {cpu_s:.2f} CPU-seconds")
    print("| category | share of daemon CPU |" + (" ns per byte |" if a.bytes else ""))
    print("| --- | --- |" + (" --- |" if a.bytes else ""))
    for name, n in counts.most_common():
        row = f"| {name} | {100 * n / total:.1f}% |"
        if a.bytes:
            row += f" {1e9 * (n / a.freq) / a.bytes:.3f} |"
        print(row)
    if a.bytes:
        print(f"| **total** | 100% | {1e9 * cpu_s / a.bytes:.3f} |")


if __name__ == "__main__":
    main()
