"""kill -9 at random moments while a client writes and flushes: after each
restart every block is exactly one version that was written, never older than
what the last acknowledged flush (or FUA write) covered, never anything else.

A writer (libnbd) writes generations of self-describing 4 KiB blocks: first
every block (A), flushed, then random subsets (B, C, ...) each ended by a
flush. It reports each generation before issuing it, each FUA write when
acknowledged and each flush when acknowledged. The daemon is killed a random
delay after the writer has started its second generation (B); the volume,
copied out after restart and key load, must match.
Replay a failure with BULWARK_TEST_SEED=<seed printed>.
"""

import json
import random
import subprocess
import sys
import time

import pytest

from conftest import HELPERS, MiB, nbd_python, require_tools, run

sys.path.insert(0, str(HELPERS))
from crashblocks import BLOCK, content, parse  # noqa: E402

VOL = 32 * MiB
NBLOCKS = VOL // BLOCK
GEN_BLOCKS = 1024  # at most, per generation; the writer picks 1..GEN_BLOCKS
ROUNDS = 6


def parse_log(text):
    written, fua, flushed, err = {}, [], [], None
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "W":
            g, _, blocks = rest.partition(" ")
            written[int(g)] = [int(b) for b in blocks.split(",")] if blocks else []
        elif kind == "U":
            g, b = rest.split()
            fua.append((int(g), int(b)))
        elif kind == "F":
            flushed.append(int(rest))
        elif kind == "E":
            err = rest
    return written, fua, flushed, err


def run_writer_and_kill(pool, seed, rnd, init, delay, log_path):
    with open(log_path, "w") as log:
        w = subprocess.Popen([nbd_python(), str(HELPERS / "crash_writer.py"), pool.uri("crash"),
                              str(seed), str(rnd), str(NBLOCKS), str(GEN_BLOCKS)]
                             + (["--init"] if init else []),
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        # The delay starts once the writer is past its first pass (it announces
        # generation 1 after the first flush), however slowly it got there.
        deadline = time.monotonic() + 120
        while True:
            lines = log_path.read_text().splitlines()
            if "F 0" in lines and any(l.startswith("W 1 ") for l in lines):
                break
            if w.poll() is not None:
                pytest.fail(f"writer exited {w.returncode} before its second pass:\n{log_path.read_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"writer did not get its first flush acknowledged and start its second "
                            f"pass:\n{log_path.read_text()}")
            time.sleep(0.02)
        time.sleep(delay)
        assert w.poll() is None, f"writer stopped before the kill:\n{log_path.read_text()[-2000:]}"
        pool.kill()
        w.wait(60)
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()
    return log_path.read_text()


def test_kill_during_flushed_writes(pool, tmp_path, seed):
    require_tools("nbdcopy")
    nbd_python()
    key = pool.create_volume("crash", size="32M", block_size="4K")
    rng = random.Random(seed)
    # observed[b]: the version (round, gen) block b holds, known durable.
    observed = None
    for rnd in range(1, ROUNDS + 1):
        delay = rng.uniform(0.2, 2.0)
        text = run_writer_and_kill(pool, seed, rnd, observed is None, delay, tmp_path / f"writer-{rnd}.log")
        written, fua, flushed, err = parse_log(text)
        assert flushed and flushed[0] == 0, text[:2000]
        last_flush = max(flushed)

        durable = list(observed) if observed is not None else [(rnd, 0)] * NBLOCKS
        for g in sorted(written):
            if g <= last_flush:
                for b in written[g]:
                    durable[b] = (rnd, g)
        for g, b in fua:
            durable[b] = max(durable[b], (rnd, g))
        allowed = [{d} for d in durable]
        for g, blocks in written.items():
            for b in blocks:
                if (rnd, g) > durable[b]:
                    allowed[b].add((rnd, g))

        pool.start()
        pool.load_key("crash", key)
        dump = tmp_path / "dump.img"
        run(["nbdcopy", pool.uri("crash"), dump])
        data = dump.read_bytes()
        assert len(data) == VOL

        bad, newer = [], 0
        observed = [None] * NBLOCKS
        for b in range(NBLOCKS):
            blk = data[b * BLOCK:(b + 1) * BLOCK]
            who = parse(blk)
            if who is None or who[0] != seed or who[3] != b:
                bad.append((b, "not any version written here", blk[:64]))
                continue
            ver = (who[1], who[2])
            if blk != content(seed, ver[0], ver[1], b):
                bad.append((b, f"torn or altered version {ver}", blk[:64]))
            elif ver not in allowed[b]:
                bad.append((b, f"version {ver}, allowed {sorted(allowed[b])} (durable {durable[b]})", b""))
            observed[b] = ver
            newer += ver != durable[b]
        summary = (f"round {rnd}: killed {delay:.2f}s after generation 1 started; last acknowledged flush: "
                   f"generation {last_flush} of {max(written, default=0)} started; {len(fua)} FUA writes "
                   f"acknowledged; {newer} blocks newer than durable; writer: {err}")
        print(summary)
        assert not bad, f"{summary}\n{len(bad)} bad blocks, first: {bad[:10]}"
        assert max(written, default=0) >= 1, f"{summary}: the writer never got past its first pass"


def test_flush_and_fua_advertised(pool):
    require_tools("nbdinfo")
    pool.create_volume("adv", size="16M")
    info = json.loads(run(["nbdinfo", "--json", pool.uri("adv")]).stdout)
    exp = info["exports"][0]
    assert exp["can_flush"] is True, exp
    assert exp["can_fua"] is True, exp
