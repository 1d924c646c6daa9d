"""Metrics (`serve --metrics-listen`, docs/metrics.md), read the way an
operator reads them: through a real Prometheus server scraping the endpoint
every second, queried over its HTTP API.

The workload is exact, so the counters must be too: fio (nbd engine) writes
then reads 256 blocks of 16 KiB; one qemu-io read follows with a bit flipped
in every read of the first mirror device (`fault set DEV read-flip`), which
the read finds and repairs from the second copy; one open of an export that
does not exist is refused. Prometheus must then see exactly those requests
and bytes, a checksum error on the flipped device and none on the other, a
repaired block, the snapshot taken, and latency histograms a p99 can be
computed from. And the endpoint binds loopback only unless
--metrics-allow-remote: `serve --metrics-listen 0.0.0.0:PORT` alone is
refused before the pool is imported.
"""

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from conftest import (REPO, KiB, MiB, WAIT_TIMEOUT_S, qemu_io, qemu_io_ok, require_tools,
                      run_fio)

BS = 16 * KiB
BLOCKS = 256
SIZE = BS * BLOCKS  # 4 MiB
FLIPPED_READ = 64 * KiB
DASHBOARD = REPO / "packaging" / "grafana" / "bulwark.json"
PROMETHEUS_READY_S = 60
SCRAPED_WITHIN_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Prometheus:
    """A real Prometheus server scraping one target every second."""

    def __init__(self, tmp_path, target: str):
        if shutil.which("prometheus") is None:
            pytest.skip("prometheus not installed (Debian package 'prometheus'; "
                        "scripts/lib.sh installs it)")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n"
            "  scrape_interval: 1s\n"
            "  scrape_timeout: 1s\n"
            "scrape_configs:\n"
            "  - job_name: bulwark\n"
            "    static_configs:\n"
            f"      - targets: ['{target}']\n")
        self.log_path = tmp_path / "prometheus.log"
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + PROMETHEUS_READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited with {self.proc.returncode}\n{self.log()}")
            try:
                if http_get(f"{self.base}/-/ready", timeout=1)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"prometheus not ready within {PROMETHEUS_READY_S}s\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def query(self, expr: str) -> list[dict]:
        url = f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        status, body = http_get(url)
        assert status == 200, f"query {expr!r}: HTTP {status}: {body}"
        answer = json.loads(body)
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def value(self, expr: str) -> float | None:
        """The one value `expr` gives now, or None if it gives no series."""
        result = self.query(expr)
        if not result:
            return None
        assert len(result) == 1, f"{expr!r} gives {len(result)} series: {result}"
        return float(result[0]["value"][1])

    def target_health(self) -> list[dict]:
        status, body = http_get(f"{self.base}/api/v1/targets")
        return json.loads(body)["data"]["activeTargets"] if status == 200 else []

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def prometheus_factory(tmp_path):
    started = []

    def start(target: str) -> Prometheus:
        p = Prometheus(tmp_path, target)
        started.append(p)
        return p

    yield start
    for p in started:
        print(p.log())  # shown by pytest only when the test failed
        p.stop()


def fio(uri, rw, out):
    cmd = ["fio", "--name=m", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={BS}",
           f"--size={SIZE}", "--iodepth=8", "--numjobs=1",
           "--output-format=json", f"--output={out}"]
    _, report = run_fio(cmd, out)
    (job,) = report["jobs"]
    assert job["error"] == 0, job
    return job


