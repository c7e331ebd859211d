"""``python -m mii_server.launch --role ROLE --config B64`` (roles: ``launcher.ROLES``).

``--config`` is url-safe base64 of a ``LaunchSpec`` as JSON (never pickle, never a secret).
"""

from __future__ import annotations

import argparse
import sys

from mii_server.serving import launcher, roles
from mii_server.serving.log_format import setup_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mii_server.launch",
        description="Run one process of a mii-server deployment (started by the supervisor, not by hand).",
    )
    parser.add_argument("--role", required=True, choices=launcher.ROLES, help="which process to run")
    parser.add_argument("--config", required=True, help="url-safe base64 JSON LaunchSpec")
    args = parser.parse_args(argv)
    setup_logging(args.role)
    spec = launcher.decode(args.config)
    return roles.RUNNERS[args.role](spec)


if __name__ == "__main__":
    sys.exit(main())
