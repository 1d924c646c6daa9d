#!/usr/bin/env python3
"""The object tier's local cache measured (issue 22 part 5, decision 0013): a pool whose
local devices keep CACHE of a SIZE volume, the rest read from the store, beside a
local-only pool with the same volume, in one run.

Each mode: a one-device `single` pool (sparse device file of DEV), an encrypted volume
of SIZE (compression off) filled with incompressible data (nbdkit random, then a FLUSH).
With the store: versitygw v1.8.0 (posix backend, on this machine's disk) behind our fault
proxy (tests/helpers/s3proxy.py, no rule on), which counts requests; the pool is created
with --object-store-cache-size CACHE, and the run waits until the device file fits it.
Then fio (nbd engine, RT seconds per cell) over the whole volume: 4K random reads at QD1
and QD32 (with the store, about 1 - CACHE/SIZE of them cold: one ranged GET each), and a
sequential 1M read at QD4. Then the pool is exported and imported on a "new host" twice:
with --object-store-cache-size (metadata only) and without (every byte downloaded).

What it does not show: a remote store's latency (loopback here: a real store adds a round
trip to every cold read), a store on other disks than the pool's, a cache device beside
the store (docs/cache.md), or reads of data brought back whole (not built).

PROXY=0: straight to the server (no request counts; what the proxy's own latency hides).

Usage: RT=20 SIZE=1G CACHE=256M [FIO=0] [PROXY=0] python3 bench/objstore_cache.py [path/to/bulwark]
"""

from __future__ import annotations

import json
import os
import re
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
SIZE = os.environ.get("SIZE", "1G")
CACHE = os.environ.get("CACHE", "256M")
DEV = os.environ.get("DEV", "")
FIO = os.environ.get("FIO", "1") != "0"
CELLS = [
    ("4K randread QD1", ["--rw=randread", "--bs=4k", "--iodepth=1"]),
    ("4K randread QD32", ["--rw=randread", "--bs=4k", "--iodepth=32"]),
    ("1M read QD4", ["--rw=read", "--bs=1M", "--iodepth=4"]),
]


