#!/usr/bin/env python3
"""The object tier measured (issue 22): the same pool and workloads with and without an
object store, side by side in one run, and what the store is asked for.

Each mode: a one-device `single` pool of DEV (2300M: the 1 GiB volume fills it to about
47%), an encrypted 1 GiB volume (compression off) filled with incompressible data
(nbdkit random, then a FLUSH), then fio (nbd engine) for RT seconds per cell: 4K random
writes at QD1 with a FLUSH after each (--fsync=1), 64K random writes at QD32 with
--fsync=32, 4K random reads at QD32. With the store: versitygw v1.8.0 (posix backend, on
this machine's disk) behind our fault proxy (tests/helpers/s3proxy.py, no rule on) that
counts requests: PUTs and bytes per FLUSH and per GiB written, requests while idle for
IDLE seconds, and the time and GETs of `pool import --object-store` into a new directory.

What it does not show: a remote store's latency (loopback here: a real store adds a
round trip or more to every FLUSH), a store on other disks than the pool's (here both
share one), or a pool larger than this machine's test size.

Usage: RT=20 IDLE=60 [FLUSH=local] python3 bench/objstore.py [path/to/bulwark]
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
from s3proxy import FaultProxy  # noqa: E402
from s3servers import start_versitygw  # noqa: E402

B = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "target" / "release" / "bulwark")
RT = int(os.environ.get("RT", "20"))
IDLE = int(os.environ.get("IDLE", "60"))
DEV = os.environ.get("DEV", "2300M")
FLUSH = os.environ.get("FLUSH", "store")  # --object-store-flush: store or local
CELLS = [
    ("4K randwrite QD1 fsync=1", ["--rw=randwrite", "--bs=4k", "--iodepth=1", "--fsync=1"], 1),
    ("64K randwrite QD32 fsync=32", ["--rw=randwrite", "--bs=64k", "--iodepth=32", "--fsync=32"], 32),
    ("4K randread QD32", ["--rw=randread", "--bs=4k", "--iodepth=32"], 0),
]


def sh(cmd, env=None, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, **kw)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed: {r.stderr}")
    return r.stdout


def fio(uri: str, args: list[str]) -> dict:
    out = sh(["fio", "--name=j", "--ioengine=nbd", f"--uri={uri}", "--size=1G",
              f"--runtime={RT}", "--time_based", "--norandommap", "--randrepeat=0",
              "--output-format=json", *args])
    j = json.loads(out[out.index("{"):])["jobs"][0]
    r = j["read"] if j["read"]["io_bytes"] else j["write"]
    return {"iops": r["iops"], "ios": r["total_ios"], "bytes": r["io_bytes"],
            "p99_us": r["clat_ns"]["percentile"]["99.000000"] / 1000}


def run_mode(work: Path, url: str | None, creds: Path | None, proxy: FaultProxy | None):
    env = dict(os.environ, BULWARK_REGISTRY=str(work / "registry.json"))
    pool = work / "p"
    key = work / "key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    extra = ["--object-store", url, "--object-store-credentials", creds,
             "--object-store-flush", FLUSH] if url else []
    sh([B, "pool", "create", pool, "--devices", "1", "--device-size", DEV, *extra], env=env)
    log = open(work / "serve.log", "wb")
    d = subprocess.Popen([B, "serve", pool], stdout=log, stderr=subprocess.STDOUT, env=env)
    penv = dict(env, BULWARK_POOL=str(pool))
    for _ in range(200):
        if subprocess.run([B, "status"], env=penv, capture_output=True).returncode == 0:
            break
        time.sleep(0.1)
    sh([B, "volume", "create", "v", "--size", "1G", "--key-file", key, "--compression", "off"],
       env=penv)
    uri = f"nbd+unix:///v?socket={pool}/nbd.sock"
    res = {}
    if proxy:
        proxy.reset_counts()
    t = time.monotonic()
    sh(["nbdkit", "-U", "-", "random", "size=1G", "--run", f"nbdcopy --flush $uri '{uri}'"])
    res["fill_s"] = time.monotonic() - t
    if proxy:
        res["fill_puts"] = proxy.counts("PUT")
    for name, args, per_flush in CELLS:
        if proxy:
            proxy.reset_counts()
        r = fio(uri, args)
        if proxy:
            r["puts"] = proxy.counts("PUT")
            r["put_bytes"] = sum(s.body_len or 0 for s in proxy.requests() if s.method == "PUT")
            if per_flush:
                flushes = max(1, r["ios"] // per_flush)
                r["puts_per_flush"] = r["puts"] / flushes
                r["put_bytes_per_gib_written"] = r["put_bytes"] / (r["bytes"] / (1 << 30))
        res[name] = r
    if proxy:
        # Idle: no client; what the daemon asks the store for on its own.
        # The last cell's dirty data commits on the 5 s timer, and one fencing check
        # follows the last client request within 30 s: idle starts after both.
        time.sleep(40)
        proxy.reset_counts()
        time.sleep(IDLE)
        res["idle_requests_per_hour"] = proxy.total() * 3600 / IDLE
    d.send_signal(signal.SIGTERM)
    d.wait(120)
    if url:
        sh([B, "pool", "export", pool], env=env)
        shutil.copy2(pool / "pool.key", work / "pool.key.backup")
        if proxy:
            proxy.reset_counts()
        t = time.monotonic()
        sh([B, "pool", "import", "--object-store", url, "--object-store-credentials", creds,
            "--pool-key", work / "pool.key.backup", "--dir", work / "imported"], env=env)
        res["import_s"] = time.monotonic() - t
        if proxy:
            res["import_gets"] = proxy.counts("GET")
    return res


def main():
    top = Path(tempfile.mkdtemp(prefix="bulwark-objstore-bench-"))
    try:
        (top / "local").mkdir()
        local = run_mode(top / "local", None, None, None)
        with start_versitygw(top / "vgw") as srv, FaultProxy.for_server(srv) as proxy:
            creds = srv.write_credentials(top / "s3.env")
            url = f"s3://{srv.bucket}/bench?endpoint={proxy.endpoint}"
            (top / "store").mkdir()
            store = run_mode(top / "store", url, creds, proxy)
        print(f"# bulwark {B}, RT={RT}s per cell, pool device {DEV}, 1 GiB encrypted volume, "
              f"--object-store-flush {FLUSH}")
        print(f"fill 1 GiB: local {local['fill_s']:.1f} s, with store {store['fill_s']:.1f} s "
              f"({store['fill_puts']} PUTs)")
        for name, _, _ in CELLS:
            lo, st = local[name], store[name]
            line = (f"{name:<28} local {lo['iops']:8.0f} IOPS  store {st['iops']:8.0f} IOPS  "
                    f"ratio {st['iops'] / lo['iops']:.2f}x  p99 {lo['p99_us']:.0f}/{st['p99_us']:.0f} us")
            if "puts_per_flush" in st:
                line += (f"  PUTs/flush {st['puts_per_flush']:.2f}  "
                         f"uploaded/GiB written {st['put_bytes_per_gib_written'] / (1 << 30):.2f} GiB")
            print(line)
        print(f"idle requests per hour: {store['idle_requests_per_hour']:.0f} (over {IDLE} s)")
        print(f"import from the bucket: {store['import_s']:.1f} s, {store['import_gets']} GETs")
    finally:
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
