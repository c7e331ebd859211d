"""Serving benchmark (issue 10), modelled on vLLM's ``benchmark_serving``: many independent streaming
callers against a deployment through its OpenAI endpoint, its gRPC client and its REST gateway,
beside ``pipeline()`` on the same workload in the same run.

It starts a deployment (``mii_server.serve(model, enable_openai_api=True, enable_restful_api=True,
**--serve-kwargs)``, every other kwarg at its default), or attaches to a running one
(``--address`` / ``--openai-url`` / ``--rest-url``), and runs, on each front end of ``--frontends``:

(a) a concurrency sweep (``--concurrency``): that many streams open at once, each caller sending its
    next request when its last ends, over ``--num-prompts`` requests (at least one per caller);
(b) Poisson arrivals (``--request-rates`` req/s), open loop.

Inputs are U[128,1024] and outputs U[64,512] tokens by default (``--input-len``, ``--output-len``;
``--fixed 512,256`` for fixed lengths), every output forced to its length (ignore_eos, min_tokens).
Per run: output tok/s, requests/s, TTFT / TPOT / inter-token latency (mean, p50, p99), errors, the
most streams open at once, the client processes' CPU (a saturated load generator shows) and the
deployment's processes' CPU by role; closed-loop runs also print their ratio against ``pipeline()``
with every prompt of the same workload submitted at once (measured first, in a child process, so
the device memory is free for the deployment afterwards). Poisson runs get no ratio: their throughput is
the offered load. Callers run in ``--client-processes`` processes, each with its own event loop and
connections; results are merged here.

    PYTHONPATH=. python3 bench/serving_benchmark.py --preset h200-targets --json $OUT/serving.json
    PYTHONPATH=. python3 bench/serving_benchmark.py --tiny          # CPU: the demo model, seconds
    PYTHONPATH=. python3 bench/serving_benchmark.py --model DIR --frontends openai --fixed 512,256 \\
        --concurrency 256 --request-rates ''
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import process_cpu
from serving_baseline import BaselineWork
from serving_clients import FRONTENDS, ClientPool, RequestSpec, Target, split_jobs
from serving_metrics import format_table, summarize, table_row
from serving_workload import PromptMaker, Workload, parse_range, requests_for

RANDOM_LLAMA = "random-llama3-8b"  # --model value: bench/checkpoints.py's Llama-3-8B shape, random bf16
DEPLOYMENT_NAME = "serving-benchmark"


@dataclass(frozen=True)
class Goal:
    """A figure a run must reach: ``metric`` (a summary key, ``ttft_ms.p50`` for nested) ``op`` ``value``."""

    metric: str
    op: str  # "<=" or ">="
    value: float

    def check(self, run: dict[str, Any]) -> tuple[float | None, bool]:
        found: Any = run
        for part in self.metric.split("."):
            found = found.get(part) if isinstance(found, dict) else None
        if found is None:
            return None, False
        return found, found <= self.value if self.op == "<=" else found >= self.value


@dataclass(frozen=True)
class RunPlan:
    """One run: a front end, a workload, and either ``concurrency`` callers or ``rate`` req/s."""

    frontend: str
    workload: Workload
    concurrency: int = 0
    rate: float = 0.0
    targets: tuple[Goal, ...] = field(default_factory=tuple)
    round: int = 0  # with --repeat: which round of the plan (0: not repeated)

    @property
    def name(self) -> str:
        load = f"c={self.concurrency}" if self.concurrency else f"{self.rate:g} req/s"
        return f"{self.frontend} {load}" + (f" round {self.round}" if self.round else "")


def lower_median(values: list[Any], key: Any = None) -> Any:
    """The middle value (the lower of the two middle ones for an even count): always a measured round."""
    return sorted(values, key=key)[(len(values) - 1) // 2]


def with_rounds(plans: list[RunPlan], rounds: int) -> list[RunPlan]:
    """The closed-loop plans ``rounds`` times over, interleaved (round 1 of every plan, then round 2, ...),
    each round its own plan; open-loop plans run once, after them."""
    closed = [p for p in plans if p.concurrency]
    if rounds <= 1 or not closed:
        return plans
    return [replace(p, round=r + 1) for r in range(rounds) for p in closed] + [
        p for p in plans if not p.concurrency
    ]


def fixed(input_len: int, output_len: int, count: int) -> Workload:
    return Workload((input_len, input_len), (output_len, output_len), count)


def h200_targets() -> list[RunPlan]:
    """Issue 10's GPU targets and table in one invocation (one H200, the 8B shape, serve() defaults)."""
    mixed = Workload((128, 1024), (64, 512), 512)
    return [
        RunPlan(
            "openai", fixed(512, 256, 256), concurrency=256, targets=(Goal("ratio_vs_pipeline", ">=", 0.95),)
        ),
        RunPlan("openai", fixed(512, 256, 1024), concurrency=1024, targets=(Goal("errors", "<=", 0),)),
        RunPlan(
            "openai",
            mixed,
            rate=16.0,
            targets=(
                Goal("ttft_ms.p50", "<=", 150),
                Goal("ttft_ms.p99", "<=", 500),
                Goal("tpot_ms.p50", "<=", 10),
            ),
        ),
        RunPlan("grpc", fixed(512, 256, 512), concurrency=512),
        RunPlan("rest", fixed(512, 256, 256), concurrency=256),
    ]


