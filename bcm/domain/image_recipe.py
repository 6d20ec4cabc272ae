"""Image recipes: named layers of a Debian root filesystem, each on top of its parent.

A recipe file ``images/<name>.yaml`` holds one :class:`Recipe`. A base (no ``parent``) is made by
mmdebstrap from ``suite``, ``variant`` and ``mirrors``; a layer adds mirrors, packages, files and
commands on top of its parent's tree. :func:`chain` walks from the base to a recipe, and
:func:`layer_keys` names each layer by its content, so a changed layer rebuilds itself and the layers
above it and nothing below. Pure: no I/O except reading the YAML files in :func:`load_recipes`.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from bcm.errors import InvalidInput

# Bump when bcm/drivers/imagebuild.py changes what a layer's tree holds, so old caches are not reused.
BUILDER_VERSION = "1"

DEFAULT_PUSH_EXCLUDE: tuple[str, ...] = (
    "/etc/hostname",
    "/etc/machine-id",
    "/etc/ssh/ssh_host_*",
    "/etc/bcm/",
    "/var/log/",
    "/var/lib/slurm*",
    "/var/spool/",
    "/tmp/",
    "/home/",
    "/root/.ssh/",  # the server's key in authorized_keys: a push must never lock bcm out of its node
    # the workload manager's files come from its deploy (slurm.conf, gres.conf, the munge key), not images
    "/etc/slurm/",
    "/etc/munge/",
)

_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# Debian policy 5.6.1: lower case letters, digits, + - . ; at least two characters, starting alphanumeric.
_DEBIAN_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")
# deb [options] URI suite [component ...]
_SOURCES_LINE = re.compile(r"^deb(-src)?\s+(\[[^\]]*\]\s+)?[a-z][a-z0-9+.-]*://\S+\s+\S+(\s+\S+)*$")


def _absolute_path(value: str) -> str:
    if not value.startswith("/") or ".." in value.split("/") or "\0" in value:
        raise ValueError(f"{value!r} is not an absolute path inside the image (starts with /, no ..)")
    return value


class RecipeFile(BaseModel):
    """One file written into the image: absolute path, text content, permission bits."""

    model_config = ConfigDict(extra="forbid")

    path: str
    content: str
    mode: int = 0o644

    @field_validator("path")
    @classmethod
    def _path_is_absolute(cls, value: str) -> str:
        _absolute_path(value)
        if value.endswith("/"):
            raise ValueError(f"{value!r} names a directory, not a file")
        return posixpath.normpath(value)

    @field_validator("mode", mode="before")
    @classmethod
    def _mode_octal(cls, value: Any) -> Any:
        # YAML 1.1 reads 0644 as octal already; "0o755" and "755" arrive as strings.
        if isinstance(value, str):
            text = value.strip().lower().removeprefix("0o")
            if not re.fullmatch(r"[0-7]{1,4}", text):
                raise ValueError(f"{value!r} is not an octal mode such as 0644")
            return int(text, 8)
        return value

    @field_validator("mode")
    @classmethod
    def _mode_range(cls, value: int) -> int:
        if not 0 <= value <= 0o7777:
            raise ValueError(f"{value:o} is not a mode between 0000 and 7777 (octal)")
        return value


class Recipe(BaseModel):
    """One image layer (a base when ``parent`` is None)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    parent: str | None = None
    suite: Literal["bookworm"] = "bookworm"
    variant: Literal["minbase", "apt", "required", "important", "standard"] = "minbase"
    mirrors: list[str] = []
    packages: list[str] = []
    # this checkout's bcm agent (a zipapp, /opt/bcm/bcm-agent.pyz): the node starts it at boot with the token
    # its callback traded (bcm-agent.service in the overlay), and it sends the node's facts at once
    agent: bool = False
    files: list[RecipeFile] = []
    post: list[str] = []
    push_exclude: list[str] = []
    drop_packages: list[str] = []

    @field_validator("name", "parent")
    @classmethod
    def _label(cls, value: str | None) -> str | None:
        if value is not None and not _LABEL.fullmatch(value):
            raise ValueError(f"{value!r} is not a lower-case RFC 1123 label (a-z, 0-9, -; at most 63)")
        return value

    @field_validator("packages", "drop_packages")
    @classmethod
    def _debian_names(cls, values: list[str]) -> list[str]:
        for value in values:
            if not _DEBIAN_PACKAGE.fullmatch(value):
                raise ValueError(f"{value!r} is not a Debian package name (a-z, 0-9, + - .)")
        return values

    @field_validator("mirrors")
    @classmethod
    def _sources_lines(cls, values: list[str]) -> list[str]:
        for value in values:
            if not _SOURCES_LINE.fullmatch(value.strip()):
                raise ValueError(
                    f"{value!r} is not a sources.list line such as 'deb http://... bookworm main'"
                )
        return [value.strip() for value in values]

    @field_validator("post")
    @classmethod
    def _commands(cls, values: list[str]) -> list[str]:
        if any(not value.strip() for value in values):
            raise ValueError("an empty command")
        return values

    @field_validator("push_exclude")
    @classmethod
    def _exclude_paths(cls, values: list[str]) -> list[str]:
        return [_absolute_path(value) for value in values]


