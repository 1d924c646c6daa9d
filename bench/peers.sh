#!/usr/bin/env bash
# Measure bulwark against its peers on this machine, with the same fio
# settings for every server: each one is measured by `bulwark bench --uri URI
# --json` (one code path: fio's nbd engine, same flags, same parsing); bulwark
# volumes on unix sockets by name (`bulwark --pool DIR bench disk`: the same
# socket and fio command line, and bench reads the pool's status around each
# write cell for its write amplification).
#
# Servers (each on a fully allocated SIZE image or volume, filled by bench's
# sequential 1M write pass before any cell, served over a unix socket, or
# TCP loopback with --tcp):
#   qemu-raw             qemu-storage-daemon, raw image (no encryption)
#   qemu-luks            qemu-storage-daemon, LUKS image (aes-256-xts-plain64)
#   nbdkit-file          nbdkit's file plugin, raw image
#   qemu-raw-btrfs       as qemu-raw (same qemu-storage-daemon command line), the raw
#                        image a file on btrfs raid1 (-d raid1 -m raid1) over two loop
#                        devices: what copy-on-write and two copies cost elsewhere (issue
#                        40). Each loop file is sized like a bulwark device (see Fill:
#                        with --fill the image is PCT% of the filesystem's usable data
#                        space). Needs root, loop devices and btrfs-progs (Debian:
#                        apt-get install btrfs-progs); without them it is skipped, with
#                        a message, and the run goes on. Not in the default set.
#   bulwark-single       bulwark layout single, encrypted, lz4 (the defaults)
#   bulwark-single-nolz4 bulwark layout single, encrypted, compression off
#   bulwark-single-noholes, bulwark-mirror2-noholes
#                        as bulwark-single / bulwark-mirror2, served with
#                        --no-fill-holes (the cleaner alone makes room: decision 0014)
#   bulwark-single-holes, bulwark-mirror2-holes
#                        served with --fill-holes (decision 0014; the default since
#                        2026-12-05, and 2026-12-04 17:30-23:30 UTC: then the same as
#                        bulwark-single / bulwark-mirror2, kept so older runs compare)
#   bulwark-single-holesfirst, bulwark-mirror2-holesfirst
#                        served with --holes-first (the cleaner runs only for the segments
#                        commits need, data fills holes; BENCHMARKS.md, "Holes first"; the
#                        default since 2026-12-05 13:00 UTC, then the same as bulwark-single
#                        / bulwark-mirror2, kept so older runs compare)
#   bulwark-single-noholesfirst, bulwark-mirror2-noholesfirst
#                        served with --no-holes-first (holes only in segments 3/4 live, the
#                        cleaner at the usual mark: the default before holes first)
#   bulwark-mirror2      bulwark layout mirror:2, encrypted, lz4
#   bulwark-single-log   as bulwark-single, with the intent log on a separate log device
#                        (--log-device: a file beside the pool's in the workdir, so on
#                        the same disk here; not in the default set)
#   bulwark-mirror2-log  as bulwark-mirror2, with a log device (likewise)
#
# Matrix (default, ~10 min): 4K randread/randwrite QD32; 64K and 1M
# read/write QD32; 4K randread QD1; and 4K randread/randwrite QD32 on two
# connections (--jobs 2, each at QD32). --full: 4K/64K/1M x randread,
# randwrite, read, write x QD1, QD32, plus the two-connection cells.
#
# Durable writes (--groups durable; not in the default set): 4K randwrite QD1
# with a flush after every write (fio --fsync=1), 4K randwrite QD32 with a flush
# after every 32 (issue 24's group-commit cell), and 64K and 1M sequential
# writes at QD32 with a flush after every 32 (--fsync=32), closer to a VM with
# cache=none or a database. Every server honours flushes: qemu-storage-daemon's
# file node runs with cache.direct=off,cache.no-flush=off (writes go through
# the host page cache; each NBD FLUSH becomes an fdatasync of the image, so it
# reaches the disk), nbdkit's file plugin fdatasyncs on flush, bulwark commits.
# Keep --workdir on a real disk for this group (a tmpfs makes flushes free).
#
# Fill (--fill PCT, e.g. 50 or 80): each bulwark pool is sized so that the
# volume's live data is PCT% of the pool's usable space (status' usable_bytes:
# total less the segments kept for commits and the cleaner; a mirror:2 pool's
# two devices each hold a copy, so each is sized like single's device). Every
# server's volume or image (same SIZE) is first filled with incompressible data
# (nbdcopy from nbdkit's random plugin; lz4 cannot shrink it), then the cells
# run on it without bench's fill pass. The device size is computed from the
# layout's reserves, checked against status after the fill and, if the fill is
# off by more than 1 point, corrected (pool made again, filled again); the
# actual fill is printed and recorded. qemu-raw-btrfs: each of its two loop
# files is sized so that the filesystem's usable data space (one copy: raid1
# stores every block on both devices; what `btrfs filesystem usage` estimates
# free on the new, empty filesystem, i.e. the device less the metadata and system
# chunks) is SIZE x 100 / PCT, so the filled image is PCT% of it: the fill is of
# the filesystem's usable space, as bulwark's is of its pool's (qemu raw's image
# is 100% of itself; its file system is not filled). After the fill, data used /
# (data used + free estimated) is printed and recorded; COW overwrites then need
# free space, and a cell that fails with ENOSPC is recorded as such (a result).
# Default groups with --fill: overwrite
# (4K and 64K randwrite QD32: sustained random overwrite), and --runtime
# defaults to 60: the cleaner must run during the cells, and 60 s of overwrite
# writes more than the pool's free space at these sizes on this machine. A
# shorter --runtime is allowed (smoke runs) and flagged in the report.
# Write amplification (bytes bulwark wrote to its devices, all copies / bytes
# fio wrote) is measured per bulwark write cell by `bulwark bench` itself
# (it benches bulwark volumes by name, which lets it read the pool's status
# around each cell; same fio command line); with --tcp it is n/a.
#
# --repeat N runs the whole sequence N times (every server on a fresh image,
# pool or volume each time) and reports the median of the N runs per cell.
#
# Output: a report on stdout (markdown tables: numbers, bulwark/peer ratios,
# targets) and a machine-readable results file (--out, JSON; default
# bench/results/peers-unix-STAMP.json or peers-tcp-STAMP.json), written by
# bench/peers_report.py from the raw `bulwark bench --json` reports.
#
# Usage: bench/peers.sh [--full] [--repeat N] [--tcp] [--runtime S] [--size SIZE]
#                       [--servers a,b,...] [--out FILE] [--workdir DIR] [--keep]
#                       [--device-factor N]   bulwark device size = N x SIZE (default 16)
#                       [--max-foreign PCT] [--retries N]
#                       [--groups a,b,...]   only these groups of the matrix (by name:
#                                            rand4k,seq,qd1,twoconn,overwrite,durable;
#                                            with --full: full,twoconn,overwrite,durable)
#                       [--fill PCT]         bulwark pools PCT% full (see Fill above)
#                       [--preallocate]      bulwark pools made with `pool create --preallocate`
#                                            (device and log files written with zeros first,
#                                            as the peers' images are filled before their
#                                            cells; default device factor 4 then)
#
# Other work on the machine: around every `bulwark bench` call the script
# accounts the CPU time of the whole machine (/proc/stat) against the
# server's, bench's + fio's, kernel threads' (writeback, I/O completion) and
# the hypervisor's steal time. The rest ("foreign": other processes in this
# VM, e.g. other people's builds and tests) is recorded per call as a
# percentage of all CPUs. A call with more than --max-foreign percent
# (default 15) is run again after 30 s, up to --retries times (default 2);
# the last attempt is kept, and the report shows foreign, kernel and steal
# shares per server. It also counts what reached the machine's disks
# (/proc/diskstats) during each call: the peers' overwrites of a 2 GiB image
# stay in the page cache for a whole cell, bulwark's commits make them
# durable (BENCHMARKS.md, "Why the write cells are disk-bound here"). With
# --workdir on a tmpfs, no server touches a disk.
# Env:   BULWARK_BIN (default target/release/bulwark)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
BULWARK=${BULWARK_BIN:-$REPO/target/release/bulwark}
ALL_SERVERS=qemu-raw,qemu-luks,nbdkit-file,qemu-raw-btrfs,bulwark-single,bulwark-single-nolz4,bulwark-mirror2,bulwark-single-log,bulwark-mirror2-log,bulwark-single-noholes,bulwark-mirror2-noholes,bulwark-single-holes,bulwark-mirror2-holes,bulwark-single-holesfirst,bulwark-mirror2-holesfirst,bulwark-single-noholesfirst,bulwark-mirror2-noholesfirst

