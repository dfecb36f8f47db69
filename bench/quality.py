"""fp8 KV quality on real models: NLL, KL, greedy agreement and passkey retrieval.

    python -m bench.quality [--model smollm2|qwen|PATH] [--dtype bfloat16] [--max-len 8192]
                            [--keys 25] [--time-budget S] [--out PATH] [--quick]
                            [--configs bf16,fp8_e4m3:token,fp8_e4m3:token+hadamard,...|rotation]
    python -m bench.quality --decide --model smollm2|qwen|qwen-1.5b [--resume] [--time-budget S]
    python -m bench.quality --decide-from A.json,B.json,C.json [--costs COSTS.json]
    python -m bench.quality --plot-only PATH.json

``--model``: smollm2 (SmolLM2-135M-Instruct, the embedded GGUF; the default), qwen
(Qwen2.5-Coder-0.5B-Instruct) or qwen-1.5b (Qwen2.5-Coder-1.5B-Instruct), the last two GGUFs
shipped in PyPI wheels (``bench.second_model``), loaded by jfp8kv's own loaders; results go
to ``bench/results/quality-<model>.json``.

``--decide`` is issue 36's run (docs/lab/quality.md section 6): the ``decide`` configs (bf16,
e4m3 token, then the seven candidates in the rule's order), at least 64,000 scored
positions per context in consecutive windows of the text before the calibration slice (the
same tokens at 1k, 4k and 8k), every mean with a standard error from blocks of
``--se-block`` positions, paired between configs (``bench.quality_stats``), 200 passkey
prompts per length, the passkey run for bf16 and the first two configs meeting the text
targets. The baseline's logits are not kept: a second engine (bf16 cache, built once)
recomputes them next to each config's, chunk by chunk. ``--resume`` keeps the configs an
earlier run of the same settings completed in ``--out``; ``--decide-from`` applies the rule
across the three models' results.
A config is ``bf16`` or ``<format>:<mode>[+<rotation>][:<scales>]`` (``CONFIG_SYNTAX``);
the rotation is the engine's ``kv_rotation`` (hadamard, smooth, smooth+hadamard; none when
omitted), and its static scales and smoothing means are calibrated in the basis K is stored
in. ``--configs rotation`` runs bf16 and e4m3 token/block/tensor with each K transform.

Every config is one ``jfp8kv.LLM`` (the default attention backend: Pallas kernels on a GPU,
the reference elsewhere) with compute dtype ``--dtype``; ``bf16`` means an unquantized cache
in the compute dtype (the baseline every fp8 config is compared with). Static scales
("calib", the default for tensor/channel, and for smoothing transforms the K means) are
measured by the engine's calibration (``jfp8kv.engine.calibrate.measure_amax``, one file per
K transform) on a held-out slice of the text; ``auto`` uses the engine's start-up
calibration, a number is a constant scale. Configs run in order of importance (bf16, e4m3
token = the default ``fp8``, e4m3 block/channel/tensor, then e5m2), and the JSON is rewritten after every config, so a
run cut short keeps what it measured; ``--time-budget`` skips the configs that would not end
in time and records them under ``skipped``. Measurements, per config:

* runs: for contexts 1k, 4k and ``--max-len`` tokens, windows of Python's pydoc topics (about
  ``--tokens-per-context`` tokens per context, strided through the text, or ``--min-scored``
  positions in consecutive windows), scored teacher-forced through the paged cache
  (``LLM.nll``'s path, logits kept on the device): mean NLL; KL(baseline || config) of the
  next-token distributions, averaged over positions; greedy agreement, the fraction of
  positions where the argmax equals the baseline's; each with its block standard error and
  the block sums (``blocks``) every paired comparison is computed from.
* passkey: "The pass key is NNNNN. Remember it." hidden at depths 0-100% of a filler
  haystack; prompts of 1k, 2k, 4k and 8k tokens (capped at --max-len minus the answer)
  ending with the question; ``--keys`` random 5-digit keys per (length, depth), the same for
  every config; all prompts of one length go through one ``LLM.generate`` call (greedy,
  8 tokens). Scoring (digits scored): an answer is correct when the string of all decimal
  digits in the generated text, in order, contains the key's five digits
  (``passkey_correct``); ``accuracy_first_number`` also records the stricter rule "the first
  number in the answer equals the key".

The baseline runs first; when its passkey accuracy is too low to resolve differences, the
output says so (``passkey_note``) and the NLL/KL numbers are the ones to judge by.
``targets`` applies issue 36's targets to every fp8 config (``quality_stats.evaluate``: NLL
increase and KL ratio against e4m3 token, each + 1 standard error; passkey within 2 paired
standard errors); ``targets_issue6`` checks issue #6's for the default (e4m3, token scales);
``rotation_targets`` checks issue #14's for every other fp8 config against fp8_e4m3:token
(KL <= 0.5x its KL and mean-NLL increase <= +0.10% at every context).
Writes the JSON (``--out``) and PNG plots next to it (``-passkey.png`` heatmaps,
``-nll.png``). JAX only: no torch, no network (SmolLM2 is the embedded GGUF; qwen fetches
its wheels once with pip unless the GGUF is already in the jfp8kv cache directory).

Shapes (each distinct shape is one compile per config, and configs share none: the cache's
dtype, scale mode and page count are static): one ``nll`` program (1 x ``chunk`` tokens), one
prefill program for every passkey length (all prompts of a length padded to the longest
length, ``--passkey-shapes one``), one decode program (the batch of one length).
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import json
import math
import os
import platform
import re
import tempfile
import time
import traceback

import numpy as np

import jax
import jax.numpy as jnp

import jfp8kv
from bench import internals
from bench import quality_stats as qs
from bench.common import RESULTS, command_line, machine_info
from jfp8kv.engine.runner import bucket
from jfp8kv.engine import calibrate as engine_calibrate
from jfp8kv.config import KV_ROTATIONS
from jfp8kv.kvcache import k_transform
from jfp8kv.kvcache.cache import bytes_per_token

MODES = ("tensor", "channel", "token", "block")
# Most important first (a run cut short by --time-budget keeps these): the baseline, the
# default fp8 mode (e4m3, token scales), the other e4m3 modes, then e5m2.
RUN_ORDER = ("token", "block", "channel", "tensor")
DEFAULT_CONFIGS = ["bf16"] + [f"{f}:{m}" for f in ("fp8_e4m3", "fp8_e5m2") for m in RUN_ORDER]
QUICK_CONFIGS = ["bf16", "fp8_e4m3:token", "fp8_e5m2:channel"]
DEFAULT_FP8 = "fp8_e4m3"  # what --kv-cache-dtype fp8 means
NLL_TARGET_PCT = 0.05  # issue #6: default fp8 mode mean NLL within +0.05% of bf16 ...
PASSKEY_TARGET_PTS = 2.0  # ... and passkey accuracy within 2 points, at every length
DEPTHS = (0, 25, 50, 75, 100)
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again.")
INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant "
               "text. Find it and memorize it. I will ask you about it.\n\n")
QUESTION = "\n\nWhat is the pass key? The pass key is"
NEW_TOKENS = 8
CALIB_CHARS = 400_000  # held-out calibration slice of the text starts near here
WINDOW_STRIDE = 80_000  # characters between context groups (the text has ~465k)


# -- text ----------------------------------------------------------------------------------
@functools.cache
def natural_text() -> str:
    """Python's own documentation topics: natural English prose shipped with CPython."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def text_windows(tokenizer, context: int, n: int, start_chars: int) -> list[list[int]]:
    """``n`` consecutive non-overlapping windows of ``context`` tokens from a paragraph start."""
    text = natural_text()
    start = text.index("\n\n", start_chars) + 2 if start_chars else 0
    ids = tokenizer.encode(text[start:start + 6 * context * n])
    if len(ids) < context * n:
        raise ValueError(f"text from {start} has only {len(ids)} tokens, need {context * n}")
    return [ids[i * context:(i + 1) * context] for i in range(n)]


