"""Shared helpers for bulwark's integration tests.

Every test drives the real `bulwark` binary and real NBD clients (qemu-io,
qemu-img, nbdcopy, nbdinfo, nbdfuse, fio, libnbd's Python binding) and checks
what a user would see. Nothing here knows the on-disk format.

The binary is `$BULWARK_BIN`, or `<repo>/target/release/bulwark`; the
suite runs a private copy of it, taken when the first pool is made.
A test that finds a client tool missing is skipped with a message naming it;
a missing `bulwark` binary is an error, never a skip.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HELPERS = Path(__file__).resolve().parent / "helpers"
BULWARK_BIN = Path(os.environ.get("BULWARK_BIN", REPO / "target" / "release" / "bulwark"))

START_TIMEOUT_S = 30
STATUS_POLL_TIMEOUT_S = 10
STOP_TIMEOUT_S = 60
CLI_TIMEOUT_S = 120
WAIT_TIMEOUT_S = 30
LOG_TAIL_CHARS = 6000
# scripts/test.sh limits every test to --timeout=300 (pytest-timeout). A test
# whose own waits (a scrub, a copy, fio, a rotation) may each take up to 300 s
# gets more, so that those waits fail first, with their message:
# `pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)` in its module.
LONG_TEST_TIMEOUT_S = 900

KiB = 1024
MiB = 1024 * KiB


# --------------------------------------------------------------------------
# client tools


def require_tools(*names: str) -> None:
    """Skip the calling test, naming the tool, if a client binary is missing."""
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        pytest.skip(f"client tool(s) not installed: {', '.join(missing)} "
                    f"(scripts/test.sh installs them)")


def _find_nbd_python() -> str | None:
    # Debian's python3-libnbd installs into the system interpreter; the
    # `python3` on PATH may be another one (pyenv) without the module.
    for cand in ("/usr/bin/python3", sys.executable, shutil.which("python3")):
        if not cand or not os.path.exists(cand):
            continue
        r = subprocess.run([cand, "-c", "import nbd"], capture_output=True)
        if r.returncode == 0:
            return cand
    return None


_NBD_PYTHON: list = []


def nbd_python() -> str:
    """Path of a Python interpreter that can `import nbd` (libnbd), or skip."""
    if not _NBD_PYTHON:
        _NBD_PYTHON.append(_find_nbd_python())
    if _NBD_PYTHON[0] is None:
        pytest.skip("no Python interpreter with libnbd's `nbd` module "
                    "(Debian package python3-libnbd)")
    return _NBD_PYTHON[0]


def run(cmd, *, check=True, timeout=CLI_TIMEOUT_S, input=None, **kw) -> subprocess.CompletedProcess:
    """Run a command, capture text output; on failure with check=True, fail
    the test showing the command and its output."""
    cmd = [str(c) for c in cmd]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input, **kw)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n"
                    f"stdout: {e.stdout}\nstderr: {e.stderr}")
    if check and r.returncode != 0:
        pytest.fail(f"command failed (exit {r.returncode}): {' '.join(cmd)}\n"
                    f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}")
    return r


def run_fio(cmd, out: Path, check=True, timeout=300):
    """Run fio (`cmd` ends with --output-format=json --output=OUT); return the
    process and the parsed report (None if fio wrote none). With check=True,
    fail the test showing the command, its output and the report."""
    r = run(cmd, check=False, timeout=timeout, cwd=out.parent)
    try:
        report = json.loads(out.read_text())
    except (OSError, ValueError):
        report = None
    if check:
        assert r.returncode == 0, f"fio failed (exit {r.returncode}): {' '.join(map(str, cmd))}\n" \
                                  f"{r.stdout}{r.stderr}\n{out.read_text() if out.exists() else ''}"
    return r, report


def run_helper(script: str, *args, check=True, timeout=CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run tests/helpers/<script> under the libnbd-capable Python."""
    return run([nbd_python(), HELPERS / script, *args], check=check, timeout=timeout)