FULL=0
REPEAT=1
TCP=0
RUNTIME=
FILL=
SIZE=2G
SERVERS=qemu-raw,qemu-luks,nbdkit-file,bulwark-single,bulwark-single-nolz4,bulwark-mirror2
OUT=
WORKDIR=
KEEP=0
DEVICE_FACTOR=
PREALLOCATE=0
MAX_FOREIGN=15
RETRIES=2
ONLY_GROUPS=
RETRY_WAIT=30
PORT=${BENCH_PORT:-10899}

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
    case "$1" in
        --full) FULL=1 ;;
        --repeat) REPEAT=$2; shift ;;
        --tcp) TCP=1 ;;
        --runtime) RUNTIME=$2; shift ;;
        --size) SIZE=$2; shift ;;
        --servers) SERVERS=$2; shift ;;
        --out) OUT=$2; shift ;;
        --workdir) WORKDIR=$2; shift ;;
        --keep) KEEP=1 ;;
        --device-factor) DEVICE_FACTOR=$2; shift ;;
        --max-foreign) MAX_FOREIGN=$2; shift ;;
        --retries) RETRIES=$2; shift ;;
        --groups) ONLY_GROUPS=$2; shift ;;
        --fill) FILL=$2; shift ;;
        --preallocate) PREALLOCATE=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "peers.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

log() { echo "peers.sh: $*" >&2; }
die() { echo "peers.sh: error: $*" >&2; exit 1; }
# The report is written by a script beside this one: a copy of peers.sh alone, run from
# elsewhere, would measure for an hour and then fail to write it.
[ -f "$REPO/bench/peers_report.py" ] \
    || die "$REPO/bench/peers_report.py not found: run peers.sh from the repository (bench/peers.sh), not from a copy of the script alone"

case "$REPEAT" in ''|*[!0-9]*|0) die "--repeat needs a positive integer" ;; esac
if [ -n "$FILL" ]; then
    case "$FILL" in ''|*[!0-9]*) die "--fill needs a percentage (an integer, 1 to 95)" ;; esac
    [ "$FILL" -ge 1 ] && [ "$FILL" -le 95 ] || die "--fill needs a percentage from 1 to 95"
    RUNTIME=${RUNTIME:-60}
    [ "$RUNTIME" -ge 60 ] || log "warning: --runtime $RUNTIME with --fill: cells under 60 s may end before the cleaner runs (the report flags it)"
    ONLY_GROUPS=${ONLY_GROUPS:-overwrite}
    command -v nbdcopy >/dev/null || die "nbdcopy is not installed (--fill fills through it; Debian: libnbd-bin)"
fi
RUNTIME=${RUNTIME:-10}
[ -x "$BULWARK" ] || die "no bulwark binary at $BULWARK (cargo build --release -p bulwark, or set BULWARK_BIN)"
for tool in fio qemu-img qemu-storage-daemon nbdkit nbdinfo python3; do
    command -v "$tool" >/dev/null || die "$tool is not installed (see /work/shared/DEPENDENCIES.md for the Debian packages)"
done
IFS=, read -r -a SERVER_LIST <<< "$SERVERS"
for s in "${SERVER_LIST[@]}"; do
    case ",$ALL_SERVERS," in *",$s,"*) ;; *) die "unknown server $s (known: $ALL_SERVERS)" ;; esac
done
# qemu-raw-btrfs needs root (losetup, mount) and btrfs-progs: without them it is skipped,
# not the run. (A loop device or mount that fails later skips it too, in that repeat.)
declare -A SKIPPED=()   # server -> why (recorded in meta.json and the report)
case ",$SERVERS," in *,qemu-raw-btrfs,*)
    why=
    [ "$(id -u)" = 0 ] || why="needs root (losetup, mkfs.btrfs, mount)"
    for tool in losetup mkfs.btrfs btrfs mount umount mountpoint; do
        [ -n "$why" ] || command -v "$tool" >/dev/null || why="$tool is not installed (Debian: btrfs-progs, util-linux)"
    done
    [ -n "$why" ] || [ -e /dev/loop-control ] || why="no /dev/loop-control (no loop devices here)"
    if [ -n "$why" ]; then
        log "qemu-raw-btrfs skipped: $why"
        SKIPPED[qemu-raw-btrfs]=$why
        kept=()
        for s in "${SERVER_LIST[@]}"; do [ "$s" = qemu-raw-btrfs ] || kept+=("$s"); done
        SERVER_LIST=("${kept[@]}")
    fi
    ;;
esac

if [ -n "$ONLY_GROUPS" ]; then
    IFS=, read -r -a WANTED <<< "$ONLY_GROUPS"
    for w in "${WANTED[@]}"; do
        case "$FULL,$w" in
            0,rand4k|0,seq|0,qd1|0,twoconn|1,full|?,twoconn|?,overwrite|?,durable) ;;
            *) die "unknown group $w (known: rand4k,seq,qd1,twoconn,overwrite,durable; with --full: full,twoconn,overwrite,durable)" ;;
        esac
    done
