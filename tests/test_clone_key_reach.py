"""A clone's key opens more than its snapshot (issue 41 part 4): `volume clone` says so,
and `volume get` shows it (originkeys): the clone holds copies of the origin's data keys
up to the clone, which read everything the origin held until then (blocks overwritten
after the snapshot, newer snapshots); `--independent` is named as the way to hold only
what the snapshot holds, and once its rewrite is done the inherited keys are gone."""

import json
import time

from conftest import make_key_file


def originkeys(pool, name):
    r = pool.cli("volume", "get", name, "originkeys", "--json")
    [row] = json.loads(r.stdout)
    return row["value"]


def test_clone_names_what_its_key_opens_and_independent(pool):
    pool.create_volume("v1", size="16M")
    pool.cli("snapshot", "create", "v1@s1")
    k2 = make_key_file(pool.keys_dir / "c.key")
    out = pool.cli("volume", "clone", "v1@s1", "c", "--key-file", k2).stdout
    assert "v1's data keys up to the clone" in out, out
    assert "everything v1 held until the clone, not only v1@s1" in out, out
    assert "overwritten after the snapshot" in out and "newer snapshots" in out, out
    assert "--independent" in out, out

    assert originkeys(pool, "c") >= 1
    text = pool.cli("volume", "get", "c", "originkeys").stdout
    assert "reads v1's data up to the clone" in text and "--independent" in text, text
    assert originkeys(pool, "v1") == 0
    assert "originkeys" in pool.cli("volume", "get", "v1").stdout

    # --independent: said, and once the rewrite is done the inherited keys are gone.
    k3 = make_key_file(pool.keys_dir / "d.key")
    out = pool.cli("volume", "clone", "v1@s1", "d", "--key-file", k3, "--independent").stdout
    assert "v1's data keys up to the clone" in out, out
    assert "--independent drops those keys" in out, out
    deadline = time.monotonic() + 60
    while originkeys(pool, "d") != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert originkeys(pool, "d") == 0
    assert pool.cli("volume", "get", "d", "originkeys").stdout.split()[-2:] == ["-", "-"]
