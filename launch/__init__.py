"""Entry module of every deployment process: ``python -m mii_server.launch --role R --config B64``.

Installed as ``mii_server.launch`` (see pyproject's package-dir); the top-level folder is named
``launch`` only in the source tree.
"""
