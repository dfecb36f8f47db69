"""bench.offline --eos-after on the CPU: requests of a random-weight model end with EOS at
their drawn length through the engine's own stop rule (``bench.internals.eos_after``), with
max_tokens unchanged, under both admission policies; the draws and the option's checks."""

from __future__ import annotations

import collections
import json

import pytest

from bench import internals, offline


def test_eos_after_draws_and_checks():
    args = offline.parse_args(["--eos-after", "8:24", "--num-prompts", "200", "--seed", "5"])
    assert args.eos_after == (8, 24)
    drawn = offline.eos_counts(args, 200, 0)
    assert drawn == offline.eos_counts(args, 200, 0) != offline.eos_counts(args, 200, 1)
    assert min(drawn) == 8 and max(drawn) == 24  # 200 draws of 17 values reach both ends
    assert offline.eos_counts(offline.parse_args([]), 200, 0) is None
    for bad in (["--eos-after", "8"], ["--eos-after", "0:4"], ["--eos-after", "9:3"],
                ["--eos-after", "a:b"], ["--eos-after", "2:4", "--prefill-only"]):
        with pytest.raises(SystemExit):
            offline.parse_args(bad)


def test_eos_after_ends_requests_through_the_stop_rule():
    from jfp8kv import LLM, SamplingParams

    llm = LLM("random:qwen3-tiny", kv_cache_dtype="bfloat16", max_model_len=64, seed=0)
    prompts = [[(97 * i + j) % 4000 for j in range(12)] for i in range(5)]
    counts = [1, 4, 2, 13, 7]
    params = [SamplingParams(max_tokens=40, temperature=0)] * len(prompts)
    with internals.eos_after(llm, counts) as stop_at:
        outs = llm.generate(prompts, params)
    eos = min(llm.engine.eos_token_ids)
    for o, n in zip(outs, counts):
        assert stop_at[o.request_id] == n and len(o.token_ids) == n
        assert o.finish_reason == "stop" and o.token_ids[-1] == eos
        assert eos not in o.token_ids[:-1] and f"t{eos}" not in o.text
    assert not {"add_request", "_take"} & set(vars(llm.engine))  # the class's methods again
    assert internals.admission_state(llm)["used"] is not None  # it learned from the finishes
    again = llm.generate(prompts[:1], SamplingParams(max_tokens=20, temperature=0))[0]
    assert len(again.token_ids) == 20 and again.finish_reason == "length"
    with pytest.raises(ValueError, match="ignore_eos"):
        with internals.eos_after(llm, [3]):
            llm.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))


@pytest.mark.timeout(900)
def test_offline_eos_after_under_both_admissions(tmp_path):
    """12 requests of 16 tokens may make 64 but end after 2-9: both policies run on one
    load (a 12-page pool of 16 tokens: reserve starts 2 at ratio 1), every request ends
    with EOS at its drawn length, and the record says so."""
    out = tmp_path / "offline.json"
    argv = ["--model", "random:qwen3-tiny", "--num-prompts", "12", "--input-len", "16",
            "--output-len", "64", "--eos-after", "2:9", "--kv-cache-dtype", "bfloat16",
            "--kv-cache-memory", str(12 * 16 * 512), "--admission", "greedy,reserve",
            "--warmup", "off", "--out", str(out)]
    assert offline.main(argv) == 0
    drawn = offline.eos_counts(offline.parse_args(argv), 12, 0)
    want = {str(k): v for k, v in sorted(collections.Counter(drawn).items())}
    runs = json.loads(out.read_text())["runs"]
    assert [r["admission"] for r in runs] == ["greedy", "reserve"]
    for r in runs:
        assert r["eos_after"] == "2:9" and r["output_len"] == 64
        assert r["finish_reasons"] == {"stop": 12} and r["ended_as_drawn"] == 12
        assert r["generated_tokens"]["counts"] == r["eos_drawn"]["counts"] == want
        assert r["total_output_tokens"] == sum(drawn)
        assert r["admission_at_start"]["policy"] == r["admission"]
