"""fp8 KV quality on CPU: the engine's fp8 cache against an independent fake quantization.

    python bench/quality_cpu.py [--tokens 2048] [--windows 4] [--configs fp8_e4m3:token,...]
                                [--out bench/results/quality-cpu.json]

Model: the embedded SmolLM2-135M-Instruct GGUF, float32 compute on both sides. Text:
``--windows`` windows of ``--tokens`` tokens of Python's pydoc topics (paragraph starts
spread over the text); static scales for "calib" configs are measured by
``jfp8kv.kvcache.calibrate`` on another slice of it (held out), written to a scales JSON
and loaded by both sides. For the baseline (float32 cache) and every config:

* engine: ``LLM(dtype="float32", kv_cache_dtype, kv_scale_mode, kv_scales).nll(ids)``;
* fake: transformers (PyTorch, float32) on the same GGUF, post-RoPE K/V fake-quantized by
  ``tests/kvcache/fakequant.py`` (numpy + ml_dtypes) before sdpa attention;

and writes mean NLLs, the increase over each side's own baseline (%), their difference
(percentage points) overall and per window, and the engine's saturation count. The
per-window spread matters: fp8 rounding makes the quantized forward pass chaotic (a float32
last-bit difference flips a rounding, which moves later values across other rounding
boundaries), so two correct implementations give different realizations of the
quantization noise; ``diff_pp_window_std`` measures that spread.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "kvcache"))
import fakequant as fq  # noqa: E402

import jfp8kv  # noqa: E402
from jfp8kv.kvcache import calibrate  # noqa: E402
from jfp8kv.kvcache.cache import bytes_per_token  # noqa: E402

FORMATS = ("fp8_e4m3", "fp8_e5m2")
DEFAULT_CONFIGS = [f"{f}:{m}" for f in FORMATS for m in
                   ("tensor:1.0", "tensor:calib", "channel:calib", "token", "block")]
WINDOW_STRIDE = 90_000  # characters between window starts (the text has ~465k)
CALIB_OFFSET = 400_000  # held-out calibration text starts here


def parse_config(s: str):
    """"fp8_e4m3:token" / "fp8_e5m2:channel:calib" / "fp8_e4m3:tensor:1.0" -> (fmt, mode, scales)."""
    parts = s.split(":")
    fmt, mode = parts[0], parts[1]
    scales = parts[2] if len(parts) > 2 else None
    if fmt not in FORMATS or mode not in ("tensor", "channel", "token", "block"):
        raise SystemExit(f"bad config {s!r}: want fp8_e4m3|fp8_e5m2 : tensor|channel|token|block")
    if mode in ("tensor", "channel") and scales is None:
        raise SystemExit(f"{s!r}: static modes need :1.0 (or another constant) or :calib")
    return fmt, mode, scales


def versions() -> dict:
    import jax
    import jaxlib
    import ml_dtypes
    import torch
    import transformers

    return {"python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": getattr(jaxlib, "__version__", "?"), "numpy": np.__version__,
            "ml_dtypes": ml_dtypes.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__}


def load_hf():
    import torch
    from transformers import AutoModelForCausalLM

    from jfp8kv.models import hub

    p = hub.default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                 dtype=torch.float32).eval()
    fq.install(model)
    return model


def engine_nll(loaded, windows, fmt, mode, kv_scales, max_len):
    c = loaded.config
    f32_bytes = bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, "float32", None)
    llm = jfp8kv.LLM(dtype="float32", kv_cache_dtype=fmt, kv_scale_mode=mode,
                     kv_scales=kv_scales, max_model_len=max_len,
                     kv_cache_memory=(max_len + 64) * f32_bytes,
                     max_num_batched_tokens=max_len, loaded=loaded)
    out = [llm.nll(ids) for ids in windows]
    return out, llm.kv_stats()["saturated_total"]


def fake_nll(hf, windows, quantizer):
    fq.set_quantizer(hf, quantizer)
    try:
        return [fq.hf_nll(hf, ids) for ids in windows]
    finally:
        fq.set_quantizer(hf, None)


def summarize(eng, fake, eng_base, fake_base, offsets) -> dict:
    """Pooled mean NLLs and increases (%), and the same per window."""
    e, f = np.concatenate(eng).mean(), np.concatenate(fake).mean()
    eb, fb = np.concatenate(eng_base).mean(), np.concatenate(fake_base).mean()
    inc_e, inc_f = 100 * (e / eb - 1), 100 * (f / fb - 1)
    per = []
    for o, a, b, ab, bb in zip(offsets, eng, fake, eng_base, fake_base):
        ie, if_ = 100 * (a.mean() / ab.mean() - 1), 100 * (b.mean() / bb.mean() - 1)
        per.append({"offset": o, "engine_increase_pct": round(float(ie), 4),
                    "fake_increase_pct": round(float(if_), 4),
                    "diff_pp": round(float(ie - if_), 4)})
    diffs = np.array([p["diff_pp"] for p in per])
    return {"engine_mean_nll": float(e), "fake_mean_nll": float(f),
            "engine_increase_pct": round(float(inc_e), 4),
            "fake_increase_pct": round(float(inc_f), 4),
            "diff_pp": round(float(inc_e - inc_f), 4),
            "within_0.1pp": bool(abs(inc_e - inc_f) <= 0.1),
            "diff_pp_window_std": round(float(diffs.std(ddof=1)), 4) if len(diffs) > 1 else None,
            "windows": per}


def plot(doc, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    labels = [f"{r['kv_cache_dtype'][4:]}\n{r['kv_scale_mode']}\n{r['scales'] or ''}"
              for r in runs]
    x = np.arange(len(runs))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(runs)), 4))
    ax.bar(x - 0.2, [r["engine_increase_pct"] for r in runs], 0.4, label="engine (jfp8kv)")
    ax.bar(x + 0.2, [r["fake_increase_pct"] for r in runs], 0.4,
           label="fake quant (transformers)")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("mean NLL increase over float32 KV (%)")
    ax.set_title(f"SmolLM2-135M, {doc['tokens_per_window']} x {len(doc['offsets'])} tokens "
                 "of pydoc topics, fp32 compute")
    ax.axhline(0, color="k", lw=0.5)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per text window")
    ap.add_argument("--windows", type=int, default=4, help="number of text windows")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help="comma-separated fmt:mode[:scales], scales = a constant or calib")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "quality-cpu.json"))
    args = ap.parse_args(argv)
    configs = [parse_config(c) for c in args.configs.split(",")]

    from jfp8kv.models.loader import load_model

    t0 = time.time()
    loaded = load_model(None, "float32")
    cfg = loaded.config
    hf = load_hf()
    offsets = [fq.paragraph_offset(i * WINDOW_STRIDE) for i in range(args.windows)]
    windows = [fq.natural_text_ids(loaded.tokenizer, args.tokens, o) for o in offsets]
    calib_offset = fq.paragraph_offset(CALIB_OFFSET)
    calib_ids = fq.natural_text_ids(loaded.tokenizer, args.tokens, calib_offset)
    scales_path = os.path.join(tempfile.mkdtemp(prefix="jfp8kv-quality-"), "scales.json")
    calibrate.measure_amax(cfg, loaded.params, [calib_ids]).to_json(scales_path)

    doc = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
                      f"({platform.node()})",
           "versions": versions(),
           "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
           "model": cfg.name, "compute_dtype": "float32", "tokens_per_window": args.tokens,
           "offsets": offsets, "text": "pydoc_data.topics (sorted keys, joined by blank lines)",
           "calibration": {"offset": calib_offset, "tokens": args.tokens,
                           "note": "held-out slice; amax per layer/head/channel; "
                                   "scale = amax / fmax (headroom 1.0)"},
           "baseline": None, "runs": []}

    def write():
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)

    eng_base, _ = engine_nll(loaded, windows, "float32", None, None, args.tokens)
    fake_base = fake_nll(hf, windows, None)
    doc["baseline"] = {
        "engine_mean_nll": float(np.concatenate(eng_base).mean()),
        "fake_mean_nll": float(np.concatenate(fake_base).mean()),
        "max_abs_token_diff": float(max(np.abs(a - b).max() for a, b in zip(eng_base, fake_base))),
    }
    print(f"baseline: {doc['baseline']}  ({time.time() - t0:.0f}s)", flush=True)
    for fmt, mode, scales in configs:
        t = time.time()
        if scales is None:
            kv_scales, sk, sv = None, None, None
        elif scales == "calib":
            kv_scales = scales_path
            sk, sv = fq.static_scales(fmt, mode, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                      scales_json=scales_path)
        else:
            kv_scales = float(scales)
            sk, sv = fq.static_scales(fmt, mode, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                      constant=kv_scales)
        eng, saturated = engine_nll(loaded, windows, fmt, mode, kv_scales, args.tokens)
        fake = fake_nll(hf, windows, fq.KVQuantizer(fmt, mode, sk, sv))
        rec = {"kv_cache_dtype": fmt, "kv_scale_mode": mode, "scales": scales,
               **summarize(eng, fake, eng_base, fake_base, offsets),
               "engine_saturated": saturated}
        doc["runs"].append(rec)
        write()
        print(f"{fmt} {mode} {scales or ''}: engine {rec['engine_increase_pct']:+.3f}% "
              f"fake {rec['fake_increase_pct']:+.3f}% diff {rec['diff_pp']:+.3f} pp "
              f"(window std {rec['diff_pp_window_std']}) sat {saturated:.0f} "
              f"({time.time() - t:.0f}s)", flush=True)
    doc["wall_s"] = round(time.time() - t0, 1)
    write()
    plot(doc, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
