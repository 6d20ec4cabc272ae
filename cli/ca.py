"""`bcm ca fetch` and `bcm ca show`: the CA the API's certificate chains to, fetched once and checked by
fingerprint, or shown on the head (a local file, like `bcm serve` is a local process)."""

from __future__ import annotations

import hmac
import os
import ssl
from pathlib import Path
from typing import Annotated

import httpx
import typer
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from cli.client import CliError, _url, user_ca_file, verify_context
from cli.common import JsonOpt, _state
from cli.render import emit_json, out

app = typer.Typer(
    help="bcm's API CA: fetch it once (checked by its fingerprint), or show it on the head.",
    no_args_is_help=True,
)

FingerprintOpt = Annotated[
    str,
    typer.Option(
        "--fingerprint", help="SHA256:AB:CD:… as `bcm ca show` prints it on the head (or 64 hex digits)"
    ),
]


def _fetch_pem(url: str) -> bytes:
    """GET the CA certificate from ``url`` (no token is sent). Over https the connection is not what vouches
    for the answer, since the CA to check it with is what is being fetched: the fingerprint the admin
    typed does, checked by the caller before anything is stored or trusted (kubeadm's discovery does the
    same with its CA hash)."""
    from bcm.services.tls import CA_PATH

    unchecked = ssl.create_default_context()
    unchecked.check_hostname = False
    unchecked.verify_mode = ssl.CERT_NONE  # the fingerprint below is the check; see the docstring
    try:
        resp = httpx.get(
            url.rstrip("/") + CA_PATH, verify=unchecked, timeout=30, headers={"User-Agent": "bcm-cli"}
        )
    except httpx.HTTPError as exc:
        raise CliError(f"cannot fetch the CA from {url}: {type(exc).__name__} {exc}".strip()) from None
    if resp.status_code != 200:
        raise CliError(
            f"{url} has no CA to fetch (HTTP {resp.status_code}): is TLS on there (BCM_TLS__ENABLED)?"
        )
    return resp.content


def _store(path: Path, pem: bytes) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(pem)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


@app.command("fetch")
def fetch(
    fingerprint: FingerprintOpt,
    path: Annotated[
        Path | None, typer.Option(help="where to store it (default: BCM_CA_CERT, else ~/.config/bcm/ca.pem)")
    ] = None,
) -> None:
    """Fetch the server's CA (from --url / BCM_URL), check its fingerprint, and store it for the CLI."""
    from bcm.services.tls import fingerprint as fingerprint_of
    from bcm.services.tls import load_pem_cert, parse_fingerprint
    from bcm.settings import Settings

    settings = Settings()
    expected = parse_fingerprint(fingerprint)
    url = _url(_state["url"], settings).rstrip("/")
    pem = _fetch_pem(url)
    cert = load_pem_cert(pem, f"the CA from {url}")
    if not hmac.compare_digest(cert.fingerprint(hashes.SHA256()), expected):
        raise CliError(
            f"the CA at {url} has fingerprint {fingerprint_of(cert)}, not the one given: nothing stored "
            "(check the fingerprint with `bcm ca show` on the head, and that this is the right server)"
        )
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        raise CliError(f"what {url} serves as its CA is not a CA certificate: nothing stored")
    target = path or settings.ca_cert or user_ca_file()
    if url.startswith("https://"):  # the server's own certificate must verify against it, name included
        staged = target.with_name(f".{target.name}.check")
        _store(staged, pem)
        try:
            httpx.get(url + "/healthz", verify=verify_context(staged), timeout=30)
        except httpx.ConnectError as exc:
            raise CliError(
                f"the CA matches the fingerprint, but {url}'s certificate does not verify against it "
                f"({exc}): nothing stored"
            ) from None
        except httpx.HTTPError:
            pass  # verified; the health answer itself does not matter here
        finally:
            staged.unlink(missing_ok=True)
    _store(target, pem)
    out.print(
        f"stored bcm's CA {fingerprint_of(cert)} in {target}", soft_wrap=True, markup=False, highlight=False
    )


@app.command("show")
def show(
    pem: Annotated[bool, typer.Option("--pem", help="print the certificate itself (PEM)")] = False,
    as_json: JsonOpt = False,
) -> None:
    """On the head: the CA clients fetch with `bcm ca fetch`, and its fingerprint."""
    from bcm.services.tls import fingerprint as fingerprint_of
    from bcm.services.tls import load_pem_cert, published_ca
    from bcm.settings import Settings

    settings = Settings()
    path = published_ca(settings)
    if path is None:
        raise CliError(
            f"no CA in {settings.tls_dir} yet: `bcm serve` with BCM_TLS__ENABLED=true makes one at its start "
            "(or set BCM_TLS__CA_FILE with an admin's certificate)"
        )
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CliError(
            f"cannot read {path}: {exc.strerror} (run this as the user bcm serve runs as)"
        ) from None
    cert = load_pem_cert(data, str(path))
    facts = {
        "fingerprint": fingerprint_of(cert),
        "path": str(path),
        "subject": cert.subject.rfc4514_string(),
        "not_after": cert.not_valid_after_utc.isoformat(),
    }
    if as_json:
        emit_json(facts)
    elif pem:
        out.print(data.decode().rstrip(), soft_wrap=True, markup=False, highlight=False)
    else:
        out.print(facts["fingerprint"], soft_wrap=True, highlight=False)
        out.print(
            f"{path} ({facts['subject']}, valid until {facts['not_after']})", soft_wrap=True, highlight=False
        )
        out.print(
            "on another machine: bcm ca fetch --fingerprint " + facts["fingerprint"],
            soft_wrap=True,
            highlight=False,
        )
