#!/usr/bin/env python3
"""Build a tiny bootable Linux guest from the host's Debian packages, without root.

    python3 tests/helpers/make_boot_image.py OUTDIR [--marker TEXT] [--kernel VERSION]
        [--init SCRIPT] [--root-mib N]

OUTDIR gets:
  vmlinuz     the host's kernel (/boot/vmlinuz-VERSION, package linux-image-amd64
              or linux-image-cloud-amd64), used with qemu's -kernel
  initrd.img  an uncompressed newc cpio: static busybox, the few modules the
              kernel needs to see a virtio disk and mount ext4 (resolved from
              /lib/modules/VERSION/modules.dep; none if built in) and an /init
              that loads them, mounts /dev/vda and switch_roots into it
  root.img    a raw ext4 image (mkfs.ext4 -d): static busybox and an /sbin/init
              that prints `BULWARK-GUEST-UP <contents of /etc/marker>`, one
              `BULWARK-SEEN <id>` line for each earlier boot recorded in
              /var/log/boots, appends this boot's id there (`BULWARK-BOOT <id>`),
              syncs, remounts / read-only, prints `BULWARK-GUEST-DONE <id>` and
              powers off (or, with --init / build(guest_init=...), any other
              /sbin/init script)

Boot it by hand (add -accel kvm where /dev/kvm is usable):
  qemu-system-x86_64 -nographic -no-reboot -m 256 -kernel OUTDIR/vmlinuz \\
      -initrd OUTDIR/initrd.img -append 'console=ttyS0 panic=-1 quiet' \\
      -drive file=OUTDIR/root.img,format=raw,if=virtio

Needs: a kernel in /boot with its modules in /lib/modules, a static busybox
(busybox-static), mkfs.ext4 (e2fsprogs). The cpio archive is written here, so
the cpio tool is not needed, and /dev/console goes in as a device node without
mknod. `missing()` lists what is absent, for a test to skip on.
"""

from __future__ import annotations

import argparse
import lzma
import gzip
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT_IMAGE_MIB = 32
# The disk the initramfs mounts as the root: the first virtio disk.
ROOT_DEVICE = "/dev/vda"
# Busybox applets the two init scripts use (symlinks to /bin/busybox).
APPLETS = ["sh", "mount", "umount", "insmod", "switch_root", "mkdir", "sleep", "cat", "echo",
           "sync", "poweroff", "test", "[", "tr", "ls", "dmesg"]

# Modules the initramfs loads (with their dependencies), where they are modules
# at all: the virtio PCI transport and disk, and ext4 (built in on the cloud
# kernel, a module on the generic one, which then also wants crc32c).
WANTED_MODULES = ["virtio_pci", "virtio_blk", "crc32c_generic", "ext4"]
REQUIRED_MODULES = {"virtio_pci", "virtio_blk", "ext4"}

INITRAMFS_INIT = f"""#!/bin/sh
export PATH=/bin
mount -t devtmpfs devtmpfs /dev
mount -t proc proc /proc
for m in $(cat /modules.load); do
    insmod "/lib/modules/$m" || echo "bulwark-initrd: insmod $m failed"
done
i=0
while [ ! -b {ROOT_DEVICE} ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
if ! mount -t ext4 -o rw {ROOT_DEVICE} /newroot; then
    echo "BULWARK-INITRD-FAILED: cannot mount {ROOT_DEVICE}"
    ls /dev; dmesg | tail -n 30
    poweroff -f
fi
umount /proc
mount --move /dev /newroot/dev
exec switch_root /newroot /sbin/init
"""

GUEST_INIT = """#!/bin/sh
export PATH=/bin:/sbin
mount -t proc proc /proc
echo "BULWARK-GUEST-UP $(cat /etc/marker 2>/dev/null)"
if [ -f /var/log/boots ]; then
    while read -r id; do echo "BULWARK-SEEN $id"; done < /var/log/boots
fi
id=$(cat /proc/sys/kernel/random/uuid)
echo "BULWARK-BOOT $id"
echo "$id" >> /var/log/boots
sync
mount -o remount,ro /
echo "BULWARK-GUEST-DONE $id"
poweroff -f
"""


# --------------------------------------------------------------------------
# what the host has


