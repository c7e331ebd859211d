"""Per-step timeline of a GenerationLoop on CUDA: where each iteration's wall time goes.

``StepTimeline(loop)`` wraps, for as long as it is active, the loop's ``step``, its scheduler's
``schedule`` and its executor's ``execute``. For every iteration it records the wall time, the host
time spent scheduling and launching, and the GPU time of the forward (CUDA events around
``execute``: on an otherwise idle stream the first fires at once, so the span is the forward's GPU
work plus any launch gaps; when the loop overlaps steps, a step's GPU time starts where the previous
one's ends, if that is later). ``summary`` groups the iterations by kind (decode-only or mixed, by
batch width) and gives means per step. Nothing in the package is changed; the wrappers are undone
on exit.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Self

import torch


@dataclass
class StepRecord:
    seqs: int = 0
    tokens: int = 0
    wall_ms: float = 0.0
    schedule_ms: float = 0.0
    execute_host_ms: float = 0.0
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    gpu_ms: float = field(default=0.0)


class StepTimeline:
    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.records: list[StepRecord] = []
        self._current: StepRecord | None = None

    def __enter__(self) -> Self:
        loop, scheduler, executor = self.loop, self.loop.scheduler, self.loop.executor
        self._originals = (loop.step, scheduler.schedule, executor.execute)
        step, schedule, execute = self._originals

        def timed_step() -> None:
            self._current = StepRecord()
            start = time.perf_counter()
            step()
            self._current.wall_ms = (time.perf_counter() - start) * 1e3
            if self._current.seqs:
                self.records.append(self._current)

        def timed_schedule() -> Any:
            start = time.perf_counter()
            out = schedule()
            if self._current is not None:
                self._current.schedule_ms += (time.perf_counter() - start) * 1e3
            return out

        def timed_execute(s: Any) -> Any:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start = time.perf_counter()
            begin.record()
            out = execute(s)
            end.record()
            if self._current is not None:
                self._current.execute_host_ms += (time.perf_counter() - start) * 1e3
                self._current.seqs, self._current.tokens = len(s.uids), s.num_tokens
                self._current.events = (begin, end)
            return out

        loop.step, scheduler.schedule, executor.execute = timed_step, timed_schedule, timed_execute
        self._base = torch.cuda.Event(enable_timing=True)
        self._base.record()
        return self

    def __exit__(self, *exc: object) -> None:
        # the wrappers were set as instance attributes: deleting them uncovers the class methods
        for obj, name in ((self.loop, "step"), (self.loop.scheduler, "schedule"), (self.loop.executor, "execute")):
            delattr(obj, name)
        torch.cuda.synchronize()
        previous_end = 0.0
        for rec in self.records:
            if rec.events is not None:
                begin, end = (self._base.elapsed_time(e) for e in rec.events)
                rec.gpu_ms = end - max(begin, previous_end)
                previous_end = end
                rec.events = None

    def summary(self) -> dict[str, dict[str, float]]:
        """Mean per-step figures for each kind of step: 'decode_<width band>' or 'mixed'."""
        groups: dict[str, list[StepRecord]] = defaultdict(list)
        for rec in self.records:
            if rec.tokens == rec.seqs:
                band = 1 if rec.seqs == 1 else 2 ** (rec.seqs - 1).bit_length()
                groups[f"decode_le{band}"].append(rec)
            else:
                groups["mixed"].append(rec)
        out = {}
        for name, recs in sorted(groups.items()):
            wall = statistics.fmean(r.wall_ms for r in recs)
            gpu = statistics.fmean(r.gpu_ms for r in recs)
            out[name] = {
                "steps": len(recs),
                "total_s": round(sum(r.wall_ms for r in recs) / 1e3, 3),
                "mean_seqs": round(statistics.fmean(r.seqs for r in recs), 1),
                "wall_ms": round(wall, 3),
                "gpu_ms": round(gpu, 3),
                "schedule_ms": round(statistics.fmean(r.schedule_ms for r in recs), 3),
                "execute_host_ms": round(statistics.fmean(r.execute_host_ms for r in recs), 3),
                # wall time per step the device had no work (the host was the bottleneck); of the means,
                # since with overlapped steps one step's GPU time can show up in its neighbour's
                "device_idle_ms": round(max(0.0, wall - gpu), 3),
            }
        return out
