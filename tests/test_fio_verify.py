"""fio through its nbd engine, two jobs (two connections) of random 4 KiB
writes at queue depth 32, each job verifying what it wrote with crc32c; a
verify-only pass after a restart finds every block intact; and the same pass
does fail once a region is overwritten, so the verification is real."""


import pytest

from conftest import LONG_TEST_TIMEOUT_S, MiB, run_fio, qemu_io_ok, require_tools, run

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)  # waits of up to 300 s each

JOB_BYTES = 16 * MiB


def fio(uri, out, *extra, check=True):
    cmd = ["fio", "--name=bw", "--ioengine=nbd", f"--uri={uri}",
           "--rw=randwrite", "--bs=4k", "--iodepth=32", "--numjobs=2",
           f"--size={JOB_BYTES}", f"--offset_increment={JOB_BYTES}",
           "--verify=crc32c", "--verify_fatal=1", "--do_verify=1", "--verify_state_save=0",
           "--output-format=json", f"--output={out}", *extra]
    return run_fio(cmd, out, check=check, timeout=300)


def test_fio_verify(pool, tmp_path):
    require_tools("fio", "qemu-io")
    key = pool.create_volume("fio1", size="64M")
    uri = pool.uri("fio1")

    # Write and verify, with verification interleaved while writing.
    _, rep = fio(uri, tmp_path / "write.json", "--verify_backlog=256")
    assert len(rep["jobs"]) == 2, rep["jobs"]
    for job in rep["jobs"]:
        assert job["error"] == 0, job
        assert job["write"]["io_bytes"] == JOB_BYTES, job["write"]
        # Every block written was read back and checked.
        assert job["read"]["io_bytes"] >= JOB_BYTES, f"verification did not read everything: {job['read']}"

    # After a clean restart, a verify-only pass finds every block.
    pool.restart()
    pool.load_key("fio1", key)
    _, rep = fio(uri, tmp_path / "verify.json", "--verify_only")
    for job in rep["jobs"]:
        assert job["error"] == 0, job
        assert job["read"]["io_bytes"] == JOB_BYTES, job["read"]

    # The check can fail: overwrite 64 KiB of the second job's region.
    qemu_io_ok(uri, f"write -P 0x5a {JOB_BYTES + 4 * MiB} 64k")
    r, rep = fio(uri, tmp_path / "tampered.json", "--verify_only", check=False)
    assert r.returncode != 0, "fio verify_only passed although 64 KiB had been overwritten"
    assert rep is not None and any(j["error"] != 0 for j in rep["jobs"]), rep
