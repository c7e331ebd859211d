"""End-to-end GPU benchmark: a Llama-3-8B-shaped model with random bf16 weights, ours vs transformers.

One command, one run (issue 5): writes the checkpoint once (random weights made on the GPU, saved as
sharded safetensors with a 128,256-word tokenizer), then measures

1. throughput: 256 requests x 512 prompt tokens x 256 generated, all submitted at once (tokens/s);
2. latency: one 512-token prompt generating 256 tokens (ms per output token);
3. variable: 512 requests, prompts uniform in [64, 2048], outputs uniform in [32, 512] (tokens/s,
   time to first token p50 / p99, preemptions);
4. kernels: the paged-attention micro-benchmarks of ``bench/kernels_bench.py``;
5. batches (only when named in ``--only``): decode steps at ``--decode-batches`` sequences of 512-token
   prompts, 128 new tokens each (ms a step, twice: the middle rows between batch 1 and throughput);

and the same model in transformers ``generate`` as the baseline (kept short: generation times at two
lengths, extrapolated linearly to 256 tokens). Every figure is printed beside its roofline and as a
ratio. The roofline of scenarios 1 and 3 is the issue's: prefill at the bf16 compute floor, decode
steps at the HBM floor of their weight and KV reads. Beside it, ``compute_aware_roofline`` also
counts, for each decode step wide enough that its products are compute-bound, the compute floor's
excess over the weight read. Greedy decoding and ignore_eos everywhere (random weights give random
tokens).

    PYTHONPATH=$PWD python3 bench/gpu_benchmark.py [--only throughput latency] [--no-hf] [--profile]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoints import LLAMA3_8B, write_random_llama
from step_timeline import StepTimeline

HBM_BYTES_PER_S = 4.24e12  # measured device-to-device copy rate on the H200 (docs/BENCHMARKS.md)
BF16_FLOPS = 790e12  # measured dense bf16 matmul rate on the H200

SHAPE = LLAMA3_8B
SCENARIOS = ("kernels", "throughput", "latency", "variable")
EXTRA_SCENARIOS = ("batches",)  # run only when named in --only
RESULTS: list[dict[str, Any]] = []
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only for a smoke test at a tiny shape


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def report(name: str, **fields: Any) -> None:
    row = {"bench": name, **{k: round(v, 4) if isinstance(v, float) else v for k, v in fields.items()}}
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


# ---- rooflines -----------------------------------------------------------------------------------

LAYER_PARAMS = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
BODY_PARAMS = 32 * LAYER_PARAMS  # every weight a token's forward multiplies, but the LM head
HEAD_PARAMS = 128256 * 4096
KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head dim x bf16
# bytes a body weight takes per quantization_mode (scales are under 0.1% more); the LM head stays bf16
BODY_BYTES_PER_PARAM = {None: 2, "fp8": 1, "int8": 1, "wf6af16": 0.75}
# the issues' batch-1 targets on the H200, ms per token (issue 18: bf16; issue 14: fp8)
LATENCY_TARGET_MS = {None: 4.2, "fp8": 2.6}


def prefill_seconds(prompt_lens: list[int]) -> float:
    """bf16 compute floor of prefilling these prompts (matmuls + causal attention, LM head once each)."""
    flops = sum(2 * BODY_PARAMS * n + 2 * HEAD_PARAMS + 32 * 4 * 4096 * n * n / 2 for n in prompt_lens)
    return flops / BF16_FLOPS


def decode_seconds(prompt_lens: list[int], output_lens: list[int]) -> float:
    """HBM floor of the decode steps: each step reads every weight but the embedding once, and every
    running sequence's KV cache (steps = the longest output; each token past the first is one step)."""
    steps = max(output_lens) - 1
    weights = (BODY_PARAMS + HEAD_PARAMS) * 2 * steps
    kv = sum(KV_BYTES_PER_TOKEN * sum(p + j for j in range(1, o)) for p, o in zip(prompt_lens, output_lens))
    return (weights + kv) / HBM_BYTES_PER_S


def decode_compute_excess_seconds(output_lens: list[int]) -> float:
    """What ``decode_seconds`` leaves out: at a wide batch a decode step's products are bound by
    compute, not by reading the weights. Summed over the steps (batch = the sequences still
    generating), the time the bf16 compute floor of those products exceeds their weight-read floor."""
    weight_read = (BODY_PARAMS + HEAD_PARAMS) * 2 / HBM_BYTES_PER_S
    excess = 0.0
    for step in range(1, max(output_lens)):
        batch = sum(1 for o in output_lens if o > step)
        excess += max(0.0, 2 * (BODY_PARAMS + HEAD_PARAMS) * batch / BF16_FLOPS - weight_read)
    return excess


