#!/usr/bin/env bash
# The read path with and without a cache device, and against a binary without one at all:
# fio 4K randread QD32 on a 1 GiB encrypted volume (compression off) filled with
# incompressible data, in a one-device `single` pool, for each binary given, in turn, in
# ROUNDS rounds (alternated: the machine is shared). A binary given as `BIN+cache` runs
# `serve --cache-device` on a file of CACHE bytes in the same temporary directory (the
# same disk: this measures the cached path's cost, not a faster device), read once whole
# first so the cache holds the volume.
# Usage: RT=20 ROUNDS=2 bench/cachedev_ab.sh /path/bulwark-base /path/bulwark-new /path/bulwark-new+cache
set -euo pipefail
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null' EXIT
RT=${RT:-20}; ROUNDS=${ROUNDS:-2}; CACHE=${CACHE:-2G}
fio_json() { fio "$@" --output-format=json 2>/dev/null | sed -n '/^{/,$ p'; }
one() {
    local spec=$1 B=${1%+cache} W
    W=$(mktemp -d)
    head -c 32 /dev/urandom >"$W/key"; chmod 600 "$W/key"
    BULWARK_REGISTRY="$W/registry.json" "$B" pool create "$W/p" --layout single --devices 1 --device-size 3G >/dev/null
    local extra=()
    if [[ $spec == *+cache ]]; then truncate -s "$CACHE" "$W/cache.img"; extra=(--cache-device "$W/cache.img"); fi
    "$B" serve "$W/p" "${extra[@]}" >"$W/serve.log" 2>&1 &
    local pid=$!
    for _ in $(seq 100); do BULWARK_POOL=$W/p "$B" status >/dev/null 2>&1 && break; sleep 0.1; done
    BULWARK_POOL=$W/p "$B" volume create v --size 1G --key-file "$W/key" --compression off >/dev/null
    local U="nbd+unix:///v?socket=$W/p/nbd.sock"
    nbdkit -U - random size=1G --run "nbdcopy \$uri '$U'"
    if [[ $spec == *+cache ]]; then
        # Read whole until the cache holds every block (offers past its fill queue are
        # dropped, so one pass may not fill it all).
        for _ in $(seq 8); do
            nbdcopy "$U" null:
            sleep 1
            n=$(BULWARK_POOL=$W/p "$B" status --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["cache_device"]["entries"])')
            [ "$n" -ge 262144 ] && break
        done
    fi
    fio_json --name=r --ioengine=nbd --uri="$U" --rw=randread --bs=4k --iodepth=32 --size=1G \
        --runtime="$RT" --time_based --norandommap --randrepeat=0 >"$W/fio.json"
    local cache_line=""
    if [[ $spec == *+cache ]]; then
        cache_line=$(BULWARK_POOL=$W/p "$B" status --json | python3 -c 'import json,sys; c=json.load(sys.stdin)["cache_device"]; print("hits %(hits)d misses %(misses)d entries %(entries)d dropped %(fills_dropped)d errors %(errors)d" % c)')
    fi
    python3 - "$W/fio.json" "$spec" "$cache_line" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["jobs"][0]["read"]
p99 = r["clat_ns"]["percentile"]["99.000000"] / 1000
print(f"{sys.argv[2]:<45} iops {r['iops']:9.0f}  p99 {p99:7.0f} us  {sys.argv[3]}")
PY
    kill "$pid"; wait "$pid" 2>/dev/null || true
    rm -rf "$W"
}
for r in $(seq "$ROUNDS"); do
    echo "round $r  $(uptime | sed 's/.*load/load/')"
    for b in "$@"; do one "$b"; done
done
