"""lm-eval-harness against a real server: its ``local-completions`` model pointed at our /v1/completions
scores a small local multiple-choice task exactly as lm-eval's own Hugging Face backend (``hf``) scores it
on the same model directory: same accuracy, same per-choice loglikelihoods (within LL_TOL).

The task is a YAML over a JSONL file written into a temporary directory (no dataset can be downloaded);
everything runs with the Hugging Face offline switches on. The commands are the ones docs/API.md shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import REPO, running_server

pytest.importorskip("lm_eval")

MODEL = "smollm"
TASK = "ddtree_local_mc"
LL_TOL = 1e-4  # absolute, per choice: a sum of a few float32 token logprobs (measured max 4.8e-7 here)
DOCS = [
    ("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("Two plus two equals", ["three", "four", "five", "six"], 1),
    ("The opposite of hot is", ["warm", "loud", "cold", "blue"], 2),
    ("A baby cat is called a", ["puppy", "kitten", "calf", "foal"], 1),
    ("Water freezes at zero degrees", ["Celsius", "Kelvin", "Newton", "Joule"], 0),
    ("The color of the clear daytime sky is", ["green", "red", "yellow", "blue"], 3),
    ("def add(a, b):\n    return a", ["+ b", "- b", "* b", "/ b"], 0),
    ("The first month of the year is", ["March", "January", "June", "December"], 1),
]
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("lm_eval_task")
    data = d / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in DOCS)
    )
    (d / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
    return d


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_path):
    # the default serve configuration: DDTree speculation with the shipped drafter; float32 as the hf run
    args = ["--served-model-name", MODEL, "--dtype", "float32", "--max-total-tokens", "8192"]
    with running_server(args, tmp_path_factory.mktemp("server-lm-eval"), timeout=300) as srv:
        yield srv.base


def _lm_eval(args: list[str], task_dir: Path, out: Path) -> tuple[float, dict[int, list[float]]]:
    """Run ``lm-eval run`` offline; return (accuracy, {doc_id: [loglikelihood per choice]})."""
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_CACHE=str(out / "hf-datasets"),
        TOKENIZERS_PARALLELISM="false",
    )
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        *args,
        "--tasks",
        TASK,
        "--include_path",
        str(task_dir),
        "--batch_size",
        "4",
        "--log_samples",
        "--output_path",
        str(out),
    ]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    acc = results["results"][TASK]["acc,none"]
    lls = {}
    for line in next(out.rglob(f"samples_{TASK}_*.jsonl")).read_text().splitlines():
        s = json.loads(line)
        lls[s["doc_id"]] = [float(ll) for ll, _greedy in s["filtered_resps"]]
    return acc, lls


@pytest.mark.slow
def test_lm_eval_local_completions_equals_hf_backend(server, task_dir, default_model_path, tmp_path):
    api_args = [
        "--model",
        "local-completions",
        "--model_args",
        f"model={MODEL},base_url={server}/v1/completions,tokenizer={default_model_path},"
        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1",
    ]
    hf_args = [
        "--model",
        "hf",
        "--model_args",
        f"pretrained={default_model_path},dtype=float32",
        "--device",
        "cpu",
    ]
    api_acc, api_lls = _lm_eval(api_args, task_dir, tmp_path / "api")
    hf_acc, hf_lls = _lm_eval(hf_args, task_dir, tmp_path / "hf")
    assert sorted(api_lls) == sorted(hf_lls) == list(range(len(DOCS)))
    for doc_id, want in hf_lls.items():
        assert len(api_lls[doc_id]) == len(DOCS[doc_id][1])
        assert api_lls[doc_id] == pytest.approx(want, abs=LL_TOL), f"doc {doc_id}"
        assert all(ll < 0 for ll in want)  # real scores, not the all-zero answer of a server without them
    diff = max(abs(a - b) for d in hf_lls for a, b in zip(api_lls[d], hf_lls[d], strict=True))
    print(
        f"lm-eval acc: local-completions {api_acc:.4f}, hf {hf_acc:.4f}; max |loglikelihood diff| {diff:.2e}"
    )
    assert api_acc == hf_acc
    assert 0.25 < hf_acc  # the model beats chance on these easy questions: the scores carry signal
