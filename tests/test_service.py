"""bulwark as a systemd service (docs/service.md): the unit template passes
`systemd-analyze verify` (with the key-loading drop-in), `install-service.sh`
stages what it says, and `bulwark serve` speaks sd_notify as systemd would
see it: READY=1 only once `status` answers, STOPPING=1 on SIGTERM, on a path
socket and on an abstract (@name) socket, and no harm when NOTIFY_SOCKET is
unusable."""

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, STOP_TIMEOUT_S, bulwark_bin, run

UNIT = REPO / "packaging" / "systemd" / "bulwark@.service"
KEYS_DROPIN = REPO / "packaging" / "systemd" / "keys.conf.example"
SOCKET = REPO / "packaging" / "systemd" / "bulwark@.socket"
READY_TIMEOUT_S = 30


def test_unit_passes_systemd_analyze_verify(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed (Debian package 'systemd'; scripts/lib.sh installs it)")
    units = tmp_path / "units"
    dropins = units / "bulwark@srv-pool.service.d"
    dropins.mkdir(parents=True)
    # verify checks that ExecStart's binary exists: point it at the one under test.
    binary = str(bulwark_bin())
    (units / "bulwark@.service").write_text(UNIT.read_text().replace("/usr/local/bin/bulwark", binary))
    (dropins / "keys.conf").write_text(KEYS_DROPIN.read_text().replace("/usr/local/bin/bulwark", binary))
    (units / "bulwark@.socket").write_text(SOCKET.read_text())
    env = dict(os.environ, SYSTEMD_UNIT_PATH=f"{units}:", SYSTEMD_LOG_LEVEL="notice")
    r = subprocess.run(["systemd-analyze", "verify", "bulwark@srv-pool.socket",
                        "bulwark@srv-pool.service"],
                       capture_output=True, text=True, env=env, cwd=units, timeout=60)
    ours = [l for l in (r.stdout + r.stderr).splitlines() if "bulwark" in l]
    assert r.returncode == 0 and not ours, f"systemd-analyze verify: exit {r.returncode}\n{r.stdout}{r.stderr}"
    # The drop-in was read: a missing ExecStartPost binary must make verify fail.
    (dropins / "keys.conf").write_text(KEYS_DROPIN.read_text().replace("/usr/local/bin/bulwark", str(tmp_path / "nope")))
    r = subprocess.run(["systemd-analyze", "verify", "bulwark@srv-pool.service"],
                       capture_output=True, text=True, env=env, cwd=units, timeout=60)
    assert r.returncode != 0, "verify did not read the keys.conf drop-in"


def test_unit_asks_for_readiness_and_hardening():
    text = UNIT.read_text()
    for line in ["Type=notify", "ExecStart=/usr/local/bin/bulwark serve %f", "ReadWritePaths=%f",
                 "ProtectSystem=strict", "NoNewPrivileges=yes", "PrivateTmp=yes", "CapabilityBoundingSet="]:
        assert f"\n{line}\n" in text, f"{UNIT.name} lacks {line!r}"


def test_install_script_stages_binary_unit_and_docs(tmp_path):
    stage = tmp_path / "stage"
    r = run([REPO / "scripts" / "install-service.sh", "--destdir", stage, "--prefix", "/opt/bw",
             "--bin", bulwark_bin()])
    assert "installed /opt/bw/bin/bulwark" in r.stdout
    assert os.access(stage / "opt/bw/bin/bulwark", os.X_OK)
    unit = (stage / "etc/systemd/system/bulwark@.service").read_text()
    assert "\nExecStart=/opt/bw/bin/bulwark serve %f\n" in unit
    assert "/usr/local" not in unit
    keys = (stage / "opt/bw/share/doc/bulwark/keys.conf.example").read_text()
    assert "ExecStartPost=/opt/bw/bin/bulwark --pool %f key load" in keys
    assert (stage / "opt/bw/share/doc/bulwark/service.md").exists()
    assert "ListenStream=%f/nbd.sock" in (stage / "etc/systemd/system/bulwark@.socket").read_text()


def _serve(pool, notify_env: str):
    """Start `bulwark serve` as systemd would: NOTIFY_SOCKET set, stdin closed."""
    env = pool._env()
    env["NOTIFY_SOCKET"] = notify_env
    pool.starts += 1
    log = open(pool.tmp / f"serve-{pool.starts}.log", "wb")
    pool.proc = subprocess.Popen([str(pool.bin), "serve", str(pool.dir)], stdout=log,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    log.close()


def _receive_until(sock: socket.socket, pool, key: str) -> list[str]:
    """Datagrams (each a list of KEY=value lines) up to and including one holding `key`."""
    got = []
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        sock.settimeout(0.2)
        try:
            msg = sock.recv(4096).decode()
        except socket.timeout:
            if pool.proc.poll() is not None:
                pytest.fail(f"serve exited {pool.proc.returncode} before {key}; got {got}\n{pool.log_tail()}")
            continue
        got.append(msg)
        if key in msg.split("\n"):
            return got
    pytest.fail(f"no {key} within {READY_TIMEOUT_S}s; got {got}\n{pool.log_tail()}")


def _ready_then_stopping(pool, sock: socket.socket, notify_env: str) -> None:
    _serve(pool, notify_env)
    before = _receive_until(sock, pool, "READY=1")
    # The moment READY=1 arrives, the control socket answers and NBD listens.
    st = pool.cli("status", "--json")
    assert '"devices"' in st.stdout
    assert pool.nbd_socket.exists()
    assert any(m.startswith("STATUS=importing pool") for m in before[:-1]), before
    assert f"STATUS=serving pool {pool.dir.resolve()}" in before[-1], before
    # Nothing more until a signal: no second READY, no STOPPING.
    sock.settimeout(0.5)
    with pytest.raises(socket.timeout):
        sock.recv(4096)
    pool.proc.send_signal(signal.SIGTERM)
    after = _receive_until(sock, pool, "STOPPING=1")
    assert after[-1].startswith("STOPPING=1\nSTATUS=shutting down"), after
    rc = pool.proc.wait(STOP_TIMEOUT_S)
    pool.proc = None
    assert rc == 0, f"serve exited {rc} after SIGTERM\n{pool.log_tail()}"


def test_ready_only_once_status_answers_and_stopping_on_sigterm(make_pool, tmp_path):
    pool = make_pool().create()
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        _ready_then_stopping(pool, sock, str(path))


def test_abstract_notify_socket(make_pool):
    pool = make_pool().create()
    name = f"bulwark-test-notify-{os.getpid()}-{secrets.token_hex(4)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        _ready_then_stopping(pool, sock, "@" + name)


def test_unusable_notify_socket_does_not_stop_the_daemon(make_pool, tmp_path, monkeypatch):
    # Nobody listens there: the daemon logs a warning and serves anyway.
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody.sock"))
    pool = make_pool().create().start()
    pool.create_volume("v", size="16M", encryption=False)
    pool.stop()
    assert "cannot notify the service manager" in (pool.tmp / "serve-1.log").read_text()
