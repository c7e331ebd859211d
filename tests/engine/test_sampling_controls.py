"""Sampling controls in the batched sampler: logit_bias, min_p, presence / frequency (OpenAI's
additive) and repetition (transformers' multiplicative) penalties. Exact on hand-made logits, equal
to transformers' generate(repetition_penalty=...) and to a reference loop over a transformers forward
for the OpenAI penalties, and the same with overlapped steps (counts kept on the device)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

import mii_server
from mii_server.generation.params import GenerateParams
from mii_server.generation.penalties import PenaltyCounts
from mii_server.generation.sampler import SamplingRow, sample
from mii_server.in_process import Pipeline

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000",
    "Deployments have replicas",
]
NEW = 16


def greedy_row(**fields: object) -> SamplingRow:
    return SamplingRow(greedy=True, temperature=1.0, top_k=None, top_p=1.0, generator=None, **fields)  # type: ignore[arg-type]


def test_logit_bias_moves_only_its_row() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0], [0.0, 3.0, 2.9, -1.0]])
    rows = [greedy_row(bias_ids=[1, 3], bias_values=[-100.0, 2.5]), greedy_row()]
    assert sample(logits.clone(), rows) == [2, 1]  # row 0: 1 is banned, 3 rises to 1.5 < 2.9
    rows[0] = greedy_row(bias_ids=[3], bias_values=[5.0])
    assert sample(logits.clone(), rows) == [3, 1]


def test_min_p_keeps_tokens_near_the_most_likely() -> None:
    probs = [0.125, 0.5, 0.25, 0.0625, 0.0625]
    logits = torch.tensor([probs]).log().repeat(3000, 1)
    gen = torch.Generator().manual_seed(0)
    row = lambda min_p: SamplingRow(False, 1.0, None, 1.0, gen, min_p=min_p)
    assert set(sample(logits.clone(), [row(0.3)] * 3000)) == {1, 2}  # >= 0.15
    counts = Counter(sample(logits.clone(), [row(0.2)] * 3000))  # >= 0.1: renormalised over 3 tokens
    assert set(counts) == {0, 1, 2}
    assert all(abs(counts[t] / 3000 - probs[t] / 0.875) < 0.03 for t in range(3))
    # top_p reads the mass left after min_p: 0.5/0.875 + 0.25/0.875 = 0.857 >= 0.85
    both = SamplingRow(False, 1.0, None, 0.85, gen, min_p=0.2)
    assert set(sample(logits.clone(), [both] * 3000)) == {1, 2}


def test_penalties_exact_on_known_counts() -> None:
    counts = PenaltyCounts(vocab_size=5, device=torch.device("cpu"))
    row = counts.row(uid=0, prompt_ids=[4], output_ids=[1, 1, 2])  # tokens 1 (twice), 2 in the output
    other = counts.row(uid=1, prompt_ids=[0], output_ids=[])
    logits = torch.tensor([[1.0, 2.0, -2.0, 0.5, 3.0], [1.0, 2.0, -2.0, 0.5, 3.0]])
    counts.apply(
        logits, torch.tensor([0, 1]), torch.tensor([row, other]),
        presence=torch.tensor([0.5, 0.0]), frequency=torch.tensor([0.25, 0.0]), repetition=torch.tensor([2.0, 1.0]),
    )  # fmt: skip
    # row 0: repetition on 1, 2 (output) and 4 (prompt); then 1 loses 2*0.25 + 0.5, 2 loses 0.25 + 0.5
    assert logits[0].tolist() == [1.0, 2.0 / 2 - 1.0, -2.0 * 2 - 0.75, 0.5, 3.0 / 2]
    assert logits[1].tolist() == [1.0, 2.0, -2.0, 0.5, 3.0]  # penalty 1 / 0: unchanged
    counts.count(torch.tensor([row, row]), torch.tensor([3, 1]))
    assert counts.output[row].tolist() == [0, 3, 1, 1, 0]
    counts.release(0)
    assert counts.row(uid=2, prompt_ids=[], output_ids=[]) == row  # the row is reused, cleared
    assert counts.output[row].tolist() == [0] * 5 and not counts.prompt[row].any()


def test_penalty_table_grows_and_keeps_rows() -> None:
    counts = PenaltyCounts(vocab_size=3, device=torch.device("cpu"))
    rows = [counts.row(uid, [uid % 3], [uid % 3]) for uid in range(20)]
    assert len(set(rows)) == 20 and len(counts) == 20
    assert all(counts.output[r].tolist()[u % 3] == 1 for u, r in enumerate(rows))


# ---- through the pipeline, against transformers ----------------------------------------------


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "sync"])
def pipe(request: pytest.FixtureRequest, tiny_checkpoints: dict[str, Path]) -> Pipeline:
    # a small budget: prompts split across forwards, decodes mix with prompt chunks
    p = mii_server.pipeline(
        str(tiny_checkpoints["llama"]), overlap_scheduling=request.param, max_ragged_batch_size=12,
        max_ragged_sequence_count=3, kv_cache={"block_size": 4, "num_blocks": 96},
    )  # fmt: skip
    yield p
    p.destroy()


def ours(pipe: Pipeline, **kwargs: object) -> list[list[int]]:
    return [
        r.token_ids for r in pipe(PROMPTS, max_new_tokens=NEW, do_sample=False, ignore_eos=True, **kwargs)
    ]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_transformers_generate(
    pipe: Pipeline, hf_llama: tuple, penalty: float
) -> None:
    tok, model = hf_llama
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
            repetition_penalty=penalty, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
        expected.append(out[0, ids.shape[1] :].tolist())
    assert ours(pipe, repetition_penalty=penalty) == expected
    assert ours(pipe) != expected  # the penalty changed something


def reference_loop(
    hf_llama: tuple, presence: float, frequency: float, bias: dict[int, float]
) -> list[list[int]]:
    """Greedy decoding with OpenAI's penalties applied by hand to a full transformers forward."""
    tok, model = hf_llama
    out = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        generated: list[int] = []
        for _ in range(NEW):
            with torch.no_grad():
                logits = model(torch.tensor([ids + generated])).logits[0, -1].float()
            for token_id, b in bias.items():
                logits[token_id] += b
            for token_id, n in Counter(generated).items():
                logits[token_id] -= frequency * n + presence
            generated.append(int(logits.argmax()))
        out.append(generated)
    return out


