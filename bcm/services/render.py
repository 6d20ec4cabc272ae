"""The one jinja2 environment for every template bcm renders (dnsmasq, iPXE, Slurm, Kubernetes).

Templates live under ``templates/`` at the path of the file they become (``slurm/etc/slurm/slurm.conf.j2``).
They are found, in order: ``$BCM_TEMPLATES_DIR``; bcm's own, package data (:mod:`bcm.resources`).
StrictUndefined: a missing value is an error at
render time, never an empty string in a config file.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2

from bcm import resources
from bcm.errors import BcmError


def template_dirs() -> list[Path]:
    candidates = []
    if os.environ.get("BCM_TEMPLATES_DIR"):
        candidates.append(Path(os.environ["BCM_TEMPLATES_DIR"]))
    candidates.append(resources.templates_dir())
    return [c for c in candidates if c.is_dir()]


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    dirs = template_dirs()
    if not dirs:
        raise BcmError("no templates directory found (set BCM_TEMPLATES_DIR to a templates/ directory)")
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(d) for d in dirs]),
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # noqa: S701 - config files, not HTML
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(name: str, **context: Any) -> str:
    """Render ``templates/<name>``; a missing variable raises BcmError naming the template."""
    try:
        return environment().get_template(name).render(**context)
    except jinja2.UndefinedError as exc:
        raise BcmError(f"template {name}: {exc.message}") from exc
    except jinja2.TemplateNotFound as exc:
        raise BcmError(f"template {name} not found in {', '.join(map(str, template_dirs()))}") from exc
