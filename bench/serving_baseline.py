"""The ``pipeline()`` baseline of ``serving_benchmark.py``: the same engine in one process, every
prompt of a workload in one call, run in a child process of its own so that its device memory is
free again before the deployment starts.

A workload whose outputs all have one length is one ``pipe(prompts, max_new_tokens=n,
ignore_eos=True)`` call, as the issue's 7,770 tok/s row was measured. Outputs of several lengths
cannot share one call's kwargs, so those prompts go to the pipeline's loop all at once, each with
its own length (``gpu_benchmark.drive``: what ``pipe()`` does, with per-prompt params and streamed
text, as the serving runs stream).
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any


@dataclass(frozen=True)
class BaselineWork:
    """One workload for the baseline: its key, prompts and output lengths."""

    key: str
    prompts: list[str]
    output_lens: list[int]


def run_baselines(model: str, model_kwargs: dict[str, Any], works: list[BaselineWork]) -> dict[str, Any]:
    """Load ``model`` with ``pipeline()``, warm it up, time each workload; figures per key."""
    import gpu_benchmark as gb

    import mii_server

    start = time.perf_counter()
    pipe = mii_server.pipeline(model, **model_kwargs)
    loaded_s = time.perf_counter() - start
    greedy = {"ignore_eos": True, "do_sample": False}
    pipe(works[0].prompts[:2], max_new_tokens=4, **greedy)  # first-call costs out of the timed runs
    figures: dict[str, Any] = {"load_s": loaded_s, "workloads": {}}
    for work in works:
        if len(set(work.output_lens)) == 1:
            gb.sync()
            t0 = time.perf_counter()
            replies = pipe(work.prompts, max_new_tokens=work.output_lens[0], **greedy)
            gb.sync()
            seconds, method = time.perf_counter() - t0, "pipe(prompts) in one call"
            tokens = sum(r.generated_length for r in replies)
            assert tokens == sum(work.output_lens), (
                f"pipeline made {tokens} tokens, not {sum(work.output_lens)}"
            )
        else:
            seconds, _, _ = gb.drive(pipe.loop, work.prompts, work.output_lens)  # checks every count
            method, tokens = "every prompt queued at once, each with its length", sum(work.output_lens)
        figures["workloads"][work.key] = {
            "seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "requests_s": len(work.prompts) / seconds, "method": method,
        }  # fmt: skip
        print(
            f"pipeline baseline {work.key}: {tokens / seconds:,.0f} output tok/s ({seconds:.2f} s)",
            flush=True,
        )
    pipe.destroy()
    return figures


def baseline_main(
    model: str, model_kwargs: dict[str, Any], works: list[BaselineWork], conn: Connection
) -> None:
    """Child process entry: send ``("ok", figures)`` or ``("error", message)``."""
    os.environ.setdefault("MII_SERVER_PROGRESS", "0")
    try:
        conn.send(("ok", run_baselines(model, model_kwargs, works)))
    except Exception as err:  # noqa: BLE001 - reported to the parent, which carries on without ratios
        traceback.print_exc()
        conn.send(("error", f"{type(err).__name__}: {err}"))


def measure(model: str, model_kwargs: dict[str, Any], works: list[BaselineWork]) -> dict[str, Any]:
    """Run the baselines in a spawned child; ``{"error": ...}`` if it failed."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=baseline_main, args=(model, model_kwargs, works, child))
    proc.start()
    child.close()
    try:
        status, payload = parent.recv()
    except EOFError:
        status, payload = "error", "the pipeline process died (see its output above)"
    proc.join()
    return payload if status == "ok" else {"error": payload}