fi

STAMP=$(date -u +%Y%m%dT%H%M%SZ)
WORKDIR=${WORKDIR:-$(mktemp -d "${TMPDIR:-/tmp}/bulwark-peers.XXXXXX")}
mkdir -p "$WORKDIR/raw"
# Measure one binary throughout, even if target/ is rebuilt during the run.
cp "$BULWARK" "$WORKDIR/bulwark.bin"
BULWARK_SRC=$BULWARK
BULWARK=$WORKDIR/bulwark.bin
TRANSPORT=unix
[ "$TCP" = 1 ] && TRANSPORT=tcp
OUT=${OUT:-$REPO/bench/results/peers-$TRANSPORT-$STAMP.json}
mkdir -p "$(dirname "$OUT")"
SIZE_BYTES=$(python3 -c '
import sys
s = sys.argv[1].strip().upper().removesuffix("IB").removesuffix("B")
mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
print(int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s))' "$SIZE")
# bulwark is log-structured: every write goes to new space, and old space
# returns through commits (or at once for space no commit has seen) and the
# cleaner. Each device (one per copy, sparse) is DEVICE_FACTOR times the
# volume, large enough that one repeat's writes fit without cleaning, so
# bulwark's numbers do not include cleaning costs. (An early version of the
# engine poisoned a pool that ran down to its reserve under these overwrites;
# with --device-factor 2 the rand4k and seq groups now run without an error,
# 2026-11-25.)
# Preallocated devices are written whole with zeros first (disk space and time):
# a smaller default factor then.
if [ -z "$DEVICE_FACTOR" ]; then
    DEVICE_FACTOR=16
    [ "$PREALLOCATE" = 1 ] && DEVICE_FACTOR=4
fi
DEVICE_BYTES=$((SIZE_BYTES * DEVICE_FACTOR))

# --- the matrix: one `bulwark bench` invocation per group --------------------
COMMON=(--force --runtime "$RUNTIME" --size "$SIZE_BYTES" --json)
if [ "$FULL" = 1 ]; then
    GROUPS_=(
        "full|--block-sizes 4k,64k,1m --patterns randread,randwrite,read,write --iodepths 1,32"
        "twoconn|--block-sizes 4k --patterns randread,randwrite --iodepths 32 --jobs 2"
    )
else
    GROUPS_=(
        "rand4k|--block-sizes 4k --patterns randread,randwrite --iodepths 32"
        "seq|--block-sizes 64k,1m --patterns read,write --iodepths 32"
        "qd1|--block-sizes 4k --patterns randread --iodepths 1"
        "twoconn|--block-sizes 4k --patterns randread,randwrite --iodepths 32 --jobs 2"
    )
fi
# Only on request (--groups, or --fill's default): a group's family is its name up to "-".
GROUPS_+=(
    "overwrite|--block-sizes 4k,64k --patterns randwrite --iodepths 32"
    "durable-qd1|--block-sizes 4k --patterns randwrite --iodepths 1 --fsync 1"
    "durable-qd32|--block-sizes 4k --patterns randwrite --iodepths 32 --fsync 32"
    "durable-seq|--block-sizes 64k,1m --patterns write --iodepths 32 --fsync 32"
)
KEPT=()
for g in "${GROUPS_[@]}"; do
    gname=${g%%|*}
    if [ -n "$ONLY_GROUPS" ]; then
        case ",$ONLY_GROUPS," in *",${gname%%-*},"*) KEPT+=("$g") ;; esac
    else
        case "${gname%%-*}" in overwrite|durable) ;; *) KEPT+=("$g") ;; esac
    fi
done
GROUPS_=("${KEPT[@]}")

# --- servers -------------------------------------------------------------------
SERVER_PID=

stop_server() { # SIGTERM the server this script started (bulwark commits and exits)
    if [ -n "$SERVER_PID" ]; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 1 300); do
            kill -0 "$SERVER_PID" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=
}
# An interrupted run stops its server and removes that server's image or pool (several GB;
# the raw reports in WORKDIR stay), unless --keep.
SERVER_DIR=
trap 'stop_server; btrfs_teardown; [ "$KEEP" = 1 ] || [ -z "$SERVER_DIR" ] || rm -rf "$SERVER_DIR"' EXIT
trap 'exit 130' INT TERM

wait_ready() { # URI LOG
    for _ in $(seq 1 300); do
        if nbdinfo --size "$1" >/dev/null 2>&1; then return 0; fi
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            tail -20 "$2" >&2
            die "the server for $1 exited during start (log: $2)"
        fi
        sleep 0.1
    done
    tail -20 "$2" >&2
    die "the server for $1 did not answer within 30 s (log: $2)"
}

# qsd's --nbd-server address and a URI for export NAME, unix socket or TCP.
nbd_addr() { # DIR
    if [ "$TCP" = 1 ]; then
        echo "addr.type=inet,addr.host=127.0.0.1,addr.port=$PORT"
    else
        echo "addr.type=unix,addr.path=$1/nbd.sock"
    fi
}
nbd_uri() { # DIR NAME
    if [ "$TCP" = 1 ]; then
        echo "nbd://127.0.0.1:$PORT/$2"
    else
        echo "nbd+unix:///$2?socket=$1/nbd.sock"
    fi
}

# qemu's defaults for a --blockdev file node, spelled out: through the host page cache
# (no O_DIRECT), and an NBD FLUSH becomes an fdatasync of the image (not dropped).
QEMU_CACHE="cache.direct=off,cache.no-flush=off"

start_qemu_raw() { # DIR [IMAGE_DIR] -> URI
    local d=$1 img=${2:-$1}/disk.raw
    qemu-img create -q -f raw "$img" "$SIZE_BYTES"
    qemu-storage-daemon \
        --blockdev "driver=file,node-name=file0,filename=$img,$QEMU_CACHE" \
        --blockdev "driver=raw,node-name=disk0,file=file0" \
        --nbd-server "$(nbd_addr "$d")" \
        --export "type=nbd,id=exp0,node-name=disk0,name=disk,writable=on" \
        >"$d/server.log" 2>&1 &
    SERVER_PID=$!
    URI=$(nbd_uri "$d" disk)
}

