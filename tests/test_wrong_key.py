"""A wrong key file or a wrong passphrase is refused with one clear line; the
volume stays locked, is not listed and cannot be opened over NBD; the right
key (or passphrase) then unlocks it with its data intact."""

import re

from conftest import make_key_file, make_passphrase_file, qemu_io_ok, require_tools, run, stderr_lines

WRONG = re.compile(r"(wrong|incorrect|invalid|bad).{0,20}(key|passphrase)|(key|passphrase).{0,30}(wrong|incorrect|does not match|invalid)", re.I)
NOISE = ("panicked", "Traceback", "RUST_BACKTRACE", "stack backtrace")


def assert_refused(r, what):
    lines = stderr_lines(r)
    assert r.returncode != 0, f"{what}: exit 0\nstdout:{r.stdout}\nstderr:{r.stderr}"
    assert len(lines) == 1, f"{what}: expected one line on stderr, got {len(lines)}:\n{r.stderr}"
    assert WRONG.search(lines[0]), f"{what}: stderr does not say the key is wrong: {lines[0]!r}"
    for n in NOISE:
        assert n not in r.stderr + r.stdout, f"{what}: {n!r} in output:\n{r.stderr}"


def assert_locked_and_hidden(pool, name, what):
    assert pool.volume_status(name)["locked"] is True, f"{what}: {name} not locked"
    exports = pool.exports()
    assert "open" in exports, f"{what}: unlocked volume 'open' not listed: {exports}"
    assert name not in exports, f"{what}: locked volume {name} is listed: {exports}"
    r = run(["nbdinfo", pool.uri(name)], check=False)
    assert r.returncode != 0, f"{what}: nbdinfo opened locked volume {name}:\n{r.stdout}"
    r = run(["qemu-io", "-f", "raw", "-c", "read 0 4k", pool.uri(name)], check=False)
    assert r.returncode != 0 or "read 4096/4096" not in r.stdout, \
        f"{what}: qemu-io read from locked volume {name}:\n{r.stdout}{r.stderr}"


def test_wrong_key(pool, tmp_path):
    require_tools("nbdinfo", "qemu-io")
    key = pool.create_volume("kv", size="32M")
    pw = make_passphrase_file(tmp_path / "pw", "correct horse battery staple")
    pool.create_volume("pv", size="32M", passphrase_file=pw)
    pool.create_volume("open", size="16M", encryption=False)
    qemu_io_ok(pool.uri("kv"), "write -P 0x4b 0 1M")
    qemu_io_ok(pool.uri("pv"), "write -P 0x50 0 1M")

    pool.restart()
    for name in ("kv", "pv"):
        assert_locked_and_hidden(pool, name, "after restart")

    wrong_key = make_key_file(tmp_path / "wrong.key")
    wrong_pw = make_passphrase_file(tmp_path / "wrong.pw", "correct horse battery stapler")
    assert_refused(pool.cli("key", "load", "kv", "--key-file", wrong_key, check=False), "wrong key file")
    assert_refused(pool.cli("key", "load", "pv", "--passphrase-file", wrong_pw, check=False), "wrong passphrase")
    for name in ("kv", "pv"):
        assert_locked_and_hidden(pool, name, "after a wrong key")

    pool.load_key("kv", key)
    pool.load_key("pv", pw, passphrase=True)
    for name, pattern in (("kv", "0x4b"), ("pv", "0x50")):
        assert pool.volume_status(name)["locked"] is False
        assert name in pool.exports()
        qemu_io_ok(pool.uri(name), f"read -P {pattern} 0 1M", "read -P 0 1M 1M")
