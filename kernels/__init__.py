"""The model's kernels, imported as ``mii_server.kernels`` (``mii_server/kernels`` links here).

``get_ops(device)`` (``dispatch``) picks the op namespace for a device: the pure-PyTorch
``reference`` or, on CUDA, the Triton twins; ``AttentionMetadata`` describes a ragged batch to
attention.

Python started from the checkout's root puts this directory on ``sys.path`` ahead of site-packages,
where it would shadow the PyPI package ``kernels`` that transformers (5.25 and newer) requires and
imports. Imported under that top-level name, this module therefore hands the name over to the
installed package, or stays empty where none is installed; it never defines our ops under that name.
"""

from __future__ import annotations

import sys

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os

    def _hand_over(name: str, checkout_root: str) -> None:
        """Execute the package ``name`` found on ``sys.path`` past the checkout's root in this module's
        place (the import statement returns what ``sys.modules`` holds once this module finishes).
        Where none is installed, this module stays empty: transformers then sees no usable package."""
        path = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != checkout_root]
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)

    _hand_over(__name__, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
else:
    from . import reference
    from .dispatch import KERNELS_ENV, get_ops
    from .metadata import AttentionMetadata

    __all__ = ["KERNELS_ENV", "AttentionMetadata", "get_ops", "reference"]
