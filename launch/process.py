"""How a child process is started, watched and stopped: ``python -m mii_server.launch --role R --config B64``.

Children of the supervisor die with it (Linux ``PR_SET_PDEATHSIG``), so a killed supervisor leaves
no orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from pathlib import Path

from .log_rotation import LOG_FILE_ENV
from .spec import Role, Spec, command

PARENT_PID_ENV = "MII_SERVER_PARENT_PID"


def raise_open_file_limit() -> None:
    """Lift this process's soft limit on open files to the hard limit: a server holding thousands of
    connections would otherwise hit the common default of 1024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


try:  # loaded here, not in the child: dlopen between fork and exec can deadlock
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not Linux: the supervisor's teardown is then the only guard
    _LIBC = None


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: ask the kernel to SIGKILL it when its parent dies."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def spawn(
    role: Role,
    spec: Spec,
    log_path: Path | None,
    *,
    detach: bool,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Start a child with stdout and stderr appended to ``log_path`` (None: this process's own, as a
    replica running on its own gives its ranks: one log stream per pod).

    ``detach=True`` (the supervisor started by ``serve()``): a new session, so the deployment outlives
    the calling script and its terminal's Ctrl-C. ``detach=False`` (children of the supervisor): also
    a new session (Ctrl-C reaches only the supervisor, which tears down in order), but killed when
    the supervisor dies.
    """
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONUNBUFFERED"] = "1"
    if log_path is not None:
        child_env[LOG_FILE_ENV] = str(log_path)  # the child rotates its own log (see log_rotation)
    else:
        child_env.pop(LOG_FILE_ENV, None)  # it shares this process's output: only one may rotate it
    if detach:
        child_env.pop(PARENT_PID_ENV, None)
    else:
        child_env[PARENT_PID_ENV] = str(os.getpid())
    with open(log_path, "ab") if log_path is not None else contextlib.nullcontext() as log:
        return subprocess.Popen(
            command(role, spec),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT if log is not None else None,
            env=child_env,
            start_new_session=True,
            # why preexec_fn: PR_SET_PDEATHSIG has no other spelling; it only calls a preloaded prctl
            preexec_fn=None if detach else _die_with_parent,  # noqa: PLW1509
            close_fds=True,
        )


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ('' if none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def stop_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the process group led by ``proc``, SIGKILL it after ``timeout``, and reap ``proc``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
            return
        except subprocess.TimeoutExpired:
            continue