def test_presence_frequency_and_bias_equal_a_reference_loop(pipe: Pipeline, hf_llama: tuple) -> None:
    settings = {"presence_penalty": 0.6, "frequency_penalty": 0.4, "logit_bias": {5: 0.8, 100: -1.0}}
    expected = reference_loop(hf_llama, 0.6, 0.4, {5: 0.8, 100: -1.0})
    assert ours(pipe, **settings) == expected
    assert ours(pipe) != expected
    assert pipe.loop.penalties.output.shape[0] > 0 and len(pipe.loop.penalties) == 0  # rows given back


def test_mixed_batch_leaves_plain_requests_alone(pipe: Pipeline) -> None:
    plain = ours(pipe)
    loop = pipe.loop
    results: dict[int, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        kwargs = {"frequency_penalty": 1.0, "repetition_penalty": 1.2} if i % 2 else {}
        params = GenerateParams(max_new_tokens=NEW, do_sample=False, ignore_eos=True, **kwargs)
        uid = loop.submit(
            prompt, params, lambda u, i=i: results.setdefault(i, []).extend(u.response.token_ids)
        )
        assert uid >= 0
    while loop.has_work():
        loop.step()
    assert [results[i] for i in (0, 2)] == [plain[0], plain[2]]
    assert [results[i] for i in (1, 3)] != [plain[1], plain[3]]
