"""GPU health rules: pure functions from one agent report to a verdict per GPU and per node.

Verdicts, best to worst: OK < UNKNOWN < WARN < FAIL; a node's verdict is the worst of its GPUs and its
own findings. Every finding carries a code, a severity, a message and the recommended action. Findings
with severity OK are informational: they are kept (logged) but never make a GPU unhealthy — that is how
application Xids (13, 31, 43, 45, 68) are treated.

The rules are tables: :data:`XID_RULES` (Xid number → severity, action), :data:`RECOVERY_RULES` (the
driver's recovery action, from Xid 154 or NVML's field → severity, action) and :data:`GPU_RULES`
(predicates over one GPU sample). Numbers live in :class:`Thresholds`, which a category overrides with
a plain dict (:meth:`Thresholds.merged`). :func:`evaluate` judges one report; it does not remember
earlier reports — keeping a FAIL until it is resolved is the caller's job.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from bcm.errors import InvalidInput


class Verdict(StrEnum):
    """Health of a GPU or node."""

    OK = "OK"
    UNKNOWN = "UNKNOWN"
    WARN = "WARN"
    FAIL = "FAIL"


_RANK = {Verdict.OK: 0, Verdict.UNKNOWN: 1, Verdict.WARN: 2, Verdict.FAIL: 3}


def worst(verdicts: Iterable[Verdict]) -> Verdict:
    """The most severe verdict; OK for none."""
    return max(verdicts, key=_RANK.__getitem__, default=Verdict.OK)


class Action(StrEnum):
    """What an operator (or bcm) should do about a finding."""

    NONE = "none"
    RESTART_APP = "restart_app"
    RESET_GPU = "reset_gpu"
    DRAIN_P2P = "drain_p2p"
    DRAIN_AND_RESET = "drain_and_reset"
    REBOOT_NODE = "reboot_node"
    REPLACE_GPU = "replace_gpu"
    CHECK_COOLING = "check_cooling"
    CHECK_PCIE = "check_pcie"
    CHECK_NVLINK = "check_nvlink"
    CHECK_AGENT = "check_agent"
    INVESTIGATE = "investigate"


@dataclass(frozen=True)
class Finding:
    """One reason behind a verdict."""

    code: str
    severity: Verdict
    message: str
    action: Action

    def to_dict(self) -> dict[str, str]:
        return {
            "code": self.code,
            "severity": self.severity.value,
            "message": self.message,
            "action": self.action.value,
        }


@dataclass(frozen=True)
class GpuVerdict:
    """The verdict on one GPU and its reasons (informational findings included)."""

    index: int
    uuid: str | None
    verdict: Verdict
    reasons: tuple[Finding, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "verdict": self.verdict.value,
            "reasons": [r.to_dict() for r in self.reasons],
        }


@dataclass(frozen=True)
class NodeVerdict:
    """The verdict on a node: the worst of its GPUs and of its node-level findings."""

    verdict: Verdict
    gpus: tuple[GpuVerdict, ...]
    findings: tuple[Finding, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict.value,
            "findings": [f.to_dict() for f in self.findings],
            "gpus": [g.to_dict() for g in self.gpus],
        }


@dataclass(frozen=True)
class XidRule:
    severity: Verdict
    action: Action
    meaning: str


# After NVIDIA's Xid catalogue (docs.nvidia.com/deploy/xid-errors) and GPU debug guidelines; Xids not
# listed are WARN/investigate. 154 is judged by the recovery action it states (RECOVERY_RULES).
XID_RULES: Mapping[int, XidRule] = {
    13: XidRule(Verdict.OK, Action.RESTART_APP, "graphics engine exception (application error)"),
    31: XidRule(Verdict.OK, Action.RESTART_APP, "GPU memory page fault (application error)"),
    43: XidRule(Verdict.OK, Action.RESTART_APP, "GPU stopped processing (application error)"),
    45: XidRule(Verdict.OK, Action.NONE, "preemptive cleanup after an application ended or an earlier error"),
    68: XidRule(Verdict.OK, Action.RESTART_APP, "video processor exception (application error)"),
    48: XidRule(Verdict.FAIL, Action.RESET_GPU, "double-bit (uncorrectable) ECC error"),
    63: XidRule(
        Verdict.WARN, Action.RESET_GPU, "row remapping or page retirement recorded; a reset activates it"
    ),
    64: XidRule(Verdict.FAIL, Action.RESET_GPU, "row remapping or page retirement failed to record"),
    74: XidRule(Verdict.FAIL, Action.RESET_GPU, "NVLink error"),
    79: XidRule(Verdict.FAIL, Action.REBOOT_NODE, "GPU has fallen off the bus"),
    92: XidRule(Verdict.WARN, Action.INVESTIGATE, "high single-bit ECC error rate"),
    94: XidRule(
        Verdict.WARN, Action.RESTART_APP, "contained ECC error; only the affected application must restart"
    ),
    95: XidRule(Verdict.FAIL, Action.RESET_GPU, "uncontained ECC error"),
    119: XidRule(Verdict.FAIL, Action.RESET_GPU, "GSP RPC timeout"),
    120: XidRule(Verdict.FAIL, Action.RESET_GPU, "GSP error"),
}
XID_RECOVERY_ACTION = 154

# The driver's recovery action (nvmlGpuRecoveryAction_t names, as the agent reports them).
RECOVERY_RULES: Mapping[str, tuple[Verdict, Action]] = {
    "none": (Verdict.OK, Action.NONE),
    "gpu_reset": (Verdict.FAIL, Action.RESET_GPU),
    "bus_reset": (Verdict.FAIL, Action.RESET_GPU),
    "node_reboot": (Verdict.FAIL, Action.REBOOT_NODE),
    "system_reboot": (Verdict.FAIL, Action.REBOOT_NODE),
    "drain_p2p": (Verdict.WARN, Action.DRAIN_P2P),
    "drain_and_reset": (Verdict.FAIL, Action.DRAIN_AND_RESET),
    "recover_imex_domain": (Verdict.WARN, Action.INVESTIGATE),
}


@dataclass(frozen=True)
class Thresholds:
    """Every number the rules use; a category overrides any of them (:meth:`merged`)."""

    ecc_uncorrected_max: int = 0  # volatile uncorrected ECC above this fails the GPU
    ecc_corrected_warn: int | None = None  # volatile corrected ECC above this warns; None: off
    retired_pages_max: int = 60  # retired pages (pre-Ampere) at or above this: replace the GPU
    temperature_margin_c: int = 0  # warn this many degrees before the slowdown threshold
    temperature_warn_c: int | None = None  # absolute warning where the GPU has no slowdown threshold
    pcie_check_generation: bool = True  # some GPUs lower the link generation when idle
    pcie_replay_warn: int | None = None  # PCIe replays since reset above this warn; None: off
    nvlink_error_warn: int | None = None  # replay+recovery+CRC errors on one link above this warn; None: off
    nvlink_inactive_warn: bool = True
    clock_events_warn: tuple[str, ...] = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
    stale_intervals: int = 3
    xid_overrides: Mapping[int, tuple[Verdict, Action]] = field(default_factory=dict)

    def merged(self, overrides: Mapping[str, Any] | None) -> Thresholds:
        """These thresholds with a category's overrides (JSON-shaped: str keys, lists) applied on top."""
        if not overrides:
            return self
        known = {f.name for f in dataclasses.fields(self)}
        changes: dict[str, Any] = {}
        for key, value in overrides.items():
            if key not in known:
                raise InvalidInput(
                    f"unknown health threshold {key!r}; known: {', '.join(sorted(known))}", field=key
                )
            if key == "xid_overrides":
                changes[key] = {**self.xid_overrides, **_parse_xid_overrides(value)}
            elif key == "clock_events_warn":
                changes[key] = tuple(str(v) for v in value)
            else:
                changes[key] = value
        return dataclasses.replace(self, **changes)


