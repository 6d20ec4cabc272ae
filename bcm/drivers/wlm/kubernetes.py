"""Kubernetes behind the workload-manager interface: its files rendered from the database, the
``kubernetes.yml`` playbook, and the API server spoken to with the official ``kubernetes`` client from the
head node. The only place bcm speaks Kubernetes.

Two modes, one entry point (``bcm_k8s.lab`` selects the roles):

- ``kubeadm`` (real nodes): containerd, ``kubeadm init`` from a rendered v1beta4 InitConfiguration on the
  control-plane node, ``kubeadm join`` with a JoinConfiguration whose bootstrap token and CA hash bcm made.
- ``lab``: etcd, kube-apiserver, kube-controller-manager and kube-scheduler (built by scripts/k8s-tools)
  run on the control-plane lab node; every member runs kwok for its own kubelet (``--manage-single-node``),
  so a dead lab node really goes NotReady.

In both, Kueue runs as a daemon on the control-plane node with bcm's certificates, and the API-side steps
are the same code: the ``bcm-system`` namespace, node labels in GPU Feature Discovery's names from bcm's
inventory (lab: the ``nvidia.com/gpu`` capacity too, as the device plugin would), a ResourceFlavor per GPU
product, a ClusterQueue and LocalQueue. Each API object is read first and written only when it differs, so
a re-deploy rewrites nothing.

Health actions: drain = cordon + ``NoSchedule`` taint ``bcm.io/gpu-unhealthy`` with the reason in an
annotation; resume removes only bcm's taint, and lifts the cordon only when it was bcm's.
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import anyio
import yaml

from bcm.domain import kubernetes as k8s
from bcm.drivers import ansible, offload
from bcm.drivers.ansible import AnsibleHost, PlaybookResult
from bcm.drivers.ssh import SshClient, Target
from bcm.drivers.wlm import k8s_pki as pki
from bcm.drivers.wlm import k8s_tenancy as k8t
from bcm.drivers.wlm.base import (
    AccountSpec,
    AccountUsage,
    AnsibleAccess,
    ClusterSpec,
    Controller,
    DeployPlan,
    NodeUsage,
    Render,
    TenancyChange,
    TenancyPlan,
    VerifyResult,
    WlmNodeState,
    poll_registered,
    write_private,
    write_rendered,
)
from bcm.errors import Conflict, DriverError, InvalidInput, RetryableDriverError

PLAYBOOK = "kubernetes.yml"
NODE_DIR = "/etc/bcm-k8s"  # on the nodes: certificates, kubeconfigs, rendered files
BIN_DIR = "/usr/local/lib/bcm-k8s/bin"  # on the nodes: the binaries the lab and Kueue run
DATA_DIR = "/var/lib/bcm-k8s"
KUEUE_DIR = f"{NODE_DIR}/kueue"
CLUSTER_QUEUE = "bcm-gpus"
LOCAL_QUEUE = "bcm"
QUEUE_LABEL = k8t.QUEUE_LABEL
KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
LAB_BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "kueue",
)
KUEUE_WEBHOOKS = (  # the admission webhooks of the integrations bcm enables (batch/job) and Kueue's own objects
    "mjob.kb.io",
    "vjob.kb.io",
    "mworkload.kb.io",
    "vworkload.kb.io",
    "mclusterqueue.kb.io",
    "vclusterqueue.kb.io",
    "mresourceflavor.kb.io",
    "vresourceflavor.kb.io",
    "vcohort.kb.io",
)
KWOK_STAGES = (  # kwok's "general" pod stages: a second or a few each, and a pod annotated
    # pod-complete.stage.kwok.x-k8s.io/delay=10m runs that long (a lab job that holds its GPUs)
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    *(
        f"kustomize/stage/pod/general/pod-{s}.yaml"
        for s in (
            "create",
            "init-container-running",
            "init-container-completed",
            "ready",
            "complete",
            "delete",
        )
    ),
)
_T = TypeVar("_T")


# ---- files and secrets ----------------------------------------------------------------------------


def _src_dir(tools: Path, which: str) -> Path:
    path = tools / f"{which}-src.path"
    if not path.exists():
        raise Conflict(f"{which} is not built in {tools}: run scripts/k8s-tools on the head node")
    return Path(path.read_text().strip())


def kwok_stages(tools: Path) -> str:
    """kwok's own stage files (from its module): nodes become Ready and heartbeat, pods run, Job pods finish."""
    src = _src_dir(tools, "kwok")
    return "".join(f"---\n# {rel}\n" + (src / rel).read_text().removeprefix("---\n") for rel in KWOK_STAGES)


def kueue_webhooks(tools: Path, url: str, ca_bundle: str) -> str:
    """Kueue's webhook configurations, kept to the webhooks bcm needs and pointed at the daemon's URL."""
    src = _src_dir(tools, "kueue") / "config/components/webhook/manifests.yaml"
    docs = [d for d in yaml.safe_load_all(src.read_text()) if d]
    out = []
    for doc in docs:
        doc["metadata"]["name"] = "bcm-kueue-" + doc["kind"].removesuffix("WebhookConfiguration").lower()
        hooks = []
        for hook in doc.get("webhooks") or []:
            if hook["name"] not in KUEUE_WEBHOOKS:
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": url.rstrip("/") + path, "caBundle": ca_bundle}
            hook["timeoutSeconds"] = 10
            hooks.append(hook)
        doc["webhooks"] = hooks
        out.append(doc)
    return yaml.safe_dump_all(out, sort_keys=True)


def kueue_crds(tools: Path) -> str:
    """The directory of Kueue's CRDs (inside its Go module)."""
    return str(_src_dir(tools, "kueue") / "config/components/crd/bases")


@dataclass(frozen=True)
class Access:
    """How the head node reaches a cluster's API server."""

    server: str
    ca: Path
    cert: Path
    key: Path
    verify_image: str = k8s.KubernetesSettings.model_fields["verify_image"].default


