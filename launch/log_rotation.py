"""Size-based rotation of a deployment process's log, done by the process that writes it.

A child's stdout and stderr are its log file (``process.spawn``), so everything it prints lands there:
logging, tracebacks, NCCL's and Triton's own lines. Rotating by renaming from outside would leave the
writer appending to the renamed file; a logging handler would miss what bypasses ``logging``. So each
child watches its own log: when fd 1 has grown past ``$MII_SERVER_LOG_MAX_BYTES`` it shifts
``LOG.1`` … ``LOG.{N-1}`` up by one (dropping ``LOG.N``, N = ``$MII_SERVER_LOG_BACKUPS``), renames
``LOG`` to ``LOG.1`` and points fds 1 and 2 at a fresh ``LOG`` (``dup2``). Nothing is lost: a write
between the rename and the ``dup2`` lands at the end of ``LOG.1``.

``process.spawn`` names the file (``$MII_SERVER_LOG_FILE``) for a child it gives a log of its own, and
removes the name from one that shares its parent's output (only one process may rotate a file).
``serve()`` sets the limits from ``DeploymentConfig.log_max_bytes`` / ``log_backups`` and every
process of the deployment inherits them. A process with no log file (a pod's stdout) rotates nothing:
the container runtime does that.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

LOG_FILE_ENV = "MII_SERVER_LOG_FILE"
MAX_BYTES_ENV = "MII_SERVER_LOG_MAX_BYTES"
BACKUPS_ENV = "MII_SERVER_LOG_BACKUPS"
CHECK_INTERVAL_S = 1.0  # how far past the limit a log can grow is what one second of output adds

log = logging.getLogger(__name__)


def rotation_env(max_bytes: int, backups: int) -> dict[str, str]:
    """The environment that carries a deployment's rotation limits to its processes."""
    return {MAX_BYTES_ENV: str(max_bytes), BACKUPS_ENV: str(backups)}


class LogRotator:
    """Rotates ``path``, the file behind this process's fds 1 and 2, once it passes ``max_bytes``."""

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups

    def check(self) -> bool:
        """Rotate if the log is over its limit; True if it did."""
        try:
            current = os.fstat(1)
            on_disk = os.stat(self.path)
        except OSError:
            return False
        if (current.st_dev, current.st_ino) != (on_disk.st_dev, on_disk.st_ino):
            return False  # fd 1 is not this file (redirected by someone else): not ours to rotate
        if current.st_size < self.max_bytes:
            return False
        self._shift_backups()
        fresh = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.dup2(fresh, 1)
            os.dup2(fresh, 2)
        finally:
            os.close(fresh)
        return True

    def _shift_backups(self) -> None:
        if self.backups == 0:
            self.path.unlink(missing_ok=True)  # no backups kept: start over
            return
        for n in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{n}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{n + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))

    def run_forever(self, interval: float = CHECK_INTERVAL_S, stop: threading.Event | None = None) -> None:
        stop = stop or threading.Event()
        while not stop.wait(interval):
            try:
                self.check()
            except OSError as err:  # a full disk or a removed directory must not kill the process
                log.warning("log rotation of %s failed: %s", self.path, err)


def start_from_environment() -> LogRotator | None:
    """In a child of the deployment: rotate its own log on a daemon thread, when it has one."""
    path = os.environ.get(LOG_FILE_ENV, "")
    max_bytes = int(os.environ.get(MAX_BYTES_ENV, "0") or 0)
    if not path or max_bytes <= 0:
        return None
    rotator = LogRotator(Path(path), max_bytes, int(os.environ.get(BACKUPS_ENV, "5") or 0))
    threading.Thread(target=rotator.run_forever, name="log-rotation", daemon=True).start()
    return rotator
