"""Settings: one pydantic-settings class, environment prefix ``BCM_``, nested groups with ``__``.

Examples: ``BCM_STATE_DIR=/var/lib/bcm``, ``BCM_DATABASE_URL=postgresql+psycopg://…``,
``BCM_SSH__CONCURRENCY=256``, ``BCM_HEALTH__INTERVAL_S=30``.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from bcm import resources
from bcm.domain.kernel_args import check_kernel_args


def _default_state_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/bcm")
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "state") / "bcm"


class SshSettings(BaseModel):
    """How the server reaches nodes over SSH."""

    username: str = "root"
    port: int = 22
    concurrency: int = Field(default=128, ge=1, le=4096)
    connect_timeout_s: float = Field(default=10.0, gt=0)
    command_timeout_s: float = Field(default=60.0, gt=0)
    # a connect that timed out, was reset or refused is tried again this many times (never a command
    # that ran, a refused login or a changed host key), after a backoff from backoff_s doubling to 8 s
    retries: int = Field(default=3, ge=0, le=10)
    backoff_s: float = Field(default=0.5, ge=0, le=60)


class HealthSettings(BaseModel):
    """GPU health reporting."""

    interval_s: float = Field(default=30.0, gt=0)
    stale_intervals: int = Field(default=3, ge=1)
    resume_after_ok_intervals: int = Field(default=3, ge=1)
    # reports whose readings each node keeps (a GPU's history: one reading per report that had it)
    history_per_gpu: int = Field(default=1000, ge=1, le=1_000_000)
    events_per_node: int = Field(default=1000, ge=1)
    # reports waiting to be written (beyond: 503 + Retry-After) and reports per write transaction
    ingest_queue: int = Field(default=5000, ge=1, le=1_000_000)
    ingest_batch: int = Field(default=500, ge=1, le=10_000)
    # processes that parse, judge and write reports (0: a worker thread of the server process); unset,
    # chosen from the cores this process may run on by :func:`default_ingest_processes`
    ingest_processes: int | None = Field(default=None, ge=0, le=64)
    # while a batch is being written, the next one gathers reports for up to this long before it starts
    # (fewer, bigger transactions: each costs the writer and the database a fixed amount besides its rows)
    ingest_linger_ms: float = Field(default=5.0, ge=0, le=1000)

    def writer_processes(self, *, sqlite: bool) -> int:
        """``ingest_processes`` as set, else the default for this machine's cores and database."""
        if self.ingest_processes is not None:
            return self.ingest_processes
        return default_ingest_processes(usable_cores(), sqlite=sqlite)


# Measured with bench/health.py --mode http on a 2-core machine (3,000 nodes x 8 GPUs, 50 agents, the
# database on the same machine): PostgreSQL 827 reports/s in the server's thread, 1,254/s with 2 writer
# processes, 960/s with 4 (more processes than cores only fight over them); SQLite 1,320/s with 2.
# A report costs ~1.3 ms of CPU, so 4 writers carry ~3,000 reports/s, three times what 10,000 nodes
# reporting every 10 s send: past that the database, not the writers, is the limit.
MAX_DEFAULT_INGEST_PROCESSES = 4


def default_ingest_processes(cores: int, *, sqlite: bool) -> int:
    """Writer processes for ``cores`` usable cores: none on a single core (a process of its own would
    only take turns with the server's event loop), else one per core up to 4; on SQLite at most 2, since
    one transaction writes the file at a time and further processes would only queue for its lock."""
    if cores < 2:
        return 0
    return min(cores, 2 if sqlite else MAX_DEFAULT_INGEST_PROCESSES)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: taskset, a cgroup's cpuset), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class HttpSettings(BaseModel):
    """Limits on what a request may carry, and the brake on guessing tokens."""

    max_body_bytes: int = Field(default=1_048_576, ge=1024, le=1_073_741_824)
    max_json_depth: int = Field(default=32, ge=4, le=256)
    auth_failures_per_minute: int = Field(default=30, ge=1, le=100_000)
    body_timeout_s: float = Field(
        default=30.0, gt=0, le=3600
    )  # the whole body, from the first byte read; 408
    # comma-separated addresses/networks (or "*") whose X-Forwarded-For / -Proto are believed; none by
    # default, so the client address (logs, the brake, hello's node address) is the TCP peer's
    trusted_proxies: str = Field(default="", max_length=4096, pattern=r"^[0-9A-Fa-f.:/*, ]*$")
    # on SIGTERM, requests still in flight after this long are cancelled (the shutdown itself is bounded too)
    graceful_shutdown_s: float = Field(default=10.0, gt=0, le=3600)

    @property
    def proxies(self) -> list[str]:
        return [p.strip() for p in self.trusted_proxies.split(",") if p.strip()]


