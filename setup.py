"""The one thing pyproject.toml cannot say: the packages are those found under bcm/ and cli/ *plus* bcm's
run-time data, which lives in the top-level templates/, ansible/ and images/ and ships as the packages
that ``[tool.setuptools.package-dir]`` maps them to (bcm.resources finds them there)."""

from setuptools import find_namespace_packages, setup

DATA_PACKAGES = ["bcm._data.templates", "bcm._data.ansible", "bcm._data.images"]

setup(packages=[*find_namespace_packages(include=["bcm*", "cli*"]), *DATA_PACKAGES])
