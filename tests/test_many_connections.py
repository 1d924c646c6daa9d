"""Hundreds of idle NBD connections (a host with many VMs, each attached)
do not lock the daemon up: while they stay open, a new client still reads
and writes, and the control socket still answers. The daemon starts with a
soft open-files limit of 256, as services often get, and must lift it
itself: each connection holds three descriptors.

Two faults this caught: every connection's threads came from the runtime's
shared blocking pool (512 threads, two held per idle connection), so past
~256 connections new clients and control commands waited forever; and the
daemon kept the soft limit it was started with, so it could not accept
more than ~80 connections under 256.
"""

import resource
import subprocess
import sys
import threading
import time

import pytest

from conftest import HELPERS, WAIT_TIMEOUT_S, nbd_python, qemu_io_ok, require_tools, run

CONNECTIONS = 300
HOLD_TIMEOUT_S = 120
FULL_WARN_EVERY_S = 10  # the daemon's interval between "too many connections" warnings


def test_hundreds_of_idle_connections_leave_the_daemon_responsive(make_pool):
    require_tools("qemu-io", "nbdinfo")
    python = nbd_python()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 3 * CONNECTIONS + 200:
        pytest.skip(f"the hard open-files limit ({hard}) is below what "
                    f"{CONNECTIONS} connections need")
    pool = make_pool(open_files=256)
    pool.create().start()
    pool.create_volume("v", size="16M")
    uri = pool.uri("v")
    qemu_io_ok(uri, "write -P 0xab 0 64k", what="first write")

    holder = subprocess.Popen([python, str(HELPERS / "hold_connections.py"), uri,
                               str(CONNECTIONS)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        # Read the first line without blocking the test forever.
        first = []
        reader = threading.Thread(target=lambda: first.append(holder.stdout.readline()))
        reader.start()
        reader.join(HOLD_TIMEOUT_S)
        if reader.is_alive():
            holder.kill()
            pytest.fail(f"{CONNECTIONS} connections were not all served within "
                        f"{HOLD_TIMEOUT_S}s\n{pool.log_tail()}")
        assert first[0].strip() == f"held {CONNECTIONS}", first[0] + pool.log_tail()

        # With every one of them open: the control socket answers...
        st = pool.status()
        assert st["state"] == "ONLINE", st
        # ...and a new client reads what was written and writes more.
        qemu_io_ok(uri, "read -P 0xab 0 64k", "write -P 0xcd 64k 64k",
                   what=f"I/O beside {CONNECTIONS} idle connections")
        r = run(["nbdinfo", "--size", uri], timeout=30)
        assert r.stdout.strip() == str(16 << 20)
    finally:
        out, _ = holder.communicate(input="", timeout=HOLD_TIMEOUT_S)
    assert holder.returncode == 0, out
    assert f"closed {CONNECTIONS}" in out, out
    # Once they are gone, the data is all there.
    qemu_io_ok(uri, "read -P 0xab 0 64k", "read -P 0xcd 64k 64k", what="after the idle ones closed")


def vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


READS_IN_FLIGHT = 64
READ_BYTES = 32 << 20
# What one connection may hold (ARCHITECTURE.md): its 4 threads' batches of
# one 32 MiB read each, 128 MiB of replies waiting for the client, and
# pooled buffers; with room to spare for the allocator.
CONNECTION_BOUND_MIB = 4 * 32 + 128 + 64 + 128

GREEDY_CLIENT = f"""
import sys, nbd
h = nbd.NBD()
h.connect_uri(sys.argv[1])
bufs = [nbd.Buffer({READ_BYTES}) for _ in range({READS_IN_FLIGHT})]
for j, b in enumerate(bufs):
    h.aio_pread(b, (j % 16) * {READ_BYTES})
while h.aio_in_flight() > 0:
    h.poll(-1)
print("done")
"""


def test_one_client_cannot_make_the_daemon_hold_gigabytes(make_pool):
    """64 reads of 32 MiB in flight on one connection (2 GiB of replies)
    once raised the daemon's peak RSS by 2 GB: a batch did not count read
    replies against its byte bound and waiting replies had none. The peak
    now stays within the documented per-connection bound."""
    python = nbd_python()
    pool = make_pool()
    pool.create().start()
    pool.create_volume("v", size="1G")
    pid = pool.proc.pid
    before = vm_kib(pid, "VmHWM")
    r = run([python, "-c", GREEDY_CLIENT, pool.uri("v")], timeout=120)
    assert r.stdout.strip() == "done"
    grown_mib = (vm_kib(pid, "VmHWM") - before) // 1024
    assert grown_mib <= CONNECTION_BOUND_MIB, (
        f"the daemon's peak RSS grew by {grown_mib} MiB for one client "
        f"(bound {CONNECTION_BOUND_MIB} MiB)")


def test_past_max_connections_a_client_is_told_the_server_is_full(make_pool):
    """`serve --max-connections 4`: a fifth client gets the reason, not a
    hang or a bare hang-up, and is served once one of the four leaves."""
    require_tools("qemu-io")
    python = nbd_python()
    pool = make_pool(serve_args=["--max-connections", "4"])
    pool.create().start()
    pool.create_volume("v", size="16M")
    uri = pool.uri("v")
    holder = subprocess.Popen([python, str(HELPERS / "hold_connections.py"), uri, "4"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        line = holder.stdout.readline()
        assert line.strip() == "held 4", line + pool.log_tail()
        started = time.monotonic()
        r = run(["qemu-io", "-f", "raw", "-c", "read 0 4k", uri], check=False, timeout=30)
        assert r.returncode != 0, r.stdout
        assert "too many connections" in r.stderr and "at most 4" in r.stderr, r.stderr
        # The admin learns it from the daemon's log too, once, not per client: at
        # most once per FULL_WARN_EVERY (10 s) however slowly the clients came.
        for _ in range(3):
            run(["qemu-io", "-f", "raw", "-c", "read 0 4k", uri], check=False, timeout=30)
        elapsed = time.monotonic() - started
        log = pool.log_path.read_text()
        warned = log.count("too many NBD connections: refused")
        assert 1 <= warned <= 1 + int(elapsed // FULL_WARN_EVERY_S), (
            f"{warned} warnings for 4 refused clients in {elapsed:.1f}s\n{pool.log_tail()}")
    finally:
        out, _ = holder.communicate(input="", timeout=HOLD_TIMEOUT_S)
    assert holder.returncode == 0, out
    # The server counts the four out as their threads finish: allow it a moment.
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    while True:
        r = run(["qemu-io", "-f", "raw", "-c", "read 0 4k", uri], check=False, timeout=30)
        if r.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.returncode == 0, f"still refused after the four left: {r.stderr}"