def test_prometheus_sees_the_workload(make_pool, tmp_path, prometheus_factory):
    require_tools("fio", "qemu-io")
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus not installed (Debian package 'prometheus'; scripts/lib.sh installs it)")
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    pool = make_pool(layout="mirror:2", devices=2, device_size="256M",
                     serve_args=["--allow-fault-injection", "--metrics-listen", endpoint])
    pool.create().start()
    assert f"metrics http://{endpoint}/metrics" in pool.log_tail(), pool.log_tail()
    pool.create_volume("m", size="64M")
    uri = pool.uri("m")

    w = fio(uri, "write", tmp_path / "write.json")["write"]
    assert (w["total_ios"], w["io_bytes"]) == (BLOCKS, SIZE), w
    r = fio(uri, "read", tmp_path / "read.json")["read"]
    assert (r["total_ios"], r["io_bytes"]) == (BLOCKS, SIZE), r
    pool.cli("snapshot", "create", "m@one")

    # A bit flips in every read of the first device (bad RAM on its path): the
    # read finds the copy bad, answers from the second, and rewrites the first.
    first, second = pool.device_paths()
    pool.cli("fault", "set", first, "read-flip", "--seed", "7")
    qemu_io_ok(uri, f"read 0 {FLIPPED_READ}")
    pool.cli("fault", "clear")
    # An export that does not exist: refused (the client is told no more).
    refused = qemu_io(pool.uri("no-such-volume"), "read 0 4k")
    assert refused.returncode != 0, refused.stdout + refused.stderr

    # What the daemon itself says, before Prometheus does.
    status, text = http_get(f"http://{endpoint}/metrics")
    assert status == 200, text
    assert f'bulwark_volume_requests_total{{volume="m",op="write"}} {BLOCKS}' in text, text

    prom = prometheus_factory(endpoint)
    reads_expected = BLOCKS + 1
    reads_q = 'bulwark_volume_requests_total{volume="m",op="read"}'
    deadline = time.monotonic() + SCRAPED_WITHIN_S
    while time.monotonic() < deadline and prom.value(reads_q) != reads_expected:
        time.sleep(0.5)
    assert prom.value(reads_q) == reads_expected, (
        f"Prometheus did not see {reads_expected} reads within {SCRAPED_WITHIN_S}s: "
        f"{prom.query(reads_q)}; targets: {prom.target_health()}\n{prom.log()}")
    assert prom.value('up{job="bulwark"}') == 1

    def v(expr):
        value = prom.value(expr)
        assert value is not None, f"no series for {expr}; targets: {prom.target_health()}"
        return value

    # Requests and bytes: exactly the workload.
    assert v('bulwark_volume_requests_total{volume="m",op="write"}') == BLOCKS
    assert v('bulwark_volume_bytes_total{volume="m",op="write"}') == SIZE
    assert v('bulwark_volume_bytes_total{volume="m",op="read"}') == SIZE + FLIPPED_READ
    assert v('sum(bulwark_volume_request_errors_total{volume="m"})') == 0
    assert v('bulwark_volume_requests_total{volume="m",op="trim"}') == 0
    assert v('bulwark_volume_request_duration_seconds_count{volume="m",op="write"}') == BLOCKS
    assert v('bulwark_volume_request_duration_seconds_count{volume="m",op="read"}') == reads_expected
    p99 = v('histogram_quantile(0.99, sum by (le) '
            '(bulwark_volume_request_duration_seconds_bucket{volume="m",op="write"}))')
    assert 0 < p99 <= 1.0, f"p99 write latency {p99}s"

    # The injected fault: counted on the flipped device only, and repaired.
    assert v(f'bulwark_device_checksum_errors_total{{device="{first}"}}') >= 1
    assert v(f'bulwark_device_checksum_errors_total{{device="{second}"}}') == 0
    assert v('bulwark_pool_repaired_blocks_total') >= 1
    assert v('bulwark_pool_unrecoverable_blocks_total') == 0
    assert v(f'bulwark_device_state{{device="{first}",state="ONLINE"}}') == 1

    # NBD: two fio runs and a qemu-io attached, one open was refused, none is left.
    assert v('bulwark_nbd_attaches_total{export="m"}') >= 3
    assert v('bulwark_nbd_refused_opens_total') >= 1
    assert v('bulwark_nbd_attached_connections{export="m"}') == 0

    # The pool, as `status` shows it.
    st = pool.status()
    assert v('bulwark_pool_state{state="ONLINE"}') == 1
    assert v('bulwark_pool_space_total_bytes') == st["space"]["total_bytes"]
    assert v('bulwark_pool_space_provisioned_bytes') == 64 * MiB
    assert v('bulwark_pool_space_used_bytes') > 0
    assert v('bulwark_pool_written_bytes_total{stream="data"}') >= SIZE
    assert v('bulwark_pool_write_amplification') >= 1
    assert v('bulwark_volume_snapshots{volume="m"}') == 1
    assert v('bulwark_volume_size_bytes{volume="m"}') == 64 * MiB
    assert v('bulwark_scrub_state{state="none"}') == 1

    # Every query of the Grafana dashboard is valid PromQL and finds series here
    # (rates need two scrapes at least).
    scrapes = 'count_over_time(up{job="bulwark"}[1m])'
    deadline = time.monotonic() + SCRAPED_WITHIN_S
    while time.monotonic() < deadline and (prom.value(scrapes) or 0) < 3:
        time.sleep(0.5)
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "1m")
            expr = re.sub(r"\$(instance|volume)\b", ".*", expr)
            if "bulwark_object_store_" in expr:
                continue  # this pool has no store: tests/test_object_store_health.py
            assert prom.query(expr), f"dashboard panel {panel['title']!r}: no series for {expr}"


def test_remote_bind_needs_allow_remote(make_pool, tmp_path):
    pool = make_pool()
    pool.create()
    port = free_port()
    # Refused at start, before the pool is imported: nothing listens, nothing is written.
    r = pool.bulwark("serve", pool.dir, "--metrics-listen", f"0.0.0.0:{port}", check=False,
                     timeout=WAIT_TIMEOUT_S)
    assert r.returncode == 2, f"exit {r.returncode}\n{r.stdout}{r.stderr}"
    assert "not a loopback address" in r.stderr and "--metrics-allow-remote" in r.stderr, r.stderr
    assert "serving pool" not in r.stderr, r.stderr

    # --metrics-allow-remote needs --metrics-listen.
    r = pool.bulwark("serve", pool.dir, "--metrics-allow-remote", check=False,
                     timeout=WAIT_TIMEOUT_S)
    assert r.returncode == 2 and "--metrics-listen" in r.stderr, r.stderr

    # With it, the wildcard address is served (and loopback reaches it).
    pool.serve_args = ["--metrics-listen", f"0.0.0.0:{port}", "--metrics-allow-remote"]
    pool.start()
    status, text = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200 and "bulwark_pool_generation " in text, text
    assert http_get(f"http://127.0.0.1:{port}/elsewhere")[0] == 404
    pool.stop()
