"""GET /metrics: GPU health for Prometheus, named and labelled like NVIDIA's dcgm-exporter.

Series keep dcgm-exporter's names (``DCGM_FI_DEV_GPU_TEMP``, ``DCGM_FI_DEV_POWER_USAGE``,
``DCGM_FI_DEV_FB_USED`` …) and labels (``gpu``, ``UUID``, ``device``, ``pci_bus_id``, ``modelName``,
``Hostname``), so its Grafana dashboards work unchanged; the values are the latest each agent reported.
All are gauges, as dcgm-exporter's ECC and Xid fields are point readings (reset with the GPU). bcm adds
``bcm_gpu_health`` and ``bcm_node_health`` (0 OK, 1 UNKNOWN, 2 WARN, 3 FAIL), the report age and bcm's drains,
and counters of the boot artifacts this process sent (``bcm_boot_artifact_bytes_total{way}``, ``…_aborted_total``,
``…_fetches_total{kind}``)
and of the health reports it wrote (``bcm_health_ingest_reports_total``, ``…_batches_total``, ``…_waiting``,
``…_capacity``, ``…_refused_total``). For alerting on bcm itself: ``bcm_nodes{state}`` and
``bcm_operations{state}`` (rows in the database, the same on every server and shard: alert on their max),
and this server's dnsmasq (``bcm_dnsmasq_running``, ``bcm_dnsmasq_restarts_total``; 0 where this server is
not the leader or PXE is off). docs/prometheus/bcm-rules.yml alerts on them; docs/grafana/bcm.json shows them.

Authentication: any token of role viewer or higher (``Authorization: Bearer …``; in Prometheus,
``authorization: {credentials_file: …}`` in the scrape config). Node tokens are refused. At tens of
thousands of GPUs, shard scrapes with ``?nodes=<hostlist>``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from bcm import pathsend
from bcm.api.deps import SessionDep, Viewer
from bcm.api.params import HostlistQuery
from bcm.models.health import GpuHealth, NodeHealth
from bcm.services import health_queries as q
from bcm.services import nodes as nodes_svc
from bcm.services import operations as ops_svc

router = APIRouter(tags=["metrics"])

GPU_LABELS = ["gpu", "UUID", "device", "pci_bus_id", "modelName", "Hostname"]
RANK = {"OK": 0, "UNKNOWN": 1, "WARN": 2, "FAIL": 3}

GpuField = Callable[[GpuHealth], float | int | bool | None]
# (series name, help, value from the latest GPU state); None means "not reported" and is skipped
GPU_SERIES: list[tuple[str, str, GpuField]] = [
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", lambda g: g.temperature_c),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", lambda g: g.power_draw_w),
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", lambda g: g.utilization_gpu_pct),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", lambda g: g.utilization_memory_pct),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", lambda g: g.memory_used_mib),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", lambda g: _fb_free(g)),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Volatile single-bit ECC errors.", lambda g: g.ecc_sbe_volatile),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Volatile double-bit ECC errors.", lambda g: g.ecc_dbe_volatile),
    ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "Aggregate single-bit ECC errors.", lambda g: g.ecc_sbe_aggregate),
    ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "Aggregate double-bit ECC errors.", lambda g: g.ecc_dbe_aggregate),
    ("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", lambda g: g.last_xid or 0),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "PCIe replay counter.", lambda g: g.pcie_replay),
    (
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "Rows remapped for correctable errors.",
        lambda g: g.remap_correctable,
    ),
    (
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "Rows remapped for uncorrectable errors.",
        lambda g: g.remap_uncorrectable,
    ),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "Whether remapping of rows has failed.", lambda g: g.remap_failure),
    ("DCGM_FI_DEV_ROW_REMAP_PENDING", "Whether a row remap awaits a GPU reset.", lambda g: g.remap_pending),
    ("DCGM_FI_DEV_RETIRED_SBE", "Pages retired for single-bit errors.", lambda g: g.retired_sbe),
    ("DCGM_FI_DEV_RETIRED_DBE", "Pages retired for double-bit errors.", lambda g: g.retired_dbe),
    ("DCGM_FI_DEV_RETIRED_PENDING", "Pages pending retirement.", lambda g: g.retired_pending),
    (
        "bcm_gpu_health",
        "bcm verdict on the GPU: 0 OK, 1 UNKNOWN, 2 WARN, 3 FAIL.",
        lambda g: RANK.get(g.verdict, 1),
    ),
    ("bcm_gpu_xid_events", "Xid events bcm has received for this GPU.", lambda g: g.xid_count),
]


def _fb_free(g: GpuHealth) -> int | None:
    if g.memory_total_mib is None or g.memory_used_mib is None:
        return None
    return max(0, g.memory_total_mib - g.memory_used_mib)


class HealthCollector(Collector):
    """Yields the metric families for rows already read from the database."""

    def __init__(
        self, gpus: Iterable[tuple[str, GpuHealth]], nodes: Iterable[tuple[str, NodeHealth]]
    ) -> None:
        self.gpus = list(gpus)
        self.nodes = list(nodes)

    def collect(self) -> Iterator[Any]:
        families = [GaugeMetricFamily(name, doc, labels=GPU_LABELS) for name, doc, _ in GPU_SERIES]
        for host, g in self.gpus:
            labels = [str(g.index), g.uuid, f"nvidia{g.index}", g.pci_bus_id or "", g.name or "", host]
            for family, (_, _, value_of) in zip(families, GPU_SERIES, strict=True):
                value = value_of(g)
                if value is not None:
                    family.add_metric(labels, float(value))
        yield from families
        verdict = GaugeMetricFamily(
            "bcm_node_health",
            "bcm verdict on the node: 0 OK, 1 UNKNOWN, 2 WARN, 3 FAIL.",
            labels=["Hostname"],
        )
        last = GaugeMetricFamily(
            "bcm_node_last_report_timestamp_seconds",
            "When the node's last health report arrived.",
            labels=["Hostname"],
        )
        drained = GaugeMetricFamily(
            "bcm_node_drained_by_bcm",
            "1 while bcm holds the node drained for GPU health.",
            labels=["Hostname"],
        )
        for host, n in self.nodes:
            verdict.add_metric([host], float(RANK.get(n.verdict, 1)))
            if n.last_report_at is not None:
                last.add_metric([host], n.last_report_at.timestamp())
            drained.add_metric([host], 1.0 if n.drained_by_bcm else 0.0)
        yield from (verdict, last, drained)


class BootCollector(Collector):
    """Boot artifacts this server process sent whole by sendfile(2), by the fallback copy, and cut short."""

    def collect(self) -> Iterator[Any]:
        sent = CounterMetricFamily(
            "bcm_boot_artifact_bytes", "Boot-artifact bytes sent by pathsend, by way.", labels=["way"]
        )
        sent.add_metric(["sendfile"], float(pathsend.stats.sendfile_bytes))
        sent.add_metric(["copy"], float(pathsend.stats.copied_bytes))
        aborted = CounterMetricFamily(
            "bcm_boot_artifact_aborted", "Boot-artifact downloads cut short (client gone or stalled)."
        )
        aborted.add_metric([], float(pathsend.stats.aborted))
        from bcm.api.boot.images import DELTA_BYTES, FETCHES

        fetches = CounterMetricFamily(
            "bcm_boot_artifact_fetches",
            "Boot-artifact downloads started, by kind (kernel, initramfs, rootfs; delta: an auto install's changes).",
            labels=["kind"],
        )
        for kind in ("kernel", "initramfs", "rootfs", "delta"):
            fetches.add_metric([kind], float(FETCHES[kind]))
        delta_bytes = CounterMetricFamily(
            "bcm_image_delta_bytes",
            "Bytes of auto-install deltas sent: what an image sync moved over the wire.",
        )
        delta_bytes.add_metric([], float(DELTA_BYTES[0]))
        yield from (sent, aborted, fetches, delta_bytes)


class IngestCollector(Collector):
    """The health reports this server wrote, and in how many transactions (their ratio: the batch size)."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def collect(self) -> Iterator[Any]:
        batches = CounterMetricFamily(
            "bcm_health_ingest_batches", "Transactions that wrote agents' health reports."
        )
        batches.add_metric([], float(self.queue.batches))
        reports = CounterMetricFamily(
            "bcm_health_ingest_reports",
            "Agents' health reports those transactions took (each answered on its own).",
        )
        reports.add_metric([], float(self.queue.reports))
        waiting = GaugeMetricFamily("bcm_health_ingest_waiting", "Health reports waiting for a transaction.")
        waiting.add_metric([], float(self.queue.waiting))
        capacity = GaugeMetricFamily(
            "bcm_health_ingest_capacity", "Reports that may wait (BCM_HEALTH__INGEST_QUEUE); beyond, a 503."
        )
        capacity.add_metric([], float(self.queue.capacity))
        refused = CounterMetricFamily(
            "bcm_health_ingest_refused", "Health reports refused with a 503 because the queue was full."
        )
        refused.add_metric([], float(self.queue.refused))
        yield from (batches, reports, waiting, capacity, refused)


