"""Benchmark: boot-artifact serving. 16 concurrent clients download a root image from a real `bcm serve`
(GET /boot/v1/images/…, the URL a booting node fetches) and the same file from nginx on the same disk.

The image is published through bcm's images service (one version whose rootfs is --size-mb MiB of random
data; kernel and initramfs are small), then both servers answer on loopback. The clients are `curl`
processes (the same client for both, so client cost cancels out), each downloading the file --rounds
times to /dev/null. Prints MiB/s for each and the ratio; asserts nothing (goal: bcm >= 0.9x nginx).
Needs nginx (`apt-get install nginx-light`; installed here when missing and run as root).

VM power-on → booted against a raw dnsmasq + nginx boot (the other half of the boot benchmark) is not
measured yet: see tests/lab/test_pxe.py for the real boot, which prints its power-on → booted time.
Usage: .venv/bin/python bench/boot.py [--clients 16] [--size-mb 256] [--rounds 4]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sqlmodel import Session

from bcm.db import make_engine
from bcm.devserver import Server, free_port
from bcm.drivers import imagebuild
from bcm.services import images as image_svc
from bcm.settings import Settings

NGINX_CONF = """
worker_processes 2;
user root;  # the files are in bcm's state directory (0700)
pid {dir}/nginx.pid;
error_log {dir}/error.log;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{ }}
    }}
}}
"""


def ensure_nginx() -> str:
    found = shutil.which("nginx") or (os.path.exists("/usr/sbin/nginx") and "/usr/sbin/nginx") or None
    if found:
        return found
    if os.geteuid() != 0:
        sys.exit("nginx is not installed (apt-get install nginx-light)")
    print("installing nginx-light (apt-get) …", flush=True)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "nginx-light"], check=True,
                   env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, stdout=subprocess.DEVNULL)  # fmt: skip
    return shutil.which("nginx") or "/usr/sbin/nginx"


def publish(state: Path, size_mb: int) -> Path:
    settings = Settings(state_dir=state)
    engine = make_engine(settings.effective_database_url, settings.db)
    with Session(engine) as s:
        image = image_svc.begin_build(s, "bootbench", None, "bench")
        staging = image_svc.staging_dir(settings.images_dir, "bootbench", image.version, 1)
        staging.mkdir(parents=True)
        found = []
        for kind, filename, size in (("kernel", "vmlinuz", 8 << 20), ("initramfs", "initramfs.img", 16 << 20),
                                     ("rootfs", "rootfs.squashfs", size_mb << 20)):  # fmt: skip
            h = hashlib.sha256()
            with open(staging / filename, "wb") as f:
                left = size
                while left:
                    chunk = os.urandom(min(left, 4 << 20))
                    f.write(chunk)
                    h.update(chunk)
                    left -= len(chunk)
            found.append(imagebuild.Artifact(kind, filename, size, h.hexdigest()))
        image_svc.publish(s, image, staging, settings.images_dir, found, {}, 3)
        s.commit()
        version = image.version
    engine.dispose()
    return image_svc.version_dir(settings.images_dir, "bootbench", version)


def download(url: str, clients: int, rounds: int, size: int) -> float:
    """MiB/s for ``clients`` curl processes fetching ``url`` ``rounds`` times each."""
    script = f'for i in $(seq {rounds}); do curl -sf -o /dev/null --noproxy "*" "{url}" || exit 1; done'
    start = time.monotonic()
    procs = [subprocess.Popen(["sh", "-c", script]) for _ in range(clients)]
    codes = [p.wait(timeout=1800) for p in procs]
    elapsed = time.monotonic() - start
    if any(codes):
        sys.exit(f"a download from {url} failed: {codes}")
    return clients * rounds * size / (1 << 20) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    nginx = ensure_nginx()
    with tempfile.TemporaryDirectory(prefix="bcm-bootbench-") as tmp:
        work = Path(tmp)
        server = Server(work / "state", extra_env={"BCM_IMAGES__MAX_TRANSFERS": str(2 * args.clients)})
        server.start()
        ngx = None
        try:
            vdir = publish(server.state_dir, args.size_mb)
            rel = f"/boot/v1/images/bootbench/{vdir.name}/rootfs.squashfs"
            port = free_port()
            (work / "nginx").mkdir()
            (work / "nginx" / "nginx.conf").write_text(NGINX_CONF.format(dir=work / "nginx", port=port, root=vdir))
            ngx = subprocess.Popen([nginx, "-c", str(work / "nginx" / "nginx.conf"), "-g", "daemon off;"])
            time.sleep(1)
            size = args.size_mb << 20
            # one warm-up each (page cache), then the measured runs, nginx first then bcm, twice
            download(f"{server.url}{rel}", 1, 1, size)
            download(f"http://127.0.0.1:{port}/rootfs.squashfs", 1, 1, size)
            results: dict[str, list[float]] = {"nginx": [], "bcm": []}
            for _ in range(2):
                results["nginx"].append(download(f"http://127.0.0.1:{port}/rootfs.squashfs", args.clients, args.rounds, size))
                results["bcm"].append(download(f"{server.url}{rel}", args.clients, args.rounds, size))
        finally:
            if ngx is not None:
                ngx.terminate()
                ngx.wait(timeout=10)
            server.stop()
    best = {k: max(v) for k, v in results.items()}
    print(f"artifact serving, {args.clients} concurrent clients x {args.rounds} x {args.size_mb} MiB (loopback, "
          f"{os.cpu_count()} cores):")  # fmt: skip
    for k in ("nginx", "bcm"):
        print(f"  {k:6s} {best[k]:8.0f} MiB/s   (runs: {', '.join(f'{x:.0f}' for x in results[k])})")
    print(f"  bcm/nginx = {best['bcm'] / best['nginx']:.2f}x   (goal >= 0.9x)")


if __name__ == "__main__":
    main()