def access_of(secrets_dir: Path) -> Access:
    info = secrets_dir / "api.json"
    if not info.exists():
        raise Conflict("the cluster has no API credentials yet: deploy it first")
    data = json.loads(info.read_text())
    d = secrets_dir / "pki"
    return Access(data["server"], d / "ca.crt", d / "admin.crt", d / "admin.key", data["verify_image"])


# ---- the API server -------------------------------------------------------------------------------


class Api:
    """A bounded client for one cluster's API server (every call carries a timeout)."""

    def __init__(self, access: Access, timeout_s: float = 20.0) -> None:
        from kubernetes import client  # imported here: the client is large

        conf = client.Configuration()
        conf.host = access.server
        conf.ssl_ca_cert = str(access.ca)
        conf.cert_file = str(access.cert)
        conf.key_file = str(access.key)
        conf.verify_ssl = True
        conf.retries = 0
        self.server = access.server
        self.verify_image = access.verify_image
        self.timeout = (5.0, timeout_s)
        self.api = client.ApiClient(conf)
        self.core = client.CoreV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.node_api = client.NodeV1Api(self.api)
        self.changes: list[str] = []

    def close(self) -> None:
        self.api.close()

    def call(self, what: str, fn: Callable[..., _T], *args: Any, **kw: Any) -> _T:
        """One request; 404 comes back as None for ``get``-like callers (``missing_ok``)."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        missing_ok = kw.pop("missing_ok", False)
        try:
            return fn(*args, _request_timeout=self.timeout, **kw)
        except ApiException as exc:
            if missing_ok and exc.status == 404:
                return None  # type: ignore[return-value]
            detail = _api_message(exc)
            if exc.status in (409,):
                raise Conflict(f"{what}: {detail}") from None
            if exc.status >= 500 or exc.status == 429:
                raise RetryableDriverError(f"{what}: API server {self.server}: {detail}") from None
            raise DriverError(f"{what}: API server {self.server}: {detail}") from None
        except (HTTPError, OSError) as exc:
            raise RetryableDriverError(
                f"{what}: API server {self.server} unreachable: {type(exc).__name__}: {str(exc)[:200]}"
            ) from None

    # -- read-then-write helpers: nothing is written when the object already is as wanted

    def ensure_namespace(self, name: str) -> None:
        if self.call(f"read namespace {name}", self.core.read_namespace, name, missing_ok=True) is None:
            body = {"metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "bcm"}}}
            self.call(f"create namespace {name}", self.core.create_namespace, body)
            self.changes.append(f"namespace/{name} created")

    def ensure_custom(self, plural: str, body: dict[str, Any], namespace: str | None = None) -> None:
        name = body["metadata"]["name"]
        what = f"{plural}/{name}"
        have: Any
        if namespace:
            have = self.call(
                f"read {what}",
                self.custom.get_namespaced_custom_object,
                KUEUE_GROUP,
                KUEUE_VERSION,
                namespace,
                plural,
                name,
                missing_ok=True,
            )
        else:
            have = self.call(
                f"read {what}",
                self.custom.get_cluster_custom_object,
                KUEUE_GROUP,
                KUEUE_VERSION,
                plural,
                name,
                missing_ok=True,
            )
        if have is None:
            if namespace:
                self.call(
                    f"create {what}",
                    self.custom.create_namespaced_custom_object,
                    KUEUE_GROUP,
                    KUEUE_VERSION,
                    namespace,
                    plural,
                    body,
                )
            else:
                self.call(
                    f"create {what}",
                    self.custom.create_cluster_custom_object,
                    KUEUE_GROUP,
                    KUEUE_VERSION,
                    plural,
                    body,
                )
            self.changes.append(f"{what} created")
            return
        if holds(body["spec"], have.get("spec") or {}):
            return
        patch = {"spec": body["spec"]}
        if namespace:
            self.call(
                f"patch {what}",
                self.custom.patch_namespaced_custom_object,
                KUEUE_GROUP,
                KUEUE_VERSION,
                namespace,
                plural,
                name,
                patch,
            )
        else:
            self.call(
                f"patch {what}",
                self.custom.patch_cluster_custom_object,
                KUEUE_GROUP,
                KUEUE_VERSION,
                plural,
                name,
                patch,
            )
        self.changes.append(f"{what} updated")

    def ensure_runtime_class(self, name: str, handler: str) -> None:
        have = self.call(f"read runtimeclass {name}", self.node_api.read_runtime_class, name, missing_ok=True)
        if have is None:
            body = {"metadata": {"name": name}, "handler": handler}
            self.call(f"create runtimeclass {name}", self.node_api.create_runtime_class, body)
            self.changes.append(f"runtimeclass/{name} created")

    def node(self, name: str) -> Any:
        return self.call(f"read node {name}", self.core.read_node, name, missing_ok=True)

    # -- generic access to the kinds tenancy renders (dicts in, dicts out)

    def _ops(self, kind: str) -> tuple[Callable[..., Any], ...]:
        from kubernetes import client

        rbac = client.RbacAuthorizationV1Api(self.api)
        c = self.custom
        custom = {
            "Cohort": ("cohorts", False),
            "ClusterQueue": ("clusterqueues", False),
            "LocalQueue": ("localqueues", True),
        }
        if kind in custom:
            plural, namespaced = custom[kind]
            g, v = KUEUE_GROUP, KUEUE_VERSION
            if namespaced:
                return (
                    lambda n, ns, **kw: c.get_namespaced_custom_object(g, v, ns, plural, n, **kw),
                    lambda ns, b, **kw: c.create_namespaced_custom_object(g, v, ns, plural, b, **kw),
                    lambda n, ns, b, **kw: c.replace_namespaced_custom_object(g, v, ns, plural, n, b, **kw),
                    lambda n, ns, **kw: c.delete_namespaced_custom_object(g, v, ns, plural, n, **kw),
                )
            return (
                lambda n, ns, **kw: c.get_cluster_custom_object(g, v, plural, n, **kw),
                lambda ns, b, **kw: c.create_cluster_custom_object(g, v, plural, b, **kw),
                lambda n, ns, b, **kw: c.replace_cluster_custom_object(g, v, plural, n, b, **kw),
                lambda n, ns, **kw: c.delete_cluster_custom_object(g, v, plural, n, **kw),
            )
        if kind == "Namespace":
            k = self.core
            return (
                lambda n, ns, **kw: k.read_namespace(n, **kw),
                lambda ns, b, **kw: k.create_namespace(b, **kw),
                lambda n, ns, b, **kw: k.replace_namespace(n, b, **kw),
                lambda n, ns, **kw: k.delete_namespace(n, **kw),
            )
        if kind == "ResourceQuota":
            k = self.core
            return (
                k.read_namespaced_resource_quota,
                k.create_namespaced_resource_quota,
                k.replace_namespaced_resource_quota,
                k.delete_namespaced_resource_quota,
            )
        if kind == "RoleBinding":
            return (
                rbac.read_namespaced_role_binding,
                rbac.create_namespaced_role_binding,
                rbac.replace_namespaced_role_binding,
                rbac.delete_namespaced_role_binding,
            )
        raise DriverError(f"bcm does not manage {kind} objects")

    def read_obj(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        got = self.call(f"read {kind} {name}", self._ops(kind)[0], name, namespace, missing_ok=True)
        if got is None:
            return None
        out: dict[str, Any] = got if isinstance(got, dict) else self.api.sanitize_for_serialization(got)
        return out

    def create_obj(self, kind: str, namespace: str | None, body: dict[str, Any]) -> None:
        self.call(f"create {kind} {body['metadata']['name']}", self._ops(kind)[1], namespace, body)

    def replace_obj(self, kind: str, namespace: str | None, name: str, body: dict[str, Any]) -> None:
        self.call(f"update {kind} {name}", self._ops(kind)[2], name, namespace, body)

    def delete_obj(self, kind: str, namespace: str | None, name: str) -> None:
        self.call(f"delete {kind} {name}", self._ops(kind)[3], name, namespace, missing_ok=True)

    def list_labelled(self, kind: str, selector: str) -> list[dict[str, Any]]:
        if kind == "Namespace":
            items = self.call("list namespaces", self.core.list_namespace, label_selector=selector).items
            return [self.api.sanitize_for_serialization(i) for i in items]
        plural = {"Cohort": "cohorts", "ClusterQueue": "clusterqueues"}[kind]
        got: Any = self.call(
            f"list {plural}",
            self.custom.list_cluster_custom_object,
            KUEUE_GROUP,
            KUEUE_VERSION,
            plural,
            label_selector=selector,
        )
        return list(got.get("items", []))


def _api_message(exc: Any) -> str:
    try:
        return str(json.loads(exc.body).get("message"))[:300]
    except (TypeError, ValueError, AttributeError):
        return f"HTTP {exc.status} {exc.reason}"


def holds(want: Any, have: Any) -> bool:
    """``want`` holds nothing that ``have`` lacks or differs in (the server may add defaults)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(k in have and holds(v, have[k]) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(holds, want, have))
    return bool(want == have)


