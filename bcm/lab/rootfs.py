"""The lab nodes' shared root filesystem: the `lab` image recipe (images/lab.yaml), built by bcm's one image
builder (bcm.drivers.imagebuild) into its layer cache and used as every node's overlay lower dir.

Nodes cannot install anything (the lab has no route out), so the image carries what a bcm node image
would: sshd, python3 for Ansible and the agent, the hardware tools the inventory reads, and the Slurm
packages. Layers are keyed by content, so a changed recipe builds a new tree beside the old one, and a
build of the `lab` image (`bcm image build lab`) reuses the very tree the lab runs.
"""

from __future__ import annotations

import logging
from pathlib import Path

from bcm import resources
from bcm.domain import image_recipe
from bcm.drivers import imagebuild
from bcm.errors import BcmError
from bcm.lab.errors import LabError

log = logging.getLogger("bcm.lab")
DEFAULT_CACHE_DIR = Path("/var/cache/bcm")
RECIPES_DIR = resources.images_dir()
RECIPE = "lab"
BUILD_TIMEOUT_S = 3600
# what the lab's nodes must carry (tests/unit/test_image_recipes.py checks the recipes hold them)
PACKAGES: tuple[str, ...] = (
    "openssh-server",
    "python3",
    "python3-apt",
    "iproute2",
    "iputils-ping",
    "procps",
    "util-linux",
    "pciutils",
    "dmidecode",
    "ethtool",
    "kmod",
    "less",
    "rsync",
    "slurmd",
    "slurm-client",
    "slurmctld",
    "slurmdbd",
    "slurm-wlm-mysql-plugin",
    "munge",
    "sudo",
    "libpam-runtime",
)


def image_cache(cache_dir: Path) -> Path:
    """The image builder's cache under the lab's cache directory (the server's default, too)."""
    return cache_dir / "images"


def ensure_rootfs(cache_dir: Path = DEFAULT_CACHE_DIR, recipes_dir: Path = RECIPES_DIR) -> Path:
    """The cached tree of the `lab` image, built first if absent (minutes, needs the Debian mirror)."""
    try:
        chain = image_recipe.chain(image_recipe.load_recipes(recipes_dir), RECIPE)
        return imagebuild.ensure_tree(
            chain, image_cache(cache_dir), lambda line: log.debug("%s", line), timeout_s=BUILD_TIMEOUT_S
        )
    except BcmError as exc:
        raise LabError(
            f"the lab image ({recipes_dir / (RECIPE + '.yaml')}) did not build: {exc.message}"
        ) from exc