# ---- transformers baseline -----------------------------------------------------------------------


def hf_generate_seconds(model: Any, batch: int, prompt: int, new: int) -> float:
    ids = torch.randint(3, model.config.vocab_size - 1, (batch, prompt), device=DEVICE)
    sync()
    start = time.perf_counter()
    model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
        do_sample=False, pad_token_id=2,
    )  # fmt: skip
    sync()
    return time.perf_counter() - start


def run_hf(path: Path, args: argparse.Namespace) -> dict[str, float]:
    """transformers generate on the same weights: a few short runs, extrapolated to 256 tokens."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.bfloat16, device_map=DEVICE if DEVICE == "cuda" else None
    ).eval()
    report("hf_loaded", seconds=time.perf_counter() - start)
    out: dict[str, float] = {}
    with torch.inference_mode():
        hf_generate_seconds(model, 2, 64, 4)  # warm-up
        if "throughput" in args.only:
            b, short, long_ = args.hf_batch, 16, args.hf_tokens
            # why a second warm-up at this shape: the first call at a new batch shape is slower (on the
            # H200 a 16-token call took 3.1 s, the 32-token one after it 2.1: a negative extrapolation)
            hf_generate_seconds(model, b, 512, short)
            t_short = hf_generate_seconds(model, b, 512, short)
            t_long = hf_generate_seconds(model, b, 512, long_)
            t256 = t_long + (t_long - t_short) * (256 - long_) / (long_ - short)
            if t_long > t_short:  # else the two runs measured noise, not the per-token cost
                out["throughput"] = b * 256 / t256
            report("hf_throughput", batch=b, prompt=512, measured_new_tokens=[short, long_],
                   measured_s=[t_short, t_long], extrapolated_s_for_256=t256,
                   output_tokens_per_s=out.get("throughput"))  # fmt: skip
        if "latency" in args.only:
            t_short = hf_generate_seconds(model, 1, 512, 16)
            t_long = hf_generate_seconds(model, 1, 512, 16 + args.hf_tokens)
            out["latency_ms"] = (t_long - t_short) / args.hf_tokens * 1e3
            report("hf_latency", prompt=512, ms_per_token=out["latency_ms"])
    del model
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


# ---- our engine ----------------------------------------------------------------------------------


class Tracker:
    """Sink for many requests: time of first update, time of last, tokens (and their ids)."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.done: dict[int, float] = {}
        self.tokens: dict[int, int] = {}
        self.times: dict[int, list[float]] = {}
        self.token_ids: dict[int, list[int]] = {}

    def __call__(self, update: Any) -> None:
        now = time.perf_counter()
        if update.error is not None:
            raise update.error
        self.first.setdefault(update.uid, now)
        self.times.setdefault(update.uid, []).append(now)
        self.tokens[update.uid] = self.tokens.get(update.uid, 0) + len(update.response.token_ids)
        self.token_ids.setdefault(update.uid, []).extend(update.response.token_ids)
        if update.finished:
            self.done[update.uid] = now

    def ms_per_step(self) -> float:
        """Milliseconds between the first request's updates, its first token to its last: a decode
        step's time when every request runs in the same steps."""
        times = next(iter(self.times.values()))
        return (times[-1] - times[0]) / (len(times) - 1) * 1e3


def drive(loop: Any, prompts: list[list[int]], outputs: list[int]) -> tuple[float, Tracker, dict[int, float]]:
    """Submit every prompt at once and step the loop until all finish; returns (seconds, tracker,
    submit time per uid)."""
    from mii_server.generation.params import GenerateParams

    tracker = Tracker()
    requests = [
        loop.prepare(
            p, GenerateParams.from_kwargs(max_new_tokens=o, ignore_eos=True, do_sample=False), tracker
        )
        for p, o in zip(prompts, outputs)
    ]
    sync()
    start = time.perf_counter()
    loop.enqueue(requests)
    while loop.has_work():
        loop.step()
    sync()
    seconds = time.perf_counter() - start
    assert len(tracker.done) == len(requests), "not every request finished"
    assert all(tracker.tokens[r.uid] == o for r, o in zip(requests, outputs)), "wrong token counts"
    return seconds, tracker, {r.uid: start for r in requests}


