"""Issue 24: a guest writes a filesystem over NBD with cache=none and syncs, the
daemon is killed (kill -9) while the guest goes on writing, and after a restart
everything the guest had synced reads back, in a filesystem that is clean.

The guest is the one of test_clone_boots (tests/helpers/make_boot_image.py: the
host's kernel, a busybox initramfs, an ext4 root image) with another /sbin/init,
which reads `bulwark.mode=` from the kernel command line:

- write: writes files of random data under /data (new files, then a few blocks
  of three of them overwritten in place with dd conv=fsync), `sync`s, prints
  `BULWARK-SUM <sha256> <path>` for each and `BULWARK-FLUSHED`, and then writes
  on without ever syncing (O_DIRECT writes, which reach the daemon with no
  FLUSH after them, and buffered ones), printing `BULWARK-UNFLUSHED <n>` after
  each round;
- verify: prints `BULWARK-CHECK <sha256> <path>` for every file the write boot
  summed, any kernel line about an ext4 error or an I/O error as
  `BULWARK-KERNEL-ERROR ...`, syncs, remounts / read-only, prints
  `BULWARK-GUEST-DONE` and powers off.

The root image is imported into the pool as an encrypted volume (`image
import`), and the guest boots from it through qemu's NBD client with
cache=none, so that the guest's `sync` reaches the daemon as NBD FLUSHes. The
test waits for BULWARK-FLUSHED and for a few rounds of unflushed writes on the
serial console, kills the daemon with SIGKILL and then the guest, restarts the
daemon on the same pool and loads the key. Then:

- on the host: the volume exported as it is after the crash (before any guest
  mounts it) has its journal replayed by e2fsck (`-E journal_only`) and must
  then pass `e2fsck -fn`, and each file synced before the marker, read with
  debugfs, has the sha256 the first guest printed;
- a second guest boots from the volume (its kernel replays the journal) and
  finds the same sha256 for each of these files and no ext4 or I/O error;
  afterwards the volume passes `e2fsck -fn` as it is.

Once with the intent log on the pool's own device (layout single), once on a
separate log device (`pool create --log-device`). qemu runs under TCG unless
BULWARK_TEST_ACCEL=kvm (see test_clone_boots)."""

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import HELPERS, LONG_TEST_TIMEOUT_S, MiB, make_key_file, require_tools, run

sys.path.insert(0, str(HELPERS))
import make_boot_image  # noqa: E402

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)

ACCEL = os.environ.get("BULWARK_TEST_ACCEL", "tcg")
ROOT_MIB = 64
LOG_SIZE = 64 * MiB
# Seconds for a boot to reach a marker (or to power off): a TCG boot of the cloud
# kernel takes a few seconds; the writes before the marker a few more.
MARKER_TIMEOUT_S = 180
# Rounds of unflushed writes the guest reports before the daemon is killed.
UNFLUSHED_ROUNDS = 3
CONSOLE_TAIL_CHARS = 6000

GUEST_INIT = r"""#!/bin/sh
export PATH=/bin:/sbin
bb=/bin/busybox
mount -t proc proc /proc
mode=none
for w in $(cat /proc/cmdline); do
    case "$w" in bulwark.mode=*) mode="${w#bulwark.mode=}";; esac
done
echo "BULWARK-GUEST-UP $mode"
if [ "$mode" = write ]; then
    mkdir -p /data
    i=1
    while [ $i -le 12 ]; do
        # 4 KiB to 388 KiB each
        $bb dd if=/dev/urandom of=/data/f$i bs=4k count=$((i * 37 % 97 + 1)) status=none
        i=$((i + 1))
    done
    $bb dd if=/dev/urandom of=/data/big bs=64k count=48 status=none
    sync
    # overwrite blocks of files already on the disk, and fsync each
    for f in /data/f3 /data/f7 /data/big; do
        $bb dd if=/dev/urandom of=$f bs=4k seek=1 count=2 conv=notrunc,fsync status=none
    done
    sync
    for f in /data/f* /data/big; do echo "BULWARK-SUM $($bb sha256sum $f)"; done
    echo "BULWARK-FLUSHED"
    # and on until killed, never synced: O_DIRECT writes reach the disk with no
    # flush after them (16 files of each kind, rewritten in turn: 16 MiB at most)
    j=0
    while :; do
        k=$((j % 16))
        $bb dd if=/dev/urandom of=/data/direct$k bs=64k count=8 oflag=direct status=none
        $bb dd if=/dev/urandom of=/data/lazy$k bs=64k count=8 status=none
        echo "BULWARK-UNFLUSHED $j"
        j=$((j + 1))
    done
elif [ "$mode" = verify ]; then
    for f in /data/f* /data/big; do
        echo "BULWARK-CHECK $($bb sha256sum $f 2>&1)"
    done
    $bb find / -xdev > /dev/null 2>&1 || echo "BULWARK-KERNEL-ERROR find / failed"
    $bb dmesg | $bb grep -i -E 'EXT4-fs error|I/O error|EXT4-fs warning' | \
        while read -r line; do echo "BULWARK-KERNEL-ERROR $line"; done
    sync
    mount -o remount,ro /
    echo "BULWARK-GUEST-DONE"
else
    echo "BULWARK-GUEST-NO-MODE"
fi
poweroff -f
"""

