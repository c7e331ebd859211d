"""Unit: deployment records are written atomically, found by name, and judged alive by pid."""

from __future__ import annotations

import os
import subprocess
import sys

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
    assert registry.read("x", str(tmp_path)) is None


def test_pid_alive_sees_dead_and_zombie_processes() -> None:
    assert registry.pid_alive(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    # a zombie (exited, not reaped) already freed its ports: it counts as dead
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    assert not registry.pid_alive(proc.pid)
    proc.wait()
    assert not registry.pid_alive(proc.pid)
    assert not registry.pid_alive(0)
