"""A key rotation on a full pool pauses, says so, and goes on once space is free.

An encrypted volume holds 4 MiB; another volume fills the 32 MiB pool to
ENOSPC. `key rotate --wait` then fails at once (exit 1) with one line saying
the rotation is paused because the pool is out of space, and that it stays
recorded; `status` shows "paused: the pool is out of space" and `status
--json` the reason. `key rotate` on the paused rotation resumes it (it was
"already running") and, the pool still full, it pauses again. Once the
filler volume is destroyed the rotation goes on by itself and finishes:
generation 1, the old data key gone, every block reads back as written,
after a restart too. (It used to stay "in progress: 0% examined" for good,
and `key rotate --wait` printed nothing and never returned.)"""

import time

import pytest

from conftest import LONG_TEST_TIMEOUT_S, MiB, qemu_io, qemu_io_ok, require_tools, stderr_lines
from keyutil import assert_one_line_error

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)  # waits of up to 300 s

ROTATION_TIMEOUT_S = 300
PAUSE_TIMEOUT_S = 120


def wait_for(pool, what, done, timeout):
    deadline = time.monotonic() + timeout
    while True:
        v = pool.volume_status("e1")
        if done(v):
            return v
        assert time.monotonic() < deadline, f"{what}: {v}\n{pool.log_tail()}"
        time.sleep(0.2)


def paused_for_space(v):
    r = v["rotation"]
    return r is not None and r.get("error") == "the pool is out of space" and r.get("retrying")


def test_rotation_paused_by_a_full_pool_goes_on_when_space_is_freed(make_pool):
    require_tools("qemu-io")
    pool = make_pool(device_size="32M")
    pool.create().start()
    key = pool.create_volume("e1", size="128M", compression="off")
    qemu_io_ok(pool.uri("e1"), "write -P 0x11 0 4M", "flush", what="e1's data")
    pool.create_volume("f1", size="128M", encryption=False, compression="off")
    r = qemu_io(pool.uri("f1"), f"write -P 0x22 0 {48 * MiB}", timeout=120)
    assert "No space left on device" in r.stdout + r.stderr, \
        f"the filler did not fill the pool: {r.stdout}{r.stderr}"

    # --wait reports the pause and fails; the rotation stays recorded.
    r = pool.cli("key", "rotate", "e1", "--wait", check=False)
    assert_one_line_error(r, r"paused at \d+% and stays recorded: the pool is out of space; "
                             r"it goes on by itself once space is free",
                          "key rotate --wait on a full pool")
    v = pool.volume_status("e1")
    assert v["key_generation"] == 1 and v["rotation"]["to_generation"] == 1, v
    assert paused_for_space(v), v
    status = pool.cli("status").stdout
    assert "rotation: volume e1 to data key generation 1, paused: the pool is out of space" \
        in status, status
    assert "rotating" in pool.cli("volume", "list").stdout
    assert "key rotation paused: the pool is out of space" in pool.log_tail()
    # The data is intact while the rotation waits.
    qemu_io_ok(pool.uri("e1"), "read -P 0x11 0 4M", "read -P 0 4M 4M", what="e1 while paused")

    # `key rotate` resumes a paused rotation (no "already running"); still full, it pauses again.
    r = pool.cli("key", "rotate", "e1")
    assert "resumed" in r.stdout and "generation 1" in r.stdout, r.stdout
    wait_for(pool, "the resumed rotation did not pause again on the full pool",
             paused_for_space, PAUSE_TIMEOUT_S)
    assert pool.volume_status("e1")["key_generation"] == 1

    # Space comes back: the rotation goes on by itself and finishes.
    pool.wait_detached("f1")
    pool.cli("volume", "destroy", "f1")
    v = wait_for(pool, "the rotation did not finish once space was freed",
                 lambda v: v["rotation"] is None, ROTATION_TIMEOUT_S)
    assert v["key_generation"] == 1 and v["locked"] is False, v
    assert "key rotation finished" in pool.log_tail()
    assert "rotation:" not in pool.cli("status").stdout
    qemu_io_ok(pool.uri("e1"), "read -P 0x11 0 4M", "read -P 0 4M 4M", what="e1 after rotation")

    # Durable, and readable with only the new data key.
    pool.wait_detached("e1")
    pool.restart()
    v = pool.volume_status("e1")
    assert v["rotation"] is None and v["key_generation"] == 1, v
    pool.load_key("e1", key)
    qemu_io_ok(pool.uri("e1"), "read -P 0x11 0 4M", "read -P 0 4M 4M", what="e1 after restart")
    assert not stderr_lines(pool.cli("status"))
