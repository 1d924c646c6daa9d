"""A WRITE whose payload crawls is dropped once `--payload-timeout` has
passed since it began, instead of holding its connection and its 1 MiB
buffer for as long as the client likes; a client on another connection is
served meanwhile, and a connection that sends nothing at all (idle, as NBD
clients are between requests) is kept. Before the timeout existed, the
crawler kept its connection: it was never closed."""

import select
import time

from conftest import WAIT_TIMEOUT_S, qemu_io_ok, require_tools, wait_until
from rawunix import CMD_READ, CMD_WRITE, attach, header, reply

TIMEOUT_S = 2
MIB = 1 << 20


def test_a_crawling_write_is_dropped(make_pool):
    require_tools("qemu-io")
    pool = make_pool(serve_args=["--payload-timeout", TIMEOUT_S])
    pool.create().start()
    pool.create_volume("v", size="16M", encryption=False)
    qemu_io_ok(pool.uri("v"), "write -P 0x11 0 64k", what="first write")

    idle, _ = attach(pool.nbd_socket, "v")
    crawler, _ = attach(pool.nbd_socket, "v")
    crawler.sendall(header(CMD_WRITE, 1, 0, MIB) + b"\x22" * 100)
    # One byte every half second (the client of the issue sent one every 5 s):
    # each byte arrives well within the timeout, the whole never does.
    started = time.monotonic()
    sent = 100
    dropped = False
    while time.monotonic() - started < WAIT_TIMEOUT_S:
        r, _, _ = select.select([crawler], [], [], 0.5)
        if r:
            try:
                dropped = crawler.recv(16) == b""
            except ConnectionError:
                dropped = True
            assert dropped, "the server answered a write whose payload never came"
            break
        try:
            crawler.sendall(b"\x22")
            sent += 1
        except (BrokenPipeError, ConnectionError):
            dropped = True
            break
        # Another client is served while the crawler crawls.
        if sent == 102:
            qemu_io_ok(pool.uri("v"), "read -P 0x11 0 64k", "write -P 0x33 64k 64k",
                       what="beside the crawler")
    took = time.monotonic() - started
    assert dropped, f"the crawling write still held its connection after {took:.0f}s"
    assert took >= TIMEOUT_S, took
    print(f"crawler dropped after {took:.1f}s and {sent} bytes")
    log = wait_until(lambda: pool.log_path.read_text(),
                     lambda t: "did not arrive within" in t)
    assert f"did not arrive within {TIMEOUT_S}s" in log, pool.log_tail()

    # The idle connection, quiet all this time (longer than the timeout), is served.
    idle.sendall(header(CMD_READ, 7, 0, 4096))
    error, handle, data = reply(idle, 4096)
    assert (error, handle, data) == (0, 7, b"\x11" * 4096)
    idle.close()
    crawler.close()
    qemu_io_ok(pool.uri("v"), "read -P 0x11 0 64k", "read -P 0x33 64k 64k", what="after")
