"""A pool 75% and 90% full under sustained random overwrite never faults.

Issue 18's reproducer, made short: a volume sized to 75% or 90% of the pool's
usable space (`status --json` space.usable_bytes), encrypted, is filled with
incompressible data by fio and overwritten at random again (4 KiB and 64 KiB
blocks, two passes over the whole volume: the second pass runs only as fast
as the cleaner frees space), with crc32c verification of every block. No I/O
error, the pool stays ONLINE with no data errors, and after `kill -9` and a
restart every block verifies again. Before the fix the daemon logged
"commit failed, pool poisoned: the pool is out of space" within a second and
every later write got EIO, for single, mirror:2 and parity:2+1 alike.
"""

import os

import pytest

from conftest import LONG_TEST_TIMEOUT_S, MiB, run_fio, require_tools, run

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)

LAYOUTS = {
    # id: (layout, devices, device size, serve arguments)
    # The daemon's default: writes fill holes when free segments run short (decision
    # 0014; the default since 2026-12-05, after three whole-suite runs with them on and 20
    # of 20 runs of every 90% case pinned to one CPU), holes first (the default since
    # 2026-12-05 13:00 UTC: segments a quarter live take data, the cleaner starts late).
    "single": ("single", 1, "160M", ()),
    "mirror:2": ("mirror:2", 2, "160M", ()),
    "parity:2+1": ("parity:2+1", 3, "96M", ()),
    # The cleaner alone (`serve --no-fill-holes`). At 90% of usable space its victims are
    # about 92% live (measured on single), so a pass moves 4-14 MB to gain about nothing: on a loaded machine
    # eight passes in a row summed to -12 KB and writes were refused ("cleaning is stuck",
    # 1 run in 3 beside a simulator run). That is the bound holes lift, not a fault:
    # BULWARK_TEST_NO_HOLES_AT_90=1 runs those cases.
    "single-no-holes": ("single", 1, "160M", ("--no-fill-holes",)),
    "mirror:2-no-holes": ("mirror:2", 2, "160M", ("--no-fill-holes",)),
    "parity:2+1-no-holes": ("parity:2+1", 3, "96M", ("--no-fill-holes",)),
    # The rule before holes first (`serve --no-holes-first`): holes only in segments 3/4
    # live, the cleaner from the usual free-space mark.
    "single-no-holes-first": ("single", 1, "160M", ("--no-holes-first",)),
    "mirror:2-no-holes-first": ("mirror:2", 2, "160M", ("--no-holes-first",)),
    "parity:2+1-no-holes-first": ("parity:2+1", 3, "96M", ("--no-holes-first",)),
}


def fio(uri, out, bs, size, *extra, check=True):
    cmd = ["fio", "--name=overwrite", "--ioengine=nbd", f"--uri={uri}",
           "--rw=randwrite", f"--bs={bs}", "--iodepth=16", f"--size={size}",
           "--loops=2", "--randseed=1818", "--refill_buffers", "--end_fsync=1",
           "--verify=crc32c", "--verify_fatal=1", "--do_verify=1", "--verify_state_save=0",
           "--output-format=json", f"--output={out}", *extra]
    return run_fio(cmd, out, check=check, timeout=600)


def assert_healthy(pool, what):
    st = pool.status()
    assert st["state"] == "ONLINE", f"{what}: pool is {st['state']}\n{pool.log_tail()}"
    assert not st["errors"], f"{what}: data errors {st['errors']}"
    assert "poisoned" not in pool.log_tail(), f"{what}:\n{pool.log_tail()}"
    return st


@pytest.mark.parametrize("fill", [0.75, 0.90])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_random_overwrite_at_fill_never_faults(make_pool, tmp_path, layout, fill):
    require_tools("fio", "nbdcopy")
    if (layout.endswith("-no-holes") and fill > 0.8
            and os.environ.get("BULWARK_TEST_NO_HOLES_AT_90") != "1"):
        pytest.skip("the cleaner alone at 90% of usable runs at its bound (see LAYOUTS): "
                    "BULWARK_TEST_NO_HOLES_AT_90=1 runs this")
    layout, devices, device_size, serve_args = LAYOUTS[layout]
    pool = make_pool(layout=layout, devices=devices, device_size=device_size,
                     serve_args=serve_args)
    pool.create().start()
    usable = pool.status()["space"]["usable_bytes"]
    assert usable > 0, pool.status()["space"]
    # Whole MiB, so both block sizes divide it.
    size = int(usable * fill) // MiB * MiB
    key = pool.create_volume("v", size=f"{size // MiB}M", compression="off")
    uri = pool.uri("v")

    for bs in ("64k", "4k"):
        # Overwrites of data that exists never fail for space while the live data fits.
        r, rep = fio(uri, tmp_path / f"write-{bs}.json", bs, size)
        job = rep["jobs"][0]
        assert job["error"] == 0, job
        assert job["write"]["io_bytes"] == 2 * size, job["write"]
        assert job["read"]["io_bytes"] >= size, \
            f"verification did not read everything: {job['read']}"
        st = assert_healthy(pool, f"after {bs} overwrite at {fill:.0%}")
        space = st["space"]
        assert space["used_bytes"] <= space["total_bytes"], space
        assert space["write_amplification"] >= 1.0, space

    # Acknowledged (flushed) data survives a crash: every block reads (nbdcopy stops at
    # the first EIO) and verifies block by block.
    pool.kill()
    pool.start()
    pool.load_key("v", key)
    run(["nbdcopy", uri, "null:"], timeout=300)
    _, rep = fio(uri, tmp_path / "verify.json", "4k", size, "--verify_only")
    assert rep["jobs"][0]["error"] == 0, rep["jobs"][0]
    assert_healthy(pool, "after kill -9 and restart")


