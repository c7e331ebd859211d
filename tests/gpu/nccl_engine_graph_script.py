"""Run by torchrun (one rank) from test_tp_cuda.py: the engine's decode CUDA graphs captured with NCCL
collectives inside, on one GPU. A one-rank group skips its collectives, so this script sends every
row-parallel all-reduce and the LM head's all-gather through NCCL, as a tensor-parallel rank's forward
does; the greedy tokens with the graphs replayed must equal the eager forward's."""

import json
import os
import sys

import torch
import torch.distributed as dist

from mii_server.config import ModelConfig
from mii_server.in_process import Pipeline
from mii_server.models.parallel import TensorParallelGroup
from mii_server.runtime import build_loop, build_runtime
from mii_server.tensor_parallel.distributed import init_tensor_parallel

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "Numbers 0 1 2 3 4 5 6 7 8 9"]
path, out = sys.argv[1], sys.argv[2]
collectives = 0


def nccl_all_reduce(self: TensorParallelGroup, x: torch.Tensor) -> torch.Tensor:
    global collectives
    collectives += 1
    dist.all_reduce(x)
    return x


def nccl_all_gather_last_dim(self: TensorParallelGroup, x: torch.Tensor) -> torch.Tensor:
    global collectives
    collectives += 1
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


TensorParallelGroup.all_reduce = nccl_all_reduce  # type: ignore[method-assign]
TensorParallelGroup.all_gather_last_dim = nccl_all_gather_last_dim  # type: ignore[method-assign]

device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
tp = init_tensor_parallel(0, 1, device, init_method="env://")
config = ModelConfig(model_name_or_path=path, device="cuda", dtype="float32", max_ragged_sequence_count=8,
                     kv_cache={"num_blocks": 64, "block_size": 16})  # fmt: skip
runtime = build_runtime(config, tp, device)
captured_with = collectives  # the warm-ups and captures went through NCCL
loop = build_loop(config, runtime)
pipe = Pipeline(config, runtime, loop)


def generate() -> list[list[int]]:
    return [r.token_ids for r in pipe(PROMPTS, max_new_tokens=24, do_sample=False, ignore_eos=True)]


graphs = runtime.engine.cuda_graphs
with_graphs = generate()
runtime.engine.use_cuda_graphs = False
eager = generate()
result = {"graphs": None if graphs is None else graphs.batch_sizes, "collectives_at_load": captured_with,
          "with_graphs": with_graphs, "eager": eager}  # fmt: skip
pipe.destroy()
with open(out, "w") as f:
    json.dump(result, f)
