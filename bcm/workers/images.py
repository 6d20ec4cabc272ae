"""Image builds as operations: recipe chain → cached layers → artifacts → verify → publish atomically.

``bcm image build gpu`` starts one Operation (no node locks: a build touches no node). The builder runs
in a worker thread; its output lines are appended to the operation's log every half second, so
``bcm op show --follow`` streams them, and its progress moves the operation's bar (0..100).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import threading
from pathlib import Path

import anyio
from sqlmodel import Session

from bcm.db import session_scope
from bcm.domain import image_recipe
from bcm.drivers import imagebuild, offload
from bcm.errors import BcmError
from bcm.models.image import ImageState
from bcm.models.operation import Operation
from bcm.services import images as svc
from bcm.services import operations as op_svc
from bcm.settings import Settings
from bcm.workers.job import Handler, Job, Starter

log = logging.getLogger("bcm.images")
FLUSH_EVERY_S = 0.5
PROGRESS_STEPS = 100
MAX_LOG_CHARS = 1_000_000  # an operation's log keeps the first and last of a very long build


def load_chain(settings: Settings, recipe: str) -> list[image_recipe.Recipe]:
    """The recipe and its parents, base first; a broken or unknown recipe is a 422 before anything starts."""
    recipes = image_recipe.load_recipes(settings.images.recipes_dir)
    return image_recipe.chain(recipes, recipe)


async def start(runner: Starter, recipe: str, version: str | None, actor: str) -> tuple[str, str, int]:
    """Check the recipe, record the image row, start the build operation: (name, version, op id)."""
    settings = runner.settings
    await anyio.to_thread.run_sync(load_chain, settings, recipe)  # a broken recipe is a 422 here

    def begin() -> tuple[int, str]:
        with session_scope(runner.engine) as s:
            image = svc.begin_build(s, recipe, version, actor)
            assert image.id is not None
            return image.id, image.version

    image_id, ver = await anyio.to_thread.run_sync(begin)

    spec = {"image_id": image_id, "recipe": recipe}
    op_id = await runner.submit("image-build", [], actor, f"{recipe} version {ver}", spec=spec)

    def link() -> None:
        with session_scope(runner.engine) as s:
            image = s.get(svc.Image, image_id)
            if image is not None:
                image.operation_id = op_id
                s.add(image)

    await anyio.to_thread.run_sync(link)
    return recipe, ver, op_id


async def _run(job: Job) -> None:
    chain = await anyio.to_thread.run_sync(load_chain, job.settings, job.spec["recipe"])
    await build_job(job, job.op_id, int(job.spec["image_id"]), chain)


def _failed(s: Session, op: Operation, settings: Settings, why: str) -> None:
    """A build that failed, was cancelled or lost its server: the image fails, its staging goes."""
    image = s.get(svc.Image, int((op.spec or {}).get("image_id", 0)))
    if image is not None and image.state == ImageState.BUILDING and op.id is not None:
        svc.fail(s, image, why, svc.staging_dir(settings.images_dir, image.name, image.version, op.id))


def _build_timeout(settings: Settings, _n: int) -> float:
    return settings.images.build_timeout_s


# a build runs in one worker thread that cannot be taken up elsewhere: a lost one fails its image
HANDLER = Handler(_run, timeout=_build_timeout, on_error=_failed, resumable=False)


async def build_job(runner: Job, op_id: int, image_id: int, chain: list[image_recipe.Recipe]) -> None:
    settings = runner.settings
    lines: list[str] = []
    state = {"progress": 0.0}
    lock = threading.Lock()

    def on_line(line: str) -> None:
        with lock:
            lines.append(line.rstrip("\n") + "\n")

    def on_progress(fraction: float) -> None:
        state["progress"] = min(1.0, max(0.0, fraction))

    def load() -> tuple[str, str]:
        with session_scope(runner.engine) as s:
            image = s.get(svc.Image, image_id)
            assert image is not None
            op = op_svc.get(s, op_id)
            op_svc.start(s, op)
            op.progress_total = PROGRESS_STEPS
            s.add(op)
            return image.name, image.version

    name, version = await anyio.to_thread.run_sync(load)
    staging = svc.staging_dir(settings.images_dir, name, version, op_id)

    def flush() -> None:
        with lock:
            text, lines[:] = "".join(lines), []
        with session_scope(runner.engine) as s:
            op = op_svc.get(s, op_id)
            op_svc.fence(s, op)
            if text:
                op.log = _bounded(op.log + text)
            op.progress_done = int(state["progress"] * PROGRESS_STEPS)
            s.add(op)

    async def flusher() -> None:
        while True:  # ends when the build ends (cancelled below)
            await asyncio.sleep(FLUSH_EVERY_S)
            await anyio.to_thread.run_sync(flush)

    def run_build() -> imagebuild.BuildResult:
        if staging.exists():
            shutil.rmtree(staging)
        staging.parent.mkdir(parents=True, exist_ok=True)
        result = imagebuild.build(
            chain,
            settings.images.cache_dir,
            staging,
            on_line,
            on_progress,
            timeout_s=settings.images.build_timeout_s,
        )
        on_line("verifying artifacts")
        imagebuild.verify(staging, result.artifacts)
        return result

    def publish(result: imagebuild.BuildResult) -> None:
        with session_scope(runner.engine) as s:
            op = op_svc.get(s, op_id)
            op_svc.fence(s, op)  # a cancelled or lost build publishes nothing
            image = s.get(svc.Image, image_id)
            assert image is not None
            final = svc.publish(
                s,
                image,
                staging,
                settings.images_dir,
                result.artifacts,
                result.manifest,
                settings.images.keep_versions,
            )
            op.progress_done = PROGRESS_STEPS
            op.log = _bounded(op.log + f"published {name} version {version} in {final}; it is current\n")
            op_svc.finish(s, op)

    def failed(error: str) -> None:
        with session_scope(runner.engine) as s:
            image = s.get(svc.Image, image_id)
            if image is not None and image.state == ImageState.BUILDING:
                svc.fail(s, image, error, staging)
            op = op_svc.get(s, op_id)
            if not op_svc.is_finished(op):
                op_svc.finish(s, op, error[-4000:])

    task = asyncio.create_task(flusher())
    try:
        try:
            result = await offload.run("image", run_build, abandon_on_cancel=True)  # not a request thread
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await anyio.to_thread.run_sync(flush)
        await anyio.to_thread.run_sync(publish, result)
    except BcmError as exc:
        log.warning("image build %s:%s failed: %s", name, version, exc.message.splitlines()[-1:] or "")
        await anyio.to_thread.run_sync(failed, exc.message)
    except asyncio.CancelledError:
        _mark_interrupted(runner, image_id, staging)
        raise
    except Exception as exc:  # a builder bug still fails the image, never leaves it building
        await anyio.to_thread.run_sync(failed, f"{type(exc).__name__}: {exc}")
        raise


def _mark_interrupted(runner: Job, image_id: int, staging: Path) -> None:
    try:
        with session_scope(runner.engine) as s:
            image = s.get(svc.Image, image_id)
            if image is not None and image.state == ImageState.BUILDING:
                svc.fail(s, image, "interrupted: the server stopped or the build was cancelled", staging)
    except Exception as exc:  # the database may be gone too
        log.warning("could not mark image %s interrupted: %s", image_id, type(exc).__name__)


def _bounded(text: str) -> str:
    if len(text) <= MAX_LOG_CHARS:
        return text
    half = MAX_LOG_CHARS // 2
    return text[:half] + "\n[… log cut …]\n" + text[-half:]
