"""A thin volume of 1E (2^48 blocks of 4K) beside a small one that is overwritten
until the cleaner runs: the pool keeps answering, and a scrub and a key rotation
finish.

Found by a tester: the cleaner, the scrub and the key rotation each went through a
volume's map in batches of 1024 or 4096 blocks, holes included, so a 1E volume
meant 2^36 batches. The cleaner holds the commit lock through its pass, and every
commit, FLUSH, control command and shutdown waited behind it (the daemon ignored
SIGTERM). Now each steps over hole subtrees (`Tree::next_mapped`). Every command
below would time out before the fix; no wall-clock threshold is asserted.
"""

import random

from conftest import MiB, qemu_io_ok, require_tools, run
from healing import assert_export_equals, scrub_wait, write_file

EXA = 1 << 60


def test_a_1e_thin_volume_does_not_stall_the_pool(make_pool, tmp_path, seed):
    require_tools("nbdcopy", "qemu-io", "fio")
    rng = random.Random(seed)
    # Writes never fill holes (decision 0014): the cleaner alone makes room, so it runs
    # and walks the 1E maps, which is what this test is about.
    pool = make_pool(layout="single", devices=1, device_size="96M",
                     serve_args=("--no-fill-holes",)).create().start()
    pool.create_volume("huge", size="1E", encryption=False)
    pool.create_volume("huge-enc", size="1E")
    pool.create_volume("small", size="48M", encryption=False, compression="off")
    # A record at each end of the 1E volumes: the maps have paths at both ends and
    # holes of every size between.
    for name in ("huge", "huge-enc"):
        qemu_io_ok(pool.uri(name), "write -P 0x11 0 64k", f"write -P 0x22 {EXA - 65536} 64k",
                   "flush")
    # The small volume filled, then overwritten at random, 4 times its size: segments
    # are left partly dead, and the cleaner runs (it moves their live records).
    img = write_file(tmp_path / "small.img", rng.randbytes(48 * MiB))
    run(["nbdcopy", "--flush", img, pool.uri("small")], timeout=300)
    run(["fio", "--name=over", "--ioengine=nbd", f"--uri={pool.uri('small')}",
         "--rw=randwrite", "--bs=16k", "--iodepth=8", "--size=48M", "--io_size=192M",
         "--norandommap", "--randrepeat=0", "--refill_buffers", "--fsync=64"], timeout=600)
    assert pool.status()["space"]["clean_written_bytes"] > 0, "the cleaner did not run"
    run(["nbdcopy", "--flush", img, pool.uri("small")], timeout=300)
    assert_export_equals(pool, "small", img, "after the overwrites")

    # The pool answers commands that take the commit lock.
    pool.create_volume("after", size="16M", encryption=False)
    pool.cli("snapshot", "create", "small@s")
    scrub_wait(pool)
    pool.cli("key", "rotate", "huge-enc", "--wait", timeout=300)
    for name in ("huge", "huge-enc"):
        qemu_io_ok(pool.uri(name), "read -P 0x11 0 64k", f"read -P 0x22 {EXA - 65536} 64k",
                   f"read -P 0 {EXA // 2} 64k")
    assert pool.status()["state"] == "ONLINE"
