"""Benchmark: boot-artifact serving. 16 concurrent clients download a root image from a real `bcm serve`
(GET /boot/v1/images/…, the URL a booting node fetches) and the same file from nginx on the same disk.

The image is published through bcm's images service (one version whose rootfs is --size-mb MiB of random
data; kernel and initramfs are small), then both servers answer on loopback. The clients are `curl`
processes (the same client for both, so client cost cancels out), each downloading the file --rounds
times to /dev/null. Prints MiB/s for each and the ratio; asserts nothing (goal: bcm >= 0.9x nginx).
Needs nginx (`apt-get install nginx-light`; installed here when missing and run as root).

``--part vm`` (root; a lab): VM power-on → booted. A lab with one qemu VM behind a BMC emulator
(`bcm lab up --vms 1 --discover-vms`), the `lab` image (`bcm image build lab`), then:
  bcm: `bcm node provision` (next boot PXE and a power cycle through the BMC) → dnsmasq run by bcm →
       iPXE script from bcm → kernel, initramfs, root image and the node's overlay from bcm → the node's
       `bcm-hello` callback → `booted`; timed from the verb to `booted`.
  raw: bcm's PXE off; plain dnsmasq (the LAB.md recipe) and nginx serve the same kernel, initramfs and root
       image, a static iPXE script with the same kernel command line, and an overlay holding only the same
       `bcm-hello` service pointed at nginx; power-on through the same BMC, timed to the callback's request
       in nginx's log.
Prints both and the ratio (goal: bcm <= 1.1x raw). TCG VMs: minutes per boot.
Usage: .venv/bin/python bench/boot.py [--part serve,vm] [--clients 16] [--size-mb 256] [--rounds 4]
    [--boots 1]
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
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "nginx-light"],
        check=True,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        stdout=subprocess.DEVNULL,
    )
    return shutil.which("nginx") or "/usr/sbin/nginx"


def publish(state: Path, size_mb: int) -> Path:
    settings = Settings(state_dir=state)
    engine = make_engine(settings.effective_database_url, settings.db)
    with Session(engine) as s:
        image = image_svc.begin_build(s, "bootbench", None, "bench")
        staging = image_svc.staging_dir(settings.images_dir, "bootbench", image.version, 1)
        staging.mkdir(parents=True)
        found = []
        for kind, filename, size in (
            ("kernel", "vmlinuz", 8 << 20),
            ("initramfs", "initramfs.img", 16 << 20),
            ("rootfs", "rootfs.squashfs", size_mb << 20),
        ):
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


def serving(args: argparse.Namespace) -> None:
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
            (work / "nginx" / "nginx.conf").write_text(
                NGINX_CONF.format(dir=work / "nginx", port=port, root=vdir)
            )
            ngx = subprocess.Popen([nginx, "-c", str(work / "nginx" / "nginx.conf"), "-g", "daemon off;"])
            time.sleep(1)
            size = args.size_mb << 20
            # one warm-up each (page cache), then the measured runs, nginx first then bcm, twice
            download(f"{server.url}{rel}", 1, 1, size)
            download(f"http://127.0.0.1:{port}/rootfs.squashfs", 1, 1, size)
            results: dict[str, list[float]] = {"nginx": [], "bcm": []}
            for _ in range(2):
                results["nginx"].append(
                    download(f"http://127.0.0.1:{port}/rootfs.squashfs", args.clients, args.rounds, size)
                )
                results["bcm"].append(download(f"{server.url}{rel}", args.clients, args.rounds, size))
        finally:
            if ngx is not None:
                ngx.terminate()
                ngx.wait(timeout=10)
            server.stop()
    best = {k: max(v) for k, v in results.items()}
    print(
        f"artifact serving, {args.clients} concurrent clients x {args.rounds} x {args.size_mb} MiB (loopback, "
        f"{os.cpu_count()} cores):"
    )
    for k in ("nginx", "bcm"):
        print(f"  {k:6s} {best[k]:8.0f} MiB/s   (runs: {', '.join(f'{x:.0f}' for x in results[k])})")
    print(f"  bcm/nginx = {best['bcm'] / best['nginx']:.2f}x   (goal >= 0.9x)")


# ---- (b) VM power-on → booted ---------------------------------------------------------------------------

LAB, SUBNET, HEAD, RANGE = "bootbench", "198.18.90.0/24", "198.18.90.1", "198.18.90.100-198.18.90.150"
BOOT_WAIT_S = 1200

RAW_DNSMASQ = """# the LAB.md recipe: DHCP and TFTP for PXE only, nothing else
port=0
interface={interface}
bind-interfaces
except-interface=lo
pid-file={dir}/dnsmasq.pid
dhcp-leasefile={dir}/dnsmasq.leases
dhcp-range={start},{end},255.255.255.0,1h
dhcp-option=option:router
dhcp-option=option:dns-server
enable-ra
dhcp-range=2001:2::,ra-only,64
enable-tftp
tftp-root=/usr/lib/ipxe
dhcp-userclass=set:ipxe,iPXE
dhcp-match=set:ipxe,175
dhcp-match=set:efi64,option:client-arch,7
dhcp-match=set:efi64,option:client-arch,9
dhcp-boot=tag:ipxe,http://{head}:{port}/boot.ipxe
dhcp-boot=tag:!ipxe,tag:efi64,ipxe.efi
dhcp-boot=tag:!ipxe,tag:!efi64,undionly.kpxe
"""

RAW_NGINX = """
worker_processes 2;
user root;
pid {dir}/nginx.pid;
error_log {dir}/error.log;
events {{ worker_connections 1024; }}
http {{
    access_log {dir}/access.log;
    sendfile on;
    tcp_nopush on;
    server {{
        listen {head}:{port};
        root {root};
        location / {{ }}
    }}
}}
"""


def vm_boot(args: argparse.Namespace) -> None:
    import io
    import json
    import tarfile

    from bcm.devserver import BCM, REPO
    from bcm.lab import vm
    from bcm.services.render import render
    from bcm.settings import PxeSettings

    if os.geteuid() != 0:
        sys.exit("--part vm needs root (network namespaces, dnsmasq, qemu)")
    nginx = ensure_nginx()
    work = Path(tempfile.mkdtemp(prefix="bcm-bootbench-vm-"))
    server = Server(work / "state", host="0.0.0.0")

    def cli(*a: str, timeout: float = 1800) -> str:
        done = subprocess.run(
            [*BCM, *a],
            env=server.env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise SystemExit(f"bcm {' '.join(a)} failed: {done.stdout[-2000:]} {done.stderr[-2000:]}")
        return done.stdout

    procs: list[subprocess.Popen[bytes]] = []
    bcm_s: list[float] = []
    raw_s: list[float] = []
    try:
        server.start()
        cli(
            "lab",
            "up",
            "--nodes",
            "1",
            "--gpus",
            "0",
            "--vms",
            "1",
            "--discover-vms",
            "--name",
            LAB,
            "--subnet",
            SUBNET,
        )
        cli("image", "build", "lab", timeout=3600)
        image = json.loads(cli("image", "show", "lab", "--json"))
        cli("pxe", "enable", "--interface", f"{LAB}-prov", "--address", HEAD, "--range", RANGE)
        lab_dir = server.state_dir / "lab" / LAB
        (machine,) = vm.load(lab_dir)
        cli("lab", "vm-power", "on", "--pxe", "--name", LAB)
        cli("node", "discovered", "--wait", "1", "--timeout", str(BOOT_WAIT_S), timeout=BOOT_WAIT_S + 60)
        cli("node", "assign", machine.mac, "--name", "bb01", "--image", "lab")
        cli("lab", "vm-bmc", machine.name, "bb01", "--name", LAB)
        for i in range(args.boots):  # bcm: the verb → `booted` (`reimage` once the node has booted)
            t0 = time.monotonic()
            cli(
                "node",
                "reimage" if i else "provision",
                "bb01",
                "--wait",
                "--timeout",
                str(BOOT_WAIT_S),
                timeout=BOOT_WAIT_S + 60,
            )
            bcm_s.append(time.monotonic() - t0)
            print(f"bcm: provision → booted in {bcm_s[-1]:.1f} s", flush=True)
            # `booted` starts the node's first inventory; the next provision waits for it (else a 409)
            for op in json.loads(cli("op", "list", "--state", "running", "--json")):
                cli("op", "wait", str(op["id"]), "--json", timeout=BOOT_WAIT_S)

        # raw: bcm's PXE off, the VM off; plain dnsmasq and nginx serve the same files
        cli("pxe", "disable")
        cli("lab", "vm-power", "off", "--name", LAB)
        raw = work / "raw"
        root = raw / "www"
        root.mkdir(parents=True)
        vdir = server.state_dir / "images" / "lab" / image["version"]
        files = {a["kind"]: a for a in image["artifacts"]}
        for kind, target in (
            ("kernel", "vmlinuz"),
            ("initramfs", "initrd.img"),
            ("rootfs", "rootfs.squashfs"),
        ):
            os.link(vdir / files[kind]["filename"], root / target)  # same disk, same bytes
        port = free_port()
        url = f"http://{HEAD}:{port}"
        ctx = {"node": "bb01", "server_url": url, "head": HEAD, "hosts": []}
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for path, text, mode in (
                ("usr/local/sbin/bcm-hello", render("overlay/usr/local/sbin/bcm-hello.j2", **ctx), 0o755),
                (
                    "etc/systemd/system/bcm-hello.service",
                    render("overlay/etc/systemd/system/bcm-hello.service.j2", **ctx),
                    0o644,
                ),
            ):
                info = tarfile.TarInfo(path)
                info.size, info.mode = len(text.encode()), mode
                tar.addfile(info, io.BytesIO(text.encode()))
            link = tarfile.TarInfo("etc/systemd/system/multi-user.target.wants/bcm-hello.service")
            link.type, link.linkname = tarfile.SYMTYPE, "/etc/systemd/system/bcm-hello.service"
            tar.addfile(link)
        (root / "overlay.tar.gz").write_bytes(buf.getvalue())
        cmdline = " ".join(
            [
                f"bcm.root={url}/rootfs.squashfs",
                f"bcm.root_sha256={files['rootfs']['sha256']}",
                f"bcm.overlay={url}/overlay.tar.gz",
                f"bcm.server={url}",
                "bcm.node=bb01",
                f"bcm.mac={machine.mac}",
                "bcm.token=raw",
                PxeSettings().kernel_args,
            ]
        )
        (root / "boot.ipxe").write_text(
            f"#!ipxe\nkernel --name vmlinuz {url}/vmlinuz initrd=initrd.img {cmdline}\n"
            f"initrd --name initrd.img {url}/initrd.img\nboot\n"
        )
        start, end = RANGE.split("-")
        (raw / "dnsmasq.conf").write_text(
            RAW_DNSMASQ.format(interface=f"{LAB}-prov", dir=raw, start=start, end=end, head=HEAD, port=port)
        )
        (raw / "nginx.conf").write_text(RAW_NGINX.format(dir=raw, head=HEAD, port=port, root=root))
        procs.append(subprocess.Popen([nginx, "-c", str(raw / "nginx.conf"), "-g", "daemon off;"]))
        procs.append(
            subprocess.Popen(["dnsmasq", "--keep-in-foreground", "--conf-file=" + str(raw / "dnsmasq.conf")])
        )
        time.sleep(1)
        for _ in range(args.boots):
            log = raw / "access.log"
            seen = log.read_text().count("POST /boot/v1/hello") if log.exists() else 0
            t0 = time.monotonic()
            cli("lab", "vm-power", "on", "--pxe", "--name", LAB)
            give_up = t0 + BOOT_WAIT_S
            while time.monotonic() < give_up:
                if log.exists() and log.read_text().count("POST /boot/v1/hello") > seen:
                    break
                time.sleep(0.5)
            else:
                raise SystemExit(f"raw boot: no callback within {BOOT_WAIT_S} s; serial: {lab_dir}/vms")
            raw_s.append(time.monotonic() - t0)
            print(f"raw: power-on → callback in {raw_s[-1]:.1f} s", flush=True)
            cli("lab", "vm-power", "off", "--name", LAB)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
        subprocess.run(
            [*BCM, "lab", "down", "--name", LAB],
            env=server.env(),
            cwd=REPO,
            capture_output=True,
            timeout=300,
            check=False,
        )
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    b, r = min(bcm_s), min(raw_s)
    print(f"VM power-on → booted, 1 TCG VM ({os.cpu_count()} cores), best of {args.boots}:")
    print(f"  raw (dnsmasq + nginx)  {r:7.1f} s   (runs: {', '.join(f'{x:.1f}' for x in raw_s)})")
    print(f"  bcm                    {b:7.1f} s   (runs: {', '.join(f'{x:.1f}' for x in bcm_s)})")
    print(f"  bcm/raw = {b / r:.2f}x   (goal <= 1.1x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="serve", help="serve (artifact throughput), vm (boot time), or both")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--boots", type=int, default=1, help="vm: boots of each kind")
    args = ap.parse_args()
    parts = args.part.split(",")
    if unknown := set(parts) - {"serve", "vm"}:
        raise SystemExit(f"unknown part {sorted(unknown)}")
    if "serve" in parts:
        serving(args)
    if "vm" in parts:
        vm_boot(args)


if __name__ == "__main__":
    main()
