"""bcm installed from its wheel, outside the checkout (tests/wheel.py): the CLI, `bcm serve` with the
README's first steps, every run-time file present in the installed package, and the PXE, image and
Kubernetes templates rendered from the installed copy exactly as from the checkout.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bcm.devserver import free_port
from tests.wheel import DATA_DIRS, REPO, Installed, clean_env, data_files, install

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]  # the wheel and its virtualenv: 1-2 min

DOC_PORT = "8470"
Served = tuple[Installed, dict[str, str], int]  # the installation, the server's environment, its port
ERROR = re.compile(r"^\s*(error:|Traceback \(most recent call last\))", re.IGNORECASE | re.MULTILINE)

# What a PXE boot, an image build and a Kubernetes deploy render, printed as JSON; run by the installed
# virtualenv's python and by this checkout's, from outside the checkout. ``dirs`` says where it read from.
RENDERS = r"""
import hashlib, json, os
from pathlib import Path
from bcm import resources
from bcm.domain import image_recipe, kubernetes as k8s
from bcm.drivers import dnsmasq
from bcm.drivers.wlm import WlmHost, kubernetes as kdrv
from bcm.services.render import render
from bcm.settings import PxeSettings, Settings

URL = "http://198.18.0.1:8470"
out = {"dirs": {n: str(getattr(resources, n + "_dir")()) for n in ("templates", "ansible", "images")}}
r = out["rendered"] = {}
pxe = PxeSettings(enabled=True, interface="bcmlab-prov", address="198.18.0.1", range_start="198.18.0.100",
                  range_end="198.18.0.199")
s = Settings(state_dir=Path("/var/lib/bcm"), pxe=pxe)
r["dnsmasq.conf"] = dnsmasq.render_config(dnsmasq.context(s, dnsmasq.paths(s), URL + "/boot/v1/ipxe/boot.ipxe"))
r["host.conf"] = dnsmasq.render_host("52:54:00:1a:00:01", "198.18.0.50", "gpu01")
boot = {"kernel_url": URL + "/boot/v1/images/base/3/vmlinuz", "image": "base:3",
        "initrd_url": URL + "/boot/v1/images/base/3/initramfs.img", "cmdline": "console=ttyS0,115200"}
r["boot.ipxe"] = render("ipxe/boot.ipxe.j2", server_url=URL)
r["discovery.ipxe"] = render("ipxe/discovery.ipxe.j2", mac="52:54:00:1a:00:01", **boot)
r["image.ipxe"] = render("ipxe/image.ipxe.j2", node="gpu01", install=None, **boot)
r["install.ipxe"] = render("ipxe/image.ipxe.j2", node="gpu01", install="full", **boot)
r["local.ipxe"] = render("ipxe/local.ipxe.j2", node="gpu01", state="ready", disk=False)
r["local-disk.ipxe"] = render("ipxe/local.ipxe.j2", node="gpu01", state="ready", disk=True)
r["noimage.ipxe"] = render("ipxe/noimage.ipxe.j2", node="gpu01", message="no image assigned")
r["refused.ipxe"] = render("ipxe/refused.ipxe.j2", node="gpu01", message="not the bound address")
overlay = {"node": "gpu01", "server_url": URL, "head": "198.18.0.1", "hosts": [("gpu01", "198.18.0.50")]}
for name in ("etc/hosts", "etc/ssh/sshd_config.d/bcm.conf", "usr/local/sbin/bcm-hello",
             "etc/systemd/system/bcm-hello.service"):
    r["overlay/" + name] = render(f"overlay/{name}.j2", **overlay)

recipes = image_recipe.load_recipes(resources.images_dir())
assert Settings().images.recipes_dir == resources.images_dir(), Settings().images.recipes_dir
r["recipes"] = {n: image_recipe.layer_keys(image_recipe.chain(recipes, n)) for n in sorted(recipes)}
for name in ("init", "udhcpc.script"):  # what the image builder copies into every initramfs
    f = resources.templates_dir() / "image" / name
    r["image/" + name] = [hashlib.sha256(f.read_bytes()).hexdigest(), os.access(f, os.X_OK)]

host = lambda n, ip, g: WlmHost(n, ip, "ssh-ed25519 AAAA", {}, [(i, "NVIDIA H100 80GB HBM3") for i in range(g)],
                                None, {i: 81559 for i in range(g)})
ctx = {"cluster": "prod", "cp": host("cp01", "198.18.50.11", 0), "bin": kdrv.BIN_DIR, "pki": kdrv.NODE_DIR,
       "data": kdrv.DATA_DIR, "kueue_dir": kdrv.KUEUE_DIR, "kwok_group": "bcm:kwok", "token": "abcdef.0123456789abcdef",
       "ca_hash": "sha256:" + "ab" * 32, "cp_is_worker": False,
       "s": k8s.KubernetesSettings(mode="kubeadm", container_toolkit=True)}
node = {"node": host("gpu01", "198.18.50.21", 2), "pod_cidr": k8s.node_pod_cidr("10.244.0.0/16", 0)}
for name in ("kubeadm/init.yaml", "containerd/config.toml", "gpu-operator/values.yaml", "kueue/config.yaml",
             "kueue/kueue.sh", "rbac.yaml"):
    r["kubernetes/" + name] = render(f"kubernetes/{name}.j2", **ctx)
