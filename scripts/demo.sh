#!/usr/bin/env bash
# The main job, end to end: build bulwark, make a mirrored pool of two sparse
# 1 GiB files in ./demo/pool, serve it, create an encrypted volume with a
# generated key file, put an ext4 filesystem on it through nbdfuse and a loop
# mount, show what it looks like, then shut everything down cleanly.
#
# Needs root for the loop mount (uses sudo otherwise). Safe to re-run: it
# removes ./demo from a previous run first. BULWARK_BIN=path skips the build.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"

DEMO=$ROOT/demo
POOL=$DEMO/pool
# The pool's trust root (pool.key, pool.anchor) apart from the device files: on a real
# host, on another disk than the devices (say /etc/bulwark/trust/NAME on the system disk),
# so that a copy of the devices' file system carries neither (docs/runbook.md, "Where the
# trust root lives"). The demo has one disk, so `pool create` warns that they share it.
TRUST=$DEMO/trust
KEY=$DEMO/keys/vm1.key
MNT=$DEMO/mnt          # nbdfuse shows the volume as the file $MNT/vm1
FS=$DEMO/fs            # where the ext4 filesystem is mounted
BIN=${BULWARK_BIN:-$ROOT/target/release/bulwark}
SOCK=$POOL/nbd.sock
URI="nbd+unix:///vm1?socket=$SOCK"

say() { printf '\n\033[1m$ %s\033[0m\n' "$*"; }
b() { say "bulwark $*"; "$BIN" --pool "$POOL" "$@"; }

teardown() {
    # Leave nothing mounted or running, whatever happened.
    mountpoint -q "$FS" 2>/dev/null && $SUDO umount "$FS" || true
    mountpoint -q "$MNT" 2>/dev/null && fusermount3 -u "$MNT" || true
    if [ -f "$DEMO/serve.pid" ]; then
        pid=$(cat "$DEMO/serve.pid")
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fi
        rm -f "$DEMO/serve.pid"
    fi
}

if [ -z "${BULWARK_BIN:-}" ]; then
    log "building bulwark (release)"
    cargo build --release -p bulwark
fi

teardown
rm -rf "$DEMO"
mkdir -p "$DEMO/keys" "$MNT" "$FS"

# The demo's pool is registered in a registry of its own ('bulwark pool list'), not the host's.
export BULWARK_REGISTRY=$DEMO/registry.json
say "bulwark pool create $POOL --layout mirror:2 --devices 2 --device-size 1G --key-dir $TRUST"
"$BIN" pool create "$POOL" --layout mirror:2 --devices 2 --device-size 1G --key-dir "$TRUST"
ls -ls "$POOL" "$TRUST"

say "bulwark serve $POOL &"
"$BIN" serve "$POOL" >"$DEMO/serve.log" 2>&1 &
echo $! >"$DEMO/serve.pid"
trap 'teardown' EXIT
for _ in $(seq 150); do
    "$BIN" --pool "$POOL" status >/dev/null 2>&1 && break
    kill -0 "$(cat "$DEMO/serve.pid")" 2>/dev/null || { cat "$DEMO/serve.log"; exit 1; }
    sleep 0.2
done

say "head -c 32 /dev/urandom > $KEY   (mode 0600)"
(umask 077; head -c 32 /dev/urandom >"$KEY")
b volume create vm1 --size 1G --key-file "$KEY"
b status

say "nbdfuse $MNT/vm1 '$URI' &"
nbdfuse "$MNT/vm1" "$URI" &
NBDFUSE=$!
for _ in $(seq 100); do [ -s "$MNT/vm1" ] && break; sleep 0.1; done
ls -l "$MNT"

say "mkfs.ext4 -q -F $MNT/vm1 && mount -o loop $MNT/vm1 $FS"
mkfs.ext4 -q -F "$MNT/vm1"
$SUDO mount -o loop "$MNT/vm1" "$FS"

say "write a few files"
$SUDO cp "$ROOT/README.md" "$FS/"
$SUDO mkdir -p "$FS/data"
for i in 1 2 3; do $SUDO dd if=/dev/urandom of="$FS/data/file$i.bin" bs=1M count=$((i * 4)) status=none; done
$SUDO sh -c "cd '$FS' && sha256sum README.md data/* | tee SHA256SUMS"
sync -f "$FS"
say "df -h $FS"
df -h "$FS"
b status

cat <<EOT

----------------------------------------------------------------------
Attach the volume to a VM while the daemon runs (key loaded):

  qemu-system-x86_64 -accel kvm -m 2G \\
      -drive file=nbd+unix:///vm1?socket=$SOCK,format=raw,if=virtio,cache=none

  libvirt <devices> entry:

    <disk type='network' device='disk'>
      <driver name='qemu' type='raw' cache='none'/>
      <source protocol='nbd' name='vm1'>
        <host transport='unix' socket='$SOCK'/>
      </source>
      <target dev='vda' bus='virtio'/>
    </disk>

  Other clients: nbdinfo '$URI', nbdcopy, qemu-img, fio --ioengine=nbd.
----------------------------------------------------------------------
EOT

say "umount $FS && fusermount3 -u $MNT"
$SUDO umount "$FS"
fusermount3 -u "$MNT"
wait "$NBDFUSE" || true

say "kill -TERM <bulwark serve>   (commits, exits 0)"
pid=$(cat "$DEMO/serve.pid")
kill -TERM "$pid"
rc=0; wait "$pid" || rc=$?
rm -f "$DEMO/serve.pid"
trap - EXIT
if [ "$rc" -ne 0 ]; then
    echo "bulwark serve exited $rc; log:"; cat "$DEMO/serve.log"; exit 1
fi
echo "daemon stopped cleanly"

cat <<EOT

The pool stays in $POOL, its trust root in $TRUST (back up pool.key, away
from the devices). To use it again:
  $BIN serve $POOL &
  $BIN --pool $POOL key load vm1 --key-file $KEY
EOT
