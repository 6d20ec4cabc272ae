"""`bcm service install` (a hardened systemd unit for `bcm serve`) and `bcm serve`'s JSON log lines."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bcm.devserver import Server

BCM_SCRIPT = Path(sys.executable).parent / "bcm"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values in order]}} (systemd allows a key more than once, which
    configparser does not)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"a setting outside any section: {raw!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=value: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit[section].get(key, [])
    assert len(values) == 1, (section, key, values)
    return values[0]


def install(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BCM_")}
    env["BCM_IMAGES__CACHE_DIR"] = str(tmp_path / "cache" / "images")
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "service", "install", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )


def test_the_unit_runs_this_bcm_hardened(tmp_path: Path) -> None:
    done = install(tmp_path, "--stdout")
    assert done.returncode == 0, done.stderr
    unit = parse_unit(done.stdout)
    svc = unit["Service"]
    assert one(unit, "Service", "ExecStart") == f"{BCM_SCRIPT} serve"
    assert BCM_SCRIPT.is_file() and os.access(BCM_SCRIPT, os.X_OK)
    assert one(unit, "Service", "Environment") == "BCM_STATE_DIR=/var/lib/bcm"
    assert one(unit, "Service", "EnvironmentFile") == "-/etc/bcm/bcm.env"
    assert one(unit, "Service", "User") == "root"
    assert one(unit, "Service", "ProtectSystem") == "strict"
    assert one(unit, "Service", "ReadWritePaths").split() == [
        "/var/lib/bcm",
        str(tmp_path / "cache" / "images"),
    ]
    assert one(unit, "Service", "ProtectHome") == "read-only"
    for key in ("PrivateTmp", "NoNewPrivileges", "ProtectKernelModules", "ProtectControlGroups"):
        assert one(unit, "Service", key) == "yes", key
    caps = set(one(unit, "Service", "CapabilityBoundingSet").split())
    # dnsmasq's, the image builds', and nothing that loads modules, reads raw memory or traces
    assert {"CAP_NET_ADMIN", "CAP_NET_BIND_SERVICE", "CAP_NET_RAW", "CAP_SYS_CHROOT", "CAP_SYS_ADMIN"} <= caps
    assert not caps & {"CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_PTRACE", "CAP_SYS_BOOT", "CAP_SYS_TIME"}
    assert one(unit, "Service", "RestrictNamespaces") == "mnt"
    # image builds make device nodes and install setuid programs: these would break them
    for broken in ("PrivateDevices", "RestrictSUIDSGID", "MemoryDenyWriteExecute", "SystemCallFilter"):
        assert broken not in svc, broken
    assert int(one(unit, "Service", "LimitNOFILE")) >= 65536
    assert one(unit, "Service", "Restart") == "on-failure"
    assert one(unit, "Install", "WantedBy") == "multi-user.target"
    assert "network-online.target" in one(unit, "Unit", "After")


def test_json_logs_and_other_paths(tmp_path: Path) -> None:
    state = tmp_path / "my state"
    done = install(
        tmp_path,
        "--stdout",
        "--log-format",
        "json",
        "--state-dir",
        str(state),
        "--env-file",
        "/etc/default/bcm",
    )
    assert done.returncode == 0, done.stderr
    unit = parse_unit(done.stdout)
    assert unit["Service"]["Environment"] == [f"BCM_STATE_DIR={state}", "BCM_LOG_FORMAT=json"]
    assert one(unit, "Service", "EnvironmentFile") == "-/etc/default/bcm"
    assert one(unit, "Service", "ReadWritePaths").startswith(f'"{state}" ')  # quoted: it has a space


def test_install_writes_the_file_and_says_how_to_start_it(tmp_path: Path) -> None:
    path = tmp_path / "etc" / "bcm-head.service"
    state = tmp_path / "state"
    done = install(tmp_path, "--path", str(path), "--state-dir", str(state))
    assert done.returncode == 0, done.stderr
    assert f"wrote {path}" in done.stdout
    assert "systemctl daemon-reload && systemctl enable --now bcm-head" in done.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert stat.S_IMODE(state.stat().st_mode) == 0o700  # made for ReadWritePaths, private as bcm keeps it
    assert (tmp_path / "cache" / "images").is_dir()
    assert parse_unit(path.read_text())["Service"]["Environment"] == [f"BCM_STATE_DIR={state}"]
    assert install(tmp_path, "--path", str(path), "--state-dir", str(state)).returncode == 0  # same: fine
    changed = install(tmp_path, "--path", str(path), "--log-format", "json")
    assert changed.returncode == 1 and "exists and differs; --force" in changed.stderr
    assert "BCM_LOG_FORMAT" not in path.read_text()
    assert install(tmp_path, "--path", str(path), "--log-format", "json", "--force").returncode == 0
    assert "BCM_LOG_FORMAT=json" in path.read_text()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--path", "bcm.service"], "not an absolute path"),
        (["--path", "/tmp/bcm.conf"], "must end in .service"),
        (["--log-format", "xml", "--stdout"], "use text or json"),
    ],
)
def test_refusals_are_one_line(tmp_path: Path, args: list[str], words: str) -> None:
    done = install(tmp_path, *args)
    assert done.returncode == 1
    assert done.stderr.strip().startswith("error: ") and words in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    """systemd's own parser (systemd-analyze verify, no systemd running needed): an unknown or misspelt
    option, a bad value, or an ExecStart that is not an executable file is reported."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-analyze is missing (scripts/test-all installs the systemd package)")
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    path = tmp_path / "bcm.service"
    assert install(tmp_path, "--path", str(path), "--state-dir", str(tmp_path / "state")).returncode == 0
    done = subprocess.run(
        [analyze, "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=120
    )
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if "bcm.service" in line]
    assert done.returncode == 0 and complaints == [], done.stdout + done.stderr
    # the check can fail: a misspelt option is named
    broken = tmp_path / "broken.service"
    broken.write_text(path.read_text().replace("ProtectClock=", "ProtectClok="))
    done = subprocess.run(
        [analyze, "verify", "--man=no", str(broken)], capture_output=True, text=True, timeout=120
    )
    assert "ProtectClok" in done.stdout + done.stderr


def test_serve_logs_json_lines_without_secrets(tmp_path: Path) -> None:
    srv = Server(tmp_path / "state", extra_env={"BCM_LOG_FORMAT": "json"})
    srv.start()
    guess = "bcm_" + "x" * 40
    try:
        r = httpx.get(f"{srv.url}/api/v1/nodes", headers={"Authorization": f"Bearer {guess}"}, timeout=10)
        assert r.status_code == 401
        token = srv.token()
    finally:
        srv.stop()
    assert srv.log is not None
    text = srv.log.read_text()
    records = [json.loads(line) for line in text.splitlines() if line.strip()]  # every line is JSON
    messages = [r["message"] for r in records]
    assert any(m.startswith("bcm serving on http://") for m in messages), messages
    assert any("created the first admin token" in m for m in messages), messages
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    assert any(m.startswith("authentication failed from 127.0.0.1") for m in messages), messages
    assert token not in text and guess not in text and "x" * 40 not in text
