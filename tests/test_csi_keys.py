"""What csi-sanity does not check, through the driver's gRPC socket:

- a volume made from a snapshot (the encrypted VM root disk from an image) opens
  with its own secret and not with its origin's;
- a wrong node-stage secret is refused with UNAUTHENTICATED and a message naming the
  volume (and no secret), and the volume stays locked;
- a node restart re-stages: a plugin restart finds its stage whole, and after a
  reboot (daemon restarted, keys locked, mounts and nbdfuse gone) NodeStageVolume
  loads the key again and the files are there.
"""

import signal
import subprocess

import pytest

from conftest import LONG_TEST_TIMEOUT_S, Pool
from csiutil import CsiDriver, grpc_stubs, key_hex, require_node_tools

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)


@pytest.fixture
def csi(tmp_path):
    require_node_tools()
    pb, pb_grpc = grpc_stubs(tmp_path / "stubs")
    import grpc
    pool = Pool(tmp_path, device_size="1G")
    pool.create().start()
    driver = CsiDriver(pool, tmp_path).start()
    # grpc-python would send the socket's path as :authority, which is not a valid one
    # (Go's gRPC, which kubelet and the sidecars use, sends "localhost").
    channel = grpc.insecure_channel(driver.endpoint,
                                    options=[("grpc.default_authority", "localhost")])
    c = type("Csi", (), {})()
    c.pb, c.grpc, c.pool, c.driver, c.tmp = pb, grpc, pool, driver, tmp_path
    c.controller = pb_grpc.ControllerStub(channel)
    c.node = pb_grpc.NodeStub(channel)
    try:
        yield c
    finally:
        channel.close()
        # Leave nothing mounted or attached behind a failed test.
        driver.cleanup()
        print(driver.log_tail())
        pool.cleanup()


def mount_cap(pb):
    return pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(fs_type="ext4"),
        access_mode=pb.VolumeCapability.AccessMode(
            mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER))


def create(c, name, secret, source=None):
    req = c.pb.CreateVolumeRequest(
        name=name, capacity_range=c.pb.CapacityRange(required_bytes=256 << 20),
        volume_capabilities=[mount_cap(c.pb)], parameters={"encryption": "on"},
        secrets=secret)
    if source:
        req.volume_content_source.snapshot.snapshot_id = source
    return c.controller.CreateVolume(req).volume


def stage_publish(c, vol, secret):
    staging, target = c.tmp / "staging" / vol, c.tmp / "mnt" / vol
    staging.mkdir(parents=True, exist_ok=True)
    c.node.NodeStageVolume(c.pb.NodeStageVolumeRequest(
        volume_id=vol, staging_target_path=str(staging),
        volume_capability=mount_cap(c.pb), secrets=secret))
    c.node.NodePublishVolume(c.pb.NodePublishVolumeRequest(
        volume_id=vol, staging_target_path=str(staging), target_path=str(target),
        volume_capability=mount_cap(c.pb)))
    return staging, target


def unpublish_unstage(c, vol):
    staging, target = c.tmp / "staging" / vol, c.tmp / "mnt" / vol
    c.node.NodeUnpublishVolume(c.pb.NodeUnpublishVolumeRequest(volume_id=vol, target_path=str(target)))
    c.node.NodeUnstageVolume(c.pb.NodeUnstageVolumeRequest(volume_id=vol, staging_target_path=str(staging)))


def locked(c, vol) -> bool:
    return c.pool.volume_status(vol)["locked"]


def expect_code(c, code, call, *args):
    with pytest.raises(c.grpc.RpcError) as e:
        call(*args)
    assert e.value.code() == code, f"{e.value.code()}: {e.value.details()}"
    return e.value.details()


