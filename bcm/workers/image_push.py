"""``bcm image push IMAGE NODES`` as an Operation of kind ``image-push``.

The work engine takes the node locks under the operation's lease and releases them at its end; each node's result is recorded as it
finishes (status, files changed, a sample of rsync's itemized lines, bytes). A dry run (the default)
changes nothing on the nodes; ``apply`` writes, and each node it reached gets an ``image.push`` event
and ``{"image", "version"}`` in its result.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import anyio

from bcm.db import session_scope
from bcm.domain import image_recipe
from bcm.drivers import offload, sync
from bcm.errors import FatalDriverError
from bcm.services import image_push as svc
from bcm.services import operations as op_svc
from bcm.settings import Settings
from bcm.workers.images import load_chain
from bcm.workers.job import Handler, Job, Starter

LOCK_MARGIN_S = 300.0  # unpacking a squashfs before the first node starts


def concurrency(settings: Settings) -> int:
    return max(1, min(settings.ssh.concurrency, sync.DEFAULT_CONCURRENCY))


def operation_timeout_s(settings: Settings, nodes: int) -> float:
    rounds = max(1, math.ceil(nodes / concurrency(settings)))
    return rounds * sync.DEFAULT_TIMEOUT_S + sync.UNPACK_TIMEOUT_S + LOCK_MARGIN_S


async def start(
    runner: Starter, name: str, names: list[str], version: str | None, apply: bool, actor: str
) -> tuple[str, int]:
    """Check the version and its recipe chain, then start the push: (version, operation id)."""
    settings = runner.settings

    def check() -> svc.PushSource:
        with session_scope(runner.engine) as s:
            image = svc.ready_version(s, name, version)
            return svc.source_of(s, image, settings.images.cache_dir, settings.images_dir)

    source = await anyio.to_thread.run_sync(check)
    # the excludes come from the recipe chain; a recipe that no longer loads stops the push here (422)
    chain = await anyio.to_thread.run_sync(load_chain, settings, source.recipe)
    image_recipe.push_excludes(chain)
    mode = "apply" if apply else "dry run"

    spec = {"image": source.name, "version": source.version, "apply": apply}
    op_id = await runner.submit(
        "image-push", names, actor, f"{source.name}:{source.version} ({mode})", spec=spec
    )
    return source.version, op_id


async def _run(job: Job) -> None:
    """The ``image-push`` operation (resumable: rsync is idempotent, a reclaimed push goes on with the
    nodes that have no result)."""
    settings = job.settings

    def check() -> svc.PushSource:
        with session_scope(job.engine) as s:
            image = svc.ready_version(s, job.spec["image"], job.spec["version"])
            return svc.source_of(s, image, settings.images.cache_dir, settings.images_dir)

    source = await anyio.to_thread.run_sync(check)
    chain = await anyio.to_thread.run_sync(load_chain, settings, source.recipe)
    await push_job(
        job,
        job.op_id,
        job.names,
        source,
        image_recipe.push_excludes(chain),
        bool(job.spec["apply"]),
        job.actor,
    )


HANDLER = Handler(_run, timeout=operation_timeout_s)


def _tree(source: svc.PushSource, settings: Settings) -> Path:
    if source.layer_tree is not None and source.layer_tree.is_dir():
        return source.layer_tree
    if source.squashfs is None or source.squashfs_sha256 is None:
        raise FatalDriverError(
            f"image {source.name}:{source.version} has no cached tree and no rootfs artifact"
        )
    return sync.unpack_squashfs(source.squashfs, source.squashfs_sha256, settings.images.cache_dir)


def _line(name: str, entry: dict[str, Any]) -> str:
    if entry["status"] == "ok":
        return f"{name}: ok, {entry.get('changed', 0)} change(s)\n"
    return f"{name}: {entry['status']}: {entry.get('message', '')}\n"


async def push_job(
    runner: Job,
    op_id: int,
    names: list[str],
    source: svc.PushSource,
    excludes: list[str],
    apply: bool,
    actor: str,
) -> None:
    settings = runner.settings
    engine = runner.engine
    targets, refused = await anyio.to_thread.run_sync(svc.targets, engine, names, settings.ssh.port)

    def begin() -> None:
        with session_scope(engine) as s:
            op = op_svc.get(s, op_id)
            op_svc.start(s, op)
            mode = "apply" if apply else "dry run: nothing on the nodes changes"
            log = f"push {source.name}:{source.version} ({mode}); excluded: {' '.join(excludes)}\n"
            op_svc.add_results(s, op, refused, log + "".join(_line(n, r) for n, r in refused.items()))

    await anyio.to_thread.run_sync(begin)
    if targets:
        await _push(runner, op_id, targets, source, excludes, apply, actor)

    def finish() -> None:
        with session_scope(engine) as s:
            op_svc.finish(s, op_svc.get(s, op_id))

    await anyio.to_thread.run_sync(finish)


async def _push(
    runner: Job,
    op_id: int,
    targets: list[sync.PushTarget],
    source: svc.PushSource,
    excludes: list[str],
    apply: bool,
    actor: str,
) -> None:
    settings = runner.settings
    engine = runner.engine
    tree = await offload.run("image", _tree, source, settings)  # not a request thread

    def record(result: sync.PushResult) -> None:
        entry = result.as_dict()
        entry.pop("name")
        entry["dry_run"] = not apply
        with session_scope(engine) as s:
            if apply and result.ok:
                entry.update(image=source.name, version=source.version)
                svc.record_pushed(s, actor, source.name, source.version, [result.name])
            op_svc.add_results(s, op_svc.get(s, op_id), {result.name: entry}, _line(result.name, entry))

    async def on_result(result: sync.PushResult) -> None:
        await anyio.to_thread.run_sync(record, result)

    await sync.push(
        tree,
        targets,
        excludes,
        key_file=settings.ssh_key_file,
        dry_run=not apply,
        username=settings.ssh.username,
        connect_timeout_s=settings.ssh.connect_timeout_s,
        timeout_s=sync.DEFAULT_TIMEOUT_S,
        concurrency=concurrency(settings),
        on_result=on_result,
    )
