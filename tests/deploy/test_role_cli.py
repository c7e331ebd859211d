"""Every container's arguments parse with the real `mii-server` command line, exactly as the pod runs them
(the images' ENTRYPOINT is `mii-server`, the manifests give the arguments).

A role whose subcommand the CLI does not have yet is skipped, with the reason, not passed.
"""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from mii_server.cli import build_parser

from .manifests import OVERLAYS, ROLES, containers, kubectl, render

pytestmark = pytest.mark.skipif(kubectl() is None, reason="kubectl is not installed; it renders the overlays")


def _subcommands(parser: argparse.ArgumentParser) -> set[str]:
    # argparse has no public way to list a parser's subcommands
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(actions[0].choices) if actions else set()


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_container_arguments_parse(overlay: str, role: str) -> None:
    parser = build_parser()
    if role not in _subcommands(parser):
        pytest.skip(f"`mii-server {role}` is not in mii_server.cli yet (issue 12's role CLIs)")
    for c in containers(render(overlay).role(role)):
        args = [str(a) for a in c["args"]]
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                parsed = parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"{overlay} {role}/{c['name']}: `mii-server {' '.join(args)}`:\n{stderr.getvalue()}")
        assert parsed.command == role
