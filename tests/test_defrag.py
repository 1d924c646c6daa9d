"""Issue 40 step 3: the idle defragmenter, through the daemon and real clients.

A volume written at random (every 4 KiB block once, in fio's random order) has its
blocks scattered over the log. Left alone, the daemon rewrites them in block order
(`pool/defrag.rs`): what a storage admin checks is that `status` says it did so (a pass
ended, bytes moved), that every block still reads what fio wrote (fio's own
verification: a checksum and the block's offset in each block, so a block moved to the
wrong place fails too), and that this holds after `kill -9` and a restart. Whether the
sequential read got faster is a benchmark (`bench/fragmentation.sh`, BENCHMARKS.md).
"""

import pytest

from conftest import LONG_TEST_TIMEOUT_S, MiB, require_tools, run_fio, wait_until

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)

SIZE = 64 * MiB


def fio_random(pool, tmp_path, tag, verify_only):
    """Every 4 KiB block of the volume once, in the order seed 40 draws, with fio's
    verification headers; `verify_only` reads them back and checks each."""
    out = tmp_path / f"fio-{tag}.json"
    cmd = ["fio", "--name=scatter", "--ioengine=nbd", f"--uri={pool.uri('v')}",
           "--rw=randwrite", "--bs=4k", "--iodepth=16", f"--size={SIZE}",
           "--randseed=40", "--verify=crc32c", "--verify_fatal=1",
           "--output-format=json", f"--output={out}"]
    if verify_only:
        cmd.append("--verify_only")
    else:
        cmd += ["--do_verify=0", "--fsync=64"]
    r, rep = run_fio(cmd, out)
    job = rep["jobs"][0]
    assert job["error"] == 0, job
    return job


def test_idle_daemon_defragments_a_randomly_written_volume_and_loses_nothing(pool, tmp_path):
    require_tools("fio")
    key = pool.create_volume("v", size=f"{SIZE // MiB}M", compression="off")
    fio_random(pool, tmp_path, "write", verify_only=False)
    # Left alone (the quiet time is 5 s), the daemon defragments: one pass over every
    # volume, then nothing until clients write again.
    space = wait_until(lambda: pool.status()["space"],
                       lambda s: s.get("defrag_passes", 0) >= 1, timeout=300, interval=0.5)
    assert space.get("defrag_passes", 0) >= 1, f"no defragmenting pass in 300 s: {space}"
    moved = space["defrag_moved_bytes"]
    # Blocks written in random order lie in a run each: the pass moves nearly all of them.
    assert moved >= SIZE // 2, f"a pass moved only {moved} bytes of {SIZE}: {space}"
    assert space["clean_written_bytes"] >= moved, space
    st = pool.status()
    assert st["state"] == "ONLINE" and not st["errors"], st
    text = pool.cli("status").stdout
    assert "defragmented: " in text and "rewritten in block order while idle" in text, text
    # Every block reads what fio wrote there.
    fio_random(pool, tmp_path, "verify", verify_only=True)
    # And after a crash: what the pass moved was committed, or its old copy still holds.
    pool.kill()
    pool.start()
    pool.load_key("v", key)
    fio_random(pool, tmp_path, "verify-after-kill", verify_only=True)
    st = pool.status()
    assert st["state"] == "ONLINE" and not st["errors"], st