class StateCollector(Collector):
    """Nodes and operations by state (counted in the database) and the dnsmasq this server supervises."""

    def __init__(self, nodes: dict[str, int], operations: dict[str, int], dhcp: Any) -> None:
        self.nodes, self.operations, self.dhcp = nodes, operations, dhcp

    def collect(self) -> Iterator[Any]:
        nodes = GaugeMetricFamily("bcm_nodes", "Nodes in each provision state.", labels=["state"])
        for state, n in sorted(self.nodes.items()):
            nodes.add_metric([state], float(n))
        ops = GaugeMetricFamily(
            "bcm_operations", "Operations in the database in each state.", labels=["state"]
        )
        for state, n in sorted(self.operations.items()):
            ops.add_metric([state], float(n))
        running = GaugeMetricFamily("bcm_dnsmasq_running", "1 while this server's dnsmasq is running.")
        running.add_metric([], 1.0 if self.dhcp is not None and self.dhcp.pid is not None else 0.0)
        restarts = CounterMetricFamily(
            "bcm_dnsmasq_restarts", "Times this server started dnsmasq again after it exited."
        )
        restarts.add_metric([], float(self.dhcp.restarts if self.dhcp is not None else 0))
        yield from (nodes, ops, running, restarts)


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
)
def metrics(
    request: Request,
    session: SessionDep,
    _t: Viewer,
    nodes: HostlistQuery = None,
) -> Response:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HealthCollector(q.metric_rows(session, nodes), q.node_metric_rows(session, nodes)))
    registry.register(BootCollector())
    registry.register(IngestCollector(request.app.state.ingest))
    dhcp = getattr(request.app.state, "dhcp", None)
    registry.register(
        StateCollector(nodes_svc.count_by_state(session), ops_svc.count_by_state(session), dhcp)
    )
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
