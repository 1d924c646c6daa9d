"""Taking a grant away closes the connections it allowed: `grant remove`
closes the client's open connections to that volume, and narrowing a
read-write grant to read-only closes its read-write connections; the
client's next request fails. Connections the remaining grants still allow
(another client's, a read-only one after the narrowing) keep working, and
the CLI says how many it closed (or is closing, while one still finishes
requests already sent)."""

import json
import re
import subprocess

from conftest import nbd_python, require_tools, wait_until
from tlsutil import make_pki, start_tls_pool

CLOSED_ONE = re.compile(r"\bclos(ed|ing) 1 open NBD connection\(s\)")

# Holds one connection open; on each line "read" from stdin reads a block and
# prints "read ok" or "read failed"; "write" likewise; ends at EOF.
HOLDER = r"""
import sys, nbd
h = nbd.NBD()
h.set_uri_allow_local_file(True)
h.connect_uri(sys.argv[1])
print("open", "ro" if h.is_read_only() else "rw", flush=True)
for line in sys.stdin:
    op = line.strip()
    try:
        if op == "read":
            h.pread(4096, 0)
        else:
            h.pwrite(b"y" * 4096, 0)
        print(op, "ok", flush=True)
    except nbd.Error as e:
        print(op, "failed", flush=True)
"""


class Holder:
    def __init__(self, uri):
        self.p = subprocess.Popen([nbd_python(), "-c", HOLDER, uri], text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.mode = self.p.stdout.readline().split()

    def do(self, op):
        self.p.stdin.write(op + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=30)


def test_taking_a_grant_away_closes_the_connections_it_allowed(make_pool, tmp_path):
    require_tools("openssl")
    pki = make_pki(tmp_path / "pki")
    alice, bob = pki.client("alice"), pki.client("bob")
    pool, port = start_tls_pool(make_pool, "--tls-certificates", pki.server_dir)
    pool.create_volume("a", size="16M")
    pool.cli("grant", "add", "cn:alice", "a", "--read-write")
    pool.cli("grant", "add", "cn:bob", "a", "--read-only")

    def uri(who):
        return f"nbds://127.0.0.1:{port}/a?tls-certificates={who}"

    holders = []
    try:
        alice_rw = Holder(uri(alice))
        bob_ro = Holder(uri(bob))
        holders += [alice_rw, bob_ro]
        assert alice_rw.mode == ["open", "rw"] and bob_ro.mode == ["open", "ro"]
        assert alice_rw.do("write") == "write ok"
        assert bob_ro.do("read") == "read ok"

        # Narrowing alice to read-only closes her read-write connection, not bob's.
        r = pool.cli("grant", "add", "cn:alice", "a", "--read-only")
        assert CLOSED_ONE.search(r.stdout), r.stdout
        assert alice_rw.do("read") == "read failed"
        assert bob_ro.do("read") == "read ok"
        alice_ro = Holder(uri(alice))
        holders.append(alice_ro)
        assert alice_ro.mode == ["open", "ro"]
        assert alice_ro.do("read") == "read ok"

        # Removing bob's grant closes his connection; alice's read-only one stays.
        r = pool.cli("grant", "remove", "cn:bob", "a")
        assert CLOSED_ONE.search(r.stdout), r.stdout
        assert bob_ro.do("read") == "read failed"
        assert alice_ro.do("read") == "read ok"

        # A change that takes nothing away closes nothing, and says nothing of it.
        r = pool.cli("grant", "add", "cn:bob", "a", "--read-write")
        assert "closed" not in r.stdout, r.stdout
        assert alice_ro.do("read") == "read ok"
        # The closed connections are counted out once they have finished.
        attached = wait_until(lambda: pool.status()["daemon"]["attached"],
                              lambda a: a == {"a": 1})
        assert attached == {"a": 1}, attached
    finally:
        for h in holders:
            h.close()

    # The audit log says why those connections ended (written as each one ends).
    def revoked_detaches():
        text = (pool.dir / "audit.log").read_text()
        records = [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]
        detached = [r for r in records if r.get("event") == "detach"]
        return detached, [r for r in detached if "access revoked" in json.dumps(r)]

    detached, revoked = wait_until(revoked_detaches, lambda d: len(d[1]) >= 2)
    assert len(revoked) == 2, detached
