"""The image builder against the real Debian mirror: base image built, cached, packed, verified.

Needs root, mmdebstrap, squashfs-tools, busybox-static and the Debian mirror. Layers are cached under
$BCM_IMAGE_CACHE (default /var/cache/bcm/images) between runs: the first base build takes a few
minutes, later ones reuse the layer. The NVIDIA layer (a DKMS build, ~10 min on 2 cores) is marked
``nvidia`` in its test id: select it with ``-k nvidia``, leave it out with ``-k 'not nvidia'``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from bcm.domain.image_recipe import chain, layer_keys, load_recipes
from bcm.drivers import imagebuild
from bcm.errors import FatalDriverError

pytestmark = [
    pytest.mark.lab,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(os.geteuid() != 0, reason="image builds need root (chroot, mounts)"),
    pytest.mark.skipif(
        any(shutil.which(tool) is None for tool in ("mmdebstrap", "mksquashfs", "unshare", "cpio")),
        reason="needs mmdebstrap, squashfs-tools, util-linux and cpio",
    ),
]

IMAGES = Path(__file__).resolve().parents[2] / "images"
CACHE = Path(os.environ.get("BCM_IMAGE_CACHE", "/var/cache/bcm/images"))


@pytest.fixture(scope="module")
def recipes() -> dict:
    return load_recipes(IMAGES)


@pytest.fixture(scope="module")
def base_build(recipes: dict, tmp_path_factory: pytest.TempPathFactory) -> imagebuild.BuildResult:
    lines: list[str] = []
    staging = tmp_path_factory.mktemp("base") / "staging"
    return imagebuild.build(chain(recipes, "base"), CACHE, staging, log=lines.append, timeout_s=3000)


def test_base_artifacts_match_their_files(base_build: imagebuild.BuildResult) -> None:
    kinds = [a.kind for a in base_build.artifacts]
    assert kinds == ["kernel", "initramfs", "rootfs", "manifest"]
    for artifact in base_build.artifacts:
        path = base_build.staging / artifact.filename
        assert path.stat().st_size == artifact.size
        assert imagebuild._sha256(path) == artifact.sha256
    imagebuild.verify(base_build.staging, base_build.artifacts)


def test_base_manifest(base_build: imagebuild.BuildResult, recipes: dict) -> None:
    manifest = json.loads((base_build.staging / "manifest.json").read_text())
    assert manifest == base_build.manifest
    assert manifest["recipes"] == ["base"]
    assert manifest["layer_keys"] == layer_keys(chain(recipes, "base"))
    kver = manifest["kernel_version"]
    # the packed kernel is the image's vmlinuz-<kver>
    tree = imagebuild.layer_dir(CACHE, manifest["layer_keys"][-1]) / "rootfs"
    assert (base_build.staging / "vmlinuz").read_bytes() == (tree / "boot" / f"vmlinuz-{kver}").read_bytes()
    assert (tree / "lib/modules" / kver).is_dir()
    assert manifest["packages"]["openssh-server"][:1].isdigit()
    assert manifest["packages"]["linux-image-amd64"]
    assert manifest["driver_version"] is None and manifest["cuda_version"] is None


def test_base_image_is_node_neutral(base_build: imagebuild.BuildResult) -> None:
    tree = imagebuild.layer_dir(CACHE, base_build.manifest["layer_keys"][-1]) / "rootfs"
    assert not list((tree / "etc/ssh").glob("ssh_host_*"))
    assert (tree / "etc/machine-id").read_text() == ""
    assert (tree / "etc/systemd/system/bcm-agent.service").is_file()
    assert not (tree / "usr/sbin/policy-rc.d").exists()


def test_initramfs_holds_busybox_init_and_modules(base_build: imagebuild.BuildResult, tmp_path: Path) -> None:
    listing = subprocess.run(
        f"gzip -dc {base_build.staging / 'initramfs.img'} | cpio -t --quiet",
        shell=True,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert {"init", "bin/busybox", "bin/udhcpc", "bin/switch_root", "etc/bcm/modules"} <= set(listing)
    assert any(name.endswith("/virtio_net.ko") for name in listing)
    assert any(name.endswith("/squashfs.ko") for name in listing)
    subprocess.run(
        f"gzip -dc {base_build.staging / 'initramfs.img'} | cpio -id --quiet etc/bcm/modules",
        shell=True,
        cwd=tmp_path,
        check=True,
    )
    order = [line.rsplit("/", 1)[-1] for line in (tmp_path / "etc/bcm/modules").read_text().split()]
    assert order.index("failover.ko") < order.index("net_failover.ko") < order.index("virtio_net.ko")


def test_rootfs_squashfs_holds_the_tree(base_build: imagebuild.BuildResult) -> None:
    listing = subprocess.run(
        ["unsquashfs", "-l", "-no-progress", str(base_build.staging / "rootfs.squashfs")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "squashfs-root/usr/sbin/sshd" in listing
    assert "squashfs-root/boot/initrd.img" not in listing


def test_second_build_reuses_the_layer(
    base_build: imagebuild.BuildResult, recipes: dict, tmp_path: Path
) -> None:
    key = base_build.manifest["layer_keys"][-1]
    marker = imagebuild.layer_dir(CACHE, key) / imagebuild.MARKER
    before = marker.stat().st_mtime_ns
    lines: list[str] = []
    again = imagebuild.build(chain(recipes, "base"), CACHE, tmp_path / "again", log=lines.append)
    assert marker.stat().st_mtime_ns == before
    assert any("cached" in line for line in lines)
    assert not any(line.startswith("bcm: image base: mmdebstrap") for line in lines)
    assert again.manifest["packages"] == base_build.manifest["packages"]


def test_tampered_rootfs_fails_verify(base_build: imagebuild.BuildResult, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(base_build.staging, copy)
    imagebuild.verify(copy, base_build.artifacts)
    with open(copy / "rootfs.squashfs", "r+b") as handle:
        handle.seek(4096)
        byte = handle.read(1)
        handle.seek(4096)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(FatalDriverError, match="rootfs"):
        imagebuild.verify(copy, base_build.artifacts)
    (copy / "vmlinuz").unlink()
    with pytest.raises(FatalDriverError, match="kernel"):
        imagebuild.verify(copy, base_build.artifacts)


def test_staging_must_be_new_or_empty(recipes: dict, tmp_path: Path) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        imagebuild.build(chain(recipes, "base"), CACHE, tmp_path / "busy", log=lambda _: None)


def test_unknown_package_fails_the_layer_and_caches_nothing(
    base_build: imagebuild.BuildResult, tmp_path: Path
) -> None:
    images = tmp_path / "images"
    images.mkdir()
    shutil.copy(IMAGES / "base.yaml", images / "base.yaml")
    (images / "broken.yaml").write_text("name: broken\nparent: base\npackages: [bcm-no-such-package]\n")
    layers = chain(load_recipes(images), "broken")
    lines: list[str] = []
    with pytest.raises(FatalDriverError, match="Unable to locate package bcm-no-such-package"):
        imagebuild.build(layers, CACHE, tmp_path / "staging", log=lines.append)
    key = layer_keys(layers)[-1]
    assert not imagebuild.layer_dir(CACHE, key).exists()
    assert not imagebuild.layer_dir(CACHE, key).with_name(key + ".partial").exists()
    assert not (tmp_path / "staging").exists()
    assert any(line.startswith("E: Unable to locate package") for line in lines)


# --- the NVIDIA driver layer: DKMS build of the 535 driver for the image's kernel (~10 min) -------------


@pytest.fixture(scope="module")
def nvidia_build(recipes: dict, tmp_path_factory: pytest.TempPathFactory) -> imagebuild.BuildResult:
    staging = tmp_path_factory.mktemp("nvidia") / "staging"
    return imagebuild.build(
        chain(recipes, "nvidia-driver"), CACHE, staging, log=lambda _: None, timeout_s=3500
    )


def test_nvidia_driver_layer(nvidia_build: imagebuild.BuildResult) -> None:
    manifest = nvidia_build.manifest
    assert manifest["recipes"] == ["base", "nvidia-driver"]
    assert str(manifest["driver_version"]).startswith("535")
    tree = imagebuild.layer_dir(CACHE, manifest["layer_keys"][-1]) / "rootfs"
    kver = manifest["kernel_version"]
    version = subprocess.run(
        ["chroot", str(tree), "/sbin/modinfo", "-k", kver, "-F", "version", "nvidia-current"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert version.startswith("535.")
    # both are symlinks through the image's own /etc/alternatives: look inside the image, not on the host
    for path in ("/usr/bin/nvidia-smi", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"):
        found = subprocess.run(["chroot", str(tree), "test", "-e", path], check=False)
        assert found.returncode == 0, f"{path} missing in the image"
    imagebuild.verify(nvidia_build.staging, nvidia_build.artifacts)


def test_nvidia_resolve_cuda_toolkit(nvidia_build: imagebuild.BuildResult, recipes: dict) -> None:
    # resolve against the nvidia-driver tree: what installing the cuda-toolkit layer would pull in
    versions = imagebuild.resolve(
        chain(recipes, "nvidia-driver"), CACHE, ["nvidia-cuda-toolkit"], log=lambda _: None
    )
    assert versions["nvidia-cuda-toolkit"].startswith("11.8")
    assert len(versions) > 10
    assert all(version[:1].isdigit() for version in versions.values())


def test_resolve_unknown_package(base_build: imagebuild.BuildResult, recipes: dict) -> None:
    with pytest.raises(FatalDriverError, match="Unable to locate package bcm-no-such-package"):
        imagebuild.resolve(chain(recipes, "base"), CACHE, ["bcm-no-such-package"], log=lambda _: None)