# --- qemu-raw-btrfs: btrfs raid1 over two loop devices --------------------------------
# The loop devices and the mount this script made (none, or those of the current
# server): btrfs_teardown undoes them, from finish_server and from the EXIT trap.
BTRFS_LOOPS=()
BTRFS_MNT=
BTRFS_DEVICE_BYTES=     # --fill: each loop file's size, once found (kept across repeats)
btrfs_teardown() {
    local l _
    if [ -n "$BTRFS_MNT" ] && mountpoint -q "$BTRFS_MNT" 2>/dev/null; then
        # qemu-storage-daemon has exited (stop_server first), but give the kernel a moment.
        for _ in $(seq 1 50); do
            umount "$BTRFS_MNT" 2>/dev/null && break
            sleep 0.2
        done
        if mountpoint -q "$BTRFS_MNT" 2>/dev/null; then
            echo "peers.sh: warning: $BTRFS_MNT is busy: unmounted lazily" >&2
            umount -l "$BTRFS_MNT" || true
        fi
    fi
    BTRFS_MNT=
    for l in "${BTRFS_LOOPS[@]}"; do
        btrfs device scan --forget "$l" >/dev/null 2>&1 || true
        losetup -d "$l" 2>/dev/null || echo "peers.sh: warning: could not detach $l (losetup -a)" >&2
    done
    BTRFS_LOOPS=()
}
# Filesystem figures in bytes: device size (all devices), free (estimated, one copy),
# data allocated, data used (one copy), metadata used (one copy).
btrfs_usage() { # MNT
    btrfs filesystem usage -b "$1" | python3 -c '
import re, sys
t = sys.stdin.read()
num = lambda pat: int(re.search(pat, t).group(1))
print(num(r"Device size:\s+(\d+)"), num(r"Free \(estimated\):\s+(\d+)"),
      num(r"\nData,[^:]*: Size:(\d+)"), num(r"\nData,[^:]*: Size:\d+, Used:(\d+)"),
      num(r"\nMetadata,[^:]*: Size:\d+, Used:(\d+)"))'
}
# Two loop files of BYTES (sparse; written with zeros with --preallocate, as bulwark's
# devices), attached, btrfs raid1 (data and metadata) over both, mounted on DIR/mnt.
# Every step checked: 1 (and a message) when this machine cannot, and the server is skipped.
btrfs_make() { # DIR BYTES
    local d=$1 bytes=$2 i f l
    for i in 0 1; do
        f=$d/btrfs-dev$i.img
        rm -f "$f"
        if [ "$PREALLOCATE" = 1 ]; then
            dd if=/dev/zero of="$f" bs=1M count=$((bytes >> 20)) conv=fsync status=none || return 1
        else
            truncate -s "$bytes" "$f" || return 1
        fi
        l=$(losetup -f --show "$f" 2>"$d/btrfs-setup.err") \
            || { log "qemu-raw-btrfs: losetup failed: $(tail -2 "$d/btrfs-setup.err")"; return 1; }
        BTRFS_LOOPS+=("$l")
    done
    # -K: no discard (it would punch the preallocated files' blocks out again)
    mkfs.btrfs -f -K -d raid1 -m raid1 "${BTRFS_LOOPS[@]}" >"$d/mkfs.log" 2>&1 \
        || { log "qemu-raw-btrfs: mkfs.btrfs failed: $(tail -2 "$d/mkfs.log")"; return 1; }
    btrfs device scan "${BTRFS_LOOPS[@]}" >/dev/null 2>&1 || true
    mkdir -p "$d/mnt"
    BTRFS_MNT=$d/mnt
    mount -t btrfs "${BTRFS_LOOPS[0]}" "$BTRFS_MNT" 2>"$d/btrfs-setup.err" \
        || { log "qemu-raw-btrfs: mount failed: $(tail -2 "$d/btrfs-setup.err")"; return 1; }
}
# The filesystem for this repeat: without --fill each loop file is DEVICE_BYTES (as
# bulwark's devices); with --fill, sized so that the new filesystem's free data space
# (one copy) is SIZE x 100 / FILL (made again, up to 3 times, until within 0.5%).
btrfs_setup() { # DIR
    local d=$1 want bytes try total free rest
    if [ -z "$FILL" ]; then
        btrfs_make "$d" "$DEVICE_BYTES" || { btrfs_teardown; return 1; }
        BTRFS_SETUP_NOTE="2 x $((DEVICE_BYTES >> 20)) MiB (device factor $DEVICE_FACTOR, as bulwark's devices)"
    else
        want=$(( (SIZE_BYTES * 100 / FILL + (1 << 20) - 1) >> 20 << 20 ))
        # first guess: metadata chunks take about a tenth of a small device, system 8 MiB
        bytes=${BTRFS_DEVICE_BYTES:-$(( ((want + (8 << 20)) * 10 / 9 + (1 << 20) - 1) >> 20 << 20 ))}
        for try in 1 2 3; do
            btrfs_make "$d" "$bytes" || { btrfs_teardown; return 1; }
            read -r total free rest < <(btrfs_usage "$BTRFS_MNT" 2>"$d/btrfs-setup.err")
            [ -n "$free" ] || { log "qemu-raw-btrfs: btrfs filesystem usage failed: $(tail -2 "$d/btrfs-setup.err")"; btrfs_teardown; return 1; }
            [ $(( (free - want) * 200 / want )) = 0 ] && break
            [ "$try" = 3 ] && { log "qemu-raw-btrfs: free space $((free >> 20)) MiB, not $((want >> 20)) MiB, after 3 tries: measured as it is"; break; }
            bytes=$(( (bytes + want - free + (1 << 20) - 1) >> 20 << 20 ))
            btrfs_teardown
            rm -f "$d"/btrfs-dev?.img
        done
        BTRFS_DEVICE_BYTES=$bytes
        BTRFS_SETUP_NOTE="2 x $((bytes >> 20)) MiB; free data space (one copy) $((free >> 20)) MiB on the empty filesystem: the $SIZE image, once filled, is $(( SIZE_BYTES * 1000 / free / 10 )).$(( SIZE_BYTES * 1000 / free % 10 ))% of it (--fill $FILL: of the filesystem's usable space; qemu raw's fill is of its own image)"
    fi
    log "qemu-raw-btrfs: btrfs raid1 (data and metadata) over ${BTRFS_LOOPS[*]}, loop files $([ "$PREALLOCATE" = 1 ] && echo "written with zeros" || echo sparse) in $d: $BTRFS_SETUP_NOTE"
}
start_qemu_raw_btrfs() { # DIR -> URI (btrfs_setup has made and mounted the filesystem)
    start_qemu_raw "$1" "$BTRFS_MNT"
}

