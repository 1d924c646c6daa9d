"""Key slots: a volume created with a key file gets a passphrase slot too;
either opens it. Removing the key-file slot makes that key file a wrong key
while the passphrase still works; changing the passphrase refuses the old one
and accepts the new one; the data never changes. The last slot cannot be
removed, `key list` shows kinds and costs but no secret, a key file other
users can read is refused, and every operation is one audit line without a
secret."""

import json
import os

from conftest import (make_key_file, make_passphrase_file, qemu_io_ok, require_tools,
                      stderr_lines)
from keyutil import (assert_no_secret_in_audit, assert_one_line_error, assert_wrong_key,
                     audited)

PASS1 = "first passphrase: tangerine 4411"
PASS2 = "second passphrase: marmalade 9902"


def verify(pool):
    qemu_io_ok(pool.uri("v"), "read -P 0x5a 0 4M", "read -P 0 4M 4M", "read -P 0xa5 8M 1M",
               what="data after key changes")


def kinds(pool):
    r = pool.cli("key", "list", "v", "--json")
    return [s["kind"] for s in json.loads(r.stdout)]


def reload(pool, opt, path):
    pool.wait_detached("v")  # the last verify's qemu-io may not be counted out yet
    pool.cli("key", "unload", "v")
    pool.cli("key", "load", "v", opt, path)


def test_key_slots(pool, tmp_path):
    require_tools("qemu-io")
    key = pool.create_volume("v", size="64M")
    qemu_io_ok(pool.uri("v"), "write -P 0x5a 0 4M", "write -P 0xa5 8M 1M")
    pw1 = make_passphrase_file(tmp_path / "pw1", PASS1)
    pw2 = make_passphrase_file(tmp_path / "pw2", PASS2)

    # A second slot, for a passphrase.
    r = pool.cli("key", "add", "v", "--passphrase-file", pw1)
    assert "slot 1" in r.stdout, r.stdout
    assert kinds(pool) == ["key_file", "passphrase"]
    assert pool.volume_status("v")["key_slots"] == 2
    table = pool.cli("key", "list", "v").stdout
    assert table.splitlines()[0].split() == ["SLOT", "KIND", "KDF"], table
    assert "argon2id" in table and "key_file" in table, table
    listed = pool.cli("volume", "list", "--json").stdout
    assert json.loads(listed)[0]["key_slots"] == 2

    # Either secret opens it.
    reload(pool, "--key-file", key)
    verify(pool)
    reload(pool, "--passphrase-file", pw1)
    verify(pool)

    # The key-file slot goes: the key file is now a wrong key; the passphrase still works.
    pool.cli("key", "remove", "v", "--key-file", key)
    assert kinds(pool) == ["passphrase"]
    pool.wait_detached("v")
    pool.cli("key", "unload", "v")
    assert_wrong_key(pool.cli("key", "load", "v", "--key-file", key, check=False),
                     "removed key file")
    assert pool.volume_status("v")["locked"] is True
    pool.cli("key", "load", "v", "--passphrase-file", pw1)
    verify(pool)

    # A new passphrase in the same slot: the old one is refused, the new one works.
    r = pool.cli("key", "change", "v", "--passphrase-file", pw1, "--new-passphrase-file", pw2)
    assert "slot 0" in r.stdout, r.stdout
    assert kinds(pool) == ["passphrase"]
    pool.wait_detached("v")
    pool.cli("key", "unload", "v")
    assert_wrong_key(pool.cli("key", "load", "v", "--passphrase-file", pw1, check=False),
                     "old passphrase after change")
    pool.cli("key", "load", "v", "--passphrase-file", pw2)
    verify(pool)

    # The last slot stays.
    r = pool.cli("key", "remove", "v", "--passphrase-file", pw2, check=False)
    assert_one_line_error(r, r"last key slot", "removing the last slot")
    assert kinds(pool) == ["passphrase"]

    # A secret file other users can read is refused, and nothing changes.
    loose = make_key_file(tmp_path / "loose.key")
    os.chmod(loose, 0o644)
    r = pool.cli("key", "add", "v", "--key-file", loose, check=False)
    assert_one_line_error(r, r"mode 0644.*chmod 600|chmod 600.*0644", "key file mode 0644")
    assert kinds(pool) == ["passphrase"]
    os.chmod(loose, 0o600)
    pool.cli("key", "add", "v", "--key-file", loose)
    assert kinds(pool) == ["passphrase", "key_file"]

    # A slot of a locked volume cannot be added (the volume key is needed to wrap it).
    pool.wait_detached("v")
    pool.cli("key", "unload", "v")
    other = make_key_file(tmp_path / "other.key")
    r = pool.cli("key", "add", "v", "--key-file", other, check=False)
    assert_one_line_error(r, r"locked", "key add on a locked volume")

    # Every change is durable.
    pool.restart()
    assert kinds(pool) == ["passphrase", "key_file"]
    assert_wrong_key(pool.cli("key", "load", "v", "--passphrase-file", pw1, check=False),
                     "old passphrase after restart")
    assert_wrong_key(pool.cli("key", "load", "v", "--key-file", key, check=False),
                     "removed key file after restart")
    pool.cli("key", "load", "v", "--key-file", loose)
    verify(pool)
    reload(pool, "--passphrase-file", pw2)
    verify(pool)

    # `key list` prints no secret, in either form.
    for args in (("key", "list", "v"), ("key", "list", "v", "--json")):
        out = pool.cli(*args).stdout
        for k in (key, loose):
            assert k.read_bytes().hex() not in out.lower()
            assert str(k) not in out, "a secret file's path in key list"
        assert PASS1 not in out and PASS2 not in out

    # The audit log: one line per operation, failures included, no secret.
    assert audited(pool, "key_add", volume="v", secret="passphrase_file", slot=1)
    assert audited(pool, "key_add", volume="v", secret="key_file", slot=1)
    assert audited(pool, "key_add", "error", volume="v", secret="key_file")
    assert audited(pool, "key_remove", volume="v", secret="key_file", slots=[0])
    assert audited(pool, "key_remove", "error", volume="v", secret="passphrase_file")
    assert audited(pool, "key_change", volume="v", old="passphrase_file", new="passphrase_file")
    assert audited(pool, "key_list", volume="v")
    wrong = audited(pool, "key_load", "error", volume="v")
    assert len(wrong) == 4, wrong
    assert_no_secret_in_audit(pool, key_files=(key, loose, other), passphrases=(PASS1, PASS2))


