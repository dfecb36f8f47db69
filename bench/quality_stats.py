"""Standard errors and issue 36's decision rule for ``bench.quality``. Pure numpy: no model,
no device, no JAX (the tests import it alone).

Standard errors of teacher-forced means come from **blocks**: the scored positions of each
window are cut into consecutive blocks of ``block`` positions (a window's last block may be
shorter; no block spans two windows), and every mean is a ratio of block sums,
``r = sum(x_k) / sum(y_k)``, whose standard error is the ratio estimator's

    se(r) = sqrt(n / (n - 1) * sum((x_k - r * y_k)^2)) / sum(y_k)      (n blocks)

(the linearization of r around its value; for y_k = block sizes it is the batch-means
standard error of a mean). Per-token values are correlated along a text (the same quantized
K/V rows feed every later query of a window), so per-token standard errors would be too small;
blocks of 1,024 positions are long next to that correlation and give >= 63 blocks per context
at 64k scored tokens. Every quantity comparing two configurations is computed **paired**, on
the same blocks of the same text: the NLL increase is sum(nll_config - nll_bf16) /
sum(nll_bf16) per block, the KL ratio is sum(kl_config) / sum(kl_reference), so the
standard error reflects what differs between the two, not the text's own spread.

Passkey: each prompt is scored by both configurations (same keys, depths, haystack); the
difference of accuracies is the mean of d_i = ok_config,i - ok_bf16,i in {-1, 0, 1}, with
standard error sd(d) / sqrt(n) (paired); each accuracy also carries its binomial standard
error sqrt(p (1 - p) / n).

The rule itself (docs/lab/quality.md, section 6, written before any issue-36 number):
``evaluate`` applies the targets to one model's result, ``decide`` picks the default across
models.
"""

from __future__ import annotations

import math

import numpy as np

# Issue 36's targets; a target is met when the value plus one standard error meets it.
NLL_PCT = 0.15          # mean-NLL increase over the bf16 cache, percent, at every context
KL_RATIO = 0.5          # KL(bf16 || config) <= 0.5 x KL(bf16 || reference), every context
PASSKEY_SE = 2.0        # passkey accuracy >= bf16's - 2 standard errors, every length
REFERENCE = "fp8_e4m3:token"  # today's default fp8 cache (token scales, no K transform)
SE_BLOCK = 1024         # positions per block for the standard errors
MIN_SCORED = 64_000     # --decide: at least this many scored positions per context

# Candidates in the rule's order of preference (docs/lab/quality.md section 6): no calibration
# before calibration (smooth needs K means), then more capacity at the Qwen3-8B shape
# (token: 4 B of scales per head and token; block: 8 B at head_dim 128), then fewer
# transforms (hadamard rotates K at store and Q in the kernels). Smooth configs use the
# engine's start-up calibration (":auto"), what a default would ship with.
CANDIDATES = (
    "fp8_e4m3:token+hadamard",
    "fp8_e4m3:block",
    "fp8_e4m3:block+hadamard",
    "fp8_e4m3:token+smooth:auto",
    "fp8_e4m3:token+smooth+hadamard:auto",
    "fp8_e4m3:block+smooth:auto",
    "fp8_e4m3:block+smooth+hadamard:auto",
)
DECIDE_CONFIGS = ("bf16", REFERENCE) + CANDIDATES


# -- blocks and standard errors -------------------------------------------------------------
def block_bounds(window_lengths, block: int = SE_BLOCK) -> list[tuple[int, int]]:
    """[(start, stop)] over positions concatenated window after window: each window's
    positions cut into consecutive blocks of ``block`` (its last one possibly shorter)."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    out, at = [], 0
    for n in window_lengths:
        out += [(at + s, at + min(s + block, n)) for s in range(0, n, block)]
        at += n
    return out


def block_sums(values, bounds) -> np.ndarray:
    """Per-block sums (float64) of a per-position array."""
    x = np.asarray(values, np.float64)
    if bounds and bounds[-1][1] != len(x):
        raise ValueError(f"blocks cover {bounds[-1][1]} positions, the array has {len(x)}")
    return np.array([x[a:b].sum() for a, b in bounds], np.float64)


def ratio_se(x, y) -> tuple[float, float]:
    """(sum(x) / sum(y), its standard error over the n paired blocks (x_k, y_k)); the
    error is nan for fewer than 2 blocks or a zero denominator."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"want two equal 1-d arrays of block sums, got {x.shape}, {y.shape}")
    sy = y.sum()
    if sy == 0:
        return float("nan"), float("nan")
    r = x.sum() / sy
    n = len(x)
    if n < 2:
        return float(r), float("nan")
    return float(r), float(math.sqrt(n / (n - 1) * np.sum((x - r * y) ** 2)) / abs(sy))


