"""Every user mistake gets one line on stderr and a non-zero exit, never a
usage dump, traceback or panic: a bad size, a bad layout, a missing key
option, an unknown volume, a daemon that is not running."""

import re


from conftest import Pool, make_key_file, stderr_lines

NOISE = ("panicked", "Traceback", "stack backtrace", "RUST_BACKTRACE", "Usage:", "For more information")


def assert_one_line_error(r, what, mentions):
    lines = stderr_lines(r)
    assert r.returncode != 0, f"{what}: exit 0\nstdout:{r.stdout}\nstderr:{r.stderr}"
    for n in NOISE:
        assert n not in r.stderr + r.stdout, f"{what}: {n!r} in output:\n{r.stderr}"
    assert len(lines) == 1, f"{what}: expected one line on stderr, got {len(lines)}:\n{r.stderr}"
    assert re.search(mentions, lines[0], re.I), f"{what}: {lines[0]!r} does not mention /{mentions}/"


def test_pool_create_errors(make_pool):
    p = make_pool()
    cases = [
        ("bad layout", ["--layout", "raid9", "--devices", "1", "--device-size", "64M"], r"layout|raid9"),
        ("mirror wider than the devices", ["--layout", "mirror:3", "--devices", "2", "--device-size", "64M"],
         r"mirror|device|layout"),
        ("bad device size", ["--layout", "single", "--devices", "1", "--device-size", "12Q"], r"size|12Q"),
        ("missing device size", ["--layout", "single", "--devices", "1"], r"device-size|size"),
        ("device size past 64 bits", ["--devices", "1", "--device-size", "99999999T"], r"too large"),
        ("device size past what a file can be", ["--devices", "1", "--device-size", "8E"],
         r"larger than a file"),
        ("parity with a device missing", ["--layout", "parity:4+2", "--devices", "5",
                                          "--device-size", "64M"], r"6 devices"),
    ]
    for what, args, mentions in cases:
        r = p.bulwark("pool", "create", p.dir, *args, check=False)
        assert_one_line_error(r, f"pool create ({what})", mentions)
        # Nothing of a failed create is left: the same command with a good
        # value works at once.
        assert not p.dir.exists(), f"pool create ({what}) left {list(p.dir.iterdir())}"
    r = p.bulwark("pool", "create", p.dir, "--devices", "1", "--device-size", "64M", check=False)
    assert r.returncode == 0, r.stderr


def test_daemon_not_running(make_pool):
    p = make_pool().create()
    for args in (["status"], ["volume", "list"], ["volume", "destroy", "x"]):
        r = p.cli(*args, check=False)
        assert_one_line_error(r, f"{' '.join(args)} without a daemon", r"not running|daemon|serve|control|connect")
    r = Pool(p.tmp / "nowhere").cli("status", check=False)
    assert_one_line_error(r, "status on a directory that does not exist", r"no pool directory .*nowhere")
    (p.tmp / "empty").mkdir()
    r = Pool(p.tmp / "empty").bulwark("--pool", p.tmp / "empty" / "pool", "status", check=False)
    assert_one_line_error(r, "status on a directory that is no pool", r"no pool directory|no bulwark pool")
    r = p.bulwark("--pool", p.tmp / "empty", "status", check=False)
    assert_one_line_error(r, "status on an empty directory", r"no bulwark pool in .*empty")
    (p.tmp / "empty" / "dev0.img").write_bytes(b"")
    r = p.bulwark("--pool", p.tmp / "empty" / "dev0.img", "volume", "list", check=False)
    assert_one_line_error(r, "--pool naming a file", r"dev0\.img is not a pool directory but a file")


