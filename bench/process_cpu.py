"""CPU time of a deployment's processes by role, read from /proc (Linux), so a benchmark can show
which process was busy (a front end pinned at one core is a bottleneck a GPU figure hides)."""

from __future__ import annotations

import os
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...


def descendant_roles(root: int) -> dict[int, str]:
    """pid -> role (``--role`` of ``python -m mii_server.launch``, else the program name) of ``root``
    and every live process under it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    roles, stack = {}, [root]
    while stack:
        pid = stack.pop()
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        roles[pid] = argv[argv.index("--role") + 1] if "--role" in argv[:-1] else Path(argv[0]).name
        stack.extend(children.get(pid, []))
    return roles


def cpu_seconds(pids: dict[int, str]) -> dict[int, float]:
    """User + system seconds each process (all its threads) has used so far; gone ones are left out."""
    out = {}
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            out[pid] = (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (stat fields 14, 15)
    return out


def cores_by_role(
    pids: dict[int, str], before: dict[int, float], after: dict[int, float], wall_s: float
) -> dict[str, float]:
    """Cores each role kept busy between two ``cpu_seconds`` readings ``wall_s`` apart (summed over
    the processes of a role)."""
    cores: dict[str, float] = {}
    for pid, end in after.items():
        if pid in before and wall_s > 0:
            cores[pids[pid]] = cores.get(pids[pid], 0.0) + (end - before[pid]) / wall_s
    return cores