def mean_se(sums, counts) -> tuple[float, float]:
    """Mean over positions and its block standard error from per-block sums and sizes."""
    return ratio_se(sums, counts)


def passkey_paired(ok, base_ok) -> dict:
    """Paired passkey comparison on the same prompts (booleans in prompt order): accuracy
    and its binomial standard error for both, the difference in points with the paired
    standard error, and the lost/gained counts."""
    a, b = np.asarray(ok, bool), np.asarray(base_ok, bool)
    if a.shape != b.shape or a.ndim != 1 or len(a) == 0:
        raise ValueError(f"want two equal non-empty prompt lists, got {a.shape}, {b.shape}")
    n = len(a)
    d = a.astype(np.float64) - b
    se_d = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    binom = lambda p: math.sqrt(p * (1 - p) / n)  # noqa: E731
    return {"n": n, "accuracy": float(a.mean()), "accuracy_se": binom(a.mean()),
            "baseline_accuracy": float(b.mean()), "baseline_accuracy_se": binom(b.mean()),
            "delta_pts": 100 * float(d.mean()), "delta_se_pts": 100 * se_d,
            "lost": int(np.sum(b & ~a)), "gained": int(np.sum(a & ~b))}


def bits(ok) -> str:
    """Per-prompt correctness as a string of 0/1 (how the JSON stores it)."""
    return "".join("1" if x else "0" for x in ok)


def unbits(s: str) -> list[bool]:
    return [c == "1" for c in s]


# -- one model's run -------------------------------------------------------------------------
def text_stats(blocks: dict, paired: bool) -> dict:
    """Means and standard errors of one (config, context) from its block sums. ``blocks``:
    {"n", "nll"} for the baseline; with ``paired`` also "kl", "agree", "d_nll" and
    "base_nll" (this config minus the bf16 cache, and the bf16 cache's own NLL, on the same
    positions)."""
    n = blocks["n"]
    out = {}
    out["mean_nll"], out["mean_nll_se"] = mean_se(blocks["nll"], n)
    if not paired:
        return out
    out["kl"], out["kl_se"] = mean_se(blocks["kl"], n)
    out["greedy_agreement"], out["greedy_agreement_se"] = mean_se(blocks["agree"], n)
    inc, se = ratio_se(blocks["d_nll"], blocks["base_nll"])
    out["nll_increase_pct"], out["nll_increase_pct_se"] = 100 * inc, 100 * se
    return out


def _runs_by(doc) -> dict:
    by = {}
    for r in doc.get("runs", []):
        by.setdefault(r["config"], {})[r["context"]] = r
    return by


def evaluate(doc, reference: str = REFERENCE) -> dict | None:
    """Issue 36's targets for every fp8 config of one model's result, each against bf16 and
    (KL) ``reference``, from the runs' block sums: at every context, NLL increase + se <=
    NLL_PCT and KL ratio + se <= KL_RATIO; at every passkey length run for the config,
    delta >= -PASSKEY_SE x se. None until bf16 and the reference have block sums.
    Per config: ``text_met``, ``passkey_met`` (None when its passkey was not run) and
    ``met`` (both True)."""
    by = _runs_by(doc)
    ref = by.get(reference)
    if "bf16" not in by or not ref or any("blocks" not in r for r in ref.values()):
        return None
    pk = {}
    for p in doc.get("passkey_summary", []):
        if "delta_se_pts" in p:
            pk.setdefault(p["config"], []).append(p)
    out = []
    for c in doc.get("configs", []):
        name = c["name"]
        if name == "bf16" or name not in by:
            continue
        rows = []
        for ctx, r in sorted(by[name].items()):
            if ctx not in ref or "blocks" not in r:
                continue
            inc, inc_se = r["nll_increase_pct"], r["nll_increase_pct_se"]
            ratio, ratio_err = ratio_se(r["blocks"]["kl"], ref[ctx]["blocks"]["kl"])
            rows.append({"context": ctx, "nll_increase_pct": inc, "nll_increase_pct_se": inc_se,
                         "nll_met": bool(inc + inc_se <= NLL_PCT),
                         "kl": r["kl"], "kl_se": r["kl_se"], "kl_ratio": ratio,
                         "kl_ratio_se": ratio_err,
                         "kl_met": bool(ratio + ratio_err <= KL_RATIO),
                         "greedy_agreement": r["greedy_agreement"],
                         "greedy_agreement_se": r["greedy_agreement_se"]})
        lengths = [{"length": p["length"], "delta_pts": p["delta_pts"],
                    "delta_se_pts": p["delta_se_pts"], "lost": p["lost"], "gained": p["gained"],
                    "met": bool(p["delta_pts"] >= -PASSKEY_SE * p["delta_se_pts"])}
                   for p in sorted(pk.get(name, []), key=lambda p: p["length"])]
        text_met = bool(rows) and all(x["nll_met"] and x["kl_met"] for x in rows)
        passkey_met = all(x["met"] for x in lengths) if lengths else None
        out.append({"config": name, "contexts": rows, "passkey": lengths,
                    "text_met": text_met, "passkey_met": passkey_met,
                    "met": bool(text_met and passkey_met is True)})
    return {"reference": reference,
            "rule": (f"at every context: mean-NLL increase over bf16 + 1 se <= +{NLL_PCT}% and "
                     f"KL(bf16 || config) / KL(bf16 || {reference}) + 1 se <= {KL_RATIO}; at "
                     f"every passkey length: accuracy - bf16's >= -{PASSKEY_SE:g} se (paired); "
                     "se from blocks of positions (bench/quality_stats.py)"),
            "configs": out, "text_met_by": [x["config"] for x in out if x["text_met"]],
            "met_by": [x["config"] for x in out if x["met"]]}


