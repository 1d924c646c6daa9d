"""The Kubernetes manifests (packaging/kubernetes/) hold together: kubectl decodes
every object offline (`kubectl label --local`: built-in kinds into their typed
structs, so a wrong field type fails), and a structural check finds what kubectl
cannot without a cluster: every container has an image, every volume mount a volume,
every service account exists, the driver name, StorageClass parameters and secret
keys are the ones the driver takes, and each `bulwark csi` command line is the
contract (`--pool DIR --endpoint unix:///PATH --node-id NAME`) and parses."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import REPO, run
from conftest import bulwark_bin

K8S = REPO / "packaging" / "kubernetes"
DRIVER = "csi.bulwark.io"
PARAMS = {"encryption", "compression", "blockSize", "thick"}


def docs():
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            if d:
                out.append((f.name, d))
    return out


def test_kubectl_decodes_every_object():
    if not shutil.which("kubectl"):
        pytest.skip("kubectl is not installed")
    files = sorted(K8S.glob("*.yaml"))
    assert files
    for f in files:
        r = subprocess.run(["kubectl", "label", "--local", "-f", str(f), "checked=yes", "-o", "name"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{f.name}: {r.stderr}"
        n = sum(1 for d in yaml.safe_load_all(f.read_text()) if d)
        assert len(r.stdout.split()) == n, f"{f.name}: {r.stdout}"


def test_manifests_hold_together():
    objs = docs()
    kinds = {d["kind"] for _, d in objs}
    for k in ("CSIDriver", "Deployment", "DaemonSet", "ServiceAccount", "ClusterRole",
              "ClusterRoleBinding", "StorageClass", "VolumeSnapshotClass", "VirtualMachine"):
        assert k in kinds, f"no {k} in packaging/kubernetes"
    accounts = {(d["metadata"]["namespace"], d["metadata"]["name"])
                for _, d in objs if d["kind"] == "ServiceAccount"}
    roles = {d["metadata"]["name"] for _, d in objs if d["kind"] == "ClusterRole"}
    secrets = {d["metadata"]["name"]: d for _, d in objs if d["kind"] == "Secret"}
    csi_commands = []
    for name, d in objs:
        assert d.get("apiVersion") and d["metadata"].get("name"), f"{name}: {d}"
        kind = d["kind"]
        if kind == "CSIDriver":
            assert d["metadata"]["name"] == DRIVER
            assert d["spec"]["attachRequired"] is False
        if kind == "ClusterRoleBinding":
            assert d["roleRef"]["name"] in roles
            for s in d["subjects"]:
                assert (s["namespace"], s["name"]) in accounts
        if kind in ("Deployment", "DaemonSet"):
            spec = d["spec"]["template"]["spec"]
            ns = d["metadata"]["namespace"]
            assert (ns, spec["serviceAccountName"]) in accounts
            assert d["spec"]["selector"]["matchLabels"].items() <= \
                d["spec"]["template"]["metadata"]["labels"].items()
            volumes = {v["name"] for v in spec["volumes"]}
            for c in spec["containers"]:
                assert c.get("image"), f"{name}: container {c['name']} has no image"
                for m in c.get("volumeMounts", []):
                    assert m["name"] in volumes, f"{name}: {c['name']} mounts {m['name']}"
                cmd = c.get("command", [])
                if cmd[:2] == ["bulwark", "csi"]:
                    csi_commands.append((name, cmd))
                for a in c.get("args", []):
                    if a.startswith("--csi-address="):
                        assert a == "--csi-address=/csi/csi.sock"
        if kind == "StorageClass":
            assert d["provisioner"] == DRIVER
            for k in d["parameters"]:
                assert k in PARAMS or k.startswith("csi.storage.k8s.io/"), f"parameter {k}"
            assert d["volumeBindingMode"] == "WaitForFirstConsumer"
        if kind == "VolumeSnapshotClass":
            assert d["driver"] == DRIVER
        if kind == "Secret":
            data = d["stringData"]
            assert set(data) <= {"key", "passphrase", "originKey", "originPassphrase"}
            for k, v in data.items():
                if k in ("key", "originKey"):
                    assert len(v) == 64 and all(ch in "0123456789abcdef" for ch in v)
        if kind == "PersistentVolumeClaim" and d["spec"].get("dataSource"):
            assert f"{d['metadata']['name']}-bulwark-key" in secrets
            assert "originKey" in secrets[f"{d['metadata']['name']}-bulwark-key"]["stringData"]
    assert {n for n, _ in csi_commands} == {"controller.yaml", "node.yaml"}
    for name, cmd in csi_commands:
        args = cmd[2:]
        for flag in ("--pool", "--endpoint", "--node-id"):
            assert flag in args, f"{name}: bulwark csi without {flag}"
        assert args[args.index("--endpoint") + 1].startswith("unix:///")
        # The command line parses (an unknown flag or value would fail before serving):
        # with --help appended clap checks the flags given, prints help and exits 0.
        r = run([str(bulwark_bin()), "csi", *[a.replace("$(NODE_NAME)", "n1") for a in args],
                 "--help"], check=False)
        assert r.returncode == 0, f"{name}: {r.stderr}"
