"""Other local users get nothing: the pool directory and pool.json are not
world-readable, the NBD unix socket checks the peer's uid as the control
socket does (so a socket whose mode was widened still refuses another
user, who would otherwise attach read-write as the owner), and a key file
owned by another user is refused even at mode 0600 (its owner can change
it or read it back).

Needs root (to connect as, and give a file to, another user); skipped
otherwise. Before these checks the unix socket greeted uid 65534 and the
key file of uid 65534 unlocked the volume."""

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import make_key_file, qemu_io_ok, require_tools, wait_until

NOBODY = 65534
# Connects to the socket as whoever runs it and prints what the server sent
# first: the greeting, or nothing when it closed the connection.
PEEK = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(30)
s.connect(sys.argv[1])
try:
    data = s.recv(18)
except ConnectionError:
    data = b""
print(data.hex() or "closed")
"""


def as_nobody(*cmd) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                           "--clear-groups", *cmd],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def public_dir():
    """A directory in /tmp that other users can enter (the test's own
    directory is private to root)."""
    d = Path(tempfile.mkdtemp(prefix="bulwark-local-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_other_users_are_refused(make_pool, public_dir):
    if os.geteuid() != 0:
        pytest.skip("needs root: connects as, and gives a file to, another user")
    require_tools("setpriv", "qemu-io")
    # The socket where another user can reach it.
    sock = public_dir / "nbd.sock"
    pool = make_pool(serve_args=["--nbd-socket", sock])
    pool.__class__ = type("PublicSocketPool", (type(pool),),
                          {"nbd_socket": property(lambda _: sock)})
    pool.create()
    # Not world-readable (nor group-readable): the directory, and pool.json.
    assert stat.S_IMODE(pool.dir.stat().st_mode) == 0o700, oct(pool.dir.stat().st_mode)
    assert stat.S_IMODE((pool.dir / "pool.json").stat().st_mode) == 0o600
    pool.start()
    key = pool.create_volume("v", size="16M")

    # Someone widens the socket's mode: another user can reach it now...
    os.chmod(pool.nbd_socket, 0o777)
    r = as_nobody(sys.executable, "-c", PEEK, str(pool.nbd_socket))
    assert r.returncode == 0, r.stderr
    # ...and is closed before a byte is sent.
    assert r.stdout.strip() == "closed", f"another user was greeted: {r.stdout}"
    refused = "refused an NBD connection on the unix socket from another user"
    log = wait_until(lambda: pool.log_path.read_text(), lambda t: refused in t)
    assert refused in log and f"uid={NOBODY}" in log, pool.log_tail()
    # The owner still gets in.
    qemu_io_ok(pool.uri("v"), "write -P 0x5a 0 64k", "read -P 0x5a 0 64k", what="owner")

    # A key file of another user, private to that user, is refused with a message.
    pool.restart()
    assert pool.volume_status("v")["locked"]
    theirs = make_key_file(pool.tmp / "theirs.key")
    theirs.write_bytes(key.read_bytes())
    os.chmod(theirs, 0o600)
    os.chown(theirs, NOBODY, NOBODY)
    r = pool.cli("key", "load", "v", "--key-file", theirs, check=False)
    assert r.returncode != 0, "a key file owned by another user was accepted"
    assert f"owned by uid {NOBODY}" in r.stderr and "chown" in r.stderr, r.stderr
    assert pool.volume_status("v")["locked"]
    # The same bytes in the user's own file unlock it.
    pool.load_key("v", key)
    qemu_io_ok(pool.uri("v"), "read -P 0x5a 0 64k", what="after key load")
