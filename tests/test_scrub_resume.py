"""kill -9 in the middle of a scrub, and in the middle of a resilver: the
restarted daemon resumes each where its saved cursor left it (same scan, same
start time, progress not back to zero, not scanned twice) and finishes it;
nothing written is lost, and the resilver leaves nothing for a scrub to fix.

The scans are slowed with `serve --scrub-rate 1M` on a thin volume with 512
KiB of data in every 16 MiB, so there is time to kill the daemon mid-scan. A
flush through NBD makes the scan's progress durable before the kill (the
cursor is saved with every commit; the daemon runs with --no-intent-log, so a
flush is a commit, not an intent log write, which saves client writes only);
its connection is opened beforehand, so
only the flush stands between seeing progress and the kill. Should a scan
still end before the kill lands (a very slow machine: the restarted daemon
then shows that very scan finished, durably), another scan is started and
killed, up to ATTEMPTS times.
"""

import random
import time

import pytest

from conftest import LONG_TEST_TIMEOUT_S, MiB, KiB
from healing import LAYOUTS, NbdShell, assert_clean_scrub, heal_pool, scrub_status

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)  # waits of up to 300 s each

REGIONS = 8
REGION = 16 * MiB
RUN = 512 * KiB
POLL_S = 0.05
DEADLINE_S = 180
ATTEMPTS = 3


def wait_scan(pool, kind, done_at_least=None):
    """Poll until the `kind` scan has done `done_at_least` bytes (still running), or until it
    stops (done_at_least None). Returns its status; with done_at_least, None if the scan
    stopped first."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        s = scrub_status(pool)
        assert s["kind"] == kind, s
        if done_at_least is None and s["state"] != "scanning":
            return s
        if done_at_least is not None:
            if s["state"] != "scanning":
                return None
            if s["bytes_done"] >= done_at_least:
                return s
        time.sleep(POLL_S)
    pytest.fail(f"the {kind} made no progress in {DEADLINE_S}s: {scrub_status(pool)}")


def write_runs(pool, rng, model, at):
    with NbdShell(pool.uri("big")) as nbd:
        for r in range(REGIONS):
            data = rng.randbytes(RUN)
            nbd.write(r * REGION + at, data)
            model[r * REGION + at] = data
        nbd.flush()


def check_runs(pool, model):
    with NbdShell(pool.uri("big")) as nbd:
        for off, data in sorted(model.items()):
            assert nbd.read(off, len(data)) == data, f"bytes at {off} differ from what was written"


def kill_and_restart_mid_scan(pool, key, kind, start_scan):
    """start_scan() starts a `kind` scan; kill the daemon in its middle and restart it.
    Returns the scan's status when it was killed."""
    for attempt in range(1, ATTEMPTS + 1):
        start_scan()
        with NbdShell(pool.uri("big")) as nbd:
            s = wait_scan(pool, kind, done_at_least=2 * RUN)
            if s is None:
                continue  # it ended before it could be interrupted
            nbd.flush()
            pool.kill()
        pool.start()
        log = pool.log_path.read_text()
        after = scrub_status(pool)
        if ("resuming the scrub" not in log and after["state"] == "finished"
                and after["started_unix"] == s["started_unix"]):
            pool.load_key("big", key)
            continue  # it ended, and said so durably, before the kill landed
        break
    else:
        pytest.fail(f"the {kind} ended before it could be interrupted, {ATTEMPTS} times "
                    f"(is --scrub-rate honoured?): {scrub_status(pool)}")
    print(f"{kind} interrupted at attempt {attempt}")
    assert "resuming the scrub" in log, log
    assert after["kind"] == kind and after["started_unix"] == s["started_unix"], (
        f"not the same {kind} after the restart: before {s}, after {after}")
    assert after["bytes_done"] >= s["bytes_done"], (
        f"the {kind} went back from {s['bytes_done']} to {after['bytes_done']} bytes done")
    pool.load_key("big", key)
    return s


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scrub_resume(make_pool, seed, layout):
    rng = random.Random(seed)
    pool = heal_pool(make_pool, layout, "64M", "--scrub-rate", "1M", "--no-intent-log")
    key = pool.create_volume("big", size=f"{REGIONS * REGION // MiB}M")
    model = {}
    write_runs(pool, rng, model, 0)

    # A scrub, killed mid-way.
    before = kill_and_restart_mid_scan(pool, key, "scrub", lambda: pool.cli("scrub"))
    s = wait_scan(pool, "scrub")
    assert s["state"] == "finished" and (s["repaired"], s["unrecoverable"]) == (0, 0), s
    assert s["bytes_done"] < s["bytes_total"] + before["bytes_done"], (
        f"the scrub scanned from the beginning again after the restart: {s}, killed at {before}")
    check_runs(pool, model)

    # A resilver of a device that missed writes, killed mid-way.
    victim = rng.choice(pool.device_paths())

    def resilver():
        pool.cli("device", "offline", victim)
        write_runs(pool, rng, model, RUN)
        pool.cli("device", "online", victim)

    before = kill_and_restart_mid_scan(pool, key, "resilver", resilver)
    s = wait_scan(pool, "resilver")
    assert s["state"] == "finished" and s["unrecoverable"] == 0, s
    assert s["bytes_done"] < s["bytes_total"] + before["bytes_done"], (
        f"the resilver scanned from the beginning again after the restart: {s}, killed at {before}")
    check_runs(pool, model)
    assert_clean_scrub(pool, "scrub after the resumed resilver")
    # Copies a resilver rebuilds were expected to be stale: they are not checksum errors of
    # the device, before or after a restart.
    st = pool.status()
    assert st["state"] == "ONLINE", (
        f"after the resumed resilver of {victim}: (path, state, READ, CKSUM) = "
        f"{[(d['path'], d['state'], d['read_errors'], d['cksum_errors']) for d in st['devices']]}")