class PowerSettings(BaseModel):
    """Power control through BMCs (IPMI, Redfish): slow and fragile, so every call is bounded."""

    timeout_s: float = Field(default=10.0, gt=0, le=300)
    retries: int = Field(default=2, ge=0, le=10)  # extra tries after a timeout; never after an auth failure
    concurrency: int = Field(default=32, ge=1, le=1024)
    poll_interval_s: float = Field(default=300.0, ge=0)  # 0: never read power states in the background
    ipmi_cipher_suite: int = Field(default=3, ge=0, le=17)
    # Redfish over https: "pin" pins each BMC's certificate (sha256) on first contact and refuses another
    # one later (`bcm power unpin` clears a pin); "ca" needs a certificate from a CA the head node trusts
    redfish_tls: Literal["pin", "ca"] = "pin"


class DbSettings(BaseModel):
    """Connection pool and timeouts: a request waits a bounded time, then gets a 503 with Retry-After."""

    threads: int = Field(default=40, ge=2, le=1000)  # worker threads for blocking work; the pool matches
    pool_timeout_s: float = Field(default=10.0, gt=0)
    connect_timeout_s: int = Field(default=5, ge=1, le=600)
    statement_timeout_s: float = Field(default=30.0, gt=0)  # PostgreSQL
    lock_timeout_s: float = Field(default=10.0, gt=0)  # PostgreSQL: waiting for a row lock
    busy_timeout_s: float = Field(default=10.0, gt=0)  # SQLite: waiting for another writer


class PxeSettings(BaseModel):
    """PXE provisioning: the dnsmasq that ``bcm serve`` supervises, the boot scripts, the callback.

    With ``enabled`` the server renders ``<state_dir>/pxe/dnsmasq.conf`` (DHCP on ``interface`` from
    ``range_start``-``range_end``, or proxy DHCP beside someone else's DHCP server with ``mode=proxy``;
    TFTP of the iPXE binaries only) and keeps dnsmasq running. Nodes reach bcm at ``server_url``
    (default ``http://<address>:<port>``).
    """

    enabled: bool = False
    interface: str | None = Field(default=None, max_length=15)
    address: str | None = None  # the head node's address on ``interface``
    server_url: str | None = Field(default=None, max_length=200)
    mode: Literal["dhcp", "proxy"] = "dhcp"
    range_start: str | None = None
    range_end: str | None = None
    netmask: str = "255.255.255.0"
    lease_time: str = Field(default="1h", pattern=r"^([0-9]{1,7}[smhd]?|infinite)$")
    router: str | None = None  # handed out only when set (a lab hands out none)
    ipv6_ra: bool = True  # enable-ra with an ra-only range: iPXE stops waiting ~13 s for a router advert
    ipxe_dir: Path = Path("/usr/lib/ipxe")
    dnsmasq: str = "dnsmasq"
    discovery_image: str | None = Field(default=None, max_length=63)  # default: the newest ready image
    provision_timeout_s: float = Field(default=1800.0, gt=0, le=86400)
    max_concurrent: int = Field(default=20, ge=1, le=10000)
    max_discovered: int = Field(default=4096, ge=1, le=1_000_000)
    # one unauthenticated discovery post stores at most this much JSON (an HGX server's facts are ~120 KiB)
    max_facts_bytes: int = Field(default=262_144, ge=4096, le=16_777_216)
    max_discovered_bytes: int = Field(
        default=134_217_728, ge=65_536, le=2**40
    )  # all discovered machines' facts
    # a discovery rule names at most this many machines that were never provisioned; the rest stay discovered
    max_rule_registered: int = Field(default=256, ge=1, le=1_000_000)
    kernel_args: str = Field(
        default="console=tty0 console=ttyS0,115200", max_length=512
    )  # the last is /dev/console

    @field_validator("kernel_args")
    @classmethod
    def _kernel_args(cls, v: str) -> str:
        return check_kernel_args(v, "pxe.kernel_args")


def _default_recipes_dir() -> Path:
    """bcm's own recipes (``images/``, package data)."""
    return resources.images_dir()


class ImagesSettings(BaseModel):
    """Image recipes, the layer cache, published versions and serving."""

    recipes_dir: Path = Field(default_factory=_default_recipes_dir)
    cache_dir: Path = Path("/var/cache/bcm/images")  # layer trees keyed by content; outside the state dir
    keep_versions: int = Field(default=3, ge=1, le=1000)  # ready versions kept per image (current always)
    build_timeout_s: float = Field(default=7200.0, gt=0, le=86400)
    # concurrent artifact downloads; more get 503. Unset: as many as pxe.max_concurrent lets provision at
    # once, at least 64 (a download costs a descriptor, no thread: bcm.pathsend), so no node bcm admitted to
    # provisioning is refused its files
    max_transfers: int | None = Field(default=None, ge=1, le=10000)
    max_transfers_per_client: int = Field(default=4, ge=1, le=4096)  # of those, per client address
    # a download that moves fewer than min_rate_bytes_s * min_rate_window_s bytes in a window is dropped
    min_rate_bytes_s: int = Field(default=65_536, ge=0, le=1 << 34)  # 0: never dropped for being slow
    min_rate_window_s: float = Field(default=30.0, gt=0, le=3600)


