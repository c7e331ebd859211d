"""Figures of one serving run from its requests' results (vLLM ``benchmark_serving``'s definitions),
and the compact table ``serving_benchmark.py`` prints.

- duration: from the run's start to the end of its last request;
- output tok/s: output tokens of the successful requests over the duration; requests/s likewise;
- TTFT: send to first output chunk; TPOT: per request, (latency - TTFT) / (output tokens - 1);
  ITL: every gap between two output chunks of a stream, pooled over the run; E2E: send to end;
- peak open: the most requests in flight at once (what a concurrency sweep is meant to hold);
- client CPU: per client process, CPU seconds over the run's wall time (1.0 = one core busy).
"""

from __future__ import annotations

import math
from typing import Any

from serving_clients import JobResult, RequestResult

FIRST_ERRORS = 5  # distinct messages kept per run
SATURATED = 0.9  # of a core: a client process this busy may be the bottleneck


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile of ``values`` (linear between ranks, as numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution_ms(values: list[float]) -> dict[str, float | None]:
    """Mean, p50 and p99 of ``values`` (seconds) in milliseconds."""
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": 1e3 * sum(values) / len(values), "p50": 1e3 * percentile(values, 50),
            "p99": 1e3 * percentile(values, 99)}  # fmt: skip


def peak_open(results: list[RequestResult]) -> int:
    """The most requests open at one instant."""
    events = sorted([(r.sent, 1) for r in results] + [(r.sent + (r.latency or 0.0), -1) for r in results])
    peak = now = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def summarize(jobs: list[JobResult]) -> dict[str, Any]:
    """The run's figures from every client process's results."""
    results = [r for job in jobs for r in job.results]
    ok = [r for r in results if not r.error]
    duration = max((r.sent + (r.latency or 0.0) for r in results), default=0.0)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in ok)
    errors = [r.error for r in results if r.error]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    cpu = [job.cpu_s / job.wall_s for job in jobs if job.wall_s > 0]
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(errors),
        "first_errors": list(dict.fromkeys(errors))[:FIRST_ERRORS],
        "duration_s": duration,
        "planned_input_tokens": sum(r.input_len for r in results),
        "planned_output_tokens": sum(r.output_len for r in results),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "cached_prompt_tokens": sum(cached) if cached else None,
        "output_tok_s": out_tokens / duration if duration else 0.0,
        "total_tok_s": (in_tokens + out_tokens) / duration if duration else 0.0,
        "requests_s": len(ok) / duration if duration else 0.0,
        "peak_open": peak_open(results),
        "ttft_ms": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution_ms(
            [
                (r.latency - r.ttft) / (r.output_tokens - 1)
                for r in ok
                if r.output_tokens > 1 and r.ttft is not None
            ]
        ),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl]),
        "e2e_ms": distribution_ms([r.latency for r in ok if r.latency is not None]),
        "client_processes": len(jobs),
        "client_cpu_cores": {
            "max": max(cpu, default=0.0),
            "mean": sum(cpu) / len(cpu) if cpu else 0.0,
            "total": sum(cpu),
        },
    }


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _pair(dist: dict[str, float | None], digits: int = 0) -> str:
    return f"{_num(dist['p50'], digits)}/{_num(dist['p99'], digits)}"


COLUMNS = ("run", "ok/err", "out tok/s", "vs pipe", "req/s", "TTFT p50/p99 ms", "TPOT p50/p99", "ITL p50/p99",
           "open", "client CPU", "server CPU")  # fmt: skip


def table_row(run: dict[str, Any]) -> list[str]:
    """One run as the table's cells (``run``: a summary plus name, ratio and server CPU)."""
    cpu = run["client_cpu_cores"]
    client = f"{cpu['max']:.2f} max{' SAT' if cpu['max'] > SATURATED else ''}"
    server = run.get("server_cpu_cores") or {}
    busiest = max(server.items(), key=lambda kv: kv[1], default=None)
    return [
        run["name"], f"{run['completed']}/{run['errors']}", _num(run["output_tok_s"]),
        "-" if run.get("ratio_vs_pipeline") is None else f"{run['ratio_vs_pipeline']:.2f}x",
        _num(run["requests_s"], 1), _pair(run["ttft_ms"]), _pair(run["tpot_ms"], 1), _pair(run["itl_ms"], 1),
        str(run["peak_open"]), client, "-" if busiest is None else f"{busiest[0]} {busiest[1]:.2f}",
    ]  # fmt: skip


def format_table(rows: list[list[str]], header: tuple[str, ...] = COLUMNS) -> str:
    """Columns padded to their widest cell."""
    cells = [list(header), *rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
