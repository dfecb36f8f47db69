"""Issue 59's text scores on the CPU: the decision rule's candidates through the independent
fake quantization (transformers in float32 + ``bench.fakequant``), in ``bench.quality``'s
--decide format so ``python -m bench.quality --decide-from`` reads the result.

Why this is evidence for the decision: the engine's fp8 cache equals ``bench.fakequant``'s
quantization bit for bit and their NLL agrees to 1e-13 in float64 (tests/kvcache, CI), so a
candidate's text numbers here differ from the engine's only by the compute (float32 here,
the GPU run's bf16) and the attention implementation. The GPU run (``bench.quality
--decide``) confirms the winner against these numbers; passkey stays on the GPU.

What is scored is ``bench.quality --decide``'s text: at each context (1k, 4k, 8k) the same
consecutive windows of the text before the calibration slice (``scored_windows``), at least
``--min-scored`` positions each, the standard errors from blocks of 1,024 positions, paired
against the unquantized cache on the same positions (``text_record``; ``quality_stats``).
Unlike the engine path, the unquantized baseline runs once per window and every config is
compared with its log-probabilities in memory (no recompute).

Smoothing candidates (``:auto``) take the engine's own start-up calibration: the K means
``jfp8kv.engine.calibrate.measure_k_mean`` measures on ``kvcache.calibrate.BUILTIN_TEXT`` with
the model in float32 (the fake path is float32), exactly what ``--kv-rotation smooth`` with
no scales file computes at start-up.

``--keep N`` prunes between contexts, so the CPU scores the long contexts only where they
can change the decision: after a context, a candidate stays if it still meets both text
targets (NLL increase + se <= 0.15%, KL ratio + se <= 0.5) at every context so far, and if
fewer than N do, the closest ones (the smallest worst value/target over the contexts so far)
fill up to N; the reference (e4m3 token) always stays. The pruned ones are listed with the
context that pruned them; ``--keep 0`` scores everything.

Resumable: each finished window's per-position arrays go to ``<out>.d/`` (npz); a rerun with
the same settings skips the windows whose configs are all there.

    python -m bench.quality_fake --model smollm2 --keep 4 \\
        --out bench/results/quality-fake-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from bench import quality_stats as qs
from bench.common import command_line, machine_info, write_result

CONTEXTS = (1024, 4096, 8192)


def resolve(model: str) -> tuple[str, Path]:
    if model in ("smollm2", "default"):
        from jfp8kv.models import hub

        return "smollm2", Path(hub.default_gguf_path())
    from bench.second_model import MODELS, gguf_path

    if model in MODELS:
        return model, gguf_path(model)
    raise SystemExit(f"--model wants smollm2 or one of {sorted(MODELS)}, got {model!r}")


def quantizer(cfg: dict, k_mean):
    from bench import fakequant as fq

    if cfg["kv_cache_dtype"] == "auto":
        return None
    rot = cfg["kv_rotation"]
    if cfg["kv_scale_mode"] not in ("token", "block"):
        raise SystemExit(f"{cfg['name']}: the fake path scores the dynamic modes only")
    if "smooth" in rot and cfg["scales"] != "auto":
        raise SystemExit(f"{cfg['name']}: smoothing here takes the start-up means (':auto')")
    return fq.KVQuantizer(cfg["kv_cache_dtype"], cfg["kv_scale_mode"],
                          rotate_k="hadamard" in rot,
                          k_mean=k_mean if "smooth" in rot else None)


def startup_k_mean(gguf: Path) -> np.ndarray:
    """The engine's start-up smoothing means (float32 model, built-in text)."""
    from jfp8kv.engine.calibrate import measure_k_mean
    from jfp8kv.kvcache import calibrate
    from jfp8kv.models.loader import load_model

    loaded = load_model(str(gguf), "float32")
    return np.asarray(measure_k_mean(loaded.config, loaded.params,
                                     [loaded.tokenizer.encode(calibrate.BUILTIN_TEXT)]),
                      np.float32)


