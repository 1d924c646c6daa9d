"""README's Quick start runs top to bottom as written (issue 42).

The test takes the Quick start's first ```sh block out of README.md and runs it, in one
bash (so `&`, `%1` and variables work as they do for a user typing it), with `set -e`:
any command that fails fails the test. What is changed, and why:

- Places: /srv/..., /tmp/... and /etc/bulwark/... are put under the test's directory
  (the test must not write the host's), /dev/sdc (a disk this machine does not have) is a
  sparse file standing in for it, /dev/disk/by-id/ata-A and ata-B are the pool's two
  disks by those names (dev0.img and that file), and the object store's
  URL points at a versitygw the test starts (tests/helpers/s3servers.py) instead of
  127.0.0.1:7070.
- What a user brings: base.qcow2 (a small image made with qemu-img), s3.env (that
  server's credentials), admin.pass and admin2.pass (passphrase files).
- Skipped: `qemu-system-x86_64` (boots a guest from vm1 and runs until that guest shuts
  down; this block has no bootable image in vm1). tests/test_clone_boots.py boots one.
- After `$B serve DIR &`, the script waits until `status` answers, as a user would wait
  for the daemon's "ready" line before typing the next command.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HELPERS, LONG_TEST_TIMEOUT_S, bulwark_bin, make_passphrase_file, require_tools

sys.path.insert(0, str(HELPERS))
from s3servers import start_server  # noqa: E402

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)

README = Path(__file__).resolve().parent.parent / "README.md"
SKIP = ("qemu-system-x86_64",)


def quick_start_commands() -> list[str]:
    text = README.read_text()
    section = text.split("## Quick start", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    commands, pending = [], ""
    for line in block.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        commands.append(pending + line)
        pending = ""
    return commands


def test_quick_start_runs_top_to_bottom(tmp_path):
    require_tools("qemu-img", "nbdcopy")
    commands = quick_start_commands()
    assert any("pool create /srv/pool" in c for c in commands), commands
    work = tmp_path / "work"
    for d in ("work", "srv", "tmp", "etc", "disks"):
        (tmp_path / d).mkdir()
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(work / "base.qcow2"), "64M"],
                   check=True)
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", "write -P 0x42 0 1M",
                    str(work / "base.qcow2")], check=True, capture_output=True)
    for n in ("sdc",):
        subprocess.run(["truncate", "-s", "1G", str(tmp_path / "disks" / n)], check=True)
    make_passphrase_file(work / "admin.pass", "first admin passphrase")
    make_passphrase_file(work / "admin2.pass", "second admin passphrase")
    with start_server("versitygw", tmp_path / "vgw") as srv:
        srv.write_credentials(work / "s3.env")
        # A daemon the script started and did not stop (it failed before its kill) is
        # stopped with it, by its own job's pid.
        script = ["set -e", "set -x", "trap 'kill $(jobs -p) 2>/dev/null || true; wait' EXIT"]
        for c in commands:
            if any(c.lstrip().startswith(s) for s in SKIP):
                script.append(f"# skipped: {c}")
                continue
            c = re.sub(r"(?<![\w.])/(srv|tmp|etc)/", lambda m: f"{tmp_path}/{m.group(1)}/", c)
            c = re.sub(r"^B=\S+", f"B={bulwark_bin()}", c)
            c = c.replace("http://127.0.0.1:7070", srv.endpoint)
            c = c.replace("s3://bucket/", f"s3://{srv.bucket}/")
            c = c.replace("/dev/sdc", str(tmp_path / "disks" / "sdc"))
            # The pool's two disks after `device replace dev1.img /dev/sdc`.
            c = c.replace("/dev/disk/by-id/ata-A", str(tmp_path / "srv" / "pool" / "dev0.img"))
            c = c.replace("/dev/disk/by-id/ata-B", str(tmp_path / "disks" / "sdc"))
            script.append(c)
            m = re.match(r"\s*\$B serve (\S+)", c)
            if m and c.rstrip().split("#")[0].rstrip().endswith("&"):
                script.append(
                    f"for i in $(seq 600); do $B --pool {m.group(1)} status >/dev/null 2>&1 "
                    "&& break; sleep 0.1; done")
        script.append("echo QUICK-START-RAN-TO-ITS-END")
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "HOME": str(tmp_path), "BULWARK_REGISTRY": str(tmp_path / "registry.json")}
        (tmp_path / "quick_start.sh").write_text("\n".join(script) + "\n")
        r = subprocess.run(["bash", str(tmp_path / "quick_start.sh")], cwd=work, env=env,
                           capture_output=True, text=True, timeout=LONG_TEST_TIMEOUT_S - 60,
                           stdin=subprocess.DEVNULL)
    skipped = [line for line in script if line.startswith("# skipped: ")]
    assert len(skipped) == 1, f"skipped more than the guest boot: {skipped}"
    assert r.returncode == 0, (f"the Quick start stopped (exit {r.returncode}); the last "
                               f"commands and their output:\n{r.stderr[-6000:]}\n"
                               f"stdout:\n{r.stdout[-3000:]}")
    assert "QUICK-START-RAN-TO-ITS-END" in r.stdout, r.stdout[-3000:]
    # What the last commands promise, as their output says it.
    assert "imported pool tank" in r.stdout, r.stdout[-3000:]
    assert "segments uploaded" in r.stdout, r.stdout[-3000:]
