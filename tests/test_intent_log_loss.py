"""Intent log loss is never silent (issue 41 part 1).

Between a crash and the restart, someone who can write the device files (or the log
device) but holds nothing of the host alters the intent log, as docs/format.md draws it
(tests/helpers/bwforge.py): a chain block zeroed, the record an entry names zeroed, a
block of an earlier run's chain put back in its place, the same three on a log device,
the log's last block zeroed. Before, the replay stopped there and every later acknowledged
flush read its older data with no error (an INFO line, or a "flush that never
finished"). Now `serve` refuses, naming the volume and the flushes lost and the flag
that takes the pool anyway; with `--accept-log-loss` it serves, `status` shows the loss
and the audit log records it.
"""

import json
import sys

import pytest

from conftest import HELPERS, qemu_io_ok, require_tools, stderr_lines, wait_until

sys.path.insert(0, str(HELPERS))
import bwforge  # noqa: E402

FLUSHES = [(0, 0x10), (1, 0x11), (2, 0x12)]  # (block, pattern): one flush each


def crashed_with_three_flushes(make_pool, log_device=None):
    """A pool killed after three flushes that only the intent log holds, once the host
    has recorded how far its log reached."""
    require_tools("qemu-io")
    p = make_pool(layout="single", devices=1, device_size="64M")
    extra = ["--devices", "1", "--device-size", "64M"]
    if log_device:
        extra += ["--log-device", str(log_device)]
    p.create(*extra).start()
    p.create_volume("v", size="16M", encryption=False)
    flush_three_and_kill(p, want_blocks=3 if not log_device else 1)
    return p


def flush_three_and_kill(p, want_blocks):
    """Three flushes, then a kill once the host has recorded that its log reached
    `want_blocks` blocks of this generation's chain."""
    for blk, pat in FLUSHES:
        qemu_io_ok(p.uri("v"), f"write -P {pat:#x} {blk * 4}k 4k", "flush")
    gen = p.status()["generation"]
    reach = wait_until(lambda: bwforge.read_log_reach(p.dir),
                       lambda r: r is not None and r["generation"] == gen
                       and r["blocks"] >= want_blocks)
    assert reach and reach["generation"] == gen, f"the host never recorded the log's reach: {reach}"
    p.kill()


def image(p):
    return bwforge.Image(p.device_paths(), (p.dir / "pool.key").read_bytes())


def refused_then_taken(p, first_lost: int, named: str = "volume(s) v"):
    r = p.bulwark("serve", p.dir, check=False, timeout=60)
    assert r.returncode != 0, f"a log that lost acknowledged flushes was served:\n{r.stderr}"
    line = " ".join(stderr_lines(r))
    assert "--accept-log-loss" in line and named in line and "lost" in line, line
    p.serve_args = ["--accept-log-loss"]
    p.start()
    st = p.status()
    assert named in (st.get("lost_flushes") or ""), st.get("lost_flushes")
    assert "intent log:" in p.cli("status").stdout
    for blk, pat in FLUSHES[:first_lost]:
        qemu_io_ok(p.uri("v"), f"read -P {pat:#x} {blk * 4}k 4k")
    audit = [json.loads(l) for l in (p.dir / "audit.log").read_text().splitlines()]
    assert [a for a in audit if a["event"] == "pool.accept_log_loss"], audit
    p.stop()


def test_a_zeroed_block_in_a_chain_that_goes_on(make_pool):
    p = crashed_with_three_flushes(make_pool)
    img = image(p)
    log = bwforge.read_log(img)
    assert len(log) == 3, [b.sequence for b in log]
    img.write_at(log[1].addrs[0], b"\0" * 4096)
    if log[1].addrs[1] != bwforge.NONE:
        img.write_at(log[1].addrs[1], b"\0" * 4096)
    refused_then_taken(p, 1)


def test_a_corrupted_named_record_is_lost_not_unfinished(make_pool):
    p = crashed_with_three_flushes(make_pool)
    img = image(p)
    log = bwforge.read_log(img)
    (_, _, ptr), = log[1].entries()
    img.write_at(ptr.addr1, b"\xee" * 4096)
    r = p.bulwark("serve", p.dir, check=False, timeout=60)
    line = " ".join(stderr_lines(r))
    assert r.returncode != 0 and "never finished" not in line, line
    refused_then_taken(p, 1)