def window_scores(hf, ids, configs, quants) -> dict:
    """{config: {"nll", "kl", "agree", "base_nll"}} for one window (torch, float32)."""
    import torch

    from bench import fakequant as fq
    from bench.rotation_cpu import forward_lp

    nxt = torch.tensor(ids[1:])
    rows = torch.arange(len(ids) - 1)
    fq.set_quantizer(hf, None)
    base = forward_lp(hf, ids)
    base_nll = (-base[rows, nxt]).numpy()
    base_arg = base.argmax(-1)
    out = {}
    for name in configs:
        if name == "bf16":
            out[name] = {"nll": base_nll, "kl": np.zeros_like(base_nll),
                         "agree": np.ones(len(base_nll), bool), "base_nll": base_nll}
            continue
        fq.set_quantizer(hf, quants[name])
        try:
            lp = forward_lp(hf, ids)
        finally:
            fq.set_quantizer(hf, None)
        kl = np.concatenate([(base[s:s + 1024].exp() * (base[s:s + 1024] - lp[s:s + 1024]))
                             .sum(-1).double().numpy() for s in range(0, len(rows), 1024)])
        out[name] = {"nll": (-lp[rows, nxt]).numpy(), "kl": kl,
                     "agree": (lp.argmax(-1) == base_arg).numpy(), "base_nll": base_nll}
        del lp
    return out


def record(name: str, cfg: dict, context: int, windows: list[dict]) -> dict:
    from bench.quality import text_record

    scored = {k: np.concatenate([w[k] for w in windows]) for k in ("nll", "kl", "agree",
                                                                   "base_nll")}
    scored["lengths"] = [len(w["nll"]) for w in windows]
    rec = text_record(scored, qs.SE_BLOCK, name == "bf16")
    return {"config": name, "kv_cache_dtype": cfg["kv_cache_dtype"],
            "kv_scale_mode": cfg["kv_scale_mode"], "kv_rotation": cfg["kv_rotation"],
            "default": name == qs.REFERENCE, "context": context, "windows": len(windows),
            **rec}


def shortfall(row: dict) -> float:
    """How far one context's row is from the text targets (<= 1: met), value + se."""
    return max((row["nll_increase_pct"] + row["nll_increase_pct_se"]) / qs.NLL_PCT,
               (row["kl_ratio"] + row["kl_ratio_se"]) / qs.KL_RATIO)


