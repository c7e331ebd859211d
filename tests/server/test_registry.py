"""Unit: deployment records are written atomically, found by name, and judged alive by pid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

import mii_server
from mii_server.errors import UntrustedRegistry
from mii_server.serving.control import registry


def _record(name: str, pid: int) -> registry.DeploymentRecord:
    return registry.DeploymentRecord(
        name=name,
        state="ready",
        supervisor_pid=pid,
        address="127.0.0.1:1",
        replica_addresses=["127.0.0.1:2"],
        rest_url=None,
        log_dir="/tmp",
        model="",
    )


def test_env_var_overrides_the_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(registry.ENV_VAR, str(tmp_path / "reg"))
    assert registry.registry_dir() == tmp_path / "reg"
    assert (tmp_path / "reg").is_dir() and (tmp_path / "reg").stat().st_mode & 0o777 == 0o700
    assert registry.registry_dir(str(tmp_path / "explicit")) == tmp_path / "explicit"
    logs = registry.log_dir("d")
    assert all(p.stat().st_mode & 0o777 == 0o700 for p in (logs, logs.parent))  # prompts land in logs


def test_write_read_list_remove(tmp_path) -> None:
    d = str(tmp_path)
    rec = _record("a", os.getpid())
    registry.write(rec, d)
    assert registry.read("a", d) == rec
    assert [r.name for r in registry.list_records(d)] == ["a"]
    assert not list(tmp_path.glob(".*.tmp"))  # no temp files left behind
    registry.remove("a", d, only_pid=os.getpid() + 1)  # someone else's: kept
    assert registry.read("a", d) is not None
    registry.remove("a", d, only_pid=os.getpid())
    assert registry.read("a", d) is None


def test_torn_file_reads_as_absent(tmp_path) -> None:
    (tmp_path / "x.json").write_text("{not json")
    (tmp_path / "x.json").chmod(0o600)
    assert registry.read("x", str(tmp_path)) is None


def _planted(directory: Path, name: str = "llama") -> Path:
    """A record someone else wrote: it sends clients to a port of theirs."""
    path = directory / f"{name}.json"
    path.write_text(json.dumps(asdict(_record(name, os.getpid())) | {"address": "127.0.0.1:6666"}))
    return path


def test_a_directory_others_may_write_is_refused(tmp_path, monkeypatch) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # world-writable, as /tmp is
    _planted(shared).chmod(0o600)
    monkeypatch.setenv(registry.ENV_VAR, str(shared))
    with pytest.raises(UntrustedRegistry, match="chmod 700"):
        mii_server.client("llama")  # before: a client of 127.0.0.1:6666
    with pytest.raises(UntrustedRegistry):
        registry.list_records()
    with pytest.raises(UntrustedRegistry):
        mii_server.serve(deployment_name="llama", registry_dir=str(shared))  # refused before any process starts


def test_a_directory_or_record_of_another_user_is_refused(tmp_path, monkeypatch) -> None:
    d = str(tmp_path)
    registry.write(_record("mine", os.getpid()), d)
    theirs = _planted(tmp_path, "theirs")
    theirs.chmod(0o600)
    if os.getuid() == 0:
        os.chown(theirs, 65534, 65534)  # nobody's, as another user would leave it
    else:  # only root can give a file away: play the other user by changing who we are instead
        real = os.getuid()
        monkeypatch.setattr(registry.os, "fstat", _owned_by(real + 1, registry.os.fstat))
    with pytest.raises(UntrustedRegistry, match="belongs to uid"):
        registry.read("theirs", d)
    assert [r.name for r in registry.list_records(d)] == ["mine"]  # skipped, with a warning; ours still listed


def _owned_by(uid: int, fstat):  # a stand-in for os.fstat
    def fake(fd: int) -> os.stat_result:
        st = fstat(fd)
        fields = list(st)
        fields[4] = uid  # st_uid
        return os.stat_result(fields)

    return fake


def test_a_record_others_may_read_or_a_link_is_refused(tmp_path) -> None:
    d = str(tmp_path)
    _planted(tmp_path, "open").chmod(0o644)  # it holds the admin token: nobody else may read it
    with pytest.raises(UntrustedRegistry, match="chmod 600"):
        registry.read("open", d)
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("{}")
    (tmp_path / "link.json").symlink_to(elsewhere)
    with pytest.raises(UntrustedRegistry, match="symbolic link"):
        registry.read("link", d)


def test_pid_alive_sees_dead_and_zombie_processes() -> None:
    assert registry.pid_alive(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    # a zombie (exited, not reaped) already freed its ports: it counts as dead
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    assert not registry.pid_alive(proc.pid)
    proc.wait()
    assert not registry.pid_alive(proc.pid)
    assert not registry.pid_alive(0)
