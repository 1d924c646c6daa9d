"""The CSI driver passes csi-sanity (kubernetes-csi/csi-test v5), the conformance
suite every CSI driver is held to, against a real daemon: once with mounted file
systems and once with raw block volumes, every volume encrypted (a key per the
secrets file, as a StorageClass's Secret gives it), snapshots and clones on.
Volumes are staged for real: nbdfuse, a loop device, mkfs and mount."""

import subprocess

import pytest

from conftest import LONG_TEST_TIMEOUT_S, Pool
from csiutil import CsiDriver, csi_sanity_bin, key_hex, require_node_tools

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)

SECRET_KINDS = ["CreateVolumeSecret", "DeleteVolumeSecret", "NodeStageVolumeSecret",
                "NodePublishVolumeSecret", "CreateSnapshotSecret", "DeleteSnapshotSecret",
                "ControllerExpandVolumeSecret", "ListSnapshotsSecret"]


@pytest.mark.parametrize("access", ["mount", "block"])
def test_csi_sanity(tmp_path, access):
    sanity = csi_sanity_bin()
    require_node_tools()
    pool = Pool(tmp_path, device_size="2G")
    pool.create().start()
    driver = CsiDriver(pool, tmp_path).start()
    try:
        key = key_hex()
        secrets = tmp_path / "secrets.yaml"
        secrets.write_text("".join(f'{k}:\n  key: "{key}"\n' for k in SECRET_KINDS))
        secrets.chmod(0o600)
        params = tmp_path / "params.yaml"
        params.write_text('encryption: "on"\ncompression: "lz4"\n')
        r = subprocess.run(
            [sanity, "--csi.endpoint", driver.endpoint,
             "--csi.secrets", str(secrets),
             "--csi.testvolumeparameters", str(params),
             "--csi.testvolumeaccesstype", access,
             "--csi.testvolumesize", str(1 << 30),
             "--csi.mountdir", str(tmp_path / "mnt"),
             "--csi.stagingdir", str(tmp_path / "staging"),
             "-ginkgo.no-color"],
            capture_output=True, text=True, timeout=LONG_TEST_TIMEOUT_S - 60)
        summary = [line for line in r.stdout.splitlines() if "Passed |" in line]
        print("\n".join(summary))
        assert r.returncode == 0 and summary, (
            f"csi-sanity ({access}) failed:\n{r.stdout[-20000:]}\n{r.stderr[-4000:]}\n"
            f"{driver.log_tail()}\n{pool.log_tail()}")
        assert " 0 Failed" in summary[-1], summary
        # Everything csi-sanity made is gone again: volumes, stages, secret files.
        assert pool.cli("volume", "list", "--json").stdout.strip() in ("[]", "")
        assert not list((driver.state / "volumes").glob("*.json"))
        assert not list((driver.state / "secrets").iterdir())
        assert not list((driver.state / "fuse").iterdir())
    finally:
        driver.cleanup()
        pool.cleanup()
