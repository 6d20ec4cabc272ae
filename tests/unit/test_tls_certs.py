"""bcm's API CA and the server certificate it issues (bcm.services.tls): names, validity, usage, renewal."""

from __future__ import annotations

import datetime as dt
import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID

from bcm.errors import InvalidInput
from bcm.services import tls
from bcm.settings import Settings

NOW = dt.datetime(2026, 12, 7, 6, 0, tzinfo=dt.UTC)


def _ext(cert: x509.Certificate, kind: type) -> object:
    return cert.extensions.get_extension_for_class(kind)


def test_server_certificate_names_validity_and_usage() -> None:
    ca, ca_key = tls.make_ca(NOW, "bcm API CA (test)")
    cert, _key = tls.issue_server(ca, ca_key, ["bcm-head.test", "198.18.0.1", "2001:db8::1"], NOW)

    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["bcm-head.test"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("198.18.0.1"),
        ipaddress.ip_address("2001:db8::1"),
    ]
    assert cert.not_valid_before_utc <= NOW < cert.not_valid_after_utc
    assert cert.not_valid_after_utc - NOW == dt.timedelta(days=tls.SERVER_DAYS)

    basic = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and basic.value.ca is False  # a server certificate cannot sign another
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature and not usage.key_cert_sign and not usage.crl_sign
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    cert.verify_directly_issued_by(ca)
    assert cert.issuer == ca.subject


def test_the_ca_signs_certificates_only() -> None:
    ca, _key = tls.make_ca(NOW, "bcm API CA (test)")
    basic = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and basic.value.ca is True and basic.value.path_length == 0
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign and not usage.digital_signature
    assert ca.not_valid_after_utc - NOW == dt.timedelta(days=tls.CA_DAYS)
    ca.verify_directly_issued_by(ca)  # self-signed


def test_a_certificate_needs_a_name() -> None:
    ca, ca_key = tls.make_ca(NOW, "ca")
    with pytest.raises(InvalidInput, match="at least one name"):
        tls.issue_server(ca, ca_key, [], NOW)


def test_fingerprint_round_trip_and_bad_input() -> None:
    ca, _key = tls.make_ca(NOW, "ca")
    fp = tls.fingerprint(ca)
    digest = ca.fingerprint(hashes.SHA256())
    assert fp == "SHA256:" + ":".join(f"{b:02X}" for b in digest)
    for written in (fp, fp.lower(), fp.removeprefix("SHA256:"), digest.hex(), "sha256 Fingerprint=" + fp[7:]):
        assert tls.parse_fingerprint(written) == digest
    for bad in ("", "SHA256:", fp[:-3], fp + "00", "SHA256:" + "zz" * 32, "md5:" + digest.hex()):
        with pytest.raises(InvalidInput, match="fingerprint"):
            tls.parse_fingerprint(bad)


def test_files_kept_while_names_hold_and_issued_again_when_they_change(tmp_path: Path) -> None:
    d = tmp_path / "tls"
    assert tls.ensure_server_cert(d, ["bcm-head.test", "198.18.0.1"], NOW) is True
    assert stat.S_IMODE((d / "ca.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((d / "server.key").stat().st_mode) == 0o600
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    ca_before = (d / "ca.crt").read_bytes()
    server_before = (d / "server.crt").read_bytes()

    assert tls.ensure_server_cert(d, ["BCM-HEAD.test", "198.18.0.1"], NOW) is False  # same names
    assert (d / "server.crt").read_bytes() == server_before
    assert tls.ensure_server_cert(d, ["bcm-head.test", "198.18.0.2"], NOW) is True  # an address changed
    cert = x509.load_pem_x509_certificate((d / "server.crt").read_bytes())
    assert tls.san_names(cert) == {"bcm-head.test", "198.18.0.2"}
    later = cert.not_valid_after_utc - dt.timedelta(days=tls.RENEW_DAYS - 1)
    assert tls.ensure_server_cert(d, ["bcm-head.test", "198.18.0.2"], later) is True  # close to expiry
    assert (d / "ca.crt").read_bytes() == ca_before  # the CA an admin fetched stays


def test_default_names_cover_loopback_host_pxe_and_extra(tmp_path: Path) -> None:
    s = Settings(state_dir=tmp_path, host="198.18.0.5")
    s.pxe.address = "198.18.0.1"
    s.tls.names = "bcm.example.test, 198.18.7.7"
    names = tls.default_names(s, pxe_address="198.18.0.9")
    assert names[:3] == ["localhost", "127.0.0.1", "::1"]
    assert {"198.18.0.5", "198.18.0.9", "198.18.0.1", "bcm.example.test", "198.18.7.7"} <= set(names)
    assert len(names) == len(set(names))
    wildcard = tls.default_names(Settings(state_dir=tmp_path, host="0.0.0.0"))
    assert "0.0.0.0" not in wildcard


def test_admin_pair_must_match(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    ca, ca_key = tls.make_ca(NOW, "admin CA")
    cert, key = tls.issue_server(ca, ca_key, ["bcm-head.test"], NOW)
    _other_cert, other_key = tls.issue_server(ca, ca_key, ["bcm-head.test"], NOW)
    pem = serialization.Encoding.PEM
    crt = tmp_path / "head.crt"
    crt.write_bytes(cert.public_bytes(pem))
    right, wrong = tmp_path / "right.key", tmp_path / "wrong.key"
    for path, k in ((right, key), (wrong, other_key)):
        path.write_bytes(
            k.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
    ca_file = tmp_path / "ca.crt"
    ca_file.write_bytes(ca.public_bytes(pem))
    assert tls.check_admin_pair(crt, right, ca_file) == ca_file.read_bytes()
    assert tls.check_admin_pair(crt, right, None) is None
    with pytest.raises(
        InvalidInput, match="BCM_TLS__KEY_FILE: .*wrong.key is not the key of the certificate"
    ):
        tls.check_admin_pair(crt, wrong, None)
    with pytest.raises(InvalidInput, match=r"BCM_TLS__KEY_FILE: cannot read .*missing.key \(No such file"):
        tls.check_admin_pair(crt, tmp_path / "missing.key", None)
    with pytest.raises(InvalidInput, match="BCM_TLS__CERT_FILE .*not a PEM certificate"):
        tls.check_admin_pair(right, right, None)
    with pytest.raises(InvalidInput, match="BCM_TLS__KEY_FILE: .*not an unencrypted PEM private key"):
        tls.check_admin_pair(crt, crt, None)


def test_half_a_ca_is_refused_not_replaced(tmp_path: Path) -> None:
    d = tmp_path / "tls"
    tls.ensure_server_cert(d, ["bcm-head.test"], NOW)
    ca = (d / "ca.crt").read_bytes()
    (d / "ca.key").unlink()
    with pytest.raises(InvalidInput, match="ca.key is missing beside .*ca.crt"):
        tls.ensure_server_cert(d, ["bcm-head.test"], NOW)
    assert (d / "ca.crt").read_bytes() == ca