PRESETS = {"h200-targets": (RANDOM_LLAMA, h200_targets)}
TINY = {"input_len": "8,32", "output_len": "4,16", "num_prompts": 16, "concurrency": "2,8", "request_rates": "16",
        "warmup": 2}  # fmt: skip
DEFAULTS = {"input_len": "128,1024", "output_len": "64,512", "num_prompts": 256, "concurrency": "1,16,64,256,1024",
            "request_rates": "2,4,8,16,32", "warmup": 8}  # fmt: skip


def numbers(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def sweep_plans(args: argparse.Namespace) -> list[RunPlan]:
    """The command line's sweep: every front end x (each concurrency, each rate)."""
    if args.fixed:
        i, o = (parse_range(x) for x in args.fixed.split(","))  # each a one-value range
        lengths = (i, o)
    else:
        lengths = (parse_range(args.input_len), parse_range(args.output_len))
    plans = []
    for frontend in args.frontends:
        for c in numbers(args.concurrency):
            plans.append(
                RunPlan(
                    frontend, Workload(*lengths, max(args.num_prompts, int(c)), args.seed), concurrency=int(c)
                )
            )
        for rate in numbers(args.request_rates):
            plans.append(RunPlan(frontend, Workload(*lengths, args.num_prompts, args.seed), rate=rate))
    return plans


# ---- the model, its tokenizer, the deployment -----------------------------------------------------


def resolve_model(args: argparse.Namespace) -> tuple[str, Path]:
    """(what serve() and pipeline() are given, the checkpoint directory holding the tokenizer)."""
    if args.model == RANDOM_LLAMA:
        import multiprocessing

        from checkpoints import write_random_llama

        # written by a child: drawing the weights on the GPU here would keep memory in this process
        proc = multiprocessing.get_context("spawn").Process(
            target=write_random_llama, args=(Path(args.weights),)
        )
        start = time.perf_counter()
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"writing the checkpoint to {args.weights} failed (exit {proc.exitcode})")
        print(f"checkpoint {args.weights} ready in {time.perf_counter() - start:.0f} s", flush=True)
        return args.weights, Path(args.weights)
    if not args.model:
        from mii_server.config import ModelConfig
        from mii_server.runtime import model_path

        return "", model_path(ModelConfig.from_kwargs(""))
    return args.model, Path(args.model)


