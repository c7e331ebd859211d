"""Integration: ``bench/serving_benchmark.py --tiny`` against a real CPU deployment of the demo model.

One run of the script (its own deployment, its pipeline() baseline, two client processes) through
all three front ends: a two-level concurrency sweep and one Poisson rate. Checked: no errors, every
request of every run completed with exactly the tokens it asked for, the prompts had exactly their
planned lengths as the server counted them, no run reused another's prompts (prefix cache), closed
loops held their streams open together, and the JSON carries every figure the report prints.
Not checked: speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import free_port_block

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = 2


def test_tiny_serving_benchmark_runs_every_front_end_without_errors(
    registry_env: str, tmp_path: Path
) -> None:
    base = free_port_block(3)  # load balancer, replica, replica metrics
    http = free_port_block(2)
    assert not set(range(http, http + 2)) & set(range(base, base + 3))
    ports = {"port_number": base, "openai_api_port": http, "restful_api_port": http + 1}
    out = tmp_path / "serving.json"
    cmd = [sys.executable, "bench/serving_benchmark.py", "--tiny", "--client-processes", str(PROCESSES),
           "--serve-kwargs", json.dumps(ports), "--json", str(out)]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())

    runs = report["runs"]
    assert [r["name"] for r in runs] == [f"{f} {load}" for f in ("openai", "grpc", "rest")
                                         for load in ("c=2", "c=8", "16 req/s")]  # fmt: skip
    (key,) = report["pipeline"]["workloads"]
    baseline = report["pipeline"]["workloads"][key]
    for run in runs:
        name = run["name"]
        assert run["errors"] == 0 and run["first_errors"] == [], (name, run["first_errors"])
        assert run["requests"] == run["completed"] == 16, name
        assert run["output_tokens"] == run["planned_output_tokens"] == baseline["output_tokens"], name
        assert run["input_tokens"] == run["planned_input_tokens"], (
            name
        )  # the server counted the planned lengths
        assert run["cached_prompt_tokens"] in (0, None), name  # OpenAI's usage does not say
        for figure in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            dist = run[figure]
            assert 0 <= dist["p50"] <= dist["p99"], (name, figure, dist)
        assert run["duration_s"] > 0 and run["output_tok_s"] > 0 and run["requests_s"] > 0, name
        assert run["client_processes"] == PROCESSES, name
        assert {"replica", "load-balancer", "openai-server", "rest-gateway"} <= set(
            run["server_cpu_cores"]
        ), name
        if run["concurrency"]:
            c = run["concurrency"]
            # each process holds its callers' streams open together; processes may start a little apart
            assert c // PROCESSES <= run["peak_open"] <= c, (name, run["peak_open"])
            assert run["ratio_vs_pipeline"] == pytest.approx(
                run["output_tok_s"] / baseline["output_tok_s"]
            ), name
        else:
            assert run["request_rate"] == 16 and run["ratio_vs_pipeline"] is None, name
    assert "pipeline()" in proc.stdout and "openai c=8" in proc.stdout
