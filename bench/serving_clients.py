"""The load generator of ``serving_benchmark.py``: streaming callers on the three front ends, run in
client processes of their own.

Imports no torch (a client process must start fast and stay small). Each client process has its
own asyncio loop and its own connections (one ``httpx.AsyncClient``, or one gRPC ``Client``, per
job). The parent sends it a ``Job``; the process answers ready; the parent sends the start time
(one ``time.monotonic()`` clock for every process: on Linux it is the system-wide CLOCK_MONOTONIC);
the process answers with one ``RequestResult`` per request and the CPU it used.

What one request measures (as vLLM's ``benchmark_serving`` does): ``ttft`` from sending to the
first streamed chunk that carries output, ``itl`` the gaps between successive such chunks,
``latency`` from sending to the end of the stream, ``output_tokens`` as the server counts them
(OpenAI: ``usage.completion_tokens`` of ``stream_options.include_usage``; gRPC and REST: the last
chunk's cumulative ``generated_length``). A request that ends with fewer tokens than asked for
counts as an error: every output is forced to its length.
"""

from __future__ import annotations

import asyncio
import json
import resource
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

FRONTENDS = ("openai", "grpc", "rest")
ERROR_CHARS = 300  # of an error message kept per request


@dataclass(frozen=True)
class Target:
    """Where the front ends of one deployment listen."""

    openai_url: str = ""  # base of the OpenAI API, e.g. http://127.0.0.1:8000/v1
    served_model: str = ""  # the OpenAI ``model`` field
    grpc_address: str = ""  # the load balancer, host:port
    rest_url: str = ""  # the REST route, e.g. http://127.0.0.1:28080/mii/NAME
    api_key: str = ""  # sent as ``Authorization: Bearer`` to the HTTP front ends when set


@dataclass(frozen=True)
class RequestSpec:
    """One request of a run: a prompt of ``input_len`` tokens asking for exactly ``output_len``."""

    prompt: str
    input_len: int  # tokens the prompt encodes to (as the server's tokenizer counts them)
    output_len: int
    arrival_s: float | None = None  # open loop: seconds after the run's start it is sent; None: closed loop


@dataclass(frozen=True)
class Job:
    """What one client process runs: its share of a run's requests."""

    frontend: str  # one of FRONTENDS
    target: Target
    requests: list[RequestSpec]
    callers: int  # closed loop: callers, each sending its next request when the last ends; 0: open loop
    timeout_s: float  # per request


@dataclass
class RequestResult:
    """What one request saw; times in seconds, ``sent`` from the run's start, the rest from ``sent``."""

    input_len: int  # planned
    output_len: int  # planned
    sent: float = 0.0
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between successive output chunks
    output_tokens: int = 0  # as the server counted them
    prompt_tokens: int | None = None  # as the server counted them, when it says
    cached_tokens: int | None = None  # prompt tokens the server took from its prefix cache, when it says
    error: str = ""


@dataclass
class JobResult:
    """One client process's answer: its results and the CPU it spent while the run lasted."""

    results: list[RequestResult]
    cpu_s: float  # user + system, every thread of the process
    wall_s: float


class StreamTimer:
    """Stamps the output chunks of one stream into its ``RequestResult``."""

    def __init__(self, result: RequestResult, sent: float) -> None:
        self.result, self.sent, self.last = result, sent, sent

    def chunk(self) -> None:
        now = time.monotonic()
        if self.result.ttft is None:
            self.result.ttft = now - self.sent
        else:
            self.result.itl.append(now - self.last)
        self.last = now


def _headers(target: Target) -> dict[str, str]:
    return {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}


async def _sse_events(reply: Any) -> AsyncIterator[tuple[str, Any]]:
    """(event name, JSON body) of each server-sent event of ``reply`` until ``data: [DONE]``."""
    event = "message"
    async for line in reply.aiter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield event, json.loads(data)
        elif not line:
            event = "message"


async def _http_refused(reply: Any) -> str:
    return f"HTTP {reply.status_code}: {(await reply.aread())[:ERROR_CHARS].decode(errors='replace')}"


