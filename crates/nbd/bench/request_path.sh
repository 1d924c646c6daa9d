#!/usr/bin/env bash
# 4 KiB request path: fio's nbd engine, 4K randread/randwrite at QD32 with 1
# and 2 connections, against nbdkit's memory plugin (reference), memserve
# and `bulwark serve`, for one or two builds of memserve/bulwark in the same
# run (so both see the same machine load).
#
#   crates/nbd/bench/request_path.sh OUT_DIR LABEL=BINDIR [LABEL=BINDIR...]
#
# BINDIR holds `memserve` and `bulwark` (e.g. a copy of target/release/ and
# target/release/examples/ from before a change). Prints one table; raw fio
# JSON stays in OUT_DIR. RUNTIME (seconds per cell, default 10).
set -euo pipefail

OUT=${1:?usage: request_path.sh OUT_DIR LABEL=BINDIR...}
shift
RUNTIME=${RUNTIME:-10}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SIZE=2G

log() { printf '==> %s\n' "$*" >&2; }

fio_cell() { # uri rw jobs name
    local uri=$1 rw=$2 jobs=$3 name=$4
    fio --name=c --ioengine=nbd --uri="$uri" --rw="$rw" --bs=4k --iodepth=32 \
        --numjobs="$jobs" --runtime="$RUNTIME" --time_based --group_reporting \
        --output-format=json --output="$OUT/$name.json" >/dev/null 2>&1
    python3 - "$OUT/$name.json" "$rw" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
job = j["jobs"][0]
side = "read" if "read" in sys.argv[2] else "write"
print(f'{job[side]["iops"]/1000:.1f}k')
EOF
}

fill() { # uri
    fio --name=fill --ioengine=nbd --uri="$1" --rw=write --bs=1m --iodepth=8 \
        --output="$OUT/fill.txt" >/dev/null 2>&1
}

row() { # label uri
    local label=$1 uri=$2 cells=()
    for rw in randread randwrite; do
        for jobs in 1 2; do
            cells+=("$(fio_cell "$uri" "$rw" "$jobs" "${label// /_}-$rw-$jobs")")
        done
    done
    printf '| %s | %s | %s | %s | %s |\n' "$label" "${cells[@]}"
}

wait_for() { # path
    for _ in $(seq 100); do [ -S "$1" ] && return 0; sleep 0.1; done
    log "no socket $1"; return 1
}

echo "load before: $(uptime)"
echo
echo '| server | randread 1 conn | randread 2 conn | randwrite 1 conn | randwrite 2 conn |'
echo '| --- | --- | --- | --- | --- |'

# nbdkit memory plugin: the protocol ceiling on this machine.
sock=$OUT/nbdkit.sock
nbdkit --foreground --unix "$sock" --exit-with-parent memory size=$SIZE &
pid=$!
wait_for "$sock"
fill "nbd+unix:///?socket=$sock"
row "nbdkit memory" "nbd+unix:///?socket=$sock"
kill "$pid"; wait "$pid" 2>/dev/null || true

# memserve: the NBD layer over an in-memory backend.
for spec in "$@"; do
    label=${spec%%=*}; bin=${spec#*=}
    sock=$OUT/mem-$label.sock
    "$bin/memserve" "$sock" disk=$SIZE 2>"$OUT/memserve-$label.log" &
    pid=$!
    wait_for "$sock"
    fill "nbd+unix:///disk?socket=$sock"
    row "memserve $label" "nbd+unix:///disk?socket=$sock"
    kill -INT "$pid"; wait "$pid" 2>/dev/null || true
done

# bulwark serve: one pool and one 2G encrypted volume, filled once, served
# by each build in turn.
pool=$OUT/pool
rm -rf "$pool"
first_bin=${1#*=}
"$first_bin/bulwark" pool create "$pool" --layout single --devices 1 --device-size 4G >/dev/null
head -c32 /dev/urandom >"$OUT/key"; chmod 600 "$OUT/key"
filled=0
for spec in "$@"; do
    label=${spec%%=*}; bin=${spec#*=}
    "$bin/bulwark" serve "$pool" 2>"$OUT/serve-$label.log" &
    pid=$!
    wait_for "$pool/control.sock"; wait_for "$pool/nbd.sock"
    if [ $filled = 0 ]; then
        "$bin/bulwark" --pool "$pool" volume create v --size $SIZE --key-file "$OUT/key" >/dev/null
        fill "nbd+unix:///v?socket=$pool/nbd.sock"
        filled=1
    else
        "$bin/bulwark" --pool "$pool" key load v --key-file "$OUT/key" >/dev/null
    fi
    row "bulwark $label" "nbd+unix:///v?socket=$pool/nbd.sock"
    kill -TERM "$pid"; wait "$pid" 2>/dev/null || true
done
echo
echo "load after: $(uptime)"
