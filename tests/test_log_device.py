"""Separate intent log devices (issue 24 part 2): `pool create --log-device PATH`
(twice: the log mirrored on both), `pool log add|remove`.

- kill -9 right after flushes with the log on a log device: every flushed write reads
  back, on single, mirror:2 and parity:2+1 pools, replayed from the log device;
- the log device fails while clients write (every I/O fails, or its file is deleted):
  the writes and flushes go on, `status` says the log fell back (the pool is DEGRADED,
  never FAULTED), and a crash after that still loses no flushed write;
- the log device is gone when the pool restarts after a crash: the import goes on at
  the last commit, says what was lost, and every block reads as the old or the new
  write, never anything else;
- `pool log add` and `pool log remove` on a stopped pool, refused while it is served.
"""


import os
import socket
import urllib.request

import pytest

from conftest import MiB, qemu_io_ok, require_tools, run

LOG_SIZE = 64 * MiB


def make_log_file(pool, name: str) -> str:
    path = pool.tmp / name
    with open(path, "wb") as f:
        f.truncate(LOG_SIZE)
    return str(path)


def create_with_log(pool, *log_paths):
    extra = ["--devices", str(pool.devices), "--device-size", pool.device_size]
    for p in log_paths:
        extra += ["--log-device", p]
    return pool.create(*extra)


def log_status(pool) -> dict:
    st = pool.status()
    assert "log" in st, f"status shows no log devices: {st}"
    return st["log"]


def flushed_writes(count: int, pattern_base: int = 1):
    cmds = []
    for i in range(count):
        cmds += [f"write -P {(i + pattern_base) % 250 + 1} {i * 65536} 4k", "flush"]
    return cmds


def reads(count: int, pattern_base: int = 1):
    return [f"read -P {(i + pattern_base) % 250 + 1} {i * 65536} 4k" for i in range(count)]


@pytest.mark.parametrize("layout,devices,logs", [
    ("single", 1, 1),
    ("mirror:2", 2, 2),
    ("parity:2+1", 3, 1),
])
def test_flushed_writes_survive_kill_9_on_a_log_device(make_pool, layout, devices, logs):
    require_tools("qemu-io")
    pool = make_pool(layout=layout, devices=devices)
    paths = [make_log_file(pool, f"log{i}.img") for i in range(logs)]
    create_with_log(pool, *paths).start()
    log = log_status(pool)
    assert log["state"] == "ONLINE", log
    assert [d["path"] for d in log["devices"]] == paths
    key = pool.create_volume("v", size="16M")
    qemu_io_ok(pool.uri("v"), *flushed_writes(64), what="flushed writes")
    pool.kill()
    pool.start()
    pool.load_key("v", key)
    qemu_io_ok(pool.uri("v"), *reads(64), what="after kill -9")
    assert "intent log replayed from the log devices" in pool.log_tail(), pool.log_tail()
    text = pool.cli("status").stdout
    assert "logs:" in text and paths[0] in text, text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.mark.parametrize("how", ["vanish", "deleted"])
def test_a_failing_log_device_falls_back(make_pool, how):
    require_tools("qemu-io")
    port = free_port()
    pool = make_pool(serve_args=["--allow-fault-injection",
                                 "--metrics-listen", f"127.0.0.1:{port}"])
    log = make_log_file(pool, "log.img")
    create_with_log(pool, log).start()
    key = pool.create_volume("v", size="16M")
    qemu_io_ok(pool.uri("v"), *flushed_writes(16), what="before the log device fails")
    assert 'bulwark_log_state{state="ONLINE"} 1' in scrape(port)
    if how == "vanish":
        pool.cli("fault", "set", log, "vanish")
    else:
        os.unlink(log)
    # Writes and flushes go on: the first flush finds the log device failed, commits, and
    # the log falls back to the main devices.
    qemu_io_ok(pool.uri("v"), *flushed_writes(16, pattern_base=100), what="while it fails")
    st = pool.status()
    assert st["state"] == "DEGRADED", st["state"]
    assert st["log"]["state"] == "FELL_BACK", st["log"]
    assert st["log"]["devices"][0]["state"] == "FAULTED", st["log"]
    assert "fell back" in st["log"]["note"], st["log"]
    assert "fell back" in pool.cli("status").stdout
    assert pool.log_tail().count("the intent log fell back") == 1, pool.log_tail()
    metrics = scrape(port)
    assert 'bulwark_log_state{state="FELL_BACK"} 1' in metrics, metrics
    assert f'bulwark_log_device_state{{device="{log}",state="FAULTED"}} 1' in metrics, metrics
    qemu_io_ok(pool.uri("v"), *flushed_writes(8, pattern_base=200), what="after the fallback")
    pool.kill()
    pool.start()
    pool.load_key("v", key)
    expect = reads(8, pattern_base=200) + [
        f"read -P {(i + 100) % 250 + 1} {i * 65536} 4k" for i in range(8, 16)]
    qemu_io_ok(pool.uri("v"), *expect, what="after kill -9 past the fallback")


