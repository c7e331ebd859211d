"""The decode CUDA-graph ladder: which batch sizes are captured and which rung a batch pads to
(plain Python; the capture itself is tested on the GPU in tests/gpu)."""

from __future__ import annotations

import torch

from mii_server.config import ModelConfig
from mii_server.engine.cuda_graphs import fastest_rungs, graph_batch_sizes, pick_rung
from mii_server.runtime import use_cuda_graphs


def test_ladder_is_fine_below_16_then_coarser_and_ends_at_the_limit() -> None:
    assert graph_batch_sizes(512) == [1, 2, 4, 8, *range(16, 257, 16), 320, 384, 448, 512]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]  # the limit is always a rung
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(2048, cap=100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]
    assert graph_batch_sizes(0) == []


def test_a_batch_pads_to_the_smallest_rung_that_holds_it() -> None:
    sizes = graph_batch_sizes(512)
    batches = (1, 3, 8, 9, 17, 256, 257, 511, 512)
    rungs = (1, 4, 8, 16, 32, 256, 320, 512, 512)
    assert tuple(pick_rung(sizes, n) for n in batches) == rungs
    assert pick_rung(sizes, 513) is None  # larger decode batches run eagerly


def test_a_rung_replays_a_larger_graph_only_when_that_is_clearly_faster() -> None:
    # the H100's cuBLAS pothole: a Llama-3-8B step's products at 448 rows took longer than at 512
    ms = {1: 3.0, 8: 3.0, 16: 3.1, 256: 9.0, 320: 9.5, 384: 10.5, 448: 14.2, 512: 12.0}
    routes = fastest_rungs(ms)
    assert routes[448] == 512  # 15% faster
    assert routes[384] == 384 and routes[512] == 512  # the fastest of what holds them
    assert routes[1] == 1 and routes[8] == 8  # equal or within noise: the smallest rung
    assert routes[16] == 16  # 8 is not a candidate for 16: it cannot hold the batch
    near = fastest_rungs({256: 10.0, 320: 9.6})  # 4% is within the timing noise allowance
    assert near == {256: 256, 320: 320}
    assert fastest_rungs({256: 10.0, 320: 9.4})[256] == 320


def test_graphs_only_where_they_can_run() -> None:
    cpu = torch.device("cpu")
    assert not use_cuda_graphs(ModelConfig(), cpu)
    assert not use_cuda_graphs(ModelConfig(cuda_graphs=False), cpu)
    assert ModelConfig().cuda_graphs is True  # on by default where CUDA allows
