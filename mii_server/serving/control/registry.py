"""The deployment registry: one JSON record per running deployment, in a per-user directory.

``serve()`` and the supervisor write records; ``client(name)`` and ``mii-server status`` read them.
The directory is ``$MII_SERVER_REGISTRY`` when set, else ``$XDG_RUNTIME_DIR/mii-server`` when that
exists, else ``~/.cache/mii-server/deployments``; it is created with mode 0700.

Trust: a record says which port to connect to and holds the admin token, so the directory must be
this user's alone (owned by them, mode 0700: nobody else can plant or swap a record) and so must every
record (owned by them, 0600, not a symbolic link). Anything else raises ``UntrustedRegistry``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from ...errors import UntrustedRegistry

log = logging.getLogger(__name__)

ENV_VAR = "MII_SERVER_REGISTRY"

State = Literal["starting", "ready", "failed", "stopping"]


@dataclass
class DeploymentRecord:
    """What a client needs to find and judge a deployment."""

    name: str  # deployment_name
    state: State  # starting -> ready -> stopping (or failed)
    supervisor_pid: int  # the process that owns every other process of the deployment
    address: str  # load balancer host:port
    replica_addresses: list[str]  # host:port of every replica's rank 0
    rest_url: str | None  # POST target of the REST gateway, None when disabled
    log_dir: str  # where every child's log lives
    model: str  # model_name_or_path ("" = built-in demo model)
    created_at: float = field(default_factory=time.time)  # seconds since the epoch
    error: str = ""  # why start-up failed (state "failed")
    openai_url: str | None = None  # base URL of the OpenAI-compatible API (".../v1"), None when disabled
    admin_token: str = ""  # what Terminate needs (why here: the record is the owner's alone, 0600 in 0700)
    tls_ca_file: str = ""  # what a client trusts when the deployment speaks TLS

    def is_alive(self) -> bool:
        return pid_alive(self.supervisor_pid)


def registry_dir(override: str = "") -> Path:
    """The registry directory (created, mode 0700)."""
    if override:
        path = Path(override)
    elif os.environ.get(ENV_VAR):
        path = Path(os.environ[ENV_VAR])
    elif os.environ.get("XDG_RUNTIME_DIR") and Path(os.environ["XDG_RUNTIME_DIR"]).is_dir():
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "mii-server"
    else:
        path = Path.home() / ".cache" / "mii-server" / "deployments"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    _check_private(path, os.stat(path), "registry directory", 0o700)
    return path


def _check_private(path: Path, st: os.stat_result, what: str, mode: int) -> None:
    """Refuse ``path`` unless this user owns it and nobody else may read or write it."""
    if st.st_uid != os.getuid():
        raise UntrustedRegistry(
            f"{what} {path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}): its records "
            f"could send clients to someone else's port; use a directory of your own (${ENV_VAR})"
        )
    if st.st_mode & 0o077:
        raise UntrustedRegistry(
            f"{what} {path} has mode {st.st_mode & 0o777:o}: other users may read or change it; "
            f"run `chmod {mode:o} {path}` or use another directory (${ENV_VAR})"
        )


def record_path(name: str, directory: str = "") -> Path:
    return registry_dir(directory) / f"{name}.json"


def log_dir(name: str, directory: str = "") -> Path:
    logs = registry_dir(directory) / "logs"
    logs.mkdir(exist_ok=True, mode=0o700)  # why not parents=True: parents would get the umask's mode
    path = logs / name
    path.mkdir(exist_ok=True, mode=0o700)
    return path


def write(record: DeploymentRecord, directory: str = "") -> None:
    """Atomically replace the record (readers never see half a file)."""
    target = record_path(record.name, directory)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{record.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(record), f, indent=1)
    os.replace(tmp, target)


def read(name: str, directory: str = "") -> DeploymentRecord | None:
    """The record of ``name`` (None when absent or torn); ``UntrustedRegistry`` when it is not ours alone."""
    return _read_record(record_path(name, directory))


def _read_record(path: Path) -> DeploymentRecord | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as err:
        if path.is_symlink():
            raise UntrustedRegistry(f"registry record {path} is a symbolic link; remove it") from None
        log.warning("cannot read registry record %s: %s", path, err)
        return None
    with os.fdopen(fd) as f:
        _check_private(path, os.fstat(f.fileno()), "registry record", 0o600)
        try:
            data = json.loads(f.read())
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            return None  # a torn file is treated as absent
    try:
        return DeploymentRecord(**data)
    except TypeError:
        return None


def remove(name: str, directory: str = "", only_pid: int | None = None) -> None:
    """Delete the record; with ``only_pid``, only if it still belongs to that supervisor."""
    if only_pid is not None:
        current = read(name, directory)
        if current is None or current.supervisor_pid != only_pid:
            return
    record_path(name, directory).unlink(missing_ok=True)


def list_records(directory: str = "") -> list[DeploymentRecord]:
    out = []
    for path in sorted(registry_dir(directory).glob("*.json")):  # the directory checked once
        try:
            record = _read_record(path)
        except UntrustedRegistry as err:
            log.warning("skipped: %s", err)  # one planted file must not hide the user's own deployments
            continue
        if record is not None:
            out.append(record)
    return out


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (a zombie's ports and memory are already gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs (macOS): trust kill(0)
    # state is the field after the parenthesised command name
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
