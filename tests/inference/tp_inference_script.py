"""Run by torchrun from test_init_inference_tp.py: every rank wraps the same models alike, as a user
script under DeepSpeed would, and rank 0 writes what generate returned."""

import faulthandler
import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.models.opt.modeling_opt import OPTDecoderLayer

import mii_server

faulthandler.dump_traceback_later(float(os.environ.get("TP_SCRIPT_HANG_S", "150")), exit=True)
cases, out = json.loads(sys.argv[1]), sys.argv[2]
ranks = int(os.environ["WORLD_SIZE"])
results = {}
for name, case in cases.items():
    config = dict(case["config"])
    if "injection_policy" in config:  # DeepSpeed's form: the layer class itself
        config["injection_policy"] = {OPTDecoderLayer: tuple(config["injection_policy"]["OPTDecoderLayer"])}
    model = AutoModelForCausalLM.from_pretrained(case["path"], dtype=torch.float32)
    engine = mii_server.init_inference(model, config, tensor_parallel={"tp_size": ranks})
    batch = {k: torch.tensor(v) for k, v in case["batch"].items()}
    results[name] = engine.generate(**batch, **case["generate"]).tolist()
    with torch.no_grad():
        results[name + ":logits"] = engine(**batch).logits[batch["attention_mask"].bool()].tolist()
if int(os.environ["RANK"]) == 0:
    with open(out, "w") as f:
        json.dump(results, f)
dist.barrier()
dist.destroy_process_group()  # why: a rank leaving an open gloo group can abort at exit
