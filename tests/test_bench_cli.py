"""`bulwark bench` drives fio's nbd engine against a volume: a one-cell
matrix on a fresh volume prints that cell with nonzero IOPS, in the table
and in --json; a volume (or --uri export) holding data is refused without
--force and left untouched; write cells of a volume show write amplification,
of an --uri export n/a; --fsync N flushes in write cells. No timing
thresholds: only that numbers exist. bench/peers.sh, copied alone, stops
at once naming the report script it needs."""

import json
import os
import pathlib
import shutil
import signal
import subprocess

from conftest import BULWARK_BIN, qemu_io_ok, require_tools

# One cell, one second: 4 KiB random reads at queue depth 4.
CELL = ["--block-sizes", "4k", "--patterns", "randread", "--iodepths", "4", "--runtime", "1"]
BENCH_TIMEOUT_S = 300


def table_rows(stdout: str) -> list[list[str]]:
    """The rows under the `BS PATTERN QD IOPS MB/S P50 P99 WA` header."""
    lines = stdout.splitlines()
    for i, line in enumerate(lines):
        if line.split() == ["BS", "PATTERN", "QD", "IOPS", "MB/S", "P50", "P99", "WA"]:
            return [l.split() for l in lines[i + 1:] if l.strip()]
    raise AssertionError(f"no table header in bench output:\n{stdout}")


def test_bench_one_cell_table_and_json(pool):
    require_tools("fio")
    pool.create_volume("b1", size="32M")
    r = pool.cli("bench", "b1", *CELL, timeout=BENCH_TIMEOUT_S)
    rows = table_rows(r.stdout)
    assert len(rows) == 1, r.stdout
    bs, pattern, qd, iops, mbps = rows[0][:5]
    assert (bs, pattern, qd) == ("4K", "randread", "4"), r.stdout
    assert float(iops) > 0 and float(mbps) > 0, r.stdout
    assert rows[0][7] == "-", f"a read cell writes nothing: {r.stdout}"
    assert "volume b1" in r.stdout and "filled first" in r.stdout, r.stdout
    # The fill pass wrote the region, so the volume now holds data.
    assert pool.volume_status("b1")["used_bytes"] > 0

    pool.create_volume("b2", size="32M", compression="off")
    r = pool.cli("bench", "b2", *CELL, "--json", timeout=BENCH_TIMEOUT_S)
    rep = json.loads(r.stdout)
    assert rep["target"]["volume"] == "b2"
    assert rep["target"]["uri"] == pool.uri("b2")
    assert rep["filled"] is True and rep["region_bytes"] == 32 * 1024 * 1024
    assert len(rep["cells"]) == 1, rep
    cell = rep["cells"][0]
    assert (cell["block_size"], cell["pattern"], cell["iodepth"], cell["jobs"]) == (4096, "randread", 4, 1)
    assert cell["iops"] > 0 and cell["mb_per_s"] > 0 and cell["io_bytes"] > 0, cell
    assert 0 < cell["lat_p50_us"] <= cell["lat_p99_us"], cell


def test_bench_refuses_a_volume_holding_data(pool):
    require_tools("fio", "qemu-io", "nbdinfo")
    pool.create_volume("data", size="32M")
    uri = pool.uri("data")
    qemu_io_ok(uri, "write -P 0x5a 1M 64k")

    r = pool.cli("bench", "data", *CELL, check=False, timeout=BENCH_TIMEOUT_S)
    assert r.returncode == 1, f"bench ran on a volume holding data:\n{r.stdout}{r.stderr}"
    assert r.stderr.startswith("error: refusing to benchmark volume 'data'"), r.stderr
    assert "--force" in r.stderr, r.stderr
    assert r.stdout == "", r.stdout

    # Through --uri it cannot see used bytes; it asks the server's allocation map.
    r = pool.bulwark("bench", "--uri", uri, *CELL, check=False, timeout=BENCH_TIMEOUT_S)
    assert r.returncode == 1, f"bench --uri ran on an export holding data:\n{r.stdout}{r.stderr}"
    assert "refusing to benchmark" in r.stderr and "--force" in r.stderr, r.stderr

    # Nothing was written.
    qemu_io_ok(uri, "read -P 0x5a 1M 64k", "read -P 0 0 1M", "read -P 0 1088k 1M")

    r = pool.cli("bench", "data", *CELL, "--force", "--json", timeout=BENCH_TIMEOUT_S)
    assert json.loads(r.stdout)["cells"][0]["iops"] > 0, r.stdout


