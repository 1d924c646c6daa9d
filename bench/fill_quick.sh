#!/usr/bin/env bash
# A quick look at random overwrite near a given fill, one cell, bulwark beside qemu raw,
# one after the other (not the side-by-side matrix: use bench/peers.sh --fill for that).
# A 1 GiB encrypted volume in a one-device `single` pool sized for ~47% fill (DEV), filled
# with incompressible data (nbdkit random), then fio randwrite QD32 for RT seconds; prints
# IOPS, MB/s and write amplification (device bytes, every stream / bytes fio wrote, from
# `status --json`). Then the same fio on qemu-storage-daemon over a raw 1 GiB file.
# Usage: BS=64k RT=30 DEV=2300M [VOPT="--compression off"] bench/fill_quick.sh
set -euo pipefail
B=${BULWARK_BIN:-$(cd "$(dirname "$0")/.." && pwd)/target/release/bulwark}
W=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$W"' EXIT
BS=${BS:-64k}; RT=${RT:-30}
fio_json() { fio "$@" --output-format=json 2>/dev/null | sed -n '/^{/,$ p'; }
head -c 32 /dev/urandom >"$W/key"; chmod 600 "$W/key"
BULWARK_REGISTRY="$W/registry.json" "$B" pool create "$W/p" --layout single --devices 1 --device-size "${DEV:-2300M}" >/dev/null
"$B" serve "$W/p" >"$W/serve.log" 2>&1 &
export BULWARK_POOL=$W/p
for _ in $(seq 100); do "$B" status >/dev/null 2>&1 && break; sleep 0.1; done
"$B" volume create v --size 1G --key-file "$W/key" ${VOPT:-} >/dev/null
U="nbd+unix:///v?socket=$W/p/nbd.sock"
nbdkit -U - random size=1G --run "nbdcopy \$uri '$U'"
"$B" status --json >"$W/before.json"
fio_json --name=o --ioengine=nbd --uri="$U" --rw=randwrite --bs="$BS" --iodepth=32 --size=1G \
    --runtime="$RT" --time_based --norandommap --randrepeat=0 >"$W/fio.json"
"$B" status --json >"$W/after.json"
python3 - "$W" <<'PY'
import json, sys
w = sys.argv[1]
f = json.load(open(f"{w}/fio.json"))["jobs"][0]["write"]
b = json.load(open(f"{w}/before.json"))["space"]; a = json.load(open(f"{w}/after.json"))["space"]
keys = ("data_written_bytes", "clean_written_bytes", "meta_written_bytes")
dev = sum(a[k] - b[k] for k in keys)
print(f"bulwark  fill {round((1 << 30) / a['usable_bytes'] * 100)}%  iops {f['iops']:.0f}  "
      f"MB/s {f['bw_bytes'] / 1e6:.0f}  WA {dev / f['io_bytes']:.2f}")
PY
truncate -s 1G "$W/img"
qemu-storage-daemon --blockdev driver=file,node-name=f,filename="$W/img",cache.direct=off,cache.no-flush=off \
    --blockdev driver=raw,node-name=r,file=f --nbd-server addr.type=unix,addr.path="$W/q.sock" \
    --export type=nbd,id=e,node-name=r,name=v,writable=on >"$W/q.log" 2>&1 &
for _ in $(seq 100); do [ -S "$W/q.sock" ] && break; sleep 0.1; done
Q="nbd+unix:///v?socket=$W/q.sock"
nbdkit -U - random size=1G --run "nbdcopy \$uri '$Q'"
fio_json --name=o --ioengine=nbd --uri="$Q" --rw=randwrite --bs="$BS" --iodepth=32 --size=1G \
    --runtime="$RT" --time_based --norandommap --randrepeat=0 >"$W/q.json"
python3 -c "import json; f=json.load(open('$W/q.json'))['jobs'][0]['write']; print(f\"qemu raw iops {f['iops']:.0f}  MB/s {f['bw_bytes']/1e6:.0f}\")"