def _ready(node: Any) -> str:
    for c in (node.status.conditions or []) if node.status else []:
        if c.type == "Ready":
            return {"True": "ready", "False": "notready"}.get(c.status, "unknown")
    return "unknown"


def node_state(node: Any) -> WlmNodeState:
    """kubectl's words: ``ready``, ``notready``, ``unknown``, with ``,schedulingdisabled`` when cordoned.
    The reason is bcm's annotation when the taint is bcm's, ``cordoned`` for anyone else's cordon."""
    state = _ready(node)
    unschedulable = bool(node.spec and node.spec.unschedulable)
    if unschedulable:
        state += ",schedulingdisabled"
    notes = (node.metadata.annotations or {}) if node.metadata else {}
    taints = [t.key for t in ((node.spec.taints or []) if node.spec else [])]
    reason = None
    if k8s.TAINT_KEY in taints:
        reason = notes.get(k8s.REASON_ANNOTATION) or k8s.clean_reason(None)
    elif unschedulable:
        reason = "cordoned"
    return WlmNodeState(state, reason)


# ---- the interface ------------------------------------------------------------------------------------


class Kubernetes:
    """:class:`bcm.drivers.wlm.base.WorkloadManager` for Kubernetes (the control plane on the controller)."""

    kind: ClassVar[str] = "kubernetes"
    title: ClassVar[str] = "Kubernetes"
    node_agent: ClassVar[str] = "kubelet"

    def plan(self, spec: ClusterSpec, secrets_dir: Path, render: Render) -> DeployPlan:
        s = k8s.KubernetesSettings.model_validate(spec.settings)
        k8s.check_subnets(s)
        cp = spec.controller
        if not cp.address:
            raise Conflict(f"control plane {cp.name} has no address")
        tools = Path(s.tools_dir)
        if not (tools / "kueue").exists() or (s.mode == "lab" and not (tools / "kube-apiserver").exists()):
            raise Conflict(
                f"settings.tools_dir: {tools} lacks the binaries: run scripts/k8s-tools on the head node"
            )
        d = secrets_dir / "pki"
        server = f"https://{cp.address}:{s.api_port}"
        svc_ip = str(next(ipaddress.ip_network(s.service_subnet).hosts()))
        pki.ensure_ca(d)
        pki.ensure_sa_keys(d)
        pki.ensure_cert(
            d,
            "apiserver",
            "kube-apiserver",
            server=True,
            dns=(
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                f"kubernetes.default.svc.{s.dns_domain}",
                cp.name,
            ),
            ips=(cp.address, svc_ip),
        )
        pki.ensure_cert(d, "admin", "bcm-admin", orgs=("system:masters",))
        pki.ensure_cert(d, "controller-manager", "system:kube-controller-manager")
        pki.ensure_cert(d, "scheduler", "system:kube-scheduler")
        pki.ensure_cert(d, "kueue", "bcm-kueue", orgs=("system:masters",))
        pki.ensure_cert(d, "kueue-serving", "bcm-kueue-webhook", server=True, ips=(cp.address,))
        token = pki.ensure_bootstrap_token(d)
        ca_hash = pki.ca_cert_hash(d)
        write_private(
            secrets_dir / "api.json", json.dumps({"server": server, "verify_image": s.verify_image}).encode()
        )

        def kc(stem: str, user: str) -> str:
            path = d / f"{stem}.kubeconfig"
            write_private(
                path,
                pki.kubeconfig(
                    d, server, user, d / f"{stem}.crt", d / f"{stem}.key", cluster=spec.name
                ).encode(),
            )
            return str(path)

        members = [m.name for m in spec.members]
        ctx: dict[str, Any] = {
            "cluster": spec.name,
            "cp": cp,
            "s": s,
            "bin": BIN_DIR,
            "pki": NODE_DIR,
            "data": DATA_DIR,
            "kueue_dir": KUEUE_DIR,
            "kwok_group": pki.KWOK_GROUP,
            "token": token,
            "ca_hash": ca_hash,
            "cp_is_worker": cp.name in members,
        }
        cp_files = {
            "kueue-config.yaml": render("kubernetes/kueue/config.yaml.j2", **ctx),
            "kueue.sh": render("kubernetes/kueue/kueue.sh.j2", **ctx),
            "rbac.yaml": render("kubernetes/rbac.yaml.j2", **ctx),
            "kueue-webhooks.yaml": kueue_webhooks(tools, f"https://{cp.address}:9443", pki.ca_bundle(d)),
        }
        secret_files: dict[str, str] = {}  # rendered files that hold the bootstrap token
        if s.mode == "lab":
            for c in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
                cp_files[f"{c}.sh"] = render(f"kubernetes/lab/{c}.sh.j2", **ctx)
        else:
            secret_files["kubeadm-init.yaml"] = render("kubernetes/kubeadm/init.yaml.j2", **ctx)
            cp_files["containerd.toml"] = render("kubernetes/containerd/config.toml.j2", **ctx)
            cp_files["gpu-operator-values.yaml"] = render("kubernetes/gpu-operator/values.yaml.j2", **ctx)
        cp_paths = write_rendered(secrets_dir, cp_files)
        stages = kwok_stages(tools) if s.mode == "lab" else ""
        node_paths: dict[str, dict[str, str]] = {}
        for i, m in enumerate(spec.members):
            nctx = {**ctx, "node": m, "pod_cidr": k8s.node_pod_cidr(s.pod_subnet, i)}
            files: dict[str, str] = {}
            if s.mode == "lab":
                if not m.address:
                    raise Conflict(f"node {m.name} has no address")
                pki.ensure_cert(d, f"node-{m.name}", f"bcm-kwok:{m.name}", orgs=(pki.KWOK_GROUP,))
                files["kwok.sh"] = render("kubernetes/lab/kwok.sh.j2", **nctx)
                files["kwok-stages.yaml"] = stages
                kc(f"node-{m.name}", f"bcm-kwok:{m.name}")
            else:
                files["containerd.toml"] = cp_files.get("containerd.toml") or render(
                    "kubernetes/containerd/config.toml.j2", **ctx
                )
                files["10-bcm.conflist"] = render("kubernetes/cni/10-bcm.conflist.j2", **nctx)
                secret_files[f"join-{m.name}.yaml"] = render("kubernetes/kubeadm/join.yaml.j2", **nctx)
            node_paths[m.name] = {
                k: str(p) for k, p in write_rendered(secrets_dir / "nodes" / m.name, files).items()
            }
            if s.mode == "lab":
                node_paths[m.name]["kwok.kubeconfig"] = str(d / f"node-{m.name}.kubeconfig")
            else:
                node_paths[m.name]["join.yaml"] = str(secrets_dir / "etc" / f"join-{m.name}.yaml")
        write_rendered(secrets_dir, secret_files)
        pki_paths = {
            "ca.crt": str(d / "ca.crt"),
            "admin.kubeconfig": kc("admin", "bcm-admin"),
            "kueue.kubeconfig": kc("kueue", "bcm-kueue"),
            "kueue-tls.crt": str(d / "kueue-serving.crt"),
            "kueue-tls.key": str(d / "kueue-serving.key"),
        }
        cp_secret_paths: dict[str, str] = {}
        if s.mode == "lab":
            kc("controller-manager", "system:kube-controller-manager")
            kc("scheduler", "system:kube-scheduler")
            for stem in ("ca.crt", "ca.key", "sa.key", "sa.pub", "apiserver.crt", "apiserver.key"):
                cp_secret_paths[stem] = str(d / stem)
            for stem in ("controller-manager.kubeconfig", "scheduler.kubeconfig"):
                cp_secret_paths[stem] = str(d / stem)
        else:
            cp_secret_paths = {
                "ca.key": str(d / "ca.key"),
                "kubeadm-init.yaml": str(secrets_dir / "etc" / "kubeadm-init.yaml"),
            }
        groups_cp = ("k8s_control_plane", *(("k8s_nodes",) if cp.name in members else ()))
        hosts = [AnsibleHost(cp.name, cp.address, cp.host_key or "", groups_cp)]
        hosts += [
            AnsibleHost(m.name, m.address or "", m.host_key or "", ("k8s_nodes",))
            for m in spec.members
            if m.name != cp.name
        ]
        extravars = {
            "bcm_k8s": {
                "cluster": spec.name,
                "lab": s.mode == "lab",
                "tools_dir": str(tools),
                "binaries": list(LAB_BINARIES) if s.mode == "lab" else ["kueue"],
                "control_plane": cp.name,
                "api_server": server,
                "cp_files": cp_paths,
                "cp_secrets": cp_secret_paths,
                "pki": pki_paths,
                "node_files": node_paths,
                "kueue_crds": kueue_crds(tools),
                "node_dir": NODE_DIR,
                "bin_dir": BIN_DIR,
                "data_dir": DATA_DIR,
                "kueue_dir": KUEUE_DIR,
            }
        }
        model = {"settings": s.model_dump(mode="json"), "members": spec.members, "controller": cp}
        fingerprint = ca_hash.removeprefix("sha256:")
        return DeployPlan(spec.name, cp.name, hosts, members, extravars, model, fingerprint, secrets_dir)

    def keep_secrets(self, secrets_dir: Path, secrets: Mapping[str, str]) -> None:
        return None

    def deploy(self, plan: DeployPlan, access: AnsibleAccess, timeout_s: float) -> PlaybookResult:
        """The playbook, then (when the control plane came up) the API-side steps, which are the same in
        both modes; what they changed is added to the result's log lines."""
        result = ansible.run_playbook(
            PLAYBOOK,
            plan.hosts,
            plan.extravars,
            key_file=access.key_file,
            work_dir=access.work_dir,
            username=access.username,
            connect_timeout_s=access.connect_timeout_s,
            timeout_s=timeout_s,
        )
        ctl = result.hosts.get(plan.controller)
        if ctl is None or ctl.status != "ok":
            return result
        assert plan.secrets_dir is not None  # plan() sets it
        api = Api(access_of(plan.secrets_dir))
        try:
            self._api_steps(api, plan)
        except DriverError as exc:
            ctl.failed += 1
            ctl.error = f"API-side steps: {exc.message}"
            result.errors.append(ctl.error)
        finally:
            api.close()
        result.notes.extend(f"api: {c}" for c in api.changes)
        result.notes.append(f"api: changed={len(api.changes)}")
        return result

    def _api_steps(self, api: Api, plan: DeployPlan) -> None:
        s = k8s.KubernetesSettings.model_validate(plan.config["settings"])
        members = plan.config["members"]
        api.ensure_namespace(k8s.SYSTEM_NAMESPACE)
        flavors: dict[str, int] = {}
        deadline = time.monotonic() + 60
        for m in members:
            gpus = k8s.node_gpus([(i, n, m.gpu_memory.get(i)) for i, n in m.gpus])
            if gpus.product:
                flavors[gpus.product] = flavors.get(gpus.product, 0) + gpus.count
            self._ensure_node(api, m.name, plan.cluster, gpus, lab=s.mode == "lab", deadline=deadline)
        self._remove_left(api, plan.cluster, {m.name for m in members})
        if s.container_toolkit:
            api.ensure_runtime_class("nvidia", "nvidia")
        for product in sorted(flavors):
            api.ensure_custom(
                "resourceflavors",
                {
                    "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}",
                    "kind": "ResourceFlavor",
                    "metadata": {"name": k8s.flavor_name(product)},
                    "spec": {"nodeLabels": {k8s.LABEL_PRODUCT: product}},
                },
            )
        left = s.gpu_quota if s.gpu_quota is not None else sum(flavors.values())
        quotas = []
        for product in sorted(flavors):
            take = min(flavors[product], left)
            left -= take
            quotas.append(
                {
                    "name": k8s.flavor_name(product),
                    "resources": [{"name": k8s.GPU_RESOURCE, "nominalQuota": str(take)}],
                }
            )
        if quotas:
            api.ensure_custom(
                "clusterqueues",
                {
                    "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}",
                    "kind": "ClusterQueue",
                    "metadata": {"name": CLUSTER_QUEUE},
                    "spec": {
                        "namespaceSelector": {},
                        "queueingStrategy": "BestEffortFIFO",
                        "resourceGroups": [{"coveredResources": [k8s.GPU_RESOURCE], "flavors": quotas}],
                    },
                },
            )
            api.ensure_custom(
                "localqueues",
                {
                    "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}",
                    "kind": "LocalQueue",
                    "metadata": {"name": LOCAL_QUEUE, "namespace": k8s.SYSTEM_NAMESPACE},
                    "spec": {"clusterQueue": CLUSTER_QUEUE},
                },
                namespace=k8s.SYSTEM_NAMESPACE,
            )

    @staticmethod
    def _remove_left(api: Api, cluster: str, members: set[str]) -> None:
        """A node bcm labelled for this cluster that is no longer a member (retired, or left out of the
        deploy) leaves it: its Node object is deleted, so nothing is scheduled there and it is not shown."""
        got: Any = api.call("list nodes", api.core.list_node, label_selector=f"{k8s.BCM_LABEL}={cluster}")
        for node in got.items:
            name = node.metadata.name
            if name not in members:
                api.call(f"delete node {name}", api.core.delete_node, name, missing_ok=True)
                api.changes.append(f"node/{name} deleted (left the cluster)")

    def _ensure_node(
        self, api: Api, name: str, cluster: str, gpus: k8s.NodeGpus, *, lab: bool, deadline: float
    ) -> None:
        """Labels from the inventory; in the lab the Node object itself (kwok then runs its kubelet) with
        the GPU capacity a device plugin would advertise. A real kubelet registers its own node: wait."""
        labels = {**gpus.labels, k8s.BCM_LABEL: cluster}
        if not gpus.product:
            labels.update({k8s.LABEL_PRODUCT: None, k8s.LABEL_COUNT: None, k8s.LABEL_MEMORY: None})  # type: ignore[dict-item]
        node = api.node(name)
        if node is None and lab:
            cap = {"cpu": "32", "memory": "256Gi", "pods": "110", k8s.GPU_RESOURCE: str(gpus.count)}
            body = {
                "metadata": {
                    "name": name,
                    "annotations": {"kwok.x-k8s.io/node": "fake"},
                    "labels": {
                        "kubernetes.io/hostname": name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "type": "kwok",
                        **{k: v for k, v in labels.items() if v is not None},
                    },
                },
                "status": {"capacity": cap, "allocatable": cap},
            }
            api.call(f"create node {name}", api.core.create_node, body)
            api.changes.append(f"node/{name} created")
            return
        while node is None:  # a kubelet that joined registers its node within seconds; bounded
            if time.monotonic() > deadline:
                raise DriverError(f"node {name} did not register with the API server")
            time.sleep(2)
            node = api.node(name)
        have = node.metadata.labels or {}
        patch = {k: v for k, v in labels.items() if have.get(k) != v and not (v is None and k not in have)}
        if patch:
            api.call(f"label node {name}", api.core.patch_node, name, {"metadata": {"labels": patch}})
            api.changes.append(f"node/{name} labels " + ",".join(sorted(patch)))
        if lab:
            want = str(gpus.count)
            cap = (node.status.capacity or {}) if node.status else {}
            if cap.get(k8s.GPU_RESOURCE) != want:
                body = {
                    "status": {"capacity": {k8s.GPU_RESOURCE: want}, "allocatable": {k8s.GPU_RESOURCE: want}}
                }
                api.call(f"patch node {name} status", api.core.patch_node_status, name, body)
                api.changes.append(f"node/{name} capacity {k8s.GPU_RESOURCE}={want}")

    # -- talking to the running cluster: the blocking client in a worker thread, bounded

    async def _with_api(self, controller: Target, fn: Callable[[Api], _T], timeout_s: float) -> _T:
        if not isinstance(controller, Controller) or controller.secrets_dir is None:
            raise DriverError(f"control plane {controller.name}: no cluster credentials handed to the driver")
        access = access_of(controller.secrets_dir)

        def run() -> _T:
            api = Api(access, timeout_s)
            try:
                return fn(api)
            finally:
                api.close()

        with anyio.fail_after(timeout_s + 10):
            return await offload.run("kubernetes", run)  # never a request thread (#27)

    async def node_states(
        self, ssh: SshClient, controller: Target, timeout_s: float = 30
    ) -> dict[str, WlmNodeState]:
        def read(api: Api) -> dict[str, WlmNodeState]:
            nodes: Any = api.call("list nodes", api.core.list_node)
            return {n.metadata.name: node_state(n) for n in nodes.items}

        return await self._with_api(controller, read, timeout_s)

    async def wait_registered(
        self, ssh: SshClient, controller: Target, names: list[str], timeout_s: float = 90
    ) -> dict[str, WlmNodeState]:
        """Poll the API's nodes until every named one is Ready, bounded by ``timeout_s``."""
        return await poll_registered(self, ssh, controller, names, timeout_s)

    async def verify(
        self,
        ssh: SshClient,
        controller: Target,
        names: list[str],
        *,
        timeout_s: float = 120,
        gpus: bool = True,
    ) -> VerifyResult:
        """A Kueue-admitted Job with one pod per node (one GPU each), admitted whole or not at all."""
        if not names:
            raise InvalidInput("nodes: nothing to verify", field="nodes")
        job_name = f"bcm-verify-{int(time.time())}"
        ns = k8s.SYSTEM_NAMESPACE
        n = len(names)
        limits = {k8s.GPU_RESOURCE: "1"} if gpus else {}
        body = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": job_name, "namespace": ns, "labels": {QUEUE_LABEL: LOCAL_QUEUE}},
            "spec": {
                "parallelism": n,
                "completions": n,
                "completionMode": "Indexed",
                "backoffLimit": 0,
                "suspend": True,
                "ttlSecondsAfterFinished": 3600,
                "template": {
                    "metadata": {"labels": {"bcm.io/verify": job_name}},
                    "spec": {
                        "restartPolicy": "Never",
                        "affinity": {
                            "nodeAffinity": {
                                "requiredDuringSchedulingIgnoredDuringExecution": {
                                    "nodeSelectorTerms": [
                                        {
                                            "matchExpressions": [
                                                {
                                                    "key": "kubernetes.io/hostname",
                                                    "operator": "In",
                                                    "values": names,
                                                }
                                            ]
                                        }
                                    ]
                                }
                            },
                            "podAntiAffinity": {
                                "requiredDuringSchedulingIgnoredDuringExecution": [
                                    {
                                        "labelSelector": {"matchLabels": {"bcm.io/verify": job_name}},
                                        "topologyKey": "kubernetes.io/hostname",
                                    }
                                ]
                            },
                        },
                        "containers": [
                            {
                                "name": "verify",
                                "image": "",
                                "command": ["nvidia-smi", "-L"],
                                "resources": {"limits": limits},
                            }
                        ],
                    },
                },
            },
        }
        if not gpus:
            body["spec"]["template"]["spec"]["containers"][0]["command"] = ["true"]  # type: ignore[index]

        def run(api: Api) -> VerifyResult:
            if api.call("read namespace", api.core.read_namespace, ns, missing_ok=True) is None:
                return VerifyResult(False, f"namespace {ns} is missing: deploy the cluster first")
            body["spec"]["template"]["spec"]["containers"][0]["image"] = api.verify_image  # type: ignore[index]
            api.call(f"create job {job_name}", api.batch.create_namespaced_job, ns, body)
            end = time.monotonic() + timeout_s
            message = "not admitted"
            while time.monotonic() < end:
                job: Any = api.call(f"read job {job_name}", api.batch.read_namespaced_job, job_name, ns)
                conds = {c.type: c for c in (job.status.conditions or [])} if job.status else {}
                if "Complete" in conds and conds["Complete"].status == "True":
                    message = ""
                    break
                if "Failed" in conds and conds["Failed"].status == "True":
                    message = f"the job failed: {conds['Failed'].message or conds['Failed'].reason}"
                    break
                message = self._admission(api, ns, job_name) or "admitted, pods not finished"
                time.sleep(1.0)
            else:
                message = f"not finished within {timeout_s:.0f}s: {message}"
            pods: Any = api.call(
                "list pods", api.core.list_namespaced_pod, ns, label_selector=f"bcm.io/verify={job_name}"
            )
            seen = {
                p.spec.node_name: (f"{k8s.GPU_RESOURCE}=1" if gpus else "-")
                for p in pods.items
                if p.spec.node_name and p.status.phase == "Succeeded"
            }
            missing = [x for x in names if x not in seen]
            if message or missing:
                why = message or f"no pod finished on {', '.join(missing)}"
                return VerifyResult(False, why, job_name, seen)
            what = "one pod with one GPU" if gpus else "one pod (no GPUs inventoried)"
            return VerifyResult(
                True,
                f"{what} ran on all {n} nodes, admitted by Kueue",
                job_name,
                seen,
                f"{k8s.GPU_RESOURCE}={n if gpus else 0}",
            )

        return await self._with_api(controller, run, timeout_s + 30)

    @staticmethod
    def _admission(api: Api, ns: str, job_name: str) -> str | None:
        """Kueue's word on the job's Workload: pending and why, or None once admitted."""
        wls: Any = api.call(
            "list workloads",
            api.custom.list_namespaced_custom_object,
            KUEUE_GROUP,
            KUEUE_VERSION,
            ns,
            "workloads",
        )
        for wl in wls.get("items", []):
            owners = wl["metadata"].get("ownerReferences") or []
            if not any(o.get("name") == job_name for o in owners):
                continue
            conds = {c["type"]: c for c in (wl.get("status") or {}).get("conditions") or []}
            if conds.get("Admitted", {}).get("status") == "True":
                return None
            pending = conds.get("QuotaReserved") or conds.get("Pending") or {}
            return (
                f"Kueue has not admitted it: {pending.get('message') or pending.get('reason') or 'pending'}"
            )
        return "no Kueue workload for the job yet"

    async def drain(
        self, ssh: SshClient, controller: Target, names: list[str], reason: str | None, timeout_s: float = 30
    ) -> None:
        text = k8s.clean_reason(reason)

        def run(api: Api) -> None:
            for name in names:
                self._update_node(api, name, lambda node: apply_drain(node, text))

        await self._with_api(controller, run, timeout_s)

    async def resume(
        self, ssh: SshClient, controller: Target, names: list[str], timeout_s: float = 30
    ) -> None:
        def run(api: Api) -> None:
            for name in names:
                self._update_node(api, name, lift_drain)

        await self._with_api(controller, run, timeout_s)

    @staticmethod
    def _update_node(api: Api, name: str, change: Callable[[Any], bool]) -> None:
        """Read, change, replace with the read resourceVersion; a concurrent writer → read again (3 tries)."""
        for _ in range(3):
            node = api.node(name)
            if node is None:
                raise DriverError(f"node {name} is not registered with the API server")
            if not change(node):
                return
            try:
                api.call(f"update node {name}", api.core.replace_node, name, node)
                return
            except Conflict:
                continue
        raise Conflict(f"node {name} kept changing under bcm's update; try again")

    @staticmethod
    def _flavors(api: Api) -> list[str]:
        got: Any = api.call(
            "list resourceflavors",
            api.custom.list_cluster_custom_object,
            KUEUE_GROUP,
            KUEUE_VERSION,
            "resourceflavors",
        )
        return sorted(
            f["metadata"]["name"]
            for f in got.get("items", [])
            if k8s.LABEL_PRODUCT in ((f.get("spec") or {}).get("nodeLabels") or {})
        )

    def _tenancy(
        self, api: Api, cluster: str, accounts: list[AccountSpec], previous: list[AccountSpec] | None
    ) -> tuple[TenancyPlan, list[tuple[TenancyChange, k8t.Obj | None]]]:
        flavors = self._flavors(api)
        want = k8t.objects(accounts, flavors)
        was = {o.key: o for o in k8t.objects(previous or [], flavors)}
        steps: list[tuple[TenancyChange, k8t.Obj | None]] = []
        notes = (
            [] if flavors else ["no GPU ResourceFlavor yet: deploy the cluster first (queues get no quota)"]
        )
        for o in want:
            live = api.read_obj(o.kind, o.namespace, o.name)
            if live is not None and (live.get("metadata") or {}).get("deletionTimestamp"):
                notes.append(f"{o.key} is being deleted: apply again once it is gone")
                continue
            if live is None:
                steps.append(
                    (
                        TenancyChange(
                            "add",
                            o.kind,
                            o.key,
                            k8t.describe(o),
                            f"kubectl create {o.key}",
                            drift=o.key in was,
                        ),
                        o,
                    )
                )
            elif not _matches(o, live):
                drift = o.key in was and was[o.key].content == o.content
                steps.append(
                    (
                        TenancyChange(
                            "modify", o.kind, o.key, k8t.describe(o), f"kubectl replace {o.key}", drift=drift
                        ),
                        o,
                    )
                )
        keys = {o.key for o in want}
        for kind in ("ClusterQueue", "Namespace", "Cohort"):
            for live in api.list_labelled(kind, f"{k8t.LABEL}=true"):
                key = f"{kind.lower()}/{live['metadata']['name']}"
                if key in keys or live["metadata"].get("deletionTimestamp"):
                    continue
                gone = k8t.Obj(kind, None, live["metadata"]["name"], {})
                steps.append(
                    (
                        TenancyChange(
                            "remove",
                            kind,
                            key,
                            "not in bcm's model",
                            f"kubectl delete {key}",
                            drift=key not in was,
                        ),
                        gone,
                    )
                )
        return TenancyPlan(cluster, [c for c, _ in steps], notes), steps

    async def tenancy_plan(
        self,
        ssh: SshClient,
        controller: Target,
        cluster: str,
        accounts: list[AccountSpec],
        timeout_s: float = 30,
        previous: list[AccountSpec] | None = None,
    ) -> TenancyPlan:
        """Kueue's cohorts and queues, the projects' namespaces, quotas and role bindings against the model."""
        return await self._with_api(
            controller, lambda api: self._tenancy(api, cluster, accounts, previous)[0], timeout_s
        )

    async def tenancy_apply(
        self,
        ssh: SshClient,
        controller: Target,
        nodes: list[Target],
        cluster: str,
        accounts: list[AccountSpec],
        timeout_s: float = 60,
        previous: list[AccountSpec] | None = None,
        uids: Mapping[str, int] | None = None,
    ) -> TenancyPlan:
        """The plan's changes in order (members are Kubernetes users by name: no Unix users needed)."""

        def run(api: Api) -> TenancyPlan:
            plan, steps = self._tenancy(api, cluster, accounts, previous)
            for change, o in steps:
                assert o is not None
                if change.action == "add":
                    api.create_obj(o.kind, o.namespace, o.body)
                elif change.action == "modify":
                    live = api.read_obj(o.kind, o.namespace, o.name) or {}
                    if o.kind == "RoleBinding" and live.get("roleRef") != o.body["roleRef"]:
                        api.delete_obj(o.kind, o.namespace, o.name)  # roleRef cannot change in place
                        api.create_obj(o.kind, o.namespace, o.body)
                        continue
                    body = {**live, **o.content}
                    body["metadata"] = {
                        **live.get("metadata", {}),
                        "labels": {**(live.get("metadata", {}).get("labels") or {}), **k8t.LABELS},
                    }
                    api.replace_obj(o.kind, o.namespace, o.name, body)
                else:
                    api.delete_obj(o.kind, o.namespace, o.name)
            plan.applied = True
            return plan

        return await self._with_api(controller, run, timeout_s)

    async def usage(
        self, ssh: SshClient, controller: Target, accounts: list[str], timeout_s: float = 30
    ) -> dict[str, AccountUsage]:
        """Per project: the GPUs its ClusterQueue has reserved for admitted workloads, and the GPUs its
        pending workloads ask for."""

        def run(api: Api) -> dict[str, AccountUsage]:
            out: dict[str, AccountUsage] = {}
            for name in accounts:
                cq = api.read_obj("ClusterQueue", None, name)
                if cq is None:
                    continue
                used = sum(
                    int(r.get("total") or 0)
                    for f in (cq.get("status") or {}).get("flavorsReservation") or []
                    for r in f.get("resources") or []
                    if r.get("name") == k8s.GPU_RESOURCE
                )
                weight = ((cq.get("spec") or {}).get("fairSharing") or {}).get("weight")
                out[name] = AccountUsage(
                    name,
                    raw_shares=int(str(weight)) if str(weight).isdigit() else None,
                    gpus_running=used,
                    gpus_pending=_pending_gpus(api, name),
                )
            return out

        return await self._with_api(controller, run, timeout_s)

    async def node_usage(self, ssh: SshClient, controller: Target, timeout_s: float = 30) -> list[NodeUsage]:
        """The running pods of every namespace: a project's namespace is its tenant (``k8t.pod_usage``)."""

        def run(api: Api) -> list[NodeUsage]:
            pods: Any = api.call(
                "list pods", api.core.list_pod_for_all_namespaces, field_selector="status.phase=Running"
            )
            return k8t.pod_usage(api.api.sanitize_for_serialization(p) for p in pods.items)

        return await self._with_api(controller, run, timeout_s)

    def drain_reason(self, reason: str | None) -> str:
        return k8s.clean_reason(reason)

    def drained_by_bcm(self, state: WlmNodeState) -> bool:
        return (state.reason or "").startswith(k8s.REASON_PREFIX)

    def is_drained(self, state: WlmNodeState) -> bool:
        return "schedulingdisabled" in state.state or self.drained_by_bcm(state)

    def is_responding(self, state: WlmNodeState | None) -> bool:
        return state is not None and state.state.startswith("ready")


