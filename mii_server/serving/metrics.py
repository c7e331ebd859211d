"""Prometheus metrics of replicas and gateways (prometheus-client; no torch).

Names follow vLLM's under our prefix ``mii_server:`` (counters get the ``_total`` suffix on the wire;
gauges never end in ``_total``). **One owner per metric**: a replica's ``/metrics`` has the engine's
series, labelled ``model_name`` (the served model id, as vLLM) and ``replica``; a front end's has only
its own HTTP series (the processes of one front end, which share one port, answer together:
``HttpMetrics.exposition``). Summing the scrapes of every front end and replica therefore counts
everything once.

| metric | kind | owner |
|---|---|---|
| ``num_requests_running`` / ``num_requests_waiting`` | gauge | replica (engine stats) |
| ``kv_cache_blocks_used`` / ``kv_cache_num_blocks`` / ``kv_cache_usage_perc`` | gauge | replica (engine stats) |
| ``prompt_tokens_total`` / ``generation_tokens_total`` / ``num_preemptions_total`` / ``prefix_cache_hits_total`` | counter | replica (engine stats) |
| ``replica_healthy`` | gauge | replica (engine stats) |
| ``request_success_total{finished_reason}`` | counter | replica, per prompt (stop, length, abort) |
| ``request_failure_total{reason}`` | counter | replica, per prompt refused or failed (error type) |
| ``time_to_first_token_seconds``, ``time_per_output_token_seconds``, ``e2e_request_latency_seconds`` | histogram | replica, per prompt |
| ``request_prompt_tokens`` / ``request_generation_tokens`` | histogram | replica, per prompt |
| ``http_requests_total{route,status}``, ``http_request_duration_seconds{route}`` | counter, histogram | front end |
| ``http_request_errors_total{route,code}`` | counter | front end, per HTTP request answered with an error (its body's ``code``) |
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from ..generation.response import FinishReason
from ..wire.types import ReplicaStats

log = logging.getLogger(__name__)

PREFIX = "mii_server:"
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's name; read once, when it loads

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
    20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


ENGINE_LABELS = ["model_name", "replica"]


class EngineStatsCollector:
    """Exports engine gauges and counters read at scrape time from ``source()`` (one entry per replica:
    a replica's own stats).

    Counters read from the engine's own totals are exact: they cannot drift from what the engine did.
    ``source`` raising (load balancer unreachable) yields no samples rather than failing the scrape.
    """

    def __init__(self, source: Callable[[], Iterable[ReplicaStats]]) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return []  # why: unchecked registration (the source may need the network)

    def collect(self) -> Iterator[Metric]:
        try:
            replicas = list(self._source())
        except Exception as err:  # noqa: BLE001 - a scrape must not fail because a peer is down
            log.warning("metrics: cannot read engine stats: %s", err)
            replicas = []
        gauges = {
            "num_requests_running": "Requests in model execution batches.",
            "num_requests_waiting": "Requests waiting to be admitted (new or preempted).",
            "kv_cache_blocks_used": "KV cache blocks in use.",
            "kv_cache_num_blocks": "KV cache blocks allocated (used and free).",
            "kv_cache_usage_perc": "KV cache usage; 1 means 100 percent.",
            "replica_healthy": "1 when the replica's engine is loaded and routable.",
        }
        counters = {
            "prompt_tokens": "Prompt tokens of requests accepted.",
            "generation_tokens": "Tokens generated.",
            "num_preemptions": "Requests preempted for want of KV blocks.",
            "prefix_cache_hits": "Prompt tokens served from the prefix cache instead of computed.",
        }
        g = {k: GaugeMetricFamily(PREFIX + k, doc, labels=ENGINE_LABELS) for k, doc in gauges.items()}
        c = {k: CounterMetricFamily(PREFIX + k, doc, labels=ENGINE_LABELS) for k, doc in counters.items()}
        for s in replicas:
            label = [s.model_name, str(s.replica_index)]
            used = s.total_blocks - s.free_blocks
            g["num_requests_running"].add_metric(label, s.running)
            g["num_requests_waiting"].add_metric(label, s.waiting)
            g["kv_cache_blocks_used"].add_metric(label, used)
            g["kv_cache_num_blocks"].add_metric(label, s.total_blocks)
            g["kv_cache_usage_perc"].add_metric(label, used / s.total_blocks if s.total_blocks else 0.0)
            g["replica_healthy"].add_metric(label, 1.0 if s.healthy else 0.0)
            c["prompt_tokens"].add_metric(label, s.prompt_tokens)
            c["generation_tokens"].add_metric(label, s.generated_tokens)
            c["num_preemptions"].add_metric(label, s.preemptions)
            c["prefix_cache_hits"].add_metric(label, s.cached_prompt_tokens)
        yield from g.values()
        yield from c.values()


@dataclass
class _Timing:
    """Clock readings of one prompt on the replica."""

    submitted: float
    first_token: float | None = None


class ReplicaMetrics:
    """Per-prompt histograms and outcome counters of one replica, fed by ``observe``. ``model_name`` (a
    label of every series) may be set until the first observation: the replica learns it at load."""

    def __init__(self, replica_index: int, registry: CollectorRegistry | None = None, model_name: str = "") -> None:
        self.registry = registry or CollectorRegistry()
        self.replica = str(replica_index)
        self.model_name = model_name
        r = self.registry
        self.success = Counter(
            PREFIX + "request_success",
            "Finished prompts by finish reason.",
            [*ENGINE_LABELS, "finished_reason"],
            registry=r,
        )
        self.failure = Counter(
            PREFIX + "request_failure",
            "Prompts refused or failed on this replica, by error type.",
            [*ENGINE_LABELS, "reason"],
            registry=r,
        )

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, ENGINE_LABELS, buckets=buckets, registry=r)

        self.ttft = histogram("time_to_first_token_seconds", "Submit to first generated token.", TTFT_BUCKETS)
        self.tpot = histogram(
            "time_per_output_token_seconds", "Mean time per output token after the first, per request.", TPOT_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Submit to last token.", E2E_BUCKETS)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.gen_len = histogram("request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)

    def start(self) -> _Timing:
        return _Timing(submitted=time.monotonic())

    def _labels(self) -> tuple[str, str]:
        return self.model_name, self.replica

    def failed(self, exc: BaseException) -> None:
        self.failure.labels(*self._labels(), type(exc).__name__).inc()

    def observe(self, timing: _Timing, update: Any) -> None:
        """Record one engine update of a prompt (runs on the batching thread, before the RPC sees it)."""
        now = time.monotonic()
        response = update.response
        if update.error is not None:
            self.failed(update.error)
            return
        if response is None:
            return
        if timing.first_token is None and response.generated_length > 0:
            timing.first_token = now
            self.ttft.labels(*self._labels()).observe(now - timing.submitted)
        if response.finish_reason is FinishReason.NONE:
            return
        labels = self._labels()
        self.success.labels(*labels, response.finish_reason.value).inc()
        self.e2e.labels(*labels).observe(now - timing.submitted)
        self.prompt_len.labels(*labels).observe(response.prompt_length)
        self.gen_len.labels(*labels).observe(response.generated_length)
        if timing.first_token is not None and response.generated_length > 1:
            self.tpot.labels(*labels).observe(
                (now - timing.first_token) / (response.generated_length - 1)
            )


class HttpMetrics:
    """What a front end counts about its own HTTP traffic, in its own registry (no engine series: those
    are the replicas')."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            PREFIX + "http_requests", "HTTP requests by route and status.", ["route", "status"], registry=r
        )
        self.duration = Histogram(
            PREFIX + "http_request_duration_seconds",
            "HTTP request start to last byte (streams included).",
            ["route"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            PREFIX + "http_request_errors",
            "HTTP requests answered with an error (or whose client left), by route and error code.",
            ["route", "code"],
            registry=r,
        )

    def finished(self, route: str, status: int, seconds: float, code: str = "") -> None:
        self.requests.labels(route, str(status)).inc()
        self.duration.labels(route).observe(seconds)
        if code:
            self.errors.labels(route, code).inc()

    def exposition(self) -> tuple[bytes, str]:
        """This front end's series, and their content type. Under ``PROMETHEUS_MULTIPROC_DIR`` (the
        supervisor's processes of one HTTP front end, which share one port, so a scrape reaches any one
        of them) they are summed over every process that wrote there, from the files prometheus-client
        keeps."""
        directory = os.environ.get(MULTIPROCESS_DIR_ENV)
        if not directory:
            return exposition(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=directory)
        return exposition(merged)


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry in Prometheus text format, and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


def start_metrics_server(
    host: str, port: int, registry: CollectorRegistry, health: Callable[[], tuple[bool, dict[str, Any]]]
) -> ThreadingHTTPServer:
    """Serve ``GET /metrics`` and ``GET /health`` (200 or 503 from ``health()``) on a daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, ctype, status = *exposition(registry), 200
            elif path == "/health":
                ok, detail = health()
                body, ctype, status = json.dumps(detail).encode(), "application/json", 200 if ok else 503
            else:
                body, ctype, status = b'{"error": "not found"}', "application/json", 404
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("metrics http: " + fmt, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