def passkey_order(targets: dict | None, limit: int) -> list[str]:
    """Configs whose passkey should run on this model: those meeting the text targets, in
    the rule's order of preference (CANDIDATES first, then any other), at most ``limit``."""
    if not targets:
        return []
    ok = targets["text_met_by"]
    ranked = [c for c in CANDIDATES if c in ok] + [c for c in ok if c not in CANDIDATES]
    return ranked[:limit]


# -- across models --------------------------------------------------------------------------
def decide(docs: list[dict], costs: dict | None = None, models_required: int = 3) -> dict:
    """The default across models (docs/lab/quality.md section 6): the first of CANDIDATES, in
    order, that meets every target (``evaluate``: text and passkey) on every model and, when
    ``costs`` ({config: {"decode_step_pct": x, "capacity_pct": y}} against the reference,
    positive = worse) are given, costs at most 3% in each. None meeting: the reference stays,
    and ``closest`` names the candidate with the fewest missed checks among those measured
    (text and passkey) on every model. Fewer than
    ``models_required`` models with issue-36 runs (bf16 and the reference with block sums):
    no winner, the result says which are missing."""
    per_model, missing = {}, []
    for d in docs:
        t = evaluate(d)
        key = d.get("model_key") or d.get("model")
        if t is None:
            missing.append(key)
            continue
        per_model[key] = {x["config"]: x for x in t["configs"]}
    rows = []
    for c in CANDIDATES:
        checks, missed = 0, []
        for model, by in per_model.items():
            x = by.get(c)
            if x is None:
                missed.append(f"{model}: not measured")
                continue
            ref = by.get(REFERENCE)
            have = {r["context"] for r in x["contexts"]}
            for ctx in sorted({r["context"] for r in ref["contexts"]} - have if ref else ()):
                missed.append(f"{model} {ctx}: not measured")  # pruned, skipped or failed
            for r in x["contexts"]:
                checks += 2
                if not r["nll_met"]:
                    missed.append(f"{model} {r['context']}: NLL {r['nll_increase_pct']:+.3f}"
                                  f" +- {r['nll_increase_pct_se']:.3f}%")
                if not r["kl_met"]:
                    missed.append(f"{model} {r['context']}: KL x{r['kl_ratio']:.3f} +- "
                                  f"{r['kl_ratio_se']:.3f}")
            if x["passkey_met"] is None:
                missed.append(f"{model}: passkey not run")
            for p in x["passkey"]:
                checks += 1
                if not p["met"]:
                    missed.append(f"{model} passkey {p['length']}: {p['delta_pts']:+.1f} +- "
                                  f"{p['delta_se_pts']:.1f} pts")
        cost = (costs or {}).get(c)
        if costs is not None:
            if cost is None:
                missed.append("cost not measured")
            else:
                for k in ("decode_step_pct", "capacity_pct"):
                    checks += 1
                    if cost.get(k) is None or cost[k] > 3.0:
                        missed.append(f"{k} {cost.get(k)}")
        rows.append({"config": c, "checks": checks, "missed": missed, "met": not missed})
    complete = not missing and len(per_model) >= models_required
    winner = next((r["config"] for r in rows if r["met"]), None) if complete else None
    measured = [r for r in rows if not any("not measured" in m or "not run" in m
                                           for m in r["missed"])]
    closest = min(measured, key=lambda r: len(r["missed"]))["config"] if measured else None
    return {"models": sorted(per_model), "incomplete_models": missing,
            "costs_checked": costs is not None, "candidates": rows,
            "winner": winner, "default": winner or REFERENCE,
            "closest": None if winner or not complete else closest,
            "note": ("the first candidate in order meeting every target on every model"
                     if winner else f"no candidate meets every target: {REFERENCE} stays"
                     if complete else f"incomplete: {len(per_model)} of {models_required} "
                     f"models have issue-36 results ({missing or 'none missing'} unusable); "
                     "no decision")}
