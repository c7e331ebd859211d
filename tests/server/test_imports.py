"""Client, load balancer, REST gateway, CLI and launcher import neither torch nor the engine."""

from __future__ import annotations

import subprocess
import sys

import pytest

LIGHT_MODULES = [
    "mii_server",
    "mii_server.serving.client",
    "mii_server.serving.api",
    "mii_server.serving.load_balancer",
    "mii_server.serving.rest_gateway",
    "mii_server.serving.openai_server",
    "mii_server.serving.openai_protocol",
    "mii_server.serving.http_common",
    "mii_server.serving.metrics",
    "mii_server.serving.supervisor",
    "mii_server.serving.roles",
    "mii_server.wire.convert",
    "mii_server.cli",
    "mii_server.launch.__main__",
]


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_no_torch(module: str) -> None:
    code = (
        f"import sys, importlib; importlib.import_module({module!r}); "
        "import mii_server; mii_server.client, mii_server.serve; "
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('mii_server.engine', "
        "'mii_server.models', 'mii_server.batching', 'transformers'))); "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"{module} imports heavy modules: {result.stdout}{result.stderr}"
