"""``python -m mii_server.launch --role ROLE --config B64`` (roles: ``spec.ROLES``).

``--config`` is url-safe base64 of the role's spec as JSON (``spec.LaunchSpec``, or ``spec.RankSpec``
for replica-rank; never pickle, never a secret).
"""

from __future__ import annotations

import argparse
import sys

from mii_server.launch import log_rotation, roles, spec
from mii_server.launch.process import raise_open_file_limit
from mii_server.serving.log_format import setup_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mii_server.launch",
        description="Run one process of a mii-server deployment (started by the supervisor, not by hand).",
    )
    parser.add_argument("--role", required=True, choices=spec.ROLES, help="which process to run")
    parser.add_argument("--config", required=True, help="url-safe base64 JSON spec (LaunchSpec or RankSpec)")
    args = parser.parse_args(argv)
    setup_logging(args.role)
    log_rotation.start_from_environment()
    raise_open_file_limit()
    return roles.RUNNERS[args.role](spec.decode(args.role, args.config))


if __name__ == "__main__":
    sys.exit(main())
