"""Issue 21: a volume cloned from an imported image boots a Linux guest under
qemu over NBD, and each clone is a disk of its own.

A tiny root disk (ext4: static busybox and an /sbin/init that prints
/etc/marker, the ids of the earlier boots it finds in /var/log/boots, appends
its own id there, syncs and powers off) is built from the host's Debian
packages by tests/helpers/make_boot_image.py, with the host's kernel and a
busybox initramfs that loads the virtio modules and switch_roots into
/dev/vda. It goes into the pool with `image import`, is cloned twice under two
new keys, and each clone boots under qemu-system-x86_64 straight from the NBD
socket, twice: each sees the image's marker, and the second boot of each sees
its own first boot and not the other clone's. The imported snapshot stays the
image byte for byte, and the clone's filesystem reads back clean.

qemu runs under TCG (a boot takes a few seconds with the Debian cloud kernel):
KVM is used only with BULWARK_TEST_ACCEL=kvm, since an openable /dev/kvm can
still fail at the first instruction (nested virtualisation)."""

import hashlib
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import HELPERS, LONG_TEST_TIMEOUT_S, make_key_file, require_tools, run

sys.path.insert(0, str(HELPERS))
import make_boot_image  # noqa: E402

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)

MARKER = "bulwark-clone-boot-test"
BOOT_TIMEOUT_S = 180
CONSOLE_TAIL_CHARS = 6000
ACCEL = os.environ.get("BULWARK_TEST_ACCEL", "tcg")
SHA_LINE = re.compile(r"^imported (\S+) as (\S+)@image: (\S+), sha256 ([0-9a-f]{64})$")


@pytest.fixture(scope="session")
def boot_image(tmp_path_factory):
    """kernel, initrd and root.img, built once per session."""
    require_tools("qemu-system-x86_64", "qemu-img", "nbdcopy")
    gone = make_boot_image.missing()
    if gone:
        pytest.skip("cannot build the guest image: missing " + "; ".join(gone) +
                    " (scripts/test.sh installs them)")
    return make_boot_image.build(tmp_path_factory.mktemp("boot-image"), MARKER)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def boot(pool, img, volume, log_dir):
    """Boot the guest from `volume` over NBD until it powers off; return what
    it printed: {"marker", "seen": [ids of earlier boots], "boot": this boot's id}."""
    log = log_dir / f"console-{volume}-{time.monotonic_ns()}.log"
    cmd = ["qemu-system-x86_64", "-accel", ACCEL, "-nographic", "-no-reboot", "-m", "256",
           "-nic", "none", "-kernel", img["kernel"], "-initrd", img["initrd"],
           "-append", "console=ttyS0 panic=-1 quiet",
           "-drive", f"file={pool.uri(volume)},format=raw,if=virtio"]
    cmd = [str(c) for c in cmd]
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        rc = proc.wait(BOOT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    took = time.monotonic() - start
    text = log.read_bytes().decode(errors="replace").replace("\r", "")
    tail = text[-CONSOLE_TAIL_CHARS:]
    what = f"boot of {volume} ({ACCEL}, {took:.1f}s)"
    print(f"{what}: qemu exit {rc}")
    assert rc is not None, f"{what}: no power-off within {BOOT_TIMEOUT_S}s\n" \
                           f"{' '.join(cmd)}\nconsole:\n{tail}\n{pool.log_tail()}"
    assert rc == 0, f"{what}: qemu exited {rc}\n{' '.join(cmd)}\nconsole:\n{tail}\n{pool.log_tail()}"

    def lines(tag):
        return re.findall(rf"{tag} ?(.*)", text)

    up, booted, done = lines("BULWARK-GUEST-UP"), lines("BULWARK-BOOT"), lines("BULWARK-GUEST-DONE")
    assert len(up) == 1 and len(booted) == 1 and done == booted, \
        f"{what}: the guest did not run its init to the end\nconsole:\n{tail}"
    return {"marker": up[0].strip(), "seen": [s.strip() for s in lines("BULWARK-SEEN")],
            "boot": booted[0].strip()}


def test_clones_of_an_imported_image_boot_separately(pool, boot_image, tmp_path):
    img = boot_image
    want = sha256_file(img["root"])

    r = pool.cli("image", "import", img["root"], "base",
                 "--key-file", make_key_file(tmp_path / "base.key"))
    m = SHA_LINE.match(r.stdout.strip().splitlines()[-1])
    assert m and m.group(2) == "base", f"unexpected import output:\n{r.stdout}"
    assert m.group(4) == want, "image import recorded another sha256 than the image's"

    for vm in ("vm1", "vm2"):
        pool.cli("volume", "clone", "base@image", vm, "--key-file", make_key_file(tmp_path / f"{vm}.key"))

    first = {vm: boot(pool, img, vm, tmp_path) for vm in ("vm1", "vm2")}
    for vm, b in first.items():
        assert b["marker"] == MARKER, f"{vm}: /etc/marker reads {b['marker']!r}, not the image's"
        assert b["seen"] == [], f"{vm}: first boot of a fresh clone found earlier boots {b['seen']}"
    assert first["vm1"]["boot"] != first["vm2"]["boot"]

    second = {vm: boot(pool, img, vm, tmp_path) for vm in ("vm1", "vm2")}
    for vm, other in (("vm1", "vm2"), ("vm2", "vm1")):
        b = second[vm]
        assert b["marker"] == MARKER, f"{vm}: /etc/marker reads {b['marker']!r} on its second boot"
        assert b["seen"] == [first[vm]["boot"]], \
            f"{vm}: second boot saw {b['seen']}, expected only its own first boot " \
            f"{first[vm]['boot']} ({other}'s was {first[other]['boot']})"

    # What the clones wrote stayed in the clones: the image's snapshot is the
    # image byte for byte, and vm1's filesystem reads back clean with its two boots.
    exp = tmp_path / "base-image.out"
    pool.cli("image", "export", "base@image", exp)
    assert sha256_file(exp) == want, "base@image changed after its clones booted and wrote"
    exp.unlink()

    require_tools("e2fsck", "debugfs")
    vm1 = tmp_path / "vm1.out"
    pool.cli("image", "export", "vm1", vm1)
    fsck = run(["e2fsck", "-fn", vm1], check=False)
    assert fsck.returncode == 0, f"vm1's filesystem is not clean after two boots:\n{fsck.stdout}{fsck.stderr}"
    boots = run(["debugfs", "-R", "cat /var/log/boots", vm1]).stdout.split()
    assert boots == [first["vm1"]["boot"], second["vm1"]["boot"]], f"vm1's /var/log/boots: {boots}"
