"""Integration: clients nobody here wrote, against the OpenAI server of a real deployment (1 replica, CPU,
demo model): lm-evaluation-harness's ``local-completions`` with its default settings (it finds our
``/tokenizer_info`` and ``/tokenize``, then sends token-id prompts, ``echo`` + ``logprobs`` with
``max_tokens: 1`` for log-likelihoods) on a multiple-choice and a generate-until task defined from local
files (no hub), and langchain-openai's chat and completion models.

Both come with the ``test`` extra (``pip install -e ".[test]"``; lm-eval installs in about half a
minute, langchain-openai in seconds); without them these tests skip, saying which is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import mii_server
from mii_server.serving.frontends.client import Client

from .helpers import free_port_block

pytestmark = pytest.mark.integration

NAME = "clients-itest"
MODEL = "mii-server-demo"
MC_DOCS = [
    {"question": "The quick brown", "choices": ["fox", "dog", "cat"], "answer": 0},
    {"question": "A model server answers", "choices": ["requests", "nothing"], "answer": 0},
    {"question": "def main():", "choices": ["pass", "return 1", "print(2)"], "answer": 2},
]
GEN_DOCS = [{"question": "The list of", "answer": "x"}, {"question": "Python is", "answer": "y"}]


@pytest.fixture(scope="module")
def deployment(registry_env: str) -> Iterator[tuple[Client, str]]:
    base = free_port_block(3)
    http = free_port_block(1)
    key = os.environ.pop("MII_SERVER_API_KEY", None)  # lm-eval probes the tokenizer endpoints without one
    try:
        client = mii_server.serve(deployment_name=NAME, port_number=base, enable_openai_api=True, openai_api_port=http)
    finally:
        if key is not None:
            os.environ["MII_SERVER_API_KEY"] = key
    yield client, f"http://127.0.0.1:{http}"
    client.terminate_server()


def _task_files(root: Path) -> None:
    """A multiple-choice and a generate-until task whose documents are local JSON lines."""
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
    (root / "mc.yaml").write_text(
        "task: mii_local_mc\n" + common.format(path=root / "mc.jsonl")
        + 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        + "doc_to_target: answer\nmetric_list:\n  - metric: acc\n"
    )  # fmt: skip
    (root / "gen.yaml").write_text(
        "task: mii_local_gen\n" + common.format(path=root / "gen.jsonl")
        + 'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        + 'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: false\n'
        + "metric_list:\n  - metric: exact_match\n"
    )  # fmt: skip


def _samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lm_eval_local_completions_with_default_settings(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install -e '.[test]')")
    client, url = request.getfixturevalue("deployment")  # why not a parameter: no deployment when skipped
    _task_files(tmp_path)
    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
         "--model_args", f"model={MODEL},base_url={url}/v1/completions",
         "--tasks", "mii_local_mc,mii_local_gen", "--include_path", str(tmp_path),
         "--output_path", str(tmp_path / "out"), "--log_samples"],
        env={**os.environ, **offline}, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert "Using remote tokenizer" in run.stderr  # it found /tokenizer_info and /tokenize: token-id prompts
    # log-likelihoods: what the harness read from our echo + logprobs is the engine's own
    for sample in _samples(tmp_path / "out", "mii_local_mc"):
        for args, resp in zip(sample["arguments"].values(), sample["filtered_resps"], strict=True):
            context, continuation = args["arg_0"], args["arg_1"]
            whole = client.tokenize(context + continuation, add_special_tokens=False)[0].token_ids
            ctx = len(client.tokenize(context, add_special_tokens=False)[0].token_ids)
            (r,) = client.generate([whole], max_new_tokens=1, do_sample=False, prompt_logprobs=0)
            want = sum(e.logprob for e in r.prompt_logprobs[ctx:])
            assert float(resp[0]) == pytest.approx(want, abs=1e-3), (context, continuation)
    # generations: what greedy decoding with the task's stop strings gives
    eos = client.tokenizer_info().eos_token
    for sample in _samples(tmp_path / "out", "mii_local_gen"):
        ids = client.tokenize(sample["doc"]["question"], add_special_tokens=False)[0].token_ids
        (r,) = client.generate([ids], max_new_tokens=8, do_sample=False, stop=["\n", eos])
        assert sample["filtered_resps"][0] == r.generated_text
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    assert set(results) == {"mii_local_mc", "mii_local_gen"}


def test_langchain_openai_chat_and_completions(request: pytest.FixtureRequest) -> None:
    langchain_openai = pytest.importorskip(
        "langchain_openai", reason="langchain-openai is not installed (pip install -e '.[test]')"
    )
    client, url = request.getfixturevalue("deployment")
    messages = [("system", "Be brief."), ("human", "Name a fox.")]
    prompt = client.apply_chat_template([("system", "Be brief."), ("user", "Name a fox.")])
    (want,) = client.generate(prompt, max_new_tokens=6, do_sample=False)
    chat = langchain_openai.ChatOpenAI(base_url=url + "/v1", api_key="unused", model=MODEL, temperature=0,
                                       max_tokens=6, max_retries=0)  # fmt: skip
    reply = chat.invoke(messages)
    assert reply.content == want.generated_text
    assert reply.usage_metadata["output_tokens"] == want.generated_length
    assert "".join(chunk.content for chunk in chat.stream(messages)) == want.generated_text
    scored = chat.bind(logprobs=True).invoke(messages)
    assert [e["token"] for e in scored.response_metadata["logprobs"]["content"]] == [
        e.token for e in client.generate(prompt, max_new_tokens=6, do_sample=False, logprobs=0)[0].logprobs
    ]
    llm = langchain_openai.OpenAI(base_url=url + "/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=6,
                                  max_retries=0)  # fmt: skip
    (plain,) = client.generate("The list of", max_new_tokens=6, do_sample=False)
    assert llm.invoke("The list of") == plain.generated_text
