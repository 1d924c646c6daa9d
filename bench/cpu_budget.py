#!/usr/bin/env python3
"""Where one fio cell's CPU goes: the NBD server's, fio's, and the machine's.

Runs one fio cell through fio's nbd engine against any NBD URI and prints the
IOPS, the server's CPU (utime+stime of --server-pid from /proc, all threads),
fio's CPU (its rusage), each over fio's whole run, the share of the machine that was busy (/proc/stat),
and each per I/O. On a machine with few cores this says how many cores a
cell would need at another rate: the "two connections >= 1.6x one" target
needs 1.6x the CPU of one connection, client included (BENCHMARKS.md, "Two
connections over one on 2 vCPUs").

    bench/cpu_budget.py --uri 'nbd+unix:///disk?socket=/srv/pool/nbd.sock' \\
        --server-pid $(pgrep -f 'bulwark serve') --rw randread --bs 4k --jobs 2

The region measured is the first --size bytes of the export (default 2048M),
split in equal slices among the jobs (one NBD connection each); writes
overwrite it. --json prints one JSON object instead of the line.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def server_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # utime and stime are fields 14 and 15 of stat(5); fields[0] here is field 3.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs, steal excluded from both."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, _steal = v
    busy = user + nice + system + irq + softirq
    return busy, busy + idle + iowait


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--uri", required=True, help="NBD URI (nbd://..., nbd+unix:///NAME?socket=PATH)")
    p.add_argument("--server-pid", type=int, required=True, help="PID of the NBD server process")
    p.add_argument("--rw", default="randread", choices=["randread", "randwrite", "read", "write"])
    p.add_argument("--bs", default="4k")
    p.add_argument("--iodepth", type=int, default=32)
    p.add_argument("--jobs", type=int, default=1, help="NBD connections (fio jobs)")
    p.add_argument("--runtime", type=int, default=5, help="seconds")
    p.add_argument("--size", type=int, default=2048, help="region in MiB")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    if not os.path.exists(f"/proc/{a.server_pid}"):
        print(f"cpu_budget: no process {a.server_pid}", file=sys.stderr)
        return 2
    slice_mib = a.size // a.jobs
    cmd = [
        "fio", "--name=cell", "--ioengine=nbd", f"--uri={a.uri}",
        f"--rw={a.rw}", f"--bs={a.bs}", f"--iodepth={a.iodepth}", f"--numjobs={a.jobs}",
        f"--size={slice_mib}M", f"--offset_increment={slice_mib}M", "--norandommap=1",
        "--time_based=1", f"--runtime={a.runtime}", "--group_reporting=1",
        "--output-format=json",
    ]
    s0, (b0, t0) = server_cpu_seconds(a.server_pid), machine_ticks()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    w0 = time.monotonic()
    run = subprocess.run(cmd, capture_output=True, text=True)
    s1, (b1, t1) = server_cpu_seconds(a.server_pid), machine_ticks()
    elapsed = time.monotonic() - w0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if run.returncode != 0:
        print(f"cpu_budget: fio failed (exit {run.returncode}):\n{run.stderr.strip()}", file=sys.stderr)
        return 1
    out = run.stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    iops = job["read"]["iops"] + job["write"]["iops"]
    ios = job["read"]["total_ios"] + job["write"]["total_ios"]
    server_s = s1 - s0
    fio_s = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    server, fio = server_s / elapsed, fio_s / elapsed
    busy = (b1 - b0) / max(t1 - t0, 1) * os.cpu_count()
    res = {
        "rw": a.rw, "bs": a.bs, "iodepth": a.iodepth, "jobs": a.jobs, "iops": round(iops),
        "server_cores": round(server, 3), "fio_cores": round(fio, 3),
        "machine_busy_cores": round(busy, 3), "cpus": os.cpu_count(),
        "server_us_per_io": round(server_s * 1e6 / ios, 2) if ios else None,
        "fio_us_per_io": round(fio_s * 1e6 / ios, 2) if ios else None,
    }
    if a.json:
        print(json.dumps(res))
    else:
        print(
            f"{a.rw} {a.bs} QD{a.iodepth} x{a.jobs} conn: {iops / 1000:.1f}k IOPS; "
            f"server {server:.2f} cores ({res['server_us_per_io']} us/IO), "
            f"fio {fio:.2f} cores ({res['fio_us_per_io']} us/IO), "
            f"machine busy {busy:.2f} of {os.cpu_count()} cores"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
