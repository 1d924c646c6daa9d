#!/usr/bin/env python3
"""Turn bench/peers.sh's raw `bulwark bench --json` reports into one results
file (JSON) and a markdown report on stdout: throughput and latency per
server, each bulwark cell as a ratio to each peer, and the performance
targets, met or not.

  raw/<server>/rep<N>-<group>.json   one `bulwark bench --json` report each
  raw/<server>/rep<N>-<group>.failed a bench call that failed (reported, not measured)
  raw/<server>/rep<N>-fill.json      --fill: how the export was filled (bulwark: the
                                     pool's size and the fill measured from its status)

With several repeats, every number is the median of the repeats (IOPS, MB/s,
p50 and p99 each on their own). Ratios compare IOPS (in one cell the block
size is the same, so this is also the MB/s ratio).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

PEERS = ["qemu-raw", "qemu-luks", "nbdkit-file", "qemu-raw-btrfs"]
BULWARKS = ["bulwark-single", "bulwark-single-nolz4", "bulwark-mirror2",
            "bulwark-single-log", "bulwark-mirror2-log",
            "bulwark-single-noholes", "bulwark-mirror2-noholes",
            "bulwark-single-holes", "bulwark-mirror2-holes",
            "bulwark-single-holesfirst", "bulwark-mirror2-holesfirst",
            "bulwark-single-noholesfirst", "bulwark-mirror2-noholesfirst"]
SERVER_ORDER = PEERS + BULWARKS
SINGLES = ["bulwark-single", "bulwark-single-nolz4"]
METRICS = ["iops", "mb_per_s", "lat_p50_us", "lat_p99_us"]
# write amplification (device bytes / client bytes) and the cleaner's and metadata's parts
WA_METRICS = ["wa", "wa_clean", "wa_meta"]
PATTERN_ORDER = {"randread": 0, "randwrite": 1, "read": 2, "write": 3}


def size_label(n: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def cell_key(c: dict) -> tuple:
    return (c["block_size"], c["pattern"], c["iodepth"], c["jobs"], c.get("fsync", 0))


def cell_sort(key: tuple) -> tuple:
    bs, pattern, qd, jobs, fsync = key
    return (fsync > 0, jobs, bs, PATTERN_ORDER.get(pattern, 9), qd)


def cell_label(key: tuple) -> str:
    bs, pattern, qd, jobs, fsync = key
    label = f"{size_label(bs)} {pattern} QD{qd}"
    label += f" x{jobs} conn" if jobs > 1 else ""
    return label + (f" fsync={fsync}" if fsync else "")


def is_write(key: tuple) -> bool:
    return key[1] in ("randwrite", "write")


def is_durable(key: tuple) -> bool:
    return key[4] > 0


def load(raw: Path) -> dict:
    """server -> cell key -> metric -> [value per repeat]."""
    servers: dict = {}
    for sdir in sorted(p for p in raw.iterdir() if p.is_dir()):
        cells: dict = {}
        for f in sorted(sdir.glob("rep*-*.json")):
            # rep<N>-<group>.json only: not .cpu.json, .status.json or -fill.json
            if f.name.count(".") != 1 or f.name.endswith("-fill.json"):
                continue
            report = json.loads(f.read_text())
            for c in report["cells"]:
                slot = cells.setdefault(cell_key(c), {m: [] for m in METRICS + WA_METRICS})
                for m in METRICS:
                    slot[m].append(c[m])
                # bench's write amplification (bulwark volumes; absent for --uri targets)
                w = c.get("pool_written")
                if c.get("write_amplification") is not None and w and c["io_bytes"] > 0:
                    slot["wa"].append(c["write_amplification"])
                    slot["wa_clean"].append(w["clean_bytes"] * w["device_factor"] / c["io_bytes"])
                    slot["wa_meta"].append(w["meta_bytes"] * w["device_factor"] / c["io_bytes"])
        if cells:
            servers[sdir.name] = cells
    return servers


def load_cpu(raw: Path) -> dict:
    """server -> [CPU accounting of each bench call] (bench/peers.sh's *.cpu.json)."""
    cpu: dict = {}
    for sdir in sorted(p for p in raw.iterdir() if p.is_dir()):
        rows = []
        for f in sorted(sdir.glob("rep*-*.cpu.json")):
            row = json.loads(f.read_text())
            row["group"] = f.name.removesuffix(".cpu.json")
            rows.append(row)
        if rows:
            cpu[sdir.name] = rows
    return cpu


def disk_rate(rows: list) -> float | None:
    """Median MB/s written to the machine's disks over the sequential group's calls."""
    seq = [r for r in rows if r.get("group", "").endswith("-seq")] or rows
    if not all("disk_written_mb" in r for r in seq):
        return None
    rates = [r["disk_written_mb"] / r["elapsed_s"] for r in seq if r["elapsed_s"] > 0]
    return round(statistics.median(rates)) if rates else None


def cpu_summary(cpu: dict) -> dict:
    """Per server: median and max foreign share, steal, and the server's and fio's CPU use."""
    out = {}
    for s, rows in cpu.items():
        def cores(key):
            return statistics.median(r[key] / r["elapsed_s"] for r in rows if r["elapsed_s"] > 0)
        out[s] = {
            "foreign_pct_median": statistics.median(r["foreign_pct"] for r in rows),
            "foreign_pct_max": max(r["foreign_pct"] for r in rows),
            "steal_pct_median": statistics.median(r["steal_pct"] for r in rows),
            "kernel_pct_median": statistics.median(r.get("kernel_pct", 0.0) for r in rows),
            "server_cores_median": round(cores("server_s"), 2),
            "client_cores_median": round(cores("client_s"), 2),
            "retried_groups": sum(1 for r in rows if r.get("attempt", 0) > 0),
            # MB/s reaching the machine's disks during the calls of the 64K/1M group (where
            # the writes are; all calls if there is none), None for results without it
            "disk_write_mbps_median": disk_rate(rows),
        }
    return out


def medians(servers: dict) -> dict:
    return {s: {k: {m: statistics.median(v) if v else None for m, v in cell.items()}
                for k, cell in cells.items()}
            for s, cells in servers.items()}


def load_side(raw: Path, suffix: str, parse) -> dict:
    """server -> [parsed raw/<server>/rep*<suffix> files]."""
    out: dict = {}
    for sdir in sorted(p for p in raw.iterdir() if p.is_dir()):
        rows = [parse(f) for f in sorted(sdir.glob(f"rep*{suffix}"))]
        if rows:
            out[sdir.name] = rows
    return out


def load_fills(raw: Path) -> dict:
    def parse(f: Path) -> dict:
        row = json.loads(f.read_text())
        row["run"] = f.name.removesuffix("-fill.json")
        return row
    return load_side(raw, "-fill.json", parse)


def load_failures(raw: Path) -> dict:
    return load_side(raw, ".failed", lambda f: f.read_text().strip())


def fmt_iops(v: float) -> str:
    return f"{v / 1000:.1f}k" if v >= 1000 else f"{v:.0f}"


def fmt_us(v: float) -> str:
    return f"{v / 1000:.2f} ms" if v >= 1000 else f"{v:.0f} µs"


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def ratio(med: dict, a: str, b: str, key: tuple) -> float | None:
    if a not in med or b not in med or key not in med[a] or key not in med[b]:
        return None
    den = med[b][key]["iops"]
    return med[a][key]["iops"] / den if den > 0 else None


def fill_bound(pct: int | None) -> float | None:
    """Issue 18's bound for bulwark's write cells over qemu raw at this pool fill."""
    if pct is None:
        return None
    if pct <= 50:
        return 1.0
    if pct <= 80:
        return 0.6
    return None


def targets(med: dict, fill_pct: int | None = None) -> list[dict]:
    """Each target: which ratios, the bound, the worst cell, met or not."""
    rows = []

    def versus(name: str, a: str, b: str, bound: float, keys) -> None:
        if a not in med or b not in med:
            return
        rs = [(k, ratio(med, a, b, k)) for k in keys if k in med[a] and k in med[b]]
        rs = [(k, r) for k, r in rs if r is not None]
        if not rs:
            return
        worst_key, worst = min(rs, key=lambda kr: kr[1])
        failing = [cell_label(k) for k, r in rs if r < bound]
        rows.append({
            "target": name, "bulwark": a, "versus": b, "bound": bound, "cells": len(rs),
            "worst_cell": cell_label(worst_key), "worst_ratio": round(worst, 3),
            "failing_cells": failing, "met": not failing,
        })

    def keys_of(a: str, b: str, pred=lambda k: True):
        return sorted((k for k in med.get(a, {}) if k in med.get(b, {}) and pred(k)), key=cell_sort)

    m2 = "bulwark-mirror2"
    plain = lambda k: not is_durable(k)
    if fill_pct is None:
        # the fresh-pool matrix (durable cells have targets of their own, below)
        versus("mirror:2 encrypted >= 1.0x qemu LUKS, every cell", m2, "qemu-luks", 1.0,
               keys_of(m2, "qemu-luks", plain))
        versus("mirror:2 encrypted >= 2.0x qemu LUKS, 64K and 1M cells", m2, "qemu-luks", 2.0,
               keys_of(m2, "qemu-luks", lambda k: plain(k) and k[0] >= 64 << 10))
        for s in SINGLES:
            versus(f"{s} >= 1.0x qemu raw, every cell", s, "qemu-raw", 1.0, keys_of(s, "qemu-raw", plain))
            versus(f"{s} >= 0.7x nbdkit file, every cell", s, "nbdkit-file", 0.7,
                   keys_of(s, "nbdkit-file", plain))
    else:
        bound = fill_bound(fill_pct)
        if bound is not None:
            for s in BULWARKS:
                versus(f"{s} at {fill_pct}% fill >= {bound}x qemu raw, every write cell", s, "qemu-raw",
                       bound, keys_of(s, "qemu-raw", lambda k: plain(k) and is_write(k)))
    # durable writes (issue 18): flushes reach the disk on every server
    for s in SINGLES + ["bulwark-single-log"]:
        versus(f"{s} durable writes >= 1.0x qemu raw" + (f" ({fill_pct}% fill)" if fill_pct else ""),
               s, "qemu-raw", 1.0, keys_of(s, "qemu-raw", is_durable))
    # issue 24: flushes from 32 writes in flight share one log write and one sync
    for s in SINGLES + ["bulwark-single-log"]:
        versus(f"{s} 4K randwrite QD32 fsync=32 >= 1.5x qemu raw", s, "qemu-raw", 1.5,
               [(4096, "randwrite", 32, 1, 32)])
    for m in (m2, "bulwark-mirror2-log"):
        versus(f"{m} durable writes >= 1.0x qemu LUKS" + (f" ({fill_pct}% fill)" if fill_pct else ""),
               m, "qemu-luks", 1.0, keys_of(m, "qemu-luks", is_durable))
    for s in BULWARKS:
        if s not in med:
            continue
        for pattern in ("randread", "randwrite"):
            one, two = (4096, pattern, 32, 1, 0), (4096, pattern, 32, 2, 0)
            if one in med[s] and two in med[s]:
                r = med[s][two]["iops"] / med[s][one]["iops"]
                rows.append({
                    "target": f"{s} 4K {pattern} QD32: 2 connections >= 1.6x 1 connection",
                    "bulwark": s, "versus": s, "bound": 1.6, "cells": 1,
                    "worst_cell": cell_label(two), "worst_ratio": round(r, 3),
                    "failing_cells": [] if r >= 1.6 else [cell_label(two)], "met": r >= 1.6,
                })
    return rows


def report(meta: dict, servers: dict, med: dict, tgt: list[dict], cpu: dict,
           fills: dict | None = None, failures: dict | None = None) -> str:
    fills, failures = fills or {}, failures or {}
    names = [s for s in SERVER_ORDER if s in med] + sorted(s for s in med if s not in SERVER_ORDER)
    keys = sorted({k for s in med.values() for k in s}, key=cell_sort)
    out = []
    m = meta.get("machine", {})
    st = meta.get("settings", {})
    reps = st.get("repeat", 1)
    out.append(f"Machine: {m.get('nproc')} CPUs ({m.get('cpu_model')}; {', '.join(m.get('cpu_flags', []))}), "
               f"{(m.get('mem_bytes') or 0) / 2**30:.1f} GiB RAM, kernel {m.get('kernel')}; "
               f"load average {' '.join(m.get('loadavg_start', []))} at start, "
               f"{' '.join(m.get('loadavg_end', []))} at end.")
    fill_pct = st.get("fill_pct")
    filled = (f"filled first with incompressible data (nbdcopy from nbdkit random); bulwark pools "
              f"sized for {fill_pct}% fill" if fill_pct else "filled first")
    prealloc = (", bulwark devices preallocated (pool create --preallocate)"
                if st.get("preallocate") else ", bulwark devices sparse")
    out.append(f"Settings: {st.get('transport')} sockets, {size_label(st.get('size_bytes', 0))} region "
               f"{filled}{prealloc}, {st.get('runtime_s')} s per cell, "
               + (f"median of {reps} runs" if reps > 1 else "one run") + ".")
    if fill_pct and st.get("runtime_s", 0) < 60:
        out.append(f"WARNING: cells of {st.get('runtime_s')} s with --fill: shorter than the 60 s a "
                   "sustained-overwrite cell needs for the cleaner to run; a smoke run, not a measurement.")
    for s, why in st.get("skipped", {}).items():
        out.append(f"SKIPPED: {s}: {why}.")
    if failures:
        out.append("WARNING: some bench calls failed (see Failures below); their servers' later groups "
                   "were not measured.")
    mx = st.get("max_foreign_pct")
    busy = [s for s, c in cpu.items() if mx is not None and c["foreign_pct_max"] > mx]
    if busy:
        out.append(f"WARNING: other processes used more than {mx}% of the CPUs during some calls of "
                   f"{', '.join(busy)} even after retries: those numbers are disturbed.")
    out.append("")

    if cpu:
        mx = meta.get("settings", {}).get("max_foreign_pct")
        out.append("**CPU during the measurements** (per `bulwark bench` call, median over calls; "
                   "cores = CPU seconds per second; foreign = other processes in the VM, kernel = "
                   "kernel threads (writeback, I/O), steal = taken by the hypervisor, each as % of "
                   "all CPUs" + (f"; calls with foreign above {mx}% were retried" if mx is not None else "")
                   + "; disk writes = MB/s that reached the machine's disks during the 64K/1M calls, "
                   "fill pass included)")
        out.append("")
        rows = []
        for s in names:
            c = cpu.get(s)
            if not c:
                continue
            rows.append([s, f"{c['server_cores_median']:.2f}", f"{c['client_cores_median']:.2f}",
                         f"{c['foreign_pct_median']:.0f}%", f"{c['foreign_pct_max']:.0f}%",
                         f"{c['kernel_pct_median']:.0f}%", f"{c['steal_pct_median']:.0f}%",
                         str(c["retried_groups"]),
                         "—" if c.get("disk_write_mbps_median") is None else f"{c['disk_write_mbps_median']:.0f}"])
        out.append(md_table(["server", "server CPU (cores)", "bench+fio CPU (cores)", "foreign (median)",
                             "foreign (max)", "kernel", "steal", "calls retried", "disk writes (MB/s)"], rows))
        out.append("")

    def grid(title: str, fmt, metric: str) -> None:
        out.append(f"**{title}**")
        out.append("")
        rows = []
        for k in keys:
            rows.append([cell_label(k)] + [fmt(med[s][k][metric]) if k in med[s] else "–" for s in names])
        out.append(md_table(["cell"] + names, rows))
        out.append("")

    if fills:
        out.append("**Fill** (per run: bulwark's pool as its status reports it after the fill; live = "
                   "the pool's used bytes, data and metadata; usable = total less the segments kept "
                   "for commits and the cleaner; qemu-raw-btrfs: its filesystem after the fill, one copy: "
                   "live = data used, usable = data used + free (estimated), device = each loop file)")
        out.append("")
        rows = []
        for s in names + sorted(set(fills) - set(names)):
            for f in fills.get(s, []):
                if "usable_bytes" in f:
                    rows.append([s, f["run"], f"{f['device_bytes'] / 2**20:.0f} MiB", f"{f['total_bytes'] / 2**20:.0f} MiB",
                                 f"{f['usable_bytes'] / 2**20:.0f} MiB", f"{f['used_bytes'] / 2**20:.0f} MiB",
                                 f"{f['fill_pct']:.1f}%", f"{f['volume_used_bytes'] / f['volume_size_bytes']:.3f}",
                                 f"{f['fill_s']:.0f} s"])
                else:
                    rows.append([s, f["run"], "–", "–", "–", "–", "–", "–", f"{f['fill_s']:.0f} s"])
        out.append(md_table(["server", "run", "device (each)", "total", "usable", "live", "fill",
                             "volume used / size", "fill time"], rows))
        out.append("")

    grid("IOPS", fmt_iops, "iops")
    disk = meta.get("settings", {}).get("disk_fdatasync_iops")
    qd1 = [k for k in keys if k[2] == 1 and k[4] == 1]  # QD1, a flush after each write
    if disk and qd1:
        k = qd1[0]
        shares = ", ".join(f"{s} {med[s][k]['iops'] / disk:.2f}" for s in names if k in med[s])
        out.append(f"**Flushes per second at QD1 against the physical limit**: the disk's own "
                   f"rate of 4K random writes each followed by an fdatasync (fio psync on a file "
                   f"in the workdir, no server) is {fmt_iops(disk)}/s; each server's "
                   f"{cell_label(k)} IOPS (one FLUSH per write) as a share of it: {shares}.")
        out.append("")
    grid("MB/s (10^6 bytes)", lambda v: f"{v:.0f}", "mb_per_s")
    out.append("**Latency p50 / p99**")
    out.append("")
    rows = []
    for k in keys:
        rows.append([cell_label(k)] + [
            f"{fmt_us(med[s][k]['lat_p50_us'])} / {fmt_us(med[s][k]['lat_p99_us'])}" if k in med[s] else "–"
            for s in names])
    out.append(md_table(["cell"] + names, rows))
    out.append("")

    wa_rows = []
    for k in keys:
        if not is_write(k):
            continue
        row, seen = [cell_label(k)], False
        for s in names:
            c = med[s].get(k)
            if c is None or c.get("wa") is None:
                row.append("–")
                continue
            seen = True
            row.append(f"{c['wa']:.2f} (cleaner {c['wa_clean']:.2f}, meta {c['wa_meta']:.2f})")
        if seen:
            wa_rows.append(row)
    if wa_rows:
        out.append("**Write amplification** (bytes written to the devices, every copy, during the cell / "
                   "bytes fio wrote; in brackets the cleaner's moves and the metadata's part of it; "
                   "mirror:2 writes every byte twice, so its floor is 2.0; peers: not measured)")
        out.append("")
        out.append(md_table(["cell"] + names, wa_rows))
        out.append("")

    peers = [p for p in PEERS if p in med]
    for b in [s for s in BULWARKS if s in med]:
        if not peers:
            break
        out.append(f"**{b} / peer (IOPS ratio)**")
        out.append("")
        rows = []
        for k in keys:
            if k not in med[b]:
                continue
            cells = []
            for p in peers:
                r = ratio(med, b, p, k)
                cells.append("–" if r is None else f"{r:.2f}x")
            rows.append([cell_label(k)] + cells)
        out.append(md_table(["cell"] + [f"vs {p}" for p in peers], rows))
        out.append("")

    scaling = []
    for s in names:
        for pattern in ("randread", "randwrite"):
            one, two = (4096, pattern, 32, 1, 0), (4096, pattern, 32, 2, 0)
            if one in med[s] and two in med[s] and med[s][one]["iops"] > 0:
                scaling.append((s, pattern, med[s][two]["iops"] / med[s][one]["iops"]))
    if scaling:
        out.append("**Two connections / one (4K QD32 each, IOPS ratio)**")
        out.append("")
        pats = ["randread", "randwrite"]
        rows = []
        for s in dict.fromkeys(x[0] for x in scaling):
            rows.append([s] + [next((f"{r:.2f}x" for n, p, r in scaling if n == s and p == pat), "–")
                               for pat in pats])
        out.append(md_table(["server"] + [f"4K {p}" for p in pats], rows))
        out.append("")

    if tgt:
        out.append("**Targets**")
        out.append("")
        rows = [[t["target"], f"{t['worst_ratio']:.2f}x ({t['worst_cell']})",
                 "met" if t["met"] else f"NOT met ({len(t['failing_cells'])}/{t['cells']} cells below)"]
                for t in tgt]
        out.append(md_table(["target", "worst ratio (cell)", "verdict"], rows))
        out.append("")

    if failures:
        out.append("**Failures**")
        out.append("")
        for s, texts in failures.items():
            for t in texts:
                out.append(f"- {s}:")
                out.append("")
                out.append("  ```")
                out.extend("  " + line for line in t.splitlines())
                out.append("  ```")
        out.append("")

    if reps > 1:
        out.append("**Spread across runs (max/min IOPS - 1)**")
        out.append("")
        rows = []
        for k in keys:
            row = [cell_label(k)]
            for s in names:
                v = servers[s].get(k, {}).get("iops")
                row.append(f"{(max(v) / min(v) - 1) * 100:.0f}%" if v and min(v) > 0 else "–")
            rows.append(row)
        out.append(md_table(["cell"] + names, rows))
        out.append("")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--raw", type=Path, required=True)
    ap.add_argument("--meta", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    meta = json.loads(a.meta.read_text()) if a.meta else {}
    servers = load(a.raw)
    failures = load_failures(a.raw)
    if not servers and not failures:
        print(f"no reports under {a.raw}", file=sys.stderr)
        return 1
    med = medians(servers)
    fill_pct = meta.get("settings", {}).get("fill_pct")
    tgt = targets(med, fill_pct)
    cpu = cpu_summary(load_cpu(a.raw))
    fills = load_fills(a.raw)
    text = report(meta, servers, med, tgt, cpu, fills, failures)
    print(text)
    if a.out:
        result = {
            **meta,
            "results": {
                s: [{"cell": cell_label(k), "block_size": k[0], "pattern": k[1], "iodepth": k[2], "jobs": k[3], "fsync": k[4],
                     **{m: round(v, 3) for m, v in med[s][k].items() if v is not None},
                     "runs": {m: servers[s][k][m] for m in METRICS}}
                    for k in sorted(med[s], key=cell_sort)]
                for s in med
            },
            "ratios": {
                b: {p: {cell_label(k): round(r, 3) for k in sorted(med[b], key=cell_sort)
                        if (r := ratio(med, b, p, k)) is not None}
                    for p in PEERS if p in med}
                for b in BULWARKS if b in med
            },
            "targets": tgt,
            "fills": fills,
            "failures": failures,
            "cpu": cpu,
            "cpu_calls": load_cpu(a.raw),
            "report_markdown": text,
        }
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
