"""The small certificate authority bcm keeps for a Kubernetes cluster, and the credentials made from it.

Everything is made once per cluster and kept 0600 under the cluster's secrets directory; a second plan
reuses what is there (the cluster's identity does not change on a redeploy). Nothing here is logged: the
functions return paths and public facts (the CA hash a join pins), never key material.

- ``ca.crt``/``ca.key``: the cluster CA (kubeadm uses it when it finds it in /etc/kubernetes/pki; the lab
  control plane signs everything with it).
- ``sa.key``/``sa.pub``: the service-account signing pair.
- ``apiserver.crt``/``.key``: the API server's serving certificate, for the control plane's address and
  the in-cluster names.
- ``admin.crt``/``.key`` (``system:masters``): what bcm itself uses from the head node.
- ``kueue.crt``/``.key``: Kueue's webhook serving certificate (the API server calls it).
- ``node-<name>.crt``/``.key`` (group ``bcm:kwok`` in the lab): what a simulated kubelet uses.
- ``bootstrap.token``: the kubeadm bootstrap token (``[a-z0-9]{6}.[a-z0-9]{16}``) a join presents.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import secrets
import string
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bcm.drivers.wlm.base import write_private

CA_DAYS = 3650
CERT_DAYS = 825
KWOK_GROUP = "bcm:kwok"
_TOKEN_ALPHABET = string.ascii_lowercase + string.digits


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _pem_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return key


def ensure_ca(d: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    crt, key = d / "ca.crt", d / "ca.key"
    if not (crt.exists() and key.exists()):
        k = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bcm-kubernetes-ca")])
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - dt.timedelta(minutes=5))
            .not_valid_after(_now() + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(k.public_key()), critical=False)
            .sign(k, hashes.SHA256())
        )
        write_private(key, _pem_key(k))
        write_private(crt, cert.public_bytes(serialization.Encoding.PEM))
    cert = x509.load_pem_x509_certificate(crt.read_bytes())
    return cert, _load_key(key)


def ensure_cert(
    d: Path,
    stem: str,
    cn: str,
    *,
    orgs: tuple[str, ...] = (),
    dns: tuple[str, ...] = (),
    ips: tuple[str, ...] = (),
    server: bool = False,
) -> tuple[Path, Path]:
    """``<stem>.crt``/``<stem>.key`` signed by the cluster CA; made again only when its names changed."""
    crt, key = d / f"{stem}.crt", d / f"{stem}.key"
    want_dns, want_ips = sorted(dns), sorted(ips)
    if crt.exists() and key.exists():
        old = x509.load_pem_x509_certificate(crt.read_bytes())
        try:
            san = old.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            have = (
                sorted(san.get_values_for_type(x509.DNSName)),
                sorted(str(i) for i in san.get_values_for_type(x509.IPAddress)),
            )
        except x509.ExtensionNotFound:
            have = ([], [])
        if have == (want_dns, want_ips) and old.not_valid_after_utc > _now() + dt.timedelta(days=30):
            return crt, key
    ca_cert, ca_key = ensure_ca(d)
    k = ec.generate_private_key(ec.SECP256R1())
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, cn))
    usage = [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(attrs))
        .issuer_name(ca_cert.subject)
        .public_key(k.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - dt.timedelta(minutes=5))
        .not_valid_after(_now() + dt.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, True, False, False, False, False, False, False), critical=True
        )
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    )
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in want_dns]
    names += [x509.IPAddress(ipaddress.ip_address(i)) for i in want_ips]
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    write_private(key, _pem_key(k))
    write_private(crt, cert.public_bytes(serialization.Encoding.PEM))
    return crt, key


def ensure_sa_keys(d: Path) -> tuple[Path, Path]:
    priv, pub = d / "sa.key", d / "sa.pub"
    if not (priv.exists() and pub.exists()):
        k = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        write_private(priv, _pem_key(k))
        write_private(
            pub,
            k.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
        )
    return priv, pub


def ensure_bootstrap_token(d: Path) -> str:
    """The kubeadm bootstrap token, made once; the caller writes it only into 0600 files."""
    path = d / "bootstrap.token"
    if not path.exists():
        tid = "".join(secrets.choice(_TOKEN_ALPHABET) for _ in range(6))
        sec = "".join(secrets.choice(_TOKEN_ALPHABET) for _ in range(16))
        write_private(path, f"{tid}.{sec}".encode())
    return path.read_text().strip()


def ca_cert_hash(d: Path) -> str:
    """``sha256:<hex>`` of the CA's public key (what ``kubeadm join --discovery-token-ca-cert-hash`` pins)."""
    cert, _ = ensure_ca(d)
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256:" + hashlib.sha256(spki).hexdigest()


def ca_bundle(d: Path) -> str:
    """The CA certificate, base64 (a webhook's ``caBundle``)."""
    return base64.b64encode((d / "ca.crt").read_bytes()).decode()


def kubeconfig(d: Path, server: str, user: str, crt: Path, key: Path, *, cluster: str = "bcm") -> str:
    """A kubeconfig with the CA, client certificate and key inline (written 0600 by the caller)."""

    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: {cluster}\n  cluster:\n    server: {server}\n"
        f"    certificate-authority-data: {b64(d / 'ca.crt')}\n"
        f"users:\n- name: {user}\n  user:\n    client-certificate-data: {b64(crt)}\n"
        f"    client-key-data: {b64(key)}\n"
        f"contexts:\n- name: {user}@{cluster}\n  context:\n    cluster: {cluster}\n    user: {user}\n"
        f"current-context: {user}@{cluster}\n"
    )
