"""Benchmark: image builds, cold (empty layer cache) and warm (cached), of `base` and `base+nvidia-driver`.

Beside bcm's builds, the same base packages through a plain `mmdebstrap` (the peer every Debian image
builder starts from) in the same run, so the cost of bcm's layering, customising and packing shows.
Needs root and the Debian mirror; the cold runs use a fresh cache directory (minutes: the NVIDIA layer
builds its kernel module by DKMS). Prints times, asserts nothing about speed.
Usage: .venv/bin/python bench/image_build.py [--cache DIR] [--skip-nvidia] [--full]
  --full also builds `cuda-toolkit` (Debian's nvidia-cuda-toolkit, ~2.4 GB of downloads) in full.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bcm.domain import image_recipe
from bcm.drivers import imagebuild

REPO = Path(__file__).resolve().parents[1]


def timed_build(label: str, chain: list[image_recipe.Recipe], cache: Path) -> tuple[float, int]:
    staging = Path(tempfile.mkdtemp(prefix="bcm-bench-stage-")) / "out"
    t0 = time.perf_counter()
    result = imagebuild.build(chain, cache, staging, log=lambda line: None, timeout_s=7200)
    imagebuild.verify(staging, result.artifacts)
    dt = time.perf_counter() - t0
    size = sum(a.size for a in result.artifacts)
    print(f"  {label:34s} {dt:8.1f} s   artifacts {size / 2**20:7.1f} MiB", flush=True)
    shutil.rmtree(staging.parent, ignore_errors=True)
    return dt, size


def plain_mmdebstrap(base: image_recipe.Recipe) -> float:
    target = Path(tempfile.mkdtemp(prefix="bcm-bench-mmdebstrap-")) / "tree"
    argv = [
        "mmdebstrap",
        f"--variant={base.variant}",
        "--mode=root",
        "--include=" + ",".join(base.packages),
        base.suite,
        str(target),
        *base.mirrors,
    ]
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, timeout=3600)
    dt = time.perf_counter() - t0
    shutil.rmtree(target.parent, ignore_errors=True)
    print(
        f"  {'plain mmdebstrap, same packages':34s} {dt:8.1f} s   (tree only: no layers, no packing)",
        flush=True,
    )
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=None, help="layer cache (default: a fresh temporary one)")
    ap.add_argument("--skip-nvidia", action="store_true")
    ap.add_argument("--full", action="store_true", help="also build cuda-toolkit in full")
    args = ap.parse_args()
    recipes = image_recipe.load_recipes(REPO / "images")
    cache = args.cache or Path(tempfile.mkdtemp(prefix="bcm-bench-cache-", dir="/var/tmp"))
    print(f"image builds, layer cache {cache}", flush=True)
    figures: dict[str, float] = {}
    figures["peer"] = plain_mmdebstrap(recipes["base"])
    base = image_recipe.chain(recipes, "base")
    figures["base cold"], _ = timed_build("base, cold", base, cache)
    figures["base warm"], _ = timed_build("base, warm (layer cached)", base, cache)
    if not args.skip_nvidia:
        nvidia = image_recipe.chain(recipes, "nvidia-driver")
        figures["nvidia cold"], _ = timed_build("base+nvidia-driver, cold layer", nvidia, cache)
        figures["nvidia warm"], _ = timed_build("base+nvidia-driver, warm", nvidia, cache)
    if args.full:
        cuda = image_recipe.chain(recipes, "cuda-toolkit")
        figures["cuda cold"], _ = timed_build("+cuda-toolkit, cold layer", cuda, cache)
    print(
        f"\n  base cold / plain mmdebstrap: {figures['base cold'] / figures['peer']:.2f}x;"
        f" warm / cold: {figures['base warm'] / figures['base cold']:.2f}x"
    )
    if args.cache is None:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