start_qemu_luks() {
    local d=$1
    printf '%s' "bench-passphrase-$RANDOM$RANDOM" >"$d/luks.pass"
    # qemu-img times its PBKDF by CPU time; on a busy machine that measurement
    # sometimes fails ("Unable to get accurate CPU usage"): try again, a few times.
    local try
    for try in 1 2 3 4 5; do
        rm -f "$d/disk.luks"
        qemu-img create -q -f luks \
            --object "secret,id=sec0,file=$d/luks.pass" \
            -o "key-secret=sec0,cipher-alg=aes-256,cipher-mode=xts,ivgen-alg=plain64,hash-alg=sha256,iter-time=100" \
            "$d/disk.luks" "$SIZE_BYTES" && break
        [ "$try" = 5 ] && return 1
        echo "peers.sh: qemu-img create of the LUKS image failed (try $try of 5); again in 2 s" >&2
        sleep 2
    done
    qemu-storage-daemon \
        --object "secret,id=sec0,file=$d/luks.pass" \
        --blockdev "driver=file,node-name=file0,filename=$d/disk.luks,$QEMU_CACHE" \
        --blockdev "driver=luks,node-name=disk0,file=file0,key-secret=sec0" \
        --nbd-server "$(nbd_addr "$d")" \
        --export "type=nbd,id=exp0,node-name=disk0,name=disk,writable=on" \
        >"$d/server.log" 2>&1 &
    SERVER_PID=$!
    URI=$(nbd_uri "$d" disk)
}

start_nbdkit_file() {
    local d=$1
    qemu-img create -q -f raw "$d/disk.raw" "$SIZE_BYTES"
    if [ "$TCP" = 1 ]; then
        nbdkit -f -i 127.0.0.1 -p "$PORT" file "file=$d/disk.raw" >"$d/server.log" 2>&1 &
    else
        nbdkit -f -U "$d/nbd.sock" file "file=$d/disk.raw" >"$d/server.log" 2>&1 &
    fi
    SERVER_PID=$!
    URI=$(nbd_uri "$d" "")
}

start_bulwark() { # DIR LAYOUT COMPRESSION [log|noholes|holes|holesfirst|noholesfirst]
    local d=$1 layout=$2 compression=$3 devices=1 device_bytes=$DEVICE_BYTES log=() prealloc=() serve_opts=()
    [ "${4:-}" = noholes ] && serve_opts=(--no-fill-holes)
    [ "${4:-}" = holes ] && serve_opts=(--fill-holes)
    [ "${4:-}" = holesfirst ] && serve_opts=(--holes-first)
    [ "${4:-}" = noholesfirst ] && serve_opts=(--no-holes-first)
    [ "$PREALLOCATE" = 1 ] && prealloc=(--preallocate)
    if [ "${4:-}" = log ]; then
        truncate -s 64M "$d/log.img"
        log=(--log-device "$d/log.img")
    fi
    [ "$layout" = mirror:2 ] && devices=2
    if [ -n "$FILL" ]; then
        device_bytes=${FILL_DEVICE_BYTES[copy]:-$(fill_device_estimate)}
        FILL_DEVICE_BYTES[copy]=$device_bytes
    fi
    # A registry of pools of its own (not the host's): every run's pool is named "pool".
    BULWARK_REGISTRY="$d/registry.json" "$BULWARK" pool create "$d/pool" --layout "$layout" --devices "$devices" \
        --device-size "$device_bytes" "${log[@]}" "${prealloc[@]}" >/dev/null
    head -c 32 /dev/urandom >"$d/volume.key"
    chmod 600 "$d/volume.key"
    local tcp=()
    # Plaintext TCP is opt-in and loopback-only; its client is "anonymous".
    [ "$TCP" = 1 ] && tcp=(--nbd-listen "127.0.0.1:$PORT" --nbd-plaintext)
    "$BULWARK" serve "$d/pool" "${tcp[@]}" "${serve_opts[@]}" >"$d/server.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 1 300); do
        "$BULWARK" --pool "$d/pool" status >/dev/null 2>&1 && break
        kill -0 "$SERVER_PID" 2>/dev/null || { tail -20 "$d/server.log" >&2; die "bulwark serve exited during start"; }
        sleep 0.1
    done
    "$BULWARK" --pool "$d/pool" volume create disk --size "$SIZE_BYTES" \
        --compression "$compression" --key-file "$d/volume.key" >/dev/null
    if [ "$TCP" = 1 ]; then
        "$BULWARK" --pool "$d/pool" grant add anonymous disk --read-write >/dev/null
        URI="nbd://127.0.0.1:$PORT/disk"
    else
        URI="nbd+unix:///disk?socket=$d/pool/nbd.sock"
        # By name: the same socket and fio command line, and bench sees the pool's
        # status around each cell (write amplification).
        BENCH_TARGET=(--pool "$d/pool" bench disk)
    fi
}

