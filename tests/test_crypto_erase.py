"""Crypto-erase, by `key erase NAME --yes` and by `volume destroy NAME
--crypto-erase`: afterwards the old passphrase and key file open nothing (the
message says the keys were erased), the data cannot be read, and no table key
that was in a superblock before the erase is left anywhere on any device, so
older copies of the volume table (the only other places the wrapped keys ever
were) cannot be decrypted. Other volumes keep working. `key erase` without
--yes asks at a terminal and refuses without one."""

import json

from conftest import make_passphrase_file, qemu_io_ok, require_tools, run
from keyutil import (assert_no_secret_in_audit, assert_one_line_error, audited, find_anywhere,
                     table_keys)

PASS = "erase me: quartz lantern 5150"
ERASED = r"keys of volume 'e' were erased"


def keys_before(pool):
    """The table keys now, and a check that the scan finds them (so it could fail)."""
    devices = pool.device_paths()
    keys = table_keys(devices)
    found = find_anywhere(devices, keys)
    for k, where in found.items():
        assert where, f"the scan does not find table key {k.hex()} that is in a superblock"
    return keys


def assert_keys_gone(pool, old_keys):
    pool.stop()  # nothing in flight while the files are read
    devices = pool.device_paths()
    new_keys = table_keys(devices)
    assert not (new_keys & old_keys), "a superblock still holds a table key from before the erase"
    left = {k.hex(): where for k, where in find_anywhere(devices, old_keys).items() if where}
    assert not left, f"old table keys are still on the devices: {left}"
    assert all(find_anywhere(devices, new_keys).values()), "the scan misses the new table key"
    pool.start()


def test_key_erase(pool, tmp_path):
    require_tools("qemu-io", "nbdinfo")
    key = pool.create_volume("e", size="32M")
    pw = make_passphrase_file(tmp_path / "pw", PASS)
    pool.cli("key", "add", "e", "--passphrase-file", pw)
    qemu_io_ok(pool.uri("e"), "write -P 0x6b 0 8M")
    keep = pool.create_volume("keep", size="16M")
    qemu_io_ok(pool.uri("keep"), "write -P 0x4b 0 2M")

    # Without --yes and without a terminal: refused, nothing erased.
    for stdin in ("", "e\n"):
        r = run([pool.bin, "--pool", pool.dir, "key", "erase", "e"], check=False, input=stdin)
        assert r.returncode == 2, r
        assert_one_line_error(r, r"--yes", "key erase without --yes")
    assert pool.volume_status("e")["key_slots"] == 2

    old = keys_before(pool)
    pool.wait_detached("e")
    r = pool.cli("key", "erase", "e", "--yes")
    assert "unrecoverable" in r.stdout, r.stdout
    v = pool.volume_status("e")
    assert (v["locked"], v["key_slots"], v["rotation"]) == (True, 0, None), v
    assert "e" not in pool.exports()
    assert run(["nbdinfo", pool.uri("e")], check=False).returncode != 0
    for opt, f in (("--key-file", key), ("--passphrase-file", pw)):
        assert_one_line_error(pool.cli("key", "load", "e", opt, f, check=False), ERASED,
                              f"key load {opt} after erase")
    # Every command that needs the key says the keys were erased, not "load its key"
    # (which `key load` then refuses).
    for cmd in (["key", "add", "e", "--passphrase-file", pw], ["key", "rotate", "e"],
                ["image", "export", "e", str(tmp_path / "e.raw")]):
        r = pool.cli(*cmd, check=False)
        assert_one_line_error(r, ERASED + r".*destroy it", " ".join(cmd[:2]) + " after erase")
    # One vocabulary in both tables: KEY says erased.
    for table in (pool.cli("status").stdout, pool.cli("volume", "list").stdout):
        row = next(l.split() for l in table.splitlines() if l.split()[:1] == ["e"])
        assert row[6] == "erased", table

    assert_keys_gone(pool, old)

    # After a restart: still erased, the other volume still opens with its data.
    for opt, f in (("--key-file", key), ("--passphrase-file", pw)):
        assert_one_line_error(pool.cli("key", "load", "e", opt, f, check=False), ERASED,
                              f"key load {opt} after erase and restart")
    pool.load_key("keep", keep)
    qemu_io_ok(pool.uri("keep"), "read -P 0x4b 0 2M", "read -P 0 2M 14M")

    # The erased volume can still be destroyed.
    pool.cli("volume", "destroy", "e")
    assert [v["name"] for v in pool.status()["volumes"]] == ["keep"]

    assert audited(pool, "key_erase", volume="e")
    assert audited(pool, "key_load", "error", volume="e", secret="passphrase_file")
    assert_no_secret_in_audit(pool, key_files=(key, keep), passphrases=(PASS,))