class AuditSettings(BaseModel):
    """Retention of the audit log (events): pruned by age and by count, noise first."""

    retention_days: float = Field(default=90.0, gt=0, le=36_500)  # older events are deleted
    # beyond this, the oldest events go, unauthenticated and system ones first; an admin's or operator's
    # action inside the retention is never deleted for the count
    max_events: int = Field(default=100_000, ge=100, le=1_000_000_000)
    prune_interval_s: float = Field(default=60.0, gt=0, le=86_400)


class WlmSettings(BaseModel):
    """Workload managers: how often their node states are copied into the database."""

    sync_interval_s: float = Field(default=30.0, gt=0, le=86_400)


class HaSettings(BaseModel):
    """Several servers on one PostgreSQL database: the leader lease (dnsmasq, the provisioning queue, WLM
    sync and drains, power polling and pruning run on the leader only)."""

    lease_s: float = Field(
        default=10.0, ge=0.5, le=600
    )  # a leader that cannot renew for this long is replaced
    # where this server's API answers, as shown by `bcm ha status` (default: its host name and port)
    address: str | None = Field(default=None, max_length=256)


class OpsSettings(BaseModel):
    """Operations (inventory, power, deploys, provisioning …): the lease a server holds on each it runs."""

    # a server that cannot renew an operation's lease for this long loses it to the next server that looks
    lease_s: float = Field(default=30.0, ge=0.5, le=3600)


class TlsSettings(BaseModel):
    """The API over https (``bcm.services.tls``). With ``enabled`` the API port speaks TLS with a certificate
    bcm's own CA (``<state_dir>/tls/``) issues for this head's names and addresses, or the admin's
    ``cert_file``/``key_file`` (with ``ca_file``, the CA that signed them, for ``bcm ca fetch`` and nodes);
    the boot files iPXE and the boot image fetch stay plain HTTP, on ``boot_port`` only."""

    enabled: bool = False
    boot_port: int = Field(default=8471, ge=1, le=65535)  # plain HTTP, /boot/... only, while TLS is on
    # names and addresses the certificate names besides localhost, 127.0.0.1, ::1, the host's own names,
    # the listen address and the PXE address (comma-separated)
    names: str = Field(default="", max_length=4096, pattern=r"^[0-9A-Za-z.:_*, -]*$")
    cert_file: Path | None = None  # the admin's certificate (PEM, may carry its chain) instead of bcm's CA
    key_file: Path | None = None  # its private key (PEM, unencrypted), readable by bcm only
    ca_file: Path | None = None  # the CA behind cert_file, published for `bcm ca fetch` and the nodes
    # the https URL nodes' agents reach the API at (default: https://<pxe address or host>:<port>)
    api_url: str | None = Field(default=None, max_length=200, pattern=r"^https://")

    @property
    def extra_names(self) -> list[str]:
        return [n.strip() for n in self.names.split(",") if n.strip()]


class Settings(BaseSettings):
    """Everything configurable about the head-node server and the CLI."""

    model_config = SettingsConfigDict(env_prefix="BCM_", env_nested_delimiter="__", extra="ignore")

    state_dir: Path = Field(default_factory=_default_state_dir)
    host: str = "127.0.0.1"
    port: int = Field(default=8470, ge=1, le=65535)
    database_url: str | None = None
    log_level: str = "info"
    log_format: str = "text"  # or "json": one JSON object a line (bcm.logs)
    # the CLI: the CA an https server is verified against (`bcm ca fetch` stores it; default ~/.config/bcm/ca.pem)
    ca_cert: Path | None = None
    ssh: SshSettings = SshSettings()
    health: HealthSettings = HealthSettings()
    pxe: PxeSettings = PxeSettings()
    db: DbSettings = DbSettings()
    power: PowerSettings = PowerSettings()
    http: HttpSettings = HttpSettings()
    images: ImagesSettings = ImagesSettings()
    audit: AuditSettings = AuditSettings()
    ha: HaSettings = HaSettings()
    wlm: WlmSettings = WlmSettings()
    ops: OpsSettings = OpsSettings()
    tls: TlsSettings = TlsSettings()

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, level: str) -> str:
        from bcm.logs import level_number

        level_number(level)  # refused here, before anything starts, not when logging is set up
        return level

    @field_validator("log_format")
    @classmethod
    def _known_format(cls, fmt: str) -> str:
        from bcm.logs import check_format

        return check_format(fmt)

    @property
    def effective_database_url(self) -> str:
        """The configured URL, or SQLite under the state directory."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.state_dir / 'bcm.db'}"

    @property
    def admin_token_file(self) -> Path:
        return self.state_dir / "admin.token"

    @property
    def images_dir(self) -> Path:
        """Published image versions, ``<name>/<version>/``, and ``.staging/`` for builds in progress."""
        return self.state_dir / "images"

    @property
    def tls_dir(self) -> Path:
        """bcm's API CA (``ca.crt``, ``ca.key``) and the server certificate it issued."""
        return self.state_dir / "tls"

    @property
    def ssh_key_file(self) -> Path:
        return self.state_dir / "ssh" / "id_ed25519"


@lru_cache
def get_settings() -> Settings:
    return Settings()