def _matches(o: k8t.Obj, live: dict[str, Any]) -> bool:
    have = dict(live)
    if o.kind == "RoleBinding":
        have.setdefault("subjects", [])
    return holds(o.content, have)


def _pending_gpus(api: Api, namespace: str) -> int:
    got: Any = api.call(
        "list workloads",
        api.custom.list_namespaced_custom_object,
        KUEUE_GROUP,
        KUEUE_VERSION,
        namespace,
        "workloads",
    )
    total = 0
    for wl in got.get("items", []):
        conds = {c["type"]: c["status"] for c in (wl.get("status") or {}).get("conditions") or []}
        if conds.get("QuotaReserved") == "True" or conds.get("Finished") == "True":
            continue
        for ps in (wl.get("spec") or {}).get("podSets") or []:
            for c in ((ps.get("template") or {}).get("spec") or {}).get("containers") or []:
                res = c.get("resources") or {}
                want = (res.get("limits") or {}).get(k8s.GPU_RESOURCE) or (res.get("requests") or {}).get(
                    k8s.GPU_RESOURCE
                )
                total += int(ps.get("count") or 1) * int(str(want or 0))
    return total


def apply_drain(node: Any, reason: str) -> bool:
    """bcm's taint and reason; the cordon marked as bcm's only when bcm is the one who set it."""
    from kubernetes.client import V1Taint

    notes = dict(node.metadata.annotations or {})
    taints = list(node.spec.taints or [])
    changed = False
    if not any(t.key == k8s.TAINT_KEY for t in taints):
        taints.append(V1Taint(key=k8s.TAINT_KEY, value="true", effect="NoSchedule"))
        node.spec.taints = taints
        changed = True
    if not node.spec.unschedulable:
        node.spec.unschedulable = True
        notes[k8s.CORDON_ANNOTATION] = "true"
        changed = True
    if notes.get(k8s.REASON_ANNOTATION) != reason:
        notes[k8s.REASON_ANNOTATION] = reason
        changed = True
    node.metadata.annotations = notes  # the client's models copy what they are given
    return changed


def lift_drain(node: Any) -> bool:
    """Remove bcm's taint and reason; lift the cordon only if bcm set it (an admin's stays)."""
    notes = dict(node.metadata.annotations or {})
    taints = list(node.spec.taints or [])
    keep = [t for t in taints if t.key != k8s.TAINT_KEY]
    changed = len(keep) != len(taints)
    node.spec.taints = keep or None
    if notes.pop(k8s.CORDON_ANNOTATION, None) == "true":
        node.spec.unschedulable = None
        changed = True
    if notes.pop(k8s.REASON_ANNOTATION, None) is not None:
        changed = True
    node.metadata.annotations = notes
    return changed