async def openai_request(http: Any, target: Target, spec: RequestSpec, result: RequestResult) -> None:
    """A streaming ``/v1/completions`` with usage in its last chunk."""
    body = {
        "model": target.served_model, "prompt": spec.prompt, "max_tokens": spec.output_len,
        "min_tokens": spec.output_len, "ignore_eos": True, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    timer = StreamTimer(result, time.monotonic())
    async with http.stream(
        "POST", f"{target.openai_url}/completions", json=body, headers=_headers(target)
    ) as reply:
        if reply.status_code != 200:
            result.error = await _http_refused(reply)
            return
        async for _, event in _sse_events(reply):
            if "error" in event:
                result.error = f"stream error: {json.dumps(event['error'])}"
                return
            if event.get("choices"):
                timer.chunk()
            usage = event.get("usage")
            if usage:
                result.output_tokens = usage["completion_tokens"]
                result.prompt_tokens = usage["prompt_tokens"]
                result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


async def rest_request(http: Any, target: Target, spec: RequestSpec, result: RequestResult) -> None:
    """MII's ``POST /mii/<deployment>`` with ``stream: true`` (one prompt)."""
    body = {"prompts": spec.prompt, "stream": True, "max_new_tokens": spec.output_len, "ignore_eos": True,
            "do_sample": False}  # fmt: skip
    timer = StreamTimer(result, time.monotonic())
    async with http.stream("POST", target.rest_url, json=body, headers=_headers(target)) as reply:
        if reply.status_code != 200:
            result.error = await _http_refused(reply)
            return
        async for name, chunk in _sse_events(reply):
            if name == "error":
                result.error = f"stream error: {json.dumps(chunk)}"
                return
            if chunk["token_ids"]:
                timer.chunk()
            result.output_tokens = chunk["generated_length"]
            result.prompt_tokens = chunk["prompt_length"]
            result.cached_tokens = chunk.get("cached_tokens")


async def grpc_request(client: Any, spec: RequestSpec, result: RequestResult) -> None:
    """``Client.agenerate_stream`` with one prompt."""
    timer = StreamTimer(result, time.monotonic())
    stream = client.agenerate_stream(
        [spec.prompt], max_new_tokens=spec.output_len, ignore_eos=True, do_sample=False
    )
    async for chunk in stream:
        if chunk.token_ids:
            timer.chunk()
        result.output_tokens = chunk.generated_length
        result.prompt_tokens = chunk.prompt_length
        result.cached_tokens = chunk.cached_tokens


async def _timed(
    send: Callable[[RequestSpec, RequestResult], Awaitable[None]],
    spec: RequestSpec,
    start: float,
    timeout_s: float,
) -> RequestResult:
    result = RequestResult(
        input_len=spec.input_len, output_len=spec.output_len, sent=time.monotonic() - start
    )
    try:
        # past the timeout the stream is cancelled, which makes the server abort the request
        await asyncio.wait_for(send(spec, result), timeout_s)
    except asyncio.TimeoutError:
        result.error = f"timed out after {timeout_s:.0f} s"
    except Exception as err:  # noqa: BLE001 - every failure is a result to count, none may stop the run
        result.error = f"{type(err).__name__}: {err}"[:ERROR_CHARS]
    result.latency = time.monotonic() - start - result.sent
    if not result.error and result.output_tokens != spec.output_len:
        result.error = f"asked for {spec.output_len} tokens, got {result.output_tokens}"
    return result


async def closed_loop(
    send: Callable[[RequestSpec, RequestResult], Awaitable[None]], job: Job, start: float
) -> list[RequestResult]:
    """``job.callers`` callers share the job's requests; each sends its next when its last has ended."""
    queue, results = deque(job.requests), []

    async def caller() -> None:
        while queue:
            results.append(await _timed(send, queue.popleft(), start, job.timeout_s))

    await asyncio.gather(*(caller() for _ in range(min(job.callers, len(job.requests)))))
    return results


async def open_loop(
    send: Callable[[RequestSpec, RequestResult], Awaitable[None]], job: Job, start: float
) -> list[RequestResult]:
    """Every request sent at its arrival time, whatever is still open."""

    async def at(spec: RequestSpec) -> RequestResult:
        assert spec.arrival_s is not None
        await asyncio.sleep(max(0.0, start + spec.arrival_s - time.monotonic()))
        return await _timed(send, spec, start, job.timeout_s)

    return list(await asyncio.gather(*(at(s) for s in job.requests)))


async def run_job(job: Job, start: float) -> JobResult:
    """Run ``job`` from ``start`` (``time.monotonic()``) on fresh connections of this event loop."""
    import httpx

    from mii_server.serving.frontends.client import Client

    http = grpc = None
    send: Callable[[RequestSpec, RequestResult], Awaitable[None]]
    if job.frontend == "grpc":
        grpc = Client(job.target.grpc_address)  # one channel; its streams multiplex over HTTP/2

        async def send(spec: RequestSpec, result: RequestResult) -> None:
            await grpc_request(grpc, spec, result)
    else:
        # HTTP/1.1: one connection per open stream, kept alive for the caller's next request
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=60.0), limits=limits)
        fn = openai_request if job.frontend == "openai" else rest_request

        async def send(spec: RequestSpec, result: RequestResult) -> None:
            await fn(http, job.target, spec, result)

    try:
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        cpu0, wall0 = _cpu_seconds(), time.monotonic()
        results = await (closed_loop if job.callers else open_loop)(send, job, start)
        return JobResult(results, _cpu_seconds() - cpu0, time.monotonic() - wall0)
    finally:
        if http is not None:
            await http.aclose()
        if grpc is not None:
            await grpc.aclose()


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def worker_main(conn: Connection) -> None:
    """A client process: for each ``Job`` it is sent, answer ready, take the start time, run the job
    and send its ``JobResult``; stop when sent None."""
    import httpx  # noqa: F401 - imported once, before the first job's clock starts

    from mii_server.launch.process import raise_open_file_limit
    from mii_server.serving.frontends import client  # noqa: F401

    raise_open_file_limit()  # one socket per open stream
    while (job := conn.recv()) is not None:
        conn.send("ready")
        conn.send(asyncio.run(run_job(job, conn.recv())))