DURABLE_CASES = {
    # id: (layout, devices, device size, serve arguments)
    "single": ("single", 1, "320M", ()),
    "single-no-holes": ("single", 1, "320M", ("--no-fill-holes",)),
    "single-no-holes-first": ("single", 1, "320M", ("--no-holes-first",)),
    # Found 2026-12-05 (holes first, then `--holes-first`): every segment a quarter live
    # was filled to the brim, and the cleaner, once it started, found only segments about
    # as live as the pool; on a 640M device the overwrite was refused after 930 MiB
    # ("cleaning is stuck", 88% of usable used; 1 run in 4 here). Near the cleaner's start
    # half-live segments are left to decay into victims now (`Log::hole_live_min`).
    "single-640M": ("single", 1, "640M", ()),
    "mirror2": ("mirror:2", 2, "320M", ()),
    "parity2+1": ("parity:2+1", 3, "160M", ()),
}


@pytest.mark.parametrize("case", list(DURABLE_CASES))
def test_durable_random_overwrite_at_84_percent_is_never_refused(make_pool, tmp_path, case):
    """A guest's random 4 KiB writes with a FLUSH every 64, three times the volume over,
    at 84% of the usable space: nothing may be refused while the live data fits, and what
    was flushed survives kill -9.

    Found 2026-12-04 (issue 36): fio got ENOSPC after 100-300 MiB in 3 runs of 4 with
    holes off and in every run with `serve --fill-holes`, "cleaning is stuck" at 16-22
    free segments. Near full, every FLUSH was a commit (and a cleaning pass committed for
    each FLUSH that waited on it): each commit rewrote a map leaf for nearly every 4 KiB
    block written or moved since the last, 1-1.7 bytes of map nodes per byte the cleaner
    moved, so passes gained nothing. Now a FLUSH goes to the intent log unless a commit
    would free at least the segments it writes (`Core::flush_by_log`). Passed on mirror:2
    and parity:2+1 too, which run here as well."""
    require_tools("fio", "nbdcopy")
    layout, devices, device_size, serve_args = DURABLE_CASES[case]
    pool = make_pool(layout=layout, devices=devices, device_size=device_size,
                     serve_args=serve_args)
    pool.create().start()
    usable = pool.status()["space"]["usable_bytes"]
    size = int(usable * 0.84) // MiB * MiB
    key = pool.create_volume("v", size=f"{size // MiB}M", compression="off")
    uri = pool.uri("v")
    run(["fio", "--name=fill", "--ioengine=nbd", f"--uri={uri}", "--rw=write", "--bs=1M",
         "--iodepth=8", "--refill_buffers", "--end_fsync=1"], timeout=300)
    # A daemon restarted after the guest's install, as hosts are: what the import
    # found written is not recycled or filled (`reuse_floor`), only what is written since.
    pool.restart()
    pool.load_key("v", key)
    out = tmp_path / "overwrite.json"
    r, rep = run_fio(["fio", "--name=overwrite", "--ioengine=nbd", f"--uri={uri}",
                      "--rw=randwrite", "--bs=4k", "--iodepth=16", f"--io_size={3 * size}",
                      "--refill_buffers", "--fsync=64", "--randseed=84",
                      "--output-format=json", f"--output={out}"], out, check=False, timeout=600)
    job = rep["jobs"][0] if rep else None
    space = pool.status()["space"]
    assert r.returncode == 0 and job and job["error"] == 0, \
        f"fio failed (exit {r.returncode}, error {job and job['error']}): " \
        f"{space}\n{r.stderr[-2000:]}"
    assert job["write"]["io_bytes"] == 3 * size, job["write"]
    assert space["refused_writes"] == 0, space
    print(f"84% durable random 4K overwrite: write amplification "
          f"{space['write_amplification']:.2f} (data {space['data_written_bytes'] >> 20} MiB, "
          f"moved {space['clean_written_bytes'] >> 20} MiB, "
          f"map {space['meta_written_bytes'] >> 20} MiB)")
    assert_healthy(pool, "after durable random overwrite at 84%")
    # What was flushed survives a crash: every block reads back (a checksum that does not
    # match is EIO, which stops nbdcopy).
    pool.kill()
    pool.start()
    pool.load_key("v", key)
    run(["nbdcopy", uri, "null:"], timeout=300)
    assert_healthy(pool, "after kill -9 and restart")
