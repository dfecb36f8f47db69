"""Plot bench/results/serving-h200.json (after ``bench/serving/merge.py``) into one PNG.

    python -m bench.serving.plot [JSON] [PNG] [--model random:qwen3-8b]

Rows: (1) median ITL, median TPOT and output throughput against input length, one line per
(concurrency, output length) and KV dtype; (2) the same against concurrency, one line per
(input, output length); (3) the decode step against its memory floor, the fp8 / bf16 ratio of
every matched pair of runs (targets drawn: ITL <= 0.8x, TTFT <= 1.03x) and output throughput
against the outside peer (transformers ``generate``). bf16 is solid, fp8 dashed (dotted for
static-scale fp8 modes). Rows 1-2 use ``--model`` (default: the shape with the most runs).

ITL is per streamed chunk (one sample per SSE chunk, as SGLang's ``bench_serving`` counts it
for OpenAI endpoints); the engine streams 8 tokens per chunk on the GPU, so ITL ~ 8 x TPOT.
TPOT is per token. When a configuration was measured more than once, the latest run is used.
Shared-prefix runs (``shared_prefix_groups`` > 0, issue 18) and runs without prefix caching
are left out: every line here is random prompts on the server's default settings.
"""

from __future__ import annotations

import argparse
import collections
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CONFIG = ("model_shape", "kv_cache_dtype", "kv_scale_mode", "input_len", "output_len",
          "max_concurrency", "max_num_batched_tokens")
COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]


def kv_label(r) -> str:
    return r["kv_cache_dtype"] + (f" ({r['kv_scale_mode']})" if r.get("kv_scale_mode") else "")


def kv_style(r) -> str:
    if not r["kv_cache_dtype"].startswith("fp8"):
        return "-"
    return "--" if r.get("kv_scale_mode") in ("token", "block", None) else ":"


def latest_runs(runs: list[dict]) -> list[dict]:
    """One run per configuration: the latest by date (ties: the later in the file)."""
    best = {}
    for i, r in enumerate(runs):
        if (not r.get("completed") or r.get("shared_prefix_groups")
                or r.get("enable_prefix_caching") is False):
            continue
        k = tuple(r.get(c) for c in CONFIG)
        if k not in best or (r.get("date") or "", i) >= (best[k][0].get("date") or "", best[k][1]):
            best[k] = (r, i)
    return [r for r, _ in best.values()]


def lines(ax, runs, x_key, group_keys, y_key, label_fmt, logx=True):
    """One line per (group, kv); groups measured at a single x are drawn as markers (after the
    multi-point ones), so every run of the model appears in both rows."""
    groups = collections.defaultdict(list)
    for r in runs:
        groups[tuple(r[k] for k in group_keys)].append(r)
    drawn = 0
    def npoints(item):
        return len({r[x_key] for r in item[1]})

    ordered = sorted(groups.items(), key=lambda it: (npoints(it) < 2, it[0]))
    for gi, (g, rs) in enumerate(ordered):
        by_kv = collections.defaultdict(list)
        for r in rs:
            by_kv[kv_label(r)].append(r)
        for kv, v in sorted(by_kv.items()):
            v = sorted(v, key=lambda r: r[x_key])
            if y_key not in v[0]:
                continue
            ax.plot([r[x_key] for r in v], [r[y_key] for r in v], kv_style(v[0]),
                    marker="o" if kv == "bfloat16" else "s", mfc="none" if kv != "bfloat16"
                    else None, color=COLORS[gi % len(COLORS)],
                    label=f"{label_fmt.format(*g)}, {kv}")
            drawn += 1
    if logx:
        ax.set_xscale("log", base=2)
    if drawn:
        ax.legend(fontsize=6.5)
    else:
        ax.text(0.5, 0.5, "no runs", ha="center", transform=ax.transAxes)
    return drawn


def pairs(runs):
    """(bf16 run, fp8 run) for every configuration measured with both."""
    idx = collections.defaultdict(dict)
    for r in runs:
        k = tuple(r.get(c) for c in CONFIG if c not in ("kv_cache_dtype", "kv_scale_mode"))
        idx[k][kv_label(r)] = r
    out = []
    for k, d in sorted(idx.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        base = d.get("bfloat16")
        if base is None:
            continue
        for lab, r in sorted(d.items()):
            if lab != "bfloat16":
                out.append((base, r))
    return out


def plot_ratios(ax, runs):
    ps = pairs(runs)
    if not ps:
        ax.text(0.5, 0.5, "no bf16/fp8 pairs", ha="center", transform=ax.transAxes)
        return
    metrics = [("median_tpot_ms", "TPOT"), ("median_itl_ms", "ITL"),
               ("median_ttft_ms", "TTFT"), ("output_throughput", "out tok/s")]
    w = 0.8 / len(metrics)
    for j, (key, name) in enumerate(metrics):
        vals = [(f[key] / b[key]) if b.get(key) else 0 for b, f in ps]
        ax.barh([i + (j - 1.5) * w for i in range(len(ps))], vals, w, label=name)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.axvline(0.8, color="r", ls="--", lw=0.8, label="ITL target 0.8")
    ax.axvline(1.03, color="m", ls=":", lw=0.8, label="TTFT target 1.03")
    labels = [f"{b['model_shape'].split(':')[-1]} {b['input_len']}:{b['output_len']} "
              f"c{b['max_concurrency']} bud{b.get('max_num_batched_tokens', '?')}\n"
              f"{f['kv_scale_mode'] or ''}" for b, f in ps]
    ax.set_yticks(range(len(ps)), labels, fontsize=6.5)
    ax.invert_yaxis()
    ax.set_title("fp8 / bf16 per matched run (medians; throughput: totals)", fontsize=9)
    ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.04), ncol=4)