def test_log_device_gone_after_a_crash(make_pool, tmp_path):
    require_tools("qemu-io", "nbdcopy")
    pool = make_pool()
    log = make_log_file(pool, "log.img")
    create_with_log(pool, log).start()
    key = pool.create_volume("v", size="16M")
    qemu_io_ok(pool.uri("v"), "write -P 0xaa 0 4M", "flush", what="old data")
    pool.stop()  # the old data committed
    pool.start()
    pool.load_key("v", key)
    cmds = []
    for i in range(64):
        cmds += [f"write -P 0xbb {i * 65536} 64k", "flush"]
    qemu_io_ok(pool.uri("v"), *cmds, what="flushed writes on the log device")
    pool.kill()
    os.unlink(log)
    pool.start()
    tail = pool.log_tail()
    assert "cannot be replayed" in tail, tail
    st = pool.status()
    assert st["state"] == "DEGRADED", st["state"]
    assert st["log"]["state"] == "FELL_BACK", st["log"]
    assert st["log"]["devices"][0]["state"] == "UNAVAIL", st["log"]
    assert "cannot be replayed" in st["log"]["note"], st["log"]
    pool.load_key("v", key)
    out = tmp_path / "v.img"
    run(["nbdcopy", pool.uri("v"), str(out)])
    data = out.read_bytes()
    old, new = b"\xaa" * 4096, b"\xbb" * 4096
    blocks = [data[i:i + 4096] for i in range(0, 4 * MiB, 4096)]
    bad = [i for i, b in enumerate(blocks) if b not in (old, new)]
    assert not bad, f"blocks neither old nor new without the log device: {bad[:10]}"
    assert data[4 * MiB:] == bytes(len(data) - 4 * MiB)
    # The pool goes on, its flushes on the main devices.
    qemu_io_ok(pool.uri("v"), "write -P 0xcc 0 64k", "flush")
    pool.kill()
    pool.start()
    pool.load_key("v", key)
    qemu_io_ok(pool.uri("v"), "read -P 0xcc 0 64k")


def test_pool_log_add_and_remove(make_pool):
    require_tools("qemu-io")
    pool = make_pool()
    pool.create().start()
    assert "log" not in pool.status()
    log = make_log_file(pool, "log.img")
    r = pool.cli("pool", "log", "add", log, check=False)
    assert r.returncode != 0 and "stop it first" in r.stderr, r.stderr
    pool.stop()
    pool.cli("pool", "log", "add", log)
    assert "LOG DEVICE" in pool.cli("pool", "status").stdout
    pool.start()
    assert log_status(pool)["state"] == "ONLINE"
    key = pool.create_volume("v", size="16M")
    qemu_io_ok(pool.uri("v"), *flushed_writes(32))
    pool.kill()
    pool.start()
    assert "intent log replayed from the log devices" in pool.log_tail(), pool.log_tail()
    pool.load_key("v", key)
    qemu_io_ok(pool.uri("v"), *reads(32))
    pool.stop()
    # A second one mirrors the log; removing one leaves the other.
    log2 = make_log_file(pool, "log2.img")
    pool.cli("pool", "log", "add", log2)
    pool.start()
    assert [d["path"] for d in log_status(pool)["devices"]] == [log, log2]
    pool.stop()
    pool.cli("pool", "log", "remove", log)
    pool.start()
    assert [d["path"] for d in log_status(pool)["devices"]] == [log2]
    pool.stop()
    pool.cli("pool", "log", "remove")
    r = pool.cli("pool", "log", "remove", check=False)
    assert r.returncode != 0 and "no log device" in r.stderr, r.stderr
    pool.start()
    assert "log" not in pool.status()
    pool.load_key("v", key)
    qemu_io_ok(pool.uri("v"), *reads(32))
    qemu_io_ok(pool.uri("v"), "write -P 0x33 0 4k", "flush")
    pool.kill()
    pool.start()
    pool.load_key("v", key)
    qemu_io_ok(pool.uri("v"), "read -P 0x33 0 4k")
    pool.stop()
    # The removed devices' labels are wiped: another pool may take them.
    other = make_pool()
    other.create("--devices", "1", "--device-size", "64M", "--log-device", log)