def _parse_xid_overrides(value: Mapping[Any, Any]) -> dict[int, tuple[Verdict, Action]]:
    out: dict[int, tuple[Verdict, Action]] = {}
    for xid, rule in value.items():
        try:
            severity, action = (rule["severity"], rule["action"]) if isinstance(rule, Mapping) else rule
            out[int(xid)] = (Verdict(severity), Action(action))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(
                f"xid_overrides[{xid!r}] must be {{'severity': OK|WARN|FAIL, 'action': …}}: {exc}",
                field="xid_overrides",
            ) from exc
    return out


def _n(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


@dataclass(frozen=True)
class GpuRule:
    """Fires when ``applies`` is true of a GPU sample; missing (None) data never fires a rule."""

    code: str
    severity: Verdict
    action: Action
    applies: Callable[[Mapping[str, Any], Thresholds], bool]
    message: Callable[[Mapping[str, Any], Thresholds], str]


def _temp(g: Mapping[str, Any]) -> tuple[int | None, int | None, int | None]:
    return g.get("temperature_c"), g.get("temperature_slowdown_c"), g.get("temperature_shutdown_c")


def _at_shutdown(g: Mapping[str, Any], t: Thresholds) -> bool:
    temp, _, shutdown = _temp(g)
    return temp is not None and shutdown is not None and temp >= shutdown - t.temperature_margin_c


def _at_slowdown(g: Mapping[str, Any], t: Thresholds) -> bool:
    temp, slowdown, _ = _temp(g)
    return (
        temp is not None and slowdown is not None and temp >= slowdown - t.temperature_margin_c
    ) and not _at_shutdown(g, t)


def _rows(g: Mapping[str, Any]) -> Mapping[str, Any]:
    return g.get("remapped_rows") or {}


def _pages(g: Mapping[str, Any]) -> Mapping[str, Any]:
    return g.get("retired_pages") or {}


def _pcie(g: Mapping[str, Any]) -> Mapping[str, Any]:
    return g.get("pcie") or {}


def _below(g: Mapping[str, Any], cur: str, top: str) -> bool:
    p = _pcie(g)
    return p.get(cur) is not None and p.get(top) is not None and p[cur] < p[top]


def _link_errors(link: Mapping[str, Any]) -> int:
    return sum(_n(link.get(k)) for k in ("replay", "recovery", "crc_flit", "crc_data"))


def _bad_links(g: Mapping[str, Any], t: Thresholds) -> list[int]:
    if t.nvlink_error_warn is None:
        return []
    return [int(lk["link"]) for lk in g.get("nvlinks") or [] if _link_errors(lk) > t.nvlink_error_warn]


def _inactive_links(g: Mapping[str, Any]) -> list[int]:
    return [int(lk["link"]) for lk in g.get("nvlinks") or [] if lk.get("active") is False]


def _clock_hits(g: Mapping[str, Any], t: Thresholds) -> list[str]:
    return [e for e in g.get("clock_events") or [] if e in t.clock_events_warn]


def _ecc(g: Mapping[str, Any], key: str) -> int | None:
    value = (g.get("ecc") or {}).get(key)
    return None if value is None else int(value)


W, F = Verdict.WARN, Verdict.FAIL
GPU_RULES: tuple[GpuRule, ...] = (
    GpuRule(
        "gpu.lost",
        F,
        Action.REBOOT_NODE,
        lambda g, t: bool(g.get("lost")),
        lambda g, t: "NVML reports the GPU lost (GPU_IS_LOST)",
    ),
    GpuRule(
        "ecc.uncorrected",
        F,
        Action.RESET_GPU,
        lambda g, t: (_ecc(g, "volatile_uncorrected") or 0) > t.ecc_uncorrected_max,
        lambda g, t: f"{_ecc(g, 'volatile_uncorrected')} uncorrected ECC errors since the last reset",
    ),
    GpuRule(
        "ecc.corrected",
        W,
        Action.INVESTIGATE,
        lambda g, t: (
            t.ecc_corrected_warn is not None and (_ecc(g, "volatile_corrected") or 0) > t.ecc_corrected_warn
        ),
        lambda g, t: f"{_ecc(g, 'volatile_corrected')} corrected ECC errors since the last reset",
    ),
    GpuRule(
        "remap.failure",
        F,
        Action.REPLACE_GPU,
        lambda g, t: bool(_rows(g).get("failure")),
        lambda g, t: "row remapping failed: the GPU has no spare rows left for a failing memory row",
    ),
    GpuRule(
        "remap.pending",
        W,
        Action.RESET_GPU,
        lambda g, t: bool(_rows(g).get("pending")),
        lambda g, t: "a row remap is pending; it takes effect at the next GPU reset",
    ),
    GpuRule(
        "retired_pages.limit",
        F,
        Action.REPLACE_GPU,
        lambda g, t: _n(_pages(g).get("single_bit")) + _n(_pages(g).get("double_bit")) >= t.retired_pages_max,
        lambda g, t: (
            f"{_n(_pages(g).get('single_bit')) + _n(_pages(g).get('double_bit'))} retired pages "
            f"(limit {t.retired_pages_max})"
        ),
    ),
    GpuRule(
        "retired_pages.pending",
        W,
        Action.RESET_GPU,
        lambda g, t: bool(_pages(g).get("pending")),
        lambda g, t: "a page retirement is pending; it takes effect at the next GPU reset",
    ),
    GpuRule(
        "temperature.shutdown",
        F,
        Action.CHECK_COOLING,
        _at_shutdown,
        lambda g, t: f"{g['temperature_c']} C at the shutdown threshold {g['temperature_shutdown_c']} C",
    ),
    GpuRule(
        "temperature.slowdown",
        W,
        Action.CHECK_COOLING,
        _at_slowdown,
        lambda g, t: f"{g['temperature_c']} C at the slowdown threshold {g['temperature_slowdown_c']} C",
    ),
    GpuRule(
        "temperature.limit",
        W,
        Action.CHECK_COOLING,
        lambda g, t: (
            t.temperature_warn_c is not None
            and g.get("temperature_slowdown_c") is None
            and g.get("temperature_c") is not None
            and g["temperature_c"] >= t.temperature_warn_c
        ),
        lambda g, t: f"{g['temperature_c']} C at or above the configured {t.temperature_warn_c} C",
    ),
    GpuRule(
        "clocks.slowdown",
        W,
        Action.CHECK_COOLING,
        lambda g, t: bool(_clock_hits(g, t)),
        lambda g, t: f"clocks held down by {', '.join(_clock_hits(g, t))}",
    ),
    GpuRule(
        "pcie.generation",
        W,
        Action.CHECK_PCIE,
        lambda g, t: t.pcie_check_generation and _below(g, "gen_current", "gen_max"),
        lambda g, t: (
            f"PCIe link at gen {_pcie(g)['gen_current']}, below its maximum gen {_pcie(g)['gen_max']}"
        ),
    ),
    GpuRule(
        "pcie.width",
        W,
        Action.CHECK_PCIE,
        lambda g, t: _below(g, "width_current", "width_max"),
        lambda g, t: f"PCIe link at x{_pcie(g)['width_current']}, below its maximum x{_pcie(g)['width_max']}",
    ),
    GpuRule(
        "pcie.replays",
        W,
        Action.CHECK_PCIE,
        lambda g, t: (
            t.pcie_replay_warn is not None and _n(_pcie(g).get("replay_counter")) > t.pcie_replay_warn
        ),
        lambda g, t: (
            f"{_pcie(g).get('replay_counter')} PCIe replays since reset (limit {t.pcie_replay_warn})"
        ),
    ),
    GpuRule(
        "nvlink.errors",
        W,
        Action.CHECK_NVLINK,
        lambda g, t: bool(_bad_links(g, t)),
        lambda g, t: f"NVLink error counters above {t.nvlink_error_warn} on links {_bad_links(g, t)}",
    ),
    GpuRule(
        "nvlink.inactive",
        W,
        Action.CHECK_NVLINK,
        lambda g, t: t.nvlink_inactive_warn and bool(_inactive_links(g)),
        lambda g, t: f"NVLink links {_inactive_links(g)} are down",
    ),
)


def recovery_finding(action: str | None, *, code: str, context: str) -> Finding:
    """The finding for a driver-stated recovery action (Xid 154 or NVML's recovery-action field)."""
    if action is None:
        return Finding(code, Verdict.WARN, f"{context}: recovery action not stated", Action.INVESTIGATE)
    severity, todo = RECOVERY_RULES.get(action, (Verdict.WARN, Action.INVESTIGATE))
    return Finding(code, severity, f"{context}: the driver asks for '{action}'", todo)


def xid_finding(event: Mapping[str, Any], t: Thresholds) -> Finding:
    """The finding for one Xid event."""
    xid = int(event["xid"])
    code = f"xid.{xid}"
    where = f"Xid {xid} ({event.get('source', '?')}, {event.get('time', '?')})"
    if xid in t.xid_overrides:
        severity, action = t.xid_overrides[xid]
        return Finding(code, severity, f"{where}: severity set by category", action)
    if xid == XID_RECOVERY_ACTION:
        return recovery_finding(event.get("recovery_action"), code=code, context=where)
    rule = XID_RULES.get(xid)
    if rule is None:
        return Finding(
            code, Verdict.WARN, f"{where}: not in bcm's table; see NVIDIA's Xid catalogue", Action.INVESTIGATE
        )
    return Finding(code, rule.severity, f"{where}: {rule.meaning}", rule.action)


def evaluate_gpu(
    gpu: Mapping[str, Any], t: Thresholds, xid_events: Iterable[Mapping[str, Any]] = ()
) -> GpuVerdict:
    """One GPU's verdict from its sample and the Xid events attributed to it."""
    reasons = [
        Finding(r.code, r.severity, r.message(gpu, t), r.action) for r in GPU_RULES if r.applies(gpu, t)
    ]
    action = gpu.get("recovery_action")
    if action is not None and action != "none":
        reasons.append(recovery_finding(action, code="recovery_action", context="NVML recovery action"))
    reasons.extend(xid_finding(e, t) for e in xid_events)
    if gpu.get("errors") and not gpu.get("lost"):
        reasons.append(
            Finding(
                "nvml.errors",
                Verdict.OK,
                "some readings failed: " + "; ".join(gpu["errors"][:5]),
                Action.NONE,
            )
        )
    return GpuVerdict(
        index=int(gpu["index"]),
        uuid=gpu.get("uuid"),
        verdict=worst(r.severity for r in reasons),
        reasons=tuple(reasons),
    )


def evaluate(
    report: Mapping[str, Any], thresholds: Thresholds | None = None, expected_gpus: int | None = None
) -> NodeVerdict:
    """Judge one report. ``expected_gpus`` (from inventory) wins over the count the agent was told."""
    t = thresholds or Thresholds()
    gpus: list[Mapping[str, Any]] = list(report.get("gpus") or [])
    by_index = {int(g["index"]): g for g in gpus}
    by_uuid = {g["uuid"]: int(g["index"]) for g in gpus if g.get("uuid")}
    per_gpu: dict[int, list[Mapping[str, Any]]] = {i: [] for i in by_index}
    node: list[Finding] = []
    for event in report.get("xid_events") or []:
        index = event.get("gpu_index")
        if index is None and event.get("uuid") in by_uuid:
            index = by_uuid[event["uuid"]]
        if index is not None and int(index) in per_gpu:
            per_gpu[int(index)].append(event)
        else:
            finding = xid_finding(event, t)
            bus = event.get("pci_bus_id") or "an unknown GPU"
            node.append(dataclasses.replace(finding, message=f"{finding.message} (on {bus})"))
    count = int(report.get("gpu_count", len(gpus)))
    expected = expected_gpus if expected_gpus is not None else report.get("expected_gpu_count")
    if expected is not None and count < expected:
        node.append(
            Finding(
                "gpu.count",
                Verdict.FAIL,
                f"{count} GPUs visible, {expected} expected",
                Action.REBOOT_NODE,
            )
        )
    elif expected is not None and count > expected:
        node.append(
            Finding(
                "gpu.count",
                Verdict.WARN,
                f"{count} GPUs visible, {expected} expected; re-inventory",
                Action.INVESTIGATE,
            )
        )
    if count == 0 and report.get("errors"):
        node.append(
            Finding(
                "nvml.unavailable",
                Verdict.UNKNOWN,
                "NVML answered nothing: " + "; ".join(report["errors"][:3]),
                Action.CHECK_AGENT,
            )
        )
    verdicts = tuple(evaluate_gpu(by_index[i], t, per_gpu[i]) for i in sorted(by_index))
    overall = worst([*(g.verdict for g in verdicts), *(f.severity for f in node)])
    return NodeVerdict(verdict=overall, gpus=verdicts, findings=tuple(node))


def staleness(
    last_report_at: dt.datetime | None, now: dt.datetime, interval_s: float, n: int = 3
) -> Finding | None:
    """An UNKNOWN finding when no report came for ``n`` intervals (or ever), else None."""
    if last_report_at is None:
        return Finding("report.missing", Verdict.UNKNOWN, "no health report received yet", Action.CHECK_AGENT)
    age = (now - last_report_at).total_seconds()
    if age >= n * interval_s:
        return Finding(
            "report.stale",
            Verdict.UNKNOWN,
            f"last health report {age:.0f} s ago (>= {n} intervals of {interval_s:g} s)",
            Action.CHECK_AGENT,
        )
    return None