# --- fill (--fill PCT) ---------------------------------------------------------------
declare -A FILL_DEVICE_BYTES=()   # by layout group: "copy" (single, mirror:N)
# Per device (each mirror device holds a whole copy, so single and mirror:2 share
# one size, and a correction made for one serves the other): live data = the
# volume's size and 2% (record headers, map nodes: 1.9% measured, 2026-11-26);
# usable = total less
# SEGMENTS_RESERVED (4 MiB) and the cleaner's reserve (max(4 MiB, total/64))
# and the map's reserve (room to rewrite every map node: known only once the
# volume is written; about 3.3% of a lz4 volume of 4K blocks filled with
# random data, 2026-11-26, taken as 3.5% here; the check after the fill
# corrects for it), total = 1 MiB segments past the
# device's labels (2 MiB here, measured after the fill).
fill_device_estimate() {
    python3 - "$SIZE_BYTES" "$FILL" <<'PY'
import sys
size, pct = int(sys.argv[1]), int(sys.argv[2])
MiB = 1 << 20
usable = 1.02 * size * 100 / pct   # live: the data, its record headers and the map
total = usable + 8 * MiB + 0.035 * size
while max(4 * MiB, (total // MiB // 64) * MiB) + usable + 4 * MiB + 0.035 * size > total:
    total += MiB
print(int(-(-(total + 2 * MiB) // MiB)) * MiB)
PY
}
# Corrected device size from the pool's status after a fill: the same overhead
# (labels, reserves, map), the clean reserve following the new total.
fill_device_correct() { # DEVICE_BYTES STATUS_JSON
    python3 - "$1" "$2" "$FILL" <<'PY'
import json, sys
device, st, pct = int(sys.argv[1]), json.load(open(sys.argv[2])), int(sys.argv[3])
MiB = 1 << 20
sp = st["space"]
total, usable, used = sp["total_bytes"], sp["usable_bytes"], sp["used_bytes"]
clean = lambda t: max(4 * MiB, (t // MiB // 64) * MiB)
fixed = total - usable - clean(total)          # commit reserve, map reserve
want = used * 100 / pct
t = want + fixed + clean(total)
for _ in range(20):
    t = want + fixed + clean(int(t))
print(int(-(-(t + device - total) // MiB)) * MiB)
PY
}
# Fill the export with incompressible data (nbdkit's random plugin through nbdcopy)
# and flush; for bulwark, check the fill against status and correct the pool's size.
fill_export() { # NAME DIR RAWDIR REP
    local name=$1 d=$2 rawd=$3 rep=$4 attempt t0 t1
    for attempt in 1 2 3; do
        t0=$(date +%s.%N)
        nbdcopy --flush -- [ nbdkit --exit-with-parent -r random "size=$SIZE_BYTES" ] "$URI" \
            || die "$name: filling $URI with nbdcopy failed (server log: $d/server.log)"
        t1=$(date +%s.%N)
        case "$name" in
            bulwark-*) ;;
            qemu-raw-btrfs)
                fill_btrfs "$d" "$rawd/rep$rep-fill.json" "$t0" "$t1"
                return 0 ;;
            *)
                python3 -c 'import json,sys; json.dump({"fill_pct_target": int(sys.argv[2]), "fill_s": round(float(sys.argv[4]) - float(sys.argv[3]), 1)}, open(sys.argv[1], "w"))' \
                    "$rawd/rep$rep-fill.json" "$FILL" "$t0" "$t1"
                log "$name: filled $SIZE with random data in $(python3 -c "print(round($t1 - $t0, 1))") s"
                return 0 ;;
        esac
        "$BULWARK" --pool "$d/pool" status --json >"$d/fill-status.json"
        local verdict
        verdict=$(python3 - "$d/fill-status.json" "$FILL" "$SIZE_BYTES" "${FILL_DEVICE_BYTES[copy]}" \
                "$attempt" "$(python3 -c "print(round($t1 - $t0, 1))")" "$rawd/rep$rep-fill.json" <<'PY'
import json, sys
st, pct, size, device, attempt, fill_s, out = json.load(open(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]), sys.argv[7]
sp = st["space"]
vol = next(v for v in st["volumes"] if v["name"] == "disk")
actual = 100 * sp["used_bytes"] / sp["usable_bytes"]
json.dump({"fill_pct_target": pct, "fill_pct": round(actual, 2), "attempt": attempt, "fill_s": fill_s,
           "device_bytes": device, "layout": st["layout"], "state": st["state"],
           "volume_size_bytes": size, "volume_used_bytes": vol["used_bytes"],
           **{k: sp[k] for k in ("total_bytes", "usable_bytes", "used_bytes", "free_bytes", "reserved_bytes")}},
          open(out, "w"))
print("ok" if abs(actual - pct) <= 1.0 else "off", f"{actual:.1f}", f"{vol['used_bytes'] / size:.3f}",
      sp["usable_bytes"], sp["used_bytes"])
PY
)
        read -r ok actual stored usable used <<<"$verdict"
        log "$name: filled in $(python3 -c "print(round($t1 - $t0, 1))") s: live $used of usable $usable bytes = ${actual}% (target $FILL%; device $((FILL_DEVICE_BYTES[copy] >> 20)) MiB; stored/written $stored)"
        if [ "$ok" = ok ] || [ "$attempt" = 3 ]; then
            [ "$ok" = ok ] || log "$name: fill ${actual}% is off the $FILL% target after 3 tries: measured as it is (recorded)"
            return 0
        fi
        FILL_DEVICE_BYTES[copy]=$(fill_device_correct "${FILL_DEVICE_BYTES[copy]}" "$d/fill-status.json")
        log "$name: fill off by more than 1 point: pool made again with $((FILL_DEVICE_BYTES[copy] >> 20)) MiB per device"
        stop_server
        rm -rf "$d"
        mkdir -p "$d"
        start_server "$name" "$d"
    done
}

# qemu-raw-btrfs after its fill: data used / (data used + free estimated), both one copy,
# recorded with the filesystem's figures (the report's Fill table).
fill_btrfs() { # DIR OUT T0 T1
    local d=$1 total free dsize dused mused
    sync -f "$BTRFS_MNT/disk.raw"
    read -r total free dsize dused mused < <(btrfs_usage "$BTRFS_MNT")
    local line
    line=$(python3 - "$2" "$FILL" "$SIZE_BYTES" "$BTRFS_DEVICE_BYTES" "$total" "$free" "$dsize" "$dused" "$mused" \
            "$(stat -c '%b %B' "$BTRFS_MNT/disk.raw")" "$3" "$4" <<'PY'
import json, sys
out, pct = sys.argv[1], int(sys.argv[2])
size, device, total, free, dsize, dused, mused = map(int, sys.argv[3:10])
blocks, bsize = map(int, sys.argv[10].split())
fill_s = round(float(sys.argv[12]) - float(sys.argv[11]), 1)
usable = dused + free
actual = 100 * dused / usable
json.dump({"fill_pct_target": pct, "fill_pct": round(actual, 2), "fill_s": fill_s,
           "layout": "btrfs raid1 (-d raid1 -m raid1), two loop devices",
           "device_bytes": device, "total_bytes": total, "usable_bytes": usable, "used_bytes": dused,
           "free_bytes": free, "data_allocated_bytes": dsize, "metadata_used_bytes": mused,
           "volume_size_bytes": size, "volume_used_bytes": blocks * bsize}, open(out, "w"))
print(f"{actual:.1f} {dused >> 20} {usable >> 20} {free >> 20} {fill_s}")
PY
)
    read -r actual dused usable free fill_s <<<"$line"
    log "qemu-raw-btrfs: filled $SIZE with random data in $fill_s s: data $dused MiB of usable $usable MiB (data + free estimated, one copy) = ${actual}% (target $FILL%); $free MiB free for copy-on-write"
}

start_server() { # NAME DIR
    BENCH_TARGET=()
    case "$1" in
        qemu-raw) start_qemu_raw "$2" ;;
        qemu-luks) start_qemu_luks "$2" ;;
        nbdkit-file) start_nbdkit_file "$2" ;;
        qemu-raw-btrfs) start_qemu_raw_btrfs "$2" ;;
        bulwark-single) start_bulwark "$2" single lz4 ;;
        bulwark-single-nolz4) start_bulwark "$2" single off ;;
        bulwark-mirror2) start_bulwark "$2" mirror:2 lz4 ;;
        bulwark-single-log) start_bulwark "$2" single lz4 log ;;
        bulwark-mirror2-log) start_bulwark "$2" mirror:2 lz4 log ;;
        bulwark-single-noholes) start_bulwark "$2" single lz4 noholes ;;
        bulwark-single-holes) start_bulwark "$2" single lz4 holes ;;
        bulwark-mirror2-holes) start_bulwark "$2" mirror:2 lz4 holes ;;
        bulwark-mirror2-noholes) start_bulwark "$2" mirror:2 lz4 noholes ;;
        bulwark-single-holesfirst) start_bulwark "$2" single lz4 holesfirst ;;
        bulwark-mirror2-holesfirst) start_bulwark "$2" mirror:2 lz4 holesfirst ;;
        bulwark-single-noholesfirst) start_bulwark "$2" single lz4 noholesfirst ;;
        bulwark-mirror2-noholesfirst) start_bulwark "$2" mirror:2 lz4 noholesfirst ;;
    esac
    wait_ready "$URI" "$2/server.log"
    [ "${#BENCH_TARGET[@]}" -gt 0 ] || BENCH_TARGET=(bench --uri "$URI")
}