class ClientPool:
    """``size`` client processes (spawned, so none inherits the parent's state), kept for every run."""

    def __init__(self, size: int) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for _ in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(child,), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    @property
    def size(self) -> int:
        return len(self.procs)

    def run(self, jobs: list[Job]) -> list[JobResult]:
        """Run one job per process (at most ``size``), started together; their results in order."""
        assert 0 < len(jobs) <= self.size
        conns = self.conns[: len(jobs)]
        for conn, job in zip(conns, jobs):
            conn.send(job)
        for conn in conns:
            if conn.recv() != "ready":
                raise RuntimeError("a client process failed to start its job")
        start = time.monotonic() + 0.05  # every process sleeps until the same instant
        for conn in conns:
            conn.send(start)
        return [conn.recv() for conn in conns]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:  # the process is gone already
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def split_jobs(frontend: str, target: Target, requests: list[RequestSpec], callers: int, processes: int,
               timeout_s: float) -> list[Job]:  # fmt: skip
    """One run as jobs for ``processes`` client processes.

    Closed loop (``callers`` > 0): the callers are spread evenly (at most one process per caller) and
    each process gets requests in proportion to its callers, in order. Open loop: requests are dealt
    round robin, each keeping its arrival time.
    """
    if not callers:
        n = min(processes, len(requests))
        return [Job(frontend, target, requests[k::n], 0, timeout_s) for k in range(n)]
    n = min(processes, callers)
    shares = [callers // n + (k < callers % n) for k in range(n)]
    jobs, begin = [], 0
    for k, share in enumerate(shares):
        end = round(len(requests) * sum(shares[: k + 1]) / callers)
        jobs.append(Job(frontend, target, requests[begin:end], share, timeout_s))
        begin = end
    return [j for j in jobs if j.requests]
