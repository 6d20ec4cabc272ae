"""Pack the agent into one self-contained zipapp that runs on a node with nothing but python3.

The archive holds the agent's stdlib-only modules, ``bcm/__init__.py`` for the version, and pynvml (one
pure-Python file from nvidia-ml-py) so the real NVML path works without pip on the node::

    python3 bcm-agent.pyz --once
"""

from __future__ import annotations

import importlib.util
import io
import zipfile
from pathlib import Path

AGENT_MODULES = ("__init__", "collector", "facts", "fake_nvml", "main", "nvml", "reporter", "schema")
SHEBANG = b"#!/usr/bin/env python3\n"
_MAIN = "import sys\nfrom bcm.agent.main import main\n\nsys.exit(main())\n"
# A fixed timestamp keeps the archive byte-for-byte reproducible.
_EPOCH = (2020, 1, 1, 0, 0, 0)


def _pynvml_source() -> bytes | None:
    spec = importlib.util.find_spec("pynvml")
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin).read_bytes()


def build_bundle(*, include_pynvml: bool = True) -> bytes:
    """The zipapp's bytes (shebang first); raises ``FileNotFoundError`` if pynvml is wanted but absent."""
    package = Path(__file__).resolve().parent
    files: dict[str, bytes] = {"__main__.py": _MAIN.encode()}
    files["bcm/__init__.py"] = (package.parent / "__init__.py").read_bytes()
    for name in AGENT_MODULES:
        files[f"bcm/agent/{name}.py"] = (package / f"{name}.py").read_bytes()
    if include_pynvml:
        source = _pynvml_source()
        if source is None:
            raise FileNotFoundError("pynvml (PyPI nvidia-ml-py) is not installed; pip install nvidia-ml-py")
        files["pynvml.py"] = source
    buffer = io.BytesIO()
    buffer.write(SHEBANG)
    with zipfile.ZipFile(buffer, "a", compression=zipfile.ZIP_DEFLATED) as archive:
        for arcname in sorted(files):
            info = zipfile.ZipInfo(arcname, date_time=_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, files[arcname])
    return buffer.getvalue()