def _version_key(v: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", v)]


def find_kernel(version: str | None = None, sysroot: str = "/") -> tuple[Path, Path] | None:
    """(vmlinuz, /lib/modules/VERSION) of the newest kernel with its modules
    under sysroot (default /), or None."""
    cands = []
    for vm in (Path(sysroot) / "boot").glob("vmlinuz-*"):
        ver = vm.name[len("vmlinuz-"):]
        mods = Path(sysroot) / "lib" / "modules" / ver
        if (mods / "modules.dep").exists() and (version is None or ver == version):
            cands.append((ver, vm, mods))
    if not cands:
        return None
    ver, vm, mods = max(cands, key=lambda c: _version_key(c[0]))
    return vm, mods


def is_static_elf(path: Path) -> bool:
    """True for an ELF executable without a PT_INTERP (dynamic loader) header."""
    try:
        with open(path, "rb") as f:
            ident = f.read(64)
            if ident[:4] != b"\x7fELF" or ident[4] != 2:  # 64-bit only
                return False
            end = "<" if ident[5] == 1 else ">"
            phoff, = struct.unpack_from(end + "Q", ident, 0x20)
            phentsize, phnum = struct.unpack_from(end + "HH", ident, 0x36)
            for i in range(phnum):
                f.seek(phoff + i * phentsize)
                p_type, = struct.unpack(end + "I", f.read(4))
                if p_type == 3:  # PT_INTERP
                    return False
            return True
    except OSError:
        return False


def find_busybox() -> Path | None:
    """A statically linked busybox (Debian: busybox-static installs /bin/busybox)."""
    seen = set()
    for cand in ("/bin/busybox", "/usr/bin/busybox", shutil.which("busybox")):
        if not cand or cand in seen:
            continue
        seen.add(cand)
        p = Path(cand)
        if p.exists() and is_static_elf(p):
            return p
    return None


def missing(kernel_version: str | None = None, sysroot: str = "/") -> list[str]:
    """What is absent for build(), each as 'thing (Debian package)'; empty if nothing."""
    out = []
    k = find_kernel(kernel_version, sysroot)
    if k is None:
        out.append("a kernel in /boot with /lib/modules (linux-image-cloud-amd64 or linux-image-amd64)")
    elif not os.access(k[0], os.R_OK):
        out.append(f"read access to {k[0]} (it is not readable by this user)")
    if find_busybox() is None:
        out.append("a static busybox (busybox-static)")
    if shutil.which("mkfs.ext4") is None and not Path("/sbin/mkfs.ext4").exists():
        out.append("mkfs.ext4 (e2fsprogs)")
    return out


# --------------------------------------------------------------------------
# modules


def _mod_name(path: str) -> str:
    base = os.path.basename(path)
    base = re.sub(r"\.ko(\.(xz|gz|zst))?$", "", base)
    return base.replace("-", "_")


def resolve_modules(moddir: Path) -> list[str]:
    """Paths (relative to moddir) of the modules to load, dependencies first."""
    deps: dict[str, tuple[str, list[str]]] = {}
    for line in (moddir / "modules.dep").read_text().splitlines():
        if ":" not in line:
            continue
        path, rest = line.split(":", 1)
        deps[_mod_name(path)] = (path, rest.split())
    builtin = set()
    bfile = moddir / "modules.builtin"
    if bfile.exists():
        builtin = {_mod_name(l.strip()) for l in bfile.read_text().splitlines() if l.strip()}

    order: list[str] = []

    def add(name: str) -> None:
        path, ds = deps[name]
        if path in order:
            return
        for d in ds:
            add(_mod_name(d))
        if path not in order:
            order.append(path)

    for name in WANTED_MODULES:
        if name in deps:
            if name == "crc32c_generic" and "ext4" not in deps:
                continue  # ext4 built in: so is what it needs
            add(name)
        elif name in REQUIRED_MODULES and name not in builtin:
            raise SystemExit(f"make_boot_image: {name} is neither a module nor built into "
                             f"the kernel of {moddir}")
    return order


def read_module(path: Path) -> bytes:
    data = path.read_bytes()
    if path.suffix == ".xz":
        return lzma.decompress(data)
    if path.suffix == ".gz":
        return gzip.decompress(data)
    if path.suffix == ".zst":
        return subprocess.run(["zstd", "-dc", str(path)], check=True, capture_output=True).stdout
    return data


# --------------------------------------------------------------------------
# the initramfs: a newc cpio archive


class Cpio:
    def __init__(self):
        self.buf = bytearray()
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev=(0, 0)) -> None:
        nameb = name.encode() + b"\0"
        fields = [self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(nameb), 0]
        self.ino += 1
        self.buf += b"070701" + b"".join(b"%08X" % f for f in fields) + nameb
        self.buf += b"\0" * (-len(self.buf) % 4)
        self.buf += data
        self.buf += b"\0" * (-len(self.buf) % 4)

    def dir(self, name):
        self._entry(name, 0o040755)

    def file(self, name, data: bytes, perm=0o644):
        self._entry(name, 0o100000 | perm, data)

    def symlink(self, name, target: str):
        self._entry(name, 0o120777, target.encode())

    def chardev(self, name, major, minor, perm=0o600):
        self._entry(name, 0o020000 | perm, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        self.buf += b"\0" * (-len(self.buf) % 512)
        return bytes(self.buf)


def build_initrd(busybox: Path, moddir: Path, out: Path) -> list[str]:
    mods = resolve_modules(moddir)
    c = Cpio()
    for d in ("bin", "dev", "proc", "sys", "newroot", "lib", "lib/modules"):
        c.dir(d)
    c.chardev("dev/console", 5, 1)
    c.file("bin/busybox", busybox.read_bytes(), 0o755)
    for a in APPLETS:
        c.symlink(f"bin/{a}", "busybox")
    load = []
    for m in mods:
        name = re.sub(r"\.(xz|gz|zst)$", "", os.path.basename(m))
        c.file(f"lib/modules/{name}", read_module(moddir / m))
        load.append(name)
    c.file("modules.load", ("\n".join(load) + "\n").encode())
    c.file("init", INITRAMFS_INIT.encode(), 0o755)
    out.write_bytes(c.finish())
    return load


# --------------------------------------------------------------------------
# the root filesystem


def build_root(busybox: Path, marker: str, out: Path, size_mib: int = ROOT_IMAGE_MIB,
               guest_init: str | None = None) -> None:
    """The root image; guest_init: another /sbin/init script than GUEST_INIT."""
    mkfs = shutil.which("mkfs.ext4") or "/sbin/mkfs.ext4"
    with tempfile.TemporaryDirectory(prefix="bulwark-rootfs-") as d:
        root = Path(d)
        for sub in ("bin", "sbin", "etc", "dev", "proc", "sys", "tmp", "var/log"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        shutil.copy(busybox, root / "bin" / "busybox")
        os.chmod(root / "bin" / "busybox", 0o755)
        for a in APPLETS:
            os.symlink("busybox", root / "bin" / a)
        (root / "sbin" / "init").write_text(GUEST_INIT if guest_init is None else guest_init)
        os.chmod(root / "sbin" / "init", 0o755)
        (root / "etc" / "marker").write_text(marker + "\n")
        if out.exists():
            out.unlink()
        r = subprocess.run([mkfs, "-q", "-F", "-L", "bulwark-root", "-d", str(root),
                            str(out), f"{size_mib}M"], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"make_boot_image: mkfs.ext4 failed (exit {r.returncode}):\n"
                             f"{r.stdout}{r.stderr}")


def build(outdir: Path, marker: str = "bulwark-test-image", kernel_version: str | None = None,
          sysroot: str = "/", guest_init: str | None = None,
          root_mib: int = ROOT_IMAGE_MIB) -> dict:
    """Build vmlinuz, initrd.img and root.img in outdir; return their paths and details.
    guest_init: the text of root.img's /sbin/init, in place of GUEST_INIT (a script for
    /bin/sh: busybox, with the APPLETS as commands and any other applet as `busybox NAME`);
    root_mib: root.img's size in MiB."""
    gone = missing(kernel_version, sysroot)
    if gone:
        raise SystemExit("make_boot_image: missing " + "; ".join(gone))
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    vmlinuz, moddir = find_kernel(kernel_version, sysroot)
    busybox = find_busybox()
    kernel = outdir / "vmlinuz"
    shutil.copyfile(vmlinuz, kernel)
    initrd = outdir / "initrd.img"
    modules = build_initrd(busybox, moddir, initrd)
    root = outdir / "root.img"
    build_root(busybox, marker, root, root_mib, guest_init)
    return {"kernel": kernel, "initrd": initrd, "root": root, "kernel_version": moddir.name,
            "modules": modules, "busybox": busybox}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--marker", default="bulwark-test-image", help="contents of /etc/marker")
    ap.add_argument("--kernel", dest="kernel_version", help="kernel version (default: newest in /boot)")
    ap.add_argument("--sysroot", default="/",
                    help="look for boot/vmlinuz-* and lib/modules/ under this directory instead "
                         "of / (a kernel .deb unpacked with dpkg-deb -x, then depmod -b DIR VERSION)")
    ap.add_argument("--init", type=Path, dest="init_file",
                    help="use this script as root.img's /sbin/init instead of the built-in one")
    ap.add_argument("--root-mib", type=int, default=ROOT_IMAGE_MIB, help="root.img's size in MiB")
    args = ap.parse_args()
    init = args.init_file.read_text() if args.init_file else None
    info = build(args.outdir, args.marker, args.kernel_version, args.sysroot, init, args.root_mib)
    print(f"kernel {info['kernel_version']}, busybox {info['busybox']}, "
          f"modules: {' '.join(info['modules']) or '(none)'}")
    for k in ("kernel", "initrd", "root"):
        print(f"{k}: {info[k]}")
    print(f"boot: qemu-system-x86_64 -nographic -no-reboot -m 256 -kernel {info['kernel']} "
          f"-initrd {info['initrd']} -append 'console=ttyS0 panic=-1 quiet' "
          f"-drive file={info['root']},format=raw,if=virtio")
    return 0


if __name__ == "__main__":
    sys.exit(main())
