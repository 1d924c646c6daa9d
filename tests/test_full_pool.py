"""A full pool: a thin volume larger than the pool gets ENOSPC for the data that
does not fit — promptly, without wedging the daemon — and nothing acknowledged
before is lost; destroying a volume gives its space back."""

from conftest import MiB, qemu_io, qemu_io_ok


def test_full_pool_says_enospc_and_keeps_data(make_pool):
    pool = make_pool(layout="single", devices=1, device_size="32M")
    pool.create().start()
    pool.create_volume("big", size="64M", encryption=False, compression="off")
    uri = pool.uri("big")
    qemu_io_ok(uri, "write -P 0x61 0 8M", "flush", what="first 8 MiB")

    r = qemu_io(uri, f"write -P 0x62 {8 * MiB} {48 * MiB}", timeout=120)
    text = r.stdout + r.stderr
    assert "No space left on device" in text, f"expected ENOSPC, got: {text}"

    # The daemon still answers, the flushed data is intact, the pool is healthy.
    qemu_io_ok(uri, "read -P 0x61 0 8M", what="data written before the pool filled")
    st = pool.status()
    assert st["state"] == "ONLINE", st
    assert st["space"]["free_bytes"] < 16 * MiB, st["space"]

    # Space comes back when a volume goes.
    pool.wait_detached("big")
    pool.cli("volume", "destroy", "big")
    pool.create_volume("small", size="16M", encryption=False, compression="off")
    qemu_io_ok(pool.uri("small"), "write -P 0x63 0 16M", "flush", "read -P 0x63 0 16M", what="after destroy")
