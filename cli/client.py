"""The REST client the CLI uses (httpx); errors become CliError with one readable line.

An https server is verified (chain and name) against bcm's CA: ``BCM_CA_CERT``, else the one
``bcm ca fetch`` stored in ``~/.config/bcm/ca.pem``, else, on the head itself, the server's own
``<state_dir>/tls/ca.crt`` where this user may read it, else the system's CAs. Never unverified.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any

import httpx

from bcm.settings import Settings

DEFAULT_URL = "http://127.0.0.1:8470"


class CliError(Exception):
    """One line for the user; the CLI prints it in red and exits 1."""


def _token(explicit: str | None, settings: Settings) -> str | None:
    if explicit:
        return explicit
    if os.environ.get("BCM_TOKEN"):
        return os.environ["BCM_TOKEN"]
    path: Path = settings.admin_token_file
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _url(explicit: str | None, settings: Settings) -> str:
    if explicit:
        return explicit
    if os.environ.get("BCM_URL"):
        return os.environ["BCM_URL"]
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    return f"{'https' if settings.tls.enabled else 'http'}://{host}:{settings.port}"


def user_ca_file() -> Path:
    """Where `bcm ca fetch` stores the CA when ``BCM_CA_CERT`` does not say."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "bcm" / "ca.pem"


def ca_file(settings: Settings) -> Path | None:
    """The CA this CLI verifies an https server against (None: the system's CAs)."""
    if settings.ca_cert is not None:
        return settings.ca_cert
    user = user_ca_file()
    if user.exists():
        return user
    local = settings.tls.ca_file or settings.tls_dir / "ca.crt"  # on the head, as the server's user
    return local if os.access(local, os.R_OK) else None


def verify_context(ca: Path | None) -> ssl.SSLContext:
    """Chain and host name verified against ``ca`` (or the system's CAs); a bad file is one line."""
    try:
        return ssl.create_default_context(cafile=str(ca) if ca else None)
    except (OSError, ssl.SSLError) as exc:
        raise CliError(
            f"cannot use {ca} as the CA to verify bcm against: {getattr(exc, 'strerror', None) or exc}"
        ) from None


def _untrusted(url: str, ca: Path | None, exc: BaseException) -> CliError | None:
    """A CliError when ``exc`` is a failed certificate verification, else None."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, ssl.SSLCertVerificationError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    reason = getattr(cause, "verify_message", None) or "verification failed"
    against = f"the CA in {ca}" if ca else "the system's CAs (no bcm CA fetched)"
    return CliError(
        f"the certificate of {url} does not verify against {against}: {reason}; "
        "fetch bcm's CA once with `bcm ca fetch --fingerprint SHA256:…` (`bcm ca show` on the head prints it)"
    )


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 60.0) -> None:
        settings = Settings()
        self.url = _url(url, settings).rstrip("/")
        headers = {"User-Agent": "bcm-cli"}
        secret = _token(token, settings)
        if secret:
            headers["Authorization"] = f"Bearer {secret}"
        self.ca = ca_file(settings) if self.url.startswith("https://") else None
        verify = verify_context(self.ca) if self.url.startswith("https://") else True
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, verify=verify)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.ConnectError as exc:
            untrusted = _untrusted(self.url, self.ca, exc)
            if untrusted is not None:
                raise untrusted from None
            raise CliError(
                f"cannot reach the bcm server at {self.url} (is `bcm serve` running? set BCM_URL)"
            ) from None
        except httpx.TimeoutException:
            raise CliError(f"the bcm server at {self.url} did not answer in time") from None
        except httpx.HTTPError as exc:
            raise CliError(f"request to {self.url} failed: {type(exc).__name__}") from None
        if resp.status_code >= 400:
            raise CliError(_error_line(resp))
        if resp.status_code == 204 or not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:  # not JSON, or a number with more digits than Python converts
            raise CliError(
                f"the bcm server at {self.url} answered {method} {path} with what is not JSON"
            ) from None

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, json=body)

    def put(self, path: str, body: Any) -> Any:
        return self.request("PUT", path, json=body)

    def patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, json=body)

    def delete(self, path: str, **params: Any) -> Any:
        return self.request("DELETE", path, params={k: v for k, v in params.items() if v is not None})


def _error_line(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return f"HTTP {resp.status_code}: {resp.text[:200].strip() or resp.reason_phrase}"
    if isinstance(body, dict) and "message" in body:
        return f"{body['message']} (HTTP {resp.status_code})"
    if isinstance(body, dict) and "detail" in body:
        return f"{body['detail']} (HTTP {resp.status_code})"
    return f"HTTP {resp.status_code}"
