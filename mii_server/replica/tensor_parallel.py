"""A replica of T tensor-parallel ranks: rank 0 starts ranks 1..T-1 as its own children.

Rank 0 binds the ZMQ step publisher and opens the torch.distributed store on loopback ports the OS
picks (so replicas and deployments on one host never collide; the ranks share one host, so nothing
of this listens beyond it) and hands both ports to the followers it spawns. The ranks live and die as a unit: a follower that exits makes rank 0 exit non-zero, and the
supervisor restarts the whole replica; followers die with rank 0 (PR_SET_PDEATHSIG) and also leave
when rank 0 falls silent.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from .. import gc_heap
from ..errors import EngineDead
from ..launch import process
from ..launch.spec import RankLink, RankSpec
from ..runtime import pick_device
from ..serving.control.roles import ReplicaRole
from ..tensor_parallel.channel import StepPublisher
from ..tensor_parallel.distributed import open_store
from ..tensor_parallel.executor import follow
from ..tensor_parallel.ranks import RankPlacement, start_rank
from .engine_driver import EngineDriver

log = logging.getLogger(__name__)

FOLLOWER_STOP_S = 30.0
RANK_HOST = "127.0.0.1"  # the ranks of a replica talk over loopback: they run on one host


class ReplicaEngine:
    """Rank 0's engine plus the follower processes it started (none when T is 1)."""

    def __init__(self, role: ReplicaRole, after_step: Callable[[], None]) -> None:
        """Load the model (and start the followers); ``after_step`` runs on the batching thread after
        every step (the relay's flush)."""
        world = role.model.tensor_parallel
        self.followers: list[subprocess.Popen] = []
        self._stopping = threading.Event()
        if world == 1:
            self.driver = EngineDriver(role.model, after_step=after_step)
            return
        publisher = StepPublisher(RANK_HOST, 0)
        store = open_store(RANK_HOST, 0, world)
        index = role.replica_index
        for rank in range(1, world):
            link = RankLink(rank=rank, store_port=store.port, channel_port=publisher.port)
            log_path = Path(role.rank_log_dir) / f"replica-{index}-rank-{rank}.log" if role.rank_log_dir else None
            proc = process.spawn("replica-rank", RankSpec(replica=role, rank_link=link), log_path, detach=False)
            self.followers.append(proc)
            log.info("replica %d: started rank %d (pid %d), log %s", index, rank, proc.pid, log_path or "stderr")
        for proc in self.followers:
            threading.Thread(target=self._watch, args=(proc,), daemon=True).start()
        placement = RankPlacement(
            rank=0, world_size=world, device=pick_device(role.model, 0),
            channel_host=RANK_HOST, channel_port=publisher.port, store=store,
        )
        started = start_rank(role.model, placement, publisher)
        self.driver = EngineDriver(role.model, started.runtime, started.executor, after_step)

    def _watch(self, proc: subprocess.Popen) -> None:
        # A follower gone means the collectives can never complete: take the replica down at once
        # (also while loading, when rank 0 may be blocked inside a collective) so it restarts whole.
        code = proc.wait()
        if not self._stopping.is_set():
            log.error("tensor-parallel follower pid %d exited with %s; exiting for a restart", proc.pid, code)
            os._exit(1)

    def shutdown(self) -> None:
        """Stop the engine (which releases the followers) and reap them."""
        self._stopping.set()
        self.driver.shutdown()
        for proc in self.followers:
            try:
                proc.wait(timeout=FOLLOWER_STOP_S)
            except subprocess.TimeoutExpired:
                process.stop_group(proc)


def run_follower(spec: RankSpec) -> int:
    """Ranks 1..T-1: load this rank's shard and execute rank 0's Steps until told to stop."""
    model = spec.replica.model
    link = spec.rank_link
    world = model.tensor_parallel
    store = open_store(RANK_HOST, link.rank, world, port=link.store_port)
    placement = RankPlacement(
        rank=link.rank, world_size=world, device=pick_device(model, link.rank),
        channel_host=RANK_HOST, channel_port=link.channel_port, store=store,
    )
    started = start_rank(model, placement)
    assert started.subscriber is not None
    gc_heap.freeze_startup_heap(f"rank {link.rank}")
    try:
        follow(started.runtime.engine, started.subscriber, started.runtime.tp)
    except EngineDead as err:
        log.error("rank %d: %s; exiting", link.rank, err)
        return 1
    log.info("rank %d stopped", link.rank)
    return 0