# --- CPU accounting around one bench call ---------------------------------------
NPROC=$(nproc)
CLK_TCK=$(getconf CLK_TCK)
machine_ticks() { # busy and steal ticks of all CPUs
    awk '/^cpu /{print $2+$3+$4+$7+$8+$9, $9; exit}' /proc/stat
}
server_ticks() { # utime+stime of the server process (all its threads)
    if [ -r "/proc/$SERVER_PID/stat" ]; then
        sed 's/.*) //' "/proc/$SERVER_PID/stat" | awk '{print $12+$13}'
    else
        echo 0
    fi
}
# `times` must run in this shell (not in a $(...) subshell) to see its children.
# user+sys of this shell's finished children (bench and its fio runs), from `times`
children_seconds() {
    tail -1 "$WORKDIR/times.txt" | awk '{
        s = 0
        for (i = 1; i <= 2; i++) { split($i, a, "m"); sub("s", "", a[2]); s += a[1] * 60 + a[2] }
        print s }'
}
kthread_ticks() { # utime+stime of kernel threads (children of kthreadd): writeback, I/O completion
    # A process that exits between the glob and the read makes cat fail; with
    # pipefail and set -e that ended the whole run silently.
    { cat /proc/[0-9]*/stat 2>/dev/null || true; } | sed 's/^[0-9]* (.*) //' | awk '$2 == 2 {s += $12 + $13} END {print s + 0}'
}
disk_sectors() { # 512-byte sectors written to the machine's disks (whole disks only: no
    # partitions, loop, RAM, device-mapper or md devices, which would count a write twice)
    local disks
    disks=$(ls /sys/block | grep -Ev '^(loop|ram|zram|dm-|md|nbd|sr)' | tr '\n' ' ')
    awk -v disks=" $disks" 'index(disks, " " $3 " ") {s += $10} END {print s + 0}' /proc/diskstats
}
cpu_mark() {
    D0=$(disk_sectors)
    K0=$(kthread_ticks)
    read -r M0 S0 < <(machine_ticks)
    P0=$(server_ticks)
    times >"$WORKDIR/times.txt"
    C0=$(children_seconds)
    T0=$(date +%s.%N)
}
cpu_account() { # FILE ATTEMPT
    local m1 s1 p1 c1 t1 k1 d1
    d1=$(disk_sectors)
    k1=$(kthread_ticks)
    read -r m1 s1 < <(machine_ticks)
    p1=$(server_ticks)
    times >"$WORKDIR/times.txt"
    c1=$(children_seconds)
    t1=$(date +%s.%N)
    python3 - "$1" "$2" "$M0" "$m1" "$S0" "$s1" "$P0" "$p1" "$C0" "$c1" "$T0" "$t1" "$K0" "$k1" "$NPROC" "$CLK_TCK" "$D0" "$d1" <<'PY'
import json, sys
f, attempt = sys.argv[1], int(sys.argv[2])
m0, m1, s0, s1, p0, p1, c0, c1, t0, t1, k0, k1, nproc, tck, d0, d1 = map(float, sys.argv[3:])
elapsed = t1 - t0
busy = (m1 - m0) / tck            # all CPUs, including steal
steal = (s1 - s0) / tck           # taken by the hypervisor
kernel = (k1 - k0) / tck          # kernel threads (writeback, I/O), partly caused by the server
server = (p1 - p0) / tck
client = c1 - c0                  # bulwark bench and its fio runs
foreign = max(0.0, busy - steal - kernel - server - client)   # other processes in this VM
cap = elapsed * nproc
pct = lambda x: round(100 * x / cap, 1)
json.dump({"attempt": attempt, "elapsed_s": round(elapsed, 2), "busy_s": round(busy, 2),
           "server_s": round(server, 2), "client_s": round(client, 2), "kernel_s": round(kernel, 2),
           "steal_s": round(steal, 2), "foreign_s": round(foreign, 2),
           "foreign_pct": pct(foreign), "steal_pct": pct(steal), "kernel_pct": pct(kernel),
           # whole machine: what reached the disks while the call ran (fill pass included)
           "disk_written_mb": round((d1 - d0) * 512 / 1e6, 1)},
          open(f, "w"))
PY
}

# --- the run -----------------------------------------------------------------------
FAILED=0
finish_server() { # NAME DIR REP
    stop_server
    btrfs_teardown   # qemu-raw-btrfs: unmount, detach (the loop files go with DIR)
    cp "$2/server.log" "$WORKDIR/raw/$1/server-rep$3.log" 2>/dev/null || true
    [ "$KEEP" = 1 ] || rm -rf "$2"
}
# The physical limit of a durable write at QD1 (issue 24): the disk's own rate of 4 KiB
# random writes each followed by an fdatasync, on a file in WORKDIR written whole first
# (fio lays it out), no server in between. Only with a durable group.
DISK_FDATASYNC_IOPS=None
case " ${GROUPS_[*]} " in *" durable-"*)
    log "the disk's own fdatasync rate (fio psync, 4K randwrite, fdatasync after each, $RUNTIME s)"
    fio --name=disk-fdatasync --filename="$WORKDIR/fdatasync.img" --size=1G --rw=randwrite \
        --bs=4k --ioengine=psync --fdatasync=1 --runtime="$RUNTIME" --time_based \
        --randrepeat=0 --output-format=json --output="$WORKDIR/fdatasync.json" >/dev/null \
        && DISK_FDATASYNC_IOPS=$(python3 -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["jobs"][0]["write"]["iops"]))' "$WORKDIR/fdatasync.json") \
        || log "warning: the disk's fdatasync rate could not be measured"
    rm -f "$WORKDIR/fdatasync.img"
    ;;
esac

