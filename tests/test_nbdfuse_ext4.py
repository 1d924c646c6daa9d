"""An ext4 filesystem on a volume: nbdfuse shows the volume as a file, mkfs
and a loop mount put a tree of files on it; after a daemon restart and key
load every file has its checksum and e2fsck finds the filesystem clean."""

import contextlib
import hashlib
import os
import random
import subprocess
import time

import pytest

from conftest import KiB, MiB, require_tools, run


def require_loop_mount():
    if os.geteuid() != 0:
        pytest.skip("mounting ext4 on a loop device needs root")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse: nbdfuse cannot run here")
    r = subprocess.run(["losetup", "-f"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"no free loop device (losetup -f: {r.stderr.strip()})")


@contextlib.contextmanager
def nbdfuse(uri, mnt):
    """Run nbdfuse MNT/disk URI; yield the path of the file; unmount after."""
    mnt.mkdir(exist_ok=True)
    disk = mnt / "disk"
    proc = subprocess.Popen(["nbdfuse", str(disk), uri],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (disk.exists() and disk.stat().st_size > 0):
            if proc.poll() is not None:
                pytest.fail(f"nbdfuse exited {proc.returncode}: {proc.stdout.read()}")
            if time.monotonic() > deadline:
                pytest.fail("nbdfuse did not show the volume within 30s")
            time.sleep(0.1)
        yield disk
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)


@contextlib.contextmanager
def loop_mount(disk, fs):
    fs.mkdir(exist_ok=True)
    run(["mount", "-o", "loop", disk, fs])
    try:
        yield fs
    finally:
        r = subprocess.run(["umount", str(fs)], capture_output=True, text=True)
        if r.returncode != 0:
            subprocess.run(["umount", "-l", str(fs)], capture_output=True)


def make_tree(root, seed):
    """A few MiB of files in nested directories; returns {relative path: sha256}."""
    rng = random.Random(seed)
    sums = {}
    for i in range(60):
        d = root / f"d{i % 4}" / f"e{i % 7}"
        d.mkdir(parents=True, exist_ok=True)
        size = rng.choice([0, 1, 511, 4096, 4097, 65536]) if i % 3 else rng.randrange(1, 256 * KiB)
        data = rng.randbytes(size)
        (d / f"f{i}.bin").write_bytes(data)
        sums[str((d / f"f{i}.bin").relative_to(root))] = hashlib.sha256(data).hexdigest()
    big = rng.randbytes(3 * MiB)
    (root / "big.bin").write_bytes(big)
    sums["big.bin"] = hashlib.sha256(big).hexdigest()
    text = b"".join(b"line %d of a compressible text file\n" % n for n in range(40000))
    (root / "text.txt").write_bytes(text)
    sums["text.txt"] = hashlib.sha256(text).hexdigest()
    return sums


def test_nbdfuse_ext4(pool, tmp_path, seed):
    require_tools("nbdfuse", "fusermount3", "mkfs.ext4", "e2fsck", "mount", "umount", "losetup")
    require_loop_mount()
    key = pool.create_volume("fs1", size="256M")
    uri = pool.uri("fs1")
    mnt, fs = tmp_path / "mnt", tmp_path / "fs"
    src = tmp_path / "src"
    sums = make_tree(src, seed)

    with nbdfuse(uri, mnt) as disk:
        assert disk.stat().st_size == 256 * MiB
        run(["mkfs.ext4", "-q", "-F", disk])
        with loop_mount(disk, fs):
            run(["cp", "-a", f"{src}/.", f"{fs}/tree"])
            run(["sync", "-f", f"{fs}/tree"])

    pool.restart()
    pool.load_key("fs1", key)

    with nbdfuse(uri, mnt) as disk:
        with loop_mount(disk, fs):
            got = {}
            for dirpath, _, files in os.walk(fs / "tree"):
                for name in files:
                    p = os.path.join(dirpath, name)
                    with open(p, "rb") as f:
                        got[os.path.relpath(p, fs / "tree")] = hashlib.sha256(f.read()).hexdigest()
            missing = sorted(set(sums) - set(got))
            wrong = sorted(k for k in sums if k in got and got[k] != sums[k])
            assert not missing and not wrong, f"after restart: missing {missing}, wrong checksum {wrong}"
        r = run(["e2fsck", "-fn", disk], check=False)
        assert r.returncode == 0, f"e2fsck -fn found problems (exit {r.returncode}):\n{r.stdout}{r.stderr}"
