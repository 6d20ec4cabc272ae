"""Golden tests for everything bcm renders for Kubernetes (kubeadm's init and join configurations,
containerd, the CNI config, GPU Operator values, Kueue's config, the lab's daemons), rendered for fixed
inputs and compared with exact text; every kubeadm configuration is also checked by the real
``kubeadm config validate`` that scripts/k8s-tools builds. Then the driver's whole plan, as a deploy
makes it: secret files 0600, no secret in the Ansible vars, Kueue's webhooks cut to the ones bcm needs.

Regenerate after an intended change with ``BCM_UPDATE_GOLDEN=1 pytest tests/golden`` and review the diff.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from bcm.domain import kubernetes as k8s
from bcm.drivers.wlm import ClusterSpec, WlmHost
from bcm.drivers.wlm import kubernetes as kdrv
from bcm.services.render import render

GOLDEN = Path(__file__).parent / "kubernetes"
TOKEN = "abcdef.0123456789abcdef"
CA_HASH = "sha256:" + "ab" * 32
H100 = "NVIDIA H100 80GB HBM3"


def tools_dir() -> Path:
    path = Path(k8s.TOOLS_DEFAULT_DIR)
    if not (path / "kubeadm").exists():
        pytest.fail(f"{path} lacks kubeadm: run scripts/k8s-tools (scripts/test-all does)")
    return path


def _host(name: str, ip: str, gpus: int = 2) -> WlmHost:
    return WlmHost(
        name,
        ip,
        "ssh-ed25519 AAAA",
        {},
        [(i, H100) for i in range(gpus)],
        None,
        {i: 81559 for i in range(gpus)},
    )


CP = _host("cp01", "198.18.50.11", 0)
NODES = [_host("gpu01", "198.18.50.21"), _host("gpu02", "198.18.50.22")]


def _ctx(mode: str, **settings: Any) -> dict[str, Any]:
    s = k8s.KubernetesSettings(mode=mode, **settings)  # type: ignore[arg-type]
    return {
        "cluster": "prod",
        "cp": CP,
        "s": s,
        "bin": kdrv.BIN_DIR,
        "pki": kdrv.NODE_DIR,
        "data": kdrv.DATA_DIR,
        "kueue_dir": kdrv.KUEUE_DIR,
        "kwok_group": "bcm:kwok",
        "token": TOKEN,
        "ca_hash": CA_HASH,
        "cp_is_worker": False,
    }


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("BCM_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} differs from its golden copy"


def _rendered() -> dict[str, str]:
    real = _ctx("kubeadm", container_toolkit=True)
    lab = _ctx("lab", pod_subnet="198.19.64.0/18", service_subnet="198.19.128.0/17")
    node = {"node": NODES[0], "pod_cidr": k8s.node_pod_cidr("10.244.0.0/16", 0)}
    out = {
        "kubeadm/init.yaml": render("kubernetes/kubeadm/init.yaml.j2", **real),
        "kubeadm/init-worker-cp.yaml": render(
            "kubernetes/kubeadm/init.yaml.j2", **{**real, "cp_is_worker": True}
        ),
        "kubeadm/join.yaml": render("kubernetes/kubeadm/join.yaml.j2", **real, **node),
        "containerd/config.toml": render("kubernetes/containerd/config.toml.j2", **_ctx("kubeadm")),
        "containerd/config-nvidia.toml": render("kubernetes/containerd/config.toml.j2", **real),
        "cni/10-bcm.conflist": render("kubernetes/cni/10-bcm.conflist.j2", **real, **node),
        "gpu-operator/values.yaml": render("kubernetes/gpu-operator/values.yaml.j2", **real),
        "kueue/config.yaml": render("kubernetes/kueue/config.yaml.j2", **real),
        "kueue/kueue.sh": render("kubernetes/kueue/kueue.sh.j2", **real),
        "rbac.yaml": render("kubernetes/rbac.yaml.j2", **real),
        "lab/kwok.sh": render(
            "kubernetes/lab/kwok.sh.j2", **lab, node=NODES[1], pod_cidr=k8s.node_pod_cidr("198.19.64.0/18", 1)
        ),
    }
    for c in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
        out[f"lab/{c}.sh"] = render(f"kubernetes/lab/{c}.sh.j2", **lab)
    return out


@pytest.mark.parametrize("name", sorted(_rendered()))
def test_kubernetes_templates_match_golden(name: str) -> None:
    _golden(name, _rendered()[name])


def test_yaml_and_json_files_parse() -> None:
    for name, text in _rendered().items():
        if name.endswith(".yaml"):
            assert list(yaml.safe_load_all(text)), name
        elif name.endswith(".conflist"):
            assert json.loads(text)["plugins"][0]["ipam"]["ranges"] == [[{"subnet": "10.244.0.0/24"}]]


@pytest.mark.parametrize("name", ["kubeadm/init.yaml", "kubeadm/init-worker-cp.yaml", "kubeadm/join.yaml"])
def test_kubeadm_validates_its_configs(name: str, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(_rendered()[name])
    done = subprocess.run(
        [str(tools_dir() / "kubeadm"), "config", "validate", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_kubeadm_rejects_a_broken_config(tmp_path: Path) -> None:
    """The validation above can fail: an unknown field is refused."""
    path = tmp_path / "config.yaml"
    path.write_text(_rendered()["kubeadm/join.yaml"].replace("criSocket:", "criSockett:"))
    done = subprocess.run(
        [str(tools_dir() / "kubeadm"), "config", "validate", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0 and "criSockett" in done.stdout + done.stderr


def _plan(tmp_path: Path, mode: str) -> tuple[Any, Path]:
    spec = ClusterSpec("prod", CP, NODES, {"mode": mode, "tools_dir": str(tools_dir())})
    secrets = tmp_path / "wlm" / "prod"
    return kdrv.Kubernetes().plan(spec, secrets, render), secrets


@pytest.mark.parametrize("mode", ["kubeadm", "lab"])
def test_plan_keeps_secrets_in_0600_files_and_out_of_vars(tmp_path: Path, mode: str) -> None:
    plan, secrets = _plan(tmp_path, mode)
    token = (secrets / "pki" / "bootstrap.token").read_text()
    assert len(token) == 23 and token[6] == "."
    blob = json.dumps(plan.extravars)
    assert token not in blob and "PRIVATE KEY" not in blob
    keys = (secrets / "pki" / "ca.key").read_text()
    for path in secrets.rglob("*"):
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
            assert keys not in path.read_text() or path.name == "ca.key", path
    assert [h.name for h in plan.hosts] == ["cp01", "gpu01", "gpu02"]
    assert plan.hosts[0].groups == ("k8s_control_plane",)
    if mode == "kubeadm":
        init = (secrets / "etc" / "kubeadm-init.yaml").read_text()
        join = Path(plan.extravars["bcm_k8s"]["node_files"]["gpu01"]["join.yaml"]).read_text()
        assert token in init and token in join
        assert kdrv.pki.ca_cert_hash(secrets / "pki") in join
    else:
        assert "kwok.kubeconfig" in plan.extravars["bcm_k8s"]["node_files"]["gpu02"]
        stages = Path(plan.extravars["bcm_k8s"]["node_files"]["gpu02"]["kwok-stages.yaml"]).read_text()
        kinds = {d["kind"] for d in yaml.safe_load_all(stages) if d}
        assert kinds == {"Stage"}


def test_plan_again_keeps_the_cluster_identity(tmp_path: Path) -> None:
    first, secrets = _plan(tmp_path, "lab")
    ca = (secrets / "pki" / "ca.crt").read_bytes()
    second, _ = _plan(tmp_path, "lab")
    assert (secrets / "pki" / "ca.crt").read_bytes() == ca and first.fingerprint == second.fingerprint


def test_kueue_webhooks_are_cut_to_bcms_and_point_at_the_daemon(tmp_path: Path) -> None:
    text = kdrv.kueue_webhooks(tools_dir(), "https://198.18.50.11:9443", "Q0E=")
    docs = list(yaml.safe_load_all(text))
    names = {h["name"] for d in docs for h in d["webhooks"]}
    assert names == set(kdrv.KUEUE_WEBHOOKS)
    for d in docs:
        for h in d["webhooks"]:
            assert h["clientConfig"]["url"].startswith("https://198.18.50.11:9443/")
            assert h["clientConfig"]["caBundle"] == "Q0E=" and "service" not in h["clientConfig"]
