"""Nothing written to an encrypted volume is found in the clear on the
devices after a commit, nor is its key; the same scan does find data written
to a volume with encryption and compression off, so the scan can fail."""

import os
import secrets

from conftest import KiB, MiB, qemu_io_ok, require_tools, run

SCAN_CHUNK = 8 * MiB


def marker_block(token: bytes) -> bytes:
    unit = b"BULWARK-PLAINTEXT-MARKER:" + token + b"|"
    return (unit * (4 * KiB // len(unit) + 1))[: 4 * KiB]


def scan(paths, needles):
    """{needle: [(path, offset)...]} for every place a needle occurs in the files."""
    found = {n: set() for n in needles}
    overlap = max(len(n) for n in needles) - 1
    for path in paths:
        with open(path, "rb") as f:
            pos, prev = 0, b""
            while True:
                chunk = f.read(SCAN_CHUNK)
                if not chunk:
                    break
                buf = prev + chunk
                base = pos - len(prev)
                for n in needles:
                    i = buf.find(n)
                    while i != -1:
                        found[n].add((path, base + i))
                        i = buf.find(n, i + 1)
                pos += len(chunk)
                prev = buf[-overlap:]
    return {n: sorted(v) for n, v in found.items()}


def all_files(root):
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            if os.path.isfile(p) and not os.path.islink(p):
                yield p


def test_no_plaintext_at_rest(pool, tmp_path):
    require_tools("qemu-io", "nbdcopy")
    secret_token = secrets.token_hex(16).encode()
    plain_token = secrets.token_hex(16).encode()

    key = pool.create_volume("secret", size="32M")
    pool.create_volume("plain", size="32M", encryption=False, compression="off")

    # 1 MiB of marker blocks in each volume, at two places, flushed.
    for name, token in (("secret", secret_token), ("plain", plain_token)):
        img = tmp_path / f"{name}.blk"
        img.write_bytes(marker_block(token) * 256)
        qemu_io_ok(pool.uri(name), f"write -s {img} 0 1M", f"write -s {img} 7654321 1M", "flush")
        out = tmp_path / f"{name}.out"
        run(["nbdcopy", pool.uri(name), out])
        data = out.read_bytes()
        assert data[:MiB] == data[7654321:7654321 + MiB] == img.read_bytes(), f"{name}: read back differs"

    devices = pool.device_paths()
    pool.stop()  # SIGTERM: everything committed

    files = sorted(set(all_files(pool.dir)) | set(devices))
    assert set(devices) <= set(files)
    key_bytes = key.read_bytes()
    found = scan(files, [secret_token, plain_token, key_bytes])

    assert not found[secret_token], \
        f"plaintext of the encrypted volume found at rest, {len(found[secret_token])} times, first at {found[secret_token][:3]}"
    assert not found[key_bytes], f"the raw volume key found at rest, at {found[key_bytes][:3]}"
    assert found[plain_token], \
        f"data of the unencrypted, uncompressed volume not found in {files}: the scan is blind"