def test_a_block_of_an_earlier_run_put_back(make_pool):
    p = crashed_with_three_flushes(make_pool)
    earlier = bytes(bwforge.read_log(image(p))[1].raw)
    # The next run replays and commits (a new chain), then flushes three times again.
    p.start()
    flush_three_and_kill(p, want_blocks=3)
    img = image(p)
    log = bwforge.read_log(img)
    assert len(log) == 3
    for a in log[1].addrs:
        if a != bwforge.NONE:
            img.write_at(a, earlier)
    refused_then_taken(p, 1)


def a_pool_with_a_log_device(make_pool, tmp_path):
    logdev = tmp_path / "log.img"
    with open(logdev, "wb") as f:
        f.truncate(16 << 20)
    p = crashed_with_three_flushes(make_pool, log_device=logdev)
    return p, logdev


def logdev_chain(p, logdev):
    sb = bwforge.newest_slot(p.device_paths()[0], (p.dir / "pool.key").read_bytes())
    return bwforge.read_logdev_chain(logdev, sb)


def test_a_zeroed_block_on_a_log_device(make_pool, tmp_path):
    p, logdev = a_pool_with_a_log_device(make_pool, tmp_path)
    chain = logdev_chain(p, logdev)
    assert len(chain) >= 3, chain
    bwforge.write_logdev_slot(logdev, chain[1][0], b"\0" * 4096)
    refused_then_taken(p, 1)


def test_a_corrupted_named_record_on_a_log_device(make_pool, tmp_path):
    """The record the middle flush's entry names, damaged in both places it lies: on the
    main devices and in the copy the log device carries after its block (a small flush's
    record rides in the log, so that only the log device is synced). Lost, and said so,
    not taken for a flush that never finished."""
    p, logdev = a_pool_with_a_log_device(make_pool, tmp_path)
    chain = logdev_chain(p, logdev)
    assert len(chain) >= 3, chain
    (slot, raw), (next_slot, _) = chain[1], chain[2]
    # The block's record copy lies in the slots between it and the next block.
    assert next_slot > slot + 1, f"the log device carries no record copy after block 1: {chain}"
    bwforge.write_logdev_slot(logdev, slot + 1, b"\xee" * 4096)
    (_, _, ptr), = bwforge.LogBlock(bytearray(raw), (bwforge.NONE, bwforge.NONE)).entries()
    image(p).write_at(ptr.addr1, b"\xee" * 4096)
    r = p.bulwark("serve", p.dir, check=False, timeout=60)
    line = " ".join(stderr_lines(r))
    assert r.returncode != 0 and "never finished" not in line, line
    refused_then_taken(p, 1)


def test_a_block_of_an_earlier_run_put_back_on_a_log_device(make_pool, tmp_path):
    """The log device's middle block replaced by the block an earlier run wrote in the
    same slot of its own chain: well formed and checksummed, but of another generation
    and chain, so the replay stops there while later blocks verify: a loss."""
    p, logdev = a_pool_with_a_log_device(make_pool, tmp_path)
    earlier = logdev_chain(p, logdev)
    assert len(earlier) >= 3, earlier
    p.start()
    flush_three_and_kill(p, want_blocks=1)
    chain = logdev_chain(p, logdev)
    assert len(chain) >= 3, chain
    old = dict(earlier)
    # An earlier block put where this run's middle block lies (the one from the same
    # slot when the ring put one there, else the earlier middle block).
    put_back = old.get(chain[1][0], earlier[1][1])
    assert put_back != chain[1][1]
    bwforge.write_logdev_slot(logdev, chain[1][0], put_back)
    refused_then_taken(p, 1)


def test_the_last_block_zeroed_is_seen_by_the_hosts_record(make_pool):
    p = crashed_with_three_flushes(make_pool)
    img = image(p)
    log = bwforge.read_log(img)
    for a in log[2].addrs:
        if a != bwforge.NONE:
            img.write_at(a, b"\0" * 4096)
    r = p.bulwark("serve", p.dir, check=False, timeout=60)
    line = " ".join(stderr_lines(r))
    assert r.returncode != 0 and "reached 3" in line, line
    # The only block that named the volume is gone: the message says it cannot name it.
    refused_then_taken(p, 2, named="volumes not known")
