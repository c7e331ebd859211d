"""Run by torchrun from test_tp_pipeline.py: the same calls on every rank, as a user script would."""

import faulthandler
import json
import os
import sys

import mii_server
from mii_server.errors import InvalidRequest

# A hang shows where every rank stands (the test's own timeout would kill them silently).
faulthandler.dump_traceback_later(float(os.environ.get("TP_SCRIPT_HANG_S", "120")), exit=True)
path, out, prompts_json, all_ranks = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "all"
prompts = json.loads(prompts_json)
model_kwargs = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}  # e.g. {"quantization_mode": "int8"}
rank = int(os.environ["RANK"])
pipe = mii_server.pipeline(
    path, tensor_parallel=int(os.environ["WORLD_SIZE"]), all_rank_output=all_ranks, **model_kwargs
)
first = pipe(prompts, max_new_tokens=16, do_sample=False, ignore_eos=True)
try:  # a prompt rank 0 refuses must not leave the other ranks waiting for a step
    refused = pipe(["word " * 5000], max_new_tokens=4)
    assert rank != 0 and refused == [], "only rank 0 sees the refusal"
except InvalidRequest:
    assert rank == 0
second = pipe(prompts[:1], max_new_tokens=4, do_sample=False, ignore_eos=True)  # and the next call works
result = {"first": [r.token_ids for r in first], "second": [r.token_ids for r in second],
          "cached": [r.cached_tokens for r in first + second],
          "graphs": pipe.runtime.engine.cuda_graphs is not None}  # fmt: skip
if rank == 0:
    result["overlap"] = pipe.loop.overlap
    result["preemptions"] = pipe.loop.scheduler.num_preemptions
if rank == 0 or all_ranks:
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
else:
    assert first == [] and second == [], "only rank 0 returns responses"
pipe.destroy()
