"""The live run through the daemon (tests/helpers/live_nbd.py): libnbd
connections with several requests in flight each, on an encrypted filled
volume, a 1E thin one and one of 8 KiB blocks written a 4 KiB half at a time,
while the operator's commands run between them (key unload and load, with
the volume read back at once; snapshots read back over NBD; clones; rollbacks;
key rotation; scrub; resize) and, in the crash runs, `kill -9` of the daemon.
Every read is checked against what the clients were told; after a kill, every
cell against what FLUSH and FUA answers made durable.

The runs last BULWARK_LIVE_NBD_SECONDS (15 by default); a long run by hand:
    /usr/bin/python3 tests/helpers/live_nbd.py --bin target/release/bulwark \\
        --dir /tmp/lnbd --layout parity --seconds 600 --seed 9 --kill
"""

import json
import os

import pytest

from conftest import HELPERS, bulwark_bin, nbd_python, run, seed

SECONDS = int(os.environ.get("BULWARK_LIVE_NBD_SECONDS", "15"))


def live(tmp_path, *args, timeout=600):
    r = run([nbd_python(), HELPERS / "live_nbd.py", "--bin", bulwark_bin(),
             "--dir", tmp_path / "live", *map(str, args)], check=False, timeout=timeout)
    try:
        report = json.loads(r.stdout)
    except ValueError:
        report = None
    return r, report


@pytest.mark.parametrize("layout,kill", [("single", False), ("mirror", True), ("parity", True),
                                         ("log", True)])
def test_live_run_through_the_daemon_keeps_every_acknowledged_write(tmp_path, seed, layout, kill):
    args = ["--layout", layout, "--seconds", SECONDS, "--seed", seed]
    if kill:
        args.append("--kill")
    r, report = live(tmp_path, *args)
    assert r.returncode == 0, f"live run failed (exit {r.returncode}):\n{r.stderr[-6000:]}\n" \
                              f"{r.stdout[-6000:]}"
    counts = report["counts"]
    # It did what it says, even on a slow machine: the first key cycle, snapshot
    # and kill are made whatever the seed.
    for what in ("writes", "reads checked", "flushes", "key cycles", "snapshots"):
        assert counts.get(what, 0) > 0, f"the run made no {what}: {counts}"
    if kill:
        assert counts.get("kills", 0) > 0, f"the run killed no daemon: {counts}"
    assert counts["cells verified"] > 0


def test_the_live_run_names_a_lost_write(tmp_path, seed):
    """The checker's negative control: a cell set back to an older value behind its
    back is reported as a lost acknowledged write, and the run fails."""
    r, report = live(tmp_path, "--seconds", 3, "--seed", seed, "--plant-older")
    assert r.returncode == 1, f"exit {r.returncode}:\n{r.stderr[-4000:]}"
    assert any("an OLDER value: an acknowledged write lost" in v
               for v in report["violations"]), report["violations"]
