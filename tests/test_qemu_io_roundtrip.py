"""qemu-io writes patterns at aligned and unaligned offsets into an encrypted
volume and reads them back verified: at once, after a clean restart and key
load, and after kill -9 when the writes were followed by a flush."""

from conftest import MiB, assert_qemu_io_ok, qemu_io, qemu_io_ok, require_tools

SIZE = 64 * MiB
END_OFF = SIZE - 4219  # a write that ends exactly at the end of the volume

WRITES = [
    "write -P 0x11 0 64k",
    "write -P 0x22 4097 3000",          # unaligned, inside the first write
    "write -P 0x33 1048575 70000",      # unaligned both ends, crosses 1 MiB
    f"write -P 0x44 {END_OFF} 4219",    # up to the last byte
]

# What every byte of the volume must read as afterwards (gaps read as zeros).
READS = [
    "read -P 0x11 0 4097",
    "read -P 0x22 4097 3000",
    "read -P 0x11 7097 58439",
    "read -P 0x00 65536 983039",
    "read -P 0x33 1048575 70000",
    f"read -P 0x00 1118575 {END_OFF - 1118575}",
    f"read -P 0x44 {END_OFF} 4219",
]

# Written after the first restart, flushed, then the daemon is killed.
LATE_WRITES = [
    "write -P 0x55 8388608 1048576",    # 8 MiB, aligned
    "write -P 0x66 20000001 123457",    # unaligned
    "flush",
]
LATE_READS = [
    "read -P 0x00 1118575 7270033",
    "read -P 0x55 8388608 1048576",
    "read -P 0x00 9437184 10562817",
    "read -P 0x66 20000001 123457",
    f"read -P 0x00 20123458 {END_OFF - 20123458}",
]


def verify(uri, reads, when):
    qemu_io_ok(uri, *reads, what=f"reading back {when}")


def test_qemu_io_roundtrip(pool):
    require_tools("qemu-io")
    key = pool.create_volume("vm1", size="64M")
    uri = pool.uri("vm1")

    qemu_io_ok(uri, *WRITES, what="writing")
    verify(uri, READS, "at once")

    # The verification can fail: a wrong pattern is reported both ways.
    bad = qemu_io(uri, "read -P 0x99 0 4k")
    assert bad.returncode != 0 and "Pattern verification failed" in bad.stdout + bad.stderr, \
        f"qemu-io did not report a wrong pattern: exit {bad.returncode}\n{bad.stdout}{bad.stderr}"

    # Clean restart: the volume comes back locked until its key is loaded.
    pool.restart()
    assert pool.volume_status("vm1")["locked"] is True
    pool.load_key("vm1", key)
    verify(uri, READS, "after SIGTERM, restart and key load")

    # Flushed writes survive kill -9.
    qemu_io_ok(uri, *LATE_WRITES, what="writing before kill -9")
    pool.kill()
    pool.start()
    pool.load_key("vm1", key)
    verify(uri, READS[:5] + LATE_READS + READS[6:], "after kill -9, restart and key load")
