"""The intent log (decision 0010): a client FLUSH is durable when it returns, through a
log block and one device sync instead of a commit.

- kill -9 right after flushes (no commit in between): every flushed write reads back,
  on single, mirror:2 and parity:2+1 pools, encrypted and not;
- the daemon crashes (BULWARK_CRASH_AT) after the log block is written but before the
  sync: every block reads as the old or the new write, never anything else, never EIO;
- it crashes after the sync, before answering: the new writes are all there;
- `serve --no-intent-log` (every flush a commit) keeps the same promise.
"""

import subprocess

import pytest

from conftest import MiB, qemu_io_ok, require_tools, run

SIZE = 16 * MiB


def read_all(pool, name: str, tmp) -> bytes:
    out = tmp / f"{name}.img"
    run(["nbdcopy", pool.uri(name), str(out)])
    return out.read_bytes()


@pytest.mark.parametrize("layout,devices,encryption", [
    ("single", 1, True),
    ("mirror:2", 2, False),
    ("parity:2+1", 3, True),
])
def test_flushed_writes_survive_kill_9(make_pool, layout, devices, encryption):
    require_tools("qemu-io")
    pool = make_pool(layout=layout, devices=devices)
    pool.create().start()
    key = pool.create_volume("v", size="16M", encryption=encryption)
    # Many small flushed writes, then kill -9: no commit ran after them (the timer is
    # seconds away; the flushes went to the log).
    cmds = []
    for i in range(64):
        cmds += [f"write -P {i % 250 + 1} {i * 65536} 4k", "flush"]
    qemu_io_ok(pool.uri("v"), *cmds, what="flushed writes")
    pool.kill()
    pool.start()
    if key is not None:
        pool.load_key("v", key)
    reads = [f"read -P {i % 250 + 1} {i * 65536} 4k" for i in range(64)]
    qemu_io_ok(pool.uri("v"), *reads, what="after kill -9")
    assert "intent log replayed" in pool.log_tail(), pool.log_tail()


@pytest.mark.parametrize("point,must_be_new", [
    ("intent.written", False),
    ("intent.synced", True),
])
def test_crash_inside_a_flush(make_pool, tmp_path, point, must_be_new):
    require_tools("qemu-io", "nbdcopy")
    pool = make_pool()
    pool.create().start()
    key = pool.create_volume("v", size="16M")
    qemu_io_ok(pool.uri("v"), "write -P 0xaa 0 4M", "flush", what="old data")
    pool.stop()  # the old data committed
    pool.start(env={"BULWARK_CRASH_AT": point})
    pool.load_key("v", key)
    r = subprocess.run(["qemu-io", "-f", "raw", "-c", "write -P 0xbb 0 4M", "-c", "flush",
                        pool.uri("v")], capture_output=True, text=True, timeout=120)
    pool.proc.wait(timeout=60)
    assert pool.proc.returncode != 0, "the daemon did not stop at the crash point"
    assert f"BULWARK_CRASH_AT={point}" in pool.log_tail()
    pool.proc = None
    pool.start()
    pool.load_key("v", key)
    data = read_all(pool, "v", tmp_path)
    old, new = b"\xaa" * 4096, b"\xbb" * 4096
    blocks = [data[i:i + 4096] for i in range(0, 4 * MiB, 4096)]
    bad = [i for i, b in enumerate(blocks) if b not in (old, new)]
    assert not bad, f"blocks neither old nor new after a crash at {point}: {bad[:10]}"
    if must_be_new:
        # The log block and the data were synced: the flush was durable before the crash.
        assert all(b == new for b in blocks), f"a synced flush lost writes (crash at {point})"
    assert data[4 * MiB:] == bytes(len(data) - 4 * MiB)


def test_without_the_log_every_flush_commits(make_pool):
    require_tools("qemu-io")
    pool = make_pool(serve_args=["--no-intent-log"])
    pool.create().start()
    key = pool.create_volume("v", size="16M")
    qemu_io_ok(pool.uri("v"), "write -P 0x42 0 1M", "flush")
    pool.kill()
    pool.start()
    pool.load_key("v", key)
    qemu_io_ok(pool.uri("v"), "read -P 0x42 0 1M")
