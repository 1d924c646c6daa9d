"""CSI volume expansion of volumes with snapshots and clones (issue 42 part 1, through
the driver's gRPC socket): the engine grows any volume, so the driver does too.
Kubernetes expands a PVC with `ControllerExpandVolume`, and makes a larger PVC from a
VolumeSnapshot with `CreateVolume`; on Proxmox, OpenStack and KubeVirt most disks have a
snapshot or are clones, so both must work. Checked as a user would: the size the daemon
reports for each volume and snapshot, and the clone's files after it grew."""

import pytest

from conftest import LONG_TEST_TIMEOUT_S
from test_csi_keys import (csi, create, expect_code, mount_cap,  # noqa: F401
                           stage_publish, unpublish_unstage)
from csiutil import key_hex

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)

MiB = 1 << 20


def size_of(c, name) -> int:
    return c.pool.volume_status(name)["size_bytes"]


def expand(c, vol, size):
    return c.controller.ControllerExpandVolume(c.pb.ControllerExpandVolumeRequest(
        volume_id=vol, capacity_range=c.pb.CapacityRange(required_bytes=size)))


def test_expand_a_volume_with_a_snapshot_a_clone_and_a_larger_clone(csi):
    c = csi
    disk_key, clone_key = key_hex(), key_hex()
    create(c, "disk", {"key": disk_key})  # 256 MiB
    _, target = stage_publish(c, "disk", {"key": disk_key})
    (target / "hello").write_text("from the snapshot\n")
    unpublish_unstage(c, "disk")
    snap = c.controller.CreateSnapshot(c.pb.CreateSnapshotRequest(
        name="disk-s1", source_volume_id="disk")).snapshot

    # A volume with a snapshot grows.
    r = expand(c, "disk", 384 * MiB)
    assert r.capacity_bytes == 384 * MiB and r.node_expansion_required
    assert size_of(c, "disk") == 384 * MiB

    # A clone asked larger than its snapshot is made at the size asked.
    req = c.pb.CreateVolumeRequest(
        name="big-clone", capacity_range=c.pb.CapacityRange(required_bytes=512 * MiB),
        volume_capabilities=[mount_cap(c.pb)],
        parameters={"encryption": "on"},
        secrets={"key": clone_key, "originKey": disk_key})
    req.volume_content_source.snapshot.snapshot_id = snap.snapshot_id
    vol = c.controller.CreateVolume(req).volume
    assert vol.capacity_bytes == 512 * MiB, vol
    assert size_of(c, "big-clone") == 512 * MiB

    # A clone grows, and so does the origin of a clone.
    assert expand(c, "big-clone", 640 * MiB).capacity_bytes == 640 * MiB
    assert size_of(c, "big-clone") == 640 * MiB
    assert expand(c, "disk", 768 * MiB).capacity_bytes == 768 * MiB
    assert size_of(c, "disk") == 768 * MiB

    # The grown clone still holds the snapshot's files (the file system grows at stage).
    _, target = stage_publish(c, "big-clone", {"key": clone_key})
    assert (target / "hello").read_text() == "from the snapshot\n"
    unpublish_unstage(c, "big-clone")

    # A limit below the snapshot's size is refused, and nothing is left behind.
    req.name = "small-clone"
    req.capacity_range.CopyFrom(c.pb.CapacityRange(required_bytes=64 * MiB,
                                                   limit_bytes=128 * MiB))
    expect_code(c, c.grpc.StatusCode.OUT_OF_RANGE, c.controller.CreateVolume, req)
    names = [v["name"] for v in c.pool.status()["volumes"]]
    assert "small-clone" not in names, names