python3 - "$WORKDIR/meta.json" <<EOF
import json, os, platform, subprocess, sys
def out(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.strip().splitlines()[0]
    except Exception:
        return None
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
flags = next((l.split(":", 1)[1].split() for l in open("/proc/cpuinfo") if l.startswith("flags")), [])
mem = next((int(l.split()[1]) * 1024 for l in open("/proc/meminfo") if l.startswith("MemTotal")), None)
meta = {
    "started_utc": "$STAMP",
    "machine": {
        "nproc": os.cpu_count(), "cpu_model": cpu,
        "cpu_flags": [f for f in ("aes", "vaes", "avx2", "avx512f", "sha_ni") if f in flags],
        "mem_bytes": mem, "kernel": platform.release(),
        "loadavg_start": open("/proc/loadavg").read().split()[:3],
    },
    "versions": {
        "fio": out("fio", "--version"), "qemu": out("qemu-storage-daemon", "--version"),
        "nbdkit": out("nbdkit", "--version"), "bulwark": out("$BULWARK", "--version"),
        "btrfs_progs": out("btrfs", "--version") if "qemu-raw-btrfs" in "$SERVERS".split(",") else None,
        "bulwark_binary": "$BULWARK_SRC",
        "bulwark_sha256": out("sha256sum", "$BULWARK").split()[0],
        "bulwark_git": out("git", "-C", "$REPO", "describe", "--always", "--dirty"),
    },
    "settings": {
        "full": $FULL == 1, "repeat": $REPEAT, "transport": "tcp" if $TCP == 1 else "unix",
        "runtime_s": $RUNTIME, "size_bytes": $SIZE_BYTES,
        # --fill: bulwark's device sizes are per layout, in raw/<server>/rep<N>-fill.json
        "bulwark_device_bytes": None if "$FILL" else $DEVICE_BYTES,
        "fill_pct": int("$FILL") if "$FILL" else None,
        "preallocate": $PREALLOCATE == 1,
        "disk_fdatasync_iops": $DISK_FDATASYNC_IOPS,
        "servers": "$SERVERS".split(","),
        "groups": [g.split("|", 1)[1] for g in """$(printf '%s\n' "${GROUPS_[@]}")""".splitlines()],
        "common": "$(echo "${COMMON[@]}")",
        "max_foreign_pct": $MAX_FOREIGN, "retries": $RETRIES,
    },
}
json.dump(meta, open(sys.argv[1], "w"), indent=1)
EOF

log "workdir $WORKDIR; servers $SERVERS; $REPEAT repeat(s); load $(cut -d' ' -f1-3 /proc/loadavg)"
# Each repeat measures every server in turn on a fresh image, pool or volume,
# so slow drifts in machine load spread over all servers, and bulwark's
# devices only ever hold one repeat's writes.
for rep in $(seq 1 "$REPEAT"); do
    for name in "${SERVER_LIST[@]}"; do
        d=$WORKDIR/$name
        SERVER_DIR=$d
        rm -rf "$d"
        mkdir -p "$d" "$WORKDIR/raw/$name"
        if [ "$name" = qemu-raw-btrfs ] && ! btrfs_setup "$d"; then
            log "qemu-raw-btrfs skipped in run $rep: the filesystem could not be made (see above; root and loop devices needed)"
            SKIPPED[qemu-raw-btrfs]="run $rep: losetup, mkfs.btrfs or mount failed"
            finish_server "$name" "$d" "$rep"
            continue
        fi
        start_server "$name" "$d"
        log "run $rep/$REPEAT, $name: $URI (load $(cut -d' ' -f1 /proc/loadavg))"
        fill=()
        if [ -n "$FILL" ]; then
            fill_export "$name" "$d" "$WORKDIR/raw/$name" "$rep"
            fill=(--no-fill)
        fi
        for g in "${GROUPS_[@]}"; do
            gname=${g%%|*}
            read -r -a gargs <<< "${g#*|}"
            raw=$WORKDIR/raw/$name/rep$rep-$gname
            for attempt in $(seq 0 "$RETRIES"); do
                log "run $rep/$REPEAT, $name, $gname: ${g#*|}"
                cpu_mark
                if ! "$BULWARK" "${BENCH_TARGET[@]}" "${COMMON[@]}" "${fill[@]}" "${gargs[@]}" \
                        >"$raw.json" 2>"$d/bench.err"; then
                    cat "$d/bench.err" >&2
                    tail -20 "$d/server.log" >&2
                    # Recorded and reported (a bulwark pool that faults or runs out of space
                    # under --fill is a result, as is btrfs' ENOSPC under copy-on-write
                    # overwrites); the server's remaining groups are skipped.
                    why="bulwark bench failed"
                    cell=$(sed -n 's/.*fio failed in \(.*\) (exit status.*/\1/p' "$d/bench.err" | head -1)
                    [ -z "$cell" ] || why="$why in cell $cell"
                    if grep -qiE 'no space left|ENOSPC' "$d/bench.err" "$d/server.log" 2>/dev/null; then
                        why="$why: ENOSPC (No space left on device)"
                    fi
                    {
                        echo "group $gname (${g#*|}), run $rep: $why"
                        tail -5 "$d/bench.err"
                        echo "--- server log (last 10 lines)"
                        tail -10 "$d/server.log"
                        case "$name" in bulwark-*)
                            echo "--- pool state: $("$BULWARK" --pool "$d/pool" status --json 2>/dev/null \
                                | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])' 2>/dev/null || echo unknown)" ;;
                            qemu-raw-btrfs)
                                echo "--- btrfs filesystem usage (bytes)"
                                btrfs filesystem usage -b "$BTRFS_MNT" 2>&1 | sed -n '/^Overall/,/^$/p;/^Data,/p;/^Metadata,/p' ;;
                        esac
                    } >"$raw.failed"
                    rm -f "$raw.json"
                    FAILED=1
                    log "$name: $why, group $gname (recorded in $raw.failed; logs in $d): skipping its other groups"
                    finish_server "$name" "$d" "$rep"
                    continue 3
                fi
                cpu_account "$raw.cpu.json" "$attempt"
                case "$name" in bulwark-*)
                    "$BULWARK" --pool "$d/pool" status --json >"$raw.status.json" 2>/dev/null || true ;;
                esac
                fill=(--no-fill)  # the first group filled the region
                foreign=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["foreign_pct"])' "$raw.cpu.json")
                if python3 -c 'import sys; sys.exit(float(sys.argv[1]) <= float(sys.argv[2]))' "$foreign" "$MAX_FOREIGN"; then
                    if [ "$attempt" -lt "$RETRIES" ]; then
                        log "$name, $gname: other work used ${foreign}% of the CPUs (> $MAX_FOREIGN%): again in ${RETRY_WAIT}s"
                        sleep "$RETRY_WAIT"
                        continue
                    fi
                    log "$name, $gname: other work used ${foreign}% of the CPUs; kept after $RETRIES retries (flagged in the report)"
                fi
                break
            done
        done
        finish_server "$name" "$d" "$rep"
    done
done
skipped=()
for s in "${!SKIPPED[@]}"; do skipped+=("$s" "${SKIPPED[$s]}"); done
python3 -c 'import json,sys; m=json.load(open(sys.argv[1])); m["machine"]["loadavg_end"]=open("/proc/loadavg").read().split()[:3]; m["settings"]["skipped"]=dict(zip(sys.argv[2::2], sys.argv[3::2])); json.dump(m,open(sys.argv[1],"w"),indent=1)' "$WORKDIR/meta.json" "${skipped[@]}"

python3 "$REPO/bench/peers_report.py" --raw "$WORKDIR/raw" --meta "$WORKDIR/meta.json" --out "$OUT"
log "results: $OUT (raw reports in $WORKDIR/raw)"
[ "$FAILED" = 0 ] || { log "some bench calls failed (see the report's Failures)"; exit 1; }
