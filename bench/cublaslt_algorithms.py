"""Every algorithm cuBLASLt's heuristic offers for the model's linears, timed against ``F.linear``.

Issue 18 asks whether choosing a cuBLASLt algorithm per shape at start-up beats what torch runs
(cuBLAS takes the heuristic's first choice). For Llama-3-8B's five linears at the given row counts,
this asks cuBLASLt for up to ``--limit`` algorithms (through nvmath-python's planner), runs each
one over 8 copies of the weight in a CUDA graph (so L2 holds none), checks its output, and prints
microseconds per product: torch's, the heuristic's first, and the best, beside the larger of the
weight-read and compute floors.

Needs a CUDA device and ``nvmath-python`` (with ``cuda-bindings``, ``cuda-core``, ``cuda-pathfinder``),
which the server itself does not use. It reuses the descriptors of a planned ``Matmul`` (its
``handle``, ``mm_desc``, layouts and ``algorithm_object_to_buffer``), attributes of nvmath-python
1.0.0 that are not its public API:

    PYTHONPATH=$PWD python3 bench/cublaslt_algorithms.py --rows 1 64 256
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import torch.nn.functional as F
import triton
from kernels_bench import BF16_FLOPS, HBM_BYTES_PER_S, LINEAR_SHAPES


def graph_us(fn, copies: int) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=100) / copies * 1e3


def time_algorithms(name: str, n: int, k: int, m: int, limit: int, workspace: torch.Tensor) -> dict:
    import nvmath
    from nvmath.bindings import cublasLt

    copies = 2 if name == "lm_head" else 8
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    expected = F.linear(x, weights[0])
    torch_us = graph_us(lambda: [F.linear(x, w) for w in weights], copies)
    # the planner's descriptors are reused with each weight's pointer, one algorithm at a time
    mm = nvmath.linalg.advanced.Matmul(x, weights[0].t(), options={"memory_limit": workspace.numel()})
    algorithms = mm.plan(preferences={"limit": limit})
    shaped = mm.execute()
    outs = [torch.empty_strided(shaped.shape, shaped.stride(), dtype=shaped.dtype, device="cuda") for _ in weights]
    alpha, beta = np.ones(1, dtype=np.float32), np.zeros(1, dtype=np.float32)
    timed = []
    for rank, algorithm in enumerate(algorithms):
        record = mm.algorithm_object_to_buffer[algorithm]
        algo_ptr, ws_bytes = record["algo"].ctypes.data, int(np.asarray(record["workspace_size"]).ravel()[0])

        def run(algo_ptr=algo_ptr, ws_bytes=ws_bytes):
            stream = torch.cuda.current_stream().cuda_stream
            for w, out in zip(weights, outs):
                cublasLt.matmul(
                    mm.handle, mm.mm_desc, alpha.ctypes.data, x.data_ptr(), mm.a_layout_ptr, w.data_ptr(),
                    mm.b_layout_ptr, beta.ctypes.data, 0, mm.c_layout_ptr, out.data_ptr(), mm.d_layout_ptr,
                    algo_ptr, workspace.data_ptr(), ws_bytes, stream,
                )  # fmt: skip

        run()
        torch.testing.assert_close(outs[0], expected, atol=2e-2, rtol=2e-2)
        timed.append((graph_us(run, copies), rank, str(algorithm.tile), algorithm.split_k))
    mm.free()
    floor_us = max(n * k * 2 / HBM_BYTES_PER_S, 2 * m * n * k / BF16_FLOPS) * 1e6
    best = min(timed)
    first = next(t for t in timed if t[1] == 0)
    return {"shape": name, "rows": m, "floor_us": round(floor_us, 1), "torch_us": round(torch_us, 1),
            "heuristic_first_us": round(first[0], 1), "best_us": round(best[0], 1),
            "best": {"rank": best[1], "tile": best[2], "split_k": best[3]}, "algorithms": len(timed)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--limit", type=int, default=24, help="algorithms asked of the heuristic per shape")
    args = parser.parse_args()
    workspace = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for name, (n, k) in LINEAR_SHAPES.items():
        for m in args.rows:
            rows.append(time_algorithms(name, n, k, m, args.limit, workspace))
            print(json.dumps(rows[-1]), flush=True)
    for m in args.rows:
        layer = [r for r in rows if r["rows"] == m and r["shape"] != "lm_head"]
        print(json.dumps({"rows": m, "per_layer_torch_us": round(sum(r["torch_us"] for r in layer), 1),
                          "per_layer_best_us": round(sum(r["best_us"] for r in layer), 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