def qemu_io(uri: str, *commands: str, timeout=CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run qemu-io on an NBD URI with one `-c` per command; never fails by itself."""
    cmd = ["qemu-io", "-f", "raw"]
    for c in commands:
        cmd += ["-c", c]
    cmd.append(uri)
    return run(cmd, check=False, timeout=timeout)


def qemu_io_ok(uri: str, *commands: str, what: str = "", timeout=CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run qemu-io and require every command to succeed (and every pattern to verify)."""
    r = qemu_io(uri, *commands, timeout=timeout)
    assert_qemu_io_ok(r, what or " ".join(commands))
    return r


def assert_qemu_io_ok(r: subprocess.CompletedProcess, what: str = "") -> None:
    """qemu-io signals a failed command both by exit status and by text; check both."""
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"qemu-io failed {what} (exit {r.returncode}):\n{out}"
    assert "Pattern verification failed" not in out, f"qemu-io pattern mismatch {what}:\n{out}"
    for bad in ("error", "failed"):
        assert bad not in out.lower(), f"qemu-io reported {bad!r} {what}:\n{out}"


def wait_until(read, done=bool, timeout=WAIT_TIMEOUT_S, interval=0.1):
    """Call read() until done(its result) holds or `timeout` seconds have passed;
    return the last result, for the caller to assert on. For what the daemon
    does a moment after a client has had its answer (counting a connection
    out, writing its audit record)."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if done(value) or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def make_key_file(path: Path) -> Path:
    """A raw key file: exactly 32 random bytes, mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    os.chmod(path, 0o600)
    return path


def make_passphrase_file(path: Path, passphrase: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(passphrase)
    os.chmod(path, 0o600)
    return path


def stderr_lines(r: subprocess.CompletedProcess) -> list[str]:
    return [l for l in r.stderr.splitlines() if l.strip()]


# --------------------------------------------------------------------------
# the pool under test

_BIN_COPY: list = []


def bulwark_bin() -> Path:
    """A private copy of the binary under test, made once per session, so that
    a rebuild during the run cannot pair a CLI and a daemon of two builds."""
    if not _BIN_COPY:
        if not BULWARK_BIN.exists():
            pytest.fail(f"bulwark binary not found at {BULWARK_BIN}: "
                        f"run `cargo build --release` or set BULWARK_BIN")
        d = tempfile.mkdtemp(prefix="bulwark-bin-")
        atexit.register(shutil.rmtree, d, True)
        dst = Path(d) / "bulwark"
        shutil.copy2(BULWARK_BIN, dst)
        _BIN_COPY.append(dst)
    return _BIN_COPY[0]


class Pool:
    """One pool directory and, while started, the `bulwark serve` daemon on it."""

    def __init__(self, tmp_path: Path, layout: str = "single", devices: int = 1,
                 device_size: str = "512M", serve_args=(), open_files: int | None = None,
                 registry: Path | None = None, dir_name: str = "pool"):
        self.tmp = Path(tmp_path)
        # The host's registry of pools (`bulwark pool list`) for this pool's commands: the
        # test's own, never /etc/bulwark/pools.json. Pools given one registry share it.
        self.registry = Path(registry) if registry else self.tmp / "registry.json"
        self.open_files = open_files  # the daemon's soft RLIMIT_NOFILE at start, if set
        self.serve_args = [str(a) for a in serve_args]  # extra `serve` options, every start
        self.dir = self.tmp / dir_name
        self.layout = layout
        self.devices = devices
        self.device_size = device_size
        self.keys_dir = self.tmp / "keys"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.log_path: Path | None = None
        self._device_paths: list[str] | None = None
        self.bin = bulwark_bin()

    # -- paths

    @property
    def nbd_socket(self) -> Path:
        return self.dir / "nbd.sock"

    @property
    def control_socket(self) -> Path:
        return self.dir / "control.sock"

    def uri(self, name: str) -> str:
        return f"nbd+unix:///{name}?socket={self.nbd_socket}"

    def list_uri(self) -> str:
        return f"nbd+unix://?socket={self.nbd_socket}"

    # -- commands

    def _env(self) -> dict:
        env = dict(os.environ)
        env["BULWARK_POOL"] = str(self.dir)
        env["BULWARK_REGISTRY"] = str(self.registry)
        env.setdefault("RUST_BACKTRACE", "1")
        return env

    def bulwark(self, *args, check=True, timeout=CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
        """Run the binary with exactly these arguments (no --pool added)."""
        return run([self.bin, *args], check=check, timeout=timeout, env=self._env())

    def cli(self, *args, check=True, timeout=CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
        """Run `bulwark --pool DIR ARGS...`."""
        r = run([self.bin, "--pool", self.dir, *args], check=False, timeout=timeout, env=self._env())
        if check and r.returncode != 0:
            pytest.fail(f"bulwark {' '.join(map(str, args))} failed (exit {r.returncode})\n"
                        f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}\n{self.log_tail()}")
        return r

    def create(self, *extra) -> "Pool":
        args = ["pool", "create", self.dir, "--layout", self.layout]
        if not extra:
            args += ["--devices", str(self.devices), "--device-size", self.device_size]
        r = self.bulwark(*args, *extra, check=False)
        if r.returncode != 0:
            pytest.fail(f"pool create failed (exit {r.returncode}): {' '.join(map(str, args + list(extra)))}\n"
                        f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}")
        return self

    def start(self, env: dict | None = None) -> "Pool":
        """Start `bulwark serve`; `env`: extra environment for the daemon only
        (BULWARK_CRASH_AT=...), never for the CLI calls."""
        assert self.proc is None, "daemon already started"
        self.starts += 1
        self.log_path = self.tmp / f"serve-{self.starts}.log"
        log = open(self.log_path, "wb")
        limit = None
        if self.open_files is not None:
            soft = self.open_files

            def limit():
                import resource
                hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        # BULWARK_TEST_SERVE_ARGS: options for every daemon of the run (the whole suite
        # with `--fill-holes`, say), before the test's own.
        # A test's own `--no-fill-holes` wins over a run-wide `--holes-first` (they conflict).
        every = [a for a in os.environ.get("BULWARK_TEST_SERVE_ARGS", "").split()
                 if a not in self.serve_args
                 and not (a == "--holes-first" and "--no-fill-holes" in self.serve_args)]
        self.proc = subprocess.Popen([str(self.bin), "serve", str(self.dir), *every,
                                      *self.serve_args],
                                     stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**self._env(), **(env or {})},
                                     preexec_fn=limit)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        last = "none yet"
        status = [str(self.bin), "--pool", str(self.dir), "status", "--json"]
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.proc = None
                pytest.fail(f"bulwark serve exited with {rc} during start\n{self.log_tail()}")
            try:
                r = subprocess.run(status, capture_output=True, text=True, env=self._env(),
                                   timeout=STATUS_POLL_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                # A slow answer (a replay after a kill, a busy machine) is a failed
                # poll: only the overall deadline fails the test.
                last = f"no answer within {STATUS_POLL_TIMEOUT_S}s"
                continue
            last = f"exit {r.returncode} {r.stderr}"
            if r.returncode == 0:
                try:
                    st = json.loads(r.stdout)
                except ValueError:
                    pytest.fail(f"`status --json` printed invalid JSON:\n{r.stdout}")
                self._device_paths = [d["path"] for d in st["devices"]]
                if self.nbd_socket.exists():
                    return self
            time.sleep(0.2)
        self.kill()
        pytest.fail(f"bulwark serve did not answer `status` within {START_TIMEOUT_S}s\n"
                    f"last status: {last}\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM: the daemon commits and exits 0."""
        assert self.proc is not None, "daemon not running"
        self._device_paths = self.device_paths()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            pytest.fail(f"bulwark serve did not exit within {STOP_TIMEOUT_S}s of SIGTERM\n{self.log_tail()}")
        self.proc = None
        assert rc == 0, f"bulwark serve exited {rc} after SIGTERM (expected 0)\n{self.log_tail()}"

    def kill(self) -> None:
        """SIGKILL: a crash, no chance to commit."""
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait()
        self.proc = None

    def restart(self) -> "Pool":
        self.stop()
        return self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self) -> str:
        out = []
        for p in sorted(self.tmp.glob("serve-*.log")):
            text = p.read_text(errors="replace")
            if len(text) > LOG_TAIL_CHARS:
                text = "...\n" + text[-LOG_TAIL_CHARS:]
            out.append(f"--- {p.name} ---\n{text}")
        return "\n".join(out) if out else "(no daemon log)"

    # -- queries

    def status(self) -> dict:
        r = self.cli("status", "--json")
        try:
            return json.loads(r.stdout)
        except ValueError:
            pytest.fail(f"`status --json` printed invalid JSON:\n{r.stdout}")

    def volume_status(self, name: str) -> dict:
        st = self.status()
        for v in st["volumes"]:
            if v["name"] == name:
                return v
        pytest.fail(f"volume {name!r} not in status: {json.dumps(st, indent=1)}")

    def wait_detached(self, name: str, timeout=WAIT_TIMEOUT_S) -> None:
        """Wait until `status` counts no NBD connection to volume `name`. A client
        (qemu-io, nbdinfo) exits before the daemon has counted its connection
        out (NBD_CMD_DISC has no reply), and `key unload` and `volume destroy`
        refuse a volume in use once a short grace has passed: call this first."""
        attached = wait_until(lambda: self.status()["daemon"]["attached"],
                              lambda a: not a.get(name), timeout)
        if attached.get(name):
            pytest.fail(f"volume {name} still has {attached[name]} NBD connection(s) "
                        f"{timeout}s after its clients exited\n{self.log_tail()}")

    def device_paths(self) -> list[str]:
        """Device file paths from `status --json`; remembered for when the daemon is stopped."""
        if self.running:
            self._device_paths = [d["path"] for d in self.status()["devices"]]
        assert self._device_paths, "device paths unknown: start the daemon once first"
        return list(self._device_paths)

    def exports(self) -> list[str]:
        """Export names the NBD server lists (nbdinfo --list)."""
        r = run(["nbdinfo", "--list", "--json", self.list_uri()])
        return [e.get("export-name") for e in json.loads(r.stdout).get("exports", [])]

    # -- volumes and keys

    def create_volume(self, name: str, size: str = "64M", encryption: bool = True,
                      key: Path | None = None, passphrase_file: Path | None = None,
                      **opts) -> Path | None:
        """Create a volume; for an encrypted one make (or use) a 32-byte key
        file, mode 0600, and return its path. Extra options: block_size="4K",
        compression="off"... become --block-size 4K, --compression off."""
        args = ["volume", "create", name, "--size", size]
        for k, v in opts.items():
            args += ["--" + k.replace("_", "-"), str(v)]
        if encryption:
            args += ["--encryption", "on"]
            if passphrase_file is not None:
                args += ["--passphrase-file", passphrase_file]
                key = passphrase_file
            else:
                if key is None:
                    key = make_key_file(self.keys_dir / f"{name}.key")
                args += ["--key-file", key]
        else:
            args += ["--encryption", "off"]
            key = None
        self.cli(*args)
        v = self.volume_status(name)
        assert not v["locked"], f"volume {name} is locked right after create: {v}"
        return key

    def load_key(self, name: str, keyfile: Path, passphrase: bool = False) -> None:
        opt = "--passphrase-file" if passphrase else "--key-file"
        self.cli("key", "load", name, opt, keyfile)

    def cleanup(self) -> None:
        self.kill()


@pytest.fixture
def make_pool(tmp_path):
    """Factory for pools not started (or started with custom options)."""
    pools: list[Pool] = []

    def factory(**kw) -> Pool:
        sub = tmp_path / f"p{len(pools)}"
        sub.mkdir()
        p = Pool(sub, **kw)
        pools.append(p)
        return p

    yield factory
    for p in pools:
        print(p.log_tail())  # shown by pytest only when the test failed
        p.cleanup()


@pytest.fixture
def pool(tmp_path):
    """A started pool with one device (layout single)."""
    p = Pool(tmp_path)
    p.create().start()
    yield p
    print(p.log_tail())  # shown by pytest only when the test failed
    p.cleanup()


@pytest.fixture
def mirror_pool(tmp_path):
    """A started pool of two devices, layout mirror:2."""
    p = Pool(tmp_path, layout="mirror:2", devices=2)
    p.create().start()
    yield p
    print(p.log_tail())  # shown by pytest only when the test failed
    p.cleanup()


@pytest.fixture
def seed() -> int:
    """A seed for randomised tests: $BULWARK_TEST_SEED or a fresh one, printed."""
    seed = int(os.environ.get("BULWARK_TEST_SEED") or secrets.randbits(32))
    print(f"seed: {seed} (replay with BULWARK_TEST_SEED={seed})")
    return seed


# --- disk: a passed test leaves nothing behind -----------------------------------
# pytest keeps every test's tmp_path until the run ends (and the last three runs
# after that). Pools, images and fio files add up to about 18 GB over the whole
# suite; a CI machine with less free disk failed every test after the first
# ENOSPC. A test that passed has its tmp_path removed as soon as its fixtures are
# torn down; a failed or skipped one keeps it for whoever looks into it.
# BULWARK_TEST_KEEP_TMP=1 keeps them all.


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed or (report.when == "call" and not report.passed):
        item._bulwark_keep_tmp = True  # any phase that failed, or a skip in the body
    if report.when != "teardown" or getattr(item, "_bulwark_keep_tmp", False):
        return
    if os.environ.get("BULWARK_TEST_KEEP_TMP") == "1":
        return
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if isinstance(tmp, Path) and tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)
