"""Image recipes: the shipped ones load, chains and layer keys behave, broken files fail in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from bcm.domain.image_recipe import (
    DEFAULT_PUSH_EXCLUDE,
    Recipe,
    RecipeFile,
    chain,
    layer_keys,
    load_recipes,
    push_excludes,
)
from bcm.errors import InvalidInput

IMAGES = Path(__file__).resolve().parents[2] / "images"
BASE = "name: base\nmirrors: ['deb http://deb.debian.org/debian bookworm main']\npackages: [openssh-server]\n"


def write(directory: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


def test_every_shipped_recipe_loads() -> None:
    recipes = load_recipes(IMAGES)
    assert {"base", "nvidia-driver", "cuda-toolkit", "slurm-node", "lab"} <= set(recipes)
    for name in recipes:
        assert chain(recipes, name)[0].name == "base"
    assert [r.name for r in chain(recipes, "cuda-toolkit")] == ["base", "nvidia-driver", "cuda-toolkit"]
    base = recipes["base"]
    assert base.parent is None and base.variant == "minbase"
    assert {"linux-image-amd64", "openssh-server", "python3", "dmidecode", "pciutils"} <= set(base.packages)


def test_lab_recipe_carries_what_the_lab_rootfs_has() -> None:
    from bcm.lab.rootfs import PACKAGES

    recipes = load_recipes(IMAGES)
    assert set(PACKAGES) <= set(recipes["base"].packages) | set(recipes["lab"].packages)


def test_every_image_with_slurmd_and_systemd_has_the_system_bus() -> None:
    # measured on a PXE-booted VM: without dbus, slurmd's cgroup/v2 plugin cannot make its scope and
    # slurmd exits ("cannot connect to dbus system daemon … slurmd initialization failed")
    recipes = load_recipes(IMAGES)
    for name in recipes:
        packages = {p for r in chain(recipes, name) for p in r.packages}
        if "slurmd" in packages and "systemd" in packages:
            assert "dbus" in packages, name


def test_layer_keys_change_from_the_changed_layer_up() -> None:
    recipes = load_recipes(IMAGES)
    layers = chain(recipes, "cuda-toolkit")
    keys = layer_keys(layers)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert all(len(k) == 64 for k in keys)
    assert layer_keys(layers) == keys  # deterministic

    top = layers[-1].model_copy(update={"packages": ["nvidia-cuda-toolkit", "nvidia-cuda-dev"]})
    changed_top = layer_keys([*layers[:-1], top])
    assert changed_top[:2] == keys[:2] and changed_top[2] != keys[2]

    base = layers[0].model_copy(update={"packages": [*layers[0].packages, "less"]})
    changed_base = layer_keys([base, *layers[1:]])
    assert all(a != b for a, b in zip(changed_base, keys, strict=True))


def test_layer_key_ignores_yaml_formatting(tmp_path: Path) -> None:
    write(tmp_path, {"base.yaml": BASE})
    one = layer_keys(chain(load_recipes(tmp_path), "base"))
    write(tmp_path, {"base.yaml": "# a comment\n" + BASE.replace("name: base", "name:   base")})
    assert layer_keys(chain(load_recipes(tmp_path), "base")) == one


def test_push_excludes_defaults_then_layers_without_repeats() -> None:
    base = Recipe(name="base", push_exclude=["/etc/hostname", "/srv/scratch/"])
    top = Recipe(name="top", parent="base", push_exclude=["/srv/scratch/", "/etc/munge/munge.key"])
    assert push_excludes([base, top]) == [*DEFAULT_PUSH_EXCLUDE, "/srv/scratch/", "/etc/munge/munge.key"]


def test_chain_of_unknown_recipe() -> None:
    with pytest.raises(InvalidInput) as info:
        chain(load_recipes(IMAGES), "no-such-image")
    assert info.value.field == "recipe"
    assert "no-such-image" in info.value.message


def test_file_mode_accepts_octal_spellings() -> None:
    assert RecipeFile(path="/a", content="", mode="0755").mode == 0o755  # type: ignore[arg-type]
    assert RecipeFile(path="/a", content="", mode="0o600").mode == 0o600  # type: ignore[arg-type]
    assert RecipeFile(path="/a", content="").mode == 0o644


BROKEN = [
    # (file text, field, words the one line must hold)
    (
        "name: base\nvariant: huge\n",
        "variant",
        ["'huge' is not one of minbase, apt, required, important, standard"],
    ),
    ("name: base\nsuite: trixie\n", "suite", ["'trixie' is not one of bookworm"]),
    ("name: base\ncolour: blue\n", "colour", ["unknown field", "packages"]),
    ("description: no name\n", "name", ["required"]),
    ("name: Base_Image\n", "name", ["RFC 1123"]),
    ("name: base\npackages: [openssh-server, Bad_Name]\n", "packages", ["'Bad_Name'", "Debian package name"]),
    ("name: base\ndrop_packages: ['gcc;rm']\n", "drop_packages", ["Debian package name"]),
    ("name: base\nfiles: [{path: etc/motd, content: hi}]\n", "files.0.path", ["absolute"]),
    ("name: base\nfiles: [{path: /etc/../../x, content: hi}]\n", "files.0.path", ["absolute"]),
    ("name: base\nfiles: [{path: /etc/motd}]\n", "files.0.content", ["required"]),
    ("name: base\nfiles: [{path: /etc/motd, content: hi, mode: '9x'}]\n", "files.0.mode", ["octal"]),
    ("name: base\nmirrors: ['http://deb.debian.org/debian']\n", "mirrors", ["sources.list line"]),
    ("name: base\npush_exclude: [var/log]\n", "push_exclude", ["absolute"]),
    ("name: base\npost: ['']\n", "post", ["empty command"]),
    ("name: base\npackages: openssh-server\n", "packages", ["list"]),
    ("- just\n- a list\n", "recipe", ["mapping"]),
    ("name: base\npackages: [a, b\n", "recipe", ["not valid YAML", "line"]),
    ("name: other\n", "name", ["'other'", "file name 'base'"]),
]


@pytest.mark.parametrize(
    ("text", "field", "words"), BROKEN, ids=[row[1] + ":" + row[0][:30] for row in BROKEN]
)
def test_broken_recipe_fails_in_one_line(tmp_path: Path, text: str, field: str, words: list[str]) -> None:
    write(tmp_path, {"base.yaml": text})
    with pytest.raises(InvalidInput) as info:
        load_recipes(tmp_path)
    message = info.value.message
    assert "\n" not in message
    prefix = f"{tmp_path / 'base.yaml'}: " + ("" if field == "recipe" else f"{field}: ")  # whole-file errors
    assert message.startswith(prefix)
    assert info.value.field == field
    for word in words:
        assert word in message


def test_layer_may_not_choose_variant(tmp_path: Path) -> None:
    write(tmp_path, {"base.yaml": BASE, "top.yaml": "name: top\nparent: base\nvariant: standard\n"})
    with pytest.raises(InvalidInput, match=r"top\.yaml: variant: only a base") as info:
        load_recipes(tmp_path)
    assert info.value.field == "variant"


def test_unknown_parent(tmp_path: Path) -> None:
    write(tmp_path, {"base.yaml": BASE, "top.yaml": "name: top\nparent: nowhere\n"})
    with pytest.raises(InvalidInput, match=r"top\.yaml: parent: unknown recipe 'nowhere'") as info:
        load_recipes(tmp_path)
    assert info.value.field == "parent"


def test_parent_cycle(tmp_path: Path) -> None:
    write(tmp_path, {"a.yaml": "name: a\nparent: b\n", "b.yaml": "name: b\nparent: a\n"})
    with pytest.raises(InvalidInput, match=r"a\.yaml: parent: a cycle \(a -> b -> a\)") as info:
        load_recipes(tmp_path)
    assert info.value.field == "parent"


def test_chain_guards_against_cycles_built_by_hand() -> None:
    recipes = {"a": Recipe(name="a", parent="b"), "b": Recipe(name="b", parent="a")}
    with pytest.raises(InvalidInput, match="cycle"):
        chain(recipes, "a")


def test_recipe_forbids_unknown_fields() -> None:
    with pytest.raises(ValueError):
        Recipe.model_validate({"name": "x", "colour": "blue"})
