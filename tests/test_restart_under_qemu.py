"""Restarts and upgrades no guest notices (issue 42): the NBD listening socket is held by
the service manager (systemd socket activation, `packaging/systemd/bulwark@.socket`) and
passed to each daemon, so across a restart the socket never goes away. A QEMU client
set up as docs/integrations.md recommends (`reconnect-delay`) keeps writing through a
restart of the daemon with no I/O error and no lost write, and a client that connects
while no daemon runs waits and is served by the next one.

What systemd does is done here by the test itself, as sd_listen_fds(3) specifies: it
binds and listens on DIR/nbd.sock, and starts each daemon with that socket as fd 3,
LISTEN_FDS=1, LISTEN_FDNAMES=nbd and LISTEN_PID set to the daemon's own pid (a shell
that sets it to $$ and execs the daemon).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time

from conftest import Pool, require_tools, run

RECONNECT_DELAY_S = 30
WRITES = 48
WRITE_KIB = 64


class ActivatedPool(Pool):
    """A pool whose NBD socket the test holds and hands to each daemon it starts."""

    def listen(self) -> None:
        self.holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.holder.bind(str(self.nbd_socket))
        os.chmod(self.nbd_socket, 0o600)
        self.holder.listen(128)

    def start(self, env: dict | None = None) -> "Pool":
        fd = self.holder.fileno()
        wrapper = (f'exec 3<&{fd}; exec {fd}<&-; '
                   'LISTEN_PID=$$ LISTEN_FDS=1 LISTEN_FDNAMES=nbd exec "$@"')
        real_popen = subprocess.Popen

        def popen(cmd, **kw):
            if cmd and cmd[0] == str(self.bin) and cmd[1] == "serve":
                cmd = ["bash", "-c", wrapper, "bash", *cmd]
                kw["pass_fds"] = (fd,)
            return real_popen(cmd, **kw)

        subprocess.Popen = popen
        try:
            return super().start(env)
        finally:
            subprocess.Popen = real_popen


def test_qemu_writes_through_a_restart(tmp_path):
    require_tools("qemu-io", "nbdinfo")
    p = ActivatedPool(tmp_path)
    p.create()
    p.listen()
    p.start()
    try:
        p.create_volume("v", size="16M", encryption=False)
        opts = (f"driver=nbd,server.type=unix,server.path={p.nbd_socket},export=v,"
                f"reconnect-delay={RECONNECT_DELAY_S}")
        cmds = []
        for i in range(WRITES):
            cmds += ["-c", f"write -P {i + 1} {i * WRITE_KIB}k {WRITE_KIB}k",
                     "-c", "flush", "-c", "sleep 100"]
        log = tmp_path / "qemu-io.log"
        with open(log, "w") as out:
            qemu = subprocess.Popen(["stdbuf", "-oL", "qemu-io", "--image-opts", opts, *cmds],
                                    stdout=out, stderr=subprocess.STDOUT, text=True)
        # Once the first write is answered, restart the daemon under the writing client.
        deadline = time.monotonic() + 60
        while "wrote" not in log.read_text() and qemu.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        p.stop()
        assert qemu.poll() is None, "qemu-io finished before the restart: nothing was tested"
        # A client that connects while no daemon runs queues in the held socket.
        info = subprocess.Popen(["nbdinfo", "--size", p.uri("v")], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        p.start()
        out, err = info.communicate(timeout=60)
        assert info.returncode == 0 and out.strip() == str(16 << 20), \
            f"a client that connected during the restart failed: {err}"
        qemu.wait(timeout=120)
        output = log.read_text()
        assert qemu.returncode == 0, output
        assert "error" not in output.lower(), f"the guest saw an I/O error:\n{output}\n{p.log_tail()}"
        assert output.count("wrote") == WRITES, output
        # Every write is there, read back through a new connection.
        checks = []
        for i in range(WRITES):
            checks += ["-c", f"read -P {i + 1} {i * WRITE_KIB}k {WRITE_KIB}k"]
        r = run(["qemu-io", "-f", "raw", *checks, p.uri("v")], check=False)
        assert r.returncode == 0 and "Pattern verification failed" not in r.stdout, \
            f"a write was lost across the restart:\n{r.stdout}\n{r.stderr}"
        assert p.nbd_socket.exists(), "the daemon removed the socket the manager holds"
        p.stop()
    finally:
        p.kill()
        p.holder.close()
