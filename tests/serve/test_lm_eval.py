"""docs/guide/lm-eval.md's recipe, run: lm-evaluation-harness against the server on a tiny local task.

``local-completions`` with ``tokenizer_backend=remote`` scores a multiple-choice task through
/v1/completions (echo + logprobs, max_tokens 0) and tokenizes through /tokenize; each
choice's log-likelihood must equal transformers' float32 forward of the same checkpoint on
the same tokens. ``local-chat-completions`` runs a generation task through
/v1/chat/completions. lm-eval is heavy (datasets, pyarrow, scikit-learn) and not a test
extra: the test runs it with this interpreter if it imports lm_eval, else with the Python
named by ``$LM_EVAL_PYTHON``, and skips otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

DOCS = [{"question": "The capital of France is", "choices": [" Paris", " Berlin", " a page"],
         "label": 0},
        {"question": "Two plus two equals", "choices": [" four", " seven"], "label": 1},
        {"question": "An fp8 value takes", "choices": [" one byte", " two", " a cache"],
         "label": 2}]
TASK = """\
task: {name}
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
doc_to_text: "{{{{question}}}}"
"""
MC = """\
output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list: [{metric: acc}]
"""
GEN = """\
output_type: generate_until
doc_to_target: "{{choices[0]}}"
generation_kwargs: {until: ["\\n"], max_gen_toks: 4, do_sample: false}
metric_list: [{metric: exact_match}]
"""


def lm_eval_python() -> str | None:
    if importlib.util.find_spec("lm_eval") is not None:
        return sys.executable
    return os.environ.get("LM_EVAL_PYTHON")


def run_lm_eval(python: str, tmp: Path, model: str, model_args: str, task: str,
                *extra: str) -> dict:
    out = tmp / f"out-{model}"
    cmd = [python, "-m", "lm_eval", "--model", model, "--model_args", model_args,
           "--tasks", task, "--include_path", str(tmp), "--output_path", str(out),
           "--log_samples", *extra]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    samples = next(out.rglob(f"samples_{task}_*.jsonl"))
    return [json.loads(line) for line in samples.read_text().splitlines()]


def hf_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """lm-eval's pairing: the continuation's tokens are those of context + continuation
    past the context's own tokens (no special tokens: the remote tokenizer's encoding)."""
    import torch

    ctx = tokenizer.encode(context, add_special_tokens=False)
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    cont = whole[len(ctx):]
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return float(sum(logp[len(ctx) - 1 + i, t] for i, t in enumerate(cont)))


@pytest.mark.skipif(lm_eval_python() is None, reason="lm_eval is not installed "
                    "(pip install \"lm_eval[api]\", or set LM_EVAL_PYTHON to a Python that has it)")
def test_lm_eval_local_completions_and_chat(server, tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name, body in (("tiny_mc", MC), ("tiny_gen", GEN)):
        (tmp_path / f"{name}.yaml").write_text(TASK.format(name=name, data=data) + body)
    python = lm_eval_python()
    common = "model=tiny,tokenizer_backend=remote,num_concurrent=2,max_retries=1"
    mc = run_lm_eval(python, tmp_path, "local-completions",
                     f"base_url={server.url}/v1/completions,{common}", "tiny_mc")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert len(mc) == len(DOCS)
    for s in mc:  # lm-eval's own (context, continuation) pairs, choices in order
        pairs = [(a["arg_0"], a["arg_1"]) for a in s["arguments"].values()]
        got = [float(r[0][0]) for r in s["resps"]]
        want = [hf_loglikelihood(model, tokenizer, *pair) for pair in pairs]
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
        assert s["acc"] == float(int(np.argmax(want)) == DOCS[s["doc_id"]]["label"])
    gen = run_lm_eval(python, tmp_path, "local-chat-completions",
                      f"base_url={server.url}/v1/chat/completions,{common}", "tiny_gen",
                      "--apply_chat_template")
    assert len(gen) == len(DOCS)
    for s in gen:  # greedy: transformers' answer to the same rendered conversation
        messages = [{"role": "user", "content": DOCS[s["doc_id"]]["question"]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
        want = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True).split("\n")[0]
        assert s["resps"][0][0] == want
