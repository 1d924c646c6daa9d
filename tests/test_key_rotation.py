"""Key rotation survives a crash: with 384 MiB of data written, `key rotate`
returns at once (new writes use generation 1), more data is written under the
new key, and the daemon is killed with SIGKILL while the old blocks are being
re-encrypted. After the restart the volume shows the rotation, paused until its
key is loaded; `key load` resumes it, it finishes (`rotation` null,
`key_generation` 1), and every block, old and new, reads back as written,
again after another restart."""

import json
import time

import pytest

from conftest import LONG_TEST_TIMEOUT_S, MiB, qemu_io_ok, require_tools
from keyutil import assert_no_secret_in_audit, audited

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)  # waits of up to 300 s each

OLD = 384 * MiB          # written before the rotation: enough to re-encrypt for seconds
ROTATION_TIMEOUT_S = 300


def verify(pool):
    qemu_io_ok(pool.uri("r"),
               "read -P 0x33 0 1M",           # overwritten after the rotation started
               f"read -P 0x11 1M {OLD - MiB}",  # written before it
               f"read -P 0 {OLD} {400 * MiB - OLD}",
               "read -P 0x22 400M 8M",        # written after it
               "read -P 0 408M 4M",
               what="old and new data", timeout=300)


def wait_rotation_done(pool):
    deadline = time.monotonic() + ROTATION_TIMEOUT_S
    while True:
        v = pool.volume_status("r")
        if v["rotation"] is None:
            return v
        assert time.monotonic() < deadline, f"rotation did not finish: {v}\n{pool.log_tail()}"
        time.sleep(0.2)


def test_rotation_resumes_after_kill(make_pool):
    require_tools("qemu-io")
    pool = make_pool(device_size="1536M")
    pool.create().start()
    key = pool.create_volume("r", size="412M", compression="off")
    qemu_io_ok(pool.uri("r"), f"write -P 0x11 0 {OLD}", "flush", timeout=300)
    assert pool.volume_status("r")["key_generation"] == 0

    r = pool.cli("key", "rotate", "r")
    assert "generation 1" in r.stdout, r.stdout
    # New writes, under the new key, while the old blocks are re-encrypted.
    qemu_io_ok(pool.uri("r"), "write -P 0x22 400M 8M", "write -P 0x33 0 1M", "flush")
    v = pool.volume_status("r")
    assert v["rotation"] is not None, \
        f"the rotation finished before the kill; write more than {OLD >> 20} MiB first: {v}"
    assert v["key_generation"] == 1
    pool.kill()

    pool.start()
    v = pool.volume_status("r")
    assert v["locked"] is True
    assert v["rotation"] is not None, f"the interrupted rotation is not recorded: {v}"
    assert v["rotation"]["to_generation"] == 1 and v["key_generation"] == 1, v
    status = pool.cli("status").stdout
    assert "rotation: volume r to data key generation 1, paused until its key is loaded" in status, status
    listed = pool.cli("volume", "list").stdout
    assert "rotating" in listed, listed

    pool.load_key("r", key)
    v = wait_rotation_done(pool)
    assert v["key_generation"] == 1 and v["locked"] is False, v
    assert "rotating" not in pool.cli("volume", "list").stdout
    verify(pool)

    pool.restart()
    v = pool.volume_status("r")
    assert v["rotation"] is None and v["key_generation"] == 1, v
    pool.load_key("r", key)
    verify(pool)

    # Another rotation, watched to the end with --wait.
    r = pool.cli("key", "rotate", "r", "--wait", timeout=ROTATION_TIMEOUT_S)
    assert "finished" in r.stdout and "generation 2" in r.stdout, r.stdout
    assert "older data keys are destroyed" in r.stdout, r.stdout
    v = pool.volume_status("r")
    assert v["rotation"] is None and v["key_generation"] == 2, v
    verify(pool)

    # With a snapshot, the old keys stay (the snapshot's blocks are under them), and the
    # end of --wait says so (it said they were destroyed).
    pool.cli("snapshot", "create", "r@keep")
    r = pool.cli("key", "rotate", "r", "--wait", timeout=ROTATION_TIMEOUT_S)
    assert "generation 3" in r.stdout and "old data keys are KEPT: 1 snapshot(s)" in r.stdout, \
        r.stdout
    assert "destroyed" not in r.stdout, r.stdout
    verify(pool)
    pool.cli("snapshot", "destroy", "r@keep")

    assert audited(pool, "key_rotate", volume="r", generation=1)
    assert audited(pool, "key_rotate", volume="r", generation=2)
    assert_no_secret_in_audit(pool, key_files=(key,))
    # The JSON status carries the same fields.
    st = json.loads(pool.cli("status", "--json").stdout)
    assert {"key_generation", "key_slots", "rotation"} <= set(st["volumes"][0])
