"""Plot bench/results/serving-h200.json: decode step vs floor, and serving ITL/throughput."""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path="bench/results/serving-h200.json", out="bench/results/serving-h200.png"):
    doc = json.load(open(path))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    fl = doc["floor"]
    names = [f"{r['kv_cache_dtype']}\n{r['kv_scale_mode'] or ''}" for r in fl]
    x = range(len(fl))
    axes[0].bar([i - 0.2 for i in x], [r["step_ms"] for r in fl], 0.4, label="decode step")
    axes[0].bar([i + 0.2 for i in x], [r["floor_ms"] for r in fl], 0.4, label="floor (bytes / copy BW)")
    axes[0].set_xticks(list(x), names)
    axes[0].set_ylabel("ms per decode step")
    axes[0].set_title(f"{fl[0]['model_shape']} B={fl[0]['batch']} ctx={fl[0]['context']}")
    axes[0].legend()
    runs = doc["runs"]
    loads = sorted({(r["input_len"], r["max_concurrency"]) for r in runs})
    for ax, key, label in ((axes[1], "median_itl_ms", "median ITL (ms)"),
                           (axes[2], "output_throughput", "output tok/s")):
        for j, kv in enumerate(("bfloat16", "fp8_e4m3")):
            vals = [next((r[key] for r in runs if r["kv_cache_dtype"] == kv and
                          (r["input_len"], r["max_concurrency"]) == w), 0) for w in loads]
            ax.bar([i + (j - 0.5) * 0.4 for i in range(len(loads))], vals, 0.4, label=kv)
        ax.set_xticks(range(len(loads)), [f"in={i}\nconc={c}" for i, c in loads])
        ax.set_ylabel(label)
        ax.set_title(f"server, {runs[0]['model_shape']}, out={runs[0]['output_len']}")
        ax.legend()
    fig.suptitle(f"jfp8kv on {doc['machine']['device']} (jax {doc['machine']['versions']['jax']})")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