def plot_floor(ax, doc):
    fl = doc.get("floor") or []
    if not fl:
        ax.text(0.5, 0.5, "no floor records", ha="center", transform=ax.transAxes)
        return
    names = [f"{r['kv_cache_dtype']}\n{r['kv_scale_mode'] or ''}" for r in fl]
    x = range(len(fl))
    ax.bar([i - 0.2 for i in x], [r["step_ms"] for r in fl], 0.4, label="decode step")
    ax.bar([i + 0.2 for i in x], [r["floor_ms"] for r in fl], 0.4,
           label="floor (bytes / copy BW)")
    ax.set_xticks(list(x), names, fontsize=7)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{fl[0]['model_shape']} B={fl[0]['batch']} ctx={fl[0]['context']}", fontsize=9)
    ax.legend(fontsize=7)


def plot_peer(ax, doc, runs):
    rows = []
    for r in doc.get("peer") or []:
        impl = r["impl"].replace("transformers ", "HF ")
        rows.append((r["model_shape"], f"{impl[:48]}\n{r['model_shape'].split(':')[-1]} "
                     f"B={r['batch']} {r['input_len']}:{r['output_len']}",
                     r["output_throughput"], "0.6"))
    shapes = {r[0] for r in rows}
    for r in runs:
        if r["model_shape"] in shapes and r["output_len"] == 128 and r["input_len"] <= 2048:
            rows.append((r["model_shape"], f"jfp8kv {kv_label(r)}\n"
                         f"{r['model_shape'].split(':')[-1]} c={r['max_concurrency']} "
                         f"{r['input_len']}:{r['output_len']}", r["output_throughput"],
                         "C1" if r["kv_cache_dtype"].startswith("fp8") else "C0"))
    if not rows:
        ax.text(0.5, 0.5, "no peer records", ha="center", transform=ax.transAxes)
        return
    rows.sort(key=lambda t: (t[0], t[2]))
    ax.barh(range(len(rows)), [t[2] for t in rows], color=[t[3] for t in rows])
    ax.set_yticks(range(len(rows)), [t[1] for t in rows], fontsize=5.5)
    ax.set_xscale("log")
    ax.set_xlabel("output tok/s")
    ax.set_title("output throughput: jfp8kv server vs transformers generate", fontsize=9)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", default="bench/results/serving-h200.json")
    p.add_argument("out", nargs="?", default="bench/results/serving-h200.png")
    p.add_argument("--model", default=None)
    args = p.parse_args(argv)
    with open(args.path) as f:
        doc = json.load(f)
    runs = latest_runs(doc.get("runs") or [])
    counts = collections.Counter(r["model_shape"] for r in runs)
    model = args.model or (counts.most_common(1)[0][0] if counts else None)
    mruns = [r for r in runs if r["model_shape"] == model]
    fig, axes = plt.subplots(3, 3, figsize=(19, 15))
    for row, (x_key, group, fmt, xlabel) in enumerate((
            ("input_len", ("max_concurrency", "output_len", "max_num_batched_tokens"),
             "c={} out={} bud={}", "input tokens"),
            ("max_concurrency", ("input_len", "output_len", "max_num_batched_tokens"),
             "in={} out={} bud={}", "max concurrency"))):
        for col, (key, ylabel) in enumerate((
                ("median_itl_ms", "median ITL (ms per streamed chunk)"),
                ("median_tpot_ms", "median TPOT (ms per token)"),
                ("output_throughput", "output tok/s"))):
            ax = axes[row][col]
            lines(ax, mruns, x_key, group, key, fmt)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.set_yscale("log")
            ax.set_title(f"{model}: {ylabel.split(' (')[0]} vs {xlabel}", fontsize=9)
            ax.grid(alpha=0.3, which="both")
    plot_floor(axes[2][0], doc)
    plot_ratios(axes[2][1], runs)
    plot_peer(axes[2][2], doc, runs)
    m = doc.get("machine") or {}
    fig.suptitle(f"jfp8kv server, bf16 vs fp8 KV, on {m.get('device', '?')} "
                 f"(jax {(m.get('versions') or {}).get('jax', '?')}); bf16 solid, fp8 dashed")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}: {len(runs)} runs ({model}: {len(mruns)}), "
          f"{len(pairs(runs))} bf16/fp8 pairs, {len(doc.get('peer') or [])} peer records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
