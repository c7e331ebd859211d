"""Plain dataclasses that cross process boundaries (no protobuf, no torch): ``wire/convert.py`` maps them
to and from the protobuf messages."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..generation.response import Response

Prompt = str | list[int]  # text, or token ids (checked against the vocabulary by the replica)


@dataclass
class StreamChunk(Response):
    """One incremental piece of one prompt's output, as ``Client.generate_stream`` yields it.

    A ``Response`` whose text and token ids are new since the previous chunk of the same prompt;
    ``prompt_index`` says which prompt (position in the list given to ``generate_stream``).
    """

    prompt_index: int = 0  # position of the prompt in the request


@dataclass
class EngineStats:
    """Counters of one engine, kept by its batching loop (the one counters type: the replica's stats,
    the Stats RPC and the Prometheus gauges all derive from it)."""

    running: int = 0  # sequences in the running batch
    waiting: int = 0  # sequences waiting for admission (new or preempted)
    free_blocks: int = 0  # free KV blocks
    total_blocks: int = 0  # all KV blocks
    requests_finished: int = 0  # requests the engine finished (stopped, aborted or failed)
    prompt_tokens: int = 0  # prompt tokens of every request accepted
    generated_tokens: int = 0  # tokens sampled
    preemptions: int = 0  # sequences preempted (and recomputed) for want of KV blocks
    cached_prompt_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed


@dataclass
class ReplicaStats(EngineStats):
    """An engine's counters with what the replica and the load balancer know about it (Stats RPC)."""

    replica_index: int = 0  # position of the replica in the deployment
    address: str = ""  # host:port of the replica's gRPC server
    healthy: bool = False  # engine loaded and the load balancer routes to it (unreachable: counters are 0)
    pid: int = 0  # process id of the replica's rank 0
    prompts_received: int = 0  # prompts this replica process accepted since it started
    prompts_routed: int = 0  # prompts the load balancer sent to this replica slot, across restarts
    busy_step_s: float = 0.0  # seconds the engine's current step has been running; 0 between steps
    model_name: str = ""  # the model id the replica serves (a metrics label)


@dataclass
class Tokenized:
    """One prompt through the tokenizer (the Tokenize RPC): its ids, its text, and each token's text."""

    token_ids: list[int]
    text: str  # the text given, or the ids decoded
    token_strings: list[str] = field(default_factory=list)  # each id decoded alone, when asked for


@dataclass
class TokenizerInfo:
    """What clients probe about the tokenizer (vLLM's ``/tokenizer_info``) and the model's context."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str  # empty: the model has none
    max_model_len: int  # the context length, in tokens
    vocab_size: int  # valid token ids are 0 .. vocab_size - 1