def test_volume_destroy_crypto_erase(pool):
    require_tools("qemu-io", "nbdinfo")
    key = pool.create_volume("d", size="32M")
    qemu_io_ok(pool.uri("d"), "write -P 0x64 0 8M")
    keep = pool.create_volume("keep", size="16M")
    qemu_io_ok(pool.uri("keep"), "write -P 0x4b 0 2M")
    pool.create_volume("plain", size="16M", encryption=False)

    # A volume without encryption has no keys to erase: refused, and it is not destroyed.
    r = pool.cli("volume", "destroy", "plain", "--crypto-erase", check=False)
    assert_one_line_error(r, r"not encrypted", "crypto-erase of a plain volume")
    assert "plain" in [v["name"] for v in pool.status()["volumes"]]

    old = keys_before(pool)
    pool.wait_detached("d")
    r = pool.cli("volume", "destroy", "d", "--crypto-erase")
    assert "erased the keys of volume d" in r.stdout and "destroyed volume d" in r.stdout, r.stdout
    names = [v["name"] for v in json.loads(pool.cli("volume", "list", "--json").stdout)]
    assert "d" not in names, names
    assert "d" not in pool.exports()
    assert run(["nbdinfo", pool.uri("d")], check=False).returncode != 0
    r = pool.cli("key", "load", "d", "--key-file", key, check=False)
    assert_one_line_error(r, r"\bd\b", "key load of a destroyed volume")

    assert_keys_gone(pool, old)

    pool.load_key("keep", keep)
    qemu_io_ok(pool.uri("keep"), "read -P 0x4b 0 2M", "read -P 0 2M 14M")
    lines = audited(pool, "key_erase", volume="d")
    assert len(lines) == 1, lines
    assert audited(pool, "volume_destroy", volume="d")
    assert audited(pool, "key_erase", "error", volume="plain")
    assert_no_secret_in_audit(pool, key_files=(key, keep))


def test_destroy_with_crypto_erase_of_a_volume_with_snapshots_needs_r_first(pool):
    """`volume destroy --crypto-erase` of a volume with snapshots is refused before the
    erase when -r is missing (else its keys would be gone and the volume kept); with -r
    both happen."""
    require_tools("qemu-io")
    key = pool.create_volume("snappy")
    qemu_io_ok(pool.uri("snappy"), "write -P 0x5a 0 1M", "flush")
    pool.cli("snapshot", "create", "snappy@one")
    r = pool.cli("volume", "destroy", "snappy", "--crypto-erase", check=False)
    assert r.returncode != 0
    assert "snapshot" in r.stderr and "-r" in r.stderr and "nothing was erased" in r.stderr
    # Nothing was erased: the data still reads with the key.
    qemu_io_ok(pool.uri("snappy"), "read -P 0x5a 0 1M")
    pool.wait_detached("snappy")
    pool.cli("volume", "destroy", "snappy", "--crypto-erase", "-r")
    names = [v["name"] for v in json.loads(pool.cli("volume", "list", "--json").stdout)]
    assert "snappy" not in names
    assert key is not None
