"""Fixtures for server tests: an isolated registry and free ports per test module."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from mii_server.serving.frontends.loop_thread import LoopThread


@pytest.fixture(scope="module")
def registry_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private registry directory in MII_SERVER_REGISTRY for this module (children inherit it)."""
    path = str(tmp_path_factory.mktemp("registry"))
    old = os.environ.get("MII_SERVER_REGISTRY")
    os.environ["MII_SERVER_REGISTRY"] = path
    yield path
    if old is None:
        os.environ.pop("MII_SERVER_REGISTRY", None)
    else:
        os.environ["MII_SERVER_REGISTRY"] = old


@pytest.fixture()
def bg() -> Iterator[LoopThread]:
    """An event loop on a thread, for the in-process gRPC servers (fakes, a load balancer) of a test."""
    loop = LoopThread()
    yield loop
    loop.close()