def random_prompts(rng: torch.Generator, lens: list[int], vocab: int | None = None) -> list[list[int]]:
    """Random token ids of ``lens`` lengths; ``vocab`` defaults to ``SHAPE``'s as it is at the call (a
    caller may set a smaller shape, as ``quantization_bench.py --tiny`` does)."""
    vocab = vocab or SHAPE["vocab_size"]
    return [torch.randint(3, vocab - 1, (n,), generator=rng).tolist() for n in lens]


def ratio(ours: float, theirs: float | None) -> float | None:
    return None if not theirs else ours / theirs


def start_ours(path: Path, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(config, runtime, loop) of our engine on ``path`` in bf16, with the benchmark's settings
    (``args``: no_graphs, batch_tokens, reserve_gb, quantization_mode)."""
    from mii_server import gc_heap
    from mii_server.config import ModelConfig
    from mii_server.runtime import build_loop, build_runtime

    config = ModelConfig(
        model_name_or_path=str(path), dtype="bfloat16", device=DEVICE, cuda_graphs=not args.no_graphs,
        max_ragged_batch_size=args.batch_tokens, max_ragged_sequence_count=512, max_tracked_sequences=2048,
        kv_cache={"reserve_bytes": int(args.reserve_gb * 1e9)}, quantization_mode=args.quantization_mode,
    )  # fmt: skip
    runtime = build_runtime(config)
    loop = build_loop(config, runtime)
    gc_heap.freeze_startup_heap("benchmark")  # as pipeline() and the replica run the engine
    return config, runtime, loop


def run_ours(path: Path, args: argparse.Namespace, hf: dict[str, float]) -> None:
    start = time.perf_counter()
    config, runtime, loop = start_ours(path, args)
    engine = runtime.engine
    graphs = engine.cuda_graphs
    free, _ = torch.cuda.mem_get_info() if DEVICE == "cuda" else (0, 0)
    report("ours_loaded", seconds=time.perf_counter() - start, kv_blocks=engine.total_blocks,
           block_size=engine.block_size, kv_gib=engine.total_blocks * engine.block_size * KV_BYTES_PER_TOKEN / 2**30,
           graph_rungs=None if graphs is None else graphs.batch_sizes,
           graph_pool_mib=None if graphs is None else graphs.pool_bytes / 2**20,
           graph_replay_ms=None if graphs is None else {n: round(ms, 3) for n, ms in graphs.replay_ms.items()},
           graph_reroutes=None if graphs is None else {n: q for n, q in graphs.routes.items() if q != n},
           free_mib_after=free / 2**20, allocated_mib=torch.cuda.memory_allocated() / 2**20,
           reserved_mib=torch.cuda.memory_reserved() / 2**20, config=config.model_dump(exclude={"kv_cache"}))  # fmt: skip
    rng = torch.Generator().manual_seed(0)
    # warm-up: compile the eager kernels for the batch shapes Triton specialises on (1, 16k, other)
    drive(loop, random_prompts(rng, [600, 37, 1100, 5]), [20, 9, 3, 40])
    drive(loop, random_prompts(rng, [40] * 16), [4] * 16)
    drive(loop, random_prompts(rng, [300]), [2])

    if "throughput" in args.only:
        n, p, o = 256, 512, 256
        with StepTimeline(loop) as timeline:
            seconds, _, _ = drive(loop, random_prompts(rng, [p] * n), [o] * n)
        report("throughput_timeline", **timeline.summary())
        tps = n * o / seconds
        floor = prefill_seconds([p] * n) + decode_seconds([p] * n, [o] * n)
        compute_aware = n * o / (floor + decode_compute_excess_seconds([o] * n))
        report("throughput", requests=n, prompt=p, output=o, seconds=seconds, output_tokens_per_s=tps,
               roofline_tokens_per_s=n * o / floor, frac_roofline=tps / (n * o / floor),
               compute_aware_roofline_tokens_per_s=compute_aware, frac_compute_aware=tps / compute_aware,
               target=10000, vs_hf=ratio(tps, hf.get("throughput")), hf_tokens_per_s=hf.get("throughput"),
               preemptions=loop.scheduler.num_preemptions)  # fmt: skip

    if "latency" in args.only:
        per_token = []
        for _ in range(2):  # the first run warms up whatever the throughput run did not
            with StepTimeline(loop) as timeline:
                _, tracker, _ = drive(loop, random_prompts(rng, [512]), [256])
            per_token.append(tracker.ms_per_step())
        weight_bytes = BODY_PARAMS * BODY_BYTES_PER_PARAM[args.quantization_mode] + HEAD_PARAMS * 2
        floor_ms = weight_bytes / HBM_BYTES_PER_S * 1e3  # the H200's: on another device, compare runs only
        ms = per_token[-1]
        report("latency_timeline", **timeline.summary())
        report("latency", prompt=512, output=256, ms_per_token=ms, warmup_ms_per_token=per_token[0],
               floor_ms=floor_ms, frac_floor=floor_ms / ms, target_ms=LATENCY_TARGET_MS.get(args.quantization_mode),
               hf_ms_per_token=hf.get("latency_ms"), speedup_vs_hf=ratio(hf.get("latency_ms", 0.0), ms))  # fmt: skip
        if graphs is not None and args.compare_eager:
            engine.use_cuda_graphs = False
            _, tracker, _ = drive(loop, random_prompts(rng, [512]), [256])
            engine.use_cuda_graphs = True
            report("latency_eager", ms_per_token=tracker.ms_per_step())

    if "batches" in args.only:
        for batch in args.decode_batches:
            ms = []
            for _ in range(2):  # the first run warms up what the other scenarios did not
                _, tracker, _ = drive(loop, random_prompts(rng, [512] * batch), [128] * batch)
                ms.append(tracker.ms_per_step())
            report("decode_batch", batch=batch, prompt=512, output=128, ms_per_step=ms[-1],
                   warmup_ms_per_step=ms[0], output_tokens_per_s=batch / ms[-1] * 1e3)  # fmt: skip

    if "variable" in args.only:
        vrng = torch.Generator().manual_seed(1)
        n = 512
        plens = torch.randint(64, 2049, (n,), generator=vrng).tolist()
        olens = torch.randint(32, 513, (n,), generator=vrng).tolist()
        pre = loop.scheduler.num_preemptions
        with StepTimeline(loop) as timeline:
            seconds, tracker, submitted = drive(loop, random_prompts(vrng, plens), olens)
        report("variable_timeline", **timeline.summary())
        ttft = sorted(tracker.first[uid] - submitted[uid] for uid in submitted)
        tps = sum(olens) / seconds
        floor = prefill_seconds(plens) + decode_seconds(plens, olens)
        compute_aware = sum(olens) / (floor + decode_compute_excess_seconds(olens))
        report("variable", requests=n, prompt_tokens=sum(plens), output_tokens=sum(olens), seconds=seconds,
               output_tokens_per_s=tps, roofline_tokens_per_s=sum(olens) / floor,
               frac_roofline=tps / (sum(olens) / floor), compute_aware_roofline_tokens_per_s=compute_aware,
               frac_compute_aware=tps / compute_aware, ttft_p50_s=statistics.median(ttft),
               ttft_p99_s=ttft[int(0.99 * (n - 1))], ttft_max_s=ttft[-1],
               preemptions=loop.scheduler.num_preemptions - pre)  # fmt: skip

    if args.compare_sync:
        loop.overlap = False
        n, p, o = 256, 512, 256
        seconds, _, _ = drive(loop, random_prompts(rng, [p] * n), [o] * n)
        report("throughput_sync", output_tokens_per_s=n * o / seconds, seconds=seconds)
        _, tracker, _ = drive(loop, random_prompts(rng, [512]), [256])
        report("latency_sync", ms_per_token=tracker.ms_per_step())
        loop.overlap = True

    if args.profile:
        profile(loop, rng, args.profile_cases)


PROFILE_CASES = {
    "batch1": ([512], [65]),
    "batch256_512in_32out": ([512] * 256, [32] * 256),
    # minus the case above: 64 decode-only steps at batch 256, context ~550-610
    "batch256_512in_96out": ([512] * 256, [96] * 256),
}


DECODE_STEPS_BETWEEN = 96 - 32  # decode-only steps the 96-token case runs beyond the 32-token one


def profile(loop: Any, rng: torch.Generator, names: list[str]) -> None:
    """torch.profiler over (a) batch-1 decode and (b) 256-wide decode with prefill, at two output
    lengths: kernel time by name, and GPU-busy time against wall time (the difference is host
    overhead between kernels). With both 256-wide cases, their difference per step is the kernel
    breakdown of one decode-only step at batch 256 (``profile_batch256_decode_step``)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    kernels: dict[str, dict[str, tuple[float, int]]] = {}  # case -> kernel -> (device ms, launches)
    for case in names:
        name, (plens, olens) = f"profile_{case}", PROFILE_CASES[case]
        prompts = random_prompts(rng, plens)
        if case == "batch1":
            drive(loop, prompts, olens)  # same shapes once before the profiled run
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            seconds, _, _ = drive(loop, prompts, olens)
        rows = prof.key_averages()

        def device_us(e: Any) -> float:
            return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))

        # kernels and copies only: CPU-side ops (aten::mm, ...) carry their kernels' time again
        busy = sum(device_us(e) for e in rows if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
        top = sorted(rows, key=device_us, reverse=True)[:32]
        report(name, wall_s=seconds, gpu_busy_s=busy, gpu_busy_frac=busy / seconds,
               top_kernels=[(e.key[:60], round(device_us(e) / 1e3, 2), e.count) for e in top])  # fmt: skip
        on_device = (e for e in rows if e.device_type == torch.autograd.DeviceType.CUDA)
        kernels[case] = {e.key[:60]: (device_us(e) / 1e3, e.count) for e in on_device}
    short, long = kernels.get("batch256_512in_32out"), kernels.get("batch256_512in_96out")
    if short is not None and long is not None:
        per_step = []
        for key, (ms, count) in long.items():
            ms_short, count_short = short.get(key, (0.0, 0))
            per_step.append((key, round((ms - ms_short) / DECODE_STEPS_BETWEEN, 3),
                             round((count - count_short) / DECODE_STEPS_BETWEEN, 2)))  # fmt: skip
        per_step = sorted((r for r in per_step if abs(r[1]) >= 0.005), key=lambda r: -r[1])
        report("profile_batch256_decode_step", ms_per_step=sum(r[1] for r in per_step),
               kernels_ms_and_launches_per_step=per_step)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", nargs="+", choices=SCENARIOS + EXTRA_SCENARIOS, default=list(SCENARIOS), help="scenarios to run"
    )
    parser.add_argument(
        "--decode-batches", type=int, nargs="+", default=[16, 24, 32, 48, 64],
        help="sequences of the batches scenario's decode steps",
    )  # fmt: skip
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--no-graphs", action="store_true", help="run our engine without CUDA graphs")
    parser.add_argument(
        "--compare-eager", action="store_true", help="also time batch-1 decode with graphs off"
    )
    parser.add_argument(
        "--profile", action="store_true", help="torch.profiler breakdowns after the scenarios"
    )
    parser.add_argument(
        "--profile-cases", nargs="+", choices=list(PROFILE_CASES), default=list(PROFILE_CASES),
        help="which --profile cases to run",
    )  # fmt: skip
    parser.add_argument(
        "--quantization-mode", choices=["fp8", "int8", "wf6af16"], help="our engine's quantization_mode"
    )
    parser.add_argument(
        "--compare-sync",
        action="store_true",
        help="also run throughput and latency with overlap_scheduling off (each step's tokens read "
        "back before the next is queued)",
    )
    parser.add_argument("--weights", default="/tmp/llama3-8b-random", help="checkpoint directory (made once)")
    parser.add_argument(
        "--batch-tokens", type=int, default=8192,
        help="our max_ragged_batch_size: tokens per step, so the prompt chunk of a prefill step",
    )  # fmt: skip
    parser.add_argument(
        "--hf-batch", type=int, default=128, help="transformers batch for the throughput baseline"
    )
    parser.add_argument(
        "--hf-tokens", type=int, default=48, help="longer of the two transformers generation lengths"
    )
    parser.add_argument(
        "--reserve-gb", type=float, default=1.0, help="our kv_cache.reserve_bytes, in GB (1: the config default)"
    )
    parser.add_argument("--json", help="write every result row to this file")
    args = parser.parse_args()
    os.environ.setdefault("MII_SERVER_PROGRESS", "0")
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("mii_server").setLevel(logging.INFO)
    import transformers

    assert DEVICE == "cuda", "this benchmark needs a CUDA device"
    import triton

    report("machine", device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
           transformers=transformers.__version__, date=time.strftime("%Y-%m-%d"), argv=sys.argv[1:])  # fmt: skip
    if "kernels" in args.only:
        import kernels_bench

        torch.manual_seed(0)
        for block_size in (16, 64):
            kernels_bench.bench_decode(False, block_size)
        kernels_bench.bench_prefill(False, 64)
        torch.cuda.empty_cache()
    start = time.perf_counter()
    path = write_random_llama(Path(args.weights))
    report("checkpoint_ready", seconds=time.perf_counter() - start, path=str(path))
    hf = {} if args.no_hf or not {"throughput", "latency"} & set(args.only) else run_hf(path, args)
    if {"throughput", "latency", "variable", "batches"} & set(args.only):
        run_ours(path, args, hf)
    if args.json:
        Path(args.json).write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