@pytest.mark.parametrize("point,must_be_new", [
    ("intent.written", False),
    ("intent.synced", True),
])
def test_crash_inside_a_flush_on_the_log_device(make_pool, tmp_path, point, must_be_new):
    require_tools("qemu-io", "nbdcopy")
    pool = make_pool(layout="mirror:2", devices=2)
    logs = [make_log_file(pool, "log0.img"), make_log_file(pool, "log1.img")]
    create_with_log(pool, *logs).start()
    key = pool.create_volume("v", size="16M")
    qemu_io_ok(pool.uri("v"), "write -P 0xaa 0 4M", "flush", what="old data")
    pool.stop()  # the old data committed
    pool.start(env={"BULWARK_CRASH_AT": point})
    pool.load_key("v", key)
    run(["qemu-io", "-f", "raw", "-c", "write -P 0xbb 0 4M", "-c", "flush", pool.uri("v")],
        check=False)
    pool.proc.wait(timeout=60)
    assert pool.proc.returncode != 0, "the daemon did not stop at the crash point"
    assert f"BULWARK_CRASH_AT={point}" in pool.log_tail()
    pool.proc = None
    pool.start()
    pool.load_key("v", key)
    out = tmp_path / "v.img"
    run(["nbdcopy", pool.uri("v"), str(out)])
    data = out.read_bytes()
    old, new = b"\xaa" * 4096, b"\xbb" * 4096
    blocks = [data[i:i + 4096] for i in range(0, 4 * MiB, 4096)]
    bad = [i for i, b in enumerate(blocks) if b not in (old, new)]
    assert not bad, f"blocks neither old nor new after a crash at {point}: {bad[:10]}"
    if must_be_new:
        assert all(b == new for b in blocks), f"a synced flush lost writes (crash at {point})"
        assert "intent log replayed from the log devices" in pool.log_tail(), pool.log_tail()
    assert data[4 * MiB:] == bytes(len(data) - 4 * MiB)
    assert pool.status()["log"]["state"] == "ONLINE"


def test_pool_destroy_wipes_the_log_device_label(make_pool):
    pool = make_pool()
    log = make_log_file(pool, "log.img")
    create_with_log(pool, log)
    pool.bulwark("pool", "destroy", str(pool.dir), "--yes")
    other = make_pool()
    other.create("--devices", "1", "--device-size", "64M", "--log-device", log)


def test_export_and_import_with_a_log_device(make_pool, tmp_path):
    require_tools("qemu-io")
    a = make_pool(layout="mirror:2", devices=2)
    log = make_log_file(a, "log.img")
    create_with_log(a, log).start()
    key = a.create_volume("v", size="16M")
    qemu_io_ok(a.uri("v"), *flushed_writes(16))
    devices = a.device_paths()
    a.stop()
    a.bulwark("pool", "export", str(a.dir))
    # Another directory takes the pool: the log device is found among the devices given.
    b = make_pool(layout="mirror:2", devices=2, dir_name="moved")
    b.bulwark("pool", "import", "--dir", str(b.dir), "--pool-key", str(a.dir / "pool.key"),
              *devices, log)
    b.start()
    st = b.status()
    assert st["state"] == "ONLINE", st["state"]
    assert [d["path"] for d in st["log"]["devices"]] == [log], st["log"]
    b.load_key("v", key)
    qemu_io_ok(b.uri("v"), *reads(16))
    qemu_io_ok(b.uri("v"), *flushed_writes(8, pattern_base=50))
    b.kill()
    b.start()
    assert "intent log replayed from the log devices" in b.log_tail(), b.log_tail()
    b.load_key("v", key)
    qemu_io_ok(b.uri("v"), *reads(8, pattern_base=50))
