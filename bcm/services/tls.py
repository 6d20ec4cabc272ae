"""The API over TLS: bcm's own CA, the server certificate it issues, or an admin's certificate checked.

``<state_dir>/tls/`` holds ``ca.crt`` (public: what ``bcm ca fetch`` downloads and what nodes get in their
overlay), ``ca.key`` (0600, never leaves the head) and ``server.crt``/``server.key`` (0600), issued for
the head's names and addresses. The server certificate is issued again at start when the names changed,
the CA changed or fewer than ``RENEW_DAYS`` remain; the CA stays, so an admin fetches it once.

Why a CA of its own and not the Kubernetes cluster CA (``bcm/drivers/wlm/k8s_pki.py``): that one exists
per Kubernetes cluster, only once a cluster is deployed, and kubeadm trusts it for client certificates;
bcm's API CA signs nothing but bcm's server certificate.

With ``BCM_TLS__CERT_FILE``/``KEY_FILE`` the admin's pair is served instead (checked at start: readable,
parseable, the key matches the certificate), and ``BCM_TLS__CA_FILE`` is the CA published beside it.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bcm.errors import InvalidInput
from bcm.settings import Settings

CA_DAYS = 3650
SERVER_DAYS = 825
RENEW_DAYS = 30
CA_PATH = "/boot/v1/ca.pem"  # public: served on the boot port too


@dataclass(frozen=True)
class ServerTls:
    """What uvicorn serves, and the CA clients and nodes verify it against (None: the admin's, unpublished)."""

    cert_file: Path
    key_file: Path
    ca_pem: bytes | None


# ---- fingerprints -------------------------------------------------------------------------------------


def fingerprint(cert: x509.Certificate) -> str:
    """``SHA256:AB:CD:…``: the SHA-256 of the DER certificate, as ``openssl x509 -fingerprint -sha256``."""
    return "SHA256:" + ":".join(f"{b:02X}" for b in cert.fingerprint(hashes.SHA256()))


def parse_fingerprint(text: str) -> bytes:
    """The 32 bytes of a fingerprint written ``SHA256:AB:CD:…``, ``sha256 Fingerprint=…`` or plain hex."""
    t = text.strip()
    t = re.sub(r"^(sha256\s+fingerprint=|sha256:)", "", t, flags=re.IGNORECASE)
    digits = t.replace(":", "")
    if not re.fullmatch(r"[0-9A-Fa-f]{64}", digits):
        raise InvalidInput(
            "fingerprint: expected SHA256: and 64 hex digits (colons allowed), as `bcm ca show` prints it",
            field="fingerprint",
        )
    return bytes.fromhex(digits)


def load_pem_cert(data: bytes, what: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError:
        raise InvalidInput(f"{what}: not a PEM certificate") from None


# ---- issuing ------------------------------------------------------------------------------------------


def default_names(settings: Settings, pxe_address: str | None = None) -> list[str]:
    """The names and addresses the server certificate covers: loopback, this host's names, the listen and
    PXE addresses, and ``tls.names``; in that order, without repeats."""
    names = ["localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()]
    if settings.host not in ("0.0.0.0", "::", ""):
        names.append(settings.host)
    for address in (pxe_address, settings.pxe.address):
        if address:
            names.append(address)
    names += settings.tls.extra_names
    seen: dict[str, None] = {}
    for n in names:
        seen.setdefault(n.strip().lower(), None)
    return [n for n in seen if n]


def _san(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for n in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            entries.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(entries)


def make_ca(now: dt.datetime, common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A CA that may sign server certificates only (path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(ca=True), critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def issue_server(
    ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, names: list[str], now: dt.datetime
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A server certificate (not a CA) for ``names`` (DNS names and IP addresses), signed by the CA."""
    if not names:
        raise InvalidInput("tls.names: the certificate needs at least one name", field="tls.names")
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=SERVER_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(_san(names), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def san_names(cert: x509.Certificate) -> set[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(v).lower() for v in san.get_values_for_type(x509.DNSName)} | {
        str(v) for v in san.get_values_for_type(x509.IPAddress)
    }


def _normal(names: list[str]) -> set[str]:
    out = set()
    for n in names:
        try:
            out.add(str(ipaddress.ip_address(n)))
        except ValueError:
            out.add(n.lower())
    return out


# ---- files --------------------------------------------------------------------------------------------


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write atomically with ``mode`` from the first byte (a key is never readable by others, even briefly)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def ensure_ca(tls_dir: Path, now: dt.datetime | None = None) -> x509.Certificate:
    """bcm's API CA, made on first use (``ca.crt`` 0644, ``ca.key`` 0600)."""
    tls_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    crt, key = tls_dir / "ca.crt", tls_dir / "ca.key"
    if crt.exists() and key.exists():
        return load_pem_cert(crt.read_bytes(), str(crt))
    if crt.exists() or key.exists():  # never a new CA over half of one an admin copied or fetched
        have, lack = (crt, key) if crt.exists() else (key, crt)
        raise InvalidInput(
            f"{lack} is missing beside {have}: copy both from the head that made them, or remove "
            f"{have} for a new CA (every client then fetches it again)"
        )
    cert, private = make_ca(now or dt.datetime.now(dt.UTC), f"bcm API CA ({socket.gethostname()[:40]})")
    _write(key, _key_pem(private), 0o600)
    _write(crt, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert


def ensure_server_cert(tls_dir: Path, names: list[str], now: dt.datetime | None = None) -> bool:
    """``server.crt``/``server.key`` for ``names``, signed by the CA; True when it was (re)issued."""
    now = now or dt.datetime.now(dt.UTC)
    ca_cert = ensure_ca(tls_dir, now)
    crt, key = tls_dir / "server.crt", tls_dir / "server.key"
    if crt.exists() and key.exists():
        current = load_pem_cert(crt.read_bytes(), str(crt))
        fresh = current.not_valid_after_utc - now > dt.timedelta(days=RENEW_DAYS)
        if fresh and current.issuer == ca_cert.subject and san_names(current) == _normal(names):
            try:
                current.verify_directly_issued_by(ca_cert)
                return False
            except (InvalidSignature, ValueError, TypeError):  # another CA's: issue a new one
                pass
    loaded = serialization.load_pem_private_key((tls_dir / "ca.key").read_bytes(), password=None)
    if not isinstance(loaded, ec.EllipticCurvePrivateKey):
        raise InvalidInput(f"{tls_dir / 'ca.key'}: not bcm's CA key (an EC key)")
    cert, private = issue_server(ca_cert, loaded, names, now)
    _write(key, _key_pem(private), 0o600)
    _write(crt, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return True


def _read(path: Path, setting: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidInput(f"setting {setting}: cannot read {path} ({exc.strerror})", field=setting) from None


def check_admin_pair(cert_file: Path, key_file: Path, ca_file: Path | None) -> bytes | None:
    """The admin's certificate and key are readable, parse, and belong together; returns the CA's PEM."""
    cert = load_pem_cert(_read(cert_file, "BCM_TLS__CERT_FILE"), f"setting BCM_TLS__CERT_FILE ({cert_file})")
    key_pem = _read(key_file, "BCM_TLS__KEY_FILE")
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise InvalidInput(
            f"setting BCM_TLS__KEY_FILE: {key_file} is not an unencrypted PEM private key",
            field="BCM_TLS__KEY_FILE",
        ) from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, public) != cert.public_key().public_bytes(
        serialization.Encoding.DER, public
    ):
        raise InvalidInput(
            f"setting BCM_TLS__KEY_FILE: {key_file} is not the key of the certificate in {cert_file}",
            field="BCM_TLS__KEY_FILE",
        )
    if ca_file is None:
        return None
    data = _read(ca_file, "BCM_TLS__CA_FILE")
    load_pem_cert(data, f"setting BCM_TLS__CA_FILE ({ca_file})")
    return data


def check_settings(settings: Settings) -> ServerTls | None:
    """Before anything starts: the TLS settings fit together, and an admin's pair is readable, parses and
    matches (returned); None when bcm's own CA is to issue the certificate. Bad settings are one
    :class:`InvalidInput` naming the variable."""
    t = settings.tls
    if (t.cert_file is None) != (t.key_file is None):
        missing = "BCM_TLS__KEY_FILE" if t.key_file is None else "BCM_TLS__CERT_FILE"
        raise InvalidInput(
            f"setting {missing}: BCM_TLS__CERT_FILE and BCM_TLS__KEY_FILE go together", field=missing
        )
    if t.cert_file is not None and t.key_file is not None:
        return ServerTls(t.cert_file, t.key_file, check_admin_pair(t.cert_file, t.key_file, t.ca_file))
    if t.ca_file is not None:
        raise InvalidInput(
            "setting BCM_TLS__CA_FILE: only with BCM_TLS__CERT_FILE and BCM_TLS__KEY_FILE",
            field="BCM_TLS__CA_FILE",
        )
    return None


def prepare(settings: Settings, pxe_address: str | None = None) -> ServerTls:
    """At ``bcm serve`` start, with TLS on: the pair to serve (the admin's, checked, or bcm's, issued as
    needed for this head's names) and the CA to publish."""
    admin = check_settings(settings)
    if admin is not None:
        return admin
    d = settings.tls_dir
    ensure_server_cert(d, default_names(settings, pxe_address))
    return ServerTls(d / "server.crt", d / "server.key", (d / "ca.crt").read_bytes())


def is_admin_pair(settings: Settings) -> bool:
    return settings.tls.cert_file is not None


def published_ca(settings: Settings) -> Path | None:
    """The CA file clients fetch on this head: the admin's ``tls.ca_file``, else bcm's once it exists."""
    if settings.tls.ca_file is not None:
        return settings.tls.ca_file
    path = settings.tls_dir / "ca.crt"
    return path if path.exists() else None


def node_api_url(settings: Settings) -> str | None:
    """The https URL nodes' agents reach the API at (None while TLS is off): ``tls.api_url`` or the PXE
    address (else the listen address) and the API port."""
    if not settings.tls.enabled:
        return None
    if settings.tls.api_url:
        return settings.tls.api_url.rstrip("/")
    host = settings.pxe.address or settings.host
    if ":" in host:
        host = f"[{host}]"
    return f"https://{host}:{settings.port}"