def test_bench_uri_on_an_empty_export(pool):
    require_tools("fio", "nbdinfo")
    pool.create_volume("empty", size="16M")
    r = pool.bulwark("bench", "--uri", pool.uri("empty"), *CELL, "--json", timeout=BENCH_TIMEOUT_S)
    rep = json.loads(r.stdout)
    assert rep["target"]["volume"] is None and rep["target"]["export_bytes"] == 16 * 1024 * 1024
    assert rep["cells"][0]["iops"] > 0, rep


def test_bench_fill_is_flushed_before_the_cells(pool):
    """The fill pass ends with a flush: the whole region is durable before any cell
    runs, so no cell measures the server's writeback of the fill. A crash (SIGKILL)
    right after a bench with only a read cell loses none of it."""
    require_tools("fio")
    key = pool.create_volume("f1", size="32M")
    pool.cli("bench", "f1", *CELL, timeout=BENCH_TIMEOUT_S)
    pool.kill()
    pool.start()
    pool.load_key("f1", key)
    # Every block of the region survived (stored bytes include each block's AEAD tag).
    used = pool.volume_status("f1")["used_bytes"]
    assert used >= 32 * 1024 * 1024, f"only {used} bytes of the filled region survived the crash"


WRITE_CELL = ["--block-sizes", "64k", "--patterns", "write", "--iodepths", "4", "--runtime", "1"]


def test_bench_write_amplification_and_fsync(pool):
    """A volume's write cell reports what the pool wrote during it (from status'
    counters) and its write amplification; with --fsync the cell runs fio --fsync
    (its JSON says so); through --uri the pool is not visible: n/a."""
    require_tools("fio", "nbdinfo")
    pool.create_volume("w1", size="32M")
    r = pool.cli("bench", "w1", *WRITE_CELL, "--fsync", "4", "--json", timeout=BENCH_TIMEOUT_S)
    rep = json.loads(r.stdout)
    assert rep["fsync"] == 4 and rep["layout"] == "single", rep
    cell = rep["cells"][0]
    assert cell["fsync"] == 4, cell
    written = cell["pool_written"]
    assert written is not None and written["data_bytes"] > 0, cell
    assert written["device_factor"] == 1.0, cell
    assert cell["write_amplification"] > 0, cell

    r = pool.cli("bench", "w1", *WRITE_CELL, "--force", "--no-fill", timeout=BENCH_TIMEOUT_S)
    wa = table_rows(r.stdout)[0][7]
    assert float(wa) > 0, r.stdout

    r = pool.bulwark("bench", "--uri", pool.uri("w1"), *WRITE_CELL, "--force", "--no-fill",
                     timeout=BENCH_TIMEOUT_S)
    assert table_rows(r.stdout)[0][7] == "n/a", r.stdout
    assert "WA:      n/a" in r.stdout, r.stdout
    r = pool.bulwark("bench", "--uri", pool.uri("w1"), *WRITE_CELL, "--force", "--no-fill", "--json",
                     timeout=BENCH_TIMEOUT_S)
    cell = json.loads(r.stdout)["cells"][0]
    assert cell["write_amplification"] is None and cell["pool_written"] is None, cell


def test_peers_script_copied_alone_says_where_its_report_script_is(tmp_path):
    """bench/peers.sh writes its report with bench/peers_report.py beside it: a copy of
    the script alone must say so before it measures anything (it used to measure for an
    hour and then fail on the missing report script)."""
    repo = pathlib.Path(__file__).resolve().parent.parent
    copy = tmp_path / "sub" / "peers.sh"
    copy.parent.mkdir()
    shutil.copy(repo / "bench" / "peers.sh", copy)
    # The binary named, as one does when running a copy: the script finds everything else.
    env = dict(os.environ, BULWARK_BIN=str(BULWARK_BIN))
    p = subprocess.Popen(["bash", str(copy), "--servers", "qemu-raw", "--runtime", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"peers.sh copied alone ran on (it measures):\n{err[-2000:]}")
    assert p.returncode == 1, (p.returncode, out, err)
    assert "peers_report.py not found" in err and "run peers.sh from the repository" in err, err
