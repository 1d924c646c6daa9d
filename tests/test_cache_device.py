"""The cache device (`--cache-device`, docs/cache.md): copies of hot records on a device
of their own, as stored on the pool.

- data read back through the cache is the data written, and a second read is served
  by it (hits counted); the cache survives a restart warm;
- after reads of an encrypted volume, the cache device holds none of its plaintext (the
  same scan finds an unencrypted volume's data there, so it is not blind);
- every byte range of the cache device damaged while the daemon runs: reads still return
  the right data, and `status` counts the copies that failed their checksum;
- the cache device missing at a restart: the pool serves without it, and says so;
- `serve --cache-device` uses one the pool was not created with.
"""

import os
import secrets

import pytest

from conftest import KiB, MiB, LONG_TEST_TIMEOUT_S, qemu_io_ok, require_tools, run, wait_until

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)

CACHE_BYTES = 64 * MiB
DATA_BYTES = 4 * MiB


def marker(token: bytes, n: int) -> bytes:
    unit = b"BULWARK-CACHE-MARKER:" + token + b"|"
    return (unit * (n // len(unit) + 1))[:n]


def make_cache_file(path, size=CACHE_BYTES):
    with open(path, "wb") as f:
        f.truncate(size)
    os.chmod(path, 0o600)
    return path


def cache_pool(make_pool, tmp_path, **kw):
    cache = make_cache_file(tmp_path / "cache.img")
    pool = make_pool(**kw)
    pool.create("--devices", "1", "--device-size", "256M", "--cache-device", str(cache))
    pool.start()
    return pool, cache


def read_volume(pool, name, tmp_path, tag):
    out = tmp_path / f"{name}.{tag}.out"
    run(["nbdcopy", pool.uri(name), str(out)])
    return out.read_bytes()


def cache_status(pool):
    c = pool.status().get("cache_device")
    assert c is not None, f"status shows no cache device: {pool.status()}"
    return c


def fill(pool, name, tmp_path, data, records):
    """Write `data` at 0 of volume `name`, flush, read it back (misses: the cache fills),
    and wait until the writer thread has written at least `records` records."""
    img = tmp_path / f"{name}.in"
    img.write_bytes(data)
    qemu_io_ok(pool.uri(name), f"write -s {img} 0 {len(data)}", "flush")
    before = cache_status(pool)["fills"]
    got = read_volume(pool, name, tmp_path, "fill")
    assert got[:len(data)] == data, f"{name}: first read (from the pool) differs"
    c = wait_until(lambda: cache_status(pool), lambda c: c["fills"] >= before + records)
    assert c["fills"] >= before + records, f"the cache did not fill: {c}"


def scan(path, needle):
    data = open(path, "rb").read()
    return data.find(needle)


def test_reads_through_the_cache_keep_no_plaintext_and_survive_restart(make_pool, tmp_path):
    require_tools("qemu-io", "nbdcopy")
    pool, cache = cache_pool(make_pool, tmp_path)
    c = cache_status(pool)
    assert c["state"] == "ONLINE" and c["size_bytes"] > 60 * MiB, c
    secret_token = secrets.token_hex(16).encode()
    plain_token = secrets.token_hex(16).encode()
    pool.create_volume("secret", size="32M", compression="off")
    pool.create_volume("plain", size="32M", encryption=False, compression="off")
    secret = marker(secret_token, DATA_BYTES)
    plain = marker(plain_token, DATA_BYTES)
    blocks = DATA_BYTES // (4 * KiB)
    fill(pool, "secret", tmp_path, secret, blocks)
    fill(pool, "plain", tmp_path, plain, blocks)

    hits = cache_status(pool)["hits"]
    assert read_volume(pool, "secret", tmp_path, "hit")[:DATA_BYTES] == secret
    assert read_volume(pool, "plain", tmp_path, "hit")[:DATA_BYTES] == plain
    c = cache_status(pool)
    assert c["hits"] >= hits + 2 * blocks, f"second reads were not served by the cache: {c}"
    assert c["errors"] == 0 and c["used_bytes"] > 2 * DATA_BYTES, c
    assert 0 < c["hit_rate"] <= 1, c
    assert "cache:" in pool.cli("status").stdout

    pool.stop()
    # The scan can see: the unencrypted volume's data is in the cache file.
    assert scan(cache, plain_token) >= 0, "unencrypted data not found in the cache: the scan is blind"
    assert scan(cache, secret_token) < 0, "plaintext of the encrypted volume found on the cache device"

    # Warm after a restart: the index is rebuilt from the device, and reads hit.
    key = pool.keys_dir / "secret.key"
    pool.start()
    c = wait_until(lambda: cache_status(pool), lambda c: c["state"] == "ONLINE")
    assert c["entries"] >= 2 * blocks, f"the cache came back cold: {c}"
    pool.load_key("secret", key)
    assert read_volume(pool, "secret", tmp_path, "warm")[:DATA_BYTES] == secret
    c = cache_status(pool)
    assert c["hits"] >= blocks and c["errors"] == 0, c


def test_a_damaged_cache_device_never_returns_wrong_bytes(make_pool, tmp_path):
    require_tools("qemu-io", "nbdcopy")
    pool, cache = cache_pool(make_pool, tmp_path)
    pool.create_volume("secret", size="32M", compression="off")
    pool.create_volume("plain", size="32M", encryption=False, compression="off")
    secret = os.urandom(DATA_BYTES)
    plain = os.urandom(DATA_BYTES)
    blocks = DATA_BYTES // (4 * KiB)
    fill(pool, "secret", tmp_path, secret, blocks)
    fill(pool, "plain", tmp_path, plain, blocks)

    # Flip a byte in every 512 of the whole device, while the daemon runs.
    size = os.path.getsize(cache)
    with open(cache, "r+b") as f:
        for off in range(0, size, 64 * KiB):
            f.seek(off)
            chunk = bytearray(f.read(64 * KiB))
            for i in range(0, len(chunk), 512):
                chunk[i + 300] ^= 0x5A
            f.seek(off)
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())

    assert read_volume(pool, "secret", tmp_path, "damaged")[:DATA_BYTES] == secret
    assert read_volume(pool, "plain", tmp_path, "damaged")[:DATA_BYTES] == plain
    c = cache_status(pool)
    assert c["errors"] >= 2 * blocks, f"damaged copies not counted: {c}"
    assert "errors detected" in pool.cli("status").stdout
    # Pool devices were not blamed: the damage was the cache's.
    for d in pool.status()["devices"]:
        assert d["cksum_errors"] == 0, d
    # Read again: the dropped entries are filled anew and serve good copies.
    assert read_volume(pool, "secret", tmp_path, "again")[:DATA_BYTES] == secret


def test_a_missing_cache_device_leaves_the_pool_serving(make_pool, tmp_path):
    require_tools("qemu-io", "nbdcopy")
    pool, cache = cache_pool(make_pool, tmp_path)
    key = pool.create_volume("v", size="32M")
    data = os.urandom(DATA_BYTES)
    fill(pool, "v", tmp_path, data, DATA_BYTES // (4 * KiB))
    pool.stop()
    os.remove(cache)
    pool.start()
    c = cache_status(pool)
    assert c["state"] == "UNAVAIL" and c.get("reason"), c
    assert "cache device not in use" in pool.log_tail()
    assert "UNAVAIL" in pool.cli("status").stdout
    pool.load_key("v", key)
    assert read_volume(pool, "v", tmp_path, "nocache")[:DATA_BYTES] == data
    qemu_io_ok(pool.uri("v"), "write -P 7 0 64k", "read -P 7 0 64k")


def test_serve_cache_device_and_refusals(make_pool, tmp_path):
    require_tools("nbdcopy", "qemu-io")
    cache = make_cache_file(tmp_path / "other-cache.img")
    pool = make_pool(serve_args=["--cache-device", str(cache)])
    pool.create().start()
    assert cache_status(pool)["state"] == "ONLINE"
    pool.create_volume("v", size="16M", encryption=False)
    data = os.urandom(MiB)
    fill(pool, "v", tmp_path, data, MiB // (4 * KiB))
    # `pool cache remove|add` change what the next start uses (no daemon may serve).
    pool.stop()
    pool.serve_args = []
    pool.cli("pool", "cache", "remove", str(pool.dir))
    pool.start()
    assert "cache_device" not in pool.status()
    pool.stop()
    pool.cli("pool", "cache", "add", str(pool.dir), str(cache))
    pool.start()
    c = wait_until(lambda: cache_status(pool), lambda c: c["state"] == "ONLINE")
    assert c["state"] == "ONLINE" and c["entries"] >= MiB // (4 * KiB), c
    r = pool.cli("pool", "cache", "remove", str(pool.dir), check=False)
    assert r.returncode != 0, "pool cache remove changed a served pool's pool.json"
    # A file holding something else is never taken (nor formatted) as a cache device.
    foreign = tmp_path / "foreign.img"
    foreign.write_bytes(b"precious" * (CACHE_BYTES // 8))
    r = pool.bulwark("pool", "create", tmp_path / "p2", "--devices", "1", "--device-size", "256M",
                     "--cache-device", foreign, check=False)
    assert r.returncode != 0 and "cache device" in r.stderr, r.stderr
    assert foreign.read_bytes()[:8] == b"precious"
