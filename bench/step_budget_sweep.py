"""The default step budget chosen by measurement (issue 18): ``max_ragged_batch_size`` swept through
``serve()``, each value on its own deployment, with the serving benchmark's clients.

Per budget: (a) 256 concurrent OpenAI streams of 512 in / 256 out (throughput), (b) Poisson arrivals
at 16 req/s, inputs U[128,1024], outputs U[64,512] (latency: TTFT and TPOT). The rule printed at the
end: the budget with the highest throughput whose TPOT p99 at 16 req/s stays within 1.25x of the
768-token setting (MII's default, always measured as the reference).

    PYTHONPATH=. python3 bench/step_budget_sweep.py --budgets 768,2048,4096,8192 --json $OUT/budgets.json
    PYTHONPATH=. python3 bench/step_budget_sweep.py --tiny        # CPU: the demo model, checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving_benchmark as sb
from serving_clients import ClientPool
from serving_metrics import format_table
from serving_workload import PromptMaker, Workload, requests_for

REFERENCE_BUDGET = 768  # MII's default: the latency yardstick
TPOT_SLACK = 1.25  # issue 18: TPOT p99 may grow to 1.25x of the reference's


def plans(tiny: bool, poisson_prompts: int) -> list[sb.RunPlan]:
    if tiny:
        return [sb.RunPlan("openai", sb.fixed(16, 8, 16), concurrency=8),
                sb.RunPlan("openai", Workload((8, 32), (4, 16), 16), rate=16.0)]  # fmt: skip
    return [
        sb.RunPlan("openai", sb.fixed(512, 256, 256), concurrency=256),
        sb.RunPlan("openai", Workload((128, 1024), (64, 512), poisson_prompts), rate=16.0),
    ]


def measure_budget(args: argparse.Namespace, model: str, maker: PromptMaker, budget: int, seed: int) -> dict:
    """Both runs on a fresh deployment serving with ``budget`` tokens a step."""
    run_plans = plans(args.tiny, args.poisson_prompts)
    requests = [requests_for(maker, p.workload, seed + i, p.rate or None) for i, p in enumerate(run_plans)]
    serve_kwargs = {**json.loads(args.serve_kwargs), "max_ragged_batch_size": budget}
    pool = ClientPool(max(1, args.client_processes))
    deployment = None
    try:
        deployment = sb.Deployment(args, model, serve_kwargs)
        runs = list(sb.run_plans(args, deployment, pool, maker, run_plans, requests, {"skipped": True}, seed + 90))
    finally:
        if deployment is not None:
            deployment.close()
        pool.close()
    closed, poisson = runs
    return {
        "budget": budget,
        "output_tok_s": closed["output_tok_s"],
        "closed_errors": closed["errors"],
        "ttft_ms_p50": poisson["ttft_ms"]["p50"],
        "ttft_ms_p99": poisson["ttft_ms"]["p99"],
        "tpot_ms_p50": poisson["tpot_ms"]["p50"],
        "tpot_ms_p99": poisson["tpot_ms"]["p99"],
        "poisson_errors": poisson["errors"],
        "runs": runs,
    }


def choose(rows: list[dict]) -> dict:
    """The highest-throughput budget within the TPOT slack of the reference."""
    reference = next(r for r in rows if r["budget"] == REFERENCE_BUDGET)
    limit = TPOT_SLACK * reference["tpot_ms_p99"]
    allowed = [r for r in rows if r["tpot_ms_p99"] <= limit and not (r["closed_errors"] or r["poisson_errors"])]
    best = max(allowed, key=lambda r: r["output_tok_s"])
    return {"budget": best["budget"], "tpot_p99_limit_ms": limit}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", default="768,2048,4096,8192", help="max_ragged_batch_size values (768 always)")
    p.add_argument("--model", default=None, help="as serving_benchmark.py's (default: random-llama3-8b; --tiny: demo)")
    p.add_argument("--weights", default="/tmp/llama3-8b-random")
    p.add_argument("--serve-kwargs", default="{}", help="JSON object of further serve() kwargs")
    p.add_argument("--poisson-prompts", type=int, default=256, help="requests of the 16 req/s run")
    p.add_argument("--client-processes", type=int, default=min(8, max(1, (os.cpu_count() or 2) - 1)))
    p.add_argument("--tiny", action="store_true", help="the demo model, short lengths (CPU smoke run)")
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.model is None:
        args.model = "" if args.tiny else sb.RANDOM_LLAMA
    # what serving_benchmark's Deployment and run_plans read
    args.api_key, args.address, args.openai_url, args.rest_url, args.served_model_name = "", "", "", "", ""
    args.warmup, args.request_timeout = 2 if args.tiny else 8, 300.0
    os.environ.setdefault("MII_SERVER_PROGRESS", "0")
    budgets = sorted({REFERENCE_BUDGET, *(int(b) for b in args.budgets.split(",") if b)})

    model, checkpoint = sb.resolve_model(args)
    from transformers import AutoTokenizer

    maker = PromptMaker(AutoTokenizer.from_pretrained(str(checkpoint)))
    rows = []
    for i, budget in enumerate(budgets):
        start = time.perf_counter()
        rows.append(measure_budget(args, model, maker, budget, seed=1000 * (i + 1)))
        print(f"budget {budget}: {time.perf_counter() - start:.0f} s", flush=True)
    choice = choose(rows)
    header = ("max_ragged_batch_size", "closed-loop tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "errors")
    cells = [[str(r["budget"]) + (" *" if r["budget"] == choice["budget"] else ""), f"{r['output_tok_s']:,.0f}",
              f"{r['ttft_ms_p50']:,.0f} / {r['ttft_ms_p99']:,.0f}", f"{r['tpot_ms_p50']:.1f} / {r['tpot_ms_p99']:.1f}",
              str(r["closed_errors"] + r["poisson_errors"])] for r in rows]  # fmt: skip
    print(format_table(cells, header))
    print(f"* chosen: highest throughput with TPOT p99 <= {choice['tpot_p99_limit_ms']:.1f} ms "
          f"({TPOT_SLACK}x the {REFERENCE_BUDGET}-token setting's)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv[1:], "choice": choice, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