def pipeline_kwargs(model: str, serve_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The model's part of the serve() kwargs (what pipeline() takes), MII's nested dicts flattened."""
    from mii_server.config import ModelConfig, merge_mii_config_dicts

    _, flat = merge_mii_config_dicts(model, dict(serve_kwargs))
    return {k: v for k, v in flat.items() if k in ModelConfig.field_names() - {"model_name_or_path"}}


class Deployment:
    """The deployment under test: started here (and torn down by ``close``) or attached to."""

    def __init__(self, args: argparse.Namespace, model: str, serve_kwargs: dict[str, Any]) -> None:
        self.client: Any = None
        self.supervisor_pid: int | None = None
        api_key = args.api_key or os.environ.get("MII_SERVER_API_KEY", "").split(",")[0]
        if args.address or args.openai_url or args.rest_url:
            self.target = Target(args.openai_url.rstrip("/"), args.served_model_name, args.address,
                                 args.rest_url, api_key)  # fmt: skip
            self._wait_attached(args)
            return
        import mii_server
        from mii_server.serving.control import registry
        from mii_server.serving.control.deployment import DeploymentConfig

        kwargs = {"deployment_name": DEPLOYMENT_NAME, **serve_kwargs, "enable_openai_api": True,
                  "enable_restful_api": True}  # fmt: skip
        config = DeploymentConfig.from_kwargs(model, **kwargs)
        start = time.perf_counter()
        self.client = mii_server.serve(model, **kwargs)
        print(f"deployment {config.deployment_name} ready in {time.perf_counter() - start:.0f} s", flush=True)
        record = registry.read(config.deployment_name)
        self.supervisor_pid = None if record is None else record.supervisor_pid
        self.target = Target(config.openai_url or "", config.served_model, config.lb_address, config.rest_url or "",
                             api_key)  # fmt: skip

    def _wait_attached(self, args: argparse.Namespace) -> None:
        """Until every given endpoint answers (and the OpenAI model id is known)."""
        import httpx

        from mii_server.serving.frontends.client import Client

        deadline = time.monotonic() + args.wait_s
        headers = {"Authorization": f"Bearer {self.target.api_key}"} if self.target.api_key else {}
        while True:
            try:
                if self.target.grpc_address:
                    with Client(self.target.grpc_address) as client:
                        if not any(s.healthy for s in client.stats(timeout=5)):
                            raise ConnectionError("no healthy replica yet")
                if self.target.openai_url:
                    models = httpx.get(f"{self.target.openai_url}/models", headers=headers, timeout=5)
                    models.raise_for_status()
                    if not self.target.served_model:
                        self.target = replace(self.target, served_model=models.json()["data"][0]["id"])
                if self.target.rest_url:
                    base = self.target.rest_url.split("/mii/")[0]
                    httpx.get(f"{base}/health", headers=headers, timeout=5).raise_for_status()
                return
            except Exception as err:  # noqa: BLE001 - not up yet: try again until the deadline
                if time.monotonic() > deadline:
                    raise SystemExit(
                        f"the deployment did not answer within {args.wait_s:.0f} s: {err}"
                    ) from None
                time.sleep(1.0)  # polling a server that is starting, bounded by the deadline

    def endpoint(self, frontend: str) -> str:
        """Where ``frontend`` listens ('' when not known)."""
        t = self.target
        return {"openai": t.openai_url, "grpc": t.grpc_address, "rest": t.rest_url}[frontend]

    def roles(self) -> dict[int, str]:
        """pid -> role of the deployment's processes (empty when attached: they may be elsewhere)."""
        return {} if self.supervisor_pid is None else process_cpu.descendant_roles(self.supervisor_pid)

    def close(self) -> None:
        if self.client is not None:
            start = time.perf_counter()
            self.client.terminate_server()
            print(f"deployment stopped in {time.perf_counter() - start:.0f} s", flush=True)
            self.client = None


# ---- runs -----------------------------------------------------------------------------------------


def run_one(pool: ClientPool, deployment: Deployment, frontend: str, requests: list[RequestSpec], callers: int,
            timeout_s: float) -> dict[str, Any]:  # fmt: skip
    """One run through the client processes; its summary with the server's CPU by role."""
    jobs = split_jobs(frontend, deployment.target, requests, callers, pool.size, timeout_s)
    roles = deployment.roles()
    before, start = process_cpu.cpu_seconds(roles), time.monotonic()
    results = pool.run(jobs)
    wall = time.monotonic() - start
    summary = summarize(results)
    summary["server_cpu_cores"] = process_cpu.cores_by_role(
        roles, before, process_cpu.cpu_seconds(roles), wall
    )
    return summary


def baseline_key(workload: Workload) -> str:
    return f"{workload.label} (seed {workload.seed})"


def measure_baselines(
    maker: PromptMaker, model: str, serve_kwargs: dict[str, Any], workloads: list[Workload], seed: int,
    rounds: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """pipeline() on each workload, ``rounds`` times each, rounds interleaved (prompts of their own
    seeds: the baseline's loop caches prefixes too); each workload's figures are its median round's."""
    import serving_baseline

    works = []
    for r in range(rounds):
        for j, w in enumerate(workloads):
            lengths = w.lengths()
            prompts = maker.prompts([i for i, _ in lengths], seed + j + 100 * r)
            works.append(BaselineWork(f"{baseline_key(w)} round {r + 1}", prompts, [o for _, o in lengths]))
    figures = serving_baseline.measure(model, pipeline_kwargs(model, serve_kwargs), works)
    if "workloads" in figures:
        measured = figures["workloads"]
        figures["workloads"] = {}
        for w in workloads:
            each = [measured[f"{baseline_key(w)} round {r + 1}"] for r in range(rounds)]
            median = lower_median(each, key=lambda fig: fig["output_tok_s"])
            figures["workloads"][baseline_key(w)] = {
                **median,
                "rounds_output_tok_s": [f["output_tok_s"] for f in each],
            }
    return figures


def run_plans(
    args: argparse.Namespace, deployment: Deployment, pool: ClientPool, maker: PromptMaker,
    plans: list[RunPlan], requests: list[list[RequestSpec]], baseline: dict[str, Any], seed: int,
) -> Iterator[dict[str, Any]]:  # fmt: skip
    """A warm-up on each front end, then every run in order, each yielded as it ends."""
    frontends = list(dict.fromkeys(p.frontend for p in plans))
    missing = [f for f in frontends if not deployment.endpoint(f)]
    if missing:
        raise SystemExit(f"no address for {', '.join(missing)}: give --address / --openai-url / --rest-url")
    for k, frontend in enumerate(frontends):
        warm = Workload((plans[0].workload.input_range[0],) * 2, (16, 16), args.warmup)
        warm_run = run_one(pool, deployment, frontend, requests_for(maker, warm, seed + k), args.warmup,
                           args.request_timeout)  # fmt: skip
        if warm_run["errors"]:
            raise SystemExit(f"warm-up on {frontend} failed: {warm_run['first_errors']}")
    for plan, reqs in zip(plans, requests):
        summary = run_one(pool, deployment, plan.frontend, reqs, plan.concurrency, args.request_timeout)
        run = finish_run(plan, summary, baseline)
        print_run(run)
        yield run


def main() -> None:
    args = parse_args()
    os.environ.setdefault("MII_SERVER_PROGRESS", "0")
    serve_kwargs = json.loads(args.serve_kwargs)
    model, checkpoint = resolve_model(args)
    plans = PRESETS[args.preset][1]() if args.preset else sweep_plans(args)
    plans = [p for p in plans if p.frontend in args.frontends]
    plans = with_rounds(plans, args.repeat)
    if not plans:
        raise SystemExit("nothing to run: no concurrency, no request rate, or no front end")

    from transformers import AutoTokenizer

    maker = PromptMaker(AutoTokenizer.from_pretrained(str(checkpoint)))
    # why distinct content seeds (runs, baselines, warm-ups): no run may hit another's prefix cache
    seed = args.seed * 1000
    requests = [requests_for(maker, p.workload, seed + i, p.rate or None) for i, p in enumerate(plans)]
    closed = [] if args.no_pipeline else list(dict.fromkeys(p.workload for p in plans if p.concurrency))
    print(f"{len(plans)} runs, {sum(r.output_len for reqs in requests for r in reqs):,} output tokens; "
          f"{len(closed)} pipeline baselines, {sum(o for w in closed for _, o in w.lengths()):,} output tokens",
          flush=True)  # fmt: skip
    baseline = {"skipped": True}
    if closed:
        baseline = measure_baselines(maker, model, serve_kwargs, closed, seed + 500, args.repeat)

    runs: list[dict[str, Any]] = []
    pool = ClientPool(max(1, args.client_processes))
    deployment = None
    try:
        deployment = Deployment(args, model, serve_kwargs)
        runs.extend(run_plans(args, deployment, pool, maker, plans, requests, baseline, seed + 900))
    finally:
        if deployment is not None:
            deployment.close()
        pool.close()
        report(args, baseline, runs)  # also what was measured before a failure


def finish_run(plan: RunPlan, summary: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """The summary with the run's plan, its pipeline ratio and its targets checked."""
    run: dict[str, Any] = {"name": plan.name, "frontend": plan.frontend, "concurrency": plan.concurrency or None,
                           "request_rate": plan.rate or None, "workload": plan.workload.label, "round": plan.round or None,
                           **summary}  # fmt: skip
    pipe = baseline.get("workloads", {}).get(baseline_key(plan.workload)) if plan.concurrency else None
    run["pipeline_output_tok_s"] = None if pipe is None else pipe["output_tok_s"]
    run["ratio_vs_pipeline"] = None if pipe is None else summary["output_tok_s"] / pipe["output_tok_s"]
    run["targets"] = []
    for target in plan.targets:
        value, met = target.check(run)
        run["targets"].append({**asdict(target), "measured": value, "met": met})
    return run


def print_run(run: dict[str, Any]) -> None:
    ttft = run["ttft_ms"]
    ratio = "" if run["ratio_vs_pipeline"] is None else f" ({run['ratio_vs_pipeline']:.2f}x pipeline)"
    print(f"{run['name']} on {run['workload']}: {run['output_tok_s']:,.0f} output tok/s{ratio}, TTFT p50 "
          f"{ttft['p50'] or 0:,.0f} ms p99 {ttft['p99'] or 0:,.0f} ms, {run['errors']} errors, "
          f"{run['duration_s']:.1f} s", flush=True)  # fmt: skip
    cpu = ", ".join(f"{role} {cores:.2f}" for role, cores in sorted(run["server_cpu_cores"].items()))
    client = run["client_cpu_cores"]
    print(f"    CPU cores: client processes {client['total']:.2f} (busiest {client['max']:.2f}); {cpu or 'server -'}",
          flush=True)  # fmt: skip
    for message in run["first_errors"]:
        print(f"    error: {message}", flush=True)


def rounds_by_plan(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Repeated closed-loop plans (``--repeat``): each plan's ratios to ``pipeline()``, in round order."""
    out: dict[str, list[float]] = {}
    for run in runs:
        if run.get("round") and run["ratio_vs_pipeline"] is not None:
            out.setdefault(f"{run['frontend']} c={run['concurrency']} on {run['workload']}", []).append(
                run["ratio_vs_pipeline"]
            )
    return out


def report(args: argparse.Namespace, baseline: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    print()
    if "error" in baseline:
        print(f"pipeline baseline failed: {baseline['error']}")
    for key, fig in baseline.get("workloads", {}).items():
        print(
            f"pipeline() {key}: {fig['output_tok_s']:,.0f} output tok/s, {fig['seconds']:.2f} s ({fig['method']})"
            + (f"; median of rounds {', '.join(f'{x:,.0f}' for x in fig['rounds_output_tok_s'])}"
               if len(fig.get("rounds_output_tok_s", ())) > 1 else "")
        )  # fmt: skip
    print(format_table([table_row(r) for r in runs]))
    for name, ratios in rounds_by_plan(runs).items():
        print(f"{name}: ratio to pipeline() by round {', '.join(f'{x:.2f}' for x in ratios)}; "
              f"median {lower_median(ratios):.2f}, worst {min(ratios):.2f}")  # fmt: skip
    print(
        "(latencies in ms; open: most streams in flight at once; CPU in cores: the busiest client process, "
        "and the busiest role of the deployment; SAT: a client process near one full core)"
    )
    for run in runs:
        for t in run["targets"]:
            measured = "-" if t["measured"] is None else f"{t['measured']:,.3g}"
            print(f"target {run['name']}: {t['metric']} {measured} {t['op']} {t['value']:g}: "
                  f"{'met' if t['met'] else 'MISSED'}")  # fmt: skip
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:], "cpus": os.cpu_count()}
        Path(args.json).write_text(json.dumps({"meta": meta, "pipeline": baseline, "runs": runs}, indent=1))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=f"checkpoint directory; '' the demo model; '{RANDOM_LLAMA}' the "
                   "Llama-3-8B-shaped random checkpoint of bench/checkpoints.py, written to --weights once. "
                   "Attached: the checkpoint the deployment serves (its tokenizer makes the prompts)")  # fmt: skip
    p.add_argument("--weights", default="/tmp/llama3-8b-random", help=f"where --model {RANDOM_LLAMA} lives")
    p.add_argument("--serve-kwargs", default="{}", help="JSON object of further serve() kwargs (ports, ...)")
    p.add_argument("--address", default="", help="attach: the load balancer's host:port (gRPC runs)")
    p.add_argument(
        "--openai-url", default="", help="attach: the OpenAI API base, e.g. http://127.0.0.1:8000/v1"
    )
    p.add_argument(
        "--rest-url", default="", help="attach: the REST route, e.g. http://127.0.0.1:28080/mii/NAME"
    )
    p.add_argument(
        "--served-model-name", default="", help="attach: the OpenAI model id (default: the first listed)"
    )
    p.add_argument(
        "--api-key", default="", help="bearer key of the HTTP front ends (default: $MII_SERVER_API_KEY)"
    )
    p.add_argument("--wait-s", type=float, default=600.0, help="attach: how long to wait for the deployment")
    p.add_argument(
        "--frontends", default="openai,grpc,rest", help="comma-separated, of: " + ", ".join(FRONTENDS)
    )
    p.add_argument(
        "--concurrency", default=None, help=f"closed-loop stream counts (default {DEFAULTS['concurrency']})"
    )
    p.add_argument(
        "--request-rates", default=None, help=f"Poisson rates, req/s (default {DEFAULTS['request_rates']})"
    )
    p.add_argument(
        "--num-prompts", type=int, default=None, help=f"requests per run (default {DEFAULTS['num_prompts']})"
    )
    p.add_argument(
        "--input-len", default=None, help=f"uniform input range LO,HI (default {DEFAULTS['input_len']})"
    )
    p.add_argument(
        "--output-len", default=None, help=f"uniform output range LO,HI (default {DEFAULTS['output_len']})"
    )
    p.add_argument("--fixed", default="", help="IN,OUT: fixed lengths instead of the ranges (e.g. 512,256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client-processes", type=int, default=min(8, max(1, (os.cpu_count() or 2) - 1)),
                   help="load-generator processes (default min(8, cpus - 1))")  # fmt: skip
    p.add_argument(
        "--warmup", type=int, default=None, help="requests per front end before the runs (default 8)"
    )
    p.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds; a request past it is an error"
    )
    p.add_argument("--repeat", type=int, default=1, help="run the closed-loop plans this many rounds (fresh "
                   "prompts each, plans interleaved) and the pipeline() baselines as often; ratios use the "
                   "baselines' median, and the median round of each plan is reported")  # fmt: skip
    p.add_argument("--no-pipeline", action="store_true", help="skip the pipeline() baseline")
    p.add_argument("--json", default="", help="write every run's figures here")
    p.add_argument(
        "--tiny", action="store_true", help="the demo model, short lengths, few prompts (CPU smoke run)"
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="a fixed set of runs: h200-targets = issue 10's GPU "
                   "targets and table (~6 min on one H200)")  # fmt: skip
    args = p.parse_args()
    if args.tiny and args.preset:
        p.error("--tiny and --preset are two different run sets: give one")
    for name, value in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.model is None:
        args.model = PRESETS[args.preset][0] if args.preset else ""
    args.frontends = [f for f in args.frontends.split(",") if f]
    unknown = set(args.frontends) - set(FRONTENDS)
    if unknown:
        p.error(f"unknown front ends {sorted(unknown)}; choose from {', '.join(FRONTENDS)}")
    return args


if __name__ == "__main__":
    main()
