"""Helpers for the CSI tests: `bulwark csi` as a process beside a pool's daemon, a
gRPC client generated from the driver's own csi.proto, and csi-sanity's files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, START_TIMEOUT_S, Pool

PROTO = REPO / "crates" / "csi" / "proto" / "csi.proto"
NODE_ID = "test-node"


def csi_sanity_bin() -> str:
    """csi-sanity, from PATH or Go's bin directory (scripts/lib.sh installs it)."""
    found = shutil.which("csi-sanity")
    if not found:
        for d in (os.environ.get("GOBIN"), Path.home() / "go" / "bin"):
            if d and (Path(d) / "csi-sanity").is_file():
                found = str(Path(d) / "csi-sanity")
    if not found:
        pytest.skip("csi-sanity is not installed (scripts/test.sh installs it with "
                    "go install github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity)")
    return found


def require_node_tools():
    if os.geteuid() != 0:
        pytest.skip("staging volumes (nbdfuse, losetup, mount) needs root")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse: nbdfuse cannot run here")
    for tool in ("nbdfuse", "fusermount3", "losetup", "mkfs.ext4", "blkid", "mount"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is not installed")


def key_hex() -> str:
    return os.urandom(32).hex()


class CsiDriver:
    """`bulwark csi --pool DIR --endpoint unix:///PATH --node-id NAME`, started and
    stopped by the test; its state directory survives restarts, as /run does not
    survive a reboot but does a plugin restart."""

    def __init__(self, pool: Pool, tmp: Path):
        self.pool = pool
        self.tmp = tmp
        self.socket = tmp / "csi.sock"
        self.state = tmp / "csi-state"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.log_path: Path | None = None

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> "CsiDriver":
        assert self.proc is None
        self.starts += 1
        self.log_path = self.tmp / f"csi-{self.starts}.log"
        # A socket a killed driver left: the new one replaces it, so wait for that.
        self.socket.unlink(missing_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(self.pool.bin), "csi", "--pool", str(self.pool.dir),
                 "--endpoint", self.endpoint, "--node-id", NODE_ID,
                 "--state-dir", str(self.state)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.pool._env())
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.socket.exists():
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.proc = None
                pytest.fail(f"bulwark csi exited with {rc}\n{self.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"bulwark csi did not listen within {START_TIMEOUT_S}s\n{self.log_tail()}")
            time.sleep(0.05)
        return self

    def stop(self, sig=None) -> None:
        if self.proc is None:
            return
        if sig is None:
            self.proc.terminate()
        else:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        """Stop the driver and undo what a failed test left staged: mounts under the
        test's directory, loop devices and nbdfuse processes its state files name."""
        import json
        self.stop()
        for line in Path("/proc/self/mounts").read_text().splitlines()[::-1]:
            mnt = line.split()[1]
            if mnt.startswith(str(self.tmp)) and "/fuse/" not in mnt:
                subprocess.run(["umount", "-l", mnt], capture_output=True)
        for f in (self.state / "volumes").glob("*.json"):
            att = json.loads(f.read_text()).get("attachment", {})
            if att.get("via") == "fuse":
                subprocess.run(["losetup", "-d", att["device"]], capture_output=True)
                subprocess.run(["fusermount3", "-u", "-z", att["fuse_dir"]], capture_output=True)
                try:
                    if Path(f"/proc/{att['pid']}/comm").read_text().strip() == "nbdfuse":
                        os.kill(att["pid"], 9)
                except (OSError, ValueError):
                    pass

    def log_tail(self) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "--- bulwark csi log ---\n" + self.log_path.read_text(errors="replace")[-6000:]


def grpc_stubs(out: Path):
    """csi_pb2 and csi_pb2_grpc compiled from the driver's csi.proto (grpcio-tools)."""
    try:
        import grpc  # noqa: F401
        from grpc_tools import protoc
    except ImportError:
        pytest.skip("grpcio and grpcio-tools are not installed (scripts/test.sh installs them)")
    import grpc_tools
    out.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(["protoc", f"-I{PROTO.parent}", f"-I{include}",
                      f"--python_out={out}", f"--grpc_python_out={out}", str(PROTO)])
    assert rc == 0, "protoc could not compile csi.proto"
    sys.path.insert(0, str(out))
    import csi_pb2
    import csi_pb2_grpc
    return csi_pb2, csi_pb2_grpc
