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

import subprocess
import sys
import threading

import pytest

from conftest import HELPERS, nbd_python, qemu_io_ok, require_tools, run

CONNECTIONS = 300
HOLD_TIMEOUT_S = 120


def test_hundreds_of_idle_connections_leave_the_daemon_responsive(make_pool):
    require_tools("qemu-io", "nbdinfo")
    python = nbd_python()
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