def test_one_secret_never_opens_two_slots(pool, tmp_path):
    """`key change` refuses a new secret that already opens another slot, in the
    words of `key add`; `key remove` then tells the truth: afterwards the removed
    passphrase opens nothing. (A change to "alpha" used to be accepted, leaving
    "alpha" in two slots, and `key remove` of "alpha" removed one of them, said
    "that passphrase no longer opens it", and "alpha" still unlocked the volume.)"""
    require_tools("qemu-io")
    a = make_passphrase_file(tmp_path / "a.pass", "alpha\n")
    b = make_passphrase_file(tmp_path / "b.pass", "beta\n")
    pool.create_volume("kc", size="16M", passphrase_file=a)
    qemu_io_ok(pool.uri("kc"), "write -P 0x5a 0 1M", "flush")
    pool.cli("key", "add", "kc", "--passphrase-file", b)

    r = pool.cli("key", "add", "kc", "--passphrase-file", a, check=False)
    assert_one_line_error(r, r"already opens a key slot", "key add of a secret in use")
    added = stderr_lines(r)[0]
    r = pool.cli("key", "change", "kc", "--passphrase-file", b, "--new-passphrase-file", a,
                 check=False)
    assert_one_line_error(r, r"already opens a key slot", "key change to a secret in use")
    assert stderr_lines(r)[0] == added, "key change and key add word the refusal differently"
    assert len(json.loads(pool.cli("key", "list", "kc", "--json").stdout)) == 2
    assert audited(pool, "key_change", "error", volume="kc")

    # Nothing changed: "beta" still opens its slot.
    pool.wait_detached("kc")
    pool.cli("key", "unload", "kc")
    pool.cli("key", "load", "kc", "--passphrase-file", b)

    # Removing "alpha" leaves "alpha" opening nothing, as the command says.
    r = pool.cli("key", "remove", "kc", "--passphrase-file", a)
    assert r.stdout == "removed key slot 0 of volume kc: that passphrase no longer opens it\n", \
        r.stdout
    assert audited(pool, "key_remove", volume="kc", secret="passphrase_file", slots=[0])
    pool.cli("key", "unload", "kc")
    assert_wrong_key(pool.cli("key", "load", "kc", "--passphrase-file", a, check=False),
                     "removed passphrase")
    pool.cli("key", "load", "kc", "--passphrase-file", b)
    qemu_io_ok(pool.uri("kc"), "read -P 0x5a 0 1M", what="data after the key changes")

    # `key remove --help` says what happens to a secret in several slots.
    help_text = " ".join(pool.cli("key", "remove", "--help").stdout.split())
    assert "every one of them is removed" in help_text, help_text
