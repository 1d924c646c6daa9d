#!/usr/bin/env bash
# Where a random-overwrite cell's time goes, thread by thread: what bounds it.
# A 1 GiB encrypted volume in a one-device `single` pool of DEV (1390M: ~80% of usable
# once filled; 2300M: ~50%), filled with incompressible data (nbdkit random), then fio
# randwrite BS at QD32 for RT seconds. From RT/3 on, for WIN seconds, it samples
# /proc/PID/task/*/schedstat of the daemon (time on a CPU, time waiting for one) and
# /proc/diskstats (sectors written to the disk under the pool), and prints per thread
# name the share of the window on a CPU, waiting for one, and off (blocked), with the
# machine's CPU use (/proc/stat), the disk's write rate, the cell's IOPS and the write
# amplification (device bytes / client bytes, from `status --json`).
# Usage: BS=64k RT=45 WIN=10 DEV=1390M [SERVE_ARGS=--no-fill-holes] bench/thread_time.sh
set -euo pipefail
B=${BULWARK_BIN:-$(cd "$(dirname "$0")/.." && pwd)/target/release/bulwark}
W=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$W"' EXIT
BS=${BS:-64k}; RT=${RT:-45}; WIN=${WIN:-10}
head -c 32 /dev/urandom >"$W/key"; chmod 600 "$W/key"
BULWARK_REGISTRY="$W/registry.json" "$B" pool create "$W/p" --layout single --devices 1 \
    --device-size "${DEV:-1390M}" --preallocate >/dev/null
# shellcheck disable=SC2086
"$B" serve "$W/p" ${SERVE_ARGS:-} >"$W/serve.log" 2>&1 &
PID=$!
export BULWARK_POOL=$W/p
for _ in $(seq 100); do "$B" status >/dev/null 2>&1 && break; sleep 0.1; done
"$B" volume create v --size 1G --key-file "$W/key" >/dev/null
U="nbd+unix:///v?socket=$W/p/nbd.sock"
nbdkit -U - random size=1G --run "nbdcopy \$uri '$U'"
"$B" status --json >"$W/before.json"
fio --name=o --ioengine=nbd --uri="$U" --rw=randwrite --bs="$BS" --iodepth=32 --size=1G \
    --runtime="$RT" --time_based --norandommap --randrepeat=0 --output-format=json \
    --output="$W/fio.json" >/dev/null 2>&1 &
FIO=$!
sleep $((RT / 3))
DISK=$(df --output=source "$W" | tail -1 | sed 's#/dev/##; s#[0-9]*$##')
snap() {
    for t in /proc/"$PID"/task/*; do
        printf '%s %s %s\n' "$(basename "$t")" "$(tr ' ' '_' <"$t/comm")" "$(cut -d' ' -f1,2 "$t/schedstat")"
    done >"$W/$1.threads"
    awk -v d="$DISK" '$3 == d {print $10}' /proc/diskstats >"$W/$1.disk"
    head -1 /proc/stat >"$W/$1.cpu"
}
snap a; T0=$(date +%s.%N); sleep "$WIN"; snap b; T1=$(date +%s.%N)
wait $FIO
"$B" status --json >"$W/after.json"
python3 - "$W" "$T0" "$T1" "$DISK" <<'PY'
import collections, json, sys
w, t0, t1, disk = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
span = t1 - t0
def threads(n):
    out = {}
    for line in open(f"{w}/{n}.threads"):
        tid, name, run, wait = line.split()
        out[tid] = (name, int(run), int(wait))
    return out
a, b = threads("a"), threads("b")
per = collections.defaultdict(lambda: [0.0, 0.0, 0])
for tid, (name, run, wait) in b.items():
    ra, wa = a.get(tid, (name, 0, 0))[1:]
    p = per[name]
    p[0] += (run - ra) / 1e9 / span
    p[1] += (wait - wa) / 1e9 / span
    p[2] += 1
print(f"window {span:.1f} s; per thread name: on a CPU / waiting for one / off (sum over its threads)")
for name, (run, wait, n) in sorted(per.items(), key=lambda kv: -kv[1][0]):
    if run + wait < 0.01:
        continue
    print(f"  {name:<24} x{n:<3} on {run:5.2f}  waiting {wait:5.2f}  off {max(n - run - wait, 0):5.2f}")
ca = [int(x) for x in open(f"{w}/a.cpu").read().split()[1:]]
cb = [int(x) for x in open(f"{w}/b.cpu").read().split()[1:]]
d = [y - x for x, y in zip(ca, cb)]
tot = sum(d)
print(f"machine CPU: user {100*(d[0]+d[1])/tot:.0f}%  system {100*(d[2]+d[5]+d[6])/tot:.0f}%  "
      f"idle {100*d[3]/tot:.0f}%  iowait {100*d[4]/tot:.0f}%  steal {100*d[7]/tot:.0f}%")
sa, sb = int(open(f"{w}/a.disk").read() or 0), int(open(f"{w}/b.disk").read() or 0)
print(f"disk {disk}: {(sb - sa) * 512 / span / 1e6:.0f} MB/s written")
f = json.load(open(f"{w}/fio.json"))["jobs"][0]["write"]
bj = json.load(open(f"{w}/before.json"))["space"]; aj = json.load(open(f"{w}/after.json"))["space"]
keys = ("data_written_bytes", "clean_written_bytes", "meta_written_bytes")
dev = sum(aj[k] - bj[k] for k in keys)
print(f"cell: {f['iops']:.0f} IOPS, {f['bw_bytes']/1e6:.0f} MB/s, WA {dev / f['io_bytes']:.2f} "
      f"(cleaner {(aj['clean_written_bytes'] - bj['clean_written_bytes']) / f['io_bytes']:.2f}), "
      f"fill {round(aj['used_bytes'] / aj['usable_bytes'] * 100)}% of usable")
PY