for name in ("kubeadm/join.yaml", "cni/10-bcm.conflist"):
    r["kubernetes/" + name] = render(f"kubernetes/{name}.j2", **ctx, **node)
lab = {**ctx, "s": k8s.KubernetesSettings(mode="lab", pod_subnet="198.19.64.0/18", service_subnet="198.19.128.0/17")}
for c in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
    r[f"kubernetes/lab/{c}.sh"] = render(f"kubernetes/lab/{c}.sh.j2", **lab)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    return install(tmp_path_factory.mktemp("wheel"))


def first_steps() -> list[str]:
    """The command lines of README's "First steps" ``sh`` block."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"^## First steps\n.*?^```sh\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert block, "README.md has no sh block under '## First steps'"
    return [ln for ln in block.group(1).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def site_packages_of(installed: Installed) -> Path:
    done = installed.python("import bcm, pathlib; print(pathlib.Path(bcm.__file__).resolve().parent)")
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip())


def test_the_wheel_runs_outside_the_checkout(installed: Installed) -> None:
    package = site_packages_of(installed)
    assert package.is_relative_to(installed.venv), f"bcm imported from {package}, not the installed wheel"
    done = subprocess.run(
        [*installed.bcm, "--help"],
        cwd=installed.work,
        env=installed.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "serve" in done.stdout and "node" in done.stdout


def test_every_run_time_file_is_in_the_wheel(installed: Installed) -> None:
    """Byte for byte, and executables stay executable (the initramfs' init)."""
    data = site_packages_of(installed) / "_data"
    files = data_files()
    assert "ansible/kubernetes.yml" in files and "templates/ipxe/boot.ipxe.j2" in files
    missing = [f for f in files if not (data / f).is_file()]
    assert missing == [], f"not in the installed package: {missing}"
    changed = [f for f in files if (data / f).read_bytes() != (REPO / f).read_bytes()]
    assert changed == []
    modes = [f for f in files if (data / f).stat().st_mode & 0o111 != (REPO / f).stat().st_mode & 0o111]
    assert modes == [], f"executable bit lost or gained: {modes}"


def test_templates_render_from_the_installed_copy(installed: Installed, tmp_path: Path) -> None:
    wheel = installed.python(RENDERS)
    assert wheel.returncode == 0, wheel.stderr[-3000:]
    source = subprocess.run(
        [sys.executable, "-c", RENDERS],
        cwd=installed.work,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert source.returncode == 0, source.stderr[-3000:]
    ours, theirs = json.loads(wheel.stdout), json.loads(source.stdout)
    for name in DATA_DIRS:
        assert Path(ours["dirs"][name]).is_relative_to(installed.venv), ours["dirs"]
        # the checkout's editable install reads the tree itself
        assert Path(theirs["dirs"][name]) == REPO / name, theirs["dirs"]
    rendered = ours["rendered"]
    assert rendered == theirs["rendered"]
    names = ("boot", "discovery", "image", "install", "local", "local-disk")
    assert all(rendered[f"{n}.ipxe"].startswith("#!ipxe\n") for n in names)
    assert "dhcp-range=198.18.0.100,198.18.0.199" in rendered["dnsmasq.conf"]
    assert {"base", "lab", "slurm-node"} <= set(rendered["recipes"])
    assert rendered["image/init"][1] is True
    assert "kind: InitConfiguration" in rendered["kubernetes/kubeadm/init.yaml"]


@pytest.fixture
def served(installed: Installed, tmp_path: Path) -> Iterator[Served]:
    """`bcm serve` from the wheel on a free loopback port, with a fresh state directory."""
    port = free_port()
    env = installed.env(BCM_STATE_DIR=str(tmp_path / "state"), BCM_PORT=str(port), COLUMNS="200")
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*installed.bcm, "serve"], cwd=installed.work, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 60
        while True:  # bounded by the deadline
            if proc.poll() is not None:
                pytest.fail(f"bcm serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"bcm serve did not answer within 60 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield installed, env, port
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_readme_first_steps_against_the_installed_server(served: Served) -> None:
    installed, env, port = served
    lines = first_steps()
    assert any("node add" in ln for ln in lines) and any("curl" in ln for ln in lines)
    outputs: dict[str, str] = {}
    for line in lines:
        command = line.replace(".venv/bin/bcm", str(installed.bin("bcm"))).replace(DOC_PORT, str(port))
        done = subprocess.run(
            ["bash", "-o", "pipefail", "-c", command],
            cwd=installed.work,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0 and not ERROR.search(output), f"{line}\n{output[-3000:]}"
        outputs[line] = output
    shown = [json.loads(out) for line, out in outputs.items() if "node show" in line and "--json" in line]
    assert shown and shown[0]["name"] == "gpu01", outputs
    assert [out.strip() for line, out in outputs.items() if line.startswith("curl")] == ["401"]
    # the dashboard's templates come from the wheel, too
    page = httpx.get(f"http://127.0.0.1:{port}/ui/signin", timeout=10)
    assert page.status_code == 200 and "<form" in page.text
