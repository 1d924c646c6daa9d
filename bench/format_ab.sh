#!/usr/bin/env bash
# What format 2's authentication costs (decision 0011): the same workloads on binaries
# given in turn, in ROUNDS rounds (alternated: the machine is shared). Each run: a
# one-device `single` pool of DEV bytes (2300M: the 1 GiB volume fills it to ~47%), an
# encrypted 1 GiB volume (compression off) filled with incompressible data (nbdkit
# random), then fio (nbd engine) for RT seconds each: 4K randread QD32, 4K randwrite QD32,
# 4K randwrite QD1 with a FLUSH after every write (fsync=1), 64K randwrite QD32.
# Prints one line per binary and job: IOPS and p99 latency.
# Usage: RT=15 ROUNDS=2 bench/format_ab.sh /path/bulwark-format1 /path/bulwark-format2
# JOBS='randwrite 4k 1 --fsync=1;randwrite 64k 32' runs only those jobs.
set -euo pipefail
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null' EXIT
RT=${RT:-15}; ROUNDS=${ROUNDS:-2}; DEV=${DEV:-2300M}
fio_json() { fio "$@" --output-format=json 2>/dev/null | sed -n '/^{/,$ p'; }
one() {
    local B=$1 W
    W=$(mktemp -d)
    head -c 32 /dev/urandom >"$W/key"; chmod 600 "$W/key"
    BULWARK_REGISTRY="$W/registry.json" "$B" pool create "$W/p" --layout single --devices 1 --device-size "$DEV" >/dev/null
    "$B" serve "$W/p" >"$W/serve.log" 2>&1 &
    local pid=$!
    for _ in $(seq 100); do BULWARK_POOL=$W/p "$B" status >/dev/null 2>&1 && break; sleep 0.1; done
    BULWARK_POOL=$W/p "$B" volume create v --size 1G --key-file "$W/key" --compression off >/dev/null
    local U="nbd+unix:///v?socket=$W/p/nbd.sock"
    nbdkit -U - random size=1G --run "nbdcopy \$uri '$U'"
    local job rw bs qd extra
    local jobs=("randread 4k 32" "randwrite 4k 32" "randwrite 4k 1 --fsync=1" "randwrite 64k 32")
    [ -n "${JOBS:-}" ] && IFS=';' read -r -a jobs <<<"$JOBS"
    for job in "${jobs[@]}"; do
        read -r rw bs qd extra <<<"$job"
        fio_json --name=j --ioengine=nbd --uri="$U" --rw="$rw" --bs="$bs" --iodepth="$qd" --size=1G \
            --runtime="$RT" --time_based --norandommap --randrepeat=0 ${extra:-} >"$W/fio.json"
        python3 - "$W/fio.json" "$B" "$job" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
r = j["read"] if j["read"]["io_bytes"] else j["write"]
p99 = r["clat_ns"]["percentile"]["99.000000"] / 1000
print(f"{sys.argv[2]:<40} {sys.argv[3]:<26} iops {r['iops']:9.0f}  p99 {p99:8.0f} us")
PY
    done
    kill "$pid"; wait "$pid" 2>/dev/null || true
    rm -rf "$W"
}
for r in $(seq "$ROUNDS"); do
    echo "round $r  $(uptime | sed 's/.*load/load/')"
    for b in "$@"; do one "$b"; done
done
