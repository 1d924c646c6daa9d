#!/usr/bin/env bash
# Writers at 90% fill (issue 36): a `single` pool, an encrypted volume sized to FILL of
# the pool's usable space, filled with incompressible data, then random overwrite at
# 4 KiB and at 64 KiB (QD16, RT seconds each, time-based, so the cleaner runs all along).
# Prints per cell: IOPS, p99 and worst (max) completion latency, errors, and the pool's
# write amplification over the cell (device bytes, every copy, per client byte).
#
#   bench/full_pool.sh [FILL=0.9] [RT=30] [DEVICE_SIZE=512M]
#   SNAPSHOT=1 bench/full_pool.sh ...   a snapshot of the filled volume pins its data:
#                                       the overwrites fill the pool and must be refused
#                                       (ENOSPC) within the stated bound, never hang;
#                                       fio goes on past errors, "worst" counts refusals
#   FSYNC=64 bench/full_pool.sh ...     a FLUSH every 64 writes (durable writes, as a
#                                       guest that syncs): also prints the worst FLUSH
#
# What it shows: how long writers wait at the fill where the cleaner works hardest, and
# that they are answered (no ENOSPC while the live data fits). What it does not: a peer
# (qemu raw does not clean: bench/peers.sh --fill 80 has the same-run ratios).
set -euo pipefail
cd "$(dirname "$0")/.."
FILL=${1:-0.9}; RT=${2:-30}; DEV=${3:-512M}
B=${BULWARK_BIN:-$PWD/target/release/bulwark}
W=$(mktemp -d); trap 'kill %1 2>/dev/null || true; wait; [ -n "${KEEP_LOG:-}" ] && cp "$W/serve.log" "$KEEP_LOG"; rm -rf "$W"' EXIT
export BULWARK_POOL=$W/pool BULWARK_REGISTRY=$W/registry.json
"$B" pool create "$W/pool" --devices 1 --device-size "$DEV" --preallocate >/dev/null 2>&1
# SERVE_ARGS: more serve flags (e.g. --no-fill-holes: the cleaner alone).
"$B" serve "$W/pool" ${SERVE_ARGS:-} 2>"$W/serve.log" &
for _ in $(seq 100); do [ -S "$W/pool/nbd.sock" ] && break; sleep 0.1; done
usable=$("$B" status --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["space"]["usable_bytes"])')
size=$(python3 -c "print(int($usable * $FILL) // 2**20)")
(umask 077; head -c 32 /dev/urandom > "$W/k")
"$B" volume create v --size "${size}M" --key-file "$W/k" --compression off >/dev/null
URI="nbd+unix:///v?socket=$W/pool/nbd.sock"
fio --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1m --iodepth=8 --refill_buffers \
    --end_fsync=1 --output-format=json --output="$W/fill.json" >/dev/null
space() { "$B" status --json | python3 -c 'import json,sys; s=json.load(sys.stdin)["space"]; print(s["data_written_bytes"], s["clean_written_bytes"], s["meta_written_bytes"], s["used_bytes"], s["usable_bytes"])'; }
EXTRA=()
if [ "${SNAPSHOT:-0}" = 1 ]; then
    "$B" snapshot create v@full >/dev/null
    EXTRA=(--continue_on_error=all)
fi
echo "fill $FILL of usable ($size MiB volume on a $DEV device), ${RT}s per cell, $(git rev-parse --short HEAD)"
for bs in 4k 64k; do
    read -r d0 c0 m0 _ _ <<<"$(space)"
    fio --name=ow --ioengine=nbd --uri="$URI" --rw=randwrite --bs=$bs --iodepth=16 \
        --time_based --runtime="$RT" --norandommap --randrepeat=0 --refill_buffers \
        ${FSYNC:+--fsync=$FSYNC} "${EXTRA[@]}" --output-format=json --output="$W/$bs.json" >/dev/null 2>&1 || true
    read -r d1 c1 m1 used usable <<<"$(space)"
    python3 - "$W/$bs.json" "$bs" "$d0" "$c0" "$m0" "$d1" "$c1" "$m1" "$used" "$usable" <<'EOF'
import json, sys
job = json.load(open(sys.argv[1]))["jobs"][0]
j = job["write"]
bs = sys.argv[2]
d0, c0, m0, d1, c1, m1, used, usable = map(int, sys.argv[3:])
client = max(d1 - d0, 1)
wa = (client + (c1 - c0) + (m1 - m0)) / client
clat = j["clat_ns"]
p99 = clat.get("percentile", {}).get("99.000000", 0) / 1e6
print(f"{bs:>4} randwrite QD16: {j['iops']:8.0f} IOPS ({j.get('total_ios', 0)} done), p99 {p99:7.2f} ms, worst {clat['max'] / 1e6:8.1f} ms, "
      f"WA {wa:.2f} (cleaner {(c1 - c0) / client:.2f}, metadata {(m1 - m0) / client:.2f}), "
      f"used {used / usable:.0%} of usable")
sync = job.get("sync", {})
if sync.get("total_ios"):
    lat = sync["lat_ns"]
    print(f"     FLUSH: {sync['total_ios']} done, mean {lat['mean'] / 1e6:.2f} ms, worst {lat['max'] / 1e6:.1f} ms")
EOF
done
"$B" status | grep -E "^(space|cleaning|cleaner cost)" || true
grep -c "out of space" "$W/serve.log" | sed 's/^/writes refused for space: /' || true
grep -m1 "out of space" "$W/serve.log" | sed 's/^/first refusal: /' || true
"$B" status | grep -E "^holes" || true