def test_clone_opens_with_its_own_secret_only(csi):
    c = csi
    image_key, root_key = key_hex(), key_hex()
    create(c, "image", {"key": image_key})
    assert locked(c, "image"), "the controller leaves keys to the node"
    _, target = stage_publish(c, "image", {"key": image_key})
    (target / "os-release").write_text("bulwark test image\n")
    unpublish_unstage(c, "image")
    assert locked(c, "image")
    snap = c.controller.CreateSnapshot(c.pb.CreateSnapshotRequest(
        name="image-v1", source_volume_id="image")).snapshot
    assert snap.snapshot_id == "image@image-v1" and snap.ready_to_use

    # The root disk's own Secret alone cannot open the locked image to clone it ...
    details = expect_code(c, c.grpc.StatusCode.FAILED_PRECONDITION,
                          create, c, "vm1-root", {"key": root_key}, snap.snapshot_id)
    assert "originKey" in details and root_key not in details
    # ... with the image's key as originKey it can, and the image is locked again after.
    vol = create(c, "vm1-root", {"key": root_key, "originKey": image_key}, snap.snapshot_id)
    assert vol.content_source.snapshot.snapshot_id == snap.snapshot_id
    assert locked(c, "image") and locked(c, "vm1-root")

    # The image's secret does not open the clone; its own does, with the image's files.
    details = expect_code(c, c.grpc.StatusCode.UNAUTHENTICATED,
                          stage_publish, c, "vm1-root", {"key": image_key})
    assert "vm1-root" in details and image_key not in details
    assert locked(c, "vm1-root")
    _, target = stage_publish(c, "vm1-root", {"key": root_key})
    assert (target / "os-release").read_text() == "bulwark test image\n"
    unpublish_unstage(c, "vm1-root")
    assert locked(c, "vm1-root")

    # The clone keeps the snapshot: deleting the snapshot first is refused, clearly.
    expect_code(c, c.grpc.StatusCode.FAILED_PRECONDITION, c.controller.DeleteSnapshot,
                c.pb.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id))
    c.controller.DeleteVolume(c.pb.DeleteVolumeRequest(volume_id="vm1-root"))
    c.controller.DeleteSnapshot(c.pb.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id))
    c.controller.DeleteVolume(c.pb.DeleteVolumeRequest(volume_id="image"))
    assert c.pool.cli("volume", "list", "--json").stdout.strip() in ("[]", "")


def test_wrong_secret_is_refused_clearly(csi):
    c = csi
    key = key_hex()
    create(c, "v1", {"key": key})
    wrong = key_hex()
    details = expect_code(c, c.grpc.StatusCode.UNAUTHENTICATED,
                          stage_publish, c, "v1", {"key": wrong})
    assert "v1" in details and "node-stage secret" in details and wrong not in details
    assert locked(c, "v1")
    assert not list((c.driver.state / "volumes").glob("*.json"))
    # A passphrase where a key was set is wrong too; a malformed key is INVALID_ARGUMENT.
    expect_code(c, c.grpc.StatusCode.UNAUTHENTICATED, stage_publish, c, "v1", {"passphrase": key})
    details = expect_code(c, c.grpc.StatusCode.INVALID_ARGUMENT, stage_publish, c, "v1",
                          {"key": "not hex"})
    assert "64 hex digits" in details and "not hex" not in details
    # No secret at all for a locked volume, and none for an encrypted create.
    expect_code(c, c.grpc.StatusCode.INVALID_ARGUMENT, stage_publish, c, "v1", {})
    expect_code(c, c.grpc.StatusCode.INVALID_ARGUMENT, create, c, "v2", {})
    # Secrets never reach the logs.
    logs = c.driver.log_tail() + c.pool.log_tail()
    assert key not in logs and wrong not in logs
    # Passphrases work as well (Argon2id).
    create(c, "v3", {"passphrase": "correct horse battery staple"})
    _, target = stage_publish(c, "v3", {"passphrase": "correct horse battery staple"})
    assert target.is_dir()
    unpublish_unstage(c, "v3")


def test_node_restart_restages(csi):
    c = csi
    key = key_hex()
    create(c, "data", {"key": key})
    staging, target = stage_publish(c, "data", {"key": key})
    (target / "kept").write_text("across restarts\n")
    subprocess.run(["sync"], check=True)

    # A plugin restart (kill -9): the stage survives; stage and publish again are no-ops.
    c.driver.stop(signal.SIGKILL)
    c.driver.start()
    stage_publish(c, "data", {"key": key})
    assert (target / "kept").read_text() == "across restarts\n"

    # A reboot: the daemon and the plugin die, mounts, loop devices and nbdfuse are gone,
    # every key is locked. The state directory here outlives it (worst case: stale state).
    c.driver.stop(signal.SIGKILL)
    state = (c.driver.state / "volumes" / "data.json").read_text()
    c.pool.kill()
    for m in (target, staging):
        subprocess.run(["umount", "-l", str(m)], capture_output=True)
    import json
    att = json.loads(state)["attachment"]
    subprocess.run(["losetup", "-d", att["device"]], capture_output=True)
    subprocess.run(["fusermount3", "-u", "-z", att["fuse_dir"]], capture_output=True)
    subprocess.run(["kill", "-9", str(att["pid"])], capture_output=True)
    c.pool.start()
    c.driver.start()
    assert locked(c, "data")
    # kubelet stages again every volume in use, then publishes it.
    stage_publish(c, "data", {"key": key})
    assert (target / "kept").read_text() == "across restarts\n"
    assert not locked(c, "data")
    unpublish_unstage(c, "data")
    assert locked(c, "data"), "unstage unloads the key stage loaded"
    assert not target.exists()
