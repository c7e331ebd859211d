"""Run by torchrun from test_tp_cuda.py: the collectives a tensor-parallel decode graph holds (an
all-reduce, and the broadcast of rank 0's sampled ids) captured in a CUDA graph on NCCL, replayed
with new inputs on every rank."""

import os

import torch
import torch.distributed as dist

from mii_server.tensor_parallel.distributed import init_tensor_parallel

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
init_tensor_parallel(rank, world, device, init_method="env://")
x = torch.zeros(8, device=device)
ids = torch.zeros(4, dtype=torch.int64, device=device)
# the communicator exists before capture, as the engine's load-time agree_min makes it
dist.all_reduce(x)
dist.broadcast(ids, src=0)
torch.cuda.synchronize(device)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph, capture_error_mode="thread_local"):
    dist.all_reduce(x)
    dist.broadcast(ids, src=0)
    out = x * 2 + ids[:1]
for step in range(3):
    x.fill_(rank + step)
    ids.fill_(100 * step + rank)
    graph.replay()
    torch.cuda.synchronize(device)
    total = sum(r + step for r in range(world))
    assert torch.all(x == total), (rank, step, x)
    assert torch.all(ids == 100 * step), (rank, step, ids)  # rank 0's
    assert torch.all(out == 2 * total + 100 * step), (rank, step, out)
dist.destroy_process_group()
print(f"rank {rank} of {world}: ok")
