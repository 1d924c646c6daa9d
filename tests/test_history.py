"""`bulwark history` prints DIR/audit.log as `zpool history` prints a pool's:
one line per record, --json for the records themselves, filters by volume,
client, event and time; it reads the file, so it works with the daemon
stopped, and a torn last line (a crash mid-append) is reported, not fatal."""

import json
import time

from conftest import run


def history(pool, *args, check=True):
    return pool.cli("history", *args, check=check)


def rows(text: str) -> list[list[str]]:
    """Table rows without the header, split on runs of blanks."""
    lines = text.splitlines()
    assert lines[0].split() == ["TIME", "EVENT", "CLIENT", "VOLUME", "RESULT", "DETAIL"], text
    return [l.split() for l in lines[1:]]


def test_history_lines_filters_and_json(pool, tmp_path):
    pool.create_volume("a", size="16M", encryption=False)
    pool.create_volume("b", size="16M", encryption=False)
    pool.cli("grant", "add", "psk:frank", "a", "--read-only")
    r = pool.cli("volume", "destroy", "nosuch", check=False)
    assert r.returncode != 0
    pool.cli("volume", "destroy", "b")

    out = history(pool).stdout
    got = [(r[1], r[2], r[3], r[4]) for r in rows(out)]
    assert got == [
        ("volume_create", "owner", "a", "ok"),
        ("volume_create", "owner", "b", "ok"),
        ("grant_add", "owner", "a", "ok"),
        ("volume_destroy", "owner", "nosuch", "error"),
        ("volume_destroy", "owner", "b", "ok"),
    ], out
    # Time first, UTC; a failed command's detail starts with its error.
    first = rows(out)[0]
    assert first[0].endswith("Z") and "T" in first[0], out
    failed = next(l for l in out.splitlines() if "nosuch" in l)
    assert "error:" in failed, out
    grant = next(l for l in out.splitlines() if "grant_add" in l)
    assert "psk:frank" in grant, out

    # Filters.
    assert [r[1] for r in rows(history(pool, "--volume", "a").stdout)] == ["volume_create", "grant_add"]
    assert [r[3] for r in rows(history(pool, "--event", "volume_destroy").stdout)] == ["nosuch", "b"]
    assert len(rows(history(pool, "--client", "owner").stdout)) == 5
    assert history(pool, "--client", "psk:frank").stdout == "no records\n"
    assert len(rows(history(pool, "--since", "1h").stdout)) == 5
    assert history(pool, "--until", "1h").stdout == "no records\n"
    assert history(pool, "--since", "2000-01-01", "--until", "2000-01-02T00:00:00+01:00").stdout == "no records\n"
    stamp = rows(out)[2][0]                       # the grant's time, as the log wrote it
    assert [r[1] for r in rows(history(pool, "--since", stamp, "--volume", "a").stdout)] == ["grant_add"]
    r = history(pool, "--since", "yesterday", check=False)
    assert r.returncode == 2 and "invalid time 'yesterday'" in r.stderr, r.stderr

    # --json: the log's own lines, filtered.
    lines = history(pool, "--json", "--volume", "b").stdout.splitlines()
    records = [json.loads(l) for l in lines]
    assert [(x["event"], x["volume"], x["result"]) for x in records] == [
        ("volume_create", "b", "ok"), ("volume_destroy", "b", "ok")]
    log_lines = (pool.dir / "audit.log").read_text().splitlines()
    assert all(l in log_lines for l in lines)


def test_history_without_daemon_and_torn_last_line(pool):
    pool.create_volume("v", size="16M", encryption=False)
    pool.stop()
    # A crash in the middle of an append leaves a line without its newline.
    with open(pool.dir / "audit.log", "a") as f:
        f.write('{"time":"2030-01-01T00:00:00.000Z","event":"volume_cre')
    r = history(pool)
    assert r.returncode == 0
    assert [(x[1], x[3]) for x in rows(r.stdout)] == [("volume_create", "v")], r.stdout
    assert "last line is incomplete" in r.stderr, r.stderr
    r = history(pool, "--json")
    assert len(r.stdout.splitlines()) == 1 and "incomplete" in r.stderr


def test_history_of_a_pool_without_log(make_pool, tmp_path):
    pool = make_pool().create()
    (pool.dir / "audit.log").unlink(missing_ok=True)
    r = history(pool)
    assert r.returncode == 0 and r.stdout == "" and "no history yet" in r.stderr, r
    r = run([pool.bin, "--pool", tmp_path / "nope", "history"], check=False)
    assert r.returncode == 1 and "cannot read" in r.stderr, r.stderr