def _allowed_values(error: Any) -> list[str]:
    expected = (error.get("ctx") or {}).get("expected", "")
    return re.findall(r"'([^']*)'", str(expected))


def _one_line(path: Path, exc: ValidationError) -> InvalidInput:
    errors = exc.errors()
    first = errors[0]
    loc = ".".join(str(part) for part in first["loc"]) or "recipe"
    if first["type"] == "literal_error":
        text = f"{first['input']!r} is not one of {', '.join(_allowed_values(first))}"
    elif first["type"] == "extra_forbidden":
        text = f"unknown field (allowed: {', '.join(Recipe.model_fields)})"
    elif first["type"] == "missing":
        text = "required"
    else:
        text = str(first["msg"]).removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return InvalidInput(f"{path}: {loc}: {text}{more}", field=loc)


def parse_recipe(path: Path, text: str) -> Recipe:
    """One recipe from a file's text; a problem raises a one-line InvalidInput naming file and field."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise InvalidInput(f"{path}: not valid YAML{where}: {problem}", field="recipe") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}: expected a mapping of recipe fields", field="recipe")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise _one_line(path, exc) from None
    if recipe.parent is not None:
        for field in ("suite", "variant"):
            if field in recipe.model_fields_set:
                raise InvalidInput(
                    f"{path}: {field}: only a base (no parent) chooses the {field}", field=field
                )
    if recipe.name != path.stem:
        raise InvalidInput(
            f"{path}: name: {recipe.name!r} must equal the file name {path.stem!r}", field="name"
        )
    return recipe


def load_recipes(directory: Path) -> dict[str, Recipe]:
    """Every ``*.yaml`` recipe in ``directory``, checked: parents known, no cycles, names = file stems."""
    recipes: dict[str, Recipe] = {}
    paths: dict[str, Path] = {}
    for path in sorted(directory.glob("*.yaml")):
        recipe = parse_recipe(path, path.read_text())
        recipes[recipe.name] = recipe
        paths[recipe.name] = path
    for name, recipe in recipes.items():
        if recipe.parent is not None and recipe.parent not in recipes:
            raise InvalidInput(
                f"{paths[name]}: parent: unknown recipe {recipe.parent!r} (known: {', '.join(sorted(recipes))})",
                field="parent",
            )
        seen = [name]
        parent = recipe.parent
        while parent is not None:
            if parent in seen:
                cycle = " -> ".join([*seen, parent])
                raise InvalidInput(f"{paths[name]}: parent: a cycle ({cycle})", field="parent")
            seen.append(parent)
            parent = recipes[parent].parent
    return recipes


def chain(recipes: dict[str, Recipe], name: str) -> list[Recipe]:
    """The recipes from the base to ``name``: base first, ``name`` last."""
    if name not in recipes:
        known = ", ".join(sorted(recipes)) or "none"
        raise InvalidInput(f"unknown image recipe {name!r} (known: {known})", field="recipe")
    layers: list[Recipe] = []
    current: str | None = name
    while current is not None:
        if current not in recipes:
            raise InvalidInput(f"recipe {layers[-1].name!r}: unknown parent {current!r}", field="parent")
        if any(layer.name == current for layer in layers):
            raise InvalidInput(f"recipe {name!r}: a parent cycle through {current!r}", field="parent")
        layers.append(recipes[current])
        current = recipes[current].parent
    layers.reverse()
    return layers


def canonical_json(recipe: Recipe) -> str:
    """The recipe as canonical JSON (sorted keys, no spaces): what its layer key hashes. ``agent`` counts
    only where it is set, with the agent's own bytes (a new agent is a new layer); recipes without it keep
    the keys they had before the field existed (their cached layers stay valid)."""
    data = recipe.model_dump(mode="json", exclude=set() if recipe.agent else {"agent"})
    if recipe.agent:
        from bcm.agent.bundle import build_bundle

        data["agent"] = hashlib.sha256(build_bundle(include_pynvml=False)).hexdigest()
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def layer_keys(layers: list[Recipe]) -> list[str]:
    """Content keys, one per layer: each hashes its parent's key, its own recipe and BUILDER_VERSION."""
    keys: list[str] = []
    previous = ""
    for recipe in layers:
        previous = hashlib.sha256((previous + canonical_json(recipe) + BUILDER_VERSION).encode()).hexdigest()
        keys.append(previous)
    return keys


def push_excludes(layers: list[Recipe]) -> list[str]:
    """Paths an image push must never touch: the defaults, then every layer's own, without repeats."""
    result: list[str] = []
    for path in [*DEFAULT_PUSH_EXCLUDE, *(p for recipe in layers for p in recipe.push_exclude)]:
        if path not in result:
            result.append(path)
    return result
