"""scripts/demo.sh installs only what the demo needs (issue 42): the build's packages and
nbdfuse, FUSE and mkfs.ext4. What only the tests use (Prometheus, a kernel image and
busybox for the boot test, systemd for unit checks, qemu, fio, ...) is installed by
scripts/test.sh alone: on a demo machine a new kernel may become the default boot entry.

scripts/lib.sh is sourced as demo.sh sources it, on a PATH where nothing is installed
and apt-get, sudo and dpkg-query are stubs that record what would be installed.
"""

import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DEMO_PACKAGES = {"pkg-config", "build-essential", "libssl-dev", "libnbd-bin", "fuse3",
                 "e2fsprogs"}


def stub(bin_dir: Path, name: str, body: str) -> None:
    p = bin_dir / name
    p.write_text("#!/bin/bash\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)


def installs(tmp_path: Path, then: str = "") -> set[str]:
    bin_dir = tmp_path / "bin"
    home = tmp_path / "home"
    (home / ".cargo" / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    log = tmp_path / "apt.log"
    stub(bin_dir, "apt-get", f'[ "$1" = install ] && echo "$@" >> {log}; exit 0')
    stub(bin_dir, "dpkg-query", "exit 1")
    stub(bin_dir, "sudo", 'exec "$@"')
    stub(bin_dir, "id", "echo 0")
    stub(home / ".cargo" / "bin", "cargo", "exit 0")
    for tool in ("sort", "grep", "cat"):
        os.symlink(f"/usr/bin/{tool}" if Path(f"/usr/bin/{tool}").exists() else f"/bin/{tool}",
                   bin_dir / tool)
    env = {"PATH": str(bin_dir), "HOME": str(home)}
    r = subprocess.run(["/bin/bash", "-euo", "pipefail", "-c",
                        f'ROOT={ROOT}; . "$ROOT/scripts/lib.sh"; {then}'],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    pkgs = set()
    if log.exists():
        for line in log.read_text().splitlines():
            pkgs |= {w for w in line.split() if not w.startswith("-") and w != "install"}
    return pkgs


def test_demo_installs_only_what_the_demo_needs(tmp_path):
    got = installs(tmp_path / "demo")
    assert got == DEMO_PACKAGES, sorted(got - DEMO_PACKAGES)


def test_test_script_installs_the_test_tools(tmp_path):
    got = installs(tmp_path / "test", "install_test_packages")
    assert DEMO_PACKAGES <= got
    # (A kernel image too, where /boot has none: this machine's decides.)
    for pkg in ("prometheus", "qemu-utils", "fio", "nbdkit", "libjson-perl", "busybox-static"):
        assert pkg in got, pkg