def scored_windows(tokenizer, context: int, n: int) -> list[list[int]]:
    """``n`` consecutive non-overlapping windows of ``context`` tokens of the text before the
    calibration slice (characters [0, CALIB_CHARS)), from its start; every context length
    cuts the same token stream, so 1k, 4k and 8k score the same text. ValueError when that
    part of the text has fewer than ``context * n`` tokens."""
    ids = scored_ids(tokenizer)
    if len(ids) < context * n:
        raise ValueError(f"the text before the calibration slice (characters 0-{CALIB_CHARS}) "
                         f"has {len(ids)} tokens, {n} windows of {context} need {context * n}")
    return [ids[i * context:(i + 1) * context] for i in range(n)]


_SCORED: dict = {}


def scored_ids(tokenizer) -> list[int]:
    """The token ids of characters [0, CALIB_CHARS) of the text (cached per tokenizer)."""
    hit = _SCORED.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:  # the entry holds the tokenizer: no id reuse
        hit = _SCORED[id(tokenizer)] = (tokenizer,
                                        list(tokenizer.encode(natural_text()[:CALIB_CHARS])))
    return hit[1]


def windows_for(min_scored: int, context: int) -> int:
    """Windows of ``context`` tokens that score at least ``min_scored`` positions (a window
    of n tokens scores its n - 1 next tokens)."""
    return max(1, -(-min_scored // (context - 1)))


# -- configs -------------------------------------------------------------------------------
FORMATS = ("fp8_e4m3", "fp8_e5m2")
CONFIG_SYNTAX = ("bf16, or <format>:<mode>[+<rotation>][:<scales>] with format "
                 f"{'|'.join(FORMATS)}, mode {'|'.join(MODES)}, rotation "
                 f"{'|'.join(r for r in KV_ROTATIONS if r != 'none')} (omitted: none) and "
                 "scales calib|auto|<float> (e.g. fp8_e4m3:token, fp8_e4m3:token+hadamard, "
                 "fp8_e4m3:block+smooth, fp8_e4m3:tensor+smooth+hadamard:calib)")
# --configs rotation: bf16 and e4m3 token/block/tensor, each with every K transform (the
# unrotated token config, today's default, first: it is the issue-#14 baseline).
ROTATION_MODES = ("token", "block", "tensor")
ROTATION_CONFIGS = ["bf16"] + [f"fp8_e4m3:{m}" + ("" if r == "none" else f"+{r}")
                               for m in ROTATION_MODES for r in KV_ROTATIONS]
# --configs decide: issue 36's candidates (bench.quality_stats.DECIDE_CONFIGS: bf16, the
# reference e4m3 token, then the candidates in the decision rule's order of preference).
PRESETS = {"default": DEFAULT_CONFIGS, "quick": QUICK_CONFIGS, "rotation": ROTATION_CONFIGS,
           "decide": list(qs.DECIDE_CONFIGS)}


def parse_config(s: str) -> dict:
    """A config string (``CONFIG_SYNTAX``) -> {name, kv_cache_dtype, kv_scale_mode,
    kv_rotation, scales}; ValueError naming the syntax otherwise. ``scales`` defaults to
    "calib" for static modes (tensor/channel) and for smoothing transforms (the calibration
    file also carries the K means), None otherwise; "calib" files are measured in the basis
    K is stored in (``main``)."""
    if s in ("bf16", "auto"):
        return {"name": "bf16", "kv_cache_dtype": "auto", "kv_scale_mode": None,
                "kv_rotation": "none", "scales": None}
    parts = s.split(":")
    if len(parts) not in (2, 3) or parts[0] not in FORMATS:
        raise ValueError(f"bad config {s!r}: want {CONFIG_SYNTAX}")
    mode, _, rot = parts[1].partition("+")
    rot = rot or "none"
    if mode not in MODES:
        raise ValueError(f"bad config {s!r}: unknown scale mode {mode!r}; want {CONFIG_SYNTAX}")
    if rot not in KV_ROTATIONS or (rot == "none" and "+" in parts[1]):
        raise ValueError(f"bad config {s!r}: unknown K rotation "
                         f"{parts[1].partition('+')[2]!r}; want {CONFIG_SYNTAX}")
    if len(parts) == 3:
        scales = parts[2]
        if scales not in ("calib", "auto"):
            try:
                ok = float(scales) > 0
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"bad config {s!r}: scales {scales!r} is not calib, auto or a "
                                 f"positive number; want {CONFIG_SYNTAX}")
    else:
        scales = "calib" if mode in ("tensor", "channel") or k_transform.smooths(rot) else None
    return {"name": s, "kv_cache_dtype": parts[0], "kv_scale_mode": mode, "kv_rotation": rot,
            "scales": scales}


def config_names(spec: str | None, quick: bool) -> list[str]:
    """``--configs``: comma-separated config strings and preset names (``PRESETS``), in
    order, duplicates dropped; None -> the quick or default preset."""
    names = []
    for item in (spec.split(",") if spec else ["quick" if quick else "default"]):
        item = item.strip()
        for n in PRESETS.get(item, [item]):
            if n and n not in names:
                names.append(n)
    return names


def kv_scales_arg(scales, calib_path):
    if scales is None or scales == "auto":
        return None
    return calib_path if scales == "calib" else float(scales)


# -- teacher-forced metrics ------------------------------------------------------------------
@jax.jit
def _compare(base_logits, logits):
    """[T, V] float32 each -> (KL(base || q) [T], argmax agreement [T])."""
    lb = jax.nn.log_softmax(base_logits, axis=-1)
    lq = jax.nn.log_softmax(logits, axis=-1)
    kl = jnp.sum(jnp.exp(lb) * (lb - lq), axis=-1)
    return kl, jnp.argmax(base_logits, -1) == jnp.argmax(logits, -1)


def score_text(llm, windows, chunk: int, base_llm=None) -> dict:
    """Teacher-forced scoring of ``windows`` -> per-position host arrays {"nll", "kl",
    "agree", "base_nll"} and "lengths" (scored positions per window). ``base_llm``: the
    baseline's engine, run on the same chunks right before this config's so its logits
    never have to be kept (None: ``llm`` is the baseline; kl 0, agreement 1). Logits stay on
    the device, one window at a time."""
    out = {k: [] for k in ("nll", "kl", "agree", "base_nll")}
    lengths = []
    for ids in windows:
        base = base_llm.nll_chunks(ids, chunk) if base_llm is not None else None
        mine = llm.nll_chunks(ids, chunk)
        for i, (nll, logits, n) in enumerate(mine):
            if base is None:
                kl, ag, bn = jnp.zeros(n), jnp.ones(n, bool), nll
            else:
                kl, ag = _compare(base[i][1], logits)
                bn = base[i][0]
            for k, v in (("nll", nll), ("kl", kl), ("agree", ag), ("base_nll", bn)):
                out[k].append(np.asarray(v[:n]))
        lengths.append(len(ids) - 1)
        del base, mine
    res = {k: np.concatenate(v) for k, v in out.items()}
    res["lengths"] = lengths
    return res


def text_record(scored: dict, block: int, baseline: bool) -> dict:
    """One (config, context)'s means, standard errors (``quality_stats``) and block sums
    from ``score_text``'s arrays."""
    bounds = qs.block_bounds(scored["lengths"], block)
    sums = {k: qs.block_sums(scored[k], bounds) for k in ("nll", "kl", "agree", "base_nll")}
    blocks = {"n": [b - a for a, b in bounds], "nll": sums["nll"].tolist()}
    if not baseline:
        blocks.update(kl=sums["kl"].tolist(), agree=sums["agree"].tolist(),
                      d_nll=qs.block_sums(scored["nll"] - scored["base_nll"].astype(np.float64),
                                          bounds).tolist(),
                      base_nll=sums["base_nll"].tolist())
    stats = qs.text_stats(blocks, not baseline)
    rec = {"positions": int(len(scored["nll"])), "se_block": block, "blocks_n": len(bounds),
           "mean_nll": stats["mean_nll"], "mean_nll_se": stats["mean_nll_se"],
           "kl": stats.get("kl", 0.0), "kl_se": stats.get("kl_se", 0.0),
           "greedy_agreement": stats.get("greedy_agreement", 1.0),
           "greedy_agreement_se": stats.get("greedy_agreement_se", 0.0)}
    if not baseline:
        rec.update(nll_increase_pct=stats["nll_increase_pct"],
                   nll_increase_pct_se=stats["nll_increase_pct_se"],
                   baseline_mean_nll=float(scored["base_nll"].mean()))
    rec["blocks"] = blocks
    return rec


# -- passkey -------------------------------------------------------------------------------
class Passkey:
    """Builds passkey prompts as token ids (pieces tokenized separately, then joined)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
        self.enc = enc
        self.prefix = enc(INSTRUCTION)
        self.question = enc(QUESTION)
        self.sentences = [enc(" " + s) for s in FILLER]

    def prompt(self, key: int, length: int, depth: int) -> list[int]:
        """At most ``length`` tokens (whole filler sentences, a few short of it); the needle
        starts at the sentence boundary nearest to ``depth``% of the haystack."""
        needle = self.enc(f" The pass key is {key}. Remember it.")
        room = length - len(self.prefix) - len(self.question) - len(needle)
        hay, bounds, i = [], [0], 0
        while len(hay) + len(self.sentences[i % len(self.sentences)]) <= room:
            hay += self.sentences[i % len(self.sentences)]
            bounds.append(len(hay))
            i += 1
        if not hay:
            raise ValueError(f"passkey length {length} is too short for the prompt")
        at = min(bounds, key=lambda b: abs(b - len(hay) * depth / 100))
        return self.prefix + hay[:at] + needle + hay[at:] + self.question


def passkey_keys(length: int, depth: int, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng([seed, length, depth])
    return [int(k) for k in rng.integers(10000, 100000, size=n)]


def answer_digits(text: str) -> str:
    return "".join(re.findall(r"[0-9]", text))


def passkey_correct(text: str, key: int) -> bool:
    """The scoring rule (digits scored): every decimal digit of the generated text, in
    order, joined into one string; correct when that string contains the key's digits.
    So " 43743. Remember" and "43 743" count, "4374" and "43748" do not."""
    return str(key) in answer_digits(text)


def first_number_is(text: str, key: int) -> bool:
    """The stricter rule: the first run of digits in the answer equals the key."""
    m = re.search(r"[0-9]+", text)
    return m is not None and m.group() == str(key)


def run_passkey(llm, pk: Passkey, lengths, depths, keys: int, seed: int):
    """One generate call per length (all depths and keys). With ``--passkey-shapes one`` the
    LLM is built with ``min_prefill_chunk`` = the longest length's bucket, so all lengths share
    one compiled prefill program (the padded lanes cost little next to a compile; teacher-forced
    scoring does not use that knob). -> (cell records, per-length list of per-prompt
    correctness, per-length seconds, per-length examples of missed keys)."""
    cells, correct, seconds, misses = [], {}, {}, {}
    params = jfp8kv.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for length in lengths:
        t = time.time()
        prompts, meta = [], []
        for d in depths:
            for k in passkey_keys(length, d, keys, seed):
                prompts.append(pk.prompt(k, length, d))
                meta.append((d, k))
        outs = llm.generate(prompts, params)
        ok = [passkey_correct(o.text, k) for o, (_, k) in zip(outs, meta)]
        strict = [first_number_is(o.text, k) for o, (_, k) in zip(outs, meta)]
        correct[length] = ok
        for d in depths:
            idx = [i for i, (dd, _) in enumerate(meta) if dd == d]
            cells.append({"length": length, "depth": d,
                          "accuracy": float(np.mean([ok[i] for i in idx])),
                          "n": len(idx),
                          "accuracy_first_number": float(np.mean([strict[i] for i in idx])),
                          "prompt_tokens": max(len(prompts[i]) for i in idx)})
        seconds[length] = round(time.time() - t, 2)
        misses[length] = [{"depth": d, "key": k, "answer": o.text}
                          for o, (d, k), g in zip(outs, meta, ok) if not g][:4]
        j = len(outs) // 2
        print(f"    passkey {length}: {np.mean(ok):.3f} ({seconds[length]}s; e.g. "
              f"{outs[j].text!r} for key {meta[j][1]})", flush=True)
    return cells, correct, seconds, misses


# -- plots ---------------------------------------------------------------------------------
def plot(doc, stem: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c["name"] for c in doc["configs"]]
    if doc["passkey"]:
        lengths = sorted({p["length"] for p in doc["passkey"]})
        depths = sorted({p["depth"] for p in doc["passkey"]})
        cols = min(5, len(names))
        rows = -(-len(names) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.4 * rows), squeeze=False)
        for ax in axes.flat[len(names):]:
            ax.axis("off")
        for ax, cfg in zip(axes.flat, doc["configs"]):
            grid = np.full((len(lengths), len(depths)), np.nan)
            for p in doc["passkey"]:
                if p["config"] == cfg["name"]:
                    grid[lengths.index(p["length"]), depths.index(p["depth"])] = p["accuracy"]
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for (i, j), v in np.ndenumerate(grid):
                ax.text(j, i, "" if np.isnan(v) else f"{v:.2f}", ha="center", va="center",
                        fontsize=7)
            ax.set_xticks(range(len(depths)), [f"{d}%" for d in depths], fontsize=7)
            ax.set_yticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
            ax.set_title(cfg["name"] + (" (default)" if cfg["default"] else ""), fontsize=8)
        fig.suptitle(f"Passkey accuracy (rows: prompt tokens, columns: depth), {doc['machine']}",
                     fontsize=9)
        fig.tight_layout()
        fig.savefig(stem + "-passkey.png", dpi=110)
        plt.close(fig)
    contexts = sorted({r["context"] for r in doc["runs"]})
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(12.0, 1.3 * len(names)), 4.5))
    width = 0.8 / max(1, len(contexts))
    x = np.arange(len(names))
    for i, c in enumerate(contexts):
        base = {r["context"]: r["mean_nll"] for r in doc["runs"] if r["kv_cache_dtype"] in
                ("bfloat16", "float16", "float32")}
        rs = {r["config"]: r for r in doc["runs"] if r["context"] == c}
        inc = [100 * (rs[n]["mean_nll"] / base[c] - 1) if n in rs else np.nan for n in names]
        a1.bar(x + i * width, inc, width, label=f"{c} tokens")
        a2.bar(x + i * width, [rs[n]["kl"] if n in rs else np.nan for n in names], width,
               label=f"{c} tokens")
    for ax, t in ((a1, "mean NLL increase over the unquantized cache (%)"),
                  (a2, "mean KL(unquantized || config), nats")):
        ax.set_xticks(x + 0.4 - width / 2, [n.replace("fp8_", "") for n in names],
                      rotation=40, ha="right", rotation_mode="anchor", fontsize=7)
        ax.set_title(t, fontsize=9)
        ax.axhline(0, color="k", lw=0.5)
        ax.legend(fontsize=7)
    fig.suptitle(f"{doc['model']}, {doc['dtype']} compute, {doc['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(stem + "-nll.png", dpi=110)
    plt.close(fig)


# -- summaries -----------------------------------------------------------------------------
def passkey_vs_baseline(correct, base_correct, base_name: str):
    """Per length: accuracy with its binomial standard error and, against the baseline on
    the same prompts, the difference in points with its paired standard error and the
    counts of keys lost (the baseline found them, this config did not) and gained
    (``quality_stats.passkey_paired``)."""
    out = []
    for length, ok in correct.items():
        b = base_correct.get(length)
        n = len(ok)
        p = float(np.mean(ok))
        rec = {"length": length, "n": n, "accuracy": p,
               "accuracy_se": math.sqrt(p * (1 - p) / n)}
        if b is not None and len(b) == len(ok):
            pair = qs.passkey_paired(ok, b)
            rec.update(baseline=base_name, baseline_accuracy=pair["baseline_accuracy"],
                       baseline_accuracy_se=pair["baseline_accuracy_se"],
                       delta_pts=float(round(pair["delta_pts"], 3)),
                       delta_se_pts=float(round(pair["delta_se_pts"], 3)),
                       lost=pair["lost"], gained=pair["gained"])
        out.append(rec)
    return out


def evaluate_targets(doc, name: str) -> dict:
    """Issue #6's targets for one config (the default fp8 mode): mean NLL within
    +NLL_TARGET_PCT % of the baseline at every context, passkey accuracy at most
    PASSKEY_TARGET_PTS points below the baseline at every length."""
    base = {r["context"]: r["mean_nll"] for r in doc["runs"] if r["config"] == "bf16"}
    nll = []
    for r in doc["runs"]:
        if r["config"] == name and r["context"] in base:
            inc = float(100 * (r["mean_nll"] / base[r["context"]] - 1))
            nll.append({"context": r["context"], "nll_increase_pct": round(inc, 4),
                        "met": bool(inc <= NLL_TARGET_PCT)})
    pk = [{"length": p["length"], "delta_pts": p["delta_pts"], "lost": p["lost"],
           "gained": p["gained"], "met": bool(p["delta_pts"] >= -PASSKEY_TARGET_PTS)}
          for p in doc["passkey_summary"] if p["config"] == name and "delta_pts" in p]
    met = [x["met"] for x in nll + pk]
    return {"config": name,
            "rule": f"mean NLL increase <= +{NLL_TARGET_PCT}% at every context; passkey "
                    f"accuracy >= baseline - {PASSKEY_TARGET_PTS} points at every length",
            "nll": nll, "passkey": pk,
            "met": bool(all(met)) if nll else None}


ROT_BASELINE = "fp8_e4m3:token"  # issue #14: today's default fp8 cache (token, unrotated)
ROT_KL_RATIO, ROT_NLL_PCT = 0.5, 0.10  # KL <= 0.5x the baseline's; NLL increase <= +0.10%


def evaluate_rotation_targets(doc, baseline: str = ROT_BASELINE) -> dict | None:
    """Issue #14's targets for every fp8 config measured, relative to ``baseline`` (e4m3
    token, unrotated): at every context, KL(bf16 || config) <= ROT_KL_RATIO x the baseline's
    KL and mean-NLL increase over bf16 <= +ROT_NLL_PCT %. None until bf16 and the baseline
    have runs. Per config: per-context numbers and ``met`` (None when it shares no context
    with the baseline)."""
    by = {}
    for r in doc["runs"]:
        by.setdefault(r["config"], {})[r["context"]] = r
    base, ref = by.get("bf16"), by.get(baseline)
    if not base or not ref:
        return None
    out = []
    for c in doc["configs"]:
        name = c["name"]
        if name in ("bf16", baseline) or name not in by:
            continue
        rows = []
        for ctx, r in sorted(by[name].items()):
            if ctx not in base or ctx not in ref:
                continue
            inc = float(100 * (r["mean_nll"] / base[ctx]["mean_nll"] - 1))
            ratio = r["kl"] / ref[ctx]["kl"] if ref[ctx]["kl"] > 0 else float("inf")
            rows.append({"context": ctx, "kl": r["kl"], "baseline_kl": ref[ctx]["kl"],
                         "kl_ratio": round(float(ratio), 4),
                         "nll_increase_pct": round(inc, 4),
                         "greedy_agreement": r["greedy_agreement"],
                         "met": bool(ratio <= ROT_KL_RATIO and inc <= ROT_NLL_PCT)})
        out.append({"config": name, "kv_scale_mode": c.get("kv_scale_mode"),
                    "kv_rotation": c.get("kv_rotation", "none"), "contexts": rows,
                    "met": bool(all(x["met"] for x in rows)) if rows else None})
    return {"baseline": baseline,
            "rule": f"at every context: KL(bf16 || config) <= {ROT_KL_RATIO} x {baseline}'s KL "
                    f"and mean NLL increase over bf16 <= +{ROT_NLL_PCT}%",
            "baseline_nll_increase_pct": {
                str(ctx): round(float(100 * (r["mean_nll"] / base[ctx]["mean_nll"] - 1)), 4)
                for ctx, r in sorted(ref.items()) if ctx in base},
            "configs": out, "met_by": [x["config"] for x in out if x["met"]]}


def resolve_model(name: str) -> tuple[str, str | None]:
    """``--model`` -> (results key, what ``load_model`` / ``jfp8kv.LLM`` take)."""
    if name in ("smollm2", "default"):
        return "smollm2", None
    if name in wheel_models():
        from bench.second_model import gguf_path

        return name, str(gguf_path(name))
    key = re.sub(r"[^A-Za-z0-9._-]+", "-", os.path.splitext(os.path.basename(
        name.rstrip("/")))[0] or name).strip("-").lower()
    return key or "model", name


def calibrate_files(loaded, calib_ids, configs) -> dict:
    """One scales JSON per K transform the configs calibrate ("calib" scales), measured by the
    engine's own calibration (``engine.calibrate.measure_amax``) on the held-out ids in the
    basis K is stored in (with the K means for smoothing). -> {kv_rotation: path}."""
    tmp = tempfile.mkdtemp(prefix="jfp8kv-quality-")
    paths = {}
    for rot in dict.fromkeys(c["kv_rotation"] for c in configs if c["scales"] == "calib"):
        paths[rot] = os.path.join(tmp, f"scales-{rot.replace('+', '-')}.json")
        engine_calibrate.measure_amax(loaded.config, loaded.params, [calib_ids],
                                      kv_rotation=rot).to_json(paths[rot])
    return paths


# -- main ----------------------------------------------------------------------------------
def arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype (bfloat16, float32)")
    ap.add_argument("--max-len", type=int, default=None, help="largest context (8192)")
    ap.add_argument("--keys", type=int, default=None,
                    help="passkeys per cell (25: 5 depths x 25 = 125 prompts fill the "
                         "128-row batch bucket that 100 prompts would pad to anyway; "
                         "--decide: 40, 200 prompts per length)")
    ap.add_argument("--configs", default=None,
                    help=f"comma-separated, run in this order (bf16 always first): "
                         f"{CONFIG_SYNTAX}; or a preset among them: {', '.join(PRESETS)} "
                         f"(rotation = {','.join(ROTATION_CONFIGS)}; decide = "
                         f"{','.join(qs.DECIDE_CONFIGS)}; default: {','.join(DEFAULT_CONFIGS)})")
    ap.add_argument("--tokens-per-context", type=int, default=None,
                    help="text tokens scored per context (16384), in windows strided through "
                         "the text; --min-scored replaces it")
    ap.add_argument("--min-scored", type=int, default=None,
                    help="at least this many scored positions per context: ceil(N / (context "
                         "- 1)) consecutive windows of the text before the calibration slice, "
                         "the same tokens for every context (--decide: 64000)")
    ap.add_argument("--se-block", type=int, default=qs.SE_BLOCK,
                    help="positions per block for the standard errors (bench.quality_stats)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="default: every prompt of one passkey length at once")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="default: all prompts of one passkey length in one prefill step "
                         "(--decide: at most 262144)")
    ap.add_argument("--passkey-shapes", choices=("one", "per-length"), default="one",
                    help="one: pad every passkey length to the longest (one compiled prefill "
                         "per config); per-length: one per length")
    ap.add_argument("--passkey-for", choices=("all", "text-pass"), default=None,
                    help="all: every config (the default); text-pass: bf16 and, in the "
                         "decision rule's order, the first --passkey-limit configs meeting "
                         "issue 36's text targets on this model (--decide's default)")
    ap.add_argument("--passkey-limit", type=int, default=2)
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds from start: a config is skipped (and recorded under "
                         "'skipped') when it would end after this, judged by the slowest "
                         "config so far")
    ap.add_argument("--resume", action="store_true",
                    help="keep the configs already complete in --out (same model, dtype, "
                         "text and passkey settings) and run the others")
    ap.add_argument("--survivors-of", default=None, metavar="JSON[,JSON...]",
                    help="run only bf16, the reference and the configs that meet issue 36's "
                         "text targets in every one of these results")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--model", default="smollm2",
                    help="smollm2 (the embedded SmolLM2-135M-Instruct GGUF, the default), "
                         f"{', '.join(wheel_models())} (GGUFs shipped in PyPI wheels, "
                         "bench.second_model) or any model jfp8kv.LLM loads (a .gguf path, "
                         "an HF directory, random:<preset>)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-passkey", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="tiny CPU smoke run: 512 tokens, 2 keys, 3 depths, 3 configs")
    ap.add_argument("--decide", action="store_true",
                    help="issue 36's decision run: --configs decide, --min-scored 64000, "
                         "--keys 40 (5 depths: 200 prompts per length), --passkey-for "
                         "text-pass; any of them can still be given")
    ap.add_argument("--decide-from", default=None, metavar="JSON,JSON,JSON",
                    help="run nothing: apply the decision rule (docs/lab/quality.md section 6) to "
                         "these models' --decide results; writes --out (default "
                         "bench/results/quality-decision.json)")
    ap.add_argument("--costs", default=None, metavar="JSON",
                    help="with --decide-from: {config: {decode_step_pct, capacity_pct}} "
                         "against fp8_e4m3:token (positive = worse)")
    ap.add_argument("--plot-only", metavar="JSON", default=None,
                    help="only redraw the PNGs of an existing result file")
    ap.add_argument("--out", default=None,
                    help="JSON path (default bench/results/quality-<model>.json, e.g. "
                         "quality-smollm2.json, quality-qwen.json; quality-<model>-quick.json "
                         "with --quick)")
    return ap


def wheel_models() -> list[str]:
    from bench.second_model import MODELS

    return list(MODELS)


def decide_main(args) -> dict:
    """``--decide-from``: the decision across models, written to ``--out`` and printed."""
    docs = []
    for path in args.decide_from.split(","):
        with open(path) as f:
            docs.append(json.load(f))
    costs = None
    if args.costs:
        with open(args.costs) as f:
            costs = json.load(f)
    info = machine_info()
    res = {"machine": info["device"], "versions": info["versions"],
           "command": command_line(),
           "inputs": args.decide_from.split(","), "costs_file": args.costs,
           **qs.decide(docs, costs)}
    out = args.out or os.path.join(RESULTS, "quality-decision.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    for r in res["candidates"]:
        print(f"{r['config']}: {'MET' if r['met'] else 'missed ' + str(len(r['missed']))}"
              + ("" if r["met"] else ": " + "; ".join(r["missed"][:6])), flush=True)
    print(f"default: {res['default']} ({res['note']}); wrote {out}", flush=True)
    return res


def survivors(paths: str) -> set[str] | None:
    """Configs meeting issue 36's text targets in every result in ``paths`` that exists
    (a missing one is reported and not used); None when none exists (no pruning)."""
    keep = None
    for path in paths.split(","):
        if not os.path.exists(path):
            print(f"--survivors-of: {path} does not exist; not pruning by it", flush=True)
            continue
        with open(path) as f:
            t = qs.evaluate(json.load(f))
        ok = set(t["text_met_by"]) if t else set()
        keep = ok if keep is None else keep & ok
    return keep


def settings(args, ap) -> dict:
    """The run's resolved settings from the arguments (presets applied)."""
    q, d = args.quick, args.decide
    max_len = args.max_len or (512 if q else 8192)
    try:
        names = config_names(args.configs or ("decide" if d else None), q)
        configs = [parse_config(c) for c in names]
    except ValueError as e:
        ap.error(str(e))
    configs = [c for c in configs if c["name"] != "bf16"]
    configs.insert(0, parse_config("bf16"))  # the baseline comes first
    keep = survivors(args.survivors_of) if args.survivors_of else None
    if keep is not None:
        keep |= {"bf16", qs.REFERENCE}
        print(f"--survivors-of: running {[c['name'] for c in configs if c['name'] in keep]}, "
              f"not {[c['name'] for c in configs if c['name'] not in keep]}", flush=True)
        pruned = [c["name"] for c in configs if c["name"] not in keep]
        configs = [c for c in configs if c["name"] in keep]
    else:
        pruned = []
    min_scored = args.min_scored or ((512 if q else qs.MIN_SCORED) if d else None)
    return {"quick": q, "max_len": max_len, "configs": configs, "pruned": pruned,
            "keys": args.keys or (2 if q else 40 if d else 25),
            "depths": (0, 50, 100) if q else DEPTHS,
            "per_context": args.tokens_per_context or (512 if q else 16384),
            "min_scored": min_scored,
            "passkey_for": "none" if args.no_passkey else (
                args.passkey_for or ("text-pass" if d else "all")),
            "contexts": [c for c in ((128, 256) if q else (1024, 4096)) if c < max_len]
            + [max_len],
            "lengths": [n for n in ((128, 256, 512) if q else (1024, 2048, 4096, 8192))
                        if n <= max_len]}


