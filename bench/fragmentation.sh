#!/usr/bin/env bash
# The cost of fragmentation (issue 40): a sequential read of a volume before and after
# random overwrite of TIMES its size. A `single` pool, an encrypted volume sized to FILL of
# the pool's usable space, filled with incompressible data by 1 MiB sequential writes; its
# read (1 MiB, QD8, whole volume) is timed; then random BS overwrites (QD16, TIMES x the
# volume's size, FLUSH every 64 writes, new incompressible data) scatter its blocks, as
# weeks of a guest's random writes do (holes filled, the cleaner moving records); then the
# same read again. Before each read the daemon is restarted (its caches empty) and, where
# this user may, the host's page cache is dropped, so the reads come from the device file.
#
#   bench/fragmentation.sh [FILL=0.8] [TIMES=5] [BS=4k] [DEVICE_SIZE=1280M]
#   SERVE_ARGS=--no-fill-holes bench/fragmentation.sh ...   the cleaner alone (holes are the default, decision 0014)
#
# Prints both reads' MiB/s, their ratio (issue 40's target: >= 0.7), the overwrite's
# IOPS and the pool's write amplification over it; then leaves the daemon alone until its
# idle defragmenter has made a pass (its time, the bytes it moved) and reads a third time
# (skipped with SERVE_ARGS=--no-defrag). What it shows: what scattering costs a
# reader on this machine's disk through the host's file system. What it does not: a
# spinning disk (seeks cost far more there), a peer (qemu raw on a file never moves a
# block: its ratio is 1 by construction), or reads while the overwrite runs.
set -euo pipefail
cd "$(dirname "$0")/.."
FILL=${1:-0.8}; TIMES=${2:-5}; BS=${3:-4k}; DEV=${4:-1280M}
B=${BULWARK_BIN:-$PWD/target/release/bulwark}
W=$(mktemp -d)
SERVE_PID=
stop() { [ -n "$SERVE_PID" ] && kill "$SERVE_PID" 2>/dev/null && wait "$SERVE_PID" 2>/dev/null; SERVE_PID=; }
trap 'stop; rm -rf "$W"' EXIT
export BULWARK_POOL=$W/pool BULWARK_REGISTRY=$W/registry.json
serve() {
    # shellcheck disable=SC2086  # SERVE_ARGS: more serve flags, split on purpose
    "$B" serve "$W/pool" ${SERVE_ARGS:-} 2>>"$W/serve.log" &
    SERVE_PID=$!
    for _ in $(seq 200); do [ -S "$W/pool/nbd.sock" ] && "$B" status >/dev/null 2>&1 && return; sleep 0.1; done
    echo "fragmentation.sh: the daemon did not start; its log:" >&2; cat "$W/serve.log" >&2; exit 1
}
restart() {
    stop
    sync
    if [ -w /proc/sys/vm/drop_caches ]; then echo 1 > /proc/sys/vm/drop_caches; DROPPED=yes; else DROPPED=no; fi
    serve
    "$B" key load v --key-file "$W/k" >/dev/null
}
URI="nbd+unix:///v?socket=$W/pool/nbd.sock"
read_mib_s() { # TAG: whole-volume 1 MiB sequential read, MiB/s
    fio --name=read --ioengine=nbd --uri="$URI" --rw=read --bs=1m --iodepth=8 \
        --output-format=json --output="$W/$1.json" >/dev/null
    python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))["jobs"][0]["read"]; print("%.1f" % (j["bw_bytes"] / 2**20))' "$W/$1.json"
}
space() { "$B" status --json | python3 -c 'import json,sys; s=json.load(sys.stdin)["space"]; print(s["data_written_bytes"], s["clean_written_bytes"], s["meta_written_bytes"], s["used_bytes"], s["usable_bytes"], s.get("hole_filled_bytes", 0))'; }

