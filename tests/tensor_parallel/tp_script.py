"""Run by torchrun from test_tp_pipeline.py: the same calls on every rank, as a user script would."""

import json
import os
import sys

import mii_server

path, out, prompts_json = sys.argv[1], sys.argv[2], sys.argv[3]
prompts = json.loads(prompts_json)
pipe = mii_server.pipeline(path, tensor_parallel=int(os.environ["WORLD_SIZE"]))
first = pipe(prompts, max_new_tokens=16, do_sample=False, ignore_eos=True)
second = pipe(prompts[:1], max_new_tokens=4, do_sample=False, ignore_eos=True)  # a second call works too
if int(os.environ["RANK"]) == 0:
    with open(out, "w") as f:
        json.dump({"first": [r.token_ids for r in first], "second": [r.token_ids for r in second]}, f)
else:
    assert first == [] and second == [], "only rank 0 returns responses"
pipe.destroy()