SUM_LINE = re.compile(r"^BULWARK-(SUM|CHECK) (\S+)\s+(/data/\S+)\s*$", re.M)


@pytest.fixture(scope="session")
def crash_image(tmp_path_factory):
    """kernel, initrd and root.img (with GUEST_INIT), built once per session."""
    require_tools("qemu-system-x86_64", "qemu-img", "nbdcopy", "e2fsck", "debugfs")
    gone = make_boot_image.missing()
    if gone:
        pytest.skip("cannot build the guest image: missing " + "; ".join(gone) +
                    " (scripts/test.sh installs them)")
    return make_boot_image.build(tmp_path_factory.mktemp("crash-image"), "bulwark-flush-crash",
                                 guest_init=GUEST_INIT, root_mib=ROOT_MIB)


class Guest:
    """qemu-system-x86_64 booting from `volume` over NBD with cache=none, its
    serial console in a file that wait_for() reads."""

    def __init__(self, pool, img, volume, mode, log_dir: Path):
        self.what = f"{mode} boot of {volume} ({ACCEL})"
        self.pool = pool
        self.log = log_dir / f"console-{mode}-{time.monotonic_ns()}.log"
        self.cmd = [str(c) for c in [
            "qemu-system-x86_64", "-accel", ACCEL, "-nographic", "-no-reboot", "-m", "256",
            "-nic", "none", "-kernel", img["kernel"], "-initrd", img["initrd"],
            "-append", f"console=ttyS0 panic=-1 quiet bulwark.mode={mode}",
            "-drive", f"file={pool.uri(volume)},format=raw,if=virtio,cache=none"]]
        self.start = time.monotonic()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_bytes().decode(errors="replace").replace("\r", "")

    def explain(self, why: str) -> str:
        return (f"{self.what}: {why} ({time.monotonic() - self.start:.1f}s)\n{' '.join(self.cmd)}\n"
                f"console:\n{self.text()[-CONSOLE_TAIL_CHARS:]}\n{self.pool.log_tail()}")

    def wait_for(self, pattern: str, timeout=MARKER_TIMEOUT_S) -> re.Match:
        """Wait until the console shows a line matching `pattern`; fail if qemu
        exits or `timeout` passes first."""
        rx = re.compile(pattern, re.M)
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(self.text())
            if m:
                return m
            if self.proc.poll() is not None:
                pytest.fail(self.explain(f"qemu exited {self.proc.returncode} before {pattern!r}"))
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(self.explain(f"no {pattern!r} within {timeout}s"))
            time.sleep(0.1)

    def wait_exit(self, timeout=MARKER_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(self.explain(f"no power-off within {timeout}s"))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def sums(text: str, kind: str) -> dict:
    return {m.group(3): m.group(2) for m in SUM_LINE.finditer(text) if m.group(1) == kind}


def fsck_after_crash(pool, volume, tmp_path) -> Path:
    """Export the volume as the crash left it, replay its journal on the copy,
    and require a clean forced check; return the copy."""
    img = tmp_path / f"{volume}-after-crash.raw"
    pool.cli("image", "export", volume, img)
    replay = run(["e2fsck", "-y", "-E", "journal_only", img], check=False)
    assert replay.returncode in (0, 1), \
        f"e2fsck could not replay the journal after the crash (exit {replay.returncode}):\n" \
        f"{replay.stdout}{replay.stderr}"
    fsck = run(["e2fsck", "-fn", img], check=False)
    assert fsck.returncode == 0, \
        f"the filesystem is not clean after the crash and a journal replay " \
        f"(e2fsck -fn exit {fsck.returncode}):\n{fsck.stdout}{fsck.stderr}"
    return img


def debugfs_sha256(img: Path, path: str) -> str:
    """sha256 of the file at `path` in the ext4 image, or what debugfs said instead."""
    r = subprocess.run(["debugfs", "-R", f"cat {path}", str(img)], capture_output=True,
                       timeout=60)
    err = r.stderr.decode(errors="replace").replace("\n", " ").strip()
    if r.returncode != 0 or "not found" in err:
        return f"(unreadable: {err})"
    return hashlib.sha256(r.stdout).hexdigest()


def differences(want: dict, got: dict) -> list[str]:
    return [f"{path}: reads {got.get(path, '(no line)')}, the guest wrote {sha}"
            for path, sha in sorted(want.items()) if got.get(path) != sha]


def create_pool(make_pool, log_device: bool):
    pool = make_pool()
    if log_device:
        log = pool.tmp / "log.img"
        with open(log, "wb") as f:
            f.truncate(LOG_SIZE)
        pool.create("--devices", str(pool.devices), "--device-size", pool.device_size,
                    "--log-device", log)
    else:
        pool.create()
    return pool.start()


@pytest.mark.parametrize("log_device", [False, True], ids=["single", "log-device"])
def test_synced_guest_filesystem_survives_kill_9(make_pool, crash_image, tmp_path, log_device):
    img = crash_image
    t0 = time.monotonic()
    pool = create_pool(make_pool, log_device)
    key = make_key_file(tmp_path / "vm.key")
    pool.cli("image", "import", img["root"], "vm", "--key-file", key)
    enc = json.loads(pool.cli("volume", "get", "vm", "encryption", "--json").stdout)
    assert [r["value"] for r in enc] == [True], f"the imported volume is not encrypted: {enc}"

    # 1. The first guest syncs its files, says so, and writes on.
    g = Guest(pool, img, "vm", "write", tmp_path)
    try:
        g.wait_for(r"^BULWARK-FLUSHED\s*$")
        g.wait_for(rf"^BULWARK-UNFLUSHED {UNFLUSHED_ROUNDS - 1}\s*$")
        pool.kill()  # SIGKILL, with the guest's unflushed writes on the way
    finally:
        g.kill()
    written = g.text()
    want = sums(written, "SUM")
    assert len(want) == 13, g.explain(f"expected 13 BULWARK-SUM lines, got {sorted(want)}")
    t_crash = time.monotonic()

    # 2. Restart on the same pool; the crash's state, as the host sees it.
    pool.start()
    pool.load_key("vm", key)
    # Whether the import replays the intent log depends on a commit falling between the
    # guest's last flush and the kill (the guest's ext4 flushes every few seconds): say
    # which, and where a replay came from.
    restart_log = pool.log_path.read_text(errors="replace")
    replayed = [l for l in restart_log.splitlines() if "intent log replay" in l]
    print(f"after the restart: {replayed or 'no intent log replay logged'}")
    # (A replay may also stop early, with a warning, at a log block the kill tore:
    # that flush had no answer yet.)
    if log_device:
        assert all("from the log devices" in l for l in replayed if "replayed" in l), \
            f"the replay did not come from the log device:\n{restart_log}"
        assert pool.status()["log"]["state"] == "ONLINE", pool.status()["log"]
    copy = fsck_after_crash(pool, "vm", tmp_path)
    bad = differences(want, {path: debugfs_sha256(copy, path) for path in want})
    assert not bad, "files synced before the kill read back otherwise on the host (debugfs):\n" + \
        "\n".join(bad) + f"\n{pool.log_tail()}"
    copy.unlink()

    # 3. A second guest mounts the filesystem (its kernel replays the journal) and checks.
    v = Guest(pool, img, "vm", "verify", tmp_path)
    try:
        v.wait_for(r"^BULWARK-GUEST-DONE\s*$")
        rc = v.wait_exit()
    finally:
        v.kill()
    checked = v.text()
    assert rc == 0, v.explain(f"qemu exited {rc}")
    errors = re.findall(r"^BULWARK-KERNEL-ERROR .*$", checked, re.M)
    assert not errors, v.explain("the guest kernel reported errors:\n" + "\n".join(errors))
    bad = differences(want, sums(checked, "CHECK"))
    assert not bad, v.explain("files synced before the kill read back otherwise in the second "
                              "guest:\n" + "\n".join(bad))

    final = tmp_path / "vm-final.raw"
    pool.cli("image", "export", "vm", final)
    fsck = run(["e2fsck", "-fn", final], check=False)
    assert fsck.returncode == 0, \
        f"the filesystem is not clean after the second guest unmounted it " \
        f"(e2fsck -fn exit {fsck.returncode}):\n{fsck.stdout}{fsck.stderr}"
    print(f"{'log device' if log_device else 'single'}: crash after {t_crash - t0:.1f}s, "
          f"verified after {time.monotonic() - t0:.1f}s")
