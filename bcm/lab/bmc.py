"""Simulated BMCs for lab machines: OpenIPMI's ``ipmi_sim`` (IPMI LAN) and sushy-tools (Redfish).

Each BMC controls one machine directory (``bcm.lab.chassis``): power on starts the machine's process,
power off kills it, and a one-time PXE boot is passed to its next start. The emulators listen on
the address given (a lab address on the bridge, or 127.0.0.1 in driver tests); their configuration is
rendered from ``templates/lab/`` and holds the BMC password, so it is written 0600 and never logged.
A Redfish BMC serves https with its own self-signed certificate, made at its first start (as a real
BMC's is): bcm pins it on first contact.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from bcm.lab import procs
from bcm.lab.errors import LabError
from bcm.services.render import render

READY_TIMEOUT_S = 30.0
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class BmcSpec:
    """One simulated BMC: what it is, where it listens, who may log in, which machine it drives."""

    kind: str  # "ipmi" | "redfish"
    name: str
    listen: str
    port: int
    user: str
    password: str
    directory: str  # holds machine.json, the emulator's config and logs

    @property
    def dir(self) -> Path:
        return Path(self.directory)

    @property
    def address(self) -> str:
        """What bcm stores as the node's ``bmc_address``."""
        if self.kind == "redfish":
            return f"https://{self.listen}:{self.port}"
        return f"{self.listen}:{self.port}"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def write_machine(spec: BmcSpec, argv: list[str]) -> None:
    """The machine the BMC powers: its command line (``{boot}`` becomes n or c at each start)."""
    spec.dir.mkdir(parents=True, exist_ok=True)
    (spec.dir / "machine.json").write_text(json.dumps({"argv": argv}, indent=2) + "\n")


def chassis_command(spec: BmcSpec) -> str:
    return f"{sys.executable} -m bcm.lab.chassis {spec.dir}"


def render_ipmi(spec: BmcSpec) -> tuple[str, str]:
    """(lan.conf, commands file) for ipmi_sim."""
    context = {
        "machine": spec.name,
        "listen": spec.listen,
        "port": spec.port,
        "user": spec.user,
        "password": spec.password,
        "guid": uuid.uuid5(uuid.NAMESPACE_DNS, f"{spec.name}.bmc.lab").hex,
        "chassis_command": chassis_command(spec),
    }
    return render("lab/ipmi_sim/lan.conf.j2", **context), render("lab/ipmi_sim/bmc.emu.j2", **context)


def render_redfish(spec: BmcSpec, mac: str) -> str:
    """The sushy-tools emulator's config file (a Python file of settings)."""
    return render(
        "lab/sushy/emulator.conf.j2",
        machine=spec.name,
        listen=spec.listen,
        port=spec.port,
        auth_file=str(spec.dir / "htpasswd"),
        state_dir=str(spec.dir / "state"),
        uuid=str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{spec.name}.redfish.lab")),
        mac=mac,
    )


def _private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def make_certificate(directory: Path, host: str) -> str:
    """A self-signed certificate for ``host`` (tls.crt, tls.key 0600) unless there is one; its sha256 (hex, DER)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    crt, key_file = directory / "tls.crt", directory / "tls.key"
    if not crt.exists():
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"bmc {host}")])
        now = datetime.datetime.now(datetime.UTC)
        try:
            alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            alt = x509.DNSName(host)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
            .sign(key, hashes.SHA256())
        )
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        _private(key_file, pem.decode())
        crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return certificate_sha256(crt)


def certificate_sha256(crt: Path) -> str:
    """The sha256 (hex) of a PEM certificate's DER form: what bcm pins."""
    import ssl

    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(crt.read_text())).hexdigest()


def _check_password(password: str) -> None:
    # the IPMI config quotes it and ipmi_sim allows at most 20 bytes (IPMI v2 passwords)
    if not (1 <= len(password) <= 20) or not password.isascii() or any(c in password for c in '"\\ \n'):
        raise LabError("a lab BMC password must be 1-20 printable ASCII characters without quotes or spaces")


def start(
    spec: BmcSpec, *, netns: str | None = None, mac: str = "52:54:00:00:00:00"
) -> subprocess.Popen[bytes]:
    """Write the emulator's files and start it (in ``netns`` when given); returns once it listens."""
    _check_password(spec.password)
    spec.dir.mkdir(parents=True, exist_ok=True)
    if spec.kind == "ipmi":
        lan, emu = render_ipmi(spec)
        _private(spec.dir / "lan.conf", lan)
        _private(spec.dir / "bmc.emu", emu)
        (spec.dir / "ipmi-state").mkdir(exist_ok=True)
        ipmi_sim = shutil.which("ipmi_sim")
        if ipmi_sim is None:
            raise LabError("ipmi_sim is not installed (Debian package openipmi)")
        argv = [
            ipmi_sim,
            "-c",
            str(spec.dir / "lan.conf"),
            "-f",
            str(spec.dir / "bmc.emu"),
            "-s",
            str(spec.dir / "ipmi-state"),
            "-n",
            "-p",
        ]
    elif spec.kind == "redfish":
        import bcrypt

        hashed = bcrypt.hashpw(spec.password.encode(), bcrypt.gensalt(rounds=4)).decode()
        _private(spec.dir / "htpasswd", f"{spec.user}:{hashed}\n")
        _private(spec.dir / "emulator.conf", render_redfish(spec, mac))
        make_certificate(spec.dir, spec.listen)
        (spec.dir / "state").mkdir(exist_ok=True)
        argv = [sys.executable, "-m", "bcm.lab.redfish_bmc", str(spec.dir / "emulator.conf"), str(spec.dir)]
    else:
        raise LabError(f"unknown BMC kind {spec.kind!r} (ipmi or redfish)")
    if netns:
        argv = ["nsenter", f"--net=/run/netns/{netns}", *argv]
    with open(spec.dir / "bmc.log", "ab") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=REPO_ROOT, start_new_session=True
        )
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not _listening(proc.pid, spec):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc.pid)
            tail = (spec.dir / "bmc.log").read_text(errors="replace")[-1500:]
            raise LabError(f"{spec.kind} BMC of {spec.name} did not start on {spec.address}:\n{tail}")
        time.sleep(0.05)
    return proc


def _listening(pid: int, spec: BmcSpec) -> bool:
    if spec.kind == "redfish":
        return procs.listening_on(pid, spec.port)
    wanted = f":{spec.port:04X}"
    try:
        lines = Path(f"/proc/{pid}/net/udp").read_text().splitlines()[1:]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return any(line.split()[1].endswith(wanted) for line in lines if len(line.split()) > 1)


def stop(pid: int | None, directory: Path | None = None) -> None:
    """Stop a BMC and the machine it powers (a machine outlives its BMC otherwise)."""
    import signal

    if pid is not None:
        procs.send([pid], signal.SIGKILL)
        procs.wait_gone([pid], 5.0)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    if directory is not None and (directory / "machine.json").exists():
        from bcm.lab.chassis import Machine

        Machine(directory).power_off()