def test_volume_and_key_errors(pool, tmp_path):
    key = make_key_file(tmp_path / "k")
    cases = [
        ("bad size", ["volume", "create", "v1", "--size", "12Q", "--key-file", key], r"size|12Q"),
        # The number the user typed is named, never one cut from it.
        ("fraction of a byte", ["volume", "create", "v1", "--size", "1.5", "--key-file", key],
         r"'1\.5': not a whole number of bytes"),
        ("negative size", ["volume", "create", "v1", "--size", "-1", "--key-file", key],
         r"invalid size '-1'"),
        ("size past 1E", ["volume", "create", "v1", "--size", "2E", "--key-file", key],
         r"volume size 2E .*use 1 block to 1E"),
        ("bad block size", ["volume", "create", "v1", "--size", "64M", "--block-size", "3000",
                            "--key-file", key], r"block"),
        ("encrypted without a key", ["volume", "create", "v1", "--size", "64M"], r"key|passphrase"),
        ("key file of the wrong length", ["volume", "create", "v1", "--size", "64M",
                                          "--key-file", tmp_path / "short.key"], r"key|32|bytes"),
        ("missing key file", ["volume", "create", "v1", "--size", "64M",
                              "--key-file", tmp_path / "absent.key"], r"absent\.key|no such|not found"),
        ("key file from standard input", ["volume", "create", "v1", "--size", "64M",
                                          "--key-file", "-"], r"standard input"),
        ("passphrase from a pipe", ["volume", "create", "v1", "--size", "64M",
                                    "--passphrase-file", "/dev/stdin"], r"standard input"),
        ("destroy unknown volume", ["volume", "destroy", "nosuch"], r"nosuch"),
        ("load key of unknown volume", ["key", "load", "nosuch", "--key-file", key], r"nosuch"),
        ("unload key of unknown volume", ["key", "unload", "nosuch"], r"nosuch"),
        ("load key without a key option", ["key", "load", "nosuch"], r"key|passphrase"),
    ]
    (tmp_path / "short.key").write_bytes(b"0123456789")
    for what, args, mentions in cases:
        r = pool.cli(*args, check=False)
        assert_one_line_error(r, what, mentions)
    names = [v["name"] for v in pool.status()["volumes"]]
    assert names == [], f"failed creates left volumes behind: {names}"

    # A duplicate name is refused and leaves the first volume alone.
    pool.create_volume("dup", size="16M")
    r = pool.cli("volume", "create", "dup", "--size", "32M", "--key-file", key, check=False)
    assert_one_line_error(r, "duplicate volume", r"dup")
    assert pool.volume_status("dup")["size_bytes"] == 16 * 1024 * 1024


def test_serve_checks_its_options_before_touching_the_pool(make_pool, tmp_path):
    """A `serve` whose options are wrong fails with one line before it imports
    the pool: an import commits, so each failed try used to write the devices."""
    import hashlib

    p = make_pool().create()

    def devices_digest():
        return [hashlib.sha256(open(d, "rb").read()).hexdigest() for d in sorted(p.dir.glob("*.img"))]

    before = devices_digest()
    cases = [
        ("TCP without TLS", ["--nbd-listen", "127.0.0.1:0"], r"requires TLS"),
        ("a PSK file that does not exist", ["--nbd-listen", "127.0.0.1:0", "--tls-psk",
                                            tmp_path / "absent.psk"], r"absent\.psk|TLS"),
        ("a port out of range", ["--nbd-listen", "127.0.0.1:99999", "--nbd-plaintext"],
         r"99999|listen"),
        ("TLS without a TCP listener", ["--tls-psk", tmp_path / "absent.psk"], r"nbd-listen|absent\.psk"),
    ]
    for what, args, mentions in cases:
        r = p.bulwark("serve", p.dir, *args, check=False, timeout=60)
        assert r.returncode != 0, f"serve ({what}) started"
        lines = [l for l in stderr_lines(r) if "error" in l.lower()]
        assert lines and re.search(mentions, lines[-1], re.I), f"serve ({what}):\n{r.stderr}"
        assert "pool imported" not in r.stderr, f"serve ({what}) imported the pool:\n{r.stderr}"
        assert devices_digest() == before, f"serve ({what}) wrote the devices"


def test_a_lost_pool_json_is_named_as_such(make_pool):
    """Devices whose pool.json is gone are still a pool: the message says so and
    does not send the admin to `pool create` (which would destroy them)."""
    p = make_pool(layout="mirror:2", devices=2, device_size="64M").create()
    (p.dir / "pool.json").rename(p.tmp / "pool.json.saved")
    r = p.bulwark("serve", p.dir, check=False, timeout=60)
    assert_one_line_error(r, "serve without pool.json", r"labels of bulwark pool")
    assert "pool create" not in r.stderr and "restore" in r.stderr, r.stderr
    (p.dir / "pool.json").write_text("{")
    r = p.bulwark("serve", p.dir, check=False, timeout=60)
    assert_one_line_error(r, "serve with a broken pool.json", r"pool\.json.*restore")