def prune(doc: dict, active: list[str], keep: int, context: int) -> list[str]:
    t = qs.evaluate(doc)
    worst = {x["config"]: max(shortfall(r) for r in x["contexts"]) for x in t["configs"]}
    cands = [c for c in active if c not in ("bf16", qs.REFERENCE)]
    met = [c for c in cands if worst[c] <= 1.0]
    rest = sorted((c for c in cands if c not in met), key=lambda c: worst[c])
    kept = set(met + rest[:max(0, keep - len(met))])
    for c in cands:
        if c not in kept:
            doc["pruned"].append({"config": c, "after_context": context,
                                  "worst_shortfall": round(worst[c], 4)})
    return [c for c in active if c in ("bf16", qs.REFERENCE) or c in kept]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--configs", default="decide",
                    help="bench.quality config strings or presets (default: decide)")
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--min-scored", type=int, default=qs.MIN_SCORED)
    ap.add_argument("--keep", type=int, default=4,
                    help="candidates kept for the next context beyond those meeting the "
                         "targets (0: no pruning)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot-only", metavar="JSON", help="only redraw JSON's PNG")
    args = ap.parse_args(argv)
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text()),
             args.plot_only.removesuffix(".json") + ".png")
        return

    import ml_dtypes
    import torch
    import transformers

    from bench import quality
    from bench.rotation_cpu import load

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    key, gguf = resolve(args.model)
    out = args.out or f"bench/results/quality-fake-{key}.json"
    state = Path(out + ".d")
    state.mkdir(parents=True, exist_ok=True)
    names = quality.config_names(args.configs, False)
    if names[0] != "bf16":
        names = ["bf16"] + [n for n in names if n != "bf16"]
    cfgs = {n: quality.parse_config(n) for n in names}
    hf, tok = load(gguf)
    k_mean = None
    if any("smooth" in c["kv_rotation"] for c in cfgs.values()):
        f = state / "startup_k_mean.npy"
        if f.is_file():
            k_mean = np.load(f)
        else:
            k_mean = startup_k_mean(gguf)
            np.save(f, k_mean)
    quants = {n: quantizer(c, k_mean) for n, c in cfgs.items()}
    contexts = [int(c) for c in args.contexts.split(",")]
    machine = machine_info()
    machine["versions"].update(torch=torch.__version__, transformers=transformers.__version__,
                               ml_dtypes=ml_dtypes.__version__, numpy=np.__version__)
    doc = {"machine": machine,
           "command": command_line("bench.quality_fake", argv),
           "model": key, "model_key": key, "dtype": "float32", "scorer": "fake32",
           "scorer_note": "transformers float32 + bench.fakequant (bit-exact to the engine's "
                          "cache); the unquantized cache is the baseline 'bf16'",
           "text": {"source": "pydoc_data.topics before character 400,000",
                    "min_scored": args.min_scored, "contexts": contexts},
           "configs": [{"name": n, **{k: v for k, v in c.items() if k != "name"}}
                       for n, c in cfgs.items()],
           "smoothing_means": "engine start-up calibration on BUILTIN_TEXT, float32",
           "keep": args.keep, "pruned": [], "runs": [], "context_wall_s": {}}
    active = list(names)
    for context in contexts:
        n = quality.windows_for(args.min_scored, context)
        windows = quality.scored_windows(tok, context, n)
        tc = time.time()
        per = []
        for i, ids in enumerate(windows):
            f = state / f"c{context}-w{i}.npz"
            have = {}
            if f.is_file():
                z = np.load(f)
                have = {c: {k: z[f"{c}|{k}"] for k in ("nll", "kl", "agree", "base_nll")}
                        for c in active if f"{c}|nll" in z.files}
            if len(have) < len(active):
                tw = time.time()
                have = window_scores(hf, ids, active, quants)
                np.savez(f, **{f"{c}|{k}": v for c, d in have.items() for k, v in d.items()})
                print(f"  context {context} window {i + 1}/{n}: {len(active)} configs in "
                      f"{time.time() - tw:.1f}s [{time.time() - t0:.0f}s]", flush=True)
            per.append(have)
        for c in active:
            doc["runs"].append(record(c, cfgs[c], context, [w[c] for w in per]))
        doc["context_wall_s"][str(context)] = round(time.time() - tc, 1)
        doc["targets"] = qs.evaluate(doc)
        report(doc, context)
        if args.keep and context != contexts[-1]:
            active = prune(doc, active, args.keep, context)
        doc["wall_s"] = round(time.time() - t0, 1)
        write_result(out, doc)
    plot(doc, out.removesuffix(".json") + ".png")
    print(json.dumps(doc["targets"]["text_met_by"]), f"wall {doc['wall_s']}s -> {out}")


def plot(doc: dict, path: str) -> None:
    """Two panels against context: the NLL increase over the unquantized cache and the KL
    ratio to e4m3 token, each with one standard error and the rule's target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = doc["targets"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    for x in t["configs"]:
        rows = x["contexts"]
        ctx = [r["context"] for r in rows]
        for ax, k, se in ((axes[0], "nll_increase_pct", "nll_increase_pct_se"),
                          (axes[1], "kl_ratio", "kl_ratio_se")):
            ax.errorbar(ctx, [r[k] for r in rows], yerr=[r[se] for r in rows], marker="o",
                        ms=3, capsize=2, label=x["config"].replace("fp8_e4m3:", ""))
    for ax, target, title in ((axes[0], qs.NLL_PCT, "mean-NLL increase over the unquantized "
                               "cache, %"), (axes[1], qs.KL_RATIO, "KL / KL of e4m3 token")):
        ax.axhline(target, color="k", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(title, fontsize=9)
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"{doc['model']}: fp8 e4m3 KV candidates, {doc['scorer']} "
                 f"({doc['dtype']}), >= {doc['text']['min_scored']} positions per context, "
                 "+-1 se; dashed: the rule's targets", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(doc: dict, context: int) -> None:
    for x in doc["targets"]["configs"]:
        for r in x["contexts"]:
            if r["context"] == context:
                print(f"{x['config']:36s} {context:5d} NLL {r['nll_increase_pct']:+.3f} +- "
                      f"{r['nll_increase_pct_se']:.3f}%  KL x{r['kl_ratio']:.3f} +- "
                      f"{r['kl_ratio_se']:.3f}  agree {r['greedy_agreement']:.4f}", flush=True)


if __name__ == "__main__":
    main()