def text_groups(tok, st: dict) -> tuple[dict, dict]:
    """{context: windows} and the JSON's description of the text."""
    if st["min_scored"]:
        groups = {c: scored_windows(tok, c, windows_for(st["min_scored"], c))
                  for c in st["contexts"]}
        layout = {"layout": "consecutive windows of characters 0 to the calibration slice, "
                            "the same tokens for every context",
                  "scored_chars": [0, CALIB_CHARS], "min_scored": st["min_scored"],
                  "available_tokens": len(scored_ids(tok))}
    else:
        groups = {c: text_windows(tok, c, max(1, st["per_context"] // c), i * WINDOW_STRIDE)
                  for i, c in enumerate(st["contexts"])}
        layout = {"layout": f"context i's windows from the paragraph after character "
                            f"i x {WINDOW_STRIDE}"}
    # the pydoc topics differ between Python versions (3.11.7 and 3.12.3 part at character
    # 15,224: docs/lab/quality-smooth.md), so the text's hash says whether two runs scored the same
    return groups, {"source": "pydoc_data.topics", "python": platform.python_version(),
                    "sha256": hashlib.sha256(natural_text().encode()).hexdigest(), **layout,
                    "windows": {str(c): len(w) for c, w in groups.items()},
                    "chunk": st["contexts"][0]}


def resumable(doc: dict, fresh: dict) -> str | None:
    """Why ``doc`` (an earlier --out) cannot be resumed by a run described by ``fresh``;
    None when it can."""
    for k in ("model_key", "dtype", "quick", "text", "passkey_setup", "se_block"):
        if doc.get(k) != fresh.get(k):
            return f"{k} differs ({doc.get(k)!r} vs {fresh.get(k)!r})"
    return None


def main(argv=None):
    ap = arg_parser()
    args = ap.parse_args(argv)
    if args.plot_only:
        with open(args.plot_only) as f:
            plot(json.load(f), os.path.splitext(args.plot_only)[0])
        print(f"plotted {args.plot_only}", flush=True)
        return
    if args.decide_from:
        decide_main(args)
        return
    t0 = time.time()
    st = settings(args, ap)
    q, max_len, keys, depths = st["quick"], st["max_len"], st["keys"], st["depths"]
    configs, contexts, lengths = st["configs"], st["contexts"], st["lengths"]
    key, model = resolve_model(args.model)
    out = args.out or os.path.join(RESULTS, f"quality-{key}{'-quick' if q else ''}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    default_mode = internals.default_fp8_scale_mode()
    target_name = f"{DEFAULT_FP8}:{default_mode}"

    from jfp8kv.models.loader import load_model

    loaded = load_model(model, args.dtype)
    cfg = loaded.config
    tok = loaded.tokenizer
    groups, text_doc = text_groups(tok, st)
    calib_ids = text_windows(tok, min(max_len, 2048), 1, CALIB_CHARS)[0]
    calib_paths = calibrate_files(loaded, calib_ids, configs)
    pk = Passkey(tok)
    page = 16
    pk_lengths = [min(n, max_len - NEW_TOKENS) for n in lengths]
    # --passkey-shapes one: every passkey prefill padded to the longest length's bucket.
    one_chunk = bucket(max(pk_lengths)) if args.passkey_shapes == "one" else None
    bpt = bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, args.dtype, None)
    max_seqs = args.max_num_seqs or len(depths) * keys
    batched = args.max_num_batched_tokens or (
        min(max_seqs * max_len, 262144) if args.decide else max_seqs * max_len)
    # Passkey engines: every prompt of one length resident at once; fp8 configs get the same
    # bytes (so more pages). Text engines: one window (the baseline's stays for the run).
    cache_memory = (max_seqs + 1) * (max_len + page) * bpt + (64 << 20)
    text_memory = 2 * (max_len + page) * bpt + (16 << 20)
    setup_s = round(time.time() - t0, 1)
    print(f"setup {setup_s}s: {cfg.name}, {args.dtype}, contexts {contexts} "
          f"({', '.join(f'{c}: {len(w)} windows' for c, w in groups.items())}), passkey "
          f"({st['passkey_for']}) lengths {pk_lengths} x {len(depths)} depths x {keys} keys, "
          f"KV pool {cache_memory / 2**30:.1f} GiB, {len(configs)} configs, time budget "
          f"{'none' if args.time_budget is None else f'{args.time_budget:.0f}s'}", flush=True)

    info0 = machine_info()
    doc = {"machine": info0["device"], "versions": info0["versions"], "python": info0["python"],
           "command": command_line("bench.quality", argv) if argv is not None else
           command_line(),
           "model": cfg.name, "model_key": key, "dtype": args.dtype, "quick": q,
           "decide": args.decide,
           "default_fp8_scale_mode": default_mode,
           "default_note": f"'default' marks the default scale mode ({default_mode}) of each fp8 "
                           f"dtype; the default fp8 cache (--kv-cache-dtype fp8) is "
                           f"{target_name}, checked against issue 6 in 'targets_issue6'; "
                           f"'targets' applies issue 36's rule to every fp8 config",
           "text": text_doc, "se_block": args.se_block,
           "se_method": "ratio-estimator standard errors over blocks of --se-block positions, "
                        "paired between configs on the same blocks (bench/quality_stats.py)",
           "passkey_setup": {"needle": "The pass key is NNNNN. Remember it.",
                             "filler": " ".join(FILLER), "question": QUESTION.strip(),
                             "depths_pct": list(depths), "new_tokens": NEW_TOKENS,
                             "keys_per_cell": keys, "greedy": True,
                             "max_prompt_tokens": dict(zip(map(str, lengths), pk_lengths)),
                             "shapes": args.passkey_shapes, "seed": args.seed,
                             "scoring": "correct when the decimal digits of the generated "
                                        "text, joined in order, contain the key's 5 digits "
                                        "(accuracy_first_number: the first number equals the "
                                        "key)"},
           "passkey_for": st["passkey_for"], "passkey_limit": args.passkey_limit,
           "pruned": {"by": args.survivors_of, "configs": st["pruned"]},
           "kv_cache_memory": cache_memory, "text_kv_cache_memory": text_memory,
           "max_num_seqs": max_seqs, "max_num_batched_tokens": batched,
           "time_budget_s": args.time_budget, "setup_s": setup_s, "partial": True,
           "configs": [], "runs": [], "passkey": [], "passkey_summary": [],
           "passkey_correct": {}, "passkey_note": None, "targets": None,
           "targets_issue6": None, "rotation_targets": None,
           "calibration": {"tokens": len(calib_ids), "text_from_chars": CALIB_CHARS,
                           "kv_rotations": sorted(calib_paths),
                           "auto": "configs with ':auto' scales (the decide preset's smooth "
                                   "configs) use the engine's start-up calibration on its "
                                   "built-in text (jfp8kv.kvcache.calibrate.BUILTIN_TEXT)"},
           "invocations": [], "skipped": [], "errors": []}
    if args.resume and os.path.exists(out):
        with open(out) as f:
            old = json.load(f)
        why = resumable(old, doc)
        if why:
            raise SystemExit(f"--resume: {out} is another run: {why}")
        old["skipped"] = []
        for k in ("command", "time_budget_s", "setup_s", "machine", "versions"):
            old[k] = doc[k]
        doc = old
        print(f"resuming {out}: done {[c['name'] for c in doc['configs']]}", flush=True)
    doc["invocations"].append({"command": doc["command"], "started": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "setup_s": setup_s})

    def write():
        if any(c["name"] == target_name for c in doc["configs"]):
            doc["targets_issue6"] = evaluate_targets(doc, target_name)
        doc["rotation_targets"] = evaluate_rotation_targets(doc)
        doc["targets"] = qs.evaluate(doc)
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, out)

    def engine(c, memory, seqs, tokens, chunk):
        return jfp8kv.LLM(model=model, dtype=args.dtype, kv_cache_dtype=c["kv_cache_dtype"],
                          kv_scale_mode=c["kv_scale_mode"],
                          kv_scales=kv_scales_arg(c["scales"], calib_paths.get(c["kv_rotation"])),
                          kv_rotation=c["kv_rotation"], max_model_len=max_len,
                          kv_cache_memory=memory, page_size=page, max_num_seqs=seqs,
                          max_num_batched_tokens=tokens,
                          attention_backend=args.attention_backend, loaded=loaded,
                          min_prefill_chunk=chunk, warmup=False)

    write()
    by_name = {c["name"]: c for c in configs}
    base_text = []  # the baseline's text engine, built once and kept for the whole run

    def is_default(c):
        return (c["kv_scale_mode"] is not None and c["kv_scale_mode"] == default_mode
                and c["kv_rotation"] == "none")

    def over_budget(name, phase, walls) -> bool:
        """Skip (and record) a phase of a config expected to end after --time-budget,
        judged by the slowest fp8 config's time in that phase so far (else bf16's)."""
        if args.time_budget is None or not walls:
            return False
        fp8 = [w for n, w in walls.items() if n != "bf16"]
        need = 1.1 * (max(fp8) if fp8 else walls.get("bf16", 0.0))
        elapsed = time.time() - t0
        if elapsed + need <= args.time_budget:
            return False
        doc["skipped"].append({"config": name, "phase": phase, "reason": (
            f"time budget: {elapsed:.0f}s elapsed + ~{need:.0f}s expected > "
            f"{args.time_budget:.0f}s")})
        print(f"{name} ({phase}): skipped ({doc['skipped'][-1]['reason']})", flush=True)
        write()
        return True

    def failed(c, phase, e) -> None:
        doc["errors"].append({"config": c["name"], "phase": phase,
                              "error": f"{type(e).__name__}: {e}",
                              "traceback": traceback.format_exc()[-3000:]})
        print(f"{c['name']} ({phase}): FAILED: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()
        gc.collect()
        write()
        if c["name"] == "bf16":
            raise SystemExit("the baseline failed: nothing to compare with")

    def text_phase(c) -> None:
        """Score the text with config ``c`` (the baseline recomputed beside it) and commit
        its record and runs."""
        t = time.time()
        is_base = c["name"] == "bf16"
        if not base_text:
            tb = time.time()
            base_text.append(engine(parse_config("bf16"), text_memory, 1, max_len, None))
            print(f"baseline text engine built in {time.time() - tb:.1f}s", flush=True)
        tb = time.time()
        llm = base_text[0] if is_base else engine(c, text_memory, 1, max_len, None)
        build_s = round(time.time() - tb, 2)
        info = llm.cache_info()
        rec = {**c, "default": is_default(c), "kv_cache_dtype_resolved": info["kv_cache_dtype"],
               "bytes_per_token": info["bytes_per_token"], "backend": info["attention_backend"],
               "scales_source": getattr(llm, "kv_scales_source", None),
               "text_engine_build_s": None if is_base else build_s}
        print(f"{c['name']}{' (default)' if rec['default'] else ''}: {info['kv_cache_dtype']}, "
              f"{info['bytes_per_token']} B/token, {info['attention_backend']}, built in "
              f"{build_s}s [{time.time() - t0:.0f}s]", flush=True)
        runs = []
        base_runs = {r["context"]: r for r in doc["runs"] if r["config"] == "bf16"}
        for ctx, windows in groups.items():
            r = text_record(score_text(llm, windows, contexts[0],
                                       None if is_base else base_text[0]),
                            args.se_block, is_base)
            if not is_base and ctx in base_runs:  # the recomputed baseline vs the stored one
                r["baseline_recompute_max_abs_diff"] = float(np.max(np.abs(np.subtract(
                    r["blocks"]["base_nll"], base_runs[ctx]["blocks"]["nll"]))))
            runs.append({"config": c["name"], "kv_cache_dtype": info["kv_cache_dtype"],
                         "kv_scale_mode": c["kv_scale_mode"], "kv_rotation": c["kv_rotation"],
                         "default": rec["default"], "context": ctx, "windows": len(windows),
                         **r})
            print(f"    context {ctx}: nll {r['mean_nll']:.4f}" + ("" if is_base else
                  f" ({r['nll_increase_pct']:+.3f} +- {r['nll_increase_pct_se']:.3f}%) kl "
                  f"{r['kl']:.5f} +- {r['kl_se']:.5f} agree {r['greedy_agreement']:.4f}"),
                  flush=True)
        rec["saturated_elements"] = llm.kv_stats()["saturated_total"]
        rec["text_s"] = rec["wall_s"] = round(time.time() - t, 1)
        doc["configs"].append(rec)  # committed only once complete
        doc["runs"].extend(runs)
        print(f"    {c['name']} text done in {rec['text_s']}s [{time.time() - t0:.0f}s]",
              flush=True)
        write()

    def passkey_phase(c) -> None:
        """The passkey prompts with config ``c``; commits cells, per-prompt correctness and
        the comparison with bf16 (run first)."""
        t = time.time()
        llm = engine(c, cache_memory, max_seqs, batched, one_chunk)
        cells, correct, pk_s, misses = run_passkey(llm, pk, pk_lengths, depths, keys, args.seed)
        del llm
        gc.collect()
        rec = next(x for x in doc["configs"] if x["name"] == c["name"])
        rec["passkey_s"] = round(time.time() - t, 1)
        rec["wall_s"] = round(rec["text_s"] + rec["passkey_s"], 1)
        rec["passkey_s_per_length"] = {str(n): pk_s[m] for n, m in zip(lengths, pk_lengths)}
        rec["passkey_missed_examples"] = {str(n): misses[m] for n, m in
                                          zip(lengths, pk_lengths)}
        nominal = dict(zip(pk_lengths, lengths))
        for cell in cells:
            doc["passkey"].append({"config": c["name"], "kv_cache_dtype":
                                   rec["kv_cache_dtype_resolved"],
                                   "kv_scale_mode": c["kv_scale_mode"],
                                   "kv_rotation": c["kv_rotation"], "default": rec["default"],
                                   **cell, "length": nominal[cell["length"]]})
        correct = {nominal[m]: ok for m, ok in correct.items()}
        doc["passkey_correct"][c["name"]] = {str(n): qs.bits(ok) for n, ok in correct.items()}
        base = {int(n): qs.unbits(b) for n, b in doc["passkey_correct"]["bf16"].items()}
        for p in passkey_vs_baseline(correct, base, "bf16"):
            doc["passkey_summary"].append({"config": c["name"], "default": rec["default"], **p})
        if c["name"] == "bf16":
            doc.update(passkey_baseline_note(correct, lengths, args.dtype,
                                             doc["passkey_summary"]))
            print("NOTE:", doc["passkey_note"], flush=True)
        print(f"    {c['name']} passkey done in {rec['passkey_s']}s [{time.time() - t0:.0f}s]",
              flush=True)
        write()

    # Phase 1: every config's text (bf16 first); phase 2: the passkey, bf16 first, then every
    # config (--passkey-for all) or the first --passkey-limit meeting the text targets.
    walls = {c["name"]: c["text_s"] for c in doc["configs"] if "text_s" in c}
    for c in configs:
        if any(x["name"] == c["name"] for x in doc["configs"]) or over_budget(
                c["name"], "text", walls):
            continue
        try:
            text_phase(c)
        except Exception as e:  # record, free, go on with the next config
            failed(c, "text", e)
            continue
        walls[c["name"]] = doc["configs"][-1]["text_s"]
    done_text = [x["name"] for x in doc["configs"] if x["name"] in by_name]
    if st["passkey_for"] == "all":
        pk_names = done_text
    elif st["passkey_for"] == "text-pass":
        pk_names = ["bf16"] + qs.passkey_order(qs.evaluate(doc), args.passkey_limit)
    else:
        pk_names = []
    doc["passkey_configs"] = pk_names
    walls = {c["name"]: c["passkey_s"] for c in doc["configs"] if "passkey_s" in c}
    for name in pk_names:
        if name in doc["passkey_correct"] or name not in done_text:
            continue
        if name != "bf16" and "bf16" not in doc["passkey_correct"]:
            break  # nothing to compare with
        if over_budget(name, "passkey", walls):
            continue
        try:
            passkey_phase(by_name[name])
        except Exception as e:
            failed(by_name[name], "passkey", e)
            continue
        walls[name] = next(x["passkey_s"] for x in doc["configs"] if x["name"] == name)
    names = {c["name"] for c in doc["configs"]}
    doc["partial"] = bool(doc["skipped"] or any(c["name"] not in names for c in configs)
                          or any(n not in doc["passkey_correct"] for n in pk_names))
    doc["wall_s"] = round(time.time() - t0, 1)
    doc["invocations"][-1]["wall_s"] = doc["wall_s"]
    write()
    plot(doc, os.path.splitext(out)[0])
    print(f"wrote {out} ({doc['wall_s']}s; {len(doc['configs'])} configs, "
          f"{len(doc['skipped'])} skipped, {len(doc['errors'])} failed)", flush=True)
    report(doc)


def passkey_baseline_note(correct: dict, lengths, dtype: str, summary) -> dict:
    """The baseline's passkey accuracy and whether it resolves fp8 differences."""
    acc = float(np.mean([np.mean(v) for v in correct.values()]))
    by_len = {p["length"]: p["accuracy"] for p in summary if p["config"] == "bf16"}
    low = sorted(n for n, a in by_len.items() if a < 0.5)
    n_len = len(correct[lengths[0]])
    se = 100 * math.sqrt(acc * (1 - acc) / n_len)
    res = {"passkey_baseline": {"accuracy": acc, "by_length": by_len,
                                "prompts_per_length": n_len,
                                "binomial_se_pts_per_length": round(se, 2)}}
    if acc < 0.5 or low:
        res["passkey_note"] = (
            f"unquantized ({dtype}) passkey accuracy is {acc:.2f} overall"
            + (f", below 0.5 at prompt lengths {low}" if low else "")
            + ": too low there to resolve fp8 differences; judge by NLL/KL")
    else:
        res["passkey_note"] = (
            f"unquantized ({dtype}) passkey accuracy is {acc:.2f} overall (by length: "
            f"{', '.join(f'{n}: {a:.2f}' for n, a in by_len.items())}), high enough to "
            f"compare; with {n_len} prompts per length one prompt is {100 / n_len:.1f} points "
            f"and a binomial standard error ~{se:.1f} points; the paired standard error of "
            f"each difference is in passkey_summary (delta_se_pts)")
    return res


def report(doc) -> None:
    """The targets, printed."""
    if doc["targets_issue6"]:
        print("issue-6 targets:", json.dumps(doc["targets_issue6"]), flush=True)
    rt = doc["rotation_targets"]
    if rt:
        for x in rt["configs"]:
            print(f"issue-14 targets vs {rt['baseline']}: {x['config']}: met={x['met']} "
                  + ", ".join(f"{r['context']}: KL x{r['kl_ratio']:.3f} NLL "
                              f"{r['nll_increase_pct']:+.3f}%" for r in x["contexts"]),
                  flush=True)
    t = doc["targets"]
    if t:
        for x in t["configs"]:
            print(f"issue-36 targets: {x['config']}: text {x['text_met']} passkey "
                  f"{x['passkey_met']} | " + ", ".join(
                      f"{r['context']}: NLL {r['nll_increase_pct']:+.3f}+-"
                      f"{r['nll_increase_pct_se']:.3f}% KL x{r['kl_ratio']:.3f}+-"
                      f"{r['kl_ratio_se']:.3f}" for r in x["contexts"]), flush=True)


if __name__ == "__main__":
    main()