"$B" pool create "$W/pool" --devices 1 --device-size "$DEV" --preallocate >/dev/null 2>&1
serve
usable=$("$B" status --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["space"]["usable_bytes"])')
size=$(python3 -c "print(int($usable * $FILL) // 2**20)")
(umask 077; head -c 32 /dev/urandom > "$W/k")
"$B" volume create v --size "${size}M" --key-file "$W/k" --compression off >/dev/null
fio --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1m --iodepth=8 --refill_buffers \
    --end_fsync=1 --output-format=json --output="$W/fill.json" >/dev/null
echo "fill $FILL of usable ($size MiB volume on a $DEV device), overwrite ${TIMES}x at $BS, $(git rev-parse --short HEAD) ${SERVE_ARGS:-}"
restart
before=$(read_mib_s before)
echo "  1M sequential read, fresh:            $before MiB/s (page cache dropped: $DROPPED)"
read -r d0 c0 m0 _ _ h0 <<<"$(space)"
fio --name=overwrite --ioengine=nbd --uri="$URI" --rw=randwrite --bs="$BS" --iodepth=16 \
    --io_size="$((size * TIMES))M" --refill_buffers --fsync=64 --randrepeat=0 \
    --output-format=json --output="$W/over.json" >/dev/null 2>"$W/over.err" \
    || echo "  random overwrite REFUSED or failed: $(grep -m1 -o 'error=[^ ]*\|No space left on device' "$W/over.err" || echo "fio exit non-zero")"
read -r d1 c1 m1 used usable h1 <<<"$(space)"
python3 - "$W/over.json" "$d0" "$c0" "$m0" "$d1" "$c1" "$m1" "$used" "$usable" "$h0" "$h1" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]["write"]
d0, c0, m0, d1, c1, m1, used, usable, h0, h1 = map(int, sys.argv[2:])
client = d1 - d0
wa = (client + (c1 - c0) + (m1 - m0)) / client if client else float("nan")
print(f"  random overwrite: {j['iops']:.0f} IOPS, "
      f"{client / 2**20:.0f} MiB, WA {wa:.2f} (cleaner {(c1 - c0) / max(client, 1):.2f}), "
      f"into holes {(h1 - h0) / 2**20:.0f} MiB, used {used / usable:.0%} of usable")
PY
restart
after=$(read_mib_s after)
echo "  1M sequential read, after overwrite:  $after MiB/s (page cache dropped: $DROPPED)"
python3 -c "print('  after / before: %.2f (target >= 0.7, issue 40)' % ($after / $before))"
# The idle defragmenter (pool/defrag.rs; off with SERVE_ARGS=--no-defrag): left alone, the
# daemon rewrites scattered blocks in block order after DEFRAG_IDLE_SECS with no client.
if [[ " ${SERVE_ARGS:-} " == *" --no-defrag "* ]]; then exit 0; fi
defrag() { "$B" status --json | python3 -c 'import json,sys; s=json.load(sys.stdin)["space"]; print(s.get("defrag_passes", 0), s.get("defrag_moved_bytes", 0), s["clean_written_bytes"])'; }
t0=$(date +%s.%N)
for _ in $(seq 600); do read -r passes moved cleaned <<<"$(defrag)"; [ "$passes" -ge 1 ] && break; sleep 1; done
t1=$(date +%s.%N)
python3 - "$passes" "$moved" "$cleaned" "$size" "$t0" "$t1" <<'PY'
import sys
p, m, c, size = map(int, sys.argv[1:5])
t = float(sys.argv[6]) - float(sys.argv[5])
done = "a pass done" if p else "NO pass done"
print(f"  idle defragmenter: {done} in {t:.1f} s (its quiet time included), moved {m / 2**20:.0f} MiB "
      f"({m / (size * 2**20):.2f}x the volume); cleaner and defragmenter wrote {c / 2**20:.0f} MiB")
PY
restart
defragged=$(read_mib_s defragged)
echo "  1M sequential read, after defragmenting: $defragged MiB/s (page cache dropped: $DROPPED)"
python3 -c "print('  defragmented / before: %.2f (target >= 0.7, issue 40)' % ($defragged / $before))"
