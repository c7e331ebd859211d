"""Everything in the serving wing (control plane, routing, front ends), the wire types, the CLI and the
launcher imports neither torch nor the engine: they start in well under a second and cost no GPU.

The modules are found by walking ``mii_server/serving/`` (not listed by hand), so a new module there
is held to the rule from the moment it exists.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mii_server

PACKAGE_ROOT = Path(mii_server.__file__).parent
OUTSIDE_SERVING = ["mii_server", "mii_server.wire.convert", "mii_server.wire.types", "mii_server.cli",
                   "mii_server.launch.__main__", "mii_server.launch.roles", "mii_server.launch.process"]  # fmt: skip
HEAVY_PREFIXES = ("mii_server.engine", "mii_server.models", "mii_server.batching", "mii_server.replica", "transformers")


def serving_modules() -> list[str]:
    root = PACKAGE_ROOT / "serving"
    modules = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
        modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


def test_the_walk_finds_every_room() -> None:
    modules = serving_modules()
    for room in ("control", "routing", "frontends"):
        assert any(m.startswith(f"mii_server.serving.{room}.") for m in modules), room
    assert len(modules) > 20


def test_no_torch_in_the_serving_wing() -> None:
    modules = serving_modules() + OUTSIDE_SERVING
    code = (
        "import importlib, sys\n"
        f"heavy_prefixes = {HEAVY_PREFIXES!r}\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith(heavy_prefixes))\n"
        "    if heavy:\n"
        "        print(f'{name} imports {heavy}')\n"
        "        sys.exit(1)\n"
        "import mii_server\n"
        "mii_server.client, mii_server.serve\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, f"{result.stdout}{result.stderr}"