def size_bytes(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def sh(cmd, env=None, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, **kw)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed: {r.stderr}")
    return r.stdout


def fio(uri: str, args: list[str]) -> dict:
    out = sh(["fio", "--name=j", "--ioengine=nbd", f"--uri={uri}", f"--size={SIZE}",
              f"--runtime={RT}", "--time_based", "--norandommap", "--randrepeat=0",
              "--output-format=json", *args])
    j = json.loads(out[out.index("{"):])["jobs"][0]
    r = j["read"]
    return {"iops": r["iops"], "ios": r["total_ios"], "bw_mib": r["bw_bytes"] / (1 << 20),
            "p99_us": r["clat_ns"]["percentile"]["99.000000"] / 1000}


def allocated(pool: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in pool.glob("dev*.img"))


def run_mode(work: Path, url: str | None, creds: Path | None, proxy: FaultProxy | None):
    env = dict(os.environ, BULWARK_REGISTRY=str(work / "registry.json"))
    pool = work / "p"
    key = work / "key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    dev = DEV or f"{size_bytes(SIZE) * 2 // (1 << 20) + 256}M"
    extra = ["--object-store", url, "--object-store-credentials", creds,
             "--object-store-cache-size", CACHE] if url else []
    sh([B, "pool", "create", pool, "--devices", "1", "--device-size", dev, *extra], env=env)
    log = open(work / "serve.log", "wb")
    d = subprocess.Popen([B, "serve", pool], stdout=log, stderr=subprocess.STDOUT, env=env)
    penv = dict(env, BULWARK_POOL=str(pool))
    for _ in range(200):
        if subprocess.run([B, "status"], env=penv, capture_output=True).returncode == 0:
            break
        time.sleep(0.1)
    sh([B, "volume", "create", "v", "--size", SIZE, "--key-file", key, "--compression", "off"],
       env=penv)
    uri = f"nbd+unix:///v?socket={pool}/nbd.sock"
    res = {}
    t = time.monotonic()
    sh(["nbdkit", "-U", "-", "random", f"size={SIZE}", "--run", f"nbdcopy --flush $uri '{uri}'"])
    res["fill_s"] = time.monotonic() - t
    if url:
        limit = size_bytes(CACHE)
        t = time.monotonic()
        while allocated(pool) > limit:
            if time.monotonic() - t > 600:
                raise SystemExit(f"the device file still takes {allocated(pool)} bytes")
            time.sleep(0.5)
        res["evict_wait_s"] = time.monotonic() - t
    res["local_bytes"] = allocated(pool)
    if FIO:
        for name, args in CELLS:
            if proxy:
                proxy.reset_counts()
            r = fio(uri, args)
            if proxy:
                r["gets"] = proxy.counts("GET")
                r["gets_per_read"] = r["gets"] / max(1, r["ios"])
            res[name] = r
    if url:
        st = json.loads(sh([B, "status", "--json"], env=penv))
        res["status"] = st.get("object_store", {})
    d.send_signal(signal.SIGTERM)
    d.wait(120)
    if url:
        sh([B, "pool", "export", pool], env=env)
        shutil.copy2(pool / "pool.key", work / "pool.key.backup")
        for name, extra in (("lazy", ["--object-store-cache-size", CACHE]), ("full", [])):
            if proxy:
                proxy.reset_counts()
            t = time.monotonic()
            r = subprocess.run([str(c) for c in (
                B, "pool", "import", "--object-store", url, "--object-store-credentials",
                creds, "--pool-key", work / "pool.key.backup", "--dir", work / f"imp-{name}",
                *extra, "--force")], capture_output=True, text=True, env=env)
            if r.returncode != 0:
                raise SystemExit(f"pool import failed: {r.stderr}")
            res[f"import_{name}_s"] = time.monotonic() - t
            if os.environ.get("IMPORT_LOGS"):  # the import's own log, for its phases
                Path(os.environ["IMPORT_LOGS"], f"import-{name}.log").write_text(r.stderr)
            # Of which the walk of every block map (the import's own log line).
            m = re.search(r'space accounting rebuilt.*seconds="?([0-9.]+)', r.stdout + r.stderr)
            res[f"import_{name}_walk_s"] = float(m.group(1)) if m else None
            res[f"import_{name}_bytes"] = allocated(work / f"imp-{name}")
            if proxy:
                res[f"import_{name}_gets"] = proxy.counts("GET")
            shutil.rmtree(work / f"imp-{name}", ignore_errors=True)
    return res


def main():
    top = Path(tempfile.mkdtemp(prefix="bulwark-cache-bench-"))
    try:
        (top / "local").mkdir()
        local = run_mode(top / "local", None, None, None) if FIO else {}
        with start_versitygw(top / "vgw") as srv, FaultProxy.for_server(srv) as proxy:
            creds = srv.write_credentials(top / "s3.env")
            direct = os.environ.get("PROXY", "1") == "0"
            endpoint = srv.endpoint if direct else proxy.endpoint
            url = f"s3://{srv.bucket}/bench?endpoint={endpoint}"
            (top / "store").mkdir()
            store = run_mode(top / "store", url, creds, None if direct else proxy)
        mib = 1 << 20
        print(f"# bulwark {B}, RT={RT}s per cell, {SIZE} encrypted volume, "
              f"--object-store-cache-size {CACHE}")
        print(f"fill: {store['fill_s']:.1f} s with the store"
              + (f", {local['fill_s']:.1f} s local-only" if local else "")
              + f"; device file {store['local_bytes'] / mib:.0f} MiB after "
              f"{store['evict_wait_s']:.1f} s")
        for name, _ in CELLS if FIO else []:
            lo, st = local[name], store[name]
            print(f"{name:<18} local {lo['iops']:8.0f} IOPS  cache {st['iops']:8.0f} IOPS  "
                  f"ratio {st['iops'] / lo['iops']:.2f}x  p99 {lo['p99_us']:.0f}/"
                  f"{st['p99_us']:.0f} us  GETs/read {st.get('gets_per_read', float('nan')):.2f}")
        s = store.get("status", {})
        print(f"store reads this run: {s.get('remote_reads')} ({(s.get('remote_read_bytes') or 0) / mib:.0f} MiB)")
        for name in ("lazy", "full"):
            print(f"import ({name}): {store[f'import_{name}_s']:.1f} s "
                  f"(walking the maps: {store.get(f'import_{name}_walk_s')} s), "
                  f"{store.get(f'import_{name}_gets', '?')} GETs, "
                  f"{store[f'import_{name}_bytes'] / mib:.0f} MiB local")
    finally:
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
