"""Plain dataclasses the serving layer hands to callers (no protobuf, no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from ..generation.response import Response


@dataclass
class StreamChunk(Response):
    """One incremental piece of one prompt's output, as ``Client.generate_stream`` yields it.

    A ``Response`` whose text and token ids are new since the previous chunk of the same prompt;
    ``prompt_index`` says which prompt (position in the list given to ``generate_stream``).
    """

    prompt_index: int = 0  # position of the prompt in the request


@dataclass
class ReplicaStats:
    """Counters of one replica, as the load balancer's Stats RPC reports them."""

    replica_index: int  # position of the replica in the deployment
    address: str  # host:port of the replica's gRPC server
    healthy: bool  # engine loaded and the load balancer routes to it (unreachable: counters are 0)
    pid: int = 0  # process id of the replica's rank 0
    prompts_received: int = 0  # prompts this replica process accepted since it started
    prompts_routed: int = 0  # prompts the load balancer sent to this replica slot, across restarts
    running: int = 0  # sequences in the running batch
    waiting: int = 0  # sequences waiting for admission
    free_blocks: int = 0  # free KV blocks
    total_blocks: int = 0  # all KV blocks
    requests_finished: int = 0  # requests the engine finished
    prompt_tokens: int = 0  # prompt tokens processed
    generated_tokens: int = 0  # tokens generated
    preemptions: int = 0  # sequences preempted for want of KV blocks
