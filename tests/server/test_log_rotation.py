"""Logs are rotated by size, N kept, nothing lost: the mechanism on a child writing both fds, and a real
deployment whose processes rotate their own logs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import mii_server
from mii_server.launch.log_rotation import CHECK_INTERVAL_S
from mii_server.serving.control import registry

from .helpers import free_port_block, wait_for

WRITER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from mii_server.launch.log_rotation import LogRotator
    rotator = LogRotator(Path(sys.argv[1]), max_bytes=2000, backups=3)
    for i in range(600):
        if i % 2:
            os.write(2, f"line {i:05d} err\\n".encode())  # stderr, as a C library writes it
        else:
            print(f"line {i:05d} out", flush=True)
        rotator.check()
    """
)


def test_a_child_rotates_its_own_stdout_and_stderr(tmp_path: Path) -> None:
    log = tmp_path / "replica-0.log"
    with open(log, "ab") as out:
        subprocess.run([sys.executable, "-c", WRITER, str(log)], stdout=out, stderr=subprocess.STDOUT, check=True)
    kept = [log.with_name(f"{log.name}.{n}") for n in (3, 2, 1)] + [log]  # oldest first
    assert all(p.exists() for p in kept) and not log.with_name(f"{log.name}.4").exists()
    assert all(p.stat().st_size <= 2000 + 16 for p in kept)  # at most one line past the limit
    assert all(p.stat().st_mode & 0o077 == 0 for p in kept[-1:])  # the fresh log is the owner's alone
    lines = [line for p in kept for line in p.read_text().splitlines()]
    numbers = [int(line.split()[1]) for line in lines]
    assert numbers == list(range(numbers[0], 600))  # nothing lost or reordered in what is kept, to the last line
    assert {line.split()[2] for line in lines} == {"out", "err"}


@pytest.mark.integration
def test_a_deployment_rotates_every_process_log(registry_env: str) -> None:
    base = free_port_block(3)
    client = mii_server.serve(deployment_name="rotating", port_number=base, log_max_bytes=4096, log_backups=2)
    try:
        record = registry.read("rotating")
        assert record is not None
        log_dir = Path(record.log_dir)
        replica_log = log_dir / "replica-0.log"

        def rotated_twice() -> bool:
            client.generate(["To read a file,"] * 8, max_new_tokens=2)  # every prompt writes its log lines
            return (log_dir / "replica-0.log.2").exists()

        # why the pace: the replica checks its log once per CHECK_INTERVAL_S, so a log overshoots its limit
        # by what arrives between two checks; two batches (~3 KB) per interval keep that well under the bound
        wait_for(rotated_twice, 120, "the replica's log to be rotated twice", interval=CHECK_INTERVAL_S / 2)
        wait_for(lambda: not (log_dir / "replica-0.log.3").exists() and replica_log.exists(), 5, "two backups only")
        assert (log_dir / "replica-0.log.1").stat().st_size < 4096 * 4
        assert client.generate(["To read a file,"], max_new_tokens=2)[0].generated_text  # still serving
    finally:
        client.terminate_server()
    assert not (log_dir / "replica-0.log.3").exists()
