"""kernels/ is ``mii_server.kernels``; Python started from the checkout's root also finds it as a
top-level ``kernels``, the name of the PyPI package transformers (5.25 and newer) requires and imports.
There it must hand the name to that package (or, where none is installed, stay empty), or
transformers fails to import and nothing loads a model."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _from_the_root(code: str) -> subprocess.CompletedProcess[str]:
    """``python -c code`` started from the checkout's root, which puts the root first on sys.path."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def _installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_a_top_level_kernels_is_the_installed_package_or_empty() -> None:
    run = _from_the_root("import kernels; print(kernels.__file__, hasattr(kernels, 'get_ops'))")
    assert run.returncode == 0, run.stderr
    file, has_our_ops = run.stdout.split()
    assert has_our_ops == "False"
    assert Path(file).resolve().is_relative_to(ROOT) != _installed(), run.stdout


def test_transformers_and_our_kernels_import_from_the_checkouts_root() -> None:
    run = _from_the_root(
        "import transformers.activations\n"
        "import mii_server.kernels as ours\n"
        "print(ours.get_ops('cpu').__name__)"
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["mii_server.kernels.reference"]
